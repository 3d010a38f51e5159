//! 2-d convolution (NCHW) forward and backward, each an implicit GEMM (`shaders/conv.wgsl`):
//! the kernel reads images, weights and grads through index maps, so no im2col matrix is
//! stored. Bias is a broadcast add; groups are one convolution per channel group.

use crate::error::{Error, Result};
use crate::kernel::{launch, Kernel, KernelParams, ShaderFamily};
use crate::tensor::graph::record;
use crate::tensor::{DType, Tensor};

crate::kernel_params! {
    /// One implicit GEMM `[m, k] x [k, n]` of a convolution of `batch` images of
    /// `c_in x height x width` with `c_out` kernels of `kernel_h x kernel_w`, giving
    /// `out_h x out_w` maps. `k` is split into `chunks` of `k_chunk` steps.
    pub(crate) struct ConvParams {
        batch: u32,
        c_in: u32,
        height: u32,
        width: u32,
        c_out: u32,
        kernel_h: u32,
        kernel_w: u32,
        out_h: u32,
        out_w: u32,
        stride: u32,
        padding: u32,
        dilation: u32,
        m: u32,
        n: u32,
        k: u32,
        k_chunk: u32,
        chunks: u32,
        tiles_n: u32,
        lhs_offset: u32,
        rhs_offset: u32,
    }
}

static CONV: ShaderFamily = ShaderFamily {
    name: "conv",
    wgsl: include_str!("../../shaders/conv.wgsl"),
    params: &[&ConvParams::LAYOUT],
};

/// Steps of k one invocation runs at most: well under llvmpipe's 65,535 loop iterations.
const K_CHUNK: usize = 4096;

/// Invocations per workgroup of `implicit_gemm`.
const GEMM_WORKGROUP: usize = 64;

/// The three GEMMs of a convolution (see `shaders/conv.wgsl`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Gemm {
    Forward,
    InputGrad,
    WeightGrad,
}

impl Gemm {
    #[cfg(test)]
    const ALL: [Gemm; 3] = [Gemm::Forward, Gemm::InputGrad, Gemm::WeightGrad];

    fn mode(self) -> &'static str {
        match self {
            Gemm::Forward => "forward",
            Gemm::InputGrad => "input_grad",
            Gemm::WeightGrad => "weight_grad",
        }
    }

    fn source(self) -> String {
        CONV.source(&[("CONV_MODE", self.mode())])
    }
}

#[cfg(test)]
pub(crate) fn kernel_sources() -> Vec<(String, String)> {
    Gemm::ALL
        .iter()
        .map(|g| (format!("conv/{}", g.mode()), g.source()))
        .collect()
}

/// Stride, padding, dilation and groups of a convolution, with PyTorch's defaults.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Conv2dOptions {
    /// Step between windows, in both directions (>= 1).
    pub stride: usize,
    /// Zeros added on every side of each image.
    pub padding: usize,
    /// Step between kernel taps (>= 1).
    pub dilation: usize,
    /// Channel groups: input and output channels split into this many independent parts.
    pub groups: usize,
}

impl Default for Conv2dOptions {
    fn default() -> Self {
        Conv2dOptions {
            stride: 1,
            padding: 0,
            dilation: 1,
            groups: 1,
        }
    }
}

/// The sizes of one convolution (of one channel group).
#[derive(Debug, Clone, Copy)]
struct Geometry {
    batch: usize,
    c_in: usize,
    height: usize,
    width: usize,
    c_out: usize,
    kernel_h: usize,
    kernel_w: usize,
    out_h: usize,
    out_w: usize,
    stride: usize,
    padding: usize,
    dilation: usize,
}

impl Geometry {
    /// `(m, n, k)` of one of the convolution's GEMMs.
    fn gemm_shape(&self, gemm: Gemm) -> (usize, usize, usize) {
        let taps = self.kernel_h * self.kernel_w;
        let out_pixels = self.batch * self.out_h * self.out_w;
        match gemm {
            Gemm::Forward => (self.c_out, out_pixels, self.c_in * taps),
            Gemm::InputGrad => (
                self.c_in,
                self.batch * self.height * self.width,
                self.c_out * taps,
            ),
            Gemm::WeightGrad => (self.c_out, self.c_in * taps, out_pixels),
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
    if stride == 0 || dilation == 0 || groups == 0 {
        return Err(Error::InvalidArgument {
            op: OP,
            msg: format!(
                "stride ({stride}), dilation ({dilation}) and groups ({groups}) must be >= 1"
            ),
        });
    }
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
    let span = |k: usize| dilation * (k.max(1) - 1) + 1;
    let (padded_h, padded_w) = (height + 2 * padding, width + 2 * padding);
    if kernel_h == 0 || kernel_w == 0 || span(kernel_h) > padded_h || span(kernel_w) > padded_w {
        return Err(shape_error(format!(
            "kernel {kernel_h}x{kernel_w} (dilation {dilation}) does not fit the padded input \
             {padded_h}x{padded_w} of input {:?}",
            x.shape()
        )));
    }
    Ok(Geometry {
        batch,
        c_in: c_in_group,
        height,
        width,
        c_out: c_out / groups,
        kernel_h,
        kernel_w,
        out_h: (padded_h - span(kernel_h)) / stride + 1,
        out_w: (padded_w - span(kernel_w)) / stride + 1,
        stride,
        padding,
        dilation,
    })
}

/// Runs one GEMM of the convolution: `lhs` is A's tensor and `rhs` B's (both contiguous), the
/// result has `out_shape`. Long k is split into chunks whose partial sums are then added.
fn implicit_gemm(
    gemm: Gemm,
    geo: &Geometry,
    lhs: &Tensor,
    rhs: &Tensor,
    out_shape: &[usize],
) -> Result<Tensor> {
    const OP: &str = "conv2d";
    let (m, n, k) = geo.gemm_shape(gemm);
    let numel: usize = out_shape.iter().product();
    if numel == 0 || k == 0 {
        return Tensor::zeros(out_shape, lhs.device());
    }
    let (lhs, rhs) = (lhs.contiguous()?, rhs.contiguous()?);
    let chunks = k.div_ceil(K_CHUNK);
    let out = Tensor::empty(OP, &[chunks, numel], DType::F32, lhs.device())?;
    let tiles_n = n.div_ceil(4);
    let invocations = tiles_n * m.div_ceil(4) * chunks;
    let params = ConvParams {
        batch: geo.batch as u32,
        c_in: geo.c_in as u32,
        height: geo.height as u32,
        width: geo.width as u32,
        c_out: geo.c_out as u32,
        kernel_h: geo.kernel_h as u32,
        kernel_w: geo.kernel_w as u32,
        out_h: geo.out_h as u32,
        out_w: geo.out_w as u32,
        stride: geo.stride as u32,
        padding: geo.padding as u32,
        dilation: geo.dilation as u32,
        m: m as u32,
        n: n as u32,
        k: k as u32,
        k_chunk: K_CHUNK as u32,
        chunks: chunks as u32,
        tiles_n: tiles_n as u32,
        lhs_offset: lhs.layout().offset as u32,
        rhs_offset: rhs.layout().offset as u32,
    };
    let source = || gemm.source();
    let kernel = Kernel::specialised(&CONV, "implicit_gemm", gemm.mode(), &source);
    let workgroups = invocations.div_ceil(GEMM_WORKGROUP) as u32;
    launch(OP, &kernel, &[&lhs, &rhs, &out], &params, workgroups)?;
    let summed = if chunks == 1 {
        out
    } else {
        out.sum_dims(&[0], false)?
    };
    summed.reshape(out_shape)
}

/// One group's convolution (no bias), recorded with its backward to input and weight.
fn conv_group(x: &Tensor, w: &Tensor, geo: Geometry) -> Result<Tensor> {
    let out_shape = [geo.batch, geo.c_out, geo.out_h, geo.out_w];
    let out = implicit_gemm(Gemm::Forward, &geo, w, x, &out_shape)?;
    Ok(record("conv2d", out, &[x, w], |_| {
        let (need_x, need_w) = (x.requires_grad(), w.requires_grad());
        let (x, w) = (x.detach(), w.detach());
        let (x_shape, w_shape) = (x.shape().to_vec(), w.shape().to_vec());
        move |g: &Tensor| {
            let grad_x = match need_x {
                true => Some(implicit_gemm(Gemm::InputGrad, &geo, &w, g, &x_shape)?),
                false => None,
            };
            let grad_w = match need_w {
                true => Some(implicit_gemm(Gemm::WeightGrad, &geo, g, &x, &w_shape)?),
                false => None,
            };
            Ok(vec![grad_x, grad_w])
        }
    }))
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
        let options = Conv2dOptions {
            stride,
            padding,
            ..Default::default()
        };
        self.conv2d_with(weight, bias, options)
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
        let geo = geometry(self, weight, &options)?;
        let c_out = weight.shape()[0];
        if let Some(b) = bias {
            self.expect_same_device("conv2d", b)?;
            if b.shape() != [c_out] {
                return Err(Error::Shape {
                    op: "conv2d",
                    msg: format!(
                        "bias of shape {:?} for a weight of shape {:?} (needs [{c_out}])",
                        b.shape(),
                        weight.shape()
                    ),
                });
            }
        }
        let out = if options.groups == 1 {
            conv_group(self, weight, geo)?
        } else {
            let parts = (0..options.groups)
                .map(|g| {
                    let x = self.narrow(1, g * geo.c_in, geo.c_in)?;
                    let w = weight.narrow(0, g * geo.c_out, geo.c_out)?;
                    conv_group(&x, &w, geo)
                })
                .collect::<Result<Vec<_>>>()?;
            Tensor::cat(&parts, 1)?
        };
        match bias {
            Some(b) => out.add(&b.reshape(&[c_out, 1, 1])?),
            None => Ok(out),
        }
    }
}
