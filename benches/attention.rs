//! Attention benches on whatever adapter `Device::new()` picks: the fused
//! scaled_dot_product_attention forward + backward at the GPT example's shape (B 12, H 4,
//! T 64, D 32) and at a long one (B 2, H 8, T 1024, D 64), and one training step of the GPT
//! example's configuration (4 pre-norm blocks, 4 heads, width 128, block 64, batch 12, AdamW).
//! Each iteration waits for the device. Before the step bench it prints the step's phases.
//! `sdpa_options` times the options against the plain causal call in the same run: a padding
//! keep-mask (bar: at most 1.2x unmasked) and grouped-query heads, H_kv = H / 4 (bar: not
//! slower than H_kv = H).

use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, Criterion};
use wgrad::nn::{self, Module};
use wgrad::optim::{self, Optimizer};
use wgrad::{Device, SdpaOptions, Tensor};

fn sdpa(c: &mut Criterion) {
    let dev = Device::new().unwrap();
    eprintln!("adapter: {}", dev.info());
    let mut group = c.benchmark_group("sdpa");
    group
        .sample_size(10)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(5));
    for (b, h, t, d) in [(12, 4, 64, 32), (2, 8, 1024, 64)] {
        let shape = [b, h, t, d];
        let q = Tensor::randn(&shape, 1, &dev).unwrap().requires_grad_(true);
        let k = Tensor::randn(&shape, 2, &dev).unwrap().requires_grad_(true);
        let v = Tensor::randn(&shape, 3, &dev).unwrap().requires_grad_(true);
        group.bench_function(
            format!("causal forward+backward B{b} H{h} T{t} D{d}"),
            |bench| {
                bench.iter(|| {
                    for x in [&q, &k, &v] {
                        x.zero_grad();
                    }
                    let out = q.scaled_dot_product_attention(&k, &v, true).unwrap();
                    out.sum().unwrap().backward().unwrap();
                    dev.synchronize().unwrap();
                })
            },
        );
    }
    group.finish();
}

fn sdpa_options(c: &mut Criterion) {
    let dev = Device::new().unwrap();
    let mut group = c.benchmark_group("sdpa options");
    group
        .sample_size(10)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(5));
    let (b, h, t, d) = (2, 8, 256, 64);
    // Batch row 1 padded over its last quarter, as a padded batch of two lengths.
    let keep: Vec<u32> = (0..b * t).map(|i| u32::from(i < t + 3 * t / 4)).collect();
    let keep = Tensor::from_vec_u32(keep, &[b, 1, 1, t], &dev).unwrap();
    for (name, kv_heads, mask) in [
        ("causal", h, None),
        ("causal + padding mask", h, Some(&keep)),
        ("causal, H_kv = H / 4", h / 4, None),
    ] {
        let make = |heads: usize, seed| {
            Tensor::randn(&[b, heads, t, d], seed, &dev)
                .unwrap()
                .requires_grad_(true)
        };
        let (q, k, v) = (make(h, 1), make(kv_heads, 2), make(kv_heads, 3));
        let opts = SdpaOptions {
            causal: true,
            mask,
            scale: None,
        };
        group.bench_function(
            format!("{name} forward+backward B{b} H{h} T{t} D{d}"),
            |bench| {
                bench.iter(|| {
                    for x in [&q, &k, &v] {
                        x.zero_grad();
                    }
                    let out = q.scaled_dot_product_attention_with(&k, &v, &opts).unwrap();
                    out.sum().unwrap().backward().unwrap();
                    dev.synchronize().unwrap();
                })
            },
        );
    }
    group.finish();
}

/// The GPT example's model, without its tokenizer: embeddings, blocks, LayerNorm, head.
struct Gpt {
    token: nn::Embedding,
    position: nn::Embedding,
    blocks: Vec<nn::TransformerBlock>,
    ln_f: nn::LayerNorm,
    head: nn::Linear,
}

impl Gpt {
    fn loss(&self, x: &Tensor, y: &Tensor) -> wgrad::Result<Tensor> {
        let t = x.shape()[1];
        let positions = Tensor::from_vec_u32((0..t as u32).collect(), &[t], x.device())?;
        let mut h = self
            .token
            .forward(x)?
            .add(&self.position.forward(&positions)?)?;
        for block in &self.blocks {
            h = block.forward(&h)?;
        }
        let logits = self.head.forward(&self.ln_f.forward(&h)?)?;
        let vocab = logits.shape()[2];
        nn::loss::cross_entropy(&logits.reshape(&[y.numel(), vocab])?, y)
    }

    fn parameters(&self) -> Vec<Tensor> {
        let mut params = self.token.parameters();
        params.extend(self.position.parameters());
        for block in &self.blocks {
            params.extend(block.parameters());
        }
        params.extend(self.ln_f.parameters());
        params.extend(self.head.parameters());
        params
    }
}

fn gpt_step(c: &mut Criterion) {
    let dev = Device::new().unwrap();
    let (vocab, width, block, batch) = (65, 128, 64, 12);
    wgrad::manual_seed(0);
    let model = Gpt {
        token: nn::Embedding::new(vocab, width, &dev).unwrap(),
        position: nn::Embedding::new(block, width, &dev).unwrap(),
        blocks: (0..4)
            .map(|_| nn::TransformerBlock::new(width, 4, true, 0.0, &dev).unwrap())
            .collect(),
        ln_f: nn::LayerNorm::new(width, 1e-5, &dev).unwrap(),
        head: nn::Linear::new(width, vocab, false, &dev).unwrap(),
    };
    let config = optim::AdamConfig {
        lr: 1e-3,
        weight_decay: 0.1,
        ..Default::default()
    };
    let mut opt = optim::AdamW::new(model.parameters(), config);
    let tokens: Vec<u32> = (0..batch * block).map(|i| (i * 7 % vocab) as u32).collect();
    let x = Tensor::from_vec_u32(tokens.clone(), &[batch, block], &dev).unwrap();
    let y = Tensor::from_vec_u32(tokens, &[batch * block], &dev).unwrap();

    // Phases of one step, each waited for.
    for _ in 0..3 {
        opt.zero_grad();
        dev.synchronize().unwrap();
        let t0 = Instant::now();
        let loss = model.loss(&x, &y).unwrap();
        dev.synchronize().unwrap();
        let t1 = Instant::now();
        loss.backward().unwrap();
        dev.synchronize().unwrap();
        let t2 = Instant::now();
        opt.step().unwrap();
        dev.synchronize().unwrap();
        let t3 = Instant::now();
        let ms = |a: Instant, b: Instant| (b - a).as_secs_f64() * 1e3;
        eprintln!(
            "gpt step phases: forward {:.1} ms, backward {:.1} ms, AdamW {:.1} ms",
            ms(t0, t1),
            ms(t1, t2),
            ms(t2, t3)
        );
    }
    let before = dev.stats();
    opt.zero_grad();
    model.loss(&x, &y).unwrap().backward().unwrap();
    opt.step().unwrap();
    dev.synchronize().unwrap();
    let after = dev.stats();
    eprintln!(
        "gpt step: {} dispatches, {} submits",
        after.dispatches - before.dispatches,
        after.submits - before.submits
    );

    let mut group = c.benchmark_group("gpt");
    group
        .sample_size(10)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(10));
    group.bench_function("train step 4x128 block 64 batch 12 (AdamW)", |b| {
        b.iter(|| {
            opt.zero_grad();
            model.loss(&x, &y).unwrap().backward().unwrap();
            opt.step().unwrap();
            dev.synchronize().unwrap();
        })
    });
    group.finish();
}

criterion_group!(benches, sdpa, sdpa_options, gpt_step);
criterion_main!(benches);
