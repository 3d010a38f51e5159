//! The memory mixed precision saves: a GPT training step under F16 autocast keeps what its
//! backward needs in 16 bits (the matmuls' inputs, attention's q, k, v and output, GELU's
//! input), so its peak device memory is well below the f32 step's. Parameters, grads, AdamW's
//! moments and the residual stream stay f32, as under torch.autocast.
//!
//! Issue 26 asks for at most 0.65x at gpt.rs's defaults and batch 32 (its Shakespeare
//! vocabulary of 84 rows); measured 0.645x (53.62 against 83.11 MB). The peak is the last
//! block's MLP backward, where the saved 16-bit activations of all four blocks are still held
//! beside the F32 residual stream, the F32 parameters, their grads and AdamW's moments (as
//! under torch.autocast). Each step runs on a device of its own, so the peak is that step's
//! alone.

use wgrad::nn::{self, Module};
use wgrad::optim::{AdamConfig, AdamW, GradScaler, Optimizer};
use wgrad::{autocast, DType, Device, Result, Tensor};

const VOCAB: usize = 84;
const WIDTH: usize = 128;
const BLOCK: usize = 64;
const BATCH: usize = 32;

/// gpt.rs's default model: 4 pre-norm blocks of width 128, 4 heads, an untied head.
#[derive(wgrad::Module)]
struct Gpt {
    token: nn::Embedding,
    position: nn::Embedding,
    blocks: Vec<nn::TransformerBlock>,
    ln_f: nn::LayerNorm,
    head: nn::Linear,
}

impl Gpt {
    fn new(dev: &Device) -> Result<Gpt> {
        Ok(Gpt {
            token: nn::Embedding::new(VOCAB, WIDTH, dev)?,
            position: nn::Embedding::new(BLOCK, WIDTH, dev)?,
            blocks: (0..4)
                .map(|_| nn::TransformerBlock::new(WIDTH, 4, true, 0.0, dev))
                .collect::<Result<_>>()?,
            ln_f: nn::LayerNorm::new(WIDTH, 1e-5, dev)?,
            head: nn::Linear::new(WIDTH, VOCAB, true, dev)?,
        })
    }

    fn forward(&self, tokens: &Tensor) -> Result<Tensor> {
        let positions = Tensor::from_labels((0..BLOCK as u32).collect(), tokens.device())?;
        let mut x = self
            .token
            .forward(tokens)?
            .add(&self.position.forward(&positions)?)?;
        for block in &self.blocks {
            x = block.forward(&x)?;
        }
        self.head.forward(&self.ln_f.forward(&x)?)
    }
}

/// The peak live bytes of the second training step (the first creates AdamW's moments), f32
/// throughout or under autocast to `dtype`.
fn step_peak(dtype: Option<DType>) -> u64 {
    let dev = Device::new().unwrap();
    wgrad::manual_seed(7);
    let model = Gpt::new(&dev).unwrap();
    let mut opt = AdamW::new(model.parameters(), AdamConfig::default());
    let mut scaler = GradScaler::new();
    let tokens: Vec<u32> = (0..BATCH * BLOCK).map(|i| (i * 7 % VOCAB) as u32).collect();
    let targets: Vec<u32> = (0..BATCH * BLOCK).map(|i| (i * 5 % VOCAB) as u32).collect();
    let tokens = Tensor::from_labels(tokens, &dev)
        .unwrap()
        .reshape(&[BATCH, BLOCK])
        .unwrap();
    let targets = Tensor::from_labels(targets, &dev).unwrap();
    let mut peak = 0;
    for step in 0..2 {
        dev.synchronize().unwrap();
        dev.reset_peak_memory();
        let loss = |t: &Tensor| -> Result<Tensor> {
            let logits = model.forward(t)?.reshape(&[BATCH * BLOCK, VOCAB])?;
            nn::loss::cross_entropy(&logits, &targets)
        };
        opt.zero_grad();
        match dtype {
            None => {
                loss(&tokens).unwrap().backward().unwrap();
                opt.step().unwrap();
            }
            Some(dtype) => {
                let loss = autocast(dtype, || loss(&tokens)).unwrap();
                scaler.scale(&loss).unwrap().backward().unwrap();
                scaler.step(&mut opt).unwrap();
                scaler.update().unwrap();
            }
        }
        dev.synchronize().unwrap();
        if step == 1 {
            peak = dev.stats().peak_live_bytes;
        }
    }
    peak
}

#[test]
fn a_gpt_step_under_f16_autocast_peaks_at_most_0_65_of_the_f32_step() {
    let f32_peak = step_peak(None);
    let f16_peak = step_peak(Some(DType::F16));
    let ratio = f16_peak as f64 / f32_peak as f64;
    eprintln!("peak live bytes: f32 {f32_peak}, f16 autocast {f16_peak} ({ratio:.3}x)");
    assert!(
        ratio <= 0.65,
        "f16 autocast peaks at {f16_peak} bytes, {ratio:.3}x the f32 step's {f32_peak}"
    );
}
