//! Reductions: `sum`, `mean` and `max`, over all elements or given dims, with `keepdim`.
//! Every reduction is run on an `[M, K]` view (kept dims x reduced dims) by one WGSL
//! template (`shaders/reduce.wgsl`) specialised for sum or max.

use crate::device::KernelFlavor;
use crate::error::{Error, Result};
use crate::kernel::{
    groups, reduces_in_subgroups, rows_per_window, with_subgroup_section, Kernel, KernelParams,
    Launch, ShaderFamily, WORKGROUP,
};
use crate::ops::binary::{binary, BinaryOp};
use crate::ops::cast;
use crate::ops::copy::fill;
use crate::ops::on_scalar_as_row;
use crate::tensor::dim::{resolve_dims, Dim};
use crate::tensor::grad_mode::NoGradGuard;
use crate::tensor::graph::record;
use crate::tensor::layout::merge_dims;
use crate::tensor::{DType, Tensor};

crate::kernel_params! {
    /// `rows` and `serial` over an `[M, K]` view in chunks of `chunk_len`; each result is
    /// multiplied by `scale` (1/K for mean). `vec4` (`serial` only): 1 when the k stride is 1
    /// and the offset and row stride are multiples of 4. `fours` (`serial` only): 1 when each
    /// invocation takes four adjacent rows (see [`in_fours`]).
    pub(crate) struct ReduceParams {
        rows: u32,
        len: u32,
        offset: u32,
        row_stride: u32,
        k_stride: u32,
        chunks: u32,
        chunk_len: u32,
        scale: f32,
        vec4: u32,
        fours: u32,
    }
}

static REDUCE: ShaderFamily = ShaderFamily {
    name: "reduce",
    wgsl: include_str!("../../shaders/reduce.wgsl"),
    params: &[&ReduceParams::LAYOUT],
    preludes: &[],
};

/// Elements one `rows` workgroup reduces at least, so large reductions take two passes.
const MIN_CHUNK: usize = 4096;
/// Elements one `subgroup_rows` subgroup reduces at most (32 a lane on a GPU's 32-wide
/// subgroups), so that a few long rows still split into enough chunks to fill the device.
const SUBGROUP_CHUNK: usize = 1024;
/// Most partial results per row after the first pass.
const MAX_CHUNKS: usize = 1024;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ReduceOp {
    Sum,
    Max,
}

impl ReduceOp {
    /// The module of this op, with the `subgroup_rows` entry where the device has
    /// `subgroups` of a fixed width.
    fn source(self, subgroups: bool) -> String {
        // Max propagates NaN, as PyTorch's does.
        let (identity, combine, combine4) = match self {
            ReduceOp::Sum => ("0.0", "a + b", "a + b"),
            ReduceOp::Max => (
                "bitcast<f32>(0xff800000u)",
                "nan_max(a, b)",
                "nan_max4(a, b)",
            ),
        };
        let source = REDUCE.source(&[
            ("REDUCE_IDENTITY", identity),
            ("REDUCE_VEC4_COMBINE", combine4),
            ("REDUCE_COMBINE", combine),
        ]);
        with_subgroup_section(&source, subgroups)
    }

    /// The name of this op's specialisation for `subgroups` (see [`ReduceOp::source`]).
    fn variant(self, subgroups: bool) -> &'static str {
        match (self, subgroups) {
            (ReduceOp::Sum, true) => "sum_subgroups",
            (ReduceOp::Sum, false) => "sum",
            (ReduceOp::Max, true) => "max_subgroups",
            (ReduceOp::Max, false) => "max",
        }
    }
}

#[cfg(test)]
pub(crate) fn kernel_sources() -> Vec<(String, String)> {
    [ReduceOp::Sum, ReduceOp::Max]
        .iter()
        .flat_map(|op| [true, false].map(|subgroups| (*op, subgroups)))
        .map(|(op, subgroups)| {
            let key = format!("reduce/{}", op.variant(subgroups));
            (key, op.source(subgroups))
        })
        .collect()
}

/// A tensor viewed as `[M, K]`: `M` rows of `K` elements, with one stride each.
pub(crate) struct Matrix {
    pub tensor: Tensor,
    pub m: usize,
    pub k: usize,
    pub row_stride: usize,
    pub k_stride: usize,
}

impl Matrix {
    /// The kernel params of a pass over this view in `chunks` chunks of `chunk_len` per row
    /// (reductions; argmax reads the same block).
    pub(crate) fn params(
        &self,
        chunks: usize,
        chunk_len: usize,
        scale: f32,
        vec4: bool,
    ) -> ReduceParams {
        ReduceParams {
            rows: self.m as u32,
            len: self.k as u32,
            offset: self.tensor.layout().offset as u32,
            row_stride: self.row_stride as u32,
            k_stride: self.k_stride as u32,
            chunks: chunks as u32,
            chunk_len: chunk_len as u32,
            scale,
            vec4: vec4 as u32,
            fours: 0,
        }
    }
}

/// Collapses dims of one operand into one `(size, stride)`, if its strides allow.
fn collapse(shape: &[usize], strides: &[usize]) -> Option<(usize, usize)> {
    let (rank, _, merged) = merge_dims(shape, &[strides])?;
    let size = shape.iter().product();
    match rank {
        0 => Some((size, 0)),
        1 => Some((size, *merged[0].last().expect("padded") as usize)),
        _ => None,
    }
}

/// `x` with its kept dims first and the reduced `dims` after (a view), and how many are kept.
fn kept_first(x: &Tensor, dims: &[usize]) -> Result<(Tensor, usize)> {
    let kept: Vec<usize> = (0..x.rank()).filter(|d| !dims.contains(d)).collect();
    let order = [kept.as_slice(), dims].concat();
    Ok((x.permute(&order)?, kept.len()))
}

/// `p` (from [`kept_first`], `nk` kept dims) as the matrix `[kept, reduced]`, where its
/// strides collapse each side into one.
fn collapsed(p: &Tensor, nk: usize) -> Option<Matrix> {
    let (shape, strides) = (&p.layout().shape, &p.layout().strides);
    let (m, rs) = collapse(&shape[..nk], &strides[..nk])?;
    let (k, ks) = collapse(&shape[nk..], &strides[nk..])?;
    Some(Matrix {
        tensor: p.clone(),
        m,
        k,
        row_stride: rs,
        k_stride: ks,
    })
}

/// Views `x` as `[kept dims, reduced dims]`, copying only when the dims will not collapse.
pub(crate) fn as_matrix(x: &Tensor, dims: &[usize]) -> Result<Matrix> {
    let (p, nk) = kept_first(x, dims)?;
    if let Some(mat) = collapsed(&p, nk) {
        return Ok(mat);
    }
    let dense = p.contiguous()?;
    let m = dense.shape()[..nk].iter().product();
    let k = dense.shape()[nk..].iter().product();
    Ok(Matrix {
        tensor: dense,
        m,
        k,
        row_stride: k,
        k_stride: 1,
    })
}

/// Validated, sorted, de-duplicated dims.
pub(crate) fn check_dims(op: &'static str, x: &Tensor, dims: &[usize]) -> Result<Vec<usize>> {
    let mut sorted = dims.to_vec();
    sorted.sort_unstable();
    sorted.dedup();
    if sorted.len() != dims.len() {
        return Err(Error::InvalidArgument {
            op,
            msg: format!(
                "dims {dims:?} name a dim more than once (input {:?})",
                x.shape()
            ),
        });
    }
    for &d in &sorted {
        x.layout().check_dim(op, d)?;
    }
    Ok(sorted)
}

/// How a reduction of an `[M, K]` view runs: which kernel, in how many chunks per row, and
/// whether each `serial` invocation takes four adjacent rows.
#[derive(Debug, Clone, Copy)]
struct Plan {
    entry: &'static str,
    chunks: usize,
    fours: bool,
}

/// True when `serial` can take the rows of `mat` four at a time, one vec4 per step along k:
/// rows adjacent in memory (a column sum, as a bias grad's sum over the batch), M a multiple
/// of 4, and every group of four starting on a multiple of 4.
fn in_fours(mat: &Matrix) -> bool {
    mat.row_stride == 1
        && mat.k_stride != 1
        && [mat.m, mat.k_stride, mat.tensor.layout().offset]
            .iter()
            .all(|x| x.is_multiple_of(4))
}

/// `serial` invocations over one chunk of every row: one per row, or per four rows.
fn invocations_per_chunk(mat: &Matrix, fours: bool) -> usize {
    if fours {
        mat.m / 4
    } else {
        mat.m
    }
}

/// Neighbouring rows in memory (reducing a leading dim) with enough rows to fill the device
/// take one invocation per row (or per four rows). Otherwise CPU adapters, where barriers are
/// coroutine switches, split rows into enough serial chunks to fill their threads, and GPUs
/// reduce each row chunk with a subgroup where the device has `subgroups` of a fixed width,
/// else with a whole workgroup.
fn plan(mat: &Matrix, cpu_flavor: bool, subgroups: bool) -> Plan {
    let fours = cpu_flavor && in_fours(mat);
    let lanes = invocations_per_chunk(mat, fours);
    if mat.k_stride != 1 && lanes >= 1024 {
        return Plan {
            entry: "serial",
            chunks: 1,
            fours,
        };
    }
    if cpu_flavor {
        let chunks = 2048usize
            .div_ceil(lanes.max(1))
            .clamp(1, mat.k.div_ceil(256).max(1));
        return Plan {
            entry: "serial",
            chunks,
            fours,
        };
    }
    match subgroups {
        true => Plan {
            entry: "subgroup_rows",
            chunks: mat.k.div_ceil(SUBGROUP_CHUNK).clamp(1, MAX_CHUNKS),
            fours: false,
        },
        false => Plan {
            entry: "rows",
            chunks: mat.k.div_ceil(MIN_CHUNK).clamp(1, MAX_CHUNKS),
            fours: false,
        },
    }
}

/// Runs one pass of `entry` over `mat` in `chunks` chunks per row: `[M, chunks]` results.
fn reduce_pass(
    op_name: &'static str,
    op: ReduceOp,
    mat: &Matrix,
    plan: &Plan,
    scale: f32,
) -> Result<Tensor> {
    let Plan {
        entry,
        chunks,
        fours,
    } = *plan;
    let out = Tensor::empty(op_name, &[mat.m, chunks], DType::F32, mat.tensor.device())?;
    // Chunks start on a multiple of 4, so contiguous rows can be read four at a time.
    let chunk_len = mat.k.div_ceil(chunks).next_multiple_of(4);
    let vec4 = mat.k_stride == 1
        && [mat.tensor.layout().offset, mat.row_stride]
            .iter()
            .all(|x| x.is_multiple_of(4));
    let params = ReduceParams {
        fours: fours as u32,
        ..mat.params(chunks, chunk_len, scale, vec4)
    };
    let device = mat.tensor.device();
    let subgroups = reduces_in_subgroups(device);
    let source = move || op.source(subgroups);
    let mut kernel = Kernel::specialised(&REDUCE, entry, op.variant(subgroups), &source);
    if entry == "serial" {
        // A captured step merges consecutive serial reductions (a backward pass's bias and
        // norm-weight grads) into one launch.
        kernel = kernel.merging("serial_part");
    }
    let workgroups = match entry {
        "rows" => (mat.m * chunks) as u32,
        // 32 (row, chunk) items a workgroup, whatever the width of its subgroups (reduce.wgsl).
        "subgroup_rows" => groups(mat.m * chunks, 32),
        _ => groups(invocations_per_chunk(mat, fours) * chunks, WORKGROUP),
    };
    Launch::new(op_name, &kernel, &[(1, &mat.tensor), (2, &out)], &params).record(workgroups)?;
    Ok(out)
}

/// Reduces each row of `mat` into a contiguous tensor of `M` values (times `scale`): one pass,
/// or two when rows are split into chunks.
fn reduce_matrix(op_name: &'static str, op: ReduceOp, mat: &Matrix, scale: f32) -> Result<Tensor> {
    let device = mat.tensor.device();
    let plan = plan(
        mat,
        device.kernel_flavor() == KernelFlavor::Cpu,
        reduces_in_subgroups(device),
    );
    if plan.chunks == 1 {
        return reduce_pass(op_name, op, mat, &plan, scale);
    }
    let partial = reduce_pass(op_name, op, mat, &plan, 1.0)?;
    let partial = Matrix {
        m: mat.m,
        k: plan.chunks,
        row_stride: plan.chunks,
        k_stride: 1,
        tensor: partial,
    };
    let last = Plan {
        entry: plan.entry,
        chunks: 1,
        fours: false,
    };
    reduce_pass(op_name, op, &partial, &last, scale)
}

/// The output shape after reducing `dims` of `shape`.
pub(crate) fn reduced_shape(shape: &[usize], dims: &[usize], keepdim: bool) -> Vec<usize> {
    shape
        .iter()
        .enumerate()
        .filter_map(|(d, &n)| match (dims.contains(&d), keepdim) {
            (false, _) => Some(n),
            (true, true) => Some(1),
            (true, false) => None,
        })
        .collect()
}

/// The reduction itself; `dims` are validated and sorted ([`check_dims`]).
fn reduce(
    op_name: &'static str,
    op: ReduceOp,
    x: &Tensor,
    dims: &[usize],
    keepdim: bool,
    mean: bool,
) -> Result<Tensor> {
    // A 16-bit tensor reduces in f32 and its result is rounded once into its dtype.
    if let Some((dtype, wide)) = cast::widened(op_name, &[x])? {
        return cast::narrowed(reduce(op_name, op, &wide[0], dims, keepdim, mean)?, dtype);
    }
    x.expect_dtype(op_name, DType::F32)?;
    let out_shape = reduced_shape(x.shape(), dims, keepdim);
    let k: usize = dims.iter().map(|&d| x.shape()[d]).product();
    let m: usize = out_shape.iter().product();
    if m == 0 {
        return Tensor::empty(op_name, &out_shape, DType::F32, x.device());
    }
    if k == 0 {
        return match (op, mean) {
            (ReduceOp::Max, _) => Err(Error::Shape {
                op: op_name,
                msg: format!(
                    "cannot take the {op_name} over an empty dim of shape {:?}",
                    x.shape()
                ),
            }),
            (ReduceOp::Sum, false) => fill(op_name, &out_shape, 0.0, 0.0, x.device()),
            (ReduceOp::Sum, true) => fill(op_name, &out_shape, f32::NAN, 0.0, x.device()),
        };
    }
    if x.exceeds_binding() {
        return reduce_windows(op_name, op, x, dims, mean)?.reshape(&out_shape);
    }
    if let Some((outer, innermost)) = separated_runs(x, dims)? {
        // The innermost run first, along its unit strides, then the rest of the smaller
        // partial result: where one pass would first copy the whole input dense.
        let partial = reduce(op_name, op, x, innermost, true, mean)?;
        return reduce(op_name, op, &partial, outer, true, mean)?.reshape(&out_shape);
    }
    let mat = as_matrix(x, dims)?;
    let scale = if mean { 1.0 / k as f32 } else { 1.0 };
    reduce_matrix(op_name, op, &mat, scale)?.reshape(&out_shape)
}

/// Reduced `dims` (sorted) that make no one matrix view of `x` and fall into runs of adjacent
/// dims, the last of them innermost (a conv bias's grad: `[N, C, H, W]` over N, H and W):
/// `(the other dims, the innermost run)`, which reduce one after the other in place.
fn separated_runs<'a>(x: &Tensor, dims: &'a [usize]) -> Result<Option<(&'a [usize], &'a [usize])>> {
    let Some(&last) = dims.last() else {
        return Ok(None);
    };
    let start = (1..dims.len())
        .rev()
        .find(|&i| dims[i - 1] + 1 != dims[i])
        .unwrap_or(0);
    if start == 0 || last + 1 != x.rank() {
        return Ok(None);
    }
    let (p, nk) = kept_first(x, dims)?;
    if collapsed(&p, nk).is_some() {
        return Ok(None);
    }
    Ok(Some(dims.split_at(start)))
}

/// [`reduce`] of a dense tensor larger than one binding: windows of whole slices along its
/// first dim, each reduced on its own, then the partial results combined (added, or their
/// maximum, when the first dim is reduced; laid end to end when it is not). The leading dims
/// that are all reduced or all kept count as one first dim (a whole sum is over single
/// elements). The result has the input's elements less the reduced ones.
fn reduce_windows(
    op_name: &'static str,
    op: ReduceOp,
    x: &Tensor,
    dims: &[usize],
    mean: bool,
) -> Result<Tensor> {
    if !x.is_contiguous() {
        return Err(crate::ops::too_large_view(op_name, x));
    }
    let k: usize = dims.iter().map(|&d| x.shape()[d]).product();
    let (shape, dims) = leading_dims_merged(x.shape(), dims);
    let x = &x.reshape(&shape)?;
    let dims = dims.as_slice();
    let rows = shape[0];
    let inner: usize = shape[1..].iter().product();
    let per = rows_per_window(x.device(), inner);
    if per == 0 {
        return Err(crate::ops::too_large_view(op_name, x));
    }
    let mut parts = Vec::new();
    for start in (0..rows).step_by(per) {
        let count = per.min(rows - start);
        let slices = x
            .window(start * inner, count * inner)
            .reshape(&[&[count], &shape[1..]].concat())?;
        parts.push(reduce(op_name, op, &slices, dims, true, false)?);
    }
    let combined = if dims.contains(&0) {
        let mut total = parts[0].clone();
        for part in &parts[1..] {
            total = match op {
                ReduceOp::Sum => total.add(part)?,
                ReduceOp::Max => binary(&total, part, BinaryOp::Maximum)?,
            };
        }
        total
    } else {
        Tensor::cat(&parts, 0)?
    };
    if mean {
        return combined.mul_scalar(1.0 / k as f32);
    }
    Ok(combined)
}

/// `shape` with its leading dims that are all reduced, or all kept, merged into one (dims of
/// size 1 go with either; at least one dim: a scalar is `[1]`), and the reduced `dims`
/// (sorted) renumbered to match.
fn leading_dims_merged(shape: &[usize], dims: &[usize]) -> (Vec<usize>, Vec<usize>) {
    if shape.is_empty() {
        return (vec![1], dims.to_vec());
    }
    let status = |d: usize| (shape[d] != 1).then(|| dims.contains(&d));
    let lead = (0..shape.len()).find_map(status);
    let merged = (0..shape.len())
        .find(|&d| status(d).is_some_and(|s| Some(s) != lead))
        .unwrap_or(shape.len());
    let new_shape = [&[shape[..merged].iter().product()], &shape[merged..]].concat();
    let new_dims = ((lead == Some(true)).then_some(0).into_iter())
        .chain(
            dims.iter()
                .filter(|&&d| d >= merged)
                .map(|&d| d + 1 - merged),
        )
        .collect();
    (new_shape, new_dims)
}

/// `grad` of a reduction over `dims` (shaped like its output) broadcast back to the input's
/// `shape` (a view, no copy).
fn expand_back(grad: &Tensor, shape: &[usize], dims: &[usize]) -> Result<Tensor> {
    grad.reshape(&reduced_shape(shape, dims, true))?
        .expand(shape)
}

/// Forward and backward of `sum`, `mean` (a sum scaled by 1/K) and `max`.
fn reduce_op(
    name: &'static str,
    op: ReduceOp,
    x: &Tensor,
    dims: &[usize],
    keepdim: bool,
    mean: bool,
) -> Result<Tensor> {
    if let Some(out) = on_scalar_as_row(x, dims, |row| reduce_op(name, op, row, &[0], false, mean))
    {
        return out;
    }
    let dims = check_dims(name, x, dims)?;
    let out = {
        let _no_grad = NoGradGuard::new();
        reduce(name, op, x, &dims, keepdim, mean)?
    };
    Ok(record(name, out, &[x], |out| {
        let shape = x.shape().to_vec();
        let k: usize = dims.iter().map(|&d| shape[d]).product();
        // max sends the grad to the elements equal to the max, split evenly among ties.
        let picked = (op == ReduceOp::Max).then(|| (x.detach(), out.detach()));
        move |g: &Tensor| {
            let g = expand_back(g, &shape, &dims)?;
            let grad = match &picked {
                None if mean => g.mul_scalar(1.0 / k as f32)?,
                None => g,
                Some((x, max)) => {
                    let mask = binary(x, &expand_back(max, &shape, &dims)?, BinaryOp::Equal)?;
                    let count = expand_back(&mask.sum_dims(&dims, true)?, &shape, &dims)?;
                    g.mul(&mask)?.div(&count)?
                }
            };
            Ok(vec![Some(grad)])
        }
    }))
}

impl Tensor {
    /// Sum of all elements, as a 0-dim tensor.
    pub fn sum(&self) -> Result<Tensor> {
        let all: Vec<usize> = (0..self.rank()).collect();
        reduce_op("sum", ReduceOp::Sum, self, &all, false, false)
    }

    /// Sum over `dims`; `keepdim` keeps them as size 1.
    pub fn sum_dims(&self, dims: &[impl Dim], keepdim: bool) -> Result<Tensor> {
        let dims = &resolve_dims("sum", dims, self.rank())?[..];
        reduce_op("sum", ReduceOp::Sum, self, dims, keepdim, false)
    }

    /// Mean of all elements, as a 0-dim tensor (NaN when empty, as PyTorch).
    pub fn mean(&self) -> Result<Tensor> {
        let all: Vec<usize> = (0..self.rank()).collect();
        reduce_op("mean", ReduceOp::Sum, self, &all, false, true)
    }

    /// Mean over `dims`; `keepdim` keeps them as size 1.
    pub fn mean_dims(&self, dims: &[impl Dim], keepdim: bool) -> Result<Tensor> {
        let dims = &resolve_dims("mean", dims, self.rank())?[..];
        reduce_op("mean", ReduceOp::Sum, self, dims, keepdim, true)
    }

    /// Maximum of all elements, as a 0-dim tensor. Its grad goes to the maximal elements,
    /// split evenly among ties.
    pub fn max(&self) -> Result<Tensor> {
        let all: Vec<usize> = (0..self.rank()).collect();
        reduce_op("max", ReduceOp::Max, self, &all, false, false)
    }

    /// Maximum over `dims`; `keepdim` keeps them as size 1.
    pub fn max_dims(&self, dims: &[impl Dim], keepdim: bool) -> Result<Tensor> {
        let dims = &resolve_dims("max", dims, self.rank())?[..];
        reduce_op("max", ReduceOp::Max, self, dims, keepdim, false)
    }
}

/// Reductions built from the fused ones above: their grads come from the ops they are made
/// of.
impl Tensor {
    /// Minimum over `dims`; `keepdim` keeps them as size 1. NaN wins, as torch's `amin`; the
    /// grad is split evenly among ties.
    pub fn min_dims(&self, dims: &[impl Dim], keepdim: bool) -> Result<Tensor> {
        let dims = &resolve_dims("min", dims, self.rank())?[..];
        reduce_op("min", ReduceOp::Max, &self.neg()?, dims, keepdim, false)?.neg()
    }

    /// `log(sum(exp(x)))` over `dims`, stable: the max of each slice is taken out first (an
    /// infinite max is taken out as 0, so rows of -inf give -inf and a +inf gives +inf, as
    /// torch). Its grad is the softmax over `dims`.
    pub fn logsumexp(&self, dims: &[impl Dim], keepdim: bool) -> Result<Tensor> {
        let dims = &resolve_dims("logsumexp", dims, self.rank())?[..];
        if let Some(out) = on_scalar_as_row(self, dims, |row| row.logsumexp(&[0], false)) {
            return out;
        }
        check_dims("logsumexp", self, dims)?;
        if dims.iter().any(|&d| self.shape()[d] == 0) {
            // No max to take out: the empty sum is 0 and its log -inf, torch's answer.
            return self.exp()?.sum_dims(dims, keepdim)?.log();
        }
        let shift = {
            let _no_grad = NoGradGuard::new();
            let max = self.max_dims(dims, true)?;
            let infinite = max.abs()?.eq_scalar(f32::INFINITY)?;
            max.masked_fill(&infinite, 0.0)?
        };
        let summed = self.sub(&shift)?.exp()?.sum_dims(dims, true)?;
        let out = summed.log()?.add(&shift)?;
        if keepdim {
            return Ok(out);
        }
        out.reshape(&reduced_shape(self.shape(), dims, false))
    }

    /// Variance over `dims` with `correction` subtracted from the count (1: the unbiased
    /// estimate, torch's default; 0: the population variance). Where the count is not above
    /// `correction` the divisor is 0, as torch's `max(0, count - correction)`: inf, or NaN
    /// where the squares sum to 0 (an empty dim among them).
    pub fn var_dims(&self, dims: &[impl Dim], correction: usize, keepdim: bool) -> Result<Tensor> {
        let dims = &resolve_dims("var", dims, self.rank())?[..];
        if let Some(out) = on_scalar_as_row(self, dims, |row| row.var_dims(&[0], correction, false))
        {
            return out;
        }
        check_dims("var", self, dims)?;
        let count: usize = dims.iter().map(|&d| self.shape()[d]).product();
        let deviations = self.sub(&self.mean_dims(dims, true)?)?;
        let squares = deviations.mul(&deviations)?.sum_dims(dims, keepdim)?;
        // The corrected two-pass algorithm: the f32 mean of values far from 0 lands an ulp off,
        // which adds its square to every squared deviation (3.6e-4 of the variance of values
        // near 1000 spread by 0.01); the deviations' own sum measures it and takes it out.
        let drift = deviations.sum_dims(dims, keepdim)?;
        // Equal values leave the two equal up to rounding: never below 0 (a NaN std).
        let squares = (squares.sub(&drift.mul(&drift)?.div_scalar(count as f32)?)?)
            .clamp(0.0, f32::INFINITY)?;
        squares.div_scalar(count.saturating_sub(correction) as f32)
    }

    /// Standard deviation over `dims`: the square root of [`Tensor::var_dims`].
    pub fn std_dims(&self, dims: &[impl Dim], correction: usize, keepdim: bool) -> Result<Tensor> {
        let dims = &resolve_dims("std", dims, self.rank())?[..];
        self.var_dims(dims, correction, keepdim)?.sqrt()
    }
}

#[cfg(test)]
mod tests {
    use super::leading_dims_merged;

    #[test]
    fn a_whole_reduction_merges_every_dim_into_one() {
        assert_eq!(
            leading_dims_merged(&[2, 3, 4], &[0, 1, 2]),
            (vec![24], vec![0])
        );
    }

    #[test]
    fn leading_kept_dims_merge_and_the_reduced_ones_are_renumbered() {
        assert_eq!(
            leading_dims_merged(&[2, 3, 4, 5], &[3]),
            (vec![24, 5], vec![1])
        );
        assert_eq!(
            leading_dims_merged(&[2, 3, 4, 5], &[0, 1, 3]),
            (vec![6, 4, 5], vec![0, 2])
        );
    }

    #[test]
    fn dims_of_size_one_go_with_either_side() {
        // [1, H, T, D] summed over H, T, D: one dim of all its elements.
        assert_eq!(
            leading_dims_merged(&[1, 3, 4, 5], &[1, 2, 3]),
            (vec![60], vec![0])
        );
        // A reduced dim of size 1 among kept ones is dropped.
        assert_eq!(
            leading_dims_merged(&[1, 3, 4], &[0, 2]),
            (vec![3, 4], vec![1])
        );
    }

    #[test]
    fn a_scalar_is_one_dim_of_one() {
        assert_eq!(leading_dims_merged(&[], &[]), (vec![1], vec![]));
    }
}
