//! Data-parallel training across processes over MPI (the `mpi` feature).
//!
//! Every rank holds the whole model and takes a disjoint shard of each global batch; between
//! `backward()` and `opt.step()` the grads are averaged across ranks. The same binary runs as
//! one process (`Dist::single()`, or `Dist::init()` without `mpirun`) and as N ranks under
//! `mpirun -np N` or Slurm's `srun`.
//!
//! Grads travel in buckets: each bucket's grads are packed into one contiguous device buffer
//! (a `cat`, not a readback per tensor), read back once, summed across ranks with MPI's
//! non-blocking all-reduce while the next bucket is read back, and written back scaled by
//! `1 / size`. The grad slots change as the engine's apply stage changes them (S-2): a kept
//! grad handle is kept and its buffer swapped; an empty slot takes a new tensor.
//!
//! MPI's default error handler is kept: a rank that dies ends the whole job, never a hang.

use std::sync::Mutex;
use std::time::Duration;
#[cfg(feature = "mpi")]
use std::time::Instant;

use rand::seq::SliceRandom;
use rand::SeedableRng;

#[cfg(feature = "mpi")]
use crate::autograd::swap_in;
use crate::error::{Error, Result};
use crate::io;
use crate::nn::Module;
#[cfg(feature = "mpi")]
use crate::no_grad;
use crate::tensor::Tensor;

/// Grad elements per bucket: several buckets are in flight for a model of a million
/// parameters, so reading one back overlaps the reduction of the one before.
#[cfg(feature = "mpi")]
const BUCKET_ELEMS: usize = 1 << 18;

/// Where the last [`Dist::all_reduce_grads`] spent its time (host wall time on this rank).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct ReduceTimings {
    /// Packing each bucket on the device and reading it back.
    pub pack_and_read: Duration,
    /// Waiting for the all-reduces beyond what the read-backs hid.
    pub reduce: Duration,
    /// Scaling and uploading the averaged grads, and installing them.
    pub upload: Duration,
}

#[cfg(feature = "mpi")]
struct Mpi {
    world: mpi::topology::SimpleCommunicator,
    // Dropped last: finalizes MPI.
    _universe: mpi::environment::Universe,
}

/// This process's place among the ranks of a data-parallel job.
pub struct Dist {
    rank: usize,
    size: usize,
    #[cfg(feature = "mpi")]
    mpi: Option<Mpi>,
    /// The parameter lists whose ranks' models have been compared (each before its first
    /// reduction), by a hash of the parameters' identities.
    models_checked: Mutex<std::collections::HashSet<u64>>,
    timings: Mutex<ReduceTimings>,
}

impl std::fmt::Debug for Dist {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Dist(rank {} of {})", self.rank, self.size)
    }
}

/// The rank count a launcher (`mpirun`, `srun`) gave this process, if it was launched by one.
#[cfg(not(feature = "mpi"))]
fn launcher_size() -> Option<usize> {
    [
        "OMPI_COMM_WORLD_SIZE",
        "PMI_SIZE",
        "PMIX_SIZE",
        "SLURM_NTASKS",
    ]
    .iter()
    .find_map(|v| std::env::var(v).ok()?.parse().ok())
}

impl Dist {
    /// One process, rank 0 of 1: every collective is a no-op.
    pub fn single() -> Dist {
        Dist {
            rank: 0,
            size: 1,
            #[cfg(feature = "mpi")]
            mpi: None,
            models_checked: Mutex::default(),
            timings: Mutex::default(),
        }
    }

    /// Joins the MPI job this process was started in (`mpirun`, `srun`); a process started
    /// on its own is rank 0 of 1. Without the `mpi` feature, a process that a launcher
    /// started as one of several ranks gets an error rather than training alone.
    pub fn init() -> Result<Dist> {
        #[cfg(feature = "mpi")]
        {
            use mpi::traits::Communicator;
            let Some((universe, _)) = mpi::initialize_with_threading(mpi::Threading::Funneled)
            else {
                return Err(Error::InvalidArgument {
                    op: "Dist::init",
                    msg: "MPI is already initialized in this process; call Dist::init once".into(),
                });
            };
            let world = universe.world();
            Ok(Dist {
                rank: world.rank() as usize,
                size: world.size() as usize,
                models_checked: Mutex::default(),
                timings: Mutex::default(),
                mpi: Some(Mpi {
                    world,
                    _universe: universe,
                }),
            })
        }
        #[cfg(not(feature = "mpi"))]
        {
            match launcher_size() {
                Some(size) if size > 1 => Err(Error::InvalidArgument {
                    op: "Dist::init",
                    msg: format!(
                        "started as one of {size} ranks, but wgrad was built without the `mpi` \
                         feature; rebuild with `--features mpi`"
                    ),
                }),
                _ => Ok(Dist::single()),
            }
        }
    }

    /// This process's rank, from 0.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// How many ranks the job has.
    pub fn size(&self) -> usize {
        self.size
    }

    /// True on rank 0, which prints and saves.
    pub fn is_root(&self) -> bool {
        self.rank == 0
    }

    /// Waits until every rank has reached this call.
    pub fn barrier(&self) {
        #[cfg(feature = "mpi")]
        if let Some(m) = &self.mpi {
            use mpi::traits::CommunicatorCollectives;
            m.world.barrier();
        }
    }

    /// This rank's share of a global batch of `global_batch` examples, or an error when it
    /// does not divide evenly among the ranks.
    pub fn local_batch(&self, global_batch: usize) -> Result<usize> {
        if global_batch == 0 || !global_batch.is_multiple_of(self.size) {
            return Err(Error::InvalidArgument {
                op: "Dist::local_batch",
                msg: format!(
                    "a global batch of {global_batch} examples does not split evenly among {} \
                     ranks; use a multiple of {}",
                    self.size, self.size
                ),
            });
        }
        Ok(global_batch / self.size)
    }

    /// The example indices this rank trains on in one epoch over `len` examples: the indices
    /// are shuffled from `seed` (the same order on every rank), cut into global batches of
    /// `global_batch`, and each global batch into `size` disjoint slices, of which this rank
    /// takes its own. A last global batch too small to split evenly is dropped.
    pub fn shard_batches(
        &self,
        len: usize,
        global_batch: usize,
        seed: u64,
    ) -> Result<Vec<Vec<usize>>> {
        self.local_batch(global_batch)?;
        Ok(shard(len, global_batch, self.rank, self.size, seed))
    }

    /// Copies rank 0's parameters and buffers (`BatchNorm2d`'s running statistics) into every
    /// other rank's `module`.
    pub fn broadcast_parameters(&self, module: &dyn Module) -> Result<()> {
        #[cfg(feature = "mpi")]
        if let Some(m) = &self.mpi {
            use mpi::traits::{Communicator, Root};
            let tensors: Vec<Tensor> = module
                .named_parameters()
                .into_iter()
                .chain(module.named_buffers())
                .map(|(_, t)| t)
                .collect();
            self.compare_shapes(&tensors)?;
            for t in &tensors {
                let mut values = if self.is_root() {
                    t.to_vec()?
                } else {
                    vec![0.0; t.numel()]
                };
                m.world.process_at_rank(0).broadcast_into(&mut values[..]);
                if !self.is_root() {
                    let root = Tensor::from_vec(values, t.shape(), t.device())?;
                    no_grad(|| t.copy_(&root))?;
                }
            }
        }
        let _ = module;
        Ok(())
    }

    /// Averages the grads of `params` across ranks, in place of each rank's own (call it
    /// between `backward()` and `opt.step()`). A parameter without a grad counts as zeros
    /// and receives the average too. Before the first reduction the ranks compare their
    /// parameters (count, shapes and a checksum of the values): ranks whose models differ all
    /// get an error, and none hangs.
    pub fn all_reduce_grads(&self, params: &[Tensor]) -> Result<()> {
        if self.size == 1 {
            return Ok(());
        }
        let identity = {
            use std::hash::{Hash, Hasher};
            let mut h = std::collections::hash_map::DefaultHasher::new();
            for p in params {
                (std::sync::Arc::as_ptr(&p.inner) as usize).hash(&mut h);
            }
            h.finish()
        };
        let checked = self
            .models_checked
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .contains(&identity);
        if !checked {
            self.check_same_parameters(params)?;
            self.models_checked
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .insert(identity);
        }
        self.reduce(params)
    }

    /// Where the last [`Dist::all_reduce_grads`] spent its time.
    pub fn last_timings(&self) -> ReduceTimings {
        *self.timings.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Saves `module` from rank 0 only (the ranks' models are equal), then waits for it on
    /// every rank, so that no rank reads the file before it is complete.
    pub fn save(&self, path: impl AsRef<std::path::Path>, module: &dyn Module) -> Result<()> {
        let saved = if self.is_root() {
            io::save(path, module)
        } else {
            Ok(())
        };
        self.barrier();
        saved
    }

    #[cfg(feature = "mpi")]
    fn reduce(&self, params: &[Tensor]) -> Result<()> {
        use mpi::collective::SystemOperation;
        use mpi::traits::CommunicatorCollectives;
        let Some(m) = &self.mpi else { return Ok(()) };
        let Some(first) = params.first() else {
            return Ok(());
        };
        let dev = first.device();
        let started = Instant::now();
        // Buckets of consecutive parameters; each packed into one buffer on the device.
        let mut buckets: Vec<std::ops::Range<usize>> = Vec::new();
        let (mut start, mut elems) = (0, 0);
        for (i, p) in params.iter().enumerate() {
            elems += p.numel();
            if elems >= BUCKET_ELEMS || i + 1 == params.len() {
                buckets.push(start..i + 1);
                (start, elems) = (i + 1, 0);
            }
        }
        let mut packed = Vec::with_capacity(buckets.len());
        for bucket in &buckets {
            let flat: Vec<Tensor> = params[bucket.clone()]
                .iter()
                .map(|p| match p.grad() {
                    Some(g) => g.reshape(&[p.numel()]),
                    None => Tensor::zeros(&[p.numel()], dev),
                })
                .collect::<Result<_>>()?;
            packed.push(no_grad(|| Tensor::cat(&flat, 0))?);
        }
        // Read each bucket back while the previous ones are being reduced.
        let mut sends: Vec<Vec<f32>> = vec![Vec::new(); packed.len()];
        let mut sums: Vec<Vec<f32>> = packed.iter().map(|t| vec![0.0; t.numel()]).collect();
        let mut read_error = None;
        let mut pack_and_read = Duration::ZERO;
        let mut reduce = Duration::ZERO;
        mpi::request::scope(|scope| {
            let mut requests = Vec::with_capacity(packed.len());
            for ((send, sum), t) in sends.iter_mut().zip(sums.iter_mut()).zip(&packed) {
                match t.to_vec() {
                    Ok(values) => *send = values,
                    Err(e) => {
                        // Every rank must still take part in the reductions it expects.
                        read_error = Some(e);
                        send.resize(t.numel(), f32::NAN);
                    }
                }
                requests.push(m.world.immediate_all_reduce_into(
                    scope,
                    &send[..],
                    &mut sum[..],
                    SystemOperation::sum(),
                ));
            }
            pack_and_read = started.elapsed();
            let waiting = Instant::now();
            for request in requests {
                request.wait();
            }
            reduce = waiting.elapsed();
        });
        if let Some(e) = read_error {
            return Err(e);
        }
        let uploading = Instant::now();
        let scale = 1.0 / self.size as f32;
        for (bucket, sum) in buckets.iter().zip(&sums) {
            let mut at = 0;
            for p in &params[bucket.clone()] {
                let values: Vec<f32> = sum[at..at + p.numel()].iter().map(|v| v * scale).collect();
                at += p.numel();
                let mean = Tensor::from_vec(values, p.shape(), dev)?;
                match p.grad() {
                    Some(handle) => swap_in(&handle, mean)?,
                    None => p.set_grad(Some(mean))?,
                }
            }
        }
        let upload = uploading.elapsed();
        *self.timings.lock().unwrap_or_else(|e| e.into_inner()) = ReduceTimings {
            pack_and_read,
            reduce,
            upload,
        };
        Ok(())
    }

    #[cfg(not(feature = "mpi"))]
    fn reduce(&self, _params: &[Tensor]) -> Result<()> {
        Ok(())
    }

    /// Every rank's `values` (the same count on each), rank by rank.
    #[cfg(feature = "mpi")]
    fn gather(&self, values: &[u64]) -> Vec<u64> {
        use mpi::traits::CommunicatorCollectives;
        let Some(m) = &self.mpi else {
            return values.to_vec();
        };
        let mut all = vec![0u64; values.len() * self.size];
        m.world.all_gather_into(values, &mut all[..]);
        all
    }

    /// Errors on every rank unless all ranks have tensors of the same count and shapes.
    #[cfg(feature = "mpi")]
    fn compare_shapes(&self, tensors: &[Tensor]) -> Result<()> {
        let mut shapes = Fnv::new();
        for t in tensors {
            shapes.add(&(t.rank() as u64).to_le_bytes());
            for &d in t.shape() {
                shapes.add(&(d as u64).to_le_bytes());
            }
        }
        let numel: usize = tensors.iter().map(|t| t.numel()).sum();
        let mine = [tensors.len() as u64, numel as u64, shapes.0];
        let all = self.gather(&mine);
        if let Some(other) = all.chunks(3).position(|r| r != mine) {
            return Err(Error::InvalidArgument {
                op: "Dist",
                msg: format!(
                    "rank {} has {} tensors of {} elements, rank {other} has {} of {} (or other \
                     shapes): every rank must build the same model",
                    self.rank,
                    mine[0],
                    mine[1],
                    all[other * 3],
                    all[other * 3 + 1]
                ),
            });
        }
        Ok(())
    }

    /// Errors on every rank unless all ranks hold the same parameters: the same count and
    /// shapes, and bitwise the same values (compared by a checksum). Reads them back.
    #[cfg(feature = "mpi")]
    pub fn check_same_parameters(&self, params: &[Tensor]) -> Result<()> {
        self.compare_shapes(params)?;
        let mut values = Fnv::new();
        for p in params {
            values.add(bytemuck::cast_slice(&p.to_vec()?));
        }
        let all = self.gather(&[values.0]);
        if let Some(other) = all.iter().position(|&h| h != values.0) {
            return Err(Error::InvalidArgument {
                op: "Dist::all_reduce_grads",
                msg: format!(
                    "rank {}'s parameters differ from rank {other}'s before the first reduction; \
                     call Dist::broadcast_parameters after building the model",
                    self.rank
                ),
            });
        }
        Ok(())
    }

    /// Errors on every rank unless all ranks hold the same parameters: the same count and
    /// shapes, and bitwise the same values (compared by a checksum). Reads them back.
    #[cfg(not(feature = "mpi"))]
    pub fn check_same_parameters(&self, _params: &[Tensor]) -> Result<()> {
        Ok(())
    }
}

/// FNV-1a, for comparing ranks' models by a checksum.
#[cfg(feature = "mpi")]
struct Fnv(u64);

#[cfg(feature = "mpi")]
impl Fnv {
    fn new() -> Fnv {
        Fnv(0xcbf2_9ce4_8422_2325)
    }

    fn add(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
}

/// Rank `rank`'s shard of each global batch, as [`Dist::shard_batches`] describes.
fn shard(len: usize, global_batch: usize, rank: usize, size: usize, seed: u64) -> Vec<Vec<usize>> {
    let local = global_batch / size;
    let mut order: Vec<usize> = (0..len).collect();
    order.shuffle(&mut rand::rngs::StdRng::seed_from_u64(seed));
    order
        .chunks(global_batch)
        .filter(|chunk| chunk.len() == global_batch)
        .map(|chunk| chunk[rank * local..(rank + 1) * local].to_vec())
        .collect()
}

/// A module's parameters and the job they are trained in: broadcasts rank 0's parameters at
/// creation, and averages the grads at [`DataParallel::sync_grads`].
///
/// ```
/// # fn main() -> wgrad::Result<()> {
/// use wgrad::dist::{DataParallel, Dist};
/// use wgrad::nn::{loss::cross_entropy, Linear, Module};
/// use wgrad::optim::{Optimizer, Sgd, SgdConfig};
/// use wgrad::{Device, Tensor};
/// let dist = Dist::init()?; // rank 0 of 1 unless started by mpirun or srun
/// let dev = Device::new()?;
/// let model = Linear::new(4, 3, true, &dev)?;
/// let dp = DataParallel::new(&dist, &model)?;
/// let mut opt = Sgd::new(model.parameters(), SgdConfig::default());
/// let global_batch = 8;
/// for batch in dist.shard_batches(64, global_batch, 0)? {
///     let x = Tensor::rand(&[batch.len(), 4], batch[0] as u64, &dev)?;
///     let y = Tensor::from_labels(batch.iter().map(|&i| i as u32 % 3).collect(), &dev)?;
///     opt.zero_grad();
///     cross_entropy(&model.forward(&x)?, &y)?.backward()?;
///     dp.sync_grads()?; // the mean of every rank's grads
///     opt.step()?;
/// }
/// # Ok(())
/// # }
/// ```
pub struct DataParallel<'a> {
    dist: &'a Dist,
    params: Vec<Tensor>,
}

impl<'a> DataParallel<'a> {
    /// Broadcasts rank 0's parameters and buffers of `module` to every rank.
    pub fn new(dist: &'a Dist, module: &dyn Module) -> Result<DataParallel<'a>> {
        dist.broadcast_parameters(module)?;
        Ok(DataParallel {
            dist,
            params: module.parameters(),
        })
    }

    /// Averages the grads across ranks: call it between `backward()` and `opt.step()`.
    pub fn sync_grads(&self) -> Result<()> {
        self.dist.all_reduce_grads(&self.params)
    }
}

#[cfg(test)]
mod tests {
    use super::{shard, Dist};

    #[test]
    fn ranks_take_disjoint_slices_of_each_global_batch() {
        let (len, global, size) = (103, 12, 3);
        let shards: Vec<Vec<Vec<usize>>> =
            (0..size).map(|r| shard(len, global, r, size, 5)).collect();
        // 8 full global batches; the last 7 examples are dropped.
        assert!(shards
            .iter()
            .all(|s| s.len() == 8 && s.iter().all(|b| b.len() == 4)));
        for b in 0..8 {
            let mut all: Vec<usize> = shards.iter().flat_map(|s| s[b].clone()).collect();
            all.sort();
            all.dedup();
            assert_eq!(all.len(), global, "batch {b} has repeats");
        }
        // The same seed gives every rank the same order.
        assert_eq!(shard(len, global, 1, size, 5), shards[1]);
        assert_ne!(shard(len, global, 1, size, 6), shards[1]);
    }

    #[test]
    fn one_process_is_rank_0_of_1() {
        let dist = Dist::single();
        assert_eq!((dist.rank(), dist.size(), dist.is_root()), (0, 1, true));
        assert_eq!(dist.local_batch(7).unwrap(), 7);
        assert!(dist.local_batch(0).is_err());
    }
}
