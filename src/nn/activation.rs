//! Activation functions as modules, for use in [`super::Sequential`].

use crate::error::Result;
use crate::nn::Module;
use crate::tensor::Tensor;

/// `max(x, 0)`.
#[derive(Debug, Clone, Copy, Default)]
pub struct Relu;

/// GELU, exact (erf) form.
#[derive(Debug, Clone, Copy, Default)]
pub struct Gelu;

/// Hyperbolic tangent.
#[derive(Debug, Clone, Copy, Default)]
pub struct Tanh;

impl Module for Relu {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        x.relu()
    }
}

impl Module for Gelu {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        x.gelu()
    }
}

impl Module for Tanh {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        x.tanh()
    }
}
