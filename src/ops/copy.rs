//! Data movement: strided copy (contiguous, cat, reshape of a view), fill (zeros, ones, full,
//! arange) and readback to the host (`to_vec`, `item`). Copies have the identity as backward.

use crate::device::Device;
use crate::error::{Error, Result};
use crate::kernel::{
    groups, rows_per_window, strided_dims, windows, Elementwise, Fusion, Kernel, KernelParams,
    Launch, ShaderFamily, CONTIGUOUS_PER_GROUP,
};
use crate::ops::cast;
use crate::tensor::dim::Dim;
use crate::tensor::graph::record;
use crate::tensor::{DType, IndexRange, Layout, Tensor};

crate::kernel_params! {
    /// `strided_copy`: element `i` of the shape, read at the source's strides, written at the
    /// destination's.
    pub(crate) struct CopyParams {
        n: u32,
        src_offset: u32,
        dst_offset: u32,
        /// The index of the first element copied (not 0 when the destination is bound a
        /// window at a time); offsets wrap, so `dst_offset` may count back from the window.
        first: u32,
        shape: [u32; 6],
        src_strides: [u32; 6],
        dst_strides: [u32; 6],
    }
}

crate::kernel_params! {
    /// `fill`: element `i` is `start + step * i`.
    pub(crate) struct FillParams { n: u32, start: f32, step: f32 }
}

static COPY: ShaderFamily = ShaderFamily {
    name: "copy",
    wgsl: include_str!("../../shaders/copy.wgsl"),
    params: &[&CopyParams::LAYOUT],
    preludes: &[],
};

static FILL: ShaderFamily = ShaderFamily {
    name: "fill",
    wgsl: include_str!("../../shaders/fill.wgsl"),
    params: &[&FillParams::LAYOUT],
    preludes: &[],
};

#[cfg(test)]
pub(crate) fn kernel_sources() -> Vec<(String, String)> {
    vec![
        ("copy".into(), copy_source(WORDS)),
        ("copy vec4".into(), copy_source(GROUPS_OF_FOUR)),
        ("fill".into(), FILL.source(&[])),
    ]
}

/// The copy kernel's units: 32-bit words, or groups of four where the layout allows.
const WORDS: &str = "u32";
const GROUPS_OF_FOUR: &str = "vec4<u32>";

/// The copy module moving `word`s (`WORDS` or `GROUPS_OF_FOUR`).
fn copy_source(word: &str) -> String {
    COPY.source(&[("WORD", word)])
}

/// Copies the view `src` into `out`, a fresh dense tensor of its shape. An F32 copy is
/// described to a captured step's fuser as the elementwise identity, so that the elementwise
/// ops reading its output (which read views through such copies: `ops/unary.rs`,
/// `ops/binary.rs`) fuse with it into one kernel that reads the view itself.
fn copy_fresh(src: &Tensor, out: &Tensor) -> Result<()> {
    let identity = (src.dtype() == DType::F32).then(|| Elementwise {
        params: "x: f32",
        expr: "x".to_string(),
        scalars: Vec::new(),
        operands: vec![(1, src.layout().clone())],
        output: 2,
        shape: src.shape().to_vec(),
    });
    copy_described("contiguous", src, out, &out.layout().clone(), identity)
}

/// `launch`, described to the fuser as `fusion` if given.
fn described(launch: Launch<'_>, fusion: Option<Elementwise<u32>>) -> Launch<'_> {
    match fusion {
        Some(f) => launch.fusible(|| Fusion::Elementwise(f)),
        None => launch,
    }
}

/// Copies the elements of `src` (any layout) into `dst`'s storage at layout `dst_layout`.
pub(crate) fn copy_into(
    op: &'static str,
    src: &Tensor,
    dst: &Tensor,
    dst_layout: &Layout,
) -> Result<()> {
    copy_described(op, src, dst, dst_layout, None)
}

/// [`copy_into`], its launch described to the fuser as `fusion` where one launch copies all.
fn copy_described(
    op: &'static str,
    src: &Tensor,
    dst: &Tensor,
    dst_layout: &Layout,
    fusion: Option<Elementwise<u32>>,
) -> Result<()> {
    let n = src.numel();
    if n == 0 {
        return Ok(());
    }
    // Past one binding, the flat windows below take a dense destination and a source bound
    // whole, and a buffer copy takes two dense tensors; anything else goes a run of slices
    // at a time.
    let flat_windows = !src.dtype().is_16_bit()
        && dst_layout.is_contiguous()
        && (!src.exceeds_binding() || src.is_contiguous() && src.storage_id() != dst.storage_id());
    if (src.exceeds_binding() || dst.exceeds_binding()) && !flat_windows {
        return copy_in_slice_runs(op, src, dst, dst_layout);
    }
    // 16-bit elements share words: the cast kernels move them (into contiguous runs).
    if src.dtype().is_16_bit() {
        return crate::ops::cast::cast_into(op, src, dst, dst_layout);
    }
    // Dense into dense, between two buffers: one buffer copy, no kernel.
    if src.is_contiguous() && dst_layout.is_contiguous() && src.storage_id() != dst.storage_id() {
        return copy_dense(op, src, dst, dst_layout.offset);
    }
    let dims = strided_dims(
        op,
        src.shape(),
        &[&src.layout().strides, &dst_layout.strides],
    )?;
    let words = || copy_source(WORDS);
    let groups_of_four = || copy_source(GROUPS_OF_FOUR);
    let kernel = Kernel::specialised(&COPY, "strided_copy", WORDS, &words);
    let params = |first: usize, len: usize, dst_offset: usize| CopyParams {
        n: len as u32,
        src_offset: src.layout().offset as u32,
        dst_offset: dst_offset as u32,
        first: first as u32,
        shape: dims.shape,
        src_strides: dims.strides[0],
        dst_strides: dims.strides[1],
    };
    if !dst.exceeds_binding() {
        let bound = [(1, src), (2, dst)];
        let params = params(0, n, dst_layout.offset);
        if let Some(params) = in_groups_of_four(params) {
            let kernel =
                Kernel::specialised(&COPY, "strided_copy", GROUPS_OF_FOUR, &groups_of_four);
            let groups = groups(params.n as usize, CONTIGUOUS_PER_GROUP);
            return described(Launch::new(op, &kernel, &bound, &params), fusion).record(groups);
        }
        return described(Launch::new(op, &kernel, &bound, &params), fusion)
            .record(groups(n, CONTIGUOUS_PER_GROUP));
    }
    // Past one binding: a dense destination region, a window of it per launch; the source
    // (a broadcast or strided view) is bound whole.
    if !dst_layout.is_contiguous() || src.exceeds_binding() {
        return Err(crate::ops::too_large_view(op, dst));
    }
    let region = dst.view(dst_layout.clone());
    for (start, len) in windows(dst.device(), n) {
        let target = region.window(start, len);
        // Element `first + j` lands at `skip + j` of the window: dst_offset counts back.
        let back = target.layout().offset.wrapping_sub(start) as u32 as usize;
        let params = params(start, len, back);
        Launch::new(op, &kernel, &[(1, src), (2, &target)], &params)
            .record(groups(len, CONTIGUOUS_PER_GROUP))?;
    }
    Ok(())
}

/// [`copy_into`] where a side past one binding is strided (a padded image's interior, a
/// permuted view of large activations) or 16-bit: a copy per run of slices along the first
/// dim, each side bound as the window of its storage those slices span (or whole, where it
/// fits one binding). Where one slice spans past a binding, each slice is copied so in turn,
/// by runs along its own first dim, down to runs of single elements.
fn copy_in_slice_runs(
    op: &'static str,
    src: &Tensor,
    dst: &Tensor,
    dst_layout: &Layout,
) -> Result<()> {
    if src.rank() == 0 {
        // One element: as a run of one slice.
        let one = |l: &Layout| Layout {
            offset: l.offset,
            ..Layout::contiguous(&[1])
        };
        let dst_one = one(dst_layout);
        return copy_in_slice_runs(op, &src.view(one(src.layout())), dst, &dst_one);
    }
    let rows = src.shape()[0];
    let per_window = rows_per_window(dst.device(), 1);
    // The slices one window of `t`'s storage holds at `layout`: all where it fits a binding,
    // none where one slice spans past it.
    let slices_per_window = |t: &Tensor, layout: &Layout| -> Result<usize> {
        let first = layout.narrow(op, 0, 0, 1)?;
        Ok(match (t.exceeds_binding(), layout.strides[0]) {
            (false, _) => rows,
            (true, _) if span(&first) > per_window => 0,
            (true, 0) => rows,
            (true, stride) => (per_window - span(&first)) / stride + 1,
        })
    };
    let per = slices_per_window(src, src.layout())?.min(slices_per_window(dst, dst_layout)?);
    if per == 0 {
        // A rank-1 slice is one element, which always fits: only wider slices get here.
        for i in 0..rows {
            let (src_i, dst_i) = (slice_of(src.layout(), i), slice_of(dst_layout, i));
            copy_in_slice_runs(op, &src.view(src_i), dst, &dst_i)?;
        }
        return Ok(());
    }
    for start in (0..rows).step_by(per) {
        let count = per.min(rows - start);
        let src_run = slice_run(op, src, src.layout(), start, count)?;
        let dst_run = slice_run(op, dst, dst_layout, start, count)?;
        copy_described(op, &src_run, &dst_run, dst_run.layout(), None)?;
    }
    Ok(())
}

/// Slices `start .. start + count` along the first dim of `layout`, a view of `t`'s storage,
/// as a kernel binds them: over the window of the storage they span where it is past one
/// binding ([`Tensor::bindable`]).
fn slice_run(
    op: &'static str,
    t: &Tensor,
    layout: &Layout,
    start: usize,
    count: usize,
) -> Result<Tensor> {
    Ok(t.view(layout.narrow(op, 0, start, count)?).bindable())
}

/// Slice `i` along the first dim of `layout`, that dim dropped.
fn slice_of(layout: &Layout, i: usize) -> Layout {
    Layout {
        shape: layout.shape[1..].to_vec(),
        strides: layout.strides[1..].to_vec(),
        offset: layout.offset + i * layout.strides[0],
    }
}

/// The elements from a (non-empty) layout's first to its last, inclusive.
fn span(layout: &Layout) -> usize {
    layout.span() - layout.offset
}

/// `params` counted in four-word groups (the `vec4` copy kernel), where the innermost dim is
/// contiguous on both sides and every size, stride and offset is a multiple of 4 (head
/// permutes, slices of a fused projection): a quarter of the loads and stores.
fn in_groups_of_four(params: CopyParams) -> Option<CopyParams> {
    let inner_contiguous = params.src_strides[5] == 1 && params.dst_strides[5] == 1;
    let counts = [
        params.n,
        params.src_offset,
        params.dst_offset,
        params.first,
        params.shape[5],
    ];
    let mut outer = params.src_strides[..5]
        .iter()
        .chain(&params.dst_strides[..5])
        .chain(&counts);
    if !inner_contiguous || outer.any(|v| v % 4 != 0) {
        return None;
    }
    let mut shape = params.shape;
    shape[5] /= 4;
    let quarter = |strides: [u32; 6]| {
        let mut s = strides.map(|v| v / 4);
        s[5] = 1;
        s
    };
    Some(CopyParams {
        n: params.n / 4,
        src_offset: params.src_offset / 4,
        dst_offset: params.dst_offset / 4,
        first: params.first / 4,
        shape,
        src_strides: quarter(params.src_strides),
        dst_strides: quarter(params.dst_strides),
    })
}

/// Copies contiguous `src` into `dst`'s buffer from element `dst_offset` on, by one
/// buffer-to-buffer copy (which a captured step records too).
fn copy_dense(op: &'static str, src: &Tensor, dst: &Tensor, dst_offset: usize) -> Result<()> {
    let size = src.dtype().size() as u64;
    let bytes = src.numel() as u64 * size;
    let (from, to) = (src.storage(), dst.storage());
    let src_at = from.base() + src.layout().offset as u64 * size;
    let dst_at = to.base() + dst_offset as u64 * size;
    src.device()
        .inner
        .copy(op, (from.buffer(), src_at), (to.buffer(), dst_at), bytes)?;
    crate::tensor::tape::record_copy((&from, src_at), (&to, dst_at), bytes);
    Ok(())
}

/// A contiguous f32 tensor holding `start + step * i`.
pub(crate) fn fill(
    op: &'static str,
    shape: &[usize],
    start: f32,
    step: f32,
    device: &Device,
) -> Result<Tensor> {
    let out = Tensor::empty(op, shape, DType::F32, device)?;
    let kernel = Kernel::plain(&FILL, "fill");
    // Past one binding, one launch per window (each starts on an alignment boundary).
    let runs = if out.exceeds_binding() {
        windows(device, out.numel())
    } else {
        vec![(0, out.numel())]
    };
    for (first, n) in runs {
        let target = if first == 0 && n == out.numel() {
            out.clone()
        } else {
            out.window(first, n)
        };
        let params = FillParams {
            n: n as u32,
            start: start + step * first as f32,
            step,
        };
        Launch::new(op, &kernel, &[(1, &target)], &params)
            .record(groups(n, CONTIGUOUS_PER_GROUP))?;
    }
    Ok(out)
}

/// Records a copy of `x`: its grad passes through unchanged.
fn record_identity(name: &'static str, out: Tensor, x: &Tensor) -> Tensor {
    record(name, out, &[x], |_| |g: &Tensor| Ok(vec![Some(g.clone())]))
}

impl Tensor {
    /// An f32 tensor of zeros.
    pub fn zeros(shape: &[usize], device: &Device) -> Result<Tensor> {
        fill("zeros", shape, 0.0, 0.0, device)
    }

    /// An f32 tensor of ones.
    pub fn ones(shape: &[usize], device: &Device) -> Result<Tensor> {
        fill("ones", shape, 1.0, 0.0, device)
    }

    /// An f32 tensor with every element `value`.
    pub fn full(shape: &[usize], value: f32, device: &Device) -> Result<Tensor> {
        fill("full", shape, value, 0.0, device)
    }

    /// `[0, 1, ..., n - 1]` as f32.
    pub fn arange(n: usize, device: &Device) -> Result<Tensor> {
        fill("arange", &[n], 0.0, 1.0, device)
    }

    /// The values, row-major, as f32 (F16 and BF16 converted exactly). Submits pending work
    /// and waits for it.
    pub fn to_vec(&self) -> Result<Vec<f32>> {
        match self.dtype() {
            DType::F16 => Ok(self.to_vec_f16()?.into_iter().map(f32::from).collect()),
            DType::BF16 => Ok(self.to_vec_bf16()?.into_iter().map(f32::from).collect()),
            _ => {
                self.expect_dtype("to_vec", DType::F32)?;
                Ok(bytemuck::pod_collect_to_vec(&self.read_bytes("to_vec")?))
            }
        }
    }

    /// The values, row-major, of an F16 tensor, as they are.
    pub fn to_vec_f16(&self) -> Result<Vec<half::f16>> {
        self.expect_dtype("to_vec_f16", DType::F16)?;
        Ok(self
            .read_16_bit("to_vec_f16")?
            .into_iter()
            .map(half::f16::from_bits)
            .collect())
    }

    /// The values, row-major, of a BF16 tensor, as they are.
    pub fn to_vec_bf16(&self) -> Result<Vec<half::bf16>> {
        self.expect_dtype("to_vec_bf16", DType::BF16)?;
        Ok(self
            .read_16_bit("to_vec_bf16")?
            .into_iter()
            .map(half::bf16::from_bits)
            .collect())
    }

    /// The values, row-major, of a u32 tensor (labels, indices, argmax).
    pub fn to_vec_u32(&self) -> Result<Vec<u32>> {
        self.expect_dtype("to_vec_u32", DType::U32)?;
        Ok(bytemuck::pod_collect_to_vec(
            &self.read_bytes("to_vec_u32")?,
        ))
    }

    /// The value of a one-element float tensor, as f32.
    pub fn item(&self) -> Result<f32> {
        if self.numel() != 1 {
            return Err(Error::Shape {
                op: "item",
                msg: format!(
                    "needs a tensor of one element, got shape {:?}",
                    self.shape()
                ),
            });
        }
        if self.dtype().is_16_bit() {
            return Ok(self.to_vec()?[0]);
        }
        self.expect_dtype("item", DType::F32)?;
        Ok(bytemuck::pod_collect_to_vec::<u8, f32>(&self.read_bytes("item")?)[0])
    }

    /// A 16-bit tensor's elements' bits. Reads whole 32-bit words: a view that starts inside
    /// one is copied to a tensor of its own first.
    fn read_16_bit(&self, op: &'static str) -> Result<Vec<u16>> {
        let starts_in_word = self.layout().offset % 2 == 1;
        let dense = match self.is_contiguous() && !starts_in_word {
            true => self.clone(),
            false => self.detach().deep_clone()?,
        };
        let mut bits: Vec<u16> = bytemuck::pod_collect_to_vec(&dense.read_bytes(op)?);
        bits.truncate(self.numel());
        Ok(bits)
    }

    fn read_bytes(&self, op: &'static str) -> Result<Vec<u8>> {
        crate::tensor::tape::refuse_host_read(op)?;
        let dense = self.contiguous()?;
        let storage = dense.storage();
        let size = dense.dtype().size() as u64;
        dense.device().inner.read(
            op,
            storage.buffer(),
            storage.base() + dense.layout().offset as u64 * size,
            (dense.numel() as u64 * size).next_multiple_of(4),
        )
    }

    /// A contiguous tensor with the same values: `self` itself when already contiguous,
    /// else a copy.
    pub fn contiguous(&self) -> Result<Tensor> {
        if self.is_contiguous() {
            return Ok(self.clone());
        }
        let out = Tensor::empty("contiguous", self.shape(), self.dtype(), self.device())?
            .with_index_range(self.index_range());
        copy_fresh(self, &out)?;
        Ok(record_identity("contiguous", out, self))
    }

    /// A contiguous copy of the values in a new buffer that aliases nothing (Rust's `clone`
    /// copies the handle). A contiguous source is one `copy_buffer_to_buffer`.
    pub fn deep_clone(&self) -> Result<Tensor> {
        const OP: &str = "deep_clone";
        let out = Tensor::empty(OP, self.shape(), self.dtype(), self.device())?
            .with_index_range(self.index_range());
        copy_into(OP, self, &out, &out.layout().clone())?;
        Ok(record_identity(OP, out, self))
    }

    /// Writes `src`'s values into this tensor's own storage, in place (PyTorch's `copy_`):
    /// every tensor sharing the storage sees them. Not recorded by autograd, so a leaf that
    /// requires grad may be written only under `no_grad` (as an optimizer step does).
    pub fn copy_(&self, src: &Tensor) -> Result<()> {
        const OP: &str = "copy_";
        self.expect_same_device(OP, src)?;
        src.expect_dtype(OP, self.dtype())?;
        if src.shape() != self.shape() {
            return Err(Error::Shape {
                op: OP,
                msg: format!(
                    "cannot copy a tensor of shape {:?} into one of shape {:?}",
                    src.shape(),
                    self.shape()
                ),
            });
        }
        if self.requires_grad() && crate::tensor::grad_mode::is_grad_enabled() {
            return Err(Error::InvalidArgument {
                op: OP,
                msg: format!(
                    "the tensor of shape {:?} requires grad; write into it under wgrad::no_grad",
                    self.shape()
                ),
            });
        }
        if self.layout().overlaps() {
            return Err(Error::InvalidArgument {
                op: OP,
                msg: format!(
                    "cannot write into a broadcast view of shape {:?}",
                    self.shape()
                ),
            });
        }
        // Index ops trust a u32 tensor's bound instead of reading its values back: a copy
        // may not bring in values past it.
        if self.dtype() == DType::U32 {
            let fits = matches!(
                (src.index_range(), self.index_range()),
                (Some(incoming), Some(range)) if incoming.within(range)
            );
            if !fits && src.numel() > 0 {
                return Err(Error::InvalidArgument {
                    op: OP,
                    msg: format!(
                        "u32 values below {:?} cannot go into a u32 tensor of shape {:?} whose \
                         values index ops take to be below {:?}; make a new tensor instead",
                        src.index_bound(),
                        self.shape(),
                        self.index_bound()
                    ),
                });
            }
        }
        // One dispatch may not read and write the same buffer through two bindings.
        let src = if src.storage_id() == self.storage_id() {
            src.deep_clone()?
        } else {
            src.clone()
        };
        copy_into(OP, &src, self, self.layout())
    }

    /// The last two dims padded with `value`: `left` and `right` columns, `top` and `bottom`
    /// rows (PyTorch's `F.pad(x, (left, right, top, bottom), value=value)`). The grad is the
    /// unpadded part of the out grad.
    pub fn pad2d(
        &self,
        (left, right, top, bottom): (usize, usize, usize, usize),
        value: f32,
    ) -> Result<Tensor> {
        const OP: &str = "pad2d";
        let sides = (left, right, top, bottom);
        if let Some(out) = cast::through_f32(OP, &[self], |w| w[0].pad2d(sides, value))? {
            return Ok(out);
        }
        self.expect_dtype(OP, DType::F32)?;
        let r = self.rank();
        if r < 2 {
            return Err(Error::Shape {
                op: OP,
                msg: format!("needs at least 2 dims, got shape {:?}", self.shape()),
            });
        }
        let (h, w) = (self.shape()[r - 2], self.shape()[r - 1]);
        let grown =
            |side: usize, before: usize, after: usize| side.checked_add(before)?.checked_add(after);
        let (Some(out_h), Some(out_w)) = (grown(h, top, bottom), grown(w, left, right)) else {
            return Err(Error::InvalidArgument {
                op: OP,
                msg: format!(
                    "sides {sides:?} overflow a dim's size of shape {:?}",
                    self.shape()
                ),
            });
        };
        let mut shape = self.shape().to_vec();
        shape[r - 2] = out_h;
        shape[r - 1] = out_w;
        let out = fill(OP, &shape, value, 0.0, self.device())?;
        let region = out
            .layout()
            .narrow(OP, r - 2, top, h)?
            .narrow(OP, r - 1, left, w)?;
        copy_into(OP, self, &out, &region)?;
        Ok(record(OP, out, &[self], |_| {
            move |g: &Tensor| {
                Ok(vec![Some(g.narrow(r - 2, top, h)?.narrow(
                    r - 1,
                    left,
                    w,
                )?)])
            }
        }))
    }

    /// Stacks tensors of one shape along a new dim `dim` (`0..=rank`). Its grad is each
    /// input's slice of the out grad (the backward of `cat`).
    pub fn stack(tensors: &[Tensor], dim: impl Dim) -> Result<Tensor> {
        const OP: &str = "stack";
        let first = tensors.first().ok_or_else(|| Error::InvalidArgument {
            op: OP,
            msg: "needs at least one tensor".into(),
        })?;
        // A new dim: -1 puts it last.
        let dim = dim.resolve(OP, first.rank() + 1)?;
        if let Some(t) = tensors.iter().find(|t| t.shape() != first.shape()) {
            return Err(Error::Shape {
                op: OP,
                msg: format!("shapes {:?} and {:?} differ", first.shape(), t.shape()),
            });
        }
        if dim > first.rank() {
            return Err(Error::Shape {
                op: OP,
                msg: format!("dim {dim} is out of range for rank {} + 1", first.rank()),
            });
        }
        let unsqueezed = tensors
            .iter()
            .map(|t| t.unsqueeze(dim))
            .collect::<Result<Vec<_>>>()?;
        Tensor::cat(&unsqueezed, dim)
    }

    /// Concatenates tensors of one dtype along `dim`; all other dims must agree.
    pub fn cat(tensors: &[Tensor], dim: impl Dim) -> Result<Tensor> {
        const OP: &str = "cat";
        let first = tensors.first().ok_or_else(|| Error::InvalidArgument {
            op: OP,
            msg: "needs at least one tensor".into(),
        })?;
        let dim = dim.resolve(OP, first.rank())?;
        first.layout().check_dim(OP, dim)?;
        let mut shape = first.shape().to_vec();
        shape[dim] = 0;
        for t in tensors {
            first.expect_same_device(OP, t)?;
            t.expect_dtype(OP, first.dtype())?;
            let agrees = t.rank() == first.rank()
                && t.shape()
                    .iter()
                    .zip(first.shape())
                    .enumerate()
                    .all(|(d, (a, b))| d == dim || a == b);
            if !agrees {
                let shapes: Vec<_> = tensors.iter().map(|t| t.shape().to_vec()).collect();
                return Err(Error::Shape {
                    op: OP,
                    msg: format!("shapes {shapes:?} differ outside dim {dim}"),
                });
            }
            shape[dim] += t.shape()[dim];
        }
        if dim > 0 && first.dtype().is_16_bit() {
            // 16-bit elements are written in contiguous runs only: a later dim joins through
            // F32 (dim 0's pieces are runs of the output, written as they are).
            let given: Vec<&Tensor> = tensors.iter().collect();
            let out = cast::through_f32(OP, &given, |w| Tensor::cat(w, dim))?;
            return Ok(out.expect("16-bit inputs"));
        }
        let range = tensors
            .iter()
            .map(|t| t.index_range())
            .try_fold(IndexRange::below(0), |all, r| r.map(|r| all.union(r)));
        let out = Tensor::empty(OP, &shape, first.dtype(), first.device())?.with_index_range(range);
        let mut start = 0;
        for t in tensors {
            let len = t.shape()[dim];
            let region = out.layout().narrow(OP, dim, start, len)?;
            copy_into(OP, t, &out, &region)?;
            start += len;
        }
        let inputs: Vec<&Tensor> = tensors.iter().collect();
        Ok(record(OP, out, &inputs, |_| {
            let lens: Vec<usize> = tensors.iter().map(|t| t.shape()[dim]).collect();
            move |g: &Tensor| {
                let mut start = 0;
                let mut grads = Vec::new();
                for &len in &lens {
                    grads.push(Some(g.narrow(dim, start, len)?));
                    start += len;
                }
                Ok(grads)
            }
        }))
    }
}
