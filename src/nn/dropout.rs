//! `Dropout`: zeroes elements at random while training, scaling the rest by `1 / (1 - p)`.

use std::sync::atomic::{AtomicBool, Ordering};

use rand::{Rng, SeedableRng};

use crate::error::{Error, Result};
use crate::nn::Module;
use crate::seed::next_seed;
use crate::tensor::Tensor;

/// Zeroes each element with probability `p` in training mode and scales the kept ones by
/// `1 / (1 - p)`; passes its input through in evaluation mode. Masks come from the global seed
/// ([`crate::manual_seed`]), so runs repeat.
pub struct Dropout {
    p: f32,
    training: AtomicBool,
}

impl Dropout {
    /// Dropout with drop probability `p` in `[0, 1)`.
    pub fn new(p: f32) -> Result<Dropout> {
        if !(0.0..1.0).contains(&p) {
            return Err(Error::InvalidArgument {
                op: "Dropout::new",
                msg: format!("p must be in [0, 1), got {p}"),
            });
        }
        Ok(Dropout {
            p,
            training: AtomicBool::new(true),
        })
    }
}

impl Module for Dropout {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        if !self.training.load(Ordering::Relaxed) || self.p == 0.0 {
            return Ok(x.clone());
        }
        let keep = 1.0 / (1.0 - self.p);
        let mut rng = rand::rngs::StdRng::seed_from_u64(next_seed());
        let mask: Vec<f32> = (0..x.numel())
            .map(|_| {
                if rng.random::<f32>() < self.p {
                    0.0
                } else {
                    keep
                }
            })
            .collect();
        x.mul(&Tensor::from_vec(mask, x.shape(), x.device())?)
    }

    fn set_training(&self, training: bool) {
        self.training.store(training, Ordering::Relaxed);
    }
}
