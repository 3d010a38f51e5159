//! The backward engine, in two stages (DESIGN.md, "Two stages"): [`compute`] walks the graph
//! and returns grads without touching any grad slot (S-15); [`apply`] installs them, by the
//! buffer swap of S-2 or the in-place add of S-3.
//!
//! The walk is iterative (a 10,000-op chain needs no deep stack): nodes run in reverse
//! topological order by dependency counts, grads reaching a node from several consumers are
//! summed into engine-owned tensors (one per output of the node: the pieces of a `split` are
//! one node), and each node's backward rule (with its saved tensors) is dropped after it runs
//! unless `retain_graph`.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use crate::autograd::accumulate::{accumulate_grad, add_into, swap_in};
use crate::error::{Error, Result};
use crate::tensor::grad_mode::NoGradGuard;
use crate::tensor::graph::{Edge, Node};
use crate::tensor::tape::{self, SlotEvent};
use crate::tensor::Tensor;

/// Which grads the walk collects.
pub(crate) enum Wanted<'a> {
    /// Every leaf that requires grad, and non-leaves marked with `retain_grad` (backward()).
    AllLeaves,
    /// Only these tensors, leaves or not (backward(inputs=...), autograd::grad).
    Listed(&'a [Tensor]),
}

/// How computed grads are installed.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Install {
    /// `accumulate_grad` into a fresh buffer, swapped under the slot's handle (S-2).
    Swap,
    /// Added into the slot's grad in place (S-3).
    InPlace,
}

fn node_key(node: &Arc<Node>) -> usize {
    Arc::as_ptr(node) as usize
}

fn tensor_key(t: &Tensor) -> usize {
    Arc::as_ptr(&t.inner) as usize
}

/// `grad` added to the engine-owned sum `slot` holds, if any; the slot is left empty.
fn summed(slot: &mut Option<Tensor>, grad: Tensor) -> Result<Tensor> {
    match slot.take() {
        Some(previous) => previous.add(&grad),
        None => Ok(grad),
    }
}

/// What the caller wants grads of, by key: listed leaves, and listed non-leaves as (node,
/// output index).
struct Wants {
    all_leaves: bool,
    leaves: HashSet<usize>,
    outputs: HashSet<(usize, usize)>,
    /// The nodes of the listed non-leaves.
    nodes: HashSet<usize>,
}

impl Wants {
    fn of(wanted: &Wanted) -> Wants {
        let (leaves, outputs): (HashSet<usize>, HashSet<(usize, usize)>) = match wanted {
            Wanted::AllLeaves => Default::default(),
            Wanted::Listed(tensors) => (
                (tensors.iter().filter(|t| t.is_leaf()).map(tensor_key)).collect(),
                (tensors.iter().filter_map(|t| t.grad_fn_output()))
                    .map(|(n, index)| (node_key(&n), index))
                    .collect(),
            ),
        };
        Wants {
            all_leaves: matches!(wanted, Wanted::AllLeaves),
            nodes: outputs.iter().map(|&(key, _)| key).collect(),
            leaves,
            outputs,
        }
    }

    fn leaf(&self, leaf: &Tensor) -> bool {
        self.all_leaves || self.leaves.contains(&tensor_key(leaf))
    }

    /// Whether output `index` of `node` is handed out: listed, or (backward()) retained.
    fn output(&self, key: usize, index: usize, output: &Tensor) -> bool {
        (self.all_leaves && output.meta().retains_grad) || self.outputs.contains(&(key, index))
    }
}

/// Every node the roots reach, each after all the nodes its edges lead to (a DFS postorder),
/// so a single pass over it can decide which nodes lead to wanted tensors.
fn postorder(roots: &[Tensor]) -> Vec<Arc<Node>> {
    let mut visited: HashSet<usize> = HashSet::new();
    let mut order: Vec<Arc<Node>> = Vec::new();
    let mut stack: Vec<(Arc<Node>, usize)> = Vec::new();
    for node in roots.iter().filter_map(|root| root.grad_fn()) {
        if visited.insert(node_key(&node)) {
            stack.push((node, 0));
        }
    }
    while let Some((node, next_edge)) = stack.pop() {
        if next_edge == node.edges.len() {
            order.push(node);
            continue;
        }
        stack.push((node.clone(), next_edge + 1));
        if let Some(Edge::Node(child, _)) = &node.edges[next_edge] {
            if visited.insert(node_key(child)) {
                stack.push((child.clone(), 0));
            }
        }
    }
    order
}

/// Which nodes run their backward rule and, per node, how many edges from running nodes still
/// owe it a grad.
struct RunPlan {
    /// Nodes with an edge leading (directly or through other nodes) to a wanted tensor.
    runs: HashSet<usize>,
    pending: HashMap<usize, usize>,
}

impl RunPlan {
    /// The plan over `postorder`; an error if a node that must run was freed (S-10), before
    /// anything runs.
    fn of(postorder: &[Arc<Node>], wants: &Wants) -> Result<RunPlan> {
        let mut plan = RunPlan {
            runs: HashSet::new(),
            pending: HashMap::new(),
        };
        for node in postorder {
            let leads_to_wanted = node.edges.iter().flatten().any(|edge| match edge {
                Edge::Leaf(leaf) => wants.leaf(leaf),
                Edge::Node(child, index) => {
                    plan.runs.contains(&node_key(child))
                        || wants.outputs.contains(&(node_key(child), *index))
                }
            });
            if leads_to_wanted {
                plan.runs.insert(node_key(node));
            }
        }
        for node in postorder
            .iter()
            .filter(|n| plan.runs.contains(&node_key(n)))
        {
            if node.backward.lock().map(|b| b.is_none()).unwrap_or(true) {
                return Err(Error::InvalidArgument {
                    op: "backward",
                    msg: format!(
                        "trying to backward through the graph a second time (through {}), but its \
                         saved tensors were already freed; graph already freed; pass \
                         retain_graph: true to the first backward",
                        node.name
                    ),
                });
            }
            for edge in node.edges.iter().flatten() {
                if let Edge::Node(child, _) = edge {
                    if plan.needed(node_key(child), wants) {
                        *plan.pending.entry(node_key(child)).or_default() += 1;
                    }
                }
            }
        }
        Ok(plan)
    }

    /// Whether a node needs its grad: it runs, or is itself wanted (S-5).
    fn needed(&self, key: usize, wants: &Wants) -> bool {
        self.runs.contains(&key) || wants.nodes.contains(&key)
    }
}

/// The engine-owned grads of the walk: per node output and per wanted leaf, each a sum of
/// what reached it, and the grads handed out so far.
#[derive(Default)]
struct GradStore {
    nodes: HashMap<usize, Vec<Option<Tensor>>>,
    leaves: HashMap<usize, (Tensor, Option<Tensor>)>,
    results: Vec<(Tensor, Tensor)>,
}

impl GradStore {
    /// Adds `grad` to the sum for output `index` of `node` (one slot per output).
    fn add_to_output(&mut self, node: &Arc<Node>, index: usize, grad: Tensor) -> Result<()> {
        let slots = self
            .nodes
            .entry(node_key(node))
            .or_insert_with(|| vec![None; node.outputs.len()]);
        slots[index] = Some(summed(&mut slots[index], grad)?);
        Ok(())
    }

    /// Adds `grad` to the sum for `leaf`.
    fn add_to_leaf(&mut self, leaf: &Tensor, grad: Tensor) -> Result<()> {
        let (_, sum) = self
            .leaves
            .entry(tensor_key(leaf))
            .or_insert_with(|| (leaf.clone(), None));
        *sum = Some(summed(sum, grad)?);
        Ok(())
    }

    /// The grads handed out: the wanted non-leaves' as they were met, then the leaves'.
    fn finish(mut self) -> Vec<(Tensor, Tensor)> {
        let leaves = self.leaves.into_values();
        self.results
            .extend(leaves.filter_map(|(leaf, sum)| sum.map(|grad| (leaf, grad))));
        self.results
    }
}

/// `grad` in the dtype of the tensor it is for (as torch's engine casts it): an op of two
/// float dtypes under autocast gives both inputs its own dtype's grad.
fn in_dtype_of(edge: &Edge, grad: Tensor) -> Result<Tensor> {
    let dtype = match edge {
        Edge::Leaf(leaf) => leaf.dtype(),
        Edge::Node(child, index) => child.output_dtypes[*index],
    };
    if grad.dtype() == dtype || !dtype.is_float() {
        return Ok(grad);
    }
    grad.to_dtype(dtype)
}

/// Runs `node`'s backward rule on its summed output grads (dropping the rule unless
/// `retain_graph`), and returns the grads of its inputs, by edge.
fn run_node(
    node: &Node,
    grads: &[Option<Tensor>],
    retain_graph: bool,
) -> Result<Vec<Option<Tensor>>> {
    let mut slot = node.backward.lock().unwrap_or_else(|e| e.into_inner());
    let backward = slot.as_ref().expect("checked before the walk");
    let input_grads = backward(grads)?;
    if !retain_graph {
        *slot = None;
    }
    Ok(input_grads)
}

/// Stage one: the grads of the wanted tensors with respect to `roots` (seeded with
/// `root_grads`). Returns `(tensor, grad)` pairs, one per wanted tensor that the roots reach.
/// Reads and writes no grad slot.
pub(crate) fn compute(
    roots: &[Tensor],
    root_grads: &[Tensor],
    wanted: Wanted,
    retain_graph: bool,
) -> Result<Vec<(Tensor, Tensor)>> {
    let _no_grad = NoGradGuard::new();
    // Backward rules run in the dtypes of their forward, inside an autocast region too.
    let _autocast = crate::ops::autocast::Suspend::new();
    let wants = Wants::of(&wanted);
    let mut plan = RunPlan::of(&postorder(roots), &wants)?;
    let mut store = GradStore::default();
    for (root, grad) in roots.iter().zip(root_grads) {
        match root.grad_fn_output() {
            Some((node, index)) => store.add_to_output(&node, index, grad.clone())?,
            None if wants.leaf(root) => store.add_to_leaf(root, grad.clone())?,
            None => {}
        }
    }
    let mut ready: Vec<Arc<Node>> = Vec::new();
    for node in roots.iter().filter_map(|root| root.grad_fn()) {
        let key = node_key(&node);
        if plan.needed(key, &wants)
            && plan.pending.get(&key).copied().unwrap_or(0) == 0
            && !ready.iter().any(|n| node_key(n) == key)
        {
            ready.push(node);
        }
    }
    while let Some(node) = ready.pop() {
        let key = node_key(&node);
        let Some(grads) = store.nodes.remove(&key) else {
            continue;
        };
        for (index, (output, grad)) in node.outputs.iter().zip(&grads).enumerate() {
            let (Some(output), Some(grad)) = (output.upgrade(), grad) else {
                continue;
            };
            let output = Tensor { inner: output };
            if wants.output(key, index, &output) {
                store.results.push((output, grad.clone()));
            }
        }
        if !plan.runs.contains(&key) {
            continue;
        }
        let input_grads = run_node(&node, &grads, retain_graph)?;
        for (edge, input_grad) in node.edges.iter().zip(input_grads) {
            let (Some(edge), Some(input_grad)) = (edge, input_grad) else {
                continue;
            };
            match edge {
                Edge::Leaf(leaf) if wants.leaf(leaf) => {
                    store.add_to_leaf(leaf, in_dtype_of(edge, input_grad)?)?;
                }
                Edge::Leaf(_) => {}
                Edge::Node(child, index) => {
                    let child_key = node_key(child);
                    if !plan.needed(child_key, &wants) {
                        continue;
                    }
                    store.add_to_output(child, *index, in_dtype_of(edge, input_grad)?)?;
                    let left = plan.pending.get_mut(&child_key).expect("counted");
                    *left -= 1;
                    if *left == 0 {
                        ready.push(child.clone());
                    }
                }
            }
        }
    }
    Ok(store.finish())
}

/// Stage two: installs each computed grad into its tensor's slot.
pub(crate) fn apply(grads: Vec<(Tensor, Tensor)>, install: Install) -> Result<()> {
    let _no_grad = NoGradGuard::new();
    // Compute every new grad first, so a failure leaves every slot as it was.
    let mut staged: Vec<(Tensor, Option<Tensor>, Tensor)> = Vec::new();
    for (target, grad) in grads {
        let current = target.grad();
        tape::note_slot(|| SlotEvent::Read {
            leaf: target.clone(),
            grad: current
                .as_ref()
                .map(|g| (g.storage_id(), g.layout().clone())),
        });
        let value = match (install, &current) {
            (Install::Swap, _) | (Install::InPlace, None) => {
                accumulate_grad(current.as_ref(), &grad)?
            }
            (Install::InPlace, Some(_)) => grad,
        };
        staged.push((target, current, value));
    }
    for (target, current, value) in staged {
        let installed = match (current, install) {
            (None, _) => {
                target.meta().grad = Some(value);
                true
            }
            (Some(slot_grad), Install::Swap) => {
                swap_in(&slot_grad, value)?;
                true
            }
            (Some(slot_grad), Install::InPlace) => {
                add_into(&slot_grad, &value)?;
                false
            }
        };
        if installed && tape::is_open() {
            let storage = target.grad().expect("just installed").storage_id();
            tape::note_slot(|| SlotEvent::Install {
                leaf: target.clone(),
                storage,
            });
        }
    }
    Ok(())
}
