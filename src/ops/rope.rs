//! Rotary position embeddings (RoPE), the Hugging Face Llama convention: one kernel forward
//! and one backward (`shaders/rope.wgsl`), reading cos/sin tables built on the device once.

use crate::device::Device;
use crate::error::{Error, Result};
use crate::kernel::{groups, Kernel, KernelParams, Launch, ShaderFamily, WORKGROUP};
use crate::ops::{cast, in_row_runs};
use crate::tensor::grad_mode::NoGradGuard;
use crate::tensor::graph::record;
use crate::tensor::{DType, Tensor};

crate::kernel_params! {
    /// `positions` x `half` table entries; `rows` rows of `2 half` features, row `r` at
    /// position `first + r % seq`; `sign` 1 forward, -1 backward.
    pub(crate) struct RopeParams {
        positions: u32,
        half: u32,
        theta: f32,
        rows: u32,
        seq: u32,
        first: u32,
        x_offset: u32,
        sign: f32,
    }
}

static ROPE: ShaderFamily = ShaderFamily {
    name: "rope",
    wgsl: include_str!("../../shaders/rope.wgsl"),
    params: &[&RopeParams::LAYOUT],
    preludes: &[],
};

#[cfg(test)]
pub(crate) fn kernel_sources() -> Vec<(String, String)> {
    vec![("rope".into(), ROPE.source(&[]))]
}

/// The cos and sin of every position's angle per frequency, `[2, positions, head_dim / 2]`.
#[derive(Clone)]
pub(crate) struct RopeTable {
    table: Tensor,
    positions: usize,
    head_dim: usize,
}

impl RopeTable {
    /// Builds the table on the device: one launch.
    pub fn new(
        head_dim: usize,
        positions: usize,
        theta: f32,
        device: &Device,
    ) -> Result<RopeTable> {
        const OP: &str = "RotaryEmbedding::new";
        if head_dim == 0 || head_dim % 2 == 1 || !(theta > 0.0 && theta.is_finite()) {
            return Err(Error::InvalidArgument {
                op: OP,
                msg: format!(
                    "needs an even head_dim and a finite theta > 0, got head_dim {head_dim} and theta {theta}"
                ),
            });
        }
        let half = head_dim / 2;
        let table = Tensor::empty(OP, &[2, positions, half], DType::F32, device)?;
        let params = RopeParams {
            positions: positions as u32,
            half: half as u32,
            theta,
            ..Default::default()
        };
        if positions > 0 {
            let kernel = Kernel::plain(&ROPE, "build_table");
            let workgroups = groups(positions * half, WORKGROUP);
            Launch::new(OP, &kernel, &[(1, &table)], &params).record(workgroups)?;
        }
        Ok(RopeTable {
            table,
            positions,
            head_dim,
        })
    }

    /// `x` (`[.., T, head_dim]`) with each position `first + t` turned by its angles.
    pub fn apply(&self, x: &Tensor, first: usize) -> Result<Tensor> {
        const OP: &str = "rotary_embedding";
        if let Some(out) = cast::through_f32(OP, &[x], |w| self.apply(&w[0], first))? {
            return Ok(out);
        }
        x.expect_dtype(OP, DType::F32)?;
        let (seq, dim) = match x.shape() {
            [.., seq, dim] => (*seq, *dim),
            _ => (0, 0),
        };
        if x.rank() < 2 || dim != self.head_dim {
            return Err(Error::Shape {
                op: OP,
                msg: format!("needs [.., T, {}], got {:?}", self.head_dim, x.shape()),
            });
        }
        if first.saturating_add(seq) > self.positions {
            return Err(Error::Shape {
                op: OP,
                msg: format!(
                    "positions from {first} for {seq} rows of input {:?} pass the table's {} \
                     positions",
                    x.shape(),
                    self.positions
                ),
            });
        }
        let rows = x.numel() / dim.max(1);
        let params = RopeParams {
            positions: self.positions as u32,
            half: (dim / 2) as u32,
            rows: rows as u32,
            seq: seq.max(1) as u32,
            first: first as u32,
            sign: 1.0,
            ..Default::default()
        };
        let out = self.turn(x, params)?;
        let table = self.clone();
        Ok(record(OP, out, &[x], move |_| {
            move |g: &Tensor| {
                let back = RopeParams {
                    sign: -1.0,
                    ..params
                };
                Ok(vec![Some(table.turn(g, back)?)])
            }
        }))
    }

    /// One `apply` launch over `x` (made contiguous) into a new tensor; past one binding, one
    /// per run of whole sequences (each turned from the same first position), the results
    /// joined end to end.
    fn turn(&self, x: &Tensor, params: RopeParams) -> Result<Tensor> {
        const OP: &str = "rotary_embedding";
        let _no_grad = NoGradGuard::new();
        let x = x.contiguous()?;
        let window = x.bindable();
        if !window.exceeds_binding() {
            return self.turn_within_binding(&window, params);
        }
        let (rows, seq) = (params.rows as usize, params.seq as usize);
        let sequences = x.reshape(&[rows / seq, seq * 2 * params.half as usize])?;
        let parts = in_row_runs(OP, &sequences, |run| {
            let params = RopeParams {
                rows: (run.shape()[0] * seq) as u32,
                ..params
            };
            self.turn_within_binding(&run.bindable(), params)
        })?;
        Tensor::cat(&parts, 0)?.reshape(x.shape())
    }

    /// One `apply` launch over the contiguous `x`, which fits one binding, into a new tensor.
    fn turn_within_binding(&self, x: &Tensor, params: RopeParams) -> Result<Tensor> {
        const OP: &str = "rotary_embedding";
        let out = Tensor::empty(OP, x.shape(), DType::F32, x.device())?;
        let pairs = params.rows as usize * params.half as usize;
        if pairs > 0 {
            let params = RopeParams {
                x_offset: x.layout().offset as u32,
                ..params
            };
            let kernel = Kernel::plain(&ROPE, "apply");
            let bound = [(1, &self.table), (2, x), (3, &out)];
            Launch::new(OP, &kernel, &bound, &params).record(groups(pairs, WORKGROUP))?;
        }
        Ok(out)
    }
}
