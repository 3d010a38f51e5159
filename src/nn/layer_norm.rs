//! `LayerNorm` over the last dim.

use crate::device::Device;
use crate::error::{Error, Result};
use crate::nn::Module;
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
        Ok(LayerNorm {
            weight: Tensor::ones(&[dim], device)?.requires_grad_(true),
            bias: Tensor::zeros(&[dim], device)?.requires_grad_(true),
            eps,
        })
    }
}

impl Module for LayerNorm {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let last = x
            .rank()
            .checked_sub(1)
            .filter(|&d| x.shape()[d] == self.weight.numel())
            .ok_or_else(|| Error::Shape {
                op: "LayerNorm",
                msg: format!(
                    "input of shape {:?} does not end in {}",
                    x.shape(),
                    self.weight.numel()
                ),
            })?;
        let centred = x.sub(&x.mean_dims(&[last], true)?)?;
        let var = centred.mul(&centred)?.mean_dims(&[last], true)?;
        let normed = centred.div(&var.add_scalar(self.eps)?.sqrt()?)?;
        normed.mul(&self.weight)?.add(&self.bias)
    }

    fn named_parameters(&self) -> Vec<(String, Tensor)> {
        vec![
            ("weight".to_string(), self.weight.clone()),
            ("bias".to_string(), self.bias.clone()),
        ]
    }
}
