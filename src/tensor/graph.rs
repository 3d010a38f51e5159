//! Graph nodes and how ops record them.

use std::sync::{Arc, Mutex, MutexGuard, Weak};

use crate::error::Result;
use crate::tensor::grad_mode::is_grad_enabled;
use crate::tensor::{Tensor, TensorInner};

/// A backward rule: from the grad of a node's output to the grads of its inputs (`None` for
/// an input that gets no grad).
pub(crate) type BackwardFn = Box<dyn Fn(&Tensor) -> Result<Vec<Option<Tensor>>> + Send + Sync>;

/// Where an input's grad goes: the node that made it, or the leaf itself.
pub(crate) enum Edge {
    Node(Arc<Node>),
    Leaf(Tensor),
}

/// One recorded op: its input edges (`None` for inputs that do not require grad), its backward
/// rule with the tensors it saved, and a weak link to its output (for `retain_grad`).
pub(crate) struct Node {
    pub name: &'static str,
    pub edges: Vec<Option<Edge>>,
    /// Taken (and so freed, with its saved tensors) by a backward without `retain_graph`.
    pub backward: Mutex<Option<BackwardFn>>,
    pub output: Weak<TensorInner>,
}

impl Drop for Node {
    /// Drops a long chain of nodes iteratively, so a 10,000-op graph does not overflow the
    /// stack by recursing through `Arc<Node>` drops.
    fn drop(&mut self) {
        let mut pending: Vec<Arc<Node>> = Vec::new();
        let take_edges = |edges: &mut Vec<Option<Edge>>, pending: &mut Vec<Arc<Node>>| {
            for edge in edges.drain(..) {
                if let Some(Edge::Node(node)) = edge {
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
    if !should_record(inputs) {
        return out;
    }
    let edges = inputs
        .iter()
        .map(|t| {
            if !t.requires_grad() {
                return None;
            }
            Some(match t.grad_fn() {
                Some(node) => Edge::Node(node),
                None => Edge::Leaf((*t).clone()),
            })
        })
        .collect();
    let node = Node {
        name,
        edges,
        backward: Mutex::new(Some(Box::new(build(&out)))),
        output: Arc::downgrade(&out.inner),
    };
    {
        let mut meta = out.meta();
        meta.requires_grad = true;
        meta.grad_fn = Some(Arc::new(node));
    }
    out
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
}
