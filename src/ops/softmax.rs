//! Softmax, log-softmax and the fused cross-entropy forward, all row kernels in
//! `shaders/softmax.wgsl` that subtract the row max first (stable for large logits).

use crate::device::Kernel;
use crate::error::{Error, Result};
use crate::ops::{dispatch, module_source};
use crate::tensor::{DType, Tensor};

const SOFTMAX_WGSL: &str = include_str!("../../shaders/softmax.wgsl");

fn source() -> String {
    module_source(SOFTMAX_WGSL, &[])
}

#[cfg(test)]
pub(crate) fn kernel_sources() -> Vec<(String, String)> {
    vec![("softmax".into(), source())]
}

/// Runs a row kernel over `x` moved so that `dim` is last.
fn along_dim(op: &'static str, entry: &'static str, x: &Tensor, dim: usize) -> Result<Tensor> {
    x.expect_dtype(op, DType::F32)?;
    x.layout().check_dim(op, dim)?;
    let last = x.rank() - 1;
    let moved = x.transpose(dim, last)?.contiguous()?;
    let out = Tensor::empty(op, moved.shape(), DType::F32, x.device())?;
    let k = x.shape()[dim];
    let m = x.numel().checked_div(k).unwrap_or(0);
    let key = format!("softmax:{entry}");
    let kernel = Kernel {
        key: &key,
        entry,
        source: &source,
    };
    let params = [m as u32, k as u32, moved.layout().offset as u32, 0];
    dispatch(op, &kernel, &[&moved, &out], &params, m as u32)?;
    out.transpose(dim, last)
}

impl Tensor {
    /// `exp(x) / sum(exp(x))` along `dim`.
    pub fn softmax(&self, dim: usize) -> Result<Tensor> {
        along_dim("softmax", "softmax", self, dim)
    }

    /// `x - log(sum(exp(x)))` along `dim`.
    pub fn log_softmax(&self, dim: usize) -> Result<Tensor> {
        along_dim("log_softmax", "log_softmax", self, dim)
    }
}

/// Mean over the batch of `-log_softmax(logits)[i, labels[i]]`, fused: one row kernel and one
/// mean. `logits` is `[N, C]` f32, `labels` is `[N]` u32 with values below `C`.
pub(crate) fn cross_entropy(logits: &Tensor, labels: &Tensor) -> Result<Tensor> {
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
    let bound = labels.index_bound().unwrap_or(u32::MAX);
    if n > 0 && bound as usize > c {
        return Err(Error::Index {
            op: OP,
            msg: format!(
                "label {} is out of range for {c} classes (logits {:?})",
                bound - 1,
                logits.shape()
            ),
        });
    }
    let logits = logits.contiguous()?;
    let labels = labels.contiguous()?;
    let losses = Tensor::empty(OP, &[n], DType::F32, logits.device())?;
    let kernel = Kernel {
        key: "softmax:cross_entropy",
        entry: "cross_entropy",
        source: &source,
    };
    let params = [
        n as u32,
        c as u32,
        logits.layout().offset as u32,
        labels.layout().offset as u32,
    ];
    dispatch(OP, &kernel, &[&logits, &losses, &labels], &params, n as u32)?;
    losses.mean()
}
