//! `Dropout`: zeroes elements at random while training, scaling the rest by `1 / (1 - p)`.

use crate::error::{Error, Result};
use crate::nn::{Module, TrainingFlag};
use crate::tensor::Tensor;

/// Zeroes each element with probability `p` in training mode and scales the kept ones by
/// `1 / (1 - p)`; passes its input through in evaluation mode. Masks come from the global seed
/// ([`crate::manual_seed`]), so runs repeat.
pub struct Dropout {
    p: f32,
    training: TrainingFlag,
}

impl Dropout {
    /// Dropout with drop probability `p` in `[0, 1]` (1 drops every element, as torch's).
    pub fn new(p: f32) -> Result<Dropout> {
        if !(0.0..=1.0).contains(&p) {
            return Err(Error::InvalidArgument {
                op: "Dropout::new",
                msg: format!("p must be in [0, 1], got {p}"),
            });
        }
        Ok(Dropout {
            p,
            training: TrainingFlag::new(),
        })
    }
}

impl Module for Dropout {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        if !self.training.get() {
            return Ok(x.clone());
        }
        x.dropout(self.p)
    }

    fn set_training(&self, training: bool) {
        self.training.set(training);
    }
}
