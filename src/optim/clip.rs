//! Gradient clipping by global norm, on the device (no readback).

use crate::autograd::NoGradGuard;
use crate::error::{Error, Result};
use crate::tensor::Tensor;

/// Scales the grads of `params` in place so that their global L2 norm is at most `max_norm`
/// (as `torch.nn.utils.clip_grad_norm_`: by `min(1, max_norm / (norm + 1e-6))`), and returns
/// the norm before clipping as a 0-dim tensor. Parameters without a grad are skipped (none
/// with a grad: a norm of 0, as torch), and a tensor listed twice (a tied weight) counts and
/// is scaled once. A `max_norm` of `f32::INFINITY` measures the norm and scales by 1 (torch's
/// idiom for logging it); 0 zeroes the grads.
pub fn clip_grad_norm(params: &[Tensor], max_norm: f32) -> Result<Tensor> {
    const OP: &str = "clip_grad_norm";
    if max_norm.is_nan() || max_norm < 0.0 {
        return Err(Error::InvalidArgument {
            op: OP,
            msg: format!("max_norm must be >= 0 (infinity: no clipping), got {max_norm}"),
        });
    }
    let _no_grad = NoGradGuard::new();
    let mut distinct: Vec<&Tensor> = Vec::new();
    for p in params {
        if !distinct.iter().any(|d| Tensor::same(d, p)) {
            distinct.push(p);
        }
    }
    let grads: Vec<Tensor> = distinct.iter().filter_map(|p| p.grad()).collect();
    let Some(first) = grads.first() else {
        // torch returns a norm of 0 and clips nothing; with no parameter there is no device to
        // put it on.
        return match params.first() {
            Some(p) => Tensor::zeros(&[], p.device()),
            None => Err(Error::InvalidArgument {
                op: OP,
                msg: "needs at least one parameter".into(),
            }),
        };
    };
    let mut total = Tensor::zeros(&[], first.device())?;
    for g in &grads {
        total = total.add(&g.mul(g)?.sum()?)?;
    }
    let norm = total.sqrt()?;
    // 1 / max(1, (norm + 1e-6) / max_norm) = min(1, max_norm / (norm + 1e-6))
    let one = Tensor::ones(&[], first.device())?;
    let coef = norm
        .add_scalar(1e-6)?
        .div_scalar(max_norm)?
        .maximum(&one)?
        .powf(-1.0)?;
    for g in &grads {
        g.copy_(&g.mul(&coef)?)?;
    }
    Ok(norm)
}
