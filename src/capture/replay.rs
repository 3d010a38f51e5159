//! Replaying a plan: the guards checked, this call's inputs, grads and outputs bound, the
//! per-step host work run (hooks, params and data computed again), one submission, and the
//! grads installed as the engine's apply stage installs them (S-2). The next call's
//! commands are encoded right after, while the device runs this one.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::guard::{InputSignature, Resolved};
use super::ir::{BufferCopy, Command, Kind, Launch, Loss, Slot};
use super::plan::{bind_group, encoding, staging, Plan};
use crate::device::workgroup_grid;
use crate::error::{Error, Result};
use crate::tensor::command::Upload;
use crate::tensor::{Storage, Tensor};

/// A replay's command buffer encoded ahead of its call, with the buffers it binds that may
/// change between calls. The call submits it only when its own buffers are the same;
/// otherwise it encodes afresh. Encoding and wgpu's `finish` are most of a replay's host time
/// (about 150 us for an MLP step on lavapipe); done after the previous submission, they
/// overlap that step's work on the device.
pub(super) struct Prepared {
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

fn capture_error(msg: String) -> Error {
    Error::Capture {
        op: "capture::Step",
        msg,
    }
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

impl Plan {
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
        let poison: Vec<(&wgpu::Buffer, Vec<u8>)> = match inner.poisons_buffers() {
            true => (self.arena.iter())
                .map(|s| (s.buffer(), vec![0xFF; s.buffer().size() as usize]))
                .collect(),
            false => Vec::new(),
        };
        let mut queue_writes: Vec<(&wgpu::Buffer, u64, &[u8])> = writes
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
        queue_writes.extend(
            poison
                .iter()
                .map(|(buffer, nan)| (*buffer, 0, nan.as_slice())),
        );
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
            Loss::Input {
                index,
                layout,
                dtype,
            } => Tensor::from_parts(
                inputs[*index].storage(),
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
        let params = self.params_buffer.as_ref().expect("launches");
        let group = bind_group(&self.device, l, params, encoded.params_offset, &refs);
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
