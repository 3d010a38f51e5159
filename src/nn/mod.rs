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
mod module_list;
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
pub use module_list::ModuleList;
pub use rotary::RotaryEmbedding;
pub use sequential::Sequential;
pub use transformer::{MultiheadAttention, TransformerBlock};

use crate::error::Result;
use crate::tensor::Tensor;

/// `#[derive(Module)]` writes a struct's [`Module`] impl from its fields: `named_parameters`,
/// `named_buffers` and `set_training`; the struct's author writes only `forward`, as an
/// inherent method (`fn forward(&self, x: &Tensor) -> Result<Tensor>`), which the impl calls.
///
/// Each field is, by its type:
/// - `Tensor`, `Option<Tensor>`, `Vec<Tensor>`: parameters named after the field
///   (`"weight"`; `"bias"` when `Some`; `"w.0"`, `"w.1"`, ...), or buffers with
///   `#[module(buffer)]`;
/// - any other type: a child module (a [`Module`], a `Box<dyn Module>`, ...) whose names get
///   the field's name in front (`"attn.q_proj.weight"`); `Option<M>` when `Some`, `Vec<M>` as
///   `"blocks.0."`, `"blocks.1."`, ... as PyTorch names an `nn.ModuleList`;
///   `#[module(flatten)]` leaves the field's name out (how [`Sequential`] names its layers
///   `"0.weight"`);
/// - `#[module(skip)]`: plain data (sizes, flags), not registered.
///
/// `eval()` and `train()` reach every child module, so no BatchNorm or Dropout inside is
/// forgotten; a tensor reached twice (tied weights) is listed once, at its first name.
///
/// ```
/// # fn main() -> wgrad::Result<()> {
/// use wgrad::nn::{self, Module};
/// use wgrad::{Device, Result, Tensor};
///
/// #[derive(Module)]
/// struct Mlp {
///     hidden: Vec<nn::Linear>,
///     head: nn::Linear,
///     dropout: nn::Dropout,
///     #[module(skip)]
///     width: usize,
/// }
///
/// impl Mlp {
///     fn forward(&self, x: &Tensor) -> Result<Tensor> {
///         let mut h = x.clone();
///         for layer in &self.hidden {
///             h = self.dropout.forward(&layer.forward(&h)?.relu()?)?;
///         }
///         self.head.forward(&h)
///     }
/// }
///
/// let dev = Device::new()?;
/// let mlp = Mlp {
///     hidden: vec![nn::Linear::new(4, 8, true, &dev)?, nn::Linear::new(8, 8, true, &dev)?],
///     head: nn::Linear::new(8, 2, true, &dev)?,
///     dropout: nn::Dropout::new(0.1)?,
///     width: 8,
/// };
/// let names: Vec<String> = mlp.named_parameters().into_iter().map(|(n, _)| n).collect();
/// assert_eq!(names, ["hidden.0.weight", "hidden.0.bias", "hidden.1.weight", "hidden.1.bias",
///                    "head.weight", "head.bias"]);
/// mlp.eval(); // reaches the dropout
/// assert_eq!(mlp.forward(&Tensor::ones(&[3, 4], &dev)?)?.shape(), &[3, 2]);
/// # Ok(())
/// # }
/// ```
pub use wgrad_derive::Module;

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

/// A boxed module is the module: `Box<dyn Module>` goes wherever a module does (a
/// [`ModuleList`] of mixed layers, a field of a derived module).
impl<M: Module + ?Sized> Module for Box<M> {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        (**self).forward(x)
    }
    fn named_parameters(&self) -> Vec<(String, Tensor)> {
        (**self).named_parameters()
    }
    fn named_buffers(&self) -> Vec<(String, Tensor)> {
        (**self).named_buffers()
    }
    fn parameters(&self) -> Vec<Tensor> {
        (**self).parameters()
    }
    fn set_training(&self, training: bool) {
        (**self).set_training(training)
    }
}

/// `named` with each tensor at its first name only: a tensor reached twice (tied weights) is
/// listed once, as PyTorch's `named_parameters` lists it. `#[derive(Module)]` ends its lists
/// with it.
pub fn first_names(named: Vec<(String, Tensor)>) -> Vec<(String, Tensor)> {
    let mut unique: Vec<(String, Tensor)> = Vec::with_capacity(named.len());
    for (name, tensor) in named {
        if !unique.iter().any(|(_, t)| Tensor::same(t, &tensor)) {
            unique.push((name, tensor));
        }
    }
    unique
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
