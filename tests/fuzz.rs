//! A seeded fuzzer: random programs of ops (unary, broadcasting binary, reductions, views,
//! matmul, softmax, index_select with repeats, cat, and the ops of today's models: sin, cos,
//! silu, softplus, leaky_relu, clamp, powf, minimum, comparison masks with where_cond and
//! masked_fill, tril, topk, sort, RMSNorm, LayerNorm and GroupNorm, conv2d with stride,
//! padding, dilation and groups, conv_transpose2d, interpolate, pad2d, adaptive_avg_pool2d,
//! max and average pools with padding and ceil mode, rotary embeddings, cumsum, flip,
//! logsumexp, var, gather, index_add and scatter_add with repeats, attention with causal
//! masks and grouped-query heads, cross-entropy, MSE, L1, smooth L1 and binary cross-entropy,
//! broadcast views, ops along dim 0 of 0-d tensors) over random shapes (0- and 1-sized dims,
//! broadcasting, ranks 0 to 6; rank 7 must be an error), on inputs dense or views followed by
//! NaN, in F32 or (one case in four) F16 or BF16, run on wgrad and on an f64 CPU interpreter.
//! Values must agree; for programs of smooth ops, finite differences must agree with the grad
//! of the first input; nothing may panic.
//!
//! `cargo test` runs 150 cases from seed 0. `WGRAD_FUZZ_CASES=N` runs N cases and
//! `WGRAD_FUZZ_SEED=S` starts from case S (each case is reproducible from its number alone).
//! Under `WGRAD_MAX_BINDING_BYTES=256` the same tensors are past one binding: ops bind
//! windows of them, and a case ends where an op that cannot is `TooLarge`.
//!
//! The same programs, with a backward pass, also run as captured steps (`capture::Step`):
//! a replay's output and input grad must equal an eager run's, whatever the fuser merged.
//! Each case compiles its own fused kernels, so `cargo test` runs 30 such cases;
//! `WGRAD_CAPTURE_FUZZ_CASES=N` runs N (from `WGRAD_FUZZ_SEED`).

mod common;
use common::*;
use std::cell::Cell;
use std::panic::{catch_unwind, AssertUnwindSafe};
use wgrad::capture::Step;
use wgrad::{DType, Tensor};

/// A tensor on the CPU: row-major f64 values.
#[derive(Clone, Debug)]
struct Cpu {
    shape: Vec<usize>,
    data: Vec<f64>,
}

impl Cpu {
    fn numel(shape: &[usize]) -> usize {
        shape.iter().product()
    }

    fn map(&self, f: impl Fn(f64) -> f64) -> Cpu {
        Cpu {
            shape: self.shape.clone(),
            data: self.data.iter().map(|&x| f(x)).collect(),
        }
    }

    /// Element `index` of `self` broadcast to `shape` (NumPy rules).
    fn at_broadcast(&self, index: &[usize]) -> f64 {
        let lead = index.len() - self.shape.len();
        let mut flat = 0;
        for (d, &n) in self.shape.iter().enumerate() {
            let i = if n == 1 { 0 } else { index[lead + d] };
            flat = flat * n + i;
        }
        self.data[flat]
    }

    fn binary(&self, other: &Cpu, f: impl Fn(f64, f64) -> f64) -> Cpu {
        let rank = self.shape.len().max(other.shape.len());
        let dim = |s: &[usize], d: usize| {
            let lead = rank - s.len();
            if d < lead {
                1
            } else {
                s[d - lead]
            }
        };
        let shape: Vec<usize> = (0..rank)
            .map(|d| {
                let (a, b) = (dim(&self.shape, d), dim(&other.shape, d));
                if a == 1 {
                    b
                } else {
                    a
                }
            })
            .collect();
        let data = (0..Cpu::numel(&shape))
            .map(|i| {
                let index = unravel(i, &shape);
                f(self.at_broadcast(&index), other.at_broadcast(&index))
            })
            .collect();
        Cpu { shape, data }
    }

    /// Folds `dims` with `f` from `init`; `keepdim` keeps them as size 1.
    fn reduce(&self, dims: &[usize], keepdim: bool, init: f64, f: impl Fn(f64, f64) -> f64) -> Cpu {
        let kept: Vec<usize> = self
            .shape
            .iter()
            .enumerate()
            .map(|(d, &n)| if dims.contains(&d) { 1 } else { n })
            .collect();
        let mut data = vec![init; Cpu::numel(&kept)];
        for i in 0..self.data.len() {
            let mut index = unravel(i, &self.shape);
            for &d in dims {
                index[d] = 0;
            }
            let flat = index
                .iter()
                .zip(strides(&kept))
                .map(|(a, b)| a * b)
                .sum::<usize>();
            data[flat] = f(data[flat], self.data[i]);
        }
        let shape = if keepdim {
            kept
        } else {
            self.shape
                .iter()
                .enumerate()
                .filter(|(d, _)| !dims.contains(d))
                .map(|(_, &n)| n)
                .collect()
        };
        Cpu { shape, data }
    }

    fn permute(&self, order: &[usize]) -> Cpu {
        let shape: Vec<usize> = order.iter().map(|&d| self.shape[d]).collect();
        let src = strides(&self.shape);
        let data = (0..self.data.len())
            .map(|i| {
                let index = unravel(i, &shape);
                let flat: usize = order
                    .iter()
                    .enumerate()
                    .map(|(k, &d)| index[k] * src[d])
                    .sum();
                self.data[flat]
            })
            .collect();
        Cpu { shape, data }
    }

    fn narrow(&self, dim: usize, start: usize, len: usize) -> Cpu {
        let mut shape = self.shape.clone();
        shape[dim] = len;
        let src = strides(&self.shape);
        let data = (0..Cpu::numel(&shape))
            .map(|i| {
                let mut index = unravel(i, &shape);
                index[dim] += start;
                index.iter().zip(&src).map(|(a, b)| a * b).sum::<usize>()
            })
            .map(|flat| self.data[flat])
            .collect();
        Cpu { shape, data }
    }

    /// `parts` joined along `dim` (all alike elsewhere); `like` gives the shape when there are
    /// none or all are empty.
    fn cat(like: &Cpu, parts: &[Cpu], dim: usize) -> Cpu {
        let mut shape = like.shape.clone();
        shape[dim] = parts.iter().map(|p| p.shape[dim]).sum();
        let mut data = vec![0.0; Cpu::numel(&shape)];
        let mut start = 0;
        for part in parts {
            for (i, &v) in part.data.iter().enumerate() {
                let mut index = unravel(i, &part.shape);
                index[dim] += start;
                let flat: usize = index.iter().zip(strides(&shape)).map(|(a, b)| a * b).sum();
                data[flat] = v;
            }
            start += part.shape[dim];
        }
        Cpu { shape, data }
    }

    /// `self [.., m, k] @ other [k, n]`.
    fn matmul(&self, other: &Cpu) -> Cpu {
        let r = self.shape.len();
        let (m, k, n) = (self.shape[r - 2], self.shape[r - 1], other.shape[1]);
        let batches = Cpu::numel(&self.shape[..r - 2]);
        let mut data = vec![0.0; batches * m * n];
        for b in 0..batches {
            for i in 0..m {
                for j in 0..n {
                    data[(b * m + i) * n + j] = (0..k)
                        .map(|l| self.data[(b * m + i) * k + l] * other.data[l * n + j])
                        .sum();
                }
            }
        }
        let mut shape = self.shape.clone();
        shape[r - 1] = n;
        Cpu { shape, data }
    }

    /// `f` applied to every line along `dim` (each line's values in order), giving lines of
    /// `len` values: the op of a row kernel, on the CPU.
    fn along(&self, dim: usize, len: usize, f: impl Fn(&[f64]) -> Vec<f64>) -> Cpu {
        let r = self.shape.len();
        let mut order: Vec<usize> = (0..r).filter(|&d| d != dim).collect();
        order.push(dim);
        let moved = self.permute(&order);
        let n = self.shape[dim];
        let rows = Cpu::numel(&moved.shape[..r - 1]);
        let data: Vec<f64> = (0..rows)
            .flat_map(|i| f(&moved.data[i * n..(i + 1) * n]))
            .collect();
        let mut shape = moved.shape.clone();
        shape[r - 1] = len;
        let mut back = vec![0; r];
        for (k, &d) in order.iter().enumerate() {
            back[d] = k;
        }
        Cpu { shape, data }.permute(&back)
    }

    /// Softmax (or log-softmax) along `dim`.
    fn softmax(&self, dim: usize, log: bool) -> Cpu {
        let max = self.reduce(&[dim], true, f64::NEG_INFINITY, f64::max);
        let shifted = self.binary(&max, |x, m| x - m);
        let sum = shifted
            .map(f64::exp)
            .reduce(&[dim], true, 0.0, |a, b| a + b);
        if log {
            shifted.binary(&sum, |x, s| x - s.ln())
        } else {
            shifted.binary(&sum, |x, s| x.exp() / s)
        }
    }
}

/// A deterministic random stream for one case.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }

    /// Dims of 0 to 5; under `WGRAD_MAX_BINDING_BYTES`, also of 9 and 13, so that most
    /// tensors are past a binding of a few hundred bytes.
    fn shape(&mut self, max_rank: usize) -> Vec<usize> {
        let rank = self.below(max_rank + 1);
        let dims = if binding_capped() { 9 } else { 7 };
        (0..rank)
            .map(|_| [1, 2, 3, 5, 1, 2, 0, 9, 13][self.below(dims)])
            .collect()
    }
}

/// A pair: the wgrad tensor and its CPU twin.
struct Pair {
    gpu: Tensor,
    cpu: Cpu,
}

thread_local! {
    /// The float dtype of the tensors the running case makes (see [`case_dtype`]).
    static DTYPE: Cell<DType> = const { Cell::new(DType::F32) };
}

/// The dtype of a case's tensors: F32 for six cases in eight, F16 and BF16 for one each
/// (their kernels read two elements to a word: a view may start or end inside one). The
/// reference rounds the inputs alike, and 16-bit cases take no finite differences.
fn case_dtype(case: u64) -> DType {
    match Rng(case ^ 0xD1B5_4A32_D192_ED03).below(8) {
        0 => DType::F16,
        1 => DType::BF16,
        _ => DType::F32,
    }
}

/// Sets [`DTYPE`] for the life of the guard.
struct DTypeGuard;

impl DTypeGuard {
    fn new(dtype: DType) -> DTypeGuard {
        DTYPE.with(|d| d.set(dtype));
        DTypeGuard
    }
}

impl Drop for DTypeGuard {
    fn drop(&mut self) {
        DTYPE.with(|d| d.set(DType::F32));
    }
}

/// `t` in the case's dtype.
fn in_case_dtype(t: Tensor) -> Tensor {
    match DTYPE.with(Cell::get) {
        DType::F32 => t,
        dtype => t.to_dtype(dtype).unwrap(),
    }
}

/// `v` as the case's dtype holds it.
fn rounded(v: f32) -> f32 {
    match DTYPE.with(Cell::get) {
        DType::F16 => half::f16::from_f32(v).to_f32(),
        DType::BF16 => half::bf16::from_f32(v).to_f32(),
        _ => v,
    }
}

/// Random values of `shape` in the case's dtype: half the time dense, else a view whose rows,
/// or whose whole span, are followed by NaN (the last dim or the first narrowed from one
/// longer), which no kernel may let into a result (vec4 loads read past a row's end).
fn fresh(shape: &[usize], seed: u64) -> Pair {
    let (dense, values) = random_tensor(shape, seed);
    let cpu = Cpu {
        shape: shape.to_vec(),
        data: values.iter().map(|&x| rounded(x) as f64).collect(),
    };
    let Some(dim) = (match seed % 4 {
        1 => shape.len().checked_sub(1),
        2 if !shape.is_empty() => Some(0),
        _ => None,
    }) else {
        return Pair {
            gpu: in_case_dtype(dense),
            cpu,
        };
    };
    let mut padded_shape = shape.to_vec();
    padded_shape[dim] += 1;
    let padded = in_case_dtype(Tensor::full(&padded_shape, f32::NAN, device()).unwrap());
    let gpu = padded.narrow(dim, 0, shape[dim]).unwrap();
    gpu.copy_(&in_case_dtype(dense)).unwrap();
    Pair { gpu, cpu }
}

/// A shape that broadcasts with `shape`: some trailing dims, some set to 1.
fn broadcastable(rng: &mut Rng, shape: &[usize]) -> Vec<usize> {
    let keep = shape.len() - rng.below(shape.len() + 1);
    shape[shape.len() - keep..]
        .iter()
        .map(|&n| if rng.below(3) == 0 { 1 } else { n })
        .collect()
}

/// One random op applied to `x` (on both sides); `smooth` turns false on kinks.
fn step(rng: &mut Rng, x: &Pair, seed: u64, smooth: &mut bool) -> wgrad::Result<Pair> {
    let r = x.cpu.shape.len();
    let pair = |gpu: Tensor, cpu: Cpu| Ok(Pair { gpu, cpu });
    match rng.below(37) {
        0 => pair(x.gpu.tanh()?, x.cpu.map(f64::tanh)),
        1 => pair(x.gpu.sigmoid()?, x.cpu.map(|v| 1.0 / (1.0 + (-v).exp()))),
        2 => pair(
            x.gpu.mul_scalar(1.5)?.add_scalar(-0.25)?,
            x.cpu.map(|v| v * 1.5 - 0.25),
        ),
        3 => {
            *smooth = false;
            pair(x.gpu.relu()?, x.cpu.map(|v| v.max(0.0)))
        }
        4..=6 => {
            let other = fresh(&broadcastable(rng, &x.cpu.shape), seed);
            match rng.below(3) {
                0 => pair(
                    x.gpu.add(&other.gpu)?,
                    x.cpu.binary(&other.cpu, |a, b| a + b),
                ),
                1 => pair(
                    x.gpu.sub(&other.gpu)?,
                    x.cpu.binary(&other.cpu, |a, b| a - b),
                ),
                _ => pair(
                    x.gpu.mul(&other.gpu)?,
                    x.cpu.binary(&other.cpu, |a, b| a * b),
                ),
            }
        }
        7 if r > 0 => {
            let dims: Vec<usize> = (0..r).filter(|_| rng.below(2) == 0).collect();
            let keepdim = rng.below(2) == 0;
            match rng.below(3) {
                0 => pair(
                    x.gpu.sum_dims(&dims, keepdim)?,
                    x.cpu.reduce(&dims, keepdim, 0.0, |a, b| a + b),
                ),
                1 if dims.iter().all(|&d| x.cpu.shape[d] > 0) => {
                    let count: usize = dims.iter().map(|&d| x.cpu.shape[d]).product();
                    let sum = x.cpu.reduce(&dims, keepdim, 0.0, |a, b| a + b);
                    pair(
                        x.gpu.mean_dims(&dims, keepdim)?,
                        sum.map(|v| v / count as f64),
                    )
                }
                _ if dims.iter().all(|&d| x.cpu.shape[d] > 0) => {
                    *smooth = false;
                    pair(
                        x.gpu.max_dims(&dims, keepdim)?,
                        x.cpu.reduce(&dims, keepdim, f64::NEG_INFINITY, f64::max),
                    )
                }
                _ => pair(x.gpu.clone(), x.cpu.clone()),
            }
        }
        8 if r >= 2 => {
            let (a, b) = (rng.below(r), rng.below(r));
            let mut order: Vec<usize> = (0..r).collect();
            order.swap(a, b);
            pair(x.gpu.transpose(a, b)?, x.cpu.permute(&order))
        }
        9 if r > 0 => {
            let dim = rng.below(r);
            let n = x.cpu.shape[dim];
            let start = rng.below(n + 1);
            if rng.below(2) == 0 {
                let len = rng.below(n - start + 1);
                pair(
                    x.gpu.narrow(dim, start, len)?,
                    x.cpu.narrow(dim, start, len),
                )
            } else {
                // Both pieces of a split, swapped and one scaled: each gets its own grad.
                let pieces = x.gpu.split(&[start, n - start], dim)?;
                let head = x.cpu.narrow(dim, 0, start).map(|v| 2.0 * v);
                let tail = x.cpu.narrow(dim, start, n - start);
                pair(
                    Tensor::cat(&[pieces[1].clone(), pieces[0].mul_scalar(2.0)?], dim)?,
                    Cpu::cat(&tail, &[tail.clone(), head], dim),
                )
            }
        }
        10 if r < 6 => {
            let dim = rng.below(r + 1);
            let mut shape = x.cpu.shape.clone();
            shape.insert(dim, 1);
            pair(
                x.gpu.unsqueeze(dim)?,
                Cpu {
                    shape,
                    data: x.cpu.data.clone(),
                },
            )
        }
        11 if r >= 2 => {
            let k = x.cpu.shape[r - 1];
            let n = [1, 2, 3, 5][rng.below(4)];
            let other = fresh(&[k, n], seed);
            pair(x.gpu.matmul(&other.gpu)?, x.cpu.matmul(&other.cpu))
        }
        12 if r > 0 && x.cpu.shape.iter().all(|&n| n > 0) => {
            let dim = rng.below(r);
            let log = rng.below(2) == 0;
            let gpu = if log {
                x.gpu.log_softmax(dim)?
            } else {
                x.gpu.softmax(dim)?
            };
            pair(gpu, x.cpu.softmax(dim, log))
        }
        13 => {
            let n = x.cpu.data.len();
            pair(
                x.gpu.reshape(&[n])?,
                Cpu {
                    shape: vec![n],
                    data: x.cpu.data.clone(),
                },
            )
        }
        14 if r > 0 => {
            let dim = rng.below(r);
            let size = x.cpu.shape[dim];
            let count = if size == 0 { 0 } else { rng.below(5) };
            let picks: Vec<u32> = (0..count).map(|_| rng.below(size) as u32).collect();
            let indices = Tensor::from_vec_u32(picks.clone(), &[count], device())?;
            let parts: Vec<Cpu> = picks
                .iter()
                .map(|&p| x.cpu.narrow(dim, p as usize, 1))
                .collect();
            pair(
                x.gpu.index_select(dim, &indices)?,
                Cpu::cat(&x.cpu, &parts, dim),
            )
        }
        15 if r > 0 => {
            let dim = rng.below(r);
            let mut shape = x.cpu.shape.clone();
            shape[dim] = rng.below(3);
            let other = fresh(&shape, seed);
            let gpu = Tensor::cat(&[x.gpu.clone(), other.gpu.clone()], dim)?;
            pair(gpu, Cpu::cat(&x.cpu, &[x.cpu.clone(), other.cpu], dim))
        }
        16 => match rng.below(5) {
            0 => pair(x.gpu.sin()?, x.cpu.map(f64::sin)),
            1 => pair(x.gpu.cos()?, x.cpu.map(f64::cos)),
            2 => pair(x.gpu.silu()?, x.cpu.map(|v| v / (1.0 + (-v).exp()))),
            3 => pair(x.gpu.softplus()?, x.cpu.map(|v| (1.0 + v.exp()).ln())),
            _ => {
                *smooth = false;
                pair(
                    x.gpu.leaky_relu(0.1)?,
                    x.cpu.map(|v| if v > 0.0 { v } else { 0.1 * v }),
                )
            }
        },
        17 => {
            // A comparison mask picks between x and another tensor: a kink where they meet.
            *smooth = false;
            let other = fresh(&broadcastable(rng, &x.cpu.shape), seed);
            let mask = x.gpu.gt_scalar(0.0)?;
            let twice = other.gpu.mul_scalar(2.0)?;
            let cpu = x
                .cpu
                .binary(&other.cpu, |a, b| if a > 0.0 { a } else { 2.0 * b });
            pair(mask.where_cond(&x.gpu, &twice)?, cpu)
        }
        18 => {
            *smooth = false;
            let other = fresh(&broadcastable(rng, &x.cpu.shape), seed);
            pair(
                x.gpu.minimum(&other.gpu)?,
                x.cpu.binary(&other.cpu, f64::min),
            )
        }
        19 if r > 0 => {
            // topk (largest first) or an ascending sort along a dim.
            *smooth = false;
            let dim = rng.below(r);
            let n = x.cpu.shape[dim];
            let k = rng.below(n + 1);
            let sorted = |line: &[f64], descending: bool| {
                let mut v = line.to_vec();
                // NaN above every number, as torch sorts it.
                v.sort_by(|a, b| (a.is_nan().cmp(&b.is_nan())).then(a.total_cmp(b)));
                if descending {
                    v.reverse();
                }
                v
            };
            if rng.below(2) == 0 {
                let cpu = x.cpu.along(dim, k, |line| sorted(line, true)[..k].to_vec());
                pair(x.gpu.topk(k, dim)?.0, cpu)
            } else {
                let cpu = x.cpu.along(dim, n, |line| sorted(line, false));
                pair(x.gpu.sort(dim, false)?.0, cpu)
            }
        }
        20 if r >= 2 && x.cpu.shape[1] > 0 && rng.below(3) == 0 => {
            // GroupNorm over 1, 2 or C groups of dim 1's channels (and the dims after).
            let c = x.cpu.shape[1];
            let groups = [1, if c.is_multiple_of(2) { 2 } else { 1 }, c][rng.below(3)];
            let rows = x.cpu.shape[0] * groups;
            let per = Cpu::numel(&x.cpu.shape[1..]) / groups;
            let flat = Cpu {
                shape: vec![rows, per],
                data: x.cpu.data.clone(),
            };
            let normed = flat.along(1, per, |line| {
                let mean = line.iter().sum::<f64>() / per as f64;
                let var = line.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / per as f64;
                line.iter()
                    .map(|v| (v - mean) / (var + 1e-5).sqrt())
                    .collect()
            });
            let cpu = Cpu {
                shape: x.cpu.shape.clone(),
                data: normed.data,
            };
            pair(x.gpu.group_norm(groups, None, None, 1e-5)?, cpu)
        }
        20 if r > 0 => {
            // RMSNorm or LayerNorm over the last dim, weight 1.5.
            let n = x.cpu.shape[r - 1];
            let w = in_case_dtype(Tensor::full(&[n], 1.5, device())?);
            if rng.below(2) == 0 {
                let cpu = x.cpu.along(r - 1, n, |line| {
                    let ms = line.iter().map(|v| v * v).sum::<f64>() / n as f64;
                    line.iter().map(|v| 1.5 * v / (ms + 1e-6).sqrt()).collect()
                });
                pair(x.gpu.rms_norm(&w, 1e-6)?, cpu)
            } else {
                let b = in_case_dtype(Tensor::full(&[n], 0.25, device())?);
                let cpu = x.cpu.along(r - 1, n, |line| {
                    let mean = line.iter().sum::<f64>() / n as f64;
                    let var = line.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / n as f64;
                    line.iter()
                        .map(|v| 1.5 * (v - mean) / (var + 1e-5).sqrt() + 0.25)
                        .collect()
                });
                pair(x.gpu.layer_norm(&w, &b, 1e-5)?, cpu)
            }
        }
        21 if r == 4 && x.cpu.shape.iter().all(|&n| n > 0) && x.cpu.data.len() <= 512 => {
            // A U-Net up step: conv_transpose2d, kernel 2, stride 2, 2 output channels.
            let c = x.cpu.shape[1];
            let w = fresh(&[c, 2, 2, 2], seed);
            let o = wgrad::ConvTranspose2dOptions {
                stride: 2,
                ..Default::default()
            };
            pair(
                x.gpu.conv_transpose2d(&w.gpu, None, &o)?,
                conv_transpose_2x2(&x.cpu, &w.cpu),
            )
        }
        22 if r > 0 => {
            // Along one dim: a running sum, a flip, a log-sum-exp or a variance (kept dims).
            let dim = rng.below(r);
            let n = x.cpu.shape[dim];
            match rng.below(4) {
                0 => {
                    let cpu = x.cpu.along(dim, n, |line| {
                        line.iter()
                            .scan(0.0, |sum, v| {
                                *sum += v;
                                Some(*sum)
                            })
                            .collect()
                    });
                    pair(x.gpu.cumsum(dim)?, cpu)
                }
                2 if n > 0 => {
                    let cpu = x.cpu.along(dim, 1, |line| {
                        let m = line.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                        vec![m + line.iter().map(|v| (v - m).exp()).sum::<f64>().ln()]
                    });
                    pair(x.gpu.logsumexp(&[dim], true)?, cpu)
                }
                3 if n >= 2 => {
                    let cpu = x.cpu.along(dim, 1, |line| {
                        let mean = line.iter().sum::<f64>() / n as f64;
                        let squares = line.iter().map(|v| (v - mean).powi(2)).sum::<f64>();
                        vec![squares / (n - 1) as f64]
                    });
                    pair(x.gpu.var_dims(&[dim], 1, true)?, cpu)
                }
                _ => pair(
                    x.gpu.flip(&[dim])?,
                    x.cpu
                        .along(dim, n, |line| line.iter().rev().copied().collect()),
                ),
            }
        }
        23 if r > 0 => {
            // gather along a dim by indices of x's shape but 0 to 3 long there, the same
            // picks on every line (repeats included: their grads add up).
            let dim = rng.below(r);
            let n = x.cpu.shape[dim];
            let k = if n == 0 { 0 } else { rng.below(4) };
            let picks: Vec<usize> = (0..k).map(|_| rng.below(n)).collect();
            let mut shape = x.cpu.shape.clone();
            shape[dim] = k;
            let inner = Cpu::numel(&shape[dim + 1..]);
            let values: Vec<u32> = (0..Cpu::numel(&shape))
                .map(|i| picks[(i / inner) % k] as u32)
                .collect();
            let indices = Tensor::from_vec_u32(values, &shape, device())?;
            let cpu = x
                .cpu
                .along(dim, k, |line| picks.iter().map(|&p| line[p]).collect());
            pair(x.gpu.gather(dim, &indices)?, cpu)
        }
        24 if r == 4 && x.cpu.shape.iter().all(|&n| n > 0) && x.cpu.data.len() <= 2048 => {
            // A 2-d max or average pool, any window that fits, with padding, ceil mode and
            // count_include_pad drawn (of a view too, where an earlier step narrowed).
            let side = x.cpu.shape[2].min(x.cpu.shape[3]);
            let kernel = 1 + rng.below(side.min(3));
            let o = wgrad::Pool2dOptions {
                kernel,
                stride: 1 + rng.below(2),
                padding: rng.below(kernel / 2 + 1),
                ceil_mode: rng.below(2) == 0,
                count_include_pad: rng.below(2) == 0,
            };
            let max = rng.below(2) == 0;
            *smooth &= !max;
            // Half the time, of all images but the first: a view that starts past its
            // buffer's first element (the pools once read from the buffer's start).
            let n = x.cpu.shape[0];
            let (gpu_in, cpu_in) = match n >= 2 && rng.below(2) == 0 {
                true => (x.gpu.narrow(0, 1, n - 1)?, x.cpu.narrow(0, 1, n - 1)),
                false => (x.gpu.clone(), x.cpu.clone()),
            };
            let gpu = match max {
                true => gpu_in.max_pool2d_with(&o)?,
                false => gpu_in.avg_pool2d_with(&o)?,
            };
            pair(gpu, pool_2d(&cpu_in, &o, max))
        }
        25 if r >= 2 && x.cpu.shape[r - 1] > 0 => {
            // x as the queries [.., Tq, D], keys and values of their own; half the time, where
            // x has an even count of heads (dim -3), grouped-query: k and v have half as many.
            let mut k_shape = x.cpu.shape.clone();
            k_shape[r - 2] = [1, 2, 3, 5][rng.below(4)];
            if r >= 3 && k_shape[r - 3].is_multiple_of(2) && rng.below(2) == 0 {
                k_shape[r - 3] /= 2;
            }
            let mut v_shape = k_shape.clone();
            v_shape[r - 1] = [1, 2, 3][rng.below(3)];
            let (k, v) = (fresh(&k_shape, seed), fresh(&v_shape, seed + 1));
            let causal = rng.below(2) == 0;
            pair(
                (x.gpu).scaled_dot_product_attention(&k.gpu, &v.gpu, causal)?,
                attention(&x.cpu, &k.cpu, &v.cpu, causal),
            )
        }
        26 if r < 6 => {
            // A broadcast view of x along a new dim (stride 0), for the next op to read; its
            // grad sums over the copies.
            let dim = rng.below(r + 1);
            let copies = [1, 2, 3][rng.below(3)];
            let mut shape = x.cpu.shape.clone();
            shape.insert(dim, copies);
            let inner = Cpu::numel(&x.cpu.shape[dim..]);
            let mut data = Vec::new();
            for block in x.cpu.data.chunks(inner.max(1)) {
                for _ in 0..copies {
                    data.extend_from_slice(block);
                }
            }
            let gpu = x.gpu.unsqueeze(dim)?.expand(&shape)?;
            pair(gpu, Cpu { shape, data })
        }
        27 if r == 4 && x.cpu.shape.iter().all(|&n| n > 0) && x.cpu.data.len() <= 1024 => {
            // A 2-d convolution: kernel sides 1 to 3, stride, padding and dilation drawn per
            // axis, one group, two or one per channel, a bias half the time.
            let [c, h, w] = [x.cpu.shape[1], x.cpu.shape[2], x.cpu.shape[3]];
            let groups = [1, c, if c % 2 == 0 { 2 } else { 1 }][rng.below(3)];
            let c_out = groups * (1 + rng.below(2));
            let o = wgrad::Conv2dOptions {
                stride: (1 + rng.below(2), 1 + rng.below(2)),
                padding: (rng.below(2), rng.below(2)),
                dilation: (1 + rng.below(2), 1 + rng.below(2)),
                groups,
            };
            // A side the dilated kernel does not fit (padded) is 1 wide.
            let fit = |k: usize, side: usize, p: usize, d: usize| match side + 2 * p > d * (k - 1) {
                true => k,
                false => 1,
            };
            let kh = fit(1 + rng.below(3), h, o.padding.0, o.dilation.0);
            let kw = fit(1 + rng.below(3), w, o.padding.1, o.dilation.1);
            let weight = fresh(&[c_out, c / groups, kh, kw], seed);
            let bias = (rng.below(2) == 0).then(|| fresh(&[c_out], seed + 1));
            pair(
                (x.gpu).conv2d_with(&weight.gpu, bias.as_ref().map(|b| &b.gpu), o)?,
                conv_2d(&x.cpu, &weight.cpu, bias.as_ref().map(|b| &b.cpu), &o),
            )
        }
        28 if r == 4 && x.cpu.shape.iter().all(|&n| n > 0) && rng.below(2) == 0 => {
            // Images resampled (nearest or bilinear) to sides of 1 to 6.
            let size = (1 + rng.below(6), 1 + rng.below(6));
            let mode = [wgrad::Interpolate::Nearest, wgrad::Interpolate::Bilinear][rng.below(2)];
            pair(
                x.gpu.interpolate(size, mode)?,
                interpolate_2d(&x.cpu, size, mode),
            )
        }
        28 if r >= 2 => {
            // The last two dims padded by 0 to 2 on each side with 0.5.
            let sides = (rng.below(3), rng.below(3), rng.below(3), rng.below(3));
            pair(x.gpu.pad2d(sides, 0.5)?, pad_2d(&x.cpu, sides, 0.5))
        }
        29 => match rng.below(2) {
            0 => {
                *smooth = false;
                pair(x.gpu.clamp(-0.3, 0.4)?, x.cpu.map(|v| v.clamp(-0.3, 0.4)))
            }
            _ => {
                let p = [2.0, 3.0][rng.below(2)];
                pair(x.gpu.powf(p as f32)?, x.cpu.map(|v| v.powf(p)))
            }
        },
        30 if r > 0 => {
            // index_add or scatter_add along a dim: a source of x's shape but 0 to 3 long
            // there, added at indices drawn with repeats (per slice or per element).
            let dim = rng.below(r);
            let n = x.cpu.shape[dim];
            let k = if n == 0 { 0 } else { rng.below(4) };
            let mut shape = x.cpu.shape.clone();
            shape[dim] = k;
            let source = fresh(&shape, seed);
            let per_element = rng.below(2) == 0;
            let count = match per_element {
                true => Cpu::numel(&shape),
                false => k,
            };
            let picks: Vec<u32> = (0..count).map(|_| rng.below(n) as u32).collect();
            let mut cpu = x.cpu.clone();
            let out_strides = strides(&x.cpu.shape);
            for (i, &v) in source.cpu.data.iter().enumerate() {
                let mut index = unravel(i, &shape);
                index[dim] = picks[if per_element { i } else { index[dim] }] as usize;
                let flat: usize = index.iter().zip(&out_strides).map(|(a, b)| a * b).sum();
                cpu.data[flat] += v;
            }
            let gpu = match per_element {
                true => {
                    let indices = Tensor::from_vec_u32(picks, &shape, device())?;
                    x.gpu.scatter_add(dim, &indices, &source.gpu)?
                }
                false => {
                    let indices = Tensor::from_vec_u32(picks, &[k], device())?;
                    x.gpu.index_add(dim, &indices, &source.gpu)?
                }
            };
            pair(gpu, cpu)
        }
        31 if r == 2 && x.cpu.shape[0] > 0 && x.cpu.shape[1] > 0 => {
            // Cross-entropy of x's rows as logits against labels drawn per row.
            let [rows, classes] = [x.cpu.shape[0], x.cpu.shape[1]];
            let labels: Vec<u32> = (0..rows).map(|_| rng.below(classes) as u32).collect();
            let loss: f64 = (0..rows)
                .map(|i| {
                    let row = &x.cpu.data[i * classes..(i + 1) * classes];
                    let m = row.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                    let lse = m + row.iter().map(|v| (v - m).exp()).sum::<f64>().ln();
                    lse - row[labels[i] as usize]
                })
                .sum::<f64>()
                / rows as f64;
            let labels = Tensor::from_vec_u32(labels, &[rows], device())?;
            let cpu = Cpu {
                shape: vec![],
                data: vec![loss],
            };
            pair(wgrad::nn::loss::cross_entropy(&x.gpu, &labels)?, cpu)
        }
        32 if r == 4 && x.cpu.shape.iter().all(|&n| n > 0) => {
            // Average pooling to sides of 1 to 4 whatever the input's (bins overlap where
            // they do not divide it).
            let size = (1 + rng.below(4), 1 + rng.below(4));
            pair(
                x.gpu.adaptive_avg_pool2d(size)?,
                adaptive_avg_pool_2d(&x.cpu, size),
            )
        }
        33 if r >= 2 && x.cpu.shape[r - 1].is_multiple_of(2) && x.cpu.shape[r - 1] > 0 => {
            // Rotary embeddings of x's rows as positions from 0 to 2 on.
            let (seq, dim) = (x.cpu.shape[r - 2], x.cpu.shape[r - 1]);
            let first = rng.below(3);
            let rope = wgrad::nn::RotaryEmbedding::new(dim, first + seq, 10_000.0, device())?;
            pair(rope.apply(&x.gpu, first)?, rotary(&x.cpu, first))
        }
        34 if !x.cpu.data.is_empty() => {
            // A loss of x against a target of its shape: MSE, L1, smooth L1 (beta 0.5) or
            // binary cross-entropy with x as logits (targets in (0, 1)).
            let target = fresh(&x.cpu.shape, seed);
            let (t, y) = (&target.gpu, &target.cpu);
            let mean = |values: Vec<f64>| Cpu {
                shape: vec![],
                data: vec![values.iter().sum::<f64>() / values.len() as f64],
            };
            let pairs = || x.cpu.data.iter().zip(&y.data);
            match rng.below(4) {
                0 => pair(
                    wgrad::nn::loss::mse(&x.gpu, t)?,
                    mean(pairs().map(|(a, b)| (a - b).powi(2)).collect()),
                ),
                1 => {
                    *smooth = false;
                    pair(
                        wgrad::nn::loss::l1(&x.gpu, t)?,
                        mean(pairs().map(|(a, b)| (a - b).abs()).collect()),
                    )
                }
                2 => {
                    let huber = |d: f64| match d < 0.5 {
                        true => d * d,
                        false => d - 0.25,
                    };
                    pair(
                        wgrad::nn::loss::smooth_l1(&x.gpu, t, 0.5)?,
                        mean(pairs().map(|(a, b)| huber((a - b).abs())).collect()),
                    )
                }
                _ => {
                    let sigmoid = |v: f64| 1.0 / (1.0 + (-v).exp());
                    let probability = t.sigmoid()?;
                    let cpu = pairs().map(|(&a, &b)| {
                        let p = rounded(sigmoid(b) as f32) as f64;
                        a.exp().ln_1p() - a * p
                    });
                    pair(
                        wgrad::nn::loss::binary_cross_entropy_with_logits(&x.gpu, &probability)?,
                        mean(cpu.collect()),
                    )
                }
            }
        }
        35 if r >= 2 => {
            // The lower triangle of the last two dims, or x masked with -1 where another
            // tensor (broadcast) is positive.
            match rng.below(2) {
                0 => {
                    let diagonal = rng.below(3) as i64 - 1;
                    let (rows, cols) = (x.cpu.shape[r - 2], x.cpu.shape[r - 1]);
                    let mut cpu = x.cpu.clone();
                    for (i, v) in cpu.data.iter_mut().enumerate() {
                        let (row, col) = ((i / cols.max(1)) % rows.max(1), i % cols.max(1));
                        if col as i64 > row as i64 + diagonal {
                            *v = 0.0;
                        }
                    }
                    pair(x.gpu.tril(diagonal)?, cpu)
                }
                _ => {
                    let other = fresh(&broadcastable(rng, &x.cpu.shape), seed);
                    let mask = other.gpu.gt_scalar(0.0)?;
                    let cpu = x
                        .cpu
                        .binary(&other.cpu, |a, b| if b > 0.0 { -1.0 } else { a });
                    pair(x.gpu.masked_fill(&mask, -1.0)?, cpu)
                }
            }
        }
        36 if r == 0 => {
            // An op along dim 0 (or -1) of a 0-d tensor, which torch takes as a dim of one.
            let same = |gpu: Tensor| pair(gpu, x.cpu.clone());
            match rng.below(8) {
                0 => same(x.gpu.sum_dims(&[-1], false)?),
                1 => same(x.gpu.mean_dims(&[0], true)?),
                2 => same(x.gpu.max_dims(&[0], false)?),
                3 => same(x.gpu.logsumexp(&[-1], false)?),
                4 => same(x.gpu.cumsum(0)?),
                5 => same(x.gpu.sort(-1, true)?.0),
                6 => pair(x.gpu.softmax(0)?, x.cpu.map(|_| 1.0)),
                _ => pair(x.gpu.log_softmax(-1)?, x.cpu.map(|_| 0.0)),
            }
        }
        _ => pair(x.gpu.neg()?, x.cpu.map(|v| -v)),
    }
}

/// torch's `adaptive_avg_pool2d(x, (oh, ow))` of `x` `[n, c, h, w]`: output bin `i` of `out`
/// averages input positions `floor(i size / out)` to `ceil((i + 1) size / out)`.
fn adaptive_avg_pool_2d(x: &Cpu, (oh, ow): (usize, usize)) -> Cpu {
    let [n, c, h, w] = [x.shape[0], x.shape[1], x.shape[2], x.shape[3]];
    let bin = |i: usize, out: usize, size: usize| (i * size / out, ((i + 1) * size).div_ceil(out));
    let shape = vec![n, c, oh, ow];
    let mut data = Vec::with_capacity(Cpu::numel(&shape));
    for plane in 0..n * c {
        for oy in 0..oh {
            let (y0, y1) = bin(oy, oh, h);
            for ox in 0..ow {
                let (x0, x1) = bin(ox, ow, w);
                let sum: f64 = (y0..y1)
                    .flat_map(|y| (x0..x1).map(move |xx| (y, xx)))
                    .map(|(y, xx)| x.data[(plane * h + y) * w + xx])
                    .sum();
                data.push(sum / ((y1 - y0) * (x1 - x0)) as f64);
            }
        }
    }
    Cpu { shape, data }
}

/// Hugging Face Llama's rotary embedding of `x` `[.., T, D]`, row `t` at position `first + t`:
/// feature `j < D / 2` pairs with `j + D / 2`, turned by `p theta^(-2j / D)`, theta 10,000.
fn rotary(x: &Cpu, first: usize) -> Cpu {
    let r = x.shape.len();
    let (seq, dim) = (x.shape[r - 2], x.shape[r - 1]);
    let half = dim / 2;
    let mut out = x.clone();
    for (row, values) in x.data.chunks(dim).enumerate() {
        let position = (first + row % seq) as f64;
        for j in 0..half {
            let angle = position * 10_000f64.powf(-2.0 * j as f64 / dim as f64);
            let (cos, sin) = (angle.cos(), angle.sin());
            let (a, b) = (values[j], values[j + half]);
            out.data[row * dim + j] = a * cos - b * sin;
            out.data[row * dim + j + half] = b * cos + a * sin;
        }
    }
    out
}

/// torch's `conv2d` of `x` `[n, c, h, w]` with `w` `[c_out, c / groups, kh, kw]` and `bias`.
fn conv_2d(x: &Cpu, w: &Cpu, bias: Option<&Cpu>, o: &wgrad::Conv2dOptions) -> Cpu {
    let [n, _, h, wd] = [x.shape[0], x.shape[1], x.shape[2], x.shape[3]];
    let [c_out, c_in, kh, kw] = [w.shape[0], w.shape[1], w.shape[2], w.shape[3]];
    let c = x.shape[1];
    let out_len = |size: usize, k: usize, s: usize, p: usize, d: usize| {
        (size + 2 * p - d * (k - 1) - 1) / s + 1
    };
    let oh = out_len(h, kh, o.stride.0, o.padding.0, o.dilation.0);
    let ow = out_len(wd, kw, o.stride.1, o.padding.1, o.dilation.1);
    let per_group = c_out / o.groups;
    let shape = vec![n, c_out, oh, ow];
    let mut data = Vec::with_capacity(Cpu::numel(&shape));
    for b in 0..n {
        for co in 0..c_out {
            let first_in = co / per_group * c_in;
            for oy in 0..oh {
                for ox in 0..ow {
                    let mut sum = bias.map_or(0.0, |bias| bias.data[co]);
                    for ci in 0..c_in {
                        for ky in 0..kh {
                            for kx in 0..kw {
                                let y = (oy * o.stride.0 + ky * o.dilation.0) as i64
                                    - o.padding.0 as i64;
                                let xx = (ox * o.stride.1 + kx * o.dilation.1) as i64
                                    - o.padding.1 as i64;
                                if y < 0 || xx < 0 || y >= h as i64 || xx >= wd as i64 {
                                    continue;
                                }
                                let at =
                                    ((b * c + first_in + ci) * h + y as usize) * wd + xx as usize;
                                sum += x.data[at] * w.data[((co * c_in + ci) * kh + ky) * kw + kx];
                            }
                        }
                    }
                    data.push(sum);
                }
            }
        }
    }
    Cpu { shape, data }
}

/// The input positions and weights each of `out` positions takes from `size`, as torch's
/// `interpolate` reckons them (its scale `size / out` in f32; bilinear: align_corners=False).
fn resample_taps(out: usize, size: usize, mode: wgrad::Interpolate) -> Vec<Vec<(usize, f64)>> {
    let scale = size as f32 / out as f32;
    (0..out)
        .map(|i| match mode {
            wgrad::Interpolate::Nearest => {
                vec![(((i as f32 * scale).floor() as usize).min(size - 1), 1.0)]
            }
            wgrad::Interpolate::Bilinear => {
                let src = ((i as f32 + 0.5) * scale - 0.5).max(0.0);
                let lo = (src.floor() as usize).min(size - 1);
                let t = (src - lo as f32) as f64;
                vec![(lo, 1.0 - t), ((lo + 1).min(size - 1), t)]
            }
        })
        .collect()
}

/// torch's `interpolate(x, size=(oh, ow), mode=...)` of `x` `[n, c, h, w]`.
fn interpolate_2d(x: &Cpu, (oh, ow): (usize, usize), mode: wgrad::Interpolate) -> Cpu {
    let [n, c, h, w] = [x.shape[0], x.shape[1], x.shape[2], x.shape[3]];
    let (rows, cols) = (resample_taps(oh, h, mode), resample_taps(ow, w, mode));
    let shape = vec![n, c, oh, ow];
    let mut data = Vec::with_capacity(Cpu::numel(&shape));
    for plane in 0..n * c {
        for row in &rows {
            for col in &cols {
                let mut sum = 0.0;
                for &(y, wy) in row {
                    for &(xx, wx) in col {
                        sum += wy * wx * x.data[(plane * h + y) * w + xx];
                    }
                }
                data.push(sum);
            }
        }
    }
    Cpu { shape, data }
}

/// torch's `F.pad(x, (left, right, top, bottom), value=value)` of the last two dims.
fn pad_2d(x: &Cpu, (left, right, top, bottom): (usize, usize, usize, usize), value: f64) -> Cpu {
    let r = x.shape.len();
    let (h, w) = (x.shape[r - 2], x.shape[r - 1]);
    let (oh, ow) = (h + top + bottom, w + left + right);
    let mut shape = x.shape.clone();
    shape[r - 2] = oh;
    shape[r - 1] = ow;
    let planes = Cpu::numel(&x.shape[..r - 2]);
    let mut data = vec![value; Cpu::numel(&shape)];
    for plane in 0..planes {
        for y in 0..h {
            for xx in 0..w {
                data[(plane * oh + y + top) * ow + xx + left] = x.data[(plane * h + y) * w + xx];
            }
        }
    }
    Cpu { shape, data }
}

/// torch's `scaled_dot_product_attention(q, k, v, is_causal)` (causal aligned top-left),
/// with each k/v head serving `q heads / k heads` consecutive q heads along dim -3.
fn attention(q: &Cpu, k: &Cpu, v: &Cpu, causal: bool) -> Cpu {
    let r = q.shape.len();
    let (t_q, d, t_k, dv) = (
        q.shape[r - 2],
        q.shape[r - 1],
        k.shape[r - 2],
        v.shape[r - 1],
    );
    let heads = if r >= 3 { q.shape[r - 3] } else { 1 };
    let kv_heads = if r >= 3 { k.shape[r - 3] } else { 1 };
    let group = heads / kv_heads.max(1);
    let all_heads = Cpu::numel(&q.shape[..r - 2]);
    let scale = 1.0 / (d as f64).sqrt();
    let mut data = vec![0.0; all_heads * t_q * dv];
    for f in 0..all_heads {
        let kv = f / heads.max(1) * kv_heads + f % heads.max(1) / group.max(1);
        for i in 0..t_q {
            let keys = if causal { t_k.min(i + 1) } else { t_k };
            let scores: Vec<f64> = (0..keys)
                .map(|j| {
                    let dot: f64 = (0..d)
                        .map(|l| q.data[(f * t_q + i) * d + l] * k.data[(kv * t_k + j) * d + l])
                        .sum();
                    dot * scale
                })
                .collect();
            let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let weights: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
            let total: f64 = weights.iter().sum();
            for c in 0..dv {
                data[(f * t_q + i) * dv + c] = (0..keys)
                    .map(|j| weights[j] / total * v.data[(kv * t_k + j) * dv + c])
                    .sum();
            }
        }
    }
    let mut shape = q.shape.clone();
    shape[r - 1] = dv;
    Cpu { shape, data }
}

/// torch's 2-d max or average pool of `x` `[n, c, h, w]` (its output sides, padding and
/// divisors: an average divides by the window clipped to the padded input, or, without
/// `count_include_pad`, by the input elements it covers).
fn pool_2d(x: &Cpu, o: &wgrad::Pool2dOptions, max: bool) -> Cpu {
    let [n, c, h, w] = [x.shape[0], x.shape[1], x.shape[2], x.shape[3]];
    let (k, s, p) = (o.kernel as i64, o.stride as i64, o.padding as i64);
    let out_len = |size: i64| {
        let span = size + 2 * p - k;
        match o.ceil_mode {
            false => span / s + 1,
            true => {
                let out = (span + s - 1) / s + 1;
                // The last window must start inside the input or its left padding.
                if (out - 1) * s >= size + p {
                    out - 1
                } else {
                    out
                }
            }
        }
    };
    let (out_h, out_w) = (out_len(h as i64), out_len(w as i64));
    let shape = vec![n, c, out_h as usize, out_w as usize];
    let mut data = Vec::with_capacity(Cpu::numel(&shape));
    for plane in 0..n * c {
        for oy in 0..out_h {
            for ox in 0..out_w {
                let (y0, x0) = (oy * s - p, ox * s - p);
                let (y1, x1) = ((y0 + k).min(h as i64 + p), (x0 + k).min(w as i64 + p));
                let padded_count = (y1 - y0) * (x1 - x0);
                let (ya, yb) = (y0.max(0), y1.min(h as i64));
                let (xa, xb) = (x0.max(0), x1.min(w as i64));
                let values: Vec<f64> = (ya..yb)
                    .flat_map(|y| (xa..xb).map(move |xx| (y, xx)))
                    .map(|(y, xx)| x.data[(plane * h + y as usize) * w + xx as usize])
                    .collect();
                data.push(match max {
                    true => values.iter().cloned().fold(f64::NEG_INFINITY, f64::max),
                    false => {
                        let divisor = match o.count_include_pad {
                            true => padded_count,
                            false => values.len() as i64,
                        };
                        values.iter().sum::<f64>() / divisor as f64
                    }
                });
            }
        }
    }
    Cpu { shape, data }
}

/// conv_transpose2d of `x` `[n, c, h, w]` with weight `[c, o, 2, 2]`, stride 2 (the kernel
/// tiles the output: each input pixel writes its own 2x2 block).
fn conv_transpose_2x2(x: &Cpu, w: &Cpu) -> Cpu {
    let [n, c, h, wd] = [x.shape[0], x.shape[1], x.shape[2], x.shape[3]];
    let o = w.shape[1];
    let shape = vec![n, o, 2 * h, 2 * wd];
    let mut data = vec![0.0; Cpu::numel(&shape)];
    for b in 0..n {
        for ci in 0..c {
            for y in 0..h {
                for xx in 0..wd {
                    let v = x.data[((b * c + ci) * h + y) * wd + xx];
                    for co in 0..o {
                        for (ky, kx) in [(0, 0), (0, 1), (1, 0), (1, 1)] {
                            let at = ((b * o + co) * 2 * h + 2 * y + ky) * 2 * wd + 2 * xx + kx;
                            data[at] += v * w.data[((ci * o + co) * 2 + ky) * 2 + kx];
                        }
                    }
                }
            }
        }
    }
    Cpu { shape, data }
}

/// What one case found, if anything.
fn run_case(case: u64) -> Option<String> {
    let dtype = case_dtype(case);
    let _dtype = DTypeGuard::new(dtype);
    let mut rng = Rng(case);
    let shape = rng.shape(4);
    let input = fresh(&shape, case);
    let x = Pair {
        gpu: input.gpu.requires_grad_(true),
        cpu: input.cpu,
    };
    let steps = 1 + rng.below(4);
    let mut smooth = true;
    let mut program = Vec::new();
    let mut y = Pair {
        gpu: x.gpu.clone(),
        cpu: x.cpu.clone(),
    };
    for s in 0..steps {
        let before = y.cpu.shape.clone();
        y = match step(&mut rng, &y, case * 31 + s as u64 + 1, &mut smooth) {
            Ok(next) => next,
            Err(e) if past_capped_binding(&e) => return None,
            Err(e) => {
                return Some(format!(
                    "case {case}: a valid op failed after {program:?}: {e}"
                ))
            }
        };
        program.push(format!("{before:?}->{:?}", y.cpu.shape));
    }
    if y.gpu.shape() != y.cpu.shape.as_slice() {
        return Some(format!(
            "case {case}: shape {:?}, want {:?} ({program:?})",
            y.gpu.shape(),
            y.cpu.shape
        ));
    }
    let got = match y.gpu.to_vec() {
        Ok(got) => got,
        Err(e) if past_capped_binding(&e) => return None,
        Err(e) => {
            return Some(format!(
                "case {case}: reading back failed: {e} ({program:?})"
            ))
        }
    };
    // The reference rounds only the inputs; each 16-bit op rounds its result once more.
    let tolerance = match dtype {
        DType::F16 => 1e-2,
        DType::BF16 => 6e-2,
        _ => 1e-4,
    };
    for (i, (&g, &w)) in got.iter().zip(&y.cpu.data).enumerate() {
        if !agrees(g as f64, w, tolerance * w.abs().max(1.0)) {
            return Some(format!(
                "case {case} ({dtype:?}): element {i}: {g} vs {w} ({program:?})"
            ));
        }
    }
    // Rank 7 is one past what kernels take: an error, never a panic.
    if rng.below(10) == 0 && Tensor::zeros(&[1; 7], device()).is_ok() {
        return Some(format!("case {case}: a rank-7 tensor was accepted"));
    }
    // Finite differences in 16 bits would measure rounding.
    if !smooth || dtype != DType::F32 || x.cpu.data.len() > 40 || y.cpu.data.is_empty() {
        return None;
    }
    // The grad of sum(y * probe) for the first input, against central differences.
    let probe = fresh(&y.cpu.shape, case + 7);
    if let Err(e) = y
        .gpu
        .mul(&probe.gpu)
        .and_then(|l| l.sum())
        .and_then(|l| l.backward())
    {
        if past_capped_binding(&e) {
            return None;
        }
        return Some(format!("case {case}: backward failed: {e} ({program:?})"));
    }
    let grad = match x.gpu.grad() {
        Some(g) => g.to_vec().unwrap(),
        None => vec![0.0; x.cpu.data.len()],
    };
    let loss_at = |values: &[f64]| -> f64 {
        let mut rng = Rng(case);
        let _ = rng.shape(4);
        let _ = rng.below(4);
        let mut y = Cpu {
            shape: shape.clone(),
            data: values.to_vec(),
        };
        let mut unused = true;
        for s in 0..steps {
            let gpu = Tensor::zeros(&y.shape, device()).unwrap();
            y = step(
                &mut rng,
                &Pair { gpu, cpu: y },
                case * 31 + s as u64 + 1,
                &mut unused,
            )
            .unwrap()
            .cpu;
        }
        y.data.iter().zip(&probe.cpu.data).map(|(a, b)| a * b).sum()
    };
    // The differences run in f64, so a small step costs little rounding (about 1e-10 here),
    // while a large one misses curvature: two LayerNorms over pairs within 1e-3 of each other
    // (where eps, not the variance, sets the scale) read 2 % off the grad at a step of 1e-4.
    let eps = 1e-6;
    for j in 0..x.cpu.data.len() {
        let mut plus = x.cpu.data.clone();
        plus[j] += eps;
        let mut minus = x.cpu.data.clone();
        minus[j] -= eps;
        let numeric = (loss_at(&plus) - loss_at(&minus)) / (2.0 * eps);
        if !agrees(grad[j] as f64, numeric, 1e-2 * numeric.abs() + 1e-3) {
            return Some(format!(
                "case {case}: grad element {j}: {} vs {numeric} ({program:?})",
                grad[j]
            ));
        }
    }
    None
}

/// Whether `got` is `want` within `tolerance`: NaN only where NaN is wanted, an infinity
/// only where the same one is.
fn agrees(got: f64, want: f64, tolerance: f64) -> bool {
    match (got.is_nan(), want.is_nan()) {
        (false, false) => got == want || (got - want).abs() <= tolerance,
        (g, w) => g && w,
    }
}

/// What the captured run of one case found (`Err`), or whether its last two calls replayed: its
/// program and a backward pass as a step, whose replay must give the eager call's output and
/// input grad.
fn captured_case(case: u64) -> Result<bool, String> {
    let _dtype = DTypeGuard::new(case_dtype(case));
    let mut rng = Rng(case);
    let shape = rng.shape(4);
    let x = fresh(&shape, case).gpu.requires_grad_(true);
    let program = move |inputs: &[Tensor]| -> wgrad::Result<Tensor> {
        let mut rng = Rng(case);
        let _ = rng.shape(4);
        let steps = 1 + rng.below(4);
        let x = &inputs[0];
        x.zero_grad();
        let zeros = Cpu {
            shape: x.shape().to_vec(),
            data: vec![0.0; x.numel()],
        };
        let mut y = Pair {
            gpu: x.clone(),
            cpu: zeros,
        };
        let mut smooth = true;
        for s in 0..steps {
            y = step(&mut rng, &y, case * 31 + s as u64 + 1, &mut smooth)?;
        }
        if y.gpu.requires_grad() {
            let probe = fresh(y.gpu.shape(), case + 7);
            y.gpu.mul(&probe.gpu)?.sum()?.backward()?;
        }
        Ok(y.gpu)
    };
    let values = |y: wgrad::Result<Tensor>| -> wgrad::Result<(Vec<f32>, Vec<f32>)> {
        let grad = x.grad().map(|g| g.to_vec()).transpose()?;
        Ok((y?.to_vec()?, grad.unwrap_or_default()))
    };
    let want = match values(program(std::slice::from_ref(&x))) {
        Ok(want) => want,
        Err(e) if past_capped_binding(&e) => return Ok(false),
        Err(e) => return Err(format!("case {case}: the eager program failed: {e}")),
    };
    let mut step = Step::new(program);
    let mut got = (Vec::new(), Vec::new());
    // Two replays: the second finds the arena as the first left it (a kernel that read an
    // intermediate before the step wrote it would read the right value there, but NaN
    // under WGRAD_POISON_BUFFERS).
    for _ in 0..4 {
        match values(step.run(std::slice::from_ref(&x))) {
            Ok(values) => got = values,
            Err(e) => return Err(format!("case {case}: a captured call failed: {e}")),
        }
    }
    let stats = step.stats();
    for (what, w, g) in [("output", &want.0, &got.0), ("grad", &want.1, &got.1)] {
        if w.len() != g.len() {
            return Err(format!(
                "case {case}: {what} has {} elements, eager {}",
                g.len(),
                w.len()
            ));
        }
        for (i, (&a, &b)) in w.iter().zip(g).enumerate() {
            let same = (a - b).abs() <= 1e-5 * a.abs().max(1.0) || (a.is_nan() && b.is_nan());
            if !same {
                return Err(format!(
                    "case {case}: replayed {what}[{i}] {b} vs eager {a} ({stats:?})"
                ));
            }
        }
    }
    Ok(stats.replays == 2)
}

/// Whether `e` is an op's `TooLarge` under `WGRAD_MAX_BINDING_BYTES`: with bindings capped
/// at a few hundred bytes, the fuzzer's tensors take the windowed paths of ops past one
/// binding, and the ops that take none (docs/ops.md) end the case there.
fn past_capped_binding(e: &wgrad::Error) -> bool {
    matches!(e, wgrad::Error::TooLarge { .. }) && binding_capped()
}

/// Whether `WGRAD_MAX_BINDING_BYTES` caps the device's bindings.
fn binding_capped() -> bool {
    std::env::var("WGRAD_MAX_BINDING_BYTES").is_ok()
}

/// A count from the environment variable `name`, or `default`.
fn env_count(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// Runs `cases` cases from `WGRAD_FUZZ_SEED` (0 by default), failing with every case that
/// failed or panicked; returns how many `run` answered `true`.
fn run_cases(cases: u64, run: impl Fn(u64) -> Result<bool, String>) -> u64 {
    let first = env_count("WGRAD_FUZZ_SEED", 0);
    let mut failures = Vec::new();
    let mut yes = 0;
    for case in first..first + cases {
        match catch_unwind(AssertUnwindSafe(|| run(case))) {
            Ok(Ok(answer)) => yes += u64::from(answer),
            Ok(Err(failure)) => failures.push(failure),
            Err(_) => failures.push(format!("case {case}: panicked")),
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {cases} cases failed:\n{}",
        failures.len(),
        failures.join("\n")
    );
    yes
}

#[test]
fn random_programs_replay_as_they_ran_eagerly() {
    let cases = env_count("WGRAD_CAPTURE_FUZZ_CASES", 30);
    let replayed = run_cases(cases, captured_case);
    // Steps that keep what they make, or make nothing, stay eager; most programs replay.
    assert!(
        replayed * 2 >= cases,
        "only {replayed} of {cases} cases replayed"
    );
    eprintln!("{replayed} of {cases} cases replayed");
}

#[test]
fn random_programs_agree_with_an_f64_reference() {
    let cases = env_count("WGRAD_FUZZ_CASES", 150);
    run_cases(cases, |case| run_case(case).map_or(Ok(true), Err));
}
