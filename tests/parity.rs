//! Parity with PyTorch: the CNN of examples/cnn.rs (narrower, on 12x12 images), one
//! pre-norm transformer block of examples/gpt.rs, a Llama decoder block (RMSNorm, RoPE, SwiGLU,
//! grouped-query attention with a padding mask), a ResNet BasicBlock with a stride-2
//! downsample, and a U-Net decoder block (ConvTranspose2d, GroupNorm, bilinear interpolation),
//! with the weights and batch PyTorch used, give PyTorch's loss and every grad (parameters and
//! input) to 1e-4 relative. The fixtures are written by `tools/pytorch_parity.py` (PyTorch in
//! float64) and committed.

mod common;
use common::*;
use std::path::{Path, PathBuf};
use wgrad::nn::{self, Module};
use wgrad::{ConvTranspose2dOptions, Interpolate, Pool2dOptions, Result, SdpaOptions, Tensor};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(format!("{name}.safetensors"))
}

/// Every tensor of a fixture file: name -> (shape, values).
fn read(path: &Path) -> std::collections::HashMap<String, (Vec<usize>, Vec<f32>)> {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let file = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    file.tensors()
        .into_iter()
        .map(|(name, view)| {
            let values = bytemuck::pod_collect_to_vec::<u8, f32>(view.data());
            (name, (view.shape().to_vec(), values))
        })
        .collect()
}

/// Checks the loss, the input's grad and every parameter's grad against the fixture.
fn check(
    name: &str,
    model: &dyn Module,
    loss_of: impl Fn(&Tensor, &std::collections::HashMap<String, (Vec<usize>, Vec<f32>)>) -> Tensor,
) {
    let path = fixture(name);
    // The fixture also holds the batch, the loss and the grads: load skips those.
    let skipped =
        wgrad::io::load_with(&path, model, wgrad::io::LoadOptions { strict: false }).unwrap();
    assert!(
        skipped
            .iter()
            .all(|n| !n.contains("weight") || n.starts_with("grad.")),
        "{skipped:?}"
    );
    let want = read(&path);
    let (shape, values) = &want["input"];
    let x = Tensor::from_slice(values, shape, device())
        .unwrap()
        .requires_grad_(true);
    let loss = loss_of(&x, &want);
    let f64s = |v: &[f32]| v.iter().map(|&x| x as f64).collect::<Vec<f64>>();
    assert_close(
        &[loss.item().unwrap()],
        &f64s(&want["loss"].1),
        1e-4,
        &format!("{name}: loss"),
    );
    loss.backward().unwrap();
    let mut checked = 0;
    let params = model.named_parameters();
    let inputs = params.iter().map(|(n, t)| (n.clone(), t.clone()));
    for (param, tensor) in inputs.chain([("input".to_string(), x.clone())]) {
        let (shape, grad) = &want[&format!("grad.{param}")];
        assert_eq!(tensor.shape(), shape.as_slice(), "{name}: {param} shape");
        let got = tensor
            .grad()
            .unwrap_or_else(|| panic!("{name}: {param} got no grad"));
        assert_close(
            &got.to_vec().unwrap(),
            &f64s(grad),
            1e-4,
            &format!("{name}: grad of {param}"),
        );
        checked += 1;
    }
    assert_eq!(checked, params.len() + 1);
}

#[test]
fn cnn_loss_and_grads_match_pytorch() {
    let dev = device();
    let model = nn::Sequential::new()
        .add(nn::Conv2d::new(1, 4, 3, 1, 1, dev).unwrap())
        .add(nn::Relu)
        .add(nn::MaxPool2d::new(2, 2))
        .add(nn::Conv2d::new(4, 8, 3, 1, 1, dev).unwrap())
        .add(nn::Relu)
        .add(nn::MaxPool2d::new(2, 2))
        .add(nn::Flatten)
        .add(nn::Linear::new(72, 16, true, dev).unwrap())
        .add(nn::Relu)
        .add(nn::Linear::new(16, 10, true, dev).unwrap());
    check("parity_cnn", &model, |x, want| {
        let labels: Vec<u32> = want["labels"].1.iter().map(|&l| l as u32).collect();
        let labels = Tensor::from_labels(labels, dev).unwrap();
        nn::loss::cross_entropy(&model.forward(x).unwrap(), &labels).unwrap()
    });
}

#[test]
fn transformer_block_loss_and_grads_match_pytorch() {
    let dev = device();
    let block = nn::TransformerBlock::new(16, 4, true, 0.0, dev).unwrap();
    check("parity_block", &block, |x, want| {
        let (shape, probe) = &want["probe"];
        let probe = Tensor::from_slice(probe, shape, dev).unwrap();
        block
            .forward(x)
            .unwrap()
            .mul(&probe)
            .unwrap()
            .sum()
            .unwrap()
    });
}

/// A fixture's tensor `name` on the device.
fn tensor_of(want: &Fixture, name: &str) -> Tensor {
    let (shape, values) = &want[name];
    Tensor::from_slice(values, shape, device()).unwrap()
}

type Fixture = std::collections::HashMap<String, (Vec<usize>, Vec<f32>)>;

/// `module`'s named tensors under `prefix.`.
fn prefixed(prefix: &str, named: Vec<(String, Tensor)>) -> Vec<(String, Tensor)> {
    named
        .into_iter()
        .map(|(n, t)| (format!("{prefix}.{n}"), t))
        .collect()
}

/// transformers' LlamaDecoderLayer, as a user writes it with wgrad's layers.
struct LlamaBlock {
    input_layernorm: nn::RmsNorm,
    q_proj: nn::Linear,
    k_proj: nn::Linear,
    v_proj: nn::Linear,
    o_proj: nn::Linear,
    post_attention_layernorm: nn::RmsNorm,
    gate_proj: nn::Linear,
    up_proj: nn::Linear,
    down_proj: nn::Linear,
    rope: nn::RotaryEmbedding,
    heads: usize,
    kv_heads: usize,
}

impl LlamaBlock {
    fn new(dim: usize, heads: usize, kv_heads: usize, hidden: usize) -> LlamaBlock {
        let dev = device();
        let hd = dim / heads;
        let linear = |i, o| nn::Linear::new(i, o, false, dev).unwrap();
        LlamaBlock {
            input_layernorm: nn::RmsNorm::new(dim, 1e-6, dev).unwrap(),
            q_proj: linear(dim, heads * hd),
            k_proj: linear(dim, kv_heads * hd),
            v_proj: linear(dim, kv_heads * hd),
            o_proj: linear(heads * hd, dim),
            post_attention_layernorm: nn::RmsNorm::new(dim, 1e-6, dev).unwrap(),
            gate_proj: linear(dim, hidden),
            up_proj: linear(dim, hidden),
            down_proj: linear(hidden, dim),
            rope: nn::RotaryEmbedding::new(hd, 64, 10000.0, dev).unwrap(),
            heads,
            kv_heads,
        }
    }

    /// `x` `[B, T, dim]` with `keep` `[B, 1, 1, T]` (1: a real token).
    fn forward_with(&self, x: &Tensor, keep: &Tensor) -> Result<Tensor> {
        let (b, t) = (x.shape()[0], x.shape()[1]);
        let h = self.input_layernorm.forward(x)?;
        let heads = |proj: &nn::Linear, n: usize| -> Result<Tensor> {
            proj.forward(&h)?
                .reshape(&[b, t, n, proj.weight.shape()[0] / n])?
                .transpose(1, 2)
        };
        let q = self.rope.apply(&heads(&self.q_proj, self.heads)?, 0)?;
        let k = self.rope.apply(&heads(&self.k_proj, self.kv_heads)?, 0)?;
        let v = heads(&self.v_proj, self.kv_heads)?;
        let opts = SdpaOptions {
            causal: true,
            mask: Some(keep),
            scale: None,
        };
        let attended = q.scaled_dot_product_attention_with(&k, &v, &opts)?;
        let merged = attended
            .transpose(1, 2)?
            .reshape(&[b, t, q.shape()[1] * q.shape()[3]])?;
        let x = x.add(&self.o_proj.forward(&merged)?)?;
        let h = self.post_attention_layernorm.forward(&x)?;
        let gated = self
            .gate_proj
            .forward(&h)?
            .silu()?
            .mul(&self.up_proj.forward(&h)?)?;
        x.add(&self.down_proj.forward(&gated)?)
    }
}

impl Module for LlamaBlock {
    fn forward(&self, _x: &Tensor) -> Result<Tensor> {
        unreachable!("the block takes a padding mask: forward_with")
    }

    fn named_parameters(&self) -> Vec<(String, Tensor)> {
        let parts: [(&str, &dyn Module); 9] = [
            ("input_layernorm", &self.input_layernorm),
            ("q_proj", &self.q_proj),
            ("k_proj", &self.k_proj),
            ("v_proj", &self.v_proj),
            ("o_proj", &self.o_proj),
            ("post_attention_layernorm", &self.post_attention_layernorm),
            ("gate_proj", &self.gate_proj),
            ("up_proj", &self.up_proj),
            ("down_proj", &self.down_proj),
        ];
        parts
            .into_iter()
            .flat_map(|(name, m)| prefixed(name, m.named_parameters()))
            .collect()
    }
}

#[test]
fn llama_block_with_gqa_rope_and_a_padding_mask_matches_pytorch() {
    let block = LlamaBlock::new(16, 4, 2, 24);
    check("parity_llama_block", &block, |x, want| {
        let keep: Vec<u32> = want["keep"].1.iter().map(|&k| k as u32).collect();
        let t = keep.len() / 2;
        let keep = Tensor::from_vec_u32(keep, &[2, 1, 1, t], device()).unwrap();
        let probe = tensor_of(want, "probe");
        block
            .forward_with(x, &keep)
            .unwrap()
            .mul(&probe)
            .unwrap()
            .sum()
            .unwrap()
    });
}

/// torchvision's BasicBlock with a stride-2 downsample, behind a padded max-pool stem and
/// ahead of global pooling and a classifier.
struct ResNetBlock {
    conv1: nn::Conv2d,
    bn1: nn::BatchNorm2d,
    conv2: nn::Conv2d,
    bn2: nn::BatchNorm2d,
    downsample: nn::Sequential,
    fc: nn::Linear,
}

impl ResNetBlock {
    fn new(c_in: usize, c_out: usize, classes: usize) -> ResNetBlock {
        let dev = device();
        let conv = |i, o, k: usize, stride, padding| {
            let options = wgrad::Conv2dOptions::square(stride, padding);
            nn::Conv2d::with_options(i, o, (k, k), options, false, dev).unwrap()
        };
        ResNetBlock {
            conv1: conv(c_in, c_out, 3, 2, 1),
            bn1: nn::BatchNorm2d::new(c_out, dev).unwrap(),
            conv2: conv(c_out, c_out, 3, 1, 1),
            bn2: nn::BatchNorm2d::new(c_out, dev).unwrap(),
            downsample: nn::Sequential::new()
                .add(conv(c_in, c_out, 1, 2, 0))
                .add(nn::BatchNorm2d::new(c_out, dev).unwrap()),
            fc: nn::Linear::new(c_out, classes, true, dev).unwrap(),
        }
    }

    fn parts(&self) -> [(&str, &dyn Module); 6] {
        [
            ("conv1", &self.conv1),
            ("bn1", &self.bn1),
            ("conv2", &self.conv2),
            ("bn2", &self.bn2),
            ("downsample", &self.downsample),
            ("fc", &self.fc),
        ]
    }
}

impl Module for ResNetBlock {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let stem = Pool2dOptions {
            padding: 1,
            ..Pool2dOptions::new(3, 2)
        };
        let x = x.max_pool2d_with(&stem)?;
        let out = self.bn1.forward(&self.conv1.forward(&x)?)?.relu()?;
        let out = self.bn2.forward(&self.conv2.forward(&out)?)?;
        let out = out.add(&self.downsample.forward(&x)?)?.relu()?;
        self.fc
            .forward(&out.adaptive_avg_pool2d((1, 1))?.flatten(1)?)
    }

    fn named_parameters(&self) -> Vec<(String, Tensor)> {
        self.parts()
            .into_iter()
            .flat_map(|(name, m)| prefixed(name, m.named_parameters()))
            .collect()
    }

    fn named_buffers(&self) -> Vec<(String, Tensor)> {
        self.parts()
            .into_iter()
            .flat_map(|(name, m)| prefixed(name, m.named_buffers()))
            .collect()
    }
}

#[test]
fn resnet_basic_block_with_a_stride_2_downsample_matches_pytorch() {
    let block = ResNetBlock::new(3, 8, 5);
    check("parity_resnet_block", &block, |x, want| {
        let labels: Vec<u32> = want["labels"].1.iter().map(|&l| l as u32).collect();
        let labels = Tensor::from_labels(labels, device()).unwrap();
        let opts = nn::loss::CrossEntropyOptions {
            label_smoothing: 0.1,
            ..Default::default()
        };
        nn::loss::cross_entropy_with(&block.forward(x).unwrap(), &labels, &opts).unwrap()
    });
}

/// A U-Net decoder block: ConvTranspose2d up, GroupNorm and SiLU, the skip resampled
/// bilinearly and concatenated, a convolution.
struct UNetUp {
    up: nn::ConvTranspose2d,
    norm: nn::GroupNorm,
    conv: nn::Conv2d,
}

impl UNetUp {
    fn forward_with(&self, x: &Tensor, skip: &Tensor) -> Result<Tensor> {
        let u = self.norm.forward(&self.up.forward(x)?)?.silu()?;
        let (h, w) = (u.shape()[2], u.shape()[3]);
        let s = skip.interpolate((h, w), Interpolate::Bilinear)?;
        self.conv.forward(&Tensor::cat(&[u, s], 1)?)
    }
}

impl Module for UNetUp {
    fn forward(&self, _x: &Tensor) -> Result<Tensor> {
        unreachable!("the block takes a skip connection: forward_with")
    }

    fn named_parameters(&self) -> Vec<(String, Tensor)> {
        let parts: [(&str, &dyn Module); 3] =
            [("up", &self.up), ("norm", &self.norm), ("conv", &self.conv)];
        parts
            .into_iter()
            .flat_map(|(name, m)| prefixed(name, m.named_parameters()))
            .collect()
    }
}

#[test]
fn unet_decoder_block_matches_pytorch() {
    let dev = device();
    let up = ConvTranspose2dOptions {
        stride: 2,
        padding: 1,
        output_padding: 1,
        ..Default::default()
    };
    let block = UNetUp {
        up: nn::ConvTranspose2d::new(8, 4, 3, up, true, dev).unwrap(),
        norm: nn::GroupNorm::new(2, 4, 1e-5, dev).unwrap(),
        conv: nn::Conv2d::new(7, 4, 3, 1, 1, dev).unwrap(),
    };
    check("parity_unet_up", &block, |x, want| {
        let skip = tensor_of(want, "skip");
        let probe = tensor_of(want, "probe");
        block
            .forward_with(x, &skip)
            .unwrap()
            .mul(&probe)
            .unwrap()
            .sum()
            .unwrap()
    });
}
