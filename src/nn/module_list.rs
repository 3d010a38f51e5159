//! `ModuleList`: modules held in a list and named by position, applied by their owner.

use crate::error::{Error, Result};
use crate::nn::Module;
use crate::tensor::Tensor;

/// Modules named by position (`"0.weight"`, `"1.weight"`, ...), as PyTorch's
/// `nn.ModuleList`: it registers its modules' parameters and buffers and passes `train()` and
/// `eval()` on, and its owner applies them (it has no forward of its own). A field of type
/// `ModuleList<M>` in a `#[derive(Module)]` struct is named as a `Vec<M>` field would be.
///
/// ```
/// # fn main() -> wgrad::Result<()> {
/// use wgrad::nn::{self, Module};
/// use wgrad::Device;
/// let dev = Device::new()?;
/// let blocks: nn::ModuleList<nn::Linear> =
///     (0..3).map(|_| nn::Linear::new(8, 8, false, &dev)).collect::<wgrad::Result<_>>()?;
/// assert_eq!(blocks.len(), 3);
/// assert_eq!(blocks.named_parameters()[2].0, "2.weight");
/// # Ok(())
/// # }
/// ```
#[derive(Module)]
pub struct ModuleList<M: Module = Box<dyn Module>> {
    #[module(flatten)]
    modules: Vec<M>,
}

impl<M: Module> ModuleList<M> {
    /// An empty list.
    pub fn new() -> Self {
        ModuleList {
            modules: Vec::new(),
        }
    }

    /// Appends a module.
    pub fn push(&mut self, module: M) {
        self.modules.push(module);
    }

    /// PyTorch's `ModuleList` has no forward; neither has this one.
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        Err(Error::InvalidArgument {
            op: "ModuleList::forward",
            msg: format!(
                "a ModuleList of {} modules has no forward of its own (input {:?}): apply its modules in the owner's forward",
                self.modules.len(),
                x.shape()
            ),
        })
    }
}

impl<M: Module> Default for ModuleList<M> {
    fn default() -> Self {
        ModuleList::new()
    }
}

impl<M: Module> std::ops::Deref for ModuleList<M> {
    type Target = [M];
    fn deref(&self) -> &[M] {
        &self.modules
    }
}

impl<M: Module> FromIterator<M> for ModuleList<M> {
    fn from_iter<I: IntoIterator<Item = M>>(modules: I) -> Self {
        ModuleList {
            modules: modules.into_iter().collect(),
        }
    }
}

impl<'a, M: Module> IntoIterator for &'a ModuleList<M> {
    type Item = &'a M;
    type IntoIter = std::slice::Iter<'a, M>;
    fn into_iter(self) -> Self::IntoIter {
        self.modules.iter()
    }
}
