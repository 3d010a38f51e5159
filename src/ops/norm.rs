//! LayerNorm over the last dim as one fused row kernel forward and one backward
//! (`shaders/norm.wgsl`), saving each row's mean and inverse deviation. Rows longer than
//! [`FUSED_MAX_LEN`] (whose loops would pass llvmpipe's iteration limit) are normalised by
//! the composed ops instead.

use crate::error::{Error, Result};
use crate::kernel::{
    groups, launch_at, launch_fusible, Kernel, KernelParams, ShaderFamily, MAX_LOOP_LEN,
};
use crate::tensor::grad_mode::NoGradGuard;
use crate::tensor::graph::record;
use crate::tensor::tape::{EpilogueSite, Fusion};
use crate::tensor::{DType, Tensor};

crate::kernel_params! {
    /// `rows` rows of `len` elements of x; weight and bias have `len` elements.
    pub(crate) struct NormParams {
        rows: u32,
        len: u32,
        eps: f32,
        x_offset: u32,
        weight_offset: u32,
        bias_offset: u32,
        grad_offset: u32,
    }
}

static NORM: ShaderFamily = ShaderFamily {
    name: "norm",
    wgsl: include_str!("../../shaders/norm.wgsl"),
    params: &[&NormParams::LAYOUT],
};

#[cfg(test)]
pub(crate) fn kernel_sources() -> Vec<(String, String)> {
    vec![
        ("norm".into(), norm_source(false)),
        ("norm aligned".into(), norm_source(true)),
    ]
}

/// The module whose kernels read rows as one vec4 per four features (`aligned`: the row
/// length and every offset are multiples of 4) or element by element.
fn norm_source(aligned: bool) -> String {
    NORM.source(&[("NORM_ALIGNED", if aligned { "true" } else { "false" })])
}

/// The pipeline-key name of [`norm_source`]'s specialisation.
fn norm_variant(aligned: bool) -> &'static str {
    if aligned {
        "aligned"
    } else {
        "elements"
    }
}

/// Longest row the fused kernels take (each walks a row in three passes at most).
const FUSED_MAX_LEN: usize = MAX_LOOP_LEN;

const NORM_WORKGROUP: usize = 64;

fn check(x: &Tensor, weight: &Tensor, bias: &Tensor, eps: f32) -> Result<usize> {
    const OP: &str = "layer_norm";
    for t in [weight, bias] {
        x.expect_same_device(OP, t)?;
        t.expect_dtype(OP, DType::F32)?;
    }
    x.expect_dtype(OP, DType::F32)?;
    let len = x.shape().last().copied().unwrap_or(0);
    if x.rank() == 0 || weight.shape() != [len] || bias.shape() != [len] {
        return Err(Error::Shape {
            op: OP,
            msg: format!(
                "input {:?} needs weight and bias of shape [last dim], got {:?} and {:?}",
                x.shape(),
                weight.shape(),
                bias.shape()
            ),
        });
    }
    if !(eps >= 0.0 && eps.is_finite()) {
        return Err(Error::InvalidArgument {
            op: OP,
            msg: format!("eps must be finite and >= 0, got {eps}"),
        });
    }
    Ok(len)
}

/// The composed LayerNorm, for rows too long for the fused kernels.
fn composed(x: &Tensor, weight: &Tensor, bias: &Tensor, eps: f32) -> Result<Tensor> {
    let last = x.rank() - 1;
    let centred = x.sub(&x.mean_dims(&[last], true)?)?;
    let var = centred.mul(&centred)?.mean_dims(&[last], true)?;
    let normed = centred.div(&var.add_scalar(eps)?.sqrt()?)?;
    normed.mul(weight)?.add(bias)
}

impl Tensor {
    /// Normalises the last dim to zero mean and unit (biased) variance, then scales by
    /// `weight` and shifts by `bias` (both `[last dim]`), as PyTorch's `layer_norm`.
    pub fn layer_norm(&self, weight: &Tensor, bias: &Tensor, eps: f32) -> Result<Tensor> {
        const OP: &str = "layer_norm";
        let len = check(self, weight, bias, eps)?;
        if len > FUSED_MAX_LEN {
            return composed(self, weight, bias, eps);
        }
        let rows = self.numel().checked_div(len).unwrap_or(0);
        let dev = self.device();
        let (x, weight_c, bias_c) = {
            let _no_grad = NoGradGuard::new();
            (self.contiguous()?, weight.contiguous()?, bias.contiguous()?)
        };
        let out = Tensor::empty(OP, self.shape(), DType::F32, dev)?;
        let stats = Tensor::empty(OP, &[rows, 2], DType::F32, dev)?;
        let params = NormParams {
            rows: rows as u32,
            len: len as u32,
            eps,
            x_offset: x.layout().offset as u32,
            weight_offset: weight_c.layout().offset as u32,
            bias_offset: bias_c.layout().offset as u32,
            grad_offset: 0,
        };
        // Rows read as vec4s when every row and every tensor starts on a multiple of 4.
        let aligned = len % 4 == 0
            && [&x, &weight_c, &bias_c]
                .iter()
                .all(|t| t.layout().offset % 4 == 0);
        let source = move || norm_source(aligned);
        if rows > 0 && len > 0 {
            let bound = [
                (1, &x),
                (2, &weight_c),
                (3, &bias_c),
                (4, &out),
                (5, &stats),
            ];
            let kernel = Kernel::specialised(&NORM, "forward", norm_variant(aligned), &source);
            let site = || {
                Fusion::Epilogue(EpilogueSite {
                    entry: "forward",
                    output: 4,
                    numel: rows * len,
                    vec4_output: true,
                })
            };
            let workgroups = groups(rows, NORM_WORKGROUP);
            launch_fusible(OP, &kernel, &bound, &params, workgroups, site)?;
        }
        Ok(record(OP, out, &[self, weight, bias], |_| {
            let (x, weight_c) = (x.detach(), weight_c.detach());
            move |g: &Tensor| {
                let g = g.contiguous()?;
                let dev = g.device();
                let grad_x = Tensor::empty(OP, x.shape(), DType::F32, dev)?;
                let grad_xhat = Tensor::empty(OP, &[rows, len], DType::F32, dev)?;
                let aligned = aligned && g.layout().offset % 4 == 0;
                let source = || norm_source(aligned);
                if rows > 0 && len > 0 {
                    let params = NormParams {
                        grad_offset: g.layout().offset as u32,
                        ..params
                    };
                    let bound = [
                        (1, &x),
                        (2, &weight_c),
                        (4, &grad_x),
                        (5, &stats),
                        (6, &g),
                        (7, &grad_xhat),
                    ];
                    let variant = norm_variant(aligned);
                    let kernel = Kernel::specialised(&NORM, "backward", variant, &source);
                    launch_at(OP, &kernel, &bound, &params, groups(rows, NORM_WORKGROUP))?;
                }
                let grad_weight = grad_xhat.sum_dims(&[0], false)?;
                let grad_bias = g.reshape(&[rows, len])?.sum_dims(&[0], false)?;
                Ok(vec![Some(grad_x), Some(grad_weight), Some(grad_bias)])
            }
        }))
    }
}
