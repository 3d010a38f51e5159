//! Captured steps (`capture::Step`, docs/semantics.md "Captured steps"): replays equal eager
//! steps, grad slots follow S-2 and S-14 (C-17), guards re-capture, and host reads refuse.

mod common;
use common::*;
use wgrad::capture::Step;
use wgrad::nn::{self, Module};
use wgrad::optim::{Adam, AdamConfig, AdamW, Optimizer, Sgd, SgdConfig};
use wgrad::{no_grad, Error, Result, Tensor};

const IN: usize = 12;
const HIDDEN: usize = 16;
const OUT: usize = 5;

fn mlp() -> nn::Sequential {
    let dev = device();
    nn::Sequential::new()
        .add(nn::Linear::new(IN, HIDDEN, true, dev).unwrap())
        .add(nn::Relu)
        .add(nn::Linear::new(HIDDEN, OUT, true, dev).unwrap())
}

/// A second model with the same parameter values as `model`.
fn twin(model: &dyn Module, make: impl Fn() -> Box<dyn Module>) -> Box<dyn Module> {
    let copy = make();
    no_grad(|| {
        for (a, b) in model.parameters().iter().zip(copy.parameters()) {
            b.copy_(a).unwrap();
        }
    });
    copy
}

fn batch(rows: usize, seed: u64) -> (Tensor, Tensor) {
    let (x, _) = random_tensor(&[rows, IN], seed);
    let labels: Vec<u32> = (0..rows as u32)
        .map(|r| (r * 7 + seed as u32) % OUT as u32)
        .collect();
    let y = Tensor::from_vec_u32(labels, &[rows], device()).unwrap();
    (x, y)
}

fn train_step(
    model: &dyn Module,
    opt: &mut dyn Optimizer,
    x: &Tensor,
    y: &Tensor,
) -> Result<Tensor> {
    opt.zero_grad();
    let loss = nn::loss::cross_entropy(&model.forward(x)?, y)?;
    loss.backward()?;
    opt.step()?;
    Ok(loss)
}

fn values(params: &[Tensor]) -> Vec<Vec<f32>> {
    params.iter().map(|p| p.to_vec().unwrap()).collect()
}

fn assert_same_parameters(eager: &dyn Module, captured: &dyn Module) {
    let (want, got) = (values(&eager.parameters()), values(&captured.parameters()));
    for (a, b) in want.iter().zip(&got) {
        assert_rel_close(b, a, 1e-5, "parameter");
    }
}

/// A 1-d leaf that requires grad.
fn leaf(values: &[f32]) -> Tensor {
    Tensor::from_slice(values, &[values.len()], device())
        .unwrap()
        .requires_grad_(true)
}

/// `sum(p * x)` and its backward: adds `x` to `p`'s grad.
fn dot_step(p: &Tensor, x: &Tensor) -> Result<Tensor> {
    let loss = p.mul(x)?.sum()?;
    loss.backward()?;
    Ok(loss)
}

/// A replay's loss equals the eager step's to 1e-5 relative.
fn assert_same_loss(got: &Tensor, want: &Tensor) {
    assert_rel_close(
        &[got.item().unwrap()],
        &[want.item().unwrap()],
        1e-5,
        "loss",
    );
}

fn assert_rel_close(a: &[f32], b: &[f32], rel: f32, what: &str) {
    assert_eq!(a.len(), b.len(), "{what}: length");
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        let tol = rel * x.abs().max(y.abs()).max(1.0);
        assert!((x - y).abs() <= tol, "{what}[{i}]: {x} vs {y}");
    }
}

#[test]
fn replayed_mlp_steps_equal_eager_steps() {
    let eager_model = mlp();
    let captured_model = twin(&eager_model, || Box::new(mlp()));
    let config = AdamConfig::default();
    let mut eager_opt = Adam::new(eager_model.parameters(), config);
    let mut opt = Adam::new(captured_model.parameters(), config);
    let mut step =
        Step::new(|b: &[Tensor]| train_step(captured_model.as_ref(), &mut opt, &b[0], &b[1]));
    for i in 0..200 {
        let (x, y) = batch(8, i % 7);
        let want = train_step(&eager_model, &mut eager_opt, &x, &y).unwrap();
        let got = step.run(&[x, y]).unwrap();
        if i % 50 == 0 || i == 199 {
            assert_same_loss(&got, &want);
        }
    }
    assert_eq!(step.stats().replays, 198);
    assert_same_parameters(&eager_model, captured_model.as_ref());
}

#[test]
fn a_replay_runs_in_one_submission() {
    let model = mlp();
    let mut opt = Sgd::new(model.parameters(), SgdConfig::default());
    let mut step = Step::new(|b: &[Tensor]| train_step(&model, &mut opt, &b[0], &b[1]));
    let (x, y) = batch(4, 1);
    for _ in 0..2 {
        step.run(&[x.clone(), y.clone()]).unwrap();
    }
    device().synchronize().unwrap();
    let before = device().stats().submits;
    step.run(&[x, y]).unwrap();
    device().synchronize().unwrap();
    // Other tests share the device; their submissions can only add.
    let submits = device().stats().submits - before;
    assert!(submits >= 1);
    assert_eq!(step.stats().replays, 1);
}

/// Runs `calls` steps of a captured and an eager twin on batches written into the same two
/// input tensors, and a call on batches in fresh tensors at `fresh_at`; checks losses and
/// parameters against the eager twin and returns the captured step's stats.
fn run_with_inputs_in_place(calls: u64, fresh_at: Option<u64>) -> wgrad::capture::StepStats {
    let eager_model = mlp();
    let captured_model = twin(&eager_model, || Box::new(mlp()));
    let config = AdamConfig::default();
    let mut eager_opt = Adam::new(eager_model.parameters(), config);
    let mut opt = Adam::new(captured_model.parameters(), config);
    let mut step =
        Step::new(|b: &[Tensor]| train_step(captured_model.as_ref(), &mut opt, &b[0], &b[1]));
    let (x, y) = batch(8, 0);
    let mut kept = Vec::new();
    for call in 0..calls {
        let (new_x, new_y) = batch(8, call % 5);
        let want = train_step(&eager_model, &mut eager_opt, &new_x, &new_y).unwrap();
        let got = if Some(call) == fresh_at {
            kept.push((x.clone(), y.clone())); // the old buffers stay taken
            step.run(&[new_x, new_y]).unwrap()
        } else {
            no_grad(|| {
                x.copy_(&new_x).unwrap();
                y.copy_(&new_y).unwrap();
            });
            step.run(&[x.clone(), y.clone()]).unwrap()
        };
        assert_same_loss(&got, &want);
    }
    assert_same_parameters(&eager_model, captured_model.as_ref());
    step.stats()
}

#[test]
fn replays_after_the_first_submit_commands_encoded_ahead() {
    // The same input buffers, the grads as the previous replay left them: every replay but
    // the first submits what was encoded after the previous one, and equals the eager step.
    let stats = run_with_inputs_in_place(8, None);
    assert_eq!(stats.replays, 6);
    assert_eq!(stats.replays_encoded_ahead, 5);
}

#[test]
fn a_replay_on_other_buffers_encodes_afresh_and_is_right() {
    // Inputs in other buffers at call 5 (the third replay): that replay encodes its own
    // commands; the next one, on the first buffers again, cannot use what was encoded for
    // the fresh ones, and the one after can.
    let stats = run_with_inputs_in_place(8, Some(4));
    assert_eq!(stats.replays, 6);
    assert_eq!(stats.replays_encoded_ahead, 3);
}

#[test]
fn a_replay_while_a_grad_is_held_elsewhere_encodes_afresh() {
    // Commands encoded ahead write the next grads into the buffers of the grads the step
    // clears; a grad handle kept by the caller keeps its buffer, so that replay encodes its
    // own (into fresh buffers) and the kept grad keeps its values.
    let model = mlp();
    let mut opt = Sgd::new(model.parameters(), SgdConfig::default());
    let mut step = Step::new(|b: &[Tensor]| train_step(&model, &mut opt, &b[0], &b[1]));
    let (x, y) = batch(8, 3);
    for _ in 0..4 {
        step.run(&[x.clone(), y.clone()]).unwrap();
    }
    assert_eq!(step.stats().replays_encoded_ahead, 1);
    let weight = model.parameters()[0].clone();
    let kept = weight.grad().unwrap();
    let kept_values = kept.to_vec().unwrap();
    step.run(&[x.clone(), y.clone()]).unwrap();
    assert_eq!(step.stats().replays_encoded_ahead, 1);
    assert_eq!(kept.to_vec().unwrap(), kept_values);
    assert!(
        !Tensor::same(&kept, &weight.grad().unwrap()),
        "zero_grad dropped it"
    );
}

#[test]
fn a_replay_after_set_grad_adds_to_the_new_grad() {
    let dev = device();
    let p = leaf(&[1.0, 2.0, 3.0]);
    let mut step = Step::new(|b: &[Tensor]| dot_step(&p, &b[0]));
    let x = Tensor::from_slice(&[3.0, 3.0, 3.0], &[3], dev).unwrap();
    for _ in 0..3 {
        step.run(std::slice::from_ref(&x)).unwrap();
    }
    assert_eq!(p.grad().unwrap().to_vec().unwrap(), vec![9.0; 3]);
    let other = Tensor::from_slice(&[10.0, 20.0, 30.0], &[3], dev).unwrap();
    p.set_grad(Some(other.clone())).unwrap();
    step.run(std::slice::from_ref(&x)).unwrap();
    assert_eq!(step.stats().replays, 2);
    assert_eq!(p.grad().unwrap().to_vec().unwrap(), vec![13.0, 23.0, 33.0]);
    // S-2: the handle set is kept, its buffer swapped.
    assert!(Tensor::same(&p.grad().unwrap(), &other));
    assert_eq!(other.to_vec().unwrap(), vec![13.0, 23.0, 33.0]);
}

#[test]
fn a_replay_after_zero_grad_gives_the_new_grad_alone() {
    let dev = device();
    let p = leaf(&[1.0, 2.0]);
    let mut step = Step::new(|b: &[Tensor]| dot_step(&p, &b[0]));
    let x = Tensor::from_slice(&[2.0, 5.0], &[2], dev).unwrap();
    for _ in 0..3 {
        step.run(std::slice::from_ref(&x)).unwrap();
    }
    assert_eq!(p.grad().unwrap().to_vec().unwrap(), vec![6.0, 15.0]);
    for _ in 0..3 {
        p.zero_grad();
        step.run(std::slice::from_ref(&x)).unwrap();
        assert_eq!(p.grad().unwrap().to_vec().unwrap(), vec![2.0, 5.0]);
    }
    assert!(step.stats().replays >= 2, "{:?}", step.stats());
}

#[test]
fn a_kept_grad_handle_sees_each_replays_values() {
    let dev = device();
    let p = leaf(&[1.0, 2.0]);
    let mut step = Step::new(|b: &[Tensor]| dot_step(&p, &b[0]));
    let x = Tensor::from_slice(&[1.0, 1.0], &[2], dev).unwrap();
    step.run(std::slice::from_ref(&x)).unwrap();
    let kept = p.grad().unwrap();
    for call in 2..=6 {
        let before = kept.storage_id();
        step.run(std::slice::from_ref(&x)).unwrap();
        assert_eq!(kept.to_vec().unwrap(), vec![call as f32; 2]);
        assert!(Tensor::same(&kept, &p.grad().unwrap()));
        assert_ne!(
            kept.storage_id(),
            before,
            "S-2: a fresh buffer under the same handle"
        );
    }
    assert_eq!(step.stats().replays, 4);
}

#[test]
fn a_batch_of_another_size_recaptures_and_is_right() {
    let eager_model = mlp();
    let captured_model = twin(&eager_model, || Box::new(mlp()));
    let mut eager_opt = Sgd::new(eager_model.parameters(), SgdConfig::default());
    let mut opt = Sgd::new(captured_model.parameters(), SgdConfig::default());
    let mut step =
        Step::new(|b: &[Tensor]| train_step(captured_model.as_ref(), &mut opt, &b[0], &b[1]));
    for rows in [8, 8, 8, 3, 3, 3, 8, 3] {
        let (x, y) = batch(rows, rows as u64);
        let want = train_step(&eager_model, &mut eager_opt, &x, &y)
            .unwrap()
            .item()
            .unwrap();
        let got = step.run(&[x, y]).unwrap().item().unwrap();
        assert_rel_close(&[got], &[want], 1e-5, "loss");
    }
    let stats = step.stats();
    assert_eq!((stats.plans, stats.replays), (2, 4), "{stats:?}");
}

#[test]
fn learning_rate_changes_reach_replays() {
    let eager_model = mlp();
    let captured_model = twin(&eager_model, || Box::new(mlp()));
    let mut eager_opt = Adam::new(eager_model.parameters(), AdamConfig::default());
    let opt = std::cell::RefCell::new(Adam::new(
        captured_model.parameters(),
        AdamConfig::default(),
    ));
    let mut step = Step::new(|b: &[Tensor]| {
        train_step(
            captured_model.as_ref(),
            &mut *opt.borrow_mut(),
            &b[0],
            &b[1],
        )
    });
    let (x, y) = batch(6, 2);
    for i in 0..6 {
        let lr = 1e-2 / (i + 1) as f32;
        eager_opt.set_lr(lr);
        opt.borrow_mut().set_lr(lr);
        train_step(&eager_model, &mut eager_opt, &x, &y).unwrap();
        step.run(&[x.clone(), y.clone()]).unwrap();
    }
    assert_eq!(step.stats().replays, 4);
    assert_same_parameters(&eager_model, captured_model.as_ref());
}

#[test]
fn a_replay_that_fails_leaves_parameters_and_grads_as_they_were() {
    let model = mlp();
    let opt = std::cell::RefCell::new(Adam::new(model.parameters(), AdamConfig::default()));
    let mut step =
        Step::new(|b: &[Tensor]| train_step(&model, &mut *opt.borrow_mut(), &b[0], &b[1]));
    let (x, y) = batch(6, 3);
    for _ in 0..3 {
        step.run(&[x.clone(), y.clone()]).unwrap();
    }
    let params = values(&model.parameters());
    let grads: Vec<Tensor> = model
        .parameters()
        .iter()
        .map(|p| p.grad().unwrap())
        .collect();
    let grad_values = values(&grads);
    // The replay's Adam hook checks the learning rate before anything is submitted.
    opt.borrow_mut().set_lr(f32::NAN);
    let err = step.run(&[x.clone(), y.clone()]).unwrap_err();
    assert!(err.to_string().contains("lr"), "{err}");
    assert_eq!(values(&model.parameters()), params);
    for (p, (g, v)) in model
        .parameters()
        .iter()
        .zip(grads.iter().zip(&grad_values))
    {
        assert!(Tensor::same(&p.grad().unwrap(), g));
        assert_eq!(&g.to_vec().unwrap(), v);
    }
    // With a good rate again, replays go on.
    opt.borrow_mut().set_lr(1e-3);
    step.run(&[x, y]).unwrap();
    assert_eq!(step.stats().replays, 2);
    assert_ne!(values(&model.parameters()), params);
}

#[test]
fn reading_a_value_on_the_host_while_capturing_is_an_error_and_keeps_no_plan() {
    let dev = device();
    let p = leaf(&[1.0, 2.0]);
    let mut step = Step::new(|b: &[Tensor]| {
        let loss = p.mul(&b[0])?.sum()?;
        loss.backward()?;
        let _ = loss.item()?;
        Ok(loss)
    });
    let x = Tensor::from_slice(&[1.0, 1.0], &[2], dev).unwrap();
    step.run(std::slice::from_ref(&x)).unwrap();
    let err = step.run(std::slice::from_ref(&x)).unwrap_err();
    assert!(matches!(err, Error::Capture { op: "item", .. }), "{err}");
    assert_eq!(step.stats().plans, 0);
    // The next call captures again (and fails again): never a stale replay.
    assert!(step.run(std::slice::from_ref(&x)).is_err());
    assert_eq!(step.stats().replays, 0);
}

#[test]
fn a_closure_that_errors_returns_the_error_and_keeps_no_plan() {
    let dev = device();
    let p = leaf(&[1.0, 2.0]);
    let mut calls = 0;
    let mut step = Step::new(|b: &[Tensor]| {
        calls += 1;
        if calls == 2 {
            return Err(Error::InvalidArgument {
                op: "user",
                msg: "bad batch".into(),
            });
        }
        let loss = p.mul(&b[0])?.sum()?;
        loss.backward()?;
        Ok(loss)
    });
    let x = Tensor::from_slice(&[1.0, 1.0], &[2], dev).unwrap();
    step.run(std::slice::from_ref(&x)).unwrap();
    assert!(matches!(
        step.run(std::slice::from_ref(&x)),
        Err(Error::InvalidArgument { op: "user", .. })
    ));
    assert_eq!(step.stats().plans, 0);
    step.run(std::slice::from_ref(&x)).unwrap();
    step.run(std::slice::from_ref(&x)).unwrap();
    assert_eq!((step.stats().plans, step.stats().replays), (1, 1));
    assert_eq!(p.grad().unwrap().to_vec().unwrap(), vec![3.0, 3.0]);
}

#[test]
fn switching_to_eval_mode_recaptures() {
    let dev = device();
    let model = nn::Sequential::new()
        .add(nn::Linear::new(IN, OUT, true, dev).unwrap())
        .add(nn::Dropout::new(0.5).unwrap());
    let mut step = Step::new(|b: &[Tensor]| model.forward(&b[0])?.sum());
    let (x, _) = batch(4, 5);
    for _ in 0..3 {
        step.run(std::slice::from_ref(&x)).unwrap();
    }
    model.eval();
    let want = model.forward(&x).unwrap().sum().unwrap().item().unwrap();
    for _ in 0..3 {
        let got = step.run(std::slice::from_ref(&x)).unwrap().item().unwrap();
        assert_rel_close(&[got], &[want], 1e-6, "eval loss");
    }
    assert_eq!(step.stats().plans, 2);
}

#[test]
fn peak_device_memory_of_a_replayed_step_is_at_most_the_eager_steps() {
    // Alone on a device of its own: other tests' buffers would blur the counts.
    let dev = wgrad::Device::new().unwrap();
    let make = || -> nn::Sequential {
        nn::Sequential::new()
            .add(nn::Linear::new(64, 128, true, &dev).unwrap())
            .add(nn::Relu)
            .add(nn::Linear::new(128, 128, true, &dev).unwrap())
            .add(nn::Relu)
            .add(nn::Linear::new(128, 10, true, &dev).unwrap())
    };
    let held = |dev: &wgrad::Device| {
        let s = dev.stats();
        s.live_bytes + s.pooled_bytes
    };
    let x = Tensor::from_vec(random_vec(32 * 64, 4), &[32, 64], &dev).unwrap();
    let y = Tensor::from_vec_u32((0..32).map(|i| i % 10).collect(), &[32], &dev).unwrap();

    let model = make();
    let mut opt = Adam::new(model.parameters(), AdamConfig::default());
    for _ in 0..3 {
        train_step(&model, &mut opt, &x, &y).unwrap();
    }
    dev.synchronize().unwrap();
    let eager = held(&dev);
    drop(opt);
    drop(model);
    dev.empty_pool();

    let model = make();
    let mut opt = Adam::new(model.parameters(), AdamConfig::default());
    let mut step = Step::new(|b: &[Tensor]| train_step(&model, &mut opt, &b[0], &b[1]));
    for _ in 0..2 {
        step.run(&[x.clone(), y.clone()]).unwrap();
    }
    // What the capture held is given back; replays then run on the plan's arena.
    dev.empty_pool();
    for _ in 0..3 {
        step.run(&[x.clone(), y.clone()]).unwrap();
    }
    dev.synchronize().unwrap();
    let replayed = held(&dev);
    assert_eq!(step.stats().replays, 3);
    assert!(
        replayed <= eager,
        "replayed step holds {replayed} bytes, eager {eager}"
    );
}

/// A causal transformer block and a head, trained with two AdamW groups (decayed matrices,
/// undecayed vectors, as the GPT example): every fusion a transformer step meets (attention,
/// LayerNorm and matmul epilogues, merged updates under two step-count hooks).
fn transformer() -> nn::Sequential {
    let dev = device();
    nn::Sequential::new()
        .add(nn::TransformerBlock::new(16, 2, true, 0.0, dev).unwrap())
        .add(nn::Linear::new(16, OUT, true, dev).unwrap())
}

#[test]
fn replayed_transformer_steps_equal_eager_steps() {
    let eager_model = transformer();
    let captured_model = twin(&eager_model, || Box::new(transformer()));
    let groups = |model: &dyn Module| -> Vec<AdamW> {
        let (matrices, vectors): (Vec<Tensor>, Vec<Tensor>) =
            model.parameters().into_iter().partition(|p| p.rank() >= 2);
        let config = |weight_decay| AdamConfig {
            weight_decay,
            ..AdamConfig::default()
        };
        vec![
            AdamW::new(matrices, config(0.1)),
            AdamW::new(vectors, config(0.0)),
        ]
    };
    let step_of = |model: &dyn Module, opts: &mut [AdamW], x: &Tensor, y: &Tensor| {
        opts.iter_mut().for_each(|o| o.zero_grad());
        let logits = model
            .forward(x)?
            .reshape(&[x.shape()[0] * x.shape()[1], OUT])?;
        let loss = nn::loss::cross_entropy(&logits, y)?;
        loss.backward()?;
        for opt in opts.iter_mut() {
            opt.step()?;
        }
        Ok(loss)
    };
    let mut eager_opts = groups(&eager_model);
    let mut opts = groups(captured_model.as_ref());
    let mut step =
        Step::new(|b: &[Tensor]| step_of(captured_model.as_ref(), &mut opts, &b[0], &b[1]));
    for i in 0..12 {
        let (x, _) = random_tensor(&[2, 8, 16], 50 + i % 3);
        let labels: Vec<u32> = (0..16).map(|r| (r * 3 + i as u32) % OUT as u32).collect();
        let y = Tensor::from_vec_u32(labels, &[16], device()).unwrap();
        let want = step_of(&eager_model, &mut eager_opts, &x, &y).unwrap();
        let got = step.run(&[x, y]).unwrap();
        assert_same_loss(&got, &want);
    }
    assert_eq!(step.stats().replays, 10);
    assert_same_parameters(&eager_model, captured_model.as_ref());
}

/// Two conv layers (the second with channels in whole 4s, whose forward reads the images in
/// the matmul kernel on 8-wide subgroups), bias, ReLU, pooling and a head, trained with Adam:
/// a replay fuses the bias add and ReLU into the convolution's stores.
fn cnn() -> nn::Sequential {
    let dev = device();
    nn::Sequential::new()
        .add(nn::Conv2d::new(1, 4, 3, 1, 1, dev).unwrap())
        .add(nn::Relu)
        .add(nn::Conv2d::new(4, 8, 3, 1, 1, dev).unwrap())
        .add(nn::Relu)
        .add(nn::MaxPool2d::new(2, 2))
        .add(nn::Flatten)
        .add(nn::Linear::new(8 * 4 * 4, OUT, true, dev).unwrap())
}

/// `calls` training steps of the image model `make` builds, on batches of `OUT` images of
/// `image` (`[C, H, W]`) with rotating labels, captured against eager on a twin: equal losses
/// and parameters after (1 eager call, 1 recorded, the rest replays). Returns both models.
fn assert_image_replays_equal_eager(
    make: fn() -> nn::Sequential,
    image: [usize; 3],
    calls: usize,
    seed: u64,
) -> (nn::Sequential, Box<dyn Module>) {
    let eager_model = make();
    let captured_model = twin(&eager_model, || Box::new(make()));
    let mut eager_opt = Adam::new(eager_model.parameters(), AdamConfig::default());
    let mut opt = Adam::new(captured_model.parameters(), AdamConfig::default());
    let mut step =
        Step::new(|b: &[Tensor]| train_step(captured_model.as_ref(), &mut opt, &b[0], &b[1]));
    for i in 0..calls {
        let (x, _) = random_tensor(&[OUT, image[0], image[1], image[2]], seed + i as u64 % 3);
        let labels: Vec<u32> = (0..OUT as u32)
            .map(|r| (r + i as u32) % OUT as u32)
            .collect();
        let y = Tensor::from_vec_u32(labels, &[OUT], device()).unwrap();
        let want = train_step(&eager_model, &mut eager_opt, &x, &y).unwrap();
        let got = step.run(&[x, y]).unwrap();
        assert_same_loss(&got, &want);
    }
    assert_eq!(step.stats().replays, calls as u64 - 2);
    assert_same_parameters(&eager_model, captured_model.as_ref());
    drop(step);
    (eager_model, captured_model)
}

#[test]
fn replayed_cnn_steps_equal_eager_steps() {
    assert_image_replays_equal_eager(cnn, [1, 8, 8], 8, 80);
}

/// A step through RMSNorm and every elementwise op of the ops issue (sin, cos, rsqrt, silu, softplus,
/// leaky_relu, minimum, pow, comparisons, where_cond, casts): a replay equals the eager step.
fn modern_elementwise_step(
    model: &dyn Module,
    opt: &mut dyn Optimizer,
    x: &Tensor,
    y: &Tensor,
) -> Result<Tensor> {
    opt.zero_grad();
    let h = model
        .forward(x)?
        .rms_norm(&Tensor::full(&[OUT], 1.5, x.device())?, 1e-5)?;
    let gate = h.silu()?.mul(&h.sin()?.add(&h.cos()?)?)?;
    let smooth = h.softplus()?.add_scalar(0.5)?;
    let scaled = smooth.rsqrt()?.mul(&smooth.pow(&h.tanh()?)?)?;
    let picked = h.gt_scalar(0.0)?.where_cond(&gate, &h.leaky_relu(0.1)?)?;
    let mixed = picked.minimum(&scaled)?;
    // A mask cast to f32 and back weighs the rows (no grad through it).
    let weight = h
        .ge(&h.neg()?)?
        .to_dtype(wgrad::DType::F32)?
        .add_scalar(1.0)?;
    let loss = nn::loss::cross_entropy(&mixed.mul(&weight)?, y)?;
    loss.backward()?;
    opt.step()?;
    Ok(loss)
}

/// A training step of the MLP on batches of 9 rows, seeds from `seed`.
type MlpStep = fn(&dyn Module, &mut dyn Optimizer, &Tensor, &Tensor) -> Result<Tensor>;

/// Six calls of `train` captured (1 eager, 1 recorded, 4 replays) give the losses and the
/// parameters of six eager calls on a twin model.
fn assert_replays_equal_eager(train: MlpStep, seed: u64) -> wgrad::capture::StepStats {
    let eager_model = mlp();
    let captured_model = twin(&eager_model, || Box::new(mlp()));
    let mut eager_opt = Adam::new(eager_model.parameters(), AdamConfig::default());
    let mut opt = Adam::new(captured_model.parameters(), AdamConfig::default());
    let mut step = Step::new(|b: &[Tensor]| train(captured_model.as_ref(), &mut opt, &b[0], &b[1]));
    for i in 0..6 {
        let (x, y) = batch(9, seed + i % 2);
        let want = train(&eager_model, &mut eager_opt, &x, &y).unwrap();
        let got = step.run(&[x, y]).unwrap();
        assert_same_loss(&got, &want);
    }
    assert_eq!(step.stats().replays, 4);
    assert_same_parameters(&eager_model, captured_model.as_ref());
    step.stats()
}

#[test]
fn replayed_steps_through_the_new_elementwise_ops_equal_eager_steps() {
    let stats = assert_replays_equal_eager(modern_elementwise_step, 400);
    assert!(stats.fused_away > 0, "{stats:?}");
}

/// A step through grouped-query attention (4 q heads, 1 k/v head) with a padding keep-mask
/// and an explicit scale; the mask is a step input, so each batch brings its own padding.
fn masked_gqa_step(
    params: &[Tensor],
    opt: &mut dyn Optimizer,
    x: &Tensor,
    keep: &Tensor,
) -> Result<Tensor> {
    opt.zero_grad();
    let (b, t) = (x.shape()[0], x.shape()[1]);
    let heads = |w: &Tensor, h: usize| -> Result<Tensor> {
        x.matmul(w)?.reshape(&[b, t, h, 4])?.transpose(1, 2)
    };
    let (q, kv) = (heads(&params[0], 4)?, heads(&params[1], 1)?);
    let opts = wgrad::SdpaOptions {
        causal: true,
        mask: Some(keep),
        scale: Some(0.3),
    };
    let out = q.scaled_dot_product_attention_with(&kv, &kv, &opts)?;
    let loss = out.mul(&out)?.mean()?;
    loss.backward()?;
    opt.step()?;
    Ok(loss)
}

#[test]
fn replayed_masked_grouped_query_attention_steps_equal_eager_steps() {
    let weights = |seed| {
        let (w, _) = random_tensor(&[8, 16], seed);
        let (kv, _) = random_tensor(&[8, 4], seed + 1);
        [w, kv].map(|p| p.requires_grad_(true))
    };
    let (eager, captured) = (weights(700), weights(700));
    let config = SgdConfig {
        lr: 0.5,
        ..Default::default()
    };
    let mut eager_opt = Sgd::new(eager.to_vec(), config);
    let mut opt = Sgd::new(captured.to_vec(), config);
    let mut step = Step::new(|b: &[Tensor]| masked_gqa_step(&captured, &mut opt, &b[0], &b[1]));
    for i in 0..6 {
        let (x, _) = random_tensor(&[2, 5, 8], 710 + i);
        // Batch row 1 keeps its first 5 - i % 3 tokens.
        let keep: Vec<u32> = (0..10)
            .map(|at| u32::from(at < 5 || at - 5 < 5 - i as usize % 3))
            .collect();
        let keep = Tensor::from_vec_u32(keep, &[2, 1, 1, 5], device()).unwrap();
        let want = masked_gqa_step(&eager, &mut eager_opt, &x, &keep).unwrap();
        let got = step.run(&[x, keep]).unwrap();
        assert_same_loss(&got, &want);
    }
    assert_eq!(step.stats().replays, 4);
    for (a, b) in values(&eager).iter().zip(&values(&captured)) {
        assert_rel_close(b, a, 1e-5, "parameter");
    }
}

/// A step whose loss takes every option of `cross_entropy_with`: a replay equals the eager
/// step, with each batch ignoring other rows.
fn weighted_smoothed_step(
    model: &dyn Module,
    opt: &mut dyn Optimizer,
    x: &Tensor,
    y: &Tensor,
) -> Result<Tensor> {
    opt.zero_grad();
    let weight = Tensor::from_slice(&values_in(OUT, 0.5, 1.5, 5), &[OUT], x.device())?;
    let opts = nn::loss::CrossEntropyOptions {
        ignore_index: Some(1),
        label_smoothing: 0.1,
        weight: Some(&weight),
        reduction: nn::loss::Reduction::Mean,
    };
    let loss = nn::loss::cross_entropy_with(&model.forward(x)?, y, &opts)?;
    loss.backward()?;
    opt.step()?;
    Ok(loss)
}

#[test]
fn replayed_steps_through_cross_entropy_options_equal_eager_steps() {
    assert_replays_equal_eager(weighted_smoothed_step, 500);
}

/// A U-Net-style stack of the ops issue's layers: conv, GroupNorm, bilinear resampling,
/// BatchNorm1d (training mode, its running statistics updated in place).
fn decoder() -> nn::Sequential {
    let dev = device();
    nn::Sequential::new()
        .add(nn::Conv2d::new(1, 4, 3, 1, 1, dev).unwrap())
        .add(nn::GroupNorm::new(2, 4, 1e-5, dev).unwrap())
        .add(nn::Upsample::to_size((4, 4), wgrad::Interpolate::Bilinear))
        .add(nn::Flatten)
        .add(nn::Linear::new(4 * 4 * 4, OUT, true, dev).unwrap())
        .add(nn::BatchNorm1d::new(OUT, dev).unwrap())
}

#[test]
fn replayed_steps_through_group_norm_resampling_and_batch_norm_1d_equal_eager_steps() {
    let (eager, captured) = assert_image_replays_equal_eager(decoder, [1, 6, 6], 6, 90);
    let buffers = |m: &dyn Module| {
        values(
            &m.named_buffers()
                .into_iter()
                .map(|(_, t)| t)
                .collect::<Vec<_>>(),
        )
    };
    for (a, b) in buffers(&eager).iter().zip(&buffers(captured.as_ref())) {
        assert_rel_close(b, a, 1e-5, "running statistic");
    }
}

/// A U-Net up block: conv_transpose2d (stride 2, output padding), then a bias-free Conv2d
/// with a 1x3 kernel padded along W only.
fn up_block() -> nn::Sequential {
    let dev = device();
    let up = wgrad::ConvTranspose2dOptions {
        stride: 2,
        padding: 1,
        output_padding: 1,
        ..Default::default()
    };
    let options = wgrad::Conv2dOptions {
        padding: (0, 1),
        ..Default::default()
    };
    nn::Sequential::new()
        .add(nn::ConvTranspose2d::new(2, 3, 3, up, true, dev).unwrap())
        .add(nn::Conv2d::with_options(3, 2, (1, 3), options, false, dev).unwrap())
        .add(nn::Flatten)
        .add(nn::Linear::new(2 * 8 * 8, OUT, true, dev).unwrap())
}

#[test]
fn replayed_steps_through_transposed_and_rectangular_convolutions_equal_eager_steps() {
    assert_image_replays_equal_eager(up_block, [2, 4, 4], 6, 150);
}

/// A step through sort, topk and scatter_add: the loss of the top-3 logits, of the sorted
/// logits weighed by position, and of the logits scattered into 4 buckets.
fn sorting_step(
    model: &dyn Module,
    opt: &mut dyn Optimizer,
    x: &Tensor,
    _y: &Tensor,
) -> Result<Tensor> {
    opt.zero_grad();
    let logits = model.forward(x)?;
    let (top, _) = logits.topk(3, 1)?;
    let (sorted, _) = logits.sort(1, false)?;
    let n = logits.shape()[0];
    let ramp = Tensor::arange_f(0.0, OUT as f32, 1.0, x.device())?;
    let buckets: Vec<u32> = (0..n * OUT).map(|i| (i % 4) as u32).collect();
    let buckets = Tensor::from_vec_u32(buckets, &[n, OUT], x.device())?;
    let scattered = Tensor::zeros(&[n, 4], x.device())?.scatter_add(1, &buckets, &logits)?;
    let loss = top
        .mean()?
        .add(&sorted.mul(&ramp)?.mean()?)?
        .add(&scattered.mul(&scattered)?.mean()?)?;
    loss.backward()?;
    opt.step()?;
    Ok(loss)
}

#[test]
fn replayed_steps_through_sort_topk_and_scatter_add_equal_eager_steps() {
    assert_replays_equal_eager(sorting_step, 600);
}

/// A ResNet stem's padded max pool, a ceil-mode average pool without the padding counted,
/// and a 1-d convolution over the pooled rows.
fn pooled_rows() -> nn::Sequential {
    let dev = device();
    let stem = wgrad::Pool2dOptions {
        padding: 1,
        ..wgrad::Pool2dOptions::new(3, 2)
    };
    let ceil = wgrad::Pool2dOptions {
        padding: 1,
        ceil_mode: true,
        count_include_pad: false,
        ..wgrad::Pool2dOptions::new(2, 2)
    };
    nn::Sequential::new()
        .add(nn::MaxPool2d::with_options(stem))
        .add(nn::AvgPool2d::with_options(ceil))
        .add(nn::Flatten)
        .add(Rows)
        .add(nn::Conv1d::new(1, 2, 3, 1, 1, dev).unwrap())
        .add(nn::Flatten)
        .add(nn::Linear::new(2 * 2 * 3 * 3, OUT, true, dev).unwrap())
}

/// `[N, L]` -> `[N, 1, L]`: rows as one-channel sequences.
struct Rows;

impl Module for Rows {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        x.unsqueeze(1)
    }
}

#[test]
fn replayed_steps_through_pooling_options_and_conv1d_equal_eager_steps() {
    assert_image_replays_equal_eager(pooled_rows, [2, 9, 9], 6, 170);
}

/// A step through the composed reductions, indexing and losses of the ops issue: logsumexp,
/// var/std, cumsum, flip, repeat, min_dims, index_add, one_hot, eye, l1, smooth_l1,
/// binary_cross_entropy_with_logits and nll.
fn composed_ops_step(
    model: &dyn Module,
    opt: &mut dyn Optimizer,
    x: &Tensor,
    y: &Tensor,
) -> Result<Tensor> {
    opt.zero_grad();
    let dev = x.device();
    let h = model.forward(x)?;
    let n = h.shape()[0];
    let spread = h.logsumexp(&[1], true)?.add(&h.var_dims(&[1], 1, true)?)?;
    let ordered = h.cumsum(1)?.flip(&[1])?.add(&h.repeat(&[1, 1])?)?;
    let low = h.min_dims(&[1], true)?.add(&h.std_dims(&[1], 0, true)?)?;
    let rows = Tensor::from_vec_u32((0..n as u32).rev().collect(), &[n], dev)?;
    let mixed = h.index_add(0, &rows, &ordered.mul_scalar(0.1)?)?;
    let targets = Tensor::one_hot(y, OUT)?.to_dtype(wgrad::DType::F32)?;
    let eye = Tensor::eye(OUT, dev)?;
    let loss = nn::loss::binary_cross_entropy_with_logits(&mixed.matmul(&eye)?, &targets)?
        .add(&nn::loss::l1(&spread, &low)?)?
        .add(&nn::loss::smooth_l1(&h, &ordered, 0.5)?)?
        .add(&nn::loss::nll(&h.log_softmax(-1)?, y)?)?;
    loss.backward()?;
    opt.step()?;
    Ok(loss)
}

#[test]
fn replayed_steps_through_composed_reductions_indexing_and_losses_equal_eager_steps() {
    assert_replays_equal_eager(composed_ops_step, 650);
}

#[test]
fn a_replay_compares_and_picks_u32_words_as_eager_does() {
    let dev = device();
    // Words whose f32 patterns are a NaN, a denormal or past 2^24: the fused kernels carry
    // u32 operands through f32 variables, which must keep their bits.
    let words = |seed: u32| -> Vec<u32> {
        [0x7F80_0001u32, 1, 16_777_217, u32::MAX, 7, 16_777_216]
            .iter()
            .map(|w| w.rotate_left(seed % 3).wrapping_add(seed % 2))
            .collect()
    };
    let batch = |seed: u32| -> Vec<Tensor> {
        let mask: Vec<u32> = (0..6).map(|i| (i + seed) % 2).collect();
        vec![
            Tensor::from_vec_u32(words(seed), &[6], dev).unwrap(),
            Tensor::from_vec_u32(words(seed + 1), &[6], dev).unwrap(),
            Tensor::from_vec_u32(mask, &[6], dev).unwrap(),
        ]
    };
    let program = |b: &[Tensor]| -> Result<Tensor> {
        let picked = b[2].where_cond(&b[0], &b[1])?;
        let below = picked.lt(&b[1])?.to_dtype(wgrad::DType::F32)?;
        let equal = picked.eq(&b[0])?.to_dtype(wgrad::DType::F32)?;
        below.mul_scalar(2.0)?.add(&equal)?.sum()
    };
    let mut step = Step::new(program);
    for seed in 0..5 {
        let inputs = batch(seed);
        let replayed = step.run(&inputs).unwrap().item().unwrap();
        let eager = program(&inputs).unwrap().item().unwrap();
        assert_eq!(replayed, eager, "batch {seed}");
    }
    assert_eq!(step.stats().replays, 3);
}

/// A step whose loss is one of its inputs (or a view of one) hands back that call's input, as
/// the eager call does, whether or not a kernel of the step reads it.
#[test]
fn a_loss_that_is_an_input_is_the_replayed_calls_input() {
    type Body = fn(&[Tensor]) -> Result<Tensor>;
    let bodies: [(&str, Body); 3] = [
        ("the input", |inputs| Ok(inputs[0].clone())),
        ("a view of it", |inputs| inputs[0].narrow(0, 1, 2)),
        ("the input, read too", |inputs| {
            inputs[0].mul_scalar(2.0)?;
            Ok(inputs[0].clone())
        }),
    ];
    for (what, body) in bodies {
        let mut step = Step::new(body);
        for call in 0..4 {
            let x = Tensor::from_vec(vec![call as f32, 10.0, 20.0], &[3], device()).unwrap();
            let want = body(std::slice::from_ref(&x)).unwrap().to_vec().unwrap();
            let got = step.run(std::slice::from_ref(&x)).unwrap();
            assert_eq!(got.to_vec().unwrap(), want, "{what}, call {call}");
        }
        assert_eq!(step.stats().replays, 2, "{what}");
    }
}
