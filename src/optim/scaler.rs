//! `GradScaler`: dynamic loss scaling for 16-bit training, as `torch.amp.GradScaler`.

use crate::autograd::NoGradGuard;
use crate::error::{Error, Result};
use crate::kernel::{
    groups, windows, Kernel, KernelParams, Launch, ShaderFamily, CONTIGUOUS_PER_GROUP,
};
use crate::optim::{lock, Optimizer};
use crate::tensor::{DType, Tensor};
use std::sync::Mutex;

crate::kernel_params! {
    /// `unscale`: `n` grad elements from element `offset` multiplied by `inv_scale`.
    pub(crate) struct UnscaleParams { n: u32, offset: u32, inv_scale: f32 }
}

static GRAD_SCALE: ShaderFamily = ShaderFamily {
    name: "grad_scale",
    wgsl: include_str!("../../shaders/grad_scale.wgsl"),
    params: &[&UnscaleParams::LAYOUT],
    preludes: &[],
};

#[cfg(test)]
pub(crate) fn kernel_sources() -> Vec<(String, String)> {
    vec![("grad_scale".into(), GRAD_SCALE.source(&[]))]
}

/// How a [`GradScaler`] scales: torch.amp's defaults.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GradScalerOptions {
    /// The first scale (65,536).
    pub init_scale: f32,
    /// The scale is multiplied by it after `growth_interval` steps without inf or NaN (2).
    pub growth_factor: f32,
    /// The scale is multiplied by it after a step with inf or NaN (0.5).
    pub backoff_factor: f32,
    /// Good steps in a row before the scale grows (2,000).
    pub growth_interval: u32,
}

impl Default for GradScalerOptions {
    fn default() -> Self {
        GradScalerOptions {
            init_scale: 65536.0,
            growth_factor: 2.0,
            backoff_factor: 0.5,
            growth_interval: 2000,
        }
    }
}

/// Dynamic loss scaling: the loss is multiplied by a large scale before `backward`, so that
/// small 16-bit grads do not flush to zero; `step` divides the grads by it on the device,
/// checks them all for inf and NaN, and skips the optimizer's step when it finds one;
/// `update` halves the scale after such a step and doubles it after 2,000 good ones.
///
/// `step` reads one flag back from the device (as torch's does), so a scaled step runs
/// eagerly, not captured.
///
/// ```
/// # fn main() -> wgrad::Result<()> {
/// use wgrad::optim::{GradScaler, Optimizer, Sgd, SgdConfig};
/// use wgrad::{Device, Tensor};
/// let dev = Device::new()?;
/// let w = Tensor::ones(&[3], &dev)?.requires_grad_(true);
/// let mut opt = Sgd::new(vec![w.clone()], SgdConfig { lr: 0.1, ..Default::default() });
/// let mut scaler = GradScaler::new();
/// let loss = w.mul_scalar(2.0)?.sum()?;
/// scaler.scale(&loss)?.backward()?;
/// assert!(scaler.step(&mut opt)?);      // stepped: the grads were finite
/// scaler.update()?;
/// assert_eq!(w.to_vec()?, vec![0.8; 3]); // 1 - 0.1 x 2: the grad was unscaled first
/// # Ok(())
/// # }
/// ```
#[derive(Debug)]
pub struct GradScaler {
    options: GradScalerOptions,
    scale: f32,
    /// Good steps since the scale last changed.
    growth_tracker: u32,
    /// Whether the last `step` found inf or NaN; `None` until a step, and after `update`.
    found_inf: Option<bool>,
    /// `scale` as a 0-d tensor on the device of the losses `scale` multiplies, made at the
    /// first of them and rewritten whenever the scale changes: a captured step that scales its
    /// loss reads it at every replay (a host scalar would be replayed as captured), as torch
    /// keeps its scale on the device for CUDA graphs.
    on_device: Mutex<Option<Tensor>>,
}

impl Clone for GradScaler {
    /// An independent scaler at the same scale (with a device scale of its own).
    fn clone(&self) -> GradScaler {
        GradScaler {
            options: self.options,
            scale: self.scale,
            growth_tracker: self.growth_tracker,
            found_inf: self.found_inf,
            on_device: Mutex::new(None),
        }
    }
}

impl Default for GradScaler {
    fn default() -> Self {
        GradScaler::new()
    }
}

impl GradScaler {
    /// A scaler with torch.amp's defaults.
    pub fn new() -> GradScaler {
        GradScaler::with_options(GradScalerOptions::default()).expect("the defaults are valid")
    }

    /// A scaler with `options`; a scale or factor that is not finite and positive (a growth
    /// factor not above 1, a backoff not below 1) or a zero interval is an error.
    pub fn with_options(options: GradScalerOptions) -> Result<GradScaler> {
        let o = &options;
        let problem = if !(o.init_scale.is_finite() && o.init_scale > 0.0) {
            Some(format!(
                "init_scale must be finite and positive, got {}",
                o.init_scale
            ))
        } else if !(o.growth_factor.is_finite() && o.growth_factor > 1.0) {
            Some(format!(
                "growth_factor must be finite and above 1, got {}",
                o.growth_factor
            ))
        } else if !(o.backoff_factor > 0.0 && o.backoff_factor < 1.0) {
            Some(format!(
                "backoff_factor must be in (0, 1), got {}",
                o.backoff_factor
            ))
        } else if o.growth_interval == 0 {
            Some("growth_interval must be at least 1".to_string())
        } else {
            None
        };
        if let Some(msg) = problem {
            return Err(Error::InvalidArgument {
                op: "GradScaler::with_options",
                msg,
            });
        }
        Ok(GradScaler {
            options,
            scale: options.init_scale,
            growth_tracker: 0,
            found_inf: None,
            on_device: Mutex::new(None),
        })
    }

    /// The current scale.
    pub fn scale_factor(&self) -> f32 {
        self.scale
    }

    /// What a training state saves of the scaler: its scale, its count of good steps and its
    /// options (floats as their bits, so a resume is exact), by name.
    pub fn state(&self) -> Vec<(String, String)> {
        let o = &self.options;
        let bits = |x: f32| format!("{:08x}", x.to_bits());
        vec![
            ("scale".into(), bits(self.scale)),
            ("growth_tracker".into(), self.growth_tracker.to_string()),
            ("growth_factor".into(), bits(o.growth_factor)),
            ("backoff_factor".into(), bits(o.backoff_factor)),
            ("growth_interval".into(), o.growth_interval.to_string()),
        ]
    }

    /// Restores a [`GradScaler::state`], checked whole first: a missing or malformed value,
    /// or one a scaler cannot hold, is an error that changes nothing.
    pub fn load_state(&mut self, state: &[(String, String)]) -> Result<()> {
        let fail = |msg: String| Error::InvalidArgument {
            op: "GradScaler::load_state",
            msg,
        };
        let get = |name: &str| -> Result<&str> {
            state
                .iter()
                .find(|(n, _)| n == name)
                .map(|(_, v)| v.as_str())
                .ok_or_else(|| fail(format!("no {name:?} in the saved state")))
        };
        let float = |name: &str| -> Result<f32> {
            let v = get(name)?;
            u32::from_str_radix(v, 16)
                .map(f32::from_bits)
                .map_err(|_| fail(format!("{name:?} is {v:?}, not f32 bits")))
        };
        let count = |name: &str| -> Result<u32> {
            let v = get(name)?;
            v.parse()
                .map_err(|_| fail(format!("{name:?} is {v:?}, not a count")))
        };
        let options = GradScalerOptions {
            init_scale: float("scale")?,
            growth_factor: float("growth_factor")?,
            backoff_factor: float("backoff_factor")?,
            growth_interval: count("growth_interval")?,
        };
        let growth_tracker = count("growth_tracker")?;
        // The checks of `with_options`, on the saved scale as the first one.
        let restored = GradScaler::with_options(options)?;
        if growth_tracker >= options.growth_interval {
            return Err(fail(format!(
                "growth_tracker {growth_tracker} is not below growth_interval {}",
                options.growth_interval
            )));
        }
        // The device scale stays the one captured steps read, holding the restored scale.
        let on_device = std::mem::take(&mut *lock(&self.on_device));
        *self = GradScaler {
            growth_tracker,
            options: GradScalerOptions {
                init_scale: self.options.init_scale,
                ..options
            },
            on_device: Mutex::new(on_device),
            ..restored
        };
        self.write_scale()
    }

    /// `loss` times the scale, to call `backward` on: a product with the scale on the device,
    /// so that a captured step replays with the scale of its own call.
    pub fn scale(&self, loss: &Tensor) -> Result<Tensor> {
        let scale = {
            let mut held = lock(&self.on_device);
            match held.as_ref() {
                Some(t) if crate::Device::same(t.device(), loss.device()) => t.clone(),
                _ => held
                    .insert(Tensor::full(&[], self.scale, loss.device())?)
                    .clone(),
            }
        };
        match loss.dtype() {
            DType::F32 => loss.mul(&scale),
            dtype => loss.mul(&scale.to_dtype(dtype)?),
        }
    }

    /// Writes `scale` into the device scale, if one was made.
    fn write_scale(&self) -> Result<()> {
        match lock(&self.on_device).as_ref() {
            Some(t) => {
                let _no_grad = NoGradGuard::new();
                t.copy_(&Tensor::full(&[], self.scale, t.device())?)
            }
            None => Ok(()),
        }
    }

    /// Divides the grads of `opt`'s parameters by the scale (on the device, in place), and
    /// runs `opt.step()` unless one of them holds inf or NaN: then the parameters and the
    /// optimizer's state stay as they were. Returns whether it stepped.
    pub fn step(&mut self, opt: &mut dyn Optimizer) -> Result<bool> {
        const OP: &str = "GradScaler::step";
        let grads: Vec<Tensor> = opt.parameters().iter().filter_map(|p| p.grad()).collect();
        let Some(first) = grads.first() else {
            return Err(Error::InvalidArgument {
                op: OP,
                msg: "no parameter has a grad: call backward on the scaled loss first".into(),
            });
        };
        let found = Tensor::from_vec_u32(vec![0], &[1], first.device())?;
        {
            let _no_grad = NoGradGuard::new();
            for grad in &grads {
                unscale(OP, grad, 1.0 / self.scale, &found)?;
            }
        }
        let found_inf = found.to_vec_u32()?[0] != 0;
        self.found_inf = Some(found_inf);
        if !found_inf {
            opt.step()?;
        }
        Ok(!found_inf)
    }

    /// Adjusts the scale after a `step`: times the backoff factor if that step found inf or
    /// NaN, times the growth factor after `growth_interval` good steps in a row, and writes
    /// it to the device scale (an error there is the device's). Without a step since the
    /// last update it does nothing.
    pub fn update(&mut self) -> Result<()> {
        let before = self.scale;
        match self.found_inf.take() {
            None => return Ok(()),
            Some(true) => {
                self.scale *= self.options.backoff_factor;
                self.growth_tracker = 0;
            }
            Some(false) => {
                self.growth_tracker += 1;
                if self.growth_tracker == self.options.growth_interval {
                    self.scale *= self.options.growth_factor;
                    self.growth_tracker = 0;
                }
            }
        }
        match self.scale == before {
            true => Ok(()),
            false => self.write_scale(),
        }
    }
}

/// `grad *= inv_scale` in place, setting `found[0]` when an element is inf or NaN.
fn unscale(op: &'static str, grad: &Tensor, inv_scale: f32, found: &Tensor) -> Result<()> {
    grad.expect_dtype(op, DType::F32)?;
    if !grad.is_contiguous() {
        // Grads the engine installs are dense; one a user set may be a view.
        let dense = grad.contiguous()?;
        unscale(op, &dense, inv_scale, found)?;
        return grad.copy_(&dense);
    }
    let kernel = Kernel::plain(&GRAD_SCALE, "unscale");
    // One launch per window of the grad (one, unless it is past a binding).
    for (start, len) in windows(grad.device(), grad.numel()) {
        let part = grad.window(start, len);
        let params = UnscaleParams {
            n: len as u32,
            offset: part.layout().offset as u32,
            inv_scale,
        };
        Launch::new(op, &kernel, &[(1, &part), (2, found)], &params)
            .record(groups(len, CONTIGUOUS_PER_GROUP))?;
    }
    Ok(())
}
