//! Batched matrix multiply with NumPy-style batch broadcasting. Inputs are read through their
//! strides, so `x.matmul(&w.t()?)` reads `w` transposed without a copy.

use crate::autograd::{record, NoGradGuard};
use crate::device::{Kernel, KernelFlavor};
use crate::error::{Error, Result};
use crate::ops::binary::sum_to_shape;
use crate::ops::{dispatch, module_source};
use crate::tensor::layout::{broadcast_shapes, merge_dims};
use crate::tensor::{DType, Tensor};

const MATMUL_WGSL: &str = include_str!("../../shaders/matmul.wgsl");

/// The marks around the part of matmul.wgsl that needs subgroup operations.
const SUBGROUP_BEGIN: &str = "// SUBGROUP SECTION BEGIN";
const SUBGROUP_END: &str = "// SUBGROUP SECTION END";

/// How `register_tiled` reads A: a vec4 along k, a vec4 along m, or element by element.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum AMode {
    K,
    M,
    Any,
}

/// How `register_tiled` reads B: a vec4 along n, a vec4 along k, or element by element.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum BMode {
    N,
    K,
    Any,
}

/// What a matmul kernel is specialised on (see shaders/matmul.wgsl): how A and B are read,
/// whether 8-wide subgroups share the A loads (vec4 modes of A only), and two facts about the
/// shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Specialisation {
    a: AMode,
    b: BMode,
    share_a: bool,
    /// N is a multiple of 4.
    n_aligned: bool,
    /// K is not a multiple of 4.
    k_tail: bool,
}

/// The module for one specialisation.
fn source(spec: Specialisation) -> String {
    let Specialisation {
        a,
        b,
        share_a,
        n_aligned,
        k_tail,
    } = spec;
    let a_mode = match a {
        AMode::K => "k",
        AMode::M => "m",
        AMode::Any => "any",
    };
    let (b_mode, aligned_cols) = match b {
        BMode::N => ("n", "true"),
        BMode::K => ("k", "false"),
        BMode::Any => ("any", "false"),
    };
    // The subgroup section (the shared A loads and the kernels that need them) is kept only
    // where the device has subgroups; wgpu enables their built-ins with the device feature (its
    // WGSL front end does not take `enable subgroups;` yet).
    let (wgsl, lane_param, lane, a_pair, exit_column) = if share_a {
        let exit = "t.col0 + (lid - lid % 8u) * 8u";
        (
            MATMUL_WGSL.to_string(),
            ", @builtin(subgroup_invocation_id) sg_lane: u32",
            "sg_lane",
            "a_pair_subgroup",
            exit,
        )
    } else {
        let begin = MATMUL_WGSL.find(SUBGROUP_BEGIN).expect("marked section");
        let end = MATMUL_WGSL.find(SUBGROUP_END).expect("marked section") + SUBGROUP_END.len();
        let without = format!("{}{}", &MATMUL_WGSL[..begin], &MATMUL_WGSL[end..]);
        (without, "", "0u", "a_pair_direct", "col_lo")
    };
    module_source(
        &wgsl,
        &[
            ("SUBGROUP_LANE_PARAM", lane_param),
            ("EXIT_COLUMN", exit_column),
            ("A_PAIR", a_pair),
            ("LANE", lane),
            ("A_MODE", a_mode),
            ("B_MODE", b_mode),
            ("B_ALIGNED_COLS", aligned_cols),
            ("N_ALIGNED", if n_aligned { "true" } else { "false" }),
            ("K_TAIL", if k_tail { "true" } else { "false" }),
        ],
    )
}

#[cfg(test)]
pub(crate) fn kernel_sources() -> Vec<(String, String)> {
    let mut all = Vec::new();
    for a in [AMode::K, AMode::M, AMode::Any] {
        for b in [BMode::N, BMode::K, BMode::Any] {
            for share_a in [false, true] {
                if share_a && a == AMode::Any {
                    continue;
                }
                for (n_aligned, k_tail) in [(true, false), (false, true)] {
                    let spec = Specialisation {
                        a,
                        b,
                        share_a,
                        n_aligned,
                        k_tail,
                    };
                    all.push((format!("matmul/{spec:?}"), source(spec)));
                }
            }
        }
    }
    all
}

/// The operand layout as (offset, batch stride, row stride, col stride), in elements.
struct Strides {
    offset: usize,
    batch: usize,
    rows: usize,
    cols: usize,
}

impl Strides {
    /// True when the offset, the batch stride and `between` (the stride from one 4-element
    /// group to the next) are multiples of 4, so every group starts on a vec4 boundary.
    fn aligned(&self, between: usize) -> bool {
        self.offset.is_multiple_of(4) && self.batch.is_multiple_of(4) && between.is_multiple_of(4)
    }
}

/// The widest reads of A that its layout allows.
fn a_mode(a: &Strides, m: usize) -> AMode {
    if a.cols == 1 && a.aligned(a.rows) {
        AMode::K
    } else if a.rows == 1 && a.aligned(a.cols) && m.is_multiple_of(8) {
        AMode::M
    } else {
        AMode::Any
    }
}

/// The widest reads of B that its layout allows.
fn b_mode(b: &Strides, n: usize) -> BMode {
    if b.cols == 1 && b.aligned(b.rows) && n.is_multiple_of(4) {
        BMode::N
    } else if b.rows == 1 && b.aligned(b.cols) {
        BMode::K
    } else {
        BMode::Any
    }
}

/// The device's matmul kernel: entry point and output tile (rows, columns).
fn kernel_for(t: &Tensor) -> (&'static str, usize, usize) {
    match t.device().kernel_flavor() {
        KernelFlavor::Cpu => ("register_tiled", 8, 256),
        KernelFlavor::Gpu => ("shared_tiled", 64, 64),
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

/// The operands of a matmul as matrices: a 1-D left operand as a row, a 1-D right one as a
/// column (views).
fn promote(a: &Tensor, b: &Tensor) -> Result<(Tensor, Tensor)> {
    let a = if a.rank() == 1 {
        a.unsqueeze(0)?
    } else {
        a.clone()
    };
    let b = if b.rank() == 1 {
        b.unsqueeze(1)?
    } else {
        b.clone()
    };
    Ok((a, b))
}

/// True when `t`'s matrices are stored column by column (a transposed view of a dense one).
fn column_major(t: &Tensor) -> bool {
    let s = &t.layout().strides;
    let r = s.len();
    s[r - 2] == 1 && s[r - 1] != 1
}

/// The last two dims of `t` swapped (a view).
fn transposed(t: &Tensor) -> Result<Tensor> {
    t.transpose(t.rank() - 2, t.rank() - 1)
}

impl Tensor {
    /// Matrix product with PyTorch's `matmul` rules: 1-D operands are promoted to a row
    /// (left) or column (right) and the added dim removed; leading dims broadcast.
    ///
    /// Backward: `grad_a = grad @ b^T` and `grad_b = a^T @ grad`, with the transposes read as
    /// views, summed over broadcast batch dims.
    pub fn matmul(&self, other: &Tensor) -> Result<Tensor> {
        let out = {
            let _no_grad = NoGradGuard::new();
            matmul_forward(self, other)?
        };
        Ok(record("matmul", out, &[self, other], |out| {
            let (a, b) = (self.detach(), other.detach());
            let (need_a, need_b) = (self.requires_grad(), other.requires_grad());
            let out_shape = out.shape().to_vec();
            move |g: &Tensor| {
                let (a2, b2) = promote(&a, &b)?;
                let batch = &out_shape[..out_shape.len().saturating_sub(2)];
                let (m, n) = (a2.shape()[a2.rank() - 2], b2.shape()[b2.rank() - 1]);
                let g2 = if a.rank() == 1 || b.rank() == 1 {
                    g.reshape(&[batch, &[m, n]].concat())?
                } else {
                    g.clone()
                };
                // Each grad is computed in its input's own layout (a grad for a transposed view,
                // such as the weight of `x W^T`, as the product's transpose), so that the grad
                // the leaf finally receives is dense and needs no strided copy.
                let grad_a = match need_a {
                    true => {
                        let grad = if column_major(&a2) {
                            transposed(&b2.matmul(&transposed(&g2)?)?)?
                        } else {
                            g2.matmul(&transposed(&b2)?)?
                        };
                        Some(sum_to_shape(&grad, a2.shape())?.reshape(a.shape())?)
                    }
                    false => None,
                };
                let grad_b = match need_b {
                    true => {
                        let grad = if column_major(&b2) {
                            transposed(&transposed(&g2)?.matmul(&a2)?)?
                        } else {
                            transposed(&a2)?.matmul(&g2)?
                        };
                        Some(sum_to_shape(&grad, b2.shape())?.reshape(b.shape())?)
                    }
                    false => None,
                };
                Ok(vec![grad_a, grad_b])
            }
        }))
    }
}

/// The product itself: shape rules, the batch layout, and one kernel dispatch.
fn matmul_forward(this: &Tensor, other: &Tensor) -> Result<Tensor> {
    const OP: &str = "matmul";
    this.expect_same_device(OP, other)?;
    this.expect_dtype(OP, DType::F32)?;
    other.expect_dtype(OP, DType::F32)?;
    if this.rank() == 0 || other.rank() == 0 {
        return Err(Error::Shape {
            op: OP,
            msg: format!(
                "needs operands of rank >= 1, got {:?} and {:?}",
                this.shape(),
                other.shape()
            ),
        });
    }
    let (a, b) = promote(this, other)?;
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
                    this.shape(),
                    other.shape()
                ),
            })
        }
    };
    // A narrow product wastes most of register_tiled's 256-column tiles: compute
    // out^T = b^T a^T instead, which lays the long side along the tiles' columns, and return
    // its transpose (a view).
    if this.device().kernel_flavor() == KernelFlavor::Cpu && n < 64 && m > n {
        let out_t = matmul_forward(&transposed(&b)?, &transposed(&a)?)?;
        let mut out_shape = [batch.as_slice(), &[m, n]].concat();
        return finish(transposed(&out_t)?, this, other, &mut out_shape);
    }
    let a = a.expand(&[batch.as_slice(), &[m, k]].concat())?;
    let b = b.expand(&[batch.as_slice(), &[k, n]].concat())?;
    // Batch dims that do not merge into one stride are made dense.
    let (a, a_batch_stride) = with_batch_stride(a)?;
    let (b, b_batch_stride) = with_batch_stride(b)?;
    let batches: usize = batch.iter().product();
    let mut out_shape = [batch.as_slice(), &[m, n]].concat();
    if k == 0 {
        let zeros = Tensor::zeros(&out_shape, this.device())?;
        return finish(zeros, this, other, &mut out_shape);
    }
    let out = Tensor::empty(OP, &out_shape, DType::F32, this.device())?;
    if out.numel() > 0 {
        let (mut entry, mut tile_rows, mut tile_cols) = kernel_for(this);
        let r = a.rank();
        let strides = |t: &Tensor, batch: u32| Strides {
            offset: t.layout().offset,
            batch: batch as usize,
            rows: t.layout().strides[r - 2],
            cols: t.layout().strides[r - 1],
        };
        let (sa, sb) = (strides(&a, a_batch_stride), strides(&b, b_batch_stride));
        let (am, bm) = match entry {
            "register_tiled" => (a_mode(&sa, m), b_mode(&sb, n)),
            _ => (AMode::Any, BMode::Any),
        };
        // On 8-wide subgroups (llvmpipe's SIMD groups) the shared A blocks are loaded once per
        // subgroup instead of once per invocation.
        let share_a = entry == "register_tiled"
            && am != AMode::Any
            && this.device().subgroup_size() == Some(8);
        // With A shared, 16 rows x 4 columns per invocation need a third fewer loads per
        // multiply-add than 8 x 8 (loads are what a software adapter pays for).
        if share_a {
            (entry, tile_rows, tile_cols) = ("register_tiled_tall", 16, 128);
        }
        let (tiles_m, tiles_n) = (m.div_ceil(tile_rows), n.div_ceil(tile_cols));
        let params = [
            m, n, k, batches, sa.offset, sa.batch, sa.rows, sa.cols, sb.offset, sb.batch, sb.rows,
            sb.cols, tiles_n, tiles_m,
        ]
        .map(|x| x as u32);
        let spec = Specialisation {
            a: am,
            b: bm,
            share_a,
            n_aligned: n.is_multiple_of(4),
            k_tail: !k.is_multiple_of(4),
        };
        let key = format!("matmul/{spec:?}:{entry}");
        let kernel = Kernel {
            key: &key,
            entry,
            source: &|| source(spec),
        };
        let workgroups = batches * tiles_m * tiles_n;
        dispatch(OP, &kernel, &[&a, &b, &out], &params, workgroups as u32)?;
    }
    finish(out, this, other, &mut out_shape)
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
