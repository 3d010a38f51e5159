//! A character-level GPT: `cargo run --release --example gpt -- --data data/shakespeare.txt`.
//!
//! Token and position embeddings, `--layers` pre-norm transformer blocks (causal multi-head
//! attention on wgrad's fused kernel, GELU MLP), a final LayerNorm and a head to the vocabulary
//! (tied to the token embedding with `--tied`). Trains with AdamW (weight decay on matrices
//! only) and a cosine schedule, reports train and validation loss every `--eval-interval`
//! steps, prints a sample at the end, and ends with one line:
//! `final: val_loss=... train_loss=... steps=... tokens_per_s=...`.
//!
//! The defaults are nanoGPT's small CPU configuration (4 layers, 4 heads, width 128, block 64,
//! batch 12, 2,000 iterations, lr 1e-3, no dropout). `tools/fetch_shakespeare.sh` writes
//! Shakespeare's plays to `data/shakespeare.txt`; without `--data` the model trains on a
//! generated corpus.

#[path = "support/lm.rs"]
mod lm;
#[path = "support/plot.rs"]
mod plot;
#[path = "support/precision.rs"]
mod precision;

use std::path::PathBuf;
use std::time::Instant;

use clap::Parser;
use lm::{say, LmArgs};
use rand::{Rng, SeedableRng};
use wgrad::dist::Dist;
use wgrad::nn::{self, Module};
use wgrad::{io, Device, Result, Tensor};

/// Train a character-level GPT with wgrad.
#[derive(Parser, Debug)]
#[command(version, about)]
struct Args {
    #[command(flatten)]
    lm: LmArgs,
    /// Transformer blocks.
    #[arg(long, default_value_t = 4)]
    layers: usize,
    /// Attention heads per block.
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u64).range(1..))]
    heads: u64,
    /// Embedding width (a multiple of --heads).
    #[arg(long, default_value_t = 128, value_parser = clap::value_parser!(u64).range(1..))]
    width: u64,
    /// Dropout probability after attention and MLP.
    #[arg(long, default_value_t = 0.0)]
    dropout: f32,
    /// Share the token embedding with the output head.
    #[arg(long)]
    tied: bool,
    /// Start from this safetensors checkpoint (of the same configuration and text).
    #[arg(long)]
    load: Option<PathBuf>,
    /// Save the trained model as a safetensors checkpoint here.
    #[arg(long)]
    save: Option<PathBuf>,
}

/// The GPT: embeddings, blocks, final LayerNorm, head.
#[derive(Module)]
struct Gpt {
    token: nn::Embedding,
    position: nn::Embedding,
    blocks: Vec<nn::TransformerBlock>,
    ln_f: nn::LayerNorm,
    /// `None` when tied to the token embedding.
    head: Option<nn::Linear>,
}

impl Gpt {
    fn new(vocab: usize, args: &Args, dev: &Device) -> Result<Gpt> {
        let width = args.width as usize;
        let blocks = (0..args.layers)
            .map(|_| nn::TransformerBlock::new(width, args.heads as usize, true, args.dropout, dev))
            .collect::<Result<Vec<_>>>()?;
        Ok(Gpt {
            token: nn::Embedding::new(vocab, width, dev)?,
            position: nn::Embedding::new(args.lm.block as usize, width, dev)?,
            blocks,
            ln_f: nn::LayerNorm::new(width, 1e-5, dev)?,
            head: match args.tied {
                true => None,
                false => Some(nn::Linear::new(width, vocab, false, dev)?),
            },
        })
    }

    /// u32 tokens `[B, T]` -> logits `[B, T, vocab]`.
    fn forward(&self, tokens: &Tensor) -> Result<Tensor> {
        let t = tokens.shape()[1];
        let positions = Tensor::from_vec_u32((0..t as u32).collect(), &[t], tokens.device())?;
        let mut x = self
            .token
            .forward(tokens)?
            .add(&self.position.forward(&positions)?)?;
        for block in &self.blocks {
            x = block.forward(&x)?;
        }
        let x = self.ln_f.forward(&x)?;
        match &self.head {
            Some(head) => head.forward(&x),
            None => x.matmul(&self.token.weight.t()?),
        }
    }
}

/// A text as character ids, with its vocabulary.
struct Corpus {
    chars: Vec<char>,
    ids: Vec<u32>,
}

impl Corpus {
    fn new(text: &str) -> Corpus {
        let mut chars: Vec<char> = text.chars().collect();
        chars.sort_unstable();
        chars.dedup();
        let ids = text
            .chars()
            .map(|c| chars.binary_search(&c).expect("in the vocabulary") as u32)
            .collect();
        Corpus { chars, ids }
    }
}

/// `len` characters sampled from the model, starting after a newline.
fn sample(model: &Gpt, corpus: &Corpus, args: &LmArgs, dev: &Device) -> Result<String> {
    model.eval();
    let _no_grad = wgrad::autograd::NoGradGuard::new();
    let mut rng = rand::rngs::StdRng::seed_from_u64(args.seed + 1);
    let mut ids = vec![corpus.chars.binary_search(&'\n').unwrap_or(0) as u32];
    let mut out = String::new();
    for _ in 0..args.sample_len {
        let context = &ids[ids.len().saturating_sub(args.block as usize)..];
        let x = Tensor::from_vec_u32(context.to_vec(), &[1, context.len()], dev)?;
        let logits = model.forward(&x)?.narrow(1, context.len() - 1, 1)?;
        let vocab = logits.numel();
        let probs = logits
            .reshape(&[vocab])?
            .narrow(0, 0, corpus.chars.len())?
            .softmax(0)?
            .to_vec()?;
        let mut u: f32 = rng.random();
        let mut next = probs.len() - 1;
        for (i, p) in probs.iter().enumerate() {
            if u < *p {
                next = i;
                break;
            }
            u -= p;
        }
        ids.push(next as u32);
        out.push(corpus.chars[next]);
    }
    Ok(out)
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
    if !args.width.is_multiple_of(args.heads) {
        return Err(format!(
            "--width ({}) must be a multiple of --heads ({})",
            args.width, args.heads
        ));
    }
    let corpus = Corpus::new(&args.lm.text()?);
    let split = corpus.ids.len() * 9 / 10;
    let (train, val) = corpus.ids.split_at(split);
    let dist = &Dist::init().map_err(|e| e.to_string())?;
    let dev = Device::new().map_err(|e| e.to_string())?;
    say(dist, format!("adapter: {}", dev.info()));
    if dist.size() > 1 {
        say(dist, format!("data-parallel: {} ranks", dist.size()));
    }
    say(
        dist,
        format!(
            "data: {}: {} train / {} validation characters, vocabulary {} (model rows {})",
            args.lm.source(),
            train.len(),
            val.len(),
            corpus.chars.len(),
            corpus.chars.len().next_multiple_of(4)
        ),
    );

    wgrad::manual_seed(args.lm.seed);
    // The table and the head are rounded up to a multiple of 4 rows (never a target), as
    // nanoGPT rounds GPT-2's 50,257 to 50,304: the logits' matmuls then take the aligned
    // kernels, and no kernel is compiled only for an odd width.
    let vocab = corpus.chars.len().next_multiple_of(4);
    let fail = |e: wgrad::Error| e.to_string();
    let model = Gpt::new(vocab, args, &dev).map_err(fail)?;
    if let Some(path) = &args.load {
        io::load(path, &model).map_err(fail)?;
        say(dist, format!("loaded: {}", path.display()));
    }
    let count: usize = model.parameters().iter().map(|p| p.numel()).sum();
    say(
        dist,
        format!(
            "model: {} layers, {} heads, width {}, {count} parameters",
            args.layers, args.heads, args.width
        ),
    );
    let run = lm::train(&model, (train, val), &args.lm, dist, &dev, process_start)?;
    if let Some(path) = &args.save {
        dist.save(path, &model).map_err(fail)?;
        say(dist, format!("saved: {}", path.display()));
    }
    let text = sample(&model, &corpus, &args.lm, &dev).map_err(fail)?;
    say(dist, format!("sample:\n{text}\n"));
    say(
        dist,
        format!(
            "final: val_loss={:.4} train_loss={:.4} steps={} tokens_per_s={:.1}",
            run.val_loss, run.train_loss, args.lm.iters, run.tokens_per_s
        ),
    );
    Ok(())
}
