//! Choosing an adapter: which backends `WGPU_BACKEND` allows, which kernels
//! `WGRAD_KERNEL_FLAVOR` asks for, how `WGRAD_F16_READS` reads F16 elements, software adapters
//! told apart from GPUs, and the device opened on the chosen adapter with the features and
//! limits wgrad uses.

use super::*;

impl Device {
    /// The best adapter on this machine: a discrete GPU, else an integrated one, else a
    /// software adapter (and then says so through the `log` crate, at info level). Honours
    /// `WGPU_BACKEND` (vulkan, metal, dx12, gl), `WGRAD_ADAPTER=software`,
    /// `WGRAD_KERNEL_FLAVOR` (gpu or cpu: the kernels to run, whatever the adapter) and
    /// `WGRAD_F16_READS` (hardware or integer: see [`F16Reads`]).
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
        let mut limits = adapter.limits();
        if let Some(cap) = workgroup_storage_from_env()? {
            limits.max_compute_workgroup_storage_size =
                limits.max_compute_workgroup_storage_size.min(cap);
        }
        if let Some(cap) = binding_bytes_from_env()? {
            let least = LEAST_WINDOWS * limits.min_storage_buffer_offset_alignment as u64;
            if cap < least {
                return Err(Error::InvalidArgument {
                    op: "Device::new",
                    msg: format!(
                        "WGRAD_MAX_BINDING_BYTES={cap} is under {least}, {LEAST_WINDOWS} times \
                         {}'s offset alignment of a bound window",
                        adapter_info.name
                    ),
                });
            }
            limits.max_storage_buffer_binding_size =
                limits.max_storage_buffer_binding_size.min(cap);
        }
        // Subgroup operations, where the adapter has them, let kernels share loads across a
        // subgroup (matmul on llvmpipe); WGSL's f16 lets them bind F16 tensors as such.
        let wanted = match subgroups_from_env()? {
            Some(false) => wgpu::Features::SHADER_F16,
            _ => wgpu::Features::SUBGROUP | wgpu::Features::SHADER_F16,
        };
        let features = adapter.features() & wanted;
        let shader_f16 = features.contains(wgpu::Features::SHADER_F16);
        let f16_reads = match f16_reads_from_env()? {
            Some(reads) => {
                check_f16_reads(reads, shader_f16, "Device::new (WGRAD_F16_READS)")?;
                reads
            }
            None if shader_f16 => F16Reads::Native,
            None => F16Reads::Hardware,
        };
        let min_subgroup_size = features
            .contains(wgpu::Features::SUBGROUP)
            .then_some(adapter_info.subgroup_min_size);
        let subgroup_size = min_subgroup_size.filter(|&min| min == adapter_info.subgroup_max_size);
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
                min_subgroup_size,
                shader_f16,
                f16_reads: AtomicU8::new(f16_reads.code()),
                poison_buffers: AtomicBool::new(poison_buffers_from_env()?),
                info,
                device,
                queue,
                limits,
                batch_limit,
                params_buffer,
                recorder: Mutex::default(),
                context_lock: Mutex::default(),
                pool: Mutex::default(),
                pipelines: Mutex::default(),
                errors,
                submits: AtomicU64::new(0),
                dispatches: AtomicU64::new(0),
                next_storage_id: AtomicU64::new(1),
            }),
        })
    }
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

pub(super) fn kernel_flavor_from(setting: Option<String>) -> Result<Option<KernelFlavor>> {
    let choices = [("gpu", KernelFlavor::Gpu), ("cpu", KernelFlavor::Cpu)];
    choice_from("WGRAD_KERNEL_FLAVOR", setting, &choices)
}

/// `WGRAD_SUBGROUPS=off` or `=on`: whether the device may use the adapter's subgroup
/// operations (unset: where it has them). Off, every kernel runs its subgroup-free form (how
/// CI runs those on lavapipe, and a way around a driver whose subgroups misbehave).
fn subgroups_from_env() -> Result<Option<bool>> {
    subgroups_from(std::env::var("WGRAD_SUBGROUPS").ok())
}

pub(super) fn subgroups_from(setting: Option<String>) -> Result<Option<bool>> {
    choice_from("WGRAD_SUBGROUPS", setting, &[("on", true), ("off", false)])
}

/// `WGRAD_POISON_BUFFERS=on` or `=off`: whether every buffer the device hands out is first
/// filled with NaN (all bits set), fresh or from the pool (unset: off). A kernel that reads
/// what no kernel wrote (the padding past a row, a pooled buffer's leftovers) then gives NaN
/// or a wrong value every run, instead of a right one on most runs: how CI runs the fuzzer.
fn poison_buffers_from_env() -> Result<bool> {
    poison_buffers_from(std::env::var("WGRAD_POISON_BUFFERS").ok())
}

pub(super) fn poison_buffers_from(setting: Option<String>) -> Result<bool> {
    Ok(choice_from(
        "WGRAD_POISON_BUFFERS",
        setting,
        &[("on", true), ("off", false)],
    )?
    .unwrap_or(false))
}

/// `WGRAD_WORKGROUP_STORAGE=<bytes>`: the most workgroup storage the device requests, below
/// what the adapter offers (unset: all of it; at least WebGPU's 16 KiB). Kernels that would
/// take more fall back to forms that fit, as on an adapter that offers less: how CI runs the
/// matmul's 8-row panels (16 KiB) on lavapipe, which offers 32 KiB.
fn workgroup_storage_from_env() -> Result<Option<u32>> {
    workgroup_storage_from(std::env::var("WGRAD_WORKGROUP_STORAGE").ok())
}

pub(super) fn workgroup_storage_from(setting: Option<String>) -> Result<Option<u32>> {
    let Some(v) = setting else {
        return Ok(None);
    };
    match v.trim().parse::<u32>() {
        Ok(bytes) if bytes >= LEAST_WORKGROUP_STORAGE => Ok(Some(bytes)),
        _ => Err(Error::InvalidArgument {
            op: "Device::new",
            msg: format!(
                "WGRAD_WORKGROUP_STORAGE={v:?}: use a number of bytes of at least \
                 {LEAST_WORKGROUP_STORAGE} (what every WebGPU adapter offers), or unset it"
            ),
        }),
    }
}

/// `WGRAD_MAX_BINDING_BYTES=<bytes>`: the most bytes the device lets one kernel bind, below
/// what the adapter offers (unset: all of it). Ops on larger tensors then bind windows of
/// them, as on an adapter that offers less: how CI runs the windowed paths, which lavapipe
/// needs tensors past 128 MiB to reach, on small tensors (the fuzzer's, a captured step's).
fn binding_bytes_from_env() -> Result<Option<u64>> {
    binding_bytes_from(std::env::var("WGRAD_MAX_BINDING_BYTES").ok())
}

pub(super) fn binding_bytes_from(setting: Option<String>) -> Result<Option<u64>> {
    let Some(v) = setting else {
        return Ok(None);
    };
    match v.trim().parse::<u64>() {
        Ok(bytes) if bytes >= LEAST_BINDING_BYTES && bytes.is_multiple_of(16) => Ok(Some(bytes)),
        _ => Err(Error::InvalidArgument {
            op: "Device::new",
            msg: format!(
                "WGRAD_MAX_BINDING_BYTES={v:?}: use a number of bytes, a multiple of 16 and at \
                 least {LEAST_BINDING_BYTES} (and {LEAST_WINDOWS} times the adapter's offset \
                 alignment), or unset it"
            ),
        }),
    }
}

/// The smallest binding cap `WGRAD_MAX_BINDING_BYTES` takes, on any adapter: small enough
/// that the fuzzer's tensors (a few hundred elements) take several windows.
const LEAST_BINDING_BYTES: u64 = 256;

/// The fewest windows of the adapter's offset alignment a capped binding must hold, so that
/// a window starting at the alignment boundary before its first element still holds some.
const LEAST_WINDOWS: u64 = 8;

/// The workgroup storage every WebGPU adapter offers (its default limit), which wgrad's
/// kernels may take without asking.
pub(crate) const LEAST_WORKGROUP_STORAGE: u32 = 16 << 10;

/// `WGRAD_F16_READS=native`, `=hardware` or `=integer`: how kernels read F16 elements (see
/// [`F16Reads`]); unset, native where the adapter has `SHADER_F16`, else hardware.
fn f16_reads_from_env() -> Result<Option<F16Reads>> {
    f16_reads_from(std::env::var("WGRAD_F16_READS").ok())
}

pub(super) fn f16_reads_from(setting: Option<String>) -> Result<Option<F16Reads>> {
    let choices = [
        ("native", F16Reads::Native),
        ("hardware", F16Reads::Hardware),
        ("integer", F16Reads::Integer),
    ];
    choice_from("WGRAD_F16_READS", setting, &choices)
}

/// The choice the environment variable `var`'s value names (in any case), or `None` when it
/// is unset; a value that names none is an error listing the choices.
fn choice_from<T: Copy>(
    var: &str,
    setting: Option<String>,
    choices: &[(&str, T)],
) -> Result<Option<T>> {
    let Some(v) = setting else {
        return Ok(None);
    };
    match choices
        .iter()
        .find(|(name, _)| v.eq_ignore_ascii_case(name))
    {
        Some(&(_, choice)) => Ok(Some(choice)),
        None => {
            let names: Vec<&str> = choices.iter().map(|(name, _)| *name).collect();
            Err(Error::InvalidArgument {
                op: "Device::new",
                msg: format!("{var}={v:?}: use {}, or unset it", names.join(" or ")),
            })
        }
    }
}

pub(super) fn backends_from(setting: Option<String>) -> Result<wgpu::Backends> {
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

pub(super) fn looks_like_software(name: &str) -> bool {
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
