//! `--precision` for the examples' training loops: the forward under `wgrad::autocast`, with a
//! `GradScaler` for F16, parameters and optimizer state in f32.

use clap::ValueEnum;
use wgrad::optim::{GradScaler, Optimizer};
use wgrad::{DType, Result, Tensor};

/// The dtype the forward pass computes its products in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Precision {
    /// Everything in f32.
    F32,
    /// Autocast to F16 with loss scaling (GradScaler; its steps run eagerly: it reads one flag
    /// back per step).
    F16,
    /// Autocast to BF16 (no loss scaling needed: f32's exponent range).
    Bf16,
}

impl Precision {
    /// True where steps must run eagerly (the GradScaler reads back).
    pub fn needs_eager(self) -> bool {
        self == Precision::F16
    }

    /// The loss `forward` computes, under autocast where asked.
    pub fn loss(self, forward: impl FnOnce() -> Result<Tensor>) -> Result<Tensor> {
        match self {
            Precision::F32 => forward(),
            Precision::F16 => wgrad::autocast(DType::F16, forward),
            Precision::Bf16 => wgrad::autocast(DType::BF16, forward),
        }
    }
}

/// Backward and optimizer step for one loss: through `scaler` where there is one (F16).
/// `sync` runs between backward and the step (data-parallel grads).
pub fn backward_and_step(
    loss: &Tensor,
    opt: &mut dyn Optimizer,
    scaler: Option<&mut GradScaler>,
    sync: impl FnOnce() -> Result<()>,
) -> Result<()> {
    match scaler {
        Some(scaler) => {
            scaler.scale(loss)?.backward()?;
            sync()?;
            scaler.step(opt)?;
            scaler.update()?;
        }
        None => {
            loss.backward()?;
            sync()?;
            opt.step()?;
        }
    }
    Ok(())
}
