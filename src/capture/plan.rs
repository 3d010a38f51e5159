//! A plan: one captured step's launches, with a buffer for every value, replayed in one
//! submission without running the step's closure.
//!
//! Building a plan sorts every storage the tape names into one of five kinds:
//! - **fixed**: storages from before the step (parameters, optimizer state, constants); the
//!   plan keeps them alive and binds them as they are;
//! - **input**: the storages of the step's inputs; a replay binds the storages of the inputs
//!   it is given (same layouts, by the guard), so a batch is never copied;
//! - **grad in**: a leaf's grad as the engine read it (S-14): bound at each replay to whatever
//!   storage that leaf's grad has then;
//! - **output**: the loss and the grads the step installs; a replay gives each a fresh
//!   storage, which it hands out afterwards as the engine's apply stage would (S-2);
//! - **intermediate**: made and dropped within the step; they share the plan's arena, buffers
//!   assigned by liveness once, at build.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use crate::autograd::is_grad_enabled;
use crate::device::{workgroup_grid, BufferSlice, CachedPipeline, Device, PARAMS_BYTES};
use crate::error::{Error, Result};
use crate::tensor::command::{self, EncodedLaunch, Upload};
use crate::tensor::tape::{SlotEvent, Tape, TapedStorage};
use crate::tensor::{DType, Layout, Storage, Tensor, TensorInner};

use super::memory;

/// What a captured step's inputs looked like: a replay needs the same, since shapes and
/// strides are baked into the plan's kernel params. Index values are not part of it: the
/// plan's [`IndexGuard`] admits them.
#[derive(Clone, PartialEq, Eq, Hash, Debug)]
pub(crate) struct InputSignature {
    inputs: Vec<(Layout, DType, bool)>,
    grad_enabled: bool,
}

impl InputSignature {
    pub fn of(inputs: &[Tensor]) -> InputSignature {
        InputSignature {
            inputs: inputs
                .iter()
                .map(|t| (t.layout().clone(), t.dtype(), t.requires_grad()))
                .collect(),
            grad_enabled: is_grad_enabled(),
        }
    }
}

/// Which index inputs a plan admits: per input, the bound every index must stay below, or
/// `None` where the step checked none of its values.
///
/// A check on an input itself (or a view of it) admits what the consumer admits (an
/// embedding's rows, a loss's classes), so batches of random tokens share one plan. A check
/// on a u32 tensor the step derived (a copy, a `cat`) cannot be traced to one input; since a
/// derived tensor's bound never exceeds its sources', such a check bounds every index input by
/// its bound at capture, which is still valid, if narrower. Bounds are known where a tensor
/// is created, so the guard reads nothing back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct IndexGuard {
    limits: Vec<Option<u32>>,
}

impl IndexGuard {
    fn of(inputs: &[Tensor], checks: &[(u64, usize)]) -> IndexGuard {
        let mut limits: Vec<Option<u32>> = vec![None; inputs.len()];
        let mut derived = false;
        for &(storage, size) in checks {
            let size = u32::try_from(size).unwrap_or(u32::MAX);
            match inputs.iter().position(|t| t.storage_id() == storage) {
                Some(i) => limits[i] = Some(limits[i].map_or(size, |l| l.min(size))),
                None => derived = true,
            }
        }
        if derived {
            for (limit, input) in limits.iter_mut().zip(inputs) {
                if let (DType::U32, Some(bound)) = (input.dtype(), input.index_bound()) {
                    *limit = Some(limit.map_or(bound, |l| l.min(bound)));
                }
            }
        }
        IndexGuard { limits }
    }

    /// Whether every index of `inputs` is below its limit.
    fn admits(&self, inputs: &[Tensor]) -> bool {
        self.limits
            .iter()
            .zip(inputs)
            .all(|(limit, t)| match limit {
                None => true,
                Some(limit) => t.numel() == 0 || t.index_bound().is_some_and(|b| b <= *limit),
            })
    }
}

/// How a replay finds a value's buffer.
enum Kind {
    /// The storage of the replay's input `i`.
    Input(usize),
    /// A storage the plan holds: from before the step, or its arena's, or an input copy.
    Fixed(Arc<Storage>),
    /// A leaf's grad as read at this point of the step; resolved at each replay.
    GradIn,
    /// A fresh storage per replay.
    Output { bytes: u64 },
    /// Made and dropped within the step; gets an arena buffer once the plan is laid out.
    Intermediate { bytes: u64 },
}

/// The plan's commands name buffers as values (indices into [`Draft`]'s values).
pub(crate) type Command = command::Command<usize>;
pub(crate) type Launch = command::Launch<usize>;
type BufferCopy = command::BufferCopy<usize>;

/// A grad-slot event with its storage named as a value.
enum Slot {
    /// `grad`: the value the grad was bound as (none when no kernel read it) and its layout.
    Read {
        leaf: Tensor,
        grad: Option<(Option<usize>, Layout)>,
    },
    Clear {
        leaf: Tensor,
    },
    Set {
        leaf: Tensor,
        grad: Tensor,
    },
    Install {
        leaf: Tensor,
        value: usize,
        layout: Layout,
    },
}

impl Slot {
    /// The leaf whose grad slot this is.
    fn leaf(&self) -> &Tensor {
        match self {
            Slot::Read { leaf, .. }
            | Slot::Clear { leaf }
            | Slot::Set { leaf, .. }
            | Slot::Install { leaf, .. } => leaf,
        }
    }
}

/// What the step returned.
enum Loss {
    Value {
        value: usize,
        layout: Layout,
        dtype: DType,
    },
    /// A tensor from before the step (a step that returns a parameter, say).
    Fixed(Tensor),
}

/// A plan as the fuser sees it: commands over values, before buffers are assigned.
pub(crate) struct Draft {
    pub commands: Vec<Command>,
    /// One per storage of the captured step: how a replay finds its buffer.
    values: Vec<Kind>,
}

impl Draft {
    /// True for values only the plan's own commands see (made and dropped within the step),
    /// which the fuser may keep in registers.
    pub fn is_intermediate(&self, value: usize) -> bool {
        matches!(self.values[value], Kind::Intermediate { .. })
    }

    /// The buffer size of a value the step makes (an intermediate or an output).
    pub fn made_bytes(&self, value: usize) -> Option<u64> {
        match self.values[value] {
            Kind::Intermediate { bytes } | Kind::Output { bytes } => Some(bytes),
            _ => None,
        }
    }
}

/// A captured step, ready to replay.
pub(crate) struct Plan {
    device: Device,
    pub signature: InputSignature,
    index_guard: IndexGuard,
    flags: Vec<(Arc<AtomicBool>, bool)>,
    requires_grad: Vec<(Weak<TensorInner>, bool)>,
    slots: Vec<Slot>,
    kinds: Vec<Kind>,
    /// The commands, laid out: each launch and upload encoded.
    commands: Vec<Command>,
    /// The commands with host work at each replay, in order: hooks, and launches and uploads
    /// whose params or data are computed again (most commands have none).
    host_work: Vec<usize>,
    params_buffer: Option<wgpu::Buffer>,
    loss: Loss,
    dispatches: u64,
    /// Host time of the latest replay up to its submission.
    last_to_submit: Duration,
    /// The next replay's commands, encoded right after the latest replay was submitted.
    prepared: Option<Prepared>,
    /// Whether the latest replay submitted commands encoded ahead.
    last_encoded_ahead: bool,
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

/// A replay's command buffer encoded ahead of its call, with the buffers it binds that may
/// change between calls. The call submits it only when its own buffers are the same;
/// otherwise it encodes afresh. Encoding and wgpu's `finish` are most of a replay's host time
/// (about 150 us for an MLP step on lavapipe); done after the previous submission, they
/// overlap that step's work on the device.
struct Prepared {
    commands: wgpu::CommandBuffer,
    /// The buffer each input was bound as.
    inputs: Vec<wgpu::Buffer>,
    /// The storage each grad-in value was bound as, by value.
    grad_in: Vec<(usize, u64)>,
    /// Outputs written into storages the call must find droppable (grads it clears), by id.
    reused: Vec<(usize, u64)>,
    /// Outputs given fresh storages.
    fresh: Vec<(usize, Arc<Storage>)>,
}

impl Prepared {
    /// The outputs' storages when `inputs` and `resolved` bind what this was encoded with
    /// (reused ones taken out of `resolved.droppable`), else `None`.
    fn outputs_for(
        &self,
        inputs: &[Tensor],
        resolved: &mut Resolved,
    ) -> Option<HashMap<usize, Arc<Storage>>> {
        let same_inputs = inputs.len() == self.inputs.len()
            && inputs
                .iter()
                .zip(&self.inputs)
                .all(|(t, b)| t.storage().buffer() == b);
        let same_grads = self.grad_in.len() == resolved.grad_in.len()
            && self
                .grad_in
                .iter()
                .all(|(v, id)| resolved.grad_in.get(v).is_some_and(|s| s.id() == *id));
        let all_free = self
            .reused
            .iter()
            .all(|(_, id)| resolved.droppable.iter().any(|s| s.id() == *id));
        if !(same_inputs && same_grads && all_free) {
            return None;
        }
        let mut outputs: HashMap<usize, Arc<Storage>> = self.fresh.iter().cloned().collect();
        for (v, id) in &self.reused {
            let at = (resolved.droppable.iter())
                .position(|s| s.id() == *id)
                .expect("checked free above");
            outputs.insert(*v, resolved.droppable.swap_remove(at));
        }
        Some(outputs)
    }
}

/// Why a tape cannot become a plan (the step then stays eager).
pub(crate) type Refusal = String;

/// Sorts the tape's storages into values and its entries into commands.
pub(crate) fn draft(
    tape: Tape,
    inputs: &[Tensor],
    loss: &Tensor,
) -> std::result::Result<(Draft, Shell), Refusal> {
    if let Some(reason) = tape.refused {
        return Err(reason);
    }
    let mut values = Values {
        ids: HashMap::new(),
        kinds: Vec::new(),
        inputs: input_values(inputs, &tape.device)?,
        grad_in: grads_read(&tape),
        outputs: step_outputs(&tape, loss.storage_id()),
    };
    nothing_made_outlives_the_step(&tape, &values.outputs)?;
    let commands = tape
        .commands
        .into_iter()
        .map(|command| command.named(|storage| values.of(&storage)))
        .collect();
    let slots = tape
        .slots
        .into_iter()
        .map(|event| slot(event, &values.ids))
        .collect::<std::result::Result<Vec<_>, Refusal>>()?;
    let loss = loss_value(loss, &values, &tape.created)?;
    Ok((
        Draft {
            commands,
            values: values.kinds,
        },
        Shell {
            device: tape.device,
            signature: InputSignature::of(inputs),
            index_guard: IndexGuard::of(inputs, &tape.index_limits),
            flags: tape.flags,
            requires_grad: tape.requires_grad,
            slots,
            loss,
        },
    ))
}

/// The values of a draft, named as the tape's storages are met: one per storage id, its kind
/// by what the step does with the storage.
struct Values {
    ids: HashMap<u64, usize>,
    kinds: Vec<Kind>,
    /// The step's inputs' storages, by id: input `i`.
    inputs: HashMap<u64, usize>,
    /// The grads the engine read before anything installed one.
    grad_in: HashSet<u64>,
    /// What the step hands out: the loss and the grads it leaves installed.
    outputs: HashSet<u64>,
}

impl Values {
    /// The value of `storage`, named on first sight.
    fn of(&mut self, storage: &TapedStorage) -> usize {
        if let Some(&v) = self.ids.get(&storage.id) {
            return v;
        }
        let (id, bytes) = (storage.id, storage.bytes);
        let kind = if let Some(&i) = self.inputs.get(&id) {
            Kind::Input(i)
        } else if self.grad_in.contains(&id) {
            Kind::GradIn
        } else if let Some(storage) = &storage.external {
            Kind::Fixed(storage.clone())
        } else if self.outputs.contains(&id) {
            Kind::Output { bytes }
        } else {
            Kind::Intermediate { bytes }
        };
        self.kinds.push(kind);
        self.ids.insert(id, self.kinds.len() - 1);
        self.kinds.len() - 1
    }
}

/// Input `i`'s storage id to `i`; inputs on another device, or two sharing a buffer, refuse.
fn input_values(
    inputs: &[Tensor],
    device: &Device,
) -> std::result::Result<HashMap<u64, usize>, Refusal> {
    let mut ids = HashMap::new();
    for (i, input) in inputs.iter().enumerate() {
        if !Device::same(input.device(), device) {
            return Err(format!("input {i} lives on another device than the step's"));
        }
        if ids.insert(input.storage_id(), i).is_some() {
            return Err("two inputs share one buffer".into());
        }
    }
    Ok(ids)
}

/// The grads the engine read at the step's start (storages the step did not make).
fn grads_read(tape: &Tape) -> HashSet<u64> {
    (tape.slots.iter())
        .filter_map(|e| match e {
            SlotEvent::Read {
                grad: Some((id, _)),
                ..
            } if !tape.created.contains(id) => Some(*id),
            _ => None,
        })
        .collect()
}

/// The loss's storage and those each leaf's grad slot ends the step with.
fn step_outputs(tape: &Tape, loss_id: u64) -> HashSet<u64> {
    let mut final_grads: HashMap<usize, u64> = HashMap::new();
    for event in &tape.slots {
        match event {
            SlotEvent::Install { leaf, storage } => {
                final_grads.insert(Arc::as_ptr(&leaf.inner) as usize, *storage);
            }
            SlotEvent::Clear { leaf } | SlotEvent::Set { leaf, .. } => {
                final_grads.remove(&(Arc::as_ptr(&leaf.inner) as usize));
            }
            SlotEvent::Read { .. } => {}
        }
    }
    final_grads.into_values().chain([loss_id]).collect()
}

/// Refuses a step that keeps a tensor it made, other than its outputs, past its end: a replay
/// would not make it.
fn nothing_made_outlives_the_step(
    tape: &Tape,
    outputs: &HashSet<u64>,
) -> std::result::Result<(), Refusal> {
    let kept = (tape.created.iter()).any(|id| !tape.released.contains(id) && !outputs.contains(id));
    match kept {
        true => Err(
            "the step keeps a tensor it made beyond its end (new optimizer state, a saved \
             graph, or a tensor stored outside the closure)"
                .into(),
        ),
        false => Ok(()),
    }
}

/// A grad-slot event with its storage named as a value; installing a grad no kernel of the
/// step wrote refuses.
fn slot(event: SlotEvent, ids: &HashMap<u64, usize>) -> std::result::Result<Slot, Refusal> {
    Ok(match event {
        SlotEvent::Read { leaf, grad } => Slot::Read {
            leaf,
            grad: grad.map(|(id, layout)| (ids.get(&id).copied(), layout)),
        },
        SlotEvent::Clear { leaf } => Slot::Clear { leaf },
        SlotEvent::Set { leaf, grad } => Slot::Set { leaf, grad },
        SlotEvent::Install { leaf, storage } => {
            let Some(&value) = ids.get(&storage) else {
                return Err("a grad was installed that no kernel of the step wrote".into());
            };
            let layout = leaf
                .grad()
                .map(|g| g.layout().clone())
                .unwrap_or_else(|| Layout::contiguous(leaf.shape()));
            Slot::Install {
                leaf,
                value,
                layout: Layout::contiguous(layout.shape.as_slice()),
            }
        }
    })
}

/// Where a replay finds the loss: a value the step makes, or a tensor from before the step.
fn loss_value(
    loss: &Tensor,
    values: &Values,
    created: &HashSet<u64>,
) -> std::result::Result<Loss, Refusal> {
    let id = loss.storage_id();
    match values.ids.get(&id) {
        Some(&value) if !matches!(values.kinds[value], Kind::Fixed(_)) => Ok(Loss::Value {
            value,
            layout: loss.layout().clone(),
            dtype: loss.dtype(),
        }),
        _ if !created.contains(&id) => Ok(Loss::Fixed(loss.clone())),
        _ => Err("the loss was made by no kernel of the step".into()),
    }
}

/// The parts of a plan the fuser does not touch.
pub(crate) struct Shell {
    device: Device,
    signature: InputSignature,
    index_guard: IndexGuard,
    flags: Vec<(Arc<AtomicBool>, bool)>,
    requires_grad: Vec<(Weak<TensorInner>, bool)>,
    slots: Vec<Slot>,
    loss: Loss,
}

fn capture_error(msg: String) -> Error {
    Error::Capture {
        op: "capture::Step",
        msg,
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

    let kinds = place_intermediates(&commands, values, &device)?;
    let (params_buffer, launches) = encode_commands(&mut commands, &kinds, &device);
    let inner = &device.inner;
    inner.take_error(OP)?;
    Ok(Plan {
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
    })
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
        inner.device.create_buffer(&wgpu::BufferDescriptor {
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
                let staging = inner.device.create_buffer(&wgpu::BufferDescriptor {
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
    let bind_group = fixed.map(|buffers| {
        bind_group(
            device,
            &l.pipeline,
            params,
            params_offset,
            &l.bindings,
            &buffers,
            l.op,
        )
    });
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
fn encoding(l: &Launch) -> &EncodedLaunch {
    l.encoded.as_ref().expect("a plan's launches are encoded")
}

/// The staging buffer laying out made for an upload of the plan.
fn staging(upload: &Upload<usize>) -> &wgpu::Buffer {
    upload
        .staging
        .as_ref()
        .expect("a plan's uploads are encoded")
}

/// `values` with every intermediate placed in an arena buffer (see `capture::memory`): one
/// storage per arena buffer, shared by the intermediates whose lives do not meet.
fn place_intermediates(
    commands: &[Command],
    mut values: Vec<Kind>,
    device: &Device,
) -> Result<Vec<Kind>> {
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
    Ok(values)
}

fn bind_group(
    device: &Device,
    pipeline: &CachedPipeline,
    params: &wgpu::Buffer,
    params_offset: u64,
    bindings: &[(u32, usize)],
    buffers: &[&wgpu::Buffer],
    op: &'static str,
) -> wgpu::BindGroup {
    let whole: Vec<(u32, BufferSlice)> = (bindings.iter().zip(buffers))
        .map(|(&(binding, _), buffer)| {
            let slice = BufferSlice {
                buffer,
                offset: 0,
                size: buffer.size(),
            };
            (binding, slice)
        })
        .collect();
    (device.inner).bind_group(op, pipeline, (params, params_offset), &whole)
}

/// The buffers a replay binds that change from call to call.
struct Resolved {
    /// The storage each grad-in value binds to.
    grad_in: HashMap<usize, Arc<Storage>>,
    /// Storages of grads the step clears that nothing else holds.
    droppable: Vec<Arc<Storage>>,
}

/// The storages a replay binds that change from call to call, by value.
struct CallStorages {
    inputs: Vec<Arc<Storage>>,
    grad_in: HashMap<usize, Arc<Storage>>,
    outputs: HashMap<usize, Arc<Storage>>,
}

impl CallStorages {
    /// The storage of value `v` (of kind `kinds[v]`) in this call.
    fn of<'a>(&'a self, kinds: &'a [Kind], v: usize) -> &'a Arc<Storage> {
        match &kinds[v] {
            Kind::Fixed(s) => s,
            Kind::Input(i) => &self.inputs[*i],
            Kind::GradIn => &self.grad_in[&v],
            Kind::Output { .. } => &self.outputs[&v],
            // `lay_out` gave every intermediate a command touches an arena buffer, and no
            // intermediate outlives the step.
            Kind::Intermediate { .. } => unreachable!("an intermediate has an arena buffer"),
        }
    }
}

/// A grad slot as a replay sees it before it changes the real one.
#[derive(Clone)]
enum SimGrad {
    None,
    Handle(Tensor),
    /// A new handle over a value (a slot that was empty when the step installed into it).
    New,
}

impl Plan {
    /// Whether this plan may replay now: the same inputs, modes, flags and grad slots as when
    /// it was captured. Returns the storage each grad-in value binds to, and the storages of
    /// grads the step clears that nothing else holds (a replay writes its outputs into them,
    /// as the eager step's pool would have reused them).
    fn check(&self, inputs: &[Tensor], signature: &InputSignature) -> Option<Resolved> {
        if !self.guards_hold(inputs, signature) {
            return None;
        }
        self.resolve_grad_slots()
    }

    /// The same signature and admitted indices, inputs in distinct buffers, and the flags and
    /// `requires_grad` of what the step read as they were at capture.
    fn guards_hold(&self, inputs: &[Tensor], signature: &InputSignature) -> bool {
        if *signature != self.signature || !self.index_guard.admits(inputs) {
            return false;
        }
        // Inputs that share a buffer were refused at capture; at replay they would alias.
        let ids: HashSet<u64> = inputs.iter().map(|t| t.storage_id()).collect();
        if ids.len() != inputs.len() {
            return false;
        }
        let flags_hold =
            (self.flags.iter()).all(|(flag, value)| flag.load(Ordering::Relaxed) == *value);
        flags_hold
            && self.requires_grad.iter().all(|(tensor, requires_grad)| {
                tensor
                    .upgrade()
                    .is_none_or(|inner| (Tensor { inner }).requires_grad() == *requires_grad)
            })
    }

    /// Walks the grad-slot events over the slots as they are now: `None` when a read would
    /// find another grad (or layout) than at capture; else the storage each grad-in value
    /// binds to and the cleared grads free to reuse.
    fn resolve_grad_slots(&self) -> Option<Resolved> {
        let mut sim: HashMap<usize, SimGrad> = HashMap::new();
        let key = |t: &Tensor| Arc::as_ptr(&t.inner) as usize;
        let mut grad_in: HashMap<usize, Arc<Storage>> = HashMap::new();
        let mut droppable: Vec<Arc<Storage>> = Vec::new();
        for slot in &self.slots {
            match slot {
                Slot::Read { leaf, grad } => {
                    let current = sim
                        .entry(key(leaf))
                        .or_insert_with(|| leaf.grad().map_or(SimGrad::None, SimGrad::Handle))
                        .clone();
                    match (grad, current) {
                        (None, SimGrad::None) => {}
                        (Some((value, layout)), SimGrad::Handle(h)) => {
                            if h.layout() != layout {
                                return None;
                            }
                            if let Some(value) =
                                value.filter(|&v| matches!(self.kinds[v], Kind::GradIn))
                            {
                                let storage = h.storage();
                                if let Some(bound) = grad_in.get(&value) {
                                    if bound.id() != storage.id() {
                                        return None;
                                    }
                                }
                                grad_in.insert(value, storage);
                            }
                        }
                        (Some(_), SimGrad::New) => {}
                        _ => return None,
                    }
                }
                Slot::Clear { leaf } => {
                    let current = sim
                        .entry(key(leaf))
                        .or_insert_with(|| leaf.grad().map_or(SimGrad::None, SimGrad::Handle));
                    if let SimGrad::Handle(h) = current {
                        // Held by the slot and by `sim` alone, and its storage by it alone.
                        let storage = h.storage();
                        let dense = h.is_contiguous() && h.layout().offset == 0;
                        if dense
                            && Arc::strong_count(&h.inner) == 2
                            && Arc::strong_count(&storage) == 2
                        {
                            droppable.push(storage);
                        }
                    }
                    *current = SimGrad::None;
                }
                Slot::Set { leaf, grad } => {
                    sim.insert(key(leaf), SimGrad::Handle(grad.clone()));
                }
                Slot::Install { leaf, .. } => {
                    let current = sim
                        .entry(key(leaf))
                        .or_insert_with(|| leaf.grad().map_or(SimGrad::None, SimGrad::Handle));
                    if matches!(current, SimGrad::None) {
                        *current = SimGrad::New;
                    }
                }
            }
        }
        // Every grad-in value must have been bound by a read.
        let bound = self
            .kinds
            .iter()
            .enumerate()
            .all(|(v, k)| !matches!(k, Kind::GradIn) || grad_in.contains_key(&v));
        // A cleared grad read later in the step is not free to reuse.
        droppable.retain(|s| grad_in.values().all(|g| g.id() != s.id()));
        bound.then_some(Resolved { grad_in, droppable })
    }

    /// Replays the step on `inputs`, or returns `Ok(None)` when a guard says this plan does
    /// not fit them. On an error, parameters and grad slots are as they were.
    pub fn replay(
        &mut self,
        inputs: &[Tensor],
        signature: &InputSignature,
        started: Instant,
    ) -> Result<Option<Tensor>> {
        const OP: &str = "capture::Step::run";
        let Some(mut resolved) = self.check(inputs, signature) else {
            return Ok(None);
        };
        let inner = self.device.inner.clone();

        // The commands encoded ahead when they bind this call's buffers; else fresh storages
        // for the outputs, and the commands encoded now.
        let ahead = self.prepared.take().and_then(|prepared| {
            let outputs = prepared.outputs_for(inputs, &mut resolved)?;
            Some((outputs, prepared.commands))
        });
        self.last_encoded_ahead = ahead.is_some();
        let (outputs, commands) = match ahead {
            Some((outputs, commands)) => (outputs, Some(commands)),
            None => (self.output_storages(&mut resolved.droppable)?, None),
        };
        let storages = CallStorages {
            inputs: inputs.iter().map(|t| t.storage()).collect(),
            grad_in: resolved.grad_in,
            outputs,
        };
        let commands = commands.unwrap_or_else(|| self.encode(&storages));

        let writes = self.host_writes()?;
        let queue_writes: Vec<(&wgpu::Buffer, u64, &[u8])> = writes
            .iter()
            .map(|(i, data)| match &self.commands[*i] {
                Command::Launch(l) => (
                    self.params_buffer.as_ref().expect("launches"),
                    encoding(l).params_offset,
                    data.as_slice(),
                ),
                Command::Upload(upload) => (staging(upload), 0, data.as_slice()),
                Command::Hook(_) | Command::Copy(_) => {
                    unreachable!("writes nothing from the host")
                }
            })
            .collect();
        self.last_to_submit = started.elapsed();
        inner.submit_commands(OP, &queue_writes, commands, self.dispatches)?;

        self.install_grads(&storages)?;
        let loss = match &self.loss {
            Loss::Value {
                value,
                layout,
                dtype,
            } => Tensor::from_parts(
                storages.of(&self.kinds, *value).clone(),
                layout.clone(),
                *dtype,
                &self.device,
            ),
            Loss::Fixed(t) => t.clone(),
        };
        drop(storages);
        self.prepare(inputs, signature);
        Ok(Some(loss))
    }

    /// The host's work before a submission: the hooks run, and the params and data that
    /// change per step, by step index.
    fn host_writes(&mut self) -> Result<Vec<(usize, Vec<u8>)>> {
        let mut writes: Vec<(usize, Vec<u8>)> = Vec::new();
        for &i in &self.host_work {
            match &mut self.commands[i] {
                Command::Hook(hook) => hook()?,
                Command::Launch(Launch {
                    dynamic_params: Some(f),
                    ..
                }) => writes.push((i, f())),
                Command::Upload(Upload {
                    dynamic: Some(f),
                    data: captured,
                    ..
                }) => {
                    let data = f();
                    if data.len() != captured.len() {
                        return Err(capture_error(format!(
                            "replayed host data of {} bytes where the capture had {}",
                            data.len(),
                            captured.len()
                        )));
                    }
                    writes.push((i, data));
                }
                _ => {}
            }
        }
        Ok(writes)
    }

    /// The grad slots changed as the step's engine changed them (S-2): cleared, set, and the
    /// grads it made installed (into a slot's handle, or as a new one).
    fn install_grads(&self, storages: &CallStorages) -> Result<()> {
        let storage_of = |v: usize| storages.of(&self.kinds, v).clone();
        for slot in &self.slots {
            match slot {
                Slot::Read { .. } => {}
                Slot::Clear { leaf } => leaf.meta().grad = None,
                Slot::Set { leaf, grad } => leaf.meta().grad = Some(grad.clone()),
                Slot::Install {
                    leaf,
                    value,
                    layout,
                } => {
                    // A grad has its leaf's dtype (the engine casts each grad to it).
                    let fresh = Tensor::from_parts(
                        storage_of(*value),
                        layout.clone(),
                        leaf.dtype(),
                        &self.device,
                    );
                    let current = leaf.grad();
                    match current {
                        Some(handle) => crate::autograd::swap_in(&handle, fresh)?,
                        None => leaf.meta().grad = Some(fresh),
                    }
                }
            }
        }
        Ok(())
    }

    /// Encodes the next replay now, for the buffers it would bind if it were called with
    /// `inputs` again: the grads as the step left them, and the grads it will clear (when
    /// nothing else holds them) as its outputs.
    /// The step has been applied by then, so nothing here may fail it: where a fresh output
    /// cannot be allocated now, the next call encodes (and allocates, and reports) itself.
    fn prepare(&mut self, inputs: &[Tensor], signature: &InputSignature) {
        let Some(Resolved {
            grad_in,
            mut droppable,
        }) = self.check(inputs, signature)
        else {
            return;
        };
        let free: Vec<u64> = droppable.iter().map(|s| s.id()).collect();
        let Ok(outputs) = self.output_storages(&mut droppable) else {
            return;
        };
        let (mut reused, mut fresh) = (Vec::new(), Vec::new());
        for (&v, storage) in &outputs {
            match free.contains(&storage.id()) {
                true => reused.push((v, storage.id())),
                false => fresh.push((v, storage.clone())),
            }
        }
        let storages = CallStorages {
            inputs: inputs.iter().map(|t| t.storage()).collect(),
            grad_in,
            outputs,
        };
        self.prepared = Some(Prepared {
            commands: self.encode(&storages),
            inputs: storages.inputs.iter().map(|s| s.buffer().clone()).collect(),
            grad_in: storages.grad_in.iter().map(|(&v, s)| (v, s.id())).collect(),
            reused,
            fresh,
        });
    }

    /// A storage for each output value: one of `droppable` of its size (a grad the step
    /// clears, as the eager step's pool would reuse it), else a fresh one.
    fn output_storages(
        &self,
        droppable: &mut Vec<Arc<Storage>>,
    ) -> Result<HashMap<usize, Arc<Storage>>> {
        let mut outputs: HashMap<usize, Arc<Storage>> = HashMap::new();
        for (v, kind) in self.kinds.iter().enumerate() {
            if let Kind::Output { bytes } = kind {
                let storage = match droppable.iter().position(|s| s.buffer().size() == *bytes) {
                    Some(i) => droppable.swap_remove(i),
                    None => Arc::new(Storage::alloc("capture::Step::run", *bytes, &self.device)?),
                };
                outputs.insert(v, storage);
            }
        }
        Ok(outputs)
    }

    /// The replay's command buffer over this call's inputs, grads and outputs.
    fn encode(&self, storages: &CallStorages) -> wgpu::CommandBuffer {
        let buffer_of = |v: usize| storages.of(&self.kinds, v).buffer();
        let mut encoder =
            self.device
                .inner
                .device
                .create_command_encoder(&wgpu::CommandEncoderDescriptor {
                    label: Some("wgrad replay"),
                });
        let mut i = 0;
        while i < self.commands.len() {
            // Consecutive dispatches share one compute pass.
            let mut pass = encoder.begin_compute_pass(&wgpu::ComputePassDescriptor {
                label: Some("wgrad replay"),
                timestamp_writes: None,
            });
            while i < self.commands.len() {
                match &self.commands[i] {
                    Command::Launch(l) => {
                        pass.set_pipeline(&l.pipeline.pipeline);
                        match &encoding(l).bind_group {
                            Some(group) => pass.set_bind_group(0, group, &[]),
                            None => pass.set_bind_group(0, &self.call_bind_group(l, storages), &[]),
                        }
                        let (x, y) = workgroup_grid(l.workgroups);
                        pass.dispatch_workgroups(x, y, 1);
                        i += 1;
                    }
                    Command::Hook(_) => i += 1,
                    Command::Upload(_) | Command::Copy(_) => break,
                }
            }
            drop(pass);
            match self.commands.get(i) {
                Some(Command::Upload(upload)) => {
                    let bytes = upload.data.len() as u64;
                    if bytes > 0 {
                        let target = buffer_of(upload.target);
                        encoder.copy_buffer_to_buffer(staging(upload), 0, target, 0, bytes);
                    }
                    i += 1;
                }
                Some(Command::Copy(BufferCopy { src, dst, bytes })) => {
                    encoder.copy_buffer_to_buffer(
                        buffer_of(src.0),
                        src.1,
                        buffer_of(dst.0),
                        dst.1,
                        *bytes,
                    );
                    i += 1;
                }
                _ => {}
            }
        }
        encoder.finish()
    }

    /// The bind group of a dispatch whose buffers change between calls: one of the two it
    /// made last (a training loop alternates between two sets of buffers), or a new one.
    fn call_bind_group(&self, l: &Launch, storages: &CallStorages) -> wgpu::BindGroup {
        let buffers: Vec<wgpu::Buffer> = (l.bindings.iter())
            .map(|&(_, v)| storages.of(&self.kinds, v).buffer().clone())
            .collect();
        let encoded = encoding(l);
        let mut recent = encoded.recent.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(hit) = recent.iter().find(|(b, _)| *b == buffers) {
            return hit.1.clone();
        }
        let refs: Vec<&wgpu::Buffer> = buffers.iter().collect();
        let group = bind_group(
            &self.device,
            &l.pipeline,
            self.params_buffer.as_ref().expect("launches"),
            encoded.params_offset,
            &l.bindings,
            &refs,
            l.op,
        );
        if recent.len() == 2 {
            recent.remove(0);
        }
        recent.push((buffers, group.clone()));
        group
    }

    /// Dispatches one replay records.
    pub fn dispatches(&self) -> u64 {
        self.dispatches
    }

    /// Host time of the latest replay, from the start of the call to its submission.
    pub fn last_to_submit(&self) -> Duration {
        self.last_to_submit
    }

    /// Whether the latest replay submitted commands encoded ahead of its call.
    pub fn last_encoded_ahead(&self) -> bool {
        self.last_encoded_ahead
    }
}
