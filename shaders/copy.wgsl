// Data movement: strided copies (contiguous, cat, reshape of a view) and fills. Elements are
// moved as raw 32-bit words, so one kernel serves f32 and u32 tensors.

@group(0) @binding(1) var<storage, read> src: array<u32>;
@group(0) @binding(2) var<storage, read_write> dst: array<u32>;

// params: 0 n, 1 src offset, 2 dst offset, 3 rank, 4..10 shape, 10..16 src strides,
//         16..22 dst strides
@compute @workgroup_size(256)
fn strided_copy(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                @builtin(local_invocation_index) lid: u32) {
    let i = workgroup_index(wid, nwg) * 256u + lid;
    if (i >= pu(0u)) {
        return;
    }
    let rank = pu(3u);
    dst[pu(2u) + strided_offset(i, rank, 4u, 16u)] = src[pu(1u) + strided_offset(i, rank, 4u, 10u)];
}
