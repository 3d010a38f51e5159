//! From tape to draft: the tape's storages named as values (each of the kinds in `ir.rs`),
//! its commands renamed over them, its grad-slot events and loss with them. A step the draft
//! cannot describe faithfully is refused here, and runs eagerly.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use super::guard::{IndexGuard, InputSignature};
use super::ir::{Draft, Kind, Loss, Refusal, Shell, Slot};
use crate::device::Device;
use crate::tensor::command::Command;
use crate::tensor::tape::{SlotEvent, Tape, TapedStorage};
use crate::tensor::{IndexRange, Layout, Tensor};

/// Sorts the tape's storages into values and its entries into commands.
pub(super) fn draft(
    tape: Tape,
    inputs: &[Tensor],
    loss: &Tensor,
) -> std::result::Result<(Draft, Shell), Refusal> {
    if let Some(reason) = tape.refused {
        return Err(reason);
    }
    let index_guard = IndexGuard::of(inputs, &checks_on_values_that_vary(&tape));
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
            index_guard,
            flags: tape.flags,
            requires_grad: tape.requires_grad,
            slots,
            loss,
        },
    ))
}

/// The step's index checks, less those on a tensor the step fills with the same host bytes at
/// every replay and nothing else writes (a position embedding's positions): such a check holds
/// at every replay as it did at capture, and says nothing of the inputs.
fn checks_on_values_that_vary(tape: &Tape) -> Vec<(u64, IndexRange)> {
    let mut constant: HashSet<u64> = HashSet::new();
    let mut written: HashSet<u64> = HashSet::new();
    for command in &tape.commands {
        match command {
            Command::Upload(upload) if upload.dynamic.is_none() => {
                constant.insert(upload.target.id);
            }
            other => written.extend(other.written().into_iter().map(|storage| storage.id)),
        }
    }
    (tape.index_limits.iter().copied())
        .filter(|(id, _)| !constant.contains(id) || written.contains(id))
        .collect()
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

/// Input `i`'s storage id to `i`; inputs on another device, windows, or two sharing a buffer,
/// refuse.
fn input_values(
    inputs: &[Tensor],
    device: &Device,
) -> std::result::Result<HashMap<u64, usize>, Refusal> {
    let mut ids = HashMap::new();
    for (i, input) in inputs.iter().enumerate() {
        if !Device::same(input.device(), device) {
            return Err(format!("input {i} lives on another device than the step's"));
        }
        // The tape names a window by its root; a replay binds the input's storage whole.
        if input.storage().is_window() {
            return Err(format!("input {i} is a window of a larger buffer"));
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

/// Where a replay finds the loss: an input, a value the step makes, or a tensor from before
/// the step.
fn loss_value(
    loss: &Tensor,
    values: &Values,
    created: &HashSet<u64>,
) -> std::result::Result<Loss, Refusal> {
    let id = loss.storage_id();
    if let Some(&index) = values.inputs.get(&id) {
        // Not `Fixed`: that would hand back the capturing call's input at every replay.
        return Ok(Loss::Input {
            index,
            layout: loss.layout().clone(),
            dtype: loss.dtype(),
        });
    }
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
