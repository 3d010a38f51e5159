//! The global seed behind parameter init and dropout, as `torch.manual_seed`.

use std::sync::Mutex;

use rand::{Rng, SeedableRng};

static GLOBAL: Mutex<Option<rand::rngs::StdRng>> = Mutex::new(None);

/// Seeds parameter initialisation and dropout masks: the same seed and the same sequence of
/// layer constructions and forward passes give the same numbers. Without a call, the seed is 0.
pub fn manual_seed(seed: u64) {
    *GLOBAL.lock().unwrap_or_else(|e| e.into_inner()) =
        Some(rand::rngs::StdRng::seed_from_u64(seed));
}

/// The next seed from the global generator, for one initialisation or one dropout mask.
pub(crate) fn next_seed() -> u64 {
    let mut global = GLOBAL.lock().unwrap_or_else(|e| e.into_inner());
    global
        .get_or_insert_with(|| rand::rngs::StdRng::seed_from_u64(0))
        .random()
}
