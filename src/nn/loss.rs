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
    if prediction.shape() != target.shape() {
        return Err(Error::Shape {
            op: "mse",
            msg: format!(
                "prediction {:?} and target {:?} differ",
                prediction.shape(),
                target.shape()
            ),
        });
    }
    let diff = prediction.sub(target)?;
    diff.mul(&diff)?.mean()
}
