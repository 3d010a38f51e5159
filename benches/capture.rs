//! Captured steps against eager ones, in the same run: the 784-512-512-10 MLP's Adam step at
//! batch 128, `relu(a * b + a)` over 16M floats, and 4 blocks of Linear 256 + LayerNorm +
//! GELU + residual (AdamW, batch 128). After each pair it prints dispatches per step, host
//! time per step (for replays also the part before the queue submission), and the median step
//! times of eager and replayed steps run alternately.

use std::cell::RefCell;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use wgrad::capture::Step;
use wgrad::nn::{self, Module};
use wgrad::optim::{self, Optimizer};
use wgrad::{Device, Result, Tensor};

/// Dispatches per call of `step`, measured over one call.
fn dispatches(dev: &Device, mut step: impl FnMut()) -> u64 {
    dev.synchronize().unwrap();
    let before = dev.stats().dispatches;
    step();
    dev.synchronize().unwrap();
    dev.stats().dispatches - before
}

/// The best host time of `run` (recording or replaying, no wait), over 50 calls.
fn host_time(dev: &Device, mut run: impl FnMut()) -> f64 {
    let mut best = f64::MAX;
    for _ in 0..50 {
        dev.synchronize().unwrap();
        let start = Instant::now();
        run();
        best = best.min(start.elapsed().as_secs_f64() * 1e6);
    }
    best
}

fn mlp(dev: &Device) -> nn::Sequential {
    nn::Sequential::new()
        .add(nn::Linear::new(784, 512, true, dev).unwrap())
        .add(nn::Relu)
        .add(nn::Linear::new(512, 512, true, dev).unwrap())
        .add(nn::Relu)
        .add(nn::Linear::new(512, 10, true, dev).unwrap())
}

fn train_step(
    model: &dyn Module,
    opt: &mut dyn Optimizer,
    x: &Tensor,
    labels: &Tensor,
) -> Result<Tensor> {
    opt.zero_grad();
    let loss = nn::loss::cross_entropy(&model.forward(x)?, labels)?;
    loss.backward()?;
    opt.step()?;
    Ok(loss)
}

/// Median times of `a` and `b` (each waited for), run alternately `pairs` times: a fairer
/// ratio than two criterion runs minutes apart on a machine whose speed drifts.
fn alternating(dev: &Device, pairs: usize, mut a: impl FnMut(), mut b: impl FnMut()) -> (f64, f64) {
    let time = |f: &mut dyn FnMut()| {
        dev.synchronize().unwrap();
        let start = Instant::now();
        f();
        dev.synchronize().unwrap();
        start.elapsed().as_secs_f64() * 1e3
    };
    let (mut ta, mut tb) = (Vec::new(), Vec::new());
    for _ in 0..pairs {
        ta.push(time(&mut a));
        tb.push(time(&mut b));
    }
    let median = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    (median(ta), median(tb))
}

/// Benches `model`'s step eagerly and captured, and prints dispatches, host time and the
/// alternating medians.
fn eager_and_captured(
    c: &mut Criterion,
    dev: &Device,
    name: &str,
    model: &dyn Module,
    opt: &mut dyn Optimizer,
    x: &Tensor,
    labels: &Tensor,
) {
    // Shared by the eager steps and the captured step's closure, which alternate below.
    let opt = RefCell::new(opt);
    let eager_step = || {
        train_step(model, &mut **opt.borrow_mut(), x, labels).unwrap();
    };
    let mut group = c.benchmark_group(name);
    group.throughput(Throughput::Elements(x.shape()[0] as u64));
    group.bench_function("eager", |b| {
        b.iter(|| {
            eager_step();
            dev.synchronize().unwrap();
        })
    });
    let eager = dispatches(dev, eager_step);
    let eager_host = host_time(dev, eager_step);
    let mut step =
        Step::new(|b: &[Tensor]| train_step(model, &mut **opt.borrow_mut(), &b[0], &b[1]));
    let batch = [x.clone(), labels.clone()];
    group.bench_function("captured", |b| {
        b.iter(|| {
            step.run(&batch).unwrap();
            dev.synchronize().unwrap();
        })
    });
    group.finish();
    // Eager, capture, replay: the counts below are of replays also when a filter skipped
    // the criterion bench above.
    for _ in 0..3 {
        step.run(&batch).unwrap();
    }
    let replayed = dispatches(dev, || {
        step.run(&batch).unwrap();
    });
    let mut to_submit = Vec::new();
    let replay_host = host_time(dev, || {
        step.run(&batch).unwrap();
        to_submit.push(step.stats().last_replay_to_submit.as_secs_f64() * 1e6);
    });
    to_submit.sort_by(f64::total_cmp);
    let (to_submit_best, to_submit_median) = (to_submit[0], to_submit[to_submit.len() / 2]);
    let fused_away = step.stats().fused_away;
    let (eager_ms, replay_ms) = alternating(dev, 40, eager_step, || {
        step.run(&batch).unwrap();
    });
    eprintln!(
        "{name}: {eager} dispatches eager, {replayed} replayed ({fused_away} launches fused \
         away); host time per step (best) {eager_host:.0} us eager, {replay_host:.0} us \
         replayed, of which {to_submit_best:.0} us (median {to_submit_median:.0}) before the \
         submission; alternating medians {eager_ms:.2} ms eager, {replay_ms:.2} ms replayed \
         ({:.2}x)",
        replay_ms / eager_ms
    );
}

fn mlp_step(c: &mut Criterion) {
    let dev = Device::new().expect("a wgpu adapter");
    eprintln!("adapter: {}", dev.info());
    let model = mlp(&dev);
    let mut opt = optim::Adam::new(model.parameters(), optim::AdamConfig::default());
    let x = Tensor::rand(&[128, 784], 7, &dev).unwrap();
    let labels = Tensor::from_labels((0..128).map(|i| i % 10).collect(), &dev).unwrap();
    eager_and_captured(c, &dev, "mlp_adam_batch_128", &model, &mut opt, &x, &labels);
}

fn norm_gelu_blocks(c: &mut Criterion) {
    let dev = Device::new().expect("a wgpu adapter");
    /// Linear 256 + LayerNorm + GELU, added to its input.
    struct Block(nn::Linear, nn::LayerNorm);
    impl Module for Block {
        fn forward(&self, x: &Tensor) -> Result<Tensor> {
            x.add(&self.1.forward(&self.0.forward(x)?)?.gelu()?)
        }
        fn named_parameters(&self) -> Vec<(String, Tensor)> {
            let mut p = self.0.named_parameters();
            p.extend(self.1.named_parameters());
            p
        }
    }
    let mut model = nn::Sequential::new();
    for _ in 0..4 {
        model = model.add(Block(
            nn::Linear::new(256, 256, true, &dev).unwrap(),
            nn::LayerNorm::new(256, 1e-5, &dev).unwrap(),
        ));
    }
    let model = model.add(nn::Linear::new(256, 10, true, &dev).unwrap());
    let mut opt = optim::AdamW::new(model.parameters(), optim::AdamConfig::default());
    let x = Tensor::rand(&[128, 256], 3, &dev).unwrap();
    let labels = Tensor::from_labels((0..128).map(|i| i % 10).collect(), &dev).unwrap();
    eager_and_captured(
        c,
        &dev,
        "norm_gelu_blocks_adamw_batch_128",
        &model,
        &mut opt,
        &x,
        &labels,
    );
}

fn fused_elementwise(c: &mut Criterion) {
    let dev = Device::new().expect("a wgpu adapter");
    let n = 16 << 20;
    let a = Tensor::rand(&[n], 1, &dev).unwrap();
    let b = Tensor::rand(&[n], 2, &dev).unwrap();
    let f = |t: &[Tensor]| t[0].mul(&t[1])?.add(&t[0])?.relu();
    let mut group = c.benchmark_group("relu_a_mul_b_add_a_16M");
    // What one fused pass moves: two reads and one write.
    group.throughput(Throughput::Bytes(3 * 4 * n as u64));
    let inputs = [a, b];
    group.bench_function("eager", |bench| {
        bench.iter(|| {
            f(&inputs).unwrap();
            dev.synchronize().unwrap();
        })
    });
    let mut step = Step::new(f);
    group.bench_function("captured", |bench| {
        bench.iter(|| {
            step.run(&inputs).unwrap();
            dev.synchronize().unwrap();
        })
    });
    group.finish();
    // Eager, capture, replay: a replay is counted also when a filter skipped the benches.
    for _ in 0..3 {
        step.run(&inputs).unwrap();
    }
    let replayed = dispatches(&dev, || {
        step.run(&inputs).unwrap();
    });
    eprintln!("relu(a * b + a): {replayed} dispatch per replay");
}

criterion_group! {
    name = capture;
    config = Criterion::default().sample_size(20).warm_up_time(Duration::from_secs(1)).measurement_time(Duration::from_secs(4));
    targets = mlp_step, fused_elementwise, norm_gelu_blocks
}
criterion_main!(capture);
