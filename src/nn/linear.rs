//! `Linear`: `x W^T + b`, with PyTorch's default initialisation.

use crate::device::Device;
use crate::error::Result;
use crate::nn::Module;
use crate::ops::autocast::for_16_bit_op;
use crate::seed::next_seed;
use crate::tensor::creation::{checked_host_numel, uniform_values};
use crate::tensor::Tensor;

/// A fully connected layer: `y = x W^T + b`, weight `[out, in]`, bias `[out]`.
///
/// Initialised as PyTorch does (Kaiming-uniform with `a = sqrt(5)`): weight and bias uniform in
/// `[-1/sqrt(in), 1/sqrt(in)]`, from the global seed ([`crate::manual_seed`]).
///
/// ```
/// # fn main() -> wgrad::Result<()> {
/// use wgrad::{nn::{self, Module}, Device, Tensor};
/// let dev = Device::new()?;
/// let lin = nn::Linear::new(4, 2, true, &dev)?;
/// let y = lin.forward(&Tensor::ones(&[3, 4], &dev)?)?;
/// assert_eq!(y.shape(), &[3, 2]);
/// # Ok(())
/// # }
/// ```
pub struct Linear {
    /// `[out, in]`.
    pub weight: Tensor,
    /// `[out]`, when the layer has one.
    pub bias: Option<Tensor>,
}

/// Uniform values in `[-bound, bound)` from the global seed, as a parameter: `Tensor::rand`'s
/// values scaled on the host (the same f32 arithmetic a kernel would do), so that building a
/// model compiles no kernel.
pub(crate) fn uniform_parameter(shape: &[usize], bound: f32, device: &Device) -> Result<Tensor> {
    let numel = checked_host_numel("parameter init", shape, device)?;
    let data = uniform_values(numel, next_seed())
        .into_iter()
        .map(|u| u * (2.0 * bound) - bound)
        .collect();
    Ok(Tensor::from_vec(data, shape, device)?.requires_grad_(true))
}

impl Linear {
    /// A layer from `in_features` to `out_features`, with a bias when `bias`. Either may be
    /// 0, as torch's (a layer of no inputs outputs its bias).
    pub fn new(
        in_features: usize,
        out_features: usize,
        bias: bool,
        device: &Device,
    ) -> Result<Linear> {
        // torch's bound, 1 / sqrt(fan_in); an empty layer (no inputs) starts at 0, as torch's
        // init leaves a zero-element weight and draws its bias from [0, 0].
        let bound = match in_features {
            0 => 0.0,
            n => 1.0 / (n as f32).sqrt(),
        };
        let weight = uniform_parameter(&[out_features, in_features], bound, device)?;
        let bias = if bias {
            Some(uniform_parameter(&[out_features], bound, device)?)
        } else {
            None
        };
        Ok(Linear { weight, bias })
    }
}

impl Module for Linear {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        // Under autocast the weight and bias are cast (once per region) before the transpose
        // view, as torch's autocast casts F.linear's arguments.
        let weight = for_16_bit_op(&self.weight)?;
        let y = x.matmul(&weight.t()?)?;
        match &self.bias {
            Some(b) => y.add(&for_16_bit_op(b)?),
            None => Ok(y),
        }
    }

    fn named_parameters(&self) -> Vec<(String, Tensor)> {
        let mut params = vec![("weight".to_string(), self.weight.clone())];
        params.extend(self.bias.iter().map(|b| ("bias".to_string(), b.clone())));
        params
    }
}
