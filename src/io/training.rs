//! Training state: everything a run needs to go on as if it had never stopped (the model's
//! parameters and buffers, the optimizer's state, the step count, the global generator) in
//! one safetensors file, its scalars in the header's metadata. Written atomically, as
//! checkpoints are.

use std::collections::HashMap;
use std::path::Path;

use safetensors::tensor::{Dtype, SafeTensors};

use crate::autograd::no_grad;
use crate::error::Result;
use crate::io::checkpoint::{encode, named_state, read_safetensors, write_atomically};
use crate::io::io_error;
use crate::nn::Module;
use crate::optim::{Optimizer, OptimizerState};
use crate::tensor::Tensor;

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
    const OP: &str = "io::save_training";
    let path = path.as_ref();
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
    let encoded = encode(OP, path, &tensors, Some(meta))?;
    write_atomically(OP, path, &encoded)
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
    const OP: &str = "io::load_training";
    let path = path.as_ref();
    let fail = |msg: String| io_error(OP, path, msg);
    let bytes = read_safetensors(OP, path)?;
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
    let read = |name: &str, shape: &[usize]| -> Result<Option<Tensor>> {
        let Ok(view) = file.tensor(name) else {
            return Ok(None);
        };
        if view.dtype() != Dtype::F32 || view.shape() != shape {
            return Err(fail(format!(
                "{name:?} is {:?} {:?}, expected F32 {shape:?}",
                view.dtype(),
                view.shape()
            )));
        }
        let values = bytemuck::pod_collect_to_vec::<u8, f32>(view.data());
        Ok(Some(Tensor::from_vec(values, shape, &device)?))
    };
    // The model's tensors, staged.
    let mut staged = Vec::new();
    for (name, t) in named_state(model) {
        let key = format!("model.{name}");
        let saved = read(&key, t.shape())?.ok_or_else(|| {
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
            let t = read(name, &shape)?.expect("named by the file");
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
    // The optimizer checks its state whole before taking it; then nothing else can fail.
    opt.load_state(&saved)?;
    no_grad(|| staged.iter().try_for_each(|(t, saved)| t.copy_(saved)))?;
    crate::seed::set_rng_state(rng);
    Ok(step)
}
