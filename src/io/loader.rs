//! `DataLoader`: the batches of an epoch, in a shuffled order new every epoch (the same for
//! the same seed), each made on a background thread while the device runs the step before.

use std::sync::mpsc::{sync_channel, Receiver};
use std::sync::Arc;
use std::thread::JoinHandle;

use rand::seq::SliceRandom;
use rand::SeedableRng;

use crate::io::Dataset;

/// What a [`DataLoader`] draws from: examples by index, assembled into one batch on the host
/// (the thread that makes it is not the one that uploads it).
pub trait BatchSource: Send + Sync + 'static {
    /// One batch, as the training loop takes it.
    type Batch: Send + 'static;
    /// Number of examples.
    fn len(&self) -> usize;
    /// True when there are no examples.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// The examples `indices`, as one batch.
    fn batch(&self, indices: &[usize]) -> Self::Batch;
}

impl BatchSource for Dataset {
    type Batch = (Vec<f32>, Vec<u32>);

    fn len(&self) -> usize {
        Dataset::len(self)
    }

    fn batch(&self, indices: &[usize]) -> (Vec<f32>, Vec<u32>) {
        Dataset::batch(self, indices)
    }
}

/// Batches of `batch_size` examples of a [`BatchSource`], as PyTorch's `DataLoader`:
/// `shuffle(seed)` visits the examples in a new order every epoch (the same orders for the
/// same seed), `drop_last` drops a last short batch, and each epoch's batches are made one
/// ahead on a background thread.
///
/// ```
/// # fn main() -> wgrad::Result<()> {
/// use wgrad::io::{synthetic_spirals, DataLoader};
/// let (train, _) = synthetic_spirals(3, 100, 10, 0);
/// let mut loader = DataLoader::new(train, 32).shuffle(7).drop_last(true);
/// for epoch in 0..2 {
///     for (inputs, labels) in loader.epoch() {
///         assert_eq!(labels.len(), 32); // upload, step...
///     }
/// }
/// # Ok(())
/// # }
/// ```
pub struct DataLoader<S: BatchSource> {
    source: Arc<S>,
    batch_size: usize,
    seed: Option<u64>,
    drop_last: bool,
    epoch: u64,
}

impl<S: BatchSource> DataLoader<S> {
    /// Batches of `batch_size` (at least 1) in order, the last one short if need be.
    pub fn new(source: S, batch_size: usize) -> DataLoader<S> {
        DataLoader {
            source: Arc::new(source),
            batch_size: batch_size.max(1),
            seed: None,
            drop_last: false,
            epoch: 0,
        }
    }

    /// Visits the examples in a new order every epoch, drawn from `seed`.
    pub fn shuffle(mut self, seed: u64) -> DataLoader<S> {
        self.seed = Some(seed);
        self
    }

    /// Drops the last batch of an epoch when it is short.
    pub fn drop_last(mut self, drop_last: bool) -> DataLoader<S> {
        self.drop_last = drop_last;
        self
    }

    /// Makes the next [`DataLoader::epoch`] epoch number `epoch` (counted from 0), with that
    /// epoch's order, as torch's `sampler.set_epoch`: how a resumed run goes on with the
    /// orders the uninterrupted run would have drawn.
    pub fn set_epoch(&mut self, epoch: u64) {
        self.epoch = epoch;
    }

    /// The examples the batches are drawn from.
    pub fn source(&self) -> &S {
        &self.source
    }

    /// Batches per epoch.
    pub fn len(&self) -> usize {
        let n = self.source.len();
        match self.drop_last {
            true => n / self.batch_size,
            false => n.div_ceil(self.batch_size),
        }
    }

    /// True when an epoch has no batch.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The order of epoch `epoch`: the indices shuffled by a generator of the seed and the
    /// epoch, or in order.
    fn order(&self, epoch: u64) -> Vec<usize> {
        let mut order: Vec<usize> = (0..self.source.len()).collect();
        if let Some(seed) = self.seed {
            let mixed = seed ^ epoch.wrapping_mul(0x9E37_79B9_7F4A_7C15);
            order.shuffle(&mut rand::rngs::StdRng::seed_from_u64(mixed));
        }
        order
    }

    /// The next epoch's batches. A background thread makes each batch while the one before is
    /// in use (one ahead); dropping the iterator stops it.
    pub fn epoch(&mut self) -> Epoch<S::Batch> {
        let order = self.order(self.epoch);
        self.epoch += 1;
        let batches: Vec<Vec<usize>> = order
            .chunks(self.batch_size)
            .filter(|c| !self.drop_last || c.len() == self.batch_size)
            .map(<[usize]>::to_vec)
            .collect();
        // One batch waits in the channel while the thread makes the next.
        let (send, receive) = sync_channel(1);
        let source = self.source.clone();
        let worker = std::thread::spawn(move || {
            for indices in batches {
                if send.send(source.batch(&indices)).is_err() {
                    return; // the epoch was dropped
                }
            }
        });
        Epoch {
            receive: Some(receive),
            worker: Some(worker),
        }
    }
}

/// One epoch's batches, made ahead on a background thread.
pub struct Epoch<B> {
    receive: Option<Receiver<B>>,
    worker: Option<JoinHandle<()>>,
}

impl<B> Iterator for Epoch<B> {
    type Item = B;

    fn next(&mut self) -> Option<B> {
        self.receive.as_ref()?.recv().ok()
    }
}

impl<B> Drop for Epoch<B> {
    fn drop(&mut self) {
        // Closing the channel ends the worker at its next send.
        self.receive = None;
        if let Some(worker) = self.worker.take() {
            let _ = worker.join();
        }
    }
}
