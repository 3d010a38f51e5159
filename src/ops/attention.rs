//! Scaled dot-product attention, forward and backward, as fused kernels
//! (`shaders/attention.wgsl`) that never store the `Tq x Tk` scores: the forward keeps a
//! running max and sum per query row (online softmax) and saves each row's log-sum-exp, and
//! the backward recomputes the scores from it. Device memory grows linearly in T.

use crate::error::{Error, Result};
use crate::kernel::{groups, launch_at, Kernel, KernelParams, ShaderFamily};
use crate::tensor::grad_mode::NoGradGuard;
use crate::tensor::graph::record;
use crate::tensor::{DType, Tensor};

crate::kernel_params! {
    /// `heads` stacks of `t_q` query rows and `t_k` key rows; q and k rows have `d` features,
    /// v rows `dv`. `rows` counts the rows the entry owns (query rows, or key rows for
    /// `backward_key`), each looping over the other side in `splits` spans of `span` rows.
    pub(crate) struct AttentionParams {
        rows: u32,
        t_q: u32,
        t_k: u32,
        d: u32,
        dv: u32,
        causal: u32,
        scale: f32,
        span: u32,
        splits: u32,
        q_offset: u32,
        k_offset: u32,
        v_offset: u32,
        o_offset: u32,
    }
}

static ATTENTION: ShaderFamily = ShaderFamily {
    name: "attention",
    wgsl: include_str!("../../shaders/attention.wgsl"),
    params: &[&AttentionParams::LAYOUT],
};

#[cfg(test)]
pub(crate) fn kernel_sources() -> Vec<(String, String)> {
    vec![("attention".into(), ATTENTION.source(&[]))]
}

/// Features a row may have (`MAX_VEC4S` vec4s in the kernels).
const MAX_FEATURES: usize = 256;

/// Loop iterations one invocation may run: well under llvmpipe's 65,535, which counts every
/// pass through every loop of the invocation, the loops around the main one included.
const LOOP_BUDGET: usize = 50_000;

/// Invocations per workgroup of every attention entry.
const ATTENTION_WORKGROUP: usize = 64;

/// The shapes of one attention call, with the batch dims flattened into `heads`.
#[derive(Debug, Clone, Copy)]
struct Shape {
    heads: usize,
    t_q: usize,
    t_k: usize,
    d: usize,
    dv: usize,
    causal: bool,
}

impl Shape {
    /// How one entry splits its loop: `(span, splits)` for loops of `len` rows whose body
    /// runs `per_row` inner loop passes. Each is counted twice: llvmpipe also counts loop
    /// exits and checks, and a count of passes alone let a 3-pass body run short.
    fn split(&self, len: usize, per_row: usize) -> (usize, usize) {
        let vec4s = self.d.div_ceil(4) + self.dv.div_ceil(4);
        let span = ((LOOP_BUDGET - 8 * vec4s) / (2 * per_row)).max(1);
        (span, len.div_ceil(span).max(1))
    }

    fn params(&self, rows: usize, span: usize, splits: usize, t: [&Tensor; 4]) -> AttentionParams {
        AttentionParams {
            rows: rows as u32,
            t_q: self.t_q as u32,
            t_k: self.t_k as u32,
            d: self.d as u32,
            dv: self.dv as u32,
            causal: self.causal as u32,
            scale: 1.0 / (self.d as f32).sqrt(),
            span: span as u32,
            splits: splits as u32,
            q_offset: t[0].layout().offset as u32,
            k_offset: t[1].layout().offset as u32,
            v_offset: t[2].layout().offset as u32,
            o_offset: t[3].layout().offset as u32,
        }
    }
}

/// Checks q `[.., Tq, D]`, k `[.., Tk, D]` and v `[.., Tk, Dv]` with equal batch dims.
fn check(q: &Tensor, k: &Tensor, v: &Tensor, causal: bool) -> Result<Shape> {
    const OP: &str = "scaled_dot_product_attention";
    for t in [k, v] {
        q.expect_same_device(OP, t)?;
    }
    for t in [q, k, v] {
        t.expect_dtype(OP, DType::F32)?;
    }
    let shapes = || format!("q {:?}, k {:?}, v {:?}", q.shape(), k.shape(), v.shape());
    let r = q.rank();
    let fits = r >= 2
        && k.rank() == r
        && v.rank() == r
        && q.shape()[..r - 2] == k.shape()[..r - 2]
        && q.shape()[..r - 2] == v.shape()[..r - 2]
        && k.shape()[r - 2] == v.shape()[r - 2]
        && q.shape()[r - 1] == k.shape()[r - 1];
    if !fits {
        return Err(Error::Shape {
            op: OP,
            msg: format!(
                "needs q [.., Tq, D], k [.., Tk, D] and v [.., Tk, Dv] with the same batch \
                 dims, got {}",
                shapes()
            ),
        });
    }
    let (d, dv) = (q.shape()[r - 1], v.shape()[r - 1]);
    if d > MAX_FEATURES || dv > MAX_FEATURES {
        return Err(Error::Shape {
            op: OP,
            msg: format!(
                "supports at most {MAX_FEATURES} features per head, got {}",
                shapes()
            ),
        });
    }
    Ok(Shape {
        heads: q.shape()[..r - 2].iter().product(),
        t_q: q.shape()[r - 2],
        t_k: k.shape()[r - 2],
        d,
        dv,
        causal,
    })
}

/// Sums a `[splits, rest..]` partial result over its splits.
fn sum_splits(partial: Tensor, splits: usize) -> Result<Tensor> {
    match splits {
        1 => partial.squeeze(0),
        _ => partial.sum_dims(&[0], false),
    }
}

/// The forward: `(out [heads Tq, Dv], stats [heads Tq, 2])` with the log-sum-exp of each row
/// in `stats[.., 0]`.
fn forward(s: &Shape, q: &Tensor, k: &Tensor, v: &Tensor) -> Result<(Tensor, Tensor)> {
    const OP: &str = "scaled_dot_product_attention";
    let dev = q.device();
    let rows = s.heads * s.t_q;
    let out = Tensor::empty(OP, &[rows, s.dv], DType::F32, dev)?;
    let stats = Tensor::empty(OP, &[rows, 2], DType::F32, dev)?;
    if rows == 0 {
        return Ok((out, stats));
    }
    let (span, splits) = s.split(s.t_k, s.d.div_ceil(4) + s.dv.div_ceil(4) + 1);
    let workgroups = |n: usize| groups(n, ATTENTION_WORKGROUP);
    let kernel = Kernel::plain(&ATTENTION, "forward");
    if splits == 1 {
        let params = s.params(rows, span, 1, [q, k, v, &out]);
        let bound = [(1, q), (2, k), (3, v), (4, &out), (5, &stats)];
        launch_at(OP, &kernel, &bound, &params, workgroups(rows))?;
        return Ok((out, stats));
    }
    let partial = Tensor::empty(OP, &[splits, rows, s.dv], DType::F32, dev)?;
    let partial_stats = Tensor::empty(OP, &[splits, rows, 2], DType::F32, dev)?;
    let params = s.params(rows, span, splits, [q, k, v, &out]);
    let bound = [(1, q), (2, k), (3, v), (4, &partial), (5, &partial_stats)];
    launch_at(OP, &kernel, &bound, &params, workgroups(rows * splits))?;
    let combine = Kernel::plain(&ATTENTION, "combine");
    let bound = [(2, &partial_stats), (3, &partial), (4, &out), (5, &stats)];
    launch_at(OP, &combine, &bound, &params, workgroups(rows))?;
    Ok((out, stats))
}

/// The grads of q, k and v (each `None` unless `need` says so) from the out grad `g`.
#[allow(clippy::too_many_arguments)]
fn backward(
    s: &Shape,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    out: &Tensor,
    stats: &Tensor,
    g: &Tensor,
    need: [bool; 3],
) -> Result<[Option<Tensor>; 3]> {
    const OP: &str = "scaled_dot_product_attention";
    let dev = q.device();
    let (rows_q, rows_k) = (s.heads * s.t_q, s.heads * s.t_k);
    let g = g.contiguous()?.reshape(&[rows_q, s.dv])?;
    // (log-sum-exp, delta = rowsum(g * out)) per query row.
    let delta = g.mul(out)?.sum_dims(&[1], true)?;
    let stats = Tensor::cat(&[stats.narrow(1, 0, 1)?, delta], 1)?;
    let workgroups = |n: usize| groups(n, ATTENTION_WORKGROUP);
    let (d4, dv4) = (s.d.div_ceil(4), s.dv.div_ceil(4));
    let mut grads = [None, None, None];
    if need[0] {
        let (span, splits) = s.split(s.t_k, 2 * d4 + dv4 + 1);
        let partial = Tensor::empty(OP, &[splits, rows_q, s.d], DType::F32, dev)?;
        let params = s.params(rows_q, span, splits, [q, k, v, &g]);
        let bound = [(1, q), (2, k), (3, v), (4, &g), (5, &stats), (6, &partial)];
        let kernel = Kernel::plain(&ATTENTION, "backward_query");
        launch_at(OP, &kernel, &bound, &params, workgroups(rows_q * splits))?;
        grads[0] = Some(sum_splits(partial, splits)?);
    }
    if need[1] || need[2] {
        let (span, splits) = s.split(s.t_q, 2 * d4 + dv4 + 1);
        let partial_k = Tensor::empty(OP, &[splits, rows_k, s.d], DType::F32, dev)?;
        let partial_v = Tensor::empty(OP, &[splits, rows_k, s.dv], DType::F32, dev)?;
        let params = s.params(rows_k, span, splits, [q, k, v, &g]);
        let bound = [
            (1, q),
            (2, k),
            (3, v),
            (4, &g),
            (5, &stats),
            (6, &partial_k),
            (7, &partial_v),
        ];
        let kernel = Kernel::plain(&ATTENTION, "backward_key");
        launch_at(OP, &kernel, &bound, &params, workgroups(rows_k * splits))?;
        grads[1] = need[1].then(|| sum_splits(partial_k, splits)).transpose()?;
        grads[2] = need[2].then(|| sum_splits(partial_v, splits)).transpose()?;
    }
    Ok(grads)
}

impl Tensor {
    /// `softmax(q k^T / sqrt(D)) v` for q `[.., Tq, D]`, k `[.., Tk, D]` and v `[.., Tk, Dv]`
    /// (the same batch dims): `[.., Tq, Dv]`. With `causal`, query `i` attends to keys
    /// `0..=i` only (PyTorch's `is_causal`, aligned top-left). Fused: the `Tq x Tk` scores
    /// are never stored, forward or backward, so memory grows linearly in T.
    ///
    /// ```
    /// # fn main() -> wgrad::Result<()> {
    /// use wgrad::{Device, Tensor};
    /// let dev = Device::new()?;
    /// let q = Tensor::randn(&[2, 4, 8, 16], 0, &dev)?;
    /// let o = q.scaled_dot_product_attention(&q, &q, true)?;
    /// assert_eq!(o.shape(), &[2, 4, 8, 16]);
    /// # Ok(())
    /// # }
    /// ```
    pub fn scaled_dot_product_attention(
        &self,
        k: &Tensor,
        v: &Tensor,
        causal: bool,
    ) -> Result<Tensor> {
        let shape = check(self, k, v, causal)?;
        let r = self.rank();
        let mut out_shape = self.shape().to_vec();
        out_shape[r - 1] = shape.dv;
        if shape.t_k == 0 {
            // No key to attend to: PyTorch gives NaN rows; wgrad gives zeros, as a row with
            // every key masked does.
            let zeros = Tensor::zeros(&out_shape, self.device())?;
            return Ok(record(
                "scaled_dot_product_attention",
                zeros,
                &[self, k, v],
                |_| {
                    let shapes = [
                        self.shape().to_vec(),
                        k.shape().to_vec(),
                        v.shape().to_vec(),
                    ];
                    let dev = self.device().clone();
                    move |_g: &Tensor| {
                        shapes
                            .iter()
                            .map(|s| Tensor::zeros(s, &dev).map(Some))
                            .collect()
                    }
                },
            ));
        }
        let (q, k2, v2) = {
            let _no_grad = NoGradGuard::new();
            (self.contiguous()?, k.contiguous()?, v.contiguous()?)
        };
        let (out, stats) = forward(&shape, &q, &k2, &v2)?;
        let result = out.reshape(&out_shape)?;
        Ok(record(
            "scaled_dot_product_attention",
            result,
            &[self, k, v],
            |_| {
                let need = [self.requires_grad(), k.requires_grad(), v.requires_grad()];
                let shapes = [
                    self.shape().to_vec(),
                    k.shape().to_vec(),
                    v.shape().to_vec(),
                ];
                let (q, k, v, out) = (q.detach(), k2.detach(), v2.detach(), out.detach());
                move |g: &Tensor| {
                    let grads = backward(&shape, &q, &k, &v, &out, &stats, g, need)?;
                    grads
                        .into_iter()
                        .zip(&shapes)
                        .map(|(grad, s)| grad.map(|t| t.reshape(s)).transpose())
                        .collect()
                }
            },
        ))
    }
}
