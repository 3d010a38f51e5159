//! `RotaryEmbedding`: rotary position embeddings for attention heads.

use crate::device::Device;
use crate::error::Result;
use crate::ops::rope::RopeTable;
use crate::tensor::Tensor;

/// Rotary position embeddings as Hugging Face's Llama applies them to queries and keys:
/// feature `j` of the first half of a head turns with feature `j + head_dim / 2` by the angle
/// `position * theta^(-2 j / head_dim)` (`rotate_half`). The cos/sin tables are built on the
/// device once, at `new`; `apply` is one kernel forward and one backward. No parameters.
///
/// ```
/// # fn main() -> wgrad::Result<()> {
/// use wgrad::{nn, Device, Tensor};
/// let dev = Device::new()?;
/// let rope = nn::RotaryEmbedding::new(4, 16, 10000.0, &dev)?;
/// let q = Tensor::ones(&[1, 2, 3, 4], &dev)?;        // [B, H, T, head_dim]
/// let turned = rope.apply(&q, 0)?;                    // positions 0, 1, 2
/// assert_eq!(turned.to_vec()?[..4], [1.0, 1.0, 1.0, 1.0]); // position 0: no turn
/// # Ok(())
/// # }
/// ```
pub struct RotaryEmbedding {
    table: RopeTable,
}

impl RotaryEmbedding {
    /// Tables for heads of `head_dim` (even) features at positions `0..max_positions`.
    pub fn new(
        head_dim: usize,
        max_positions: usize,
        theta: f32,
        device: &Device,
    ) -> Result<RotaryEmbedding> {
        Ok(RotaryEmbedding {
            table: RopeTable::new(head_dim, max_positions, theta, device)?,
        })
    }

    /// `x` (`[.., T, head_dim]`, as `[B, H, T, head_dim]`) with row `t` turned for position
    /// `first_position + t` (a KV cache's offset when decoding). Positions past the table
    /// are an `Error`.
    pub fn apply(&self, x: &Tensor, first_position: usize) -> Result<Tensor> {
        self.table.apply(x, first_position)
    }
}
