//! Image and sequence layers: `Conv2d`, `ConvTranspose2d`, `Conv1d`, `MaxPool2d`,
//! `AvgPool2d`, `Upsample` and `Flatten`.

use crate::device::Device;
use crate::error::{Error, Result};
use crate::nn::linear::uniform_parameter;
use crate::nn::Module;
use crate::ops::conv::{Conv1dOptions, Conv2dOptions, ConvTranspose2dOptions};
use crate::ops::pool::{Interpolate, Pool2dOptions};
use crate::tensor::Tensor;

/// A 2-d convolution over `[N, C_in, H, W]`: weight `[C_out, C_in / groups, kH, kW]`, bias
/// `[C_out]` when it has one.
///
/// Initialised as PyTorch does: weight and bias uniform in `[-1/sqrt(fan_in), 1/sqrt(fan_in)]`
/// with `fan_in = C_in / groups kH kW`, from the global seed ([`crate::manual_seed`]).
///
/// ```
/// # fn main() -> wgrad::Result<()> {
/// use wgrad::{nn::{self, Module}, Conv2dOptions, Device, Tensor};
/// let dev = Device::new()?;
/// let conv = nn::Conv2d::new(1, 8, 3, 1, 1, &dev)?;
/// let y = conv.forward(&Tensor::ones(&[2, 1, 28, 28], &dev)?)?;
/// assert_eq!(y.shape(), &[2, 8, 28, 28]);
/// // A 1x3 kernel padded along W only, without a bias (a ResNet conv before a BatchNorm).
/// let options = Conv2dOptions { padding: (0, 1), ..Default::default() };
/// let conv = nn::Conv2d::with_options(8, 8, (1, 3), options, false, &dev)?;
/// assert_eq!(conv.forward(&y)?.shape(), &[2, 8, 28, 28]);
/// # Ok(())
/// # }
/// ```
pub struct Conv2d {
    /// `[C_out, C_in / groups, kH, kW]`.
    pub weight: Tensor,
    /// `[C_out]`, or none.
    pub bias: Option<Tensor>,
    /// Stride, padding, dilation and groups.
    pub options: Conv2dOptions,
}

impl Conv2d {
    /// `in_channels -> out_channels` with a square `kernel`, `stride` and `padding`, and a
    /// bias.
    pub fn new(
        in_channels: usize,
        out_channels: usize,
        kernel: usize,
        stride: usize,
        padding: usize,
        device: &Device,
    ) -> Result<Conv2d> {
        let options = Conv2dOptions::square(stride, padding);
        Conv2d::with_options(
            in_channels,
            out_channels,
            (kernel, kernel),
            options,
            true,
            device,
        )
    }

    /// `in_channels -> out_channels` with a `(kH, kW)` kernel, any [`Conv2dOptions`] and a
    /// bias or none, as PyTorch's `Conv2d(.., bias=False)`.
    pub fn with_options(
        in_channels: usize,
        out_channels: usize,
        (kernel_h, kernel_w): (usize, usize),
        options: Conv2dOptions,
        bias: bool,
        device: &Device,
    ) -> Result<Conv2d> {
        let strides_positive = options.stride.0 > 0 && options.stride.1 > 0;
        let shape = [kernel_h, kernel_w];
        let (weight, bias) = conv_parameters(
            "Conv2d::new",
            (in_channels, out_channels, options.groups),
            &shape,
            strides_positive,
            bias,
            device,
        )?;
        Ok(Conv2d {
            weight,
            bias,
            options,
        })
    }
}

impl Module for Conv2d {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        x.conv2d_with(&self.weight, self.bias.as_ref(), self.options)
    }

    fn named_parameters(&self) -> Vec<(String, Tensor)> {
        weight_and_bias(&self.weight, self.bias.as_ref())
    }
}

/// `"weight"` and, when there is one, `"bias"`: a convolution's parameters.
fn weight_and_bias(weight: &Tensor, bias: Option<&Tensor>) -> Vec<(String, Tensor)> {
    let mut params = vec![("weight".to_string(), weight.clone())];
    params.extend(bias.map(|b| ("bias".to_string(), b.clone())));
    params
}

/// A convolution's weight `[C_out, C_in / groups, kernel..]` and bias `[C_out]` (when `bias`),
/// uniform in `[-1/sqrt(fan_in), 1/sqrt(fan_in)]` with `fan_in = C_in / groups prod(kernel)`,
/// as PyTorch initialises them; an error unless the sizes fit.
fn conv_parameters(
    op: &'static str,
    (in_channels, out_channels, groups): (usize, usize, usize),
    kernel: &[usize],
    strides_positive: bool,
    bias: bool,
    device: &Device,
) -> Result<(Tensor, Option<Tensor>)> {
    let fits = in_channels > 0
        && out_channels > 0
        && kernel.iter().all(|&k| k > 0)
        && groups > 0
        && in_channels.is_multiple_of(groups)
        && out_channels.is_multiple_of(groups)
        && strides_positive;
    if !fits {
        return Err(Error::InvalidArgument {
            op,
            msg: format!(
                "needs positive channels divisible by the {groups} groups, a positive kernel \
                 and stride, got {in_channels} -> {out_channels}, kernel {kernel:?}"
            ),
        });
    }
    let fan_in = in_channels / groups * kernel.iter().product::<usize>();
    let bound = 1.0 / (fan_in as f32).sqrt();
    let mut shape = vec![out_channels, in_channels / groups];
    shape.extend(kernel);
    let weight = uniform_parameter(&shape, bound, device)?;
    let bias = match bias {
        true => Some(uniform_parameter(&[out_channels], bound, device)?),
        false => None,
    };
    Ok((weight, bias))
}

/// A transposed 2-d convolution over `[N, C_in, H, W]` (a U-Net's or a VAE decoder's
/// upsampling): weight `[C_in, C_out / groups, k, k]` as PyTorch's, bias `[C_out]`, both
/// uniform in `[-1/sqrt(fan_in), 1/sqrt(fan_in)]` with `fan_in = C_out / groups k k`, as
/// PyTorch initialises them.
pub struct ConvTranspose2d {
    /// `[C_in, C_out / groups, k, k]`.
    pub weight: Tensor,
    /// `[C_out]`, or none.
    pub bias: Option<Tensor>,
    /// Stride, padding, output padding, dilation and groups.
    pub options: ConvTranspose2dOptions,
}

impl ConvTranspose2d {
    /// `in_channels -> out_channels` with a square `kernel`, the `options` and a bias or
    /// none.
    pub fn new(
        in_channels: usize,
        out_channels: usize,
        kernel: usize,
        options: ConvTranspose2dOptions,
        bias: bool,
        device: &Device,
    ) -> Result<ConvTranspose2d> {
        // The weight is a convolution's from out_channels to in_channels.
        let (weight, _) = conv_parameters(
            "ConvTranspose2d::new",
            (out_channels, in_channels, options.groups),
            &[kernel, kernel],
            options.stride > 0,
            false,
            device,
        )?;
        let bound = 1.0 / ((out_channels / options.groups * kernel * kernel) as f32).sqrt();
        let bias = match bias {
            true => Some(uniform_parameter(&[out_channels], bound, device)?),
            false => None,
        };
        Ok(ConvTranspose2d {
            weight,
            bias,
            options,
        })
    }
}

impl Module for ConvTranspose2d {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        x.conv_transpose2d(&self.weight, self.bias.as_ref(), &self.options)
    }

    fn named_parameters(&self) -> Vec<(String, Tensor)> {
        weight_and_bias(&self.weight, self.bias.as_ref())
    }
}

/// A 1-d convolution over `[N, C_in, L]` (audio, sequences): weight `[C_out, C_in / groups,
/// k]`, bias `[C_out]` when it has one; initialised as [`Conv2d`].
pub struct Conv1d {
    /// `[C_out, C_in / groups, k]`.
    pub weight: Tensor,
    /// `[C_out]`, or none.
    pub bias: Option<Tensor>,
    /// Stride, padding, dilation and groups.
    pub options: Conv1dOptions,
}

impl Conv1d {
    /// `in_channels -> out_channels` with a `kernel`, `stride` and `padding`, and a bias.
    pub fn new(
        in_channels: usize,
        out_channels: usize,
        kernel: usize,
        stride: usize,
        padding: usize,
        device: &Device,
    ) -> Result<Conv1d> {
        let options = Conv1dOptions {
            stride,
            padding,
            ..Default::default()
        };
        Conv1d::with_options(in_channels, out_channels, kernel, options, true, device)
    }

    /// `in_channels -> out_channels` with any [`Conv1dOptions`] and a bias or none.
    pub fn with_options(
        in_channels: usize,
        out_channels: usize,
        kernel: usize,
        options: Conv1dOptions,
        bias: bool,
        device: &Device,
    ) -> Result<Conv1d> {
        let (weight, bias) = conv_parameters(
            "Conv1d::new",
            (in_channels, out_channels, options.groups),
            &[kernel],
            options.stride > 0,
            bias,
            device,
        )?;
        Ok(Conv1d {
            weight,
            bias,
            options,
        })
    }
}

impl Module for Conv1d {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        x.conv1d_with(&self.weight, self.bias.as_ref(), self.options)
    }

    fn named_parameters(&self) -> Vec<(String, Tensor)> {
        weight_and_bias(&self.weight, self.bias.as_ref())
    }
}

/// Max pooling over `kernel x kernel` windows every `stride` (no parameters), with torch's
/// padding and ceil mode through [`MaxPool2d::with_options`].
#[derive(Debug, Clone, Copy)]
pub struct MaxPool2d {
    /// The window.
    pub options: Pool2dOptions,
}

impl MaxPool2d {
    /// Windows of `kernel x kernel` every `stride`.
    pub fn new(kernel: usize, stride: usize) -> MaxPool2d {
        MaxPool2d::with_options(Pool2dOptions::new(kernel, stride))
    }

    /// Windows with padding or ceil mode.
    pub fn with_options(options: Pool2dOptions) -> MaxPool2d {
        MaxPool2d { options }
    }
}

impl Module for MaxPool2d {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        x.max_pool2d_with(&self.options)
    }
}

/// Average pooling over `kernel x kernel` windows every `stride` (no parameters), with
/// torch's padding, ceil mode and `count_include_pad` through [`AvgPool2d::with_options`].
#[derive(Debug, Clone, Copy)]
pub struct AvgPool2d {
    /// The window.
    pub options: Pool2dOptions,
}

impl AvgPool2d {
    /// Windows of `kernel x kernel` every `stride`.
    pub fn new(kernel: usize, stride: usize) -> AvgPool2d {
        AvgPool2d::with_options(Pool2dOptions::new(kernel, stride))
    }

    /// Windows with padding, ceil mode or `count_include_pad`.
    pub fn with_options(options: Pool2dOptions) -> AvgPool2d {
        AvgPool2d { options }
    }
}

impl Module for AvgPool2d {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        x.avg_pool2d_with(&self.options)
    }
}

/// `[N, ...] -> [N, product of the rest]`, as between convolutions and a classifier.
#[derive(Debug, Clone, Copy, Default)]
pub struct Flatten;

impl Module for Flatten {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        x.flatten(1)
    }
}

/// Resamples NCHW images by an integer factor or to a size, as torch's `nn.Upsample` (no
/// parameters): the U-Net decoder's upsampling.
#[derive(Debug, Clone, Copy)]
pub struct Upsample {
    /// Output `(height, width)`; `None` scales by `scale_factor`.
    pub size: Option<(usize, usize)>,
    /// Output sides are the input's times this (when `size` is `None`).
    pub scale_factor: usize,
    /// Nearest or bilinear.
    pub mode: Interpolate,
}

impl Upsample {
    /// Images scaled by `scale_factor` in both directions.
    pub fn new(scale_factor: usize, mode: Interpolate) -> Upsample {
        Upsample {
            size: None,
            scale_factor,
            mode,
        }
    }

    /// Images resampled to `(height, width)`.
    pub fn to_size(size: (usize, usize), mode: Interpolate) -> Upsample {
        Upsample {
            size: Some(size),
            scale_factor: 1,
            mode,
        }
    }
}

impl Module for Upsample {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let size = match (self.size, x.shape()) {
            (Some(size), _) => size,
            // Saturated, so that a side past any tensor's is interpolate's error.
            (None, [_, _, h, w]) => (
                h.saturating_mul(self.scale_factor),
                w.saturating_mul(self.scale_factor),
            ),
            // interpolate names the shape.
            (None, _) => (0, 0),
        };
        x.interpolate(size, self.mode)
    }
}
