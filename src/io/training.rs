//! Training state: everything a run needs to go on as if it had never stopped (the model's
//! parameters and buffers, the optimizer's state, the step count, the global generator) in
//! one safetensors file, its scalars in the header's metadata. Written atomically, as
//! checkpoints are.

use std::collections::HashMap;
use std::path::Path;

use safetensors::tensor::{Dtype, SafeTensors};

use crate::autograd::no_grad;
use crate::error::Result;
use crate::io::checkpoint::{encode, file_tensor, named_state, read_safetensors, write_atomically};
use crate::io::io_error;
use crate::nn::Module;
use crate::optim::{GradScaler, Optimizer, OptimizerState};
use crate::tensor::{DType, Tensor};

/// The header's tag of a training-state file.
const FORMAT: &str = "wgrad-training-state-1";

/// Saves `model`'s parameters and buffers (as `model.<name>`), `opt`'s state (its tensors as
/// `optim.<name>`, its scalars, each parameter's group settings), the step count `step` and
/// the global generator's state to `path`, so that [`load_training`] resumes the same run:
/// bit for bit, eager or captured.
///
/// ```
/// # fn main() -> wgrad::Result<()> {
/// use wgrad::{io, nn::{self, Module}, optim::{self, Optimizer}};
/// let dev = wgrad::Device::new()?;
/// let model = nn::Linear::new(4, 2, true, &dev)?;
/// let mut opt = optim::AdamW::new(model.parameters(), Default::default());
/// let path = std::env::temp_dir().join("wgrad-doc-run.safetensors");
/// io::save_training(&path, &model, &opt, 17)?;
/// assert_eq!(io::load_training(&path, &model, &mut opt)?, 17);
/// # Ok(())
/// # }
/// ```
pub fn save_training(
    path: impl AsRef<Path>,
    model: &dyn Module,
    opt: &dyn Optimizer,
    step: u64,
) -> Result<()> {
    save("io::save_training", path.as_ref(), model, opt, None, step)
}

/// As [`save_training`], with a mixed-precision run's [`GradScaler`] (its scale, its count of
/// good steps, its options) beside the optimizer.
pub fn save_training_with_scaler(
    path: impl AsRef<Path>,
    model: &dyn Module,
    opt: &dyn Optimizer,
    scaler: &GradScaler,
    step: u64,
) -> Result<()> {
    let op = "io::save_training_with_scaler";
    save(op, path.as_ref(), model, opt, Some(scaler), step)
}

fn save(
    op: &'static str,
    path: &Path,
    model: &dyn Module,
    opt: &dyn Optimizer,
    scaler: Option<&GradScaler>,
    step: u64,
) -> Result<()> {
    let state = opt.state();
    let mut tensors: Vec<(String, Tensor)> = named_state(model)
        .into_iter()
        .map(|(n, t)| (format!("model.{n}"), t))
        .collect();
    tensors.extend(
        state
            .tensors
            .iter()
            .map(|(n, t)| (format!("optim.{n}"), t.clone())),
    );
    let mut meta: HashMap<String, String> = HashMap::new();
    meta.insert("format".into(), FORMAT.into());
    meta.insert("step".into(), step.to_string());
    meta.insert("rng".into(), crate::seed::rng_state().to_string());
    meta.insert("optim.kind".into(), state.kind.clone());
    meta.insert("optim.shapes".into(), format!("{:?}", state.shapes));
    for (name, value) in &state.scalars {
        meta.insert(format!("optim.{name}"), value.clone());
    }
    for (name, value) in scaler.map(GradScaler::state).unwrap_or_default() {
        meta.insert(format!("scaler.{name}"), value);
    }
    let encoded = encode(op, path, &tensors, Some(meta))?;
    write_atomically(op, path, &encoded)
}

/// Restores what [`save_training`] wrote into `model` and `opt` and returns the step count.
/// Everything is checked before anything changes (the file's tag, the optimizer's kind and
/// parameter shapes, every model tensor present with its shape), so an error names what
/// differs and leaves the model, the optimizer and the generator exactly as they were.
pub fn load_training(
    path: impl AsRef<Path>,
    model: &dyn Module,
    opt: &mut dyn Optimizer,
) -> Result<u64> {
    load("io::load_training", path.as_ref(), model, opt, None)
}

/// As [`load_training`], restoring the [`GradScaler`] that
/// [`save_training_with_scaler`] saved too; a file without one is an error that changes
/// nothing.
pub fn load_training_with_scaler(
    path: impl AsRef<Path>,
    model: &dyn Module,
    opt: &mut dyn Optimizer,
    scaler: &mut GradScaler,
) -> Result<u64> {
    let op = "io::load_training_with_scaler";
    load(op, path.as_ref(), model, opt, Some(scaler))
}

fn load(
    op: &'static str,
    path: &Path,
    model: &dyn Module,
    opt: &mut dyn Optimizer,
    scaler: Option<&mut GradScaler>,
) -> Result<u64> {
    let fail = |msg: String| io_error(op, path, msg);
    let bytes = read_safetensors(op, path)?;
    let file = SafeTensors::deserialize(&bytes)
        .map_err(|e| fail(format!("not a valid safetensors file: {e}")))?;
    let (_, header) = SafeTensors::read_metadata(&bytes)
        .map_err(|e| fail(format!("not a valid safetensors file: {e}")))?;
    let meta = header.metadata().clone().unwrap_or_default();
    let get = |key: &str| {
        meta.get(key)
            .ok_or_else(|| fail(format!("not a training state: no {key:?} in its header")))
    };
    if get("format")? != FORMAT {
        return Err(fail(format!(
            "not a training state of this version: {:?}",
            meta.get("format")
        )));
    }
    let count = |key: &str| -> Result<u64> {
        let v = get(key)?;
        v.parse()
            .map_err(|_| fail(format!("{key:?} is {v:?}, not a count")))
    };
    let step = count("step")?;
    let rng = count("rng")?;
    let device = match model.parameters().first() {
        Some(p) => p.device().clone(),
        None => crate::Device::new()?,
    };
    // A saved tensor of `shape` in `dtype` (F16 and BF16 tensors are saved as they are).
    let read = |name: &str, shape: &[usize], dtype: DType| -> Result<Option<Tensor>> {
        let Ok(view) = file.tensor(name) else {
            return Ok(None);
        };
        let float = matches!(view.dtype(), Dtype::F32 | Dtype::F16 | Dtype::BF16);
        if !float || view.shape() != shape {
            return Err(fail(format!(
                "{name:?} is {:?} {:?}, expected a float tensor of shape {shape:?}",
                view.dtype(),
                view.shape()
            )));
        }
        let saved = file_tensor(&view, &device).expect("a float dtype")?;
        Ok(Some(saved.to_dtype(dtype)?))
    };
    // The model's tensors, staged.
    let mut staged = Vec::new();
    for (name, t) in named_state(model) {
        let key = format!("model.{name}");
        let saved = read(&key, t.shape(), t.dtype())?.ok_or_else(|| {
            fail(format!(
                "the model's {name:?} ({:?}) is not in the file",
                t.shape()
            ))
        })?;
        staged.push((t, saved));
    }
    // The optimizer's state, as its own state says it is laid out.
    let own = opt.state();
    let mut tensors = Vec::new();
    for name in file.names() {
        if let Some(short) = name.strip_prefix("optim.") {
            let view = file.tensor(name).expect("named by the file");
            let shape = view.shape().to_vec();
            let t = read(name, &shape, DType::F32)?.expect("named by the file");
            tensors.push((short.to_string(), t));
        }
    }
    let scalars = meta
        .iter()
        .filter_map(|(k, v)| k.strip_prefix("optim.").map(|k| (k.to_string(), v.clone())))
        .collect();
    let saved = OptimizerState {
        kind: get("optim.kind")?.clone(),
        shapes: own.shapes.clone(),
        scalars,
        tensors,
    };
    if get("optim.kind")? != &own.kind {
        return Err(fail(format!(
            "the file holds a {} state, the optimizer is {}",
            get("optim.kind")?,
            own.kind
        )));
    }
    if get("optim.shapes")? != &format!("{:?}", own.shapes) {
        return Err(fail(format!(
            "the optimizer state is for parameters {}, the optimizer has {:?}",
            get("optim.shapes")?,
            own.shapes
        )));
    }
    // The scaler's state, checked on a copy before anything changes.
    let restored_scaler = match scaler.as_deref() {
        None => None,
        Some(current) => {
            let state: Vec<(String, String)> = meta
                .iter()
                .filter_map(|(k, v)| k.strip_prefix("scaler.").map(|k| (k.into(), v.clone())))
                .collect();
            if state.is_empty() {
                return Err(fail("the file holds no GradScaler state".into()));
            }
            let mut restored = current.clone();
            restored.load_state(&state)?;
            Some(restored)
        }
    };
    // The optimizer checks its state whole before taking it; then nothing else can fail.
    opt.load_state(&saved)?;
    if let (Some(scaler), Some(restored)) = (scaler, restored_scaler) {
        *scaler = restored;
    }
    no_grad(|| staged.iter().try_for_each(|(t, saved)| t.copy_(saved)))?;
    crate::seed::set_rng_state(rng);
    Ok(step)
}
