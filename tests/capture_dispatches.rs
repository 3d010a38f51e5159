//! Dispatches per replay of the examples' models, pinned: the capture redesign (issue 25) and
//! new fusions may lower them, never raise them. Each count is the replay's launches after
//! fusion on lavapipe (the CPU flavour); a change that raises one must say why.

mod common;
use common::*;
use wgrad::capture::Step;
use wgrad::nn::{self, Module};
use wgrad::optim::{self, Optimizer};
use wgrad::Tensor;

/// The replay's dispatch count of an Adam training step of `model` on `(x, y)`.
fn replay_dispatches(model: &dyn Module, x: &Tensor, y: &Tensor) -> u64 {
    let mut opt = optim::Adam::new(model.parameters(), Default::default());
    let mut step = Step::new(|b: &[Tensor]| {
        opt.zero_grad();
        let logits = model.forward(&b[0])?;
        let classes = *logits.shape().last().unwrap();
        let loss = nn::loss::cross_entropy(&logits.reshape(&[b[1].numel(), classes])?, &b[1])?;
        loss.backward()?;
        opt.step()?;
        Ok(loss)
    });
    for _ in 0..3 {
        step.run(&[x.clone(), y.clone()]).unwrap();
    }
    assert_eq!(step.stats().replays, 1);
    step.stats().replay_dispatches
}

fn labels(n: usize, classes: u32) -> Tensor {
    Tensor::from_labels((0..n as u32).map(|i| i % classes).collect(), device()).unwrap()
}

/// The counts (MLP, CNN, GPT) on lavapipe (22.3 and 25.0.7 alike) and on llvmpipe through GL,
/// whose kernels differ (no subgroups). Written at 17, 41, 141 and 18, 40, 146 (session 13);
/// the GPT's went down by 5 when LayerNorm's backward took the residual grad's add into its
/// stores (session 17).
const VULKAN_SOFTWARE: [u64; 3] = [17, 41, 136];
const GL_SOFTWARE: [u64; 3] = [18, 40, 141];

#[test]
fn dispatches_per_replay_do_not_grow() {
    let dev = device();
    let mlp = nn::Sequential::new()
        .add(nn::Linear::new(784, 128, true, dev).unwrap())
        .add(nn::Relu)
        .add(nn::Linear::new(128, 128, true, dev).unwrap())
        .add(nn::Relu)
        .add(nn::Linear::new(128, 10, true, dev).unwrap());
    let (x, _) = random_tensor(&[64, 784], 1);
    let mlp_count = replay_dispatches(&mlp, &x, &labels(64, 10));

    let cnn = nn::Sequential::new()
        .add(nn::Conv2d::new(1, 32, 3, 1, 1, dev).unwrap())
        .add(nn::Relu)
        .add(nn::MaxPool2d::new(2, 2))
        .add(nn::Conv2d::new(32, 64, 3, 1, 1, dev).unwrap())
        .add(nn::Relu)
        .add(nn::MaxPool2d::new(2, 2))
        .add(nn::Flatten)
        .add(nn::Linear::new(64 * 7 * 7, 128, true, dev).unwrap())
        .add(nn::Relu)
        .add(nn::Linear::new(128, 10, true, dev).unwrap());
    let (x, _) = random_tensor(&[8, 1, 28, 28], 2);
    let cnn_count = replay_dispatches(&cnn, &x, &labels(8, 10));

    let mut gpt = nn::Sequential::new();
    for _ in 0..4 {
        gpt = gpt.add(nn::TransformerBlock::new(64, 4, true, 0.0, dev).unwrap());
    }
    let gpt = gpt
        .add(nn::LayerNorm::new(64, 1e-5, dev).unwrap())
        .add(nn::Linear::new(64, 65, false, dev).unwrap());
    let (x, _) = random_tensor(&[4, 16, 64], 3);
    let gpt_count = replay_dispatches(&gpt, &x, &labels(64, 65));

    let info = dev.info();
    eprintln!("dispatches per replay on {info}: MLP {mlp_count}, CNN {cnn_count}, GPT {gpt_count}");
    // Pinned where they were measured: software adapters running their own kernels (a GPU,
    // or WGRAD_KERNEL_FLAVOR=gpu, runs other kernels).
    if !info.is_software() || dev.kernel_flavor() != wgrad::KernelFlavor::Cpu {
        return;
    }
    let pinned = match format!("{:?}", info.backend).as_str() {
        "Gl" => GL_SOFTWARE,
        _ => VULKAN_SOFTWARE,
    };
    let counts = [mlp_count, cnn_count, gpt_count];
    for ((name, got), pinned) in ["MLP", "CNN", "GPT"].iter().zip(counts).zip(pinned) {
        assert!(
            got <= pinned,
            "{name}: {got} dispatches per replay, pinned at {pinned}"
        );
    }
}
