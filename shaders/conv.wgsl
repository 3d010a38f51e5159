// 2-d convolution (NCHW, weight [c_out, c_in, kernel_h, kernel_w]) runs as matmuls over column
// matrices: `im2col` lays a chunk of images out as cols[group][k][image in group][pixel] with
// k = (c_in, ky, kx) and pixel = (oy, ox), zeros in the padding, so that the forward is
// weight[c_out, k] x cols and the weight grad out_grad x cols^T, a group of images at a time
// (`group` images side by side along the pixels: small images make one product of many
// pixels, not many of a few); `col2im` sums the grad of cols back onto the input pixels.
// Chunks bound the column matrix, whatever the batch.
// Params: `ConvParams` (src/ops/conv.rs). All tensors are contiguous.

@group(0) @binding(1) var<storage, read> src: array<f32>;
@group(0) @binding(2) var<storage, read_write> dst: array<f32>;

// One invocation per run of `segment` elements of a row of out_w elements of cols
// [images / group, c_in * kh * kw, group, out_h, out_w], `segments` runs to a row (`n` counts
// the runs): the divisions are paid once per run, not per element, and a run stays within
// Mesa 22.3's loop limit however long the row (a 1-d convolution over 70,000 steps).
@compute @workgroup_size(256)
fn im2col(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
          @builtin(local_invocation_index) lid: u32) {
    let run = workgroup_index(wid, nwg) * 256u + lid;
    if (run >= pu(CONV_N)) {
        return;
    }
    let row = run / pu(CONV_SEGMENTS);
    let ox0 = (run - row * pu(CONV_SEGMENTS)) * pu(CONV_SEGMENT);
    let oh = pu(CONV_OUT_H);
    let ow = pu(CONV_OUT_W);
    let kw = pu(CONV_KERNEL_W);
    let taps = pu(CONV_KERNEL_H) * kw;
    let c_in = pu(CONV_C_IN);
    let h = pu(CONV_HEIGHT);
    let w = pu(CONV_WIDTH);
    let oy = row % oh;
    let k = (row / oh) % (c_in * taps);
    let image = row / (oh * c_in * taps);
    let y = i32(oy * pu(CONV_STRIDE_H) + ((k % taps) / kw) * pu(CONV_DILATION_H)) - i32(pu(CONV_PADDING_H));
    let x0 = i32((k % kw) * pu(CONV_DILATION_W)) - i32(pu(CONV_PADDING_W));
    let stride_w = pu(CONV_STRIDE_W);
    let plane_at = pu(CONV_SRC_OFFSET) + (image * c_in + k / taps) * h * w;
    let group = pu(CONV_GROUP);
    let group_pixels = group * oh * ow;
    let out_at = (image / group) * c_in * taps * group_pixels + k * group_pixels
        + (image % group) * oh * ow + oy * ow;
    let row_inside = y >= 0 && u32(y) < h;
    for (var ox = ox0; ox < min(ox0 + pu(CONV_SEGMENT), ow); ox = ox + 1u) {
        let x = x0 + i32(ox * stride_w);
        var v = 0.0;
        if (row_inside && x >= 0 && u32(x) < w) {
            v = src[plane_at + u32(y) * w + u32(x)];
        }
        dst[out_at + ox] = v;
    }
}

// The output position whose tap `t` lands on input position `p` along an axis of `out_len`
// outputs with `stride`, `padding` and `dilation` (`axis`), and whether one does: o with
// o * stride = p + padding - t * dilation.
fn source_of(p: u32, t: u32, out_len: u32, axis: vec3<u32>) -> vec2<u32> {
    let shifted = i32(p + axis.y) - i32(t * axis.z);
    let s = i32(axis.x);
    if (shifted < 0 || shifted % s != 0 || u32(shifted / s) >= out_len) {
        return vec2<u32>(0u, 0u);
    }
    return vec2<u32>(u32(shifted / s), 1u);
}

// Input element i of [images, c_in, height, width]: its column and row, where its plane's
// first tap starts in the cols grad [images / group, c_in * kh * kw, group, out_h * out_w]
// (image b's channel c owns rows c kh kw .. (c + 1) kh kw of its group), and the step from
// one tap's row to the next (`row_stride`: a group's pixels).
struct Col2imAt {
    x: u32,
    y: u32,
    base: u32,
    row_stride: u32,
}

fn col2im_at(i: u32) -> Col2imAt {
    let h = pu(CONV_HEIGHT);
    let w = pu(CONV_WIDTH);
    let c_in = pu(CONV_C_IN);
    let taps = pu(CONV_KERNEL_H) * pu(CONV_KERNEL_W);
    let group = pu(CONV_GROUP);
    let pixels = pu(CONV_OUT_H) * pu(CONV_OUT_W);
    let plane = i / (h * w);
    let image = plane / c_in;
    let base = pu(CONV_SRC_OFFSET) + (image / group) * c_in * taps * group * pixels
        + (plane - image * c_in) * taps * group * pixels + (image % group) * pixels;
    return Col2imAt(i % w, (i / w) % h, base, group * pixels);
}

// One invocation per input element [images, c_in, height, width]: the sum of the cols grad
// [images, c_in * kh * kw, out_h * out_w] over the taps that read it.
@compute @workgroup_size(256)
fn col2im(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
          @builtin(local_invocation_index) lid: u32) {
    let i = workgroup_index(wid, nwg) * 256u + lid;
    if (i >= pu(CONV_N)) {
        return;
    }
    let at = col2im_at(i);
    let kh = pu(CONV_KERNEL_H);
    let kw = pu(CONV_KERNEL_W);
    let oh = pu(CONV_OUT_H);
    let ow = pu(CONV_OUT_W);
    let along_h = vec3<u32>(pu(CONV_STRIDE_H), pu(CONV_PADDING_H), pu(CONV_DILATION_H));
    let along_w = vec3<u32>(pu(CONV_STRIDE_W), pu(CONV_PADDING_W), pu(CONV_DILATION_W));
    var sum = 0.0;
    for (var ty = 0u; ty < kh; ty = ty + 1u) {
        let oy = source_of(at.y, ty, oh, along_h);
        if (oy.y == 0u) {
            continue;
        }
        for (var tx = 0u; tx < kw; tx = tx + 1u) {
            let ox = source_of(at.x, tx, ow, along_w);
            if (ox.y == 1u) {
                sum = sum + src[at.base + (ty * kw + tx) * at.row_stride + oy.x * ow + ox.x];
            }
        }
    }
    dst[i] = sum;
}

// `col2im` for stride 1: a tap's output position is the input position shifted, so nothing
// divides per tap (the general entry divides twice per tap and ran at 60 ns per input
// element in the CNN's backward; CPU adapters divide lane by lane).
@compute @workgroup_size(256)
fn col2im_unit_stride(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                      @builtin(local_invocation_index) lid: u32) {
    let i = workgroup_index(wid, nwg) * 256u + lid;
    if (i >= pu(CONV_N)) {
        return;
    }
    let at = col2im_at(i);
    let kh = pu(CONV_KERNEL_H);
    let kw = pu(CONV_KERNEL_W);
    let oh = pu(CONV_OUT_H);
    let ow = pu(CONV_OUT_W);
    var sum = 0.0;
    for (var ty = 0u; ty < kh; ty = ty + 1u) {
        let oy = i32(at.y) + i32(pu(CONV_PADDING_H)) - i32(ty * pu(CONV_DILATION_H));
        if (oy < 0 || oy >= i32(oh)) {
            continue;
        }
        let row_at = at.base + ty * kw * at.row_stride + u32(oy) * ow;
        for (var tx = 0u; tx < kw; tx = tx + 1u) {
            let ox = i32(at.x) + i32(pu(CONV_PADDING_W)) - i32(tx * pu(CONV_DILATION_W));
            if (ox >= 0 && ox < i32(ow)) {
                sum = sum + src[row_at + tx * at.row_stride + u32(ox)];
            }
        }
    }
    dst[i] = sum;
}

// `col2im` for adjacent taps (dilation 1), any stride: one invocation per run of input elements
// of one row (`n` counts the runs, `segments` runs per row, `segment` elements per run).
// Along an axis, input position p meets taps t = (p + padding) % stride, + stride, .. at
// outputs (p + padding) / stride, - 1, ..: the row's taps are found once per run and a
// column's by stepping (p + padding) along the run, so nothing divides per element or tap
// (`col2im` divides twice per tap, and `col2im_at` six times per element).
@compute @workgroup_size(256)
fn col2im_rows(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
               @builtin(local_invocation_index) lid: u32) {
    let run = workgroup_index(wid, nwg) * 256u + lid;
    if (run >= pu(CONV_N)) {
        return;
    }
    let h = pu(CONV_HEIGHT);
    let w = pu(CONV_WIDTH);
    let row = run / pu(CONV_SEGMENTS);
    let x0 = (run - row * pu(CONV_SEGMENTS)) * pu(CONV_SEGMENT);
    let x1 = min(x0 + pu(CONV_SEGMENT), w);
    let at = col2im_at(row * w + x0);
    let kh = pu(CONV_KERNEL_H);
    let kw = pu(CONV_KERNEL_W);
    let oh = i32(pu(CONV_OUT_H));
    let ow = i32(pu(CONV_OUT_W));
    let stride_h = pu(CONV_STRIDE_H);
    let stride_w = pu(CONV_STRIDE_W);
    let y_shifted = at.y + pu(CONV_PADDING_H);
    let ty0 = y_shifted % stride_h;
    let oy0 = i32(y_shifted / stride_h);
    let x_shifted = x0 + pu(CONV_PADDING_W);
    var tx0 = x_shifted % stride_w;
    var ox0 = i32(x_shifted / stride_w);
    for (var x = x0; x < x1; x = x + 1u) {
        var sum = 0.0;
        var oy = oy0;
        for (var ty = ty0; ty < kh && oy >= 0; ty = ty + stride_h) {
            if (oy < oh) {
                var ox = ox0;
                for (var tx = tx0; tx < kw && ox >= 0; tx = tx + stride_w) {
                    if (ox < ow) {
                        sum = sum + src[at.base + (ty * kw + tx) * at.row_stride + u32(oy * ow + ox)];
                    }
                    ox = ox - 1;
                }
            }
            oy = oy - 1;
        }
        dst[row * w + x] = sum;
        tx0 = tx0 + 1u;
        if (tx0 == stride_w) {
            tx0 = 0u;
            ox0 = ox0 + 1;
        }
    }
}
