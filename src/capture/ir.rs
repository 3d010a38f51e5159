//! The one command list a captured step is made of, from the tape to the replay: the draft
//! (commands over values), what each value is, and the grad-slot events and loss a replay
//! reproduces. A draft's values sort every storage the tape names into one of five kinds:
//! - **fixed**: storages from before the step (parameters, optimizer state, constants); the
//!   plan keeps them alive and binds them as they are;
//! - **input**: the storages of the step's inputs; a replay binds the storages of the inputs
//!   it is given (same layouts, by the guard), so a batch is never copied;
//! - **grad in**: a leaf's grad as the engine read it (S-14): bound at each replay to whatever
//!   storage that leaf's grad has then;
//! - **output**: the loss and the grads the step installs; a replay gives each a fresh
//!   storage, which it hands out afterwards as the engine's apply stage would (S-2);
//! - **intermediate**: made and dropped within the step; they share the plan's arena, buffers
//!   assigned by liveness once, when the plan is laid out (`memory.rs`).

use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Weak};

use super::guard::{IndexGuard, InputSignature};
use crate::device::Device;
use crate::tensor::command;
use crate::tensor::{DType, Layout, Storage, Tensor, TensorInner};

/// How a replay finds a value's buffer.
pub(super) enum Kind {
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
pub(super) type Command = command::Command<usize>;
pub(super) type Launch = command::Launch<usize>;
pub(super) type BufferCopy = command::BufferCopy<usize>;

/// A grad-slot event with its storage named as a value.
pub(super) enum Slot {
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
    pub fn leaf(&self) -> &Tensor {
        match self {
            Slot::Read { leaf, .. }
            | Slot::Clear { leaf }
            | Slot::Set { leaf, .. }
            | Slot::Install { leaf, .. } => leaf,
        }
    }
}

/// What the step returned.
pub(super) enum Loss {
    Value {
        value: usize,
        layout: Layout,
        dtype: DType,
    },
    /// Input `index` itself, or a view of it (a step that returns its batch): the replayed
    /// call's input, seen through `layout` (the signature fixes the input's own layout).
    Input {
        index: usize,
        layout: Layout,
        dtype: DType,
    },
    /// A tensor from before the step (a step that returns a parameter, say).
    Fixed(Tensor),
}

/// A plan as the fuser sees it: commands over values, before buffers are assigned.
pub(super) struct Draft {
    pub commands: Vec<Command>,
    /// One per storage of the captured step: how a replay finds its buffer.
    pub values: Vec<Kind>,
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

/// The parts of a plan the fuser does not touch.
pub(super) struct Shell {
    pub device: Device,
    pub signature: InputSignature,
    pub index_guard: IndexGuard,
    pub flags: Vec<(Arc<AtomicBool>, bool)>,
    pub requires_grad: Vec<(Weak<TensorInner>, bool)>,
    pub slots: Vec<Slot>,
    pub loss: Loss,
}

/// Why a tape cannot become a plan (the step then stays eager).
pub(super) type Refusal = String;
