//! `BatchNorm1d` and `BatchNorm2d`: per-channel normalisation with running statistics, one
//! type over the two input layouts ([`BatchNormInput`]).

use std::marker::PhantomData;

use crate::autograd::no_grad;
use crate::device::Device;
use crate::error::{Error, Result};
use crate::nn::{Module, TrainingFlag};
use crate::ops::norm::scaled_for_statistics;
use crate::tensor::Tensor;

/// The inputs a [`BatchNorm`] takes: channels on dim 1, statistics over every other dim.
pub trait BatchNormInput {
    /// The module's name, as PyTorch's.
    const NAME: &'static str;
    /// The input shapes it takes, for errors.
    const SHAPES: &'static str;
    /// Whether it takes inputs of `rank`.
    fn takes_rank(rank: usize) -> bool;
}

/// `[N, C]` or `[N, C, L]` (features, sequences).
#[derive(Debug, Clone, Copy)]
pub struct Features;

/// `[N, C, H, W]` (images).
#[derive(Debug, Clone, Copy)]
pub struct Images;

impl BatchNormInput for Features {
    const NAME: &'static str = "BatchNorm1d";
    const SHAPES: &'static str = "[N, C] or [N, C, L]";
    fn takes_rank(rank: usize) -> bool {
        rank == 2 || rank == 3
    }
}

impl BatchNormInput for Images {
    const NAME: &'static str = "BatchNorm2d";
    const SHAPES: &'static str = "[N, C, H, W]";
    fn takes_rank(rank: usize) -> bool {
        rank == 4
    }
}

/// PyTorch's `BatchNorm1d`: over `[N, C]` or `[N, C, L]`.
pub type BatchNorm1d = BatchNorm<Features>;

/// PyTorch's `BatchNorm2d`: over `[N, C, H, W]`.
pub type BatchNorm2d = BatchNorm<Images>;

/// Normalises each channel (dim 1) over every other dim, then scales by `weight` and shifts
/// by `bias` (ones and zeros at first), as PyTorch's `BatchNorm1d`/`BatchNorm2d` (eps 1e-5,
/// momentum 0.1). In training mode it uses the batch's statistics and updates
/// `running_mean` and `running_var` (the unbiased variance); in evaluation mode it uses the
/// running ones. Checkpoints hold the buffers beside the parameters.
pub struct BatchNorm<Input: BatchNormInput> {
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
    input: PhantomData<fn() -> Input>,
}

impl<Input: BatchNormInput> BatchNorm<Input> {
    /// BatchNorm over `channels` channels.
    pub fn new(channels: usize, device: &Device) -> Result<BatchNorm<Input>> {
        if channels == 0 {
            return Err(Error::InvalidArgument {
                op: Input::NAME,
                msg: "needs at least one channel".into(),
            });
        }
        Ok(BatchNorm {
            weight: Tensor::ones(&[channels], device)?.requires_grad_(true),
            bias: Tensor::zeros(&[channels], device)?.requires_grad_(true),
            running_mean: Tensor::zeros(&[channels], device)?,
            running_var: Tensor::ones(&[channels], device)?,
            eps: 1e-5,
            momentum: 0.1,
            training: TrainingFlag::new(),
            input: PhantomData,
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

impl<Input: BatchNormInput> Module for BatchNorm<Input> {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let c = self.weight.numel();
        if !Input::takes_rank(x.rank()) || x.shape()[1] != c {
            return Err(Error::Shape {
                op: Input::NAME,
                msg: format!(
                    "needs input {} with C = {c}, got {:?}",
                    Input::SHAPES,
                    x.shape()
                ),
            });
        }
        // Every dim but the channels'.
        let dims: Vec<usize> = (0..x.rank()).filter(|&d| d != 1).collect();
        let mut channel_shape = vec![1; x.rank()];
        channel_shape[1] = c;
        let per_channel = |t: &Tensor| t.reshape(&channel_shape);
        let normed = if self.training.get() {
            let count = x.numel() / c;
            if count < 2 {
                return Err(Error::Shape {
                    op: Input::NAME,
                    msg: format!(
                        "training needs more than one value per channel, got input {:?}",
                        x.shape()
                    ),
                });
            }
            // The statistics of x over its per-channel magnitude, which cannot overflow.
            let (u, divisor, eps_scaled) = scaled_for_statistics(x, &dims, self.eps)?;
            let mean = u.mean_dims(&dims, true)?;
            let centred = u.sub(&mean)?;
            let var = centred.mul(&centred)?.mean_dims(&dims, true)?;
            no_grad(|| {
                let batch_mean = mean.mul(&divisor)?.reshape(&[c])?;
                let unbiased = var
                    .mul(&divisor.mul(&divisor)?)?
                    .mul_scalar(count as f32 / (count - 1) as f32)?;
                self.update(&self.running_mean, &batch_mean)?;
                self.update(&self.running_var, &unbiased.reshape(&[c])?)
            })?;
            centred.mul(&var.add(&eps_scaled)?.rsqrt()?)?
        } else {
            let mean = per_channel(&self.running_mean)?;
            let var = per_channel(&self.running_var)?;
            x.sub(&mean)?.div(&var.add_scalar(self.eps)?.sqrt()?)?
        };
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
