//! BatchNorm's training-mode normalisation, fused (`shaders/batch_norm.wgsl`): the
//! per-channel statistics over the batch and the pixels in two launches, the normalised and
//! scaled output in one, and beside it the backward rule (two launches for the per-channel
//! grad sums, one for the input grad). `nn::BatchNorm1d`/`BatchNorm2d` call it in training
//! mode. An input past one binding is bound as windows of whole images, a launch per window
//! for each kernel that reads the values.

use crate::error::{Error, Result};
use crate::kernel::{
    groups, reduces_in_subgroups, rows_per_window, with_subgroup_section, Kernel, KernelParams,
    Launch, ShaderFamily, CONTIGUOUS_PER_GROUP, WORKGROUP_REDUCE_WGSL,
};
use crate::tensor::grad_mode::NoGradGuard;
use crate::tensor::graph::record;
use crate::tensor::{DType, Tensor};

crate::kernel_params! {
    /// x `[batch, channels, pixels]` (contiguous from `x_offset`): the launch's window of whole
    /// images (every image when x fits one binding), each channel's `batch * pixels` values
    /// there in `parts` parts of `PER_PART`; `count` a channel's values over the whole batch;
    /// `affine` 1 where weight and bias are bound.
    pub(crate) struct BatchNormParams {
        batch: u32,
        channels: u32,
        pixels: u32,
        parts: u32,
        numel: u32,
        count: u32,
        eps: f32,
        affine: u32,
        x_offset: u32,
        weight_offset: u32,
        bias_offset: u32,
        out_offset: u32,
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

/// A run of whole images of x, and of the tensors shaped like it, that one launch of the
/// per-value kernels binds: every image when they all fit one binding, else as many as one
/// window holds (a BatchNorm at ResNet's first layer, `[64, 64, 112, 112]`, is 205 MB; lavapipe
/// binds 128 MiB).
#[derive(Clone, Copy)]
struct ImageRun {
    first: usize,
    images: usize,
    image_len: usize,
    pixels: usize,
    every_image: bool,
}

impl ImageRun {
    /// The runs that cover `batch` images of `channels * pixels` values, windowed when any of
    /// `tensors` (contiguous, shaped like x) is past one binding. One image past a binding is a
    /// `TooLarge` error: its channels are not split.
    fn cover(
        op: &'static str,
        tensors: &[&Tensor],
        batch: usize,
        channels: usize,
        pixels: usize,
    ) -> Result<Vec<ImageRun>> {
        let image_len = channels * pixels;
        let run = |first, images, every_image| ImageRun {
            first,
            images,
            image_len,
            pixels,
            every_image,
        };
        if !tensors.iter().any(|t| t.exceeds_binding()) {
            return Ok(vec![run(0, batch, true)]);
        }
        let dev = tensors[0].device();
        let per = rows_per_window(dev, image_len);
        if per == 0 {
            return Err(Error::TooLarge {
                op,
                bytes: (image_len * 4) as u64,
                limit: dev.max_binding_bytes(),
            });
        }
        Ok((0..batch)
            .step_by(per)
            .map(|first| run(first, per.min(batch - first), false))
            .collect())
    }

    /// `t` over this run's images: `t` itself when the run is every image.
    fn of(&self, t: &Tensor) -> Tensor {
        match self.every_image {
            true => t.clone(),
            false => t.window(self.first * self.image_len, self.images * self.image_len),
        }
    }

    /// The parts of at most `PER_PART` that a channel's values in this run split into.
    fn parts(&self) -> usize {
        (self.images * self.pixels).div_ceil(PER_PART).max(1)
    }

    /// `params` for a launch over this run's window `x` of x.
    fn params(&self, params: &BatchNormParams, x: &Tensor) -> BatchNormParams {
        BatchNormParams {
            batch: self.images as u32,
            parts: self.parts() as u32,
            numel: (self.images * self.image_len) as u32,
            x_offset: x.layout().offset as u32,
            ..*params
        }
    }
}

/// The runs' partial sums `[channels, parts, k]` as one tensor of every part.
fn every_part(partials: Vec<Tensor>) -> Result<Tensor> {
    match partials.len() {
        1 => Ok(partials.into_iter().next().expect("one run")),
        _ => Tensor::cat(&partials, 1),
    }
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
    let (x_c, weight_c, bias_c) = {
        let _no_grad = NoGradGuard::new();
        let (w, b) = match affine {
            Some((w, b)) => (Some(w.contiguous()?), Some(b.contiguous()?)),
            None => (None, None),
        };
        (x.contiguous()?, w, b)
    };
    let out = Tensor::empty(op, x.shape(), DType::F32, dev)?;
    let stats = Tensor::empty(op, &[channels, 3], DType::F32, dev)?;
    let runs = ImageRun::cover(op, &[&x_c, &out], batch, channels, pixels)?;
    let params = BatchNormParams {
        batch: batch as u32,
        channels: channels as u32,
        pixels: pixels as u32,
        parts: runs.iter().map(ImageRun::parts).sum::<usize>() as u32,
        numel: x.numel() as u32,
        count: (batch * pixels) as u32,
        eps,
        affine: affine.is_some() as u32,
        x_offset: 0,
        weight_offset: weight_c.as_ref().map_or(0, |w| w.layout().offset as u32),
        bias_offset: bias_c.as_ref().map_or(0, |b| b.layout().offset as u32),
        out_offset: 0,
        grad_offset: 0,
    };
    // Without affine parameters the kernels read none: x stands in for both bindings.
    let weight_bound = weight_c.clone().unwrap_or_else(|| x_c.clone());
    let bias_bound = bias_c.unwrap_or_else(|| x_c.clone());

    let subgroups = reduces_in_subgroups(dev);
    if x.numel() > 0 {
        let mut partials = Vec::new();
        for run in &runs {
            let x_w = run.of(&x_c);
            let part = Tensor::empty(op, &[channels, run.parts(), 4], DType::F32, dev)?;
            let kernel = kernel_of("partial_stats", subgroups);
            let bound = [(1, &x_w), (5, &part)];
            let workgroups = (channels * run.parts()) as u32;
            Launch::new(op, &kernel, &bound, &run.params(&params, &x_w)).record(workgroups)?;
            partials.push(part);
        }
        let partials = every_part(partials)?;
        let kernel = kernel_of("channel_stats", subgroups);
        let bound = [(5, &partials), (6, &stats)];
        Launch::new(op, &kernel, &bound, &params).record(groups(channels, 64))?;
        for run in &runs {
            let (x_w, out_w) = (run.of(&x_c), run.of(&out));
            let params = BatchNormParams {
                out_offset: out_w.layout().offset as u32,
                ..run.params(&params, &x_w)
            };
            let kernel = kernel_of("normalise", subgroups);
            let bound = [
                (1, &x_w),
                (2, &weight_bound),
                (3, &bias_bound),
                (4, &out_w),
                (6, &stats),
            ];
            let workgroups = groups(x_w.numel(), CONTIGUOUS_PER_GROUP);
            Launch::new(op, &kernel, &bound, &params).record(workgroups)?;
        }
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
            let grad_x = Tensor::empty(op, x_c.shape(), DType::F32, dev)?;
            let sums = Tensor::empty(op, &[channels, 2], DType::F32, dev)?;
            if x_c.numel() > 0 {
                let runs = ImageRun::cover(op, &[&x_c, &g, &grad_x], batch, channels, pixels)?;
                let mut partials = Vec::new();
                for run in &runs {
                    let (x_w, g_w) = (run.of(&x_c), run.of(&g));
                    let params = BatchNormParams {
                        grad_offset: g_w.layout().offset as u32,
                        ..run.params(&params, &x_w)
                    };
                    let part = Tensor::empty(op, &[channels, run.parts(), 3], DType::F32, dev)?;
                    let kernel = kernel_of("partial_grad_sums", subgroups);
                    let bound = [(1, &x_w), (5, &part), (6, &stats), (7, &g_w)];
                    let workgroups = (channels * run.parts()) as u32;
                    Launch::new(op, &kernel, &bound, &params).record(workgroups)?;
                    partials.push(part);
                }
                let every = BatchNormParams {
                    parts: partials.iter().map(|p| p.shape()[1]).sum::<usize>() as u32,
                    ..params
                };
                let partials = every_part(partials)?;
                let kernel = kernel_of("channel_grad_sums", subgroups);
                let bound = [(5, &partials), (8, &sums)];
                Launch::new(op, &kernel, &bound, &every).record(groups(channels, 64))?;
                for run in &runs {
                    let (x_w, g_w, grad_w) = (run.of(&x_c), run.of(&g), run.of(&grad_x));
                    let params = BatchNormParams {
                        grad_offset: g_w.layout().offset as u32,
                        out_offset: grad_w.layout().offset as u32,
                        ..run.params(&params, &x_w)
                    };
                    let kernel = kernel_of("input_grad", subgroups);
                    let bound = [
                        (1, &x_w),
                        (2, &weight_bound),
                        (4, &grad_w),
                        (6, &stats),
                        (7, &g_w),
                        (8, &sums),
                    ];
                    let workgroups = groups(x_w.numel(), CONTIGUOUS_PER_GROUP);
                    Launch::new(op, &kernel, &bound, &params).record(workgroups)?;
                }
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
