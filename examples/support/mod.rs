//! What the examples share: the command-line options of a classifier's training run, and the
//! run itself (Adam/AdamW/SGD with cosine decay, a progress bar, per-epoch test accuracy,
//! checkpoints, a plot, and one `final:` line), in one process or data-parallel under
//! `mpirun` (built with `--features mpi`; rank 0 prints and saves).

use std::cell::RefCell;
use std::path::PathBuf;
use std::time::Instant;

use clap::{Args, ValueEnum};
use indicatif::{ProgressBar, ProgressStyle};
use wgrad::capture::Step;
use wgrad::dist::{DataParallel, Dist};
use wgrad::nn::{self, Module};
use wgrad::optim::{self, LrSchedule, Optimizer};
use wgrad::{io, Device, Tensor};

pub mod plot;
pub mod precision;

use precision::{backward_and_step, Precision};

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum OptimizerKind {
    Sgd,
    Adam,
    Adamw,
}

/// Options of a classifier's training run.
#[derive(Args, Debug)]
pub struct TrainArgs {
    /// Directory of MNIST-format IDX files (train-images-idx3-ubyte, ...; .gz allowed).
    /// Without it, a built-in synthetic set is used.
    #[arg(long)]
    pub data: Option<PathBuf>,
    /// Passes over the training set.
    #[arg(long, default_value_t = 20)]
    pub epochs: usize,
    /// Examples per step.
    #[arg(long, default_value_t = 128, value_parser = clap::value_parser!(u64).range(1..))]
    pub batch_size: u64,
    /// Peak learning rate, decayed to 0 by a cosine schedule (default: the example's with its
    /// optimizer; else 3e-3 for Adam and AdamW, 0.05 for SGD with momentum 0.9).
    #[arg(long)]
    pub lr: Option<f32>,
    /// Optimizer (default: the example's).
    #[arg(long, value_enum)]
    pub optimizer: Option<OptimizerKind>,
    /// Weight decay of the weight matrices and kernels; biases and norms get none (default:
    /// the example's with its optimizer; else 0.01 for AdamW, 0 for the others).
    #[arg(long)]
    pub weight_decay: Option<f32>,
    /// Nesterov momentum for SGD (default: the example's).
    #[arg(long)]
    pub nesterov: Option<bool>,
    /// Label smoothing of the cross-entropy, in [0, 1) (default: the example's).
    #[arg(long)]
    pub label_smoothing: Option<f32>,
    /// Seed for initialisation, shuffling and the synthetic set.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Start from this safetensors checkpoint (of the same architecture) instead of a fresh
    /// initialisation.
    #[arg(long)]
    pub load: Option<PathBuf>,
    /// Save the trained model as a safetensors checkpoint here.
    #[arg(long)]
    pub save: Option<PathBuf>,
    /// Save the training state (model, optimizer, step, generator) here after every epoch,
    /// for --resume; `{epoch}` in the path is replaced by the epoch's number (one file each).
    #[arg(long)]
    pub save_state: Option<String>,
    /// Go on from a training state --save-state wrote (same architecture, optimizer and
    /// batch size): the run continues as if it had never stopped.
    #[arg(long)]
    pub resume: Option<PathBuf>,
    /// Write a PNG of the loss and test accuracy per epoch here.
    #[arg(long, value_parser = plot::png_path)]
    pub plot: Option<PathBuf>,
    /// Run every step eagerly instead of capturing it once and replaying it (to compare).
    #[arg(long)]
    pub eager: bool,
    /// Read the loss back to the host every this many steps (each read waits for the device).
    #[arg(long, default_value_t = 20, value_parser = clap::value_parser!(u64).range(1..))]
    pub log_every: u64,
    /// Mixed precision: the forward's matmuls and convolutions in 16 bits under
    /// wgrad::autocast, parameters and optimizer state in f32.
    #[arg(long, value_enum, default_value_t = Precision::F32)]
    pub precision: Precision,
}

/// How a classifier trains: what each example picks, and each flag may change.
#[derive(Debug, Clone, Copy)]
pub struct Recipe {
    pub optimizer: OptimizerKind,
    pub lr: f32,
    pub weight_decay: f32,
    pub nesterov: bool,
    pub label_smoothing: f32,
}

impl Recipe {
    /// Adam at 3e-3, no weight decay, plain cross-entropy.
    pub const ADAM: Recipe = Recipe {
        optimizer: OptimizerKind::Adam,
        lr: 3e-3,
        weight_decay: 0.0,
        nesterov: false,
        label_smoothing: 0.0,
    };

    /// `optimizer`'s defaults where an example does not choose it.
    fn for_optimizer(optimizer: OptimizerKind) -> Recipe {
        let (lr, weight_decay) = match optimizer {
            OptimizerKind::Sgd => (0.05, 0.0),
            OptimizerKind::Adam => (3e-3, 0.0),
            OptimizerKind::Adamw => (3e-3, 0.01),
        };
        Recipe {
            optimizer,
            lr,
            weight_decay,
            ..Recipe::ADAM
        }
    }
}

impl TrainArgs {
    /// The recipe the run uses: `defaults` (the example's), with the flags given over it;
    /// checked.
    pub fn recipe(&self, defaults: &Recipe) -> Result<Recipe, String> {
        let optimizer = self.optimizer.unwrap_or(defaults.optimizer);
        let base = match optimizer == defaults.optimizer {
            true => *defaults,
            false => Recipe::for_optimizer(optimizer),
        };
        let recipe = Recipe {
            optimizer,
            lr: self.lr.unwrap_or(base.lr),
            weight_decay: self.weight_decay.unwrap_or(base.weight_decay),
            nesterov: self.nesterov.unwrap_or(base.nesterov),
            label_smoothing: self.label_smoothing.unwrap_or(base.label_smoothing),
        };
        if !recipe.lr.is_finite() || recipe.lr <= 0.0 {
            return Err(format!(
                "--lr must be a finite positive number, got {}",
                recipe.lr
            ));
        }
        if !recipe.weight_decay.is_finite() || recipe.weight_decay < 0.0 {
            return Err(format!(
                "--weight-decay must be finite and at least 0, got {}",
                recipe.weight_decay
            ));
        }
        if !(0.0..1.0).contains(&recipe.label_smoothing) {
            return Err(format!(
                "--label-smoothing must be in [0, 1), got {}",
                recipe.label_smoothing
            ));
        }
        if recipe.nesterov && optimizer != OptimizerKind::Sgd {
            return Err("--nesterov true needs --optimizer sgd".into());
        }
        if self.epochs == 0 {
            return Err("--epochs must be at least 1".into());
        }
        Ok(recipe)
    }

    /// The data set the run trains on: `--data`'s IDX files, or `synthetic()`.
    pub fn dataset(
        &self,
        dist: &Dist,
        synthetic: impl FnOnce(u64) -> (io::Dataset, io::Dataset),
        synthetic_name: &str,
    ) -> Result<(io::Dataset, io::Dataset), String> {
        let (train, test) = match &self.data {
            Some(dir) => io::load_idx_dir(dir).map_err(|e| e.to_string())?,
            None => synthetic(self.seed),
        };
        if train.is_empty() || test.is_empty() {
            return Err("the training and test sets must not be empty".into());
        }
        let source = self
            .data
            .as_ref()
            .map_or(synthetic_name.to_string(), |d| d.display().to_string());
        say(
            dist,
            format!(
                "data: {source}: {} train / {} test examples, {} features, {} classes",
                train.len(),
                test.len(),
                train.features,
                train.classes
            ),
        );
        Ok((train, test))
    }
}

/// Prints `line` on rank 0 only.
pub fn say(dist: &Dist, line: impl std::fmt::Display) {
    if dist.is_root() {
        println!("{line}");
    }
}

/// Per-epoch figures, for the plot.
struct History {
    train_loss: Vec<f32>,
    test_acc: Vec<f32>,
}

/// Trains `model` (which takes rows of `train.features` values) on `train`, evaluating on
/// `test` after every epoch, and prints the `final:` line.
pub fn fit(
    model: &dyn Module,
    (train, test): (io::Dataset, &io::Dataset),
    dev: &Device,
    args: &TrainArgs,
    recipe: &Recipe,
    dist: &Dist,
    process_start: Instant,
) -> Result<(), String> {
    let lr = recipe.lr;
    let batch = args.batch_size as usize;
    // Data-parallel: --batch-size is the global batch; each rank takes its share.
    dist.local_batch(batch).map_err(|e| e.to_string())?;
    if let Some(path) = &args.load {
        io::load(path, model).map_err(|e| e.to_string())?;
        say(dist, format!("loaded: {}", path.display()));
    }
    let data_parallel = DataParallel::new(dist, model).map_err(|e| e.to_string())?;
    // The grads are averaged across ranks on the host between backward and the optimizer,
    // which a captured step cannot hold: data-parallel runs are eager.
    let eager = args.eager || dist.size() > 1 || args.precision.needs_eager();
    // F16 needs loss scaling; BF16 has f32's range.
    let scaler = RefCell::new(args.precision.needs_eager().then(optim::GradScaler::new));
    // Weight decay on matrices and kernels only, as is usual (none on biases and norms).
    let (matrices, vectors): (Vec<Tensor>, Vec<Tensor>) =
        model.parameters().into_iter().partition(|p| p.rank() >= 2);
    let groups = vec![
        optim::ParamGroup::new(matrices).weight_decay(recipe.weight_decay),
        optim::ParamGroup::new(vectors).weight_decay(0.0),
    ];
    let adam = optim::AdamConfig {
        lr,
        ..Default::default()
    };
    let mut opt: Box<dyn Optimizer> = match recipe.optimizer {
        OptimizerKind::Sgd => Box::new(optim::Sgd::with_groups(
            groups,
            optim::SgdConfig {
                lr,
                momentum: 0.9,
                nesterov: recipe.nesterov,
                ..Default::default()
            },
        )),
        OptimizerKind::Adam => Box::new(optim::Adam::with_groups(groups, adam)),
        OptimizerKind::Adamw => Box::new(optim::AdamW::with_groups(groups, adam)),
    };
    let loss_options = nn::loss::CrossEntropyOptions {
        label_smoothing: recipe.label_smoothing,
        ..Default::default()
    };

    let steps_per_epoch = if dist.size() > 1 {
        train.len() / batch
    } else {
        train.len().div_ceil(batch)
    };
    // Cosine decay to zero over the run: large steps early, a settled model at the end.
    let schedule = optim::CosineLr {
        base_lr: lr,
        min_lr: 0.0,
        total_steps: steps_per_epoch * args.epochs,
    };
    let features = train.features;
    // Batches made on a background thread while the step before runs, in a new order every
    // epoch drawn from --seed.
    let mut loader = io::DataLoader::new(train, batch).shuffle(args.seed);
    // A resumed run starts after the epochs its state has done, with the order the
    // uninterrupted run would draw next.
    let mut first_epoch = 1;
    if let Some(path) = &args.resume {
        let done = io::load_training(path, model, opt.as_mut()).map_err(|e| e.to_string())?;
        if !(done as usize).is_multiple_of(steps_per_epoch.max(1)) {
            return Err(format!(
                "{} was not saved at the end of an epoch",
                path.display()
            ));
        }
        first_epoch = done as usize / steps_per_epoch.max(1) + 1;
        loader.set_epoch(first_epoch as u64 - 1);
        say(
            dist,
            format!("resumed: {} after step {done}", path.display()),
        );
    }
    let mut history = History {
        train_loss: Vec::new(),
        test_acc: Vec::new(),
    };
    // One training step; captured on its second call and replayed after (`--eager`: never).
    // The optimizer sits in a RefCell: the step uses it, and the loop sets its learning rate.
    let opt = RefCell::new(opt);
    let train_step = |batch: &[Tensor]| -> wgrad::Result<Tensor> {
        let mut opt = opt.borrow_mut();
        opt.zero_grad();
        let loss = args.precision.loss(|| {
            nn::loss::cross_entropy_with(&model.forward(&batch[0])?, &batch[1], &loss_options)
        })?;
        let mut scaler = scaler.borrow_mut();
        backward_and_step(&loss, &mut **opt, scaler.as_mut(), || {
            data_parallel.sync_grads()
        })?;
        Ok(loss)
    };
    let mut captured = Step::new(train_step);
    let mut run_step = |batch: &[Tensor]| -> wgrad::Result<Tensor> {
        if eager {
            train_step(batch)
        } else {
            captured.run(batch)
        }
    };
    let (mut step, mut seen) = ((first_epoch - 1) * steps_per_epoch, 0usize);
    let started = Instant::now();
    let style = ProgressStyle::with_template("epoch {prefix} {bar:30} {pos}/{len} {msg}")
        .expect("valid template");
    for epoch in first_epoch..=args.epochs {
        model.train();
        let bar = if dist.is_root() {
            ProgressBar::new(steps_per_epoch as u64)
        } else {
            ProgressBar::hidden()
        }
        .with_style(style.clone())
        .with_prefix(format!("{epoch}/{}", args.epochs));
        let (mut epoch_loss, mut epoch_rows) = (0.0f64, 0usize);
        // Losses not yet read back, with their batch sizes: read every --log-every steps.
        let mut pending: Vec<(Tensor, usize)> = Vec::new();
        let batches: Box<dyn Iterator<Item = (Vec<f32>, Vec<u32>)>> = if dist.size() > 1 {
            // Every rank shuffles alike and takes its own slice of each global batch.
            let seed = args.seed ^ (epoch as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
            let source = loader.source();
            let chunks = dist
                .shard_batches(source.len(), batch, seed)
                .map_err(|e| e.to_string())?;
            Box::new(chunks.into_iter().map(move |c| source.batch(&c)))
        } else {
            Box::new(loader.epoch())
        };
        for (i, (inputs, labels)) in batches.enumerate() {
            let rows = labels.len();
            let x = Tensor::from_vec(inputs, &[rows, features], dev).map_err(|e| e.to_string())?;
            let y = Tensor::from_labels(labels, dev).map_err(|e| e.to_string())?;
            opt.borrow_mut().set_lr(schedule.lr(step));
            let loss = run_step(&[x, y]).map_err(|e| e.to_string())?;
            pending.push((loss, rows));
            step += 1;
            seen += rows * dist.size();
            if step == 1 {
                dev.synchronize().map_err(|e| e.to_string())?;
                let elapsed = process_start.elapsed().as_secs_f64();
                bar.suspend(|| say(dist, format!("first step done {elapsed:.3} s after start")));
            }
            let epoch_end = i + 1 == steps_per_epoch;
            if pending.len() as u64 >= args.log_every || epoch_end {
                let losses: Vec<Tensor> = pending.iter().map(|(l, _)| l.clone()).collect();
                let values = Tensor::stack(&losses, 0)
                    .and_then(|t| t.to_vec())
                    .map_err(|e| e.to_string())?;
                for (value, (_, rows)) in values.iter().zip(&pending) {
                    if !value.is_finite() {
                        bar.abandon();
                        return Err(format!(
                            "the loss became {value} by step {step} (epoch {epoch}); try a \
                             smaller --lr"
                        ));
                    }
                    epoch_loss += *value as f64 * *rows as f64;
                    epoch_rows += *rows;
                }
                pending.clear();
                bar.set_message(format!(
                    "loss {:.4}  {:.0} samples/s",
                    values.last().expect("one loss or more"),
                    seen as f64 / started.elapsed().as_secs_f64()
                ));
            }
            bar.inc(1);
        }
        // This rank's examples (all of them in one process).
        let train_loss = (epoch_loss / epoch_rows.max(1) as f64) as f32;
        let test_acc = accuracy(model, test, dev).map_err(|e| e.to_string())?;
        bar.finish_and_clear();
        say(
            dist,
            format!("epoch {epoch}: train_loss={train_loss:.4} test_acc={test_acc:.4}"),
        );
        history.train_loss.push(train_loss);
        history.test_acc.push(test_acc);
        if let (Some(path), true) = (&args.save_state, dist.is_root()) {
            let path = path.replace("{epoch}", &epoch.to_string());
            let opt = opt.borrow();
            io::save_training(&path, model, opt.as_ref(), step as u64)
                .map_err(|e| e.to_string())?;
        }
    }
    let samples_per_s = seen as f64 / started.elapsed().as_secs_f64();

    if let Some(path) = &args.save {
        dist.save(path, model).map_err(|e| e.to_string())?;
        say(dist, format!("saved: {}", path.display()));
    }
    if let Some(path) = args.plot.as_ref().filter(|_| dist.is_root()) {
        let loss = ("train loss", history.train_loss.as_slice());
        let acc = ("test accuracy", history.test_acc.as_slice());
        plot::plot(path, "epoch", loss, acc)
            .map_err(|e| format!("writing the plot {}: {e}", path.display()))?;
        say(dist, format!("plot: {}", path.display()));
    }
    if !eager {
        let stats = captured.stats();
        say(
            dist,
            format!(
                "captured: {} eager, {} capturing, {} replayed steps; {} plans, {} dispatches per \
             replay ({} launches fused away)",
                stats.eager,
                stats.captures,
                stats.replays,
                stats.plans,
                stats.replay_dispatches,
                stats.fused_away
            ),
        );
    }
    say(
        dist,
        format!(
            "final: test_acc={:.4} train_loss={:.4} steps={step} samples_per_s={samples_per_s:.1}",
            history.test_acc.last().expect("at least one epoch"),
            history.train_loss.last().expect("at least one epoch"),
        ),
    );
    Ok(())
}

/// Fraction of `data` the model classifies correctly, in evaluation mode and without a graph.
fn accuracy(model: &dyn Module, data: &io::Dataset, dev: &Device) -> wgrad::Result<f32> {
    model.eval();
    let _no_grad = wgrad::autograd::NoGradGuard::new();
    let indices: Vec<usize> = (0..data.len()).collect();
    let mut correct = 0;
    for chunk in indices.chunks(1024) {
        let (inputs, labels) = data.batch(chunk);
        let x = Tensor::from_vec(inputs, &[chunk.len(), data.features], dev)?;
        let labels = Tensor::from_vec_u32(labels, &[chunk.len()], dev)?;
        // The hits counted on the device: one number read back per chunk.
        let hits = model.forward(&x)?.argmax(1, false)?.eq(&labels)?;
        correct += hits.to_dtype(wgrad::DType::F32)?.sum()?.item()? as usize;
    }
    Ok(correct as f32 / data.len() as f32)
}
