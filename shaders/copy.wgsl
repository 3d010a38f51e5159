// Data movement: strided copies (contiguous, cat, reshape of a view) and fills. Elements are
// moved as raw 32-bit words, so one kernel serves f32 and u32 tensors.

@group(0) @binding(1) var<storage, read> src: array<u32>;
@group(0) @binding(2) var<storage, read_write> dst: array<u32>;

// Params: `CopyParams` (src/ops/copy.rs). Each invocation copies the items
// `contiguous_item(.., j, ..)` for j < 64, which run 8 elements apart: it computes the strided
// offsets of its first element and steps both by 8 strides of the innermost dim, computing them
// afresh only where a step crosses the end of that dim (per element, that is a load and a
// store, not a walk over every dim).
@compute @workgroup_size(256)
fn strided_copy(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                @builtin(local_invocation_index) lid: u32) {
    let n = pu(COPY_N);
    let rank = pu(COPY_RANK);
    let first = pu(COPY_FIRST);
    let src_offset = pu(COPY_SRC_OFFSET);
    let dst_offset = pu(COPY_DST_OFFSET);
    let inner = pu(COPY_SHAPE + 5u);
    let src_step = 8u * pu(COPY_SRC_STRIDES + 5u);
    let dst_step = 8u * pu(COPY_DST_STRIDES + 5u);
    var i = contiguous_item(wid, nwg, lid, 0u, CONTIGUOUS_PER_GROUP);
    var col = (first + i) % inner;
    var s = src_offset + strided_offset(first + i, rank, COPY_SHAPE, COPY_SRC_STRIDES);
    var d = dst_offset + strided_offset(first + i, rank, COPY_SHAPE, COPY_DST_STRIDES);
    for (var j = 0u; j < rolled(CONTIGUOUS_PER_GROUP / 256u); j = j + 1u) {
        if (i >= n) {
            break;
        }
        dst[d] = src[s];
        i = i + 8u;
        col = col + 8u;
        if (col < inner) {
            s = s + src_step;
            d = d + dst_step;
        } else {
            col = (first + i) % inner;
            s = src_offset + strided_offset(first + i, rank, COPY_SHAPE, COPY_SRC_STRIDES);
            d = dst_offset + strided_offset(first + i, rank, COPY_SHAPE, COPY_DST_STRIDES);
        }
    }
}
