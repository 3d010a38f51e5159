// How wgrad's kernels read and write 16-bit elements (F16, BF16): prepended, after
// common.wgsl, to the modules of the families that list it among their `preludes`. Two
// elements per u32 word, the element at an even index in the word's low half (the byte order
// safetensors and torch keep them in), converted to and from f32 in integer arithmetic, so
// every adapter rounds alike, to nearest even as torch does. Kernels name a dtype by its code:
// 0 F32, 1 U32, 2 F16, 3 BF16 (`DType::wgsl_code`).

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

// The four halves of two words as f32, in integer arithmetic.
fn f16_to_f32x4(w: vec2<u32>) -> vec4<f32> {
    return vec4<f32>(f16_to_f32(w.x & 0xffffu), f16_to_f32(w.x >> 16u),
                     f16_to_f32(w.y & 0xffffu), f16_to_f32(w.y >> 16u));
}

// F16 READS BEGIN
// How kernels read F16 elements: here in integer arithmetic (`F16Reads::Integer`). By
// default the device compiles every module with `shaders/f16_hardware_reads.wgsl` in place of
// this section: the adapter's own conversion instructions.
fn f16_read(h: u32) -> f32 {
    return f16_to_f32(h);
}

fn f16_read4(w: vec2<u32>) -> vec4<f32> {
    return f16_to_f32x4(w);
}
// F16 READS END

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
// 16-bit bits `h` of the dtype coded `dtype` (2 F16, 3 BF16) as f32.
fn half_to_f32(h: u32, dtype: u32) -> f32 {
    if (dtype == 2u) {
        return f16_read(h);
    }
    return bf16_to_f32(h);
}

// f32 as the 16-bit bits of the dtype coded `dtype` (2 F16, 3 BF16).
fn f32_to_half(x: f32, dtype: u32) -> u32 {
    if (dtype == 2u) {
        return f32_to_f16(x);
    }
    return f32_to_bf16(x);
}

// Two f32 values as one word of 16-bit elements: `lo` the even element, `hi` the odd one.
fn pack_halves(lo: f32, hi: f32, dtype: u32) -> u32 {
    return f32_to_half(lo, dtype) | (f32_to_half(hi, dtype) << 16u);
}

// Elements 4q .. 4q + 4 of a 16-bit array bound as `array<vec4<u32>>` (eight elements per
// vec4: `words` is the vec4 at q / 2), as f32.
fn halves_to_f32x4(words: vec4<u32>, q: u32, dtype: u32) -> vec4<f32> {
    let w = select(words.xy, words.zw, (q & 1u) == 1u);
    if (dtype == 2u) {
        return f16_read4(w);
    }
    return vec4<f32>(bf16_to_f32(w.x & 0xffffu), bf16_to_f32(w.x >> 16u),
                     bf16_to_f32(w.y & 0xffffu), bf16_to_f32(w.y >> 16u));
}
