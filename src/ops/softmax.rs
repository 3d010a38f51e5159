//! Softmax, log-softmax and the fused cross-entropy, forward and backward: row kernels in
//! `shaders/softmax.wgsl` that subtract the row max first (stable for large logits).

use crate::device::KernelFlavor;
use crate::error::{Error, Result};
use crate::kernel::{
    groups, rows_per_window, Kernel, KernelParams, Launch, RowLanes, ShaderFamily, MAX_LOOP_LEN,
    ROW_GROUP_WGSL, WORKGROUP_REDUCE_WGSL,
};
use crate::ops::index::expect_indices_in;
use crate::ops::on_scalar_as_row;
use crate::tensor::dim::Dim;
use crate::tensor::grad_mode::NoGradGuard;
use crate::tensor::graph::record;
use crate::tensor::{DType, IndexRange, Tensor};

crate::kernel_params! {
    /// Every row kernel: `rows` rows of `len` elements from `offset`, written from
    /// `dst_offset`. `log`: 1 for log_softmax. `vec4` (`serial` only): four-wide reads. The
    /// cross-entropy entries: the options of [`RowLoss`], and `grad_stride`, the distance
    /// between rows' grads.
    pub(crate) struct SoftmaxParams {
        rows: u32,
        len: u32,
        offset: u32,
        dst_offset: u32,
        labels_offset: u32,
        log: u32,
        vec4: u32,
        grad_offset: u32,
        grad_stride: u32,
        ignore: u32,
        ignore_index: u32,
        weighted: u32,
        smoothing: f32,
    }
}

static SOFTMAX: ShaderFamily = ShaderFamily {
    name: "softmax",
    wgsl: include_str!("../../shaders/softmax.wgsl"),
    params: &[&SoftmaxParams::LAYOUT],
    preludes: &[ROW_GROUP_WGSL, WORKGROUP_REDUCE_WGSL],
};

#[cfg(test)]
pub(crate) fn kernel_sources() -> Vec<(String, String)> {
    (RowLanes::ALL.iter())
        .map(|lanes| (format!("softmax/{}", lanes.name()), softmax_source(*lanes)))
        .collect()
}

/// Longest row a subgroup runs alone (32 elements a lane on a GPU's 32-wide subgroups); longer
/// rows take a workgroup, so that a few long rows still fill the device.
const SUBGROUP_ROW_MAX_LEN: usize = 1024;

/// The module whose `*_rows` entries run on `lanes`.
fn softmax_source(lanes: RowLanes) -> String {
    lanes.source(&SOFTMAX.source(&[]))
}

/// Rows of the `[M, K]` input one `*_serial` workgroup handles (its `WG`).
const SERIAL_ROWS_PER_GROUP: usize = 64;

/// Invocations of a `*_rows` workgroup (its `WG`): one row, or 8 rows run by its subgroups.
const ROWS_WG: usize = 64;

/// The row kernel families of `shaders/softmax.wgsl`; each has a `_rows` (a group of lanes per row)
/// and a `_serial` (invocation per row) entry.
#[derive(Clone, Copy)]
enum Family {
    Softmax,
    CrossEntropy,
    SoftmaxBackward,
    CrossEntropyBackward,
}

impl Family {
    fn entry(self, serial: bool) -> &'static str {
        match (self, serial) {
            (Family::Softmax, false) => "softmax_rows",
            (Family::Softmax, true) => "softmax_serial",
            (Family::CrossEntropy, false) => "cross_entropy_rows",
            (Family::CrossEntropy, true) => "cross_entropy_serial",
            (Family::SoftmaxBackward, false) => "softmax_backward_rows",
            (Family::SoftmaxBackward, true) => "softmax_backward_serial",
            (Family::CrossEntropyBackward, false) => "cross_entropy_backward_rows",
            (Family::CrossEntropyBackward, true) => "cross_entropy_backward_serial",
        }
    }
}

/// One pass of a row kernel over `m` rows of `k` elements of contiguous `src`, writing `dst`.
/// `grad` is read from its offset, rows `grad_stride` apart (the cross-entropy's per-row
/// grads) or densely (softmax's).
struct RowPass<'a> {
    family: Family,
    src: &'a Tensor,
    dst: &'a Tensor,
    labels: Option<&'a Tensor>,
    grad: Option<&'a Tensor>,
    grad_stride: usize,
    log: bool,
    loss: &'a RowLoss,
}

/// How the cross-entropy weighs each row, as torch's `cross_entropy` options: rows whose
/// label is `ignore_index` give 0, `weight` (F32 `[C]`) weighs each class, and
/// `label_smoothing` mixes in the uniform distribution over the classes.
#[derive(Clone, Default)]
pub(crate) struct RowLoss {
    pub ignore_index: Option<u32>,
    pub weight: Option<Tensor>,
    pub label_smoothing: f32,
}

/// Longest row one invocation walks (several passes each).
const SERIAL_MAX_LEN: usize = MAX_LOOP_LEN;

/// Longest row a workgroup of 64 walks, each invocation taking one element in 64.
const ROWS_MAX_LEN: usize = 64 * SERIAL_MAX_LEN;

impl RowPass<'_> {
    /// Rows `first .. first + count` of this pass's `m`: windows of the tensors with a row's
    /// worth per row (the rows, their softmax or grads), views of the per-row ones (labels,
    /// the cross-entropy's losses and grads).
    fn rows(&self, first: usize, count: usize, m: usize, k: usize) -> Result<RowWindows> {
        let rows_of = |t: &Tensor| -> Result<Tensor> {
            if t.numel() == m * k && t.is_contiguous() {
                return Ok(t.window(first * k, count * k));
            }
            // One value a row (its stride 0 where a mean's grad is broadcast).
            Ok(t.view(t.layout().narrow("rows", 0, first, count)?))
        };
        Ok(RowWindows {
            src: rows_of(self.src)?,
            dst: rows_of(self.dst)?,
            labels: self.labels.map(rows_of).transpose()?,
            grad: self.grad.map(rows_of).transpose()?,
        })
    }
}

/// A run of rows of a [`RowPass`]'s tensors (see [`RowPass::rows`]).
struct RowWindows {
    src: Tensor,
    dst: Tensor,
    labels: Option<Tensor>,
    grad: Option<Tensor>,
}

/// Runs `pass` over `m` rows of `k`: one launch, or, where a tensor is past one binding
/// (the logits of a language model's batch over a real vocabulary), one per window of whole
/// rows.
fn run_rows(op: &'static str, pass: RowPass, m: usize, k: usize) -> Result<()> {
    if k > ROWS_MAX_LEN {
        return Err(Error::Shape {
            op,
            msg: format!(
                "rows of {k} elements are longer than the {ROWS_MAX_LEN} this kernel takes \
                 ({m} rows)"
            ),
        });
    }
    let tensors = [Some(pass.src), Some(pass.dst), pass.labels, pass.grad];
    let Some(large) = tensors.into_iter().flatten().find(|t| t.exceeds_binding()) else {
        let rows = RowWindows {
            src: pass.src.clone(),
            dst: pass.dst.clone(),
            labels: pass.labels.cloned(),
            grad: pass.grad.cloned(),
        };
        return launch_rows(op, &pass, &rows, m, k);
    };
    let per_window = rows_per_window(pass.src.device(), k);
    if per_window == 0 {
        return Err(crate::ops::too_large_view(op, large));
    }
    for first in (0..m).step_by(per_window) {
        let count = per_window.min(m - first);
        launch_rows(op, &pass, &pass.rows(first, count, m, k)?, count, k)?;
    }
    Ok(())
}

/// One launch of `pass`'s kernel over `rows`, `m` rows of `k`. Software adapters give each
/// row one invocation (no barriers; four-wide reads when aligned) once there are enough rows
/// to fill a workgroup and the rows are not too long for one invocation; otherwise, and on
/// GPUs, each row gets a group of lanes ([`RowLanes`]).
fn launch_rows(
    op: &'static str,
    pass: &RowPass,
    rows: &RowWindows,
    m: usize,
    k: usize,
) -> Result<()> {
    let offset = rows.src.layout().offset;
    let dst_offset = rows.dst.layout().offset;
    let cpu_flavor = rows.src.device().kernel_flavor() == KernelFlavor::Cpu;
    let serial = cpu_flavor && m >= SERIAL_ROWS_PER_GROUP && k <= SERIAL_MAX_LEN;
    let vec4 =
        serial && k.is_multiple_of(4) && offset.is_multiple_of(4) && dst_offset.is_multiple_of(4);
    let labels_offset = rows.labels.as_ref().map_or(0, |l| l.layout().offset);
    let grad_offset = rows.grad.as_ref().map_or(0, |g| g.layout().offset);
    let params = SoftmaxParams {
        rows: m as u32,
        len: k as u32,
        offset: offset as u32,
        dst_offset: dst_offset as u32,
        labels_offset: labels_offset as u32,
        log: pass.log as u32,
        vec4: vec4 as u32,
        grad_offset: grad_offset as u32,
        grad_stride: pass.grad_stride as u32,
        ignore: pass.loss.ignore_index.is_some() as u32,
        ignore_index: pass.loss.ignore_index.unwrap_or(0),
        weighted: pass.loss.weight.is_some() as u32,
        smoothing: pass.loss.label_smoothing,
    };
    let device = rows.src.device();
    let lanes = RowLanes::of(device, k <= SUBGROUP_ROW_MAX_LEN);
    let workgroups = if serial {
        groups(m, SERIAL_ROWS_PER_GROUP)
    } else {
        lanes.workgroups(m, ROWS_WG)
    };
    let source = move || softmax_source(lanes);
    let kernel = Kernel::specialised(&SOFTMAX, pass.family.entry(serial), lanes.name(), &source);
    let mut bindings = vec![(1, &rows.src), (2, &rows.dst)];
    bindings.extend(rows.labels.as_ref().map(|l| (3, l)));
    bindings.extend(rows.grad.as_ref().map(|g| (4, g)));
    if rows.labels.is_some() {
        // The class weights' binding needs a buffer when there are none: the logits.
        bindings.push((5, pass.loss.weight.as_ref().unwrap_or(&rows.src)));
    }
    Launch::new(op, &kernel, &bindings, &params).record(workgroups)
}

/// Softmax or log_softmax over `x` moved so that `dim` is last; its backward is one fused
/// row kernel on the saved output.
fn along_dim(op: &'static str, log: bool, x: &Tensor, dim: usize) -> Result<Tensor> {
    // Under autocast, in f32 and returned in F32.
    let x = &crate::ops::autocast::for_f32_op(x)?;
    if x.dtype().is_16_bit() {
        // Statistics in f32; the casts carry the grad back in the input's dtype.
        return along_dim(op, log, &x.to_dtype(DType::F32)?, dim)?.to_dtype(x.dtype());
    }
    x.expect_dtype(op, DType::F32)?;
    x.layout().check_dim(op, dim)?;
    let last = x.rank() - 1;
    let out = {
        let _no_grad = NoGradGuard::new();
        let moved = x.transpose(dim, last)?.contiguous()?;
        let out = Tensor::empty(op, moved.shape(), DType::F32, x.device())?;
        let k = x.shape()[dim];
        let m = x.numel().checked_div(k).unwrap_or(0);
        let pass = RowPass {
            family: Family::Softmax,
            src: &moved,
            dst: &out,
            labels: None,
            grad: None,
            grad_stride: 0,
            log,
            loss: &RowLoss::default(),
        };
        run_rows(op, pass, m, k)?;
        out.transpose(dim, last)?
    };
    Ok(record(op, out, &[x], |out| {
        let y = out.detach();
        move |g: &Tensor| {
            let y_rows = y.transpose(dim, last)?.contiguous()?;
            let g_rows = g.transpose(dim, last)?.contiguous()?;
            let dx = Tensor::empty(op, y_rows.shape(), DType::F32, y.device())?;
            let k = y.shape()[dim];
            let m = y.numel().checked_div(k).unwrap_or(0);
            let pass = RowPass {
                family: Family::SoftmaxBackward,
                src: &y_rows,
                dst: &dx,
                labels: None,
                grad: Some(&g_rows),
                grad_stride: 0,
                log,
                loss: &RowLoss::default(),
            };
            run_rows(op, pass, m, k)?;
            Ok(vec![Some(dx.transpose(dim, last)?)])
        }
    }))
}

impl Tensor {
    /// `exp(x) / sum(exp(x))` along `dim`.
    pub fn softmax(&self, dim: impl Dim) -> Result<Tensor> {
        let dim = dim.resolve("softmax", self.rank())?;
        if let Some(out) = on_scalar_as_row(self, &[dim], |row| row.softmax(0)) {
            return out;
        }
        along_dim("softmax", false, self, dim)
    }

    /// `x - log(sum(exp(x)))` along `dim`.
    pub fn log_softmax(&self, dim: impl Dim) -> Result<Tensor> {
        let dim = dim.resolve("log_softmax", self.rank())?;
        if let Some(out) = on_scalar_as_row(self, &[dim], |row| row.log_softmax(0)) {
            return out;
        }
        along_dim("log_softmax", true, self, dim)
    }
}

/// The cross-entropy of each row of `logits` `[M, C]` f32 against `labels` `[M]` u32, weighed
/// by `loss` (see [`RowLoss`]; the caller checks its weight and ignore_index): `[M]`, 0 on
/// ignored rows. One fused row kernel forward and one backward, which recomputes each row's
/// softmax and reads the rows' grads in place (a mean's broadcast grad included).
pub(crate) fn cross_entropy_rows(
    logits: &Tensor,
    labels: &Tensor,
    loss: RowLoss,
) -> Result<Tensor> {
    const OP: &str = "cross_entropy";
    logits.expect_same_device(OP, labels)?;
    logits.expect_dtype(OP, DType::F32)?;
    labels.expect_dtype(OP, DType::U32)?;
    if logits.rank() != 2 || labels.rank() != 1 || labels.shape()[0] != logits.shape()[0] {
        return Err(Error::Shape {
            op: OP,
            msg: format!(
                "needs logits [N, C] and labels [N], got {:?} and {:?}",
                logits.shape(),
                labels.shape()
            ),
        });
    }
    let (n, c) = (logits.shape()[0], logits.shape()[1]);
    if c == 0 {
        return Err(Error::Shape {
            op: OP,
            msg: format!("needs at least one class, got logits {:?}", logits.shape()),
        });
    }
    // A label may also be the ignore_index, past the classes (torch's -100).
    let allowed = IndexRange::of_size(c, loss.ignore_index);
    expect_indices_in(OP, labels, allowed, |label| {
        let ignore = match loss.ignore_index {
            Some(i) if i as usize >= c => format!(" and is not the ignore_index {i}"),
            _ => String::new(),
        };
        format!(
            "label {label} is out of range for {c} classes{ignore} (logits {:?})",
            logits.shape()
        )
    })?;
    let (dense_logits, dense_labels, losses) = {
        let _no_grad = NoGradGuard::new();
        let dense_logits = logits.contiguous()?;
        let dense_labels = labels.contiguous()?;
        let losses = Tensor::empty(OP, &[n], DType::F32, logits.device())?;
        let pass = RowPass {
            family: Family::CrossEntropy,
            src: &dense_logits,
            dst: &losses,
            labels: Some(&dense_labels),
            grad: None,
            grad_stride: 0,
            log: false,
            loss: &loss,
        };
        run_rows(OP, pass, n, c)?;
        (dense_logits, dense_labels, losses)
    };
    Ok(record(OP, losses, &[logits], |_| {
        let (x, labels) = (dense_logits.detach(), dense_labels);
        move |g: &Tensor| {
            // A rank-1 grad is read through its stride (0 for a mean's broadcast one).
            let g = if g.rank() == 1 {
                g.clone()
            } else {
                g.contiguous()?
            };
            let grad_stride = g.layout().strides.first().copied().unwrap_or(0);
            let dx = Tensor::empty(OP, x.shape(), DType::F32, x.device())?;
            let pass = RowPass {
                family: Family::CrossEntropyBackward,
                src: &x,
                dst: &dx,
                labels: Some(&labels),
                grad: Some(&g),
                grad_stride,
                log: false,
                loss: &loss,
            };
            run_rows(OP, pass, n, c)?;
            Ok(vec![Some(dx)])
        }
    }))
}
