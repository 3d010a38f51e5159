//! `accumulate_grad` (S-1) and the engine's two ways of installing a grad: the buffer swap of
//! S-2 and the in-place add of S-3. Kernels: `shaders/accumulate_grad.wgsl`.

use crate::error::{Error, Result};
use crate::kernel::{
    groups, strided_dims, windows, Elementwise, Fusion, Kernel, KernelParams, Launch, ShaderFamily,
    CONTIGUOUS_PER_GROUP, WORKGROUP,
};
use crate::ops::copy::copy_into;
use crate::ops::too_large_view;
use crate::tensor::{DType, Storage, Tensor};

crate::kernel_params! {
    /// An elementwise pass over the current grad and the new grad (same shape, any layouts).
    pub(crate) struct AccumulateParams {
        n: u32,
        rank: u32,
        current_offset: u32,
        new_offset: u32,
        shape: [u32; 6],
        current_strides: [u32; 6],
        new_strides: [u32; 6],
        /// The `_dense` entries: 1 where they move four elements per load.
        vec4: u32,
    }
}

static ACCUMULATE: ShaderFamily = ShaderFamily {
    name: "accumulate_grad",
    wgsl: include_str!("../../shaders/accumulate_grad.wgsl"),
    params: &[&AccumulateParams::LAYOUT],
    preludes: &[],
};

#[cfg(test)]
pub(crate) fn kernel_sources() -> Vec<(String, String)> {
    vec![("accumulate_grad".into(), ACCUMULATE.source(&[]))]
}

fn check_pair(op: &'static str, current: &Tensor, new_grad: &Tensor) -> Result<()> {
    current.expect_same_device(op, new_grad)?;
    if !current.dtype().is_float() {
        current.expect_dtype(op, DType::F32)?;
    }
    new_grad.expect_dtype(op, current.dtype())?;
    if current.shape() != new_grad.shape() {
        return Err(Error::Shape {
            op,
            msg: format!(
                "the current grad has shape {:?} but the new grad has shape {:?}",
                current.shape(),
                new_grad.shape()
            ),
        });
    }
    Ok(())
}

/// An elementwise pass over `current` and `new_grad` (same shape, any layouts): its params,
/// and which twin of `entry` runs it with how many workgroups: the `_dense` twin, 64 elements
/// per invocation, where both are dense (a leaf's grad and the grad backward made for it),
/// else the strided one, an element per invocation.
struct Pass {
    params: AccumulateParams,
    dense: bool,
    workgroups: u32,
}

impl Pass {
    fn new(op: &'static str, current: &Tensor, new_grad: &Tensor) -> Result<Pass> {
        let (lc, ln) = (current.layout(), new_grad.layout());
        let dims = strided_dims(op, &lc.shape, &[&lc.strides, &ln.strides])?;
        let n = current.numel();
        let dense = lc.is_contiguous() && ln.is_contiguous();
        let vec4 = dense
            && [n, lc.offset, ln.offset]
                .iter()
                .all(|v| v.is_multiple_of(4));
        Ok(Pass {
            params: AccumulateParams {
                n: n as u32,
                rank: dims.rank,
                current_offset: lc.offset as u32,
                new_offset: ln.offset as u32,
                shape: dims.shape,
                current_strides: dims.strides[0],
                new_strides: dims.strides[1],
                vec4: vec4 as u32,
            },
            dense,
            workgroups: groups(
                n,
                if dense {
                    CONTIGUOUS_PER_GROUP
                } else {
                    WORKGROUP
                },
            ),
        })
    }

    /// The kernel of `strided_entry` or its `_dense` twin.
    fn kernel(&self, strided_entry: &'static str, dense_entry: &'static str) -> Kernel<'static> {
        Kernel::plain(
            &ACCUMULATE,
            if self.dense {
                dense_entry
            } else {
                strided_entry
            },
        )
    }
}

/// The grad a leaf should hold after receiving `new_grad`, in a buffer that aliases neither
/// input: `current + new_grad` by one clone-then-add kernel, or a copy of `new_grad` when there
/// is no current grad. Pure: it reads no grad slot and changes neither input (S-1).
///
/// ```
/// # fn main() -> wgrad::Result<()> {
/// use wgrad::{autograd, Device, Tensor};
/// let dev = Device::new()?;
/// let g = Tensor::ones(&[3], &dev)?;
/// let n = Tensor::from_vec(vec![2.0, 3.0, 4.0], &[3], &dev)?;
/// let out = autograd::accumulate_grad(Some(&g), &n)?;
/// assert_eq!(out.to_vec()?, vec![3.0, 4.0, 5.0]);
/// assert_ne!(out.storage_id(), g.storage_id());
/// # Ok(())
/// # }
/// ```
pub fn accumulate_grad(current: Option<&Tensor>, new_grad: &Tensor) -> Result<Tensor> {
    const OP: &str = "accumulate_grad";
    let Some(current) = current else {
        if !new_grad.dtype().is_float() {
            new_grad.expect_dtype(OP, DType::F32)?;
        }
        return new_grad.deep_clone();
    };
    check_pair(OP, current, new_grad)?;
    if current.dtype().is_16_bit() {
        // The sum of a 16-bit leaf's grads, in f32 and rounded once, in a fresh buffer.
        let _no_grad = crate::tensor::grad_mode::NoGradGuard::new();
        return current.add(new_grad);
    }
    let out = Tensor::empty(OP, current.shape(), DType::F32, current.device())?;
    if out.numel() == 0 {
        return Ok(out);
    }
    if out.exceeds_binding() || current.exceeds_binding() || new_grad.exceeds_binding() {
        // Past one binding: a launch per window of dense grads.
        for t in [current, new_grad] {
            if !t.is_contiguous() {
                return Err(too_large_view(OP, t));
            }
        }
        for (start, len) in windows(out.device(), out.numel()) {
            let (c, g) = (current.window(start, len), new_grad.window(start, len));
            clone_add(&c, &g, &out.window(start, len))?;
        }
        return Ok(out);
    }
    clone_add(current, new_grad, &out)?;
    Ok(out)
}

/// `out = current + new_grad` by the clone-then-add kernel (same shapes; `out` contiguous).
fn clone_add(current: &Tensor, new_grad: &Tensor, out: &Tensor) -> Result<()> {
    const OP: &str = "accumulate_grad";
    let pass = Pass::new(OP, current, new_grad)?;
    let describe = || Elementwise {
        params: "current: f32, new_grad: f32",
        expr: "current + new_grad".into(),
        scalars: Vec::new(),
        operands: vec![
            (2, current.layout().clone()),
            (1, new_grad.layout().clone()),
        ],
        output: 3,
        shape: current.shape().to_vec(),
    };
    Launch::new(
        OP,
        &pass.kernel("clone_add", "clone_add_dense"),
        &[(1, new_grad), (2, current), (3, out)],
        &pass.params,
    )
    .fusible(|| Fusion::Elementwise(describe()))
    .record(pass.workgroups)
}

/// `current += new_grad` in place: same handle, same storage (S-3).
pub(crate) fn add_into(current: &Tensor, new_grad: &Tensor) -> Result<()> {
    const OP: &str = "add_into";
    check_pair(OP, current, new_grad)?;
    let n = current.numel();
    if n == 0 {
        return Ok(());
    }
    if current.dtype().is_16_bit() {
        let _no_grad = crate::tensor::grad_mode::NoGradGuard::new();
        return current.copy_(&current.add(new_grad)?);
    }
    // One dispatch may not read and write the same buffer through two bindings.
    let new_grad = if new_grad.storage_id() == current.storage_id() {
        new_grad.deep_clone()?
    } else {
        new_grad.clone()
    };
    let pass = Pass::new(OP, current, &new_grad)?;
    Launch::new(
        OP,
        &pass.kernel("add_into", "add_into_dense"),
        &[(1, &new_grad), (3, current)],
        &pass.params,
    )
    .record(pass.workgroups)
}

/// Points the grad handle `slot_grad` at the values of `fresh` (a contiguous result of
/// [`accumulate_grad`]) by swapping its buffer (S-2): the handle stays, its storage changes,
/// and the old buffer returns to the pool once nothing else uses it. A grad handle that is a
/// strided view gets a fresh buffer laid out like it, holding `fresh`'s values.
pub(crate) fn swap_in(slot_grad: &Tensor, fresh: Tensor) -> Result<()> {
    let layout = slot_grad.layout();
    if layout.is_contiguous() && layout.offset == 0 {
        slot_grad.swap_storage(fresh.storage());
        return Ok(());
    }
    let bytes = (layout.span() * slot_grad.dtype().size()) as u64;
    let storage = std::sync::Arc::new(Storage::alloc("backward", bytes, slot_grad.device())?);
    let target = Tensor::from_parts(
        storage.clone(),
        layout.clone(),
        slot_grad.dtype(),
        slot_grad.device(),
    );
    copy_into("backward", &fresh, &target, layout)?;
    slot_grad.swap_storage(storage);
    Ok(())
}
