//! Checkpoints: a module's named parameters as a safetensors file (opens in PyTorch and every
//! other tool that reads safetensors).

use std::collections::HashMap;
use std::io::Write;
use std::path::Path;

use safetensors::tensor::{Dtype, SafeTensors, TensorView};

use crate::error::{Error, Result};
use crate::io::io_error;
use crate::nn::Module;
use crate::tensor::Tensor;

/// What a checkpoint holds: the parameters, then the buffers.
fn named_state(module: &dyn Module) -> Vec<(String, Tensor)> {
    let mut state = module.named_parameters();
    state.extend(module.named_buffers());
    state
}

/// Writes `module`'s named parameters and buffers to `path` as f32 safetensors. The file is written beside
/// `path` under a temporary name, flushed to disk, then renamed over `path`, so a crash never
/// leaves a half-written checkpoint.
pub fn save(path: impl AsRef<Path>, module: &dyn Module) -> Result<()> {
    const OP: &str = "io::save";
    let path = path.as_ref();
    let params = named_state(module);
    let mut bytes: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::new();
    for (name, t) in &params {
        let values = t.to_vec()?;
        bytes.push((
            name.clone(),
            t.shape().to_vec(),
            bytemuck::cast_slice(&values).to_vec(),
        ));
    }
    let views = bytes
        .iter()
        .map(|(name, shape, data)| {
            Ok((
                name.clone(),
                TensorView::new(Dtype::F32, shape.clone(), data)
                    .map_err(|e| io_error(OP, path, e))?,
            ))
        })
        .collect::<Result<Vec<_>>>()?;
    let encoded = safetensors::serialize(views, None::<HashMap<String, String>>)
        .map_err(|e| io_error(OP, path, e))?;
    let file_name = path
        .file_name()
        .ok_or_else(|| io_error(OP, path, "not a file path"))?;
    let temporary = path.with_file_name(format!(
        ".{}.tmp-{}",
        file_name.to_string_lossy(),
        std::process::id()
    ));
    let write = || -> std::io::Result<()> {
        let mut file = std::fs::File::create(&temporary)?;
        file.write_all(&encoded)?;
        file.sync_all()?;
        std::fs::rename(&temporary, path)
    };
    write().map_err(|e| {
        let _ = std::fs::remove_file(&temporary);
        io_error(OP, path, e)
    })
}

/// Reads the parameters and buffers of `module` from the safetensors file at `path`, by name. Every
/// tensor is checked first (present, f32, right shape), so on any error the module is left
/// unchanged; the error names the tensor.
pub fn load(path: impl AsRef<Path>, module: &dyn Module) -> Result<()> {
    const OP: &str = "io::load";
    let path = path.as_ref();
    let bytes = std::fs::read(path).map_err(|e| io_error(OP, path, e))?;
    let file = SafeTensors::deserialize(&bytes)
        .map_err(|e| io_error(OP, path, format!("not a valid safetensors file: {e}")))?;
    let mut staged: Vec<(Tensor, Tensor)> = Vec::new();
    for (name, param) in named_state(module) {
        let view = file.tensor(&name).map_err(|_| {
            io_error(
                OP,
                path,
                format!(
                    "tensor {name:?} (shape {:?}) is missing; the file has {:?}",
                    param.shape(),
                    file.names()
                ),
            )
        })?;
        if view.dtype() != Dtype::F32 {
            return Err(io_error(
                OP,
                path,
                format!("tensor {name:?} is {:?}, expected F32", view.dtype()),
            ));
        }
        if view.shape() != param.shape() {
            return Err(Error::Shape {
                op: OP,
                msg: format!(
                    "tensor {name:?} in {} has shape {:?}, the module's has {:?}",
                    path.display(),
                    view.shape(),
                    param.shape()
                ),
            });
        }
        let values: Vec<f32> = bytemuck::pod_collect_to_vec(view.data());
        staged.push((
            param.clone(),
            Tensor::from_vec(values, view.shape(), param.device())?,
        ));
    }
    crate::no_grad(|| {
        staged
            .iter()
            .try_for_each(|(param, values)| param.copy_(values))
    })
}
