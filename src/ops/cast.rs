//! Casts to and from the 16-bit float dtypes (F16, BF16), and copies of 16-bit tensors:
//! `shaders/cast.wgsl`, through `shaders/sixteen_bit.wgsl` (the one way kernels convert
//! 16-bit elements); and `through_f32`, how ops without 16-bit kernels take 16-bit tensors.

use crate::error::{Error, Result};
use crate::kernel::{
    strided_dims, windows, Kernel, KernelParams, Launch, ShaderFamily, SIXTEEN_BIT_WGSL,
};
use crate::ops::too_large_view;
use crate::tensor::graph::record;
use crate::tensor::{DType, Layout, Tensor};

crate::kernel_params! {
    /// `convert`: the source's layout (in elements), `n` elements in all, written to the
    /// destination's elements from `dst_offset` on.
    pub(crate) struct CastParams {
        n: u32,
        offset: u32,
        rank: u32,
        shape: [u32; 6],
        strides: [u32; 6],
        dst_offset: u32,
    }
}

crate::kernel_params! {
    /// `convert_into_view`: a strided view of a 16-bit destination, its dims (size 1 left
    /// out) ordered by stride, largest first, with the source's strides in the same order;
    /// `span` elements from the view's first to its last.
    pub(crate) struct CastIntoViewParams {
        span: u32,
        src_offset: u32,
        dst_offset: u32,
        rank: u32,
        shape: [u32; 6],
        dst_strides: [u32; 6],
        src_strides: [u32; 6],
    }
}

static CAST: ShaderFamily = ShaderFamily {
    name: "cast",
    wgsl: include_str!("../../shaders/cast.wgsl"),
    params: &[&CastParams::LAYOUT, &CastIntoViewParams::LAYOUT],
    preludes: &[SIXTEEN_BIT_WGSL],
};

/// `x` as a new contiguous tensor of `dtype`, where `x` or `dtype` is 16-bit (the same dtype
/// copies). Between float dtypes the grad is cast back to `x`'s dtype; a U32 side records no
/// grad.
pub(crate) fn cast(op: &'static str, x: &Tensor, dtype: DType) -> Result<Tensor> {
    let out = Tensor::empty(op, x.shape(), dtype, x.device())?;
    let n = x.numel();
    if n > 0 && (x.exceeds_binding() || out.exceeds_binding()) {
        // Past one binding: a launch per window of a dense x and of the output. Windows start
        // 64 elements apart, so no word of a 16-bit output straddles two.
        if !x.is_contiguous() {
            return Err(too_large_view(op, x));
        }
        for (start, len) in windows(x.device(), n) {
            let target = out.window(start, len);
            launch_cast(op, &x.window(start, len), &target, target.layout().offset)?;
        }
    } else if n > 0 {
        launch_cast(op, x, &out, 0)?;
    }
    if x.dtype() == DType::U32 || dtype == DType::U32 {
        return Ok(out);
    }
    let from = x.dtype();
    Ok(record(op, out, &[x], |_| {
        move |g: &Tensor| Ok(vec![Some(g.to_dtype(from)?)])
    }))
}

/// The dtype an op's result takes from its float inputs: `None` when none is 16-bit (F32 as
/// ever); the 16-bit dtype they share; F32 for two float dtypes under autocast, as torch
/// promotes them. Outside autocast two float dtypes are an error naming the op (casts are
/// explicit there).
pub(crate) fn result_dtype(op: &'static str, inputs: &[&Tensor]) -> Result<Option<DType>> {
    let Some((narrow, other)) = float_dtypes(inputs.iter().map(|t| t.dtype())) else {
        return Ok(None);
    };
    match other {
        None => Ok(Some(narrow)),
        Some(_) if crate::ops::autocast::active_dtype().is_some() => Ok(Some(DType::F32)),
        Some(other) => Err(two_float_dtypes(op, narrow, other)),
    }
}

/// An op's inputs ready for kernels that read F32: `None` when none is 16-bit; else every
/// float input cast to F32 (recording no grad: the caller records the op itself, whose
/// backward rule runs on the 16-bit tensors in turn) and the dtype the output goes back to
/// ([`result_dtype`]). Arithmetic runs in f32, as torch runs 16-bit ops.
pub(crate) fn widened(
    op: &'static str,
    inputs: &[&Tensor],
) -> Result<Option<(DType, Vec<Tensor>)>> {
    let Some(result) = result_dtype(op, inputs)? else {
        return Ok(None);
    };
    let _no_grad = crate::tensor::grad_mode::NoGradGuard::new();
    let wide = inputs
        .iter()
        .map(|t| match t.dtype() {
            DType::U32 => Ok((*t).clone()),
            _ => t.to_dtype(DType::F32),
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(Some((result, wide)))
}

/// For ops without 16-bit kernels of their own (norms, indexing, sorting, padding, `cat` along
/// a later dim, the losses): when a float input is 16-bit, `op_f32` run on the inputs as F32
/// tensors (through recorded casts, so grads come back in each input's dtype; with autocast
/// suspended, so they stay F32 inside) and its float result cast back to that 16-bit dtype (a
/// U32 result, indices or a mask, stays as it is); `None` when no float input is 16-bit.
/// Float inputs of two dtypes are an error naming `op`. Torch computes these ops on 16-bit
/// tensors in f32 and rounds the result once, as this does.
pub(crate) fn through_f32(
    op: &'static str,
    inputs: &[&Tensor],
    op_f32: impl FnOnce(&[Tensor]) -> Result<Tensor>,
) -> Result<Option<Tensor>> {
    let Some((narrow, other)) = float_dtypes(inputs.iter().map(|t| t.dtype())) else {
        return Ok(None);
    };
    if let Some(other) = other {
        return Err(two_float_dtypes(op, narrow, other));
    }
    let wide = inputs
        .iter()
        .map(|t| match t.dtype().is_16_bit() {
            true => t.to_dtype(DType::F32),
            false => Ok((*t).clone()),
        })
        .collect::<Result<Vec<_>>>()?;
    let out = {
        let _plain = crate::ops::autocast::Suspend::new();
        op_f32(&wide)?
    };
    match out.dtype() {
        DType::F32 => out.to_dtype(narrow).map(Some),
        _ => Ok(Some(out)),
    }
}

/// The first 16-bit dtype among `dtypes`' float ones, and another float dtype beside it if
/// there is one; `None` when no float dtype is 16-bit.
pub(crate) fn float_dtypes(dtypes: impl Iterator<Item = DType>) -> Option<(DType, Option<DType>)> {
    let floats: Vec<DType> = dtypes.filter(|d| d.is_float()).collect();
    let narrow = *floats.iter().find(|d| d.is_16_bit())?;
    Some((narrow, floats.into_iter().find(|&d| d != narrow)))
}

/// The error for an op given float inputs of two dtypes outside autocast.
pub(crate) fn two_float_dtypes(op: &'static str, narrow: DType, other: DType) -> Error {
    Error::DType {
        op,
        msg: format!(
            "inputs of two float dtypes, {narrow:?} and {other:?}: cast one with to_dtype (or \
             run the op under wgrad::autocast)"
        ),
    }
}

/// An F32 result of [`widened`] inputs back in their 16-bit `dtype` (a U32 result, a mask or
/// indices, stays as it is).
pub(crate) fn narrowed(out: Tensor, dtype: DType) -> Result<Tensor> {
    if out.dtype() != DType::F32 {
        return Ok(out);
    }
    let _no_grad = crate::tensor::grad_mode::NoGradGuard::new();
    out.to_dtype(dtype)
}

/// Every specialisation (source, destination) of `shaders/cast.wgsl`, for the module checks.
#[cfg(test)]
pub(crate) fn kernel_sources() -> Vec<(String, String)> {
    const ALL: [DType; 4] = [DType::F32, DType::U32, DType::F16, DType::BF16];
    ALL.iter()
        .flat_map(|&from| ALL.iter().map(move |&to| (from, to)))
        .filter(|(from, to)| from.is_16_bit() || to.is_16_bit())
        .map(|(from, to)| (format!("cast/{from:?}_to_{to:?}"), source(from, to)))
        .collect()
}

/// The module casting `from` to `to`.
fn source(from: DType, to: DType) -> String {
    CAST.source(&[
        ("SRC_DTYPE", from.wgsl_code()),
        ("DST_DTYPE", to.wgsl_code()),
    ])
}

/// Writes `src`'s values, cast to `dst`'s dtype, into `dst`'s storage at `dst_layout` (`copy_`,
/// a piece of `cat`): a contiguous run at any offset, or a strided view of a 16-bit
/// destination (16-bit elements that share a word with the written ones keep their bits).
pub(crate) fn cast_into(
    op: &'static str,
    src: &Tensor,
    dst: &Tensor,
    dst_layout: &Layout,
) -> Result<()> {
    if src.numel() == 0 {
        return Ok(());
    }
    if !dst_layout.is_contiguous() && !dst.dtype().is_16_bit() {
        // A strided 32-bit destination: the source cast, then a 32-bit strided copy.
        let wide = cast(op, &src.detach(), dst.dtype())?;
        return crate::ops::copy::copy_into(op, &wide, dst, dst_layout);
    }
    // A strided 16-bit destination's dims, refused before any work is recorded.
    let view_dims = match dst_layout.is_contiguous() {
        true => None,
        false => Some(writable_dims(op, src, dst, dst_layout)?),
    };
    for t in [src, dst] {
        if t.exceeds_binding() {
            return Err(too_large_view(op, t));
        }
    }
    // One dispatch may not read and write the same buffer through two bindings: the source
    // is read whole before any of it is written.
    let src = match src.storage_id() == dst.storage_id() {
        true => cast(op, &src.detach(), src.dtype())?,
        false => src.clone(),
    };
    let Some(dims) = view_dims else {
        return launch_cast(op, &src, dst, dst_layout.offset);
    };
    let params = view_params(&src, dst_layout, &dims);
    let (from, to) = (src.dtype(), dst.dtype());
    let variant = format!("{from:?}_to_{to:?}");
    let source = || source(from, to);
    let kernel = Kernel::specialised(&CAST, "convert_into_view", &variant, &source)
        .with_dtypes(&[(1, from), (2, to)]);
    let first = params.dst_offset as usize;
    let words = (first + params.span as usize).div_ceil(2) - first / 2;
    Launch::new(op, &kernel, &[(1, &src), (2, dst)], &params).record(words.div_ceil(256) as u32)
}

/// The dims of the strided view `dst_layout` of a 16-bit `dst` that `src` is written into,
/// largest stride first, leaving out dims of size 1. Each stride must be at least the next
/// one's times its size, as in any view of a dense tensor made by slicing and permuting.
fn writable_dims(
    op: &'static str,
    src: &Tensor,
    dst: &Tensor,
    dst_layout: &Layout,
) -> Result<Vec<usize>> {
    let not_writable = |why: &str| Error::InvalidArgument {
        op,
        msg: format!(
            "cannot write a source of shape {:?} into a {:?} view of shape {:?} and strides \
             {:?}: {why}",
            src.shape(),
            dst.dtype(),
            dst_layout.shape,
            dst_layout.strides
        ),
    };
    if src.shape() != dst_layout.shape.as_slice() {
        return Err(not_writable("the shapes differ"));
    }
    let (shape, strides) = (&dst_layout.shape, &dst_layout.strides);
    let mut dims: Vec<usize> = (0..shape.len()).filter(|&d| shape[d] > 1).collect();
    dims.sort_by_key(|&d| std::cmp::Reverse(strides[d]));
    let nested = dims
        .windows(2)
        .all(|p| strides[p[0]] >= strides[p[1]] * shape[p[1]]);
    if !nested || dims.iter().any(|&d| strides[d] == 0) {
        return Err(not_writable("its elements overlap or interleave"));
    }
    Ok(dims)
}

/// The params of `convert_into_view`: the destination's `dims` (from `writable_dims`) with
/// the source's strides in the same order.
fn view_params(src: &Tensor, dst_layout: &Layout, dims: &[usize]) -> CastIntoViewParams {
    let six = |of: &[usize]| -> [u32; 6] {
        let mut out = [0u32; 6];
        for (slot, &d) in out.iter_mut().zip(dims) {
            *slot = of[d] as u32;
        }
        out
    };
    CastIntoViewParams {
        span: (dst_layout.span() - dst_layout.offset) as u32,
        src_offset: src.layout().offset as u32,
        dst_offset: dst_layout.offset as u32,
        rank: dims.len() as u32,
        shape: six(&dst_layout.shape),
        dst_strides: six(&dst_layout.strides),
        src_strides: six(&src.layout().strides),
    }
}

/// Casts `x` into the contiguous run of `out`'s storage from element `first`.
fn launch_cast(op: &'static str, x: &Tensor, out: &Tensor, first: usize) -> Result<()> {
    let layout = x.layout();
    let dims = strided_dims(op, &layout.shape, &[&layout.strides])?;
    let n = x.numel();
    let params = CastParams {
        n: n as u32,
        offset: layout.offset as u32,
        rank: dims.rank,
        shape: dims.shape,
        strides: dims.strides[0],
        dst_offset: first as u32,
    };
    let (from, to) = (x.dtype(), out.dtype());
    let variant = format!("{from:?}_to_{to:?}");
    let source = || source(from, to);
    let kernel =
        Kernel::specialised(&CAST, "convert", &variant, &source).with_dtypes(&[(1, from), (2, to)]);
    // One invocation per destination word: two elements of a 16-bit destination.
    let words = match to.size() {
        2 => (first + n).div_ceil(2) - first / 2,
        _ => n,
    };
    Launch::new(op, &kernel, &[(1, x), (2, out)], &params).record(words.div_ceil(256) as u32)
}
