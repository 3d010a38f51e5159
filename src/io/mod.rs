//! Files: safetensors checkpoints of a module's named parameters, MNIST-format IDX readers,
//! and the datasets the training example uses.

mod checkpoint;
mod data;
mod idx;
mod loader;
mod training;

pub use checkpoint::{load, load_with, save, LoadOptions};
pub use data::{load_idx_dir, synthetic_shapes, synthetic_spirals, Dataset, SHAPES_SIDE};
pub use idx::{read_idx_images, read_idx_labels};
pub use loader::{BatchSource, DataLoader, Epoch};
pub use training::{load_training, save_training};

use crate::error::Error;
use std::path::Path;

fn io_error(op: &'static str, path: &Path, msg: impl std::fmt::Display) -> Error {
    Error::Io {
        op,
        path: path.display().to_string(),
        msg: msg.to_string(),
    }
}
