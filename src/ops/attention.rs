//! Scaled dot-product attention, forward and backward, as fused kernels
//! (`shaders/attention.wgsl`) that never store the `Tq x Tk` scores: the forward keeps a
//! running max and sum per query row (online softmax) and saves each row's log-sum-exp, and
//! the backward recomputes the scores from it. Device memory grows linearly in T.
//!
//! Options ([`SdpaOptions`]): a mask read in place through broadcast strides (never
//! expanded to `[.., Tq, Tk]`), an explicit scale, and grouped-query attention, where each k/v
//! head serves `group` consecutive q heads: the kernels map a q head to its k/v head, so k and
//! v are never copied out to H heads.

use crate::device::{Device, KernelFlavor};
use crate::error::{Error, Result};
use crate::kernel::{groups, with_subgroup_section, Kernel, KernelParams, Launch, ShaderFamily};
use crate::ops::autocast::for_16_bit_op;
use crate::ops::{cast, run_sizes};
use crate::tensor::grad_mode::NoGradGuard;
use crate::tensor::graph::record;
use crate::tensor::layout::{broadcast_shapes, inverse_permutation, merge_dims};
use crate::tensor::{DType, Layout, Tensor};

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
        group: u32,
        q_layout: [u32; 5],
        k_layout: [u32; 5],
        v_layout: [u32; 5],
        o_layout: [u32; 5],
        out_layout: [u32; 5],
        out2_layout: [u32; 5],
        mask_layout: [u32; 6],
    }
}

/// How [`Tensor::scaled_dot_product_attention_with`] attends, as PyTorch's
/// `scaled_dot_product_attention` arguments.
#[derive(Debug, Clone, Copy, Default)]
pub struct SdpaOptions<'a> {
    /// Query `i` attends to keys `0..=i` only (PyTorch's `is_causal`, aligned top-left).
    pub causal: bool,
    /// An F32 mask added to the scaled scores (`-inf` drops a key), or a U32 keep-mask
    /// (nonzero: attend), broadcastable to `[.., Tq, Tk]` over q's batch dims. It takes no
    /// grad. A query row whose keys are all dropped gives zeros, as PyTorch 2.5 and later do
    /// (earlier versions gave NaN).
    pub mask: Option<&'a Tensor>,
    /// The factor on `q k^T`; `None` is `1 / sqrt(D)`.
    pub scale: Option<f32>,
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
    preludes: &[],
};

/// The module for heads of `d` q/k features and `dv` v features, reading four features per
/// load when `aligned`, with the subgroup sections (`*_shared`, `*_tiled_lanes`) where
/// `subgroups` (the device runs one of them), for a mask of `mask_kind` (see [`MaskKind`]);
/// with `value_grad_shared`, the key entries write the value grad through the key grad's
/// binding (see [`packed_grads`]).
fn source(
    d: usize,
    dv: usize,
    aligned: bool,
    subgroups: bool,
    mask_kind: u32,
    value_grad_shared: bool,
) -> String {
    let source = ATTENTION.source(&[
        (
            "VALUE_GRAD_SHARED_CODE",
            if value_grad_shared { "true" } else { "false" },
        ),
        ("ALIGNED", if aligned { "true" } else { "false" }),
        ("HEAD_VEC4S", &d.div_ceil(4).to_string()),
        ("VALUE_VEC4S", &dv.div_ceil(4).to_string()),
        ("MASK_CODE", &mask_kind.to_string()),
        ("TILE_ROWS", &tile_rows(d, dv).to_string()),
    ]);
    with_subgroup_section(&source, subgroups)
}

#[cfg(test)]
pub(crate) fn kernel_sources() -> Vec<(String, String)> {
    let mut all = Vec::new();
    for (d, dv, aligned, mask) in [
        (32, 32, true, MaskKind::None),
        (6, 3, false, MaskKind::Additive),
        (256, 256, true, MaskKind::Keep),
        (64, 40, true, MaskKind::None),
    ] {
        for subgroups in [false, true] {
            all.push((
                format!("attention/{d}x{dv}/{aligned}/{subgroups}/{mask:?}"),
                source(d, dv, aligned, subgroups, mask as u32, false),
            ));
        }
    }
    all
}

/// Workgroup memory the `*_tiled` entries' two tiles take at most: WebGPU's least
/// `max_compute_workgroup_storage_size`.
const TILE_BYTES: usize = crate::device::LEAST_WORKGROUP_STORAGE as usize;

/// Rows of the other side per tile in the `*_tiled` entries, for rows of `d` q/k and `dv` v
/// features (feature groups of 4 padded to whole 8s): as many as fit both tiles in
/// [`TILE_BYTES`], at most one per invocation.
fn tile_rows(d: usize, dv: usize) -> usize {
    let padded = |features: usize| features.div_ceil(4).next_multiple_of(8);
    let vec4s_per_row = (padded(d) + padded(dv)).max(1);
    (TILE_BYTES / 16 / vec4s_per_row).clamp(1, ATTENTION_WORKGROUP)
}

/// Which entries run attention on a device. Each owns rows of one side (query rows, or key
/// rows for the key grads) and loops over the other.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Entries {
    /// One invocation per row, reading the other side from storage: CPU adapters without
    /// 8-wide subgroups (llvmpipe through GL ran the tiles 1.3x slower), and any adapter
    /// whose workgroup memory cannot hold the tiles.
    PerRow,
    /// `*_shared`: a subgroup owns 8 rows of one head and broadcasts each row of the other
    /// side it loads. A CPU adapter with 8-wide subgroups, where a subgroup is one SIMD group
    /// whose loads are loops over its lanes.
    Shared,
    /// `*_tiled` (flash-attention tiles): a workgroup owns 64 rows of one head and stages the
    /// other side in workgroup memory. The GPU kernel flavour on adapters without subgroups
    /// of 8 or more lanes.
    Tiled,
    /// `*_tiled_lanes`: the same tiles, register-blocked: 8 lanes of a subgroup own 8 rows,
    /// each lane an eighth of their features, and meet through subgroup shuffles. The GPU
    /// kernel flavour where subgroups have 8 or more lanes.
    TiledLanes,
}

/// The passes each set of entries has: the forward (owning query rows), the query grad
/// (query rows) and the key and value grads (key rows).
#[derive(Debug, Clone, Copy)]
enum Pass {
    Forward,
    QueryGrad,
    KeyValueGrad,
}

impl Entries {
    /// The set this device runs (its kernel flavour, subgroups and workgroup memory).
    fn of(device: &Device) -> Entries {
        let tiles_fit =
            device.inner.limits.max_compute_workgroup_storage_size as usize >= TILE_BYTES;
        match device.kernel_flavor() {
            KernelFlavor::Cpu if device.subgroup_size() == Some(8) => Entries::Shared,
            KernelFlavor::Gpu
                if tiles_fit && device.min_subgroup_size().is_some_and(|w| w >= 8) =>
            {
                Entries::TiledLanes
            }
            KernelFlavor::Gpu if tiles_fit => Entries::Tiled,
            _ => Entries::PerRow,
        }
    }

    /// The entry point of `pass` in this set.
    fn entry(self, pass: Pass) -> &'static str {
        match (self, pass) {
            (Entries::PerRow, Pass::Forward) => "forward",
            (Entries::PerRow, Pass::QueryGrad) => "backward_query",
            (Entries::PerRow, Pass::KeyValueGrad) => "backward_key",
            (Entries::Shared, Pass::Forward) => "forward_shared",
            (Entries::Shared, Pass::QueryGrad) => "backward_query_shared",
            (Entries::Shared, Pass::KeyValueGrad) => "backward_key_shared",
            (Entries::Tiled, Pass::Forward) => "forward_tiled",
            (Entries::Tiled, Pass::QueryGrad) => "backward_query_tiled",
            (Entries::Tiled, Pass::KeyValueGrad) => "backward_key_tiled",
            (Entries::TiledLanes, Pass::Forward) => "forward_tiled_lanes",
            (Entries::TiledLanes, Pass::QueryGrad) => "backward_query_tiled_lanes",
            (Entries::TiledLanes, Pass::KeyValueGrad) => "backward_key_tiled_lanes",
        }
    }

    /// Invocations for `heads` heads of `t` owned rows each: a head's rows padded to whole
    /// 8s (a subgroup's) or 64s (a workgroup's), whose padding invocations load with the
    /// rest and store nothing.
    fn invocations(self, heads: usize, t: usize) -> usize {
        match self {
            Entries::PerRow => heads * t,
            Entries::Shared => heads * t.next_multiple_of(8),
            Entries::Tiled | Entries::TiledLanes => heads * t.next_multiple_of(ATTENTION_WORKGROUP),
        }
    }
}

/// Runs `entry` with `bound` tensors, four features per load where `operands` allow; with
/// `value_grad_shared`, a key entry writes the value grad through the key grad's binding.
fn run(
    entry: &'static str,
    operands: &[&HeadLayout],
    s: &Shape,
    bound: &[(u32, &Tensor)],
    params: &AttentionParams,
    invocations: usize,
    value_grad_shared: bool,
) -> Result<()> {
    let dev = bound[0].1.device();
    let aligned = s.d.is_multiple_of(4)
        && s.dv.is_multiple_of(4)
        && operands.iter().all(|layout| layout.aligned());
    let subgroups = matches!(Entries::of(dev), Entries::Shared | Entries::TiledLanes);
    let mask = s.mask_kind;
    let specialise = || source(s.d, s.dv, aligned, subgroups, mask, value_grad_shared);
    let variant = format!(
        "{}x{}/{aligned}/{subgroups}/{mask}{}",
        s.d.div_ceil(4),
        s.dv.div_ceil(4),
        if value_grad_shared {
            "/shared value grad"
        } else {
            ""
        }
    );
    let kernel = Kernel::specialised(&ATTENTION, entry, &variant, &specialise);
    let workgroups = groups(invocations, ATTENTION_WORKGROUP);
    Launch::new("scaled_dot_product_attention", &kernel, bound, params).record(workgroups)
}

/// Features a row may have (the kernels keep rows in registers).
const MAX_FEATURES: usize = 256;

/// Loop iterations one invocation may run: well under llvmpipe's 65,535, which counts every
/// pass through every loop of the invocation, the loops around the main one included.
const LOOP_BUDGET: usize = 50_000;

/// Invocations per workgroup of every attention entry.
const ATTENTION_WORKGROUP: usize = 64;

/// What the kernels' `MASK_KIND` says the mask binding holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
enum MaskKind {
    None = 0,
    /// F32, added to the scores.
    Additive = 1,
    /// U32, nonzero where a key is attended to.
    Keep = 2,
}

/// The shapes of one attention call, with q's batch dims flattened into `heads` (k and v
/// have `heads / group` heads), and its options.
#[derive(Debug, Clone, Copy)]
struct Shape {
    heads: usize,
    group: usize,
    t_q: usize,
    t_k: usize,
    d: usize,
    dv: usize,
    causal: bool,
    scale: f32,
    mask_kind: u32,
    /// Where the mask's element for (q head, query, key) lies: see `masked_score` in the WGSL.
    mask_layout: [u32; 6],
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
            scale: self.scale,
            span: span as u32,
            splits: splits as u32,
            split: 0,
            group: self.group as u32,
            q_layout: l[0].slots(),
            k_layout: l[1].slots(),
            v_layout: l[2].slots(),
            o_layout: l[3].slots(),
            out_layout: written[0].slots(),
            out2_layout: written[1].slots(),
            mask_layout: self.mask_layout,
        }
    }
}

const OP: &str = "scaled_dot_product_attention";

/// Checks q `[.., Tq, D]`, k `[.., Tk, D]` and v `[.., Tk, Dv]`, whose batch dims are equal
/// but for dim -3 (the heads), where q's may be a multiple of k's and v's (grouped-query);
/// and the mask, which [`mask_operand`] returns as the kernels read it.
fn check(q: &Tensor, k: &Tensor, v: &Tensor, opts: &SdpaOptions) -> Result<(Shape, MaskOperand)> {
    for t in [k, v] {
        q.expect_same_device(OP, t)?;
    }
    for t in [q, k, v] {
        // Float operands share one dtype (see [`sixteen_bit_dtype`]).
        if !t.dtype().is_float() {
            t.expect_dtype(OP, DType::F32)?;
        }
    }
    let shapes = || format!("q {:?}, k {:?}, v {:?}", q.shape(), k.shape(), v.shape());
    let r = q.rank();
    let fits = r >= 2
        && k.rank() == r
        && v.rank() == r
        && k.shape()[..r - 2] == v.shape()[..r - 2]
        && k.shape()[r - 2] == v.shape()[r - 2]
        && q.shape()[r - 1] == k.shape()[r - 1];
    // Batch dims above the heads (dim -3) equal; the heads equal, or q's a multiple of k's.
    let outer = r.saturating_sub(3);
    let batch_fits = fits && q.shape()[..outer] == k.shape()[..outer];
    if !batch_fits {
        return Err(Error::Shape {
            op: OP,
            msg: format!(
                "needs q [.., Tq, D], k [.., Tk, D] and v [.., Tk, Dv] with the same batch \
                 dims (q may have a multiple of k's heads on dim -3), got {}",
                shapes()
            ),
        });
    }
    let (heads_q, heads_kv) = if r >= 3 {
        (q.shape()[r - 3], k.shape()[r - 3])
    } else {
        (1, 1)
    };
    let group = match (heads_q, heads_kv) {
        (0, 0) => 1,
        (_, 0) => 0,
        (hq, hkv) if hq % hkv == 0 => hq / hkv,
        _ => 0,
    };
    if group == 0 {
        return Err(Error::Shape {
            op: OP,
            msg: format!(
                "grouped-query attention needs q's heads (dim -3, {heads_q}) to be a multiple \
                 of k's and v's ({heads_kv}), got {}",
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
    if let Some(scale) = opts.scale {
        if !scale.is_finite() {
            return Err(Error::InvalidArgument {
                op: OP,
                msg: format!("scale must be finite, got {scale}"),
            });
        }
    }
    let t_k = k.shape()[r - 2];
    let mask = mask_operand(opts.mask, q, t_k)?;
    let shape = Shape {
        heads: q.shape()[..r - 2].iter().product(),
        group,
        t_q: q.shape()[r - 2],
        t_k,
        d,
        dv,
        causal: opts.causal,
        scale: opts.scale.unwrap_or(1.0 / (d as f32).sqrt()),
        mask_kind: mask.kind as u32,
        mask_layout: mask.layout,
    };
    Ok((shape, mask))
}

/// The mask as the kernels read it: its kind, the tensor to bind (q when there is no mask:
/// the binding needs a buffer) and where its element for (q head, query, key) lies.
struct MaskOperand {
    kind: MaskKind,
    tensor: Option<Tensor>,
    layout: [u32; 6],
}

impl MaskOperand {
    /// The tensor to bind at the mask's binding: the mask, or `q` where there is none.
    fn bound<'a>(&'a self, q: &'a Tensor) -> &'a Tensor {
        self.tensor.as_ref().unwrap_or(q)
    }
}

/// Checks `mask` against q `[.., Tq, D]` and `t_k` keys and lays it out: a view expanded to
/// `[q batch.., Tq, Tk]` (broadcast dims have stride 0), copied only where its batch dims do
/// not merge into two.
fn mask_operand(mask: Option<&Tensor>, q: &Tensor, t_k: usize) -> Result<MaskOperand> {
    let Some(mask) = mask else {
        return Ok(MaskOperand {
            kind: MaskKind::None,
            tensor: None,
            layout: [0, 0, 0, 1, 0, 0],
        });
    };
    q.expect_same_device(OP, mask)?;
    // Exhaustive, so that a new dtype must say whether it can be a mask.
    let kind = match mask.dtype() {
        DType::F32 => MaskKind::Additive,
        DType::U32 => MaskKind::Keep,
        DType::F16 | DType::BF16 => {
            return Err(Error::DType {
                op: OP,
                msg: format!(
                    "a mask is F32 (added) or U32 (1 = attend), got {:?}",
                    mask.dtype()
                ),
            })
        }
    };
    if mask.requires_grad() {
        return Err(Error::InvalidArgument {
            op: OP,
            msg: "the mask takes no grad: pass mask.detach()".to_string(),
        });
    }
    let r = q.rank();
    let mut full = q.shape()[..r - 2].to_vec();
    full.extend([q.shape()[r - 2], t_k]);
    if broadcast_shapes(mask.shape(), &full).as_deref() != Some(&full[..]) {
        return Err(Error::Shape {
            op: OP,
            msg: format!(
                "the mask of shape {:?} does not broadcast to [.., Tq, Tk] = {full:?} (q {:?})",
                mask.shape(),
                q.shape()
            ),
        });
    }
    let _no_grad = NoGradGuard::new();
    let layout_of = |m: &Tensor| -> Option<[u32; 6]> {
        let strides = &m.layout().strides;
        let n = strides.len();
        if m.numel() == 0 {
            return Some([0, 0, 0, 1, 0, 0]);
        }
        let (rank, merged, merged_strides) = merge_dims(&full[..n - 2], &[&strides[..n - 2]])?;
        if rank > 2 {
            return None;
        }
        let s = &merged_strides[0];
        Some([
            m.layout().offset as u32,
            s[4],
            s[5],
            merged[5].max(1),
            strides[n - 2] as u32,
            strides[n - 1] as u32,
        ])
    };
    let expanded = mask.expand(&full)?;
    let (tensor, layout) = match layout_of(&expanded) {
        Some(layout) => (expanded, layout),
        None => {
            let dense = expanded.contiguous()?;
            let layout = layout_of(&dense).expect("a contiguous mask's batch dims merge");
            (dense, layout)
        }
    };
    Ok(MaskOperand {
        kind,
        tensor: Some(tensor),
        layout,
    })
}

/// Whether one call's kernels can bind what they bind, each whole: q, k and v (an F32 one in
/// place, its whole buffer, or with `windowed` as [`attend_in_windows`] binds it, a window of
/// its span or else a dense copy; a 16-bit one through a dense F32 copy) and the mask so too,
/// and the new tensors: each input's grad and the output of `out_rows` rows, with the
/// forward's partial outputs (one per split of the keys). The windowed answer is the plain
/// one's for the tensors `attend_in_windows` makes, so that a chunk that fits one never
/// chunks again.
fn fits_one_binding(
    [q, k, v]: [&Tensor; 3],
    mask: Option<&Tensor>,
    s: &Shape,
    out_rows: usize,
    windowed: bool,
) -> bool {
    let inner = &q.device().inner;
    let new_fits =
        |elements: usize| inner.buffer_bytes(elements as u64 * 4) <= inner.max_binding_bytes();
    // An empty tensor is never bound (no kernel runs over it).
    let binds = |t: &Tensor| {
        t.numel() == 0
            || match (t.dtype().is_16_bit(), windowed) {
                (true, _) => new_fits(t.numel()),
                (false, false) => !t.exceeds_binding(),
                (false, true) => !t.bindable().exceeds_binding() || new_fits(t.numel()),
            }
    };
    // The output and row statistics, and where the keys split, their partial sums.
    let (_, splits) = s.split(s.t_k, s.d.div_ceil(4) + s.dv.div_ceil(4) + 1);
    let per_row = s.dv.max(2);
    [q, k, v]
        .into_iter()
        .all(|t| binds(t) && new_fits(t.numel()))
        && mask.is_none_or(binds)
        && new_fits(out_rows * per_row)
        && (splits == 1 || new_fits(splits * out_rows * per_row))
}

/// Attention whose tensors are past one binding ([`fits_one_binding`]): where they are views
/// of part of a larger buffer that fit one binding each, one call on windows of their spans;
/// else attention over chunks of q's outermost batch dim that can be split (the heads, on dim
/// -3, in whole groups of grouped-query heads), each chunk's q, k, v and mask (where the mask
/// is not broadcast along that dim) so, the outputs joined with `cat`. A chunk still past a
/// binding splits its next dim, and so on; a single head past one is a `TooLarge` error. Each
/// chunk is an attention node of its own; `split` joins their grads.
fn in_chunks(q: &Tensor, k: &Tensor, v: &Tensor, opts: &SdpaOptions, s: &Shape) -> Result<Tensor> {
    let rows = q.numel() / s.d.max(1);
    if fits_one_binding([q, k, v], opts.mask, s, rows, true) {
        return attend_in_windows([q, k, v], opts.mask.cloned(), opts);
    }
    let r = q.rank();
    let least = |d: usize| if d + 3 == r { s.group } else { 1 };
    let Some(dim) = (0..r - 2).find(|&d| q.shape()[d] > least(d)) else {
        let bytes = [q, k, v].map(|t| t.storage().bytes()).into_iter().max();
        return Err(Error::TooLarge {
            op: OP,
            bytes: bytes.unwrap_or(0),
            limit: q.device().max_binding_bytes(),
        });
    };
    let (n, per_kv) = (q.shape()[dim], least(dim));
    // The mask's dim that lines up with `dim`, unless the mask is broadcast along it.
    let mask_dim = opts.mask.and_then(|m| {
        let at = (dim + m.rank()).checked_sub(r)?;
        (m.shape()[at] > 1).then_some(at)
    });
    let mask_of = |start: usize, count: usize| -> Result<Option<Tensor>> {
        match (opts.mask, mask_dim) {
            (Some(m), Some(at)) => m.narrow(at, start, count).map(Some),
            (m, _) => Ok(m.cloned()),
        }
    };
    let fits = |count: usize| -> Result<bool> {
        let q = q.narrow(dim, 0, count)?;
        let [k, v] = [k, v].map(|t| t.narrow(dim, 0, count / per_kv));
        let rows = q.numel() / s.d.max(1);
        Ok(fits_one_binding(
            [&q, &k?, &v?],
            mask_of(0, count)?.as_ref(),
            s,
            rows,
            true,
        ))
    };
    // The most q slices (whole groups of them) a chunk takes; one group where none fit.
    let mut count = per_kv;
    for c in (per_kv..=n).rev().step_by(per_kv) {
        if fits(c)? {
            count = c;
            break;
        }
    }
    let sizes = run_sizes(n, count);
    let kv_sizes: Vec<usize> = sizes.iter().map(|c| c / per_kv).collect();
    let (qs, ks, vs) = (
        q.split(&sizes, dim)?,
        k.split(&kv_sizes, dim)?,
        v.split(&kv_sizes, dim)?,
    );
    let mut outs = Vec::with_capacity(sizes.len());
    let mut start = 0;
    for (i, &len) in sizes.iter().enumerate() {
        let mask = mask_of(start, len)?;
        outs.push(attend_in_windows([&qs[i], &ks[i], &vs[i]], mask, opts)?);
        start += len;
    }
    Tensor::cat(&outs, dim)
}

/// Attention of q, k and v each bound as a window of its span (an op whose grad passes
/// through), or copied dense where its span is past one binding (a head of a packed
/// projection spans every row of it); the mask so too (it has no grad).
fn attend_in_windows(
    qkv: [&Tensor; 3],
    mask: Option<Tensor>,
    opts: &SdpaOptions,
) -> Result<Tensor> {
    // A dense copy where the window is past one binding: a new buffer (`contiguous` would
    // give a dense `t` back as it is).
    let in_window = |t: &Tensor| -> Result<Tensor> {
        // Bound as it is: `t` itself (a window of it would share its node, and a node
        // recorded on it would make a leaf of the caller's into a node of its own graph).
        if !t.exceeds_binding() {
            return Ok(t.clone());
        }
        let window = t.bindable();
        if window.exceeds_binding() {
            return t.deep_clone();
        }
        Ok(record(OP, window, &[t], |_| {
            move |g: &Tensor| Ok(vec![Some(g.clone())])
        }))
    };
    let (q, k, v) = (in_window(qkv[0])?, in_window(qkv[1])?, in_window(qkv[2])?);
    // The mask takes no grad, so its window records no node.
    let mask = mask.as_ref().map(in_window).transpose()?;
    let opts = SdpaOptions {
        mask: mask.as_ref(),
        ..*opts
    };
    q.scaled_dot_product_attention_with(&k, &v, &opts)
}

/// The forward: `(out [.., Tq, Dv], stats [heads Tq, 2])` with the log-sum-exp of each row
/// in `stats[.., 0]`; `out` laid out in q's order (see [`empty_in_order_of`]).
/// `ops.tensors[3]` is unused (any tensor); `mask` is bound at the mask's binding.
fn forward(
    s: &Shape,
    ops: &Operands,
    mask: &Tensor,
    out_shape: &[usize],
) -> Result<(Tensor, Tensor)> {
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
    let entries = Entries::of(dev);
    let (entry, invocations) = (
        entries.entry(Pass::Forward),
        entries.invocations(s.heads, s.t_q),
    );
    if splits == 1 {
        let bound = [(1, q), (2, k), (3, v), (4, &out), (5, &stats), (8, mask)];
        run(entry, &read, s, &bound, &params, invocations, false)?;
        return Ok((out, stats));
    }
    let partial = Tensor::empty(OP, &[splits, rows, s.dv], DType::F32, dev)?;
    let partial_stats = Tensor::empty(OP, &[splits, rows, 2], DType::F32, dev)?;
    let bound = [
        (1, q),
        (2, k),
        (3, v),
        (4, &partial),
        (5, &partial_stats),
        (8, mask),
    ];
    run(
        entry,
        &read,
        s,
        &bound,
        &params,
        invocations * splits,
        false,
    )?;
    let bound = [(2, &partial_stats), (3, &partial), (4, &out), (5, &stats)];
    run("combine", &[&lo], s, &bound, &params, rows, false)?;
    Ok((out, stats))
}

/// The grads of q, k and v (each `None` unless `need` says so) from the out grad `g`; `mask`
/// is bound at the mask's binding. `out` is dropped once the row statistics are made (a
/// 16-bit step's F32 copy of it is not held while the grads are).
#[allow(clippy::too_many_arguments)]
fn backward(
    s: &Shape,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: &Tensor,
    (out, stats): (Tensor, &Tensor),
    g: &Tensor,
    need: [bool; 3],
) -> Result<[Option<Tensor>; 3]> {
    let dev = q.device();
    let (rows_q, rows_k) = (s.heads * s.t_q, s.heads / s.group * s.t_k);
    let ops = operands([q, k, v, g])?;
    let [q, k, v, g] = &ops.tensors;
    let read: Vec<&HeadLayout> = ops.layouts.iter().collect();
    // (log-sum-exp, delta = rowsum(g * out)) per query row, in one launch.
    let stats = {
        let lo = HeadLayout::of(&out).expect("written by the forward, readable");
        let lg = &ops.layouts[3];
        let with_stats = Tensor::empty(OP, &[rows_q, 2], DType::F32, dev)?;
        let params = s.params(rows_q, 0, 1, &[lo, lo, lo, *lg], [&lo, &lo]);
        // q is bound, unread: the kernel's one row loader names all four inputs.
        let bound = [(1, q), (2, stats), (3, &out), (4, g), (5, &with_stats)];
        run(
            "backward_stats",
            &[&lo, lg],
            s,
            &bound,
            &params,
            rows_q,
            false,
        )?;
        with_stats
    };
    drop(out);
    let (d4, dv4) = (s.d.div_ceil(4), s.dv.div_ceil(4));
    let entries = Entries::of(dev);
    let mut grads = [None, None, None];
    // One launch per span of the other side, each adding to the grads the earlier wrote. A
    // key row's loop runs over the queries of each of its `group` q heads.
    let spans = |len: usize, heads_per_row: usize, params: AttentionParams| {
        let (span, splits) = s.split(len, heads_per_row * (2 * d4 + dv4 + 1));
        (0..splits).map(move |split| AttentionParams {
            span: span as u32,
            splits: 1,
            split: split as u32,
            ..params
        })
    };
    let packed = if need == [true; 3] {
        packed_grads(q, k, v)?
    } else {
        None
    };
    if need[0] {
        let (grad_q, lq) = match &packed {
            Some([(grad_q, lq), _, _]) => (grad_q.clone(), *lq),
            None => written_like(OP, q.shape(), q)?,
        };
        let base = s.params(rows_q, 0, 1, &ops.layouts, [&lq, &lq]);
        let bound = [
            (1, q),
            (2, k),
            (3, v),
            (4, g),
            (5, &stats),
            (6, &grad_q),
            (8, mask),
        ];
        let entry = entries.entry(Pass::QueryGrad);
        let invocations = entries.invocations(s.heads, s.t_q);
        let layouts: Vec<&HeadLayout> = read.iter().copied().chain([&lq]).collect();
        for params in spans(s.t_k, 1, base) {
            run(entry, &layouts, s, &bound, &params, invocations, false)?;
        }
        grads[0] = Some(grad_q);
    }
    if need[1] || need[2] {
        let ((grad_k, lk), (grad_v, lv)) = match &packed {
            Some([_, k, v]) => (k.clone(), v.clone()),
            None => (
                written_like(OP, k.shape(), k)?,
                written_like(OP, v.shape(), v)?,
            ),
        };
        let base = s.params(rows_k, 0, 1, &ops.layouts, [&lk, &lv]);
        // The value grad shares the key grad's buffer (and binding) when packed.
        let scratch = match packed {
            Some(_) => Some(Tensor::empty(OP, &[4], DType::F32, dev)?),
            None => None,
        };
        let bound = [
            (1, q),
            (2, k),
            (3, v),
            (4, g),
            (5, &stats),
            (6, &grad_k),
            (7, scratch.as_ref().unwrap_or(&grad_v)),
            (8, mask),
        ];
        let entry = entries.entry(Pass::KeyValueGrad);
        let invocations = entries.invocations(s.heads / s.group, s.t_k);
        let layouts: Vec<&HeadLayout> = read.iter().copied().chain([&lk, &lv]).collect();
        for params in spans(s.t_q, s.group, base) {
            run(
                entry,
                &layouts,
                s,
                &bound,
                &params,
                invocations,
                scratch.is_some(),
            )?;
        }
        grads[1] = need[1].then_some(grad_k);
        grads[2] = need[2].then_some(grad_v);
    }
    Ok(grads)
}

/// The grads of q, k and v in one buffer, each laid out as its input is, with their
/// layouts; `None` unless q, k and v are F32 views of one buffer that differ only in their
/// offsets and do not overlap (the heads of a packed projection, as `nn::MultiheadAttention`
/// splits them). Split's backward then joins the three grads as a view of that buffer where
/// it would have copied them together (see `Tensor::split`).
fn packed_grads(q: &Tensor, k: &Tensor, v: &Tensor) -> Result<Option<[(Tensor, HeadLayout); 3]>> {
    let layouts = [q.layout(), k.layout(), v.layout()];
    let one_buffer = [k, v].iter().all(|t| t.storage_id() == q.storage_id());
    let alike = layouts[1..]
        .iter()
        .all(|l| l.shape == layouts[0].shape && l.strides == layouts[0].strides);
    let f32 = [q, k, v].iter().all(|t| t.dtype() == DType::F32);
    if !one_buffer || !alike || !f32 || q.numel() == 0 {
        return Ok(None);
    }
    let Some((period, run)) = runs(layouts[0]) else {
        return Ok(None);
    };
    // Every element of a view lies at its offset plus a multiple of `period` plus 0 .. run:
    // views whose offsets' residues start runs that fit in a period and do not meet share
    // no element.
    let mut starts: Vec<usize> = layouts.iter().map(|l| l.offset % period).collect();
    starts.sort_unstable();
    let apart = starts.windows(2).all(|w| w[0] + run <= w[1]);
    if !apart || starts[2] + run > period {
        return Ok(None);
    }
    let span = layouts
        .iter()
        .map(|l| l.span())
        .max()
        .expect("three layouts");
    let buffer = Tensor::empty(OP, &[span], DType::F32, q.device())?;
    let grads = layouts.map(|l| {
        let grad = buffer.view(l.clone());
        HeadLayout::of(&grad).map(|layout| (grad, layout))
    });
    match grads {
        [Some(a), Some(b), Some(c)] => Ok(Some([a, b, c])),
        _ => Ok(None),
    }
}

/// `(period, run)` for a layout without overlapping elements whose elements are runs of
/// `run` adjacent ones, each starting a multiple of `period` (at least `run`) from its offset
/// (`usize::MAX` for one run); `None` for any other layout.
fn runs(l: &Layout) -> Option<(usize, usize)> {
    let mut dims: Vec<(usize, usize)> = l
        .shape
        .iter()
        .zip(&l.strides)
        .filter(|(&n, _)| n > 1)
        .map(|(&n, &s)| (n, s))
        .collect();
    dims.sort_by_key(|&(_, s)| std::cmp::Reverse(s));
    // Each dim steps past all of the dims inside it: no element is reached twice.
    let nested = dims.windows(2).all(|w| w[0].1 >= w[1].0 * w[1].1) && dims.iter().all(|d| d.1 > 0);
    if !nested {
        return None;
    }
    let mut run = 1;
    while let Some(&(n, s)) = dims.last() {
        if s != run {
            break;
        }
        run *= n;
        dims.pop();
    }
    let period = dims.iter().fold(0, |g, &(_, s)| gcd(g, s));
    match period {
        0 => Some((usize::MAX, run)),
        p if p >= run => Some((p, run)),
        _ => None,
    }
}

fn gcd(a: usize, b: usize) -> usize {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
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

/// The 16-bit dtype q, k and v share, or `None` when they are F32; float operands of two
/// dtypes are an error (autocast casts them all to its dtype before this).
fn sixteen_bit_dtype(q: &Tensor, k: &Tensor, v: &Tensor) -> Result<Option<DType>> {
    match cast::float_dtypes([q, k, v].iter().map(|t| t.dtype())) {
        None => Ok(None),
        Some((narrow, None)) => Ok(Some(narrow)),
        Some((narrow, Some(other))) => Err(cast::two_float_dtypes(OP, narrow, other)),
    }
}

/// `t` as the kernels read it: itself where the operands are F32 (`narrow` is `None`), else
/// an F32 copy recording no grad.
fn as_f32(t: &Tensor, narrow: Option<DType>) -> Result<Tensor> {
    match narrow {
        Some(_) if t.dtype() != DType::F32 => cast_in_memory_order(t, DType::F32),
        _ => Ok(t.clone()),
    }
}

/// `t` cast to `dtype` (recording no grad), its dims laid out in memory in `t`'s order: a
/// `[B, H, T, D]` view of `[B, T, H, D]` heads stays one, so the kernels read it in place
/// and merging its heads back stays a view.
fn cast_in_memory_order(t: &Tensor, dtype: DType) -> Result<Tensor> {
    let _no_grad = NoGradGuard::new();
    let order = memory_order(t);
    t.permute(&order)?
        .to_dtype(dtype)?
        .permute(&inverse_permutation(&order))
}

impl Tensor {
    /// `softmax(q k^T / sqrt(D)) v` for q `[.., Tq, D]`, k `[.., Tk, D]` and v `[.., Tk, Dv]`
    /// (the same batch dims): `[.., Tq, Dv]`. With `causal`, query `i` attends to keys
    /// `0..=i` only (PyTorch's `is_causal`, aligned top-left). Fused: the `Tq x Tk` scores
    /// are never stored, forward or backward, so memory grows linearly in T. For masks, a
    /// scale or grouped-query heads see [`Tensor::scaled_dot_product_attention_with`].
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
        self.scaled_dot_product_attention_with(
            k,
            v,
            &SdpaOptions {
                causal,
                ..Default::default()
            },
        )
    }

    /// Attention as [`Tensor::scaled_dot_product_attention`], with PyTorch's options: a mask
    /// (F32 added to the scores, or U32 keep-mask, broadcastable to `[.., Tq, Tk]`: a padding
    /// mask `[B, 1, 1, Tk]` is read in place, never expanded), a scale, and grouped-query
    /// attention: k and v may have fewer heads than q on dim -3 (q's a multiple of theirs),
    /// each k/v head serving consecutive q heads, read in place without copies.
    ///
    /// ```
    /// # fn main() -> wgrad::Result<()> {
    /// use wgrad::{Device, SdpaOptions, Tensor};
    /// let dev = Device::new()?;
    /// let q = Tensor::randn(&[2, 8, 5, 16], 0, &dev)?; // 8 query heads
    /// let kv = Tensor::randn(&[2, 2, 5, 16], 1, &dev)?; // 2 key/value heads
    /// // Batch row 1 has two padding tokens at the end: 1 = attend.
    /// let keep = Tensor::from_vec_u32(vec![1, 1, 1, 1, 1, 1, 1, 1, 0, 0], &[2, 1, 1, 5], &dev)?;
    /// let opts = SdpaOptions { causal: true, mask: Some(&keep), scale: None };
    /// let o = q.scaled_dot_product_attention_with(&kv, &kv, &opts)?;
    /// assert_eq!(o.shape(), &[2, 8, 5, 16]);
    /// # Ok(())
    /// # }
    /// ```
    pub fn scaled_dot_product_attention_with(
        &self,
        k: &Tensor,
        v: &Tensor,
        opts: &SdpaOptions,
    ) -> Result<Tensor> {
        // Under autocast q, k and v are cast to the region's dtype (torch's autocast runs
        // attention in 16 bits); 16-bit operands are read as f32 by the kernels through casts
        // that live only for the launch, and the node saves the 16-bit tensors themselves.
        let [q, k, v] = [self, k, v].map(for_16_bit_op);
        let (q, k, v) = (q?, k?, v?);
        let narrow = sixteen_bit_dtype(&q, &k, &v)?;
        let (shape, mask) = check(&q, &k, &v, opts)?;
        let r = q.rank();
        let mut out_shape = q.shape().to_vec();
        out_shape[r - 1] = shape.dv;
        if shape.t_k == 0 {
            // No key to attend to: zeros, as PyTorch's math path gives (its weights are an
            // empty product) and as a row with every key masked gives.
            let zeros = Tensor::zeros(&out_shape, q.device())?.to_dtype(q.dtype())?;
            return Ok(record(OP, zeros, &[&q, &k, &v], |_| {
                let shapes = [q.shape().to_vec(), k.shape().to_vec(), v.shape().to_vec()];
                let dev = q.device().clone();
                move |_g: &Tensor| {
                    shapes
                        .iter()
                        .map(|s| Tensor::zeros(s, &dev).map(Some))
                        .collect()
                }
            }));
        }
        let rows = q.numel() / shape.d.max(1);
        if !fits_one_binding([&q, &k, &v], opts.mask, &shape, rows, false) {
            return in_chunks(&q, &k, &v, opts, &shape);
        }
        let wide = [&q, &k, &v].map(|t| as_f32(t, narrow));
        let [wq, wk, wv] = wide;
        let (wq, wk, wv) = (wq?, wk?, wv?);
        let ops = operands([&wq, &wk, &wv, &wq])?;
        let (out, stats) = forward(&shape, &ops, mask.bound(&wq), &out_shape)?;
        let out = match narrow {
            Some(dtype) => cast_in_memory_order(&out, dtype)?,
            None => out,
        };
        Ok(record(OP, out, &[&q, &k, &v], |out| {
            let need = [q.requires_grad(), k.requires_grad(), v.requires_grad()];
            // The forward's operands where they are f32 (read in place, or the copies the
            // kernels read); the 16-bit tensors themselves otherwise.
            let saved = match narrow {
                Some(_) => [&q, &k, &v].map(Tensor::detach),
                None => [0, 1, 2].map(|i| ops.tensors[i].detach()),
            };
            let mask = mask.tensor.clone();
            let out = out.detach();
            move |g: &Tensor| {
                // A chunk's grad is a view of the whole output's (see `in_chunks`).
                let g = &g.bindable();
                let [q, k, v] = [&saved[0], &saved[1], &saved[2]].map(|t| as_f32(t, narrow));
                let (q, k, v) = (q?, k?, v?);
                let (out, g) = (as_f32(&out, narrow)?, as_f32(g, narrow)?);
                let mask = mask.clone().unwrap_or_else(|| q.clone());
                let grads = backward(&shape, &q, &k, &v, &mask, (out, &stats), &g, need)?;
                Ok(grads.into_iter().collect())
            }
        }))
    }
}
