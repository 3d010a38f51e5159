//! Optimizers that update parameters in place, one fused WGSL kernel per parameter per step
//! (`shaders/optim.wgsl`), with their state on the device; gradient clipping; LR schedules.

mod adam;
mod clip;
mod group;
mod scaler;
mod schedule;
mod sgd;

pub use adam::{Adam, AdamConfig, AdamW};
pub use clip::clip_grad_norm;
pub use group::ParamGroup;
pub use scaler::{GradScaler, GradScalerOptions};
pub use schedule::{CosineLr, LrSchedule, StepLr, Warmup};
pub use sgd::{Sgd, SgdConfig};

use crate::error::{Error, Result};
use crate::kernel::{
    groups, windows, Kernel, KernelParams, Launch, ShaderFamily, CONTIGUOUS_PER_GROUP,
};
use crate::tensor::Tensor;

crate::kernel_params! {
    /// `sgd` and `sgd_momentum`: flags 1 nesterov, 2 first step.
    pub(crate) struct SgdParams {
        n: u32, lr: f32, weight_decay: f32, momentum: f32, dampening: f32, flags: u32,
    }
}

crate::kernel_params! {
    /// `adam`: bias corrections are `1 - beta^t`; flag 4 is AdamW's decoupled weight decay.
    pub(crate) struct AdamParams {
        n: u32, lr: f32, weight_decay: f32, beta1: f32, beta2: f32, eps: f32,
        bias_correction1: f32, bias_correction2: f32, flags: u32,
    }
}

static OPTIM: ShaderFamily = ShaderFamily {
    name: "optim",
    wgsl: include_str!("../../shaders/optim.wgsl"),
    params: &[&SgdParams::LAYOUT, &AdamParams::LAYOUT],
    preludes: &[],
};

#[cfg(test)]
pub(crate) fn kernel_sources() -> Vec<(String, String)> {
    vec![("optim".into(), OPTIM.source(&[]))]
}

#[cfg(test)]
pub(crate) use scaler::kernel_sources as scaler_kernel_sources;

/// An optimizer: `step()` updates every parameter that has a grad, in place (the parameters'
/// storage never changes); `zero_grad()` empties their grad slots.
pub trait Optimizer {
    /// One update of every parameter that has a grad.
    fn step(&mut self) -> Result<()>;

    /// Sets every parameter's grad slot to `None`.
    fn zero_grad(&mut self);

    /// The parameters it updates, each once (torch's `param_groups`, flattened): what a
    /// [`GradScaler`] unscales.
    fn parameters(&self) -> Vec<Tensor>;

    /// The learning rate the next step uses.
    fn lr(&self) -> f32;

    /// Changes the learning rate (for schedules).
    fn set_lr(&mut self, lr: f32);

    /// What a training state saves of the optimizer (see `io::save_training`).
    fn state(&self) -> OptimizerState;

    /// Restores a state [`Optimizer::state`] gave, checked whole first (the optimizer's kind,
    /// its parameters' count and shapes), so an error changes nothing.
    fn load_state(&mut self, state: &OptimizerState) -> Result<()>;
}

/// An optimizer's state: its kind, its scalars (step count, base rate, each parameter's group
/// settings; floats as their bits, so a resume is exact) and its per-parameter tensors
/// (moments, momentum buffers) named `"<parameter index>.<what>"`, as torch's `state_dict`.
#[derive(Clone)]
pub struct OptimizerState {
    /// `"Sgd"`, `"Adam"` or `"AdamW"`.
    pub kind: String,
    /// The shapes of the parameters, in order.
    pub shapes: Vec<Vec<usize>>,
    /// Named scalars.
    pub scalars: Vec<(String, String)>,
    /// Named tensors.
    pub tensors: Vec<(String, Tensor)>,
}

impl OptimizerState {
    /// The scalar `name`, or an error naming it.
    pub(crate) fn scalar(&self, name: &str) -> Result<&str> {
        self.scalars
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
            .ok_or_else(|| self.mismatch(format!("no {name:?} in the saved state")))
    }

    /// The scalar `name` as a u64, or an error.
    pub(crate) fn scalar_u64(&self, name: &str) -> Result<u64> {
        let v = self.scalar(name)?;
        v.parse()
            .map_err(|_| self.mismatch(format!("{name:?} is {v:?}, not a count")))
    }

    /// The f32 whose bits the scalar `name` holds.
    pub(crate) fn scalar_f32(&self, name: &str) -> Result<f32> {
        let v = self.scalar(name)?;
        u32::from_str_radix(v, 16)
            .map(f32::from_bits)
            .map_err(|_| self.mismatch(format!("{name:?} is {v:?}, not f32 bits")))
    }

    /// The tensor `name`, if saved, checked to have `shape`.
    pub(crate) fn tensor(&self, name: &str, shape: &[usize]) -> Result<Option<&Tensor>> {
        match self.tensors.iter().find(|(n, _)| n == name) {
            None => Ok(None),
            Some((_, t)) if t.shape() == shape => Ok(Some(t)),
            Some((_, t)) => Err(self.mismatch(format!(
                "{name:?} has shape {:?}, the parameter {shape:?}",
                t.shape()
            ))),
        }
    }

    /// Errors unless the state is of `kind` over parameters of `shapes`.
    pub(crate) fn expect(&self, kind: &str, shapes: &[Vec<usize>]) -> Result<()> {
        if self.kind != kind {
            return Err(self.mismatch(format!("a {} state cannot load into {kind}", self.kind)));
        }
        if self.shapes != shapes {
            return Err(self.mismatch(format!(
                "the state is for {} parameters of shapes {:?}, the optimizer has {} of {:?}",
                self.shapes.len(),
                self.shapes,
                shapes.len(),
                shapes
            )));
        }
        Ok(())
    }

    fn mismatch(&self, msg: String) -> Error {
        Error::InvalidArgument {
            op: "Optimizer::load_state",
            msg,
        }
    }
}

/// An f32 as the hex of its bits (a scalar of [`OptimizerState`]).
pub(crate) fn bits(x: f32) -> String {
    format!("{:08x}", x.to_bits())
}

/// The shapes of `params`.
pub(crate) fn shapes_of(params: &[Tensor]) -> Vec<Vec<usize>> {
    params.iter().map(|p| p.shape().to_vec()).collect()
}

/// Locks state an optimizer or scaler shares with a captured step's replays (hyperparameters,
/// the device scale), poisoned or not.
fn lock<T>(shared: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    shared.lock().unwrap_or_else(|e| e.into_inner())
}

fn zero_grads(params: &[Tensor]) {
    for p in params {
        p.zero_grad();
    }
}

/// Errors when `params` lists one tensor twice (a tied weight listed per use): each listing
/// would update it, twice per step. `nn::Module::parameters` lists it once.
fn check_distinct(op: &'static str, params: &[Tensor]) -> Result<()> {
    let mut seen = std::collections::HashMap::new();
    for (i, p) in params.iter().enumerate() {
        if let Some(first) = seen.insert(std::sync::Arc::as_ptr(&p.inner), i) {
            return Err(Error::InvalidArgument {
                op,
                msg: format!(
                    "parameters {first} and {i} are one tensor (shape {:?}): it would be \
                     updated twice per step; list it once (Module::parameters does)",
                    p.shape()
                ),
            });
        }
    }
    Ok(())
}

/// Errors unless `value` is finite and non-negative, naming the optimizer. A rate of 0 is
/// valid, as in torch: schedules end there (`CosineLr`'s `min_lr` of 0).
fn check_hyper(op: &'static str, name: &str, value: f32) -> Result<()> {
    if !(value.is_finite() && value >= 0.0) {
        return Err(Error::InvalidArgument {
            op,
            msg: format!("{name} must be finite and >= 0, got {value}"),
        });
    }
    Ok(())
}

/// Runs one fused update `entry` on `param` (and its state tensors, bound at 3 and 4).
/// `params(n)` gives the kernel's params for `n` elements, reading the optimizer's
/// hyperparameters when called, so that a captured step's replays use the learning rate and
/// step count of their own step. A parameter larger than one binding is updated one window at
/// a time.
fn run_update<P: KernelParams>(
    op: &'static str,
    entry: &'static str,
    param: &Tensor,
    grad: &Tensor,
    state: &[&Tensor],
    params: impl Fn(u32) -> P + Send + Sync + Clone + 'static,
) -> Result<()> {
    param.expect_dtype(op, crate::tensor::DType::F32)?;
    if !param.is_contiguous() || param.layout().offset != 0 {
        return Err(Error::InvalidArgument {
            op,
            msg: format!(
                "parameter of shape {:?} must own its contiguous storage",
                param.shape()
            ),
        });
    }
    if grad.shape() != param.shape() {
        return Err(Error::Shape {
            op,
            msg: format!(
                "grad of shape {:?} for a parameter of shape {:?}",
                grad.shape(),
                param.shape()
            ),
        });
    }
    let n = param.numel();
    if n == 0 {
        return Ok(());
    }
    // The kernel reads the grad densely from the start of its buffer, and may not bind the
    // parameter's buffer twice.
    let dense = grad.is_contiguous() && grad.layout().offset == 0;
    let grad = if dense && grad.storage_id() != param.storage_id() {
        grad.clone()
    } else {
        grad.deep_clone()?
    };
    // Each entry point runs its `*_part` over its workgroups: a captured step merges the
    // updates of consecutive parameters into one launch.
    let part = match entry {
        "sgd" => "sgd_part",
        "sgd_momentum" => "sgd_momentum_part",
        "adam" => "adam_part",
        other => unreachable!("optim.wgsl has no entry point {other}"),
    };
    let kernel = Kernel::plain(&OPTIM, entry).merging(part);
    if !param.exceeds_binding() && !grad.exceeds_binding() {
        let mut bindings = vec![(1, param), (2, &grad)];
        bindings.extend(state.iter().enumerate().map(|(i, t)| (3 + i as u32, *t)));
        let all = n as u32;
        let workgroups = groups(n, CONTIGUOUS_PER_GROUP);
        return Launch::new_dynamic(op, &kernel, &bindings, move || params(all)).record(workgroups);
    }
    // Past one binding: windows of the parameter, its grad and its state (all offset 0, so
    // every window starts on an alignment boundary, as the kernel's dense reads need).
    for (start, len) in windows(param.device(), n) {
        let (p, g) = (param.window(start, len), grad.window(start, len));
        let states: Vec<Tensor> = state.iter().map(|t| t.window(start, len)).collect();
        let mut bindings = vec![(1, &p), (2, &g)];
        bindings.extend(states.iter().enumerate().map(|(i, t)| (3 + i as u32, t)));
        let params = params.clone();
        let workgroups = groups(len, CONTIGUOUS_PER_GROUP);
        Launch::new_dynamic(op, &kernel, &bindings, move || params(len as u32))
            .record(workgroups)?;
    }
    Ok(())
}
