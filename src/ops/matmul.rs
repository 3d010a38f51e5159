//! Batched matrix multiply with NumPy-style batch broadcasting. Inputs are read through their
//! strides, so `x.matmul(&w.t()?)` reads `w` transposed without a copy.

use crate::device::{Device, KernelFlavor};
use crate::error::{Error, Result};
use crate::kernel::{
    rows_per_window, with_subgroup_section, EpilogueSite, Fusion, Kernel, KernelParams, Launch,
    ShaderFamily, MAX_LOOP_LEN, SIXTEEN_BIT_WGSL,
};
use crate::ops::binary::sum_to_shape;
use crate::ops::cast;
use crate::ops::sum_over_chunks;
use crate::tensor::grad_mode::NoGradGuard;
use crate::tensor::graph::record;
use crate::tensor::layout::{broadcast_shapes, merge_dims};
use crate::tensor::{DType, Tensor};

crate::kernel_params! {
    /// `batches` products of `[m, k] x [k, n]`, each operand read at its offset and strides
    /// (in elements); the output tiles are `row_tiles x col_tiles` per batch. The `conv_`
    /// fields describe B where it is a convolution's implicit column matrix ([`ImageColumns`];
    /// 0 otherwise).
    pub(crate) struct MatmulParams {
        m: u32,
        n: u32,
        k: u32,
        batches: u32,
        a_offset: u32,
        a_batch_stride: u32,
        a_row_stride: u32,
        a_col_stride: u32,
        b_offset: u32,
        b_batch_stride: u32,
        b_row_stride: u32,
        b_col_stride: u32,
        col_tiles: u32,
        row_tiles: u32,
        conv_c_in: u32,
        conv_height: u32,
        conv_width: u32,
        conv_kernel_w: u32,
        conv_out_w: u32,
        conv_pixels: u32,
        conv_stride_h: u32,
        conv_stride_w: u32,
        conv_padding_h: u32,
        conv_padding_w: u32,
        conv_dilation_h: u32,
        conv_dilation_w: u32,
        conv_k: u32,
    }
}

static MATMUL: ShaderFamily = ShaderFamily {
    name: "matmul",
    wgsl: include_str!("../../shaders/matmul.wgsl"),
    params: &[&MatmulParams::LAYOUT],
    preludes: &[SIXTEEN_BIT_WGSL],
};

/// How the register kernels read A: a vec4 along k, a vec4 along m, or element by element.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum AMode {
    K,
    M,
    Any,
}

/// How the register kernels read B: a vec4 along n, a vec4 along k, or element by element.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum BMode {
    N,
    K,
    Any,
}

/// What the kernels multiply A by: a matrix read in its `BMode`, the column matrix of a
/// convolution read from the images ([`conv_product`]), or its transpose
/// ([`conv_weight_product`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum BSource {
    Matrix,
    Image,
    ImageT,
}

/// What a matmul kernel is specialised on (see shaders/matmul.wgsl): how A and B are read,
/// whether the module keeps the subgroup sections (`register_tiled_tall` and the block
/// kernels' shared A reads, for 8-wide subgroups), the block kernels' panel depth, and two
/// facts about the shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Specialisation {
    a: AMode,
    b: BMode,
    b_source: BSource,
    subgroups: bool,
    /// Output rows per invocation of `register_tiled_tall` (16 or 32).
    tall_rows: usize,
    /// Rows of k per panel of the block kernels (see [`block_k`]); 8 in modules that never
    /// run them.
    block_k: usize,
    /// The module's last step of 4 along k may be partial, its elements past K masked (K not
    /// a multiple of 4, or A read element by element: see [`with_k_tail`]).
    k_tail: bool,
    /// The dtypes of A, B and the output (F32, F16 or BF16; a 16-bit output needs N a
    /// multiple of 4).
    a_dtype: DType,
    b_dtype: DType,
    out_dtype: DType,
}

/// The module for one specialisation.
fn source(spec: Specialisation) -> String {
    let a_mode = match spec.a {
        AMode::K => "k",
        AMode::M => "m",
        AMode::Any => "any",
    };
    let (b_mode, aligned_cols) = match spec.b {
        BMode::N => ("n", "true"),
        BMode::K => ("k", "false"),
        BMode::Any => ("any", "false"),
    };
    let wgsl = with_stores(MATMUL.wgsl, spec.out_dtype);
    let out_words = match spec.out_dtype {
        DType::F32 => "vec4<f32>",
        _ => "vec4<u32>",
    };
    let b_source = match spec.b_source {
        BSource::Matrix => "matrix",
        BSource::Image => "image",
        BSource::ImageT => "image_t",
    };
    let flag = |on: bool| if on { "true" } else { "false" };
    let source = MATMUL.source_of(
        &wgsl,
        &[
            ("A_MODE", a_mode),
            ("B_MODE", b_mode),
            ("B_SOURCE", b_source),
            ("B_ALIGNED_COLS", aligned_cols),
            ("K_TAIL", flag(spec.k_tail)),
            ("TALL_ROWS", &spec.tall_rows.to_string()),
            ("BLOCK_K_ROWS", &spec.block_k.to_string()),
            ("A_DTYPE_CODE", spec.a_dtype.wgsl_code()),
            ("B_DTYPE_CODE", spec.b_dtype.wgsl_code()),
            ("OUT_DTYPE_CODE", spec.out_dtype.wgsl_code()),
            ("OUT_WORDS", out_words),
        ],
    );
    with_subgroup_section(&source, spec.subgroups)
}

/// `wgsl` with the stores of an `out` of `dtype`: the EPILOGUE SECTION's F32 stores (which a
/// captured step's fuser may replace), or the 16-BIT STORES in their place; the 16-BIT STORES
/// section itself is cut out either way.
fn with_stores(wgsl: &str, dtype: DType) -> String {
    const EPILOGUE: [&str; 2] = ["// EPILOGUE SECTION BEGIN", "// EPILOGUE SECTION END"];
    const SIXTEEN: [&str; 2] = ["// 16-BIT STORES BEGIN", "// 16-BIT STORES END"];
    let span = |[begin, end]: [&str; 2]| {
        let b = wgsl.find(begin).expect("matmul.wgsl has the section");
        let e = wgsl.find(end).expect("matmul.wgsl has the section") + end.len();
        b..e
    };
    let (epilogue, sixteen) = (span(EPILOGUE), span(SIXTEEN));
    debug_assert!(epilogue.end < sixteen.start);
    let stores = match dtype {
        DType::F32 => &wgsl[epilogue.clone()],
        _ => &wgsl[sixteen.clone()],
    };
    format!(
        "{}{stores}{}{}",
        &wgsl[..epilogue.start],
        &wgsl[epilogue.end..sixteen.start],
        &wgsl[sixteen.end..]
    )
}

#[cfg(test)]
pub(crate) fn kernel_sources() -> Vec<(String, String)> {
    let mut all = Vec::new();
    for a in [AMode::K, AMode::M, AMode::Any] {
        for b in [BMode::N, BMode::K, BMode::Any] {
            for (subgroups, tall_rows) in [(false, 32), (true, 16), (true, 32)] {
                for k_tail in [false, true] {
                    let spec = Specialisation {
                        a,
                        b,
                        b_source: BSource::Matrix,
                        subgroups,
                        tall_rows,
                        block_k: if subgroups { 16 } else { 8 },
                        k_tail,
                        a_dtype: DType::F32,
                        b_dtype: DType::F32,
                        out_dtype: DType::F32,
                    };
                    all.push((format!("matmul/{spec:?}"), source(spec)));
                }
            }
        }
    }
    for source_of_b in [BSource::Image, BSource::ImageT] {
        for (tall_rows, subgroups) in [(16, true), (32, true), (32, false)] {
            let spec = image_specialisation(source_of_b, AMode::K, tall_rows, subgroups);
            all.push((format!("matmul/{spec:?}"), source(spec)));
        }
    }
    for (a_dtype, b_dtype, out_dtype) in [
        (DType::F16, DType::BF16, DType::F32),
        (DType::BF16, DType::F32, DType::F32),
        (DType::F16, DType::F16, DType::F16),
        (DType::BF16, DType::BF16, DType::BF16),
    ] {
        for subgroups in [false, true] {
            let spec = Specialisation {
                a_dtype,
                b_dtype,
                out_dtype,
                subgroups,
                ..SMALL_SPECIALISATION
            };
            all.push((format!("matmul/{spec:?}"), source(spec)));
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

/// The widest reads of A that its layout allows. Reads along m take whole groups of 4 rows:
/// `register_tiled_tall` clamps each lane's group to the last whole one, so M a multiple of 4
/// will do (an 84-character vocabulary's head); `register_tiled` reads rows 4 to 8 of its
/// tile's 8 at once, so it needs a multiple of 8.
fn a_mode(a: &Strides, m: usize, tall: bool) -> AMode {
    let whole_groups = if tall { 4 } else { 8 };
    if a.cols == 1 && a.aligned(a.rows) {
        AMode::K
    } else if a.rows == 1 && a.aligned(a.cols) && m.is_multiple_of(whole_groups) {
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

/// A matmul kernel: its entry point, the output tile one workgroup computes, and the module's
/// specialisation (the shape facts still to fill in).
struct KernelChoice {
    entry: &'static str,
    tile_rows: usize,
    tile_cols: usize,
    /// Output tiles per workgroup: one, or one per invocation (`small_tiled`).
    tiles_per_workgroup: usize,
    spec: Specialisation,
}

/// The kernel for this device, these operand layouts and an `m x n` product. GPUs stage
/// panels in workgroup memory and keep 8 x 8 outputs per invocation: 128 x 128 tiles where
/// the product fills them, 64 x 64 where it fills those. A product with a side under 64, or a
/// device without the 16 KiB of workgroup storage the panels take, keeps 8 x 8 per invocation
/// with no workgroup memory (`register_tiled`): a 64 x 64 tile over a first convolution's 9
/// taps or a 10-class head would sit mostly idle (that convolution ran 10x faster so, forward
/// and backward, with the GPU flavour forced on lavapipe).
/// Software adapters keep the outputs in registers and pay per load: where subgroups are 8
/// wide (one SIMD group), the A loads are shared across the subgroup and
/// each invocation keeps 32 x 4 outputs (a quarter of the loads per multiply-add of 8 x 8), or
/// 16 x 4 where the product has at most 16 rows (a 32-row tile would compute twice the rows it
/// keeps); otherwise each invocation loads its own A and keeps 8 x 8.
fn kernel_for(device: &Device, a: AMode, b: BMode, (m, n): (usize, usize)) -> KernelChoice {
    let spec = |a, b, subgroups, tall_rows| Specialisation {
        a,
        b,
        b_source: BSource::Matrix,
        subgroups,
        tall_rows,
        block_k: 8,
        k_tail: false,
        a_dtype: DType::F32,
        b_dtype: DType::F32,
        out_dtype: DType::F32,
    };
    let block = |entry, side| KernelChoice {
        entry,
        tile_rows: side,
        tile_cols: side,
        tiles_per_workgroup: 1,
        spec: block_specialisation(device, spec(AMode::Any, BMode::Any, false, 32)),
    };
    let blocks = fits_block_tiles(device);
    match device.kernel_flavor() {
        KernelFlavor::Gpu if blocks && m.min(n) >= BLOCK => block("block_tiled", BLOCK),
        KernelFlavor::Gpu if blocks && m.min(n) >= BLOCK / 2 => block("block_tiled_64", BLOCK / 2),
        KernelFlavor::Cpu if runs_tall(device) => {
            let tall_rows = if m <= 16 { 16 } else { 32 };
            KernelChoice {
                entry: "register_tiled_tall",
                tile_rows: tall_rows,
                tile_cols: 128,
                tiles_per_workgroup: 1,
                spec: spec(a, b, true, tall_rows),
            }
        }
        _ => KernelChoice {
            entry: "register_tiled",
            tile_rows: 8,
            tile_cols: 256,
            tiles_per_workgroup: 1,
            spec: spec(a, b, false, 32),
        },
    }
}

/// `spec` for a product over `k`: with the masked partial last step where K needs it, and
/// always where A is read element by element. That layout comes from an odd dim (a vocabulary
/// of 65, 10 classes), whose products need the tail in one direction and not in the other (a
/// head's input grad sums over the vocabulary, its weight grad over the batch); one module
/// serves both, where two cost a model's first step 0.45 s more on lavapipe. The masks cost a
/// product without a partial step a few selects per step of 4.
fn with_k_tail(spec: Specialisation, k: usize) -> Specialisation {
    Specialisation {
        k_tail: !k.is_multiple_of(4) || spec.a == AMode::Any,
        ..spec
    }
}

/// The output tile of `block_tiled` (the GPU kernel for products of at least this many rows
/// and columns).
const BLOCK: usize = 128;

/// Workgroup storage the block kernels' panels take at 8 rows of k: two buffers each of A's
/// and B's 8 x 128 f32.
const PANEL_BYTES_AT_8: u32 = 2 * 2 * 8 * 128 * 4;

/// Whether the device runs the block kernels' workgroups: up to 256 invocations and the
/// panels at 8 rows of k (16 KiB, WebGPU's defaults; an adapter may offer less).
fn fits_block_tiles(device: &Device) -> bool {
    let limits = &device.inner.limits;
    limits.max_compute_workgroup_storage_size >= PANEL_BYTES_AT_8
        && limits.max_compute_invocations_per_workgroup >= 256
        && limits.max_compute_workgroup_size_x >= 256
}

/// Rows of k per block-kernel panel for a device with `workgroup_storage` bytes: 16 where
/// it holds them (32 KiB: GPUs offer 32 to 64, llvmpipe 32), else 8. Each step of the
/// product ends in a barrier, so deeper panels halve the barriers per k (the 70 %-of-peak
/// WGSL GEMMs stage 16 rows too).
fn block_k(workgroup_storage: u32) -> usize {
    if workgroup_storage >= 2 * PANEL_BYTES_AT_8 {
        16
    } else {
        8
    }
}

/// `spec` made a block kernel's on `device`: its panel depth, and the subgroup sections
/// where subgroups are 8 wide (each subgroup's lanes then share their A panel reads).
fn block_specialisation(device: &Device, spec: Specialisation) -> Specialisation {
    Specialisation {
        block_k: block_k(device.inner.limits.max_compute_workgroup_storage_size),
        subgroups: device.subgroup_size() == Some(8),
        ..spec
    }
}

/// Products below both of these (a dim, and multiply-adds) run `small_tiled` on software
/// adapters. A dim under 16 is what makes a layout the register kernels read element by
/// element or with a tail (a 10-class head's weight, its grad, a product over 10 classes),
/// and each such layout is one more specialisation to compile in a model's first step (0.2 to
/// 0.45 s each on lavapipe). `small_tiled` reads any layout from one module but pays a load
/// per element: up to 256K multiply-adds that costs a fraction of a millisecond per product
/// (the CNN's head at batch 64: 0.1 to 0.25 ms against 0.08 to 0.12), and past it the register
/// kernels' vec4 loads win back a specialisation's compile within a few hundred steps (an
/// MLP's 10-class head at batch 128: 0.6 to 1.2 ms against 0.2 to 0.45 per product). Large
/// products with a short dim (a first convolution's 9 taps against a batch of images) keep
/// the register kernels too.
const SMALL_DIM: usize = 16;
const SMALL_MULTIPLY_ADDS: usize = 1 << 18;

/// True when the product runs `small_tiled` (see [`SMALL_DIM`]).
fn is_small_product(device: &Device, batches: usize, m: usize, n: usize, k: usize) -> bool {
    device.kernel_flavor() == KernelFlavor::Cpu
        && m.min(n).min(k) < SMALL_DIM
        && batches
            .saturating_mul(m)
            .saturating_mul(n)
            .saturating_mul(k)
            <= SMALL_MULTIPLY_ADDS
}

/// `small_tiled`: 8x8 outputs per invocation, in one module for every layout and shape.
fn small_kernel() -> KernelChoice {
    KernelChoice {
        entry: "small_tiled",
        tile_rows: 8,
        tile_cols: 8,
        tiles_per_workgroup: 16, // its @workgroup_size
        spec: SMALL_SPECIALISATION,
    }
}

/// The one module `small_tiled` runs from (it reads element by element, stores element by
/// element at a ragged edge, and needs no subgroups).
const SMALL_SPECIALISATION: Specialisation = Specialisation {
    a: AMode::Any,
    b: BMode::Any,
    b_source: BSource::Matrix,
    subgroups: false,
    tall_rows: 32,
    block_k: 8,
    k_tail: true,
    a_dtype: DType::F32,
    b_dtype: DType::F32,
    out_dtype: DType::F32,
};

/// True when products (not small ones) run `register_tiled_tall`: software adapters with
/// 8-wide subgroups.
fn runs_tall(device: &Device) -> bool {
    device.kernel_flavor() == KernelFlavor::Cpu && device.subgroup_size() == Some(8)
}

/// Batch stride of a tensor whose batch dims (all but the last two) merge into one.
fn batch_stride(t: &Tensor) -> Option<u32> {
    let rank = t.rank();
    if t.numel() == 0 {
        // Nothing to visit (an empty batch or an empty matrix), whatever the strides say.
        return Some(0);
    }
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
    let stride = batch_stride(&dense).ok_or_else(|| Error::Shape {
        op: "matmul",
        msg: format!("batch dims of shape {:?} do not merge", t.shape()),
    })?;
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

/// For `a` of rank > 2 times a matrix `b`, the number of rows of `a` stacked into one matrix,
/// when its layout allows that as a view (no copy).
fn stacked_rows(a: &Tensor, b: &Tensor) -> Option<usize> {
    if a.rank() <= 2 || b.rank() != 2 {
        return None;
    }
    let k = a.shape()[a.rank() - 1];
    let rows = a.numel().checked_div(k)?;
    a.layout().reshape_view(&[rows, k]).map(|_| rows)
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
        if crate::ops::autocast::active_dtype().is_some() {
            let a = crate::ops::autocast::for_16_bit_op(self)?;
            let b = crate::ops::autocast::for_16_bit_op(other)?;
            if !Tensor::same(&a, self) || !Tensor::same(&b, other) {
                return a.matmul(&b);
            }
        }
        if let Some(rows) = stacked_rows(self, other) {
            // A batch of matrices times one matrix is one product of the stacked rows (as
            // `x W^T` in a Linear over [B, T, C]): one large GEMM forward and backward, and
            // the weight's grad without a batched product and a sum over the batch.
            let k = self.shape()[self.rank() - 1];
            let mut out_shape = self.shape().to_vec();
            *out_shape.last_mut().expect("rank > 2") = other.shape()[1];
            return self.reshape(&[rows, k])?.matmul(other)?.reshape(&out_shape);
        }
        let out = {
            let _no_grad = NoGradGuard::new();
            matmul_forward(self, other)?
        };
        Ok(record("matmul", out, &[self, other], |_| {
            let (a, b) = (self.detach(), other.detach());
            let (need_a, need_b) = (self.requires_grad(), other.requires_grad());
            move |g: &Tensor| {
                let (a2, b2) = promote(&a, &b)?;
                // The product's batch dims, from the promoted operands: the output's shape has
                // lost the dims of 1-D operands.
                let batch =
                    broadcast_shapes(&a2.shape()[..a2.rank() - 2], &b2.shape()[..b2.rank() - 2])
                        .unwrap_or_default();
                let batch = batch.as_slice();
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

/// Most steps of k one product runs in one kernel, on every kernel.
const K_CHUNK: usize = MAX_LOOP_LEN;

/// The product in the operands' dtype. 16-bit operands are read as they are (the kernels
/// convert each element to f32 as they load it), the product accumulates in f32, and the F32
/// result is rounded once into their dtype (F32 for two float dtypes under autocast).
fn matmul_forward(this: &Tensor, other: &Tensor) -> Result<Tensor> {
    const OP: &str = "matmul";
    let Some(dtype) = cast::result_dtype(OP, &[this, other])? else {
        return product(this, other, DType::F32);
    };
    if this.exceeds_binding() || other.exceeds_binding() {
        // Windows of a tensor past one binding are read as F32 copies.
        let (dtype, wide) = cast::widened(OP, &[this, other])?.expect("a 16-bit operand");
        return cast::narrowed(product(&wide[0], &wide[1], DType::F32)?, dtype);
    }
    cast::narrowed(product(this, other, dtype)?, dtype)
}

/// The product of operands of any float dtypes: shape rules, the batch layout, and one
/// kernel dispatch. It is stored in `out_dtype` where the kernel can store that dtype (a
/// 16-bit product of whole groups of four columns), else in F32.
fn product(this: &Tensor, other: &Tensor, out_dtype: DType) -> Result<Tensor> {
    const OP: &str = "matmul";
    this.expect_same_device(OP, other)?;
    for t in [this, other] {
        if !t.dtype().is_float() {
            t.expect_dtype(OP, DType::F32)?;
        }
    }
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
    if a.exceeds_binding() || b.exceeds_binding() {
        let out = matmul_windows(&a, &b)?;
        let mut out_shape = out.shape().to_vec();
        return finish(out, this, other, &mut out_shape);
    }
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
    let batches: usize = batch.iter().product();
    let small = is_small_product(this.device(), batches, m, n, k);
    // A narrow product wastes most of the register kernels' 128- or 256-column tiles: compute
    // out^T = b^T a^T instead, which lays the long side along the tiles' columns, and return
    // its transpose (a view).
    if this.device().kernel_flavor() == KernelFlavor::Cpu && !small && n < 64 && m > n {
        let out_t = product(&transposed(&b)?, &transposed(&a)?, out_dtype)?;
        let mut out_shape = [batch.as_slice(), &[m, n]].concat();
        return finish(transposed(&out_t)?, this, other, &mut out_shape);
    }
    let a = a.expand(&[batch.as_slice(), &[m, k]].concat())?;
    let b = b.expand(&[batch.as_slice(), &[k, n]].concat())?;
    let out_len: usize = batch.iter().product::<usize>() * m * n;
    if (out_len * 4) as u64 > this.device().max_binding_bytes() {
        let out = product_in_runs(&a, &b)?;
        let mut out_shape = out.shape().to_vec();
        return finish(out, this, other, &mut out_shape);
    }
    // Batch dims that do not merge into one stride are made dense.
    let (a, a_batch_stride) = with_batch_stride(a)?;
    let (b, b_batch_stride) = with_batch_stride(b)?;
    let mut out_shape = [batch.as_slice(), &[m, n]].concat();
    if k == 0 {
        let zeros = Tensor::zeros(&out_shape, this.device())?;
        return finish(zeros, this, other, &mut out_shape);
    }
    if k > K_CHUNK {
        // Long products are summed over chunks of k: no kernel loops past llvmpipe's 65,535
        // iterations per invocation.
        let part = |start, len| {
            let a_part = a.narrow(a.rank() - 1, start, len)?;
            let b_part = b.narrow(b.rank() - 2, start, len)?;
            product(&a_part, &b_part, DType::F32)
        };
        let sum = sum_over_chunks(k, K_CHUNK, part)?.expect("k > K_CHUNK gives chunks");
        return finish(sum, this, other, &mut out_shape);
    }
    // A 16-bit product is stored as it is where every store is a whole group of four.
    let direct = out_dtype.is_16_bit() && !small && n.is_multiple_of(4);
    let stored = if direct { out_dtype } else { DType::F32 };
    let out = Tensor::empty(OP, &out_shape, stored, this.device())?;
    if out.numel() > 0 {
        let r = a.rank();
        let strides = |t: &Tensor, batch: u32| Strides {
            offset: t.layout().offset,
            batch: batch as usize,
            rows: t.layout().strides[r - 2],
            cols: t.layout().strides[r - 1],
        };
        let (sa, sb) = (strides(&a, a_batch_stride), strides(&b, b_batch_stride));
        let choice = if small {
            small_kernel()
        } else {
            let tall = runs_tall(this.device());
            kernel_for(this.device(), a_mode(&sa, m, tall), b_mode(&sb, n), (m, n))
        };
        let (tiles_m, tiles_n) = (m.div_ceil(choice.tile_rows), n.div_ceil(choice.tile_cols));
        let params = MatmulParams {
            m: m as u32,
            n: n as u32,
            k: k as u32,
            batches: batches as u32,
            a_offset: sa.offset as u32,
            a_batch_stride: sa.batch as u32,
            a_row_stride: sa.rows as u32,
            a_col_stride: sa.cols as u32,
            b_offset: sb.offset as u32,
            b_batch_stride: sb.batch as u32,
            b_row_stride: sb.rows as u32,
            b_col_stride: sb.cols as u32,
            col_tiles: tiles_n as u32,
            row_tiles: tiles_m as u32,
            ..MatmulParams::default()
        };
        let spec = match small {
            true => choice.spec,
            false => with_k_tail(choice.spec, k),
        };
        let spec = Specialisation {
            a_dtype: a.dtype(),
            b_dtype: b.dtype(),
            out_dtype: stored,
            ..spec
        };
        let workgroups = (batches * tiles_m * tiles_n).div_ceil(choice.tiles_per_workgroup);
        launch_product(OP, choice.entry, spec, &params, [&a, &b, &out], workgroups)?;
    }
    finish(out, this, other, &mut out_shape)
}

/// The sizes of a convolution's column matrix: images `[count, c_in, height, width]` read
/// with `kernel_h x kernel_w` taps into `out_h x out_w` pixels. [`conv_product`] reads it as
/// its B operand straight from the images, channels innermost along k (im2col in
/// `ops/conv.rs` writes it out with channels outermost).
#[derive(Debug, Clone, Copy)]
pub(crate) struct ImageColumns {
    pub c_in: usize,
    pub height: usize,
    pub width: usize,
    pub kernel_h: usize,
    pub kernel_w: usize,
    pub out_h: usize,
    pub out_w: usize,
    /// `(along H, along W)`, as the three below.
    pub stride: (usize, usize),
    pub padding: (usize, usize),
    pub dilation: (usize, usize),
}

impl ImageColumns {
    /// Output pixels per image: columns of the matrix per image.
    pub fn pixels(&self) -> usize {
        self.out_h * self.out_w
    }

    /// Rows of the column matrix: taps times channels.
    pub fn k(&self) -> usize {
        self.kernel_h * self.kernel_w * self.c_in
    }

    /// The params that place these columns in the images (the rest left at 0).
    fn params(&self) -> MatmulParams {
        MatmulParams {
            conv_c_in: self.c_in as u32,
            conv_height: self.height as u32,
            conv_width: self.width as u32,
            conv_kernel_w: self.kernel_w as u32,
            conv_out_w: self.out_w as u32,
            conv_pixels: self.pixels() as u32,
            conv_stride_h: self.stride.0 as u32,
            conv_stride_w: self.stride.1 as u32,
            conv_padding_h: self.padding.0 as u32,
            conv_padding_w: self.padding.1 as u32,
            conv_dilation_h: self.dilation.0 as u32,
            conv_dilation_w: self.dilation.1 as u32,
            conv_k: self.k() as u32,
            ..MatmulParams::default()
        }
    }
}

/// The kernel that reads a convolution's column matrix (or its transpose: `source`) from its
/// images, for `rows` rows of A over `n` output columns, and A's read mode `a`:
/// `register_tiled_tall` on 8-wide subgroups; on GPUs what [`kernel_for`] picks for a matrix
/// of that shape (the block kernels, or `register_tiled` for a side under 64); none on
/// software adapters without subgroups.
fn image_kernel(
    device: &Device,
    source: BSource,
    a: AMode,
    rows: usize,
    n: usize,
) -> Option<KernelChoice> {
    let choice = |entry, tile_rows, tile_cols, spec| KernelChoice {
        entry,
        tile_rows,
        tile_cols,
        tiles_per_workgroup: 1,
        spec,
    };
    let blocks = fits_block_tiles(device);
    match device.kernel_flavor() {
        KernelFlavor::Cpu if runs_tall(device) => {
            let tall_rows = if rows <= 16 { 16 } else { 32 };
            let spec = image_specialisation(source, a, tall_rows, true);
            Some(choice("register_tiled_tall", tall_rows, 128, spec))
        }
        KernelFlavor::Gpu if blocks && rows.min(n) >= BLOCK => {
            let spec = image_specialisation(source, AMode::Any, 32, false);
            let spec = block_specialisation(device, spec);
            Some(choice("block_tiled", BLOCK, BLOCK, spec))
        }
        KernelFlavor::Gpu if blocks && rows.min(n) >= BLOCK / 2 => {
            let spec = image_specialisation(source, AMode::Any, 32, false);
            let spec = block_specialisation(device, spec);
            Some(choice("block_tiled_64", BLOCK / 2, BLOCK / 2, spec))
        }
        KernelFlavor::Gpu => {
            let spec = image_specialisation(source, a, 32, false);
            Some(choice("register_tiled", 8, 256, spec))
        }
        KernelFlavor::Cpu => None,
    }
}

/// The module of a kernel over image columns (`source`): `register_tiled_tall` (with
/// `subgroups`), `register_tiled` or the block kernels.
fn image_specialisation(
    source: BSource,
    a: AMode,
    tall_rows: usize,
    subgroups: bool,
) -> Specialisation {
    Specialisation {
        a,
        b: BMode::Any,
        b_source: source,
        subgroups,
        tall_rows,
        block_k: 8,
        k_tail: false,
        a_dtype: DType::F32,
        b_dtype: DType::F32,
        out_dtype: DType::F32,
    }
}

/// True when [`conv_product`] can run a weight of `c_out` rows over `images` images: where
/// the device has a kernel that reads images ([`image_kernel`]), with output pixels per image
/// in whole 4s (a group of 4 output columns stays in one image), the images and the output
/// within one binding, and k within one kernel's loop.
pub(crate) fn conv_product_applies(
    device: &Device,
    c_out: usize,
    images: usize,
    cols: &ImageColumns,
) -> bool {
    let in_bytes = images * cols.c_in * cols.height * cols.width * 4;
    let out_bytes = c_out * images * cols.pixels() * 4;
    let limit = device.inner.max_binding_bytes();
    image_kernel(
        device,
        BSource::Image,
        AMode::Any,
        c_out,
        images * cols.pixels(),
    )
    .is_some()
        && cols.pixels().is_multiple_of(4)
        && cols.k().next_multiple_of(4) <= K_CHUNK
        && in_bytes as u64 <= limit
        && out_bytes as u64 <= limit
}

/// `weight` `[c_out, k]` (taps outer, channels inner, `k` the column matrix's rows padded
/// with zero weights to whole 4s) times the column matrix of `images` (contiguous
/// `[count, c_in, height, width]`), as `[count, c_out, out_h, out_w]`: a convolution's forward
/// with no column matrix in memory. Callers check [`conv_product_applies`] first.
pub(crate) fn conv_product(
    weight: &Tensor,
    images: &Tensor,
    cols: &ImageColumns,
) -> Result<Tensor> {
    const OP: &str = "conv2d";
    debug_assert!(weight.is_contiguous() && images.is_contiguous());
    let (m, k) = (weight.shape()[0], weight.shape()[1]);
    debug_assert_eq!(k, cols.k().next_multiple_of(4));
    let count = images.shape()[0];
    let out_shape = [count, m, cols.out_h, cols.out_w];
    let out = Tensor::empty(OP, &out_shape, DType::F32, images.device())?;
    if out.numel() == 0 {
        return Ok(out);
    }
    launch_image_product(BSource::Image, weight, images, 0, cols, &out)?;
    Ok(out)
}

/// True when [`conv_weight_product`] can run the weight grad of `c_out` output channels over
/// `images` images in groups of `group`: where the device has a kernel that reads images, with
/// each group's output pixels in whole 4s (no k tail) within one kernel's loop, and the
/// images, the out grad and the product within one binding.
pub(crate) fn conv_weight_product_applies(
    device: &Device,
    c_out: usize,
    images: usize,
    group: usize,
    cols: &ImageColumns,
) -> bool {
    let group_pixels = group * cols.pixels();
    let in_bytes = images * cols.c_in * cols.height * cols.width * 4;
    let grad_bytes = images * c_out * cols.pixels() * 4;
    let out_bytes = images.div_ceil(group.max(1)) * c_out * cols.k() * 4;
    let limit = device.inner.max_binding_bytes();
    image_kernel(device, BSource::ImageT, AMode::K, c_out, cols.k()).is_some()
        && group_pixels.is_multiple_of(4)
        && group_pixels <= K_CHUNK
        && [in_bytes, grad_bytes, out_bytes]
            .iter()
            .all(|&b| b as u64 <= limit)
}

/// A convolution's weight grad over groups of images with no column matrix in memory:
/// `out_grad` `[groups, c_out, group pixels]` (contiguous, each group's images side by side,
/// as `conv.rs`'s `grouped`) times the transposed column matrix of `images` (contiguous
/// `[groups group, c_in, height, width]`), as `[groups, c_out, c_in kh kw]`, one partial grad
/// per group in the weight's layout. Callers check [`conv_weight_product_applies`] first.
pub(crate) fn conv_weight_product(
    out_grad: &Tensor,
    images: &Tensor,
    cols: &ImageColumns,
    group: usize,
) -> Result<Tensor> {
    const OP: &str = "conv2d";
    debug_assert!(out_grad.is_contiguous() && images.is_contiguous());
    let (groups, m, k) = (
        out_grad.shape()[0],
        out_grad.shape()[1],
        out_grad.shape()[2],
    );
    debug_assert_eq!(k, group * cols.pixels());
    let n = cols.k();
    let out = Tensor::empty(OP, &[groups, m, n], DType::F32, images.device())?;
    if out.numel() == 0 {
        return Ok(out);
    }
    let group_images = group * cols.c_in * cols.height * cols.width;
    launch_image_product(BSource::ImageT, out_grad, images, group_images, cols, &out)?;
    Ok(out)
}

/// Records the product of `a` (contiguous `[batches, m, k]`, or `[m, k]` for one batch) by the
/// image columns of `images` that `source` reads (`b_batch_stride` elements of the images per
/// batch) into `out` (`[batches, m, n]` in the source's output layout). Callers check that
/// [`image_kernel`] has a kernel for it.
fn launch_image_product(
    source: BSource,
    a: &Tensor,
    images: &Tensor,
    b_batch_stride: usize,
    cols: &ImageColumns,
    out: &Tensor,
) -> Result<()> {
    const OP: &str = "conv2d";
    let (m, k) = (a.shape()[a.rank() - 2], a.shape()[a.rank() - 1]);
    let batches: usize = a.shape()[..a.rank() - 2].iter().product();
    let n = out.numel() / (batches * m).max(1);
    // A's rows are dense with k a multiple of 4: whole vec4s where it starts on one.
    let a_mode = match a.layout().offset.is_multiple_of(4) {
        true => AMode::K,
        false => AMode::Any,
    };
    let choice =
        image_kernel(images.device(), source, a_mode, m, n).expect("callers check it applies");
    let (tiles_m, tiles_n) = (m.div_ceil(choice.tile_rows), n.div_ceil(choice.tile_cols));
    let params = MatmulParams {
        m: m as u32,
        n: n as u32,
        k: k as u32,
        batches: batches as u32,
        a_offset: a.layout().offset as u32,
        a_batch_stride: (m * k) as u32,
        a_row_stride: k as u32,
        a_col_stride: 1,
        b_offset: images.layout().offset as u32,
        b_batch_stride: b_batch_stride as u32,
        col_tiles: tiles_n as u32,
        row_tiles: tiles_m as u32,
        ..cols.params()
    };
    launch_product(
        OP,
        choice.entry,
        choice.spec,
        &params,
        [a, images, out],
        batches * tiles_m * tiles_n,
    )
}

/// Records one product kernel over `[a, b, out]`; a captured step may run the product's
/// elementwise consumers in its stores.
fn launch_product(
    op: &'static str,
    entry: &'static str,
    spec: Specialisation,
    params: &MatmulParams,
    [a, b, out]: [&Tensor; 3],
    workgroups: usize,
) -> Result<()> {
    let variant = format!("{spec:?}");
    let specialised = || source(spec);
    let dtypes = [(1, spec.a_dtype), (2, spec.b_dtype), (3, spec.out_dtype)];
    let kernel = Kernel::specialised(&MATMUL, entry, &variant, &specialised).with_dtypes(&dtypes);
    let bound = [(1, a), (2, b), (3, out)];
    if spec.out_dtype.is_16_bit() {
        // The fuser's epilogues store F32: a 16-bit product runs as it is.
        return Launch::new(op, &kernel, &bound, params).record(workgroups as u32);
    }
    let site = || {
        Fusion::Epilogue(EpilogueSite {
            entry,
            output: 3,
            numel: out.numel(),
            vec4_output: true,
        })
    };
    Launch::new(op, &kernel, &bound, params)
        .fusible(site)
        .record(workgroups as u32)
}

/// A 2-D product with an operand larger than one binding: a dense `a` `[M, K]` a window of
/// rows at a time (the output's rows laid end to end; each run's product with a `b` past one
/// binding too splits `b` in turn), `b` the transpose of a dense `[N, K]` (a tied output
/// layer) a window of its rows at a time (the output's columns side by side), or runs of k,
/// summed, where `a`'s transpose or `b` is dense. Anything else is a `TooLarge` error.
fn matmul_windows(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    const OP: &str = "matmul";
    let big = if a.exceeds_binding() { a } else { b };
    if a.rank() != 2 || b.rank() != 2 || a.shape()[1] != b.shape()[0] {
        return Err(crate::ops::too_large_view(OP, big));
    }
    let (m, k, n) = (a.shape()[0], a.shape()[1], b.shape()[1]);
    let dev = a.device();
    // An empty view of a buffer past one binding: nothing to bind, no runs to join.
    if m == 0 || n == 0 || k == 0 {
        return Tensor::zeros(&[m, n], dev);
    }
    // Rows `first .. first + count` of the contiguous `t` (rows of `len`), as a window.
    let rows = |t: &Tensor, first: usize, count: usize, len: usize| {
        t.window(first * len, count * len).reshape(&[count, len])
    };
    let (a_t, b_t) = (transposed(a)?, transposed(b)?);
    let dense = |t: &Tensor| !t.exceeds_binding() || t.is_contiguous();
    if a.exceeds_binding() && a.is_contiguous() {
        // Runs of A's rows, the products laid end to end (each run's product with a B past
        // one binding in turn takes runs of B's columns or of k).
        let per = rows_per_window(dev, k);
        if per == 0 {
            return Err(crate::ops::too_large_view(OP, a));
        }
        let parts: Vec<Tensor> = (0..m)
            .step_by(per)
            .map(|r| rows(a, r, per.min(m - r), k)?.matmul(b))
            .collect::<Result<_>>()?;
        return Tensor::cat(&parts, 0);
    }
    if b.exceeds_binding() && b_t.is_contiguous() && !a.exceeds_binding() {
        // Runs of B's columns (rows of the table B^T: a tied output layer), end to end.
        let per = rows_per_window(dev, k);
        if per == 0 {
            return Err(crate::ops::too_large_view(OP, b));
        }
        let parts: Vec<Tensor> = (0..n)
            .step_by(per)
            .map(|r| a.matmul(&rows(&b_t, r, per.min(n - r), k)?.t()?))
            .collect::<Result<_>>()?;
        return Tensor::cat(&parts, 1);
    }
    // Runs of k, the products summed: A transposed dense (an out grad's transpose, as in a
    // weight's grad g^T x) and B dense, each windowed where past a binding.
    let a_rows_of_k = a.exceeds_binding() && a_t.is_contiguous();
    let b_rows_of_k = b.exceeds_binding() && b.is_contiguous();
    if !(a_rows_of_k || b_rows_of_k) || !dense(&a_t) || !dense(b) {
        return Err(crate::ops::too_large_view(OP, big));
    }
    let per = [(a_rows_of_k, m), (b_rows_of_k, n)]
        .iter()
        .filter(|(windowed, _)| *windowed)
        .map(|&(_, len)| rows_per_window(dev, len))
        .min()
        .unwrap_or(0);
    if per == 0 {
        return Err(crate::ops::too_large_view(OP, big));
    }
    let mut sum: Option<Tensor> = None;
    for first in (0..k).step_by(per) {
        let count = per.min(k - first);
        let a_part = match a_rows_of_k {
            true => rows(&a_t, first, count, m)?.t()?,
            false => a.narrow(1, first, count)?,
        };
        let b_part = match b_rows_of_k {
            true => rows(b, first, count, n)?,
            false => b.narrow(0, first, count)?,
        };
        let part = a_part.matmul(&b_part)?;
        sum = Some(match sum {
            None => part,
            Some(total) => total.add(&part)?,
        });
    }
    sum.map_or_else(|| Tensor::zeros(&[m, n], dev), Ok)
}

/// The product of `a` `[batch.., m, k]` and `b` `[batch.., k, n]` (expanded to one batch)
/// whose output is past one binding, though its operands are not (a language model's logits
/// over a real vocabulary): runs of the output's slices along its first dim whose slices fit
/// a binding (a batch dim, or the rows), each a product of its own, joined along that dim.
fn product_in_runs(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    const OP: &str = "matmul";
    let r = a.rank();
    let mut out_shape = a.shape()[..r - 1].to_vec();
    out_shape.push(b.shape()[r - 1]);
    let split = (0..r - 1).find_map(|d| {
        let inner: usize = out_shape[d + 1..].iter().product();
        let per = rows_per_window(a.device(), inner);
        (per > 0).then_some((d, per))
    });
    let Some((d, per)) = split else {
        return Err(Error::TooLarge {
            op: OP,
            bytes: (out_shape[r - 1] * 4) as u64,
            limit: a.device().max_binding_bytes(),
        });
    };
    let parts: Vec<Tensor> = (0..out_shape[d])
        .step_by(per)
        .map(|first| {
            let count = per.min(out_shape[d] - first);
            let a_part = a.narrow(d, first, count)?;
            // B is shared by every row; a batch dim splits both.
            let b_part = match d < r - 2 {
                true => b.narrow(d, first, count)?,
                false => b.clone(),
            };
            // F32 runs, so that they join whatever each stored (the caller narrows).
            product(&a_part, &b_part, DType::F32)
        })
        .collect::<Result<_>>()?;
    Tensor::cat(&parts, d)
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

#[cfg(test)]
mod tests {
    use super::{block_k, PANEL_BYTES_AT_8};

    #[test]
    fn block_panels_are_16_rows_deep_where_workgroup_storage_holds_them() {
        assert_eq!(block_k(32 << 10), 16);
        assert_eq!(block_k(48 << 10), 16);
    }

    #[test]
    fn block_panels_are_8_rows_deep_in_webgpus_default_workgroup_storage() {
        assert_eq!(PANEL_BYTES_AT_8, 16 << 10);
        assert_eq!(block_k(16 << 10), 8);
        assert_eq!(block_k((32 << 10) - 4), 8);
    }
}
