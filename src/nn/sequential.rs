//! `Sequential`: modules applied one after another.

use crate::error::Result;
use crate::nn::Module;
use crate::tensor::Tensor;

/// Modules applied in order. Parameters are named by position, as PyTorch does:
/// `"0.weight"`, `"0.bias"`, `"2.weight"`, ...
#[derive(Default, Module)]
pub struct Sequential {
    #[module(flatten)]
    layers: Vec<Box<dyn Module>>,
}

impl Sequential {
    /// An empty sequence.
    pub fn new() -> Sequential {
        Sequential::default()
    }

    /// Appends a module (builder style).
    #[allow(clippy::should_implement_trait)]
    pub fn add(mut self, module: impl Module + 'static) -> Sequential {
        self.layers.push(Box::new(module));
        self
    }

    /// The modules, in order.
    pub fn layers(&self) -> &[Box<dyn Module>] {
        &self.layers
    }
}

impl Sequential {
    /// Applies the layers in order.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let mut h = x.clone();
        for layer in &self.layers {
            h = layer.forward(&h)?;
        }
        Ok(h)
    }
}
