//! `Sequential`: modules applied one after another.

use crate::error::Result;
use crate::nn::Module;
use crate::tensor::Tensor;

/// Modules applied in order. Parameters are named by position, as PyTorch does:
/// `"0.weight"`, `"0.bias"`, `"2.weight"`, ...
#[derive(Default)]
pub struct Sequential {
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

impl Module for Sequential {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let mut h = x.clone();
        for layer in &self.layers {
            h = layer.forward(&h)?;
        }
        Ok(h)
    }

    fn named_parameters(&self) -> Vec<(String, Tensor)> {
        self.layers
            .iter()
            .enumerate()
            .flat_map(|(i, layer)| {
                layer
                    .named_parameters()
                    .into_iter()
                    .map(move |(name, t)| (format!("{i}.{name}"), t))
            })
            .collect()
    }

    fn named_buffers(&self) -> Vec<(String, Tensor)> {
        self.layers
            .iter()
            .enumerate()
            .flat_map(|(i, layer)| {
                layer
                    .named_buffers()
                    .into_iter()
                    .map(move |(name, t)| (format!("{i}.{name}"), t))
            })
            .collect()
    }

    fn set_training(&self, training: bool) {
        for layer in &self.layers {
            layer.set_training(training);
        }
    }
}
