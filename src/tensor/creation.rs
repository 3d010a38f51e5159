//! Making tensors from host data (one upload) or from a seeded random generator. Tensors made
//! by a fill kernel (`zeros`, `ones`, `full`, `arange`) are in `ops/copy.rs`.

use std::sync::Arc;

use rand::{Rng, SeedableRng};
use rand_distr::{Distribution, StandardNormal};

use crate::device::Device;
use crate::error::{Error, Result};
use crate::tensor::{checked_numel, tape, DType, IndexRange, Layout, Storage, Tensor};

fn upload(
    op: &'static str,
    bytes: &[u8],
    shape: &[usize],
    dtype: DType,
    device: &Device,
) -> Result<Tensor> {
    upload_with(op, bytes, None, shape, dtype, device)
}

/// A contiguous tensor of `shape` holding `data()`, which a captured step calls again at each
/// replay: for host data that changes from step to step (dropout masks).
pub(crate) fn from_host_fn(
    op: &'static str,
    data: tape::HostBytes,
    shape: &[usize],
    dtype: DType,
    device: &Device,
) -> Result<Tensor> {
    let bytes = data();
    upload_with(op, &bytes, Some(data), shape, dtype, device)
}

fn upload_with(
    op: &'static str,
    bytes: &[u8],
    dynamic: Option<tape::HostBytes>,
    shape: &[usize],
    dtype: DType,
    device: &Device,
) -> Result<Tensor> {
    let storage = Storage::alloc(op, bytes.len() as u64, device)?;
    device.inner.upload(op, storage.buffer(), bytes)?;
    let storage = Arc::new(storage);
    tape::record_upload(&storage, bytes, dynamic);
    Ok(Tensor::from_parts(
        storage,
        Layout::contiguous(shape),
        dtype,
        device,
    ))
}

/// A 16-bit tensor of `shape` from its elements' bits, uploaded in whole 32-bit words (the
/// last one padded with zeros when the count is odd).
fn from_16_bit(
    op: &'static str,
    mut bits: Vec<u16>,
    shape: &[usize],
    dtype: DType,
    device: &Device,
) -> Result<Tensor> {
    check_len(op, bits.len(), shape)?;
    if bits.len() % 2 == 1 {
        bits.push(0);
    }
    upload(op, bytemuck::cast_slice(&bits), shape, dtype, device)
}

/// The element count of an f32 tensor of `shape` to be made on the host, checked against
/// what `device` can hold in one tensor before any host memory is taken for it.
pub(crate) fn checked_host_numel(
    op: &'static str,
    shape: &[usize],
    device: &Device,
) -> Result<usize> {
    let numel = checked_numel(op, shape)?;
    let bytes = numel as u64 * 4;
    let limit = device.max_tensor_bytes();
    if bytes > limit {
        return Err(Error::TooLarge { op, bytes, limit });
    }
    Ok(numel)
}

fn check_len(op: &'static str, len: usize, shape: &[usize]) -> Result<()> {
    let numel = checked_numel(op, shape)?;
    if len != numel {
        return Err(Error::InvalidArgument {
            op,
            msg: format!("{len} values do not fill shape {shape:?} ({numel} elements)"),
        });
    }
    Ok(())
}

impl Tensor {
    /// An f32 tensor of `shape` holding `data` in row-major order.
    ///
    /// ```
    /// # fn main() -> wgrad::Result<()> {
    /// let dev = wgrad::Device::new()?;
    /// let t = wgrad::Tensor::from_vec(vec![1.0, 2.0, 3.0, 4.0], &[2, 2], &dev)?;
    /// assert_eq!(t.to_vec()?, vec![1.0, 2.0, 3.0, 4.0]);
    /// # Ok(())
    /// # }
    /// ```
    pub fn from_vec(data: Vec<f32>, shape: &[usize], device: &Device) -> Result<Tensor> {
        Self::from_slice(&data, shape, device)
    }

    /// Like [`Tensor::from_vec`], from a borrowed slice.
    pub fn from_slice(data: &[f32], shape: &[usize], device: &Device) -> Result<Tensor> {
        check_len("from_vec", data.len(), shape)?;
        upload(
            "from_vec",
            bytemuck::cast_slice(data),
            shape,
            DType::F32,
            device,
        )
    }

    /// The `[n, n]` identity matrix.
    pub fn eye(n: usize, device: &Device) -> Result<Tensor> {
        let numel = checked_numel("eye", &[n, n])?;
        let mut data = vec![0.0f32; numel];
        for i in 0..n {
            data[i * n + i] = 1.0;
        }
        Tensor::from_vec(data, &[n, n], device)
    }

    /// `start, start + step, ..` up to `end` (excluded), as torch's float `arange`:
    /// `ceil((end - start) / step)` elements.
    pub fn arange_f(start: f32, end: f32, step: f32, device: &Device) -> Result<Tensor> {
        let count = ((end as f64 - start as f64) / step as f64).ceil();
        if step == 0.0 || !count.is_finite() || count < 0.0 || count > u32::MAX as f64 {
            return Err(Error::InvalidArgument {
                op: "arange_f",
                msg: format!(
                    "needs a nonzero step toward end, got start {start}, end {end}, step {step}"
                ),
            });
        }
        let data: Vec<f32> = (0..count as usize)
            .map(|i| (start as f64 + i as f64 * step as f64) as f32)
            .collect();
        let n = data.len();
        Tensor::from_vec(data, &[n], device)
    }

    /// A u32 tensor of `shape` (indices for `index_select` and `gather`).
    pub fn from_vec_u32(data: Vec<u32>, shape: &[usize], device: &Device) -> Result<Tensor> {
        check_len("from_vec_u32", data.len(), shape)?;
        let range = IndexRange::of(&data);
        Ok(upload(
            "from_vec_u32",
            bytemuck::cast_slice(&data),
            shape,
            DType::U32,
            device,
        )?
        .with_index_range(Some(range)))
    }

    /// An F16 tensor of `shape` holding `data` as it is (no rounding: the values are halves).
    pub fn from_vec_f16(data: Vec<half::f16>, shape: &[usize], device: &Device) -> Result<Tensor> {
        let bits: Vec<u16> = data.iter().map(|h| h.to_bits()).collect();
        from_16_bit("from_vec_f16", bits, shape, DType::F16, device)
    }

    /// A BF16 tensor of `shape` holding `data` as it is.
    pub fn from_vec_bf16(
        data: Vec<half::bf16>,
        shape: &[usize],
        device: &Device,
    ) -> Result<Tensor> {
        let bits: Vec<u16> = data.iter().map(|h| h.to_bits()).collect();
        from_16_bit("from_vec_bf16", bits, shape, DType::BF16, device)
    }

    /// A u32 `[rows, cols]` mask: 1 where `j <= i + diagonal` (on and below that diagonal),
    /// else 0. For [`Tensor::masked_fill`].
    pub fn tril_mask(rows: usize, cols: usize, diagonal: i64, device: &Device) -> Result<Tensor> {
        let data = (0..checked_numel("tril_mask", &[rows, cols])?)
            .map(|x| ((x % cols) as i64 <= ((x / cols) as i64).saturating_add(diagonal)) as u32)
            .collect();
        Self::from_vec_u32(data, &[rows, cols], device)
    }

    /// A u32 `[rows, cols]` mask: 1 where `j >= i + diagonal` (on and above that diagonal),
    /// else 0. `triu_mask(t, t, 1)` masks what a causal attention must not see.
    pub fn triu_mask(rows: usize, cols: usize, diagonal: i64, device: &Device) -> Result<Tensor> {
        let data = (0..checked_numel("triu_mask", &[rows, cols])?)
            .map(|x| ((x % cols) as i64 >= ((x / cols) as i64).saturating_add(diagonal)) as u32)
            .collect();
        Self::from_vec_u32(data, &[rows, cols], device)
    }

    /// A 1-D u32 tensor of class labels, for `nn::loss::cross_entropy`.
    pub fn from_labels(labels: Vec<u32>, device: &Device) -> Result<Tensor> {
        let n = labels.len();
        Self::from_vec_u32(labels, &[n], device)
    }

    /// Uniform samples in `[0, 1)`, reproducible from `seed`.
    pub fn rand(shape: &[usize], seed: u64, device: &Device) -> Result<Tensor> {
        let data = uniform_values(checked_host_numel("rand", shape, device)?, seed);
        upload(
            "rand",
            bytemuck::cast_slice(&data),
            shape,
            DType::F32,
            device,
        )
    }

    /// Standard normal samples, reproducible from `seed`.
    pub fn randn(shape: &[usize], seed: u64, device: &Device) -> Result<Tensor> {
        let n = checked_host_numel("randn", shape, device)?;
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let data: Vec<f32> = (0..n).map(|_| StandardNormal.sample(&mut rng)).collect();
        upload(
            "randn",
            bytemuck::cast_slice(&data),
            shape,
            DType::F32,
            device,
        )
    }

    /// Values from N(mean, std^2) drawn from the global generator ([`crate::manual_seed`]), as
    /// `torch.normal(mean, std, shape)` (and `torch.randn` at 0, 1): a second call gives new
    /// values; [`Tensor::randn`] takes its own seed instead. A negative or non-finite std is
    /// an error, as torch's.
    pub fn normal(shape: &[usize], mean: f32, std: f32, device: &Device) -> Result<Tensor> {
        if !(std >= 0.0 && std.is_finite() && mean.is_finite()) {
            return Err(Error::InvalidArgument {
                op: "normal",
                msg: format!(
                    "needs a finite mean and a finite std >= 0, got mean {mean} and std {std}"
                ),
            });
        }
        let n = checked_host_numel("normal", shape, device)?;
        let data = normal_values(n, mean, std, crate::seed::next_seed());
        upload(
            "normal",
            bytemuck::cast_slice(&data),
            shape,
            DType::F32,
            device,
        )
    }

    /// Values uniform in `[low, high)` drawn from the global generator, as
    /// `torch.empty(shape).uniform_(low, high)` (and `torch.rand` at 0, 1); `low > high` is an
    /// error, as torch's.
    pub fn uniform(shape: &[usize], low: f32, high: f32, device: &Device) -> Result<Tensor> {
        if !(low <= high && low.is_finite() && high.is_finite()) {
            return Err(Error::InvalidArgument {
                op: "uniform",
                msg: format!("needs finite bounds with low <= high, got low {low} and high {high}"),
            });
        }
        let n = checked_host_numel("uniform", shape, device)?;
        let data: Vec<f32> = uniform_values(n, crate::seed::next_seed())
            .into_iter()
            .map(|u| low + (high - low) * u)
            .collect();
        upload(
            "uniform",
            bytemuck::cast_slice(&data),
            shape,
            DType::F32,
            device,
        )
    }
}

/// The `n` values `Tensor::rand` draws from `seed`: uniform in `[0, 1)`.
/// `n` values from N(mean, std^2), drawn from a generator seeded with `seed`.
pub(crate) fn normal_values(n: usize, mean: f32, std: f32, seed: u64) -> Vec<f32> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    (0..n)
        .map(|_| {
            let z: f32 = StandardNormal.sample(&mut rng);
            mean + std * z
        })
        .collect()
}

pub(crate) fn uniform_values(n: usize, seed: u64) -> Vec<f32> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    (0..n).map(|_| rng.random::<f32>()).collect()
}
