//! Graph nodes and how ops record them.

use std::sync::{Arc, Mutex, MutexGuard, Weak};

use crate::error::Result;
use crate::tensor::grad_mode::is_grad_enabled;
use crate::tensor::{DType, Tensor, TensorInner};

/// A backward rule: from the grads of a node's outputs (one per output, `None` for an output
/// no grad reached; most ops have one output) to the grads of its inputs (`None` for an input
/// that gets no grad).
pub(crate) type BackwardFn =
    Box<dyn Fn(&[Option<Tensor>]) -> Result<Vec<Option<Tensor>>> + Send + Sync>;

/// Where an input's grad goes: output `.1` of the node that made it, or the leaf itself.
pub(crate) enum Edge {
    Node(Arc<Node>, usize),
    Leaf(Tensor),
}

/// One recorded op: its input edges (`None` for inputs that do not require grad), its backward
/// rule with the tensors it saved, and weak links to its outputs (for `retain_grad`).
pub(crate) struct Node {
    pub name: &'static str,
    pub edges: Vec<Option<Edge>>,
    /// Taken (and so freed, with its saved tensors) by a backward without `retain_graph`.
    pub backward: Mutex<Option<BackwardFn>>,
    pub outputs: Vec<Weak<TensorInner>>,
    /// Each output's dtype: the dtype the grad reaching it must have.
    pub output_dtypes: Vec<DType>,
}

impl Drop for Node {
    /// Drops a long chain of nodes iteratively, so a 10,000-op graph does not overflow the
    /// stack by recursing through `Arc<Node>` drops.
    fn drop(&mut self) {
        let mut pending: Vec<Arc<Node>> = Vec::new();
        let take_edges = |edges: &mut Vec<Option<Edge>>, pending: &mut Vec<Arc<Node>>| {
            for edge in edges.drain(..) {
                if let Some(Edge::Node(node, _)) = edge {
                    pending.push(node);
                }
            }
        };
        take_edges(&mut self.edges, &mut pending);
        while let Some(node) = pending.pop() {
            if let Ok(mut node) = Arc::try_unwrap(node) {
                take_edges(&mut node.edges, &mut pending);
            }
        }
    }
}

/// Autograd state of one tensor handle.
#[derive(Default)]
pub(crate) struct AutogradMeta {
    /// Set by `requires_grad_` on leaves, and on every recorded op's output.
    pub requires_grad: bool,
    /// The grad slot.
    pub grad: Option<Tensor>,
    /// The node that made this tensor; `None` for leaves.
    pub grad_fn: Option<Arc<Node>>,
    /// Which of `grad_fn`'s outputs this tensor is (0 but for the pieces of a `split`).
    pub output_index: usize,
    /// `retain_grad()` was called on this non-leaf.
    pub retains_grad: bool,
}

/// True when an op on `inputs` must record a node: grad mode is on and some input requires
/// grad.
pub(crate) fn should_record(inputs: &[&Tensor]) -> bool {
    is_grad_enabled() && inputs.iter().any(|t| t.requires_grad())
}

/// Records the op that made `out` from `inputs`, when [`should_record`] says so, and returns
/// `out`. `build` is given `out` and makes the backward rule; it runs only when recording, so
/// saving tensors costs nothing otherwise. Saved tensors are `detach()`ed handles, so that a
/// node never keeps its own output (or a graph) alive.
pub(crate) fn record<F>(
    name: &'static str,
    out: Tensor,
    inputs: &[&Tensor],
    build: impl FnOnce(&Tensor) -> F,
) -> Tensor
where
    F: Fn(&Tensor) -> Result<Vec<Option<Tensor>>> + Send + Sync + 'static,
{
    let mut outs = record_outputs(name, vec![out], inputs, |outs| {
        let backward = build(&outs[0]);
        // A node runs only once its one output has a grad (see the engine's walk).
        move |grads: &[Option<Tensor>]| match &grads[0] {
            Some(grad) => backward(grad),
            None => Ok(Vec::new()),
        }
    });
    outs.pop().expect("one output in, one out")
}

/// [`record`] for an op with several outputs (the pieces of a `split`): one node, whose
/// backward rule gets one grad per output (`None` where no grad reached that output) and runs
/// once, after every consumer of every output has given its grad.
pub(crate) fn record_outputs<F>(
    name: &'static str,
    outs: Vec<Tensor>,
    inputs: &[&Tensor],
    build: impl FnOnce(&[Tensor]) -> F,
) -> Vec<Tensor>
where
    F: Fn(&[Option<Tensor>]) -> Result<Vec<Option<Tensor>>> + Send + Sync + 'static,
{
    if !should_record(inputs) {
        return outs;
    }
    let edges = inputs
        .iter()
        .map(|t| {
            if !t.requires_grad() {
                return None;
            }
            Some(match t.grad_fn_output() {
                Some((node, index)) => Edge::Node(node, index),
                None => Edge::Leaf((*t).clone()),
            })
        })
        .collect();
    let node = Arc::new(Node {
        name,
        edges,
        backward: Mutex::new(Some(Box::new(build(&outs)))),
        outputs: outs.iter().map(|out| Arc::downgrade(&out.inner)).collect(),
        output_dtypes: outs.iter().map(Tensor::dtype).collect(),
    });
    for (index, out) in outs.iter().enumerate() {
        let mut meta = out.meta();
        meta.requires_grad = true;
        meta.grad_fn = Some(node.clone());
        meta.output_index = index;
    }
    outs
}

impl Tensor {
    /// The tensor's autograd state: its grad slot, `requires_grad`, and the node that made it.
    pub(crate) fn meta(&self) -> MutexGuard<'_, AutogradMeta> {
        self.inner
            .autograd
            .lock()
            .unwrap_or_else(|e| e.into_inner())
    }

    /// The node that made this tensor, if an op recorded one.
    pub(crate) fn grad_fn(&self) -> Option<Arc<Node>> {
        self.meta().grad_fn.clone()
    }

    /// The node that made this tensor and which of its outputs this tensor is.
    pub(crate) fn grad_fn_output(&self) -> Option<(Arc<Node>, usize)> {
        let meta = self.meta();
        meta.grad_fn.clone().map(|node| (node, meta.output_index))
    }
}
