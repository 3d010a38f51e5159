//! What a user runs first: `cargo run --release --example train`.
//!
//! Until nn and optim land this is a forward-only demo, and says so: it builds a 784-512-512-10
//! MLP with random weights, runs its forward pass and cross-entropy on a synthetic batch on the
//! best adapter, and reports timings. It does not train.

use std::time::Instant;

use wgrad::{nn, Device, Result, Tensor};

fn main() {
    if let Err(e) = run() {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}

fn run() -> Result<()> {
    let start = Instant::now();
    let dev = Device::new()?;
    println!("adapter: {}", dev.info());

    let (batch, sizes) = (128, [784, 512, 512, 10]);
    let x = Tensor::rand(&[batch, sizes[0]], 0, &dev)?;
    let labels = Tensor::from_labels((0..batch as u32).map(|i| i % 10).collect(), &dev)?;
    let first = x
        .matmul(&Tensor::randn(&[sizes[0], 8], 1, &dev)?)?
        .sum()?
        .item()?;
    println!(
        "first matmul done {:.3} s after start (checksum {first:.3})",
        start.elapsed().as_secs_f64()
    );

    // Kaiming-uniform weights, stored [out, in] as nn::Linear will store them.
    let mut layers = Vec::new();
    for (i, pair) in sizes.windows(2).enumerate() {
        let bound = (1.0 / pair[0] as f32).sqrt();
        let w = Tensor::rand(&[pair[1], pair[0]], 10 + i as u64, &dev)?
            .mul_scalar(2.0 * bound)?
            .sub_scalar(bound)?;
        let b = Tensor::zeros(&[pair[1]], &dev)?;
        layers.push((w, b));
    }
    let forward = |x: &Tensor| -> Result<Tensor> {
        let mut h = x.clone();
        for (i, (w, b)) in layers.iter().enumerate() {
            h = h.matmul(&w.t()?)?.add(b)?;
            if i + 1 < layers.len() {
                h = h.relu()?;
            }
        }
        Ok(h)
    };

    let logits = forward(&x)?;
    let loss = nn::loss::cross_entropy(&logits, &labels)?.item()?;
    println!("untrained loss {loss:.4} (ln 10 = {:.4})", 10f32.ln());

    let iters = 20;
    dev.synchronize()?;
    let timer = Instant::now();
    for _ in 0..iters {
        nn::loss::cross_entropy(&forward(&x)?, &labels)?;
    }
    dev.synchronize()?;
    let per_step = timer.elapsed().as_secs_f64() / iters as f64;
    let stats = dev.stats();
    println!(
        "forward + loss: {:.2} ms/batch of {batch} ({:.0} samples/s); {} submits, {} dispatches in all",
        per_step * 1e3,
        batch as f64 / per_step,
        stats.submits,
        stats.dispatches
    );
    println!("this demo runs the forward pass only; training arrives with nn and optim");
    Ok(())
}
