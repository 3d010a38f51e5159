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

#[path = "support/plot.rs"]
mod plot;

use std::cell::RefCell;
use std::path::PathBuf;
use std::time::Instant;

use clap::Parser;
use indicatif::{ProgressBar, ProgressStyle};
use rand::{Rng, SeedableRng};
use wgrad::capture::Step;
use wgrad::dist::{DataParallel, Dist};
use wgrad::nn::{self, Module};
use wgrad::optim::{self, LrSchedule, Optimizer};
use wgrad::{io, Device, Result, Tensor};

/// Train a character-level GPT with wgrad.
#[derive(Parser, Debug)]
#[command(version, about)]
struct Args {
    /// A text file to train on (90% train, 10% validation). Without it, a generated corpus.
    #[arg(long)]
    data: Option<PathBuf>,
    /// Optimizer steps.
    #[arg(long, default_value_t = 2000, value_parser = clap::value_parser!(u64).range(1..))]
    iters: u64,
    /// Sequences per step.
    #[arg(long, default_value_t = 12, value_parser = clap::value_parser!(u64).range(1..))]
    batch_size: u64,
    /// Context length (characters).
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u64).range(1..))]
    block: u64,
    /// Transformer blocks.
    #[arg(long, default_value_t = 4)]
    layers: usize,
    /// Attention heads per block.
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u64).range(1..))]
    heads: u64,
    /// Embedding width (a multiple of --heads).
    #[arg(long, default_value_t = 128, value_parser = clap::value_parser!(u64).range(1..))]
    width: u64,
    /// Peak learning rate, decayed to a tenth by a cosine schedule.
    #[arg(long, default_value_t = 1e-3)]
    lr: f32,
    /// Dropout probability after attention and MLP.
    #[arg(long, default_value_t = 0.0)]
    dropout: f32,
    /// Share the token embedding with the output head.
    #[arg(long)]
    tied: bool,
    /// Steps between loss estimates.
    #[arg(long, default_value_t = 250, value_parser = clap::value_parser!(u64).range(1..))]
    eval_interval: u64,
    /// Batches per loss estimate.
    #[arg(long, default_value_t = 20, value_parser = clap::value_parser!(u64).range(1..))]
    eval_iters: u64,
    /// Characters to sample at the end.
    #[arg(long, default_value_t = 300)]
    sample_len: usize,
    /// Seed for initialisation, batches and sampling.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Start from this safetensors checkpoint (of the same configuration and text).
    #[arg(long)]
    load: Option<PathBuf>,
    /// Save the trained model as a safetensors checkpoint here.
    #[arg(long)]
    save: Option<PathBuf>,
    /// Save the training state (model, optimizer, step, generator) here at every loss
    /// estimate, for --resume; `{step}` in the path is replaced by the step (one file each).
    #[arg(long)]
    save_state: Option<String>,
    /// Go on from a training state --save-state wrote (same flags otherwise): the run
    /// continues as if it had never stopped.
    #[arg(long)]
    resume: Option<PathBuf>,
    /// Write a PNG of the train and validation loss per estimate here.
    #[arg(long)]
    plot: Option<PathBuf>,
    /// Run every step eagerly instead of capturing it once and replaying it (to compare).
    #[arg(long)]
    eager: bool,
}

/// The GPT: embeddings, blocks, final LayerNorm, head.
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
            position: nn::Embedding::new(args.block as usize, width, dev)?,
            blocks,
            ln_f: nn::LayerNorm::new(width, 1e-5, dev)?,
            head: match args.tied {
                true => None,
                false => Some(nn::Linear::new(width, vocab, false, dev)?),
            },
        })
    }
}

impl Module for Gpt {
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

    fn named_parameters(&self) -> Vec<(String, Tensor)> {
        let mut params = vec![
            ("token.weight".to_string(), self.token.weight.clone()),
            ("position.weight".to_string(), self.position.weight.clone()),
        ];
        for (i, block) in self.blocks.iter().enumerate() {
            for (name, t) in block.named_parameters() {
                params.push((format!("blocks.{i}.{name}"), t));
            }
        }
        for (name, t) in self.ln_f.named_parameters() {
            params.push((format!("ln_f.{name}"), t));
        }
        if let Some(head) = &self.head {
            params.extend(
                head.named_parameters()
                    .into_iter()
                    .map(|(n, t)| (format!("head.{n}"), t)),
            );
        }
        params
    }

    fn set_training(&self, training: bool) {
        for block in &self.blocks {
            block.set_training(training);
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

/// A generated corpus of simple English sentences, for runs without `--data`.
fn generated_text(seed: u64) -> String {
    let subjects = [
        "the king",
        "a fool",
        "my lord",
        "the queen",
        "his daughter",
        "the ghost",
    ];
    let verbs = ["loves", "betrays", "fears", "follows", "forgives", "mocks"];
    let objects = [
        "the crown",
        "her father",
        "the night",
        "a stranger",
        "the sea",
        "his name",
    ];
    let endings = [".", "!", "?", ", and weeps.", ", and laughs."];
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut text = String::new();
    while text.len() < 200_000 {
        let pick = |rng: &mut rand::rngs::StdRng, words: &[&str]| {
            words[rng.random_range(0..words.len())].to_string()
        };
        let sentence = format!(
            "{} {} {}{}",
            pick(&mut rng, &subjects),
            pick(&mut rng, &verbs),
            pick(&mut rng, &objects),
            pick(&mut rng, &endings)
        );
        text.push_str(&sentence);
        text.push(if rng.random_range(0..4) == 0 {
            '\n'
        } else {
            ' '
        });
    }
    text
}

/// `batch` random windows of `block + 1` ids from `ids`: inputs `[batch, block]` and the
/// next-character targets, flattened.
fn sample_batch(
    ids: &[u32],
    batch: usize,
    block: usize,
    rng: &mut rand::rngs::StdRng,
    dev: &Device,
) -> Result<(Tensor, Tensor)> {
    let (mut x, mut y) = (
        Vec::with_capacity(batch * block),
        Vec::with_capacity(batch * block),
    );
    for _ in 0..batch {
        let start = rng.random_range(0..ids.len() - block);
        x.extend_from_slice(&ids[start..start + block]);
        y.extend_from_slice(&ids[start + 1..start + block + 1]);
    }
    Ok((
        Tensor::from_vec_u32(x, &[batch, block], dev)?,
        Tensor::from_vec_u32(y, &[batch * block], dev)?,
    ))
}

fn loss_of(model: &Gpt, x: &Tensor, y: &Tensor) -> Result<Tensor> {
    let logits = model.forward(x)?;
    let vocab = logits.shape()[2];
    nn::loss::cross_entropy(&logits.reshape(&[y.numel(), vocab])?, y)
}

/// Mean loss over `iters` random batches of `ids`, in evaluation mode.
fn estimate_loss(
    model: &Gpt,
    ids: &[u32],
    args: &Args,
    rng: &mut rand::rngs::StdRng,
    dev: &Device,
) -> Result<f32> {
    model.eval();
    let _no_grad = wgrad::autograd::NoGradGuard::new();
    let mut total = 0.0;
    for _ in 0..args.eval_iters {
        let (x, y) = sample_batch(ids, args.batch_size as usize, args.block as usize, rng, dev)?;
        total += loss_of(model, &x, &y)?.item()?;
    }
    model.train();
    Ok(total / args.eval_iters as f32)
}

/// `len` characters sampled from the model, starting after a newline.
fn sample(model: &Gpt, corpus: &Corpus, args: &Args, dev: &Device) -> Result<String> {
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

/// `println!` on rank 0 only.
macro_rules! say {
    ($dist:expr, $($arg:tt)*) => {
        if $dist.is_root() {
            println!($($arg)*);
        }
    };
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
    if !args.lr.is_finite() || args.lr <= 0.0 {
        return Err(format!(
            "--lr must be a finite positive number, got {}",
            args.lr
        ));
    }
    if !args.width.is_multiple_of(args.heads) {
        return Err(format!(
            "--width ({}) must be a multiple of --heads ({})",
            args.width, args.heads
        ));
    }
    let text = match &args.data {
        Some(path) => {
            std::fs::read_to_string(path).map_err(|e| format!("reading {}: {e}", path.display()))?
        }
        None => generated_text(args.seed),
    };
    let corpus = Corpus::new(&text);
    let split = corpus.ids.len() * 9 / 10;
    let (train, val) = corpus.ids.split_at(split);
    let block = args.block as usize;
    if val.len() <= block + 1 {
        return Err(format!(
            "the text has {} characters: too short for a validation split longer than --block {block}",
            corpus.ids.len()
        ));
    }
    let dist = &Dist::init().map_err(|e| e.to_string())?;
    // --batch-size is the global batch; each rank draws its share from its own stream.
    let local_batch = dist
        .local_batch(args.batch_size as usize)
        .map_err(|e| e.to_string())?;
    let dev = Device::new().map_err(|e| e.to_string())?;
    say!(dist, "adapter: {}", dev.info());
    if dist.size() > 1 {
        say!(dist, "data-parallel: {} ranks", dist.size());
    }
    let source = args
        .data
        .as_ref()
        .map_or("generated corpus".to_string(), |p| p.display().to_string());
    say!(
        dist,
        "data: {source}: {} train / {} validation characters, vocabulary {} (model rows {})",
        train.len(),
        val.len(),
        corpus.chars.len(),
        corpus.chars.len().next_multiple_of(4)
    );

    wgrad::manual_seed(args.seed);
    // The table and the head are rounded up to a multiple of 4 rows (never a target), as
    // nanoGPT rounds GPT-2's 50,257 to 50,304: the logits' matmuls then take the aligned
    // kernels, and no kernel is compiled only for an odd width.
    let vocab = corpus.chars.len().next_multiple_of(4);
    let model = Gpt::new(vocab, args, &dev).map_err(|e| e.to_string())?;
    if let Some(path) = &args.load {
        io::load(path, &model).map_err(|e| e.to_string())?;
        say!(dist, "loaded: {}", path.display());
    }
    let data_parallel = DataParallel::new(dist, &model).map_err(|e| e.to_string())?;
    // Grads are averaged across ranks on the host, which a captured step cannot hold.
    let eager = args.eager || dist.size() > 1;
    let count: usize = model.parameters().iter().map(|p| p.numel()).sum();
    say!(
        dist,
        "model: {} layers, {} heads, width {}, {count} parameters",
        args.layers,
        args.heads,
        args.width
    );
    // Weight decay on matrices only, as nanoGPT.
    let (matrices, vectors): (Vec<Tensor>, Vec<Tensor>) =
        model.parameters().into_iter().partition(|p| p.rank() >= 2);
    let config = |weight_decay| optim::AdamConfig {
        lr: args.lr,
        betas: (0.9, 0.99),
        weight_decay,
        ..Default::default()
    };
    // One optimizer, two groups. In a RefCell: the training step uses it, and the loop sets
    // its learning rate.
    let groups = vec![
        optim::ParamGroup::new(matrices).weight_decay(0.1),
        optim::ParamGroup::new(vectors).weight_decay(0.0),
    ];
    let opt = RefCell::new(optim::AdamW::with_groups(groups, config(0.1)));
    let mut first_step = 1;
    if let Some(path) = &args.resume {
        let done =
            io::load_training(path, &model, &mut *opt.borrow_mut()).map_err(|e| e.to_string())?;
        first_step = done as usize + 1;
        say!(dist, "resumed: {} after step {done}", path.display());
    }
    // One training step; captured on its second call and replayed after (`--eager`: never).
    // Its loss is never read: the loop estimates losses every --eval-interval steps.
    let train_step = |batch: &[Tensor]| -> wgrad::Result<Tensor> {
        let mut opt = opt.borrow_mut();
        opt.zero_grad();
        let loss = loss_of(&model, &batch[0], &batch[1])?;
        loss.backward()?;
        data_parallel.sync_grads()?;
        opt.step()?;
        Ok(loss)
    };
    let mut captured = Step::new(train_step);
    let schedule = optim::CosineLr {
        base_lr: args.lr,
        min_lr: args.lr / 10.0,
        total_steps: args.iters as usize,
    };

    // Batches drawn from generators seeded by the step, so a resumed run draws what the
    // uninterrupted one would.
    let generator = |step: usize, stream: u64| {
        let seed = args.seed
            ^ (stream + 7919 * dist.rank() as u64)
            ^ (step as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        rand::rngs::StdRng::seed_from_u64(seed)
    };
    let (mut train_losses, mut val_losses) = (Vec::new(), Vec::new());
    let bar = if dist.is_root() {
        ProgressBar::new(args.iters)
    } else {
        ProgressBar::hidden()
    }
    .with_style(
        ProgressStyle::with_template("step {bar:30} {pos}/{len} {msg}").expect("valid template"),
    );
    let started = Instant::now();
    let tokens_per_step = (args.batch_size * args.block) as f64;
    let fail = |e: wgrad::Error| e.to_string();
    for step in first_step..=args.iters as usize {
        let mut rng = generator(step, 0);
        let (x, y) = sample_batch(train, local_batch, block, &mut rng, &dev).map_err(fail)?;
        opt.borrow_mut().set_lr(schedule.lr(step - 1));
        if eager {
            train_step(&[x, y]).map_err(fail)?;
        } else {
            captured.run(&[x, y]).map_err(fail)?;
        }
        if step == 1 {
            dev.synchronize().map_err(fail)?;
            let elapsed = process_start.elapsed().as_secs_f64();
            bar.suspend(|| say!(dist, "first step done {elapsed:.3} s after start"));
        }
        if step % args.eval_interval as usize == 0 || step == args.iters as usize {
            let mut eval_rng = generator(step, 1);
            let train_loss =
                estimate_loss(&model, train, args, &mut eval_rng, &dev).map_err(fail)?;
            let val_loss = estimate_loss(&model, val, args, &mut eval_rng, &dev).map_err(fail)?;
            if !val_loss.is_finite() {
                bar.abandon();
                return Err(format!(
                    "the loss became {val_loss} at step {step}; try a smaller --lr"
                ));
            }
            bar.suspend(|| {
                say!(
                    dist,
                    "step {step}: train_loss={train_loss:.4} val_loss={val_loss:.4}"
                )
            });
            train_losses.push(train_loss);
            val_losses.push(val_loss);
            if let (Some(path), true) = (&args.save_state, dist.is_root()) {
                let path = path.replace("{step}", &step.to_string());
                io::save_training(&path, &model, &*opt.borrow(), step as u64).map_err(fail)?;
            }
        }
        bar.set_message(format!(
            "{:.0} tokens/s",
            step as f64 * tokens_per_step / started.elapsed().as_secs_f64()
        ));
        bar.inc(1);
    }
    bar.finish_and_clear();
    let tokens_per_s = args.iters as f64 * tokens_per_step / started.elapsed().as_secs_f64();

    if let Some(path) = &args.save {
        dist.save(path, &model).map_err(fail)?;
        say!(dist, "saved: {}", path.display());
    }
    if let Some(path) = args.plot.as_ref().filter(|_| dist.is_root()) {
        let train_series = ("train loss", train_losses.as_slice());
        let val_series = ("validation loss", val_losses.as_slice());
        plot::plot(path, "estimate", train_series, val_series)
            .map_err(|e| format!("writing the plot {}: {e}", path.display()))?;
        say!(dist, "plot: {}", path.display());
    }
    if !eager {
        let stats = captured.stats();
        say!(
            dist,
            "captured: {} eager, {} capturing, {} replayed steps; {} dispatches per replay ({} \
             launches fused away)",
            stats.eager,
            stats.captures,
            stats.replays,
            stats.replay_dispatches,
            stats.fused_away
        );
    }
    say!(
        dist,
        "sample:\n{}\n",
        sample(&model, &corpus, args, &dev).map_err(fail)?
    );
    say!(
        dist,
        "final: val_loss={:.4} train_loss={:.4} steps={} tokens_per_s={tokens_per_s:.1}",
        val_losses.last().expect("at least one estimate"),
        train_losses.last().expect("at least one estimate"),
        args.iters
    );
    Ok(())
}
