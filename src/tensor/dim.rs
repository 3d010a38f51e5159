//! Dim arguments: a `usize` counted from the front, or a signed integer where `-1` names the
//! last dim, as PyTorch takes them (`x.softmax(-1)`).

use crate::error::{Error, Result};

/// A dim of a tensor: `usize` from the front, or `i32`/`i64`/`isize` where negative counts
/// from the back (`-1` is the last dim). Every op that takes a dim takes any of them; an
/// integer literal is an `i32`, so `x.softmax(-1)` and `x.softmax(1)` both read as torch.
///
/// ```
/// # fn main() -> wgrad::Result<()> {
/// use wgrad::{Device, Tensor};
/// let dev = Device::new()?;
/// let x = Tensor::randn(&[2, 3, 4], 0, &dev)?;
/// assert_eq!(x.sum_dims(&[-1], false)?.shape(), &[2, 3]);
/// assert_eq!(x.transpose(-2, -1)?.shape(), &[2, 4, 3]);
/// assert!(x.softmax(-4).is_err()); // out of range: an error naming the op and the shape
/// # Ok(())
/// # }
/// ```
pub trait Dim: Copy {
    /// The dim this names in a tensor of `rank` dims. A `usize` is returned as it is (the op
    /// checks its range); a negative one past the front is an error naming `op`.
    fn resolve(self, op: &'static str, rank: usize) -> Result<usize>;
}

impl Dim for usize {
    fn resolve(self, _op: &'static str, _rank: usize) -> Result<usize> {
        Ok(self)
    }
}

/// A signed dim: from the back when negative. A 0-d tensor takes -1 as dim 0, as torch does
/// (the ops that run along a dim take dim 0 of a 0-d tensor as a dim of size 1).
fn signed(op: &'static str, dim: i64, rank: usize) -> Result<usize> {
    if dim >= 0 {
        return Ok(dim as usize);
    }
    let from_front = rank.max(1) as i64 + dim;
    if from_front < 0 {
        return Err(Error::Shape {
            op,
            msg: format!("dim {dim} is out of range for a tensor of rank {rank}"),
        });
    }
    Ok(from_front as usize)
}

impl Dim for i32 {
    fn resolve(self, op: &'static str, rank: usize) -> Result<usize> {
        signed(op, self as i64, rank)
    }
}

impl Dim for i64 {
    fn resolve(self, op: &'static str, rank: usize) -> Result<usize> {
        signed(op, self, rank)
    }
}

impl Dim for isize {
    fn resolve(self, op: &'static str, rank: usize) -> Result<usize> {
        signed(op, self as i64, rank)
    }
}

/// Every dim of `dims` resolved for a tensor of `rank` dims.
pub(crate) fn resolve_dims(op: &'static str, dims: &[impl Dim], rank: usize) -> Result<Vec<usize>> {
    dims.iter().map(|d| d.resolve(op, rank)).collect()
}
