//! `BatchNorm1d` and `BatchNorm2d`: per-channel normalisation with running statistics, one
//! type over the two input layouts ([`BatchNormInput`]).

use std::marker::PhantomData;

use crate::autograd::no_grad;
use crate::device::Device;
use crate::error::{Error, Result};
use crate::nn::{Module, TrainingFlag};
use crate::ops::batch_norm::batch_norm_training;
use crate::ops::norm::check_eps;
use crate::tensor::{DType, Tensor};

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

/// A BatchNorm's options, as PyTorch's arguments, with its defaults.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BatchNormOptions {
    /// Added to the variance.
    pub eps: f32,
    /// The running statistics' update factor; `None` averages every batch seen alike (torch's
    /// `momentum=None`: a cumulative average over `num_batches_tracked`).
    pub momentum: Option<f32>,
    /// Learnable `weight` and `bias` (`false`: none, the output is only normalised).
    pub affine: bool,
    /// Running statistics kept and used in evaluation mode (`false`: batch statistics always,
    /// and no buffers).
    pub track_running_stats: bool,
}

impl Default for BatchNormOptions {
    fn default() -> Self {
        BatchNormOptions {
            eps: 1e-5,
            momentum: Some(0.1),
            affine: true,
            track_running_stats: true,
        }
    }
}

/// Normalises each channel (dim 1) over every other dim, then scales by `weight` and shifts
/// by `bias` (ones and zeros at first), as PyTorch's `BatchNorm1d`/`BatchNorm2d` (eps 1e-5,
/// momentum 0.1 by default, [`BatchNorm::with_options`] for others). In training mode it uses
/// the batch's statistics and updates `running_mean`, `running_var` (the unbiased variance)
/// and `num_batches_tracked`; in evaluation mode it uses the running ones. Checkpoints hold
/// the buffers beside the parameters under PyTorch's names, so its state loads into PyTorch
/// with `strict=True` and back.
pub struct BatchNorm<Input: BatchNormInput> {
    /// `[C]` (ones, and not a parameter, without `affine`).
    pub weight: Tensor,
    /// `[C]` (zeros, and not a parameter, without `affine`).
    pub bias: Tensor,
    /// `[C]`, updated in place by each training-mode forward.
    pub running_mean: Tensor,
    /// `[C]`, updated in place by each training-mode forward.
    pub running_var: Tensor,
    /// `[]`, the training-mode forwards so far (f32, exact to 2^24).
    pub num_batches_tracked: Tensor,
    options: BatchNormOptions,
    training: TrainingFlag,
    input: PhantomData<fn() -> Input>,
}

impl<Input: BatchNormInput> BatchNorm<Input> {
    /// BatchNorm over `channels` channels, with PyTorch's defaults.
    pub fn new(channels: usize, device: &Device) -> Result<BatchNorm<Input>> {
        BatchNorm::with_options(channels, BatchNormOptions::default(), device)
    }

    /// BatchNorm over `channels` channels with other options.
    pub fn with_options(
        channels: usize,
        options: BatchNormOptions,
        device: &Device,
    ) -> Result<BatchNorm<Input>> {
        if channels == 0 {
            return Err(Error::InvalidArgument {
                op: Input::NAME,
                msg: "needs at least one channel".into(),
            });
        }
        check_eps(Input::NAME, options.eps)?;
        if let Some(m) = options.momentum {
            if !(0.0..=1.0).contains(&m) {
                return Err(Error::InvalidArgument {
                    op: Input::NAME,
                    msg: format!("momentum must be in [0, 1], got {m}"),
                });
            }
        }
        Ok(BatchNorm {
            weight: Tensor::ones(&[channels], device)?.requires_grad_(options.affine),
            bias: Tensor::zeros(&[channels], device)?.requires_grad_(options.affine),
            running_mean: Tensor::zeros(&[channels], device)?,
            running_var: Tensor::ones(&[channels], device)?,
            num_batches_tracked: Tensor::zeros(&[], device)?,
            options,
            training: TrainingFlag::new(),
            input: PhantomData,
        })
    }

    /// One more batch tracked, and each running statistic moved towards the batch's:
    /// `running = (1 - f) running + f batch` with `f` the momentum, or `1 / batches` without
    /// one. In place.
    fn update(&self, batch_mean: &Tensor, batch_var: &Tensor) -> Result<()> {
        no_grad(|| {
            let batches = self.num_batches_tracked.add_scalar(1.0)?;
            self.num_batches_tracked.copy_(&batches)?;
            for (running, batch) in [
                (&self.running_mean, batch_mean),
                (&self.running_var, batch_var),
            ] {
                let next = match self.options.momentum {
                    Some(m) => running.mul_scalar(1.0 - m)?.add(&batch.mul_scalar(m)?)?,
                    None => {
                        let f = batches.powf(-1.0)?;
                        running.add(&batch.sub(running)?.mul(&f)?)?
                    }
                };
                running.copy_(&next)?;
            }
            Ok(())
        })
    }
}

impl<Input: BatchNormInput> Module for BatchNorm<Input> {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        // Under autocast, in f32 (its statistics need f32's range).
        let x = &crate::ops::autocast::for_f32_op(x)?;
        if x.dtype().is_16_bit() {
            // A 16-bit input with F32 parameters, as torch's mixed batch norm: statistics,
            // parameters and running stats in f32, the output in the input's dtype.
            return self.forward(&x.to_dtype(DType::F32)?)?.to_dtype(x.dtype());
        }
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
        let tracking = self.options.track_running_stats;
        let eps = self.options.eps;
        if self.training.get() || !tracking {
            if x.numel() / c < 2 {
                return Err(Error::Shape {
                    op: Input::NAME,
                    msg: format!(
                        "training needs more than one value per channel, got input {:?}",
                        x.shape()
                    ),
                });
            }
            let affine = self.options.affine.then_some((&self.weight, &self.bias));
            let (out, batch) = batch_norm_training(Input::NAME, x, affine, eps)?;
            if tracking && self.training.get() {
                self.update(&batch.mean, &batch.unbiased_var)?;
            }
            return Ok(out);
        }
        // Evaluation: the running statistics, composed of broadcasting ops (their grads flow
        // to x and to the affine parameters, as when fine-tuning with frozen statistics).
        let mut channel_shape = vec![1; x.rank()];
        channel_shape[1] = c;
        let per_channel = |t: &Tensor| t.reshape(&channel_shape);
        let mean = per_channel(&self.running_mean)?;
        let var = per_channel(&self.running_var)?;
        let normed = x.sub(&mean)?.div(&var.add_scalar(eps)?.sqrt()?)?;
        if !self.options.affine {
            return Ok(normed);
        }
        normed
            .mul(&per_channel(&self.weight)?)?
            .add(&per_channel(&self.bias)?)
    }

    fn named_parameters(&self) -> Vec<(String, Tensor)> {
        if !self.options.affine {
            return Vec::new();
        }
        vec![
            ("weight".to_string(), self.weight.clone()),
            ("bias".to_string(), self.bias.clone()),
        ]
    }

    fn named_buffers(&self) -> Vec<(String, Tensor)> {
        if !self.options.track_running_stats {
            return Vec::new();
        }
        vec![
            ("running_mean".to_string(), self.running_mean.clone()),
            ("running_var".to_string(), self.running_var.clone()),
            (
                "num_batches_tracked".to_string(),
                self.num_batches_tracked.clone(),
            ),
        ]
    }

    fn set_training(&self, training: bool) {
        self.training.set(training);
    }
}
