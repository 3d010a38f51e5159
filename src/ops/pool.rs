//! 2-d max and average pooling (NCHW, no padding) and their backward passes
//! (`shaders/pool.wgsl`). Max pooling keeps each window's arg-max (the first maximum in
//! row-major window order, as PyTorch) for its backward. Adaptive pooling and resampling
//! (`interpolate`) are separable: two products with `[out, in]` weight matrices, one per axis,
//! whose grads come through the products.

use crate::error::{Error, Result};
use crate::kernel::{
    groups, rows_per_window, Kernel, KernelParams, Launch, ShaderFamily, MAX_LOOP_LEN, WORKGROUP,
};
use crate::ops::{check_window_params, too_large_view};
use crate::tensor::grad_mode::NoGradGuard;
use crate::tensor::graph::record;
use crate::tensor::{checked_numel, DType, Tensor};

crate::kernel_params! {
    /// `n` counts the entry's invocations: runs of `segment` elements of a row (`segments`
    /// runs per row) of the output forward and where windows tile the input backward, else of
    /// the input backward. Planes are
    /// `height x width` in, `out_h x out_w` out. Each bound tensor starts its offset's
    /// elements into its binding.
    pub(crate) struct PoolParams {
        n: u32,
        src_offset: u32,
        dst_offset: u32,
        argmax_offset: u32,
        height: u32,
        width: u32,
        out_h: u32,
        out_w: u32,
        kernel: u32,
        stride: u32,
        segment: u32,
        segments: u32,
    }
}

static POOL: ShaderFamily = ShaderFamily {
    name: "pool",
    wgsl: include_str!("../../shaders/pool.wgsl"),
    params: &[&PoolParams::LAYOUT],
    preludes: &[],
};

#[cfg(test)]
pub(crate) fn kernel_sources() -> Vec<(String, String)> {
    vec![("pool".into(), POOL.source(&[]))]
}

/// Max or average.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Pool {
    Max,
    Avg,
}

impl Pool {
    fn name(self) -> &'static str {
        match self {
            Pool::Max => "max_pool2d",
            Pool::Avg => "avg_pool2d",
        }
    }
}

/// The params of a pass over `x` `[N, C, H, W]`; `n` is set by the caller.
fn pool_params(op: &'static str, x: &Tensor, kernel: usize, stride: usize) -> Result<PoolParams> {
    x.expect_dtype(op, DType::F32)?;
    if x.rank() != 4 {
        return Err(Error::Shape {
            op,
            msg: format!("needs input [N, C, H, W], got {:?}", x.shape()),
        });
    }
    if kernel == 0 || stride == 0 {
        return Err(Error::InvalidArgument {
            op,
            msg: format!("kernel ({kernel}) and stride ({stride}) must be >= 1"),
        });
    }
    check_window_params(op, &[("kernel", kernel), ("stride", stride)])?;
    let (height, width) = (x.shape()[2], x.shape()[3]);
    if kernel > height || kernel > width {
        return Err(Error::Shape {
            op,
            msg: format!(
                "kernel {kernel}x{kernel} does not fit input {:?}",
                x.shape()
            ),
        });
    }
    Ok(PoolParams {
        n: 0,
        src_offset: 0,
        dst_offset: 0,
        argmax_offset: 0,
        height: height as u32,
        width: width as u32,
        out_h: ((height - kernel) / stride + 1) as u32,
        out_w: ((width - kernel) / stride + 1) as u32,
        kernel: kernel as u32,
        stride: stride as u32,
        segment: 0,
        segments: 0,
    })
}

/// `params` for a pass whose invocations each cover a run of at most [`RUN_LEN`] elements of a
/// row of `row_len`, each element costing `loops` loop iterations (a forward output reads
/// `k * k` taps; a backward input element visits at most `ceil(k / s)` squared windows): runs
/// shorten so that an invocation's loops stay within [`MAX_LOOP_LEN`]. Returns the params and
/// the number of runs over a plane's `rows` rows.
fn in_runs(params: PoolParams, rows: usize, row_len: usize, loops: usize) -> (PoolParams, usize) {
    let segment = (MAX_LOOP_LEN / loops.max(1)).clamp(1, RUN_LEN);
    let segments = row_len.div_ceil(segment);
    let params = PoolParams {
        segment: segment as u32,
        segments: segments as u32,
        ..params
    };
    (params, rows * segments)
}

/// Elements of a row one invocation covers: the divisions that place a run are paid once per
/// 64 elements.
const RUN_LEN: usize = 64;

/// Runs `entry` from `src` (any layout) into `dst` (`[N, C, ..]`), `per_plane` invocations
/// per plane (see `PoolParams`); max pooling's arg-max is bound beside them. Planes are
/// independent: where a tensor is past one binding, each launch binds windows of whole
/// planes (a ResNet's first pool at 224 pixels and batch 64 reads 205 MB).
fn run(
    kind: Pool,
    entry: &'static str,
    src: &Tensor,
    dst: &Tensor,
    argmax: Option<&Tensor>,
    params: PoolParams,
    per_plane: usize,
) -> Result<()> {
    if dst.numel() == 0 {
        return Ok(());
    }
    let src = src.contiguous()?;
    let planes = dst.shape()[0] * dst.shape()[1];
    let tensors: Vec<&Tensor> = [Some(&src), Some(dst), argmax]
        .into_iter()
        .flatten()
        .collect();
    let per_window = match tensors.iter().find(|t| t.exceeds_binding()) {
        None => planes,
        Some(large) => {
            let per = tensors
                .iter()
                .map(|t| rows_per_window(dst.device(), t.numel() / planes))
                .min()
                .unwrap_or(0);
            if per == 0 {
                return Err(too_large_view(kind.name(), large));
            }
            per
        }
    };
    let kernel = Kernel::plain(&POOL, entry);
    for first in (0..planes).step_by(per_window) {
        let count = per_window.min(planes - first);
        let part = |t: &Tensor| match per_window == planes {
            true => t.clone(),
            false => {
                let plane = t.numel() / planes;
                t.window(first * plane, count * plane)
            }
        };
        let (src, dst, argmax) = (part(&src), part(dst), argmax.map(part));
        let n = count * per_plane;
        let params = PoolParams {
            n: n as u32,
            src_offset: src.layout().offset as u32,
            dst_offset: dst.layout().offset as u32,
            argmax_offset: argmax.as_ref().map_or(0, |a| a.layout().offset as u32),
            ..params
        };
        let mut bound = vec![(1, &src), (2, &dst)];
        bound.extend(argmax.as_ref().map(|a| (3, a)));
        Launch::new(kind.name(), &kernel, &bound, &params).record(groups(n, WORKGROUP))?;
    }
    Ok(())
}

fn pool(x: &Tensor, kind: Pool, kernel: usize, stride: usize) -> Result<Tensor> {
    if x.dtype().is_16_bit() {
        // In f32 through recorded casts, the result in the input's dtype.
        return pool(&x.to_dtype(DType::F32)?, kind, kernel, stride)?.to_dtype(x.dtype());
    }
    let op = kind.name();
    let params = pool_params(op, x, kernel, stride)?;
    let shape = [
        x.shape()[0],
        x.shape()[1],
        params.out_h as usize,
        params.out_w as usize,
    ];
    let out = Tensor::empty(op, &shape, DType::F32, x.device())?;
    let argmax = match kind {
        Pool::Max => Some(Tensor::empty(op, &shape, DType::U32, x.device())?),
        Pool::Avg => None,
    };
    let entry = match kind {
        Pool::Max => "max_forward",
        Pool::Avg => "avg_forward",
    };
    let (forward, runs) = in_runs(params, shape[2], shape[3], kernel * kernel);
    run(kind, entry, x, &out, argmax.as_ref(), forward, runs)?;
    Ok(record(op, out, &[x], |_| {
        let in_shape = x.shape().to_vec();
        move |g: &Tensor| {
            let grad = Tensor::empty(op, &in_shape, DType::F32, g.device())?;
            // Windows that tile the input: each run of outputs writes its windows whole, as
            // the forward reads them.
            let tiles = stride == kernel
                && in_shape[2].is_multiple_of(kernel)
                && in_shape[3].is_multiple_of(kernel);
            let (entry, backward, runs) = match (kind, tiles) {
                (Pool::Max, true) => ("max_backward_tiles", forward, runs),
                (Pool::Avg, true) => ("avg_backward_tiles", forward, runs),
                (_, false) => {
                    let (backward, runs) = in_runs(
                        params,
                        in_shape[2],
                        in_shape[3],
                        kernel.div_ceil(stride).pow(2),
                    );
                    let entry = match kind {
                        Pool::Max => "max_backward",
                        Pool::Avg => "avg_backward",
                    };
                    (entry, backward, runs)
                }
            };
            run(kind, entry, g, &grad, argmax.as_ref(), backward, runs)?;
            Ok(vec![Some(grad)])
        }
    }))
}

/// A 2-d pooling's window, as PyTorch's `MaxPool2d`/`AvgPool2d` arguments.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pool2dOptions {
    /// Window side.
    pub kernel: usize,
    /// Step between windows.
    pub stride: usize,
    /// Implicit padding on every side (at most half the kernel, as torch): `-inf` for max
    /// pooling, zeros for average pooling.
    pub padding: usize,
    /// Output sides rounded up, so that a last partial window counts (it must start inside
    /// the input or its left padding, as torch).
    pub ceil_mode: bool,
    /// Average pooling divides by the whole window, padding included (torch's default), or
    /// by the input elements it covers.
    pub count_include_pad: bool,
}

impl Pool2dOptions {
    /// `kernel x kernel` windows every `stride`, no padding, floor mode.
    pub fn new(kernel: usize, stride: usize) -> Pool2dOptions {
        Pool2dOptions {
            kernel,
            stride,
            padding: 0,
            ceil_mode: false,
            count_include_pad: true,
        }
    }

    /// The output side for an input side of `size`, as torch computes it.
    fn out_len(&self, size: usize) -> usize {
        let span = size + 2 * self.padding - self.kernel;
        let mut out = match self.ceil_mode {
            true => span.div_ceil(self.stride) + 1,
            false => span / self.stride + 1,
        };
        // The last window must start inside the input or its left padding.
        if self.ceil_mode && (out - 1) * self.stride >= size + self.padding {
            out -= 1;
        }
        out
    }
}

/// Pooling with padding or ceil mode as the plain kernels over a padded input: `x` padded by
/// `padding` before and what the last window needs after (filled with `fill`), then pooled.
fn padded_pool(x: &Tensor, kind: Pool, o: &Pool2dOptions) -> Result<Tensor> {
    if x.dtype().is_16_bit() {
        return padded_pool(&x.to_dtype(DType::F32)?, kind, o)?.to_dtype(x.dtype());
    }
    let op = kind.name();
    if x.rank() != 4 {
        return Err(Error::Shape {
            op,
            msg: format!("needs input [N, C, H, W], got {:?}", x.shape()),
        });
    }
    let (h, w) = (x.shape()[2], x.shape()[3]);
    if o.kernel == 0 || o.stride == 0 || o.padding > o.kernel / 2 {
        return Err(Error::InvalidArgument {
            op,
            msg: format!(
                "needs kernel and stride >= 1 and padding at most half the kernel, got {o:?} \
                 for input {:?}",
                x.shape()
            ),
        });
    }
    // The padding is at most half the kernel, so below the bound neither sum overflows.
    check_window_params(op, &[("kernel", o.kernel), ("stride", o.stride)])?;
    if h + 2 * o.padding < o.kernel || w + 2 * o.padding < o.kernel {
        return Err(Error::Shape {
            op,
            msg: format!("{o:?} does not fit input {:?}", x.shape()),
        });
    }
    let (out_h, out_w) = (o.out_len(h), o.out_len(w));
    // What the last window reaches past the input, beyond the padding.
    let after = |size: usize, out: usize| {
        ((out - 1) * o.stride + o.kernel).saturating_sub(size + o.padding)
    };
    let (bottom, right) = (after(h, out_h), after(w, out_w));
    let sides = (o.padding, right, o.padding, bottom);
    let fill = match kind {
        Pool::Max => f32::NEG_INFINITY,
        Pool::Avg => 0.0,
    };
    let pooled = match sides {
        (0, 0, 0, 0) => pool(x, kind, o.kernel, o.stride)?,
        _ => pool(&x.pad2d(sides, fill)?, kind, o.kernel, o.stride)?,
    };
    // Windows that end inside the padding count every tap, as the plain kernel divides.
    let counts_every_tap = o.count_include_pad && bottom <= o.padding && right <= o.padding;
    if kind == Pool::Max || counts_every_tap {
        return Ok(pooled);
    }
    // Average pooling divides by the taps that count: the input's (and the padding's, with
    // count_include_pad), never the ceil mode's overhang: the average of a 0/1 map of them
    // over the padded input.
    let counted = {
        let _no_grad = NoGradGuard::new();
        let (total_h, total_w) = (o.padding + h + bottom, o.padding + w + right);
        let (first, count_h, count_w) = match o.count_include_pad {
            true => (
                0,
                total_h.min(h + 2 * o.padding),
                total_w.min(w + 2 * o.padding),
            ),
            false => (o.padding, h, w),
        };
        let ones = Tensor::ones(&[1, 1, count_h, count_w], x.device())?;
        let sides = (
            first,
            total_w - first - count_w,
            first,
            total_h - first - count_h,
        );
        pool(&ones.pad2d(sides, 0.0)?, Pool::Avg, o.kernel, o.stride)?
    };
    pooled.div(&counted)
}

impl Tensor {
    /// 2-d max pooling of `[N, C, H, W]` over `kernel x kernel` windows every `stride`
    /// (no padding): `[N, C, (H - kernel) / stride + 1, ..]`. The grad goes to each window's
    /// first maximum; NaN counts as a maximum, so it propagates.
    pub fn max_pool2d(&self, kernel: usize, stride: usize) -> Result<Tensor> {
        pool(self, Pool::Max, kernel, stride)
    }

    /// 2-d average pooling of `[N, C, H, W]` over `kernel x kernel` windows every `stride`
    /// (no padding). The grad is spread evenly over each window.
    pub fn avg_pool2d(&self, kernel: usize, stride: usize) -> Result<Tensor> {
        pool(self, Pool::Avg, kernel, stride)
    }

    /// Max pooling with torch's padding (`-inf`) and ceil mode, as `F.max_pool2d`: a
    /// ResNet's stem pools `3x3` windows every 2 with padding 1.
    ///
    /// ```
    /// # fn main() -> wgrad::Result<()> {
    /// use wgrad::{Device, Pool2dOptions, Tensor};
    /// let dev = Device::new()?;
    /// let x = Tensor::randn(&[1, 8, 112, 112], 0, &dev)?;
    /// let o = Pool2dOptions { padding: 1, ..Pool2dOptions::new(3, 2) };
    /// assert_eq!(x.max_pool2d_with(&o)?.shape(), &[1, 8, 56, 56]);
    /// # Ok(())
    /// # }
    /// ```
    pub fn max_pool2d_with(&self, options: &Pool2dOptions) -> Result<Tensor> {
        padded_pool(self, Pool::Max, options)
    }

    /// Average pooling with torch's padding (zeros), ceil mode and `count_include_pad`, as
    /// `F.avg_pool2d`.
    pub fn avg_pool2d_with(&self, options: &Pool2dOptions) -> Result<Tensor> {
        padded_pool(self, Pool::Avg, options)
    }
}

/// The sides `(H, W)` of NCHW images `x` to be resampled to `out`: an error unless both and
/// `out` are nonzero.
fn image_sides(
    op: &'static str,
    x: &Tensor,
    (out_h, out_w): (usize, usize),
) -> Result<(usize, usize)> {
    let [_, _, h, w] = *x.shape() else {
        return Err(Error::Shape {
            op,
            msg: format!("needs NCHW images, got {:?}", x.shape()),
        });
    };
    if out_h == 0 || out_w == 0 || h == 0 || w == 0 {
        return Err(Error::Shape {
            op,
            msg: format!(
                "needs nonzero image and output sizes, got input {:?} and output ({out_h}, {out_w})",
                x.shape()
            ),
        });
    }
    // The output and the per-axis weight matrices (made on the host) must fit the device.
    let out_shape = [x.shape()[0], x.shape()[1], out_h, out_w];
    for shape in [&out_shape[..], &[out_h, h], &[out_w, w]] {
        let bytes = checked_numel(op, shape)? as u64 * 4;
        let limit = x.device().max_tensor_bytes();
        if bytes > limit {
            return Err(Error::TooLarge { op, bytes, limit });
        }
    }
    Ok((h, w))
}

/// `[out, size]`: row `i` averages input positions `floor(i size / out) .. ceil((i + 1) size /
/// out)`, PyTorch's adaptive pooling bins.
fn adaptive_bins(out: usize, size: usize, device: &crate::device::Device) -> Result<Tensor> {
    let mut weights = vec![0.0f32; out * size];
    for i in 0..out {
        let (start, end) = (i * size / out, ((i + 1) * size).div_ceil(out));
        for w in &mut weights[i * size + start..i * size + end] {
            *w = 1.0 / (end - start) as f32;
        }
    }
    Tensor::from_vec(weights, &[out, size], device)
}

impl Tensor {
    /// Average pooling of NCHW images to `(out_h, out_w)` whatever their size, as torch's
    /// `adaptive_avg_pool2d` (`(1, 1)`: global average pooling). A bin's average is a row
    /// average then a column average, so it runs as two products with bin matrices; grads come
    /// through them.
    pub fn adaptive_avg_pool2d(&self, (out_h, out_w): (usize, usize)) -> Result<Tensor> {
        let (h, w) = image_sides("adaptive_avg_pool2d", self, (out_h, out_w))?;
        // The bins in the images' dtype (16-bit images stay 16-bit).
        let rows = adaptive_bins(out_h, h, self.device())?.to_dtype(self.dtype())?;
        let cols = adaptive_bins(out_w, w, self.device())?.to_dtype(self.dtype())?;
        rows.matmul(self)?.matmul(&cols.t()?)
    }
}

/// How [`Tensor::interpolate`] resamples, as torch's `mode`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Interpolate {
    /// Each output pixel copies input pixel `floor(i in / out)` (torch's `"nearest"`).
    Nearest,
    /// Linear in each axis between the two nearest input pixels, `align_corners=False`
    /// (torch's `"bilinear"`).
    Bilinear,
}

/// `[out, size]`: row `i` holds the weights output position `i` takes from each input
/// position, as torch computes them (scale `size / out` in f32).
fn resample_weights(
    mode: Interpolate,
    out: usize,
    size: usize,
    device: &crate::device::Device,
) -> Result<Tensor> {
    let scale = size as f32 / out as f32;
    let mut weights = vec![0.0f32; out * size];
    for i in 0..out {
        let row = &mut weights[i * size..(i + 1) * size];
        match mode {
            Interpolate::Nearest => {
                row[((i as f32 * scale).floor() as usize).min(size - 1)] = 1.0;
            }
            Interpolate::Bilinear => {
                let src = ((i as f32 + 0.5) * scale - 0.5).max(0.0);
                let lo = (src.floor() as usize).min(size - 1);
                let hi = (lo + 1).min(size - 1);
                let t = src - lo as f32;
                row[lo] += 1.0 - t;
                row[hi] += t;
            }
        }
    }
    Tensor::from_vec(weights, &[out, size], device)
}

impl Tensor {
    /// NCHW images resampled to `(out_h, out_w)`, as torch's `interpolate(size=..., mode=...)`
    /// (bilinear with `align_corners=False`). Two products with per-axis weight matrices;
    /// grads come through them.
    ///
    /// ```
    /// # fn main() -> wgrad::Result<()> {
    /// use wgrad::{Device, Interpolate, Tensor};
    /// let dev = Device::new()?;
    /// let x = Tensor::from_vec(vec![1.0, 2.0, 3.0, 4.0], &[1, 1, 2, 2], &dev)?;
    /// let up = x.interpolate((4, 4), Interpolate::Nearest)?;
    /// assert_eq!(&up.to_vec()?[..4], &[1.0, 1.0, 2.0, 2.0]);
    /// # Ok(())
    /// # }
    /// ```
    pub fn interpolate(&self, (out_h, out_w): (usize, usize), mode: Interpolate) -> Result<Tensor> {
        let (h, w) = image_sides("interpolate", self, (out_h, out_w))?;
        let rows = resample_weights(mode, out_h, h, self.device())?.to_dtype(self.dtype())?;
        let cols = resample_weights(mode, out_w, w, self.device())?.to_dtype(self.dtype())?;
        rows.matmul(self)?.matmul(&cols.t()?)
    }
}
