// 2-d max and average pooling over NCHW planes (no padding), and their backward passes.
// Params: `PoolParams` (src/ops/pool.rs). All tensors are contiguous.
//
// Backward passes give each run of input elements of a row one invocation, which sums each
// element's grad over the few windows containing it, so overlapping windows need no atomics;
// where the windows tile the input (stride = kernel, sides in whole windows), each run of
// outputs writes its windows whole instead (`*_backward_tiles`).

@group(0) @binding(1) var<storage, read> src: array<f32>;
@group(0) @binding(2) var<storage, read_write> dst: array<f32>;
// max_forward writes, and max_backward reads, the window position of each maximum.
@group(0) @binding(3) var<storage, read_write> argmax: array<u32>;

// Each tensor starts its offset's elements into its buffer: src may be a view of part of a
// batch, and a tensor past one binding is bound a window of whole planes at a time.
fn src_at(i: u32) -> f32 {
    return src[pu(POOL_SRC_OFFSET) + i];
}

fn store(i: u32, v: f32) {
    dst[pu(POOL_DST_OFFSET) + i] = v;
}

fn argmax_at(i: u32) -> u32 {
    return argmax[pu(POOL_ARGMAX_OFFSET) + i];
}

fn store_argmax(i: u32, v: u32) {
    argmax[pu(POOL_ARGMAX_OFFSET) + i] = v;
}

// A run of outputs of one output row, [ox0, ox1): forward passes give each run one invocation,
// so the divisions that place an output are paid once per run (CPU adapters divide lane by
// lane); `n` counts runs, `segments` runs per output row, `segment` outputs per run. `out_at`
// is the offset of the row's output 0, `in_at` that of its windows' top row in the input.
struct OutRun {
    out_at: u32,
    in_at: u32,
    ox0: u32,
    ox1: u32,
}

fn out_run_of(i: u32) -> OutRun {
    let segments = pu(POOL_SEGMENTS);
    let row = i / segments;
    let ox0 = (i % segments) * pu(POOL_SEGMENT);
    let oh = pu(POOL_OUT_H);
    let ow = pu(POOL_OUT_W);
    let plane = row / oh;
    let y0 = (row - plane * oh) * pu(POOL_STRIDE);
    let in_at = (plane * pu(POOL_HEIGHT) + y0) * pu(POOL_WIDTH);
    return OutRun(row * ow, in_at, ox0, min(ox0 + pu(POOL_SEGMENT), ow));
}

// The first maximum in row-major window order, as PyTorch picks it; NaN counts as a maximum.
@compute @workgroup_size(256)
fn max_forward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
               @builtin(local_invocation_index) lid: u32) {
    let i = workgroup_index(wid, nwg) * 256u + lid;
    if (i >= pu(POOL_N)) {
        return;
    }
    let r = out_run_of(i);
    let w = pu(POOL_WIDTH);
    let k = pu(POOL_KERNEL);
    let s = pu(POOL_STRIDE);
    for (var ox = r.ox0; ox < r.ox1; ox = ox + 1u) {
        let at = r.in_at + ox * s;
        var best = src_at(at);
        var best_at = 0u;
        // Row by row, so no tap divides (the first tap compares with itself: no change).
        for (var ty = 0u; ty < k; ty = ty + 1u) {
            for (var tx = 0u; tx < k; tx = tx + 1u) {
                let v = src_at(at + ty * w + tx);
                if (v > best || (is_nan(v) && !is_nan(best))) {
                    best = v;
                    best_at = ty * k + tx;
                }
            }
        }
        store(r.out_at + ox, best);
        store_argmax(r.out_at + ox, best_at);
    }
}

@compute @workgroup_size(256)
fn avg_forward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
               @builtin(local_invocation_index) lid: u32) {
    let i = workgroup_index(wid, nwg) * 256u + lid;
    if (i >= pu(POOL_N)) {
        return;
    }
    let r = out_run_of(i);
    let w = pu(POOL_WIDTH);
    let k = pu(POOL_KERNEL);
    let s = pu(POOL_STRIDE);
    for (var ox = r.ox0; ox < r.ox1; ox = ox + 1u) {
        let at = r.in_at + ox * s;
        var sum = 0.0;
        for (var ty = 0u; ty < k; ty = ty + 1u) {
            for (var tx = 0u; tx < k; tx = tx + 1u) {
                sum = sum + src_at(at + ty * w + tx);
            }
        }
        store(r.out_at + ox, sum / f32(k * k));
    }
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

// A run of input elements of one row, [x0, x1): its plane, its row y and the rows of outputs
// whose windows hold row y. Backward passes give each run one invocation, so the divisions
// that place an element are paid once per run (CPU adapters divide lane by lane); `n` counts
// runs, `segments` runs per row, `segment` elements per run.
struct Run {
    plane: u32,
    y: u32,
    rows: vec2<u32>,
    x0: u32,
    x1: u32,
}

fn run_of(i: u32) -> Run {
    let segments = pu(POOL_SEGMENTS);
    let row = i / segments;
    let x0 = (i % segments) * pu(POOL_SEGMENT);
    let h = pu(POOL_HEIGHT);
    let y = row % h;
    return Run(row / h, y, windows_over(y, pu(POOL_OUT_H)), x0, min(x0 + pu(POOL_SEGMENT), pu(POOL_WIDTH)));
}

// The output columns whose windows hold input column x, from those of column x - 1: each
// bound moves by at most one per column, so no division.
fn next_cols(cols: vec2<u32>, x: u32) -> vec2<u32> {
    let s = pu(POOL_STRIDE);
    var c = cols;
    if (c.x * s + pu(POOL_KERNEL) <= x) {
        c.x = c.x + 1u;
    }
    if (c.y < pu(POOL_OUT_W) && c.y * s <= x) {
        c.y = c.y + 1u;
    }
    return c;
}

// Backward passes: `src` is the out grad, `dst` the input grad. Max pooling passes each
// window's grad to its arg-max only.
@compute @workgroup_size(256)
fn max_backward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                @builtin(local_invocation_index) lid: u32) {
    let i = workgroup_index(wid, nwg) * 256u + lid;
    if (i >= pu(POOL_N)) {
        return;
    }
    let r = run_of(i);
    let ow = pu(POOL_OUT_W);
    let k = pu(POOL_KERNEL);
    let s = pu(POOL_STRIDE);
    let out_plane = r.plane * pu(POOL_OUT_H);
    let in_row = (r.plane * pu(POOL_HEIGHT) + r.y) * pu(POOL_WIDTH);
    var cols = windows_over(r.x0, ow);
    for (var x = r.x0; x < r.x1; x = x + 1u) {
        if (x > r.x0) {
            cols = next_cols(cols, x);
        }
        var sum = 0.0;
        for (var oy = r.rows.x; oy < r.rows.y; oy = oy + 1u) {
            for (var ox = cols.x; ox < cols.y; ox = ox + 1u) {
                let o = (out_plane + oy) * ow + ox;
                if (argmax_at(o) == (r.y - oy * s) * k + (x - ox * s)) {
                    sum = sum + src_at(o);
                }
            }
        }
        store(in_row + x, sum);
    }
}

// Average pooling spreads each window's grad evenly over it.
@compute @workgroup_size(256)
fn avg_backward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                @builtin(local_invocation_index) lid: u32) {
    let i = workgroup_index(wid, nwg) * 256u + lid;
    if (i >= pu(POOL_N)) {
        return;
    }
    let r = run_of(i);
    let ow = pu(POOL_OUT_W);
    let k = pu(POOL_KERNEL);
    let out_plane = r.plane * pu(POOL_OUT_H);
    let in_row = (r.plane * pu(POOL_HEIGHT) + r.y) * pu(POOL_WIDTH);
    var cols = windows_over(r.x0, ow);
    for (var x = r.x0; x < r.x1; x = x + 1u) {
        if (x > r.x0) {
            cols = next_cols(cols, x);
        }
        var sum = 0.0;
        for (var oy = r.rows.x; oy < r.rows.y; oy = oy + 1u) {
            for (var ox = cols.x; ox < cols.y; ox = ox + 1u) {
                sum = sum + src_at((out_plane + oy) * ow + ox);
            }
        }
        store(in_row + x, sum / f32(k * k));
    }
}

// Backward passes where the windows tile the input (stride = kernel, height and width whole
// windows): each input element lies in exactly one window, so each run of outputs (as the
// forward's) writes its windows whole, one read of the out grad per window instead of one
// per input element and no search for the windows over it (`max_backward` ran at 5.8 ns per
// input element on lavapipe, the forward at 2).
@compute @workgroup_size(256)
fn max_backward_tiles(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                      @builtin(local_invocation_index) lid: u32) {
    let i = workgroup_index(wid, nwg) * 256u + lid;
    if (i >= pu(POOL_N)) {
        return;
    }
    let r = out_run_of(i);
    let w = pu(POOL_WIDTH);
    let k = pu(POOL_KERNEL);
    for (var ox = r.ox0; ox < r.ox1; ox = ox + 1u) {
        let g = src_at(r.out_at + ox);
        let best = argmax_at(r.out_at + ox);
        let at = r.in_at + ox * k;
        for (var ty = 0u; ty < k; ty = ty + 1u) {
            for (var tx = 0u; tx < k; tx = tx + 1u) {
                store(at + ty * w + tx, select(0.0, g, ty * k + tx == best));
            }
        }
    }
}

@compute @workgroup_size(256)
fn avg_backward_tiles(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                      @builtin(local_invocation_index) lid: u32) {
    let i = workgroup_index(wid, nwg) * 256u + lid;
    if (i >= pu(POOL_N)) {
        return;
    }
    let r = out_run_of(i);
    let w = pu(POOL_WIDTH);
    let k = pu(POOL_KERNEL);
    for (var ox = r.ox0; ox < r.ox1; ox = ox + 1u) {
        let g = src_at(r.out_at + ox) / f32(k * k);
        let at = r.in_at + ox * k;
        for (var ty = 0u; ty < k; ty = ty + 1u) {
            for (var tx = 0u; tx < k; tx = tx + 1u) {
                store(at + ty * w + tx, g);
            }
        }
    }
}
