//! Views: new layouts over the same storage (no copy), except `reshape` of a layout that
//! cannot be re-strided, which copies.

use crate::error::{Error, Result};
use crate::ops::binary::sum_to_shape;
use crate::ops::copy::copy_into;
use crate::ops::on_scalar_as_row;
use crate::ops::reduce::check_dims;
use crate::tensor::dim::{resolve_dims, Dim};
use crate::tensor::grad_mode::NoGradGuard;
use crate::tensor::graph::{record, record_outputs};
use crate::tensor::layout::inverse_permutation;
use crate::tensor::{checked_numel, Layout, Tensor, MAX_RANK};

/// Records an op that only re-shapes `x` (same elements, same order): its grad is the
/// output's grad re-shaped back.
fn record_reshape(name: &'static str, out: Tensor, x: &Tensor) -> Tensor {
    record(name, out, &[x], |_| {
        let shape = x.shape().to_vec();
        move |g: &Tensor| Ok(vec![Some(g.reshape(&shape)?)])
    })
}

/// Zeros of `shape` with `grad` written at `start..` along `dim`: the grad of a `narrow`.
pub(crate) fn pad_into(grad: &Tensor, shape: &[usize], dim: usize, start: usize) -> Result<Tensor> {
    let out = Tensor::zeros(shape, grad.device())?.to_dtype(grad.dtype())?;
    let region = out
        .layout()
        .narrow("narrow", dim, start, grad.shape()[dim])?;
    copy_into("narrow", grad, &out, &region)?;
    Ok(out)
}

/// `pieces` joined along `dim` into a tensor of `whole`'s shape as a view, where they already
/// lie that way in one buffer: the same strides, each starting where the one before ends
/// along `dim` (the grads that attention writes for the heads of a packed projection, see
/// `packed_grads` in src/ops/attention.rs). `None` otherwise, for `cat` to copy them.
fn adjacent_pieces(pieces: &[Tensor], dim: usize, whole: &[usize]) -> Option<Tensor> {
    let first = pieces.first()?;
    let (strides, offset) = (&first.layout().strides, first.layout().offset);
    let mut at = offset;
    for piece in pieces {
        let layout = piece.layout();
        let joins = piece.storage_id() == first.storage_id()
            && piece.dtype() == first.dtype()
            && &layout.strides == strides
            && layout.offset == at;
        if !joins {
            return None;
        }
        at += layout.shape[dim] * strides[dim];
    }
    Some(first.view(Layout {
        shape: whole.to_vec(),
        strides: strides.clone(),
        offset,
    }))
}

impl Tensor {
    /// The transpose of a 2-D tensor (a view).
    pub fn t(&self) -> Result<Tensor> {
        if self.rank() != 2 {
            return Err(Error::Shape {
                op: "t",
                msg: format!("needs a 2-D tensor, got shape {:?}", self.shape()),
            });
        }
        self.transpose(0, 1)
    }

    /// Swaps dims `d0` and `d1` (a view).
    pub fn transpose(&self, d0: impl Dim, d1: impl Dim) -> Result<Tensor> {
        let (d0, d1) = (
            d0.resolve("transpose", self.rank())?,
            d1.resolve("transpose", self.rank())?,
        );
        let out = self.view(self.layout().transpose("transpose", d0, d1)?);
        Ok(record("transpose", out, &[self], |_| {
            move |g: &Tensor| Ok(vec![Some(g.transpose(d0, d1)?)])
        }))
    }

    /// Reorders dims: dim `i` of the result is dim `dims[i]` of `self` (a view).
    pub fn permute(&self, dims: &[impl Dim]) -> Result<Tensor> {
        let dims = &resolve_dims("permute", dims, self.rank())?[..];
        let out = self.view(self.layout().permute("permute", dims)?);
        Ok(record("permute", out, &[self], |_| {
            let inverse = inverse_permutation(dims);
            move |g: &Tensor| Ok(vec![Some(g.permute(&inverse)?)])
        }))
    }

    /// Elements `start..start + len` along `dim` (a view).
    pub fn narrow(&self, dim: impl Dim, start: usize, len: usize) -> Result<Tensor> {
        let dim = dim.resolve("narrow", self.rank())?;
        let out = self.view(self.layout().narrow("narrow", dim, start, len)?);
        Ok(record("narrow", out, &[self], |_| {
            let shape = self.shape().to_vec();
            move |g: &Tensor| Ok(vec![Some(pad_into(g, &shape, dim, start)?)])
        }))
    }

    /// Consecutive pieces of `sizes` elements along `dim`, which must add up to its size
    /// (views, as PyTorch's `split` with a list of sizes). The pieces are one recorded op, so
    /// their grads come back as one tensor written piece by piece (a `cat`, with zeros for
    /// pieces no grad reached), not as one zero-padded grad per piece summed up. Grads that
    /// already lie side by side in one buffer, as attention writes those of the heads of a
    /// packed projection, are joined as a view, with no copy.
    ///
    /// ```
    /// # fn main() -> wgrad::Result<()> {
    /// use wgrad::{Device, Tensor};
    /// let dev = Device::new()?;
    /// let qkv = Tensor::from_slice(&[0., 1., 2., 3., 4., 5., 6., 7., 8., 9., 10., 11.], &[2, 6], &dev)?;
    /// let parts = qkv.split(&[2, 2, 2], 1)?;
    /// assert_eq!(parts[1].to_vec()?, vec![2.0, 3.0, 8.0, 9.0]);
    /// # Ok(())
    /// # }
    /// ```
    pub fn split(&self, sizes: &[usize], dim: impl Dim) -> Result<Vec<Tensor>> {
        let dim = dim.resolve("split", self.rank())?;
        const OP: &str = "split";
        self.layout().check_dim(OP, dim)?;
        let total = self.shape()[dim];
        if sizes.is_empty()
            || sizes.iter().try_fold(0usize, |a, &b| a.checked_add(b)) != Some(total)
        {
            return Err(Error::Shape {
                op: OP,
                msg: format!(
                    "sizes {sizes:?} do not add up to dim {dim} of shape {:?} ({total})",
                    self.shape()
                ),
            });
        }
        let mut pieces = Vec::with_capacity(sizes.len());
        let mut start = 0;
        for &len in sizes {
            pieces.push(self.view(self.layout().narrow(OP, dim, start, len)?));
            start += len;
        }
        Ok(record_outputs(OP, pieces, &[self], |pieces| {
            let shapes: Vec<Vec<usize>> = pieces.iter().map(|p| p.shape().to_vec()).collect();
            let whole = self.shape().to_vec();
            let device = self.device().clone();
            move |grads: &[Option<Tensor>]| {
                let grads = grads
                    .iter()
                    .zip(&shapes)
                    .map(|(grad, shape)| match grad {
                        Some(grad) => Ok(grad.clone()),
                        None => Tensor::zeros(shape, &device),
                    })
                    .collect::<Result<Vec<_>>>()?;
                if let Some(joined) = adjacent_pieces(&grads, dim, &whole) {
                    return Ok(vec![Some(joined)]);
                }
                Ok(vec![Some(Tensor::cat(&grads, dim)?)])
            }
        }))
    }

    /// `chunks` pieces along `dim`, as PyTorch's `chunk`: each of `ceil(size / chunks)`
    /// elements but the last, which holds the rest (so there may be fewer than `chunks`
    /// pieces; a dim of size 0 gives one empty piece). Views, recorded as [`Tensor::split`].
    pub fn chunk(&self, chunks: usize, dim: impl Dim) -> Result<Vec<Tensor>> {
        let dim = dim.resolve("chunk", self.rank())?;
        const OP: &str = "chunk";
        self.layout().check_dim(OP, dim)?;
        if chunks == 0 {
            return Err(Error::InvalidArgument {
                op: OP,
                msg: format!("chunks must be at least 1 (shape {:?})", self.shape()),
            });
        }
        let total = self.shape()[dim];
        let size = total.div_ceil(chunks);
        let sizes: Vec<usize> = if total == 0 {
            vec![0]
        } else {
            (0..total)
                .step_by(size)
                .map(|start| size.min(total - start))
                .collect()
        };
        self.split(&sizes, dim)
    }

    /// The slices along `dim`, each without that dim (views, as PyTorch's `unbind`): a
    /// [`Tensor::split`] into pieces of one, squeezed.
    pub fn unbind(&self, dim: impl Dim) -> Result<Vec<Tensor>> {
        let dim = dim.resolve("unbind", self.rank())?;
        self.layout().check_dim("unbind", dim)?;
        let n = self.shape()[dim];
        if n == 0 {
            return Ok(Vec::new());
        }
        self.split(&vec![1; n], dim)?
            .iter()
            .map(|piece| piece.squeeze(dim))
            .collect()
    }

    /// Broadcasts to `shape` by NumPy rules, repeating along size-1 and new leading dims with
    /// stride 0 (a view).
    pub fn expand(&self, shape: &[usize]) -> Result<Tensor> {
        let out = self.view(self.layout().expand("expand", shape)?);
        Ok(record("expand", out, &[self], |_| {
            let own = self.shape().to_vec();
            move |g: &Tensor| Ok(vec![Some(sum_to_shape(g, &own)?)])
        }))
    }

    /// Inserts a dim of size 1 at `dim` (a view).
    pub fn unsqueeze(&self, dim: impl Dim) -> Result<Tensor> {
        // A new dim: -1 puts it last.
        let dim = dim.resolve("unsqueeze", self.rank() + 1)?;
        if dim > self.rank() || self.rank() >= MAX_RANK {
            return Err(Error::Shape {
                op: "unsqueeze",
                msg: format!(
                    "dim {dim} is out of range for shape {:?} (at most {MAX_RANK} dims)",
                    self.shape()
                ),
            });
        }
        let mut layout = self.layout().clone();
        let stride = layout
            .strides
            .get(dim)
            .map_or(1, |&s| s * layout.shape[dim]);
        layout.shape.insert(dim, 1);
        layout.strides.insert(dim, stride);
        Ok(record_reshape("unsqueeze", self.view(layout), self))
    }

    /// Removes dim `dim`, which must have size 1 (a view).
    pub fn squeeze(&self, dim: impl Dim) -> Result<Tensor> {
        let dim = dim.resolve("squeeze", self.rank())?;
        self.layout().check_dim("squeeze", dim)?;
        if self.shape()[dim] != 1 {
            return Err(Error::Shape {
                op: "squeeze",
                msg: format!("dim {dim} of shape {:?} is not of size 1", self.shape()),
            });
        }
        let mut layout = self.layout().clone();
        layout.shape.remove(dim);
        layout.strides.remove(dim);
        Ok(record_reshape("squeeze", self.view(layout), self))
    }

    /// The same elements in row-major order under another shape of equal size: a view where
    /// the strides allow it (as PyTorch's `view`: dims laid out densely after one another may
    /// be split or merged, so splitting the last dim of a narrowed or transposed tensor is a
    /// view), else a copy.
    pub fn reshape(&self, shape: &[usize]) -> Result<Tensor> {
        let numel = checked_numel("reshape", shape)?;
        if numel != self.numel() {
            return Err(Error::Shape {
                op: "reshape",
                msg: format!(
                    "cannot reshape {:?} ({} elements) to {shape:?} ({numel} elements)",
                    self.shape(),
                    self.numel()
                ),
            });
        }
        let out = match self.layout().reshape_view(shape) {
            Some(layout) => self.view(layout),
            None => {
                let _no_grad = NoGradGuard::new();
                self.contiguous()?.reshape(shape)?
            }
        };
        Ok(record_reshape("reshape", out, self))
    }

    /// Dims `start_dim..` merged into one, as PyTorch's `flatten(start_dim)`: `[N, C, H, W]`
    /// with `start_dim` 1 gives `[N, C H W]`. A rank-0 tensor becomes `[1]`.
    pub fn flatten(&self, start_dim: impl Dim) -> Result<Tensor> {
        let start_dim = start_dim.resolve("flatten", self.rank())?;
        if self.rank() == 0 {
            return self.reshape(&[1]);
        }
        self.layout().check_dim("flatten", start_dim)?;
        let mut shape = self.shape()[..start_dim].to_vec();
        shape.push(self.shape()[start_dim..].iter().product());
        self.reshape(&shape)
    }
}

/// Shape ops built from views and indexing; their grads come from what they are made of.
impl Tensor {
    /// This tensor with the order of elements along each of `dims` reversed, as torch's
    /// `flip`.
    pub fn flip(&self, dims: &[impl Dim]) -> Result<Tensor> {
        let dims = resolve_dims("flip", dims, self.rank())?;
        if let Some(out) = on_scalar_as_row(self, &dims, |row| row.flip(&[0])) {
            return out;
        }
        let dims = check_dims("flip", self, &dims)?;
        let mut out = self.clone();
        for d in dims {
            let n = self.shape()[d] as u32;
            let reversed =
                Tensor::from_vec_u32((0..n).rev().collect(), &[n as usize], self.device())?;
            out = out.index_select(d, &reversed)?;
        }
        Ok(out)
    }

    /// This tensor tiled `repeats[d]` times along each dim, as torch's `repeat`; `repeats`
    /// may be longer than the rank (new leading dims).
    pub fn repeat(&self, repeats: &[usize]) -> Result<Tensor> {
        if repeats.len() < self.rank() {
            return Err(Error::Shape {
                op: "repeat",
                msg: format!(
                    "needs at least one repeat per dim of shape {:?}, got {repeats:?}",
                    self.shape()
                ),
            });
        }
        let lead = repeats.len() - self.rank();
        let shape: Vec<usize> = std::iter::repeat_n(1, lead)
            .chain(self.shape().iter().copied())
            .collect();
        let out: Option<Vec<usize>> = (shape.iter().zip(repeats))
            .map(|(&s, &r)| s.checked_mul(r))
            .collect();
        let Some(out) = out else {
            return Err(Error::InvalidArgument {
                op: "repeat",
                msg: format!(
                    "repeats {repeats:?} of shape {:?} overflow a dim's size",
                    self.shape()
                ),
            });
        };
        checked_numel("repeat", &out)?;
        // A dim at a time, as [before, 1, s, after] expanded to [before, r, s, after] and
        // merged: four dims whatever the rank (pairing every dim with a new one went past the
        // six dims a tensor has, so a rank-4 tensor could not repeat).
        let mut tiled = self.reshape(&shape)?;
        for (d, &r) in repeats.iter().enumerate().filter(|(_, &r)| r != 1) {
            let now = tiled.shape().to_vec();
            let before: usize = now[..d].iter().product();
            let after: usize = now[d + 1..].iter().product();
            let mut merged = now.clone();
            merged[d] *= r;
            tiled = tiled
                .reshape(&[before, 1, now[d], after])?
                .expand(&[before, r, now[d], after])?
                .reshape(&merged)?;
        }
        Ok(tiled)
    }
}
