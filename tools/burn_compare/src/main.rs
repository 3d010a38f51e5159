//! The workloads of wgrad's benchmark report (`examples/bench.rs`) written in Burn 0.22 and timed
//! the same way on the same adapter: matmul 1024 GFLOP/s, and the first and median training
//! steps (forward, backward, AdamW) of the MLP at batch 128 and 1024, the CNN at batch 64 and
//! the GPT (4 pre-norm blocks of width 128, 4 heads, block 64, batch 12).
//!
//! Run with `bash tools/burn_compare.sh`, which builds this crate and wgrad's report on one
//! adapter and prints both. `burn_compare [matmul] [mlp128] [mlp1024] [cnn] [gpt]` runs only
//! the workloads named. Burn's device is the first Vulkan adapter (`WGPU_BACKEND` is not
//! read by Burn): on a machine without a GPU, lavapipe.

use std::time::{Duration, Instant};

use burn::nn::attention::generate_autoregressive_mask;
use burn::nn::conv::{Conv2d, Conv2dConfig};
use burn::nn::loss::{CrossEntropyLoss, CrossEntropyLossConfig};
use burn::nn::pool::{MaxPool2d, MaxPool2dConfig};
use burn::nn::transformer::{
    TransformerEncoder, TransformerEncoderConfig, TransformerEncoderInput,
};
use burn::nn::{
    Embedding, EmbeddingConfig, LayerNorm, LayerNormConfig, Linear, LinearConfig, PaddingConfig2d,
    Relu,
};
use burn::optim::{AdamWConfig, GradientsParams};
use burn::prelude::*;
use burn::tensor::wgpu::WgpuBackend;
use burn::tensor::{DeviceKind, Distribution, TensorData};

/// The median seconds of `run` (waited for), after `warm_up` runs, over at least `min_runs`
/// runs and about `budget` of time: `examples/bench.rs`'s `median_secs`.
fn median_secs(
    device: &Device,
    warm_up: usize,
    min_runs: usize,
    budget: Duration,
    mut run: impl FnMut(),
) -> f64 {
    for _ in 0..warm_up {
        run();
        device.sync().expect("device sync");
    }
    let started = Instant::now();
    let mut samples = Vec::new();
    while samples.len() < min_runs || (started.elapsed() < budget && samples.len() < 100) {
        let t = Instant::now();
        run();
        device.sync().expect("device sync");
        samples.push(t.elapsed().as_secs_f64());
    }
    samples.sort_by(f64::total_cmp);
    samples[samples.len() / 2]
}

#[derive(Module, Debug)]
struct Mlp {
    l1: Linear,
    l2: Linear,
    l3: Linear,
    relu: Relu,
}

impl Mlp {
    fn new(device: &Device) -> Mlp {
        Mlp {
            l1: LinearConfig::new(784, 512).init(device),
            l2: LinearConfig::new(512, 512).init(device),
            l3: LinearConfig::new(512, 10).init(device),
            relu: Relu::new(),
        }
    }

    fn forward(&self, x: Tensor<2>) -> Tensor<2> {
        let h = self.relu.forward(self.l1.forward(x));
        let h = self.relu.forward(self.l2.forward(h));
        self.l3.forward(h)
    }
}

#[derive(Module, Debug)]
struct Cnn {
    conv1: Conv2d,
    conv2: Conv2d,
    pool: MaxPool2d,
    fc1: Linear,
    fc2: Linear,
    relu: Relu,
}

impl Cnn {
    fn new(device: &Device) -> Cnn {
        let conv = |c_in, c_out| {
            Conv2dConfig::new([c_in, c_out], [3, 3])
                .with_padding(PaddingConfig2d::Explicit(1, 1, 1, 1))
                .init(device)
        };
        Cnn {
            conv1: conv(1, 32),
            conv2: conv(32, 64),
            pool: MaxPool2dConfig::new([2, 2]).init(),
            fc1: LinearConfig::new(3136, 128).init(device),
            fc2: LinearConfig::new(128, 10).init(device),
            relu: Relu::new(),
        }
    }

    fn forward(&self, x: Tensor<4>) -> Tensor<2> {
        let h = self.pool.forward(self.relu.forward(self.conv1.forward(x)));
        let h = self.pool.forward(self.relu.forward(self.conv2.forward(h)));
        let h: Tensor<2> = h.flatten(1, 3);
        self.fc2.forward(self.relu.forward(self.fc1.forward(h)))
    }
}

/// wgrad's GPT: token and position embeddings, 4 pre-norm blocks (causal attention, a GELU
/// feed-forward of 4x the width, no dropout), a final LayerNorm and a head without bias.
#[derive(Module, Debug)]
struct Gpt {
    token: Embedding,
    position: Embedding,
    blocks: TransformerEncoder,
    ln_f: LayerNorm,
    head: Linear,
}

impl Gpt {
    fn new(vocab: usize, width: usize, block: usize, device: &Device) -> Gpt {
        Gpt {
            token: EmbeddingConfig::new(vocab, width).init(device),
            position: EmbeddingConfig::new(block, width).init(device),
            blocks: TransformerEncoderConfig::new(width, 4 * width, 4, 4)
                .with_dropout(0.0)
                .with_norm_first(true)
                .init(device),
            ln_f: LayerNormConfig::new(width).init(device),
            head: LinearConfig::new(width, vocab)
                .with_bias(false)
                .init(device),
        }
    }

    fn forward(&self, tokens: Tensor<2, Int>, mask: Tensor<3, Bool>) -> Tensor<3> {
        let [_, t] = tokens.dims();
        let positions = Tensor::<1, Int>::arange(0..t as i64, &tokens.device()).unsqueeze::<2>();
        let h = self.token.forward(tokens) + self.position.forward(positions);
        let h = self
            .blocks
            .forward(TransformerEncoderInput::new(h).mask_attn(mask));
        self.head.forward(self.ln_f.forward(h))
    }
}

fn labels(n: usize, classes: i64, device: &Device) -> Tensor<1, Int> {
    let ids: Vec<i64> = (0..n as i64).map(|i| i % classes).collect();
    Tensor::from_data(TensorData::new(ids, [n]), device)
}

/// One row of the printed table.
struct Row {
    name: String,
    value: f64,
    unit: &'static str,
}

/// The first step (kernels compiling) and the median step of `train`, which runs one step of
/// forward, backward and AdamW and hands the model back.
fn steps<M: Module>(
    name: &str,
    device: &Device,
    mut model: M,
    loss: impl Fn(&M) -> Tensor<1>,
    rows: &mut Vec<Row>,
) {
    let mut optim = AdamWConfig::new().init();
    let mut train = || {
        let current = model.clone();
        let grads = GradientsParams::from_grads(loss(&current).backward(), &current);
        model = optim.step(1e-3, current, grads);
    };
    let started = Instant::now();
    train();
    device.sync().expect("device sync");
    let first = started.elapsed().as_secs_f64();
    let eager = median_secs(device, 1, 5, Duration::from_secs(3), &mut train);
    eprintln!("{name}: first {first:.2} s, step {:.1} ms", eager * 1e3);
    rows.push(Row {
        name: format!("{name} first step"),
        value: first * 1e3,
        unit: "ms",
    });
    rows.push(Row {
        name: format!("{name} eager"),
        value: eager * 1e3,
        unit: "ms",
    });
}

/// The workloads to run, from the command line (all when none is named).
const WORKLOADS: [&str; 5] = ["matmul", "mlp128", "mlp1024", "cnn", "gpt"];

fn main() {
    let named: Vec<String> = std::env::args().skip(1).collect();
    if let Some(bad) = named.iter().find(|n| !WORKLOADS.contains(&n.as_str())) {
        eprintln!("burn_compare: unknown workload {bad}; the workloads: {WORKLOADS:?}");
        std::process::exit(2);
    }
    let wanted = |name: &str| named.is_empty() || named.iter().any(|n| n == name);
    let device = Device::wgpu_options()
        .device_kind(DeviceKind::DefaultDevice)
        .graphics_api(WgpuBackend::Vulkan)
        .init()
        .expect("Burn finds a Vulkan adapter");
    device.seed(0);
    let mut rows = Vec::new();

    if wanted("matmul") {
        let n = 1024;
        let a = Tensor::<2>::random([n, n], Distribution::Default, &device);
        let b = Tensor::<2>::random([n, n], Distribution::Default, &device);
        let secs = median_secs(&device, 1, 3, Duration::from_secs(2), || {
            let _ = a.clone().matmul(b.clone());
        });
        let gflops = 2.0 * (n as f64).powi(3) / secs / 1e9;
        eprintln!("matmul F32 {n}: {gflops:.1} GFLOP/s");
        rows.push(Row {
            name: format!("matmul F32 {n}x{n}x{n}"),
            value: gflops,
            unit: "GFLOP/s",
        });
    }

    let device = device.autodiff();
    let xent: CrossEntropyLoss = CrossEntropyLossConfig::new().init(&device);
    for batch in [128, 1024] {
        if !wanted(&format!("mlp{batch}")) {
            continue;
        }
        let x = Tensor::<2>::random([batch, 784], Distribution::Default, &device);
        let y = labels(batch, 10, &device);
        steps(
            &format!("MLP 784-512-512-10, batch {batch}, AdamW"),
            &device,
            Mlp::new(&device),
            |m: &Mlp| xent.forward(m.forward(x.clone()), y.clone()),
            &mut rows,
        );
    }

    if wanted("cnn") {
        let x = Tensor::<4>::random([64, 1, 28, 28], Distribution::Default, &device);
        let y = labels(64, 10, &device);
        steps(
            "CNN (2 conv + 2 linear), batch 64, AdamW",
            &device,
            Cnn::new(&device),
            |m: &Cnn| xent.forward(m.forward(x.clone()), y.clone()),
            &mut rows,
        );
    }

    if wanted("gpt") {
        gpt(&device, &xent, &mut rows);
    }

    println!("Burn 0.22.1 on {device:?}\n");
    println!("| bench | value | unit |");
    println!("|---|---|---|");
    for row in rows {
        println!("| {} | {:.2} | {} |", row.name, row.value, row.unit);
    }
}

/// The GPT's first and median steps.
fn gpt(device: &Device, xent: &CrossEntropyLoss, rows: &mut Vec<Row>) {
    let (vocab, block, batch) = (65usize, 64usize, 12usize);
    let ids: Vec<i64> = (0..batch * block).map(|i| (i * 7 % vocab) as i64).collect();
    let x = Tensor::<2, Int>::from_data(TensorData::new(ids.clone(), [batch, block]), device);
    let y = Tensor::<1, Int>::from_data(TensorData::new(ids, [batch * block]), device);
    let mask = generate_autoregressive_mask(batch, block, device);
    steps(
        "GPT 4x128, block 64, batch 12, AdamW",
        device,
        Gpt::new(vocab, 128, block, device),
        |m: &Gpt| {
            let logits = m.forward(x.clone(), mask.clone());
            xent.forward(logits.reshape([batch * block, vocab]), y.clone())
        },
        rows,
    );
}
