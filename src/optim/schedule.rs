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

/// A linear warmup before `schedule`: the rate climbs from 0 at step 0 to `schedule`'s first
/// rate at step `steps`, then follows `schedule` from its step 0. With a [`CosineLr`] of
/// `total_steps: total - steps` and `min_lr: 0.0` this is transformers'
/// `get_cosine_schedule_with_warmup`, the usual schedule of a language model's training (the
/// first step's rate is 0, so its update is none).
///
/// ```
/// use wgrad::optim::{CosineLr, LrSchedule, Warmup};
/// let schedule = Warmup {
///     steps: 100,
///     schedule: CosineLr { base_lr: 3e-4, min_lr: 0.0, total_steps: 900 },
/// };
/// assert_eq!(schedule.lr(0), 0.0);
/// assert_eq!(schedule.lr(50), 1.5e-4);
/// assert_eq!(schedule.lr(100), 3e-4);
/// assert_eq!(schedule.lr(1000), 0.0);
/// ```
#[derive(Debug, Clone, Copy)]
pub struct Warmup<S> {
    /// Length of the warmup (0: `schedule` alone).
    pub steps: usize,
    /// What follows it, started at its step 0.
    pub schedule: S,
}

impl<S: LrSchedule> LrSchedule for Warmup<S> {
    fn lr(&self, step: usize) -> f32 {
        if step < self.steps {
            (self.schedule.lr(0) as f64 * step as f64 / self.steps as f64) as f32
        } else {
            self.schedule.lr(step - self.steps)
        }
    }
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
