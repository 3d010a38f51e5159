//! Transformer layers: `MultiheadAttention` (self-attention on the fused
//! `scaled_dot_product_attention`) and a pre-norm `TransformerBlock`.

use crate::device::Device;
use crate::error::{Error, Result};
use crate::nn::linear::uniform_parameter;
use crate::nn::{Dropout, Gelu, LayerNorm, Linear, Module, Sequential};
use crate::ops::autocast::for_16_bit_op;
use crate::tensor::Tensor;

/// Multi-head self-attention over `[B, T, C]`, with PyTorch's `nn.MultiheadAttention`
/// parameters: `in_proj_weight` `[3C, C]` and `in_proj_bias` `[3C]` make q, k and v;
/// `out_proj` (a [`Linear`] `C -> C`) mixes the heads. With `causal`, position `t` attends to
/// positions `0..=t` only.
///
/// ```
/// # fn main() -> wgrad::Result<()> {
/// use wgrad::{nn::{self, Module}, Device, Tensor};
/// let dev = Device::new()?;
/// let attn = nn::MultiheadAttention::new(32, 4, true, &dev)?;
/// let y = attn.forward(&Tensor::randn(&[2, 10, 32], 0, &dev)?)?;
/// assert_eq!(y.shape(), &[2, 10, 32]);
/// # Ok(())
/// # }
/// ```
#[derive(Module)]
pub struct MultiheadAttention {
    /// `[3C, C]`: the q, k and v projections stacked.
    pub in_proj_weight: Tensor,
    /// `[3C]`.
    pub in_proj_bias: Tensor,
    /// `C -> C`.
    pub out_proj: Linear,
    #[module(skip)]
    heads: usize,
    #[module(skip)]
    causal: bool,
}

impl MultiheadAttention {
    /// `heads` heads over an embedding of `dim` (divisible by `heads`). Initialised as PyTorch
    /// (Xavier-uniform in-projection, zero biases, out-projection as a [`Linear`] with a zero
    /// bias).
    pub fn new(dim: usize, heads: usize, causal: bool, device: &Device) -> Result<Self> {
        if heads == 0 || dim == 0 || !dim.is_multiple_of(heads) {
            return Err(Error::InvalidArgument {
                op: "MultiheadAttention::new",
                msg: format!("dim ({dim}) must be a positive multiple of heads ({heads})"),
            });
        }
        let bound = (6.0 / (dim + 3 * dim) as f32).sqrt();
        let out_proj = Linear::new(dim, dim, true, device)?;
        if let Some(bias) = &out_proj.bias {
            crate::autograd::no_grad(|| bias.copy_(&Tensor::zeros(&[dim], device)?))?;
        }
        Ok(MultiheadAttention {
            in_proj_weight: uniform_parameter(&[3 * dim, dim], bound, device)?,
            in_proj_bias: Tensor::zeros(&[3 * dim], device)?.requires_grad_(true),
            out_proj,
            heads,
            causal,
        })
    }
}

impl MultiheadAttention {
    /// Self-attention over `x` `[B, T, C]`.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let dim = self.in_proj_weight.shape()[1];
        if x.rank() != 3 || x.shape()[2] != dim {
            return Err(Error::Shape {
                op: "MultiheadAttention",
                msg: format!("needs input [B, T, {dim}], got {:?}", x.shape()),
            });
        }
        let (b, t) = (x.shape()[0], x.shape()[1]);
        // As `Linear` does: under autocast the weight and bias are cast (once per region)
        // before the transpose view, so the projection and its bias add stay 16-bit.
        let weight = for_16_bit_op(&self.in_proj_weight)?;
        let qkv = x
            .matmul(&weight.t()?)?
            .add(&for_16_bit_op(&self.in_proj_bias)?)?;
        // [B, T, C] -> [B, heads, T, C / heads] for each of q, k and v (one `split`, whose
        // backward writes the three grads into one tensor).
        let heads = qkv
            .split(&[dim, dim, dim], 2)?
            .iter()
            .map(|part| {
                part.reshape(&[b, t, self.heads, dim / self.heads])?
                    .transpose(1, 2)
            })
            .collect::<Result<Vec<_>>>()?;
        let attended = heads[0].scaled_dot_product_attention(&heads[1], &heads[2], self.causal)?;
        let merged = attended.transpose(1, 2)?.reshape(&[b, t, dim])?;
        self.out_proj.forward(&merged)
    }
}

/// A pre-norm transformer block over `[B, T, C]`:
/// `x + attn(ln_1(x))`, then `x + mlp(ln_2(x))` with `mlp` = Linear `C -> 4C`, GELU,
/// Linear `4C -> C`, and dropout after the attention and the MLP (as GPT-2).
#[derive(Module)]
pub struct TransformerBlock {
    /// Before the attention.
    pub ln_1: LayerNorm,
    /// Causal or not, as built.
    pub attn: MultiheadAttention,
    /// Before the MLP.
    pub ln_2: LayerNorm,
    /// `0`: Linear `C -> 4C`, `1`: GELU, `2`: Linear `4C -> C`.
    pub mlp: Sequential,
    dropout: Dropout,
}

impl TransformerBlock {
    /// A block of width `dim` with `heads` heads and dropout probability `dropout`.
    pub fn new(
        dim: usize,
        heads: usize,
        causal: bool,
        dropout: f32,
        device: &Device,
    ) -> Result<Self> {
        Ok(TransformerBlock {
            ln_1: LayerNorm::new(dim, 1e-5, device)?,
            attn: MultiheadAttention::new(dim, heads, causal, device)?,
            ln_2: LayerNorm::new(dim, 1e-5, device)?,
            mlp: Sequential::new()
                .add(Linear::new(dim, 4 * dim, true, device)?)
                .add(Gelu)
                .add(Linear::new(4 * dim, dim, true, device)?),
            dropout: Dropout::new(dropout)?,
        })
    }
}

impl TransformerBlock {
    /// The block applied to `x` `[B, T, C]`.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let attended = self.attn.forward(&self.ln_1.forward(x)?)?;
        let x = x.add(&self.dropout.forward(&attended)?)?;
        let mixed = self.mlp.forward(&self.ln_2.forward(&x)?)?;
        x.add(&self.dropout.forward(&mixed)?)
    }
}
