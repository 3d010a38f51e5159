//! Checkpoints: a module's named parameters as a safetensors file (opens in PyTorch and every
//! other tool that reads safetensors).

use std::collections::HashMap;
use std::io::Write;
use std::path::Path;

use safetensors::tensor::{Dtype, SafeTensors, TensorView};

use crate::device::Device;
use crate::error::{Error, Result};
use crate::io::{io_error, open_with_size};
use crate::nn::Module;
use crate::tensor::{DType, Tensor};

/// The prefix of a writer's temporary files: `.wgrad-<pid>-<random>.tmp` beside the target,
/// short whatever the target's name (a 255-byte name still saves).
fn temporary_prefix(pid: u32) -> String {
    format!(".wgrad-{pid}-")
}

/// Removes the temporary files beside `path` left by writers that died mid-save (their
/// process is gone). Best effort: a file that cannot be checked or removed is left.
fn remove_stale_temporaries(path: &Path) {
    let dir = directory_of(path);
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(rest) = name.to_str().and_then(|n| n.strip_prefix(".wgrad-")) else {
            continue;
        };
        let Some(pid) = rest.split('-').next().and_then(|p| p.parse::<u32>().ok()) else {
            continue;
        };
        if rest.ends_with(".tmp") && pid != std::process::id() && !process_alive(pid) {
            let _ = std::fs::remove_file(entry.path());
        }
    }
}

/// The directory `path` is in (`.` for a bare file name).
fn directory_of(path: &Path) -> &Path {
    match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
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
    std::fs::File::open(directory_of(path))?.sync_all()?;
    #[cfg(not(unix))]
    let _ = path;
    Ok(())
}

/// Writes `bytes` to `path` atomically: into a temporary file of this writer's own (created
/// with `O_EXCL` beside `path`), flushed, renamed over `path`, the directory flushed. Writers
/// racing on one path each rename a complete file, so the file ends as the save whose rename
/// came last; a failed write removes its temporary and leaves `path` as it was.
pub(crate) fn write_atomically(op: &'static str, path: &Path, bytes: &[u8]) -> Result<()> {
    if path.file_name().is_none() {
        return Err(io_error(op, path, "not a file path"));
    }
    remove_stale_temporaries(path);
    let write = || -> std::io::Result<()> {
        let prefix = temporary_prefix(std::process::id());
        let mut builder = tempfile::Builder::new();
        builder.prefix(&prefix).suffix(".tmp");
        // The mode a plain `File::create` gives (0o666 less the umask), not the temporary's
        // private 0o600: a checkpoint is shared like any file.
        #[cfg(unix)]
        builder.permissions(std::os::unix::fs::PermissionsExt::from_mode(0o666));
        let mut file = builder.tempfile_in(directory_of(path))?;
        file.write_all(bytes)?;
        file.as_file().sync_all()?;
        // Dropped unpersisted (an error above), the temporary removes itself.
        file.persist(path).map_err(|e| e.error)?;
        sync_directory(path)
    };
    write().map_err(|e| io_error(op, path, e))
}

/// The largest safetensors header read (the safetensors crate's own limit).
const MAX_HEADER_BYTES: u64 = 100_000_000;

/// A safetensors file's bytes, read no further than its header says it holds: the header's
/// length checked (against the file's size where it has one) before its bytes are read, its
/// tensors' extent before theirs, so an endless stream (`/dev/zero`) or a lying header ends in
/// an error without taking memory. A header naming a tensor twice is an error.
pub(crate) fn read_safetensors(op: &'static str, path: &Path) -> Result<Vec<u8>> {
    use std::io::Read;
    let fail = |msg: String| io_error(op, path, msg);
    let (file, size) = open_with_size(op, path)?;
    let mut reader = std::io::BufReader::new(file);
    let mut read_exactly = |bytes: &mut Vec<u8>, n: u64, what: &str| -> Result<()> {
        let before = bytes.len();
        (&mut reader)
            .take(n)
            .read_to_end(bytes)
            .map_err(|e| io_error(op, path, e))?;
        match (bytes.len() - before) as u64 == n {
            true => Ok(()),
            false => Err(io_error(
                op,
                path,
                format!("truncated: the file ends inside its {what}"),
            )),
        }
    };
    let mut bytes = Vec::new();
    read_exactly(&mut bytes, 8, "header length")?;
    let header_len = u64::from_le_bytes(bytes[..8].try_into().expect("8 bytes"));
    let too_long = header_len > MAX_HEADER_BYTES || size.is_some_and(|s| 8 + header_len > s);
    if header_len < 2 || too_long {
        return Err(fail(format!(
            "not a valid safetensors file: a header of {header_len} bytes in a file of {}",
            size.map_or("unknown size".to_string(), |s| format!("{s} bytes"))
        )));
    }
    read_exactly(&mut bytes, header_len, "header")?;
    let data_len = tensors_extent(&bytes[8..]).map_err(&fail)?;
    if size.is_some_and(|s| 8 + header_len + data_len > s) {
        return Err(fail(format!(
            "truncated: the header places {data_len} bytes of tensors after it, the file has {}",
            size.unwrap_or(0) - 8 - header_len
        )));
    }
    read_exactly(&mut bytes, data_len, "tensors")?;
    Ok(bytes)
}

/// The bytes of tensor data a safetensors header places (its largest end offset), read key by
/// key so that a tensor named twice is an error (a map would keep the last).
fn tensors_extent(header: &[u8]) -> std::result::Result<u64, String> {
    use serde::de::{Deserializer, Error as _, IgnoredAny, MapAccess, Visitor};
    struct Extent;
    impl<'de> Visitor<'de> for Extent {
        type Value = u64;
        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            f.write_str("a map of tensor names to their dtype, shape and data offsets")
        }
        fn visit_map<M: MapAccess<'de>>(self, mut map: M) -> std::result::Result<u64, M::Error> {
            let mut names = std::collections::HashSet::new();
            let mut end = 0;
            while let Some(name) = map.next_key::<String>()? {
                if !names.insert(name.clone()) {
                    return Err(M::Error::custom(format!(
                        "the header names tensor {name:?} twice"
                    )));
                }
                if name == "__metadata__" {
                    map.next_value::<IgnoredAny>()?;
                    continue;
                }
                let info: serde_json::Value = map.next_value()?;
                let offset = |i: usize| info["data_offsets"][i].as_u64();
                match (offset(0), offset(1)) {
                    (Some(_), Some(last)) => end = end.max(last),
                    _ => {
                        return Err(M::Error::custom(format!(
                            "tensor {name:?} has no data offsets"
                        )))
                    }
                }
            }
            Ok(end)
        }
    }
    let mut json = serde_json::Deserializer::from_slice(header);
    json.deserialize_map(Extent)
        .map_err(|e| format!("not a valid safetensors header: {e}"))
}

/// A file's tensor on `device` in its own float dtype: F32, F16 and BF16 as they are, and the
/// integer counts PyTorch saves (I64, I32: `num_batches_tracked`) as F32; `None` for other
/// dtypes.
pub(crate) fn file_tensor(view: &TensorView, device: &Device) -> Option<Result<Tensor>> {
    let shape = view.shape();
    let halves = || -> Vec<u16> { bytemuck::pod_collect_to_vec(view.data()) };
    let f32s = |values: Vec<f32>| Some(Tensor::from_vec(values, shape, device));
    match view.dtype() {
        Dtype::F32 => f32s(bytemuck::pod_collect_to_vec(view.data())),
        Dtype::F16 => Some(Tensor::from_vec_f16(
            halves().into_iter().map(half::f16::from_bits).collect(),
            shape,
            device,
        )),
        Dtype::BF16 => Some(Tensor::from_vec_bf16(
            halves().into_iter().map(half::bf16::from_bits).collect(),
            shape,
            device,
        )),
        Dtype::I64 => f32s(
            bytemuck::pod_collect_to_vec::<u8, i64>(view.data())
                .into_iter()
                .map(|v| v as f32)
                .collect(),
        ),
        Dtype::I32 => f32s(
            bytemuck::pod_collect_to_vec::<u8, i32>(view.data())
                .into_iter()
                .map(|v| v as f32)
                .collect(),
        ),
        _ => None,
    }
}

/// What a checkpoint holds: the parameters, then the buffers.
pub(crate) fn named_state(module: &dyn Module) -> Vec<(String, Tensor)> {
    let mut state = module.named_parameters();
    state.extend(module.named_buffers());
    state
}

/// A tensor read back as the safetensors dtype and bytes it is saved as: F16 and BF16 as they
/// are, every other dtype as F32 (as before 16-bit tensors existed).
fn stored_bytes(t: &Tensor) -> Result<(Dtype, Vec<u8>)> {
    let bits = |halves: Vec<u16>| bytemuck::cast_slice(&halves).to_vec();
    Ok(match t.dtype() {
        DType::F16 => (
            Dtype::F16,
            bits(t.to_vec_f16()?.iter().map(|h| h.to_bits()).collect()),
        ),
        DType::BF16 => (
            Dtype::BF16,
            bits(t.to_vec_bf16()?.iter().map(|h| h.to_bits()).collect()),
        ),
        _ => (Dtype::F32, bytemuck::cast_slice(&t.to_vec()?).to_vec()),
    })
}

/// `tensors` read back and encoded as safetensors (F16 and BF16 as they are, others as F32) with `metadata` in the header; two
/// tensors of one name are an error naming it (a file holds one per name).
pub(crate) fn encode(
    op: &'static str,
    path: &Path,
    tensors: &[(String, Tensor)],
    metadata: Option<HashMap<String, String>>,
) -> Result<Vec<u8>> {
    let mut seen = std::collections::HashSet::new();
    if let Some((name, _)) = tensors.iter().find(|(name, _)| !seen.insert(name.as_str())) {
        return Err(io_error(
            op,
            path,
            format!("two tensors are named {name:?}: a file holds one per name"),
        ));
    }
    let values = tensors
        .iter()
        .map(|(_, t)| stored_bytes(t))
        .collect::<Result<Vec<_>>>()?;
    let views = tensors
        .iter()
        .zip(&values)
        .map(|((name, t), (dtype, bytes))| {
            let view = TensorView::new(*dtype, t.shape().to_vec(), bytes)
                .map_err(|e| io_error(op, path, e))?;
            Ok((name.clone(), view))
        })
        .collect::<Result<Vec<_>>>()?;
    safetensors::serialize(views, metadata).map_err(|e| io_error(op, path, e))
}

/// Writes `module`'s named parameters and buffers to `path` as safetensors (F16 and BF16
/// tensors in their dtype, the others as F32), atomically
/// (through a temporary file of its own, renamed over `path`): a crash never leaves a
/// half-written checkpoint, and concurrent saves to one path leave one complete file, the
/// save whose rename came last. A name given twice by the module is an error naming it.
pub fn save(path: impl AsRef<Path>, module: &dyn Module) -> Result<()> {
    const OP: &str = "io::save";
    let path = path.as_ref();
    let encoded = encode(OP, path, &named_state(module), None)?;
    write_atomically(OP, path, &encoded)
}

/// How [`load_with`] treats tensors in the file that the module does not have.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LoadOptions {
    /// `true` (as [`load`]): such tensors are an error. `false`: they are skipped, and
    /// [`load_with`] returns their names.
    pub strict: bool,
}

/// Reads the parameters and buffers of `module` from the safetensors file at `path`, by name.
/// Every tensor is checked first (present, F32, F16 or BF16, right shape, and no tensor in
/// the file that the module lacks), so on any error the module is left unchanged; the error
/// names the tensor. Values take the parameter's dtype: an F16 or BF16 tensor loads into an
/// F32 parameter exactly, and into one of its own dtype as it is.
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
    let bytes = read_safetensors(OP, path)?;
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
        let Some(values) = file_tensor(&view, param.device()) else {
            return Err(io_error(
                OP,
                path,
                format!(
                    "tensor {name:?} is {:?}, expected F32, F16 or BF16 (or an integer count, \
                     as PyTorch saves num_batches_tracked)",
                    view.dtype()
                ),
            ));
        };
        // In the parameter's dtype: an F16 file into an F32 parameter converts exactly, an
        // F32 file into an F16 parameter rounds as torch's `.half()`.
        staged.push((param.clone(), values?.to_dtype(param.dtype())?));
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
