//! 2-d max and average pooling (NCHW, no padding) and their backward passes
//! (`shaders/pool.wgsl`). Max pooling keeps each window's arg-max (the first maximum in
//! row-major window order, as PyTorch) for its backward.

use crate::error::{Error, Result};
use crate::kernel::{groups, launch, Kernel, KernelParams, ShaderFamily, WORKGROUP};
use crate::tensor::graph::record;
use crate::tensor::{DType, Tensor};

crate::kernel_params! {
    /// `n` counts the elements the entry writes: outputs forward, inputs backward. Planes are
    /// `height x width` in, `out_h x out_w` out.
    pub(crate) struct PoolParams {
        n: u32,
        height: u32,
        width: u32,
        out_h: u32,
        out_w: u32,
        kernel: u32,
        stride: u32,
    }
}

static POOL: ShaderFamily = ShaderFamily {
    name: "pool",
    wgsl: include_str!("../../shaders/pool.wgsl"),
    params: &[&PoolParams::LAYOUT],
};

#[cfg(test)]
pub(crate) fn kernel_sources() -> Vec<(String, String)> {
    vec![("pool".into(), POOL.source(&[]))]
}

/// Max or average.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Pool {
    Max,
    Avg,
}

impl Pool {
    fn name(self) -> &'static str {
        match self {
            Pool::Max => "max_pool2d",
            Pool::Avg => "avg_pool2d",
        }
    }
}

/// The params of a pass over `x` `[N, C, H, W]`; `n` is set by the caller.
fn pool_params(op: &'static str, x: &Tensor, kernel: usize, stride: usize) -> Result<PoolParams> {
    x.expect_dtype(op, DType::F32)?;
    if x.rank() != 4 {
        return Err(Error::Shape {
            op,
            msg: format!("needs input [N, C, H, W], got {:?}", x.shape()),
        });
    }
    if kernel == 0 || stride == 0 {
        return Err(Error::InvalidArgument {
            op,
            msg: format!("kernel ({kernel}) and stride ({stride}) must be >= 1"),
        });
    }
    let (height, width) = (x.shape()[2], x.shape()[3]);
    if kernel > height || kernel > width {
        return Err(Error::Shape {
            op,
            msg: format!(
                "kernel {kernel}x{kernel} does not fit input {:?}",
                x.shape()
            ),
        });
    }
    Ok(PoolParams {
        n: 0,
        height: height as u32,
        width: width as u32,
        out_h: ((height - kernel) / stride + 1) as u32,
        out_w: ((width - kernel) / stride + 1) as u32,
        kernel: kernel as u32,
        stride: stride as u32,
    })
}

fn pool(x: &Tensor, kind: Pool, kernel: usize, stride: usize) -> Result<Tensor> {
    let op = kind.name();
    let mut params = pool_params(op, x, kernel, stride)?;
    let shape = [
        x.shape()[0],
        x.shape()[1],
        params.out_h as usize,
        params.out_w as usize,
    ];
    let out = Tensor::empty(op, &shape, DType::F32, x.device())?;
    let argmax = match kind {
        Pool::Max => Some(Tensor::empty(op, &shape, DType::U32, x.device())?),
        Pool::Avg => None,
    };
    let n = out.numel();
    if n > 0 {
        params.n = n as u32;
        let src = x.contiguous()?;
        let mut tensors = vec![&src, &out];
        tensors.extend(argmax.as_ref());
        let entry = match kind {
            Pool::Max => "max_forward",
            Pool::Avg => "avg_forward",
        };
        launch(
            op,
            &Kernel::plain(&POOL, entry),
            &tensors,
            &params,
            groups(n, WORKGROUP),
        )?;
    }
    Ok(record(op, out, &[x], |_| {
        let in_shape = x.shape().to_vec();
        move |g: &Tensor| {
            let mut params = params;
            let grad = Tensor::empty(op, &in_shape, DType::F32, g.device())?;
            let n = grad.numel();
            if n > 0 {
                params.n = n as u32;
                let g = g.contiguous()?;
                let mut tensors = vec![&g, &grad];
                tensors.extend(argmax.as_ref());
                let entry = match kind {
                    Pool::Max => "max_backward",
                    Pool::Avg => "avg_backward",
                };
                launch(
                    op,
                    &Kernel::plain(&POOL, entry),
                    &tensors,
                    &params,
                    groups(n, WORKGROUP),
                )?;
            }
            Ok(vec![Some(grad)])
        }
    }))
}

impl Tensor {
    /// 2-d max pooling of `[N, C, H, W]` over `kernel x kernel` windows every `stride`
    /// (no padding): `[N, C, (H - kernel) / stride + 1, ..]`. The grad goes to each window's
    /// first maximum; NaN counts as a maximum, so it propagates.
    pub fn max_pool2d(&self, kernel: usize, stride: usize) -> Result<Tensor> {
        pool(self, Pool::Max, kernel, stride)
    }

    /// 2-d average pooling of `[N, C, H, W]` over `kernel x kernel` windows every `stride`
    /// (no padding). The grad is spread evenly over each window.
    pub fn avg_pool2d(&self, kernel: usize, stride: usize) -> Result<Tensor> {
        pool(self, Pool::Avg, kernel, stride)
    }
}
