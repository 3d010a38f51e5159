//! Grad mode: whether ops record graph nodes. Per thread, as in PyTorch, so one thread's
//! `no_grad` never changes what another thread records.

use std::cell::Cell;

thread_local! {
    static GRAD_ENABLED: Cell<bool> = const { Cell::new(true) };
}

/// True when ops on this thread record graph nodes.
pub fn is_grad_enabled() -> bool {
    GRAD_ENABLED.with(|g| g.get())
}

/// Turns recording off on this thread until dropped, then restores what was there before.
///
/// ```
/// # fn main() -> wgrad::Result<()> {
/// let dev = wgrad::Device::new()?;
/// let w = wgrad::Tensor::ones(&[2], &dev)?.requires_grad_(true);
/// let y = {
///     let _guard = wgrad::autograd::NoGradGuard::new();
///     w.mul_scalar(2.0)?
/// };
/// assert!(!y.requires_grad());
/// # Ok(())
/// # }
/// ```
pub struct NoGradGuard {
    previous: bool,
}

impl NoGradGuard {
    /// Starts a region in which ops record nothing.
    #[allow(clippy::new_without_default)]
    pub fn new() -> NoGradGuard {
        let previous = GRAD_ENABLED.with(|g| g.replace(false));
        NoGradGuard { previous }
    }
}

impl Drop for NoGradGuard {
    fn drop(&mut self) {
        GRAD_ENABLED.with(|g| g.set(self.previous));
    }
}

/// Runs `f` with recording off: its ops record nothing and their results do not require
/// grad (S-11).
///
/// ```
/// # fn main() -> wgrad::Result<()> {
/// let dev = wgrad::Device::new()?;
/// let w = wgrad::Tensor::ones(&[2], &dev)?.requires_grad_(true);
/// let y = wgrad::no_grad(|| w.mul_scalar(2.0))?;
/// assert!(!y.requires_grad());
/// # Ok(())
/// # }
/// ```
pub fn no_grad<T>(f: impl FnOnce() -> T) -> T {
    let _guard = NoGradGuard::new();
    f()
}
