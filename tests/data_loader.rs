//! `io::DataLoader`: every example once per epoch, a new order each epoch and the same orders
//! for the same seed, short last batches kept or dropped, and the next batch made while the
//! step before runs.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;
use wgrad::io::{BatchSource, DataLoader};

/// A source whose batches are their own indices.
struct Indices(usize);

impl BatchSource for Indices {
    type Batch = Vec<usize>;
    fn len(&self) -> usize {
        self.0
    }
    fn batch(&self, indices: &[usize]) -> Vec<usize> {
        indices.to_vec()
    }
}

fn epochs(loader: &mut DataLoader<Indices>, n: usize) -> Vec<Vec<Vec<usize>>> {
    (0..n).map(|_| loader.epoch().collect()).collect()
}

#[test]
fn every_example_comes_once_per_epoch_in_a_new_order() {
    let mut loader = DataLoader::new(Indices(103), 10).shuffle(5);
    assert_eq!(loader.len(), 11);
    let seen = epochs(&mut loader, 3);
    for epoch in &seen {
        assert_eq!(epoch.len(), 11);
        assert_eq!(
            epoch.last().unwrap().len(),
            3,
            "the short last batch is kept"
        );
        let mut all: Vec<usize> = epoch.concat();
        all.sort();
        assert_eq!(all, (0..103).collect::<Vec<_>>());
    }
    assert_ne!(seen[0], seen[1]);
    assert_ne!(seen[1], seen[2]);
    // The same seed, the same orders; another seed, others.
    assert_eq!(
        epochs(&mut DataLoader::new(Indices(103), 10).shuffle(5), 3),
        seen
    );
    assert_ne!(
        epochs(&mut DataLoader::new(Indices(103), 10).shuffle(6), 1)[0],
        seen[0]
    );
    // Without shuffling, in order.
    let plain = epochs(&mut DataLoader::new(Indices(25), 10), 1).remove(0);
    assert_eq!(plain.concat(), (0..25).collect::<Vec<_>>());
}

#[test]
fn set_epoch_resumes_the_orders_of_an_uninterrupted_run() {
    let whole = epochs(&mut DataLoader::new(Indices(50), 8).shuffle(3), 4);
    let mut resumed = DataLoader::new(Indices(50), 8).shuffle(3);
    resumed.set_epoch(2);
    assert_eq!(epochs(&mut resumed, 2), whole[2..].to_vec());
}

#[test]
fn drop_last_drops_a_short_last_batch() {
    let mut loader = DataLoader::new(Indices(103), 10).shuffle(1).drop_last(true);
    assert_eq!(loader.len(), 10);
    let epoch: Vec<Vec<usize>> = loader.epoch().collect();
    assert_eq!(epoch.len(), 10);
    assert!(epoch.iter().all(|b| b.len() == 10));
    assert!(DataLoader::new(Indices(0), 4).epoch().next().is_none());
}

/// A slow source that counts the batches it has finished.
struct Slow {
    made: Arc<AtomicUsize>,
}

impl BatchSource for Slow {
    type Batch = usize;
    fn len(&self) -> usize {
        8
    }
    fn batch(&self, indices: &[usize]) -> usize {
        std::thread::sleep(Duration::from_millis(20));
        self.made.fetch_add(1, Ordering::SeqCst);
        indices[0]
    }
}

/// While the loop holds batch k, batch k + 1 is being made: it is finished before the loop
/// asks for it (waited for with a generous deadline, so no timing decides the test).
#[test]
fn the_next_batch_is_made_while_the_step_runs() {
    let made = Arc::new(AtomicUsize::new(0));
    let mut loader = DataLoader::new(Slow { made: made.clone() }, 2);
    let mut epoch = loader.epoch();
    for k in 0..4 {
        let _batch = epoch.next().unwrap();
        // The "step": until the loader has finished the next batch too, or 10 s.
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while made.load(Ordering::SeqCst) < (k + 2).min(4) && std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(1));
        }
        assert!(
            made.load(Ordering::SeqCst) >= (k + 2).min(4),
            "batch {} was not made ahead",
            k + 1
        );
    }
    assert!(epoch.next().is_none());
    drop(epoch);
    // Dropping an epoch midway stops its thread.
    let mut early = loader.epoch();
    early.next().unwrap();
    drop(early);
}
