//! Training steps of a 784-512-512-10 MLP (ReLU, cross-entropy) on whatever adapter
//! `Device::new()` picks: forward + backward at batch 128 (the autograd bench), and a full
//! step (forward, backward, Adam) at batch 128 and 1024. Each iteration waits for the device,
//! so the figures are whole steps' wall time. After each bench it prints dispatches and
//! submissions per step, device memory, and how much of a step the host spends recording.

use std::time::Duration;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use std::time::Instant;
use wgrad::optim::{self, Optimizer};
use wgrad::{nn, Device, Tensor};

struct Mlp {
    layers: Vec<(Tensor, Tensor)>,
}

impl Mlp {
    fn new(sizes: &[usize], dev: &Device) -> Mlp {
        let layers = sizes
            .windows(2)
            .enumerate()
            .map(|(i, pair)| {
                let bound = (1.0 / pair[0] as f32).sqrt();
                let w = Tensor::rand(&[pair[1], pair[0]], i as u64, dev)
                    .unwrap()
                    .mul_scalar(2.0 * bound)
                    .unwrap()
                    .sub_scalar(bound)
                    .unwrap()
                    .requires_grad_(true);
                let b = Tensor::zeros(&[pair[1]], dev).unwrap().requires_grad_(true);
                (w, b)
            })
            .collect();
        Mlp { layers }
    }

    fn loss(&self, x: &Tensor, labels: &Tensor) -> wgrad::Result<Tensor> {
        let mut h = x.clone();
        for (i, (w, b)) in self.layers.iter().enumerate() {
            h = h.matmul(&w.t()?)?.add(b)?;
            if i + 1 < self.layers.len() {
                h = h.relu()?;
            }
        }
        nn::loss::cross_entropy(&h, labels)
    }

    fn parameters(&self) -> Vec<Tensor> {
        self.layers
            .iter()
            .flat_map(|(w, b)| [w.clone(), b.clone()])
            .collect()
    }

    fn zero_grad(&self) {
        for (w, b) in &self.layers {
            w.zero_grad();
            b.zero_grad();
        }
    }
}

/// Prints what one more `step` costs: dispatches, submissions, device memory, host time.
fn report(dev: &Device, label: &str, mut step: impl FnMut()) {
    dev.synchronize().unwrap();
    let before = dev.stats();
    let start = Instant::now();
    step();
    let recorded = start.elapsed();
    dev.synchronize().unwrap();
    let total = start.elapsed();
    let after = dev.stats();
    eprintln!(
        "{label}: {} dispatches, {} submits per step; {:.1} MiB device memory (live + pooled), \
         {} buffers created by this step; host recording {:.1} ms of {:.1} ms",
        after.dispatches - before.dispatches,
        after.submits - before.submits,
        (after.live_bytes + after.pooled_bytes) as f64 / (1 << 20) as f64,
        after.buffers_created - before.buffers_created,
        recorded.as_secs_f64() * 1e3,
        total.as_secs_f64() * 1e3,
    );
}

fn batch_of(batch: usize, dev: &Device) -> (Tensor, Tensor) {
    let x = Tensor::rand(&[batch, 784], 7, dev).unwrap();
    let labels = Tensor::from_labels((0..batch as u32).map(|i| i % 10).collect(), dev).unwrap();
    (x, labels)
}

fn forward_backward(c: &mut Criterion) {
    let dev = Device::new().expect("a wgpu adapter");
    eprintln!("adapter: {}", dev.info());
    let mlp = Mlp::new(&[784, 512, 512, 10], &dev);
    let (x, labels) = batch_of(128, &dev);
    let mut group = c.benchmark_group("mlp_784_512_512_10");
    group.throughput(Throughput::Elements(128));
    let step = || {
        mlp.zero_grad();
        mlp.loss(&x, &labels).unwrap().backward().unwrap();
    };
    group.bench_function("forward_backward_batch_128", |bench| {
        bench.iter(|| {
            step();
            dev.synchronize().unwrap();
        })
    });
    group.finish();
    report(&dev, "forward_backward_batch_128", step);
}

fn adam_step(c: &mut Criterion) {
    let dev = Device::new().expect("a wgpu adapter");
    let mut group = c.benchmark_group("mlp_784_512_512_10");
    for batch in [128usize, 1024] {
        let mlp = Mlp::new(&[784, 512, 512, 10], &dev);
        let mut opt = optim::Adam::new(mlp.parameters(), optim::AdamConfig::default());
        let (x, labels) = batch_of(batch, &dev);
        let mut step = || {
            opt.zero_grad();
            mlp.loss(&x, &labels).unwrap().backward().unwrap();
            opt.step().unwrap();
        };
        group.throughput(Throughput::Elements(batch as u64));
        group.bench_function(format!("adam_step_batch_{batch}"), |bench| {
            bench.iter(|| {
                step();
                dev.synchronize().unwrap();
            })
        });
        report(&dev, &format!("adam_step_batch_{batch}"), &mut step);
        report_phases(
            &dev,
            &format!("adam_step_batch_{batch}"),
            &mlp,
            &mut opt,
            &x,
            &labels,
        );
    }
    group.finish();
}

/// Prints where a step's time goes: forward (with the loss), backward and the optimizer,
/// waiting for the device after each, best of 20 steps (this VM's timings are noisy).
fn report_phases(
    dev: &Device,
    label: &str,
    mlp: &Mlp,
    opt: &mut optim::Adam,
    x: &Tensor,
    labels: &Tensor,
) {
    let mut best = [f64::MAX; 3];
    for _ in 0..20 {
        opt.zero_grad();
        dev.synchronize().unwrap();
        let start = Instant::now();
        let loss = mlp.loss(x, labels).unwrap();
        dev.synchronize().unwrap();
        let forward = start.elapsed();
        loss.backward().unwrap();
        dev.synchronize().unwrap();
        let backward = start.elapsed();
        opt.step().unwrap();
        dev.synchronize().unwrap();
        let total = start.elapsed();
        let phases = [forward, backward - forward, total - backward];
        for (b, p) in best.iter_mut().zip(phases) {
            *b = b.min(p.as_secs_f64() * 1e3);
        }
    }
    eprintln!(
        "{label}: best phases forward {:.1} ms, backward {:.1} ms, Adam {:.1} ms",
        best[0], best[1], best[2]
    );
}

criterion_group! {
    name = training;
    config = Criterion::default().sample_size(20).warm_up_time(Duration::from_secs(1)).measurement_time(Duration::from_secs(4));
    targets = forward_backward, adam_step
}
criterion_main!(training);
