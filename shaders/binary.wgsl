// Elementwise binary ops with NumPy broadcasting. One template: the host splices the op's
// expression in `a` and `b` for BINARY_EXPR. Each operand is dense or a dense run held and
// repeated (`repeated`); the host copies any other layout (a transposed view, an outer
// broadcast) dense first (src/ops/binary.rs, readable_operand).
//
// Tensors are bound as words so that the `*_vec4` entries can move four elements per load where
// lengths and offsets allow (software adapters pay per load, not per element), and so that
// one module reads and writes any dtype: LHS_DTYPE_CODE, RHS_DTYPE_CODE and DST_DTYPE_CODE are
// spliced (0 F32, 1 U32: four elements per vec4, seen as f32 bits; 2 F16, 3 BF16: eight,
// converted through sixteen_bit.wgsl). Arithmetic is in f32. A 16-bit
// destination is written a word (two elements) per invocation, so no two invocations write
// one word.

@group(0) @binding(1) var<storage, read> lhs: array<vec4<u32>>;
@group(0) @binding(2) var<storage, read> rhs: array<vec4<u32>>;
@group(0) @binding(3) var<storage, read_write> dst: array<vec4<u32>>;

const LHS_DTYPE: u32 = LHS_DTYPE_CODEu;
const RHS_DTYPE: u32 = RHS_DTYPE_CODEu;
const DST_DTYPE: u32 = DST_DTYPE_CODEu;

// The op's expression reads `a`, `b` and the op's scalar `s` (masked_fill's value,
// leaky_relu's slope), the same names a captured step's fused kernels give them.
fn op(a: f32, b: f32) -> f32 {
    let s = pf(BINARY_SCALAR);
    return BINARY_EXPR;
}

fn op4(a: vec4<f32>, b: vec4<f32>) -> vec4<f32> {
    return vec4<f32>(op(a.x, b.x), op(a.y, b.y), op(a.z, b.z), op(a.w, b.w));
}

// F16 OPERAND lhs BEGIN
// Element i of lhs.
fn lhs_at(i: u32) -> f32 {
    if (LHS_DTYPE < 2u) {
        return bitcast<f32>(lhs[i / 4u][i % 4u]);
    }
    return half_to_f32(half_of(lhs[i / 8u][(i / 2u) % 4u], i), LHS_DTYPE);
}

// Elements 4q .. 4q + 4 of lhs.
fn lhs_quad(q: u32) -> vec4<f32> {
    if (LHS_DTYPE < 2u) {
        return bitcast<vec4<f32>>(lhs[q]);
    }
    return halves_to_f32x4(lhs[q / 2u], q, LHS_DTYPE);
}
// F16 OPERAND lhs END

// F16 OPERAND rhs BEGIN
// Element i of rhs.
fn rhs_at(i: u32) -> f32 {
    if (RHS_DTYPE < 2u) {
        return bitcast<f32>(rhs[i / 4u][i % 4u]);
    }
    return half_to_f32(half_of(rhs[i / 8u][(i / 2u) % 4u], i), RHS_DTYPE);
}

// Elements 4q .. 4q + 4 of rhs.
fn rhs_quad(q: u32) -> vec4<f32> {
    if (RHS_DTYPE < 2u) {
        return bitcast<vec4<f32>>(rhs[q]);
    }
    return halves_to_f32x4(rhs[q / 2u], q, RHS_DTYPE);
}
// F16 OPERAND rhs END

// Params: `BinaryParams` (src/ops/binary.rs). Each layout has two entries, so that a model
// compiles only the one its tensors take: `*_vec4` four elements per load, where lengths,
// offsets and runs allow, and the plain one element by element. (Each per-element load and
// store compiles to a loop over the lanes on CPU adapters: lavapipe 25 spent a third of one
// entry holding both paths on the path a model never ran.) `repeated*` have one or both
// operands a dense run held and repeated (a bias over rows or over channels): output element
// i reads run element (i / stretch) % period. Each entry passes its layout as a constant, so
// the driver's compiler drops the other's code and the plain case keeps its loop free of
// index wrapping.
@compute @workgroup_size(256)
fn contiguous_vec4(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                   @builtin(local_invocation_index) lid: u32) {
    store_quads(wid, nwg, lid, false);
}

@compute @workgroup_size(256)
fn contiguous(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
              @builtin(local_invocation_index) lid: u32) {
    store_elements(wid, nwg, lid, false);
}

@compute @workgroup_size(256)
fn repeated_vec4(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                 @builtin(local_invocation_index) lid: u32) {
    store_quads(wid, nwg, lid, true);
}

@compute @workgroup_size(256)
fn repeated(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
            @builtin(local_invocation_index) lid: u32) {
    store_elements(wid, nwg, lid, true);
}

// The workgroup's output elements, four at a time.
fn store_quads(wid: vec3<u32>, nwg: vec3<u32>, lid: u32, repeated: bool) {
    let n = pu(BINARY_N);
    let per_group = CONTIGUOUS_PER_GROUP / 4u;
    for (var j = 0u; j < rolled(per_group / 256u); j = j + 1u) {
        let i = contiguous_item(wid, nwg, lid, j, per_group);
        if (i >= n / 4u) {
            break;
        }
        store_quad(i, quad_at(i, repeated));
    }
}

// The workgroup's output elements one at a time (a word of two where dst is 16-bit).
fn store_elements(wid: vec3<u32>, nwg: vec3<u32>, lid: u32, repeated: bool) {
    let n = pu(BINARY_N);
    for (var j = 0u; j < rolled(CONTIGUOUS_PER_GROUP / 256u); j = j + 1u) {
        let i = contiguous_item(wid, nwg, lid, j, CONTIGUOUS_PER_GROUP);
        if (DST_DTYPE < 2u) {
            if (i >= n) {
                break;
            }
            store1(i, element_at(i, repeated));
        } else {
            // Word i; an odd n's last word repeats its one element in the half past the end.
            if (2u * i >= n) {
                break;
            }
            store_pair(i, element_at(2u * i, repeated), element_at(min(2u * i + 1u, n - 1u), repeated));
        }
    }
}

// Output elements 4i .. 4i + 4.
fn quad_at(i: u32, repeated: bool) -> vec4<f32> {
    let la = pu(BINARY_LHS_OFFSET);
    let lb = pu(BINARY_RHS_OFFSET);
    if (repeated) {
        return op4(lhs_run4(la, i, pu(BINARY_LHS_STRETCH), pu(BINARY_LHS_PERIOD)),
                   rhs_run4(lb, i, pu(BINARY_RHS_STRETCH), pu(BINARY_RHS_PERIOD)));
    }
    return op4(lhs_quad(la / 4u + i), rhs_quad(lb / 4u + i));
}

// Output element i.
fn element_at(i: u32, repeated: bool) -> f32 {
    var a = i;
    var b = i;
    if (repeated) {
        a = run_index(i, pu(BINARY_LHS_STRETCH), pu(BINARY_LHS_PERIOD));
        b = run_index(i, pu(BINARY_RHS_STRETCH), pu(BINARY_RHS_PERIOD));
    }
    return op(lhs_at(pu(BINARY_LHS_OFFSET) + a), rhs_at(pu(BINARY_RHS_OFFSET) + b));
}

// The run element output element i reads (see `repeated`); a stretch of 1 divides nothing.
fn run_index(i: u32, stretch: u32, period: u32) -> u32 {
    if (stretch == 1u) {
        return i % period;
    }
    return (i / stretch) % period;
}

// Output elements 4 i .. 4 i + 4 of an operand read as a run (`repeated_vec4`): one aligned load
// where the stretch is 1, else one element for all four (the stretch is a multiple of 4).
fn lhs_run4(offset: u32, i: u32, stretch: u32, period: u32) -> vec4<f32> {
    if (stretch == 1u) {
        return lhs_quad(offset / 4u + i % (period / 4u));
    }
    return vec4<f32>(lhs_at(offset + (i * 4u / stretch) % period));
}

fn rhs_run4(offset: u32, i: u32, stretch: u32, period: u32) -> vec4<f32> {
    if (stretch == 1u) {
        return rhs_quad(offset / 4u + i % (period / 4u));
    }
    return vec4<f32>(rhs_at(offset + (i * 4u / stretch) % period));
}
