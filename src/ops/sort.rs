//! `sort` and `topk` along a dim, forward and backward (`shaders/sort.wgsl`): a stable merge
//! sort, one invocation per element in each pass (runs of 64 sorted by counting, then
//! `log2(len / 64)` passes that merge neighbouring runs by binary search), so a row of `n`
//! takes `n log n` work whatever its order, and no invocation loops past 64. The last pass
//! keeps each element's rank for the backward, which gathers each element's grad from its
//! rank (0 past the k kept).

use crate::error::{Error, Result};
use crate::kernel::{groups, Kernel, KernelParams, Launch, ShaderFamily, WORKGROUP};
use crate::ops::{from_rows, in_row_runs, rows_along};
use crate::tensor::dim::Dim;
use crate::tensor::grad_mode::NoGradGuard;
use crate::tensor::graph::record;
use crate::tensor::{DType, Tensor};

crate::kernel_params! {
    /// `rows` rows of `len` elements from element `offset` of the input's buffer; `finish`
    /// keeps ranks below `keep`; `merge_runs` merges runs of `width`.
    pub(crate) struct SortParams {
        offset: u32,
        rows: u32,
        len: u32,
        keep: u32,
        descending: u32,
        width: u32,
    }
}

/// Elements of a row that `sort_runs` sorts by counting (the 64u in sort.wgsl).
const RUN: usize = 64;

static SORT: ShaderFamily = ShaderFamily {
    name: "sort",
    wgsl: include_str!("../../shaders/sort.wgsl"),
    params: &[&SortParams::LAYOUT],
    preludes: &[],
};

#[cfg(test)]
pub(crate) fn kernel_sources() -> Vec<(String, String)> {
    vec![("sort".into(), SORT.source(&[]))]
}

/// The first `keep` elements of `x` along `dim` in sorted order, and their positions along
/// `dim` (U32), both with `dim` of size `keep`.
fn sorted(
    op: &'static str,
    x: &Tensor,
    dim: usize,
    descending: bool,
    keep: usize,
) -> Result<(Tensor, Tensor)> {
    x.expect_dtype(op, DType::F32)?;
    x.layout().check_dim(op, dim)?;
    let len = x.shape()[dim];
    if keep > len {
        return Err(Error::Shape {
            op,
            msg: format!(
                "k = {keep} is larger than dim {dim} of size {len} (shape {:?})",
                x.shape()
            ),
        });
    }
    let rows = x.numel().checked_div(len).unwrap_or(0);
    let dev = x.device();
    // Each pass binds the rows' keys and positions, [rows, len] each, whole.
    if (rows * len * 4) as u64 > dev.max_binding_bytes() {
        return sorted_in_row_runs(op, x, dim, descending, keep);
    }
    // Rows [rows, len] with `dim` last (a window of them where they are part of a larger
    // buffer: a run of rows); results [rows, keep] moved back.
    let (ranks, values, indices) = {
        let _no_grad = NoGradGuard::new();
        let rows_t = rows_along(x, dim)?.bindable();
        let ranks = Tensor::empty(op, &[rows, len], DType::U32, dev)?;
        let values = Tensor::empty(op, &[rows, keep], DType::F32, dev)?;
        let indices = Tensor::empty(op, &[rows, keep], DType::U32, dev)?;
        if rows * len > 0 {
            let mut params = SortParams {
                offset: rows_t.layout().offset as u32,
                rows: rows as u32,
                len: len as u32,
                keep: keep as u32,
                descending: descending as u32,
                width: RUN as u32,
            };
            let workgroups = groups(rows * len, WORKGROUP);
            let runs = || -> Result<(Tensor, Tensor)> {
                Ok((
                    Tensor::empty(op, &[rows, len], DType::F32, dev)?,
                    Tensor::empty(op, &[rows, len], DType::U32, dev)?,
                ))
            };
            let (mut keys, mut positions) = runs()?;
            let sort_runs = Kernel::plain(&SORT, "sort_runs");
            Launch::new(
                op,
                &sort_runs,
                &[(1, &rows_t), (7, &keys), (8, &positions)],
                &params,
            )
            .record(workgroups)?;
            let merge_runs = Kernel::plain(&SORT, "merge_runs");
            while (params.width as usize) < len {
                let (merged_keys, merged_positions) = runs()?;
                Launch::new(
                    op,
                    &merge_runs,
                    &[
                        (5, &keys),
                        (6, &positions),
                        (7, &merged_keys),
                        (8, &merged_positions),
                    ],
                    &params,
                )
                .record(workgroups)?;
                (keys, positions) = (merged_keys, merged_positions);
                params.width *= 2;
            }
            let finish = Kernel::plain(&SORT, "finish");
            Launch::new(
                op,
                &finish,
                &[
                    (5, &keys),
                    (6, &positions),
                    (2, &ranks),
                    (3, &values),
                    (4, &indices),
                ],
                &params,
            )
            .record(workgroups)?;
        }
        // Clamped to `keep` by the finish pass.
        (
            ranks.with_index_bound(Some(keep as u32 + 1)),
            values,
            indices,
        )
    };
    let indices = from_rows(
        &indices.with_index_bound(Some(len.max(1) as u32)),
        x.shape(),
        dim,
    )?;
    let values = record(op, values, &[x], |_| {
        let shape = x.shape().to_vec();
        move |g: &Tensor| {
            // Element i's grad is the grad at its rank, 0 where its rank is not kept: the
            // grads padded with a column of zeros, gathered at min(rank, keep).
            let g = g.reshape(&[rows, keep])?.pad2d((0, 1, 0, 0), 0.0)?;
            let grad = g.gather(1, &ranks)?;
            Ok(vec![Some(from_rows(&grad, &shape, dim)?)])
        }
    });
    Ok((from_rows(&values, x.shape(), dim)?, indices))
}

/// [`sorted`] of `x` past one binding: runs of whole rows along `dim` that one binding
/// holds, each sorted as a tensor of its own, the values and positions joined with `cat`
/// (`split` joins the runs' grads). A row past one binding is a `TooLarge` error.
fn sorted_in_row_runs(
    op: &'static str,
    x: &Tensor,
    dim: usize,
    descending: bool,
    keep: usize,
) -> Result<(Tensor, Tensor)> {
    let len = x.shape()[dim];
    let runs = in_row_runs(op, &rows_along(x, dim)?, |run| {
        sorted(op, run, 1, descending, keep)
    })?;
    let (values, positions): (Vec<Tensor>, Vec<Tensor>) = runs.into_iter().unzip();
    let values = Tensor::cat(&values, 0)?;
    let positions = Tensor::cat(&positions, 0)?.with_index_bound(Some(len as u32));
    Ok((
        from_rows(&values, x.shape(), dim)?,
        from_rows(&positions, x.shape(), dim)?,
    ))
}

impl Tensor {
    /// The elements along `dim` in order, ascending or `descending`, and the positions they
    /// came from (U32), as torch's `sort` (stable: equal elements keep their order; NaN sorts
    /// as the largest). The grad goes back to each element's position.
    ///
    /// ```
    /// # fn main() -> wgrad::Result<()> {
    /// use wgrad::{Device, Tensor};
    /// let dev = Device::new()?;
    /// let x = Tensor::from_vec(vec![3.0, 1.0, 2.0], &[3], &dev)?;
    /// let (values, indices) = x.sort(0, false)?;
    /// assert_eq!(values.to_vec()?, vec![1.0, 2.0, 3.0]);
    /// assert_eq!(indices.to_vec_u32()?, vec![1, 2, 0]);
    /// # Ok(())
    /// # }
    /// ```
    pub fn sort(&self, dim: impl Dim, descending: bool) -> Result<(Tensor, Tensor)> {
        let dim = dim.resolve("sort", self.rank())?;
        if self.rank() == 0 && dim == 0 {
            // torch takes dim 0 of a 0-d tensor as a dim of size 1.
            let (values, at) = self.reshape(&[1])?.sort(0, descending)?;
            return Ok((values.reshape(&[])?, at.reshape(&[])?));
        }
        let len = self.shape().get(dim).copied().unwrap_or(0);
        sixteen_bit_values(self, |x| sorted("sort", x, dim, descending, len))
    }

    /// The `k` largest elements along `dim`, largest first, and their positions (U32), as
    /// torch's `topk` (ties in position order, NaN the largest): what top-k sampling takes
    /// from a vocabulary's logits. The grad goes to the `k` positions.
    pub fn topk(&self, k: usize, dim: impl Dim) -> Result<(Tensor, Tensor)> {
        let dim = dim.resolve("topk", self.rank())?;
        if self.rank() == 0 && dim == 0 && k == 1 {
            // torch takes dim 0 of a 0-d tensor as a dim of size 1.
            let (values, at) = self.reshape(&[1])?.topk(1, 0)?;
            return Ok((values.reshape(&[])?, at.reshape(&[])?));
        }
        sixteen_bit_values(self, |x| sorted("topk", x, dim, true, k))
    }
}

/// `f` of `x`; for a 16-bit `x`, of an F32 copy (a recorded cast, so the grad comes back in
/// `x`'s dtype), with the values cast back to `x`'s dtype and the positions as they are.
fn sixteen_bit_values(
    x: &Tensor,
    f: impl FnOnce(&Tensor) -> Result<(Tensor, Tensor)>,
) -> Result<(Tensor, Tensor)> {
    if !x.dtype().is_16_bit() {
        return f(x);
    }
    let (values, positions) = {
        let wide = x.to_dtype(DType::F32)?;
        let _plain = crate::ops::autocast::Suspend::new();
        f(&wide)?
    };
    Ok((values.to_dtype(x.dtype())?, positions))
}
