//! Loss functions.

use crate::error::Result;
use crate::tensor::Tensor;

/// Mean over the batch of the negative log-likelihood of `labels` under
/// `log_softmax(logits)`: `logits` is `[N, C]` f32, `labels` a `[N]` u32 tensor
/// ([`Tensor::from_labels`]) with values below `C`. Fused: one row kernel and one mean.
pub fn cross_entropy(logits: &Tensor, labels: &Tensor) -> Result<Tensor> {
    crate::ops::softmax::cross_entropy(logits, labels)
}
