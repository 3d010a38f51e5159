//! Softmax, log-softmax and the fused cross-entropy forward, all row kernels in
//! `shaders/softmax.wgsl` that subtract the row max first (stable for large logits).

use crate::device::Kernel;
use crate::error::{Error, Result};
use crate::ops::{dispatch, groups, module_source};
use crate::tensor::{DType, Tensor};

const SOFTMAX_WGSL: &str = include_str!("../../shaders/softmax.wgsl");

fn source() -> String {
    module_source(SOFTMAX_WGSL, &[])
}

#[cfg(test)]
pub(crate) fn kernel_sources() -> Vec<(String, String)> {
    vec![("softmax".into(), source())]
}

/// Rows of the `[M, K]` input one `*_serial` workgroup handles (its `WG`).
const SERIAL_ROWS_PER_GROUP: usize = 64;

/// The row kernels of `shaders/softmax.wgsl`.
#[derive(Clone, Copy)]
enum RowKernel {
    Softmax { log: bool },
    CrossEntropy { labels_offset: usize },
}

/// Runs `kernel` over the `m` rows of `k` elements of contiguous `tensors[0]` (from
/// `offset`). Software adapters give each row one invocation (no barriers; four-wide reads
/// when aligned) once there are enough rows to fill a workgroup; GPUs give each row a
/// workgroup.
fn run_rows(
    op: &'static str,
    kernel: RowKernel,
    tensors: &[&Tensor],
    m: usize,
    k: usize,
    offset: usize,
) -> Result<()> {
    let serial = tensors[0].device().info().is_software() && m >= SERIAL_ROWS_PER_GROUP;
    let vec4 = serial && k.is_multiple_of(4) && offset.is_multiple_of(4);
    let (entry, log, labels_offset) = match (kernel, serial) {
        (RowKernel::Softmax { log }, false) => ("softmax_rows", log, 0),
        (RowKernel::Softmax { log }, true) => ("softmax_serial", log, 0),
        (RowKernel::CrossEntropy { labels_offset }, false) => {
            ("cross_entropy_rows", false, labels_offset)
        }
        (RowKernel::CrossEntropy { labels_offset }, true) => {
            ("cross_entropy_serial", false, labels_offset)
        }
    };
    let params = [m, k, offset, labels_offset, log as usize, vec4 as usize].map(|x| x as u32);
    let workgroups = if serial {
        groups(m, SERIAL_ROWS_PER_GROUP)
    } else {
        m as u32
    };
    let key = format!("softmax:{entry}");
    let kernel = Kernel {
        key: &key,
        entry,
        source: &source,
    };
    dispatch(op, &kernel, tensors, &params, workgroups)
}

/// Runs softmax or log_softmax over `x` moved so that `dim` is last.
fn along_dim(op: &'static str, log: bool, x: &Tensor, dim: usize) -> Result<Tensor> {
    x.expect_dtype(op, DType::F32)?;
    x.layout().check_dim(op, dim)?;
    let last = x.rank() - 1;
    let moved = x.transpose(dim, last)?.contiguous()?;
    let out = Tensor::empty(op, moved.shape(), DType::F32, x.device())?;
    let k = x.shape()[dim];
    let m = x.numel().checked_div(k).unwrap_or(0);
    let offset = moved.layout().offset;
    run_rows(
        op,
        RowKernel::Softmax { log },
        &[&moved, &out],
        m,
        k,
        offset,
    )?;
    out.transpose(dim, last)
}

impl Tensor {
    /// `exp(x) / sum(exp(x))` along `dim`.
    pub fn softmax(&self, dim: usize) -> Result<Tensor> {
        along_dim("softmax", false, self, dim)
    }

    /// `x - log(sum(exp(x)))` along `dim`.
    pub fn log_softmax(&self, dim: usize) -> Result<Tensor> {
        along_dim("log_softmax", true, self, dim)
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
    let kernel = RowKernel::CrossEntropy {
        labels_offset: labels.layout().offset,
    };
    let offset = logits.layout().offset;
    run_rows(OP, kernel, &[&logits, &losses, &labels], n, c, offset)?;
    losses.mean()
}
