//! LayerNorm and RMSNorm over the last dim, each one fused row kernel forward and one backward
//! (`shaders/norm.wgsl`, one family: RMSNorm is LayerNorm without the mean and the bias),
//! saving each row's mean and inverse deviation. Rows longer than [`FUSED_MAX_LEN`] (whose
//! loops would pass llvmpipe's iteration limit), and inputs past one binding, are normalised
//! by the composed ops instead.

use crate::device::{Device, KernelFlavor};
use crate::error::{Error, Result};
use crate::kernel::{
    groups, rows_per_window, EpilogueSite, Fusion, Kernel, KernelParams, Launch, RowLanes,
    ShaderFamily, MAX_LOOP_LEN, ROW_GROUP_WGSL,
};
use crate::ops::{cast, in_row_runs};
use crate::tensor::grad_mode::NoGradGuard;
use crate::tensor::graph::record;
use crate::tensor::{DType, Tensor};

crate::kernel_params! {
    /// `rows` rows of `len` elements of x; weight and bias have `len` elements. `center`: 1
    /// for LayerNorm, 0 for RMSNorm (no mean, no bias).
    pub(crate) struct NormParams {
        rows: u32,
        len: u32,
        eps: f32,
        x_offset: u32,
        weight_offset: u32,
        bias_offset: u32,
        grad_offset: u32,
        center: u32,
    }
}

static NORM: ShaderFamily = ShaderFamily {
    name: "norm",
    wgsl: include_str!("../../shaders/norm.wgsl"),
    params: &[&NormParams::LAYOUT],
    preludes: &[ROW_GROUP_WGSL],
};

#[cfg(test)]
pub(crate) fn kernel_sources() -> Vec<(String, String)> {
    let mut all = Vec::new();
    for aligned in [false, true] {
        for lanes in RowLanes::ALL {
            let name = format!("norm/{}", norm_variant(aligned, lanes));
            all.push((name, norm_source(aligned, lanes)));
        }
    }
    all
}

/// The module whose kernels read rows as one vec4 per four features (`aligned`: the row
/// length and every offset are multiples of 4) or element by element, and whose `*_rows`
/// entries run on `lanes`.
fn norm_source(aligned: bool, lanes: RowLanes) -> String {
    let aligned = if aligned { "true" } else { "false" };
    lanes.source(&NORM.source(&[("NORM_ALIGNED", aligned)]))
}

/// The pipeline-key name of [`norm_source`]'s specialisation.
fn norm_variant(aligned: bool, lanes: RowLanes) -> String {
    let reads = if aligned { "aligned" } else { "elements" };
    format!("{reads} {}", lanes.name())
}

/// Longest row the fused kernels take (each walks a row in three passes at most).
const FUSED_MAX_LEN: usize = MAX_LOOP_LEN;

/// True when the fused kernels take `x` in rows of `len`: rows no longer than
/// [`FUSED_MAX_LEN`] that one binding holds (past one binding, [`fused_in_row_runs`] runs
/// them a window of rows at a time).
fn fused_applies(x: &Tensor, len: usize) -> bool {
    len <= FUSED_MAX_LEN && rows_per_window(x.device(), len) > 0
}

/// `norm`'s fused kernels over `x` in rows of `len`, as [`fused_norm`] where `x` and its
/// output fit one binding; past that in runs of whole rows that one binding holds, each a
/// fused norm of its own bound as a window, the outputs joined with `cat` (`split` joins
/// their grads; the weight's and bias's add up over the runs).
fn fused_in_row_runs(
    norm: Norm,
    x: &Tensor,
    weight: &Tensor,
    bias: Option<&Tensor>,
    eps: f32,
    len: usize,
) -> Result<Tensor> {
    let dev = x.device();
    if (x.numel() * 4) as u64 <= dev.max_binding_bytes() {
        return fused_norm(norm, x, weight, bias, eps, len);
    }
    let rows = x.contiguous()?.reshape(&[x.numel() / len, len])?;
    let parts = in_row_runs(norm.op(), &rows, |run| {
        fused_norm(norm, run, weight, bias, eps, len)
    })?;
    Tensor::cat(&parts, 0)?.reshape(x.shape())
}

const NORM_WORKGROUP: usize = 64;

/// Rows each invocation of the weight-grad kernel sums (`WEIGHT_GRAD_ROWS` in norm.wgsl).
const WEIGHT_GRAD_ROWS: usize = 64;

/// Which normalisation a row kernel runs.
#[derive(Clone, Copy)]
enum Norm {
    /// Zero mean, unit variance, then weight and bias.
    Layer,
    /// Unit root mean square, then weight.
    Rms,
}

impl Norm {
    fn op(self) -> &'static str {
        match self {
            Norm::Layer => "layer_norm",
            Norm::Rms => "rms_norm",
        }
    }
}

/// The row length, after checking `x`, `weight` (and `bias`, LayerNorm's) and `eps`.
fn check(
    norm: Norm,
    x: &Tensor,
    weight: &Tensor,
    bias: Option<&Tensor>,
    eps: f32,
) -> Result<usize> {
    let op = norm.op();
    for t in std::iter::once(weight).chain(bias) {
        x.expect_same_device(op, t)?;
        t.expect_dtype(op, DType::F32)?;
    }
    x.expect_dtype(op, DType::F32)?;
    let len = x.shape().last().copied().unwrap_or(0);
    let fits = |t: &Tensor| t.shape() == [len];
    if x.rank() == 0 || !fits(weight) || !bias.is_none_or(fits) {
        let what = match bias {
            Some(b) => format!(
                "weight and bias of shape [last dim], got {:?} and {:?}",
                weight.shape(),
                b.shape()
            ),
            None => format!("a weight of shape [last dim], got {:?}", weight.shape()),
        };
        return Err(Error::Shape {
            op,
            msg: format!("input {:?} needs {what}", x.shape()),
        });
    }
    check_eps(op, eps)?;
    Ok(len)
}

/// Errors unless a norm's `eps` is finite and not negative (the ops and the nn layers' `new`).
pub(crate) fn check_eps(op: &'static str, eps: f32) -> Result<()> {
    if !(eps >= 0.0 && eps.is_finite()) {
        return Err(Error::InvalidArgument {
            op,
            msg: format!("eps must be finite and >= 0, got {eps}"),
        });
    }
    Ok(())
}

/// `x` divided by its largest magnitude over `dims` (kept as size 1; 1 where that is 0), and
/// `eps` over the divisor squared: a norm's statistics of the quotient cannot overflow for
/// finite `x` (squares of 1e20 would), and `(u - mean(u)) / sqrt(var(u) + eps / s^2)` is the
/// same function of `x` as the unscaled form, so the divisor takes no grad and the grads are
/// the same.
pub(crate) fn scaled_for_statistics(
    x: &Tensor,
    dims: &[usize],
    eps: f32,
) -> Result<(Tensor, Tensor)> {
    let divisor = {
        let _no_grad = NoGradGuard::new();
        let largest = x.abs()?.max_dims(dims, true)?;
        // 1 where the largest is 0 (a row of zeros) or NaN (it propagates through x anyway).
        let ones = Tensor::ones(largest.shape(), x.device())?;
        largest.eq_scalar(0.0)?.where_cond(&ones, &largest)?
    };
    let eps_scaled = divisor.powf(-2.0)?.mul_scalar(eps)?;
    Ok((x.div(&divisor)?, eps_scaled))
}

/// `x` normalised over `dims` to zero mean and unit (biased) variance, `eps` added to the
/// variance: the statistics of [`scaled_for_statistics`], so rows of finite values up to 1e30
/// normalise. Composed of reductions and elementwise ops, whose grads it takes.
///
/// Centred twice (the corrected two-pass algorithm): values far from 0 with a small spread
/// round their f32 mean an ulp off, so once-centred values do not sum to 0, and the grad of
/// the variance carries that sum times 1 / sigma into every element (the grad of a GroupNorm's
/// summed outputs, 0, read 10 for values of 1000 +- 0.005). The second pass's mean is of the
/// deviations, exact to their own rounding.
pub(crate) fn standardised(x: &Tensor, dims: &[usize], eps: f32) -> Result<Tensor> {
    let (u, eps_scaled) = scaled_for_statistics(x, dims, eps)?;
    let once = u.sub(&u.mean_dims(dims, true)?)?;
    let centred = once.sub(&once.mean_dims(dims, true)?)?;
    let var = centred.mul(&centred)?.mean_dims(dims, true)?;
    centred.mul(&var.add(&eps_scaled)?.rsqrt()?)
}

/// The composed LayerNorm, for rows too long for the fused kernels.
fn composed(x: &Tensor, weight: &Tensor, bias: &Tensor, eps: f32) -> Result<Tensor> {
    let last = x.rank() - 1;
    standardised(x, &[last], eps)?.mul(weight)?.add(bias)
}

/// The composed RMSNorm, for rows too long for the fused kernels (scaled as
/// [`standardised`]).
fn composed_rms(x: &Tensor, weight: &Tensor, eps: f32) -> Result<Tensor> {
    let last = x.rank() - 1;
    let (u, eps_scaled) = scaled_for_statistics(x, &[last], eps)?;
    let mean_square = u.mul(&u)?.mean_dims(&[last], true)?;
    u.mul(&mean_square.add(&eps_scaled)?.rsqrt()?)?.mul(weight)
}

/// Checks an optional per-channel affine parameter of group_norm: `[C]`, on `x`'s device.
fn check_channel_param(
    op: &'static str,
    x: &Tensor,
    p: Option<&Tensor>,
    c: usize,
    what: &str,
) -> Result<()> {
    let Some(p) = p else {
        return Ok(());
    };
    x.expect_same_device(op, p)?;
    p.expect_dtype(op, DType::F32)?;
    if p.shape() != [c] {
        return Err(Error::Shape {
            op,
            msg: format!(
                "{what} must be [C] = [{c}], got {:?} (input {:?})",
                p.shape(),
                x.shape()
            ),
        });
    }
    Ok(())
}

impl Tensor {
    /// Normalises the last dim to zero mean and unit (biased) variance, then scales by
    /// `weight` and shifts by `bias` (both `[last dim]`), as PyTorch's `layer_norm`.
    pub fn layer_norm(&self, weight: &Tensor, bias: &Tensor, eps: f32) -> Result<Tensor> {
        if crate::ops::autocast::active_dtype().is_some() && self.dtype().is_16_bit() {
            // Under autocast, in f32 (its statistics need f32's range).
            return self.to_dtype(DType::F32)?.layer_norm(weight, bias, eps);
        }
        let inputs = [self, weight, bias];
        if let Some(out) = cast::through_f32("layer_norm", &inputs, |w| {
            w[0].layer_norm(&w[1], &w[2], eps)
        })? {
            return Ok(out);
        }
        let len = check(Norm::Layer, self, weight, Some(bias), eps)?;
        if !fused_applies(self, len) {
            return composed(self, weight, bias, eps);
        }
        fused_in_row_runs(Norm::Layer, self, weight, Some(bias), eps, len)
    }

    /// Scales the last dim to unit root mean square, `x / sqrt(mean(x^2) + eps) * weight`
    /// (`weight`: `[last dim]`), as PyTorch's `rms_norm` and Llama's RMSNorm: one row kernel
    /// forward and one backward.
    ///
    /// ```
    /// # fn main() -> wgrad::Result<()> {
    /// use wgrad::{Device, Tensor};
    /// let dev = Device::new()?;
    /// let x = Tensor::from_vec(vec![3.0, 4.0], &[1, 2], &dev)?;
    /// let y = x.rms_norm(&Tensor::ones(&[2], &dev)?, 0.0)?; // rms of [3, 4] is sqrt(12.5)
    /// let want = [3.0 / 12.5f32.sqrt(), 4.0 / 12.5f32.sqrt()];
    /// assert!(y.to_vec()?.iter().zip(want).all(|(a, b)| (a - b).abs() < 1e-6));
    /// # Ok(())
    /// # }
    /// ```
    pub fn rms_norm(&self, weight: &Tensor, eps: f32) -> Result<Tensor> {
        if crate::ops::autocast::active_dtype().is_some() && self.dtype().is_16_bit() {
            return self.to_dtype(DType::F32)?.rms_norm(weight, eps);
        }
        if let Some(out) =
            cast::through_f32("rms_norm", &[self, weight], |w| w[0].rms_norm(&w[1], eps))?
        {
            return Ok(out);
        }
        let len = check(Norm::Rms, self, weight, None, eps)?;
        if !fused_applies(self, len) {
            return composed_rms(self, weight, eps);
        }
        fused_in_row_runs(Norm::Rms, self, weight, None, eps, len)
    }

    /// Normalises `[N, C, *]` over each of `groups` groups of channels (and every position),
    /// to zero mean and unit (biased) variance, then scales and shifts each channel by
    /// `weight` and `bias` (`[C]`, when given), as PyTorch's `group_norm`. Composed of
    /// reductions and elementwise ops, whose grads it takes.
    pub fn group_norm(
        &self,
        groups: usize,
        weight: Option<&Tensor>,
        bias: Option<&Tensor>,
        eps: f32,
    ) -> Result<Tensor> {
        const OP: &str = "group_norm";
        let given: Vec<&Tensor> = [Some(self), weight, bias].into_iter().flatten().collect();
        if let Some(out) = cast::through_f32(OP, &given, |w| {
            // `w` holds x, then the weight and the bias that were given.
            let mut rest = w[1..].iter();
            let weight = weight.map(|_| rest.next().expect("given"));
            let bias = bias.map(|_| rest.next().expect("given"));
            w[0].group_norm(groups, weight, bias, eps)
        })? {
            return Ok(out);
        }
        self.expect_dtype(OP, DType::F32)?;
        check_eps(OP, eps)?;
        let shape = self.shape().to_vec();
        if shape.len() < 2 || groups == 0 || !shape[1].is_multiple_of(groups) {
            return Err(Error::Shape {
                op: OP,
                msg: format!(
                    "needs input [N, C, *] with C divisible by the {groups} groups, got {shape:?}"
                ),
            });
        }
        let c = shape[1];
        check_channel_param(OP, self, weight, c, "weight")?;
        check_channel_param(OP, self, bias, c, "bias")?;
        let per_group = self.numel().checked_div(shape[0] * groups).unwrap_or(0);
        let rows = self.reshape(&[shape[0] * groups, per_group])?;
        let normed = if fused_applies(self, per_group) {
            // Each group a row of LayerNorm's fused kernels, without its affine (a U-Net's
            // groups ran 5-6x faster than through the composed ops).
            let ones = Tensor::ones(&[per_group], self.device())?;
            let zeros = Tensor::zeros(&[per_group], self.device())?;
            fused_in_row_runs(Norm::Layer, &rows, &ones, Some(&zeros), eps, per_group)?
        } else {
            standardised(&rows, &[1], eps)?
        }
        .reshape(&shape)?;
        let mut channel_shape = vec![1; shape.len()];
        channel_shape[1] = c;
        let scaled = match weight {
            Some(w) => normed.mul(&w.reshape(&channel_shape)?)?,
            None => normed,
        };
        match bias {
            Some(b) => scaled.add(&b.reshape(&channel_shape)?),
            None => Ok(scaled),
        }
    }
}

/// The fused row kernels of `norm` over rows of `len` (checked), and its backward rule:
/// the grads of x, the weight and (LayerNorm's) bias.
fn fused_norm(
    norm: Norm,
    input: &Tensor,
    weight: &Tensor,
    bias: Option<&Tensor>,
    eps: f32,
    len: usize,
) -> Result<Tensor> {
    let op = norm.op();
    let rows = input.numel().checked_div(len).unwrap_or(0);
    let dev = input.device();
    let (x, weight_c, bias_c) = {
        let _no_grad = NoGradGuard::new();
        let weight_c = weight.contiguous()?;
        // RMSNorm reads no bias: the weight is bound in its place.
        let bias_c = match bias {
            Some(b) => b.contiguous()?,
            None => weight_c.clone(),
        };
        // A part of a larger buffer (a chunk of a batch) is bound as a window of itself.
        (input.contiguous()?.bindable(), weight_c, bias_c)
    };
    let out = Tensor::empty(op, input.shape(), DType::F32, dev)?;
    let stats = Tensor::empty(op, &[rows, 2], DType::F32, dev)?;
    let params = NormParams {
        rows: rows as u32,
        len: len as u32,
        eps,
        x_offset: x.layout().offset as u32,
        weight_offset: weight_c.layout().offset as u32,
        bias_offset: bias_c.layout().offset as u32,
        grad_offset: 0,
        center: matches!(norm, Norm::Layer) as u32,
    };
    // Rows read as vec4s when every row and every tensor starts on a multiple of 4.
    let aligned = len.is_multiple_of(4)
        && [&x, &weight_c, &bias_c]
            .iter()
            .all(|t| t.layout().offset % 4 == 0);
    if rows > 0 && len > 0 {
        let bound = [
            (1, &x),
            (2, &weight_c),
            (3, &bias_c),
            (4, &out),
            (5, &stats),
        ];
        launch_rows(op, Pass::Forward, aligned, &bound, &params, rows, len)?;
    }
    let inputs: Vec<&Tensor> = [input, weight].into_iter().chain(bias).collect();
    // A frozen norm's (or GroupNorm's fixed rows') parameters take no grads: none computed.
    let param_grads_wanted = weight.requires_grad() || bias.is_some_and(|b| b.requires_grad());
    let has_bias = bias.is_some();
    Ok(record(op, out, &inputs, |_| {
        let (x, weight_c) = (x.detach(), weight_c.detach());
        move |g: &Tensor| {
            // A run's grad is a view of the whole output's (see `fused_in_row_runs`).
            let g = g.contiguous()?.bindable();
            let aligned = aligned && g.layout().offset % 4 == 0;
            let params = NormParams {
                grad_offset: g.layout().offset as u32,
                ..params
            };
            // The parameters' grads first, so that the input grad's launch is the last to
            // touch the row statistics, right before its consumer (see `launch_rows`).
            let (grad_weight, grad_bias) = match param_grads_wanted {
                true => {
                    let (w, b) = param_grads(op, &x, &stats, &g, &params, aligned)?;
                    (Some(w), b)
                }
                false => (None, None),
            };
            let grad_x = Tensor::empty(op, x.shape(), DType::F32, g.device())?;
            if rows > 0 && len > 0 {
                let bound = [(1, &x), (2, &weight_c), (4, &grad_x), (5, &stats), (6, &g)];
                launch_rows(op, Pass::Backward, aligned, &bound, &params, rows, len)?;
            }
            let mut grads = vec![Some(grad_x), grad_weight];
            if has_bias {
                grads.push(grad_bias);
            }
            Ok(grads)
        }
    }))
}

/// The shortest row the GPU flavour gives a workgroup: 2 groups of 4 features per invocation.
/// A shorter row leaves most of the workgroup idle through its reductions' barriers (on
/// lavapipe a row of 128 took 4x the time of an invocation per row, a row of 512 2-3x): it
/// gets a subgroup where the device has subgroups of a fixed width, else an invocation.
const WORKGROUP_ROW_LEN: usize = 512;

/// The lanes the GPU flavour gives a row of `len` features on `device`: a subgroup below
/// [`WORKGROUP_ROW_LEN`], else a workgroup (the module's specialisation on either flavour).
fn row_lanes(device: &Device, len: usize) -> RowLanes {
    RowLanes::of(device, len < WORKGROUP_ROW_LEN)
}

/// The row kernels' passes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Pass {
    Forward,
    Backward,
}

/// Launches a pass of the row kernels (writing binding 4 through the EPILOGUE SECTION's
/// stores), which a captured step may give the elementwise ops that consume its output: an
/// activation after the forward, the residual stream's other grad added to the backward's.
/// The CPU flavour runs an invocation per row; the GPU flavour a workgroup per row of at least
/// [`WORKGROUP_ROW_LEN`] features and a subgroup per shorter row (an invocation where the
/// device has no subgroups of a fixed width), whose neighbour lanes read neighbour features.
fn launch_rows(
    op: &'static str,
    pass: Pass,
    aligned: bool,
    bound: &[(u32, &Tensor)],
    params: &NormParams,
    rows: usize,
    len: usize,
) -> Result<()> {
    let dev = bound[0].1.device();
    let lanes = row_lanes(dev, len);
    let in_lanes = dev.kernel_flavor() == KernelFlavor::Gpu
        && (len >= WORKGROUP_ROW_LEN || lanes == RowLanes::Subgroup);
    let row_groups = lanes.workgroups(rows, NORM_WORKGROUP);
    let (entry, workgroups) = match (pass, in_lanes) {
        (Pass::Forward, false) => ("forward", groups(rows, NORM_WORKGROUP)),
        (Pass::Backward, false) => ("backward", groups(rows, NORM_WORKGROUP)),
        (Pass::Forward, true) => ("forward_rows", row_groups),
        (Pass::Backward, true) => ("backward_rows", row_groups),
    };
    let source = move || norm_source(aligned, lanes);
    let variant = norm_variant(aligned, lanes);
    let kernel = Kernel::specialised(&NORM, entry, &variant, &source);
    let site = || {
        Fusion::Epilogue(EpilogueSite {
            entry,
            output: 4,
            numel: rows * len,
            vec4_output: true,
        })
    };
    Launch::new(op, &kernel, bound, params)
        .fusible(site)
        .record(workgroups)
}

/// The weight's and (LayerNorm's) the bias's grads: column sums of `g * xhat` and of `g` over the rows.
/// One launch sums each chunk of `WEIGHT_GRAD_ROWS` rows (recomputing `xhat` from `x` and the
/// row statistics, so no `[rows, len]` tensor of `g * xhat` is stored: at the top of a
/// backward pass that would be the peak), then a reduction sums the chunks.
fn param_grads(
    op: &'static str,
    x: &Tensor,
    stats: &Tensor,
    g: &Tensor,
    params: &NormParams,
    aligned: bool,
) -> Result<(Tensor, Option<Tensor>)> {
    let (rows, len) = (params.rows as usize, params.len as usize);
    let (chunks, width) = (rows.div_ceil(WEIGHT_GRAD_ROWS), len.div_ceil(4) * 4);
    let weight_partials = Tensor::empty(op, &[chunks, width], DType::F32, g.device())?;
    let bias_partials = Tensor::empty(op, &[chunks, width], DType::F32, g.device())?;
    if rows > 0 && len > 0 {
        let bound = [
            (1, x),
            (5, stats),
            (6, g),
            (7, &weight_partials),
            (8, &bias_partials),
        ];
        // The module of the rows' passes (one compile for the three entries).
        let lanes = row_lanes(g.device(), len);
        let source = move || norm_source(aligned, lanes);
        let variant = norm_variant(aligned, lanes);
        let kernel = Kernel::specialised(&NORM, "weight_grads", &variant, &source);
        let workgroups = groups(chunks * width / 4, NORM_WORKGROUP);
        Launch::new(op, &kernel, &bound, params).record(workgroups)?;
    }
    // One chunk of whole fours holds the sums already.
    let column_sums = |partials: Tensor| {
        if chunks == 1 && width == len {
            partials.reshape(&[len])
        } else {
            partials.narrow(1, 0, len)?.sum_dims(&[0], false)
        }
    };
    let grad_bias = match params.center {
        1 => Some(column_sums(bias_partials)?),
        _ => None, // RMSNorm has no bias
    };
    Ok((column_sums(weight_partials)?, grad_bias))
}
