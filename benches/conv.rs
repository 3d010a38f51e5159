//! Convolution benches on whatever adapter `Device::new()` picks: the forward of the CNN
//! example's second conv layer beside a matmul of the same GEMM shape (M = 64 output channels,
//! N = 64 images x 14 x 14 pixels, K = 32 x 3 x 3), both as FLOP/s; forward + backward of the
//! CNN's two conv layers at batch 64; one whole CNN training step (batch 64, Adam); and a
//! U-Net up block's `conv_transpose2d` (64 -> 32 channels, 16x16 -> 32x32, batch 8) beside the
//! stride-2 conv2d with the same GEMMs (32 -> 64, 32x32 -> 16x16), forward + backward (bar:
//! within 1.5x). Each iteration waits for the device.

use std::time::Duration;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use wgrad::nn::{self, Module};
use wgrad::optim::{self, Optimizer};
use wgrad::{ConvTranspose2dOptions, Device, Tensor};

const BATCH: usize = 64;

fn conv_layers(c: &mut Criterion) {
    let dev = Device::new().unwrap();
    eprintln!("adapter: {}", dev.info());
    let mut group = c.benchmark_group("conv2d");
    group
        .sample_size(10)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(5));

    // The second layer's forward and the same GEMM as a matmul.
    let (m, n, k) = (64, BATCH * 14 * 14, 32 * 9);
    group.throughput(Throughput::Elements((2 * m * n * k) as u64));
    let x = Tensor::randn(&[BATCH, 32, 14, 14], 1, &dev).unwrap();
    let w = Tensor::randn(&[64, 32, 3, 3], 2, &dev).unwrap();
    group.bench_function("forward 32->64 14x14 (GEMM 64x12544x288)", |b| {
        b.iter(|| {
            x.conv2d(&w, None, 1, 1).unwrap();
            dev.synchronize().unwrap();
        })
    });
    let a = Tensor::randn(&[m, k], 3, &dev).unwrap();
    let bm = Tensor::randn(&[k, n], 4, &dev).unwrap();
    group.bench_function("matmul 64x12544x288", |b| {
        b.iter(|| {
            a.matmul(&bm).unwrap();
            dev.synchronize().unwrap();
        })
    });

    // Forward + backward of each layer (grads to input and weight).
    for (c_in, c_out, side) in [(1, 32, 28), (32, 64, 14)] {
        let x = Tensor::randn(&[BATCH, c_in, side, side], 5, &dev)
            .unwrap()
            .requires_grad_(true);
        let w = Tensor::randn(&[c_out, c_in, 3, 3], 6, &dev)
            .unwrap()
            .requires_grad_(true);
        let flops = 3 * 2 * c_out * c_in * 9 * BATCH * side * side;
        group.throughput(Throughput::Elements(flops as u64));
        let name = format!("forward+backward {c_in}->{c_out} {side}x{side}");
        group.bench_function(name, |b| {
            b.iter(|| {
                x.zero_grad();
                w.zero_grad();
                x.conv2d(&w, None, 1, 1)
                    .unwrap()
                    .sum()
                    .unwrap()
                    .backward()
                    .unwrap();
                dev.synchronize().unwrap();
            })
        });
    }
    group.finish();
}

fn cnn_step(c: &mut Criterion) {
    let dev = Device::new().unwrap();
    wgrad::manual_seed(0);
    let model = nn::Sequential::new()
        .add(nn::Conv2d::new(1, 32, 3, 1, 1, &dev).unwrap())
        .add(nn::Relu)
        .add(nn::MaxPool2d::new(2, 2))
        .add(nn::Conv2d::new(32, 64, 3, 1, 1, &dev).unwrap())
        .add(nn::Relu)
        .add(nn::MaxPool2d::new(2, 2))
        .add(nn::Flatten)
        .add(nn::Linear::new(3136, 128, true, &dev).unwrap())
        .add(nn::Relu)
        .add(nn::Linear::new(128, 10, true, &dev).unwrap());
    let mut opt = optim::Adam::new(model.parameters(), optim::AdamConfig::default());
    let x = Tensor::rand(&[BATCH, 1, 28, 28], 7, &dev).unwrap();
    let labels = Tensor::from_labels((0..BATCH as u32).map(|i| i % 10).collect(), &dev).unwrap();
    let mut group = c.benchmark_group("cnn");
    group
        .sample_size(10)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(10));
    group.bench_function("train step batch 64 (Adam)", |b| {
        b.iter(|| {
            opt.zero_grad();
            let loss = nn::loss::cross_entropy(&model.forward(&x).unwrap(), &labels).unwrap();
            loss.backward().unwrap();
            opt.step().unwrap();
            dev.synchronize().unwrap();
        })
    });
    group.finish();
}

fn conv_transpose(c: &mut Criterion) {
    let dev = Device::new().unwrap();
    let mut group = c.benchmark_group("conv_transpose2d");
    group
        .sample_size(10)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(5));
    let batch = 8;
    let make = |shape: &[usize], seed| {
        Tensor::randn(shape, seed, &dev)
            .unwrap()
            .requires_grad_(true)
    };
    let small = make(&[batch, 64, 16, 16], 8);
    let large = make(&[batch, 32, 32, 32], 9);
    // One weight serves both: [64, 32, 3, 3] is conv2d's [C_out, C_in] and conv_transpose2d's
    // [C_in, C_out].
    let w = make(&[64, 32, 3, 3], 10);
    let up = ConvTranspose2dOptions {
        stride: 2,
        padding: 1,
        output_padding: 1,
        ..Default::default()
    };
    group.bench_function("up block 64->32 16x16->32x32 forward+backward", |b| {
        b.iter(|| {
            small.zero_grad();
            w.zero_grad();
            let out = small.conv_transpose2d(&w, None, &up).unwrap();
            out.sum().unwrap().backward().unwrap();
            dev.synchronize().unwrap();
        })
    });
    group.bench_function(
        "conv2d 32->64 32x32->16x16 stride 2 forward+backward",
        |b| {
            b.iter(|| {
                large.zero_grad();
                w.zero_grad();
                let out = large.conv2d(&w, None, 2, 1).unwrap();
                out.sum().unwrap().backward().unwrap();
                dev.synchronize().unwrap();
            })
        },
    );
    group.finish();
}

criterion_group!(benches, conv_layers, cnn_step, conv_transpose);
criterion_main!(benches);
