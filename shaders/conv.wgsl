// 2-d convolution (NCHW, weight [c_out, c_in, kernel_h, kernel_w]) as implicit GEMMs:
// out[m][n] = sum over k of A(m, k) B(k, n), where A and B are read straight from the images,
// weights and grads through index maps, so no im2col matrix is ever stored. CONV_MODE picks
// the map:
//   forward:     m = c_out, n = (image, oy, ox), k = (c_in, ky, kx);  A = weight,   B = input
//   input_grad:  m = c_in,  n = (image, iy, ix), k = (c_out, ky, kx); A = weight,   B = out grad
//   weight_grad: m = c_out, n = (c_in, ky, kx),  k = (image, oy, ox); A = out grad, B = input
// Params: `ConvParams` (src/ops/conv.rs). All tensors are contiguous.
//
// Each invocation computes a 4x4 block of out over one chunk of k (at most `k_chunk` steps, so
// no invocation loops past llvmpipe's 65,535 iterations). With several chunks, chunk c writes
// its partial sums to out[c * M * N ..] and the host sums the chunks.

@group(0) @binding(1) var<storage, read> lhs: array<f32>;
@group(0) @binding(2) var<storage, read> rhs: array<f32>;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;

// One image element of B, or 0 in the padding. `at` is (image, channel) as a plane index.
fn image_at(offset: u32, plane: u32, y: i32, x: i32) -> f32 {
    let h = pu(CONV_HEIGHT);
    let w = pu(CONV_WIDTH);
    if (y < 0 || x < 0 || u32(y) >= h || u32(x) >= w) {
        return 0.0;
    }
    return rhs[offset + (plane * h + u32(y)) * w + u32(x)];
}

// forward: n -> (image, top row, left column) of its receptive field; k -> (c_in, ky, kx) with
// the kernel offsets dilated.
fn n_parts_forward(n: u32) -> vec3<i32> {
    let ow = pu(CONV_OUT_W);
    let pixels = pu(CONV_OUT_H) * ow;
    let r = n % pixels;
    let s = i32(pu(CONV_STRIDE));
    let p = i32(pu(CONV_PADDING));
    return vec3<i32>(i32(n / pixels), i32(r / ow) * s - p, i32(r % ow) * s - p);
}

fn k_parts_forward(k: u32) -> vec3<i32> {
    let kw = pu(CONV_KERNEL_W);
    let taps = pu(CONV_KERNEL_H) * kw;
    let r = k % taps;
    let d = i32(pu(CONV_DILATION));
    return vec3<i32>(i32(k / taps), i32(r / kw) * d, i32(r % kw) * d);
}

fn a_forward(m: u32, k: u32, kp: vec3<i32>) -> f32 {
    return lhs[pu(CONV_LHS_OFFSET) + m * pu(CONV_K) + k];
}

fn b_forward(kp: vec3<i32>, np: vec3<i32>) -> f32 {
    let plane = u32(np.x) * pu(CONV_C_IN) + u32(kp.x);
    return image_at(pu(CONV_RHS_OFFSET), plane, np.y + kp.y, np.z + kp.z);
}

fn out_forward(m: u32, n: u32) -> u32 {
    let pixels = pu(CONV_OUT_H) * pu(CONV_OUT_W);
    return ((n / pixels) * pu(CONV_C_OUT) + m) * pixels + n % pixels;
}

// input_grad: n -> (image, iy + padding, ix + padding); k -> (c_out, ky, kx) dilated. The out
// grad at (oy, ox) reaches the input pixel when oy * stride = iy + padding - ky * dilation.
fn n_parts_input_grad(n: u32) -> vec3<i32> {
    let w = pu(CONV_WIDTH);
    let pixels = pu(CONV_HEIGHT) * w;
    let r = n % pixels;
    let p = i32(pu(CONV_PADDING));
    return vec3<i32>(i32(n / pixels), i32(r / w) + p, i32(r % w) + p);
}

fn k_parts_input_grad(k: u32) -> vec3<i32> {
    return k_parts_forward(k);
}

fn a_input_grad(m: u32, k: u32, kp: vec3<i32>) -> f32 {
    let taps = pu(CONV_KERNEL_H) * pu(CONV_KERNEL_W);
    return lhs[pu(CONV_LHS_OFFSET) + (u32(kp.x) * pu(CONV_C_IN) + m) * taps + k % taps];
}

fn b_input_grad(kp: vec3<i32>, np: vec3<i32>) -> f32 {
    let ty = np.y - kp.y;
    let tx = np.z - kp.z;
    let s = i32(pu(CONV_STRIDE));
    if (ty < 0 || tx < 0 || ty % s != 0 || tx % s != 0) {
        return 0.0;
    }
    let oy = u32(ty / s);
    let ox = u32(tx / s);
    let oh = pu(CONV_OUT_H);
    let ow = pu(CONV_OUT_W);
    if (oy >= oh || ox >= ow) {
        return 0.0;
    }
    let plane = u32(np.x) * pu(CONV_C_OUT) + u32(kp.x);
    return rhs[pu(CONV_RHS_OFFSET) + (plane * oh + oy) * ow + ox];
}

fn out_input_grad(m: u32, n: u32) -> u32 {
    let pixels = pu(CONV_HEIGHT) * pu(CONV_WIDTH);
    return ((n / pixels) * pu(CONV_C_IN) + m) * pixels + n % pixels;
}

// weight_grad: n -> (c_in, ky * dilation - padding, kx * dilation - padding); k -> (image,
// oy * stride, ox * stride).
fn n_parts_weight_grad(n: u32) -> vec3<i32> {
    let taps = k_parts_forward(n);
    let p = i32(pu(CONV_PADDING));
    return vec3<i32>(taps.x, taps.y - p, taps.z - p);
}

fn k_parts_weight_grad(k: u32) -> vec3<i32> {
    let ow = pu(CONV_OUT_W);
    let pixels = pu(CONV_OUT_H) * ow;
    let r = k % pixels;
    let s = i32(pu(CONV_STRIDE));
    return vec3<i32>(i32(k / pixels), i32(r / ow) * s, i32(r % ow) * s);
}

fn a_weight_grad(m: u32, k: u32, kp: vec3<i32>) -> f32 {
    let pixels = pu(CONV_OUT_H) * pu(CONV_OUT_W);
    return lhs[pu(CONV_LHS_OFFSET) + (u32(kp.x) * pu(CONV_C_OUT) + m) * pixels + k % pixels];
}

fn b_weight_grad(kp: vec3<i32>, np: vec3<i32>) -> f32 {
    let plane = u32(kp.x) * pu(CONV_C_IN) + u32(np.x);
    return image_at(pu(CONV_RHS_OFFSET), plane, kp.y + np.y, kp.z + np.z);
}

fn out_weight_grad(m: u32, n: u32) -> u32 {
    return m * pu(CONV_N) + n;
}

fn store(base: u32, m: u32, n: u32, v: f32) {
    if (m < pu(CONV_M) && n < pu(CONV_N)) {
        out[base + out_CONV_MODE(m, n)] = v;
    }
}

@compute @workgroup_size(64)
fn implicit_gemm(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                 @builtin(local_invocation_index) lid: u32) {
    let m_len = pu(CONV_M);
    let n_len = pu(CONV_N);
    let tiles_n = pu(CONV_TILES_N);
    let tiles = tiles_n * ((m_len + 3u) / 4u);
    let t = workgroup_index(wid, nwg) * 64u + lid;
    if (t >= tiles * pu(CONV_CHUNKS)) {
        return;
    }
    let chunk = t / tiles;
    let m0 = ((t % tiles) / tiles_n) * 4u;
    let n0 = ((t % tiles) % tiles_n) * 4u;
    let k_chunk = pu(CONV_K_CHUNK);
    let k_start = chunk * k_chunk;
    let k_end = min(k_start + k_chunk, pu(CONV_K));
    // Rows and columns past the edge repeat the last one, so every load stays in range; their
    // sums are not stored.
    let rows = min(vec4<u32>(m0) + vec4<u32>(0u, 1u, 2u, 3u), vec4<u32>(m_len - 1u));
    let np0 = n_parts_CONV_MODE(min(n0, n_len - 1u));
    let np1 = n_parts_CONV_MODE(min(n0 + 1u, n_len - 1u));
    let np2 = n_parts_CONV_MODE(min(n0 + 2u, n_len - 1u));
    let np3 = n_parts_CONV_MODE(min(n0 + 3u, n_len - 1u));
    var acc0 = vec4<f32>(0.0);
    var acc1 = vec4<f32>(0.0);
    var acc2 = vec4<f32>(0.0);
    var acc3 = vec4<f32>(0.0);
    for (var k = k_start; k < k_end; k = k + 1u) {
        let kp = k_parts_CONV_MODE(k);
        let b = vec4<f32>(b_CONV_MODE(kp, np0), b_CONV_MODE(kp, np1), b_CONV_MODE(kp, np2), b_CONV_MODE(kp, np3));
        acc0 = acc0 + a_CONV_MODE(rows.x, k, kp) * b;
        acc1 = acc1 + a_CONV_MODE(rows.y, k, kp) * b;
        acc2 = acc2 + a_CONV_MODE(rows.z, k, kp) * b;
        acc3 = acc3 + a_CONV_MODE(rows.w, k, kp) * b;
    }
    let base = chunk * m_len * n_len;
    for (var j = 0u; j < 4u; j = j + 1u) {
        store(base, m0, n0 + j, acc0[j]);
        store(base, m0 + 1u, n0 + j, acc1[j]);
        store(base, m0 + 2u, n0 + j, acc2[j]);
        store(base, m0 + 3u, n0 + j, acc3[j]);
    }
}
