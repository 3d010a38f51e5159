//! In-place initialisers, as `torch.nn.init`: each writes new values into a tensor (a
//! parameter keeps its storage and its handle, so an optimizer built on it sees them) and
//! draws from the global generator ([`crate::manual_seed`]).

use crate::autograd::no_grad;
use crate::error::{Error, Result};
use crate::tensor::Tensor;

/// Writes `values` (host-made, `t`'s shape) into `t`.
fn write(t: &Tensor, values: Vec<f32>) -> Result<()> {
    let src = Tensor::from_vec(values, t.shape(), t.device())?;
    no_grad(|| t.copy_(&src))
}

/// Fills `t` with values uniform in `[low, high)`.
pub fn uniform_(t: &Tensor, low: f32, high: f32) -> Result<()> {
    no_grad(|| t.copy_(&Tensor::uniform(t.shape(), low, high, t.device())?))
}

/// Fills `t` with values from N(mean, std^2).
pub fn normal_(t: &Tensor, mean: f32, std: f32) -> Result<()> {
    no_grad(|| t.copy_(&Tensor::normal(t.shape(), mean, std, t.device())?))
}

/// Fills `t` with values from N(mean, std^2) redrawn until inside `[low, high]`, as torch's
/// `trunc_normal_` (ViT and GPT-style inits).
pub fn trunc_normal_(t: &Tensor, mean: f32, std: f32, low: f32, high: f32) -> Result<()> {
    if low.partial_cmp(&high) != Some(std::cmp::Ordering::Less) || std <= 0.0 || !std.is_finite() {
        return Err(Error::InvalidArgument {
            op: "nn::init::trunc_normal_",
            msg: format!("needs std > 0 and low < high, got std {std}, [{low}, {high}]"),
        });
    }
    let n = t.numel();
    let mut seed = crate::seed::next_seed();
    let mut kept = Vec::with_capacity(n);
    // Redraws in batches from seeds of the global stream (at most a few passes: a window of
    // two deviations keeps 95%).
    while kept.len() < n {
        let batch = crate::tensor::creation::normal_values(n - kept.len() + 16, mean, std, seed);
        kept.extend(
            batch
                .into_iter()
                .filter(|v| (low..=high).contains(v))
                .take(n - kept.len()),
        );
        seed = crate::seed::next_seed();
    }
    write(t, kept)
}

/// Fills `t` with `value`.
pub fn constant_(t: &Tensor, value: f32) -> Result<()> {
    no_grad(|| t.copy_(&Tensor::full(t.shape(), value, t.device())?))
}

/// Fills `t` with zeros.
pub fn zeros_(t: &Tensor) -> Result<()> {
    constant_(t, 0.0)
}

/// Fills `t` with ones.
pub fn ones_(t: &Tensor) -> Result<()> {
    constant_(t, 1.0)
}

/// `(fan_in, fan_out)` of a weight `[out, in, kernel..]`, as torch computes them; an error
/// below two dims.
fn fans(op: &'static str, t: &Tensor) -> Result<(usize, usize)> {
    let shape = t.shape();
    if shape.len() < 2 {
        return Err(Error::Shape {
            op,
            msg: format!("fans need a tensor of at least 2 dims, got {shape:?}"),
        });
    }
    let receptive: usize = shape[2..].iter().product();
    Ok((shape[1] * receptive, shape[0] * receptive))
}

/// Glorot's uniform init: `U(-b, b)` with `b = gain sqrt(6 / (fan_in + fan_out))`.
pub fn xavier_uniform_(t: &Tensor, gain: f32) -> Result<()> {
    let (fan_in, fan_out) = fans("nn::init::xavier_uniform_", t)?;
    let bound = gain * (6.0 / (fan_in + fan_out).max(1) as f32).sqrt();
    uniform_(t, -bound, bound)
}

/// He's uniform init for a leaky ReLU of negative slope `a` (0: ReLU), fan-in mode:
/// `U(-b, b)` with `b = sqrt(2 / (1 + a^2)) sqrt(3 / fan_in)`, as torch's default
/// `kaiming_uniform_`. (`a = sqrt(5)` gives the `1 / sqrt(fan_in)` bound of Linear's init.)
pub fn kaiming_uniform_(t: &Tensor, a: f32) -> Result<()> {
    let (fan_in, _) = fans("nn::init::kaiming_uniform_", t)?;
    let gain = (2.0 / (1.0 + a * a)).sqrt();
    let bound = gain * (3.0 / fan_in.max(1) as f32).sqrt();
    uniform_(t, -bound, bound)
}
