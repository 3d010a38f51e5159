// 2-d max and average pooling over NCHW planes (no padding), and their backward passes.
// Params: `PoolParams` (src/ops/pool.rs). All tensors are contiguous.
//
// Backward passes give each input element one invocation that sums over the few windows
// containing it, so overlapping windows need no atomics.

@group(0) @binding(1) var<storage, read> src: array<f32>;
@group(0) @binding(2) var<storage, read_write> dst: array<f32>;
// max_forward writes, and max_backward reads, the window position of each maximum.
@group(0) @binding(3) var<storage, read_write> argmax: array<u32>;

struct Window {
    plane: u32,
    y0: u32,
    x0: u32,
}

// The window of output element `i`: its plane and its top-left input position.
fn window_of(i: u32) -> Window {
    let ow = pu(POOL_OUT_W);
    let pixels = pu(POOL_OUT_H) * ow;
    let r = i % pixels;
    let s = pu(POOL_STRIDE);
    return Window(i / pixels, (r / ow) * s, (r % ow) * s);
}

// The first maximum in row-major window order, as PyTorch picks it; NaN counts as a maximum.
@compute @workgroup_size(256)
fn max_forward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
               @builtin(local_invocation_index) lid: u32) {
    let i = workgroup_index(wid, nwg) * 256u + lid;
    if (i >= pu(POOL_N)) {
        return;
    }
    let win = window_of(i);
    let w = pu(POOL_WIDTH);
    let k = pu(POOL_KERNEL);
    let plane_base = win.plane * pu(POOL_HEIGHT) * w;
    var best = src[plane_base + win.y0 * w + win.x0];
    var best_at = 0u;
    for (var t = 1u; t < k * k; t = t + 1u) {
        let v = src[plane_base + (win.y0 + t / k) * w + win.x0 + t % k];
        if (v > best || (is_nan(v) && !is_nan(best))) {
            best = v;
            best_at = t;
        }
    }
    dst[i] = best;
    argmax[i] = best_at;
}

@compute @workgroup_size(256)
fn avg_forward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
               @builtin(local_invocation_index) lid: u32) {
    let i = workgroup_index(wid, nwg) * 256u + lid;
    if (i >= pu(POOL_N)) {
        return;
    }
    let win = window_of(i);
    let w = pu(POOL_WIDTH);
    let k = pu(POOL_KERNEL);
    let plane_base = win.plane * pu(POOL_HEIGHT) * w;
    var sum = 0.0;
    for (var t = 0u; t < k * k; t = t + 1u) {
        sum = sum + src[plane_base + (win.y0 + t / k) * w + win.x0 + t % k];
    }
    dst[i] = sum / f32(k * k);
}

// Outputs whose windows hold input (y, x) along one axis: o with o * s <= y < o * s + k and
// o < out_len, as [first, last + 1).
fn windows_over(y: u32, out_len: u32) -> vec2<u32> {
    let s = pu(POOL_STRIDE);
    let k = pu(POOL_KERNEL);
    var first = 0u;
    if (y + 1u > k) {
        first = (y + 1u - k + s - 1u) / s;
    }
    return vec2<u32>(first, min(y / s + 1u, out_len));
}

// Where input element `i` lies, and the outputs whose windows hold it: rows [first, last + 1)
// and columns likewise.
struct Covering {
    plane: u32,
    y: u32,
    x: u32,
    rows: vec2<u32>,
    cols: vec2<u32>,
}

fn covering(i: u32) -> Covering {
    let w = pu(POOL_WIDTH);
    let in_pixels = pu(POOL_HEIGHT) * w;
    let y = (i % in_pixels) / w;
    let x = i % w;
    return Covering(i / in_pixels, y, x, windows_over(y, pu(POOL_OUT_H)), windows_over(x, pu(POOL_OUT_W)));
}

// Backward passes: `src` is the out grad, `dst` the input grad, `n` counts input elements.
// Max pooling passes each window's grad to its arg-max only.
@compute @workgroup_size(256)
fn max_backward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                @builtin(local_invocation_index) lid: u32) {
    let i = workgroup_index(wid, nwg) * 256u + lid;
    if (i >= pu(POOL_N)) {
        return;
    }
    let c = covering(i);
    let ow = pu(POOL_OUT_W);
    let k = pu(POOL_KERNEL);
    let s = pu(POOL_STRIDE);
    var sum = 0.0;
    for (var oy = c.rows.x; oy < c.rows.y; oy = oy + 1u) {
        for (var ox = c.cols.x; ox < c.cols.y; ox = ox + 1u) {
            let o = (c.plane * pu(POOL_OUT_H) + oy) * ow + ox;
            if (argmax[o] == (c.y - oy * s) * k + (c.x - ox * s)) {
                sum = sum + src[o];
            }
        }
    }
    dst[i] = sum;
}

// Average pooling spreads each window's grad evenly over it.
@compute @workgroup_size(256)
fn avg_backward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                @builtin(local_invocation_index) lid: u32) {
    let i = workgroup_index(wid, nwg) * 256u + lid;
    if (i >= pu(POOL_N)) {
        return;
    }
    let c = covering(i);
    let ow = pu(POOL_OUT_W);
    let k = pu(POOL_KERNEL);
    var sum = 0.0;
    for (var oy = c.rows.x; oy < c.rows.y; oy = oy + 1u) {
        for (var ox = c.cols.x; ox < c.cols.y; ox = ox + 1u) {
            sum = sum + src[(c.plane * pu(POOL_OUT_H) + oy) * ow + ox];
        }
    }
    dst[i] = sum / f32(k * k);
}
