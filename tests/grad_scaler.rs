//! `optim::GradScaler` (docs/ops.md, "Mixed precision"): the loss scaled, grads unscaled on
//! the device and checked for inf and NaN, a step skipped when one is found, the scale halved
//! after it and doubled after `growth_interval` good steps, as torch.amp's GradScaler.

mod common;
use common::*;
use wgrad::optim::{Adam, AdamConfig, GradScaler, GradScalerOptions, Optimizer, Sgd, SgdConfig};
use wgrad::{Error, Tensor};

fn leaf(values: &[f32]) -> Tensor {
    Tensor::from_slice(values, &[values.len()], device())
        .unwrap()
        .requires_grad_(true)
}

#[test]
fn a_step_with_finite_grads_unscales_them_then_steps() {
    let w = leaf(&[1.0, -2.0, 3.0]);
    let mut opt = Sgd::new(
        vec![w.clone()],
        SgdConfig {
            lr: 0.5,
            ..Default::default()
        },
    );
    let mut scaler = GradScaler::new();
    // loss = sum(w * [1, 2, 3]): the grad is [1, 2, 3], scaled by 65,536 in backward.
    let c = Tensor::from_slice(&[1.0, 2.0, 3.0], &[3], device()).unwrap();
    let scaled = scaler.scale(&w.mul(&c).unwrap().sum().unwrap()).unwrap();
    scaled.backward().unwrap();
    assert_eq!(
        w.grad().unwrap().to_vec().unwrap(),
        vec![65536.0, 131072.0, 196608.0]
    );
    assert!(scaler.step(&mut opt).unwrap());
    assert_eq!(w.grad().unwrap().to_vec().unwrap(), vec![1.0, 2.0, 3.0]);
    assert_eq!(w.to_vec().unwrap(), vec![0.5, -3.0, 1.5]);
    scaler.update().unwrap();
    assert_eq!(scaler.scale_factor(), 65536.0);
}

#[test]
fn a_loss_forced_to_inf_skips_the_step_and_halves_the_scale() {
    let w = leaf(&[0.5, 0.25]);
    let mut opt = Adam::new(vec![w.clone()], AdamConfig::default());
    let mut scaler = GradScaler::new();
    // One good step, so the optimizer has state to keep.
    scaler.scale(&w.sum().unwrap()).unwrap().backward().unwrap();
    assert!(scaler.step(&mut opt).unwrap());
    scaler.update().unwrap();
    let params_before = w.to_vec().unwrap();
    let state_before = opt.state();
    let moments_before: Vec<Vec<f32>> = state_before
        .tensors
        .iter()
        .map(|(_, t)| t.to_vec().unwrap())
        .collect();

    opt.zero_grad();
    let inf = w.sum().unwrap().mul_scalar(f32::INFINITY).unwrap();
    scaler.scale(&inf).unwrap().backward().unwrap();
    assert!(!scaler.step(&mut opt).unwrap(), "the step is skipped");
    assert_eq!(w.to_vec().unwrap(), params_before);
    let state_after = opt.state();
    assert_eq!(
        state_after.scalars, state_before.scalars,
        "step count unchanged"
    );
    let moments_after: Vec<Vec<f32>> = state_after
        .tensors
        .iter()
        .map(|(_, t)| t.to_vec().unwrap())
        .collect();
    assert_eq!(moments_after, moments_before);
    scaler.update().unwrap();
    assert_eq!(scaler.scale_factor(), 32768.0);
}

#[test]
fn a_nan_anywhere_in_a_grad_past_65536_elements_is_found() {
    let n = 70_001;
    let w = Tensor::zeros(&[n], device()).unwrap().requires_grad_(true);
    let mut grad = vec![1.0f32; n];
    grad[n - 1] = f32::NAN;
    w.set_grad(Some(Tensor::from_vec(grad, &[n], device()).unwrap()))
        .unwrap();
    let mut opt = Sgd::new(
        vec![w.clone()],
        SgdConfig {
            lr: 1.0,
            ..Default::default()
        },
    );
    let mut scaler = GradScaler::new();
    assert!(!scaler.step(&mut opt).unwrap());
    assert!(w.to_vec().unwrap().iter().all(|&v| v == 0.0), "no update");
}

#[test]
fn good_steps_double_the_scale_after_the_growth_interval() {
    let options = GradScalerOptions {
        init_scale: 8.0,
        growth_interval: 3,
        ..Default::default()
    };
    let mut scaler = GradScaler::with_options(options).unwrap();
    let w = leaf(&[1.0]);
    let mut opt = Sgd::new(
        vec![w.clone()],
        SgdConfig {
            lr: 1e-3,
            ..Default::default()
        },
    );
    let mut run = |scaler: &mut GradScaler, loss_scale: f32| {
        opt.zero_grad();
        let loss = w.sum().unwrap().mul_scalar(loss_scale).unwrap();
        scaler.scale(&loss).unwrap().backward().unwrap();
        scaler.step(&mut opt).unwrap();
        scaler.update().unwrap();
        scaler.scale_factor()
    };
    assert_eq!(run(&mut scaler, 1.0), 8.0);
    assert_eq!(run(&mut scaler, 1.0), 8.0);
    assert_eq!(run(&mut scaler, 1.0), 16.0, "3 good steps: doubled");
    assert_eq!(run(&mut scaler, 1.0), 16.0);
    assert_eq!(run(&mut scaler, f32::INFINITY), 8.0, "an overflow: halved");
    assert_eq!(run(&mut scaler, 1.0), 8.0, "the count starts again");
    assert_eq!(run(&mut scaler, 1.0), 8.0);
    assert_eq!(run(&mut scaler, 1.0), 16.0);
}

#[test]
fn update_without_a_step_changes_nothing() {
    let mut scaler = GradScaler::new();
    scaler.update().unwrap();
    assert_eq!(scaler.scale_factor(), 65536.0);
}

#[test]
fn bad_scaler_options_are_errors() {
    let bad = [
        GradScalerOptions {
            init_scale: f32::INFINITY,
            ..Default::default()
        },
        GradScalerOptions {
            init_scale: f32::NAN,
            ..Default::default()
        },
        GradScalerOptions {
            init_scale: 0.0,
            ..Default::default()
        },
        GradScalerOptions {
            growth_factor: 1.0,
            ..Default::default()
        },
        GradScalerOptions {
            backoff_factor: 1.0,
            ..Default::default()
        },
        GradScalerOptions {
            growth_interval: 0,
            ..Default::default()
        },
    ];
    for options in bad {
        match GradScaler::with_options(options) {
            Err(Error::InvalidArgument { op, .. }) => assert_eq!(op, "GradScaler::with_options"),
            other => panic!("{options:?}: {other:?}"),
        }
    }
}

#[test]
fn a_step_before_backward_is_an_error() {
    let w = leaf(&[1.0]);
    let mut opt = Sgd::new(vec![w], SgdConfig::default());
    let err = GradScaler::new().step(&mut opt).unwrap_err();
    assert!(err.to_string().contains("GradScaler::step"), "{err}");
}

#[test]
fn a_training_state_carries_the_scaler() {
    let options = GradScalerOptions {
        init_scale: 1024.0,
        growth_interval: 4,
        ..Default::default()
    };
    let mut scaler = GradScaler::with_options(options).unwrap();
    let w = leaf(&[1.0, 2.0]);
    let model = wgrad::nn::Linear {
        weight: w.clone(),
        bias: None,
    };
    let mut opt = Sgd::new(
        vec![w.clone()],
        SgdConfig {
            lr: 0.1,
            ..Default::default()
        },
    );
    let run = |scaler: &mut GradScaler, opt: &mut Sgd, loss_scale: f32| {
        opt.zero_grad();
        let loss = w.sum().unwrap().mul_scalar(loss_scale).unwrap();
        scaler.scale(&loss).unwrap().backward().unwrap();
        scaler.step(opt).unwrap();
        scaler.update().unwrap();
    };
    run(&mut scaler, &mut opt, f32::INFINITY); // 512
    run(&mut scaler, &mut opt, 1.0);
    run(&mut scaler, &mut opt, 1.0); // two good steps of four
    let path =
        std::env::temp_dir().join(format!("wgrad-scaler-{}.safetensors", std::process::id()));
    wgrad::io::save_training_with_scaler(&path, &model, &opt, &scaler, 3).unwrap();

    let mut resumed = GradScaler::new();
    let step = wgrad::io::load_training_with_scaler(&path, &model, &mut opt, &mut resumed).unwrap();
    assert_eq!(step, 3);
    assert_eq!(resumed.scale_factor(), 512.0);
    assert_eq!(resumed.state(), scaler.state());
    // Two more good steps complete the interval of four: both double.
    for s in [&mut scaler, &mut resumed] {
        run(s, &mut opt, 1.0);
        run(s, &mut opt, 1.0);
        assert_eq!(s.scale_factor(), 1024.0);
    }

    // A state without a scaler cannot fill one, and the failed load changes nothing.
    wgrad::io::save_training(&path, &model, &opt, 5).unwrap();
    let before = resumed.state();
    let err =
        wgrad::io::load_training_with_scaler(&path, &model, &mut opt, &mut resumed).unwrap_err();
    assert!(err.to_string().contains("GradScaler"), "{err}");
    assert_eq!(resumed.state(), before);
    std::fs::remove_file(&path).unwrap();
}

#[test]
fn a_malformed_scaler_state_is_an_error_that_changes_nothing() {
    let mut scaler = GradScaler::new();
    let mut state = scaler.state();
    state.retain(|(name, _)| name != "growth_tracker");
    let err = scaler.load_state(&state).unwrap_err();
    assert!(err.to_string().contains("growth_tracker"), "{err}");
    let mut state = GradScaler::new().state();
    state[0].1 = format!("{:08x}", f32::INFINITY.to_bits());
    assert!(scaler.load_state(&state).is_err(), "an infinite scale");
    assert_eq!(scaler.state(), GradScaler::new().state());
}

/// A captured step that scales its loss reads the scale at every replay: `update` growing it
/// (every good step here) reaches replays, whose grads are then unscaled by the same scale.
#[test]
fn a_captured_step_scales_its_loss_by_the_scale_of_each_replay() {
    use std::cell::RefCell;
    let options = GradScalerOptions {
        init_scale: 4.0,
        growth_interval: 1,
        ..Default::default()
    };
    let sgd = SgdConfig {
        lr: 0.1,
        ..Default::default()
    };
    let (eager_w, captured_w) = (leaf(&[1.0, -2.0]), leaf(&[1.0, -2.0]));
    let mut eager_opt = Sgd::new(vec![eager_w.clone()], sgd);
    let mut captured_opt = Sgd::new(vec![captured_w.clone()], sgd);
    let mut eager_scaler = GradScaler::with_options(options).unwrap();
    let captured_scaler = RefCell::new(GradScaler::with_options(options).unwrap());
    let body = |w: &Tensor, x: &Tensor, scaler: &GradScaler| -> wgrad::Result<Tensor> {
        let loss = w.mul(x)?.sum()?;
        scaler.scale(&loss)?.backward()?;
        Ok(loss)
    };
    let mut step = wgrad::capture::Step::new(|inputs: &[Tensor]| {
        body(&captured_w, &inputs[0], &captured_scaler.borrow())
    });
    for call in 0..5 {
        let x = Tensor::from_vec(vec![1.0 + call as f32, 0.5], &[2], device()).unwrap();
        eager_opt.zero_grad();
        body(&eager_w, &x, &eager_scaler).unwrap();
        assert!(eager_scaler.step(&mut eager_opt).unwrap());
        eager_scaler.update().unwrap();
        captured_opt.zero_grad();
        step.run(std::slice::from_ref(&x)).unwrap();
        let mut scaler = captured_scaler.borrow_mut();
        assert!(scaler.step(&mut captured_opt).unwrap());
        scaler.update().unwrap();
        assert_eq!(
            captured_w.to_vec().unwrap(),
            eager_w.to_vec().unwrap(),
            "call {call}, scale {}",
            scaler.scale_factor()
        );
    }
    assert_eq!(step.stats().replays, 3);
}
