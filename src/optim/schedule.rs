//! Learning-rate schedules: a schedule says the LR for a step (or epoch); the training loop
//! passes it to [`super::Optimizer::set_lr`].

/// The learning rate at each step.
pub trait LrSchedule {
    /// The LR for step `step` (counting from 0).
    fn lr(&self, step: usize) -> f32;
}

/// Cosine annealing from `base_lr` to `min_lr` over `total_steps` (then `min_lr`), as
/// `torch.optim.lr_scheduler.CosineAnnealingLR` over one half period.
#[derive(Debug, Clone, Copy)]
pub struct CosineLr {
    /// LR at step 0.
    pub base_lr: f32,
    /// LR at `total_steps` and after.
    pub min_lr: f32,
    /// Length of the decay.
    pub total_steps: usize,
}

/// `base_lr * gamma^(step / step_size)`, as `torch.optim.lr_scheduler.StepLR`.
#[derive(Debug, Clone, Copy)]
pub struct StepLr {
    /// LR at step 0.
    pub base_lr: f32,
    /// Steps between decays.
    pub step_size: usize,
    /// Factor of each decay.
    pub gamma: f32,
}

impl LrSchedule for CosineLr {
    fn lr(&self, step: usize) -> f32 {
        let t = step.min(self.total_steps) as f64 / self.total_steps.max(1) as f64;
        let cos = (1.0 + (std::f64::consts::PI * t).cos()) / 2.0;
        (self.min_lr as f64 + (self.base_lr - self.min_lr) as f64 * cos) as f32
    }
}

impl LrSchedule for StepLr {
    fn lr(&self, step: usize) -> f32 {
        self.base_lr * self.gamma.powi((step / self.step_size.max(1)) as i32)
    }
}
