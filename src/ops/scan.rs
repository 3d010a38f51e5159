//! `cumsum` along a dim, forward and backward (`shaders/scan.wgsl`): running sums of blocks
//! of 1,024 elements, one workgroup each, started from the running sum of the blocks' totals
//! (the same kernels over `[rows, blocks]`), so that no invocation loops over a row and the
//! work is linear in its length. The backward is the running sum of the grad from the end:
//! the same kernels reading each row backwards.

use crate::error::Result;
use crate::kernel::{groups, Kernel, KernelParams, Launch, ShaderFamily, WORKGROUP};
use crate::ops::{cast, from_rows, on_scalar_as_row, rows_along};
use crate::tensor::dim::Dim;
use crate::tensor::grad_mode::NoGradGuard;
use crate::tensor::graph::record;
use crate::tensor::{DType, Tensor};

crate::kernel_params! {
    /// `rows` rows of `len` elements from element `offset` of the source's buffer, in
    /// `blocks` blocks of [`SCAN_BLOCK`]; `reverse` (1) sums each row from its end.
    pub(crate) struct ScanParams {
        offset: u32,
        rows: u32,
        len: u32,
        blocks: u32,
        reverse: u32,
    }
}

static SCAN: ShaderFamily = ShaderFamily {
    name: "scan",
    wgsl: include_str!("../../shaders/scan.wgsl"),
    params: &[&ScanParams::LAYOUT],
    preludes: &[],
};

#[cfg(test)]
pub(crate) fn kernel_sources() -> Vec<(String, String)> {
    vec![("scan".into(), SCAN.source(&[]))]
}

/// Positions of a row one workgroup sums (256 invocations of 4; the 1024u in scan.wgsl).
const SCAN_BLOCK: usize = 1024;

/// The longest rows one invocation walks alone (`serial_rows`).
const SERIAL_LEN: usize = 64;

/// Running sums along the last dim of contiguous rows `rows_t` (`[rows, len]`, F32), from the
/// end when `reverse`, in a new `[rows, len]` tensor. Records no grad.
fn running_sums(op: &'static str, rows_t: &Tensor, reverse: bool) -> Result<Tensor> {
    let (rows, len) = (rows_t.shape()[0], rows_t.shape()[1]);
    let dev = rows_t.device();
    let out = Tensor::empty(op, &[rows, len], DType::F32, dev)?;
    if rows * len == 0 {
        return Ok(out);
    }
    let blocks = len.div_ceil(SCAN_BLOCK);
    let params = ScanParams {
        offset: rows_t.layout().offset as u32,
        rows: rows as u32,
        len: len as u32,
        blocks: blocks as u32,
        reverse: reverse as u32,
    };
    if len <= SERIAL_LEN {
        let serial = Kernel::plain(&SCAN, "serial_rows");
        Launch::new(op, &serial, &[(1, rows_t), (2, &out)], &params)
            .record(groups(rows, WORKGROUP))?;
        return Ok(out);
    }
    let workgroups = (rows * blocks) as u32;
    // The totals' running sums; a row of one block needs none, and binds its source again.
    let scanned_totals = if blocks > 1 {
        let totals = Tensor::empty(op, &[rows, blocks], DType::F32, dev)?;
        let kernel = Kernel::plain(&SCAN, "block_totals");
        Launch::new(op, &kernel, &[(1, rows_t), (2, &totals)], &params).record(workgroups)?;
        running_sums(op, &totals, false)?
    } else {
        rows_t.clone()
    };
    let kernel = Kernel::plain(&SCAN, "scan_blocks");
    Launch::new(
        op,
        &kernel,
        &[(1, rows_t), (2, &out), (3, &scanned_totals)],
        &params,
    )
    .record(workgroups)?;
    Ok(out)
}

/// `x`'s running sums along `dim` (from the end when `reverse`), recorded: the grad of each
/// direction is the other direction's running sum of the grad.
fn cumsum_along(x: &Tensor, dim: usize, reverse: bool) -> Result<Tensor> {
    const OP: &str = "cumsum";
    x.expect_dtype(OP, DType::F32)?;
    x.layout().check_dim(OP, dim)?;
    let out = {
        let _no_grad = NoGradGuard::new();
        let sums = running_sums(OP, &rows_along(x, dim)?, reverse)?;
        from_rows(&sums, x.shape(), dim)?
    };
    Ok(record(OP, out, &[x], |_| {
        move |g: &Tensor| Ok(vec![Some(cumsum_along(g, dim, !reverse)?)])
    }))
}

impl Tensor {
    /// Running sums along `dim`: element `i` holds the sum of elements `0..=i`, as torch's
    /// `cumsum`, for rows of any length (work linear in it). Its grad is the running sum of the
    /// grad from the end.
    ///
    /// ```
    /// # fn main() -> wgrad::Result<()> {
    /// use wgrad::{Device, Tensor};
    /// let dev = Device::new()?;
    /// let x = Tensor::from_vec(vec![1.0, 2.0, 3.0, 4.0], &[2, 2], &dev)?;
    /// assert_eq!(x.cumsum(1)?.to_vec()?, vec![1.0, 3.0, 3.0, 7.0]);
    /// assert_eq!(x.cumsum(0)?.to_vec()?, vec![1.0, 2.0, 4.0, 6.0]);
    /// # Ok(())
    /// # }
    /// ```
    pub fn cumsum(&self, dim: impl Dim) -> Result<Tensor> {
        let dim = dim.resolve("cumsum", self.rank())?;
        if let Some(out) = cast::through_f32("cumsum", &[self], |w| w[0].cumsum(dim))? {
            return Ok(out);
        }
        if let Some(out) = on_scalar_as_row(self, &[dim], |row| cumsum_along(row, 0, false)) {
            return out;
        }
        cumsum_along(self, dim, false)
    }
}
