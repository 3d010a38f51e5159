// Gradient accumulation. `clone_add` writes current + new into a fresh contiguous buffer and
// leaves both inputs alone (accumulate_grad, S-1); `add_into` adds new into current in place
// (the eager backward(inputs=...) path, S-3). Both read their operands through strides.
// params: 0 n, 1 rank, 2 current offset, 3 new offset, 4..10 shape, 10..16 current strides,
//         16..22 new strides

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
    if (i >= pu(0u)) {
        return;
    }
    let rank = pu(1u);
    out[i] = current[pu(2u) + strided_offset(i, rank, 4u, 10u)]
        + new_grad[pu(3u) + strided_offset(i, rank, 4u, 16u)];
}

@compute @workgroup_size(256)
fn add_into(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
            @builtin(local_invocation_index) lid: u32) {
    let i = element(wid, nwg, lid);
    if (i >= pu(0u)) {
        return;
    }
    let rank = pu(1u);
    let at = pu(2u) + strided_offset(i, rank, 4u, 10u);
    out[at] = out[at] + new_grad[pu(3u) + strided_offset(i, rank, 4u, 16u)];
}
