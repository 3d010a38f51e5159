//! A captured step with LayerNorm and dropout equals the eager step, masks included: replays
//! draw each dropout seed from the global generator as the eager step does. Its own binary,
//! since the global seed is shared by every thread of a test process.

mod common;
use common::*;
use wgrad::capture::Step;
use wgrad::nn::{self, Module};
use wgrad::optim::{AdamConfig, AdamW, Optimizer};
use wgrad::{manual_seed, Result, Tensor};

const STEPS: usize = 200;

fn model() -> nn::Sequential {
    let dev = device();
    nn::Sequential::new()
        .add(nn::Linear::new(10, 24, true, dev).unwrap())
        .add(nn::LayerNorm::new(24, 1e-5, dev).unwrap())
        .add(nn::Gelu)
        .add(nn::Dropout::new(0.2).unwrap())
        .add(nn::Linear::new(24, 4, true, dev).unwrap())
}

fn step(model: &nn::Sequential, opt: &mut AdamW, x: &Tensor, y: &Tensor) -> Result<Tensor> {
    opt.zero_grad();
    let loss = nn::loss::cross_entropy(&model.forward(x)?, y)?;
    loss.backward()?;
    opt.step()?;
    Ok(loss)
}

/// Losses of every step and the final parameters.
fn train(captured: bool) -> (Vec<f32>, Vec<Vec<f32>>) {
    manual_seed(11);
    let model = model();
    let config = AdamConfig {
        weight_decay: 0.01,
        ..AdamConfig::default()
    };
    let mut opt = AdamW::new(model.parameters(), config);
    let (x, _) = random_tensor(&[16, 10], 5);
    let y = Tensor::from_vec_u32((0..16).map(|i| i % 4).collect(), &[16], device()).unwrap();
    let mut losses = Vec::new();
    if captured {
        let mut run = Step::new(|b: &[Tensor]| step(&model, &mut opt, &b[0], &b[1]));
        for _ in 0..STEPS {
            losses.push(run.run(&[x.clone(), y.clone()]).unwrap());
        }
        assert_eq!(run.stats().replays, STEPS as u64 - 2);
    } else {
        for _ in 0..STEPS {
            losses.push(step(&model, &mut opt, &x, &y).unwrap());
        }
    }
    let losses = losses.iter().map(|l| l.item().unwrap()).collect();
    let params = model
        .parameters()
        .iter()
        .map(|p| p.to_vec().unwrap())
        .collect();
    (losses, params)
}

#[test]
fn replayed_layer_norm_and_dropout_steps_equal_eager_steps() {
    let (eager_losses, eager_params) = train(false);
    let (losses, params) = train(true);
    for (i, (a, b)) in losses.iter().zip(&eager_losses).enumerate() {
        assert!(
            (a - b).abs() <= 1e-5 * b.abs().max(1.0),
            "step {i}: loss {a} vs {b}"
        );
    }
    for (p, q) in params.iter().zip(&eager_params) {
        for (a, b) in p.iter().zip(q) {
            assert!(
                (a - b).abs() <= 1e-5 * b.abs().max(1.0),
                "parameter {a} vs {b}"
            );
        }
    }
}
