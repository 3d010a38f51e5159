//! The benchmark report: `cargo run --release --example bench`.
//!
//! Prints, for the adapter `Device::new()` picks, a markdown table of matmul GFLOP/s, sdpa
//! TFLOP/s (forward, and forward + backward), memory bandwidth (a buffer copy, a strided copy
//! kernel, an elementwise chain eager and fused by a captured step), and the training steps of
//! the MLP, CNN, GPT (also under F16 autocast) and Llama the examples and criterion benches
//! use, eager and captured (ms per step, samples or tokens per second, the first step's time
//! with its kernels compiling, peak device memory). Where the adapter is a GPU it knows, each
//! figure also gets its share of the adapter's fp32 peak or memory bandwidth.
//!
//! `--json` prints the same as JSON; `--compare A.json B.json` prints two reports side by side
//! with their ratios (how to compare two adapters); `--full` adds the largest sizes on
//! software adapters, where the defaults stop early so that the report takes a few minutes;
//! `--sections matmul,training` measures only those sections (matmul, attention, bandwidth,
//! training).

use std::path::PathBuf;
use std::time::{Duration, Instant};

use clap::Parser;
use wgrad::capture::Step;
use wgrad::models::{Llama, LlamaConfig};
use wgrad::nn::{self, Module};
use wgrad::optim::{self, Optimizer};
use wgrad::{DType, Device, Result, Tensor};

/// Benchmark report for one adapter.
#[derive(Parser, Debug)]
#[command(version, about)]
struct Args {
    /// Print JSON instead of markdown.
    #[arg(long)]
    json: bool,
    /// The largest sizes on software adapters too (matmul 4096 and 8192, sdpa T up to 8192).
    #[arg(long)]
    full: bool,
    /// Two reports written with --json: print them side by side with the ratio B / A.
    #[arg(long, num_args = 2, value_names = ["A", "B"])]
    compare: Option<Vec<PathBuf>>,
    /// The sections to measure, comma-separated (all by default).
    #[arg(long, value_enum, value_delimiter = ',', default_values_t = Section::ALL)]
    sections: Vec<Section>,
}

/// A part of the report, run on its own with `--sections`.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
enum Section {
    Matmul,
    Attention,
    Bandwidth,
    Training,
}

impl Section {
    const ALL: [Section; 4] = [
        Section::Matmul,
        Section::Attention,
        Section::Bandwidth,
        Section::Training,
    ];
}

impl std::fmt::Display for Section {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let name = format!("{self:?}").to_lowercase();
        f.write_str(&name)
    }
}

/// One measured figure.
struct Row {
    section: &'static str,
    name: String,
    /// `None`: not measured on this adapter ("n/a"), with the reason in `note`.
    value: Option<f64>,
    unit: &'static str,
    note: String,
}

impl Row {
    fn new(section: &'static str, name: String, value: f64, unit: &'static str) -> Row {
        Row {
            section,
            name,
            value: Some(value),
            unit,
            note: String::new(),
        }
    }

    fn note(mut self, note: String) -> Row {
        self.note = note;
        self
    }
}

/// Vendor figures (fp32 non-tensor-core TFLOPS, memory GB/s) of GPUs the report knows by a
/// part of their adapter name, most specific first.
const KNOWN_GPUS: &[(&str, f64, f64)] = &[
    ("H200", 67.0, 4800.0),
    ("H100 PCIe", 51.0, 2000.0),
    ("H100", 67.0, 3350.0),
    ("A100", 19.5, 1935.0),
    ("L40S", 91.6, 864.0),
    ("L4", 30.3, 300.0),
    ("A10", 31.2, 600.0),
    ("T4", 8.1, 320.0),
    ("V100", 15.7, 900.0),
    ("RTX 4090", 82.6, 1008.0),
    ("RTX 4080", 48.7, 717.0),
    ("RTX 3090", 35.6, 936.0),
    ("M4 Max", 16.1, 546.0),
    ("M4 Pro", 8.1, 273.0),
    ("M2 Max", 13.6, 400.0),
    ("M2 Pro", 6.8, 200.0),
    ("M2", 3.6, 100.0),
    ("M1 Max", 10.4, 400.0),
    ("M1 Pro", 5.2, 200.0),
    ("M1", 2.6, 68.0),
];

/// The adapter's fp32 TFLOPS and GB/s, where it is a GPU the report knows.
fn peak_of(name: &str) -> Option<(f64, f64)> {
    KNOWN_GPUS
        .iter()
        .find(|(part, _, _)| name.contains(part))
        .map(|&(_, tflops, gbs)| (tflops, gbs))
}

fn main() {
    let args = Args::parse();
    let outcome = match &args.compare {
        Some(files) => compare(&files[0], &files[1]),
        None => report(&args).map_err(|e| e.to_string()),
    };
    if let Err(message) = outcome {
        eprintln!("error: {message}");
        std::process::exit(1);
    }
}

fn report(args: &Args) -> Result<()> {
    let dev = Device::new()?;
    let info = dev.info().clone();
    let software = info.is_software();
    let large = args.full || !software;
    eprintln!("adapter: {info}");
    let mut rows = Vec::new();
    let sizes: &[usize] = if large {
        &[512, 1024, 2048, 4096, 8192]
    } else {
        &[512, 1024, 2048]
    };
    let lengths: &[usize] = if large {
        &[1024, 2048, 4096, 8192]
    } else {
        &[1024, 2048]
    };
    let wanted = |section| args.sections.contains(&section);
    if wanted(Section::Matmul) {
        rows.extend(matmul(&dev, sizes)?);
    }
    if wanted(Section::Attention) {
        rows.extend(attention(&dev, lengths)?);
    }
    if wanted(Section::Bandwidth) {
        rows.extend(bandwidth(&dev)?);
    }
    if wanted(Section::Training) {
        rows.extend(training_steps(&dev)?);
    }

    let peak = peak_of(&info.name);
    if let Some((tflops, gbs)) = peak {
        for row in &mut rows {
            let Some(v) = row.value else { continue };
            let share = match row.unit {
                "GFLOP/s" => Some(v / (tflops * 1e3)),
                "TFLOP/s" => Some(v / tflops),
                "GB/s" => Some(v / gbs),
                _ => None,
            };
            if let Some(share) = share {
                let sep = if row.note.is_empty() { "" } else { "; " };
                row.note = format!("{}{sep}{:.0}% of peak", row.note, share * 100.0);
            }
        }
    }
    let limits = format!(
        "kernel flavour {:?}, subgroup size {}, F16 reads {:?}, max binding {} MiB, max tensor {} MiB",
        dev.kernel_flavor(),
        dev.subgroup_size()
            .map_or("n/a".to_string(), |s| s.to_string()),
        dev.f16_reads(),
        dev.max_binding_bytes() >> 20,
        dev.max_tensor_bytes() >> 20
    );
    let peak_text = peak.map_or("n/a (not a GPU this report knows)".to_string(), |(t, g)| {
        format!("{t} TFLOPS fp32, {g} GB/s")
    });
    if args.json {
        let json = serde_json::json!({
            "adapter": info.name,
            "backend": format!("{:?}", info.backend),
            "device_type": format!("{:?}", info.device_type),
            "driver": info.driver,
            "limits": limits,
            "peak": peak_text,
            "rows": rows.iter().map(|r| serde_json::json!({
                "section": r.section, "name": r.name, "value": r.value, "unit": r.unit, "note": r.note,
            })).collect::<Vec<_>>(),
        });
        println!("{json:#}");
    } else {
        println!(
            "## {} ({:?}, {:?})\n",
            info.name, info.backend, info.device_type
        );
        println!("Driver: {}. {limits}. Peak: {peak_text}.\n", info.driver);
        println!("| section | bench | value | unit | note |");
        println!("|---|---|---|---|---|");
        for r in &rows {
            let value = r.value.map_or("n/a".to_string(), format_value);
            println!(
                "| {} | {} | {value} | {} | {} |",
                r.section, r.name, r.unit, r.note
            );
        }
    }
    Ok(())
}

fn format_value(v: f64) -> String {
    if v >= 100.0 {
        format!("{v:.0}")
    } else if v >= 1.0 {
        format!("{v:.2}")
    } else {
        format!("{v:.4}")
    }
}

/// The median seconds of `run` (waited for), after `warm_up` runs, over at least `min_runs`
/// runs and about `budget` of time.
fn median_secs(
    dev: &Device,
    warm_up: usize,
    min_runs: usize,
    budget: Duration,
    mut run: impl FnMut() -> Result<()>,
) -> Result<f64> {
    for _ in 0..warm_up {
        run()?;
        dev.synchronize()?;
    }
    let started = Instant::now();
    let mut samples = Vec::new();
    while samples.len() < min_runs || (started.elapsed() < budget && samples.len() < 100) {
        let t = Instant::now();
        run()?;
        dev.synchronize()?;
        samples.push(t.elapsed().as_secs_f64());
    }
    samples.sort_by(f64::total_cmp);
    Ok(samples[samples.len() / 2])
}

/// Square products in F32, then with F16 and BF16 operands (read as they are, accumulated in
/// f32, the result rounded once), each beside the F32 figure of its size.
fn matmul(dev: &Device, sizes: &[usize]) -> Result<Vec<Row>> {
    let mut rows = Vec::new();
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        for &n in sizes {
            let a = Tensor::rand(&[n, n], 1, dev)?.to_dtype(dtype)?;
            let b = Tensor::rand(&[n, n], 2, dev)?.to_dtype(dtype)?;
            let budget = Duration::from_secs(2);
            let secs = median_secs(dev, 1, 3, budget, || a.matmul(&b).map(drop))?;
            let gflops = 2.0 * (n as f64).powi(3) / secs / 1e9;
            eprintln!("matmul {dtype:?} {n}: {gflops:.1} GFLOP/s");
            rows.push(Row::new(
                "matmul",
                format!("{dtype:?} {n}x{n}x{n}"),
                gflops,
                "GFLOP/s",
            ));
        }
    }
    Ok(rows)
}

/// sdpa over `[1, 8, T, 64]` q, k, v, not causal: forward, and forward with backward.
/// FLOPs: 4 T^2 D per head forward, 2.5 times that backward (FlashAttention's count).
fn attention(dev: &Device, lengths: &[usize]) -> Result<Vec<Row>> {
    let (heads, head_dim) = (8, 64);
    let mut rows = Vec::new();
    for &t in lengths {
        let shape = [1, heads, t, head_dim];
        let leaf =
            |seed| -> Result<Tensor> { Ok(Tensor::randn(&shape, seed, dev)?.requires_grad_(true)) };
        let (q, k, v) = (leaf(1)?, leaf(2)?, leaf(3)?);
        let forward_flops = 4.0 * (heads * head_dim) as f64 * (t as f64).powi(2);
        let budget = Duration::from_secs(2);
        let forward = median_secs(dev, 1, 2, budget, || {
            wgrad::no_grad(|| q.scaled_dot_product_attention(&k, &v, false).map(drop))
        })?;
        let both = median_secs(dev, 1, 2, budget, || {
            let o = q.scaled_dot_product_attention(&k, &v, false)?;
            o.sum()?.backward()?;
            for leaf in [&q, &k, &v] {
                leaf.zero_grad();
            }
            Ok(())
        })?;
        let (fwd, fwd_bwd) = (
            forward_flops / forward / 1e12,
            3.5 * forward_flops / both / 1e12,
        );
        eprintln!("sdpa T={t}: forward {fwd:.4} TFLOP/s, forward+backward {fwd_bwd:.4} TFLOP/s");
        let name = |what: &str| format!("{what} [1, 8, {t}, 64]");
        rows.push(Row::new("sdpa", name("forward"), fwd, "TFLOP/s"));
        rows.push(Row::new(
            "sdpa",
            name("forward+backward"),
            fwd_bwd,
            "TFLOP/s",
        ));
    }
    Ok(rows)
}

/// Bytes moved per second: a buffer-to-buffer copy, a strided copy kernel (a transpose), and
/// `relu(a * b + c) * 0.5` eager (four kernels) and fused by a captured step (one).
fn bandwidth(dev: &Device) -> Result<Vec<Row>> {
    let side = 4096;
    let n = side * side;
    let bytes = (n * 4) as f64;
    let a = Tensor::rand(&[n], 1, dev)?;
    let b = Tensor::rand(&[n], 2, dev)?;
    let c = Tensor::rand(&[n], 3, dev)?;
    let budget = Duration::from_secs(2);
    let gbs = |moved: f64, secs: f64| moved / secs / 1e9;
    let mut rows = Vec::new();

    let copy = median_secs(dev, 1, 3, budget, || a.deep_clone().map(drop))?;
    rows.push(Row::new(
        "bandwidth",
        "copy 64 MiB (buffer to buffer)".into(),
        gbs(2.0 * bytes, copy),
        "GB/s",
    ));
    let square = a.reshape(&[side, side])?.t()?;
    let strided = median_secs(dev, 1, 3, budget, || square.contiguous().map(drop))?;
    rows.push(Row::new(
        "bandwidth",
        "transpose 4096x4096 (copy kernel)".into(),
        gbs(2.0 * bytes, strided),
        "GB/s",
    ));

    let chain = |x: &[Tensor]| x[0].mul(&x[1])?.add(&x[2])?.relu()?.mul_scalar(0.5);
    let inputs = [a.clone(), b.clone(), c.clone()];
    let eager = median_secs(dev, 1, 3, budget, || chain(&inputs).map(drop))?;
    // Four kernels, each reading its inputs and writing its output: 10 passes over n floats.
    rows.push(
        Row::new(
            "bandwidth",
            "relu(a*b+c)*0.5 eager".into(),
            gbs(10.0 * bytes, eager),
            "GB/s",
        )
        .note("4 kernels, 10 passes over 64 MiB".into()),
    );
    let mut step = Step::new(|x: &[Tensor]| chain(x));
    let fused = median_secs(dev, 3, 3, budget, || step.run(&inputs).map(drop))?;
    rows.push(
        Row::new(
            "bandwidth",
            "relu(a*b+c)*0.5 captured".into(),
            gbs(4.0 * bytes, fused),
            "GB/s",
        )
        .note(format!(
            "{} dispatch(es) per replay, 4 passes",
            step.stats().replay_dispatches
        )),
    );
    Ok(rows)
}

/// A model's training step to time: the loss of a batch, with its optimizer.
struct Workload {
    name: &'static str,
    /// Samples (or tokens) per step, and the unit's name.
    per_step: (usize, &'static str),
    model: Box<dyn Module>,
    inputs: [Tensor; 2],
    /// The loss of the model's output against the targets.
    loss: fn(&Tensor, &Tensor) -> Result<Tensor>,
    /// The dtype the forward runs under `wgrad::autocast` in, if any (parameters and AdamW
    /// state stay F32; no loss scaling, whose flag would be read back each step). Such a
    /// workload follows its F32 twin in the list, and its times are also given as a share of
    /// the twin's (issue 26's GPU line: at most 0.7x for the GPT).
    autocast: Option<DType>,
}

fn class_loss(logits: &Tensor, labels: &Tensor) -> Result<Tensor> {
    nn::loss::cross_entropy(logits, labels)
}

fn token_loss(logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
    let vocab = logits.shape()[2];
    nn::loss::cross_entropy(&logits.reshape(&[targets.numel(), vocab])?, targets)
}

/// The GPT of `examples/gpt.rs` and `benches/attention.rs`: 4 blocks of width 128, 4 heads.
#[derive(Module)]
struct Gpt {
    token: nn::Embedding,
    position: nn::Embedding,
    blocks: Vec<nn::TransformerBlock>,
    ln_f: nn::LayerNorm,
    head: nn::Linear,
}

impl Gpt {
    fn new(vocab: usize, width: usize, block: usize, dev: &Device) -> Result<Gpt> {
        Ok(Gpt {
            token: nn::Embedding::new(vocab, width, dev)?,
            position: nn::Embedding::new(block, width, dev)?,
            blocks: (0..4)
                .map(|_| nn::TransformerBlock::new(width, 4, true, 0.0, dev))
                .collect::<Result<_>>()?,
            ln_f: nn::LayerNorm::new(width, 1e-5, dev)?,
            head: nn::Linear::new(width, vocab, false, dev)?,
        })
    }

    fn forward(&self, tokens: &Tensor) -> Result<Tensor> {
        let t = tokens.shape()[1];
        let positions = Tensor::from_vec_u32((0..t as u32).collect(), &[t], tokens.device())?;
        let mut h = self
            .token
            .forward(tokens)?
            .add(&self.position.forward(&positions)?)?;
        for block in &self.blocks {
            h = block.forward(&h)?;
        }
        self.head.forward(&self.ln_f.forward(&h)?)
    }
}

fn workloads(dev: &Device) -> Result<Vec<Workload>> {
    wgrad::manual_seed(0);
    let labels = |n: usize, classes: u32| {
        Tensor::from_labels((0..n as u32).map(|i| i % classes).collect(), dev)
    };
    let mlp = || -> Result<nn::Sequential> {
        Ok(nn::Sequential::new()
            .add(nn::Linear::new(784, 512, true, dev)?)
            .add(nn::Relu)
            .add(nn::Linear::new(512, 512, true, dev)?)
            .add(nn::Relu)
            .add(nn::Linear::new(512, 10, true, dev)?))
    };
    let cnn = nn::Sequential::new()
        .add(nn::Conv2d::new(1, 32, 3, 1, 1, dev)?)
        .add(nn::Relu)
        .add(nn::MaxPool2d::new(2, 2))
        .add(nn::Conv2d::new(32, 64, 3, 1, 1, dev)?)
        .add(nn::Relu)
        .add(nn::MaxPool2d::new(2, 2))
        .add(nn::Flatten)
        .add(nn::Linear::new(3136, 128, true, dev)?)
        .add(nn::Relu)
        .add(nn::Linear::new(128, 10, true, dev)?);
    let (block, batch) = (64, 12);
    let tokens = |vocab: usize| -> Result<[Tensor; 2]> {
        let ids: Vec<u32> = (0..batch * block).map(|i| (i * 7 % vocab) as u32).collect();
        Ok([
            Tensor::from_vec_u32(ids.clone(), &[batch, block], dev)?,
            Tensor::from_vec_u32(ids, &[batch * block], dev)?,
        ])
    };
    Ok(vec![
        Workload {
            name: "MLP 784-512-512-10, batch 128, AdamW",
            per_step: (128, "samples/s"),
            model: Box::new(mlp()?),
            inputs: [Tensor::rand(&[128, 784], 1, dev)?, labels(128, 10)?],
            loss: class_loss,
            autocast: None,
        },
        Workload {
            name: "MLP 784-512-512-10, batch 1024, AdamW",
            per_step: (1024, "samples/s"),
            model: Box::new(mlp()?),
            inputs: [Tensor::rand(&[1024, 784], 2, dev)?, labels(1024, 10)?],
            loss: class_loss,
            autocast: None,
        },
        Workload {
            name: "CNN (2 conv + 2 linear), batch 64, AdamW",
            per_step: (64, "samples/s"),
            model: Box::new(cnn),
            inputs: [Tensor::rand(&[64, 1, 28, 28], 3, dev)?, labels(64, 10)?],
            loss: class_loss,
            autocast: None,
        },
        Workload {
            name: "GPT 4x128, block 64, batch 12, AdamW",
            per_step: (batch * block, "tokens/s"),
            model: Box::new(Gpt::new(65, 128, block, dev)?),
            inputs: tokens(65)?,
            loss: token_loss,
            autocast: None,
        },
        Workload {
            name: "GPT 4x128, block 64, batch 12, AdamW, F16 autocast",
            per_step: (batch * block, "tokens/s"),
            model: Box::new(Gpt::new(65, 128, block, dev)?),
            inputs: tokens(65)?,
            loss: token_loss,
            autocast: Some(DType::F16),
        },
        Workload {
            name: "Llama 4x128 (GQA 4/2, SwiGLU), vocab 512, block 64, batch 12, AdamW",
            per_step: (batch * block, "tokens/s"),
            model: Box::new(Llama::new(LlamaConfig::small(512), dev)?),
            inputs: tokens(512)?,
            loss: token_loss,
            autocast: None,
        },
    ])
}

/// Each workload's first step (its kernels compiling, where no earlier section compiled
/// them), its eager and captured steps, and its peak device memory.
fn training_steps(dev: &Device) -> Result<Vec<Row>> {
    let mut rows = Vec::new();
    // The eager and captured step times of the last workload without autocast.
    let mut f32_twin = (f64::NAN, f64::NAN);
    for w in workloads(dev)? {
        let mut opt = optim::AdamW::new(w.model.parameters(), optim::AdamConfig::default());
        let mut train = |x: &[Tensor]| -> Result<Tensor> {
            opt.zero_grad();
            let forward = || (w.loss)(&w.model.forward(&x[0])?, &x[1]);
            let loss = match w.autocast {
                Some(dtype) => wgrad::autocast(dtype, forward)?,
                None => forward()?,
            };
            loss.backward()?;
            opt.step()?;
            Ok(loss)
        };
        let started = Instant::now();
        train(&w.inputs)?;
        dev.synchronize()?;
        let first = started.elapsed().as_secs_f64();
        dev.reset_peak_memory();
        let budget = Duration::from_secs(3);
        let eager = median_secs(dev, 1, 5, budget, || train(&w.inputs).map(drop))?;
        let peak = dev.stats().peak_live_bytes as f64 / (1 << 20) as f64;
        let mut step = Step::new(&mut train);
        let captured = median_secs(dev, 3, 5, budget, || step.run(&w.inputs).map(drop))?;
        let (count, unit) = w.per_step;
        let stats = step.stats();
        eprintln!(
            "{}: first {:.2} s, eager {:.1} ms, captured {:.1} ms",
            w.name,
            first,
            eager * 1e3,
            captured * 1e3
        );
        let name = |what: &str| format!("{} {what}", w.name);
        let share = |secs: f64, twin: f64| match w.autocast {
            Some(_) => format!(", {:.2}x the F32 step's time", secs / twin),
            None => String::new(),
        };
        rows.push(
            Row::new("training", name("first step"), first * 1e3, "ms")
                .note("compiles its kernels".into()),
        );
        rows.push(
            Row::new("training", name("eager"), eager * 1e3, "ms").note(format!(
                "{:.0} {unit}{}",
                count as f64 / eager,
                share(eager, f32_twin.0)
            )),
        );
        rows.push(
            Row::new("training", name("captured"), captured * 1e3, "ms").note(format!(
                "{:.0} {unit}, {} dispatches per replay, {} of {} calls replayed{}",
                count as f64 / captured,
                stats.replay_dispatches,
                stats.replays,
                stats.eager + stats.captures + stats.replays,
                share(captured, f32_twin.1)
            )),
        );
        if w.autocast.is_none() {
            f32_twin = (eager, captured);
        }
        rows.push(Row::new("training", name("peak memory"), peak, "MiB"));
    }
    Ok(rows)
}

/// Two `--json` reports side by side: each bench of A with B's figure and B / A.
fn compare(a: &PathBuf, b: &PathBuf) -> std::result::Result<(), String> {
    let read = |path: &PathBuf| -> std::result::Result<serde_json::Value, String> {
        let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
        serde_json::from_str(&text)
            .map_err(|e| format!("{}: not a --json report: {e}", path.display()))
    };
    let (a, b) = (read(a)?, read(b)?);
    let rows = |report: &serde_json::Value| report["rows"].as_array().cloned().unwrap_or_default();
    println!(
        "| bench | unit | A: {} | B: {} | B / A |",
        a["adapter"], b["adapter"]
    );
    println!("|---|---|---|---|---|");
    for row in rows(&a) {
        let key = (&row["section"], &row["name"]);
        let other = rows(&b)
            .into_iter()
            .find(|r| (&r["section"], &r["name"]) == key);
        let value = |r: &serde_json::Value| r["value"].as_f64();
        let (va, vb) = (value(&row), other.as_ref().and_then(value));
        let show = |v: Option<f64>| v.map_or("n/a".to_string(), format_value);
        let ratio = match (va, vb) {
            (Some(x), Some(y)) if x > 0.0 => format!("{:.2}x", y / x),
            _ => "n/a".to_string(),
        };
        println!(
            "| {} {} | {} | {} | {} | {ratio} |",
            row["section"].as_str().unwrap_or(""),
            row["name"].as_str().unwrap_or(""),
            row["unit"].as_str().unwrap_or(""),
            show(va),
            show(vb)
        );
    }
    Ok(())
}
