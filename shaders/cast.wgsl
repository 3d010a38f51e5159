// Casts between dtypes where one side is 16-bit (F16, BF16), and strided copies of 16-bit
// tensors (a cast to the same dtype). The 16-BIT SECTION is the one way wgrad's kernels read
// and write 16-bit elements: two per u32 word, the element at an even index in the word's low
// half (the byte order safetensors and torch keep them in), converted to and from f32 in
// integer arithmetic, so every adapter rounds alike, to nearest even as torch does.

@group(0) @binding(1) var<storage, read> src: array<u32>;
@group(0) @binding(2) var<storage, read_write> dst: array<u32>;

// 16-BIT SECTION BEGIN
// The 16 bits of element `i` of a packed array whose word holding it is `word`.
fn half_of(word: u32, i: u32) -> u32 {
    return (word >> ((i & 1u) * 16u)) & 0xffffu;
}

// IEEE half bits as f32 (exact: every half is an f32).
fn f16_to_f32(h: u32) -> f32 {
    let sign = (h & 0x8000u) << 16u;
    let e = (h >> 10u) & 0x1fu;
    let m = h & 0x3ffu;
    if (e == 0x1fu) {
        return bitcast<f32>(sign | 0x7f800000u | (m << 13u));
    }
    if (e == 0u) {
        // Zero or subnormal: m x 2^-24, a normal f32.
        let magnitude = f32(m) * 5.9604644775390625e-8;
        return select(magnitude, -magnitude, sign != 0u);
    }
    return bitcast<f32>(sign | ((e + 112u) << 23u) | (m << 13u));
}

// f32 as IEEE half bits, rounded to nearest even; past the largest half (65504, and from
// 65520 up) inf; NaN a quiet NaN of the same sign (torch's conversion).
fn f32_to_f16(x: f32) -> u32 {
    let b = bitcast<u32>(x);
    let sign = (b >> 16u) & 0x8000u;
    let a = b & 0x7fffffffu;
    if (a > 0x7f800000u) {
        return sign | 0x7e00u;
    }
    if (a >= 0x477ff000u) {
        return sign | 0x7c00u;
    }
    if (a < 0x38800000u) {
        // Below the smallest normal half (2^-14): a subnormal m x 2^-24 or zero.
        if (a < 0x33000000u) {
            return sign;
        }
        let e = a >> 23u;
        let m = (a & 0x7fffffu) | 0x800000u;
        let shift = 126u - e;
        return sign | round_shifted(m, shift);
    }
    return sign | round_shifted(a - 0x38000000u, 13u);
}

// `v >> shift` (shift 1 to 31) rounded to nearest, ties to even.
fn round_shifted(v: u32, shift: u32) -> u32 {
    let kept = v >> shift;
    let rest = v & ((1u << shift) - 1u);
    let half = 1u << (shift - 1u);
    let up = rest > half || (rest == half && (kept & 1u) == 1u);
    return kept + select(0u, 1u, up);
}

// bfloat16 bits as f32 (exact).
fn bf16_to_f32(h: u32) -> f32 {
    return bitcast<f32>(h << 16u);
}

// f32 as bfloat16 bits, rounded to nearest even (past the largest bfloat16: inf); NaN 0xffff
// whatever its sign, as torch's (vectorised) `.bfloat16()` writes it.
fn f32_to_bf16(x: f32) -> u32 {
    let b = bitcast<u32>(x);
    if ((b & 0x7fffffffu) > 0x7f800000u) {
        return 0xffffu;
    }
    return (b + 0x7fffu + ((b >> 16u) & 1u)) >> 16u;
}
// 16-BIT SECTION END

// SRC_DTYPE and DST_DTYPE are replaced by the host: 0 F32, 1 U32, 2 F16, 3 BF16.
const SRC: u32 = SRC_DTYPEu;
const DST: u32 = DST_DTYPEu;

// Element `i` (row-major over the shape) of the source, as f32.
fn load(i: u32) -> f32 {
    let at = pu(CAST_OFFSET) + strided_offset(i, pu(CAST_RANK), CAST_SHAPE, CAST_STRIDES);
    if (SRC == 0u) {
        return bitcast<f32>(src[at]);
    }
    if (SRC == 1u) {
        return f32(src[at]);
    }
    let h = half_of(src[at / 2u], at);
    if (SRC == 2u) {
        return f16_to_f32(h);
    }
    return bf16_to_f32(h);
}

// The bits `x` is stored as in the destination (16 bits for F16 and BF16).
fn stored(x: f32) -> u32 {
    if (DST == 0u) {
        return bitcast<u32>(x);
    }
    if (DST == 1u) {
        return select(0u, u32(x), x > 0.0); // WGSL saturates at the top; negatives, NaN: 0
    }
    if (DST == 2u) {
        return f32_to_f16(x);
    }
    return f32_to_bf16(x);
}

// Params: `CastParams` (src/ops/cast.rs): `n` elements of the source's layout into the
// contiguous run of the destination from element DST_OFFSET. One invocation per destination
// word: a 32-bit element, or the two 16-bit elements sharing a word, of which it writes those
// in the run and keeps the other's bits (so no two invocations write one word, and a run may
// start or end inside one). A 16-bit element's own bits move unchanged where both sides have
// its dtype (NaN payloads included), through f32 otherwise.
@compute @workgroup_size(256)
fn convert(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
           @builtin(local_invocation_index) lid: u32) {
    let k = workgroup_index(wid, nwg) * 256u + lid;
    let n = pu(CAST_N);
    let first = pu(CAST_DST_OFFSET);
    if (DST < 2u) {
        if (k < n) {
            dst[first + k] = stored(load(k));
        }
        return;
    }
    let w = first / 2u + k;
    if (2u * w >= first + n) {
        return;
    }
    var word = 0u;
    for (var h = 0u; h < 2u; h = h + 1u) {
        let e = 2u * w + h;
        var bits = half_of(dst[w], e);
        if (e >= first && e < first + n) {
            bits = element_bits(e - first);
        }
        word = word | (bits << (16u * h));
    }
    dst[w] = word;
}

// The 16 bits element `i` of the source is stored as in a 16-bit destination.
fn element_bits(i: u32) -> u32 {
    if (SRC == DST) {
        let at = pu(CAST_OFFSET) + strided_offset(i, pu(CAST_RANK), CAST_SHAPE, CAST_STRIDES);
        return half_of(src[at / 2u], at);
    }
    return stored(load(i));
}
