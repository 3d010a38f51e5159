// Elementwise binary ops with NumPy broadcasting (broadcast dims have stride 0). One
// template: the host splices the op's expression in `a` and `b` for BINARY_EXPR, and the
// element type for ELEM (ELEM_WIDTH scalars): f32, or vec4<f32> for the `contiguous` entry on operands whose length
// and offsets are multiples of 4 (then n and the offsets are counted in vec4s).

@group(0) @binding(1) var<storage, read> lhs: array<ELEM>;
@group(0) @binding(2) var<storage, read> rhs: array<ELEM>;
@group(0) @binding(3) var<storage, read_write> dst: array<ELEM>;

fn op(a: ELEM, b: ELEM) -> ELEM {
    return BINARY_EXPR;
}

// params: 0 n, 1 lhs offset, 2 rhs offset, 3 rank, 4..10 shape, 10..16 lhs strides,
//         16..22 rhs strides
@compute @workgroup_size(256)
fn contiguous(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
              @builtin(local_invocation_index) lid: u32) {
    // CONTIGUOUS_PER_GROUP scalars per workgroup, whatever ELEM is.
    let per_group = CONTIGUOUS_PER_GROUP / ELEM_WIDTH;
    let start = workgroup_index(wid, nwg) * per_group + lid;
    let end = min(start + per_group, pu(0u));
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
