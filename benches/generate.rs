//! Decoding speed on whatever adapter `Device::new()` picks: `Llama::generate` of the llama
//! example's default config (`LlamaConfig::small`, 256 positions), greedy, from a one-token
//! prompt. The time of new tokens 10 to 20 and of new tokens 200 to 210 is what
//! `generate(.., 20)` takes beyond `generate(.., 10)`, and `generate(.., 210)` beyond
//! `generate(.., 200)`: the KV cache keeps it flat (bar: the later at most 1.5x the earlier),
//! where recomputing the prefix would make token 200 some 20x token 10.

use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, Criterion};
use wgrad::models::{Llama, LlamaConfig, Sampling};
use wgrad::{manual_seed, Device, Tensor};

/// Seconds `model.generate(prompt, tokens)` takes, the tokens read back.
fn generate_time(model: &Llama, prompt: &Tensor, tokens: usize) -> Duration {
    let started = Instant::now();
    let out = model.generate(prompt, tokens, &Sampling::greedy()).unwrap();
    out.to_vec_u32().unwrap();
    started.elapsed()
}

fn per_token(c: &mut Criterion) {
    let dev = Device::new().unwrap();
    eprintln!("adapter: {}", dev.info());
    manual_seed(0);
    let model = Llama::new(LlamaConfig::small(512), &dev).unwrap();
    let prompt = Tensor::from_vec_u32(vec![1], &[1, 1], &dev).unwrap();
    let mut group = c.benchmark_group("generate per token");
    group
        .sample_size(10)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(10));
    for first in [10, 200] {
        group.bench_function(format!("tokens {first} to {}", first + 10), |bench| {
            bench.iter_custom(|iters| {
                let mut total = Duration::ZERO;
                for _ in 0..iters {
                    let before = generate_time(&model, &prompt, first);
                    let after = generate_time(&model, &prompt, first + 10);
                    // Per token: the ten tokens' time beyond the shorter run's.
                    total += after.saturating_sub(before) / 10;
                }
                total
            })
        });
    }
    group.finish();
}

criterion_group!(benches, per_token);
criterion_main!(benches);
