//! Op families. Each file holds the forward of its ops (shape rules, output allocation, the
//! kernel launch) and, beside it, their backward rules; each family's WGSL is one file in
//! `shaders/`.

pub(crate) mod attention;
pub(crate) mod autocast;
pub(crate) mod batch_norm;
pub(crate) mod binary;
pub(crate) mod cast;
pub(crate) mod conv;
pub(crate) mod copy;
pub(crate) mod index;
pub(crate) mod matmul;
pub(crate) mod norm;
pub(crate) mod pool;
pub(crate) mod reduce;
pub(crate) mod rope;
pub(crate) mod scan;
pub(crate) mod softmax;
pub(crate) mod sort;
pub(crate) mod unary;
pub(crate) mod view;

use crate::error::Result;
use crate::tensor::Tensor;

/// The most a stride, padding, dilation or kernel side may be: no side of a tensor (at most
/// 2^32 - 1 elements) needs more, the kernels take them as u32s, and the geometry reckoned
/// from values below it cannot overflow.
pub(crate) const MAX_WINDOW_PARAM: usize = u32::MAX as usize;

/// An error naming `op` for the first of `params` (name, value) past [`MAX_WINDOW_PARAM`].
pub(crate) fn check_window_params(op: &'static str, params: &[(&str, usize)]) -> Result<()> {
    match params.iter().find(|(_, v)| *v > MAX_WINDOW_PARAM) {
        Some((name, v)) => Err(crate::Error::InvalidArgument {
            op,
            msg: format!("{name} ({v}) must be at most {MAX_WINDOW_PARAM}"),
        }),
        None => Ok(()),
    }
}

/// torch takes dim 0 (or -1) of a 0-d tensor as a dim of size 1: `op` of `x` as `[1]` along
/// dim 0, its result back as 0-d (one element reduces, sorts and softmaxes to itself, its
/// grad through the reshapes). `None` unless `x` is 0-d and `dims` is `[0]`.
pub(crate) fn on_scalar_as_row(
    x: &Tensor,
    dims: &[usize],
    op: impl FnOnce(&Tensor) -> Result<Tensor>,
) -> Option<Result<Tensor>> {
    (x.rank() == 0 && dims == [0]).then(|| {
        let out = op(&x.reshape(&[1])?)?;
        match out.numel() {
            1 => out.reshape(&[]),
            _ => Ok(out),
        }
    })
}

/// `x` as dense rows `[rows, n]` along `dim` (moved last; a dense view keeps its offset), for
/// the kernels that walk whole rows (sort, cumsum). [`from_rows`] lays their results back out.
pub(crate) fn rows_along(x: &Tensor, dim: usize) -> Result<Tensor> {
    let n = x.shape()[dim];
    let rows = x.numel().checked_div(n).unwrap_or(0);
    x.transpose(dim, x.rank() - 1)?
        .contiguous()?
        .reshape(&[rows, n])
}

/// Rows `[rows, m]` computed from [`rows_along`]`(x, dim)` in the layout of `x` (`shape`),
/// `dim` now of size m (a view: `dim` moved back from last).
pub(crate) fn from_rows(rows: &Tensor, shape: &[usize], dim: usize) -> Result<Tensor> {
    let last = shape.len() - 1;
    let mut moved = shape.to_vec();
    moved.swap(dim, last);
    moved[last] = rows.shape()[1];
    rows.reshape(&moved)?.transpose(dim, last)
}

/// `part(start, len)` for the chunks of at most `chunk` items that cover `0..total`, added
/// up (`None` when `total` is 0): how ops split work whose loops would otherwise run past
/// llvmpipe's iteration limit, or whose buffers would grow with the batch.
pub(crate) fn sum_over_chunks(
    total: usize,
    chunk: usize,
    part: impl Fn(usize, usize) -> Result<Tensor>,
) -> Result<Option<Tensor>> {
    let mut sum: Option<Tensor> = None;
    for start in (0..total).step_by(chunk) {
        let next = part(start, chunk.min(total - start))?;
        sum = Some(match sum {
            Some(s) => s.add(&next)?,
            None => next,
        });
    }
    Ok(sum)
}

/// The sizes of runs of at most `per` (> 0) items that cover `total` in order: what an op
/// past one binding `split`s its input into.
pub(crate) fn run_sizes(total: usize, per: usize) -> Vec<usize> {
    (0..total)
        .step_by(per)
        .map(|first| per.min(total - first))
        .collect()
}

/// `f` over runs of whole rows of `rows` (`[n, len]`), as many as one binding holds each, in
/// order: how a row kernel reaches a tensor past one binding. The caller joins the runs'
/// outputs with `cat` (`split` joins their grads). A row past one binding is `TooLarge`.
pub(crate) fn in_row_runs<T>(
    op: &'static str,
    rows: &crate::tensor::Tensor,
    f: impl FnMut(&crate::tensor::Tensor) -> crate::Result<T>,
) -> crate::Result<Vec<T>> {
    let (n, len) = (rows.shape()[0], rows.shape()[1]);
    let per = crate::kernel::rows_per_window(rows.device(), len);
    if per == 0 {
        return Err(too_large_view(op, rows));
    }
    rows.split(&run_sizes(n, per), 0)?.iter().map(f).collect()
}

/// The error for a strided or broadcast view of a tensor larger than one binding: ops bind
/// windows of dense tensors only.
pub(crate) fn too_large_view(op: &'static str, t: &crate::tensor::Tensor) -> crate::Error {
    crate::Error::TooLarge {
        op,
        bytes: t.storage().bytes(),
        limit: t.device().inner.max_binding_bytes(),
    }
}
