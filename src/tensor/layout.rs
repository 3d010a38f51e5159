//! `Layout`: shape, strides and offset in elements. Views (transpose, permute, narrow, expand)
//! are new layouts over the same storage.

use crate::error::{Error, Result};

/// Shape, strides and element offset of a tensor within its storage.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) struct Layout {
    pub shape: Vec<usize>,
    pub strides: Vec<usize>,
    pub offset: usize,
}

/// Row-major strides of `shape`.
pub(crate) fn row_major_strides(shape: &[usize]) -> Vec<usize> {
    let mut strides = vec![1; shape.len()];
    for d in (0..shape.len().saturating_sub(1)).rev() {
        strides[d] = strides[d + 1] * shape[d + 1].max(1);
    }
    strides
}

/// The permutation that undoes `dims` (dim `dims[i]` goes back to place `i`): what turns a
/// `permute(dims)` view back.
pub(crate) fn inverse_permutation(dims: &[usize]) -> Vec<usize> {
    let mut inverse = vec![0; dims.len()];
    for (i, &d) in dims.iter().enumerate() {
        inverse[d] = i;
    }
    inverse
}

/// The NumPy broadcast of two shapes, or `None` when they do not broadcast.
pub(crate) fn broadcast_shapes(a: &[usize], b: &[usize]) -> Option<Vec<usize>> {
    let rank = a.len().max(b.len());
    let mut out = vec![0; rank];
    for i in 0..rank {
        let da = if i + a.len() >= rank {
            a[i + a.len() - rank]
        } else {
            1
        };
        let db = if i + b.len() >= rank {
            b[i + b.len() - rank]
        } else {
            1
        };
        out[i] = match (da, db) {
            (x, y) if x == y => x,
            (1, y) => y,
            (x, 1) => x,
            _ => return None,
        };
    }
    Some(out)
}

impl Layout {
    /// A row-major layout of `shape` at offset 0.
    pub fn contiguous(shape: &[usize]) -> Layout {
        Layout {
            shape: shape.to_vec(),
            strides: row_major_strides(shape),
            offset: 0,
        }
    }

    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// True when the elements lie row-major and densely from `offset`.
    pub fn is_contiguous(&self) -> bool {
        // An empty tensor places no element anywhere: whatever its strides, it is dense.
        if self.shape.contains(&0) {
            return true;
        }
        let mut expected = 1;
        for (&n, &s) in self.shape.iter().zip(&self.strides).rev() {
            if n != 1 && s != expected {
                return false;
            }
            expected *= n;
        }
        true
    }

    /// One past the largest element index this layout reaches (0 when empty).
    pub fn span(&self) -> usize {
        if self.numel() == 0 {
            return 0;
        }
        let last: usize = self
            .shape
            .iter()
            .zip(&self.strides)
            .map(|(n, s)| (n - 1) * s)
            .sum();
        self.offset + last + 1
    }

    /// True when two elements share a position (a dim of size > 1 with stride 0).
    pub fn overlaps(&self) -> bool {
        self.shape
            .iter()
            .zip(&self.strides)
            .any(|(&n, &s)| n > 1 && s == 0)
    }

    pub fn check_dim(&self, op: &'static str, dim: usize) -> Result<()> {
        if dim >= self.shape.len() {
            return Err(Error::Shape {
                op,
                msg: format!(
                    "dim {dim} is out of range for shape {:?} (rank {})",
                    self.shape,
                    self.shape.len()
                ),
            });
        }
        Ok(())
    }

    pub fn permute(&self, op: &'static str, dims: &[usize]) -> Result<Layout> {
        let rank = self.shape.len();
        let mut seen = vec![false; rank];
        if dims.len() != rank
            || dims
                .iter()
                .any(|&d| d >= rank || std::mem::replace(&mut seen[d], true))
        {
            return Err(Error::Shape {
                op,
                msg: format!(
                    "{dims:?} is not a permutation of the {rank} dims of shape {:?}",
                    self.shape
                ),
            });
        }
        Ok(Layout {
            shape: dims.iter().map(|&d| self.shape[d]).collect(),
            strides: dims.iter().map(|&d| self.strides[d]).collect(),
            offset: self.offset,
        })
    }

    pub fn transpose(&self, op: &'static str, d0: usize, d1: usize) -> Result<Layout> {
        self.check_dim(op, d0)?;
        self.check_dim(op, d1)?;
        let mut out = self.clone();
        out.shape.swap(d0, d1);
        out.strides.swap(d0, d1);
        Ok(out)
    }

    pub fn narrow(&self, op: &'static str, dim: usize, start: usize, len: usize) -> Result<Layout> {
        self.check_dim(op, dim)?;
        if start
            .checked_add(len)
            .is_none_or(|end| end > self.shape[dim])
        {
            return Err(Error::Shape {
                op,
                msg: format!(
                    "range {start}..{} is out of bounds for dim {dim} of size {} (shape {:?})",
                    start.saturating_add(len),
                    self.shape[dim],
                    self.shape
                ),
            });
        }
        let mut out = self.clone();
        out.shape[dim] = len;
        if len > 0 {
            out.offset += start * self.strides[dim];
        }
        Ok(out)
    }

    /// Broadcasts to `shape` with stride 0 along expanded dims (NumPy rules).
    pub fn expand(&self, op: &'static str, shape: &[usize]) -> Result<Layout> {
        let err = || Error::Shape {
            op,
            msg: format!("shape {:?} cannot be broadcast to {shape:?}", self.shape),
        };
        if shape.len() < self.shape.len() {
            return Err(err());
        }
        // Kernels index elements with u32s: a view may not hold more.
        crate::tensor::checked_numel(op, shape)?;
        let lead = shape.len() - self.shape.len();
        let mut strides = vec![0; shape.len()];
        for (i, &n) in shape.iter().enumerate() {
            if i < lead {
                continue;
            }
            let (own, stride) = (self.shape[i - lead], self.strides[i - lead]);
            strides[i] = if own == n {
                stride
            } else if own == 1 {
                0
            } else {
                return Err(err());
            };
        }
        Ok(Layout {
            shape: shape.to_vec(),
            strides,
            offset: self.offset,
        })
    }

    /// The same elements under `shape` (of the same size) without a copy, when the strides
    /// allow it, as PyTorch's `view`: each run of dims that lie densely after one another in
    /// memory may be split or merged, whatever the strides between runs (splitting the last
    /// dim of a transposed or narrowed view into heads is a view).
    pub fn reshape_view(&self, shape: &[usize]) -> Option<Layout> {
        let view = |strides: Vec<usize>| Layout {
            shape: shape.to_vec(),
            strides,
            offset: self.offset,
        };
        if shape == self.shape.as_slice() {
            return Some(self.clone());
        }
        // No two elements to place apart (or none at all): any strides will do.
        if self.is_contiguous() || self.numel() <= 1 {
            return Some(view(row_major_strides(shape)));
        }
        // Walk both shapes from the last dim: a chunk of old dims ends where the next one up
        // is not laid out densely on top of it; the new dims that cover exactly that chunk's
        // elements take strides within it.
        let (old, old_strides) = (&self.shape, &self.strides);
        let mut strides = vec![0; shape.len()];
        let mut new_d = shape.len();
        let mut chunk_stride = *old_strides.last()?;
        let (mut chunk_numel, mut view_numel) = (1, 1);
        for d in (0..old.len()).rev() {
            chunk_numel *= old[d];
            let chunk_ends =
                d == 0 || (old[d - 1] != 1 && old_strides[d - 1] != chunk_numel * chunk_stride);
            if !chunk_ends {
                continue;
            }
            while new_d > 0 && (view_numel < chunk_numel || shape[new_d - 1] == 1) {
                new_d -= 1;
                strides[new_d] = view_numel * chunk_stride;
                view_numel *= shape[new_d];
            }
            if view_numel != chunk_numel {
                return None;
            }
            if d > 0 {
                chunk_stride = old_strides[d - 1];
                chunk_numel = 1;
                view_numel = 1;
            }
        }
        (new_d == 0).then(|| view(strides))
    }
}

/// Up to this many dims are passed to strided kernels (after merging).
pub(crate) const KERNEL_RANK: usize = 6;

/// `shape` and each operand's strides with size-1 dims dropped and adjacent dims merged where
/// every operand is dense across them, padded at the front to [`KERNEL_RANK`] dims.
/// Returns `None` when more than `KERNEL_RANK` dims remain.
pub(crate) fn merge_dims(
    shape: &[usize],
    strides: &[&[usize]],
) -> Option<(usize, Vec<u32>, Vec<Vec<u32>>)> {
    let mut dims: Vec<(usize, Vec<usize>)> = Vec::new();
    for (d, &n) in shape.iter().enumerate() {
        if n == 1 {
            continue;
        }
        let these: Vec<usize> = strides.iter().map(|s| s[d]).collect();
        if let Some((last_n, last_s)) = dims.last_mut() {
            if last_s.iter().zip(&these).all(|(&ls, &s)| ls == s * n) {
                *last_n *= n;
                *last_s = these;
                continue;
            }
        }
        dims.push((n, these));
    }
    if dims.len() > KERNEL_RANK {
        return None;
    }
    let rank = dims.len();
    let pad = KERNEL_RANK - rank;
    let mut out_shape = vec![1u32; pad];
    let mut out_strides = vec![vec![0u32; pad]; strides.len()];
    for (n, s) in dims {
        out_shape.push(n as u32);
        for (k, st) in s.into_iter().enumerate() {
            out_strides[k].push(st as u32);
        }
    }
    Some((rank, out_shape, out_strides))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn merge_dims_joins_dense_dims_and_pads_to_kernel_rank() {
        let (rank, shape, strides) = merge_dims(&[2, 3, 4], &[&[12, 4, 1]]).unwrap();
        assert_eq!(rank, 1);
        assert_eq!(shape, vec![1, 1, 1, 1, 1, 24]);
        assert_eq!(strides[0], vec![0, 0, 0, 0, 0, 1]);
        let (rank, shape, strides) = merge_dims(&[2, 3], &[&[3, 1], &[0, 1]]).unwrap();
        assert_eq!(rank, 2);
        assert_eq!(&shape[4..], &[2, 3]);
        assert_eq!(&strides[1][4..], &[0, 1]);
    }

    fn layout(shape: &[usize], strides: &[usize], offset: usize) -> Layout {
        Layout {
            shape: shape.to_vec(),
            strides: strides.to_vec(),
            offset,
        }
    }

    #[test]
    fn reshape_view_splits_and_merges_dense_runs_of_a_strided_layout() {
        // The second third of the last dim of [2, 3, 12] (a split q of a packed qkv), as
        // [2, 3, 2, 2] heads: a view with the row strides kept.
        let piece = layout(&[2, 3, 4], &[36, 12, 1], 4);
        let heads = piece.reshape_view(&[2, 3, 2, 2]).unwrap();
        assert_eq!(heads.strides, vec![36, 12, 2, 1]);
        assert_eq!(heads.offset, 4);
        // Merging the batch dims of a transposed [3, 2, 4] (rows of 4 stay dense).
        let t = layout(&[2, 3, 4], &[4, 8, 1], 0);
        assert_eq!(
            t.reshape_view(&[2, 3, 2, 2]).unwrap().strides,
            vec![4, 8, 2, 1]
        );
        assert!(
            t.reshape_view(&[6, 4]).is_none(),
            "rows of different batches interleave"
        );
        // Size-1 dims go anywhere.
        let col = layout(&[3, 1], &[5, 1], 2);
        assert_eq!(col.reshape_view(&[1, 3, 1]).unwrap().strides[1], 5);
        // A broadcast view splits only along its repeated runs.
        let wide = layout(&[3, 4], &[1, 0], 0);
        assert_eq!(
            wide.reshape_view(&[3, 2, 2]).unwrap().strides,
            vec![1, 0, 0]
        );
        assert!(wide.reshape_view(&[12]).is_none());
        // A transpose does not flatten.
        assert!(layout(&[4, 3], &[1, 4], 0).reshape_view(&[12]).is_none());
    }

    #[test]
    fn broadcast_follows_numpy() {
        assert_eq!(broadcast_shapes(&[3, 1], &[4]), Some(vec![3, 4]));
        assert_eq!(broadcast_shapes(&[], &[2, 2]), Some(vec![2, 2]));
        assert_eq!(broadcast_shapes(&[3], &[4]), None);
        assert_eq!(broadcast_shapes(&[0, 1], &[1, 5]), Some(vec![0, 5]));
    }
}
