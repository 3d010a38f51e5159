//! What a user runs first: `cargo run --release --example train`.
//!
//! Trains an MLP classifier on MNIST-format IDX files (`--data DIR`) or, with no arguments, on
//! a built-in synthetic set (four interleaved spirals, which no linear model separates). Shows
//! a progress bar with the loss and samples/s, evaluates on the test split every epoch, and
//! ends with one line: `final: test_acc=... train_loss=... steps=... samples_per_s=...`.

mod support;

use std::time::Instant;

use clap::Parser;
use support::TrainArgs;
use wgrad::dist::Dist;
use wgrad::{io, nn, Device};

/// Train an MLP classifier with wgrad.
#[derive(Parser, Debug)]
#[command(version, about)]
struct Args {
    #[command(flatten)]
    train: TrainArgs,
    /// Width of the two hidden layers.
    #[arg(long, default_value_t = 128)]
    hidden: usize,
}

fn main() {
    let process_start = Instant::now();
    let args = Args::parse();
    if let Err(message) = run(&args, process_start) {
        eprintln!("error: {message}");
        std::process::exit(1);
    }
}

fn run(args: &Args, process_start: Instant) -> Result<(), String> {
    let recipe = args.train.recipe(&support::Recipe::ADAM)?;
    if args.hidden == 0 {
        return Err("--hidden must be at least 1".into());
    }
    let dist = Dist::init().map_err(|e| e.to_string())?;
    let dev = Device::new().map_err(|e| e.to_string())?;
    support::say(&dist, format!("adapter: {}", dev.info()));
    if dist.size() > 1 {
        support::say(&dist, format!("data-parallel: {} ranks", dist.size()));
    }
    let (train, test) = args.train.dataset(
        &dist,
        |seed| io::synthetic_spirals(4, 8000, 2000, seed),
        "synthetic spirals",
    )?;
    wgrad::manual_seed(args.train.seed);
    let linear = |i, o| nn::Linear::new(i, o, true, &dev).map_err(|e| e.to_string());
    let model = nn::Sequential::new()
        .add(linear(train.features, args.hidden)?)
        .add(nn::Relu)
        .add(linear(args.hidden, args.hidden)?)
        .add(nn::Relu)
        .add(linear(args.hidden, train.classes)?);
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
