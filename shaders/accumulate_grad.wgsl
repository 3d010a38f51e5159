// Gradient accumulation. `clone_add` writes current + new into a fresh contiguous buffer and
// leaves both inputs alone (accumulate_grad, S-1); `add_into` adds new into current in place
// (the eager backward(inputs=...) path, S-3). Both read their operands through strides.
// Params: `AccumulateParams` (src/autograd/accumulate.rs).

@group(0) @binding(1) var<storage, read> new_grad: array<f32>;
@group(0) @binding(2) var<storage, read> current: array<f32>;
// clone_add: the fresh sum. add_into: the current grad itself.
@group(0) @binding(3) var<storage, read_write> out: array<f32>;

fn element(wid: vec3<u32>, nwg: vec3<u32>, lid: u32) -> u32 {
    return workgroup_index(wid, nwg) * 256u + lid;
}

@compute @workgroup_size(256)
fn clone_add(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
             @builtin(local_invocation_index) lid: u32) {
    let i = element(wid, nwg, lid);
    if (i >= pu(ACCUMULATE_N)) {
        return;
    }
    let rank = pu(ACCUMULATE_RANK);
    out[i] = current[pu(ACCUMULATE_CURRENT_OFFSET) + strided_offset(i, rank, ACCUMULATE_SHAPE, ACCUMULATE_CURRENT_STRIDES)]
        + new_grad[pu(ACCUMULATE_NEW_OFFSET) + strided_offset(i, rank, ACCUMULATE_SHAPE, ACCUMULATE_NEW_STRIDES)];
}

@compute @workgroup_size(256)
fn add_into(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
            @builtin(local_invocation_index) lid: u32) {
    let i = element(wid, nwg, lid);
    if (i >= pu(ACCUMULATE_N)) {
        return;
    }
    let rank = pu(ACCUMULATE_RANK);
    let at = pu(ACCUMULATE_CURRENT_OFFSET) + strided_offset(i, rank, ACCUMULATE_SHAPE, ACCUMULATE_CURRENT_STRIDES);
    out[at] = out[at] + new_grad[pu(ACCUMULATE_NEW_OFFSET) + strided_offset(i, rank, ACCUMULATE_SHAPE, ACCUMULATE_NEW_STRIDES)];
}
