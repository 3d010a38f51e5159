//! The global seed behind parameter init and dropout, as `torch.manual_seed`: a SplitMix64
//! stream whose whole state is one `u64`, so a training state can save and restore it.

use std::sync::Mutex;

/// The stream's state; `manual_seed(s)` sets it to `s`, and 0 is the seed without a call.
static GLOBAL: Mutex<u64> = Mutex::new(0);

/// Seeds parameter initialisation and dropout masks: the same seed and the same sequence of
/// layer constructions and forward passes give the same numbers. Without a call, the seed is 0.
pub fn manual_seed(seed: u64) {
    *GLOBAL.lock().unwrap_or_else(|e| e.into_inner()) = seed;
}

/// The next seed from the global generator, for one initialisation or one dropout mask.
pub(crate) fn next_seed() -> u64 {
    let mut state = GLOBAL.lock().unwrap_or_else(|e| e.into_inner());
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The generator's state, for a training state to save.
pub(crate) fn rng_state() -> u64 {
    *GLOBAL.lock().unwrap_or_else(|e| e.into_inner())
}

/// Restores the generator's state a training state saved.
pub(crate) fn set_rng_state(state: u64) {
    *GLOBAL.lock().unwrap_or_else(|e| e.into_inner()) = state;
}
