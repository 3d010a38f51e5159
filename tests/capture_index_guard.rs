//! Captured steps over real vocabularies (docs/semantics.md, "Captured steps", index guards):
//! a plan admits any batch whose indices are below the bound its kernels were built for (the
//! embedding's rows, the loss's classes), not only batches with the same largest index; plans
//! per step are bounded; indices out of range are the eager step's error.

mod common;
use wgrad::capture::Step;
use wgrad::nn::loss::{cross_entropy_with, CrossEntropyOptions, IGNORE_INDEX};
use wgrad::nn::{self, Module};
use wgrad::optim::{Optimizer, Sgd, SgdConfig};
use wgrad::{Device, Error, Result, Tensor};

/// Pseudo-random indices in `0..n`.
fn random_indices(count: usize, n: u32, seed: u64) -> Vec<u32> {
    common::random_vec(count, seed)
        .into_iter()
        .map(|v| (((v + 1.0) * 0.5 * n as f32) as u32).min(n - 1))
        .collect()
}

/// One SGD step of `model` on `x` with `labels`.
fn train(model: &dyn Module, opt: &mut Sgd, x: &Tensor, labels: &Tensor) -> Result<Tensor> {
    opt.zero_grad();
    let loss = nn::loss::cross_entropy(&model.forward(x)?, labels)?;
    loss.backward()?;
    opt.step()?;
    Ok(loss)
}

/// Runs `calls` captured steps of `model` on batches from `batch(i)`; returns the step's
/// stats and the device's live bytes after calls 20 and `calls`.
fn run_steps(
    dev: &Device,
    model: &dyn Module,
    calls: usize,
    batch: impl Fn(u64) -> (Tensor, Tensor),
) -> (wgrad::capture::StepStats, u64, u64) {
    let mut opt = Sgd::new(
        model.parameters(),
        SgdConfig {
            lr: 0.05,
            ..Default::default()
        },
    );
    let mut step = Step::new(|b: &[Tensor]| train(model, &mut opt, &b[0], &b[1]));
    let mut live_at_20 = 0;
    let mut replays_after_5 = 0;
    for i in 0..calls {
        let (x, y) = batch(i as u64);
        let before = step.stats().replays;
        let loss = step.run(&[x, y]).unwrap();
        assert!(loss.item().unwrap().is_finite(), "call {i}: loss");
        if i >= 5 {
            replays_after_5 += step.stats().replays - before;
        }
        if i + 1 == 20 {
            dev.synchronize().unwrap();
            live_at_20 = dev.stats().live_bytes;
        }
    }
    dev.synchronize().unwrap();
    let stats = step.stats();
    let share = replays_after_5 as f64 / (calls - 5) as f64;
    assert!(
        share >= 0.95,
        "replays after call 5: {share:.3} ({stats:?})"
    );
    (stats, live_at_20, dev.stats().live_bytes)
}

/// Batch `i` of 64 random tokens in `0..vocab`, and 64 random next tokens.
fn token_batch(i: u64, vocab: usize, dev: &Device) -> (Tensor, Tensor) {
    let tokens = random_indices(64, vocab as u32, 2 * i);
    let next = random_indices(64, vocab as u32, 2 * i + 1);
    (
        Tensor::from_vec_u32(tokens, &[64], dev).unwrap(),
        Tensor::from_vec_u32(next, &[64], dev).unwrap(),
    )
}

fn assert_flat(at_20: u64, at_end: u64) {
    let growth = at_end as f64 / at_20 as f64;
    assert!(
        (0.95..=1.05).contains(&growth),
        "live bytes after call 20: {at_20}, at the end: {at_end}"
    );
}

#[test]
fn a_language_model_step_replays_batches_of_random_tokens() {
    const VOCAB: usize = 5_000;
    let dev = Device::new().unwrap();
    let model = nn::Sequential::new()
        .add(nn::Embedding::new(VOCAB, 32, &dev).unwrap())
        .add(nn::Linear::new(32, VOCAB, true, &dev).unwrap());
    let batch = |i: u64| token_batch(i, VOCAB, &dev);
    let (stats, at_20, at_end) = run_steps(&dev, &model, 120, batch);
    assert!(stats.plans <= 2, "{stats:?}");
    assert_flat(at_20, at_end);
}

/// Token and learned position embeddings, as GPT-2 has them: the positions are uploaded inside
/// the step, and the position embedding checks them.
struct WithPositions {
    tokens: nn::Embedding,
    positions: nn::Embedding,
    head: nn::Linear,
}

impl Module for WithPositions {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let t = x.shape()[0];
        let at = Tensor::from_vec_u32((0..t as u32).collect(), &[t], x.device())?;
        let h = self.tokens.forward(x)?.add(&self.positions.forward(&at)?)?;
        self.head.forward(&h)
    }

    fn named_parameters(&self) -> Vec<(String, Tensor)> {
        let mut params = self.tokens.named_parameters();
        params.extend(self.positions.named_parameters());
        params.extend(self.head.named_parameters());
        params
    }
}

#[test]
fn positions_uploaded_inside_the_step_do_not_narrow_the_token_bound() {
    // The positions are the same host data at every replay, so their check says nothing of
    // the tokens: batches of random tokens share one plan, as without position embeddings.
    const VOCAB: usize = 5_000;
    let dev = Device::new().unwrap();
    let model = WithPositions {
        tokens: nn::Embedding::new(VOCAB, 32, &dev).unwrap(),
        positions: nn::Embedding::new(64, 32, &dev).unwrap(),
        head: nn::Linear::new(32, VOCAB, true, &dev).unwrap(),
    };
    let batch = |i: u64| token_batch(i, VOCAB, &dev);
    let (stats, at_20, at_end) = run_steps(&dev, &model, 60, batch);
    assert_eq!(stats.captures, 1, "{stats:?}");
    assert_flat(at_20, at_end);
}

#[test]
fn an_mlp_with_a_thousand_classes_replays_batches_of_random_labels() {
    const CLASSES: usize = 1_000;
    let dev = Device::new().unwrap();
    let model = nn::Sequential::new()
        .add(nn::Linear::new(16, 64, true, &dev).unwrap())
        .add(nn::Relu)
        .add(nn::Linear::new(64, CLASSES, true, &dev).unwrap());
    let batch = |i: u64| {
        let x = Tensor::randn(&[256, 16], i, &dev).unwrap();
        let labels = random_indices(256, CLASSES as u32, i + 1_000);
        (x, Tensor::from_vec_u32(labels, &[256], &dev).unwrap())
    };
    let (stats, at_20, at_end) = run_steps(&dev, &model, 120, batch);
    assert!(stats.plans <= 2, "{stats:?}");
    assert_flat(at_20, at_end);
}

#[test]
fn an_index_past_the_plans_bound_is_the_eager_error() {
    let dev = Device::new().unwrap();
    let model = nn::Linear::new(4, 3, true, &dev).unwrap();
    let mut opt = Sgd::new(model.parameters(), SgdConfig::default());
    let mut step = Step::new(|b: &[Tensor]| train(&model, &mut opt, &b[0], &b[1]));
    let x = Tensor::ones(&[2, 4], &dev).unwrap();
    let labels = |v: Vec<u32>| Tensor::from_vec_u32(v, &[2], &dev).unwrap();
    for _ in 0..3 {
        step.run(&[x.clone(), labels(vec![0, 1])]).unwrap();
    }
    assert_eq!(step.stats().replays, 1);
    // Class 2 exists: a larger label than any captured one still replays.
    step.run(&[x.clone(), labels(vec![2, 0])]).unwrap();
    assert_eq!(step.stats().replays, 2);
    // Class 3 does not: the eager step's error, not a replay.
    let err = step.run(&[x.clone(), labels(vec![3, 0])]).unwrap_err();
    expect_loss_index_error(&err);
    assert_eq!(step.stats().replays, 2);
    assert_eq!(step.stats().plans, 1);
}

/// `err` is the loss's error for a label out of range, as the eager step gives it.
fn expect_loss_index_error(err: &Error) {
    assert!(
        matches!(
            err,
            Error::Index {
                op: "cross_entropy",
                ..
            }
        ),
        "{err}"
    );
}

#[test]
fn plans_per_step_are_bounded() {
    let dev = Device::new().unwrap();
    let model = nn::Linear::new(4, 3, true, &dev).unwrap();
    let mut opt = Sgd::new(model.parameters(), SgdConfig::default());
    let mut step = Step::new(|b: &[Tensor]| train(&model, &mut opt, &b[0], &b[1]));
    // A new batch size is a new signature, so a new plan each: only the latest few stay.
    for rows in 1..=8usize {
        let x = Tensor::ones(&[rows, 4], &dev).unwrap();
        let y = Tensor::from_vec_u32(vec![1; rows], &[rows], &dev).unwrap();
        for _ in 0..3 {
            step.run(&[x.clone(), y.clone()]).unwrap();
        }
    }
    assert_eq!(step.stats().replays, 8);
    assert_eq!(step.stats().plans, wgrad::capture::MAX_PLANS);
}

#[test]
fn labels_the_step_derives_are_bounded_by_their_inputs_at_capture() {
    let dev = Device::new().unwrap();
    let model = nn::Linear::new(4, 6, true, &dev).unwrap();
    let mut opt = Sgd::new(model.parameters(), SgdConfig::default());
    // The loss checks a `cat` of the two label inputs, a tensor no input is a view of.
    let mut step = Step::new(|b: &[Tensor]| {
        let labels = Tensor::cat(&[b[1].clone(), b[2].clone()], 0)?;
        train(&model, &mut opt, &b[0], &labels)
    });
    let x = Tensor::ones(&[2, 4], &dev).unwrap();
    let label = |v: u32| Tensor::from_vec_u32(vec![v], &[1], &dev).unwrap();
    for _ in 0..3 {
        step.run(&[x.clone(), label(3), label(1)]).unwrap();
    }
    assert_eq!(step.stats().replays, 1);
    // Below the captured bounds: replays.
    step.run(&[x.clone(), label(2), label(0)]).unwrap();
    assert_eq!(step.stats().replays, 2);
    // Past a captured bound but below the classes: runs the closure again, right.
    step.run(&[x.clone(), label(5), label(1)]).unwrap();
    assert_eq!(step.stats().replays, 2);
    // Past the classes: the eager error.
    let err = step.run(&[x.clone(), label(6), label(1)]).unwrap_err();
    assert!(matches!(err, Error::Index { .. }), "{err}");
}

/// A loss that ignores targets holding `IGNORE_INDEX` (torch's -100).
const IGNORING: CrossEntropyOptions = CrossEntropyOptions {
    ignore_index: Some(IGNORE_INDEX),
    label_smoothing: 0.0,
    weight: None,
    reduction: wgrad::nn::loss::Reduction::Mean,
};

/// SGD at a rate of 0: the model stays as it is, so every call's loss can be compared with the
/// eager loss.
fn frozen(model: &nn::Linear) -> Sgd {
    Sgd::new(
        model.parameters(),
        SgdConfig {
            lr: 0.0,
            ..Default::default()
        },
    )
}

/// A step whose loss ignores targets holding `IGNORE_INDEX`, on labels `derive` makes of the
/// inputs.
fn ignoring_step<'a>(
    model: &'a nn::Linear,
    opt: &'a mut Sgd,
    derive: impl Fn(&[Tensor]) -> Result<Tensor> + 'a,
) -> Step<impl FnMut(&[Tensor]) -> Result<Tensor> + 'a> {
    Step::new(move |b: &[Tensor]| {
        opt.zero_grad();
        let loss = cross_entropy_with(&model.forward(&b[0])?, &derive(b)?, &IGNORING)?;
        loss.backward()?;
        opt.step()?;
        Ok(loss)
    })
}

#[test]
fn labels_holding_the_ignore_marker_replay_and_a_label_past_the_classes_is_the_eager_error() {
    let dev = Device::new().unwrap();
    let model = nn::Linear::new(4, 3, true, &dev).unwrap();
    let mut opt = frozen(&model);
    let x = Tensor::randn(&[2, 4], 5, &dev).unwrap();
    let labels = |v: Vec<u32>| Tensor::from_vec_u32(v, &[2], &dev).unwrap();
    let eager = |y: &Tensor| {
        cross_entropy_with(&model.forward(&x).unwrap(), y, &IGNORING)
            .unwrap()
            .item()
            .unwrap()
    };
    let want: Vec<f32> = [vec![0, IGNORE_INDEX], vec![IGNORE_INDEX, 2], vec![1, 0]]
        .into_iter()
        .map(|v| eager(&labels(v)))
        .collect();
    let mut step = ignoring_step(&model, &mut opt, |b| Ok(b[1].clone()));
    for _ in 0..3 {
        let loss = step
            .run(&[x.clone(), labels(vec![0, IGNORE_INDEX])])
            .unwrap();
        assert_eq!(loss.item().unwrap(), want[0]);
    }
    assert_eq!(step.stats().replays, 1);
    // The marker in another row, then no marker: both replay.
    let loss = step
        .run(&[x.clone(), labels(vec![IGNORE_INDEX, 2])])
        .unwrap();
    assert_eq!(loss.item().unwrap(), want[1]);
    let loss = step.run(&[x.clone(), labels(vec![1, 0])]).unwrap();
    assert_eq!(loss.item().unwrap(), want[2]);
    assert_eq!(step.stats().replays, 3);
    // Class 3 does not exist and is not the marker: the eager step's error.
    let err = step
        .run(&[x.clone(), labels(vec![3, IGNORE_INDEX])])
        .unwrap_err();
    expect_loss_index_error(&err);
    assert_eq!(step.stats().replays, 3);
}

#[test]
fn derived_labels_holding_the_ignore_marker_replay() {
    let dev = Device::new().unwrap();
    let model = nn::Linear::new(4, 3, true, &dev).unwrap();
    let mut opt = frozen(&model);
    let x = Tensor::randn(&[2, 4], 6, &dev).unwrap();
    let label = |v: u32| Tensor::from_vec_u32(vec![v], &[1], &dev).unwrap();
    let mut step = ignoring_step(&model, &mut opt, |b| {
        Tensor::cat(&[b[1].clone(), b[2].clone()], 0)
    });
    for _ in 0..3 {
        step.run(&[x.clone(), label(2), label(IGNORE_INDEX)])
            .unwrap();
    }
    assert_eq!(step.stats().replays, 1);
    // A smaller label and the marker again: replays.
    step.run(&[x.clone(), label(0), label(IGNORE_INDEX)])
        .unwrap();
    assert_eq!(step.stats().replays, 2);
    // Past the classes: the eager error.
    let err = step.run(&[x.clone(), label(1), label(7)]).unwrap_err();
    assert!(matches!(err, Error::Index { .. }), "{err}");
}
