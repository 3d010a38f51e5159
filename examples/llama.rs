//! A Llama-style language model: `cargo run --release --example llama -- --data data/shakespeare.txt`.
//!
//! From scratch, it trains a byte-level BPE tokenizer on the text (Hugging Face's `tokenizers`)
//! and a small Llama (RMSNorm, rotary positions, SwiGLU, grouped-query attention: the
//! transformers architecture, `wgrad::models::Llama`); `--init-from DIR` fine-tunes a Hugging
//! Face checkpoint directory instead, with its `tokenizer.json`. Trains with AdamW (weight decay
//! on matrices only) and a cosine schedule, reports train and validation loss every
//! `--eval-interval` steps, prints a sample (generated with the KV cache) at the end, can save
//! the result with `--save-pretrained DIR` for transformers, and ends with one line:
//! `final: val_loss=... train_loss=... steps=... tokens_per_s=... val_loss_per_char=...`
//! (losses per token; the last figure per character, comparable with gpt.rs's).
//!
//! The defaults mirror gpt.rs's nanoGPT configuration (4 layers, 4 heads, width 128, block 64,
//! batch 12, 2,000 iterations, lr 1e-3), with 2 key/value heads and a 512-token vocabulary.

#[path = "support/lm.rs"]
mod lm;
#[path = "support/plot.rs"]
mod plot;
#[path = "support/precision.rs"]
mod precision;

use std::path::{Path, PathBuf};
use std::time::Instant;

use clap::Parser;
use lm::{say, LmArgs};
use tokenizers::models::bpe::{BpeTrainerBuilder, BPE};
use tokenizers::models::TrainerWrapper;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::{
    AddedToken, DecoderWrapper, ModelWrapper, NormalizerWrapper, PostProcessorWrapper,
    PreTokenizerWrapper, Tokenizer, TokenizerBuilder,
};
use wgrad::dist::Dist;
use wgrad::models::{Llama, LlamaConfig, Sampling};
use wgrad::nn::Module;
use wgrad::{Device, Tensor};

/// Train a Llama-style language model with wgrad.
#[derive(Parser, Debug)]
#[command(version, about)]
struct Args {
    #[command(flatten)]
    lm: LmArgs,
    /// Decoder layers (from scratch).
    #[arg(long, default_value_t = 4)]
    layers: usize,
    /// Query heads per layer (from scratch).
    #[arg(long, default_value_t = 4)]
    heads: usize,
    /// Key/value heads per layer, a divisor of --heads (from scratch).
    #[arg(long, default_value_t = 2)]
    kv_heads: usize,
    /// Width of the residual stream, a multiple of --heads (from scratch).
    #[arg(long, default_value_t = 128)]
    width: usize,
    /// Tokens of the byte-level BPE trained on the text (from scratch; at least 257).
    #[arg(long, default_value_t = 512)]
    vocab_size: usize,
    /// A Hugging Face checkpoint directory (config.json, model.safetensors, tokenizer.json) to
    /// fine-tune instead of training from scratch.
    #[arg(long)]
    init_from: Option<PathBuf>,
    /// Save the trained model and its tokenizer here as a Hugging Face checkpoint.
    #[arg(long)]
    save_pretrained: Option<PathBuf>,
    /// Sampling temperature for the sample at the end (0: greedy).
    #[arg(long, default_value_t = 0.8)]
    temperature: f32,
    /// Sample among this many most likely tokens.
    #[arg(long, default_value_t = 40)]
    top_k: usize,
    /// Then among the most likely whose probabilities add up to this (nucleus sampling; 1: all).
    #[arg(long, default_value_t = 1.0, value_parser = probability_mass)]
    top_p: f32,
}

/// `--top-p`'s value: a probability mass in (0, 1], checked before any training starts.
fn probability_mass(arg: &str) -> Result<f32, String> {
    let p: f32 = arg.parse().map_err(|e| format!("{e}"))?;
    if p > 0.0 && p <= 1.0 {
        Ok(p)
    } else {
        Err(format!("must be in (0, 1], got {p}"))
    }
}

/// A byte-level BPE of `vocab_size` tokens trained on the file `text` (GPT-2's pre-tokenizer
/// and decoder, one `<|endoftext|>` special token).
fn train_tokenizer(text: &Path, vocab_size: usize) -> Result<Tokenizer, String> {
    let mut trainer: TrainerWrapper = BpeTrainerBuilder::new()
        .show_progress(false)
        .vocab_size(vocab_size)
        .min_frequency(2)
        .initial_alphabet(ByteLevel::alphabet().into_iter().collect())
        .special_tokens(vec![AddedToken::from("<|endoftext|>", true)])
        .build()
        .into();
    let byte_level = ByteLevel::new(false, true, true);
    let mut tokenizer = TokenizerBuilder::<
        ModelWrapper,
        NormalizerWrapper,
        PreTokenizerWrapper,
        PostProcessorWrapper,
        DecoderWrapper,
    >::new()
    .with_model(BPE::default().into())
    .with_normalizer(None)
    .with_pre_tokenizer(Some(byte_level.into()))
    .with_post_processor(Some(byte_level.into()))
    .with_decoder(Some(byte_level.into()))
    .build()
    .map_err(|e| format!("building the tokenizer: {e}"))?;
    let file = text.display().to_string();
    tokenizer
        .train_from_files(&mut trainer, vec![file])
        .map_err(|e| format!("training the tokenizer on {}: {e}", text.display()))?;
    Ok(Tokenizer::from(tokenizer))
}

/// The text as token ids, encoded a line at a time (as the tokenizer was trained).
fn encode(tokenizer: &Tokenizer, text: &str) -> Result<Vec<u32>, String> {
    let lines: Vec<&str> = text.split_inclusive('\n').collect();
    let encodings = tokenizer
        .encode_batch(lines, false)
        .map_err(|e| format!("encoding the text: {e}"))?;
    Ok(encodings
        .iter()
        .flat_map(|e| e.get_ids().iter().copied())
        .collect())
}

/// `len` tokens sampled after `start`, in windows of the model's positions: each window
/// starts from the last half of the text so far, and generates with the KV cache.
fn sample(
    model: &Llama,
    start: &[u32],
    len: usize,
    sampling: Sampling,
    dev: &Device,
) -> wgrad::Result<Vec<u32>> {
    let window = model.config.max_position_embeddings;
    let mut tokens = start.to_vec();
    let mut round = 0;
    while tokens.len() < start.len() + len {
        let context = &tokens[tokens.len().saturating_sub(window / 2)..];
        let n = (window - context.len()).min(start.len() + len - tokens.len());
        let prompt = Tensor::from_vec_u32(context.to_vec(), &[1, context.len()], dev)?;
        let seeded = Sampling {
            seed: sampling.seed + round,
            ..sampling
        };
        let out = model.generate(&prompt, n, &seeded)?.to_vec_u32()?;
        tokens.extend_from_slice(&out[context.len()..]);
        round += 1;
    }
    Ok(tokens[start.len()..].to_vec())
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
    let fail = |e: wgrad::Error| e.to_string();
    let text = args.lm.text()?;
    let dist = &Dist::init().map_err(fail)?;
    let dev = Device::new().map_err(fail)?;
    say(dist, format!("adapter: {}", dev.info()));
    wgrad::manual_seed(args.lm.seed);
    let (model, tokenizer) = match &args.init_from {
        Some(dir) => {
            let model = Llama::from_pretrained(dir, &dev).map_err(fail)?;
            let path = dir.join("tokenizer.json");
            let tokenizer = Tokenizer::from_file(&path)
                .map_err(|e| format!("reading {}: {e}", path.display()))?;
            say(dist, format!("loaded: {}", dir.display()));
            (model, tokenizer)
        }
        None => {
            if args.vocab_size <= 256 {
                return Err("--vocab-size must be above 256 (the byte alphabet)".into());
            }
            if args.heads == 0 || !args.width.is_multiple_of(args.heads) {
                return Err(format!(
                    "--width ({}) must be a multiple of --heads ({})",
                    args.width, args.heads
                ));
            }
            // The tokenizer trains on a file: the text itself, or the generated corpus
            // written out.
            let scratch =
                std::env::temp_dir().join(format!("wgrad-llama-{}.txt", std::process::id()));
            let source = match &args.lm.data {
                Some(path) => path.clone(),
                None => {
                    std::fs::write(&scratch, &text).map_err(|e| e.to_string())?;
                    scratch.clone()
                }
            };
            let tokenizer = train_tokenizer(&source, args.vocab_size)?;
            let _ = std::fs::remove_file(&scratch);
            let mut config = LlamaConfig::small(tokenizer.get_vocab_size(true));
            config.hidden_size = args.width;
            config.num_hidden_layers = args.layers;
            config.num_attention_heads = args.heads;
            config.num_key_value_heads = args.kv_heads;
            config.head_dim = args.width / args.heads;
            // SwiGLU's three matrices at 8/3 of the width hold what a 4x GELU MLP holds.
            config.intermediate_size = (args.width * 8 / 3).next_multiple_of(8);
            config.max_position_embeddings = args.lm.block as usize;
            (Llama::new(config, &dev).map_err(fail)?, tokenizer)
        }
    };
    let block = args.lm.block as usize;
    if block > model.config.max_position_embeddings {
        return Err(format!(
            "--block {block} is longer than the model's {} positions",
            model.config.max_position_embeddings
        ));
    }
    let ids = encode(&tokenizer, &text)?;
    let split_char = text.len() * 9 / 10;
    let split = ids.len() * 9 / 10;
    let (train, val) = ids.split_at(split);
    let chars_per_token = text.chars().count() as f64 / ids.len().max(1) as f64;
    say(
        dist,
        format!(
            "data: {}: {} train / {} validation tokens ({chars_per_token:.2} characters each, \
             {} bytes before the split), vocabulary {}",
            args.lm.source(),
            train.len(),
            val.len(),
            split_char,
            model.config.vocab_size
        ),
    );
    let c = &model.config;
    let count: usize = model.parameters().iter().map(|p| p.numel()).sum();
    say(
        dist,
        format!(
            "model: {} layers, {} heads ({} key/value), width {}, MLP {}, {count} parameters",
            c.num_hidden_layers,
            c.num_attention_heads,
            c.num_key_value_heads,
            c.hidden_size,
            c.intermediate_size
        ),
    );
    let run = lm::train(&model, (train, val), &args.lm, dist, &dev, process_start)?;
    if let (Some(dir), true) = (&args.save_pretrained, dist.is_root()) {
        model.save_pretrained(dir).map_err(fail)?;
        let path = dir.join("tokenizer.json");
        tokenizer
            .save(&path, true)
            .map_err(|e| format!("writing {}: {e}", path.display()))?;
        say(
            dist,
            format!("saved: {} (model and tokenizer)", dir.display()),
        );
    }
    let sampling = Sampling {
        temperature: args.temperature,
        top_k: Some(args.top_k.max(1)),
        top_p: Some(args.top_p),
        seed: args.lm.seed + 1,
    };
    let start = &val[..1];
    let sampled = sample(&model, start, args.lm.sample_len, sampling, &dev).map_err(fail)?;
    let words = tokenizer
        .decode(&sampled, true)
        .map_err(|e| format!("decoding the sample: {e}"))?;
    say(dist, format!("sample:\n{words}\n"));
    say(
        dist,
        format!(
            "final: val_loss={:.4} train_loss={:.4} steps={} tokens_per_s={:.1} \
             val_loss_per_char={:.4}",
            run.val_loss,
            run.train_loss,
            args.lm.iters,
            run.tokens_per_s,
            run.val_loss as f64 / chars_per_token
        ),
    );
    Ok(())
}
