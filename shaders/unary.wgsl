// Elementwise unary ops: one template. The host splices the op's expression in `x` (the
// element) and `s` (the op's scalar) for UNARY_EXPR.

// Tensors are bound as vec4s so that `contiguous` can move four elements per load where
// lengths and offsets allow: software adapters pay per load, not per element.
@group(0) @binding(1) var<storage, read> src: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read_write> dst: array<vec4<f32>>;

fn op(x: f32, s: f32) -> f32 {
    return UNARY_EXPR;
}

fn op4(x: vec4<f32>, s: f32) -> vec4<f32> {
    return vec4<f32>(op(x.x, s), op(x.y, s), op(x.z, s), op(x.w, s));
}

// Params: `UnaryParams` (src/ops/unary.rs).
@compute @workgroup_size(256)
fn contiguous(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
              @builtin(local_invocation_index) lid: u32) {
    let s = pf(UNARY_SCALAR);
    let n = pu(UNARY_N);
    let off = pu(UNARY_OFFSET);
    if (pu(UNARY_VEC4) == 1u) {
        let per_group = CONTIGUOUS_PER_GROUP / 4u;
        for (var j = 0u; j < rolled(per_group / 256u); j = j + 1u) {
            let i = contiguous_item(wid, nwg, lid, j, per_group);
            if (i >= n / 4u) {
                break;
            }
            dst[i] = op4(src[off / 4u + i], s);
        }
        return;
    }
    for (var j = 0u; j < rolled(CONTIGUOUS_PER_GROUP / 256u); j = j + 1u) {
        let i = contiguous_item(wid, nwg, lid, j, CONTIGUOUS_PER_GROUP);
        if (i >= n) {
            break;
        }
        let x = off + i;
        dst[i / 4u][i % 4u] = op(src[x / 4u][x % 4u], s);
    }
}

@compute @workgroup_size(256)
fn strided(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
           @builtin(local_invocation_index) lid: u32) {
    let i = workgroup_index(wid, nwg) * 256u + lid;
    if (i >= pu(UNARY_N)) {
        return;
    }
    let x = pu(UNARY_OFFSET) + strided_offset(i, pu(UNARY_RANK), UNARY_SHAPE, UNARY_STRIDES);
    dst[i / 4u][i % 4u] = op(src[x / 4u][x % 4u], pf(UNARY_SCALAR));
}
