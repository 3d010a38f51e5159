//! Loss functions.

use crate::error::{Error, Result};
use crate::tensor::Tensor;

/// Mean over the batch of the negative log-likelihood of `labels` under
/// `log_softmax(logits)`: `logits` is `[N, C]` f32, `labels` a `[N]` u32 tensor
/// ([`Tensor::from_labels`]) with values below `C`. Fused: one row kernel and one mean.
pub fn cross_entropy(logits: &Tensor, labels: &Tensor) -> Result<Tensor> {
    crate::ops::softmax::cross_entropy(logits, labels)
}

/// Mean squared error: `mean((prediction - target)^2)`; the shapes must match.
pub fn mse(prediction: &Tensor, target: &Tensor) -> Result<Tensor> {
    same_shapes("mse", prediction, target)?;
    let diff = prediction.sub(target)?;
    diff.mul(&diff)?.mean()
}

/// Mean absolute error: `mean(|prediction - target|)`, as torch's `l1_loss` (grad 0 where
/// they are equal).
pub fn l1(prediction: &Tensor, target: &Tensor) -> Result<Tensor> {
    same_shapes("l1", prediction, target)?;
    prediction.sub(target)?.abs()?.mean()
}

/// Huber-style loss, as torch's `smooth_l1_loss`: per element `0.5 d^2 / beta` where
/// `|d| < beta`, else `|d| - 0.5 beta`, averaged; `beta` 0 is [`l1`].
pub fn smooth_l1(prediction: &Tensor, target: &Tensor, beta: f32) -> Result<Tensor> {
    same_shapes("smooth_l1", prediction, target)?;
    if !(beta >= 0.0 && beta.is_finite()) {
        return Err(Error::InvalidArgument {
            op: "smooth_l1",
            msg: format!("beta must be finite and >= 0, got {beta}"),
        });
    }
    let d = prediction.sub(target)?.abs()?;
    if beta == 0.0 {
        return d.mean();
    }
    let quadratic = d.mul(&d)?.mul_scalar(0.5 / beta)?;
    let linear = d.sub_scalar(0.5 * beta)?;
    d.lt_scalar(beta)?.where_cond(&quadratic, &linear)?.mean()
}

/// Binary cross-entropy of f32 `targets` in `[0, 1]` under `sigmoid(logits)`, averaged, as
/// torch's `binary_cross_entropy_with_logits`: `softplus(x) - x y`, stable for any logit, with
/// the grad `sigmoid(x) - y`.
pub fn binary_cross_entropy_with_logits(logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
    same_shapes("binary_cross_entropy_with_logits", logits, targets)?;
    logits.softplus()?.sub(&logits.mul(targets)?)?.mean()
}

/// Mean over the batch of `-log_probs[i, targets[i]]`, as torch's `nll_loss`: `log_probs`
/// `[N, C]` (a `log_softmax`), `targets` a `[N]` u32 tensor below `C`.
pub fn nll(log_probs: &Tensor, targets: &Tensor) -> Result<Tensor> {
    const OP: &str = "nll";
    if log_probs.rank() != 2 || targets.rank() != 1 || targets.shape()[0] != log_probs.shape()[0] {
        return Err(Error::Shape {
            op: OP,
            msg: format!(
                "needs log_probs [N, C] and targets [N], got {:?} and {:?}",
                log_probs.shape(),
                targets.shape()
            ),
        });
    }
    let picked = log_probs.gather(1, &targets.unsqueeze(1)?)?;
    picked.mean()?.neg()
}

fn same_shapes(op: &'static str, prediction: &Tensor, target: &Tensor) -> Result<()> {
    if prediction.shape() != target.shape() {
        return Err(Error::Shape {
            op,
            msg: format!(
                "prediction {:?} and target {:?} differ",
                prediction.shape(),
                target.shape()
            ),
        });
    }
    Ok(())
}
