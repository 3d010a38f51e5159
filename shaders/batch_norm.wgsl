// BatchNorm in training mode, fused: per-channel statistics of x `[batch, channels, pixels]`
// (contiguous) over the batch and the pixels, the normalised output with the affine weight
// and bias, and the backward. Params: `BatchNormParams` (src/ops/batch_norm.rs). An x past
// one binding is bound as windows of whole images, a launch each: `batch` counts the
// window's images, `count` the channel's values over the whole batch.
// A channel's `batch * pixels` values are split into parts of at most PER_PART; a workgroup
// sums one (channel, part) and a second kernel merges a channel's parts, so that no
// invocation loops more than 3 * PER_PART / 256 times plus its reductions (llvmpipe ends an
// invocation after 65,535 loop iterations, all loops counted) and a GPU gets many workgroups.
// The statistics are of x over its largest magnitude in the part, so finite values up to
// 1e30 do not overflow their squares (as the composed norms, src/ops/norm.rs).

@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read> weight: array<f32>;
@group(0) @binding(3) var<storage, read> bias: array<f32>;
// forward: the output; backward: the input grad (from `out_offset`).
@group(0) @binding(4) var<storage, read_write> out: array<f32>;
// forward, [channels, parts, 4]: each part's count, scale, mean and sum of squared deviations
// (both of x / scale); backward, [channels, parts, 3]: its sums of the out grad, of
// grad * xhat and of xhat.
@group(0) @binding(5) var<storage, read_write> partials: array<f32>;
// [channels, 3]: the batch mean, 1 / sqrt(var + eps) and the unbiased variance.
@group(0) @binding(6) var<storage, read_write> stats: array<f32>;
// backward: the out grad, contiguous as x.
@group(0) @binding(7) var<storage, read> grad: array<f32>;
// backward, [channels, 2]: the sum of the out grad over each channel and the co-moment
// sum(grad xhat) - sum(grad) mean(xhat) (the bias's and the weight's grads; see
// channel_grad_sums).
@group(0) @binding(8) var<storage, read_write> sums: array<f32>;

const PER_PART: u32 = 16384u;

// The sum (or, with `largest`, the maximum) of every invocation's `v`, for all of them
// (workgroup_reduce.wgsl). WORKGROUP_REDUCE is spliced: workgroup_reduce_subgroups where the
// device has subgroups of a fixed width, else workgroup_reduce_tree.
fn workgroup_reduce(lid: u32, v: f32, largest: bool) -> f32 {
    return WORKGROUP_REDUCE(lid, v, largest, 256u);
}

// A channel's values in the bound window of x.
fn values_per_channel() -> u32 {
    return pu(BATCH_NORM_BATCH) * pu(BATCH_NORM_PIXELS);
}

// A channel's values over the whole batch, which its statistics are of.
fn channel_count() -> f32 {
    return f32(pu(BATCH_NORM_COUNT));
}

// Where the values j, j + 256, j + 512, .. of `channel` lie (past the tensor's own offset):
// value j is pixel j % pixels of image j / pixels. A part's invocation visits its values 256
// apart, so the walk divides once and then steps (CPU adapters divide lane by lane: two
// divisions per value took most of a part's time).
struct ValueWalk {
    // The offset of the current value's image plane of the channel, and its pixel.
    plane_at: u32,
    pixel: u32,
    // What one step of 256 values adds: pixels, and whole images' planes.
    pixel_step: u32,
    plane_step: u32,
}

fn value_walk(channel: u32, j: u32) -> ValueWalk {
    let pixels = pu(BATCH_NORM_PIXELS);
    let image_len = pu(BATCH_NORM_CHANNELS) * pixels;
    let image = j / pixels;
    return ValueWalk(image * image_len + channel * pixels, j - image * pixels, 256u % pixels,
                     (256u / pixels) * image_len);
}

fn value_at(w: ValueWalk) -> u32 {
    return w.plane_at + w.pixel;
}

fn value_walk_next(w: ValueWalk) -> ValueWalk {
    let pixels = pu(BATCH_NORM_PIXELS);
    var next = w;
    next.pixel = w.pixel + w.pixel_step;
    next.plane_at = w.plane_at + w.plane_step;
    if (next.pixel >= pixels) {
        next.pixel = next.pixel - pixels;
        next.plane_at = next.plane_at + pu(BATCH_NORM_CHANNELS) * pixels;
    }
    return next;
}

// A workgroup's part of a channel's values: invocation `lid` visits j = start + lid, + 256,
// .. while j < end.
struct Part {
    channel: u32,
    index: u32,
    start: u32,
    end: u32,
}

// How many of the part's values invocation `lid` visits (at most PER_PART / 256): loops run
// that many times, not PER_PART / 256 (a channel of 2x2 images at batch 128 has 512 values,
// two per invocation: the 64 iterations each of the three passes ran took a BatchNorm's
// forward from 3 to 22 ms on lavapipe).
fn visits(part: Part, lid: u32) -> u32 {
    let len = part.end - part.start;
    return (len + 255u - min(lid, len)) / 256u;
}

fn part_of(wid: vec3<u32>, nwg: vec3<u32>) -> Part {
    let w = workgroup_index(wid, nwg);
    let parts = pu(BATCH_NORM_PARTS);
    let index = w % parts;
    let start = index * PER_PART;
    return Part(w / parts, index, start, min(start + PER_PART, values_per_channel()));
}

// One workgroup per (channel, part): the part's count, largest magnitude (1 where that is 0
// or not finite: NaN and inf then propagate through the values themselves), and the mean and
// the sum of squared deviations of the values over it, two passes.
@compute @workgroup_size(256)
fn partial_stats(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                 @builtin(local_invocation_index) lid: u32) {
    let part = part_of(wid, nwg);
    if (part.channel >= pu(BATCH_NORM_CHANNELS)) {
        return;
    }
    let x0 = pu(BATCH_NORM_X_OFFSET);
    let first = value_walk(part.channel, part.start + lid);
    let own = visits(part, lid);
    var largest = 0.0;
    var walk = first;
    for (var k = 0u; k < own; k = k + 1u) {
        largest = max(largest, abs(x[x0 + value_at(walk)]));
        walk = value_walk_next(walk);
    }
    largest = workgroup_reduce(lid, largest, true);
    let scale = select(1.0, largest, largest > 0.0 && largest <= 3.4028234e38);
    var sum = 0.0;
    walk = first;
    for (var k = 0u; k < own; k = k + 1u) {
        sum = sum + x[x0 + value_at(walk)] / scale;
        walk = value_walk_next(walk);
    }
    let count = f32(part.end - part.start);
    let mean = workgroup_reduce(lid, sum, false) / count;
    var squares = 0.0;
    walk = first;
    for (var k = 0u; k < own; k = k + 1u) {
        let d = x[x0 + value_at(walk)] / scale - mean;
        squares = squares + d * d;
        walk = value_walk_next(walk);
    }
    squares = workgroup_reduce(lid, squares, false);
    if (lid == 0u) {
        let at = (part.channel * pu(BATCH_NORM_PARTS) + part.index) * 4u;
        partials[at] = count;
        partials[at + 1u] = scale;
        partials[at + 2u] = mean;
        partials[at + 3u] = squares;
    }
}

// One invocation per channel: its parts merged (Chan et al.'s pairwise update, each part
// rescaled to the channel's largest scale), into the mean, 1 / sqrt(var + eps) and the
// unbiased variance, in units of x.
@compute @workgroup_size(64)
fn channel_stats(@builtin(global_invocation_id) gid: vec3<u32>) {
    let channel = gid.x;
    if (channel >= pu(BATCH_NORM_CHANNELS)) {
        return;
    }
    let parts = pu(BATCH_NORM_PARTS);
    let first = channel * parts * 4u;
    var scale = 0.0;
    for (var p = 0u; p < rolled(parts); p = p + 1u) {
        scale = max(scale, partials[first + p * 4u + 1u]);
    }
    var count = 0.0;
    var mean = 0.0;
    var squares = 0.0;
    for (var p = 0u; p < rolled(parts); p = p + 1u) {
        let at = first + p * 4u;
        let n = partials[at];
        let ratio = partials[at + 1u] / scale;
        let part_mean = partials[at + 2u] * ratio;
        let part_squares = partials[at + 3u] * ratio * ratio;
        let total = count + n;
        let delta = part_mean - mean;
        mean = mean + delta * (n / total);
        squares = squares + part_squares + delta * delta * (count * n / total);
        count = total;
    }
    let var_scaled = squares / count;
    let eps_scaled = pf(BATCH_NORM_EPS) / (scale * scale);
    stats[channel * 3u] = mean * scale;
    stats[channel * 3u + 1u] = inverseSqrt(var_scaled + eps_scaled) / scale;
    stats[channel * 3u + 2u] = squares / (count - 1.0) * scale * scale;
}

// The channel of items i, i + 8, i + 16, .. of x `[batch, channels, pixels]`, the items one
// invocation of a contiguous kernel visits (contiguous_item_at): the walk divides once and
// then steps, as ValueWalk.
struct ChannelWalk {
    channel: u32,
    pixel: u32,
    // What one step of 8 items adds: pixels, and whole planes' channels (mod channels).
    pixel_step: u32,
    channel_step: u32,
}

// No channel: what a kernel's cache of a channel's values holds before its first load.
const NO_CHANNEL: u32 = 0xffffffffu;

fn channel_walk(i: u32) -> ChannelWalk {
    let pixels = pu(BATCH_NORM_PIXELS);
    let channels = pu(BATCH_NORM_CHANNELS);
    let plane = i / pixels;
    return ChannelWalk(plane % channels, i - plane * pixels, 8u % pixels, (8u / pixels) % channels);
}

fn channel_walk_next(w: ChannelWalk) -> ChannelWalk {
    let pixels = pu(BATCH_NORM_PIXELS);
    let channels = pu(BATCH_NORM_CHANNELS);
    var next = w;
    next.pixel = w.pixel + w.pixel_step;
    next.channel = w.channel + w.channel_step;
    if (next.pixel >= pixels) {
        next.pixel = next.pixel - pixels;
        next.channel = next.channel + 1u;
    }
    if (next.channel >= channels) {
        next.channel = next.channel - channels;
    }
    return next;
}

// The affine weight and bias of `channel` (1 and 0 without affine parameters).
fn weight_of(channel: u32) -> f32 {
    if (pu(BATCH_NORM_AFFINE) == 0u) {
        return 1.0;
    }
    return weight[pu(BATCH_NORM_WEIGHT_OFFSET) + channel];
}

fn bias_of(channel: u32) -> f32 {
    if (pu(BATCH_NORM_AFFINE) == 0u) {
        return 0.0;
    }
    return bias[pu(BATCH_NORM_BIAS_OFFSET) + channel];
}

// Contiguous over every element: out = (x - mean) rstd weight + bias.
@compute @workgroup_size(256)
fn normalise(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
             @builtin(local_invocation_index) lid: u32) {
    let n = pu(BATCH_NORM_NUMEL);
    var walk = channel_walk(contiguous_item(wid, nwg, lid, 0u, CONTIGUOUS_PER_GROUP));
    // The channel's mean, rstd, weight and bias, loaded when the walk enters a channel, not
    // per item (each is a load per lane on CPU adapters).
    var loaded = NO_CHANNEL;
    var channel = vec4<f32>();
    for (var k = 0u; k < rolled(CONTIGUOUS_PER_GROUP / 256u); k = k + 1u) {
        let i = contiguous_item(wid, nwg, lid, k, CONTIGUOUS_PER_GROUP);
        if (i < n) {
            let c = walk.channel;
            if (c != loaded) {
                channel = vec4<f32>(stats[c * 3u], stats[c * 3u + 1u], weight_of(c), bias_of(c));
                loaded = c;
            }
            let xhat = (x[pu(BATCH_NORM_X_OFFSET) + i] - channel.x) * channel.y;
            out[pu(BATCH_NORM_OUT_OFFSET) + i] = xhat * channel.z + channel.w;
        }
        walk = channel_walk_next(walk);
    }
}

// One workgroup per (channel, part): the part's sums of the out grad, of grad * xhat and of
// xhat.
@compute @workgroup_size(256)
fn partial_grad_sums(@builtin(workgroup_id) wid: vec3<u32>,
                     @builtin(num_workgroups) nwg: vec3<u32>,
                     @builtin(local_invocation_index) lid: u32) {
    let part = part_of(wid, nwg);
    if (part.channel >= pu(BATCH_NORM_CHANNELS)) {
        return;
    }
    let c = part.channel;
    let mean = stats[c * 3u];
    let rstd = stats[c * 3u + 1u];
    var sum_g = 0.0;
    var sum_g_xhat = 0.0;
    var sum_xhat = 0.0;
    var walk = value_walk(c, part.start + lid);
    for (var k = 0u; k < visits(part, lid); k = k + 1u) {
        let e = value_at(walk);
        let g = grad[pu(BATCH_NORM_GRAD_OFFSET) + e];
        let xhat = (x[pu(BATCH_NORM_X_OFFSET) + e] - mean) * rstd;
        sum_g = sum_g + g;
        sum_g_xhat = sum_g_xhat + g * xhat;
        sum_xhat = sum_xhat + xhat;
        walk = value_walk_next(walk);
    }
    sum_g = workgroup_reduce(lid, sum_g, false);
    sum_g_xhat = workgroup_reduce(lid, sum_g_xhat, false);
    sum_xhat = workgroup_reduce(lid, sum_xhat, false);
    if (lid == 0u) {
        let at = (c * pu(BATCH_NORM_PARTS) + part.index) * 3u;
        partials[at] = sum_g;
        partials[at + 1u] = sum_g_xhat;
        partials[at + 2u] = sum_xhat;
    }
}

// One invocation per channel: its parts' grad sums added into `sums`, the second as the
// co-moment sum(g xhat) - sum(g) mean(xhat). xhat's mean is 0 in exact arithmetic, but a
// channel far from 0 with a small spread rounds its f32 mean an ulp off, and 1 / sigma
// magnifies the recomputed xhat's mean: the co-moment cancels it, in the input grad and the
// weight's (the grad of a BatchNorm's summed outputs, 0, read 14 for values of 1000 +- 0.005).

@compute @workgroup_size(64)
fn channel_grad_sums(@builtin(global_invocation_id) gid: vec3<u32>) {
    let channel = gid.x;
    if (channel >= pu(BATCH_NORM_CHANNELS)) {
        return;
    }
    let parts = pu(BATCH_NORM_PARTS);
    var sum_g = 0.0;
    var sum_g_xhat = 0.0;
    var sum_xhat = 0.0;
    for (var p = 0u; p < rolled(parts); p = p + 1u) {
        let at = (channel * parts + p) * 3u;
        sum_g = sum_g + partials[at];
        sum_g_xhat = sum_g_xhat + partials[at + 1u];
        sum_xhat = sum_xhat + partials[at + 2u];
    }
    sums[channel * 2u] = sum_g;
    sums[channel * 2u + 1u] = sum_g_xhat - sum_g * (sum_xhat / channel_count());
}

// Contiguous over every element: the input grad
// weight rstd (g - sum_g / count - xhat sum_g_xhat / count).
@compute @workgroup_size(256)
fn input_grad(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
              @builtin(local_invocation_index) lid: u32) {
    let n = pu(BATCH_NORM_NUMEL);
    let count = channel_count();
    var walk = channel_walk(contiguous_item(wid, nwg, lid, 0u, CONTIGUOUS_PER_GROUP));
    // The channel's mean and rstd, its means of g and of g xhat, and its weight, loaded when
    // the walk enters a channel (as in normalise).
    var loaded = NO_CHANNEL;
    var channel = vec4<f32>();
    var weight_c = 0.0;
    for (var k = 0u; k < rolled(CONTIGUOUS_PER_GROUP / 256u); k = k + 1u) {
        let i = contiguous_item(wid, nwg, lid, k, CONTIGUOUS_PER_GROUP);
        if (i < n) {
            let c = walk.channel;
            if (c != loaded) {
                channel = vec4<f32>(stats[c * 3u], stats[c * 3u + 1u], sums[c * 2u] / count,
                                    sums[c * 2u + 1u] / count);
                weight_c = weight_of(c);
                loaded = c;
            }
            let rstd = channel.y;
            let xhat = (x[pu(BATCH_NORM_X_OFFSET) + i] - channel.x) * rstd;
            let g = grad[pu(BATCH_NORM_GRAD_OFFSET) + i];
            let grad_x = weight_c * rstd * (g - channel.z - xhat * channel.w);
            out[pu(BATCH_NORM_OUT_OFFSET) + i] = grad_x;
        }
        walk = channel_walk_next(walk);
    }
}
