//! Scaled dot-product attention, forward and backward, as fused kernels
//! (`shaders/attention.wgsl`) that never store the `Tq x Tk` scores: the forward keeps a
//! running max and sum per query row (online softmax) and saves each row's log-sum-exp, and
//! the backward recomputes the scores from it. Device memory grows linearly in T.

use crate::device::{Device, KernelFlavor};
use crate::error::{Error, Result};
use crate::kernel::{
    groups, launch_at, without_subgroup_section, Kernel, KernelParams, ShaderFamily,
};
use crate::tensor::grad_mode::NoGradGuard;
use crate::tensor::graph::record;
use crate::tensor::layout::{inverse_permutation, merge_dims};
use crate::tensor::{DType, Tensor};

crate::kernel_params! {
    /// Heads of `t_q` query rows and `t_k` key rows; q and k rows have `d` features, v rows
    /// `dv`. `rows` counts the rows the entry owns (query rows, or key rows for
    /// `backward_key`), each looping over the other side in `splits` spans of `span` rows
    /// (the backward runs one launch per span: `split` names it). Each `*_layout` is a
    /// [`HeadLayout`]: of q, k, v and the out grad, read; of the output the entry writes (the
    /// forward's out, the query or key grad) and of the value grad.
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
        split: u32,
        q_layout: [u32; 5],
        k_layout: [u32; 5],
        v_layout: [u32; 5],
        o_layout: [u32; 5],
        out_layout: [u32; 5],
        out2_layout: [u32; 5],
    }
}

/// Where the rows of a `[.., T, features]` tensor lie, read in place: head `h` (of the batch
/// dims, merged into at most two) starts at `offset + (h / inner_len) outer_stride +
/// (h % inner_len) inner_stride`, its rows `row_stride` apart, features adjacent.
#[derive(Debug, Clone, Copy)]
struct HeadLayout {
    offset: usize,
    outer_stride: usize,
    inner_stride: usize,
    inner_len: usize,
    row_stride: usize,
}

impl HeadLayout {
    /// The layout of `t` as it is, or `None` when its features are not adjacent or its
    /// batch dims do not merge into two. An empty tensor has nothing to read or write: any
    /// layout will do (its strides may be a broadcast's, which no copy would change).
    fn of(t: &Tensor) -> Option<HeadLayout> {
        let (shape, strides) = (t.shape(), &t.layout().strides);
        let r = t.rank();
        if t.numel() == 0 {
            return Some(HeadLayout {
                offset: 0,
                outer_stride: 0,
                inner_stride: 0,
                inner_len: 1,
                row_stride: 0,
            });
        }
        if shape[r - 1] > 1 && strides[r - 1] != 1 {
            return None;
        }
        let (rank, merged, merged_strides) = merge_dims(&shape[..r - 2], &[&strides[..r - 2]])?;
        if rank > 2 {
            return None;
        }
        let s = &merged_strides[0];
        Some(HeadLayout {
            offset: t.layout().offset,
            outer_stride: s[4] as usize,
            inner_stride: s[5] as usize,
            inner_len: merged[5] as usize,
            row_stride: strides[r - 2],
        })
    }

    /// `t` itself when the kernels can read it in place, else a contiguous copy; with its
    /// layout.
    fn readable(t: &Tensor) -> Result<(Tensor, HeadLayout)> {
        if let Some(layout) = HeadLayout::of(t) {
            return Ok((t.clone(), layout));
        }
        let dense = {
            let _no_grad = NoGradGuard::new();
            t.contiguous()?
        };
        let layout = HeadLayout::of(&dense).expect("a contiguous tensor is readable");
        Ok((dense, layout))
    }

    fn slots(&self) -> [u32; 5] {
        [
            self.offset,
            self.outer_stride,
            self.inner_stride,
            self.inner_len.max(1),
            self.row_stride,
        ]
        .map(|x| x as u32)
    }

    /// Every start and stride a multiple of 4, so rows can be read four features at a time.
    fn aligned(&self) -> bool {
        [
            self.offset,
            self.outer_stride,
            self.inner_stride,
            self.row_stride,
        ]
        .iter()
        .all(|x| x.is_multiple_of(4))
    }
}

/// The dims of `t` from the largest stride to the smallest (ties in dim order): the order its
/// elements lie in memory.
fn memory_order(t: &Tensor) -> Vec<usize> {
    let strides = &t.layout().strides;
    let mut order: Vec<usize> = (0..t.rank()).collect();
    order.sort_by_key(|&d| std::cmp::Reverse(strides[d]));
    order
}

/// A new tensor of `shape` whose dims lie in memory in `like`'s order, as PyTorch's
/// `empty_like`: an output that follows q laid out `[B, T, H, D]` under a `[B, H, T, D]` view
/// is laid out so too, and merging its heads back is a view.
fn empty_in_order_of(op: &'static str, shape: &[usize], like: &Tensor) -> Result<Tensor> {
    let order = memory_order(like);
    let stored: Vec<usize> = order.iter().map(|&d| shape[d]).collect();
    Tensor::empty(op, &stored, DType::F32, like.device())?.permute(&inverse_permutation(&order))
}

/// An output of `shape` for the kernels to write, laid out in `like`'s order where they can
/// write that layout (its batch dims merge into two), else contiguous; with its layout.
fn written_like(op: &'static str, shape: &[usize], like: &Tensor) -> Result<(Tensor, HeadLayout)> {
    let out = empty_in_order_of(op, shape, like)?;
    if let Some(layout) = HeadLayout::of(&out) {
        return Ok((out, layout));
    }
    let out = Tensor::empty(op, shape, DType::F32, like.device())?;
    let layout = HeadLayout::of(&out).expect("a contiguous tensor is writable");
    Ok((out, layout))
}

/// q, k, v (and, backward, the out grad) as the kernels read them.
struct Operands {
    tensors: [Tensor; 4],
    layouts: [HeadLayout; 4],
}

static ATTENTION: ShaderFamily = ShaderFamily {
    name: "attention",
    wgsl: include_str!("../../shaders/attention.wgsl"),
    params: &[&AttentionParams::LAYOUT],
};

/// The module for heads of `d` q/k features and `dv` v features, reading four features per
/// load when `aligned`, with the `*_shared` entries where the device has `subgroups` 8 wide.
fn source(d: usize, dv: usize, aligned: bool, subgroups: bool) -> String {
    let wgsl = if subgroups {
        ATTENTION.wgsl.to_string()
    } else {
        without_subgroup_section(ATTENTION.wgsl)
    };
    ATTENTION.source_of(
        &wgsl,
        &[
            ("ALIGNED", if aligned { "true" } else { "false" }),
            ("HEAD_VEC4S", &d.div_ceil(4).to_string()),
            ("VALUE_VEC4S", &dv.div_ceil(4).to_string()),
        ],
    )
}

#[cfg(test)]
pub(crate) fn kernel_sources() -> Vec<(String, String)> {
    let mut all = Vec::new();
    for (d, dv, aligned) in [
        (32, 32, true),
        (6, 3, false),
        (256, 256, true),
        (64, 40, true),
    ] {
        for subgroups in [false, true] {
            all.push((
                format!("attention/{d}x{dv}/{aligned}/{subgroups}"),
                source(d, dv, aligned, subgroups),
            ));
        }
    }
    all
}

/// Whether the device runs the `*_shared` entries (for every shape): a CPU adapter with 8-wide
/// subgroups, where a subgroup is one SIMD group whose loads are loops over its lanes.
fn has_shared_entries(device: &Device) -> bool {
    device.kernel_flavor() == KernelFlavor::Cpu && device.subgroup_size() == Some(8)
}

/// Invocations of a `*_shared` entry for `heads` heads of `t` rows each: a head's rows padded
/// to whole 8s, so that every 8-wide subgroup owns rows of one head (the padding's invocations
/// load with their subgroup and store nothing).
fn shared_invocations(heads: usize, t: usize) -> usize {
    heads * t.next_multiple_of(8)
}

/// Runs `entry` with `bound` tensors, four features per load where `operands` allow.
fn run(
    entry: &'static str,
    operands: &[&HeadLayout],
    s: &Shape,
    bound: &[(u32, &Tensor)],
    params: &AttentionParams,
    invocations: usize,
) -> Result<()> {
    let dev = bound[0].1.device();
    let aligned = s.d.is_multiple_of(4)
        && s.dv.is_multiple_of(4)
        && operands.iter().all(|layout| layout.aligned());
    let subgroups = has_shared_entries(dev);
    let specialise = || source(s.d, s.dv, aligned, subgroups);
    let variant = format!(
        "{}x{}/{aligned}/{subgroups}",
        s.d.div_ceil(4),
        s.dv.div_ceil(4)
    );
    let kernel = Kernel::specialised(&ATTENTION, entry, &variant, &specialise);
    let workgroups = groups(invocations, ATTENTION_WORKGROUP);
    launch_at(
        "scaled_dot_product_attention",
        &kernel,
        bound,
        params,
        workgroups,
    )
}

/// Features a row may have (the kernels keep rows in registers).
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

    /// Params for `rows` rows reading through `l` and writing through `written` (the output
    /// and, for the key grads' entry, the value grad).
    fn params(
        &self,
        rows: usize,
        span: usize,
        splits: usize,
        l: &[HeadLayout; 4],
        written: [&HeadLayout; 2],
    ) -> AttentionParams {
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
            split: 0,
            q_layout: l[0].slots(),
            k_layout: l[1].slots(),
            v_layout: l[2].slots(),
            o_layout: l[3].slots(),
            out_layout: written[0].slots(),
            out2_layout: written[1].slots(),
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

/// The forward: `(out [.., Tq, Dv], stats [heads Tq, 2])` with the log-sum-exp of each row
/// in `stats[.., 0]`; `out` laid out in q's order (see [`empty_in_order_of`]).
/// `ops.tensors[3]` is unused (any tensor).
fn forward(s: &Shape, ops: &Operands, out_shape: &[usize]) -> Result<(Tensor, Tensor)> {
    const OP: &str = "scaled_dot_product_attention";
    let [q, k, v, _] = &ops.tensors;
    let [lq, lk, lv, _] = &ops.layouts;
    let dev = q.device();
    let rows = s.heads * s.t_q;
    let (out, lo) = written_like(OP, out_shape, q)?;
    let stats = Tensor::empty(OP, &[rows, 2], DType::F32, dev)?;
    if rows == 0 {
        return Ok((out, stats));
    }
    let (span, splits) = s.split(s.t_k, s.d.div_ceil(4) + s.dv.div_ceil(4) + 1);
    let params = s.params(rows, span, splits, &ops.layouts, [&lo, &lo]);
    let read = [lq, lk, lv, &lo];
    let (entry, invocations) = if has_shared_entries(dev) {
        ("forward_shared", shared_invocations(s.heads, s.t_q))
    } else {
        ("forward", rows)
    };
    if splits == 1 {
        let bound = [(1, q), (2, k), (3, v), (4, &out), (5, &stats)];
        run(entry, &read, s, &bound, &params, invocations)?;
        return Ok((out, stats));
    }
    let partial = Tensor::empty(OP, &[splits, rows, s.dv], DType::F32, dev)?;
    let partial_stats = Tensor::empty(OP, &[splits, rows, 2], DType::F32, dev)?;
    let bound = [(1, q), (2, k), (3, v), (4, &partial), (5, &partial_stats)];
    run(entry, &read, s, &bound, &params, invocations * splits)?;
    let bound = [(2, &partial_stats), (3, &partial), (4, &out), (5, &stats)];
    run("combine", &[&lo], s, &bound, &params, rows)?;
    Ok((out, stats))
}

/// The grads of q, k and v (each `None` unless `need` says so) from the out grad `g`.
fn backward(
    s: &Shape,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    (out, stats): (&Tensor, &Tensor),
    g: &Tensor,
    need: [bool; 3],
) -> Result<[Option<Tensor>; 3]> {
    const OP: &str = "scaled_dot_product_attention";
    let dev = q.device();
    let (rows_q, rows_k) = (s.heads * s.t_q, s.heads * s.t_k);
    let ops = operands([q, k, v, g])?;
    let [q, k, v, g] = &ops.tensors;
    let read: Vec<&HeadLayout> = ops.layouts.iter().collect();
    // (log-sum-exp, delta = rowsum(g * out)) per query row, in one launch.
    let stats = {
        let lo = HeadLayout::of(out).expect("written by the forward, readable");
        let lg = &ops.layouts[3];
        let with_stats = Tensor::empty(OP, &[rows_q, 2], DType::F32, dev)?;
        let params = s.params(rows_q, 0, 1, &[lo, lo, lo, *lg], [&lo, &lo]);
        let bound = [(2, stats), (3, out), (4, g), (5, &with_stats)];
        run("backward_stats", &[&lo, lg], s, &bound, &params, rows_q)?;
        with_stats
    };
    let (d4, dv4) = (s.d.div_ceil(4), s.dv.div_ceil(4));
    let mut grads = [None, None, None];
    // One launch per span of the other side, each adding to the grads the earlier wrote.
    let spans = |len: usize, params: AttentionParams| {
        let (span, splits) = s.split(len, 2 * d4 + dv4 + 1);
        (0..splits).map(move |split| AttentionParams {
            span: span as u32,
            splits: 1,
            split: split as u32,
            ..params
        })
    };
    if need[0] {
        let (grad_q, lq) = written_like(OP, q.shape(), q)?;
        let base = s.params(rows_q, 0, 1, &ops.layouts, [&lq, &lq]);
        let bound = [(1, q), (2, k), (3, v), (4, g), (5, &stats), (6, &grad_q)];
        let (entry, invocations) = if has_shared_entries(dev) {
            ("backward_query_shared", shared_invocations(s.heads, s.t_q))
        } else {
            ("backward_query", rows_q)
        };
        let layouts: Vec<&HeadLayout> = read.iter().copied().chain([&lq]).collect();
        for params in spans(s.t_k, base) {
            run(entry, &layouts, s, &bound, &params, invocations)?;
        }
        grads[0] = Some(grad_q);
    }
    if need[1] || need[2] {
        let (grad_k, lk) = written_like(OP, k.shape(), k)?;
        let (grad_v, lv) = written_like(OP, v.shape(), v)?;
        let base = s.params(rows_k, 0, 1, &ops.layouts, [&lk, &lv]);
        let bound = [
            (1, q),
            (2, k),
            (3, v),
            (4, g),
            (5, &stats),
            (6, &grad_k),
            (7, &grad_v),
        ];
        let (entry, invocations) = if has_shared_entries(dev) {
            ("backward_key_shared", shared_invocations(s.heads, s.t_k))
        } else {
            ("backward_key", rows_k)
        };
        let layouts: Vec<&HeadLayout> = read.iter().copied().chain([&lk, &lv]).collect();
        for params in spans(s.t_q, base) {
            run(entry, &layouts, s, &bound, &params, invocations)?;
        }
        grads[1] = need[1].then_some(grad_k);
        grads[2] = need[2].then_some(grad_v);
    }
    Ok(grads)
}

/// `tensors` as the kernels read them: in place where their layouts allow.
fn operands(tensors: [&Tensor; 4]) -> Result<Operands> {
    let [a, b, c, d] = tensors.map(HeadLayout::readable);
    let (a, b, c, d) = (a?, b?, c?, d?);
    Ok(Operands {
        layouts: [a.1, b.1, c.1, d.1],
        tensors: [a.0, b.0, c.0, d.0],
    })
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
        let ops = operands([self, k, v, self])?;
        let (out, stats) = forward(&shape, &ops, &out_shape)?;
        Ok(record(
            "scaled_dot_product_attention",
            out,
            &[self, k, v],
            |out| {
                let need = [self.requires_grad(), k.requires_grad(), v.requires_grad()];
                let [q, k, v, _] = ops.tensors.map(|t| t.detach());
                let out = out.detach();
                move |g: &Tensor| {
                    let grads = backward(&shape, &q, &k, &v, (&out, &stats), g, need)?;
                    Ok(grads.into_iter().collect())
                }
            },
        ))
    }
}
