//! 2-d convolution (NCHW) forward and backward as matmuls over column matrices
//! `[images, c_in kh kw, out pixels]`. Where the matmul kernel can read the column matrix from
//! the images itself (8-wide subgroups on the CPU flavour, every GPU-flavour device; output
//! pixels in whole 4s), the forward is one implicit GEMM (`conv_product` in `ops/matmul.rs`):
//! no column matrix is written.
//! Otherwise `im2col` (`shaders/conv.wgsl`) writes a chunk of images' columns and the forward
//! is `weight x cols`. The weight grad is `out_grad x cols^T`, read from the images in the same
//! way where the kernel can (`conv_weight_product`), else over im2col's columns; small images
//! go through their columns a group of images at a time (`images_per_group`). The input
//! grad of a unit-stride convolution is itself a convolution (of the out grad with the flipped,
//! transposed weight, padded by `d (k - 1) - p`), so it takes the same implicit GEMM; any other
//! input grad is the cols grad `weight^T x out_grad` summed back by `col2im`. Chunks of images
//! bound each column matrix (at most `COLS_LIMIT` elements) whatever the batch. Bias is a
//! broadcast add; groups are one convolution per channel group.

use crate::device::Device;
use crate::error::{Error, Result};
use crate::kernel::{
    groups, rows_per_window, Kernel, KernelParams, Launch, ShaderFamily, MAX_LOOP_LEN, WORKGROUP,
};
use crate::ops::autocast::in_f32;
use crate::ops::matmul::{
    conv_product, conv_product_applies, conv_weight_product, conv_weight_product_applies,
    ImageColumns,
};
use crate::ops::{check_window_params, sum_over_chunks, MAX_WINDOW_PARAM};
use crate::tensor::grad_mode::NoGradGuard;
use crate::tensor::graph::record;
use crate::tensor::{DType, Tensor};

crate::kernel_params! {
    /// `im2col` and `col2im` over a chunk of images of `c_in x height x width`, read with
    /// `kernel_h x kernel_w` taps into `out_h x out_w` positions, the column matrix holding
    /// `group` images side by side. `n` counts what the entry writes: runs of `segment`
    /// elements of a row of out_w, `segments` to a row (`im2col`), elements (`col2im`), or
    /// runs of `segment` elements of an input row, `segments` to a row (`col2im_rows`).
    pub(crate) struct ConvParams {
        n: u32,
        c_in: u32,
        height: u32,
        width: u32,
        kernel_h: u32,
        kernel_w: u32,
        out_h: u32,
        out_w: u32,
        stride_h: u32,
        stride_w: u32,
        padding_h: u32,
        padding_w: u32,
        dilation_h: u32,
        dilation_w: u32,
        src_offset: u32,
        group: u32,
        segment: u32,
        segments: u32,
    }
}

static CONV: ShaderFamily = ShaderFamily {
    name: "conv",
    wgsl: include_str!("../../shaders/conv.wgsl"),
    params: &[&ConvParams::LAYOUT],
    preludes: &[],
};

#[cfg(test)]
pub(crate) fn kernel_sources() -> Vec<(String, String)> {
    vec![("conv".into(), CONV.source(&[]))]
}

/// Input elements of a row one `col2im_rows` invocation sums: what divides is paid once per
/// run.
const COL2IM_RUN: usize = 64;

/// Most elements of one chunk's column matrix (16 MiB).
const COLS_LIMIT: usize = 1 << 22;

/// Most pixels of one group of images in a column matrix: images of fewer pixels (a ResNet's
/// last stages, 1 to 49) go side by side, so that each product runs over a group's pixels.
/// Image by image, the weight grad of 2x2 images wrote a `[c_out, k]` product per image and
/// ran at 2.4 GFLOP/s on lavapipe.
const GROUP_PIXELS: usize = 256;

/// Images of `pixels` output pixels whose columns one product covers together: the largest
/// divisor of `count` (a chunk's images) whose pixels stay within [`GROUP_PIXELS`], at least 1.
fn images_per_group(count: usize, pixels: usize) -> usize {
    let most = (GROUP_PIXELS / pixels.max(1)).clamp(1, count.max(1));
    (1..=most)
        .rev()
        .find(|g| count.is_multiple_of(*g))
        .unwrap_or(1)
}

/// `t` `[count, channels, h, w]` (any layout) as `[count / group, channels, group h w]`: each
/// group's images side by side along the last dim, the layout of `im2col`'s columns (a copy
/// unless `group` is 1).
fn grouped(t: &Tensor, group: usize) -> Result<Tensor> {
    let [count, channels, h, w] = [t.shape()[0], t.shape()[1], t.shape()[2], t.shape()[3]];
    if group == 1 {
        return t.reshape(&[count, channels, h * w]);
    }
    t.reshape(&[count / group, group, channels, h * w])?
        .permute(&[0, 2, 1, 3])?
        .contiguous()?
        .reshape(&[count / group, channels, group * h * w])
}

/// The inverse of [`grouped`]: `t` `[count / group, channels, group h w]` as `shape`
/// `[count, channels, h, w]`.
fn ungrouped(t: &Tensor, group: usize, shape: [usize; 4]) -> Result<Tensor> {
    if group == 1 {
        return t.reshape(&shape);
    }
    let [count, channels, h, w] = shape;
    t.reshape(&[count / group, channels, group, h * w])?
        .permute(&[0, 2, 1, 3])?
        .contiguous()?
        .reshape(&shape)
}

/// Stride, padding, dilation and groups of a convolution, with PyTorch's defaults; each
/// `(along H, along W)`, as torch's tuples ([`Conv2dOptions::square`] for equal ones).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Conv2dOptions {
    /// Step between windows (>= 1).
    pub stride: (usize, usize),
    /// Zeros added before and after each image row (H) and column (W).
    pub padding: (usize, usize),
    /// Step between kernel taps (>= 1).
    pub dilation: (usize, usize),
    /// Channel groups: input and output channels split into this many independent parts.
    pub groups: usize,
}

impl Default for Conv2dOptions {
    fn default() -> Self {
        Conv2dOptions {
            stride: (1, 1),
            padding: (0, 0),
            dilation: (1, 1),
            groups: 1,
        }
    }
}

impl Conv2dOptions {
    /// The same stride and padding along both axes, no dilation, one group.
    pub fn square(stride: usize, padding: usize) -> Conv2dOptions {
        Conv2dOptions {
            stride: (stride, stride),
            padding: (padding, padding),
            ..Default::default()
        }
    }
}

/// Stride, padding, dilation and groups of a 1-d convolution, with PyTorch's defaults.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Conv1dOptions {
    /// Step between windows (>= 1).
    pub stride: usize,
    /// Zeros added at both ends of each sequence.
    pub padding: usize,
    /// Step between kernel taps (>= 1).
    pub dilation: usize,
    /// Channel groups, as in [`Conv2dOptions`].
    pub groups: usize,
}

impl Default for Conv1dOptions {
    fn default() -> Self {
        Conv1dOptions {
            stride: 1,
            padding: 0,
            dilation: 1,
            groups: 1,
        }
    }
}

impl Conv1dOptions {
    /// The same convolution over `[N, C, 1, L]`: the options along W, H untouched.
    pub(crate) fn as_2d(&self) -> Conv2dOptions {
        Conv2dOptions {
            stride: (1, self.stride),
            padding: (0, self.padding),
            dilation: (1, self.dilation),
            groups: self.groups,
        }
    }
}

/// The sizes of one convolution (of one channel group): the batch, the output channels, and
/// the column matrix the input is read as.
#[derive(Debug, Clone, Copy)]
struct Geometry {
    batch: usize,
    c_out: usize,
    cols: ImageColumns,
}

impl Geometry {
    /// Images per chunk, so that one chunk's column matrix holds at most [`COLS_LIMIT`]
    /// elements and its images, columns and outputs each fit one binding of `device` (at
    /// least one image: one past a binding is then the `TooLarge` of the op that binds it).
    fn images_per_chunk(&self, device: &Device) -> usize {
        let c = &self.cols;
        // Elements one window holds (see `rows_per_window`).
        let binding = rows_per_window(device, 1);
        let per_image = [
            (c.k() * c.pixels(), COLS_LIMIT.min(binding)),
            (c.c_in * c.height * c.width, binding),
            (self.c_out * c.pixels(), binding),
        ];
        (per_image.iter())
            .map(|&(elements, limit)| limit / elements.max(1))
            .min()
            .expect("three limits")
            .max(1)
    }

    fn params(&self, n: usize, src: &Tensor, group: usize) -> ConvParams {
        let c = &self.cols;
        ConvParams {
            n: n as u32,
            c_in: c.c_in as u32,
            height: c.height as u32,
            width: c.width as u32,
            kernel_h: c.kernel_h as u32,
            kernel_w: c.kernel_w as u32,
            out_h: c.out_h as u32,
            out_w: c.out_w as u32,
            stride_h: c.stride.0 as u32,
            stride_w: c.stride.1 as u32,
            padding_h: c.padding.0 as u32,
            padding_w: c.padding.1 as u32,
            dilation_h: c.dilation.0 as u32,
            dilation_w: c.dilation.1 as u32,
            src_offset: src.layout().offset as u32,
            group: group as u32,
            segment: 0,
            segments: 0,
        }
    }
}

/// Checks shapes and options; returns the geometry of one group.
fn geometry(x: &Tensor, w: &Tensor, options: &Conv2dOptions) -> Result<Geometry> {
    const OP: &str = "conv2d";
    x.expect_same_device(OP, w)?;
    x.expect_dtype(OP, DType::F32)?;
    w.expect_dtype(OP, DType::F32)?;
    let shape_error = |msg: String| Error::Shape { op: OP, msg };
    if x.rank() != 4 || w.rank() != 4 {
        return Err(shape_error(format!(
            "needs input [N, C, H, W] and weight [C_out, C_in / groups, kH, kW], got {:?} and {:?}",
            x.shape(),
            w.shape()
        )));
    }
    let Conv2dOptions {
        stride,
        padding,
        dilation,
        groups,
    } = *options;
    if stride.0 == 0 || stride.1 == 0 || dilation.0 == 0 || dilation.1 == 0 || groups == 0 {
        return Err(Error::InvalidArgument {
            op: OP,
            msg: format!(
                "stride {stride:?}, dilation {dilation:?} and groups ({groups}) must be >= 1"
            ),
        });
    }
    check_window_params(
        OP,
        &[
            ("stride", stride.0.max(stride.1)),
            ("padding", padding.0.max(padding.1)),
            ("dilation", dilation.0.max(dilation.1)),
        ],
    )?;
    let (batch, c_in, height, width) = (x.shape()[0], x.shape()[1], x.shape()[2], x.shape()[3]);
    let (c_out, c_in_group, kernel_h, kernel_w) =
        (w.shape()[0], w.shape()[1], w.shape()[2], w.shape()[3]);
    if c_in % groups != 0 || c_out % groups != 0 || c_in_group * groups != c_in {
        return Err(shape_error(format!(
            "input {:?} with {groups} group(s) needs weight [C_out, {}, kH, kW] with C_out \
             divisible by {groups}, got weight {:?}",
            x.shape(),
            c_in / groups.max(1),
            w.shape()
        )));
    }
    let span = |k: usize, dilation: usize| dilation * (k.max(1) - 1) + 1;
    let (span_h, span_w) = (span(kernel_h, dilation.0), span(kernel_w, dilation.1));
    let (padded_h, padded_w) = (height + 2 * padding.0, width + 2 * padding.1);
    if kernel_h == 0 || kernel_w == 0 || span_h > padded_h || span_w > padded_w {
        return Err(shape_error(format!(
            "kernel {kernel_h}x{kernel_w} (dilation {dilation:?}) does not fit the padded input \
             {padded_h}x{padded_w} of input {:?}",
            x.shape()
        )));
    }
    Ok(Geometry {
        batch,
        c_out: c_out / groups,
        cols: ImageColumns {
            c_in: c_in_group,
            height,
            width,
            kernel_h,
            kernel_w,
            out_h: (padded_h - span_h) / stride.0 + 1,
            out_w: (padded_w - span_w) / stride.1 + 1,
            stride,
            padding,
            dilation,
        },
    })
}

/// The column matrix `[images / group, c_in kh kw, group out pixels]` of `images` (contiguous,
/// a chunk of the batch; `group` divides their count), zeros in the padding.
fn im2col(images: &Tensor, geo: &Geometry, group: usize) -> Result<Tensor> {
    const OP: &str = "conv2d";
    let count = images.shape()[0];
    let cols = Tensor::empty(
        OP,
        &[count / group, geo.cols.k(), group * geo.cols.pixels()],
        DType::F32,
        images.device(),
    )?;
    if cols.numel() > 0 {
        let rows = count * geo.cols.k() * geo.cols.out_h;
        let segment = geo.cols.out_w.min(MAX_LOOP_LEN);
        let segments = geo.cols.out_w.div_ceil(segment);
        let params = ConvParams {
            segment: segment as u32,
            segments: segments as u32,
            ..geo.params(rows * segments, images, group)
        };
        let kernel = Kernel::plain(&CONV, "im2col");
        Launch::new(OP, &kernel, &[(1, images), (2, &cols)], &params)
            .record(groups(rows * segments, WORKGROUP))?;
    }
    Ok(cols)
}

/// The input grad `[images, c_in, height, width]` from the grad of a chunk's column matrix
/// `[images / group, c_in kh kw, group out pixels]` (any layout: a matmul may return its
/// product as a transposed view).
fn col2im(cols_grad: &Tensor, geo: &Geometry, group: usize) -> Result<Tensor> {
    const OP: &str = "conv2d";
    let cols_grad = &cols_grad.contiguous()?;
    let count = cols_grad.shape()[0] * group;
    let shape = [count, geo.cols.c_in, geo.cols.height, geo.cols.width];
    let grad = Tensor::empty(OP, &shape, DType::F32, cols_grad.device())?;
    let n = grad.numel();
    if n == 0 {
        return Ok(grad);
    }
    let c = &geo.cols;
    let (entry, params, invocations) = match (c.dilation, c.stride) {
        ((1, 1), (stride_h, stride_w)) => {
            // Runs short enough that an invocation's loops stay within MAX_LOOP_LEN
            // iterations: per element, itself, its rows of taps and its taps.
            let tap_rows = c.kernel_h.div_ceil(stride_h);
            let taps = tap_rows * c.kernel_w.div_ceil(stride_w);
            let segment = (MAX_LOOP_LEN / (1 + tap_rows + taps)).clamp(1, COL2IM_RUN);
            let segments = c.width.div_ceil(segment);
            let runs = count * c.c_in * c.height * segments;
            let params = ConvParams {
                segment: segment as u32,
                segments: segments as u32,
                ..geo.params(runs, cols_grad, group)
            };
            ("col2im_rows", params, runs)
        }
        (_, (1, 1)) => ("col2im_unit_stride", geo.params(n, cols_grad, group), n),
        _ => ("col2im", geo.params(n, cols_grad, group), n),
    };
    let kernel = Kernel::plain(&CONV, entry);
    Launch::new(OP, &kernel, &[(1, cols_grad), (2, &grad)], &params)
        .record(groups(invocations, WORKGROUP))?;
    Ok(grad)
}

/// `f(start, count)` over the batch in chunks of images, the results joined along dim 0;
/// a tensor of shape `[0, rest..]` for an empty batch.
fn by_chunks(
    x: &Tensor,
    geo: &Geometry,
    rest: [usize; 3],
    f: impl Fn(usize, usize) -> Result<Tensor>,
) -> Result<Tensor> {
    let step = geo.images_per_chunk(x.device());
    let parts = (0..geo.batch)
        .step_by(step)
        .map(|start| f(start, step.min(geo.batch - start)))
        .collect::<Result<Vec<_>>>()?;
    match parts.len() {
        0 => Tensor::zeros(&[0, rest[0], rest[1], rest[2]], x.device()),
        1 => Ok(parts.into_iter().next().expect("one part")),
        _ => Tensor::cat(&parts, 0),
    }
}

/// One group's forward: where the matmul kernel can read the column matrix from the images
/// itself, one implicit GEMM with the weight's taps laid out channels innermost; otherwise
/// a chunk at a time, each chunk's implicit GEMM where it applies to the chunk (a batch past
/// one binding), else im2col, each group of images' columns times the weight.
fn forward(x: &Tensor, w: &Tensor, geo: &Geometry) -> Result<Tensor> {
    let columns = &geo.cols;
    // [c_out, kh, kw, c_in]: taps outer, channels inner.
    let w_taps_outer = w.permute(&[0, 2, 3, 1])?;
    if conv_product_applies(x.device(), geo.c_out, geo.batch, columns) {
        return implicit_gemm(&w_taps_outer, x, columns);
    }
    let w_mat = w.reshape(&[geo.c_out, geo.cols.k()])?;
    let out_rest = [geo.c_out, geo.cols.out_h, geo.cols.out_w];
    by_chunks(x, geo, out_rest, |start, count| {
        let images = x.narrow(0, start, count)?.contiguous()?.bindable();
        if conv_product_applies(x.device(), geo.c_out, count, columns) {
            return implicit_gemm(&w_taps_outer, &images, columns);
        }
        let group = images_per_group(count, geo.cols.pixels());
        let cols = im2col(&images, geo, group)?;
        let shape = [count, geo.c_out, geo.cols.out_h, geo.cols.out_w];
        ungrouped(&w_mat.matmul(&cols)?, group, shape)
    })
}

/// `conv_product` of `w_taps_outer` (`[rows, taps.., channels]`, any layout) over `images`:
/// the weight made one dense matrix `[rows, k]` with k padded by zero weights to whole 4s.
fn implicit_gemm(w_taps_outer: &Tensor, images: &Tensor, columns: &ImageColumns) -> Result<Tensor> {
    let rows = w_taps_outer.shape()[0];
    let w_mat = w_taps_outer.contiguous()?.reshape(&[rows, columns.k()])?;
    let pad = columns.k().next_multiple_of(4) - columns.k();
    let w_mat = match pad {
        0 => w_mat,
        _ => w_mat.pad2d((0, pad, 0, 0), 0.0)?,
    };
    conv_product(&w_mat, &images.contiguous()?, columns)
}

/// The column matrix that turns one group's input grad into a forward convolution, where
/// there is one: with unit stride, the input grad is the out grad convolved with the weight
/// flipped along both taps and with its channels swapped, padded by `dilation (k - 1) - padding`
/// (at least 0), which gives back the input's height and width.
fn adjoint_columns(geo: &Geometry) -> Option<ImageColumns> {
    let c = &geo.cols;
    let adjoint_padding =
        |k: usize, dilation: usize, padding: usize| (dilation * (k - 1)).checked_sub(padding);
    if c.stride != (1, 1) {
        return None;
    }
    Some(ImageColumns {
        c_in: geo.c_out,
        height: c.out_h,
        width: c.out_w,
        kernel_h: c.kernel_h,
        kernel_w: c.kernel_w,
        out_h: c.height,
        out_w: c.width,
        stride: (1, 1),
        padding: (
            adjoint_padding(c.kernel_h, c.dilation.0, c.padding.0)?,
            adjoint_padding(c.kernel_w, c.dilation.1, c.padding.1)?,
        ),
        dilation: c.dilation,
    })
}

/// One group's input grad from the out grad `g` `[N, c_out, out_h, out_w]`. With unit stride
/// where the matmul kernel reads images, one implicit GEMM of `g` with the flipped weight
/// ([`adjoint_columns`]); otherwise the cols grad `w^T g` summed back onto the input by
/// col2im, a chunk of images at a time. It is also the forward of the transposed convolution.
fn input_grad(g: &Tensor, w: &Tensor, geo: &Geometry) -> Result<Tensor> {
    let adjoint = adjoint_columns(geo);
    let applies = |images: usize| {
        let columns = adjoint.as_ref()?;
        conv_product_applies(g.device(), geo.cols.c_in, images, columns).then_some(columns)
    };
    if let Some(columns) = applies(geo.batch) {
        return implicit_gemm(&flipped_taps_outer(w, geo)?, g, columns);
    }
    let flipped = match applies(1) {
        Some(_) => Some(flipped_taps_outer(w, geo)?),
        None => None,
    };
    // Contiguous once, so that each chunk below is a view of it.
    let g = &g.contiguous()?;
    let w_mat = w.reshape(&[geo.c_out, geo.cols.k()])?;
    let in_rest = [geo.cols.c_in, geo.cols.height, geo.cols.width];
    by_chunks(g, geo, in_rest, |start, count| {
        // A chunk of a batch past one binding takes the implicit GEMM where it applies.
        if let (Some(columns), Some(flipped)) = (applies(count), &flipped) {
            let g_chunk = g.narrow(0, start, count)?.bindable();
            return implicit_gemm(flipped, &g_chunk, columns);
        }
        let group = images_per_group(count, geo.cols.pixels());
        let g_groups = grouped(&g.narrow(0, start, count)?.bindable(), group)?;
        col2im(&w_mat.t()?.matmul(&g_groups)?, geo, group)
    })
}

/// The weight `[c_out, c_in, kh, kw]` as `[c_in, taps reversed, c_out]`, the matrix of the
/// adjoint convolution: the tap `(kh - 1 - a, kw - 1 - b)` at `(a, b)` is the flattened taps
/// reversed. One gather writes it contiguous (a flip and a permute would copy twice).
fn flipped_taps_outer(w: &Tensor, geo: &Geometry) -> Result<Tensor> {
    let (c_out, c_in) = (geo.c_out, geo.cols.c_in);
    let taps = geo.cols.kernel_h * geo.cols.kernel_w;
    let mut picks = Vec::with_capacity(c_in * taps * c_out);
    for ci in 0..c_in {
        for t in 0..taps {
            for co in 0..c_out {
                picks.push(((co * c_in + ci) * taps + (taps - 1 - t)) as u32);
            }
        }
    }
    let picks = Tensor::from_vec_u32(picks, &[c_in * taps * c_out], w.device())?;
    w.reshape(&[c_out * c_in * taps])?
        .index_select(0, &picks)?
        .reshape(&[c_in, taps, c_out])
}

/// One group's weight grad, shaped as `w_shape`, from the input `x` and the out grad `g`: the
/// sum over groups of images of `g cols^T`, read from the images where the matmul kernel can
/// ([`conv_weight_product`]: no column matrix written), else through im2col's columns.
fn weight_grad(x: &Tensor, g: &Tensor, geo: &Geometry, w_shape: &[usize]) -> Result<Tensor> {
    let part = |start, count| {
        let group = images_per_group(count, geo.cols.pixels());
        // Chunks of a batch past one binding are bound as windows of their own images.
        let images = x.narrow(0, start, count)?.contiguous()?.bindable();
        let g_groups = grouped(&g.narrow(0, start, count)?.bindable(), group)?;
        let partials =
            if conv_weight_product_applies(x.device(), geo.c_out, count, group, &geo.cols) {
                conv_weight_product(&g_groups.contiguous()?, &images, &geo.cols, group)?
            } else {
                g_groups.matmul(&im2col(&images, geo, group)?.transpose(1, 2)?)?
            };
        partials.sum_dims(&[0], false)
    };
    let sum = match sum_over_chunks(geo.batch, geo.images_per_chunk(x.device()), part)? {
        Some(s) => s,
        None => Tensor::zeros(&[geo.c_out, geo.cols.k()], x.device())?,
    };
    sum.reshape(w_shape)
}

/// Which way one group's convolution `geo` runs: forward (images `[N, c_in, height, width]`
/// to `[N, c_out, out_h, out_w]`), or transposed, its adjoint (the other way: the input grad
/// of the forward).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Direction {
    Forward,
    Transposed,
}

impl Direction {
    /// `x` through the convolution of weight `w` in this direction.
    fn apply(self, x: &Tensor, w: &Tensor, geo: &Geometry) -> Result<Tensor> {
        match self {
            Direction::Forward => forward(x, w, geo),
            Direction::Transposed => input_grad(x, w, geo),
        }
    }

    /// The other direction: what carries an out grad back to the input.
    fn adjoint(self) -> Direction {
        match self {
            Direction::Forward => Direction::Transposed,
            Direction::Transposed => Direction::Forward,
        }
    }
}

/// One group's convolution of `x` with `w` (no bias) in `direction`, recorded with its
/// backward: the input grad is the out grad through the adjoint direction, and the weight
/// grad is the forward convolution's, of its input (`x`, or the out grad when transposed)
/// and its out grad.
fn conv_group(
    op: &'static str,
    direction: Direction,
    x: &Tensor,
    w: &Tensor,
    geo: Geometry,
) -> Result<Tensor> {
    let out = {
        let _no_grad = NoGradGuard::new();
        direction.apply(x, w, &geo)?
    };
    Ok(record(op, out, &[x, w], |_| {
        let (need_x, need_w) = (x.requires_grad(), w.requires_grad());
        let (x, w) = (x.detach(), w.detach());
        move |g: &Tensor| {
            let grad_x = need_x
                .then(|| direction.adjoint().apply(g, &w, &geo))
                .transpose()?;
            let (images, out_grad) = match direction {
                Direction::Forward => (&x, g),
                Direction::Transposed => (g, &x),
            };
            let grad_w = need_w
                .then(|| weight_grad(images, out_grad, &geo, w.shape()))
                .transpose()?;
            Ok(vec![grad_x, grad_w])
        }
    }))
}

/// Stride, padding, output padding, dilation and groups of a transposed convolution, the
/// same along both axes, with PyTorch's defaults.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConvTranspose2dOptions {
    /// Step between the input pixels' windows in the output (>= 1).
    pub stride: usize,
    /// Rows and columns of the full output cut from each side.
    pub padding: usize,
    /// Rows and columns added at the bottom and right (below `stride`), to reach the size a
    /// strided convolution came from.
    pub output_padding: usize,
    /// Step between kernel taps (>= 1).
    pub dilation: usize,
    /// Channel groups: weight `[C_in, C_out / groups, kH, kW]`.
    pub groups: usize,
}

impl Default for ConvTranspose2dOptions {
    fn default() -> Self {
        ConvTranspose2dOptions {
            stride: 1,
            padding: 0,
            output_padding: 0,
            dilation: 1,
            groups: 1,
        }
    }
}

/// Checks a transposed convolution's shapes and options; returns the geometry of one group
/// of the convolution it is the input grad of (from the output to `x`).
fn transpose_geometry(x: &Tensor, w: &Tensor, o: &ConvTranspose2dOptions) -> Result<Geometry> {
    const OP: &str = "conv_transpose2d";
    x.expect_same_device(OP, w)?;
    x.expect_dtype(OP, DType::F32)?;
    w.expect_dtype(OP, DType::F32)?;
    let shapes = || format!("input {:?}, weight {:?}, {o:?}", x.shape(), w.shape());
    if x.rank() != 4 || w.rank() != 4 {
        return Err(Error::Shape {
            op: OP,
            msg: format!(
                "needs input [N, C_in, H, W] and weight [C_in, C_out / groups, kH, kW], got {}",
                shapes()
            ),
        });
    }
    if o.stride == 0 || o.dilation == 0 || o.groups == 0 || o.output_padding >= o.stride {
        return Err(Error::InvalidArgument {
            op: OP,
            msg: format!(
                "stride, dilation and groups must be >= 1 and output_padding below stride, got {}",
                shapes()
            ),
        });
    }
    let params = [
        ("stride", o.stride),
        ("padding", o.padding),
        ("dilation", o.dilation),
    ];
    check_window_params(OP, &params)?;
    let (batch, c_in, height, width) = (x.shape()[0], x.shape()[1], x.shape()[2], x.shape()[3]);
    let (w_in, c_out_group, kernel_h, kernel_w) =
        (w.shape()[0], w.shape()[1], w.shape()[2], w.shape()[3]);
    if w_in != c_in || !c_in.is_multiple_of(o.groups) || kernel_h == 0 || kernel_w == 0 {
        return Err(Error::Shape {
            op: OP,
            msg: format!(
                "needs weight [C_in, C_out / groups, kH, kW] with C_in = {c_in} divisible by \
                 the groups, got {}",
                shapes()
            ),
        });
    }
    // The full output, less the padding on each side, plus the output padding (in u128: each
    // term is below 2^64, their sum need not be).
    let side = |size: usize, k: usize| {
        let full =
            (size.max(1) as u128 - 1) * o.stride as u128 + o.dilation as u128 * (k as u128 - 1) + 1;
        (full + o.output_padding as u128).checked_sub(2 * o.padding as u128)
    };
    let (Some(out_h), Some(out_w)) = (side(height, kernel_h), side(width, kernel_w)) else {
        return Err(Error::Shape {
            op: OP,
            msg: format!("the padding leaves no output, got {}", shapes()),
        });
    };
    if out_h.max(out_w) > MAX_WINDOW_PARAM as u128 {
        return Err(Error::Shape {
            op: OP,
            msg: format!(
                "an output side of {out_h}x{out_w} is past any tensor's, got {}",
                shapes()
            ),
        });
    }
    let (out_h, out_w) = (out_h as usize, out_w as usize);
    if out_h == 0 || out_w == 0 || height == 0 || width == 0 {
        return Err(Error::Shape {
            op: OP,
            msg: format!("needs nonzero image and output sizes, got {}", shapes()),
        });
    }
    Ok(Geometry {
        batch,
        c_out: c_in / o.groups,
        cols: ImageColumns {
            c_in: c_out_group,
            height: out_h,
            width: out_w,
            kernel_h,
            kernel_w,
            out_h: height,
            out_w: width,
            stride: (o.stride, o.stride),
            padding: (o.padding, o.padding),
            dilation: (o.dilation, o.dilation),
        },
    })
}

/// Errors unless `bias` is `[c_out]` on `x`'s device.
fn check_bias(
    op: &'static str,
    x: &Tensor,
    weight: &Tensor,
    bias: Option<&Tensor>,
    c_out: usize,
) -> Result<()> {
    let Some(b) = bias else {
        return Ok(());
    };
    x.expect_same_device(op, b)?;
    if b.shape() != [c_out] {
        return Err(Error::Shape {
            op,
            msg: format!(
                "bias of shape {:?} for a weight of shape {:?} (needs [{c_out}])",
                b.shape(),
                weight.shape()
            ),
        });
    }
    Ok(())
}

/// `f(g)` for each of `groups` channel groups, joined along the channels.
fn by_groups(groups: usize, f: impl Fn(usize) -> Result<Tensor>) -> Result<Tensor> {
    if groups == 1 {
        return f(0);
    }
    let parts = (0..groups).map(f).collect::<Result<Vec<_>>>()?;
    Tensor::cat(&parts, 1)
}

/// `out` plus `bias` `[C]` over its channels, when given.
fn add_bias(out: Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
    match bias {
        Some(b) => out.add(&b.reshape(&[b.numel(), 1, 1])?),
        None => Ok(out),
    }
}

impl Tensor {
    /// 2-d convolution of `self` `[N, C_in, H, W]` with `weight` `[C_out, C_in, kH, kW]`,
    /// plus `bias` `[C_out]` if given: `[N, C_out, H_out, W_out]` with
    /// `H_out = (H + 2 padding - kH) / stride + 1`. As PyTorch's `conv2d` (cross-correlation).
    ///
    /// ```
    /// # fn main() -> wgrad::Result<()> {
    /// use wgrad::{Device, Tensor};
    /// let dev = Device::new()?;
    /// let x = Tensor::ones(&[1, 1, 3, 3], &dev)?;
    /// let w = Tensor::ones(&[1, 1, 2, 2], &dev)?;
    /// let y = x.conv2d(&w, None, 1, 0)?;
    /// assert_eq!(y.shape(), &[1, 1, 2, 2]);
    /// assert_eq!(y.to_vec()?, vec![4.0; 4]);
    /// # Ok(())
    /// # }
    /// ```
    pub fn conv2d(
        &self,
        weight: &Tensor,
        bias: Option<&Tensor>,
        stride: usize,
        padding: usize,
    ) -> Result<Tensor> {
        self.conv2d_with(weight, bias, Conv2dOptions::square(stride, padding))
    }

    /// 1-d convolution of `self` `[N, C_in, L]` with `weight` `[C_out, C_in, k]`, plus `bias`
    /// `[C_out]` if given: `[N, C_out, L_out]`, as PyTorch's `conv1d`.
    pub fn conv1d(
        &self,
        weight: &Tensor,
        bias: Option<&Tensor>,
        stride: usize,
        padding: usize,
    ) -> Result<Tensor> {
        let options = Conv1dOptions {
            stride,
            padding,
            ..Default::default()
        };
        self.conv1d_with(weight, bias, options)
    }

    /// [`Tensor::conv1d`] with dilation and groups: the 2-d convolution of `[N, C_in, 1, L]`
    /// with a `1 x k` kernel.
    pub fn conv1d_with(
        &self,
        weight: &Tensor,
        bias: Option<&Tensor>,
        options: Conv1dOptions,
    ) -> Result<Tensor> {
        if self.rank() != 3 || weight.rank() != 3 {
            return Err(Error::Shape {
                op: "conv1d",
                msg: format!(
                    "needs input [N, C, L] and weight [C_out, C_in / groups, k], got {:?} and {:?}",
                    self.shape(),
                    weight.shape()
                ),
            });
        }
        self.unsqueeze(2)?
            .conv2d_with(&weight.unsqueeze(2)?, bias, options.as_2d())
            .map_err(|e| {
                let inputs = format!(
                    "input {:?} and weight {:?} as a 2-d convolution",
                    self.shape(),
                    weight.shape()
                );
                e.into_error_of("conv1d", inputs)
            })?
            .squeeze(2)
    }

    /// [`Tensor::conv2d`] with dilation and groups too: `weight` is
    /// `[C_out, C_in / groups, kH, kW]`, and each group of `C_out / groups` output channels
    /// sees only its group of input channels.
    pub fn conv2d_with(
        &self,
        weight: &Tensor,
        bias: Option<&Tensor>,
        options: Conv2dOptions,
    ) -> Result<Tensor> {
        let inputs = [Some(self), Some(weight), bias];
        if let Some(out) = in_f32("conv2d", &inputs, |w| {
            let (x, weight) = (w[0].as_ref().expect("given"), w[1].as_ref().expect("given"));
            x.conv2d_with(weight, w[2].as_ref(), options)
        })? {
            return Ok(out);
        }
        let geo = geometry(self, weight, &options)?;
        check_bias("conv2d", self, weight, bias, weight.shape()[0])?;
        let out = by_groups(options.groups, |g| match options.groups {
            1 => conv_group("conv2d", Direction::Forward, self, weight, geo),
            _ => {
                let x = self.narrow(1, g * geo.cols.c_in, geo.cols.c_in)?;
                let w = weight.narrow(0, g * geo.c_out, geo.c_out)?;
                conv_group("conv2d", Direction::Forward, &x, &w, geo)
            }
        })?;
        add_bias(out, bias)
    }

    /// The transposed 2-d convolution of `self` `[N, C_in, H, W]` with `weight`
    /// `[C_in, C_out / groups, kH, kW]` (PyTorch's layout), plus `bias` `[C_out]` if given:
    /// `[N, C_out, H_out, W_out]` with
    /// `H_out = (H - 1) stride - 2 padding + dilation (kH - 1) + output_padding + 1`, as
    /// PyTorch's `conv_transpose2d` (the input grad of a convolution, so a U-Net's up block
    /// undoes a stride-2 down block's size). It runs the convolution's kernels: col2im
    /// forward, im2col and the GEMMs backward.
    ///
    /// ```
    /// # fn main() -> wgrad::Result<()> {
    /// use wgrad::{ConvTranspose2dOptions, Device, Tensor};
    /// let dev = Device::new()?;
    /// let x = Tensor::ones(&[1, 4, 8, 8], &dev)?;
    /// let w = Tensor::ones(&[4, 2, 3, 3], &dev)?;
    /// let o = ConvTranspose2dOptions { stride: 2, padding: 1, output_padding: 1, ..Default::default() };
    /// assert_eq!(x.conv_transpose2d(&w, None, &o)?.shape(), &[1, 2, 16, 16]);
    /// # Ok(())
    /// # }
    /// ```
    pub fn conv_transpose2d(
        &self,
        weight: &Tensor,
        bias: Option<&Tensor>,
        options: &ConvTranspose2dOptions,
    ) -> Result<Tensor> {
        let inputs = [Some(self), Some(weight), bias];
        if let Some(out) = in_f32("conv_transpose2d", &inputs, |w| {
            let (x, weight) = (w[0].as_ref().expect("given"), w[1].as_ref().expect("given"));
            x.conv_transpose2d(weight, w[2].as_ref(), options)
        })? {
            return Ok(out);
        }
        let geo = transpose_geometry(self, weight, options)?;
        let c_out = geo.cols.c_in * options.groups;
        check_bias("conv_transpose2d", self, weight, bias, c_out)?;
        let out = by_groups(options.groups, |g| match options.groups {
            1 => conv_group("conv_transpose2d", Direction::Transposed, self, weight, geo),
            _ => {
                let x = self.narrow(1, g * geo.c_out, geo.c_out)?;
                let w = weight.narrow(0, g * geo.c_out, geo.c_out)?;
                conv_group("conv_transpose2d", Direction::Transposed, &x, &w, geo)
            }
        })?;
        add_bias(out, bias)
    }
}
