//! BatchNorm's training-mode normalisation, fused (`shaders/batch_norm.wgsl`): the
//! per-channel statistics over the batch and the pixels in two launches, the normalised and
//! scaled output in one, and beside it the backward rule (two launches for the per-channel
//! grad sums, one for the input grad). `nn::BatchNorm1d`/`BatchNorm2d` call it in training
//! mode; the composed form ([`standardised`](crate::ops::norm::standardised)) stays for
//! inputs larger than one binding.

use crate::error::Result;
use crate::kernel::{
    groups, reduces_in_subgroups, with_subgroup_section, Kernel, KernelParams, Launch,
    ShaderFamily, CONTIGUOUS_PER_GROUP, WORKGROUP_REDUCE_WGSL,
};
use crate::tensor::grad_mode::NoGradGuard;
use crate::tensor::graph::record;
use crate::tensor::{DType, Tensor};

crate::kernel_params! {
    /// x `[batch, channels, pixels]` (contiguous from `x_offset`) with each channel's
    /// `batch * pixels` values in `parts` parts of `PER_PART`; `affine` 1 where weight and
    /// bias are bound.
    pub(crate) struct BatchNormParams {
        batch: u32,
        channels: u32,
        pixels: u32,
        parts: u32,
        numel: u32,
        eps: f32,
        affine: u32,
        x_offset: u32,
        weight_offset: u32,
        bias_offset: u32,
        grad_offset: u32,
    }
}

static BATCH_NORM: ShaderFamily = ShaderFamily {
    name: "batch_norm",
    wgsl: include_str!("../../shaders/batch_norm.wgsl"),
    params: &[&BatchNormParams::LAYOUT],
    preludes: &[WORKGROUP_REDUCE_WGSL],
};

#[cfg(test)]
pub(crate) fn kernel_sources() -> Vec<(String, String)> {
    [false, true]
        .map(|subgroups| {
            (
                format!("batch_norm/{}", variant(subgroups)),
                source(subgroups),
            )
        })
        .to_vec()
}

/// The module whose workgroups reduce through subgroup operations (`subgroups`: where the
/// device has subgroups of a fixed width) or a tree in workgroup memory.
fn source(subgroups: bool) -> String {
    let reduce = match subgroups {
        true => "workgroup_reduce_subgroups",
        false => "workgroup_reduce_tree",
    };
    let source = BATCH_NORM.source(&[("WORKGROUP_REDUCE", reduce)]);
    with_subgroup_section(&source, subgroups)
}

/// The pipeline-key name of [`source`]'s specialisation.
fn variant(subgroups: bool) -> &'static str {
    if subgroups {
        "subgroups"
    } else {
        "tree"
    }
}

/// The kernel of `entry` in the module whose workgroups reduce through subgroups where
/// `subgroups` (see [`source`]).
fn kernel_of(entry: &'static str, subgroups: bool) -> Kernel<'static> {
    let specialise: &'static dyn Fn() -> String = match subgroups {
        true => &|| source(true),
        false => &|| source(false),
    };
    Kernel::specialised(&BATCH_NORM, entry, variant(subgroups), specialise)
}

/// Values of one channel one workgroup reduces (`PER_PART` in the shader).
const PER_PART: usize = 16384;

/// What the fused training-mode BatchNorm returns besides its output: the batch's mean and
/// unbiased variance per channel (for the running statistics), no grad.
pub(crate) struct BatchStatistics {
    pub mean: Tensor,
    pub unbiased_var: Tensor,
}

/// True when [`batch_norm_training`] runs `x` fused: x within one binding.
pub(crate) fn fused_applies(x: &Tensor) -> bool {
    (x.numel() * 4) as u64 <= x.device().max_binding_bytes()
}

/// `x` (`[N, C, ..]`, at least two values per channel: the caller checks) normalised per
/// channel by the batch's statistics, times `weight` plus `bias` (`[C]` each) where given,
/// recorded with its backward; and those statistics.
pub(crate) fn batch_norm_training(
    op: &'static str,
    x: &Tensor,
    affine: Option<(&Tensor, &Tensor)>,
    eps: f32,
) -> Result<(Tensor, BatchStatistics)> {
    let dev = x.device();
    let (batch, channels) = (x.shape()[0], x.shape()[1]);
    let pixels = x.numel() / (batch * channels).max(1);
    let parts = (batch * pixels).div_ceil(PER_PART).max(1);
    let (x_c, weight_c, bias_c) = {
        let _no_grad = NoGradGuard::new();
        let (w, b) = match affine {
            Some((w, b)) => (Some(w.contiguous()?), Some(b.contiguous()?)),
            None => (None, None),
        };
        (x.contiguous()?, w, b)
    };
    let params = BatchNormParams {
        batch: batch as u32,
        channels: channels as u32,
        pixels: pixels as u32,
        parts: parts as u32,
        numel: x.numel() as u32,
        eps,
        affine: affine.is_some() as u32,
        x_offset: x_c.layout().offset as u32,
        weight_offset: weight_c.as_ref().map_or(0, |w| w.layout().offset as u32),
        bias_offset: bias_c.as_ref().map_or(0, |b| b.layout().offset as u32),
        grad_offset: 0,
    };
    // Without affine parameters the kernels read none: x stands in for both bindings.
    let weight_bound = weight_c.clone().unwrap_or_else(|| x_c.clone());
    let bias_bound = bias_c.unwrap_or_else(|| x_c.clone());

    let partials = Tensor::empty(op, &[channels, parts, 4], DType::F32, dev)?;
    let stats = Tensor::empty(op, &[channels, 3], DType::F32, dev)?;
    let out = Tensor::empty(op, x.shape(), DType::F32, dev)?;
    let subgroups = reduces_in_subgroups(dev);
    if x.numel() > 0 {
        let kernel = kernel_of("partial_stats", subgroups);
        let bound = [(1, &x_c), (5, &partials)];
        Launch::new(op, &kernel, &bound, &params).record((channels * parts) as u32)?;
        let kernel = kernel_of("channel_stats", subgroups);
        let bound = [(5, &partials), (6, &stats)];
        Launch::new(op, &kernel, &bound, &params).record(groups(channels, 64))?;
        let kernel = kernel_of("normalise", subgroups);
        let bound = [
            (1, &x_c),
            (2, &weight_bound),
            (3, &bias_bound),
            (4, &out),
            (6, &stats),
        ];
        let workgroups = groups(x.numel(), CONTIGUOUS_PER_GROUP);
        Launch::new(op, &kernel, &bound, &params).record(workgroups)?;
    }
    let statistics = BatchStatistics {
        mean: stats.narrow(1, 0, 1)?.reshape(&[channels])?,
        unbiased_var: stats.narrow(1, 2, 1)?.reshape(&[channels])?,
    };
    let inputs: Vec<&Tensor> = match affine {
        Some((w, b)) => vec![x, w, b],
        None => vec![x],
    };
    let out = record(op, out, &inputs, |_| {
        let (x_c, stats) = (x_c.detach(), stats.detach());
        let weight_bound = weight_bound.detach();
        let has_affine = affine.is_some();
        move |g: &Tensor| {
            let g = g.contiguous()?;
            let dev = g.device();
            let params = BatchNormParams {
                grad_offset: g.layout().offset as u32,
                ..params
            };
            let partials = Tensor::empty(op, &[channels, parts, 3], DType::F32, dev)?;
            let sums = Tensor::empty(op, &[channels, 2], DType::F32, dev)?;
            let grad_x = Tensor::empty(op, x_c.shape(), DType::F32, dev)?;
            if x_c.numel() > 0 {
                let kernel = kernel_of("partial_grad_sums", subgroups);
                let bound = [(1, &x_c), (5, &partials), (6, &stats), (7, &g)];
                Launch::new(op, &kernel, &bound, &params).record((channels * parts) as u32)?;
                let kernel = kernel_of("channel_grad_sums", subgroups);
                let bound = [(5, &partials), (8, &sums)];
                Launch::new(op, &kernel, &bound, &params).record(groups(channels, 64))?;
                let kernel = kernel_of("input_grad", subgroups);
                let bound = [
                    (1, &x_c),
                    (2, &weight_bound),
                    (4, &grad_x),
                    (6, &stats),
                    (7, &g),
                    (8, &sums),
                ];
                let workgroups = groups(x_c.numel(), CONTIGUOUS_PER_GROUP);
                Launch::new(op, &kernel, &bound, &params).record(workgroups)?;
            }
            let mut grads = vec![Some(grad_x)];
            if has_affine {
                let column = |c| sums.narrow(1, c, 1)?.reshape(&[channels]);
                grads.push(Some(column(1)?));
                grads.push(Some(column(0)?));
            }
            Ok(grads)
        }
    });
    Ok((out, statistics))
}
