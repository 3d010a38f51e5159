//! Files: safetensors checkpoints of a module's named parameters, MNIST-format IDX readers,
//! and the datasets the training example uses.

mod checkpoint;
mod data;
mod idx;
mod loader;
mod training;

pub use checkpoint::{load, load_with, save, LoadOptions};
pub(crate) use checkpoint::{read_safetensors, write_atomically};
pub use data::{load_idx_dir, synthetic_shapes, synthetic_spirals, Dataset, SHAPES_SIDE};
pub use idx::{read_idx_images, read_idx_labels};
pub use loader::{BatchSource, DataLoader, Epoch};
pub use training::{
    load_training, load_training_with_scaler, save_training, save_training_with_scaler,
};

use crate::error::{Error, Result};
use std::path::Path;

/// `path` opened for reading, with its size when it is a regular file (a stream, a device or a
/// pipe has none): readers check what a header announces against it before they allocate.
fn open_with_size(op: &'static str, path: &Path) -> Result<(std::fs::File, Option<u64>)> {
    let file = std::fs::File::open(path).map_err(|e| io_error(op, path, e))?;
    let size = file
        .metadata()
        .ok()
        .filter(|m| m.is_file())
        .map(|m| m.len());
    Ok((file, size))
}

fn io_error(op: &'static str, path: &Path, msg: impl std::fmt::Display) -> Error {
    Error::Io {
        op,
        path: path.display().to_string(),
        msg: msg.to_string(),
    }
}
