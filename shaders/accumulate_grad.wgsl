// Gradient accumulation. `clone_add` writes current + new into a fresh contiguous buffer and
// leaves both inputs alone (accumulate_grad, S-1); `add_into` adds new into current in place
// (the eager backward(inputs=...) path, S-3). Both read their operands through strides; their
// `_dense` twins take two dense operands (the common case: a leaf's grad and the grad that
// backward made for it), 64 elements per invocation and four per load where offsets and the
// length are multiples of 4 (CPU adapters pay per load, and per division of a strided walk).
// Params: `AccumulateParams` (src/autograd/accumulate.rs).

@group(0) @binding(1) var<storage, read> new_grad: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read> current: array<vec4<f32>>;
// clone_add: the fresh sum. add_into: the current grad itself.
@group(0) @binding(3) var<storage, read_write> out: array<vec4<f32>>;

fn new_at(i: u32) -> f32 {
    return new_grad[i / 4u][i % 4u];
}

fn current_at(i: u32) -> f32 {
    return current[i / 4u][i % 4u];
}

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
    out[i / 4u][i % 4u] = current_at(pu(ACCUMULATE_CURRENT_OFFSET) + strided_offset(i, rank, ACCUMULATE_SHAPE, ACCUMULATE_CURRENT_STRIDES))
        + new_at(pu(ACCUMULATE_NEW_OFFSET) + strided_offset(i, rank, ACCUMULATE_SHAPE, ACCUMULATE_NEW_STRIDES));
}

@compute @workgroup_size(256)
fn clone_add_dense(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                   @builtin(local_invocation_index) lid: u32) {
    let n = pu(ACCUMULATE_N);
    let c0 = pu(ACCUMULATE_CURRENT_OFFSET);
    let g0 = pu(ACCUMULATE_NEW_OFFSET);
    if (pu(ACCUMULATE_VEC4) == 1u) {
        let per_group = CONTIGUOUS_PER_GROUP / 4u;
        for (var j = 0u; j < rolled(per_group / 256u); j = j + 1u) {
            let i = contiguous_item(wid, nwg, lid, j, per_group);
            if (i >= n / 4u) {
                break;
            }
            out[i] = current[c0 / 4u + i] + new_grad[g0 / 4u + i];
        }
        return;
    }
    for (var j = 0u; j < rolled(CONTIGUOUS_PER_GROUP / 256u); j = j + 1u) {
        let i = contiguous_item(wid, nwg, lid, j, CONTIGUOUS_PER_GROUP);
        if (i >= n) {
            break;
        }
        out[i / 4u][i % 4u] = current_at(c0 + i) + new_at(g0 + i);
    }
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
    out[at / 4u][at % 4u] = out[at / 4u][at % 4u] + new_at(pu(ACCUMULATE_NEW_OFFSET) + strided_offset(i, rank, ACCUMULATE_SHAPE, ACCUMULATE_NEW_STRIDES));
}

@compute @workgroup_size(256)
fn add_into_dense(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                  @builtin(local_invocation_index) lid: u32) {
    let n = pu(ACCUMULATE_N);
    let c0 = pu(ACCUMULATE_CURRENT_OFFSET);
    let g0 = pu(ACCUMULATE_NEW_OFFSET);
    if (pu(ACCUMULATE_VEC4) == 1u) {
        let per_group = CONTIGUOUS_PER_GROUP / 4u;
        for (var j = 0u; j < rolled(per_group / 256u); j = j + 1u) {
            let i = contiguous_item(wid, nwg, lid, j, per_group);
            if (i >= n / 4u) {
                break;
            }
            out[c0 / 4u + i] = out[c0 / 4u + i] + new_grad[g0 / 4u + i];
        }
        return;
    }
    for (var j = 0u; j < rolled(CONTIGUOUS_PER_GROUP / 256u); j = j + 1u) {
        let i = contiguous_item(wid, nwg, lid, j, CONTIGUOUS_PER_GROUP);
        if (i >= n) {
            break;
        }
        let at = c0 + i;
        out[at / 4u][at % 4u] = out[at / 4u][at % 4u] + new_at(g0 + i);
    }
}
