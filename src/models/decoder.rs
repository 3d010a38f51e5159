//! What the causal language models share: the checks on their input, the attention context
//! of a layer (padding mask, KV cache), and generation: a KV cache on the device, so each new
//! token runs the model on that token alone, and sampling on the host (greedy, temperature,
//! top-k, top-p) from a seeded generator.

use std::cell::OnceCell;

use rand::{Rng, SeedableRng};

use crate::autograd::NoGradGuard;
use crate::error::{Error, Result};
use crate::ops::attention::SdpaOptions;
use crate::ops::index::expect_indices_below;
use crate::tensor::{DType, Tensor};

/// How [`Llama::generate`](crate::models::Llama::generate) and
/// [`Gpt2::generate`](crate::models::Gpt2::generate) pick each next token.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sampling {
    /// Logits are divided by it before the softmax; 0 picks the most likely token (greedy).
    pub temperature: f32,
    /// Sample among the `k` most likely tokens only; `None`: among all.
    pub top_k: Option<usize>,
    /// Nucleus sampling, after top-k as transformers orders them: sample among the most likely
    /// tokens whose probabilities (at this temperature) add up to at least `p`, in (0, 1];
    /// the most likely token always stays. `None` (or 1): no cut.
    pub top_p: Option<f32>,
    /// Seed of the generator the samples are drawn from (unused when greedy).
    pub seed: u64,
}

impl Sampling {
    /// The most likely token every step, as `generate(do_sample=False)`.
    pub fn greedy() -> Sampling {
        Sampling {
            temperature: 0.0,
            top_k: None,
            top_p: None,
            seed: 0,
        }
    }

    fn check(&self, op: &'static str) -> Result<()> {
        if !self.temperature.is_finite() || self.temperature < 0.0 {
            return Err(Error::InvalidArgument {
                op,
                msg: format!(
                    "temperature must be finite and at least 0, got {}",
                    self.temperature
                ),
            });
        }
        if self.top_k == Some(0) {
            return Err(Error::InvalidArgument {
                op,
                msg: "top_k must be at least 1".to_string(),
            });
        }
        if let Some(p) = self.top_p {
            if !(p > 0.0 && p <= 1.0) {
                return Err(Error::InvalidArgument {
                    op,
                    msg: format!("top_p must be in (0, 1], got {p}"),
                });
            }
        }
        Ok(())
    }
}

/// Each layer's keys and values so far, stored `[max_positions, B, kv_heads, head_dim]`
/// (positions outermost, so the next positions are one contiguous run, which 16-bit elements
/// need), allocated once at a layer's first append in the dtype of its keys; `len` positions
/// hold values.
pub(crate) struct KvCache {
    layers: Vec<OnceCell<(Tensor, Tensor)>>,
    dims: [usize; 4],
    len: usize,
}

impl KvCache {
    /// An empty cache for `shape`'s model and `batch` sequences.
    pub fn new(shape: &DecoderShape, batch: usize) -> KvCache {
        KvCache {
            layers: (0..shape.layers).map(|_| OnceCell::new()).collect(),
            dims: [shape.max_positions, batch, shape.kv_heads, shape.head_dim],
            len: 0,
        }
    }

    /// Positions already cached: the first position of the next tokens.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Writes layer `layer`'s keys and values for the next `k.shape()[2]` positions
    /// (`[B, kv_heads, T, head_dim]`) and returns every position's so far, read in place.
    pub fn append(&self, layer: usize, k: &Tensor, v: &Tensor) -> Result<(Tensor, Tensor)> {
        let (keys, values) = match self.layers[layer].get() {
            Some(cached) => cached,
            None => {
                let empty = || -> Result<Tensor> {
                    let zeros = Tensor::zeros(&self.dims, k.device())?;
                    match k.dtype() {
                        DType::F32 => Ok(zeros),
                        dtype => zeros.to_dtype(dtype),
                    }
                };
                let made = (empty()?, empty()?);
                self.layers[layer].get_or_init(|| made)
            }
        };
        let t = k.shape()[2];
        // [B, H, T, D] as the store's [T, B, H, D], and back (views).
        let stored = [2, 0, 1, 3];
        let read = [1, 2, 0, 3];
        keys.narrow(0, self.len, t)?.copy_(&k.permute(&stored)?)?;
        values.narrow(0, self.len, t)?.copy_(&v.permute(&stored)?)?;
        Ok((
            keys.narrow(0, 0, self.len + t)?.permute(&read)?,
            values.narrow(0, 0, self.len + t)?.permute(&read)?,
        ))
    }

    /// Marks `t` more positions as cached, once every layer has appended them.
    pub fn advance(&mut self, t: usize) {
        self.len += t;
    }
}

/// What generation needs to know of a model.
pub(crate) struct DecoderShape {
    pub layers: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub max_positions: usize,
    /// The config field `max_positions` comes from, for errors (`n_positions` in GPT-2's).
    pub positions_field: &'static str,
    pub vocab: usize,
}

/// A causal language model that can run on new tokens after cached ones.
pub(crate) trait Decoder {
    fn shape(&self) -> DecoderShape;

    /// The last layer's normalised output `[B, T, hidden]` for checked `tokens` `[B, T]`,
    /// at the positions after `ctx`'s cache (whose keys and values the layers append).
    fn hidden(&self, tokens: &Tensor, ctx: Attend) -> Result<Tensor>;

    /// Logits `[.., vocab]` of hidden states `[.., hidden]`.
    fn head(&self, x: &Tensor) -> Result<Tensor>;
}

/// What a layer attends with besides its input: the padding mask, and the cache with the
/// layer's index in it when decoding.
#[derive(Clone, Copy)]
pub(crate) struct Attend<'a> {
    pub mask: Option<&'a Tensor>,
    pub cache: Option<&'a KvCache>,
    pub layer: usize,
}

impl<'a> Attend<'a> {
    /// For layer `layer`.
    pub fn layer(self, layer: usize) -> Attend<'a> {
        Attend { layer, ..self }
    }

    /// The position of the first of the new tokens.
    pub fn first_position(&self) -> usize {
        self.cache.map_or(0, KvCache::len)
    }

    /// Attention of `q` over `k` and `v` (`[B, heads, T, head_dim]`, the new positions'),
    /// after the cached positions when decoding; causal, and with the padding mask if any.
    pub fn attend(&self, q: &Tensor, k: Tensor, v: Tensor, scale: Option<f32>) -> Result<Tensor> {
        let (k, v) = match self.cache {
            Some(cache) => cache.append(self.layer, &k, &v)?,
            None => (k, v),
        };
        let t_k = k.shape()[2];
        let mask = self
            .mask
            .map(|m| m.reshape(&[m.shape()[0], 1, 1, t_k]))
            .transpose()?;
        let opts = SdpaOptions {
            // One new token sees every cached one; several (a prompt) start the cache.
            causal: q.shape()[2] > 1,
            mask: mask.as_ref(),
            scale,
        };
        q.scaled_dot_product_attention_with(&k, &v, &opts)
    }
}

/// Logits `[B, T, vocab]` of `tokens` `[B, T]` with the padding `mask` (u32 `[B, T]`).
pub(crate) fn forward_with(
    op: &'static str,
    model: &dyn Decoder,
    tokens: &Tensor,
    mask: Option<&Tensor>,
) -> Result<Tensor> {
    check_tokens(op, &model.shape(), tokens, mask, 0)?;
    let ctx = Attend {
        mask,
        cache: None,
        layer: 0,
    };
    model.head(&model.hidden(tokens, ctx)?)
}

/// The logits `[B, vocab]` of the last of `tokens` (`[B, T]`, the positions after the cached
/// ones), with their keys and values appended to `cache`.
fn last_logits(
    op: &'static str,
    model: &dyn Decoder,
    tokens: &Tensor,
    cache: &mut KvCache,
) -> Result<Tensor> {
    let (b, t) = (tokens.shape()[0], tokens.shape()[1]);
    check_tokens(op, &model.shape(), tokens, None, cache.len())?;
    let ctx = Attend {
        mask: None,
        cache: Some(cache),
        layer: 0,
    };
    let x = model.hidden(tokens, ctx)?;
    cache.advance(t);
    let last = model.head(&x.narrow(1, t - 1, 1)?)?;
    last.reshape(&[b, model.shape().vocab])
}

/// Checks a language model's input: u32 tokens `[B, T]` below the vocabulary's size,
/// positions `first..first + T` within the model's, and a mask (u32 `[B, first + T]`) if any.
fn check_tokens(
    op: &'static str,
    shape: &DecoderShape,
    tokens: &Tensor,
    mask: Option<&Tensor>,
    first: usize,
) -> Result<()> {
    tokens.expect_dtype(op, DType::U32)?;
    if tokens.rank() != 2 {
        return Err(Error::Shape {
            op,
            msg: format!("needs u32 tokens [B, T], got shape {:?}", tokens.shape()),
        });
    }
    let (b, t) = (tokens.shape()[0], tokens.shape()[1]);
    expect_indices_below(op, tokens, shape.vocab, |id| {
        format!(
            "token ids reach {id} but the vocabulary has {} (vocab_size)",
            shape.vocab
        )
    })?;
    if first + t > shape.max_positions {
        return Err(Error::Shape {
            op,
            msg: format!(
                "a sequence of {} positions is longer than the model's {} ({}); tokens {:?}",
                first + t,
                shape.max_positions,
                shape.positions_field,
                tokens.shape()
            ),
        });
    }
    if let Some(mask) = mask {
        mask.expect_dtype(op, DType::U32)?;
        if mask.shape() != [b, first + t] {
            return Err(Error::Shape {
                op,
                msg: format!(
                    "the attention mask must be u32 [{b}, {}] (1 = token, 0 = padding), got {:?}",
                    first + t,
                    mask.shape()
                ),
            });
        }
    }
    Ok(())
}

/// `prompt` (`[B, T]` u32) followed by `max_new_tokens` tokens, each chosen by `sampling`
/// from the model's logits given everything before it.
pub(crate) fn generate(
    op: &'static str,
    model: &dyn Decoder,
    prompt: &Tensor,
    max_new_tokens: usize,
    sampling: &Sampling,
) -> Result<Tensor> {
    sampling.check(op)?;
    let shape = model.shape();
    prompt.expect_dtype(op, DType::U32)?;
    if prompt.rank() != 2 || prompt.shape()[1] == 0 {
        return Err(Error::Shape {
            op,
            msg: format!(
                "needs a prompt of u32 tokens [B, T] with T >= 1, got {:?}",
                prompt.shape()
            ),
        });
    }
    let (batch, t) = (prompt.shape()[0], prompt.shape()[1]);
    if t.saturating_add(max_new_tokens) > shape.max_positions {
        return Err(Error::Shape {
            op,
            msg: format!(
                "a prompt of {t} tokens and {max_new_tokens} new ones pass the model's \
                 {} positions ({})",
                shape.max_positions, shape.positions_field
            ),
        });
    }
    let _no_grad = NoGradGuard::new();
    let device = prompt.device();
    let mut rows: Vec<Vec<u32>> = prompt
        .to_vec_u32()?
        .chunks(t)
        .map(<[u32]>::to_vec)
        .collect();
    let mut rng = rand::rngs::StdRng::seed_from_u64(sampling.seed);
    let mut cache = KvCache::new(&shape, batch);
    let mut next = prompt.clone();
    for _ in 0..max_new_tokens {
        let logits = last_logits(op, model, &next, &mut cache)?.to_vec()?;
        let picked: Vec<u32> = logits
            .chunks(shape.vocab)
            .map(|row| pick(row, sampling, &mut rng))
            .collect();
        for (row, token) in rows.iter_mut().zip(&picked) {
            row.push(*token);
        }
        next = Tensor::from_vec_u32(picked, &[batch, 1], device)?;
    }
    let len = t + max_new_tokens;
    Tensor::from_vec_u32(rows.concat(), &[batch, len], device)
}

/// The token `sampling` picks from one row of logits (NaN logits are never picked).
fn pick(logits: &[f32], sampling: &Sampling, rng: &mut rand::rngs::StdRng) -> u32 {
    let mut order: Vec<usize> = (0..logits.len()).filter(|&i| !logits[i].is_nan()).collect();
    // Most likely first; ties keep the lower id first, as torch's argmax.
    order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
    if order.is_empty() {
        return 0;
    }
    if sampling.temperature == 0.0 {
        return order[0] as u32;
    }
    order.truncate(sampling.top_k.unwrap_or(order.len()).min(order.len()));
    let top = logits[order[0]];
    let mut weights: Vec<f64> = order
        .iter()
        .map(|&i| (((logits[i] - top) / sampling.temperature) as f64).exp())
        .collect();
    if let Some(p) = sampling.top_p {
        // transformers' TopPLogitsWarper: drop the least likely tokens while their mass, the
        // dropped one's included, is at most 1 - p; the most likely token stays.
        let total: f64 = weights.iter().sum();
        let mut tail = 0.0;
        let mut keep = weights.len();
        while keep > 1 && tail + weights[keep - 1] <= (1.0 - p as f64) * total {
            tail += weights[keep - 1];
            keep -= 1;
        }
        weights.truncate(keep);
    }
    let mut u = rng.random::<f64>() * weights.iter().sum::<f64>();
    for (&i, w) in order.iter().zip(&weights) {
        if u < *w {
            return i as u32;
        }
        u -= w;
    }
    *order.last().expect("not empty") as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The tokens `pick` draws in `draws` tries from probabilities `probs` under `sampling`.
    fn drawn(probs: &[f64], sampling: &Sampling, draws: usize) -> Vec<usize> {
        let logits: Vec<f32> = probs.iter().map(|p| p.ln() as f32).collect();
        let mut rng = rand::rngs::StdRng::seed_from_u64(sampling.seed);
        let mut counts = vec![0; probs.len()];
        for _ in 0..draws {
            counts[pick(&logits, sampling, &mut rng) as usize] += 1;
        }
        counts
    }

    fn nucleus(top_p: Option<f32>) -> Sampling {
        Sampling {
            temperature: 1.0,
            top_k: None,
            top_p,
            seed: 5,
        }
    }

    /// transformers drops the least likely tokens while their mass is at most 1 - p: of 0.5,
    /// 0.3, 0.15, 0.05, p = 0.7 keeps two (the last two hold 0.2, the last three 0.5) and
    /// p = 0.85 keeps three.
    #[test]
    fn top_p_keeps_the_most_likely_tokens_that_hold_p() {
        let probs = [0.5, 0.3, 0.15, 0.05];
        let two = drawn(&probs, &nucleus(Some(0.7)), 4000);
        assert!(
            two[0] > 0 && two[1] > 0 && two[2] == 0 && two[3] == 0,
            "{two:?}"
        );
        // Renormalised over what is kept: 0.5 / 0.8 of the draws.
        let share = two[0] as f64 / 4000.0;
        assert!((share - 0.625).abs() < 0.03, "{two:?}");
        let three = drawn(&probs, &nucleus(Some(0.85)), 4000);
        assert!(three[2] > 0 && three[3] == 0, "{three:?}");
        let all = drawn(&probs, &nucleus(Some(1.0)), 4000);
        assert!(all.iter().all(|&c| c > 0), "{all:?}");
        assert_eq!(all, drawn(&probs, &nucleus(None), 4000));
    }

    /// A p below the most likely token's probability leaves that token alone.
    #[test]
    fn a_small_top_p_keeps_the_most_likely_token() {
        let counts = drawn(&[0.2, 0.6, 0.2], &nucleus(Some(1e-6)), 500);
        assert_eq!(counts, vec![0, 500, 0]);
    }

    #[test]
    fn top_p_outside_zero_to_one_is_an_error() {
        for p in [0.0, -0.5, 1.5, f32::NAN] {
            assert!(nucleus(Some(p)).check("generate").is_err(), "top_p {p}");
        }
        assert!(nucleus(Some(1.0)).check("generate").is_ok());
    }
}
