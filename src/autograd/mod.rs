//! Autograd: graph recording, the backward engine, `accumulate_grad`, and grad mode.
//!
//! Every op on a tensor that requires grad (with grad mode on) records a node holding its
//! input edges and its backward rule. `backward()` runs the engine in two stages: compute
//! the grads ([`grad`] is that stage alone), then install them: into a leaf's grad slot by
//! [`accumulate_grad`] and a buffer swap (S-2), or, for `backward_with` and listed
//! `inputs`, by an in-place add (S-3). The rules are in `docs/semantics.md`.

mod accumulate;
mod engine;

pub use crate::tensor::grad_mode::{is_grad_enabled, no_grad, NoGradGuard};
pub use accumulate::accumulate_grad;
pub(crate) use accumulate::swap_in;

use crate::error::{Error, Result};
use crate::tensor::tape::{self, SlotEvent};
use crate::tensor::Tensor;
use engine::{Install, Wanted};

#[cfg(test)]
pub(crate) use accumulate::kernel_sources;

/// Options of [`Tensor::backward_with`]. `Default` is what [`Tensor::backward`] uses.
#[derive(Clone, Default)]
pub struct BackwardOptions {
    /// Accumulate only into these tensors' grads, in place where a grad exists (S-3 to S-6).
    pub inputs: Option<Vec<Tensor>>,
    /// The grad of the root; required when the root is not a scalar (S-9).
    pub grad_output: Option<Tensor>,
    /// Keep the graph's saved tensors so that another backward can run through it (S-10).
    pub retain_graph: bool,
}

/// The grads of `inputs` with respect to `outputs` (seeded with `grad_outputs`, or ones for
/// scalar outputs), without changing any grad slot (S-15). `None` for an input the outputs
/// do not reach.
///
/// ```
/// # fn main() -> wgrad::Result<()> {
/// use wgrad::{autograd, Device, Tensor};
/// let dev = Device::new()?;
/// let w = Tensor::from_vec(vec![1.0, 2.0], &[2], &dev)?.requires_grad_(true);
/// let loss = w.mul(&w)?.sum()?;
/// let grads = autograd::grad(&[loss], &[w.clone()], None, false)?;
/// assert_eq!(grads[0].as_ref().unwrap().to_vec()?, vec![2.0, 4.0]);
/// assert!(w.grad().is_none());
/// # Ok(())
/// # }
/// ```
pub fn grad(
    outputs: &[Tensor],
    inputs: &[Tensor],
    grad_outputs: Option<&[Tensor]>,
    retain_graph: bool,
) -> Result<Vec<Option<Tensor>>> {
    const OP: &str = "autograd::grad";
    if inputs.is_empty() {
        return Err(Error::InvalidArgument {
            op: OP,
            msg: "needs at least one input".into(),
        });
    }
    check_inputs_require_grad(OP, inputs)?;
    let root_grads = root_grads(OP, outputs, grad_outputs)?;
    let computed = engine::compute(outputs, &root_grads, Wanted::Listed(inputs), retain_graph)?;
    Ok(inputs
        .iter()
        .map(|input| {
            computed
                .iter()
                .find(|(t, _)| Tensor::same(t, input))
                .map(|(_, g)| g.clone())
        })
        .collect())
}

fn check_inputs_require_grad(op: &'static str, inputs: &[Tensor]) -> Result<()> {
    if let Some((i, t)) = inputs.iter().enumerate().find(|(_, t)| !t.requires_grad()) {
        return Err(Error::InvalidArgument {
            op,
            msg: format!("input {i} (shape {:?}) does not require grad; call requires_grad_(true) on it first", t.shape()),
        });
    }
    Ok(())
}

/// The seed grads of `outputs`: the given ones (shapes checked), or ones for scalars.
fn root_grads(
    op: &'static str,
    outputs: &[Tensor],
    grad_outputs: Option<&[Tensor]>,
) -> Result<Vec<Tensor>> {
    if outputs.is_empty() {
        return Err(Error::InvalidArgument {
            op,
            msg: "needs at least one output".into(),
        });
    }
    if let Some(given) = grad_outputs {
        if given.len() != outputs.len() {
            return Err(Error::InvalidArgument {
                op,
                msg: format!("{} grad_outputs for {} outputs", given.len(), outputs.len()),
            });
        }
    }
    let mut grads = Vec::new();
    for (i, out) in outputs.iter().enumerate() {
        if !out.requires_grad() {
            return Err(Error::InvalidArgument {
                op,
                msg: format!(
                    "output {i} (shape {:?}) does not require grad and has no graph: nothing to \
                     differentiate (was it computed under no_grad, or from tensors without requires_grad?)",
                    out.shape()
                ),
            });
        }
        let grad = match grad_outputs.map(|g| &g[i]) {
            Some(g) => {
                if g.shape() != out.shape() {
                    return Err(Error::Shape {
                        op,
                        msg: format!(
                            "grad_output has shape {:?} but the output has shape {:?}",
                            g.shape(),
                            out.shape()
                        ),
                    });
                }
                g.expect_dtype(op, out.dtype())?;
                out.expect_same_device(op, g)?;
                g.clone()
            }
            None if out.numel() == 1 => {
                Tensor::ones(out.shape(), out.device())?.to_dtype(out.dtype())?
            }
            None => {
                return Err(Error::Shape {
                    op,
                    msg: format!(
                    "grad can be implicitly created only for scalar outputs; the output has shape \
                         {:?}, so pass grad_output",
                    out.shape()
                ),
                })
            }
        };
        grads.push(grad);
    }
    Ok(grads)
}

impl Tensor {
    /// Marks a leaf as requiring grad (or not), and returns it. On a non-leaf (made by an op
    /// that recorded a node) it has no effect: such tensors always require grad. Only float
    /// tensors can require grad: on a u32 tensor (indices, labels) it has no effect either,
    /// where PyTorch raises; so no grad or optimizer step ever writes into indices.
    pub fn requires_grad_(self, requires_grad: bool) -> Tensor {
        if !self.dtype().is_float() {
            return self;
        }
        {
            let mut meta = self.meta();
            if meta.grad_fn.is_none() {
                meta.requires_grad = requires_grad;
            }
        }
        self
    }

    /// True for leaves marked with `requires_grad_(true)` and for every tensor an op made from
    /// them with grad mode on.
    pub fn requires_grad(&self) -> bool {
        let meta = self.meta();
        meta.requires_grad || meta.grad_fn.is_some()
    }

    /// True when no recorded op made this tensor.
    pub fn is_leaf(&self) -> bool {
        self.meta().grad_fn.is_none()
    }

    /// The grad slot: the handle itself, so a handle kept by the user sees later accumulation.
    pub fn grad(&self) -> Option<Tensor> {
        self.meta().grad.clone()
    }

    /// Installs `grad` (the handle itself) in the grad slot, or empties it (S-12). The grad
    /// must have this tensor's shape and dtype, on the same device, and may not be a
    /// broadcast view (its elements must not share memory).
    pub fn set_grad(&self, grad: Option<Tensor>) -> Result<()> {
        const OP: &str = "set_grad";
        if let Some(g) = &grad {
            self.expect_same_device(OP, g)?;
            if !self.dtype().is_float() {
                self.expect_dtype(OP, crate::tensor::DType::F32)?;
            }
            g.expect_dtype(OP, self.dtype())?;
            if g.shape() != self.shape() {
                return Err(Error::Shape {
                    op: OP,
                    msg: format!(
                        "grad of shape {:?} for a tensor of shape {:?}",
                        g.shape(),
                        self.shape()
                    ),
                });
            }
            if g.layout().overlaps() {
                return Err(Error::InvalidArgument {
                    op: OP,
                    msg: format!("grad of shape {:?} is a broadcast view; pass a tensor that owns its elements (contiguous())", g.shape()),
                });
            }
        }
        tape::note_slot(|| match &grad {
            Some(g) => SlotEvent::Set {
                leaf: self.clone(),
                grad: g.clone(),
            },
            None => SlotEvent::Clear { leaf: self.clone() },
        });
        self.meta().grad = grad;
        Ok(())
    }

    /// Empties the grad slot (`None`); the next backward creates a fresh grad (S-12).
    pub fn zero_grad(&self) {
        tape::note_slot(|| SlotEvent::Clear { leaf: self.clone() });
        self.meta().grad = None;
    }

    /// A tensor sharing this one's storage that records nothing and does not require grad
    /// (S-11).
    pub fn detach(&self) -> Tensor {
        self.view(self.layout().clone())
    }

    /// Asks `backward()` to fill this non-leaf's grad slot too (S-7). No effect on leaves.
    pub fn retain_grad(&self) {
        let mut meta = self.meta();
        if meta.grad_fn.is_some() {
            meta.retains_grad = true;
        }
    }

    /// Computes the grad of this scalar with respect to every leaf that requires grad, and
    /// accumulates it into their grad slots (S-2).
    pub fn backward(&self) -> Result<()> {
        self.backward_with(BackwardOptions::default())
    }

    /// `backward()` with options: a root grad for non-scalars, `retain_graph`, and `inputs` to
    /// accumulate only into the listed tensors, in place (S-3 to S-6).
    pub fn backward_with(&self, options: BackwardOptions) -> Result<()> {
        const OP: &str = "backward";
        let given = options.grad_output.as_ref().map(std::slice::from_ref);
        let roots = std::slice::from_ref(self);
        let root_grads = root_grads(OP, roots, given)?;
        match &options.inputs {
            None => {
                let grads =
                    engine::compute(roots, &root_grads, Wanted::AllLeaves, options.retain_graph)?;
                engine::apply(grads, Install::Swap)
            }
            Some(inputs) => {
                if inputs.is_empty() {
                    return Err(Error::InvalidArgument {
                        op: OP,
                        msg: "inputs is an empty list; pass None to accumulate into every leaf"
                            .into(),
                    });
                }
                check_inputs_require_grad(OP, inputs)?;
                let mut unique: Vec<Tensor> = Vec::new();
                for t in inputs {
                    if !unique.iter().any(|u| Tensor::same(u, t)) {
                        unique.push(t.clone());
                    }
                }
                let grads = engine::compute(
                    roots,
                    &root_grads,
                    Wanted::Listed(&unique),
                    options.retain_graph,
                )?;
                engine::apply(grads, Install::InPlace)
            }
        }
    }
}
