//! `wgrad::autocast` (docs/ops.md, "Mixed precision"): inside it, matmul-like ops run on 16-bit
//! inputs and softmax, norms and losses in f32, as torch.autocast; parameters stay F32 with F32
//! grads; a parameter is cast once per region; outside it nothing changes.

mod common;
use common::*;
use wgrad::capture::Step;
use wgrad::nn::{self, Module};
use wgrad::optim::{Optimizer, Sgd, SgdConfig};
use wgrad::{autocast, DType, Error, Result, Tensor};

/// `make` with the global generator to itself: the generator is one per process, and a test
/// that draws from it (every module's initialiser does) while another seeds it would change
/// what the other draws.
fn drawing<T>(make: impl FnOnce() -> T) -> T {
    static SEEDING: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _one_at_a_time = SEEDING.lock().unwrap_or_else(|e| e.into_inner());
    make()
}

/// The same MLP on every call.
fn mlp() -> nn::Sequential {
    drawing(|| {
        wgrad::manual_seed(3);
        nn::Sequential::new()
            .add(nn::Linear::new(12, 16, true, device()).unwrap())
            .add(nn::Relu)
            .add(nn::Linear::new(16, 5, true, device()).unwrap())
    })
}

fn batch() -> (Tensor, Tensor) {
    let (x, _) = random_tensor(&[8, 12], 4);
    let y = Tensor::from_labels((0..8).map(|i| i % 5).collect(), device()).unwrap();
    (x, y)
}

fn grads(model: &dyn Module) -> Vec<Vec<f32>> {
    model
        .parameters()
        .iter()
        .map(|p| p.grad().unwrap().to_vec().unwrap())
        .collect()
}

#[test]
fn linear_runs_in_16_bit_and_the_loss_in_f32() {
    let model = mlp();
    let (x, y) = batch();
    autocast(DType::F16, || {
        let logits = model.forward(&x)?;
        assert_eq!(logits.dtype(), DType::F16);
        let loss = nn::loss::cross_entropy(&logits, &y)?;
        assert_eq!(loss.dtype(), DType::F32);
        assert_eq!(logits.softmax(1)?.dtype(), DType::F32);
        Ok(())
    })
    .unwrap();
}

#[test]
fn autocast_losses_and_grads_follow_the_f32_ones_within_16_bit_rounding() {
    let (x, y) = batch();
    let model = mlp();
    let loss = nn::loss::cross_entropy(&model.forward(&x).unwrap(), &y).unwrap();
    loss.backward().unwrap();
    let (want_loss, want_grads) = (loss.item().unwrap(), grads(&model));
    for (dtype, rel) in [(DType::F16, 5e-3f64), (DType::BF16, 3e-2)] {
        let model = mlp();
        let loss = autocast(dtype, || nn::loss::cross_entropy(&model.forward(&x)?, &y)).unwrap();
        loss.backward().unwrap();
        let got_loss = f64::from(loss.item().unwrap());
        assert_ne!(
            got_loss,
            f64::from(want_loss),
            "{dtype:?}: the products were rounded"
        );
        assert!(
            (got_loss - f64::from(want_loss)).abs() <= rel * f64::from(want_loss).abs(),
            "{dtype:?} loss"
        );
        for (p, (got, want)) in model
            .parameters()
            .iter()
            .zip(grads(&model).iter().zip(&want_grads))
        {
            assert_eq!(
                p.grad().unwrap().dtype(),
                DType::F32,
                "master weights' grads are F32"
            );
            let want: Vec<f64> = want.iter().map(|&v| f64::from(v)).collect();
            assert_close(got, &want, rel, &format!("{dtype:?} grad"));
        }
    }
}

#[test]
fn a_parameter_is_cast_once_per_region() {
    // A device of its own: its dispatch count is this test's alone.
    let dev = wgrad::Device::software().unwrap();
    let lin = drawing(|| nn::Linear::new(12, 6, false, &dev).unwrap());
    let x = Tensor::from_vec(common::random_vec(8 * 12, 4), &[8, 12], &dev).unwrap();
    let dispatches = || dev.stats().dispatches;
    autocast(DType::BF16, || {
        let before = dispatches();
        lin.forward(&x)?;
        let first = dispatches() - before;
        let before = dispatches();
        lin.forward(&x)?;
        let second = dispatches() - before;
        assert_eq!(second + 1, first, "the weight's cast is reused");
        Ok(())
    })
    .unwrap();
}

#[test]
fn outside_the_region_nothing_changes() {
    let model = mlp();
    let (x, _) = batch();
    autocast(DType::F16, || model.forward(&x)).unwrap();
    assert_eq!(model.forward(&x).unwrap().dtype(), DType::F32);
    for p in model.parameters() {
        assert_eq!(p.dtype(), DType::F32);
    }
}

#[test]
fn a_backward_pass_inside_the_region_runs_in_the_forward_dtypes() {
    let model = mlp();
    let (x, y) = batch();
    autocast(DType::F16, || {
        nn::loss::cross_entropy(&model.forward(&x)?, &y)?.backward()
    })
    .unwrap();
    for p in model.parameters() {
        assert_eq!(p.grad().unwrap().dtype(), DType::F32);
    }
}

#[test]
fn convolutions_and_attention_run_in_16_bit_with_f32_grads() {
    let conv = drawing(|| nn::Conv2d::new(2, 3, 3, 1, 1, device()).unwrap());
    let (x, _) = random_tensor(&[2, 2, 6, 6], 5);
    let (q, _) = random_tensor(&[1, 2, 5, 4], 6);
    let q = q.requires_grad_(true);
    autocast(DType::F16, || {
        let y = conv.forward(&x)?;
        assert_eq!(y.dtype(), DType::F16);
        let o = q.scaled_dot_product_attention(&q, &q, true)?;
        assert_eq!(o.dtype(), DType::F16);
        y.sum()?.add(&o.sum()?)?.backward()
    })
    .unwrap();
    assert_eq!(conv.weight.grad().unwrap().dtype(), DType::F32);
    assert_eq!(q.grad().unwrap().dtype(), DType::F32);
}

#[test]
fn a_captured_step_under_autocast_equals_the_eager_steps() {
    let run = |captured: bool| -> Vec<f32> {
        let model = mlp();
        let mut opt = Sgd::new(
            model.parameters(),
            SgdConfig {
                lr: 0.1,
                ..Default::default()
            },
        );
        let mut train = |b: &[Tensor]| -> Result<Tensor> {
            opt.zero_grad();
            let loss = autocast(DType::BF16, || {
                nn::loss::cross_entropy(&model.forward(&b[0])?, &b[1])
            })?;
            loss.backward()?;
            opt.step()?;
            Ok(loss)
        };
        let (x, y) = batch();
        let inputs = [x, y];
        let losses: Vec<f32> = match captured {
            true => {
                let mut step = Step::new(&mut train);
                let losses = (0..4)
                    .map(|_| step.run(&inputs).unwrap().item().unwrap())
                    .collect();
                assert_eq!(step.stats().replays, 2);
                losses
            }
            false => (0..4)
                .map(|_| train(&inputs).unwrap().item().unwrap())
                .collect(),
        };
        losses
    };
    assert_eq!(run(true), run(false));
}

#[test]
fn autocast_to_a_32_bit_dtype_is_an_error() {
    match autocast(DType::F32, || Ok(())) {
        Err(Error::InvalidArgument { op, .. }) => assert_eq!(op, "autocast"),
        other => panic!("{other:?}"),
    }
}

#[test]
fn each_input_of_a_two_dtype_op_gets_a_grad_of_its_own_dtype() {
    let h = Tensor::from_slice(&[1.0, 2.0], &[2], device())
        .unwrap()
        .to_dtype(DType::BF16)
        .unwrap()
        .requires_grad_(true);
    let f = Tensor::from_slice(&[0.5, 0.25], &[2], device())
        .unwrap()
        .requires_grad_(true);
    let y = autocast(DType::BF16, || h.add(&f)).unwrap();
    assert_eq!(y.dtype(), DType::F32, "promoted");
    y.mul_scalar(3.0)
        .unwrap()
        .sum()
        .unwrap()
        .backward()
        .unwrap();
    assert_eq!(h.grad().unwrap().dtype(), DType::BF16);
    assert_eq!(f.grad().unwrap().dtype(), DType::F32);
    assert_eq!(h.grad().unwrap().to_vec().unwrap(), vec![3.0, 3.0]);
}

#[test]
fn a_transformer_block_trains_under_autocast() {
    let block = drawing(|| nn::TransformerBlock::new(16, 2, true, 0.0, device()).unwrap());
    let (x, _) = random_tensor(&[2, 5, 16], 9);
    let want = block.forward(&x).unwrap().to_vec().unwrap();
    let y = autocast(DType::BF16, || block.forward(&x)).unwrap();
    let want: Vec<f64> = want.into_iter().map(f64::from).collect();
    assert_close(&y.to_vec().unwrap(), &want, 5e-2, "block output");
    y.to_dtype(DType::F32)
        .unwrap()
        .sum()
        .unwrap()
        .backward()
        .unwrap();
    for p in block.parameters() {
        assert_eq!(p.grad().unwrap().dtype(), DType::F32);
    }
}
