// The sum (or, with `is_max`, the maximum) of one f32 per invocation over a one-dimensional
// workgroup of `size` invocations (a power of 2, at most 256), for every invocation: through
// subgroup operations where the device has subgroups of a fixed width (two barriers), else a
// tree in workgroup memory (log2(size) + 2 barriers: software adapters run each as a
// coroutine switch of every SIMD group). Prepended by the families whose modules choose one
// (softmax.wgsl, batch_norm.wgsl).

var<workgroup> reduce_scratch: array<f32, 256>;
var<workgroup> reduce_total: f32;

fn workgroup_reduce_tree(lid: u32, v: f32, is_max: bool, size: u32) -> f32 {
    reduce_scratch[lid] = v;
    workgroupBarrier();
    for (var half = size / 2u; half > 0u; half = half / 2u) {
        if (lid < half) {
            let a = reduce_scratch[lid];
            let b = reduce_scratch[lid + half];
            reduce_scratch[lid] = select(a + b, max(a, b), is_max);
        }
        workgroupBarrier();
    }
    let total = reduce_scratch[0];
    workgroupBarrier();
    return total;
}

// SUBGROUP SECTION BEGIN: kept only where the device has subgroups of a fixed width.
// Each subgroup reduces its lanes and its first lane writes the result at the subgroup's
// index (the subgroups of a one-dimensional workgroup hold consecutive invocations, as on every
// adapter wgrad knows); invocation 0 combines the size / width results for all.
fn workgroup_reduce_subgroups(lid: u32, v: f32, is_max: bool, size: u32) -> f32 {
    let s = select(subgroupAdd(v), subgroupMax(v), is_max);
    let width = subgroupAdd(1u);
    if (subgroupExclusiveAdd(1u) == 0u) {
        reduce_scratch[lid / width] = s;
    }
    workgroupBarrier();
    if (lid == 0u) {
        var total = reduce_scratch[0];
        for (var j = 1u; j < size / width; j = j + 1u) {
            total = select(total + reduce_scratch[j], max(total, reduce_scratch[j]), is_max);
        }
        reduce_total = total;
    }
    return workgroupUniformLoad(&reduce_total);
}
// SUBGROUP SECTION END
