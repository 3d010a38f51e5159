//! `Tensor`: a cheap, thread-safe handle to a strided view of a GPU buffer.

pub(crate) mod command;
pub(crate) mod creation;
pub(crate) mod dim;
mod display;
pub(crate) mod fusion;
pub(crate) mod grad_mode;
pub(crate) mod graph;
pub(crate) mod index_range;
pub(crate) mod layout;
mod storage;
pub(crate) mod tape;

use std::sync::{Arc, Mutex, RwLock};

use crate::device::Device;
use crate::error::{Error, Result};
use graph::AutogradMeta;
pub(crate) use index_range::IndexRange;
pub(crate) use layout::Layout;
pub(crate) use storage::Storage;

/// Element types. f32 is the working type; u32 holds labels and indices; F16 and BF16 store
/// floats in 2 bytes each (two per 32-bit word), for checkpoints and mixed precision.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DType {
    /// 32-bit float.
    F32,
    /// 32-bit unsigned integer (labels, indices).
    U32,
    /// IEEE 754 half precision (`half::f16`, torch's `float16`).
    F16,
    /// bfloat16: f32's exponent, 8 bits of mantissa (`half::bf16`, torch's `bfloat16`).
    BF16,
}

impl DType {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::F32 | DType::U32 => 4,
            DType::F16 | DType::BF16 => 2,
        }
    }

    /// True for the float dtypes (F32, F16, BF16).
    pub fn is_float(self) -> bool {
        self != DType::U32
    }

    /// True for F16 and BF16, which kernels read two to a word.
    pub fn is_16_bit(self) -> bool {
        self.size() == 2
    }

    /// The code kernels name the dtype by where a module is specialised on it
    /// (`shaders/sixteen_bit.wgsl`).
    pub(crate) fn wgsl_code(self) -> &'static str {
        match self {
            DType::F32 => "0",
            DType::U32 => "1",
            DType::F16 => "2",
            DType::BF16 => "3",
        }
    }
}

/// An n-dimensional array on a [`Device`]. Cloning a `Tensor` clones the handle, not the data:
/// [`Tensor::same`] tells handles of one tensor apart from equal copies.
#[derive(Clone)]
pub struct Tensor {
    pub(crate) inner: Arc<TensorInner>,
}

pub(crate) struct TensorInner {
    /// Grad slot, requires-grad flag and the node that made this tensor (autograd's state).
    pub(crate) autograd: Mutex<AutogradMeta>,
    /// Behind a lock so that the engine can swap a grad's buffer under a handle the user holds.
    storage: RwLock<Arc<Storage>>,
    layout: Layout,
    dtype: DType,
    /// For u32 tensors: the range of the values, known from how the tensor was made, so that
    /// ops can reject out-of-range labels without reading the data back.
    index_range: Option<IndexRange>,
    device: Device,
}

impl std::fmt::Debug for Tensor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Tensor({:?}, {:?}, storage {})",
            self.shape(),
            self.dtype(),
            self.storage_id()
        )
    }
}

impl Tensor {
    pub(crate) fn from_parts(
        storage: Arc<Storage>,
        layout: Layout,
        dtype: DType,
        device: &Device,
    ) -> Tensor {
        Tensor {
            inner: Arc::new(TensorInner {
                autograd: Mutex::default(),
                storage: RwLock::new(storage),
                layout,
                dtype,
                index_range: None,
                device: device.clone(),
            }),
        }
    }

    /// A new uninitialised contiguous tensor (its values are written by the caller's kernel).
    pub(crate) fn empty(
        op: &'static str,
        shape: &[usize],
        dtype: DType,
        device: &Device,
    ) -> Result<Tensor> {
        let numel = checked_numel(op, shape)?;
        // Whole 32-bit words: kernels bind and read 16-bit elements two to a word.
        let bytes = (numel * dtype.size()).next_multiple_of(4);
        let storage = Storage::alloc(op, bytes as u64, device)?;
        Ok(Tensor::from_parts(
            Arc::new(storage),
            Layout::contiguous(shape),
            dtype,
            device,
        ))
    }

    /// A new handle on the same storage with another layout.
    pub(crate) fn view(&self, layout: Layout) -> Tensor {
        let mut t = Tensor::from_parts(self.storage(), layout, self.dtype(), self.device());
        Arc::get_mut(&mut t.inner)
            .expect("fresh handle")
            .index_range = self.inner.index_range;
        t
    }

    /// This tensor with its values known to be below `bound` (`None`: unknown).
    pub(crate) fn with_index_bound(self, bound: Option<u32>) -> Tensor {
        self.with_index_range(bound.map(IndexRange::below))
    }

    /// This tensor with its values known to lie in `range` (`None`: unknown).
    pub(crate) fn with_index_range(mut self, range: Option<IndexRange>) -> Tensor {
        if let Some(inner) = Arc::get_mut(&mut self.inner) {
            inner.index_range = range;
            return self;
        }
        let mut t = self.view(self.layout().clone());
        Arc::get_mut(&mut t.inner)
            .expect("fresh handle")
            .index_range = range;
        t
    }

    /// Elements `start .. start + len` of this contiguous tensor, as a flat tensor over a
    /// window of its buffer: what kernels bind of a tensor larger than one binding. The
    /// window starts at the alignment boundary at or before the first element, so the
    /// result's offset is that element's distance from it.
    pub(crate) fn window(&self, start: usize, len: usize) -> Tensor {
        debug_assert!(self.is_contiguous(), "windows are of contiguous tensors");
        let size = self.dtype().size() as u64;
        let storage = self.storage();
        let align = self.device().inner.binding_alignment();
        let first = storage.base() + (self.layout().offset + start) as u64 * size;
        let aligned = first / align * align;
        let skip = ((first - aligned) / size) as usize;
        // Whole 16-byte groups where the buffer has them (it always does: its size is a
        // multiple of 16), so that kernels binding `vec4` arrays reach a partial last group.
        let room = storage.buffer().size() - aligned;
        let bytes = ((skip + len) as u64 * size)
            .max(size)
            .next_multiple_of(16)
            .min(room);
        let window = Storage::window(&storage, aligned - storage.base(), bytes);
        let layout = Layout {
            shape: vec![len],
            strides: vec![1],
            offset: skip,
        };
        Tensor::from_parts(Arc::new(window), layout, self.dtype(), self.device())
            .with_index_range(self.index_range())
    }

    /// True when this tensor's buffer is larger than one kernel may bind.
    pub(crate) fn exceeds_binding(&self) -> bool {
        self.storage().bytes() > self.device().inner.max_binding_bytes()
    }

    /// This tensor as a kernel can bind it: itself, or, where it is a view of part of a
    /// buffer past one binding (a chunk of a large batch, a head of large activations) and
    /// the elements from its first to its last fit one, the same view of a window of just
    /// those, with no graph (as [`Tensor::window`]).
    pub(crate) fn bindable(&self) -> Tensor {
        if !self.exceeds_binding() || self.numel() == 0 {
            return self.clone();
        }
        let layout = self.layout();
        let elements = (self.storage().bytes() / self.dtype().size() as u64) as usize;
        let window = (self.view(Layout::contiguous(&[elements])))
            .window(layout.offset, layout.span() - layout.offset);
        match window.exceeds_binding() {
            true => self.clone(),
            false => window.view(Layout {
                shape: self.shape().to_vec(),
                strides: layout.strides.clone(),
                offset: window.layout().offset,
            }),
        }
    }

    /// An exclusive bound on every value of this u32 tensor, where known.
    pub(crate) fn index_bound(&self) -> Option<u32> {
        self.inner.index_range.map(IndexRange::bound)
    }

    /// What this u32 tensor's values are known to be, where known.
    pub(crate) fn index_range(&self) -> Option<IndexRange> {
        self.inner.index_range
    }

    /// Points this handle at another buffer of the same layout: how the engine installs a
    /// fresh grad under a handle the user holds (S-2).
    pub(crate) fn swap_storage(&self, storage: Arc<Storage>) {
        *self
            .inner
            .storage
            .write()
            .unwrap_or_else(|e| e.into_inner()) = storage;
    }

    pub(crate) fn storage(&self) -> Arc<Storage> {
        self.inner
            .storage
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    pub(crate) fn layout(&self) -> &Layout {
        &self.inner.layout
    }

    /// The tensor's dimensions.
    pub fn shape(&self) -> &[usize] {
        &self.inner.layout.shape
    }

    /// Number of dimensions.
    pub fn rank(&self) -> usize {
        self.shape().len()
    }

    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.inner.layout.numel()
    }

    /// The element type.
    pub fn dtype(&self) -> DType {
        self.inner.dtype
    }

    /// The device the tensor lives on.
    pub fn device(&self) -> &Device {
        &self.inner.device
    }

    /// True when the elements lie densely in row-major order (so kernels read them directly).
    pub fn is_contiguous(&self) -> bool {
        self.inner.layout.is_contiguous()
    }

    /// Names the GPU buffer behind this tensor: two tensors with the same id alias.
    pub fn storage_id(&self) -> u64 {
        self.storage().id()
    }

    /// Handle identity: true when `a` and `b` are the same tensor object, not merely equal.
    pub fn same(a: &Tensor, b: &Tensor) -> bool {
        Arc::ptr_eq(&a.inner, &b.inner)
    }

    pub(crate) fn expect_dtype(&self, op: &'static str, dtype: DType) -> Result<()> {
        if self.dtype() != dtype {
            return Err(Error::DType {
                op,
                msg: format!(
                    "expected a {dtype:?} tensor, got {:?} with shape {:?}",
                    self.dtype(),
                    self.shape()
                ),
            });
        }
        Ok(())
    }

    pub(crate) fn expect_same_device(&self, op: &'static str, other: &Tensor) -> Result<()> {
        if !Device::same(self.device(), other.device()) {
            return Err(Error::InvalidArgument {
                op,
                msg: format!(
                    "tensors of shapes {:?} and {:?} live on different devices",
                    self.shape(),
                    other.shape()
                ),
            });
        }
        Ok(())
    }
}

/// Most dims a tensor may have: what strided kernels walk.
pub(crate) const MAX_RANK: usize = 6;

/// The number of elements of `shape`, or an error if it has more than [`MAX_RANK`] dims or
/// more elements than a u32 counts.
pub(crate) fn checked_numel(op: &'static str, shape: &[usize]) -> Result<usize> {
    if shape.len() > MAX_RANK {
        return Err(Error::Shape {
            op,
            msg: format!(
                "shape {shape:?} has rank {}; tensors have at most {MAX_RANK} dims",
                shape.len()
            ),
        });
    }
    shape
        .iter()
        .try_fold(1usize, |acc, &n| acc.checked_mul(n))
        .filter(|&n| n <= u32::MAX as usize)
        .ok_or_else(|| Error::InvalidArgument {
            op,
            msg: format!("shape {shape:?} has more than {} elements", u32::MAX),
        })
}
