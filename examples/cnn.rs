//! A small convolutional classifier: `cargo run --release --example cnn`.
//!
//! conv 1->32 3x3 (padding 1), ReLU, 2x2 max pool, conv 32->64 3x3 (padding 1), ReLU, 2x2 max
//! pool, then Linear -> 128 -> ReLU -> classes. Trains on MNIST-format IDX files (`--data DIR`,
//! e.g. Fashion-MNIST from Debian's `dataset-fashion-mnist` package in
//! `/usr/share/datasets/fashion-mnist`) or, with no arguments, on a built-in synthetic image
//! set (bars, squares and crosses). Ends with one line:
//! `final: test_acc=... train_loss=... steps=... samples_per_s=...`.

mod support;

use std::time::Instant;

use clap::Parser;
use support::TrainArgs;
use wgrad::dist::Dist;
use wgrad::nn::{self, Module};
use wgrad::{io, Device, Result, Tensor};

/// Train a small CNN classifier with wgrad.
#[derive(Parser, Debug)]
#[command(version, about)]
struct Args {
    #[command(flatten)]
    train: TrainArgs,
}

/// The CNN, taking rows of `side * side` pixels as the data sets hold them.
#[derive(Module)]
struct Cnn {
    #[module(skip)]
    side: usize,
    #[module(flatten)]
    layers: nn::Sequential,
}

impl Cnn {
    fn new(side: usize, classes: usize, dev: &Device) -> Result<Cnn> {
        let pooled = side / 4;
        let layers = nn::Sequential::new()
            .add(nn::Conv2d::new(1, 32, 3, 1, 1, dev)?)
            .add(nn::Relu)
            .add(nn::MaxPool2d::new(2, 2))
            .add(nn::Conv2d::new(32, 64, 3, 1, 1, dev)?)
            .add(nn::Relu)
            .add(nn::MaxPool2d::new(2, 2))
            .add(nn::Flatten)
            .add(nn::Linear::new(64 * pooled * pooled, 128, true, dev)?)
            .add(nn::Relu)
            .add(nn::Linear::new(128, classes, true, dev)?);
        Ok(Cnn { side, layers })
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let images = x.reshape(&[x.shape()[0], 1, self.side, self.side])?;
        self.layers.forward(&images)
    }
}

fn main() {
    let process_start = Instant::now();
    let args = Args::parse();
    if let Err(message) = run(&args, process_start) {
        eprintln!("error: {message}");
        std::process::exit(1);
    }
}

fn run(args: &Args, process_start: Instant) -> std::result::Result<(), String> {
    let recipe = args.train.recipe(&support::Recipe::ADAM)?;
    let dist = Dist::init().map_err(|e| e.to_string())?;
    let dev = Device::new().map_err(|e| e.to_string())?;
    support::say(&dist, format!("adapter: {}", dev.info()));
    if dist.size() > 1 {
        support::say(&dist, format!("data-parallel: {} ranks", dist.size()));
    }
    let (train, test) = args.train.dataset(
        &dist,
        |seed| io::synthetic_shapes(2000, 1000, seed),
        "synthetic shapes",
    )?;
    let side = (train.features as f64).sqrt().round() as usize;
    if side * side != train.features || side < 4 {
        return Err(format!(
            "the CNN needs square images of at least 4x4, got {} pixels",
            train.features
        ));
    }
    wgrad::manual_seed(args.train.seed);
    let model = Cnn::new(side, train.classes, &dev).map_err(|e| e.to_string())?;
    support::fit(
        &model,
        (train, &test),
        &dev,
        &args.train,
        &recipe,
        &dist,
        process_start,
    )
}
