// Elementwise binary ops with NumPy broadcasting (broadcast dims have stride 0). One
// template: the host splices the op's expression in `a` and `b` for BINARY_EXPR.
//
// Tensors are bound as vec4s so that `contiguous` can move four elements per load where
// lengths and offsets allow: software adapters pay per load, not per element.

@group(0) @binding(1) var<storage, read> lhs: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read> rhs: array<vec4<f32>>;
@group(0) @binding(3) var<storage, read_write> dst: array<vec4<f32>>;

fn op(a: f32, b: f32) -> f32 {
    return BINARY_EXPR;
}

fn op4(a: vec4<f32>, b: vec4<f32>) -> vec4<f32> {
    return vec4<f32>(op(a.x, b.x), op(a.y, b.y), op(a.z, b.z), op(a.w, b.w));
}

fn lhs_at(i: u32) -> f32 {
    return lhs[i / 4u][i % 4u];
}

fn rhs_at(i: u32) -> f32 {
    return rhs[i / 4u][i % 4u];
}

// Params: `BinaryParams` (src/ops/binary.rs).
@compute @workgroup_size(256)
fn contiguous(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
              @builtin(local_invocation_index) lid: u32) {
    let n = pu(BINARY_N);
    let la = pu(BINARY_LHS_OFFSET);
    let lb = pu(BINARY_RHS_OFFSET);
    if (pu(BINARY_VEC4) == 1u) {
        let per_group = CONTIGUOUS_PER_GROUP / 4u;
        for (var j = 0u; j < rolled(per_group / 256u); j = j + 1u) {
            let i = contiguous_item(wid, nwg, lid, j, per_group);
            if (i >= n / 4u) {
                break;
            }
            dst[i] = op4(lhs[la / 4u + i], rhs[lb / 4u + i]);
        }
        return;
    }
    for (var j = 0u; j < rolled(CONTIGUOUS_PER_GROUP / 256u); j = j + 1u) {
        let i = contiguous_item(wid, nwg, lid, j, CONTIGUOUS_PER_GROUP);
        if (i >= n) {
            break;
        }
        dst[i / 4u][i % 4u] = op(lhs_at(la + i), rhs_at(lb + i));
    }
}

// Like `contiguous`, with one or both operands a dense run held and repeated (a bias over
// rows or over channels): output element i reads run element (i / stretch) % period. A
// separate entry, so the plain case keeps its loop free of index wrapping.
@compute @workgroup_size(256)
fn repeated(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
            @builtin(local_invocation_index) lid: u32) {
    let n = pu(BINARY_N);
    let la = pu(BINARY_LHS_OFFSET);
    let lb = pu(BINARY_RHS_OFFSET);
    let pa = pu(BINARY_LHS_PERIOD);
    let pb = pu(BINARY_RHS_PERIOD);
    let sa = pu(BINARY_LHS_STRETCH);
    let sb = pu(BINARY_RHS_STRETCH);
    if (pu(BINARY_VEC4) == 1u) {
        let per_group = CONTIGUOUS_PER_GROUP / 4u;
        for (var j = 0u; j < rolled(per_group / 256u); j = j + 1u) {
            let i = contiguous_item(wid, nwg, lid, j, per_group);
            if (i >= n / 4u) {
                break;
            }
            dst[i] = op4(lhs_run4(la, i, sa, pa), rhs_run4(lb, i, sb, pb));
        }
        return;
    }
    for (var j = 0u; j < rolled(CONTIGUOUS_PER_GROUP / 256u); j = j + 1u) {
        let i = contiguous_item(wid, nwg, lid, j, CONTIGUOUS_PER_GROUP);
        if (i >= n) {
            break;
        }
        dst[i / 4u][i % 4u] = op(lhs_at(la + run_index(i, sa, pa)), rhs_at(lb + run_index(i, sb, pb)));
    }
}

// The run element output element i reads (see `repeated`); a stretch of 1 divides nothing.
fn run_index(i: u32, stretch: u32, period: u32) -> u32 {
    if (stretch == 1u) {
        return i % period;
    }
    return (i / stretch) % period;
}

// Output elements 4 i .. 4 i + 4 of an operand read as a run (vec4 mode): one aligned load
// where the stretch is 1, else one element for all four (the stretch is a multiple of 4).
fn lhs_run4(offset: u32, i: u32, stretch: u32, period: u32) -> vec4<f32> {
    if (stretch == 1u) {
        return lhs[offset / 4u + i % (period / 4u)];
    }
    return vec4<f32>(lhs_at(offset + (i * 4u / stretch) % period));
}

fn rhs_run4(offset: u32, i: u32, stretch: u32, period: u32) -> vec4<f32> {
    if (stretch == 1u) {
        return rhs[offset / 4u + i % (period / 4u)];
    }
    return vec4<f32>(rhs_at(offset + (i * 4u / stretch) % period));
}

@compute @workgroup_size(256)
fn strided(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
           @builtin(local_invocation_index) lid: u32) {
    let i = workgroup_index(wid, nwg) * 256u + lid;
    if (i >= pu(BINARY_N)) {
        return;
    }
    let rank = pu(BINARY_RANK);
    let a = lhs_at(pu(BINARY_LHS_OFFSET) + strided_offset(i, rank, BINARY_SHAPE, BINARY_LHS_STRIDES));
    let b = rhs_at(pu(BINARY_RHS_OFFSET) + strided_offset(i, rank, BINARY_SHAPE, BINARY_RHS_STRIDES));
    dst[i / 4u][i % 4u] = op(a, b);
}
