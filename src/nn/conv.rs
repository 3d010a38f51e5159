//! Image layers: `Conv2d`, `MaxPool2d`, `AvgPool2d`, `Upsample` and `Flatten`.

use crate::device::Device;
use crate::error::{Error, Result};
use crate::nn::linear::uniform_parameter;
use crate::nn::Module;
use crate::ops::conv::Conv2dOptions;
use crate::ops::pool::Interpolate;
use crate::tensor::Tensor;

/// A 2-d convolution over `[N, C_in, H, W]`: weight `[C_out, C_in, k, k]`, bias `[C_out]`.
///
/// Initialised as PyTorch does: weight and bias uniform in `[-1/sqrt(fan_in), 1/sqrt(fan_in)]`
/// with `fan_in = C_in k k`, from the global seed ([`crate::manual_seed`]).
///
/// ```
/// # fn main() -> wgrad::Result<()> {
/// use wgrad::{nn::{self, Module}, Device, Tensor};
/// let dev = Device::new()?;
/// let conv = nn::Conv2d::new(1, 8, 3, 1, 1, &dev)?;
/// let y = conv.forward(&Tensor::ones(&[2, 1, 28, 28], &dev)?)?;
/// assert_eq!(y.shape(), &[2, 8, 28, 28]);
/// # Ok(())
/// # }
/// ```
pub struct Conv2d {
    /// `[C_out, C_in, k, k]`.
    pub weight: Tensor,
    /// `[C_out]`.
    pub bias: Tensor,
    /// Stride and padding (dilation 1, one group).
    pub options: Conv2dOptions,
}

impl Conv2d {
    /// `in_channels -> out_channels` with a square `kernel`, `stride` and `padding`.
    pub fn new(
        in_channels: usize,
        out_channels: usize,
        kernel: usize,
        stride: usize,
        padding: usize,
        device: &Device,
    ) -> Result<Conv2d> {
        if in_channels == 0 || out_channels == 0 || kernel == 0 || stride == 0 {
            return Err(Error::InvalidArgument {
                op: "Conv2d::new",
                msg: format!(
                    "needs positive channels, kernel and stride, got {in_channels} -> \
                     {out_channels}, kernel {kernel}, stride {stride}"
                ),
            });
        }
        let bound = 1.0 / ((in_channels * kernel * kernel) as f32).sqrt();
        let shape = [out_channels, in_channels, kernel, kernel];
        Ok(Conv2d {
            weight: uniform_parameter(&shape, bound, device)?,
            bias: uniform_parameter(&[out_channels], bound, device)?,
            options: Conv2dOptions {
                stride,
                padding,
                ..Default::default()
            },
        })
    }
}

impl Module for Conv2d {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        x.conv2d_with(&self.weight, Some(&self.bias), self.options)
    }

    fn named_parameters(&self) -> Vec<(String, Tensor)> {
        vec![
            ("weight".to_string(), self.weight.clone()),
            ("bias".to_string(), self.bias.clone()),
        ]
    }
}

/// Max pooling over `kernel x kernel` windows every `stride` (no parameters).
#[derive(Debug, Clone, Copy)]
pub struct MaxPool2d {
    /// Window side.
    pub kernel: usize,
    /// Step between windows.
    pub stride: usize,
}

impl MaxPool2d {
    /// Windows of `kernel x kernel` every `stride`.
    pub fn new(kernel: usize, stride: usize) -> MaxPool2d {
        MaxPool2d { kernel, stride }
    }
}

impl Module for MaxPool2d {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        x.max_pool2d(self.kernel, self.stride)
    }
}

/// Average pooling over `kernel x kernel` windows every `stride` (no parameters).
#[derive(Debug, Clone, Copy)]
pub struct AvgPool2d {
    /// Window side.
    pub kernel: usize,
    /// Step between windows.
    pub stride: usize,
}

impl AvgPool2d {
    /// Windows of `kernel x kernel` every `stride`.
    pub fn new(kernel: usize, stride: usize) -> AvgPool2d {
        AvgPool2d { kernel, stride }
    }
}

impl Module for AvgPool2d {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        x.avg_pool2d(self.kernel, self.stride)
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
            (None, [_, _, h, w]) => (h * self.scale_factor, w * self.scale_factor),
            // interpolate names the shape.
            (None, _) => (0, 0),
        };
        x.interpolate(size, self.mode)
    }
}
