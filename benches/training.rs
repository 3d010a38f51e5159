//! Forward + backward of a 784-512-512-10 MLP (ReLU, cross-entropy) at batch 128, on whatever
//! adapter `Device::new()` picks. Each iteration records the step, runs backward, and waits
//! for the device, so the figure is the whole step's wall time.

use std::time::Duration;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
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

    fn zero_grad(&self) {
        for (w, b) in &self.layers {
            w.zero_grad();
            b.zero_grad();
        }
    }
}

fn forward_backward(c: &mut Criterion) {
    let dev = Device::new().expect("a wgpu adapter");
    eprintln!("adapter: {}", dev.info());
    let batch = 128;
    let mlp = Mlp::new(&[784, 512, 512, 10], &dev);
    let x = Tensor::rand(&[batch, 784], 7, &dev).unwrap();
    let labels = Tensor::from_labels((0..batch as u32).map(|i| i % 10).collect(), &dev).unwrap();
    let mut group = c.benchmark_group("mlp_784_512_512_10");
    group.throughput(Throughput::Elements(batch as u64));
    group.bench_function("forward_backward_batch_128", |bench| {
        bench.iter(|| {
            mlp.zero_grad();
            mlp.loss(&x, &labels).unwrap().backward().unwrap();
            dev.synchronize().unwrap();
        })
    });
    group.finish();
    let before = dev.stats();
    mlp.zero_grad();
    mlp.loss(&x, &labels).unwrap().backward().unwrap();
    dev.synchronize().unwrap();
    let after = dev.stats();
    eprintln!(
        "per step: {} dispatches, {} submits; live + pooled device memory {:.1} MiB",
        after.dispatches - before.dispatches,
        after.submits - before.submits,
        (after.live_bytes + after.pooled_bytes) as f64 / (1 << 20) as f64
    );
}

criterion_group! {
    name = training;
    config = Criterion::default().sample_size(20).warm_up_time(Duration::from_secs(1)).measurement_time(Duration::from_secs(4));
    targets = forward_backward
}
criterion_main!(training);
