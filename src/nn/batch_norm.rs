//! `BatchNorm2d`: per-channel normalisation of `[N, C, H, W]` with running statistics.

use crate::autograd::no_grad;
use crate::device::Device;
use crate::error::{Error, Result};
use crate::nn::{Module, TrainingFlag};
use crate::tensor::Tensor;

/// Normalises each channel of `[N, C, H, W]` over `N`, `H` and `W`, then scales by `weight`
/// and shifts by `bias` (ones and zeros at first), as PyTorch's `BatchNorm2d` (eps 1e-5,
/// momentum 0.1). In training mode it uses the batch's statistics and updates
/// `running_mean` and `running_var` (the unbiased variance); in evaluation mode it uses the
/// running ones. Checkpoints hold the buffers beside the parameters.
pub struct BatchNorm2d {
    /// `[C]`.
    pub weight: Tensor,
    /// `[C]`.
    pub bias: Tensor,
    /// `[C]`, updated in place by each training-mode forward.
    pub running_mean: Tensor,
    /// `[C]`, updated in place by each training-mode forward.
    pub running_var: Tensor,
    eps: f32,
    momentum: f32,
    training: TrainingFlag,
}

impl BatchNorm2d {
    /// BatchNorm over `channels` channels.
    pub fn new(channels: usize, device: &Device) -> Result<BatchNorm2d> {
        if channels == 0 {
            return Err(Error::InvalidArgument {
                op: "BatchNorm2d::new",
                msg: "needs at least one channel".into(),
            });
        }
        Ok(BatchNorm2d {
            weight: Tensor::ones(&[channels], device)?.requires_grad_(true),
            bias: Tensor::zeros(&[channels], device)?.requires_grad_(true),
            running_mean: Tensor::zeros(&[channels], device)?,
            running_var: Tensor::ones(&[channels], device)?,
            eps: 1e-5,
            momentum: 0.1,
            training: TrainingFlag::new(),
        })
    }

    /// `running = (1 - momentum) running + momentum batch`, in place.
    fn update(&self, running: &Tensor, batch: &Tensor) -> Result<()> {
        no_grad(|| {
            let next = running
                .mul_scalar(1.0 - self.momentum)?
                .add(&batch.mul_scalar(self.momentum)?)?;
            running.copy_(&next)
        })
    }
}

impl Module for BatchNorm2d {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let c = self.weight.numel();
        if x.rank() != 4 || x.shape()[1] != c {
            return Err(Error::Shape {
                op: "BatchNorm2d",
                msg: format!("needs input [N, {c}, H, W], got {:?}", x.shape()),
            });
        }
        let per_channel = |t: &Tensor| t.reshape(&[1, c, 1, 1]);
        let (mean, var) = if self.training.get() {
            let count = x.numel() / c;
            if count < 2 {
                return Err(Error::Shape {
                    op: "BatchNorm2d",
                    msg: format!(
                        "training needs more than one value per channel, got input {:?}",
                        x.shape()
                    ),
                });
            }
            let mean = x.mean_dims(&[0, 2, 3], true)?;
            let centred = x.sub(&mean)?;
            let var = centred.mul(&centred)?.mean_dims(&[0, 2, 3], true)?;
            let unbiased = var.mul_scalar(count as f32 / (count - 1) as f32)?;
            self.update(&self.running_mean, &mean.detach().reshape(&[c])?)?;
            self.update(&self.running_var, &unbiased.detach().reshape(&[c])?)?;
            (mean, var)
        } else {
            (
                per_channel(&self.running_mean)?,
                per_channel(&self.running_var)?,
            )
        };
        let normed = x.sub(&mean)?.div(&var.add_scalar(self.eps)?.sqrt()?)?;
        normed
            .mul(&per_channel(&self.weight)?)?
            .add(&per_channel(&self.bias)?)
    }

    fn named_parameters(&self) -> Vec<(String, Tensor)> {
        vec![
            ("weight".to_string(), self.weight.clone()),
            ("bias".to_string(), self.bias.clone()),
        ]
    }

    fn named_buffers(&self) -> Vec<(String, Tensor)> {
        vec![
            ("running_mean".to_string(), self.running_mean.clone()),
            ("running_var".to_string(), self.running_var.clone()),
        ]
    }

    fn set_training(&self, training: bool) {
        self.training.set(training);
    }
}
