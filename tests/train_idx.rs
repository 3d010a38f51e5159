//! End to end: write a small MNIST-format dataset (plain and gzip), read it with the IDX
//! reader, train an MLP on it with Adam, and check the test accuracy, as the example does.

mod common;
use common::*;
use rand::{Rng, SeedableRng};
use std::io::Write;
use std::path::Path;
use wgrad::nn::{self, Module};
use wgrad::optim::{self, Optimizer};
use wgrad::{io, Tensor};

const SIDE: usize = 6;
const CLASSES: usize = 3;

/// `n` noisy 6x6 images: class c lights up rows 2c and 2c + 1.
fn images(n: usize, seed: u64) -> (Vec<u8>, Vec<u8>) {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut pixels = Vec::new();
    let mut labels = Vec::new();
    for _ in 0..n {
        let class = rng.random_range(0..CLASSES);
        for row in 0..SIDE {
            for _ in 0..SIDE {
                let lit = row / 2 == class;
                let base: u8 = if lit { 180 } else { 40 };
                pixels.push(base.saturating_add(rng.random_range(0..60)));
            }
        }
        labels.push(class as u8);
    }
    (pixels, labels)
}

fn write(path: &Path, header: &[u32], payload: &[u8], gzip: bool) {
    let mut bytes: Vec<u8> = header.iter().flat_map(|v| v.to_be_bytes()).collect();
    bytes.extend_from_slice(payload);
    if gzip {
        let mut enc = flate2::write::GzEncoder::new(
            std::fs::File::create(path).unwrap(),
            flate2::Compression::default(),
        );
        enc.write_all(&bytes).unwrap();
        enc.finish().unwrap();
    } else {
        std::fs::write(path, bytes).unwrap();
    }
}

fn write_dataset(dir: &Path, gzip: bool) {
    let suffix = if gzip { ".gz" } else { "" };
    for (prefix, n, seed) in [("train", 300, 1), ("t10k", 90, 2)] {
        let (pixels, labels) = images(n, seed);
        let side = SIDE as u32;
        write(
            &dir.join(format!("{prefix}-images-idx3-ubyte{suffix}")),
            &[0x803, n as u32, side, side],
            &pixels,
            gzip,
        );
        write(
            &dir.join(format!("{prefix}-labels-idx1-ubyte{suffix}")),
            &[0x801, n as u32],
            &labels,
            gzip,
        );
    }
}

fn train_and_test(dir: &Path) -> f32 {
    let dev = device();
    let (train, test) = io::load_idx_dir(dir).unwrap();
    assert_eq!(
        (train.len(), test.len(), train.features, train.classes),
        (300, 90, SIDE * SIDE, CLASSES)
    );
    let model = nn::Sequential::new()
        .add(nn::Linear::new(train.features, 32, true, dev).unwrap())
        .add(nn::Relu)
        .add(nn::Linear::new(32, train.classes, true, dev).unwrap());
    let mut opt = optim::Adam::new(
        model.parameters(),
        optim::AdamConfig {
            lr: 1e-2,
            ..Default::default()
        },
    );
    let order: Vec<usize> = (0..train.len()).collect();
    for _epoch in 0..8 {
        for chunk in order.chunks(32) {
            let (inputs, labels) = train.batch(chunk);
            let x = Tensor::from_vec(inputs, &[chunk.len(), train.features], dev).unwrap();
            let y = Tensor::from_labels(labels, dev).unwrap();
            opt.zero_grad();
            nn::loss::cross_entropy(&model.forward(&x).unwrap(), &y)
                .unwrap()
                .backward()
                .unwrap();
            opt.step().unwrap();
        }
    }
    let all: Vec<usize> = (0..test.len()).collect();
    let (inputs, labels) = test.batch(&all);
    let x = Tensor::from_vec(inputs, &[test.len(), test.features], dev).unwrap();
    let predicted = wgrad::no_grad(|| model.forward(&x))
        .unwrap()
        .argmax(1, false)
        .unwrap()
        .to_vec_u32()
        .unwrap();
    predicted
        .iter()
        .zip(&labels)
        .filter(|(p, l)| p == l)
        .count() as f32
        / test.len() as f32
}

#[test]
fn an_mlp_learns_from_plain_idx_files() {
    let dir = tempfile::tempdir().unwrap();
    write_dataset(dir.path(), false);
    let acc = train_and_test(dir.path());
    assert!(acc >= 0.95, "test accuracy {acc}");
}

#[test]
fn an_mlp_learns_from_gzipped_idx_files() {
    let dir = tempfile::tempdir().unwrap();
    write_dataset(dir.path(), true);
    let acc = train_and_test(dir.path());
    assert!(acc >= 0.95, "test accuracy {acc}");
}
