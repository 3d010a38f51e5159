//! Language models from Hugging Face checkpoints: [`Llama`] and [`Gpt2`] read a directory
//! `save_pretrained` wrote (config and safetensors weights, sharded or not), train like any
//! [`Module`](crate::nn::Module) (every optimizer, capture, `dist`), generate with a KV cache,
//! and write the directory back for transformers, vLLM or llama.cpp's converters.
//!
//! ```no_run
//! # fn main() -> wgrad::Result<()> {
//! use wgrad::{models::Llama, nn::{self, Module}, optim::{self, Optimizer}, Device, Tensor};
//! let dev = Device::new()?;
//! let model = Llama::from_pretrained("checkpoint", &dev)?;
//! let mut opt = optim::AdamW::new(model.parameters(), optim::AdamConfig::default());
//! let tokens = Tensor::from_vec_u32(vec![1, 2, 3, 4], &[1, 4], &dev)?;
//! let targets = Tensor::from_vec_u32(vec![2, 3, 4, 5], &[4], &dev)?;
//! let logits = model.forward(&tokens)?.reshape(&[4, model.config.vocab_size])?;
//! nn::loss::cross_entropy(&logits, &targets)?.backward()?;
//! opt.step()?;
//! model.save_pretrained("fine-tuned")?;
//! # Ok(())
//! # }
//! ```

mod decoder;
mod gpt2;
mod llama;
mod pretrained;

pub use decoder::Sampling;
pub use gpt2::{Gpt2, Gpt2Attention, Gpt2Block, Gpt2Config, Gpt2Mlp, HfConv1d};
pub use llama::{Llama, LlamaAttention, LlamaConfig, LlamaDecoderLayer, LlamaMlp};
pub use pretrained::{LoadDType, WeightDType};
