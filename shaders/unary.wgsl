// Elementwise unary ops: one template. The host splices the op's expression in `x` (the
// element) and `s` (the op's scalar) for UNARY_EXPR.
//
// Tensors are bound as words so that `contiguous_vec4` can move four elements per load where
// lengths and offsets allow (software adapters pay per load, not per element), and so that
// one module reads and writes any dtype: SRC_DTYPE_CODE and DST_DTYPE_CODE are spliced (0 F32,
// 1 U32: four elements per vec4, seen as f32 bits; 2 F16, 3 BF16: eight, converted through the
// sixteen_bit.wgsl). Arithmetic is in f32. A 16-bit destination is written a word
// (two elements) per invocation, so no two invocations write one word.
@group(0) @binding(1) var<storage, read> src: array<vec4<u32>>;
@group(0) @binding(2) var<storage, read_write> dst: array<vec4<u32>>;

const SRC_DTYPE: u32 = SRC_DTYPE_CODEu;
const DST_DTYPE: u32 = DST_DTYPE_CODEu;

// The op's expression reads the element `x`, the op's scalar `s` and its second scalar `t`
// (clamp's upper bound), the same names a captured step's fused kernels give them.
fn op(x: f32, s: f32) -> f32 {
    let t = pf(UNARY_SCALAR2);
    return UNARY_EXPR;
}

fn op4(x: vec4<f32>, s: f32) -> vec4<f32> {
    return vec4<f32>(op(x.x, s), op(x.y, s), op(x.z, s), op(x.w, s));
}

// F16 OPERAND src BEGIN
// Element i of src.
fn src_at(i: u32) -> f32 {
    if (SRC_DTYPE < 2u) {
        return bitcast<f32>(src[i / 4u][i % 4u]);
    }
    return half_to_f32(half_of(src[i / 8u][(i / 2u) % 4u], i), SRC_DTYPE);
}

// Elements 4q .. 4q + 4 of src.
fn src_quad(q: u32) -> vec4<f32> {
    if (SRC_DTYPE < 2u) {
        return bitcast<vec4<f32>>(src[q]);
    }
    return halves_to_f32x4(src[q / 2u], q, SRC_DTYPE);
}
// F16 OPERAND src END

// Output element i.
fn contiguous_at(i: u32) -> f32 {
    return op(src_at(pu(UNARY_OFFSET) + i), pf(UNARY_SCALAR));
}

// Params: `UnaryParams` (src/ops/unary.rs). Two entries, so that a model compiles only the one
// its tensors take: `contiguous_vec4` four elements per load, where `n` and the offset are
// multiples of 4, and `contiguous` element by element. (Each per-element load and store
// compiles to a loop over the lanes on CPU adapters: lavapipe 25 spent a third of one
// entry holding both paths on the path a model never ran.)
@compute @workgroup_size(256)
fn contiguous_vec4(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                   @builtin(local_invocation_index) lid: u32) {
    let s = pf(UNARY_SCALAR);
    let n = pu(UNARY_N);
    let off = pu(UNARY_OFFSET);
    let per_group = CONTIGUOUS_PER_GROUP / 4u;
    for (var j = 0u; j < rolled(per_group / 256u); j = j + 1u) {
        let i = contiguous_item(wid, nwg, lid, j, per_group);
        if (i >= n / 4u) {
            break;
        }
        store_quad(i, op4(src_quad(off / 4u + i), s));
    }
}

@compute @workgroup_size(256)
fn contiguous(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
              @builtin(local_invocation_index) lid: u32) {
    let n = pu(UNARY_N);
    for (var j = 0u; j < rolled(CONTIGUOUS_PER_GROUP / 256u); j = j + 1u) {
        let i = contiguous_item(wid, nwg, lid, j, CONTIGUOUS_PER_GROUP);
        if (DST_DTYPE < 2u) {
            if (i >= n) {
                break;
            }
            store1(i, contiguous_at(i));
        } else {
            // Word i; an odd n's last word repeats its one element in the half past the end.
            if (2u * i >= n) {
                break;
            }
            store_pair(i, contiguous_at(2u * i), contiguous_at(min(2u * i + 1u, n - 1u)));
        }
    }
}
