//! Batched matrix multiply with NumPy-style batch broadcasting. Inputs are read through their
//! strides, so `x.matmul(&w.t()?)` reads `w` transposed without a copy.

use crate::device::{Kernel, MatmulKernel};
use crate::error::{Error, Result};
use crate::ops::{dispatch, module_source};
use crate::tensor::layout::{broadcast_shapes, merge_dims};
use crate::tensor::{DType, Tensor};

const MATMUL_WGSL: &str = include_str!("../../shaders/matmul.wgsl");

fn source() -> String {
    module_source(MATMUL_WGSL, &[])
}

#[cfg(test)]
pub(crate) fn kernel_sources() -> Vec<(String, String)> {
    vec![("matmul".into(), source())]
}

/// The device's matmul kernel: entry point and output tile (rows, columns).
fn kernel_for(t: &Tensor) -> (&'static str, usize, usize) {
    match t.device().matmul_kernel() {
        MatmulKernel::RegisterTiled => ("register_tiled", 8, 256),
        MatmulKernel::SharedTiled => ("shared_tiled", 64, 64),
    }
}

/// Batch stride of a tensor whose batch dims (all but the last two) merge into one.
fn batch_stride(t: &Tensor) -> Option<u32> {
    let rank = t.rank();
    let (batch_rank, _, strides) =
        merge_dims(&t.shape()[..rank - 2], &[&t.layout().strides[..rank - 2]])?;
    match batch_rank {
        0 => Some(0),
        1 => Some(*strides[0].last().expect("padded")),
        _ => None,
    }
}

/// `t` with one batch stride: itself when its batch dims merge, else a dense copy.
fn with_batch_stride(t: Tensor) -> Result<(Tensor, u32)> {
    if let Some(stride) = batch_stride(&t) {
        return Ok((t, stride));
    }
    let dense = t.contiguous()?;
    let stride = batch_stride(&dense).expect("dense batch dims merge");
    Ok((dense, stride))
}

impl Tensor {
    /// Matrix product with PyTorch's `matmul` rules: 1-D operands are promoted to a row
    /// (left) or column (right) and the added dim removed; leading dims broadcast.
    pub fn matmul(&self, other: &Tensor) -> Result<Tensor> {
        const OP: &str = "matmul";
        self.expect_same_device(OP, other)?;
        self.expect_dtype(OP, DType::F32)?;
        other.expect_dtype(OP, DType::F32)?;
        if self.rank() == 0 || other.rank() == 0 {
            return Err(Error::Shape {
                op: OP,
                msg: format!(
                    "needs operands of rank >= 1, got {:?} and {:?}",
                    self.shape(),
                    other.shape()
                ),
            });
        }
        let a = if self.rank() == 1 {
            self.unsqueeze(0)?
        } else {
            self.clone()
        };
        let b = if other.rank() == 1 {
            other.unsqueeze(1)?
        } else {
            other.clone()
        };
        let (m, k) = (a.shape()[a.rank() - 2], a.shape()[a.rank() - 1]);
        let (k2, n) = (b.shape()[b.rank() - 2], b.shape()[b.rank() - 1]);
        let batch = broadcast_shapes(&a.shape()[..a.rank() - 2], &b.shape()[..b.rank() - 2]);
        let batch = match batch {
            Some(batch) if k == k2 => batch,
            _ => {
                return Err(Error::Shape {
                    op: OP,
                    msg: format!(
                        "shapes {:?} and {:?} do not multiply",
                        self.shape(),
                        other.shape()
                    ),
                })
            }
        };
        let a = a.expand(&[batch.as_slice(), &[m, k]].concat())?;
        let b = b.expand(&[batch.as_slice(), &[k, n]].concat())?;
        // Batch dims that do not merge into one stride are made dense.
        let (a, a_batch_stride) = with_batch_stride(a)?;
        let (b, b_batch_stride) = with_batch_stride(b)?;
        let batches: usize = batch.iter().product();
        let mut out_shape = [batch.as_slice(), &[m, n]].concat();
        if k == 0 {
            let zeros = Tensor::zeros(&out_shape, self.device())?;
            return finish(zeros, self, other, &mut out_shape);
        }
        let out = Tensor::empty(OP, &out_shape, DType::F32, self.device())?;
        if out.numel() > 0 {
            let (entry, tile_rows, tile_cols) = kernel_for(self);
            let (la, lb) = (a.layout(), b.layout());
            let r = a.rank();
            let (tiles_m, tiles_n) = (m.div_ceil(tile_rows), n.div_ceil(tile_cols));
            let params = [
                m as u32,
                n as u32,
                k as u32,
                batches as u32,
                la.offset as u32,
                a_batch_stride,
                la.strides[r - 2] as u32,
                la.strides[r - 1] as u32,
                lb.offset as u32,
                b_batch_stride,
                lb.strides[r - 2] as u32,
                lb.strides[r - 1] as u32,
                tiles_n as u32,
                tiles_m as u32,
            ];
            let key = format!("matmul:{entry}");
            let kernel = Kernel {
                key: &key,
                entry,
                source: &source,
            };
            let workgroups = batches * tiles_m * tiles_n;
            dispatch(OP, &kernel, &[&a, &b, &out], &params, workgroups as u32)?;
        }
        finish(out, self, other, &mut out_shape)
    }
}

/// Removes the dims that 1-D operands were promoted with.
fn finish(out: Tensor, a: &Tensor, b: &Tensor, shape: &mut Vec<usize>) -> Result<Tensor> {
    if b.rank() == 1 {
        shape.pop();
    }
    if a.rank() == 1 {
        shape.remove(shape.len() - if b.rank() == 1 { 1 } else { 2 });
    }
    out.reshape(shape)
}
