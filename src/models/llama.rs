//! Llama, as transformers' `LlamaForCausalLM`: token embedding, decoder layers of RMSNorm,
//! grouped-query attention with rotary positions and a SwiGLU MLP, a final RMSNorm and a head
//! to the vocabulary (tied to the embedding or not). The parameters carry transformers' names.

use std::path::Path;

use serde_json::{json, Map, Value};

use crate::device::Device;
use crate::error::{Error, Result};
use crate::models::decoder::{self, Attend, Decoder, DecoderShape, Sampling};
use crate::models::pretrained::{self, Config, Init, LoadDType, Source, WeightDType, Weights};
use crate::nn::{self, prefixed, Module};
use crate::tensor::Tensor;

/// A Llama's shape, as `config.json` gives it (transformers' `LlamaConfig` field names).
#[derive(Debug, Clone, PartialEq)]
pub struct LlamaConfig {
    /// Rows of the token embedding and of the head.
    pub vocab_size: usize,
    /// The residual stream's width.
    pub hidden_size: usize,
    /// The MLP's inner width.
    pub intermediate_size: usize,
    /// Decoder layers.
    pub num_hidden_layers: usize,
    /// Query heads.
    pub num_attention_heads: usize,
    /// Key/value heads (a divisor of the query heads: grouped-query attention).
    pub num_key_value_heads: usize,
    /// Features per head (`hidden_size / num_attention_heads` unless stated).
    pub head_dim: usize,
    /// Positions the rotary tables cover: the longest sequence.
    pub max_position_embeddings: usize,
    /// Added to the mean square in every RMSNorm.
    pub rms_norm_eps: f32,
    /// The rotary embedding's base.
    pub rope_theta: f32,
    /// The head shares the token embedding's matrix.
    pub tie_word_embeddings: bool,
    /// The q, k, v and o projections have biases.
    pub attention_bias: bool,
    /// The MLP's projections have biases.
    pub mlp_bias: bool,
    /// Standard deviation of the weights of a model built from the config alone.
    pub initializer_range: f32,
    /// The rest of `config.json` (token ids, generation defaults), written back as it was.
    pub extra: Map<String, Value>,
}

impl LlamaConfig {
    /// A small Llama for training from scratch: width 128, 4 layers, 4 query heads over 2
    /// key/value heads, MLP width 344 (SwiGLU's 8/3 of the width, to a multiple of 8), 256
    /// positions, untied head.
    pub fn small(vocab_size: usize) -> LlamaConfig {
        LlamaConfig {
            vocab_size,
            hidden_size: 128,
            intermediate_size: 344,
            num_hidden_layers: 4,
            num_attention_heads: 4,
            num_key_value_heads: 2,
            head_dim: 32,
            max_position_embeddings: 256,
            rms_norm_eps: 1e-5,
            rope_theta: 10000.0,
            tie_word_embeddings: false,
            attention_bias: false,
            mlp_bias: false,
            initializer_range: 0.02,
            extra: Map::new(),
        }
    }

    /// Reads and checks the fields of a Llama `config.json`.
    fn read(op: &'static str, c: &Config) -> Result<LlamaConfig> {
        c.expect_model_type(op, "llama")?;
        let act = c.string(op, "hidden_act", "silu")?;
        if act != "silu" {
            return Err(Error::Io {
                op,
                path: c.path.display().to_string(),
                msg: format!("field \"hidden_act\" is {act:?}; Llama runs \"silu\""),
            });
        }
        c.refuse(op, "pretraining_tp", &[json!(1)])?;
        c.refuse(op, "attention_dropout", &[json!(0.0), json!(0)])?;
        // transformers 4 writes rope_theta and rope_scaling; 5 writes rope_parameters.
        let rope = c
            .fields
            .get("rope_parameters")
            .cloned()
            .unwrap_or(Value::Null);
        let scaling = c.fields.get("rope_scaling").cloned().unwrap_or(Value::Null);
        for (field, spec) in [("rope_parameters", &rope), ("rope_scaling", &scaling)] {
            let kind = spec.get("rope_type").or_else(|| spec.get("type"));
            if !spec.is_null() && kind.and_then(Value::as_str) != Some("default") {
                return Err(Error::Io {
                    op,
                    path: c.path.display().to_string(),
                    msg: format!(
                        "field {field:?} is {spec}: only the default rotary embedding is \
                         implemented (no scaling)"
                    ),
                });
            }
        }
        let rope_theta = match rope.get("rope_theta").and_then(Value::as_f64) {
            Some(theta) => theta as f32,
            None => c.f32(op, "rope_theta", Some(10000.0))?,
        };
        let hidden_size = c.usize(op, "hidden_size", None)?;
        let heads = c.usize(op, "num_attention_heads", None)?;
        let config = LlamaConfig {
            vocab_size: c.usize(op, "vocab_size", None)?,
            hidden_size,
            intermediate_size: c.usize(op, "intermediate_size", None)?,
            num_hidden_layers: c.usize(op, "num_hidden_layers", None)?,
            num_attention_heads: heads,
            num_key_value_heads: c.usize(op, "num_key_value_heads", Some(heads))?,
            head_dim: c.usize(op, "head_dim", Some(hidden_size / heads.max(1)))?,
            max_position_embeddings: c.usize(op, "max_position_embeddings", None)?,
            rms_norm_eps: c.f32(op, "rms_norm_eps", Some(1e-6))?,
            rope_theta,
            tie_word_embeddings: c.bool(op, "tie_word_embeddings", false)?,
            attention_bias: c.bool(op, "attention_bias", false)?,
            mlp_bias: c.bool(op, "mlp_bias", false)?,
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

    /// The constraints between fields, as a message naming them.
    fn check(&self) -> std::result::Result<(), String> {
        let fields = [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("num_attention_heads", self.num_attention_heads),
            ("num_key_value_heads", self.num_key_value_heads),
            ("head_dim", self.head_dim),
            ("max_position_embeddings", self.max_position_embeddings),
        ];
        if let Some((name, _)) = fields.iter().find(|(_, v)| *v == 0) {
            return Err(format!("field {name:?} must be positive"));
        }
        if !self
            .num_attention_heads
            .is_multiple_of(self.num_key_value_heads)
        {
            return Err(format!(
                "num_attention_heads ({}) must be a multiple of num_key_value_heads ({})",
                self.num_attention_heads, self.num_key_value_heads
            ));
        }
        if !self.head_dim.is_multiple_of(2) {
            return Err(format!(
                "head_dim ({}) must be even for rotary positions",
                self.head_dim
            ));
        }
        let positive = |x: f32| x.is_finite() && x > 0.0;
        if !positive(self.rms_norm_eps) || !positive(self.rope_theta) {
            return Err(format!(
                "rms_norm_eps ({}) and rope_theta ({}) must be positive",
                self.rms_norm_eps, self.rope_theta
            ));
        }
        Ok(())
    }

    /// `config.json`'s fields: the kept ones with this config's values over them.
    fn to_json(&self) -> Map<String, Value> {
        let mut m = self.extra.clone();
        let mut set = |k: &str, v: Value| {
            m.insert(k.to_string(), v);
        };
        set("architectures", json!(["LlamaForCausalLM"]));
        set("model_type", json!("llama"));
        set("vocab_size", json!(self.vocab_size));
        set("hidden_size", json!(self.hidden_size));
        set("intermediate_size", json!(self.intermediate_size));
        set("num_hidden_layers", json!(self.num_hidden_layers));
        set("num_attention_heads", json!(self.num_attention_heads));
        set("num_key_value_heads", json!(self.num_key_value_heads));
        set("head_dim", json!(self.head_dim));
        set(
            "max_position_embeddings",
            json!(self.max_position_embeddings),
        );
        set("rms_norm_eps", json!(self.rms_norm_eps as f64));
        set("tie_word_embeddings", json!(self.tie_word_embeddings));
        set("attention_bias", json!(self.attention_bias));
        set("mlp_bias", json!(self.mlp_bias));
        set("hidden_act", json!("silu"));
        set("initializer_range", json!(self.initializer_range as f64));
        let theta = json!(self.rope_theta as f64);
        match m.get_mut("rope_parameters").and_then(Value::as_object_mut) {
            Some(rope) => {
                rope.insert("rope_theta".into(), theta);
            }
            None => {
                m.insert("rope_theta".into(), theta);
            }
        }
        m
    }
}

/// A projection `in -> out` named as transformers names it.
fn linear(
    src: &mut Source,
    name: &str,
    (inputs, outputs): (usize, usize),
    bias: bool,
    config: &LlamaConfig,
    dev: &Device,
) -> Result<nn::Linear> {
    let std = Init::Normal(config.initializer_range);
    Ok(nn::Linear {
        weight: src.param(
            OP_LOAD,
            &format!("{name}.weight"),
            &[outputs, inputs],
            std,
            dev,
        )?,
        bias: match bias {
            true => Some(src.param(
                OP_LOAD,
                &format!("{name}.bias"),
                &[outputs],
                Init::Zeros,
                dev,
            )?),
            false => None,
        },
    })
}

fn rms_norm(
    src: &mut Source,
    name: &str,
    config: &LlamaConfig,
    dev: &Device,
) -> Result<nn::RmsNorm> {
    let mut norm = nn::RmsNorm::new(config.hidden_size, config.rms_norm_eps, dev)?;
    norm.weight = src.param(
        OP_LOAD,
        &format!("{name}.weight"),
        &[config.hidden_size],
        Init::Ones,
        dev,
    )?;
    Ok(norm)
}

const OP_LOAD: &str = "Llama::from_pretrained";
const OP: &str = "Llama::forward";

/// Grouped-query self-attention with rotary positions.
pub struct LlamaAttention {
    /// `hidden -> heads x head_dim`.
    pub q_proj: nn::Linear,
    /// `hidden -> kv_heads x head_dim`.
    pub k_proj: nn::Linear,
    /// `hidden -> kv_heads x head_dim`.
    pub v_proj: nn::Linear,
    /// `heads x head_dim -> hidden`.
    pub o_proj: nn::Linear,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
}

impl LlamaAttention {
    /// `x` `[B, T, hidden]` attending to itself (and to the cached positions before it).
    fn forward(&self, x: &Tensor, rope: &nn::RotaryEmbedding, ctx: Attend) -> Result<Tensor> {
        let (b, t) = (x.shape()[0], x.shape()[1]);
        let first = ctx.first_position();
        let heads = |proj: &nn::Linear, n: usize| -> Result<Tensor> {
            proj.forward(x)?
                .reshape(&[b, t, n, self.head_dim])?
                .transpose(1, 2)
        };
        let q = rope.apply(&heads(&self.q_proj, self.heads)?, first)?;
        let k = rope.apply(&heads(&self.k_proj, self.kv_heads)?, first)?;
        let v = heads(&self.v_proj, self.kv_heads)?;
        let o = ctx.attend(&q, k, v, None)?;
        self.o_proj.forward(
            &o.transpose(1, 2)?
                .reshape(&[b, t, self.heads * self.head_dim])?,
        )
    }

    fn named_parameters(&self) -> Vec<(String, Tensor)> {
        let mut params = prefixed("q_proj", &self.q_proj);
        params.extend(prefixed("k_proj", &self.k_proj));
        params.extend(prefixed("v_proj", &self.v_proj));
        params.extend(prefixed("o_proj", &self.o_proj));
        params
    }
}

/// The SwiGLU MLP: `down(silu(gate(x)) * up(x))`.
pub struct LlamaMlp {
    /// `hidden -> intermediate`, through SiLU.
    pub gate_proj: nn::Linear,
    /// `hidden -> intermediate`.
    pub up_proj: nn::Linear,
    /// `intermediate -> hidden`.
    pub down_proj: nn::Linear,
}

impl Module for LlamaMlp {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let gated = self
            .gate_proj
            .forward(x)?
            .silu()?
            .mul(&self.up_proj.forward(x)?)?;
        self.down_proj.forward(&gated)
    }

    fn named_parameters(&self) -> Vec<(String, Tensor)> {
        let mut params = prefixed("gate_proj", &self.gate_proj);
        params.extend(prefixed("up_proj", &self.up_proj));
        params.extend(prefixed("down_proj", &self.down_proj));
        params
    }
}

/// One decoder layer: `x + attn(norm(x))`, then `x + mlp(norm(x))`.
pub struct LlamaDecoderLayer {
    /// Before the attention.
    pub input_layernorm: nn::RmsNorm,
    /// Grouped-query attention.
    pub self_attn: LlamaAttention,
    /// Before the MLP.
    pub post_attention_layernorm: nn::RmsNorm,
    /// SwiGLU.
    pub mlp: LlamaMlp,
}

impl LlamaDecoderLayer {
    fn new(src: &mut Source, i: usize, c: &LlamaConfig, dev: &Device) -> Result<Self> {
        let p = format!("model.layers.{i}");
        let (h, q, kv) = (
            c.hidden_size,
            c.num_attention_heads * c.head_dim,
            c.num_key_value_heads * c.head_dim,
        );
        let ab = c.attention_bias;
        let mb = c.mlp_bias;
        Ok(LlamaDecoderLayer {
            input_layernorm: rms_norm(src, &format!("{p}.input_layernorm"), c, dev)?,
            self_attn: LlamaAttention {
                q_proj: linear(src, &format!("{p}.self_attn.q_proj"), (h, q), ab, c, dev)?,
                k_proj: linear(src, &format!("{p}.self_attn.k_proj"), (h, kv), ab, c, dev)?,
                v_proj: linear(src, &format!("{p}.self_attn.v_proj"), (h, kv), ab, c, dev)?,
                o_proj: linear(src, &format!("{p}.self_attn.o_proj"), (q, h), ab, c, dev)?,
                heads: c.num_attention_heads,
                kv_heads: c.num_key_value_heads,
                head_dim: c.head_dim,
            },
            post_attention_layernorm: rms_norm(
                src,
                &format!("{p}.post_attention_layernorm"),
                c,
                dev,
            )?,
            mlp: LlamaMlp {
                gate_proj: linear(
                    src,
                    &format!("{p}.mlp.gate_proj"),
                    (h, c.intermediate_size),
                    mb,
                    c,
                    dev,
                )?,
                up_proj: linear(
                    src,
                    &format!("{p}.mlp.up_proj"),
                    (h, c.intermediate_size),
                    mb,
                    c,
                    dev,
                )?,
                down_proj: linear(
                    src,
                    &format!("{p}.mlp.down_proj"),
                    (c.intermediate_size, h),
                    mb,
                    c,
                    dev,
                )?,
            },
        })
    }

    fn forward(&self, x: &Tensor, rope: &nn::RotaryEmbedding, ctx: Attend) -> Result<Tensor> {
        let attended = self
            .self_attn
            .forward(&self.input_layernorm.forward(x)?, rope, ctx)?;
        let x = x.add(&attended)?;
        x.add(
            &self
                .mlp
                .forward(&self.post_attention_layernorm.forward(&x)?)?,
        )
    }

    fn named_parameters(&self) -> Vec<(String, Tensor)> {
        let mut params = prefixed("input_layernorm", &self.input_layernorm);
        params.extend(
            self.self_attn
                .named_parameters()
                .into_iter()
                .map(|(n, t)| (format!("self_attn.{n}"), t)),
        );
        params.extend(prefixed(
            "post_attention_layernorm",
            &self.post_attention_layernorm,
        ));
        params.extend(prefixed("mlp", &self.mlp));
        params
    }
}

/// A Llama causal language model: u32 tokens `[B, T]` to logits `[B, T, vocab]`.
///
/// ```no_run
/// # fn main() -> wgrad::Result<()> {
/// use wgrad::{models::{Llama, Sampling}, nn::Module, Device, Tensor};
/// let dev = Device::new()?;
/// let model = Llama::from_pretrained("TinyLlama-checkpoint", &dev)?;
/// let prompt = Tensor::from_vec_u32(vec![1, 450, 4996], &[1, 3], &dev)?;
/// let logits = model.forward(&prompt)?; // [1, 3, vocab]
/// let tokens = model.generate(&prompt, 20, &Sampling::greedy())?; // [1, 23]
/// model.save_pretrained("fine-tuned")?;
/// # Ok(())
/// # }
/// ```
pub struct Llama {
    /// The shape it was built with.
    pub config: LlamaConfig,
    /// `model.embed_tokens`: `[vocab, hidden]`.
    pub embed_tokens: nn::Embedding,
    /// `model.layers`.
    pub layers: Vec<LlamaDecoderLayer>,
    /// `model.norm`, after the last layer.
    pub norm: nn::RmsNorm,
    /// `lm_head` (`hidden -> vocab`); `None` when tied to the embedding.
    pub lm_head: Option<nn::Linear>,
    rope: nn::RotaryEmbedding,
    dtype: WeightDType,
}

impl Llama {
    /// A model of `config` with fresh weights from the global generator (`manual_seed`),
    /// initialised as transformers does (normal with `initializer_range`, norms at one).
    pub fn new(config: LlamaConfig, device: &Device) -> Result<Llama> {
        config.check().map_err(|msg| Error::InvalidArgument {
            op: "Llama::new",
            msg,
        })?;
        Llama::build(config, &mut Source::Fresh, WeightDType::F32, device)
    }

    /// The model in a Hugging Face checkpoint directory: `config.json` and
    /// `model.safetensors` (or a sharded `model.safetensors.index.json`), F32, F16 or BF16
    /// (read as F32). A field, file or tensor the model cannot take is an error naming it.
    pub fn from_pretrained(dir: impl AsRef<Path>, device: &Device) -> Result<Llama> {
        Llama::from_pretrained_with(dir, device, LoadDType::F32)
    }

    /// As [`Llama::from_pretrained`], with the parameters in the dtype `load` says: F32, or
    /// the checkpoint's own (a BF16 checkpoint kept in BF16, transformers' `dtype="auto"`).
    ///
    /// ```no_run
    /// # fn main() -> wgrad::Result<()> {
    /// use wgrad::models::{LoadDType, Llama};
    /// use wgrad::{DType, Device};
    /// let dev = Device::new()?;
    /// let model = Llama::from_pretrained_with("llama-dir", &dev, LoadDType::Checkpoint)?;
    /// assert_eq!(model.embed_tokens.weight.dtype(), DType::BF16); // a BF16 checkpoint
    /// # Ok(())
    /// # }
    /// ```
    pub fn from_pretrained_with(
        dir: impl AsRef<Path>,
        device: &Device,
        load: LoadDType,
    ) -> Result<Llama> {
        let dir = dir.as_ref();
        let raw = Config::read(OP_LOAD, dir)?;
        let config = LlamaConfig::read(OP_LOAD, &raw)?;
        let mut weights = Weights::read(OP_LOAD, dir, &raw, load)?;
        let dtype = weights.dtype;
        let tied = config.tie_word_embeddings;
        let model = Llama::build(config, &mut Source::Checkpoint(&mut weights), dtype, device)?;
        weights.expect_all_taken(OP_LOAD, |name| {
            name.ends_with("rotary_emb.inv_freq") || (tied && name == "lm_head.weight")
        })?;
        Ok(model)
    }

    fn build(
        config: LlamaConfig,
        src: &mut Source,
        dtype: WeightDType,
        dev: &Device,
    ) -> Result<Llama> {
        let std = Init::Normal(config.initializer_range);
        let (v, h) = (config.vocab_size, config.hidden_size);
        let embed = src.param(OP_LOAD, "model.embed_tokens.weight", &[v, h], std, dev)?;
        let layers = (0..config.num_hidden_layers)
            .map(|i| LlamaDecoderLayer::new(src, i, &config, dev))
            .collect::<Result<Vec<_>>>()?;
        let norm = rms_norm(src, "model.norm", &config, dev)?;
        let lm_head = match config.tie_word_embeddings {
            true => None,
            false => Some(linear(src, "lm_head", (h, v), false, &config, dev)?),
        };
        let rope = nn::RotaryEmbedding::new(
            config.head_dim,
            config.max_position_embeddings,
            config.rope_theta,
            dev,
        )?;
        Ok(Llama {
            embed_tokens: nn::Embedding {
                weight: embed,
                padding_idx: None,
            },
            layers,
            norm,
            lm_head,
            rope,
            dtype,
            config,
        })
    }

    /// Writes `config.json` and `model.safetensors` to `dir` (created if needed) as
    /// transformers' `save_pretrained` does, in the dtype the model was loaded in (F32 for a
    /// model built from a config): `AutoModelForCausalLM.from_pretrained(dir)` loads it.
    pub fn save_pretrained(&self, dir: impl AsRef<Path>) -> Result<()> {
        pretrained::write(
            "Llama::save_pretrained",
            dir.as_ref(),
            self.config.to_json(),
            &self.named_parameters(),
            self.dtype,
        )
    }

    /// Logits `[B, T, vocab]` of `tokens` `[B, T]`, with `mask` (u32 `[B, T]`, 1 for a real
    /// token, 0 for padding: transformers' `attention_mask`) keeping padding out of every
    /// other position's attention. A padding position attending to nothing but padding gets
    /// logits from a zero attention output (transformers: from a uniform one); its loss is
    /// normally ignored.
    pub fn forward_with(&self, tokens: &Tensor, mask: Option<&Tensor>) -> Result<Tensor> {
        decoder::forward_with(OP, self, tokens, mask)
    }

    /// `prompt` (u32 `[B, T]`, no padding) followed by `max_new_tokens` tokens chosen by
    /// `sampling`: `[B, T + max_new_tokens]`. Keys and values are cached on the device, so
    /// each new token runs the model on that token alone.
    pub fn generate(
        &self,
        prompt: &Tensor,
        max_new_tokens: usize,
        sampling: &Sampling,
    ) -> Result<Tensor> {
        decoder::generate("Llama::generate", self, prompt, max_new_tokens, sampling)
    }
}

impl Decoder for Llama {
    fn shape(&self) -> DecoderShape {
        DecoderShape {
            layers: self.config.num_hidden_layers,
            kv_heads: self.config.num_key_value_heads,
            head_dim: self.config.head_dim,
            max_positions: self.config.max_position_embeddings,
            positions_field: "max_position_embeddings",
            vocab: self.config.vocab_size,
        }
    }

    fn hidden(&self, tokens: &Tensor, ctx: Attend) -> Result<Tensor> {
        let mut x = self.embed_tokens.forward(tokens)?;
        for (i, layer) in self.layers.iter().enumerate() {
            x = layer.forward(&x, &self.rope, ctx.layer(i))?;
        }
        self.norm.forward(&x)
    }

    fn head(&self, x: &Tensor) -> Result<Tensor> {
        match &self.lm_head {
            Some(head) => head.forward(x),
            None => x.matmul(&self.embed_tokens.weight.t()?),
        }
    }
}

impl Module for Llama {
    fn forward(&self, tokens: &Tensor) -> Result<Tensor> {
        self.forward_with(tokens, None)
    }

    /// transformers' names (`model.layers.0.self_attn.q_proj.weight`, ...); a tied head is
    /// the embedding, listed once as `model.embed_tokens.weight`.
    fn named_parameters(&self) -> Vec<(String, Tensor)> {
        let mut params = vec![(
            "model.embed_tokens.weight".to_string(),
            self.embed_tokens.weight.clone(),
        )];
        for (i, layer) in self.layers.iter().enumerate() {
            params.extend(
                layer
                    .named_parameters()
                    .into_iter()
                    .map(|(n, t)| (format!("model.layers.{i}.{n}"), t)),
            );
        }
        params.extend(prefixed("model.norm", &self.norm));
        if let Some(head) = &self.lm_head {
            params.extend(prefixed("lm_head", head));
        }
        params
    }
}
