// Elementwise binary ops with NumPy broadcasting (broadcast dims have stride 0). One
// template: the host splices the op's expression in `a` and `b` for BINARY_EXPR.

@group(0) @binding(1) var<storage, read> lhs: array<f32>;
@group(0) @binding(2) var<storage, read> rhs: array<f32>;
@group(0) @binding(3) var<storage, read_write> dst: array<f32>;

fn op(a: f32, b: f32) -> f32 {
    return BINARY_EXPR;
}

// params: 0 n, 1 lhs offset, 2 rhs offset, 3 rank, 4..10 shape, 10..16 lhs strides,
//         16..22 rhs strides
@compute @workgroup_size(256)
fn contiguous(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
              @builtin(local_invocation_index) lid: u32) {
    let start = workgroup_index(wid, nwg) * CONTIGUOUS_PER_GROUP + lid;
    let end = min(start + CONTIGUOUS_PER_GROUP, pu(0u));
    for (var i = start; i < end; i = i + 256u) {
        dst[i] = op(lhs[pu(1u) + i], rhs[pu(2u) + i]);
    }
}

@compute @workgroup_size(256)
fn strided(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
           @builtin(local_invocation_index) lid: u32) {
    let i = workgroup_index(wid, nwg) * 256u + lid;
    if (i >= pu(0u)) {
        return;
    }
    let rank = pu(3u);
    dst[i] = op(lhs[pu(1u) + strided_offset(i, rank, 4u, 10u)], rhs[pu(2u) + strided_offset(i, rank, 4u, 16u)]);
}
