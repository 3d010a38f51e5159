//! Autocast: inside [`autocast`], the ops that gain from 16-bit inputs (matmul and what is made
//! of it, convolutions, attention) cast their float inputs to the region's 16-bit dtype, and
//! the ops that need f32's range (norms, softmax, losses) cast theirs to F32, as
//! `torch.autocast` does. Per thread, like grad mode.

use std::cell::RefCell;

use crate::error::{Error, Result};
use crate::tensor::{DType, Tensor};

thread_local! {
    static REGION: RefCell<Option<Region>> = const { RefCell::new(None) };
}

/// An autocast region: its dtype, and the casts of leaves it has made (a parameter is cast
/// once per region, however often it is used).
struct Region {
    dtype: DType,
    casts: Vec<(Tensor, Tensor)>,
    /// True while a backward pass runs inside the region: backward rules run in the dtypes
    /// of their forward, as torch's do.
    suspended: bool,
}

/// Runs `f` with autocast to `dtype` (F16 or BF16) on this thread: matmul (and `Linear`),
/// convolutions and attention cast their F32 inputs to `dtype` and compute in f32 over them,
/// their results in `dtype`; softmax, log_softmax, the norms and the losses cast 16-bit inputs
/// to F32; a binary op of two float dtypes computes in F32. Parameters stay F32 (a leaf is
/// cast once per region, and its grad comes back F32 through the cast); outside the region
/// nothing changes. A captured step records the casts like any other op.
///
/// ```
/// # fn main() -> wgrad::Result<()> {
/// use wgrad::{nn::{self, Module}, DType, Device, Tensor};
/// let dev = Device::new()?;
/// let lin = nn::Linear::new(8, 4, true, &dev)?;
/// let x = Tensor::randn(&[2, 8], 0, &dev)?;
/// let (y, loss) = wgrad::autocast(DType::BF16, || {
///     let y = lin.forward(&x)?;                     // BF16: a 16-bit op
///     let loss = y.log_softmax(1)?.mean()?;         // F32: softmax runs in f32
///     Ok((y, loss))
/// })?;
/// assert_eq!((y.dtype(), loss.dtype()), (DType::BF16, DType::F32));
/// loss.backward()?;
/// assert_eq!(lin.weight.grad().unwrap().dtype(), DType::F32); // master weights
/// # Ok(())
/// # }
/// ```
pub fn autocast<T>(dtype: DType, f: impl FnOnce() -> Result<T>) -> Result<T> {
    if !dtype.is_16_bit() {
        return Err(Error::InvalidArgument {
            op: "autocast",
            msg: format!("casts to F16 or BF16, got {dtype:?}"),
        });
    }
    let region = Region {
        dtype,
        casts: Vec::new(),
        suspended: false,
    };
    let previous = REGION.with(|r| r.replace(Some(region)));
    // Restored on the way out, a panic included.
    struct Restore(Option<Option<Region>>);
    impl Drop for Restore {
        fn drop(&mut self) {
            let previous = self.0.take().expect("restored once");
            REGION.with(|r| *r.borrow_mut() = previous);
        }
    }
    let _restore = Restore(Some(previous));
    f()
}

/// The dtype of the autocast region this thread is in, unless a backward pass suspends it.
pub(crate) fn active_dtype() -> Option<DType> {
    REGION.with(|r| {
        r.borrow()
            .as_ref()
            .filter(|region| !region.suspended)
            .map(|region| region.dtype)
    })
}

/// Suspends autocast until dropped: a backward pass run inside a region, or an op that has
/// cast its inputs itself and runs on them as they are.
pub(crate) struct Suspend(bool);

impl Suspend {
    pub(crate) fn new() -> Suspend {
        Suspend(REGION.with(|r| {
            r.borrow_mut()
                .as_mut()
                .map(|region| std::mem::replace(&mut region.suspended, true))
                .unwrap_or(true)
        }))
    }
}

impl Drop for Suspend {
    fn drop(&mut self) {
        let previous = self.0;
        REGION.with(|r| {
            if let Some(region) = r.borrow_mut().as_mut() {
                region.suspended = previous;
            }
        });
    }
}

/// `t` as a 16-bit op's input in an autocast region: an F32 tensor cast to the region's dtype
/// (a leaf that requires grad, once per region), anything else as it is. Outside a region,
/// `t` itself.
pub(crate) fn for_16_bit_op(t: &Tensor) -> Result<Tensor> {
    let Some(dtype) = active_dtype() else {
        return Ok(t.clone());
    };
    if t.dtype() != DType::F32 {
        return Ok(t.clone());
    }
    let cached = t.is_leaf() && t.requires_grad();
    if cached {
        let hit = REGION.with(|r| {
            let region = r.borrow();
            let casts = &region.as_ref().expect("in a region").casts;
            casts
                .iter()
                .find(|(source, _)| Tensor::same(source, t))
                .map(|(_, c)| c.clone())
        });
        if let Some(cast) = hit {
            return Ok(cast);
        }
    }
    let cast = t.to_dtype(dtype)?;
    if cached {
        REGION.with(|r| {
            if let Some(region) = r.borrow_mut().as_mut() {
                region.casts.push((t.clone(), cast.clone()));
            }
        });
    }
    Ok(cast)
}

/// `t` as an f32 op's input in an autocast region: a 16-bit tensor cast to F32, anything else
/// as it is. Outside a region, `t` itself.
pub(crate) fn for_f32_op(t: &Tensor) -> Result<Tensor> {
    match active_dtype() {
        Some(_) if t.dtype().is_16_bit() => t.to_dtype(DType::F32),
        _ => Ok(t.clone()),
    }
}

/// For the ops autocast runs in 16 bits that have no 16-bit kernels yet (convolutions): under
/// autocast the F32 inputs are cast to the region's dtype first (as [`for_16_bit_op`]); then,
/// when a float input is 16-bit, the op runs as [`crate::ops::cast::through_f32`] says (on F32
/// copies through recorded casts, its result cast back); `None` when every float input is F32
/// and stays so. Float inputs of two dtypes outside autocast are an error naming `op`.
pub(crate) fn in_f32(
    op: &'static str,
    inputs: &[Option<&Tensor>],
    op_f32: impl FnOnce(&[Option<Tensor>]) -> Result<Tensor>,
) -> Result<Option<Tensor>> {
    let inputs = inputs
        .iter()
        .map(|t| t.map(for_16_bit_op).transpose())
        .collect::<Result<Vec<_>>>()?;
    let given: Vec<&Tensor> = inputs.iter().flatten().collect();
    crate::ops::cast::through_f32(op, &given, |wide| {
        // `wide` holds the given inputs in order: put them back in their slots.
        let mut wide = wide.iter();
        let slots: Vec<Option<Tensor>> = inputs
            .iter()
            .map(|t| {
                t.as_ref()
                    .map(|_| wide.next().expect("one per given input").clone())
            })
            .collect();
        op_f32(&slots)
    })
}
