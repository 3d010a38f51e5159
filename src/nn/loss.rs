//! Loss functions.

use crate::device::Device;
use crate::error::{Error, Result};
use crate::ops::autocast::for_f32_op;
use crate::ops::index::expect_indices_in;
use crate::ops::softmax::RowLoss;
use crate::tensor::grad_mode::NoGradGuard;
use crate::tensor::{DType, IndexRange, Tensor};

/// Mean over the batch of the negative log-likelihood of `labels` under
/// `log_softmax(logits)`: `logits` is `[N, C]` f32, `labels` a `[N]` u32 tensor
/// ([`Tensor::from_labels`]) with values below `C`. Fused: one row kernel and one mean.
/// [`cross_entropy_with`] takes torch's options.
pub fn cross_entropy(logits: &Tensor, labels: &Tensor) -> Result<Tensor> {
    cross_entropy_with(logits, labels, &CrossEntropyOptions::default())
}

/// How a loss reduces its per-element values, as torch's `reduction`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Reduction {
    /// The (weighted) mean.
    #[default]
    Mean,
    /// The sum.
    Sum,
    /// No reduction: one value per element, shaped as the targets.
    None,
}

/// A target value past every class that marks a target to ignore, as torch's default
/// `ignore_index` of -100 (whose u32 image this is not: U32 targets have no negative values).
/// Labels from Hugging Face's `-100` map to it; pass it as
/// [`CrossEntropyOptions::ignore_index`].
pub const IGNORE_INDEX: u32 = u32::MAX;

/// The options of [`cross_entropy_with`], as torch's `cross_entropy` arguments.
#[derive(Debug, Clone, Copy, Default)]
pub struct CrossEntropyOptions<'a> {
    /// Targets equal to it contribute 0 and count for nothing in the mean. Any u32: a class
    /// index, or a value past the classes that marks targets as torch's -100 does (U32 has no
    /// -100; [`IGNORE_INDEX`] is one such marker). Targets holding a marker pass this loss's
    /// range check only (index ops still refuse them). With every target ignored the mean is
    /// 0 / 0 = NaN, as in torch.
    pub ignore_index: Option<u32>,
    /// In `[0, 1]`: the target becomes `(1 - s) one_hot + s / C`.
    pub label_smoothing: f32,
    /// F32 `[C]` weights per class (no grad); the mean divides by the targets' weights.
    pub weight: Option<&'a Tensor>,
    /// Mean (default), sum or none.
    pub reduction: Reduction,
}

/// Cross-entropy with torch's options: `logits` `[N, C]` or `[N, C, d1, ..]` (images,
/// sequences), `targets` u32 `[N]` or `[N, d1, ..]` below C. Per element
/// `(1 - s) w[y] (lse - x[y]) + s / C sum_c w[c] (lse - x[c])`, reduced as `reduction` says
/// (the mean divides by the sum of `w[y]` over targets not ignored, as torch). One fused row
/// kernel forward and one backward, the reduction a sum or two on top.
///
/// ```
/// # fn main() -> wgrad::Result<()> {
/// use wgrad::nn::loss::{cross_entropy_with, CrossEntropyOptions};
/// use wgrad::{Device, Tensor};
/// let dev = Device::new()?;
/// let logits = Tensor::randn(&[4, 10], 0, &dev)?; // 4 tokens, 10 classes
/// let targets = Tensor::from_labels(vec![3, 0, 0, 7], &dev)?; // 0 marks padding
/// let opts = CrossEntropyOptions { ignore_index: Some(0), label_smoothing: 0.1, ..Default::default() };
/// let loss = cross_entropy_with(&logits, &targets, &opts)?; // the mean over tokens 0 and 3
/// assert_eq!(loss.shape(), &[] as &[usize]);
/// # Ok(())
/// # }
/// ```
pub fn cross_entropy_with(
    logits: &Tensor,
    targets: &Tensor,
    opts: &CrossEntropyOptions,
) -> Result<Tensor> {
    const OP: &str = "cross_entropy";
    // Under autocast, in f32 (as every loss); outside it 16-bit logits give a loss of their
    // dtype, computed in f32.
    let logits = &for_f32_op(logits)?;
    if let Some(loss) = crate::ops::cast::through_f32(OP, &[logits, targets], |w| {
        cross_entropy_with(&w[0], &w[1], opts)
    })? {
        return Ok(loss);
    }
    let (rows, flat_targets) = class_rows(
        OP,
        "logits",
        logits,
        targets,
        opts.ignore_index,
        opts.weight,
    )?;
    let s = opts.label_smoothing;
    if !(0.0..=1.0).contains(&s) {
        return Err(Error::InvalidArgument {
            op: OP,
            msg: format!("label_smoothing must be in [0, 1], got {s}"),
        });
    }
    let losses = crate::ops::softmax::cross_entropy_rows(
        &rows,
        &flat_targets,
        RowLoss {
            ignore_index: opts.ignore_index,
            weight: opts.weight.cloned(),
            label_smoothing: s,
        },
    )?;
    match opts.reduction {
        Reduction::None => losses.reshape(targets.shape()),
        Reduction::Sum => losses.sum(),
        Reduction::Mean if opts.weight.is_none() && opts.ignore_index.is_none() => losses.mean(),
        Reduction::Mean => {
            // Divided by the weight of the targets that count (their number unweighted).
            let denominator = {
                let _no_grad = NoGradGuard::new();
                target_weights(
                    &flat_targets,
                    opts.weight,
                    opts.ignore_index,
                    logits.device(),
                )?
                .sum()?
            };
            losses.sum()?.div(&denominator)
        }
    }
}

/// Each target's weight, F32 `[M]` for targets `[M]`: `weight[t]` (1 without class weights),
/// 0 for a target equal to `ignore` (a marker past the classes reads a class's weight through
/// [`targets_in_classes`], then 0 like any ignored target).
fn target_weights(
    targets: &Tensor,
    weight: Option<&Tensor>,
    ignore: Option<u32>,
    device: &Device,
) -> Result<Tensor> {
    let weights = match weight {
        None => Tensor::ones(&[targets.numel()], device)?,
        Some(w) => w.index_select(0, &targets_in_classes(targets, w.numel(), ignore)?)?,
    };
    match ignore {
        // The caller's range check left every target below 2^24 but the marker: exact.
        Some(ignore) => weights.masked_fill(&targets.eq_scalar(ignore as f32)?, 0.0),
        None => Ok(weights),
    }
}

/// Mean squared error: `mean((prediction - target)^2)`; the shapes must match.
pub fn mse(prediction: &Tensor, target: &Tensor) -> Result<Tensor> {
    same_shapes("mse", prediction, target)?;
    let (prediction, target) = (&for_f32_op(prediction)?, &for_f32_op(target)?);
    let diff = prediction.sub(target)?;
    diff.mul(&diff)?.mean()
}

/// Mean absolute error: `mean(|prediction - target|)`, as torch's `l1_loss` (grad 0 where
/// they are equal).
pub fn l1(prediction: &Tensor, target: &Tensor) -> Result<Tensor> {
    same_shapes("l1", prediction, target)?;
    let (prediction, target) = (&for_f32_op(prediction)?, &for_f32_op(target)?);
    prediction.sub(target)?.abs()?.mean()
}

/// Huber-style loss, as torch's `smooth_l1_loss`: per element `0.5 d^2 / beta` where
/// `|d| < beta`, else `|d| - 0.5 beta`, averaged; `beta` 0 is [`l1`].
pub fn smooth_l1(prediction: &Tensor, target: &Tensor, beta: f32) -> Result<Tensor> {
    same_shapes("smooth_l1", prediction, target)?;
    if !(beta >= 0.0 && beta.is_finite()) {
        return Err(Error::InvalidArgument {
            op: "smooth_l1",
            msg: format!("beta must be finite and >= 0, got {beta}"),
        });
    }
    let (prediction, target) = (&for_f32_op(prediction)?, &for_f32_op(target)?);
    let d = prediction.sub(target)?.abs()?;
    if beta == 0.0 {
        return d.mean();
    }
    let quadratic = d.mul(&d)?.mul_scalar(0.5 / beta)?;
    let linear = d.sub_scalar(0.5 * beta)?;
    d.lt_scalar(beta)?.where_cond(&quadratic, &linear)?.mean()
}

/// Binary cross-entropy of f32 `targets` in `[0, 1]` under `sigmoid(logits)`, averaged, as
/// torch's `binary_cross_entropy_with_logits`: `softplus(x) - x y`, stable for any logit, with
/// the grad `sigmoid(x) - y`.
pub fn binary_cross_entropy_with_logits(logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
    same_shapes("binary_cross_entropy_with_logits", logits, targets)?;
    let (logits, targets) = (&for_f32_op(logits)?, &for_f32_op(targets)?);
    logits.softplus()?.sub(&logits.mul(targets)?)?.mean()
}

/// Mean over the batch of `-log_probs[i, targets[i]]`, as torch's `nll_loss`: `log_probs`
/// `[N, C]` (a `log_softmax`), `targets` a `[N]` u32 tensor below `C`. [`nll_with`] takes
/// torch's options.
pub fn nll(log_probs: &Tensor, targets: &Tensor) -> Result<Tensor> {
    nll_with(log_probs, targets, &NllOptions::default())
}

/// The options of [`nll_with`], as torch's `nll_loss` arguments.
#[derive(Debug, Clone, Copy, Default)]
pub struct NllOptions<'a> {
    /// As [`CrossEntropyOptions::ignore_index`]: a class, or a marker past the classes such
    /// as [`IGNORE_INDEX`] (torch's -100).
    pub ignore_index: Option<u32>,
    /// F32 `[C]` weights per class (no grad); the mean divides by the targets' weights.
    pub weight: Option<&'a Tensor>,
    /// Mean (default), sum or none.
    pub reduction: Reduction,
}

/// torch's `nll_loss` with its options: `log_probs` `[N, C]` or `[N, C, d1, ..]`, `targets`
/// u32 `[N]` or `[N, d1, ..]` below C (or the ignore_index). Per element `-w[y] x[y]`, 0 for
/// an ignored target, reduced as `reduction` says (the mean divides by the sum of `w[y]` over
/// targets not ignored). Composed: a gather of each target's log-probability and the
/// reductions.
///
/// ```
/// # fn main() -> wgrad::Result<()> {
/// use wgrad::nn::loss::{nll_with, NllOptions, IGNORE_INDEX};
/// use wgrad::{Device, Tensor};
/// let dev = Device::new()?;
/// let log_probs = Tensor::randn(&[3, 5], 0, &dev)?.log_softmax(1)?;
/// let targets = Tensor::from_labels(vec![4, IGNORE_INDEX, 0], &dev)?;
/// let opts = NllOptions { ignore_index: Some(IGNORE_INDEX), ..Default::default() };
/// let loss = nll_with(&log_probs, &targets, &opts)?; // the mean over rows 0 and 2
/// assert_eq!(loss.shape(), &[] as &[usize]);
/// # Ok(())
/// # }
/// ```
pub fn nll_with(log_probs: &Tensor, targets: &Tensor, opts: &NllOptions) -> Result<Tensor> {
    const OP: &str = "nll";
    let log_probs = &for_f32_op(log_probs)?;
    if let Some(loss) =
        crate::ops::cast::through_f32(OP, &[log_probs, targets], |w| nll_with(&w[0], &w[1], opts))?
    {
        return Ok(loss);
    }
    let (rows, flat_targets) = class_rows(
        OP,
        "log_probs",
        log_probs,
        targets,
        opts.ignore_index,
        opts.weight,
    )?;
    let (m, c) = (rows.shape()[0], rows.shape()[1]);
    let allowed = IndexRange::of_size(c, opts.ignore_index);
    expect_indices_in(OP, targets, allowed, |target| {
        format!(
            "target {target} is out of range for {c} classes (log_probs {:?})",
            log_probs.shape()
        )
    })?;
    // Each target's weight, 0 where ignored; ignored targets pick a class they then weigh 0.
    let (weights, picks) = {
        let _no_grad = NoGradGuard::new();
        let weights = target_weights(
            &flat_targets,
            opts.weight,
            opts.ignore_index,
            log_probs.device(),
        )?;
        (
            weights,
            targets_in_classes(&flat_targets, c, opts.ignore_index)?,
        )
    };
    let picked = rows.gather(1, &picks.reshape(&[m, 1])?)?.reshape(&[m])?;
    let losses = picked.mul(&weights)?.neg()?;
    match opts.reduction {
        Reduction::None => losses.reshape(targets.shape()),
        Reduction::Sum => losses.sum(),
        Reduction::Mean => losses.sum()?.div(&weights.sum()?),
    }
}

/// `targets` `[M]` with a marker past the `c` classes (an ignore_index) replaced by class
/// `c - 1`, so that every value indexes a class: the caller weighs those targets 0.
fn targets_in_classes(targets: &Tensor, c: usize, ignore: Option<u32>) -> Result<Tensor> {
    match ignore {
        Some(marker) if marker as usize >= c && c > 0 => Ok((targets.to_dtype(DType::F32)?)
            .clamp(0.0, (c - 1) as f32)?
            .to_dtype(DType::U32)?
            .with_index_bound(Some(c as u32))),
        _ => Ok(targets.clone()),
    }
}

/// A class loss's `input` (named `input_name` in errors) as `[M, C]` rows with the classes
/// last, and its targets as `[M]`, after the checks the class losses share: `input` `[N, C]`
/// or `[N, C, d1, ..]` with `targets` `[N]` or `[N, d1, ..]`; at most 2^24 classes with an
/// ignore_index (the mean's count compares targets as f32s, exact below 2^24: a marker past the
/// classes rounds, but no class rounds to it); class weights as [`check_class_weight`] says.
fn class_rows(
    op: &'static str,
    input_name: &str,
    input: &Tensor,
    targets: &Tensor,
    ignore_index: Option<u32>,
    weight: Option<&Tensor>,
) -> Result<(Tensor, Tensor)> {
    let r = input.rank();
    let mut want_targets = input.shape().to_vec();
    if r >= 2 {
        want_targets.remove(1);
    }
    if r < 2 || targets.shape() != want_targets {
        return Err(Error::Shape {
            op,
            msg: format!(
                "needs {input_name} [N, C] or [N, C, d1, ..] and targets [N] or [N, d1, ..], \
                 got {:?} and {:?}",
                input.shape(),
                targets.shape()
            ),
        });
    }
    let c = input.shape()[1];
    if ignore_index.is_some() && c > 1 << 24 {
        return Err(Error::InvalidArgument {
            op,
            msg: format!("ignore_index supports up to 2^24 classes, got {c}"),
        });
    }
    if let Some(w) = weight {
        check_class_weight(op, w, c, input)?;
    }
    let m = targets.numel();
    let rows = if r == 2 {
        input.clone()
    } else {
        let mut order: Vec<usize> = (0..r).filter(|&d| d != 1).collect();
        order.push(1);
        input.permute(&order)?.reshape(&[m, c])?
    };
    Ok((rows, targets.reshape(&[m])?))
}

/// Checks a loss's class weights: F32 `[C]` on the input's device, taking no grad.
fn check_class_weight(op: &'static str, w: &Tensor, c: usize, input: &Tensor) -> Result<()> {
    input.expect_same_device(op, w)?;
    w.expect_dtype(op, DType::F32)?;
    if w.shape() != [c] {
        return Err(Error::Shape {
            op,
            msg: format!(
                "weight must be [C] = [{c}], got {:?} (input {:?})",
                w.shape(),
                input.shape()
            ),
        });
    }
    if w.requires_grad() {
        return Err(Error::InvalidArgument {
            op,
            msg: "weight takes no grad: pass weight.detach()".into(),
        });
    }
    Ok(())
}

fn same_shapes(op: &'static str, prediction: &Tensor, target: &Tensor) -> Result<()> {
    if prediction.shape() != target.shape() {
        return Err(Error::Shape {
            op,
            msg: format!(
                "prediction {:?} and target {:?} differ",
                prediction.shape(),
                target.shape()
            ),
        });
    }
    Ok(())
}
