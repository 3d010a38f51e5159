//! GPT-2, as transformers' `GPT2LMHeadModel`: token and position embeddings, pre-norm blocks
//! of LayerNorm, causal attention and a GELU MLP (OpenAI's `Conv1D` projections, weights
//! `[in, out]`), a final LayerNorm and a head tied to the token embedding.

use std::path::Path;

use serde_json::{json, Map, Value};

use crate::device::Device;
use crate::error::{Error, Result};
use crate::models::decoder::{self, Attend, Decoder, DecoderShape, Sampling};
use crate::models::pretrained::{self, Config, Init, LoadDType, Source, WeightDType, Weights};
use crate::nn::{self, prefixed, Module};
use crate::tensor::Tensor;

const OP_LOAD: &str = "Gpt2::from_pretrained";
const OP: &str = "Gpt2::forward";

/// A GPT-2's shape, as `config.json` gives it (transformers' `GPT2Config` field names).
#[derive(Debug, Clone, PartialEq)]
pub struct Gpt2Config {
    /// Rows of the token embedding (and of the head).
    pub vocab_size: usize,
    /// The residual stream's width.
    pub n_embd: usize,
    /// Blocks.
    pub n_layer: usize,
    /// Attention heads.
    pub n_head: usize,
    /// Rows of the position embedding: the longest sequence.
    pub n_positions: usize,
    /// The MLP's inner width (`4 n_embd` unless stated).
    pub n_inner: usize,
    /// Added to the variance in every LayerNorm.
    pub layer_norm_epsilon: f32,
    /// The MLP's activation: `gelu_new` (tanh form, GPT-2's), `gelu_pytorch_tanh`, `gelu`
    /// (exact), `relu` or `silu`.
    pub activation_function: String,
    /// Scores scaled by `1 / sqrt(head_dim)` (GPT-2: yes).
    pub scale_attn_weights: bool,
    /// Scores of block `i` further divided by `i + 1`.
    pub scale_attn_by_inverse_layer_idx: bool,
    /// The head shares the token embedding's matrix (GPT-2: yes).
    pub tie_word_embeddings: bool,
    /// Standard deviation of the weights of a model built from the config alone.
    pub initializer_range: f32,
    /// The rest of `config.json`, written back as it was.
    pub extra: Map<String, Value>,
}

impl Gpt2Config {
    fn read(op: &'static str, c: &Config) -> Result<Gpt2Config> {
        c.expect_model_type(op, "gpt2")?;
        c.refuse(op, "add_cross_attention", &[json!(false)])?;
        let n_embd = c.usize(op, "n_embd", None)?;
        let config = Gpt2Config {
            vocab_size: c.usize(op, "vocab_size", None)?,
            n_embd,
            n_layer: c.usize(op, "n_layer", None)?,
            n_head: c.usize(op, "n_head", None)?,
            n_positions: c.usize(op, "n_positions", None)?,
            n_inner: c.usize(op, "n_inner", Some(4 * n_embd))?,
            layer_norm_epsilon: c.f32(op, "layer_norm_epsilon", Some(1e-5))?,
            activation_function: c.string(op, "activation_function", "gelu_new")?,
            scale_attn_weights: c.bool(op, "scale_attn_weights", true)?,
            scale_attn_by_inverse_layer_idx: c.bool(
                op,
                "scale_attn_by_inverse_layer_idx",
                false,
            )?,
            tie_word_embeddings: c.bool(op, "tie_word_embeddings", true)?,
            initializer_range: c.f32(op, "initializer_range", Some(0.02))?,
            extra: c.fields.clone(),
        };
        config.check().map_err(|msg| Error::Io {
            op,
            path: c.path.display().to_string(),
            msg,
        })?;
        Ok(config)
    }

    fn check(&self) -> std::result::Result<(), String> {
        if !self.n_embd.is_multiple_of(self.n_head) {
            return Err(format!(
                "n_embd ({}) must be a multiple of n_head ({})",
                self.n_embd, self.n_head
            ));
        }
        if !ACTIVATIONS.contains(&self.activation_function.as_str()) {
            return Err(format!(
                "field \"activation_function\" is {:?}; GPT-2 runs one of {ACTIVATIONS:?}",
                self.activation_function
            ));
        }
        if self.layer_norm_epsilon.is_nan() || self.layer_norm_epsilon <= 0.0 {
            return Err(format!(
                "layer_norm_epsilon ({}) must be positive",
                self.layer_norm_epsilon
            ));
        }
        Ok(())
    }

    fn to_json(&self) -> Map<String, Value> {
        let mut m = self.extra.clone();
        for (k, v) in [
            ("architectures", json!(["GPT2LMHeadModel"])),
            ("model_type", json!("gpt2")),
            ("vocab_size", json!(self.vocab_size)),
            ("n_embd", json!(self.n_embd)),
            ("n_layer", json!(self.n_layer)),
            ("n_head", json!(self.n_head)),
            ("n_positions", json!(self.n_positions)),
            ("n_inner", json!(self.n_inner)),
            ("layer_norm_epsilon", json!(self.layer_norm_epsilon as f64)),
            ("activation_function", json!(self.activation_function)),
            ("scale_attn_weights", json!(self.scale_attn_weights)),
            (
                "scale_attn_by_inverse_layer_idx",
                json!(self.scale_attn_by_inverse_layer_idx),
            ),
            ("tie_word_embeddings", json!(self.tie_word_embeddings)),
            ("initializer_range", json!(self.initializer_range as f64)),
        ] {
            m.insert(k.to_string(), v);
        }
        m
    }
}

/// The activations [`Gpt2Config::activation_function`] may name.
const ACTIVATIONS: [&str; 5] = ["gelu_new", "gelu_pytorch_tanh", "gelu", "relu", "silu"];

/// OpenAI's `Conv1D` (transformers keeps the name): a linear layer whose weight is stored
/// `[in, out]`, the transpose of [`nn::Linear`]'s, so `y = x W + b`.
pub struct HfConv1d {
    /// `[in, out]`.
    pub weight: Tensor,
    /// `[out]`.
    pub bias: Tensor,
}

impl HfConv1d {
    fn new(
        src: &mut Source,
        name: &str,
        (inputs, outputs): (usize, usize),
        std: f32,
        dev: &Device,
    ) -> Result<HfConv1d> {
        Ok(HfConv1d {
            weight: src.param(
                OP_LOAD,
                &format!("{name}.weight"),
                &[inputs, outputs],
                Init::Normal(std),
                dev,
            )?,
            bias: src.param(
                OP_LOAD,
                &format!("{name}.bias"),
                &[outputs],
                Init::Zeros,
                dev,
            )?,
        })
    }
}

impl Module for HfConv1d {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        x.matmul(&self.weight)?.add(&self.bias)
    }

    fn named_parameters(&self) -> Vec<(String, Tensor)> {
        vec![
            ("weight".to_string(), self.weight.clone()),
            ("bias".to_string(), self.bias.clone()),
        ]
    }
}

fn layer_norm(src: &mut Source, name: &str, c: &Gpt2Config, dev: &Device) -> Result<nn::LayerNorm> {
    let mut norm = nn::LayerNorm::new(c.n_embd, c.layer_norm_epsilon, dev)?;
    norm.weight = src.param(
        OP_LOAD,
        &format!("{name}.weight"),
        &[c.n_embd],
        Init::Ones,
        dev,
    )?;
    norm.bias = src.param(
        OP_LOAD,
        &format!("{name}.bias"),
        &[c.n_embd],
        Init::Zeros,
        dev,
    )?;
    Ok(norm)
}

/// Causal multi-head self-attention with q, k and v from one projection.
pub struct Gpt2Attention {
    /// `n_embd -> 3 n_embd`: q, k and v side by side.
    pub c_attn: HfConv1d,
    /// `n_embd -> n_embd`.
    pub c_proj: HfConv1d,
    heads: usize,
    scale: f32,
}

impl Gpt2Attention {
    fn forward(&self, x: &Tensor, ctx: Attend) -> Result<Tensor> {
        let (b, t, c) = (x.shape()[0], x.shape()[1], x.shape()[2]);
        let qkv = self.c_attn.forward(x)?.split(&[c, c, c], 2)?;
        let heads = |part: &Tensor| {
            part.reshape(&[b, t, self.heads, c / self.heads])?
                .transpose(1, 2)
        };
        let (q, k, v) = (heads(&qkv[0])?, heads(&qkv[1])?, heads(&qkv[2])?);
        let o = ctx.attend(&q, k, v, Some(self.scale))?;
        self.c_proj
            .forward(&o.transpose(1, 2)?.reshape(&[b, t, c])?)
    }
}

/// The MLP: `c_proj(act(c_fc(x)))`.
pub struct Gpt2Mlp {
    /// `n_embd -> n_inner`.
    pub c_fc: HfConv1d,
    /// `n_inner -> n_embd`.
    pub c_proj: HfConv1d,
    activation: String,
}

impl Module for Gpt2Mlp {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let h = self.c_fc.forward(x)?;
        let h = match self.activation.as_str() {
            "gelu" => h.gelu()?,
            "relu" => h.relu()?,
            "silu" => h.silu()?,
            _ => h.gelu_tanh()?,
        };
        self.c_proj.forward(&h)
    }

    fn named_parameters(&self) -> Vec<(String, Tensor)> {
        let mut params = prefixed("c_fc", &self.c_fc);
        params.extend(prefixed("c_proj", &self.c_proj));
        params
    }
}

/// One block: `x + attn(ln_1(x))`, then `x + mlp(ln_2(x))`.
pub struct Gpt2Block {
    /// Before the attention.
    pub ln_1: nn::LayerNorm,
    /// Causal self-attention.
    pub attn: Gpt2Attention,
    /// Before the MLP.
    pub ln_2: nn::LayerNorm,
    /// The MLP.
    pub mlp: Gpt2Mlp,
}

impl Gpt2Block {
    fn new(
        src: &mut Source,
        prefix: &str,
        i: usize,
        c: &Gpt2Config,
        dev: &Device,
    ) -> Result<Gpt2Block> {
        let p = format!("{prefix}h.{i}");
        let (e, std) = (c.n_embd, c.initializer_range);
        let mut scale = match c.scale_attn_weights {
            true => 1.0 / ((e / c.n_head) as f32).sqrt(),
            false => 1.0,
        };
        if c.scale_attn_by_inverse_layer_idx {
            scale /= (i + 1) as f32;
        }
        Ok(Gpt2Block {
            ln_1: layer_norm(src, &format!("{p}.ln_1"), c, dev)?,
            attn: Gpt2Attention {
                c_attn: HfConv1d::new(src, &format!("{p}.attn.c_attn"), (e, 3 * e), std, dev)?,
                c_proj: HfConv1d::new(src, &format!("{p}.attn.c_proj"), (e, e), std, dev)?,
                heads: c.n_head,
                scale,
            },
            ln_2: layer_norm(src, &format!("{p}.ln_2"), c, dev)?,
            mlp: Gpt2Mlp {
                c_fc: HfConv1d::new(src, &format!("{p}.mlp.c_fc"), (e, c.n_inner), std, dev)?,
                c_proj: HfConv1d::new(src, &format!("{p}.mlp.c_proj"), (c.n_inner, e), std, dev)?,
                activation: c.activation_function.clone(),
            },
        })
    }

    fn forward(&self, x: &Tensor, ctx: Attend) -> Result<Tensor> {
        let x = x.add(&self.attn.forward(&self.ln_1.forward(x)?, ctx)?)?;
        x.add(&self.mlp.forward(&self.ln_2.forward(&x)?)?)
    }

    fn named_parameters(&self) -> Vec<(String, Tensor)> {
        let mut params = prefixed("ln_1", &self.ln_1);
        params.extend(prefixed("attn.c_attn", &self.attn.c_attn));
        params.extend(prefixed("attn.c_proj", &self.attn.c_proj));
        params.extend(prefixed("ln_2", &self.ln_2));
        params.extend(prefixed("mlp", &self.mlp));
        params
    }
}

/// A GPT-2 causal language model: u32 tokens `[B, T]` to logits `[B, T, vocab]`.
///
/// ```no_run
/// # fn main() -> wgrad::Result<()> {
/// use wgrad::{models::{Gpt2, Sampling}, Device, Tensor};
/// let dev = Device::new()?;
/// let model = Gpt2::from_pretrained("gpt2-checkpoint", &dev)?;
/// let prompt = Tensor::from_vec_u32(vec![464, 2068], &[1, 2], &dev)?;
/// let tokens = model.generate(&prompt, 10, &Sampling { temperature: 0.8, top_k: Some(40), top_p: None, seed: 0 })?;
/// # Ok(())
/// # }
/// ```
pub struct Gpt2 {
    /// The shape it was built with.
    pub config: Gpt2Config,
    /// `transformer.wte`: `[vocab, n_embd]`.
    pub wte: nn::Embedding,
    /// `transformer.wpe`: `[n_positions, n_embd]`.
    pub wpe: nn::Embedding,
    /// `transformer.h`.
    pub h: Vec<Gpt2Block>,
    /// `transformer.ln_f`.
    pub ln_f: nn::LayerNorm,
    /// `lm_head`; `None` when tied to `wte` (GPT-2's own checkpoints).
    pub lm_head: Option<nn::Linear>,
    dtype: WeightDType,
}

impl Gpt2 {
    /// A model of `config` with fresh weights from the global generator, initialised as
    /// transformers does (normal with `initializer_range`, norms at one, biases at zero).
    pub fn new(config: Gpt2Config, device: &Device) -> Result<Gpt2> {
        config.check().map_err(|msg| Error::InvalidArgument {
            op: "Gpt2::new",
            msg,
        })?;
        Gpt2::build(
            config,
            &mut Source::Fresh,
            "transformer.",
            WeightDType::F32,
            device,
        )
    }

    /// The model in a Hugging Face checkpoint directory (as [`Llama::from_pretrained`]
    /// reads one), with transformers' names (`transformer.h.0.attn.c_attn.weight`) or the
    /// original OpenAI ones (`h.0.attn.c_attn.weight`).
    ///
    /// [`Llama::from_pretrained`]: crate::models::Llama::from_pretrained
    pub fn from_pretrained(dir: impl AsRef<Path>, device: &Device) -> Result<Gpt2> {
        Gpt2::from_pretrained_with(dir, device, LoadDType::F32)
    }

    /// As [`Gpt2::from_pretrained`], with the parameters in the dtype `load` says (see
    /// [`Llama::from_pretrained_with`]).
    ///
    /// [`Llama::from_pretrained_with`]: crate::models::Llama::from_pretrained_with
    pub fn from_pretrained_with(
        dir: impl AsRef<Path>,
        device: &Device,
        load: LoadDType,
    ) -> Result<Gpt2> {
        let dir = dir.as_ref();
        let raw = Config::read(OP_LOAD, dir)?;
        let config = Gpt2Config::read(OP_LOAD, &raw)?;
        let mut weights = Weights::read(OP_LOAD, dir, &raw, load)?;
        let prefix = match !weights.has("transformer.wte.weight") && weights.has("wte.weight") {
            true => "",
            false => "transformer.",
        };
        let (dtype, tied) = (weights.dtype, config.tie_word_embeddings);
        let model = Gpt2::build(
            config,
            &mut Source::Checkpoint(&mut weights),
            prefix,
            dtype,
            device,
        )?;
        // The causal masks older transformers saved as buffers are rebuilt, not loaded.
        weights.expect_all_taken(OP_LOAD, |name| {
            name.ends_with(".attn.bias")
                || name.ends_with(".attn.masked_bias")
                || (tied && name == "lm_head.weight")
        })?;
        Ok(model)
    }

    fn build(
        config: Gpt2Config,
        src: &mut Source,
        prefix: &str,
        dtype: WeightDType,
        dev: &Device,
    ) -> Result<Gpt2> {
        let std = Init::Normal(config.initializer_range);
        let (v, e) = (config.vocab_size, config.n_embd);
        let wte = src.param(OP_LOAD, &format!("{prefix}wte.weight"), &[v, e], std, dev)?;
        let std = Init::Normal(config.initializer_range);
        let wpe = src.param(
            OP_LOAD,
            &format!("{prefix}wpe.weight"),
            &[config.n_positions, e],
            std,
            dev,
        )?;
        let h = (0..config.n_layer)
            .map(|i| Gpt2Block::new(src, prefix, i, &config, dev))
            .collect::<Result<Vec<_>>>()?;
        let ln_f = layer_norm(src, &format!("{prefix}ln_f"), &config, dev)?;
        let lm_head = match config.tie_word_embeddings {
            true => None,
            false => Some(nn::Linear {
                weight: src.param(
                    OP_LOAD,
                    "lm_head.weight",
                    &[v, e],
                    Init::Normal(config.initializer_range),
                    dev,
                )?,
                bias: None,
            }),
        };
        Ok(Gpt2 {
            wte: nn::Embedding {
                weight: wte,
                padding_idx: None,
            },
            wpe: nn::Embedding {
                weight: wpe,
                padding_idx: None,
            },
            h,
            ln_f,
            lm_head,
            dtype,
            config,
        })
    }

    /// Writes `config.json` and `model.safetensors` to `dir` as transformers'
    /// `save_pretrained` does, in the dtype the model was loaded in.
    pub fn save_pretrained(&self, dir: impl AsRef<Path>) -> Result<()> {
        pretrained::write(
            "Gpt2::save_pretrained",
            dir.as_ref(),
            self.config.to_json(),
            &self.named_parameters(),
            self.dtype,
        )
    }

    /// Logits `[B, T, vocab]` of `tokens` `[B, T]`, with `mask` (u32 `[B, T]`, 1 = token,
    /// 0 = padding) keeping padding out of the attention, as
    /// [`Llama::forward_with`](crate::models::Llama::forward_with).
    pub fn forward_with(&self, tokens: &Tensor, mask: Option<&Tensor>) -> Result<Tensor> {
        decoder::forward_with(OP, self, tokens, mask)
    }

    /// `prompt` (u32 `[B, T]`, no padding) followed by `max_new_tokens` tokens chosen by
    /// `sampling`, with a KV cache on the device.
    pub fn generate(
        &self,
        prompt: &Tensor,
        max_new_tokens: usize,
        sampling: &Sampling,
    ) -> Result<Tensor> {
        decoder::generate("Gpt2::generate", self, prompt, max_new_tokens, sampling)
    }
}

impl Decoder for Gpt2 {
    fn shape(&self) -> DecoderShape {
        DecoderShape {
            layers: self.config.n_layer,
            kv_heads: self.config.n_head,
            head_dim: self.config.n_embd / self.config.n_head,
            max_positions: self.config.n_positions,
            positions_field: "n_positions",
            vocab: self.config.vocab_size,
        }
    }

    fn hidden(&self, tokens: &Tensor, ctx: Attend) -> Result<Tensor> {
        let (first, t) = (ctx.first_position(), tokens.shape()[1]);
        let positions = (first as u32..(first + t) as u32).collect();
        let positions = Tensor::from_vec_u32(positions, &[t], tokens.device())?;
        let mut x = self
            .wte
            .forward(tokens)?
            .add(&self.wpe.forward(&positions)?)?;
        for (i, block) in self.h.iter().enumerate() {
            x = block.forward(&x, ctx.layer(i))?;
        }
        self.ln_f.forward(&x)
    }

    fn head(&self, x: &Tensor) -> Result<Tensor> {
        match &self.lm_head {
            Some(head) => head.forward(x),
            None => x.matmul(&self.wte.weight.t()?),
        }
    }
}

impl Module for Gpt2 {
    fn forward(&self, tokens: &Tensor) -> Result<Tensor> {
        self.forward_with(tokens, None)
    }

    /// transformers' names (`transformer.h.0.attn.c_attn.weight`, ...); the tied head is
    /// `transformer.wte.weight`, listed once.
    fn named_parameters(&self) -> Vec<(String, Tensor)> {
        let mut params = prefixed("transformer.wte", &self.wte);
        params.extend(prefixed("transformer.wpe", &self.wpe));
        for (i, block) in self.h.iter().enumerate() {
            let named = block.named_parameters().into_iter();
            params.extend(named.map(|(n, t)| (format!("transformer.h.{i}.{n}"), t)));
        }
        params.extend(prefixed("transformer.ln_f", &self.ln_f));
        if let Some(head) = &self.lm_head {
            params.extend(prefixed("lm_head", head));
        }
        params
    }
}
