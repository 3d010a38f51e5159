//! A plan: one captured step's commands laid out for replay. Laying out gives every
//! intermediate an arena buffer (by liveness, `memory.rs`), writes each launch's params into
//! one buffer once, makes the bind groups of launches whose buffers never change, and gives
//! each upload its staging buffer. Guards are in `guard.rs`, the replay in `replay.rs`.

use std::collections::HashMap;
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use super::guard::{IndexGuard, InputSignature};
use super::ir::{Command, Draft, Kind, Launch, Loss, Shell, Slot};
use super::memory;
use super::replay::Prepared;
use crate::device::{BufferSlice, Device, PARAMS_BYTES};
use crate::error::Result;
use crate::tensor::command::{EncodedLaunch, Upload};
use crate::tensor::{Storage, TensorInner};

/// A captured step, ready to replay.
pub(crate) struct Plan {
    pub(super) device: Device,
    pub(super) signature: InputSignature,
    pub(super) index_guard: IndexGuard,
    pub(super) flags: Vec<(Arc<AtomicBool>, bool)>,
    pub(super) requires_grad: Vec<(Weak<TensorInner>, bool)>,
    pub(super) slots: Vec<Slot>,
    pub(super) kinds: Vec<Kind>,
    /// The commands, laid out: each launch and upload encoded.
    pub(super) commands: Vec<Command>,
    /// The commands with host work at each replay, in order: hooks, and launches and uploads
    /// whose params or data are computed again (most commands have none).
    pub(super) host_work: Vec<usize>,
    pub(super) params_buffer: Option<wgpu::Buffer>,
    pub(super) loss: Loss,
    pub(super) dispatches: u64,
    /// Host time of the latest replay up to its submission.
    pub(super) last_to_submit: Duration,
    /// The next replay's commands, encoded right after the latest replay was submitted.
    pub(super) prepared: Option<Prepared>,
    /// Whether the latest replay submitted commands encoded ahead.
    pub(super) last_encoded_ahead: bool,
    /// The arena's buffers (in `kinds` as `Kind::Fixed` too): filled with NaN before each
    /// replay under `WGRAD_POISON_BUFFERS`, so that a kernel reading an intermediate before
    /// the step writes it reads NaN, not the value the previous replay left there.
    pub(super) arena: Vec<Arc<Storage>>,
}

impl Plan {
    /// The device the plan runs on.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Whether the plan holds the only handle to a leaf it trains: the user replaced or
    /// dropped it (a new model or optimizer swapped in), so a replay would train a tensor
    /// nobody can see. Such a plan must go; the call captures afresh.
    pub fn is_orphaned(&self) -> bool {
        let mut held: HashMap<*const TensorInner, usize> = HashMap::new();
        for slot in &self.slots {
            *held.entry(Arc::as_ptr(&slot.leaf().inner)).or_default() += 1;
        }
        if let Loss::Fixed(t) = &self.loss {
            if let Some(n) = held.get_mut(&Arc::as_ptr(&t.inner)) {
                *n += 1;
            }
        }
        self.slots.iter().any(|slot| {
            let leaf = &slot.leaf().inner;
            Arc::strong_count(leaf) <= held[&Arc::as_ptr(leaf)]
        })
    }
}

/// Lays out a draft: arena buffers for intermediates (by liveness), copies for inputs, the
/// params buffer, and bind groups for the launches whose buffers never change.
pub(crate) fn lay_out(draft: Draft, shell: Shell) -> Result<Plan> {
    const OP: &str = "capture::Step";
    let Draft {
        mut commands,
        values,
    } = draft;
    let device = shell.device.clone();

    let (kinds, arena) = place_intermediates(&commands, values, &device)?;
    let (params_buffer, launches) = encode_commands(&mut commands, &kinds, &device);
    let plan = Plan {
        device,
        signature: shell.signature,
        index_guard: shell.index_guard,
        flags: shell.flags,
        requires_grad: shell.requires_grad,
        slots: shell.slots,
        kinds,
        host_work: host_work(&commands),
        commands,
        params_buffer,
        loss: shell.loss,
        dispatches: launches,
        last_to_submit: Duration::ZERO,
        prepared: None,
        last_encoded_ahead: false,
        arena,
    };
    // A failed encoding drops the plan, which releases what it made (see `Drop for Plan`).
    plan.device.inner.take_error(OP)?;
    Ok(plan)
}

impl Drop for Plan {
    /// Releases the wgpu objects the plan made or may hold last (its params and staging
    /// buffers, its kernels) under the device's context lock (`DeviceInner::in_context`): on
    /// GL, destroying a buffer or a pipeline takes the adapter's context, and wgpu panics when
    /// a thread waits for it more than 6 s, as one dropping a plan does behind another
    /// thread's cold pipeline link. Clones keep those objects alive while the rest of the plan
    /// drops outside the lock (its storages go back to the pool, whose lock is taken before
    /// the context's, never after); dropping the clones releases them.
    fn drop(&mut self) {
        let mut buffers: Vec<wgpu::Buffer> = self.params_buffer.take().into_iter().collect();
        let mut pipelines = Vec::new();
        for command in &self.commands {
            match command {
                Command::Launch(l) => pipelines.push(l.pipeline.clone()),
                Command::Upload(u) => buffers.extend(u.staging.clone()),
                Command::Copy(_) | Command::Hook(_) => {}
            }
        }
        drop(self.prepared.take());
        drop(std::mem::take(&mut self.commands));
        self.device.inner.in_context(|| drop((buffers, pipelines)));
    }
}

/// Encodes `commands` for replay (their values placed as `kinds` says): each launch gets its
/// slot of the params buffer (written once here, one slot each) and, when every buffer it
/// binds is fixed, its bind group, once; each upload its staging buffer. Returns the params
/// buffer and the launch count.
fn encode_commands(
    commands: &mut [Command],
    kinds: &[Kind],
    device: &Device,
) -> (Option<wgpu::Buffer>, u64) {
    let inner = &device.inner;
    let launches = commands
        .iter()
        .filter(|c| matches!(c, Command::Launch(_)))
        .count() as u64;
    let params_buffer = (launches > 0).then(|| {
        inner.create_buffer(&wgpu::BufferDescriptor {
            label: Some("wgrad plan params"),
            size: PARAMS_BYTES * launches,
            usage: wgpu::BufferUsages::UNIFORM | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        })
    });
    let mut static_params = vec![0u8; (PARAMS_BYTES * launches) as usize];
    let mut launch_index = 0u64;
    for command in commands.iter_mut() {
        match command {
            Command::Launch(l) => {
                let params_offset = launch_index * PARAMS_BYTES;
                launch_index += 1;
                let at = params_offset as usize;
                static_params[at..at + l.params.len()].copy_from_slice(&l.params);
                let params = params_buffer.as_ref().expect("launches have params");
                l.encoded = Some(encoded_launch(l, kinds, device, params, params_offset));
            }
            Command::Upload(upload) => {
                let staging = inner.create_buffer(&wgpu::BufferDescriptor {
                    label: Some("wgrad plan upload"),
                    size: (upload.data.len() as u64).max(4),
                    usage: wgpu::BufferUsages::COPY_SRC | wgpu::BufferUsages::COPY_DST,
                    mapped_at_creation: false,
                });
                inner.write_buffer(&staging, 0, &upload.data);
                upload.staging = Some(staging);
            }
            Command::Copy(_) | Command::Hook(_) => {}
        }
    }
    if let Some(buffer) = &params_buffer {
        inner.write_buffer(buffer, 0, &static_params);
    }
    (params_buffer, launches)
}

/// A launch's encoding, with its bind group made now when every buffer it binds is fixed
/// (else each replay makes one).
fn encoded_launch(
    l: &Launch,
    kinds: &[Kind],
    device: &Device,
    params: &wgpu::Buffer,
    params_offset: u64,
) -> EncodedLaunch {
    let fixed: Option<Vec<&wgpu::Buffer>> = l
        .bindings
        .iter()
        .map(|&(_, v)| match &kinds[v] {
            Kind::Fixed(s) => Some(s.buffer()),
            _ => None,
        })
        .collect();
    let bind_group = fixed.map(|buffers| bind_group(device, l, params, params_offset, &buffers));
    EncodedLaunch {
        params_offset,
        bind_group,
        recent: Mutex::new(Vec::new()),
    }
}

/// The indices of the commands a replay runs host work for (see [`Plan::host_work`]).
fn host_work(commands: &[Command]) -> Vec<usize> {
    (commands.iter().enumerate())
        .filter(|(_, command)| match command {
            Command::Hook(_) => true,
            Command::Launch(l) => l.dynamic_params.is_some(),
            Command::Upload(u) => u.dynamic.is_some(),
            Command::Copy(_) => false,
        })
        .map(|(i, _)| i)
        .collect()
}

/// What laying out made for a launch of the plan.
pub(super) fn encoding(l: &Launch) -> &EncodedLaunch {
    l.encoded.as_ref().expect("a plan's launches are encoded")
}

/// The staging buffer laying out made for an upload of the plan.
pub(super) fn staging(upload: &Upload<usize>) -> &wgpu::Buffer {
    upload
        .staging
        .as_ref()
        .expect("a plan's uploads are encoded")
}

/// `values` with every intermediate placed in an arena buffer (see `capture::memory`): one
/// storage per arena buffer, shared by the intermediates whose lives do not meet; and those
/// storages.
fn place_intermediates(
    commands: &[Command],
    mut values: Vec<Kind>,
    device: &Device,
) -> Result<(Vec<Kind>, Vec<Arc<Storage>>)> {
    let uses = commands.iter().enumerate().flat_map(|(at, command)| {
        let used: Vec<usize> = command.buffers().into_iter().copied().collect();
        used.into_iter().map(move |v| (at, v))
    });
    let live = memory::liveness(values.len(), uses);
    let intermediates: Vec<(usize, u64)> = values
        .iter()
        .enumerate()
        .filter_map(|(v, kind)| match kind {
            Kind::Intermediate { bytes } => Some((v, *bytes)),
            _ => None,
        })
        .collect();
    let arena = memory::plan_arena(&intermediates, &live);
    let buffers = arena
        .buffer_bytes
        .iter()
        .map(|&bytes| Storage::alloc("capture::Step", bytes, device).map(Arc::new))
        .collect::<Result<Vec<_>>>()?;
    for (&(v, _), buffer) in intermediates.iter().zip(&arena.buffer_of) {
        if let Some(b) = buffer {
            values[v] = Kind::Fixed(buffers[*b].clone());
        }
    }
    Ok((values, buffers))
}

/// The bind group of launch `l` over `buffers` (one per binding, in order): each bound whole,
/// or as the window the launch bound of it at capture.
pub(super) fn bind_group(
    device: &Device,
    l: &Launch,
    params: &wgpu::Buffer,
    params_offset: u64,
    buffers: &[&wgpu::Buffer],
) -> wgpu::BindGroup {
    let slices: Vec<(u32, BufferSlice)> = (l.bindings.iter().zip(buffers))
        .map(|(&(binding, _), buffer)| {
            let range = l.range(binding, buffer.size());
            let slice = BufferSlice {
                buffer,
                offset: range.offset,
                size: range.bytes,
            };
            (binding, slice)
        })
        .collect();
    (device.inner).bind_group(l.op, &l.pipeline, (params, params_offset), &slices)
}
