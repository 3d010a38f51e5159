//! What the language-model examples (gpt.rs, llama.rs) share: the options of a run, the text,
//! batches of token windows, and the training loop (AdamW with weight decay on matrices only,
//! cosine schedule, captured steps, loss estimates, training state, a plot), in one process
//! or data-parallel under `mpirun` (rank 0 prints and saves).

use std::cell::RefCell;
use std::path::PathBuf;
use std::time::Instant;

use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use rand::{Rng, SeedableRng};
use wgrad::capture::Step;
use wgrad::dist::{DataParallel, Dist};
use wgrad::nn::{self, Module};
use wgrad::optim::{self, LrSchedule, Optimizer};
use wgrad::{io, Device, Result, Tensor};

use crate::precision::{backward_and_step, Precision};

/// Options of a language model's training run.
#[derive(Args, Debug)]
pub struct LmArgs {
    /// A text file to train on (90% train, 10% validation). Without it, a generated corpus.
    #[arg(long)]
    pub data: Option<PathBuf>,
    /// Optimizer steps.
    #[arg(long, default_value_t = 2000, value_parser = clap::value_parser!(u64).range(1..))]
    pub iters: u64,
    /// Sequences per step.
    #[arg(long, default_value_t = 12, value_parser = clap::value_parser!(u64).range(1..))]
    pub batch_size: u64,
    /// Context length (tokens).
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u64).range(1..))]
    pub block: u64,
    /// Peak learning rate, decayed to a tenth by a cosine schedule.
    #[arg(long, default_value_t = 1e-3)]
    pub lr: f32,
    /// Steps of linear warmup from a rate of 0 up to --lr, before the cosine decay.
    #[arg(long, default_value_t = 0)]
    pub warmup: u64,
    /// Steps between loss estimates.
    #[arg(long, default_value_t = 250, value_parser = clap::value_parser!(u64).range(1..))]
    pub eval_interval: u64,
    /// Batches per loss estimate.
    #[arg(long, default_value_t = 20, value_parser = clap::value_parser!(u64).range(1..))]
    pub eval_iters: u64,
    /// Tokens to sample at the end.
    #[arg(long, default_value_t = 300)]
    pub sample_len: usize,
    /// Seed for initialisation, batches and sampling.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Save the training state (model, optimizer, step, generator) here at every loss
    /// estimate, for --resume; `{step}` in the path is replaced by the step (one file each).
    #[arg(long)]
    pub save_state: Option<String>,
    /// Go on from a training state --save-state wrote (same flags otherwise): the run
    /// continues as if it had never stopped.
    #[arg(long)]
    pub resume: Option<PathBuf>,
    /// Write a PNG of the train and validation loss per estimate here.
    #[arg(long, value_parser = crate::plot::png_path)]
    pub plot: Option<PathBuf>,
    /// Run every step eagerly instead of capturing it once and replaying it (to compare).
    #[arg(long)]
    pub eager: bool,
    /// Mixed precision: the forward's matmuls, attention and products in 16 bits under
    /// wgrad::autocast, parameters and optimizer state in f32.
    #[arg(long, value_enum, default_value_t = Precision::F32)]
    pub precision: Precision,
}

impl LmArgs {
    /// The text to train on: `--data`, or a generated corpus.
    pub fn text(&self) -> std::result::Result<String, String> {
        if !self.lr.is_finite() || self.lr <= 0.0 {
            return Err(format!(
                "--lr must be a finite positive number, got {}",
                self.lr
            ));
        }
        match &self.data {
            Some(path) => std::fs::read_to_string(path)
                .map_err(|e| format!("reading {}: {e}", path.display())),
            None => Ok(generated_text(self.seed)),
        }
    }

    /// Where the text came from, for the log.
    pub fn source(&self) -> String {
        self.data
            .as_ref()
            .map_or("generated corpus".to_string(), |p| p.display().to_string())
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
/// next-token targets, flattened.
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

/// The mean cross-entropy of `model`'s logits (`[B, T, vocab]`) for `x` against `y`.
pub fn loss_of(model: &dyn Module, x: &Tensor, y: &Tensor) -> Result<Tensor> {
    let logits = model.forward(x)?;
    let vocab = logits.shape()[2];
    nn::loss::cross_entropy(&logits.reshape(&[y.numel(), vocab])?, y)
}

/// Mean loss over `args.eval_iters` random batches of `ids`, in evaluation mode.
fn estimate_loss(
    model: &dyn Module,
    ids: &[u32],
    args: &LmArgs,
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

/// Prints `line` on rank 0 only.
pub fn say(dist: &Dist, line: impl std::fmt::Display) {
    if dist.is_root() {
        println!("{line}");
    }
}

/// The last estimates of a run, and its speed.
pub struct LmRun {
    pub train_loss: f32,
    pub val_loss: f32,
    pub tokens_per_s: f64,
}

/// Trains `model` on windows of `train`, estimating the loss on `train` and `val` every
/// `--eval-interval` steps; `process_start` times the first step from the process's start.
pub fn train(
    model: &dyn Module,
    (train, val): (&[u32], &[u32]),
    args: &LmArgs,
    dist: &Dist,
    dev: &Device,
    process_start: Instant,
) -> std::result::Result<LmRun, String> {
    let block = args.block as usize;
    if train.len() <= block + 1 || val.len() <= block + 1 {
        return Err(format!(
            "{} train / {} validation tokens: too short for windows of --block {block}",
            train.len(),
            val.len()
        ));
    }
    let fail = |e: wgrad::Error| e.to_string();
    // --batch-size is the global batch; each rank draws its share from its own stream.
    let local_batch = dist.local_batch(args.batch_size as usize).map_err(fail)?;
    let data_parallel = DataParallel::new(dist, model).map_err(fail)?;
    // Grads are averaged across ranks on the host, which a captured step cannot hold.
    let eager = args.eager || dist.size() > 1 || args.precision.needs_eager();
    // F16 needs loss scaling; BF16 has f32's range.
    let scaler = RefCell::new((args.precision == Precision::F16).then(optim::GradScaler::new));
    // Weight decay on matrices only, as nanoGPT.
    let (matrices, vectors): (Vec<Tensor>, Vec<Tensor>) =
        model.parameters().into_iter().partition(|p| p.rank() >= 2);
    let config = optim::AdamConfig {
        lr: args.lr,
        betas: (0.9, 0.99),
        weight_decay: 0.1,
        ..Default::default()
    };
    // One optimizer, two groups. In a RefCell: the training step uses it, and the loop sets
    // its learning rate.
    let groups = vec![
        optim::ParamGroup::new(matrices).weight_decay(0.1),
        optim::ParamGroup::new(vectors).weight_decay(0.0),
    ];
    let opt = RefCell::new(optim::AdamW::with_groups(groups, config));
    let mut first_step = 1;
    if let Some(path) = &args.resume {
        let done = io::load_training(path, model, &mut *opt.borrow_mut()).map_err(fail)?;
        first_step = done as usize + 1;
        say(
            dist,
            format!("resumed: {} after step {done}", path.display()),
        );
    }
    // One training step; captured on its second call and replayed after (`--eager`: never).
    // Its loss is never read: the loop estimates losses every --eval-interval steps.
    let train_step = |batch: &[Tensor]| -> wgrad::Result<Tensor> {
        let mut opt = opt.borrow_mut();
        opt.zero_grad();
        let loss = args
            .precision
            .loss(|| loss_of(model, &batch[0], &batch[1]))?;
        let mut scaler = scaler.borrow_mut();
        backward_and_step(&loss, &mut *opt, scaler.as_mut(), || {
            data_parallel.sync_grads()
        })?;
        Ok(loss)
    };
    let mut captured = Step::new(train_step);
    let schedule = optim::Warmup {
        steps: args.warmup as usize,
        schedule: optim::CosineLr {
            base_lr: args.lr,
            min_lr: args.lr / 10.0,
            total_steps: args.iters.saturating_sub(args.warmup) as usize,
        },
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
    for step in first_step..=args.iters as usize {
        let mut rng = generator(step, 0);
        let (x, y) = sample_batch(train, local_batch, block, &mut rng, dev).map_err(fail)?;
        opt.borrow_mut().set_lr(schedule.lr(step - 1));
        if eager {
            train_step(&[x, y]).map_err(fail)?;
        } else {
            captured.run(&[x, y]).map_err(fail)?;
        }
        if step == first_step {
            dev.synchronize().map_err(fail)?;
            let elapsed = process_start.elapsed().as_secs_f64();
            bar.suspend(|| say(dist, format!("first step done {elapsed:.3} s after start")));
        }
        if step % args.eval_interval as usize == 0 || step == args.iters as usize {
            let mut eval_rng = generator(step, 1);
            let train_loss = estimate_loss(model, train, args, &mut eval_rng, dev).map_err(fail)?;
            let val_loss = estimate_loss(model, val, args, &mut eval_rng, dev).map_err(fail)?;
            if !val_loss.is_finite() {
                bar.abandon();
                return Err(format!(
                    "the loss became {val_loss} at step {step}; try a smaller --lr"
                ));
            }
            // The time since the process started, so that runs of two models can be compared
            // by the loss each reached at a given wall time.
            let elapsed = process_start.elapsed().as_secs_f64();
            bar.suspend(|| {
                say(
                    dist,
                    format!(
                        "step {step} ({elapsed:.0} s): train_loss={train_loss:.4} \
                         val_loss={val_loss:.4}"
                    ),
                )
            });
            train_losses.push(train_loss);
            val_losses.push(val_loss);
            if let (Some(path), true) = (&args.save_state, dist.is_root()) {
                let path = path.replace("{step}", &step.to_string());
                io::save_training(&path, model, &*opt.borrow(), step as u64).map_err(fail)?;
            }
        }
        bar.set_message(format!(
            "{:.0} tokens/s",
            (step + 1 - first_step) as f64 * tokens_per_step / started.elapsed().as_secs_f64()
        ));
        bar.inc(1);
    }
    bar.finish_and_clear();
    let steps_run = args.iters as usize + 1 - first_step;
    let tokens_per_s = steps_run as f64 * tokens_per_step / started.elapsed().as_secs_f64();

    if let Some(path) = args.plot.as_ref().filter(|_| dist.is_root()) {
        let train_series = ("train loss", train_losses.as_slice());
        let val_series = ("validation loss", val_losses.as_slice());
        crate::plot::plot(path, "estimate", train_series, val_series)
            .map_err(|e| format!("writing the plot {}: {e}", path.display()))?;
        say(dist, format!("plot: {}", path.display()));
    }
    if !eager {
        let stats = captured.stats();
        say(
            dist,
            format!(
                "captured: {} eager, {} capturing, {} replayed steps; {} dispatches per replay \
                 ({} launches fused away)",
                stats.eager,
                stats.captures,
                stats.replays,
                stats.replay_dispatches,
                stats.fused_away
            ),
        );
    }
    Ok(LmRun {
        train_loss: *train_losses
            .last()
            .ok_or("no loss estimate: nothing to resume")?,
        val_loss: *val_losses.last().ok_or("no loss estimate")?,
        tokens_per_s,
    })
}
