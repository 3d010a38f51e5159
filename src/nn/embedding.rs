//! `Embedding`: a lookup table of vectors.

use crate::device::Device;
use crate::error::{Error, Result};
use crate::nn::Module;
use crate::ops::index::expect_indices_below;
use crate::seed::next_seed;
use crate::tensor::{DType, Tensor};

/// Maps each u32 index to a row of `weight` (`[num, dim]`, standard normal as PyTorch):
/// input of any shape, output that shape plus `[dim]`.
pub struct Embedding {
    /// `[num, dim]`.
    pub weight: Tensor,
    /// A row that reads as zeros and gets no grad (padding tokens), as torch's
    /// `padding_idx`. Its lookups are filled with 0, so the row's own values never show
    /// (torch returns them; both start at zeros).
    pub padding_idx: Option<usize>,
}

impl Embedding {
    /// A table of `num` vectors of size `dim`.
    pub fn new(num: usize, dim: usize, device: &Device) -> Result<Embedding> {
        Ok(Embedding {
            weight: Tensor::randn(&[num, dim], next_seed(), device)?.requires_grad_(true),
            padding_idx: None,
        })
    }

    /// As [`Embedding::new`], with row `padding_idx` zeroed and kept out of the grads.
    pub fn with_padding_idx(
        num: usize,
        dim: usize,
        padding_idx: usize,
        device: &Device,
    ) -> Result<Embedding> {
        if padding_idx >= num {
            return Err(Error::InvalidArgument {
                op: "Embedding::with_padding_idx",
                msg: format!("padding_idx {padding_idx} is out of range for {num} rows"),
            });
        }
        let mut is_padding = vec![0u32; num];
        is_padding[padding_idx] = 1;
        let is_padding = Tensor::from_vec_u32(is_padding, &[num, 1], device)?;
        let weight = crate::no_grad(|| {
            Tensor::randn(&[num, dim], next_seed(), device)?.masked_fill(&is_padding, 0.0)
        })?;
        Ok(Embedding {
            weight: weight.requires_grad_(true),
            padding_idx: Some(padding_idx),
        })
    }
}

impl Module for Embedding {
    fn forward(&self, indices: &Tensor) -> Result<Tensor> {
        let table_rows = self.weight.shape()[0];
        expect_indices_below("Embedding", indices, table_rows, |id| {
            format!(
                "id {id} is out of range for an embedding of {table_rows} rows (weight {:?}, ids \
                 {:?})",
                self.weight.shape(),
                indices.shape()
            )
        })?;
        let flat = indices.reshape(&[indices.numel()])?;
        let mut rows = self.weight.index_select(0, &flat)?;
        if let Some(padding) = self.padding_idx {
            // Padding tokens' rows read as zeros, and masked_fill passes no grad back there.
            let is_padding = flat.to_dtype(DType::F32)?.eq_scalar(padding as f32)?;
            rows = rows.masked_fill(&is_padding.unsqueeze(1)?, 0.0)?;
        }
        rows.reshape(&[indices.shape(), &[self.weight.shape()[1]]].concat())
    }

    fn named_parameters(&self) -> Vec<(String, Tensor)> {
        vec![("weight".to_string(), self.weight.clone())]
    }
}
