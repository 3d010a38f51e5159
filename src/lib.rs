#![warn(missing_docs)]
//! wgrad trains neural networks on any GPU that wgpu reaches (Vulkan, Metal, DX12, GL) and on
//! software adapters where there is none: tensors live in GPU buffers, and every op dispatches
//! a WGSL compute kernel, recorded into one command encoder and submitted in batches.
//!
//! ```
//! # fn main() -> wgrad::Result<()> {
//! use wgrad::{Device, Tensor};
//! let dev = Device::new()?;
//! let a = Tensor::from_vec(vec![1.0, 2.0, 3.0, 4.0], &[2, 2], &dev)?;
//! let b = Tensor::ones(&[2, 2], &dev)?;
//! let c = (&a.matmul(&b)? + &a)?.relu()?;
//! assert_eq!(c.to_vec()?, vec![4.0, 5.0, 10.0, 11.0]);
//! # Ok(())
//! # }
//! ```

// `#[derive(Module)]` writes `::wgrad::...` paths; this makes them resolve inside wgrad too.
extern crate self as wgrad;

pub mod autograd;
pub mod capture;
mod device;
pub mod dist;
mod error;
pub mod io;
mod kernel;
pub mod models;
pub mod nn;
mod ops;
pub mod optim;
mod seed;
#[cfg(test)]
mod shader_tests;
mod tensor;

pub use autograd::{no_grad, BackwardOptions};
pub use device::{Device, DeviceInfo, DeviceStats, F16Reads, KernelFlavor};
pub use error::{Error, Result};
pub use ops::attention::SdpaOptions;
pub use ops::autocast::autocast;
pub use ops::conv::{Conv1dOptions, Conv2dOptions, ConvTranspose2dOptions};
pub use ops::pool::{Interpolate, Pool2dOptions};
pub use seed::manual_seed;
pub use tensor::dim::Dim;
pub use tensor::{DType, Tensor};
/// `#[derive(Module)]`: see [`nn::Module`](derive@nn::Module).
pub use wgrad_derive::Module;
