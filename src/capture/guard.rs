//! Whether a plan may replay a call: the inputs' signature, the index bounds its kernels
//! were built for, the flags and `requires_grad` the step read, and the grad slots as the
//! step will find them. Nothing here reads the device.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::ir::{Kind, Slot};
use super::plan::Plan;
use crate::autograd::is_grad_enabled;
use crate::tensor::{DType, IndexRange, Layout, Storage, Tensor};

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

/// Which index inputs a plan admits: per input, the range every index must stay in (below a
/// bound, or a loss's ignore_index), or `None` where the step checked none of its values.
///
/// A check on an input itself (or a view of it) admits what the consumer admits (an
/// embedding's rows, a loss's classes), so batches of random tokens share one plan. A check
/// on a u32 tensor the step derived (a copy, a `cat`) cannot be traced to one input; since a
/// derived tensor's bound never exceeds its sources', such a check bounds every index input by
/// its bound at capture, which is still valid, if narrower (see [`derived_limit`] for a loss's
/// ignore_index marker). Checks on tensors the step uploads with the same bytes at every
/// replay never reach the guard: `draft.rs` drops them. Ranges are known where a tensor is
/// created, so the guard reads nothing back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct IndexGuard {
    limits: Vec<Option<IndexRange>>,
}

impl IndexGuard {
    pub(super) fn of(inputs: &[Tensor], checks: &[(u64, IndexRange)]) -> IndexGuard {
        let mut limits: Vec<Option<IndexRange>> = vec![None; inputs.len()];
        // The exceptions (ignore_index markers) that checks on derived tensors allow.
        let mut derived: Option<Vec<Option<u32>>> = None;
        for &(storage, range) in checks {
            match inputs.iter().position(|t| t.storage_id() == storage) {
                Some(i) => limits[i] = Some(limits[i].map_or(range, |l| l.intersection(range))),
                None => derived.get_or_insert_default().push(range.except),
            }
        }
        if let Some(markers) = derived {
            for (limit, input) in limits.iter_mut().zip(inputs) {
                if let (DType::U32, Some(range)) = (input.dtype(), input.index_range()) {
                    let bound = derived_limit(range, &markers);
                    *limit = Some(limit.map_or(bound, |l| l.intersection(bound)));
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
                Some(limit) => t.numel() == 0 || t.index_range().is_some_and(|r| r.within(*limit)),
            })
    }
}

/// What an index input whose values the step checked only through a tensor it derived (a
/// `cat` of labels) may hold at a replay: any value below its bound at capture, as the derived
/// tensor's values come from the inputs' and its check passed; or, where its largest value is
/// a marker a check allows (a loss's ignore_index), that marker and any value below the
/// others' bound.
fn derived_limit(range: IndexRange, markers: &[Option<u32>]) -> IndexRange {
    match range.except {
        Some(e) if e >= range.below && markers.contains(&Some(e)) => range,
        _ => IndexRange::below(range.bound()),
    }
}

/// The buffers a replay binds that change from call to call.
pub(super) struct Resolved {
    /// The storage each grad-in value binds to.
    pub grad_in: HashMap<usize, Arc<Storage>>,
    /// Storages of grads the step clears that nothing else holds.
    pub droppable: Vec<Arc<Storage>>,
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
    pub(super) fn check(&self, inputs: &[Tensor], signature: &InputSignature) -> Option<Resolved> {
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
}
