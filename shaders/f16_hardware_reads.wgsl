// F16 reads through the adapter's conversion instructions (`unpack2x16float`: one F16C
// instruction on x86, one conversion on a GPU), swapped by the device for the integer
// arithmetic between `// F16 READS BEGIN` and `// F16 READS END` of `sixteen_bit.wgsl` when
// it compiles a module (`device/pipelines.rs`; `F16Reads::Hardware`). Zeros, subnormals,
// infinities and NaNs take the integer path, which keeps their bits exactly (an adapter may
// flush subnormals or quiet a NaN); every other half is exact either way. Writes stay in
// integer arithmetic on every path: WGSL leaves `pack2x16float`'s rounding to the adapter
// (some round toward zero), and F16 must round as torch does.

fn f16_read(h: u32) -> f32 {
    let e = h & 0x7c00u;
    if (e == 0u || e == 0x7c00u) {
        return f16_to_f32(h);
    }
    return unpack2x16float(h).x;
}

fn f16_read4(w: vec2<u32>) -> vec4<f32> {
    let e = vec4<u32>(w.x >> 10u, w.x >> 26u, w.y >> 10u, w.y >> 26u) & vec4<u32>(0x1fu);
    if (any(e == vec4<u32>(0u)) || any(e == vec4<u32>(0x1fu))) {
        return f16_to_f32x4(w);
    }
    return vec4<f32>(unpack2x16float(w.x), unpack2x16float(w.y));
}
