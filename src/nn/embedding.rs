//! `Embedding`: a lookup table of vectors.

use crate::device::Device;
use crate::error::Result;
use crate::nn::Module;
use crate::seed::next_seed;
use crate::tensor::Tensor;

/// Maps each u32 index to a row of `weight` (`[num, dim]`, standard normal as PyTorch):
/// input of any shape, output that shape plus `[dim]`.
pub struct Embedding {
    /// `[num, dim]`.
    pub weight: Tensor,
}

impl Embedding {
    /// A table of `num` vectors of size `dim`.
    pub fn new(num: usize, dim: usize, device: &Device) -> Result<Embedding> {
        Ok(Embedding {
            weight: Tensor::randn(&[num, dim], next_seed(), device)?.requires_grad_(true),
        })
    }
}

impl Module for Embedding {
    fn forward(&self, indices: &Tensor) -> Result<Tensor> {
        let flat = indices.reshape(&[indices.numel()])?;
        let rows = self.weight.index_select(0, &flat)?;
        rows.reshape(&[indices.shape(), &[self.weight.shape()[1]]].concat())
    }

    fn named_parameters(&self) -> Vec<(String, Tensor)> {
        vec![("weight".to_string(), self.weight.clone())]
    }
}
