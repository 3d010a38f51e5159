//! Soak: 10,000 Adam steps of the 784-512-512-10 MLP at batch 128 on whatever adapter
//! `Device::new()` picks, checking that device memory (live + pooled bytes, buffers created)
//! and the process's resident host memory stay flat after warm-up. Not a criterion bench: it
//! prints one line per 1,000 steps and fails (exit code 1) if memory grows.
//!
//! `cargo bench --bench soak` (`WGRAD_SOAK_STEPS=N` for another length).

use std::time::Instant;

use wgrad::nn::{self, Module};
use wgrad::optim::{self, Optimizer};
use wgrad::{Device, Tensor};

/// Resident set size in bytes, from /proc (0 where there is none).
fn resident_bytes() -> u64 {
    std::fs::read_to_string("/proc/self/statm")
        .ok()
        .and_then(|s| {
            s.split_whitespace()
                .nth(1)
                .and_then(|p| p.parse::<u64>().ok())
        })
        .map_or(0, |pages| pages * 4096)
}

fn main() {
    let steps: usize = std::env::var("WGRAD_SOAK_STEPS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(10_000);
    let dev = Device::new().expect("a device");
    println!("adapter: {}", dev.info());
    wgrad::manual_seed(0);
    let model = nn::Sequential::new()
        .add(nn::Linear::new(784, 512, true, &dev).unwrap())
        .add(nn::Relu)
        .add(nn::Linear::new(512, 512, true, &dev).unwrap())
        .add(nn::Relu)
        .add(nn::Linear::new(512, 10, true, &dev).unwrap());
    let mut opt = optim::Adam::new(model.parameters(), optim::AdamConfig::default());
    let labels: Vec<u32> = (0..128).map(|i| i % 10).collect();
    let started = Instant::now();
    let mut warm = None;
    let mut grew = false;
    for step in 1..=steps {
        // A fresh batch each step, as a training loop uploads one.
        let x = Tensor::rand(&[128, 784], step as u64, &dev).unwrap();
        let y = Tensor::from_labels(labels.clone(), &dev).unwrap();
        opt.zero_grad();
        let loss = nn::loss::cross_entropy(&model.forward(&x).unwrap(), &y).unwrap();
        loss.backward().unwrap();
        opt.step().unwrap();
        if step % 1000 == 0 || step == 100 {
            let value = loss.item().unwrap();
            let stats = dev.stats();
            let device_bytes = stats.live_bytes + stats.pooled_bytes;
            let host = resident_bytes();
            println!(
                "step {step}: loss {value:.4}, device {:.1} MiB ({} buffers created), host {:.1} MiB, {:.1} ms/step",
                device_bytes as f64 / (1 << 20) as f64,
                stats.buffers_created,
                host as f64 / (1 << 20) as f64,
                started.elapsed().as_secs_f64() * 1e3 / step as f64
            );
            match warm {
                None => warm = Some((device_bytes, stats.buffers_created, host)),
                Some((device0, created0, host0)) => {
                    // Device memory and buffer count exactly flat; host within 16 MiB.
                    if device_bytes != device0
                        || stats.buffers_created != created0
                        || host > host0 + (16 << 20)
                    {
                        grew = true;
                    }
                }
            }
        }
    }
    if grew {
        eprintln!("soak: memory grew after warm-up");
        std::process::exit(1);
    }
    println!("soak: {steps} steps, memory flat after step 100");
}
