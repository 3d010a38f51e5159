//! Ops that produce or consume u32 indices: `argmax`, `index_select`, `gather`. Indices are
//! checked against the bound each u32 tensor carries, so no data is read back to validate.

use crate::device::Device;
use crate::error::{Error, Result};
use crate::kernel::{
    groups, rows_per_window, Kernel, KernelParams, Launch, ShaderFamily, MAX_LOOP_LEN, WORKGROUP,
};
use crate::ops::cast;
use crate::ops::reduce::{as_matrix, reduced_shape, ReduceParams};
use crate::ops::{on_scalar_as_row, sum_over_chunks};
use crate::tensor::dim::Dim;
use crate::tensor::grad_mode::NoGradGuard;
use crate::tensor::graph::record;
use crate::tensor::layout::KERNEL_RANK;
use crate::tensor::tape;
use crate::tensor::{DType, IndexRange, Tensor};

crate::kernel_params! {
    /// `index_select` and its backward over contiguous `[outer, dim_size, inner]` data, of
    /// which `selected` slices are picked; `n` counts the elements written (read, for
    /// `index_select_scatter`; runs of 16 written, for `index_select_backward`). The table's
    /// bound rows are `row_start .. row_start + row_count` (all of them, unless a table past
    /// one binding is bound a window of rows at a time; then `outer` is 1), from element
    /// `table_offset` of its binding.
    pub(crate) struct IndexSelectParams {
        n: u32, selected: u32, inner: u32, dim_size: u32, src_offset: u32, indices_offset: u32,
        row_start: u32, row_count: u32, table_offset: u32,
    }
}

crate::kernel_params! {
    /// `gather`: `dim` counts in the six padded dims; `shape` is the indices' (padded with 1s)
    /// and `src_strides` the input's (padded with 0s).
    pub(crate) struct GatherParams {
        n: u32,
        dim: u32,
        src_offset: u32,
        indices_offset: u32,
        src_dim_size: u32,
        rank: u32,
        shape: [u32; 6],
        src_strides: [u32; 6],
    }
}

crate::kernel_params! {
    /// `gather_backward`: shapes padded with 1s to six dims, `dim` counted in them.
    pub(crate) struct GatherBackwardParams {
        n: u32,
        dim: u32,
        src_offset: u32,
        indices_offset: u32,
        rank: u32,
        dst_shape: [u32; 6],
        indices_shape: [u32; 6],
    }
}

static INDEX: ShaderFamily = ShaderFamily {
    name: "index",
    wgsl: include_str!("../../shaders/index.wgsl"),
    params: &[
        // argmax and argmax_join: an `[rows, len]` view in chunks, as the reductions read it.
        &ReduceParams::LAYOUT,
        &IndexSelectParams::LAYOUT,
        &GatherParams::LAYOUT,
        &GatherBackwardParams::LAYOUT,
    ],
    preludes: &[],
};

#[cfg(test)]
pub(crate) fn kernel_sources() -> Vec<(String, String)> {
    vec![("index".into(), INDEX.source(&[]))]
}

/// Elements one argmax invocation scans at most.
const ARGMAX_CHUNK: usize = MAX_LOOP_LEN;

/// Lookups one backward invocation sums over at most: each dst element loops over them.
const SCATTER_CHUNK: usize = MAX_LOOP_LEN;

/// Lookups one `index_select_backward` invocation sums over at most: each costs one iteration
/// of its loop over the lookups and, where it matches, up to 4 of the loop that adds its run
/// (see `index_select_backward` in shaders/index.wgsl).
const INDEX_SELECT_GRAD_CHUNK: usize = MAX_LOOP_LEN / 5;

/// Past this many (table rows x lookups; for gather, input elements x lookups along its dim),
/// index_select's and gather's grads are scattered with atomic adds (work in the lookups)
/// rather than gathered per table element (work in rows x lookups: 44 s for an
/// Embedding(10000, 64) over 8,192 tokens on lavapipe).
const GATHER_MAX_WORK: usize = 1 << 20;

/// The grad of index_select by scattering each incoming element into a zeroed table.
fn index_select_scatter(
    grad: &Tensor,
    dim: usize,
    indices: &Tensor,
    shape: &[usize],
) -> Result<Tensor> {
    const OP: &str = "index_select";
    let out = Tensor::zeros(shape, grad.device())?;
    let n = grad.numel();
    if n == 0 {
        return Ok(out);
    }
    let (g, idx) = (grad.contiguous()?, indices.contiguous()?);
    let inner: usize = shape[dim + 1..].iter().product();
    let kernel = Kernel::plain(&INDEX, "index_select_scatter");
    // An incoming grad past one binding (an embedding's, over a long batch of tokens) is
    // bound a run of lookups at a time.
    let lookups = idx.numel();
    let per = match g.exceeds_binding() && dim == 0 {
        true => rows_per_window(g.device(), inner),
        false => lookups,
    };
    if per == 0 {
        return Err(crate::ops::too_large_view(OP, &g));
    }
    for first in (0..lookups).step_by(per) {
        let count = per.min(lookups - first);
        let (g, idx) = match per == lookups {
            true => (g.clone(), idx.clone()),
            false => (
                g.window(first * inner, count * inner),
                idx.view(idx.layout().narrow(OP, 0, first, count)?),
            ),
        };
        let n = g.numel();
        for (rows, table) in row_windows(OP, &out, dim, shape[dim], inner)? {
            // Each launch adds the lookups whose rows its window of the table holds.
            let (src, at) = (g.layout().offset, table.layout().offset);
            let params = IndexSelectParams::new(n, &idx, (inner, shape[dim]), src, rows, at);
            let bound = [(1, &g), (3, &idx), (4, &table)];
            Launch::new(OP, &kernel, &bound, &params).record(groups(n, WORKGROUP))?;
        }
    }
    Ok(out)
}

impl IndexSelectParams {
    /// Params for `n` elements over a table of `dim_size` rows of `inner` elements, picking
    /// the rows `idx` names, with the table's rows `rows` bound from element `table_offset`
    /// and the incoming grad (backward only) from element `src_offset`.
    fn new(
        n: usize,
        idx: &Tensor,
        (inner, dim_size): (usize, usize),
        src_offset: usize,
        rows: std::ops::Range<usize>,
        table_offset: usize,
    ) -> IndexSelectParams {
        IndexSelectParams {
            n: n as u32,
            selected: idx.numel() as u32,
            inner: inner as u32,
            dim_size: dim_size as u32,
            src_offset: src_offset as u32,
            indices_offset: idx.layout().offset as u32,
            row_start: rows.start as u32,
            row_count: rows.len() as u32,
            table_offset: table_offset as u32,
        }
    }
}

/// The table `x` (contiguous, `[outer, rows, inner]` around `dim`) as the windows kernels
/// bind: all of it, or, past one binding, runs of whole rows (when `outer` is 1), each with
/// its range of rows. An error when one row is past a binding, or `outer` is not 1.
fn row_windows(
    op: &'static str,
    x: &Tensor,
    dim: usize,
    rows: usize,
    inner: usize,
) -> Result<Vec<(std::ops::Range<usize>, Tensor)>> {
    if !x.exceeds_binding() {
        return Ok(vec![(0..rows, x.clone())]);
    }
    let outer: usize = x.shape()[..dim].iter().product();
    let per = rows_per_window(x.device(), inner);
    if outer != 1 || per == 0 || !x.is_contiguous() {
        return Err(crate::ops::too_large_view(op, x));
    }
    Ok((0..rows)
        .step_by(per)
        .map(|r| {
            let count = per.min(rows - r);
            (r..r + count, x.window(r * inner, count * inner))
        })
        .collect())
}

/// `shape` padded at the front with `fill` to six dims.
fn padded(shape: &[usize], fill: u32) -> [u32; KERNEL_RANK] {
    let pad = KERNEL_RANK - shape.len();
    std::array::from_fn(|d| if d < pad { fill } else { shape[d - pad] as u32 })
}

/// Errors unless every value of `indices` is below `size` (known from its bound).
fn check_bound(
    op: &'static str,
    indices: &Tensor,
    size: usize,
    x: &Tensor,
    dim: usize,
) -> Result<()> {
    expect_indices_below(op, indices, size, |index| {
        format!(
            "index {index} is out of range for dim {dim} of size {size} (shape {:?})",
            x.shape()
        )
    })
}

/// Errors unless every value of the u32 `indices` is below `size`, known from the bound the
/// tensor carries from its creation (no read-back); `out_of_range` words the error for the
/// largest index. A captured step notes `size` as the bound its plan admits indices under.
pub(crate) fn expect_indices_below(
    op: &'static str,
    indices: &Tensor,
    size: usize,
    out_of_range: impl FnOnce(u32) -> String,
) -> Result<()> {
    expect_indices_in(op, indices, IndexRange::of_size(size, None), out_of_range)
}

/// Errors unless every value of the u32 `indices` lies in `limit` (below a size, or a loss's
/// ignore_index), known from the range the tensor carries (no read-back); `out_of_range`
/// words the error for the largest index that may lie outside. A captured step notes `limit`
/// as the range its plan admits indices in.
pub(crate) fn expect_indices_in(
    op: &'static str,
    indices: &Tensor,
    limit: IndexRange,
    out_of_range: impl FnOnce(u32) -> String,
) -> Result<()> {
    indices.expect_dtype(op, DType::U32)?;
    if indices.numel() == 0 {
        return Ok(());
    }
    match indices.index_range() {
        Some(range) if range.within(limit) => {
            tape::note_index_limit(indices, limit);
            Ok(())
        }
        Some(range) => {
            // The exception where it is the value outside, else the largest of the others.
            let outside = match range.except {
                Some(e) if e >= limit.below && Some(e) != limit.except => e,
                _ => range.below - 1,
            };
            Err(Error::Index {
                op,
                msg: out_of_range(outside),
            })
        }
        None => Err(Error::Index {
            op,
            msg: "indices of unknown range".into(),
        }),
    }
}

impl Tensor {
    /// Index of the first minimum along `dim` (removed), as u32.
    pub fn argmin(&self, dim: impl Dim, keepdim: bool) -> Result<Tensor> {
        let dim = dim.resolve("argmin", self.rank())?;
        let _no_grad = NoGradGuard::new();
        if let Some(out) = on_scalar_as_row(self, &[dim], |row| row.argmin(0, false)) {
            return out;
        }
        extremum_index("argmin", &self.neg()?, dim, keepdim)
    }

    /// A `[.., classes]` u32 tensor of 0/1: 1 at each label's class, as torch's `one_hot`.
    /// Labels must be below `classes` (an `Error::Index` otherwise).
    pub fn one_hot(labels: &Tensor, classes: usize) -> Result<Tensor> {
        const OP: &str = "one_hot";
        // Compared as f32s, exact below 2^24.
        if classes > 1 << 24 {
            return Err(Error::InvalidArgument {
                op: OP,
                msg: format!("supports up to 2^24 classes, got {classes}"),
            });
        }
        expect_indices_below(OP, labels, classes, |label| {
            format!(
                "label {label} is out of range for {classes} classes (labels {:?})",
                labels.shape()
            )
        })?;
        let classes_row = Tensor::arange(classes, labels.device())?;
        let column = labels.to_dtype(DType::F32)?.unsqueeze(labels.rank())?;
        column.eq(&classes_row)
    }

    /// This tensor with `source`'s slices added at `indices` along `dim`, as torch's
    /// `index_add`: slice `i` of `source` (along `dim`) is added to slice `indices[i]`;
    /// repeated indices add up. One product with the one-hot matrix of the indices, so the
    /// grads are the incoming grad (this tensor) and its slices at `indices` (`source`).
    pub fn index_add(&self, dim: impl Dim, indices: &Tensor, source: &Tensor) -> Result<Tensor> {
        let dim = dim.resolve("index_add", self.rank())?;
        const OP: &str = "index_add";
        if let Some(out) =
            cast::through_f32(OP, &[self, source], |w| w[0].index_add(dim, indices, &w[1]))?
        {
            return Ok(out);
        }
        for t in [self, source] {
            t.expect_dtype(OP, DType::F32)?;
        }
        self.layout().check_dim(OP, dim)?;
        let mut want = self.shape().to_vec();
        want[dim] = indices.numel();
        if indices.rank() != 1 || source.shape() != want.as_slice() {
            return Err(Error::Shape {
                op: OP,
                msg: format!(
                    "needs indices [n] and a source of shape {want:?} for input {:?}, got indices {:?} and source {:?}",
                    self.shape(),
                    indices.shape(),
                    source.shape()
                ),
            });
        }
        let size = self.shape()[dim];
        check_bound(OP, indices, size, self, dim)?;
        // [n, size]: row i is one-hot at indices[i].
        let scatter = Tensor::one_hot(indices, size)?.to_dtype(DType::F32)?;
        let last = self.rank() - 1;
        // Move `dim` last, multiply by the one-hot, move it back.
        let added = source
            .transpose(dim, last)?
            .matmul(&scatter)?
            .transpose(dim, last)?;
        self.add(&added)
    }

    /// Index of the first maximum along `dim`, as u32.
    pub fn argmax(&self, dim: impl Dim, keepdim: bool) -> Result<Tensor> {
        let dim = dim.resolve("argmax", self.rank())?;
        // u32 indices have no grad: argmax records nothing, and neither do its internals.
        let _no_grad = NoGradGuard::new();
        if let Some(out) = on_scalar_as_row(self, &[dim], |row| row.argmax(0, false)) {
            return out;
        }
        extremum_index("argmax", self, dim, keepdim)
    }

    /// The slices `indices[j]` of `dim`, in order: `out` has `dim` of size `indices.len()`.
    /// Its grad adds each slice's grad back at its index (repeated indices add up). A U32
    /// tensor (a batch of token rows) is picked from exactly, and its picks stay valid
    /// indices wherever its values were.
    pub fn index_select(&self, dim: impl Dim, indices: &Tensor) -> Result<Tensor> {
        let dim = dim.resolve("index_select", self.rank())?;
        if let Some(out) =
            cast::through_f32("index_select", &[self], |w| w[0].index_select(dim, indices))?
        {
            return Ok(out);
        }
        let out = {
            let _no_grad = NoGradGuard::new();
            index_select_forward(self, dim, indices)?
        };
        Ok(record("index_select", out, &[self], |_| {
            let (shape, indices) = (self.shape().to_vec(), indices.clone());
            move |g: &Tensor| Ok(vec![Some(index_select_backward(g, dim, &indices, &shape)?)])
        }))
    }

    /// PyTorch's `gather`: `out[i][j] = self[i][indices[i][j]]` for `dim = 1`, and so on.
    /// `indices` has the rank of `self` and no larger size than `self` in the other dims.
    /// Its grad adds each element's grad back at its index. U32 tensors too, as
    /// [`Tensor::index_select`].
    pub fn gather(&self, dim: impl Dim, indices: &Tensor) -> Result<Tensor> {
        let dim = dim.resolve("gather", self.rank())?;
        if let Some(out) = cast::through_f32("gather", &[self], |w| w[0].gather(dim, indices))? {
            return Ok(out);
        }
        let out = {
            let _no_grad = NoGradGuard::new();
            gather_forward(self, dim, indices)?
        };
        Ok(record("gather", out, &[self], |_| {
            let (shape, indices) = (self.shape().to_vec(), indices.clone());
            move |g: &Tensor| Ok(vec![Some(gather_backward(g, dim, &indices, &shape)?)])
        }))
    }

    /// This tensor with `source`'s elements added at `indices` along `dim`, as torch's
    /// `scatter_add`: for `dim` 1, `out[i][indices[i][j]] += source[i][j]`; repeated indices
    /// add up. `indices` (U32) and `source` have one shape, no larger than this tensor's but
    /// along `dim`. It is gather's backward, so the grads are the incoming grad (this tensor)
    /// and the incoming grad gathered at `indices` (`source`).
    pub fn scatter_add(&self, dim: impl Dim, indices: &Tensor, source: &Tensor) -> Result<Tensor> {
        let dim = dim.resolve("scatter_add", self.rank())?;
        const OP: &str = "scatter_add";
        if let Some(out) = cast::through_f32(OP, &[self, source], |w| {
            w[0].scatter_add(dim, indices, &w[1])
        })? {
            return Ok(out);
        }
        self.expect_same_device(OP, source)?;
        self.expect_same_device(OP, indices)?;
        for t in [self, source] {
            t.expect_dtype(OP, DType::F32)?;
        }
        self.layout().check_dim(OP, dim)?;
        let fits = source.shape() == indices.shape()
            && indices.rank() == self.rank()
            && self.rank() <= KERNEL_RANK
            && (0..self.rank()).all(|d| d == dim || indices.shape()[d] <= self.shape()[d]);
        if !fits {
            return Err(Error::Shape {
                op: OP,
                msg: format!(
                    "needs indices and source of one shape that fits the input but along dim \
                     {dim}, got input {:?}, indices {:?}, source {:?}",
                    self.shape(),
                    indices.shape(),
                    source.shape()
                ),
            });
        }
        check_bound(OP, indices, self.shape()[dim], self, dim)?;
        let scattered = {
            let _no_grad = NoGradGuard::new();
            gather_backward(&source.contiguous()?, dim, indices, self.shape())?
        };
        let scattered = record(OP, scattered, &[source], |_| {
            let indices = indices.clone();
            move |g: &Tensor| Ok(vec![Some(g.gather(dim, &indices)?)])
        });
        self.add(&scattered)
    }
}

/// Errors unless `t` is F32 or U32: the selecting kernels move 32-bit words, whatever they
/// hold (16-bit tensors go through F32 before they get here).
fn expect_word_dtype(op: &'static str, t: &Tensor) -> Result<()> {
    match t.dtype() {
        DType::F32 | DType::U32 => Ok(()),
        _ => t.expect_dtype(op, DType::F32),
    }
}

fn index_select_forward(this: &Tensor, dim: usize, indices: &Tensor) -> Result<Tensor> {
    const OP: &str = "index_select";
    this.expect_same_device(OP, indices)?;
    expect_word_dtype(OP, this)?;
    this.layout().check_dim(OP, dim)?;
    if indices.rank() != 1 {
        return Err(Error::Shape {
            op: OP,
            msg: format!("needs 1-D indices, got shape {:?}", indices.shape()),
        });
    }
    check_bound(OP, indices, this.shape()[dim], this, dim)?;
    let mut shape = this.shape().to_vec();
    shape[dim] = indices.numel();
    let out_bytes = shape.iter().product::<usize>() * 4;
    if out_bytes as u64 > this.device().max_binding_bytes() && dim == 0 {
        // An output past one binding (a long batch of token rows through an embedding): runs
        // of the lookups whose picked rows fit one, laid end to end.
        let per = rows_per_window(this.device(), this.numel() / this.shape()[0]);
        if per == 0 {
            return Err(Error::TooLarge {
                op: OP,
                bytes: out_bytes as u64,
                limit: this.device().max_binding_bytes(),
            });
        }
        let lookups = indices.numel();
        let parts: Vec<Tensor> = (0..lookups)
            .step_by(per)
            .map(|first| {
                let part = indices.narrow(0, first, per.min(lookups - first))?;
                index_select_forward(this, dim, &part)
            })
            .collect::<Result<_>>()?;
        return Ok(Tensor::cat(&parts, 0)?.with_index_range(this.index_range()));
    }
    // A u32 input's picks hold a subset of its values.
    let out = Tensor::empty(OP, &shape, this.dtype(), this.device())?
        .with_index_range(this.index_range());
    let n = out.numel();
    if n == 0 {
        return Ok(out);
    }
    let x = this.contiguous()?;
    let idx = indices.contiguous()?;
    let inner: usize = this.shape()[dim + 1..].iter().product();
    let dim_size = this.shape()[dim];
    let kernel = Kernel::plain(&INDEX, "index_select");
    for (rows, table) in row_windows(OP, &x, dim, dim_size, inner)? {
        // Each launch writes the picked slices whose rows its window holds.
        let at = table.layout().offset;
        let params = IndexSelectParams::new(n, &idx, (inner, dim_size), 0, rows, at);
        Launch::new(OP, &kernel, &[(1, &table), (2, &out), (3, &idx)], &params)
            .record(groups(n, WORKGROUP))?;
    }
    Ok(out)
}

fn gather_forward(this: &Tensor, dim: usize, indices: &Tensor) -> Result<Tensor> {
    const OP: &str = "gather";
    this.expect_same_device(OP, indices)?;
    expect_word_dtype(OP, this)?;
    this.layout().check_dim(OP, dim)?;
    let fits = indices.rank() == this.rank()
        && indices
            .shape()
            .iter()
            .zip(this.shape())
            .enumerate()
            .all(|(d, (i, s))| d == dim || i <= s);
    if !fits || this.rank() > KERNEL_RANK {
        return Err(Error::Shape {
            op: OP,
            msg: format!(
                "indices of shape {:?} do not fit input {:?} along dim {dim}",
                indices.shape(),
                this.shape()
            ),
        });
    }
    check_bound(OP, indices, this.shape()[dim], this, dim)?;
    if this.exceeds_binding() && dim > 0 && this.is_contiguous() {
        // Past one binding: runs of whole slices along the first dim (a batch's log-probs
        // over a real vocabulary), each slice's lookups within it, laid end to end.
        let rows = indices.shape()[0];
        let parts = in_first_dim_runs(OP, this, rows, |first, count, slices| {
            gather_forward(slices, dim, &indices.narrow(0, first, count)?)
        })?;
        return Ok(Tensor::cat(&parts, 0)?.with_index_range(this.index_range()));
    }
    let out = Tensor::empty(OP, indices.shape(), this.dtype(), this.device())?
        .with_index_range(this.index_range());
    let n = out.numel();
    if n == 0 {
        return Ok(out);
    }
    let idx = indices.contiguous()?;
    let pad = KERNEL_RANK - this.rank();
    let params = GatherParams {
        n: n as u32,
        dim: (pad + dim) as u32,
        src_offset: this.layout().offset as u32,
        indices_offset: idx.layout().offset as u32,
        src_dim_size: this.shape()[dim] as u32,
        rank: this.rank() as u32,
        shape: padded(indices.shape(), 1),
        src_strides: padded(&this.layout().strides, 0),
    };
    Launch::new(
        OP,
        &Kernel::plain(&INDEX, "gather"),
        &[(1, this), (2, &out), (3, &idx)],
        &params,
    )
    .record(groups(n, WORKGROUP))?;
    Ok(out)
}

/// The grad of `index_select` for an input of `shape`.
fn index_select_backward(
    grad: &Tensor,
    dim: usize,
    indices: &Tensor,
    shape: &[usize],
) -> Result<Tensor> {
    let selected = indices.numel();
    let table_bytes = shape.iter().product::<usize>() as u64 * 4;
    let limit = grad.device().inner.max_binding_bytes();
    // The scatter takes a table or an incoming grad past one binding (a byte-level model's
    // small table, looked up by a long batch of tokens) in windows.
    let past_binding = table_bytes > limit || (grad.numel() * 4) as u64 > limit;
    if shape[dim] * selected > GATHER_MAX_WORK || past_binding {
        return index_select_scatter(grad, dim, indices, shape);
    }
    if selected > INDEX_SELECT_GRAD_CHUNK {
        let part = |start, len| {
            let (g, i) = (
                grad.narrow(dim, start, len)?,
                indices.narrow(0, start, len)?,
            );
            index_select_backward(&g, dim, &i, shape)
        };
        let sum = sum_over_chunks(selected, INDEX_SELECT_GRAD_CHUNK, part)?;
        return Ok(sum.expect("more than one chunk of lookups"));
    }
    const OP: &str = "index_select";
    let out = Tensor::empty(OP, shape, DType::F32, grad.device())?;
    let n = out.numel();
    if n == 0 {
        return Ok(out);
    }
    // A chunk of a larger grad is bound as a window of itself.
    let (g, idx) = (grad.contiguous()?.bindable(), indices.contiguous()?);
    let inner: usize = shape[dim + 1..].iter().product();
    let all_rows = 0..shape[dim];
    let src = g.layout().offset;
    // One invocation per run of 16 elements of a table row.
    let runs = (n / inner) * inner.div_ceil(16);
    let params = IndexSelectParams::new(runs, &idx, (inner, shape[dim]), src, all_rows, 0);
    Launch::new(
        OP,
        &Kernel::plain(&INDEX, "index_select_backward"),
        &[(1, &g), (2, &out), (3, &idx)],
        &params,
    )
    .record(groups(runs, WORKGROUP))?;
    Ok(out)
}

/// `f(first, count, slices)` over runs of `x`'s (contiguous, past one binding) whole slices
/// along its first dim, `rows` of them from the start, each run bound as a window of them.
fn in_first_dim_runs(
    op: &'static str,
    x: &Tensor,
    rows: usize,
    f: impl Fn(usize, usize, &Tensor) -> Result<Tensor>,
) -> Result<Vec<Tensor>> {
    let inner = x.numel() / x.shape()[0].max(1);
    (first_dim_runs(op, x.device(), rows, inner)?.into_iter())
        .map(|(first, count)| {
            let shape = [&[count], &x.shape()[1..]].concat();
            f(
                first,
                count,
                &x.window(first * inner, count * inner).reshape(&shape)?,
            )
        })
        .collect()
}

/// The runs `(first, count)` of whole slices of `inner` f32 elements along a first dim of
/// `rows` that one binding holds each; a slice past one binding is `TooLarge`. No rows are
/// one empty run, so that the caller has a part of the right trailing shape to join.
fn first_dim_runs(
    op: &'static str,
    device: &Device,
    rows: usize,
    inner: usize,
) -> Result<Vec<(usize, usize)>> {
    let per = rows_per_window(device, inner);
    if per == 0 {
        return Err(Error::TooLarge {
            op,
            bytes: (rows * inner * 4) as u64,
            limit: device.max_binding_bytes(),
        });
    }
    if rows == 0 {
        return Ok(vec![(0, 0)]);
    }
    Ok((0..rows)
        .step_by(per)
        .map(|first| (first, per.min(rows - first)))
        .collect())
}

/// The grad of `gather` for an input of `shape` (and `scatter_add`'s sum): per input element
/// a sum over the lookups along `dim`, or, where that work (input x lookups along `dim`)
/// passes [`GATHER_MAX_WORK`], each lookup's grad added in atomically.
fn gather_backward(grad: &Tensor, dim: usize, indices: &Tensor, shape: &[usize]) -> Result<Tensor> {
    let extent = indices.shape()[dim];
    let out_bytes = shape.iter().product::<usize>() * 4;
    if out_bytes as u64 > grad.device().max_binding_bytes() && dim > 0 {
        // An input past one binding: its grad in runs of whole slices along the first dim,
        // each from the lookups of its own slices (none past the indices' rows), end to end.
        let (rows, lookup_rows) = (shape[0], indices.shape()[0]);
        let inner: usize = shape[1..].iter().product();
        let parts: Vec<Tensor> = (first_dim_runs("gather", grad.device(), rows, inner)?)
            .into_iter()
            .map(|(first, count)| {
                let part_shape = [&[count], &shape[1..]].concat();
                let looked_up = lookup_rows.saturating_sub(first).min(count);
                match looked_up {
                    0 => Tensor::zeros(&part_shape, grad.device()),
                    n => gather_backward(
                        &grad.narrow(0, first, n)?,
                        dim,
                        &indices.narrow(0, first, n)?,
                        &part_shape,
                    ),
                }
            })
            .collect::<Result<_>>()?;
        return Tensor::cat(&parts, 0);
    }
    if shape.iter().product::<usize>() * extent > GATHER_MAX_WORK {
        return gather_scatter(grad, dim, indices, shape);
    }
    if extent > SCATTER_CHUNK {
        let part = |start, len| {
            let (g, i) = (
                grad.narrow(dim, start, len)?,
                indices.narrow(dim, start, len)?,
            );
            gather_backward(&g, dim, &i, shape)
        };
        let sum = sum_over_chunks(extent, SCATTER_CHUNK, part)?;
        return Ok(sum.expect("more than one chunk of lookups"));
    }
    const OP: &str = "gather";
    let out = Tensor::empty(OP, shape, DType::F32, grad.device())?;
    let n = out.numel();
    if n == 0 {
        return Ok(out);
    }
    let (g, idx) = (grad.contiguous()?, indices.contiguous()?);
    let params = GatherBackwardParams::new(n, dim, &g, &idx, shape);
    Launch::new(
        OP,
        &Kernel::plain(&INDEX, "gather_backward"),
        &[(1, &g), (2, &out), (3, &idx)],
        &params,
    )
    .record(groups(n, WORKGROUP))?;
    Ok(out)
}

impl GatherBackwardParams {
    /// `n` invocations over the contiguous incoming grad `g` and lookups `idx` along `dim`
    /// of an input of `shape`.
    fn new(n: usize, dim: usize, g: &Tensor, idx: &Tensor, shape: &[usize]) -> Self {
        GatherBackwardParams {
            n: n as u32,
            dim: (KERNEL_RANK - shape.len() + dim) as u32,
            src_offset: g.layout().offset as u32,
            indices_offset: idx.layout().offset as u32,
            rank: shape.len() as u32,
            dst_shape: padded(shape, 1),
            indices_shape: padded(idx.shape(), 1),
        }
    }
}

/// `gather_backward` by scattering each lookup's grad into a zeroed input (`gather_scatter`).
fn gather_scatter(grad: &Tensor, dim: usize, indices: &Tensor, shape: &[usize]) -> Result<Tensor> {
    const OP: &str = "gather";
    let out = Tensor::zeros(shape, grad.device())?;
    let n = indices.numel();
    if n == 0 {
        return Ok(out);
    }
    let (g, idx) = (grad.contiguous()?, indices.contiguous()?);
    let params = GatherBackwardParams::new(n, dim, &g, &idx, shape);
    Launch::new(
        OP,
        &Kernel::plain(&INDEX, "gather_scatter"),
        &[(1, &g), (3, &idx), (4, &out)],
        &params,
    )
    .record(groups(n, WORKGROUP))?;
    Ok(out)
}

/// Index of the first maximum of `x` along `dim`, as u32: `argmax`, and `argmin` of the
/// negated input, each naming itself in errors. Runs with grad off.
fn extremum_index(op: &'static str, x: &Tensor, dim: usize, keepdim: bool) -> Result<Tensor> {
    if let Some(out) = cast::through_f32(op, &[x], |w| extremum_index(op, &w[0], dim, keepdim))? {
        return Ok(out);
    }
    x.expect_dtype(op, DType::F32)?;
    x.layout().check_dim(op, dim)?;
    let k = x.shape()[dim];
    let out_shape = reduced_shape(x.shape(), &[dim], keepdim);
    if k == 0 && x.numel() == 0 && out_shape.iter().product::<usize>() > 0 {
        return Err(Error::Shape {
            op,
            msg: format!(
                "cannot take {op} over an empty dim of shape {:?}",
                x.shape()
            ),
        });
    }
    if x.exceeds_binding() && dim > 0 && x.is_contiguous() {
        // Past one binding: windows of whole slices along the first dim, each its own
        // launch, the indices laid end to end (the argmax of a batch's logits over a real
        // vocabulary).
        let parts = in_first_dim_runs(op, x, x.shape()[0], |_, _, slices| {
            extremum_index(op, slices, dim, keepdim)
        })?;
        return Ok(Tensor::cat(&parts, 0)?.with_index_bound(Some(k as u32)));
    }
    let mat = as_matrix(x, &[dim])?;
    let out = Tensor::empty(op, &[mat.m], DType::U32, x.device())?.with_index_bound(Some(k as u32));
    let chunks = mat.k.div_ceil(ARGMAX_CHUNK).max(1);
    let params = mat.params(chunks, ARGMAX_CHUNK, 1.0, false);
    let pass = |entry, src: &Tensor, dst: &Tensor, invocations: usize| {
        let kernel = Kernel::plain(&INDEX, entry);
        Launch::new(op, &kernel, &[(1, src), (2, dst)], &params)
            .record(groups(invocations, WORKGROUP))
    };
    if chunks == 1 {
        pass("argmax", &mat.tensor, &out, mat.m)?;
    } else {
        let pairs = Tensor::empty(op, &[mat.m, chunks, 2], DType::U32, x.device())?;
        pass("argmax", &mat.tensor, &pairs, mat.m * chunks)?;
        pass("argmax_join", &pairs, &out, mat.m)?;
    }
    out.reshape(&out_shape)
}
