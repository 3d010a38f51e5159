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

/// Removes `PREFIX<pid>` files beside `path` left by writers that died mid-save (their process
/// is gone). Best effort: a file that cannot be checked or removed is left.
fn remove_stale_temporaries(path: &Path, prefix: &str) {
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(pid) = name.to_str().and_then(|n| n.strip_prefix(prefix)) else {
            continue;
        };
        let Ok(pid) = pid.parse::<u32>() else {
            continue;
        };
        if pid != std::process::id() && !process_alive(pid) {
            let _ = std::fs::remove_file(entry.path());
        }
    }
}

/// Whether process `pid` still runs. Where that cannot be known (no `/proc`), it is assumed
/// to, so no live writer's file is ever removed.
fn process_alive(pid: u32) -> bool {
    let proc_root = Path::new("/proc/self");
    if !proc_root.exists() {
        return true;
    }
    Path::new("/proc").join(pid.to_string()).exists()
}

/// Flushes the directory entry of a rename to disk, so the new name survives a crash
/// (Unix; elsewhere the rename's own durability is all there is).
fn sync_directory(path: &Path) -> std::io::Result<()> {
    #[cfg(unix)]
    {
        let dir = match path.parent() {
            Some(d) if !d.as_os_str().is_empty() => d,
            _ => Path::new("."),
        };
        std::fs::File::open(dir)?.sync_all()?;
    }
    #[cfg(not(unix))]
    let _ = path;
    Ok(())
}

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
    let prefix = format!(".{}.tmp-", file_name.to_string_lossy());
    let temporary = path.with_file_name(format!("{prefix}{}", std::process::id()));
    remove_stale_temporaries(path, &prefix);
    let write = || -> std::io::Result<()> {
        let mut file = std::fs::File::create(&temporary)?;
        file.write_all(&encoded)?;
        file.sync_all()?;
        std::fs::rename(&temporary, path)?;
        sync_directory(path)
    };
    write().map_err(|e| {
        let _ = std::fs::remove_file(&temporary);
        io_error(OP, path, e)
    })
}

/// How [`load_with`] treats tensors in the file that the module does not have.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LoadOptions {
    /// `true` (as [`load`]): such tensors are an error. `false`: they are skipped, and
    /// [`load_with`] returns their names.
    pub strict: bool,
}

/// Reads the parameters and buffers of `module` from the safetensors file at `path`, by name.
/// Every tensor is checked first (present, f32, right shape, and no tensor in the file that
/// the module lacks), so on any error the module is left unchanged; the error names the
/// tensor.
pub fn load(path: impl AsRef<Path>, module: &dyn Module) -> Result<()> {
    load_with(path, module, LoadOptions { strict: true }).map(|_| ())
}

/// As [`load`]; with `strict: false` the file may hold tensors the module lacks (a
/// checkpoint with optimizer state, a fixture with inputs), and their names are returned.
pub fn load_with(
    path: impl AsRef<Path>,
    module: &dyn Module,
    options: LoadOptions,
) -> Result<Vec<String>> {
    const OP: &str = "io::load";
    let path = path.as_ref();
    let bytes = std::fs::read(path).map_err(|e| io_error(OP, path, e))?;
    let file = SafeTensors::deserialize(&bytes)
        .map_err(|e| io_error(OP, path, format!("not a valid safetensors file: {e}")))?;
    let state = named_state(module);
    let mut skipped: Vec<String> = file
        .names()
        .into_iter()
        .filter(|name| !state.iter().any(|(own, _)| own == *name))
        .map(str::to_string)
        .collect();
    skipped.sort();
    let mut staged: Vec<(Tensor, Tensor)> = Vec::new();
    for (name, param) in state {
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
    if options.strict && !skipped.is_empty() {
        return Err(io_error(
            OP,
            path,
            format!(
                "holds tensors the module does not have: {skipped:?} (pass LoadOptions {{ \
                 strict: false }} to io::load_with to skip them)"
            ),
        ));
    }
    crate::no_grad(|| {
        staged
            .iter()
            .try_for_each(|(param, values)| param.copy_(values))
    })?;
    Ok(skipped)
}
