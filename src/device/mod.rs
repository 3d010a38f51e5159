//! The device layer: adapter choice, the queue, the buffer pool, the pipeline cache, and the one
//! open command encoder that every op records into.
//!
//! Work is recorded, not run: each op appends a dispatch to the open encoder, and the encoder
//! is submitted only when the host needs data (`to_vec`, `item`), at [`Device::synchronize`],
//! when a batch reaches its limit, or after a pipeline's first dispatch (so that a software
//! driver compiles it while the host records on). This is what keeps a chain of small ops from
//! paying a queue submission each.

mod pipelines;
mod pool;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use crate::error::{Error, Result};
use pipelines::PipelineCache;
pub(crate) use pipelines::{declared_bindings, CachedPipeline, GENERATED};
pub(crate) use pool::size_class;
use pool::BufferPool;

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
    /// matmul stages 64x16 panels of A and B in workgroup memory for 64x64 output tiles;
    /// reductions, softmax and cross-entropy give each row a workgroup that reduces in
    /// workgroup memory.
    Gpu,
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
    /// Held around each queue submission and each poll: wgpu-core asserts on a poll that
    /// races another thread's submission.
    queue_lock: Mutex<()>,
    pool: Mutex<BufferPool>,
    pipelines: Mutex<PipelineCache>,
    /// Errors wgpu reported outside any scope, waiting to be returned as `Error::Device`.
    errors: Arc<Mutex<Vec<String>>>,
    /// The subgroup width, when the device has subgroup operations and a fixed width.
    subgroup_size: Option<u32>,
    /// True when the device runs `KernelFlavor::Gpu`.
    gpu_flavor: AtomicBool,
    submits: AtomicU64,
    dispatches: AtomicU64,
    next_storage_id: AtomicU64,
}

/// The open batch: one command encoder, the parameters of its dispatches, and the ops that
/// recorded into it (to name them if the device rejects the batch).
#[derive(Default)]
struct Recorder {
    encoder: Option<wgpu::CommandEncoder>,
    params: Vec<u8>,
    commands: u32,
    ops: Vec<&'static str>,
}

/// The backends `WGPU_BACKEND` names (vulkan, metal, dx12, gl; comma-separated), or all of
/// them when it is unset. A value that names none is an error, not a silent fallback.
fn backends_from_env() -> Result<wgpu::Backends> {
    backends_from(std::env::var("WGPU_BACKEND").ok())
}

/// `WGRAD_KERNEL_FLAVOR=gpu` or `=cpu`: the kernels every device runs, whatever its adapter
/// (how `tools/gpu_check.sh` runs the GPU kernels' tests on a software adapter).
fn kernel_flavor_from_env() -> Result<Option<KernelFlavor>> {
    kernel_flavor_from(std::env::var("WGRAD_KERNEL_FLAVOR").ok())
}

fn kernel_flavor_from(setting: Option<String>) -> Result<Option<KernelFlavor>> {
    match setting {
        None => Ok(None),
        Some(v) if v.eq_ignore_ascii_case("gpu") => Ok(Some(KernelFlavor::Gpu)),
        Some(v) if v.eq_ignore_ascii_case("cpu") => Ok(Some(KernelFlavor::Cpu)),
        Some(v) => Err(Error::InvalidArgument {
            op: "Device::new",
            msg: format!("WGRAD_KERNEL_FLAVOR={v:?}: use gpu or cpu, or unset it"),
        }),
    }
}

fn backends_from(setting: Option<String>) -> Result<wgpu::Backends> {
    match setting {
        Some(value) => {
            let backends = wgpu::Backends::from_comma_list(&value);
            if backends.is_empty() {
                return Err(Error::NoAdapter(format!(
                    "WGPU_BACKEND={value:?} names no backend; use vulkan, metal, dx12 or gl \
                     (comma-separated), or unset it"
                )));
            }
            Ok(backends)
        }
        None => Ok(wgpu::Backends::all()),
    }
}

/// Mesa's device-select Vulkan layer connects to Wayland to order GPUs; without a session
/// (`XDG_RUNTIME_DIR` unset: CI, servers, containers) libwayland then prints two `error:`
/// lines at every start. wgrad ranks adapters itself, so there the layer is switched off
/// (`NODEVICE_SELECT=1`), unless the user has set that variable. This runs when a device is
/// opened, before wgpu starts any thread of its own.
fn quiet_device_select_layer() {
    let headless = std::env::var_os("XDG_RUNTIME_DIR").is_none();
    if headless && std::env::var_os("NODEVICE_SELECT").is_none() {
        std::env::set_var("NODEVICE_SELECT", "1");
    }
}

/// The adapters of `backends`.
fn enumerate(backends: wgpu::Backends) -> Vec<wgpu::Adapter> {
    let instance = wgpu::Instance::new(wgpu::InstanceDescriptor {
        backends,
        flags: wgpu::InstanceFlags::empty().with_env(),
        ..wgpu::InstanceDescriptor::new_without_display_handle()
    });
    pollster::block_on(instance.enumerate_adapters(backends))
}

/// The `(x, y)` grid of a dispatch of `workgroups` workgroups: kernels that need more than
/// one dimension allows fold `y` rows of `x` into a linear workgroup index.
pub(crate) fn workgroup_grid(workgroups: u32) -> (u32, u32) {
    let x = workgroups.min(MAX_WORKGROUPS_PER_DIM);
    (x, workgroups.div_ceil(x))
}

fn looks_like_software(name: &str) -> bool {
    let name = name.to_ascii_lowercase();
    [
        "llvmpipe",
        "lavapipe",
        "softpipe",
        "swiftshader",
        "warp",
        "microsoft basic render",
    ]
    .iter()
    .any(|s| name.contains(s))
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
    /// The best adapter on this machine: a discrete GPU, else an integrated one, else a
    /// software adapter (and then says so through the `log` crate, at info level). Honours
    /// `WGPU_BACKEND`
    /// (vulkan, metal, dx12, gl), `WGRAD_ADAPTER=software` and `WGRAD_KERNEL_FLAVOR` (gpu or
    /// cpu: the kernels to run, whatever the adapter).
    pub fn new() -> Result<Device> {
        let software_only = std::env::var("WGRAD_ADAPTER")
            .map(|v| v.eq_ignore_ascii_case("software"))
            .unwrap_or(false);
        let device = Self::open(software_only)?;
        if device.inner.info.is_software() && !software_only {
            log::info!(
                "no hardware GPU adapter found; using software adapter {}",
                device.inner.info
            );
        }
        Ok(device)
    }

    /// Alias of [`Device::new`].
    pub fn default_device() -> Result<Device> {
        Self::new()
    }

    /// A software adapter (lavapipe, llvmpipe, WARP), or `Error::NoAdapter`. Tests and CI use
    /// it so results do not depend on which GPU a machine has.
    pub fn software() -> Result<Device> {
        Self::open(true)
    }

    fn open(software_only: bool) -> Result<Device> {
        let backends = backends_from_env()?;
        quiet_device_select_layer();
        // The native APIs first; GL only where they find nothing (probing GL starts EGL,
        // which prints errors on machines without a display).
        let native = backends & !wgpu::Backends::GL;
        let mut adapters = if native.is_empty() {
            Vec::new()
        } else {
            enumerate(native)
        };
        if adapters.is_empty() && backends.contains(wgpu::Backends::GL) {
            adapters = enumerate(wgpu::Backends::GL);
        }
        let rank = |a: &wgpu::Adapter| {
            let info = a.get_info();
            let kind = match info.device_type {
                wgpu::DeviceType::DiscreteGpu => 0,
                wgpu::DeviceType::IntegratedGpu => 1,
                wgpu::DeviceType::VirtualGpu => 2,
                wgpu::DeviceType::Other => 3,
                wgpu::DeviceType::Cpu => 4,
            };
            let kind = if looks_like_software(&info.name) {
                4
            } else {
                kind
            };
            // Prefer the native APIs over GL for the same kind of adapter.
            let api = if info.backend == wgpu::Backend::Gl {
                1
            } else {
                0
            };
            (kind, api)
        };
        let adapter = adapters
            .into_iter()
            .filter(|a| !software_only || rank(a).0 == 4)
            .min_by_key(rank)
            .ok_or_else(|| {
                let what = if software_only {
                    "software adapter"
                } else {
                    "adapter"
                };
                Error::NoAdapter(format!(
                    "wgpu found no {what} for backends {backends:?}; {INSTALL_HINT}"
                ))
            })?;
        Self::from_adapter(adapter)
    }

    fn from_adapter(adapter: wgpu::Adapter) -> Result<Device> {
        let adapter_info = adapter.get_info();
        let limits = adapter.limits();
        // Subgroup operations, where the adapter has them, let kernels share loads across a
        // subgroup (matmul on llvmpipe).
        let features = adapter.features() & wgpu::Features::SUBGROUP;
        let subgroup_size = (features.contains(wgpu::Features::SUBGROUP)
            && adapter_info.subgroup_min_size == adapter_info.subgroup_max_size)
            .then_some(adapter_info.subgroup_min_size);
        let (device, queue) = pollster::block_on(adapter.request_device(&wgpu::DeviceDescriptor {
            label: Some("wgrad"),
            required_features: features,
            required_limits: limits.clone(),
            ..Default::default()
        }))
        .map_err(|e| Error::NoAdapter(format!("{}: {e}; {INSTALL_HINT}", adapter_info.name)))?;

        let errors: Arc<Mutex<Vec<String>>> = Arc::default();
        let sink = errors.clone();
        device.on_uncaptured_error(Arc::new(move |e: wgpu::Error| {
            lock(&sink).push(e.to_string())
        }));
        let sink = errors.clone();
        device.set_device_lost_callback(move |reason, msg| {
            lock(&sink).push(format!("device lost ({reason:?}): {msg}"))
        });

        let batch_limit = if adapter_info.backend == wgpu::Backend::Gl {
            16
        } else {
            64
        };
        let params_buffer = device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("wgrad params"),
            size: PARAMS_BYTES * batch_limit as u64,
            usage: wgpu::BufferUsages::UNIFORM | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        let info = DeviceInfo {
            name: adapter_info.name.clone(),
            backend: adapter_info.backend,
            device_type: adapter_info.device_type,
            driver: format!("{} {}", adapter_info.driver, adapter_info.driver_info)
                .trim()
                .to_string(),
        };
        Ok(Device {
            inner: Arc::new(DeviceInner {
                gpu_flavor: AtomicBool::new(
                    kernel_flavor_from_env()?
                        .map_or(!info.is_software(), |f| f == KernelFlavor::Gpu),
                ),
                subgroup_size,
                info,
                device,
                queue,
                limits,
                batch_limit,
                params_buffer,
                recorder: Mutex::default(),
                queue_lock: Mutex::default(),
                pool: Mutex::default(),
                pipelines: Mutex::default(),
                errors,
                submits: AtomicU64::new(0),
                dispatches: AtomicU64::new(0),
                next_storage_id: AtomicU64::new(1),
            }),
        })
    }

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
    /// and a fixed subgroup width (8 on lavapipe).
    pub fn subgroup_size(&self) -> Option<u32> {
        self.inner.subgroup_size
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
        lock(&self.inner.pool).clear();
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

    /// A storage buffer of at least `bytes` bytes, from the pool when it has one of that size
    /// class. Its contents are undefined.
    pub(crate) fn alloc(&self, op: &'static str, bytes: u64) -> Result<wgpu::Buffer> {
        let limit = self.max_buffer_bytes();
        if bytes > limit {
            return Err(Error::TooLarge { op, bytes, limit });
        }
        let class = size_class(bytes).min(limit.max(bytes));
        if let Some(buffer) = lock(&self.pool).take(class) {
            return Ok(buffer);
        }
        let buffer = self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some(op),
            size: class,
            usage: wgpu::BufferUsages::STORAGE
                | wgpu::BufferUsages::COPY_SRC
                | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        self.take_error(op)?;
        lock(&self.pool).note_created(class);
        Ok(buffer)
    }

    /// Takes back a buffer whose last tensor has dropped. Work already recorded that reads
    /// it still runs first: every later use is recorded after it on the same queue.
    pub(crate) fn release(&self, buffer: wgpu::Buffer) {
        lock(&self.pool).give_back(buffer);
    }

    /// Drops the generated kernels no captured plan holds any more (see
    /// [`pipelines::GENERATED`]).
    pub(crate) fn release_unheld_generated_pipelines(&self) {
        lock(&self.pipelines).release_unheld_generated();
    }

    /// The compiled pipeline of `kernel`, compiling it at its first use.
    pub(crate) fn pipeline(&self, kernel: &PipelineSource) -> Arc<CachedPipeline> {
        lock(&self.pipelines).get_or_compile(
            &self.device,
            kernel.key,
            kernel.module_key,
            kernel.entry,
            kernel.source,
        )
    }

    /// The bind group of one dispatch of `cached`: its params slot (`PARAMS_BYTES` at an
    /// offset of a uniform buffer) at binding 0 and each `(binding, buffer)` as storage. Eager
    /// dispatches and captured replays both bind through here.
    pub(crate) fn bind_group(
        &self,
        op: &'static str,
        cached: &CachedPipeline,
        (params, params_offset): (&wgpu::Buffer, u64),
        buffers: &[(u32, BufferSlice)],
    ) -> wgpu::BindGroup {
        let mut entries = vec![wgpu::BindGroupEntry {
            binding: 0,
            resource: wgpu::BindingResource::Buffer(wgpu::BufferBinding {
                buffer: params,
                offset: params_offset,
                size: wgpu::BufferSize::new(PARAMS_BYTES),
            }),
        }];
        for (binding, slice) in buffers {
            entries.push(wgpu::BindGroupEntry {
                binding: *binding,
                resource: wgpu::BindingResource::Buffer(wgpu::BufferBinding {
                    buffer: slice.buffer,
                    offset: slice.offset,
                    size: wgpu::BufferSize::new(slice.size),
                }),
            });
        }
        self.device.create_bind_group(&wgpu::BindGroupDescriptor {
            label: Some(op),
            layout: &cached.layout,
            entries: &entries,
        })
    }

    /// Records one dispatch of `cached` over `workgroups` workgroups, binding `params` as the
    /// uniform at binding 0 and each `(binding, buffer)` as storage.
    pub(crate) fn dispatch(
        &self,
        op: &'static str,
        cached: &CachedPipeline,
        buffers: &[(u32, BufferSlice)],
        params: &[u8],
        workgroups: u32,
    ) -> Result<()> {
        let limit = self.max_binding_bytes();
        if let Some((_, big)) = buffers.iter().find(|(_, b)| b.size > limit) {
            return Err(Error::TooLarge {
                op,
                bytes: big.size,
                limit,
            });
        }
        // The last slot stays 0: `pu` in shaders/common.wgsl indexes through it.
        assert!(
            params.len() < PARAMS_BYTES as usize,
            "{op}: too many kernel params"
        );
        if workgroups == 0 {
            return Ok(());
        }
        let mut rec = lock(&self.recorder);
        let offset = rec.params.len() as u64;
        rec.params.extend_from_slice(params);
        rec.params.resize((offset + PARAMS_BYTES) as usize, 0);

        let bind_group = self.bind_group(op, cached, (&self.params_buffer, offset), buffers);

        let (x, y) = workgroup_grid(workgroups);
        let encoder = self.open_encoder(&mut rec);
        {
            let mut pass = encoder.begin_compute_pass(&wgpu::ComputePassDescriptor {
                label: Some(op),
                timestamp_writes: None,
            });
            pass.set_pipeline(&cached.pipeline);
            pass.set_bind_group(0, &bind_group, &[]);
            pass.dispatch_workgroups(x, y, 1);
        }
        self.dispatches.fetch_add(1, Ordering::Relaxed);
        self.take_error(op)?;
        // A pipeline's first dispatch submits the batch at once: software drivers compile a
        // pipeline's machine code on their queue thread when it first runs (lavapipe: 40 ms
        // to 0.45 s each), and submitted now that compile overlaps the host's recording of
        // what follows (and creating the next pipelines), instead of waiting for the batch
        // to fill. Only a model's first steps have new pipelines.
        let first_use = cached.unused.swap(false, Ordering::Relaxed);
        self.end_command(rec, op, first_use)
    }

    /// Records a copy of `data` into `target` at byte 0, ordered after all recorded work.
    /// (A `queue.write_buffer` would land before work already recorded into the open encoder,
    /// which may still read a pooled buffer's previous contents.)
    pub(crate) fn upload(
        &self,
        op: &'static str,
        target: &wgpu::Buffer,
        data: &[u8],
    ) -> Result<()> {
        if data.is_empty() {
            return Ok(());
        }
        let staging = self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("wgrad upload"),
            size: data.len() as u64,
            usage: wgpu::BufferUsages::COPY_SRC,
            mapped_at_creation: true,
        });
        staging
            .get_mapped_range_mut(..)
            .map_err(|e| Error::Device {
                op: op.to_string(),
                msg: e.to_string(),
            })?
            .copy_from_slice(data);
        staging.unmap();
        let mut rec = lock(&self.recorder);
        self.open_encoder(&mut rec).copy_buffer_to_buffer(
            &staging,
            0,
            target,
            0,
            data.len() as u64,
        );
        self.take_error(op)?;
        self.end_command(rec, op, false)
    }

    /// Records a buffer-to-buffer copy of `bytes` bytes, ordered after all recorded work.
    pub(crate) fn copy(
        &self,
        op: &'static str,
        src: (&wgpu::Buffer, u64),
        dst: (&wgpu::Buffer, u64),
        bytes: u64,
    ) -> Result<()> {
        if bytes == 0 {
            return Ok(());
        }
        let mut rec = lock(&self.recorder);
        self.open_encoder(&mut rec)
            .copy_buffer_to_buffer(src.0, src.1, dst.0, dst.1, bytes);
        self.take_error(op)?;
        self.end_command(rec, op, false)
    }

    /// Copies `bytes` bytes at `offset` of `src` back to the host: submits everything
    /// recorded so far and waits for it.
    pub(crate) fn read(
        &self,
        op: &'static str,
        src: &wgpu::Buffer,
        offset: u64,
        bytes: u64,
    ) -> Result<Vec<u8>> {
        if bytes == 0 {
            self.flush()?;
            return Ok(Vec::new());
        }
        let staging = self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("wgrad readback"),
            size: bytes,
            usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        {
            let mut rec = lock(&self.recorder);
            self.open_encoder(&mut rec)
                .copy_buffer_to_buffer(src, offset, &staging, 0, bytes);
            rec.ops.push(op);
        }
        let submission = self.flush()?;
        let mapped: Arc<Mutex<Option<std::result::Result<(), wgpu::BufferAsyncError>>>> =
            Arc::default();
        let slot = mapped.clone();
        staging.map_async(wgpu::MapMode::Read, .., move |r| *lock(&slot) = Some(r));
        self.wait(submission)?;
        while lock(&mapped).is_none() {
            self.poll_slice(None)?;
        }
        if let Some(Err(e)) = lock(&mapped).take() {
            return Err(Error::Device {
                op: op.to_string(),
                msg: e.to_string(),
            });
        }
        let data = staging
            .get_mapped_range(..)
            .map_err(|e| Error::Device {
                op: op.to_string(),
                msg: e.to_string(),
            })?
            .to_vec();
        staging.unmap();
        Ok(data)
    }

    fn open_encoder<'r>(&self, rec: &'r mut Recorder) -> &'r mut wgpu::CommandEncoder {
        rec.encoder.get_or_insert_with(|| {
            self.device
                .create_command_encoder(&wgpu::CommandEncoderDescriptor {
                    label: Some("wgrad batch"),
                })
        })
    }

    /// Counts one recorded command and submits the batch when it is full, or at once when
    /// `submit_now`.
    fn end_command(
        &self,
        mut rec: MutexGuard<'_, Recorder>,
        op: &'static str,
        submit_now: bool,
    ) -> Result<()> {
        rec.commands += 1;
        if rec.ops.last() != Some(&op) {
            rec.ops.push(op);
        }
        if submit_now || rec.commands >= self.batch_limit {
            self.submit(rec)?;
        }
        Ok(())
    }

    /// Submits `commands`, recorded outside the open batch (a captured step's replay), after
    /// the open batch, so that it runs after all work recorded before it. `queue_writes` are
    /// staged first: they land before `commands` run. Counts `dispatches`.
    pub(crate) fn submit_commands(
        &self,
        op: &'static str,
        queue_writes: &[(&wgpu::Buffer, u64, &[u8])],
        commands: wgpu::CommandBuffer,
        dispatches: u64,
    ) -> Result<()> {
        self.flush()?;
        for (buffer, offset, data) in queue_writes {
            self.queue.write_buffer(buffer, *offset, data);
        }
        {
            let _queue = lock(&self.queue_lock);
            self.queue.submit([commands]);
        }
        self.submits.fetch_add(1, Ordering::Relaxed);
        self.dispatches.fetch_add(dispatches, Ordering::Relaxed);
        self.take_error(op)
    }

    /// Writes `data` into `buffer` at `offset` before the next submission runs (for buffers
    /// no recorded work reads: a captured plan's own params and staging buffers).
    pub(crate) fn write_buffer(&self, buffer: &wgpu::Buffer, offset: u64, data: &[u8]) {
        self.queue.write_buffer(buffer, offset, data);
    }

    /// Submits the open batch, if any. Returns the submission to wait on.
    pub(crate) fn flush(&self) -> Result<Option<wgpu::SubmissionIndex>> {
        self.submit(lock(&self.recorder))
    }

    fn submit(&self, mut rec: MutexGuard<'_, Recorder>) -> Result<Option<wgpu::SubmissionIndex>> {
        let Some(encoder) = rec.encoder.take() else {
            return Ok(None);
        };
        if !rec.params.is_empty() {
            self.queue.write_buffer(&self.params_buffer, 0, &rec.params);
        }
        let submission = {
            let _queue = lock(&self.queue_lock);
            self.queue.submit([encoder.finish()])
        };
        self.submits.fetch_add(1, Ordering::Relaxed);
        let ops = std::mem::take(&mut rec.ops);
        rec.params.clear();
        rec.commands = 0;
        drop(rec);
        if !lock(&self.errors).is_empty() {
            let mut names: Vec<&str> = Vec::new();
            for op in ops {
                if !names.contains(&op) {
                    names.push(op);
                }
            }
            self.take_error(&format!(
                "one of the ops submitted together ({})",
                names.join(", ")
            ))?;
        }
        Ok(Some(submission))
    }

    /// Waits in bounded slices, so no poll holds GL's context lock long, for `submission`, or
    /// when there is none (nothing was open to submit) for everything submitted before: a batch
    /// that the batch limit submitted by itself may still be running.
    fn wait(&self, submission: Option<wgpu::SubmissionIndex>) -> Result<()> {
        while !self.poll_slice(submission.clone())? {}
        self.take_error("synchronize")
    }

    /// One bounded poll: `true` when the submission (or the whole queue) is done, `false`
    /// when the time slice ran out first.
    fn poll_slice(&self, submission: Option<wgpu::SubmissionIndex>) -> Result<bool> {
        let wait = wgpu::PollType::Wait {
            submission_index: submission,
            timeout: Some(POLL_SLICE),
        };
        let _queue = lock(&self.queue_lock);
        match self.device.poll(wait) {
            Ok(_) => Ok(true),
            Err(wgpu::PollError::Timeout) => Ok(false),
            Err(e) => Err(Error::Device {
                op: "synchronize".into(),
                msg: e.to_string(),
            }),
        }
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
    use super::{backends_from, kernel_flavor_from, Device, KernelFlavor};

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
