// Data movement: strided copies (contiguous, cat, reshape of a view) and fills. Elements are
// moved as raw 32-bit words, so one kernel serves f32 and u32 tensors.

@group(0) @binding(1) var<storage, read> src: array<u32>;
@group(0) @binding(2) var<storage, read_write> dst: array<u32>;

// Params: `CopyParams` (src/ops/copy.rs).
@compute @workgroup_size(256)
fn strided_copy(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                @builtin(local_invocation_index) lid: u32) {
    let i = workgroup_index(wid, nwg) * 256u + lid;
    if (i >= pu(COPY_N)) {
        return;
    }
    let rank = pu(COPY_RANK);
    let e = pu(COPY_FIRST) + i;
    dst[pu(COPY_DST_OFFSET) + strided_offset(e, rank, COPY_SHAPE, COPY_DST_STRIDES)] = src[pu(COPY_SRC_OFFSET) + strided_offset(e, rank, COPY_SHAPE, COPY_SRC_STRIDES)];
}
