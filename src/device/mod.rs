//! The device layer: adapter choice, the queue, the buffer pool, the pipeline cache, and the one
//! open command encoder that every op records into.
//!
//! Work is recorded, not run: each op appends a dispatch to the open encoder, and the encoder
//! is submitted only when the host needs data (`to_vec`, `item`), at [`Device::synchronize`],
//! when a batch reaches its limit, or after a pipeline's first dispatch (so that a software
//! driver compiles it while the host records on). This is what keeps a chain of small ops from
//! paying a queue submission each.

mod adapter;
pub(crate) mod pipelines;
mod pool;
mod recorder;

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use crate::error::{Error, Result};
use adapter::looks_like_software;
pub(crate) use adapter::LEAST_WORKGROUP_STORAGE;
use pipelines::PipelineCache;
pub(crate) use pipelines::{declared_bindings, CachedPipeline, GENERATED};
pub(crate) use pool::size_class;
use pool::BufferPool;
use recorder::Recorder;

/// Bytes of uniform parameters each dispatch may pass (63 `u32`s and a reserved 0), and the
/// stride between dispatches in the per-batch parameter buffer.
pub(crate) const PARAMS_BYTES: u64 = 256;

/// The most workgroups a dispatch may have along one dimension (WebGPU's default limit).
const MAX_WORKGROUPS_PER_DIM: u32 = 65535;

/// How long one blocking poll may hold the device. GL's adapter context is a lock that other
/// threads give up on after 6 s, so waits are sliced well below that.
const POLL_SLICE: Duration = Duration::from_millis(50);

/// The byte range of a buffer that a kernel binds.
#[derive(Clone, Copy)]
pub(crate) struct BufferSlice<'a> {
    pub buffer: &'a wgpu::Buffer,
    pub offset: u64,
    pub size: u64,
}

/// The largest tensor wgrad makes, whatever the adapter allows: 4 GiB (a u32 element index
/// times 4 bytes would pass it anyway).
const MAX_TENSOR_BYTES: u64 = 1 << 32;

/// What the device compiles a pipeline from: one WGSL module (a family's shader with its
/// specialisation applied) and the entry point to call. `key` names the pair for the cache.
pub(crate) struct PipelineSource<'a> {
    pub key: &'a str,
    /// Names the module alone: entries of one module share its compilation.
    pub module_key: &'a str,
    pub entry: &'static str,
    pub source: &'a dyn Fn() -> String,
    /// The bindings the module reads as F16 elements, bit `b` for binding `b`: those a device
    /// with `F16Reads::Native` binds as WGSL `f16` where the module allows (see
    /// `pipelines::compiled_source`).
    pub f16_bindings: u64,
}

/// Which family of kernels a device runs where ops have two. Chosen per adapter at start-up,
/// with no tuning pass: software adapters run workgroup barriers as coroutine switches and pay
/// per memory access, so they want barrier-free kernels with one invocation per row; GPUs
/// want workgroups that cooperate through workgroup memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KernelFlavor {
    /// matmul keeps 8x8 outputs per invocation in registers (A loaded once per subgroup
    /// where subgroups are 8 wide); reductions, softmax and cross-entropy give each row (or
    /// row chunk) one invocation. No workgroup memory, no barriers.
    Cpu,
    /// matmul stages panels of A and B in workgroup memory and keeps 8x8 outputs per
    /// invocation: 128x128 output tiles where the product fills them, else 64x64, and no
    /// workgroup memory for a product with a side under 64 (either reads a convolution's
    /// columns from its images); attention runs flash-attention tiles (a workgroup per 64
    /// rows of a head, the other side staged in workgroup memory);
    /// reductions, softmax and cross-entropy over rows of up to 1,024, and LayerNorm and
    /// RMSNorm over rows under 512 give each row (or row chunk) a subgroup where the device has
    /// fixed-width subgroups; longer rows give each a workgroup that reduces in workgroup
    /// memory (through subgroup operations first where the device has them), as do the
    /// reductions, softmax and cross-entropy on devices without; short norm rows there get an
    /// invocation.
    Gpu,
}

/// How kernels read F16 elements (they write them in integer arithmetic on every path, to
/// round as torch does). Storage is the same on every path, IEEE half bits at 2 bytes an
/// element (two to a 32-bit word, the even element in the low half), and so are the values
/// read: the paths differ in how the kernel sees the bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum F16Reads {
    /// WGSL's own `f16`: the elementwise ops and matmul bind their F16 operands as
    /// `array<vec4<f16>>` and convert with the adapter's instructions. Only where the adapter
    /// has `SHADER_F16` (lavapipe and most GPUs; not GL), and there the default. Kernels that
    /// move F16 bits exactly (casts, copies) and a captured step's generated kernels keep
    /// the packed words, read as with `Hardware`.
    Native,
    /// Packed words converted by the adapter's instructions (WGSL `unpack2x16float`); zeros,
    /// subnormals, infinities and NaNs in integer arithmetic, which keeps their bits. The
    /// default where the adapter has no `SHADER_F16`.
    Hardware,
    /// Packed words converted in integer arithmetic throughout.
    Integer,
}

impl F16Reads {
    const ALL: [F16Reads; 3] = [F16Reads::Native, F16Reads::Hardware, F16Reads::Integer];

    /// This path's index in [`F16Reads::ALL`], as the device stores it.
    fn code(self) -> u8 {
        self as u8
    }

    fn from_code(code: u8) -> F16Reads {
        F16Reads::ALL[code as usize]
    }
}

/// The adapter a [`Device`] runs on.
#[derive(Debug, Clone)]
pub struct DeviceInfo {
    /// The adapter's name, e.g. "llvmpipe (LLVM 15.0.6, 256 bits)".
    pub name: String,
    /// The wgpu backend: Vulkan, Metal, Dx12 or Gl.
    pub backend: wgpu::Backend,
    /// Discrete, integrated, virtual, CPU (software) or other.
    pub device_type: wgpu::DeviceType,
    /// The driver's name and version, where the backend reports one.
    pub driver: String,
}

impl DeviceInfo {
    /// True for software adapters (lavapipe, llvmpipe, WARP, SwiftShader).
    pub fn is_software(&self) -> bool {
        self.device_type == wgpu::DeviceType::Cpu || looks_like_software(&self.name)
    }
}

impl std::fmt::Display for DeviceInfo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} ({:?}, {:?}",
            self.name, self.backend, self.device_type
        )?;
        if !self.driver.is_empty() {
            write!(f, ", driver {}", self.driver)?;
        }
        write!(f, ")")
    }
}

/// Counters that show how the device is being used, for tests and benches.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DeviceStats {
    /// Queue submissions so far.
    pub submits: u64,
    /// Compute dispatches recorded so far.
    pub dispatches: u64,
    /// Bytes in buffers owned by live tensors.
    pub live_bytes: u64,
    /// Bytes in freed buffers kept for reuse.
    pub pooled_bytes: u64,
    /// The most bytes live tensors have held at once since the device started or
    /// [`Device::reset_peak_memory`] (torch's `max_memory_allocated`, in size classes).
    pub peak_live_bytes: u64,
    /// Storage buffers ever created (each pool miss creates one).
    pub buffers_created: u64,
    /// Compiled pipelines in the cache.
    pub pipelines: usize,
}

/// A handle to one GPU (or software) device. Cheap to clone; every clone is the same device.
#[derive(Clone)]
pub struct Device {
    pub(crate) inner: Arc<DeviceInner>,
}

impl std::fmt::Debug for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Device({})", self.inner.info)
    }
}

pub(crate) struct DeviceInner {
    info: DeviceInfo,
    pub(crate) device: wgpu::Device,
    queue: wgpu::Queue,
    pub(crate) limits: wgpu::Limits,
    /// Dispatches per submission; smaller on GL, where one submission holds the context lock.
    batch_limit: u32,
    /// Uniform parameters of the open batch, written once when the batch is submitted.
    params_buffer: wgpu::Buffer,
    recorder: Mutex<Recorder>,
    /// Held around every wgpu call that takes GL's context lock for long or often (see
    /// [`DeviceInner::in_context`]); always the innermost lock wgrad takes.
    context_lock: Mutex<()>,
    pool: Mutex<BufferPool>,
    pipelines: Mutex<PipelineCache>,
    /// Errors wgpu reported outside any scope, waiting to be returned as `Error::Device`.
    errors: Arc<Mutex<Vec<String>>>,
    /// The subgroup width, when the device has subgroup operations and a fixed width.
    subgroup_size: Option<u32>,
    /// The least subgroup width, when the device has subgroup operations (fixed or not).
    min_subgroup_size: Option<u32>,
    /// True when the device runs `KernelFlavor::Gpu`.
    gpu_flavor: AtomicBool,
    /// True when the adapter has `SHADER_F16` (WGSL's `f16`), which `F16Reads::Native` needs.
    shader_f16: bool,
    /// How modules read F16 elements: an [`F16Reads`] code.
    f16_reads: AtomicU8,
    /// True when every buffer handed out is filled with NaN first (`WGRAD_POISON_BUFFERS`).
    poison_buffers: AtomicBool,
    submits: AtomicU64,
    dispatches: AtomicU64,
    next_storage_id: AtomicU64,
}

/// `Ok` when a device with `SHADER_F16` or without (`shader_f16`) can read F16 elements
/// through `reads`; `F16Reads::Native` needs the feature.
pub(super) fn check_f16_reads(reads: F16Reads, shader_f16: bool, op: &'static str) -> Result<()> {
    if reads == F16Reads::Native && !shader_f16 {
        return Err(Error::InvalidArgument {
            op,
            msg: "F16Reads::Native needs an adapter with SHADER_F16 (WGSL f16), which this one \
                  lacks; F16Reads::Hardware reads the same values from packed words"
                .into(),
        });
    }
    Ok(())
}

/// The `(x, y)` grid of a dispatch of `workgroups` workgroups: kernels that need more than
/// one dimension allows fold `y` rows of `x` into a linear workgroup index.
pub(crate) fn workgroup_grid(workgroups: u32) -> (u32, u32) {
    let x = workgroups.min(MAX_WORKGROUPS_PER_DIM);
    (x, workgroups.div_ceil(x))
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while holding one of these locks cannot leave the data half-updated in a way
    // that matters more than losing the device, so poisoning is ignored.
    mutex.lock().unwrap_or_else(|e| e.into_inner())
}

const INSTALL_HINT: &str = "install a GPU driver, or a software one: on Debian/Ubuntu \
    `apt-get install -y mesa-vulkan-drivers libvulkan1` (lavapipe); Mesa's llvmpipe through \
    EGL (libegl1, libgl1-mesa-dri) serves WGPU_BACKEND=gl";

impl Device {
    /// The adapter this device runs on.
    pub fn info(&self) -> &DeviceInfo {
        &self.inner.info
    }

    /// Submits all recorded work and waits for it. Returns the first device error that work
    /// caused, naming the op.
    pub fn synchronize(&self) -> Result<()> {
        let submission = self.inner.flush()?;
        self.inner.wait(submission)
    }

    /// Submission, dispatch and memory counters.
    pub fn stats(&self) -> DeviceStats {
        let pool = lock(&self.inner.pool);
        DeviceStats {
            submits: self.inner.submits.load(Ordering::Relaxed),
            dispatches: self.inner.dispatches.load(Ordering::Relaxed),
            live_bytes: pool.live_bytes,
            pooled_bytes: pool.pooled_bytes,
            peak_live_bytes: pool.peak_live_bytes,
            buffers_created: pool.created,
            pipelines: lock(&self.inner.pipelines).len(),
        }
    }

    /// Starts [`DeviceStats::peak_live_bytes`] again from the bytes live now (torch's
    /// `reset_peak_memory_stats`), to measure the peak of one step.
    pub fn reset_peak_memory(&self) {
        let mut pool = lock(&self.inner.pool);
        pool.peak_live_bytes = pool.live_bytes;
    }

    /// The subgroup width kernels may rely on: `Some` when the device has subgroup operations
    /// and a fixed subgroup width (8 on lavapipe), `None` under `WGRAD_SUBGROUPS=off`.
    pub fn subgroup_size(&self) -> Option<u32> {
        self.inner.subgroup_size
    }

    /// The least width a subgroup may have, where the device has subgroup operations: kernels
    /// that only need subgroups at least so wide run on devices whose width varies (32 or 64
    /// on AMD).
    pub(crate) fn min_subgroup_size(&self) -> Option<u32> {
        self.inner.min_subgroup_size
    }

    /// True where the adapter has `SHADER_F16` (WGSL's `f16` type), and kernels may bind F16
    /// tensors as such (`F16Reads::Native`).
    pub fn shader_f16(&self) -> bool {
        self.inner.shader_f16
    }

    /// The family of kernels this device runs.
    pub fn kernel_flavor(&self) -> KernelFlavor {
        if self.inner.gpu_flavor.load(Ordering::Relaxed) {
            KernelFlavor::Gpu
        } else {
            KernelFlavor::Cpu
        }
    }

    /// Overrides the per-adapter choice of kernels (to compare them, or to test the GPU
    /// kernels on a software adapter, as CI does).
    pub fn set_kernel_flavor(&self, flavor: KernelFlavor) {
        let gpu = flavor == KernelFlavor::Gpu;
        self.inner.gpu_flavor.store(gpu, Ordering::Relaxed);
    }

    /// How this device's kernels read F16 elements.
    pub fn f16_reads(&self) -> F16Reads {
        F16Reads::from_code(self.inner.f16_reads.load(Ordering::Relaxed))
    }

    /// Overrides how kernels read F16 elements (to test one path against another, as CI
    /// does); kernels compiled from now on take it. `F16Reads::Native` on an adapter without
    /// `SHADER_F16` is an error, and the device keeps the path it had.
    pub fn set_f16_reads(&self, reads: F16Reads) -> Result<()> {
        check_f16_reads(reads, self.inner.shader_f16, "Device::set_f16_reads")?;
        let code = reads.code();
        if self.inner.f16_reads.swap(code, Ordering::Relaxed) != code {
            let mut pipelines = lock(&self.inner.pipelines);
            self.inner.in_context(|| pipelines.clear());
        }
        Ok(())
    }

    /// The largest tensor, in bytes, this adapter holds (its largest buffer, at most 4 GiB).
    /// Larger tensors are an `Error::TooLarge`.
    pub fn max_tensor_bytes(&self) -> u64 {
        self.inner.max_buffer_bytes()
    }

    /// The most bytes one kernel binds of a buffer (128 MiB on lavapipe and in browsers). Ops
    /// on larger tensors bind windows of them where the op allows (elementwise ops, copies,
    /// fills, optimizer updates, `accumulate_grad`, `index_select` / `Embedding` along their
    /// rows); the others are an `Error::TooLarge` naming the op.
    pub fn max_binding_bytes(&self) -> u64 {
        self.inner.max_binding_bytes()
    }

    /// Releases every pooled buffer back to the driver. Buffers in use are unaffected.
    pub fn empty_pool(&self) {
        let mut pool = lock(&self.inner.pool);
        self.inner.in_context(|| pool.clear());
    }

    /// True when both handles are the same device.
    pub fn same(a: &Device, b: &Device) -> bool {
        Arc::ptr_eq(&a.inner, &b.inner)
    }
}

impl DeviceInner {
    pub(crate) fn new_storage_id(&self) -> u64 {
        self.next_storage_id.fetch_add(1, Ordering::Relaxed)
    }

    /// The largest buffer the device makes, in bytes.
    pub(crate) fn max_buffer_bytes(&self) -> u64 {
        self.limits.max_buffer_size.min(MAX_TENSOR_BYTES)
    }

    /// The offset alignment of a bound window, in bytes.
    pub(crate) fn binding_alignment(&self) -> u64 {
        self.limits.min_storage_buffer_offset_alignment as u64
    }

    /// The largest range one kernel may bind, in bytes.
    pub(crate) fn max_binding_bytes(&self) -> u64 {
        self.limits
            .max_storage_buffer_binding_size
            .min(self.limits.max_buffer_size)
    }

    /// The most bytes of elements a window may cover and still fit one binding wherever they
    /// start: a window begins at the alignment boundary before its first element
    /// (`Tensor::window`), and the binding is a multiple of 16, so its rounding up to whole
    /// 16-byte groups never passes it.
    pub(crate) fn window_bytes(&self) -> u64 {
        self.max_binding_bytes() - self.binding_alignment()
    }

    /// Runs `f`, a wgpu call that takes the GL backend's context lock (a submission, a poll, a
    /// queue write, creating a pipeline or a buffer, unmapping or releasing one), under
    /// `context_lock`. wgpu's GL backend panics when a thread waits more than 6 s for its
    /// context lock ("Could not lock adapter context"), as one does behind another thread's
    /// cold pipeline link on a slow machine; threads wait on `context_lock` instead, with no
    /// timeout. It also keeps a poll from racing a submission, which wgpu-core asserts on.
    pub(crate) fn in_context<T>(&self, f: impl FnOnce() -> T) -> T {
        let _context = lock(&self.context_lock);
        f()
    }

    /// Holds `context_lock` until the guard drops: tests use it to see that a path waits for
    /// the lock.
    #[cfg(test)]
    pub(crate) fn hold_context(&self) -> MutexGuard<'_, ()> {
        lock(&self.context_lock)
    }

    /// Creates a buffer (under `context_lock`: see [`DeviceInner::in_context`]).
    pub(crate) fn create_buffer(&self, desc: &wgpu::BufferDescriptor) -> wgpu::Buffer {
        self.in_context(|| self.device.create_buffer(desc))
    }

    /// The size of the buffer [`DeviceInner::alloc`] gives a tensor of `bytes` bytes: its
    /// size class (what a kernel binds when it binds the tensor whole).
    pub(crate) fn buffer_bytes(&self, bytes: u64) -> u64 {
        size_class(bytes).min(self.max_buffer_bytes().max(bytes))
    }

    /// A storage buffer of at least `bytes` bytes, from the pool when it has one of that size
    /// class. Its contents are undefined.
    pub(crate) fn alloc(&self, op: &'static str, bytes: u64) -> Result<wgpu::Buffer> {
        let limit = self.max_buffer_bytes();
        if bytes > limit {
            return Err(Error::TooLarge { op, bytes, limit });
        }
        let class = self.buffer_bytes(bytes);
        let pooled = lock(&self.pool).take(class);
        let buffer = match pooled {
            Some(buffer) => buffer,
            None => {
                let buffer = self.create_buffer(&wgpu::BufferDescriptor {
                    label: Some(op),
                    size: class,
                    usage: wgpu::BufferUsages::STORAGE
                        | wgpu::BufferUsages::COPY_SRC
                        | wgpu::BufferUsages::COPY_DST,
                    mapped_at_creation: false,
                });
                self.take_error(op)?;
                lock(&self.pool).note_created(class);
                buffer
            }
        };
        if self.poisons_buffers() {
            // Recorded like any write, so it lands after the work that read the buffer last.
            self.upload(op, &buffer, &vec![0xFF; class as usize])?;
        }
        Ok(buffer)
    }

    /// Whether every buffer handed out is filled with NaN first (`WGRAD_POISON_BUFFERS`):
    /// captured plans then fill their arenas so before each replay.
    pub(crate) fn poisons_buffers(&self) -> bool {
        self.poison_buffers.load(Ordering::Relaxed)
    }

    /// Turns `WGRAD_POISON_BUFFERS` on or off for this device (tests of it).
    #[cfg(test)]
    pub(crate) fn set_poison_buffers(&self, on: bool) {
        self.poison_buffers.store(on, Ordering::Relaxed);
    }

    /// Takes back a buffer whose last tensor has dropped. Work already recorded that reads
    /// it still runs first: every later use is recorded after it on the same queue.
    pub(crate) fn release(&self, buffer: wgpu::Buffer) {
        lock(&self.pool).give_back(buffer);
    }

    /// Drops the generated kernels no captured plan holds any more (see
    /// [`pipelines::GENERATED`]).
    pub(crate) fn release_unheld_generated_pipelines(&self) {
        let mut pipelines = lock(&self.pipelines);
        self.in_context(|| pipelines.release_unheld_generated());
    }

    /// The compiled pipeline of `kernel`, compiling it at its first use.
    pub(crate) fn pipeline(&self, kernel: &PipelineSource) -> Arc<CachedPipeline> {
        let f16_reads = F16Reads::from_code(self.f16_reads.load(Ordering::Relaxed));
        let mut pipelines = lock(&self.pipelines);
        pipelines.get_or_compile(&self.device, &self.context_lock, f16_reads, kernel)
    }

    /// Returns the first error wgpu has reported since the last check, attributed to `op`.
    pub(crate) fn take_error(&self, op: &str) -> Result<()> {
        let mut errors = lock(&self.errors);
        if errors.is_empty() {
            return Ok(());
        }
        let msg = errors.join("; ");
        errors.clear();
        Err(Error::Device {
            op: op.to_string(),
            msg,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::adapter::{
        backends_from, binding_bytes_from, f16_reads_from, kernel_flavor_from, poison_buffers_from,
        subgroups_from, workgroup_storage_from,
    };
    use super::{Device, F16Reads, KernelFlavor};

    #[test]
    fn wgrad_f16_reads_picks_the_path_or_is_an_error() {
        let reads = |v: &str| f16_reads_from(Some(v.into()));
        assert_eq!(reads("hardware").unwrap(), Some(F16Reads::Hardware));
        assert_eq!(reads("Integer").unwrap(), Some(F16Reads::Integer));
        assert_eq!(reads("NATIVE").unwrap(), Some(F16Reads::Native));
        assert_eq!(f16_reads_from(None).unwrap(), None);
        let err = reads("fast").unwrap_err().to_string();
        assert!(
            err.contains("WGRAD_F16_READS") && err.contains("fast") && err.contains("native"),
            "{err}"
        );
    }

    #[test]
    fn wgrad_kernel_flavor_picks_the_kernels_or_is_an_error() {
        let flavor = |v: &str| kernel_flavor_from(Some(v.into()));
        assert_eq!(flavor("gpu").unwrap(), Some(KernelFlavor::Gpu));
        assert_eq!(flavor("CPU").unwrap(), Some(KernelFlavor::Cpu));
        assert_eq!(kernel_flavor_from(None).unwrap(), None);
        let err = flavor("fast").unwrap_err().to_string();
        assert!(
            err.contains("WGRAD_KERNEL_FLAVOR") && err.contains("fast"),
            "{err}"
        );
    }

    #[test]
    fn wgrad_subgroups_turns_them_off_or_is_an_error() {
        let subgroups = |v: &str| subgroups_from(Some(v.into()));
        assert_eq!(subgroups("off").unwrap(), Some(false));
        assert_eq!(subgroups("ON").unwrap(), Some(true));
        assert_eq!(subgroups_from(None).unwrap(), None);
        let err = subgroups("0").unwrap_err().to_string();
        assert!(
            err.contains("WGRAD_SUBGROUPS") && err.contains("\"0\"") && err.contains("off"),
            "{err}"
        );
    }

    #[test]
    fn wgrad_workgroup_storage_caps_it_at_16_kib_or_more_or_is_an_error() {
        let cap = |v: &str| workgroup_storage_from(Some(v.into()));
        assert_eq!(cap("16384").unwrap(), Some(16384));
        assert_eq!(workgroup_storage_from(None).unwrap(), None);
        for bad in ["16k", "8192", "0"] {
            let err = cap(bad).unwrap_err().to_string();
            assert!(
                err.contains("WGRAD_WORKGROUP_STORAGE") && err.contains(&format!("{bad:?}")),
                "{err}"
            );
        }
    }

    #[test]
    fn wgrad_max_binding_bytes_caps_it_at_256_or_more_in_16s_or_is_an_error() {
        let cap = |v: &str| binding_bytes_from(Some(v.into()));
        assert_eq!(cap("256").unwrap(), Some(256));
        assert_eq!(cap(" 1048576 ").unwrap(), Some(1 << 20));
        assert_eq!(binding_bytes_from(None).unwrap(), None);
        for bad in ["4k", "252", "4100", "0", "-4096"] {
            let err = cap(bad).unwrap_err().to_string();
            assert!(
                err.contains("WGRAD_MAX_BINDING_BYTES") && err.contains(&format!("{bad:?}")),
                "{err}"
            );
        }
    }

    #[test]
    fn wgrad_poison_buffers_turns_it_on_or_is_an_error() {
        let poison = |v: &str| poison_buffers_from(Some(v.into()));
        assert!(poison("on").unwrap());
        assert!(!poison("OFF").unwrap());
        assert!(!poison_buffers_from(None).unwrap());
        let err = poison("1").unwrap_err().to_string();
        assert!(
            err.contains("WGRAD_POISON_BUFFERS") && err.contains("\"1\""),
            "{err}"
        );
    }

    /// With poisoning on, a buffer comes out all ones, whether created or taken back from the
    /// pool after a tensor wrote zeros into it.
    #[test]
    fn poisoned_buffers_hold_nan_whether_fresh_or_pooled() {
        let dev = Device::new().unwrap();
        dev.inner.set_poison_buffers(true);
        let bytes = 1 << 10;
        let fresh = dev.inner.alloc("test", bytes).unwrap();
        assert!(dev
            .inner
            .read("test", &fresh, 0, bytes)
            .unwrap()
            .iter()
            .all(|&b| b == 0xFF));
        dev.inner
            .upload("test", &fresh, &vec![0; bytes as usize])
            .unwrap();
        dev.inner.release(fresh);
        let created = dev.stats().buffers_created;
        let pooled = dev.inner.alloc("test", bytes).unwrap();
        assert_eq!(
            dev.stats().buffers_created,
            created,
            "the pool's buffer came back"
        );
        assert!(dev
            .inner
            .read("test", &pooled, 0, bytes)
            .unwrap()
            .iter()
            .all(|&b| b == 0xFF));
    }

    #[test]
    fn wgpu_backend_naming_no_backend_is_an_error() {
        let err = backends_from(Some("foo".into())).unwrap_err().to_string();
        assert!(err.contains("WGPU_BACKEND") && err.contains("foo"), "{err}");
        assert_eq!(
            backends_from(Some("vulkan".into())).unwrap(),
            wgpu::Backends::VULKAN
        );
        assert_eq!(backends_from(None).unwrap(), wgpu::Backends::all());
    }

    /// A batch submitted by itself at the batch limit leaves no open encoder; synchronize must
    /// still wait for it.
    #[test]
    fn synchronize_waits_for_a_batch_submitted_at_the_limit() {
        let dev = Device::new().unwrap();
        dev.synchronize().unwrap();
        let submits = dev.stats().submits;
        let bytes = 16 << 20;
        let src = dev.inner.alloc("test", bytes).unwrap();
        let dst = dev.inner.alloc("test", bytes).unwrap();
        while dev.stats().submits == submits {
            dev.inner.copy("test", (&src, 0), (&dst, 0), bytes).unwrap();
        }
        dev.synchronize().unwrap();
        let status = dev.inner.device.poll(wgpu::PollType::Poll).unwrap();
        assert!(
            status.is_queue_empty(),
            "synchronize returned while submitted work was still running"
        );
    }
}
