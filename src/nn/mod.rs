//! Neural-network building blocks: the [`Module`] trait, layers, activations and losses.

mod activation;
mod batch_norm;
mod conv;
mod dropout;
mod embedding;
pub mod init;
mod layer_norm;
mod linear;
pub mod loss;
mod rotary;
mod sequential;
mod transformer;

pub use activation::{Gelu, Relu, Tanh};
pub use batch_norm::{
    BatchNorm, BatchNorm1d, BatchNorm2d, BatchNormInput, BatchNormOptions, Features, Images,
};
pub use conv::{AvgPool2d, Conv1d, Conv2d, ConvTranspose2d, Flatten, MaxPool2d, Upsample};
pub use dropout::Dropout;
pub use embedding::Embedding;
pub use layer_norm::{GroupNorm, LayerNorm, RmsNorm};
pub use linear::Linear;
pub use rotary::RotaryEmbedding;
pub use sequential::Sequential;
pub use transformer::{MultiheadAttention, TransformerBlock};

use crate::error::Result;
use crate::tensor::Tensor;

/// A layer or model: a forward function and the parameters it trains.
///
/// `parameters()` returns handles to the parameters themselves (an optimizer updating them
/// updates the module), in a fixed order; `named_parameters()` pairs them with the dotted
/// names checkpoints use (`"0.weight"` for the first layer of a [`Sequential`]).
pub trait Module: Send + Sync {
    /// Applies the module.
    fn forward(&self, x: &Tensor) -> Result<Tensor>;

    /// Parameters with their names, in a fixed order (weight before bias).
    fn named_parameters(&self) -> Vec<(String, Tensor)> {
        Vec::new()
    }

    /// State that is saved and loaded with the parameters but not trained (BatchNorm's
    /// running statistics), with dotted names as for parameters.
    fn named_buffers(&self) -> Vec<(String, Tensor)> {
        Vec::new()
    }

    /// The parameters, in the order of [`Module::named_parameters`], each once: a tensor
    /// shared by two modules (tied weights) is listed at its first name, as PyTorch lists it,
    /// so an optimizer built from them updates it once per step.
    fn parameters(&self) -> Vec<Tensor> {
        let mut params: Vec<Tensor> = Vec::new();
        for (_, t) in self.named_parameters() {
            if !params.iter().any(|p| Tensor::same(p, &t)) {
                params.push(t);
            }
        }
        params
    }

    /// Switches training-only behaviour (dropout) on or off, here and in every child module.
    fn set_training(&self, _training: bool) {}

    /// Training mode (the default): dropout is active.
    fn train(&self) {
        self.set_training(true);
    }

    /// Evaluation mode: dropout passes its input through.
    fn eval(&self) {
        self.set_training(false);
    }
}

/// `name.param` for each of `module`'s parameters: a composite module's names for a child's.
pub(crate) fn prefixed(name: &str, module: &dyn Module) -> Vec<(String, Tensor)> {
    module
        .named_parameters()
        .into_iter()
        .map(|(p, t)| (format!("{name}.{p}"), t))
        .collect()
}

/// A module's train/eval flag. A captured step notes each flag it reads, so that a replay under
/// the other mode re-captures instead of running the wrong kernels.
pub(crate) struct TrainingFlag(std::sync::Arc<std::sync::atomic::AtomicBool>);

impl TrainingFlag {
    /// Training mode, the default.
    pub fn new() -> TrainingFlag {
        TrainingFlag(std::sync::Arc::new(std::sync::atomic::AtomicBool::new(
            true,
        )))
    }

    /// True in training mode.
    pub fn get(&self) -> bool {
        crate::tensor::tape::observe_flag(&self.0);
        self.0.load(std::sync::atomic::Ordering::Relaxed)
    }

    pub fn set(&self, training: bool) {
        self.0.store(training, std::sync::atomic::Ordering::Relaxed);
    }
}
