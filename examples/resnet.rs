//! A ResNet-18-style classifier: `cargo run --release --example resnet`.
//!
//! A 3x3 stem, then four stages of two BasicBlocks (3x3 conv, BatchNorm, ReLU, 3x3 conv,
//! BatchNorm, plus the shortcut) at widths `w, 2w, 4w, 8w`, each stage after the first
//! halving the resolution with a stride-2 block whose shortcut is a 1x1 stride-2 conv with
//! BatchNorm; adaptive average pooling to 1x1 and a linear head. SGD with Nesterov momentum
//! 0.9, weight decay 5e-4 on the kernels, a cosine schedule and label smoothing 0.1.
//!
//! Data: MNIST-format IDX files (`--data DIR`; Fashion-MNIST from Debian's
//! `dataset-fashion-mnist` package is used when it is installed and no `--data` is given),
//! CIFAR-10's binary format (`--data DIR` holding `data_batch_1.bin` .. `data_batch_5.bin` and
//! `test_batch.bin`), or a built-in synthetic image set. Ends with one line:
//! `final: test_acc=... train_loss=... steps=... samples_per_s=...`.

mod support;

use std::path::Path;
use std::time::Instant;

use clap::Parser;
use support::{OptimizerKind, Recipe, TrainArgs};
use wgrad::dist::Dist;
use wgrad::nn::{self, Module};
use wgrad::{io, Conv2dOptions, Device, Result, Tensor};

/// Train a ResNet-18-style classifier with wgrad.
#[derive(Parser, Debug)]
#[command(version, about)]
struct Args {
    #[command(flatten)]
    train: TrainArgs,
    /// Channels of the first stage (ResNet-18: 64); the stages have 1, 2, 4 and 8 times it.
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u64).range(1..))]
    width: u64,
}

/// The example's recipe: SGD, Nesterov momentum, weight decay, label smoothing.
const RESNET: Recipe = Recipe {
    optimizer: OptimizerKind::Sgd,
    lr: 0.1,
    weight_decay: 5e-4,
    nesterov: true,
    label_smoothing: 0.1,
};

/// Where Debian's `dataset-fashion-mnist` package puts the IDX files.
const FASHION_MNIST: &str = "/usr/share/datasets/fashion-mnist";

/// A conv without bias (BatchNorm follows) and its BatchNorm.
#[derive(Module)]
struct ConvBn {
    conv: nn::Conv2d,
    bn: nn::BatchNorm2d,
}

impl ConvBn {
    fn new(c_in: usize, c_out: usize, kernel: usize, stride: usize, dev: &Device) -> Result<Self> {
        let options = Conv2dOptions::square(stride, kernel / 2);
        Ok(ConvBn {
            conv: nn::Conv2d::with_options(c_in, c_out, (kernel, kernel), options, false, dev)?,
            bn: nn::BatchNorm2d::new(c_out, dev)?,
        })
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.bn.forward(&self.conv.forward(x)?)
    }
}

/// `relu(bn(conv(relu(bn(conv(x))))) + shortcut(x))`.
#[derive(Module)]
struct BasicBlock {
    first: ConvBn,
    second: ConvBn,
    /// A 1x1 conv with BatchNorm where the block changes width or resolution.
    downsample: Option<ConvBn>,
}

impl BasicBlock {
    fn new(c_in: usize, c_out: usize, stride: usize, dev: &Device) -> Result<Self> {
        let downsample = match stride != 1 || c_in != c_out {
            true => Some(ConvBn::new(c_in, c_out, 1, stride, dev)?),
            false => None,
        };
        Ok(BasicBlock {
            first: ConvBn::new(c_in, c_out, 3, stride, dev)?,
            second: ConvBn::new(c_out, c_out, 3, 1, dev)?,
            downsample,
        })
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let h = self.second.forward(&self.first.forward(x)?.relu()?)?;
        let shortcut = match &self.downsample {
            Some(down) => down.forward(x)?,
            None => x.clone(),
        };
        h.add(&shortcut)?.relu()
    }
}

/// The network, taking rows of `channels x side x side` values as the data sets hold them.
#[derive(Module)]
struct ResNet {
    #[module(skip)]
    channels: usize,
    #[module(skip)]
    side: usize,
    stem: ConvBn,
    blocks: Vec<BasicBlock>,
    head: nn::Linear,
}

impl ResNet {
    fn new(
        channels: usize,
        side: usize,
        width: usize,
        classes: usize,
        dev: &Device,
    ) -> Result<Self> {
        let mut blocks = Vec::new();
        let mut c_in = width;
        for stage in 0..4 {
            let c_out = width << stage;
            let stride = if stage == 0 { 1 } else { 2 };
            blocks.push(BasicBlock::new(c_in, c_out, stride, dev)?);
            blocks.push(BasicBlock::new(c_out, c_out, 1, dev)?);
            c_in = c_out;
        }
        Ok(ResNet {
            channels,
            side,
            stem: ConvBn::new(channels, width, 3, 1, dev)?,
            blocks,
            head: nn::Linear::new(c_in, classes, true, dev)?,
        })
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let images = x.reshape(&[x.shape()[0], self.channels, self.side, self.side])?;
        let mut h = self.stem.forward(&images)?.relu()?;
        for block in &self.blocks {
            h = block.forward(&h)?;
        }
        let pooled = h.adaptive_avg_pool2d((1, 1))?;
        self.head
            .forward(&pooled.reshape(&[x.shape()[0], pooled.shape()[1]])?)
    }
}

/// CIFAR-10's binary format: records of a label byte and 3,072 pixel bytes (red, green and
/// blue planes of 32x32), scaled to [0, 1].
fn read_cifar(dir: &Path) -> std::result::Result<(io::Dataset, io::Dataset), String> {
    let read = |names: &[String]| -> std::result::Result<io::Dataset, String> {
        let mut data = io::Dataset {
            inputs: Vec::new(),
            labels: Vec::new(),
            features: 3 * 32 * 32,
            classes: 10,
        };
        for name in names {
            let path = dir.join(name);
            let bytes =
                std::fs::read(&path).map_err(|e| format!("reading {}: {e}", path.display()))?;
            if bytes.is_empty() || !bytes.len().is_multiple_of(3073) {
                return Err(format!(
                    "{}: {} bytes is not a whole number of 3,073-byte CIFAR-10 records",
                    path.display(),
                    bytes.len()
                ));
            }
            for record in bytes.chunks(3073) {
                if record[0] >= 10 {
                    return Err(format!(
                        "{}: label {} is not below 10",
                        path.display(),
                        record[0]
                    ));
                }
                data.labels.push(record[0] as u32);
                data.inputs
                    .extend(record[1..].iter().map(|&b| b as f32 / 255.0));
            }
        }
        Ok(data)
    };
    let train: Vec<String> = (1..=5).map(|i| format!("data_batch_{i}.bin")).collect();
    Ok((read(&train)?, read(&["test_batch.bin".to_string()])?))
}

fn main() {
    let process_start = Instant::now();
    let args = Args::parse();
    if let Err(message) = run(args, process_start) {
        eprintln!("error: {message}");
        std::process::exit(1);
    }
}

fn run(mut args: Args, process_start: Instant) -> std::result::Result<(), String> {
    let recipe = args.train.recipe(&RESNET)?;
    let dist = Dist::init().map_err(|e| e.to_string())?;
    let dev = Device::new().map_err(|e| e.to_string())?;
    support::say(&dist, format!("adapter: {}", dev.info()));
    if args.train.data.is_none() && Path::new(FASHION_MNIST).is_dir() {
        args.train.data = Some(FASHION_MNIST.into());
    }
    let cifar = args
        .train
        .data
        .as_ref()
        .filter(|d| d.join("data_batch_1.bin").exists())
        .cloned();
    let (train, test) = match &cifar {
        Some(dir) => {
            let sets = read_cifar(dir)?;
            support::say(
                &dist,
                format!(
                    "data: {} (CIFAR-10): {} train / {} test images",
                    dir.display(),
                    sets.0.len(),
                    sets.1.len()
                ),
            );
            sets
        }
        None => args.train.dataset(
            &dist,
            |seed| io::synthetic_shapes(2000, 1000, seed),
            "synthetic shapes",
        )?,
    };
    let channels = if cifar.is_some() { 3 } else { 1 };
    let side = ((train.features / channels) as f64).sqrt().round() as usize;
    if channels * side * side != train.features || side < 8 {
        return Err(format!(
            "the ResNet needs square images of at least 8x8, got {} values per example",
            train.features
        ));
    }
    wgrad::manual_seed(args.train.seed);
    let width = args.width as usize;
    let model =
        ResNet::new(channels, side, width, train.classes, &dev).map_err(|e| e.to_string())?;
    let count: usize = model.parameters().iter().map(|p| p.numel()).sum();
    support::say(
        &dist,
        format!(
            "model: ResNet-18-style, widths {width}/{}/{}/{}, {count} parameters; {:?} lr {} \
             nesterov {} weight decay {} label smoothing {}",
            2 * width,
            4 * width,
            8 * width,
            recipe.optimizer,
            recipe.lr,
            recipe.nesterov,
            recipe.weight_decay,
            recipe.label_smoothing
        ),
    );
    support::fit(
        &model,
        (train, &test),
        &dev,
        &args.train,
        &recipe,
        &dist,
        process_start,
    )
}
