//! Decoding speed on whatever adapter `Device::new()` picks: `Llama::generate` of the llama
//! example's default config (`LlamaConfig::small`, 256 positions), greedy. The time per new
//! token at position 10 and at position 200: a prompt of that many tokens, then what
//! `generate(.., 11)` takes beyond `generate(.., 1)` (both prefill the prompt and make a first
//! token), over ten. The KV cache keeps it flat (bar: position 200 at most 1.5x position 10),
//! where recomputing the prefix would make it grow with the position.

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
    let mut group = c.benchmark_group("generate per token");
    group
        .sample_size(10)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(10));
    for first in [10, 200] {
        let prompt = Tensor::from_vec_u32(
            (0..first as u32).map(|i| 1 + i % 500).collect(),
            &[1, first],
            &dev,
        )
        .unwrap();
        group.bench_function(format!("token at position {first}"), |bench| {
            bench.iter_custom(|iters| {
                let mut total = Duration::ZERO;
                for _ in 0..iters {
                    let one = generate_time(&model, &prompt, 1);
                    let eleven = generate_time(&model, &prompt, 11);
                    // Per token: the ten tokens' time beyond the prefill and the first token.
                    total += eleven.saturating_sub(one).max(Duration::from_nanos(1)) / 10;
                }
                total
            })
        });
    }
    group.finish();
}

criterion_group!(benches, per_token);
criterion_main!(benches);
