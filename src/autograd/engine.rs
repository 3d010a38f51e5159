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

/// Adds `grad` to the engine-owned sum under `key`.
fn add_to(sums: &mut HashMap<usize, Tensor>, key: usize, grad: Tensor) -> Result<()> {
    let sum = summed(&mut sums.remove(&key), grad)?;
    sums.insert(key, sum);
    Ok(())
}

/// Adds `grad` to the engine-owned sum for output `index` of `node` (one slot per output).
fn add_to_output(
    sums: &mut HashMap<usize, Vec<Option<Tensor>>>,
    node: &Arc<Node>,
    index: usize,
    grad: Tensor,
) -> Result<()> {
    let slots = sums
        .entry(node_key(node))
        .or_insert_with(|| vec![None; node.outputs.len()]);
    slots[index] = Some(summed(&mut slots[index], grad)?);
    Ok(())
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
    let listed_leaves: HashSet<usize>;
    // Listed non-leaves as (node, output index), and the nodes they come from.
    let listed_outputs: HashSet<(usize, usize)>;
    match &wanted {
        Wanted::AllLeaves => {
            listed_leaves = HashSet::new();
            listed_outputs = HashSet::new();
        }
        Wanted::Listed(tensors) => {
            listed_leaves = tensors
                .iter()
                .filter(|t| t.is_leaf())
                .map(tensor_key)
                .collect();
            listed_outputs = tensors
                .iter()
                .filter_map(|t| t.grad_fn_output())
                .map(|(n, index)| (node_key(&n), index))
                .collect();
        }
    }
    let listed_nodes: HashSet<usize> = listed_outputs.iter().map(|&(key, _)| key).collect();
    let wants_leaf = |leaf: &Tensor| match wanted {
        Wanted::AllLeaves => true,
        Wanted::Listed(_) => listed_leaves.contains(&tensor_key(leaf)),
    };

    // Every node the roots reach, each after all the nodes its edges lead to (a DFS postorder),
    // so a single pass over it can decide which nodes lead to wanted tensors.
    let mut visited: HashSet<usize> = HashSet::new();
    let mut postorder: Vec<Arc<Node>> = Vec::new();
    let mut stack: Vec<(Arc<Node>, usize)> = Vec::new();
    for root in roots {
        if let Some(node) = root.grad_fn() {
            if visited.insert(node_key(&node)) {
                stack.push((node, 0));
            }
        }
    }
    while let Some((node, next_edge)) = stack.pop() {
        if next_edge < node.edges.len() {
            stack.push((node.clone(), next_edge + 1));
            if let Some(Edge::Node(child, _)) = &node.edges[next_edge] {
                if visited.insert(node_key(child)) {
                    stack.push((child.clone(), 0));
                }
            }
        } else {
            postorder.push(node);
        }
    }

    // A node runs its backward rule when some edge leads (directly or through other nodes) to
    // a wanted tensor; it needs its grad when it runs or is itself wanted (S-5).
    let mut runs: HashSet<usize> = HashSet::new();
    for node in &postorder {
        let leads_to_wanted = node.edges.iter().flatten().any(|edge| match edge {
            Edge::Leaf(leaf) => wants_leaf(leaf),
            Edge::Node(child, index) => {
                runs.contains(&node_key(child))
                    || listed_outputs.contains(&(node_key(child), *index))
            }
        });
        if leads_to_wanted {
            runs.insert(node_key(node));
        }
    }
    let needed = |key: usize| runs.contains(&key) || listed_nodes.contains(&key);

    // Refuse before anything runs if a node that must run was freed (S-10).
    for node in &postorder {
        if runs.contains(&node_key(node))
            && node.backward.lock().map(|b| b.is_none()).unwrap_or(true)
        {
            return Err(Error::InvalidArgument {
                op: "backward",
                msg: format!(
                    "trying to backward through the graph a second time (through {}), but its saved \
                     tensors were already freed; graph already freed; pass retain_graph: true to the \
                     first backward",
                    node.name
                ),
            });
        }
    }

    // Dependency counts: how many edges from running nodes still owe each node a grad.
    let mut pending: HashMap<usize, usize> = HashMap::new();
    for node in &postorder {
        if !runs.contains(&node_key(node)) {
            continue;
        }
        for edge in node.edges.iter().flatten() {
            if let Edge::Node(child, _) = edge {
                if needed(node_key(child)) {
                    *pending.entry(node_key(child)).or_default() += 1;
                }
            }
        }
    }

    let mut node_grads: HashMap<usize, Vec<Option<Tensor>>> = HashMap::new();
    let mut leaf_grads: HashMap<usize, Tensor> = HashMap::new();
    let mut leaf_handles: HashMap<usize, Tensor> = HashMap::new();
    let mut results: Vec<(Tensor, Tensor)> = Vec::new();
    for (root, grad) in roots.iter().zip(root_grads) {
        match root.grad_fn_output() {
            Some((node, index)) => add_to_output(&mut node_grads, &node, index, grad.clone())?,
            None if wants_leaf(root) => {
                leaf_handles.insert(tensor_key(root), root.clone());
                add_to(&mut leaf_grads, tensor_key(root), grad.clone())?;
            }
            None => {}
        }
    }
    let mut ready: Vec<Arc<Node>> = Vec::new();
    for root in roots {
        if let Some(node) = root.grad_fn() {
            let key = node_key(&node);
            if needed(key)
                && pending.get(&key).copied().unwrap_or(0) == 0
                && !ready.iter().any(|n| node_key(n) == key)
            {
                ready.push(node);
            }
        }
    }

    while let Some(node) = ready.pop() {
        let key = node_key(&node);
        let Some(grads) = node_grads.remove(&key) else {
            continue;
        };
        for (index, (output, grad)) in node.outputs.iter().zip(&grads).enumerate() {
            let (Some(output), Some(grad)) = (output.upgrade(), grad) else {
                continue;
            };
            let output = Tensor { inner: output };
            let retained = matches!(wanted, Wanted::AllLeaves) && output.meta().retains_grad;
            if retained || listed_outputs.contains(&(key, index)) {
                results.push((output, grad.clone()));
            }
        }
        if !runs.contains(&key) {
            continue;
        }
        let input_grads = {
            let mut slot = node.backward.lock().unwrap_or_else(|e| e.into_inner());
            let backward = slot.as_ref().expect("checked before the walk");
            let grads = backward(&grads)?;
            if !retain_graph {
                *slot = None;
            }
            grads
        };
        for (edge, input_grad) in node.edges.iter().zip(input_grads) {
            let (Some(edge), Some(input_grad)) = (edge, input_grad) else {
                continue;
            };
            // A grad takes the dtype of the tensor it is for (as torch's engine casts it): an
            // op of two float dtypes under autocast gives both inputs its own dtype's grad.
            let dtype = match edge {
                Edge::Leaf(leaf) => leaf.dtype(),
                Edge::Node(child, index) => child.output_dtypes[*index],
            };
            let input_grad = match input_grad.dtype() == dtype || !dtype.is_float() {
                true => input_grad,
                false => input_grad.to_dtype(dtype)?,
            };
            match edge {
                Edge::Leaf(leaf) => {
                    if wants_leaf(leaf) {
                        leaf_handles.insert(tensor_key(leaf), leaf.clone());
                        add_to(&mut leaf_grads, tensor_key(leaf), input_grad)?;
                    }
                }
                Edge::Node(child, index) => {
                    let child_key = node_key(child);
                    if !needed(child_key) {
                        continue;
                    }
                    add_to_output(&mut node_grads, child, *index, input_grad)?;
                    let left = pending.get_mut(&child_key).expect("counted");
                    *left -= 1;
                    if *left == 0 {
                        ready.push(child.clone());
                    }
                }
            }
        }
    }
    for (key, grad) in leaf_grads {
        results.push((
            leaf_handles.remove(&key).expect("recorded with its grad"),
            grad,
        ));
    }
    Ok(results)
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
