//! Attention's device memory grows linearly in T: the `T x T` scores are never stored, nor a
//! mask expanded to them, nor k and v copied out to q's heads. Alone in its test binary, and
//! its tests one at a time, so that nothing else allocates on the shared device meanwhile.

mod common;
use common::*;
use std::sync::Mutex;
use wgrad::{SdpaOptions, Tensor};

/// One measurement at a time: the tests of this binary run on threads of one process.
static POOL: Mutex<()> = Mutex::new(());

/// Bytes the pool holds (live + pooled) after a forward and backward of causal attention of
/// B 2, `heads` q heads and `kv_heads` k/v heads of D 32 at length `t`, with a padding mask
/// when `padded`, starting from an empty pool: the most the step had allocated at once, give
/// or take the pool's reuse.
fn bytes_for(t: usize, heads: usize, kv_heads: usize, padded: bool) -> u64 {
    let _one_at_a_time = POOL.lock().unwrap_or_else(|e| e.into_inner());
    let dev = device();
    dev.synchronize().unwrap();
    dev.empty_pool();
    {
        let make = |h: usize, seed| {
            Tensor::randn(&[2, h, t, 32], seed, dev)
                .unwrap()
                .requires_grad_(true)
        };
        let (q, k, v) = (make(heads, 1), make(kv_heads, 2), make(kv_heads, 3));
        // Batch row 1 is padded over its last quarter.
        let keep: Vec<u32> = (0..2 * t).map(|i| u32::from(i < t + 3 * t / 4)).collect();
        let mask = Tensor::from_vec_u32(keep, &[2, 1, 1, t], dev).unwrap();
        let opts = SdpaOptions {
            causal: true,
            mask: padded.then_some(&mask),
            scale: None,
        };
        let loss = q
            .scaled_dot_product_attention_with(&k, &v, &opts)
            .unwrap()
            .sum()
            .unwrap();
        loss.backward().unwrap();
        dev.synchronize().unwrap();
    }
    let stats = dev.stats();
    stats.live_bytes + stats.pooled_bytes
}

#[test]
fn sdpa_memory_grows_linearly_in_sequence_length() {
    let short = bytes_for(256, 4, 4, false);
    let long = bytes_for(1024, 4, 4, false);
    eprintln!("sdpa forward + backward, B 2 H 4 D 32: T 256 {short} bytes, T 1024 {long} bytes");
    assert!(
        long < 6 * short,
        "T = 1024 took {long} bytes, T = 256 took {short}: more than 6x"
    );
    // What a stored score matrix alone would take at T = 1024: 2 x 4 x 1024 x 1024 floats.
    assert!(long < 2 * 4 * 1024 * 1024 * 4, "T = 1024 took {long} bytes");
}

#[test]
fn masked_sdpa_memory_grows_linearly_in_sequence_length() {
    let short = bytes_for(256, 4, 4, true);
    let long = bytes_for(1024, 4, 4, true);
    eprintln!("padding-masked sdpa: T 256 {short} bytes, T 1024 {long} bytes");
    assert!(
        long < 6 * short,
        "T = 1024 took {long} bytes, T = 256 took {short}: more than 6x"
    );
}

#[test]
fn grouped_query_sdpa_does_not_copy_k_and_v_to_every_head() {
    let grouped = bytes_for(512, 8, 2, true);
    let full = bytes_for(512, 8, 8, true);
    eprintln!("sdpa H 8: H_kv 2 {grouped} bytes, H_kv 8 {full} bytes");
    // q, out and their grads are the same in both; k, v and their grads a quarter.
    assert!(
        grouped < full,
        "H_kv = 2 took {grouped} bytes, H_kv = 8 {full}"
    );
    // With k and v expanded to 8 heads, the grouped call would hold what the full one holds.
    assert!(
        (grouped as f64) < 0.8 * full as f64,
        "H_kv = 2 took {grouped} bytes, H_kv = 8 {full}"
    );
}
