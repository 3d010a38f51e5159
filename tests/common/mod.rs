//! Shared by the integration tests: one device for every test in a binary, and CPU references.
#![allow(dead_code)]

use std::sync::OnceLock;

use wgrad::{Device, Tensor};

/// The device every test shares: creating one per test would cost seconds on software adapters.
pub fn device() -> &'static Device {
    static DEVICE: OnceLock<Device> = OnceLock::new();
    DEVICE.get_or_init(|| Device::new().expect("a wgpu adapter (install mesa-vulkan-drivers)"))
}

/// Deterministic pseudo-random values in [-1, 1) for CPU references (SplitMix64).
pub fn random_vec(n: usize, seed: u64) -> Vec<f32> {
    let mut state = seed.wrapping_add(0x9E37_79B9_7F4A_7C15);
    (0..n)
        .map(|_| {
            state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = state;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^= z >> 31;
            ((z >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

/// A tensor of `shape` with values from [`random_vec`], and those values.
pub fn random_tensor(shape: &[usize], seed: u64) -> (Tensor, Vec<f32>) {
    let n = shape.iter().product();
    let data = random_vec(n, seed);
    (Tensor::from_slice(&data, shape, device()).unwrap(), data)
}

/// Asserts `got` matches the f64 reference `want` elementwise within `rel * max(1, |want|)`.
pub fn assert_close(got: &[f32], want: &[f64], rel: f64, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let tol = rel * w.abs().max(1.0);
        let ok = (g as f64 - w).abs() <= tol || (g.is_nan() && w.is_nan()) || (g as f64 == w);
        assert!(ok, "{what}: element {i}: got {g}, want {w} (tol {tol})");
    }
}

/// Row-major strides of `shape`.
pub fn strides(shape: &[usize]) -> Vec<usize> {
    let mut s = vec![1; shape.len()];
    for d in (0..shape.len().saturating_sub(1)).rev() {
        s[d] = s[d + 1] * shape[d + 1];
    }
    s
}

/// The multi-index of flat position `i` in `shape`.
pub fn unravel(mut i: usize, shape: &[usize]) -> Vec<usize> {
    let mut idx = vec![0; shape.len()];
    for d in (0..shape.len()).rev() {
        idx[d] = i % shape[d];
        i /= shape[d];
    }
    idx
}
