//! `LayerNorm` and `RmsNorm` over the last dim, `GroupNorm` over groups of channels.

use crate::device::Device;
use crate::error::{Error, Result};
use crate::nn::Module;
use crate::ops::norm::check_eps;
use crate::tensor::Tensor;

/// Normalises the last dim to zero mean and unit variance (biased, as PyTorch), then scales
/// by `weight` and shifts by `bias` (initialised to ones and zeros).
pub struct LayerNorm {
    /// `[dim]`.
    pub weight: Tensor,
    /// `[dim]`.
    pub bias: Tensor,
    eps: f32,
}

impl LayerNorm {
    /// LayerNorm over a last dim of size `dim`, with `eps` added to the variance.
    pub fn new(dim: usize, eps: f32, device: &Device) -> Result<LayerNorm> {
        check_eps("LayerNorm::new", eps)?;
        Ok(LayerNorm {
            weight: Tensor::ones(&[dim], device)?.requires_grad_(true),
            bias: Tensor::zeros(&[dim], device)?.requires_grad_(true),
            eps,
        })
    }
}

impl Module for LayerNorm {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        x.layer_norm(&self.weight, &self.bias, self.eps)
    }

    fn named_parameters(&self) -> Vec<(String, Tensor)> {
        vec![
            ("weight".to_string(), self.weight.clone()),
            ("bias".to_string(), self.bias.clone()),
        ]
    }
}

/// Scales the last dim to unit root mean square, then by `weight` (initialised to ones), as
/// PyTorch's `RMSNorm` and Llama's: no mean is subtracted and there is no bias.
pub struct RmsNorm {
    /// `[dim]`.
    pub weight: Tensor,
    eps: f32,
}

impl RmsNorm {
    /// RMSNorm over a last dim of size `dim`, with `eps` added to the mean square.
    pub fn new(dim: usize, eps: f32, device: &Device) -> Result<RmsNorm> {
        check_eps("RmsNorm::new", eps)?;
        Ok(RmsNorm {
            weight: Tensor::ones(&[dim], device)?.requires_grad_(true),
            eps,
        })
    }
}

impl Module for RmsNorm {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        x.rms_norm(&self.weight, self.eps)
    }

    fn named_parameters(&self) -> Vec<(String, Tensor)> {
        vec![("weight".to_string(), self.weight.clone())]
    }
}

/// Normalises `[N, C, *]` over groups of channels, then scales and shifts each channel by
/// `weight` and `bias` (ones and zeros at first), as PyTorch's `GroupNorm` (the U-Net's and
/// diffusion models' norm: independent of the batch size).
pub struct GroupNorm {
    /// `[C]`.
    pub weight: Tensor,
    /// `[C]`.
    pub bias: Tensor,
    groups: usize,
    eps: f32,
}

impl GroupNorm {
    /// GroupNorm of `channels` channels in `groups` groups (`channels` divisible by it).
    pub fn new(groups: usize, channels: usize, eps: f32, device: &Device) -> Result<GroupNorm> {
        const OP: &str = "GroupNorm::new";
        check_eps(OP, eps)?;
        if groups == 0 || !channels.is_multiple_of(groups) {
            return Err(Error::InvalidArgument {
                op: OP,
                msg: format!("{channels} channels do not split into {groups} groups"),
            });
        }
        Ok(GroupNorm {
            weight: Tensor::ones(&[channels], device)?.requires_grad_(true),
            bias: Tensor::zeros(&[channels], device)?.requires_grad_(true),
            groups,
            eps,
        })
    }
}

impl Module for GroupNorm {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        x.group_norm(self.groups, Some(&self.weight), Some(&self.bias), self.eps)
    }

    fn named_parameters(&self) -> Vec<(String, Tensor)> {
        vec![
            ("weight".to_string(), self.weight.clone()),
            ("bias".to_string(), self.bias.clone()),
        ]
    }
}
