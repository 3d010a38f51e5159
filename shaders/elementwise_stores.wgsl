// The stores of the elementwise families (unary, binary) into their `dst`, bound as
// `array<vec4<u32>>` words, of the dtype coded DST_DTYPE (0 F32, 1 U32: four elements per
// vec4; 2 F16, 3 BF16: eight, through sixteen_bit.wgsl). Prepended to their modules: each
// declares `dst` and DST_DTYPE itself.

// Stores elements 4q .. 4q + 4 of dst.
fn store_quad(q: u32, v: vec4<f32>) {
    if (DST_DTYPE < 2u) {
        dst[q] = bitcast<vec4<u32>>(v);
        return;
    }
    let c = (q & 1u) * 2u;
    dst[q / 2u][c] = pack_halves(v.x, v.y, DST_DTYPE);
    dst[q / 2u][c + 1u] = pack_halves(v.z, v.w, DST_DTYPE);
}

// Stores element i of a 32-bit dst.
fn store1(i: u32, v: f32) {
    dst[i / 4u][i % 4u] = bitcast<u32>(v);
}

// Stores word w of a 16-bit dst: elements 2w (`lo`) and 2w + 1 (`hi`).
fn store_pair(w: u32, lo: f32, hi: f32) {
    dst[w / 4u][w % 4u] = pack_halves(lo, hi, DST_DTYPE);
}
