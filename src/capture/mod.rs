//! Captured training steps: record a step once, then replay it without running its closure.
//!
//! [`Step`] wraps a closure that runs one training step (forward, `backward()`,
//! `opt.step()`) and returns the loss. Its first call on inputs of a given shape runs eagerly;
//! the second runs eagerly too, while every kernel launch, upload and grad-slot change is
//! written down; from then on [`Step::run`] replays that plan in one queue submission. What a
//! replay guarantees is stated in `docs/semantics.md` ("Captured steps"): the same values as
//! the eager step, each leaf's current grad read as an input (S-14), grads installed after the
//! replay as the engine's apply stage installs them (S-2), and per-step host values (learning
//! rate, Adam's step count, dropout seeds) read at each replay.

mod codegen;
mod draft;
mod guard;
mod ir;
mod memory;
mod passes;
mod plan;
mod replay;

use std::collections::HashMap;

use crate::error::{Error, Result};
use crate::tensor::tape;
use crate::tensor::Tensor;
use guard::InputSignature;
use plan::Plan;

/// How often a signature may fail to capture before its calls stay eager.
const MAX_CAPTURE_ATTEMPTS: u32 = 3;

/// How many plans a [`Step`] keeps. A plan holds its arena (every intermediate of the step)
/// on the device, so plans for input shapes not seen lately are dropped, least recently
/// replayed first, and their arenas freed; a dropped shape that comes back is captured again.
pub const MAX_PLANS: usize = 4;

/// What a [`Step`] has done so far.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StepStats {
    /// Calls that ran the closure without recording.
    pub eager: u64,
    /// Calls that ran the closure while recording a plan (kept or not).
    pub captures: u64,
    /// Calls that replayed a plan.
    pub replays: u64,
    /// Plans kept, one per input signature, at most [`MAX_PLANS`].
    pub plans: usize,
    /// Launches the fuser merged away in the latest plan (`passes.epilogues + passes.fused +
    /// passes.merged`).
    pub fused_away: usize,
    /// What each pass did to the latest plan.
    pub passes: PassStats,
    /// Dispatches one replay of the latest plan records.
    pub replay_dispatches: u64,
    /// Host time of the latest replay from the start of `run` to its queue submission:
    /// guards, per-step host values, and encoding where it was not done ahead. (The
    /// submission itself then wakes the driver.)
    pub last_replay_to_submit: std::time::Duration,
    /// Replays that submitted commands encoded right after the previous replay's submission
    /// (while the device ran it), because they bind the same buffers: the same input
    /// buffers (a pool hands a training loop's batches the same ones), the grads as that
    /// replay left them, and no grad of the step held elsewhere.
    pub replays_encoded_ahead: u64,
}

/// The commands each pass of a capture removed from its plan, in the order they run.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PassStats {
    /// Whole copies of an intermediate into a value the step makes (a grad installed into an
    /// empty slot), gone because the intermediate's writers write the value itself.
    pub copies_forwarded: usize,
    /// Elementwise launches run in the stores of the matmul or norm whose product they
    /// consume (that launch's own count included: it moves to the run's end).
    pub epilogues: usize,
    /// Elementwise launches run inside another: one generated kernel per run of them.
    pub fused: usize,
    /// Launches of one pipeline merged into one launch (an optimizer's updates, a backward
    /// pass's reductions).
    pub merged: usize,
}

/// A training step that is captured on its second call and replayed after that.
///
/// ```
/// # fn main() -> wgrad::Result<()> {
/// use wgrad::nn::{loss::mse, Linear, Module};
/// use wgrad::optim::{Optimizer, Sgd, SgdConfig};
/// use wgrad::{capture::Step, Device, Tensor};
/// let dev = Device::new()?;
/// let model = Linear::new(3, 1, true, &dev)?;
/// let mut opt = Sgd::new(model.parameters(), SgdConfig::default());
/// let mut step = Step::new(|batch: &[Tensor]| {
///     opt.zero_grad();
///     let loss = mse(&model.forward(&batch[0])?, &batch[1])?;
///     loss.backward()?;
///     opt.step()?;
///     Ok(loss)
/// });
/// let x = Tensor::ones(&[4, 3], &dev)?;
/// let y = Tensor::zeros(&[4, 1], &dev)?;
/// for _ in 0..3 {
///     step.run(&[x.clone(), y.clone()])?; // eager, capture, replay
/// }
/// assert_eq!(step.stats().replays, 1);
/// # Ok(())
/// # }
/// ```
pub struct Step<F> {
    closure: F,
    fusion: bool,
    /// Most recently replayed or captured first.
    plans: Vec<Plan>,
    /// Calls seen per signature, and failed captures.
    seen: HashMap<InputSignature, (u64, u32)>,
    stats: StepStats,
}

impl<F> Step<F>
where
    F: FnMut(&[Tensor]) -> Result<Tensor>,
{
    /// Wraps `closure`, which takes the step's inputs (a batch) and returns its loss.
    pub fn new(closure: F) -> Step<F> {
        Step {
            closure,
            fusion: true,
            plans: Vec::new(),
            seen: HashMap::new(),
            stats: StepStats::default(),
        }
    }

    /// Turns the fuser off (or on again) for plans captured from now on: to compare, or to
    /// look for a fusion bug.
    pub fn with_fusion(mut self, fusion: bool) -> Step<F> {
        self.fusion = fusion;
        self
    }

    /// Runs one step on `inputs` and returns the loss: eagerly on the first call for inputs
    /// of this shape, eagerly while capturing on the second, by replay after that. A call
    /// whose inputs, grad mode, train/eval flags or grad slots differ from every plan's
    /// captures again. The returned loss is a fresh tensor each call, detached: the step's
    /// backward has already run, and a replay records no graph.
    pub fn run(&mut self, inputs: &[Tensor]) -> Result<Tensor> {
        let Some(first) = inputs.first() else {
            return Err(Error::InvalidArgument {
                op: "capture::Step::run",
                msg: "needs at least one input tensor".into(),
            });
        };
        if tape::is_open() {
            return Err(Error::Capture {
                op: "capture::Step::run",
                msg: "called while another step is being captured on this thread".into(),
            });
        }
        let started = std::time::Instant::now();
        let signature = InputSignature::of(inputs);
        // A plan that alone holds a leaf it trains (the user swapped the model) is dropped,
        // with its arena.
        release_plans(&mut self.plans, |plan| !plan.is_orphaned());
        for i in 0..self.plans.len() {
            let plan = &mut self.plans[i];
            if let Some(loss) = plan.replay(inputs, &signature, started)? {
                self.stats.replays += 1;
                self.stats.replays_encoded_ahead += u64::from(plan.last_encoded_ahead());
                self.stats.last_replay_to_submit = plan.last_to_submit();
                self.plans[..=i].rotate_right(1);
                return Ok(loss);
            }
        }
        let (calls, failures) = self.seen.entry(signature.clone()).or_default();
        *calls += 1;
        if *calls == 1 || *failures >= MAX_CAPTURE_ATTEMPTS {
            self.stats.eager += 1;
            return Ok((self.closure)(inputs)?.detach());
        }

        self.stats.captures += 1;
        // A panic in the closure drops the recording, which closes the tape.
        let recording = tape::open(first.device());
        // Like a replayed loss, the returned loss has no graph; dropping the graph before the
        // tape closes frees the tensors it saved, which would otherwise outlive the step.
        let result = (self.closure)(inputs).map(|loss| loss.detach());
        let tape = recording.finish();
        let loss = result?;
        let device = first.device().clone();
        let fusion = self.fusion;
        let mut passes = PassStats::default();
        let planned = draft::draft(tape, inputs, &loss).and_then(|(mut draft, shell)| {
            if fusion {
                passes = passes::run_passes(&mut draft, &device);
            }
            plan::lay_out(draft, shell).map_err(|e| e.to_string())
        });
        match planned {
            Ok(plan) => {
                self.stats.passes = passes;
                self.stats.fused_away = passes.epilogues + passes.fused + passes.merged;
                self.stats.replay_dispatches = plan.dispatches();
                // Older plans whose guards no longer pass are kept, a few: a later call may
                // match them.
                self.plans.insert(0, plan);
                let mut kept = 0;
                release_plans(&mut self.plans, |_| {
                    kept += 1;
                    kept <= MAX_PLANS
                });
                self.stats.plans = self.plans.len();
            }
            Err(reason) => {
                let (_, failures) = self.seen.get_mut(&signature).expect("counted above");
                *failures += 1;
                if *failures >= MAX_CAPTURE_ATTEMPTS {
                    log::warn!("capture::Step: running eagerly from now on: {reason}");
                } else {
                    log::debug!("capture::Step: not captured this call: {reason}");
                }
            }
        }
        Ok(loss)
    }

    /// Counts of eager, capturing and replayed calls.
    pub fn stats(&self) -> StepStats {
        self.stats
    }
}

/// Drops the plans `keep` refuses (in order), with their arenas and the generated kernels
/// only they held.
fn release_plans(plans: &mut Vec<Plan>, keep: impl FnMut(&Plan) -> bool) {
    let before = plans.len();
    let device = plans.first().map(|p| p.device().clone());
    plans.retain(keep);
    if let (Some(device), true) = (device, plans.len() < before) {
        device.inner.release_unheld_generated_pipelines();
    }
}

impl<F> Drop for Step<F> {
    fn drop(&mut self) {
        release_plans(&mut self.plans, |_| false);
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    use std::time::Duration;

    use super::Step;
    use crate::{Device, Tensor};

    /// A plan releases its buffers and kernels under the device's context lock (see `Drop for
    /// Plan`), so a thread dropping one waits while another thread holds that lock: on GL it
    /// would otherwise meet wgpu's own lock, which panics after 6 s of waiting. (Dropping the
    /// whole step waits anyway, to release the generated kernels no plan holds.)
    #[test]
    fn dropping_a_captured_plan_waits_for_the_context_lock() {
        let dev = Device::new().unwrap();
        let w = Tensor::randn(&[4, 4], 1, &dev)
            .unwrap()
            .requires_grad_(true);
        let x = Tensor::randn(&[2, 4], 2, &dev).unwrap();
        let mut step = Step::new(move |inputs: &[Tensor]| {
            let loss = inputs[0].matmul(&w)?.sum()?;
            loss.backward()?;
            Ok(loss)
        });
        for _ in 0..3 {
            step.run(std::slice::from_ref(&x)).unwrap();
        }
        assert_eq!((step.stats().plans, step.stats().replays), (1, 1));
        let plan = step.plans.pop().expect("the captured plan");
        let dropped = Arc::new(AtomicBool::new(false));
        let context = dev.inner.hold_context();
        let done = dropped.clone();
        let dropper = std::thread::spawn(move || {
            drop(plan);
            done.store(true, Ordering::SeqCst);
        });
        std::thread::sleep(Duration::from_millis(300));
        assert!(
            !dropped.load(Ordering::SeqCst),
            "the plan was released while another thread held the context lock"
        );
        drop(context);
        dropper.join().unwrap();
        assert!(dropped.load(Ordering::SeqCst));
    }

    /// Under `WGRAD_POISON_BUFFERS` each replay first fills the plan's arena with NaN, so a
    /// kernel that read an intermediate before the step wrote it would read NaN, not what the
    /// previous replay left: the bytes of the arena no kernel writes come out all ones, and
    /// the step's loss is unchanged.
    #[test]
    fn a_poisoned_replay_fills_the_arena_with_nan_first() {
        let dev = Device::new().unwrap();
        let w = Tensor::randn(&[4, 4], 1, &dev)
            .unwrap()
            .requires_grad_(true);
        let x = Tensor::randn(&[2, 4], 2, &dev).unwrap();
        let mut step = Step::new(move |inputs: &[Tensor]| {
            let loss = inputs[0].matmul(&w)?.tanh()?.sum()?;
            loss.backward()?;
            Ok(loss)
        });
        let mut losses = Vec::new();
        for _ in 0..3 {
            losses.push(step.run(std::slice::from_ref(&x)).unwrap().item().unwrap());
        }
        assert_eq!(step.stats().replays, 1);
        // The bytes past the intermediates: every [2, 4] value takes 32 of its 256.
        let unwritten = |plan: &super::plan::Plan| -> Vec<Vec<u8>> {
            assert!(!plan.arena.is_empty(), "the step has intermediates");
            (plan.arena.iter())
                .map(|s| dev.inner.read("test", s.buffer(), 128, 128).unwrap())
                .collect()
        };
        let before = unwritten(&step.plans[0]);
        assert!(before.iter().all(|b| b.iter().any(|&x| x != 0xFF)));
        dev.inner.set_poison_buffers(true);
        losses.push(step.run(std::slice::from_ref(&x)).unwrap().item().unwrap());
        assert_eq!(step.stats().replays, 2);
        let after = unwritten(&step.plans[0]);
        assert!(after.iter().all(|b| b.iter().all(|&x| x == 0xFF)));
        assert_eq!(losses[3], losses[2]);
    }
}
