//! `io::save_training` and `io::load_training`: a run stopped and resumed into fresh objects
//! (another init, a scrambled generator) goes on bit for bit as the run that never stopped,
//! with AdamW over two parameter groups under a cosine schedule and dropout, with SGD
//! momentum, and captured; and bad training-state files are errors that change nothing. The
//! tests run one at a time: they share the global generator.

mod common;
use common::*;
use std::sync::{Mutex, MutexGuard};
use wgrad::capture::Step;
use wgrad::nn::{self, Module};
use wgrad::optim::{self, LrSchedule, Optimizer, ParamGroup};
use wgrad::{Error, Tensor};

fn serial() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

const STEPS: usize = 40;
const STOP: usize = 17;

fn model() -> nn::Sequential {
    let dev = device();
    nn::Sequential::new()
        .add(nn::Linear::new(8, 16, true, dev).unwrap())
        .add(nn::Relu)
        .add(nn::Dropout::new(0.3).unwrap())
        .add(nn::Linear::new(16, 4, true, dev).unwrap())
}

/// The batch of step `i`: the same in every run.
fn batch(i: usize) -> [Tensor; 2] {
    let (x, _) = random_tensor(&[12, 8], 100 + i as u64);
    let y = Tensor::from_labels((0..12).map(|r| ((r + i) % 4) as u32).collect(), device()).unwrap();
    [x, y]
}

/// Weights with decay 0.1, biases without at twice the rate.
fn grouped_adamw(model: &nn::Sequential) -> optim::AdamW {
    let (w, b): (Vec<_>, Vec<_>) = model
        .named_parameters()
        .into_iter()
        .partition(|(n, _)| n.ends_with("weight"));
    let strip = |v: Vec<(String, Tensor)>| v.into_iter().map(|(_, t)| t).collect::<Vec<_>>();
    let groups = vec![
        ParamGroup::new(strip(w)).weight_decay(0.1),
        ParamGroup::new(strip(b)).weight_decay(0.0).lr(2e-2),
    ];
    optim::AdamW::with_groups(
        groups,
        optim::AdamConfig {
            lr: 1e-2,
            ..Default::default()
        },
    )
}

fn sgd_momentum(model: &nn::Sequential) -> optim::Sgd {
    let config = optim::SgdConfig {
        lr: 0.05,
        momentum: 0.9,
        weight_decay: 1e-3,
        ..Default::default()
    };
    optim::Sgd::new(model.parameters(), config)
}

fn schedule() -> optim::CosineLr {
    optim::CosineLr {
        base_lr: 1e-2,
        min_lr: 1e-4,
        total_steps: STEPS,
    }
}

/// One training step `i`: the schedule's rate, then forward, backward, update.
fn train_step(model: &dyn Module, opt: &mut dyn Optimizer, b: &[Tensor]) -> wgrad::Result<Tensor> {
    opt.zero_grad();
    let loss = nn::loss::cross_entropy(&model.forward(&b[0])?, &b[1])?;
    loss.backward()?;
    opt.step()?;
    Ok(loss)
}

/// Steps `from..to`, eager or captured; their losses' bits.
fn run(
    model: &nn::Sequential,
    opt: &mut dyn Optimizer,
    (from, to): (usize, usize),
    captured: bool,
) -> Vec<u32> {
    let opt = std::cell::RefCell::new(opt);
    let mut step = Step::new(|b: &[Tensor]| train_step(model, &mut **opt.borrow_mut(), b));
    (from..to)
        .map(|i| {
            opt.borrow_mut().set_lr(schedule().lr(i));
            let b = batch(i);
            let loss = match captured {
                true => step.run(&b).unwrap(),
                false => train_step(model, &mut **opt.borrow_mut(), &b).unwrap(),
            };
            loss.item().unwrap().to_bits()
        })
        .collect()
}

fn bits_of(model: &nn::Sequential) -> Vec<Vec<u32>> {
    model
        .parameters()
        .iter()
        .map(|p| p.to_vec().unwrap().iter().map(|v| v.to_bits()).collect())
        .collect()
}

/// The run that never stops, and the one stopped after `STOP` steps, saved, and resumed into
/// a fresh model and optimizer: their losses and final parameters, bit for bit.
fn assert_resume_is_exact<O: Optimizer>(make_opt: fn(&nn::Sequential) -> O, captured: bool) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("run.safetensors");
    wgrad::manual_seed(7);
    let whole = model();
    let mut opt = make_opt(&whole);
    let want = run(&whole, &mut opt, (0, STEPS), captured);

    wgrad::manual_seed(7);
    let first = model();
    let mut opt = make_opt(&first);
    let mut got = run(&first, &mut opt, (0, STOP), captured);
    wgrad::io::save_training(&path, &first, &opt, STOP as u64).unwrap();
    drop((first, opt));

    // A fresh model of another init, a generator elsewhere: the file restores both.
    wgrad::manual_seed(12345);
    let resumed = model();
    let mut opt = make_opt(&resumed);
    assert_eq!(
        wgrad::io::load_training(&path, &resumed, &mut opt).unwrap(),
        STOP as u64
    );
    got.extend(run(&resumed, &mut opt, (STOP, STEPS), captured));
    assert_eq!(got, want, "losses, bit for bit");
    assert_eq!(
        bits_of(&resumed),
        bits_of(&whole),
        "parameters, bit for bit"
    );
}

#[test]
fn adamw_with_two_groups_a_cosine_schedule_and_dropout_resumes_bit_for_bit() {
    let _s = serial();
    assert_resume_is_exact(grouped_adamw, false);
}

#[test]
fn sgd_with_momentum_resumes_bit_for_bit() {
    let _s = serial();
    assert_resume_is_exact(sgd_momentum, false);
}

#[test]
fn a_captured_run_resumes_bit_for_bit() {
    let _s = serial();
    assert_resume_is_exact(grouped_adamw, true);
}

/// Values of every parameter and `opt`'s saved state, to see that nothing changed.
fn snapshot(model: &nn::Sequential, opt: &dyn Optimizer) -> (Vec<Vec<u32>>, Vec<(String, String)>) {
    (bits_of(model), opt.state().scalars)
}

#[test]
fn a_state_from_another_model_or_optimizer_is_an_error_that_changes_nothing() {
    let _s = serial();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("run.safetensors");
    let saved = model();
    let mut opt = grouped_adamw(&saved);
    run(&saved, &mut opt, (0, 3), false);
    wgrad::io::save_training(&path, &saved, &opt, 3).unwrap();

    let target = model();
    let mut adamw = grouped_adamw(&target);
    run(&target, &mut adamw, (0, 1), false);
    let before = snapshot(&target, &adamw);
    // Another optimizer kind.
    let mut sgd = sgd_momentum(&target);
    let err = wgrad::io::load_training(&path, &target, &mut sgd).unwrap_err();
    assert!(err.to_string().contains("AdamW"), "{err}");
    // Another model: other shapes.
    let wider = nn::Sequential::new().add(nn::Linear::new(8, 5, true, device()).unwrap());
    let mut wider_opt = optim::AdamW::new(wider.parameters(), Default::default());
    let err = wgrad::io::load_training(&path, &wider, &mut wider_opt).unwrap_err();
    assert!(
        err.to_string().contains("[5, 8]") || err.to_string().contains("shape"),
        "{err}"
    );
    // A plain checkpoint is no training state; a truncated file neither.
    let plain = dir.path().join("plain.safetensors");
    wgrad::io::save(&plain, &target).unwrap();
    let err = wgrad::io::load_training(&plain, &target, &mut adamw).unwrap_err();
    assert!(err.to_string().contains("not a training state"), "{err}");
    let bytes = std::fs::read(&path).unwrap();
    let truncated = dir.path().join("truncated.safetensors");
    std::fs::write(&truncated, &bytes[..bytes.len() - 10]).unwrap();
    assert!(matches!(
        wgrad::io::load_training(&truncated, &target, &mut adamw),
        Err(Error::Io { .. })
    ));
    assert_eq!(snapshot(&target, &adamw), before);
}

#[test]
fn a_step_count_that_does_not_fit_is_an_error() {
    let _s = serial();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("run.safetensors");
    let m = model();
    let mut opt = sgd_momentum(&m);
    wgrad::io::save_training(&path, &m, &opt, u64::MAX).unwrap();
    assert_eq!(
        wgrad::io::load_training(&path, &m, &mut opt).unwrap(),
        u64::MAX
    );
    // The header's step, 20 digits, made one past what a u64 holds (same length).
    let mut bytes = std::fs::read(&path).unwrap();
    let max = u64::MAX.to_string().into_bytes();
    let at = bytes
        .windows(max.len())
        .position(|w| w == max.as_slice())
        .unwrap();
    bytes[at..at + max.len()].copy_from_slice(b"99999999999999999999");
    std::fs::write(&path, &bytes).unwrap();
    let err = wgrad::io::load_training(&path, &m, &mut opt).unwrap_err();
    assert!(err.to_string().contains("step"), "{err}");
}

/// The resumed half of [`a_run_resumes_bit_for_bit_in_a_fresh_process`], run only in the
/// process that test starts: resumes from `WGRAD_RESUME_FROM` and writes the losses' and final
/// parameters' bits beside it.
#[test]
fn resumed_half_in_a_child_process() {
    let Ok(path) = std::env::var("WGRAD_RESUME_FROM") else {
        return;
    };
    let _s = serial();
    let resumed = model();
    let mut opt = grouped_adamw(&resumed);
    let step = wgrad::io::load_training(&path, &resumed, &mut opt).unwrap() as usize;
    let losses = run(&resumed, &mut opt, (step, STEPS), false);
    let out = format!("{losses:?}\n{:?}", bits_of(&resumed));
    std::fs::write(format!("{path}.out"), out).unwrap();
}

#[test]
fn a_run_resumes_bit_for_bit_in_a_fresh_process() {
    let _s = serial();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("run.safetensors");
    wgrad::manual_seed(7);
    let whole = model();
    let mut opt = grouped_adamw(&whole);
    let want = run(&whole, &mut opt, (0, STEPS), false);
    wgrad::manual_seed(7);
    let first = model();
    let mut opt = grouped_adamw(&first);
    run(&first, &mut opt, (0, STOP), false);
    wgrad::io::save_training(&path, &first, &opt, STOP as u64).unwrap();
    let status = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "resumed_half_in_a_child_process",
            "--test-threads",
            "1",
        ])
        .env("WGRAD_RESUME_FROM", &path)
        .status()
        .unwrap();
    assert!(status.success());
    let out = std::fs::read_to_string(format!("{}.out", path.display())).unwrap();
    let want = format!("{:?}\n{:?}", &want[STOP..], bits_of(&whole));
    assert_eq!(
        out, want,
        "the fresh process's losses and parameters, bit for bit"
    );
}
