//! Attention's device memory grows linearly in T: the `T x T` scores are never stored. Alone
//! in its test binary, so that no other test allocates on the shared device meanwhile.

mod common;
use common::*;

/// Bytes the pool holds (live + pooled) after a forward and backward of attention at length
/// `t`, starting from an empty pool: the most the step had allocated at once, give or take
/// the pool's reuse.
fn bytes_for(t: usize) -> u64 {
    let dev = device();
    dev.synchronize().unwrap();
    dev.empty_pool();
    {
        let shape = [2, 4, t, 32];
        let q = wgrad::Tensor::randn(&shape, 1, dev)
            .unwrap()
            .requires_grad_(true);
        let k = wgrad::Tensor::randn(&shape, 2, dev)
            .unwrap()
            .requires_grad_(true);
        let v = wgrad::Tensor::randn(&shape, 3, dev)
            .unwrap()
            .requires_grad_(true);
        let loss = q
            .scaled_dot_product_attention(&k, &v, true)
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
    let short = bytes_for(256);
    let long = bytes_for(1024);
    eprintln!("sdpa forward + backward, B 2 H 4 D 32: T 256 {short} bytes, T 1024 {long} bytes");
    assert!(
        long < 6 * short,
        "T = 1024 took {long} bytes, T = 256 took {short}: more than 6x"
    );
    // What a stored score matrix alone would take at T = 1024: 2 x 4 x 1024 x 1024 floats.
    assert!(long < 2 * 4 * 1024 * 1024 * 4, "T = 1024 took {long} bytes");
}
