//! Shared by the integration tests: one device for every test in a binary, and CPU references.
#![allow(dead_code)]

use std::sync::OnceLock;

use wgrad::{Device, Tensor};

/// The device every test shares: creating one per test would cost seconds on software adapters.
/// The `dtypes_integer_f16_reads` target runs `tests/dtypes.rs` with F16 read in integer
/// arithmetic.
pub fn device() -> &'static Device {
    static DEVICE: OnceLock<Device> = OnceLock::new();
    DEVICE.get_or_init(|| {
        let device = Device::new().expect("a wgpu adapter (install mesa-vulkan-drivers)");
        if env!("CARGO_CRATE_NAME") == "dtypes_integer_f16_reads" {
            (device.set_f16_reads(wgrad::F16Reads::Integer))
                .expect("every adapter reads F16 in integers");
        }
        device
    })
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

/// GELU, exact (erf) form, in f64.
pub fn gelu_ref(x: f64) -> f64 {
    0.5 * x * (1.0 + erf(x / std::f64::consts::SQRT_2))
}

/// erf by its Maclaurin series (converges to f64 precision for the |x| < 5 used here).
pub fn erf(x: f64) -> f64 {
    if x.abs() >= 5.0 {
        return x.signum();
    }
    let (mut sum, mut power, mut n) = (0.0f64, x, 0.0f64);
    while n < 200.0 {
        let term = power / (2.0 * n + 1.0);
        sum += term;
        if term.abs() < 1e-18 {
            break;
        }
        n += 1.0;
        power *= -x * x / n;
    }
    sum * 2.0 / std::f64::consts::PI.sqrt()
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

/// Compares the backward of `f` with central finite differences at `inputs` (shape, values).
/// The loss is `sum(f(inputs) * r)` for fixed random `r`, so every output element's grad
/// differs. Panics with the op, input and element on a mismatch beyond `2e-2 * |numeric| +
/// 2e-3`. Keep inputs away from kinks (relu at 0, ties in max).
pub fn gradcheck(
    name: &str,
    inputs: &[(Vec<usize>, Vec<f32>)],
    f: impl Fn(&[Tensor]) -> wgrad::Result<Tensor>,
) {
    let dev = device();
    let make = |values: &[Vec<f32>], grad: bool| -> Vec<Tensor> {
        inputs
            .iter()
            .zip(values)
            .map(|((shape, _), v)| {
                Tensor::from_slice(v, shape, dev)
                    .unwrap()
                    .requires_grad_(grad)
            })
            .collect()
    };
    let base: Vec<Vec<f32>> = inputs.iter().map(|(_, v)| v.clone()).collect();
    let leaves = make(&base, true);
    let out = f(&leaves).unwrap_or_else(|e| panic!("{name}: forward failed: {e}"));
    let r_values = random_vec(out.numel(), 99);
    let r = Tensor::from_slice(&r_values, out.shape(), dev).unwrap();
    out.mul(&r)
        .unwrap()
        .sum()
        .unwrap()
        .backward()
        .unwrap_or_else(|e| panic!("{name}: backward failed: {e}"));
    let loss_at = |values: &[Vec<f32>]| -> f64 {
        let out = wgrad::no_grad(|| f(&make(values, false))).unwrap();
        out.to_vec()
            .unwrap()
            .iter()
            .zip(&r_values)
            .map(|(&o, &w)| o as f64 * w as f64)
            .sum()
    };
    let eps = 1e-2f32;
    for (i, leaf) in leaves.iter().enumerate() {
        let analytic = leaf
            .grad()
            .unwrap_or_else(|| panic!("{name}: input {i} got no grad"))
            .to_vec()
            .unwrap();
        assert_eq!(
            analytic.len(),
            base[i].len(),
            "{name}: input {i} grad length"
        );
        for j in 0..base[i].len() {
            let mut plus = base.clone();
            plus[i][j] += eps;
            let mut minus = base.clone();
            minus[i][j] -= eps;
            let numeric = (loss_at(&plus) - loss_at(&minus)) / (2.0 * eps as f64);
            let a = analytic[j] as f64;
            assert!(
                (a - numeric).abs() <= 2e-2 * numeric.abs() + 2e-3,
                "{name}: input {i} element {j}: analytic {a}, numeric {numeric}"
            );
        }
    }
}

/// `n` values in [lo, hi), deterministic from `seed`.
pub fn values_in(n: usize, lo: f32, hi: f32, seed: u64) -> Vec<f32> {
    random_vec(n, seed)
        .iter()
        .map(|x| lo + (x + 1.0) * 0.5 * (hi - lo))
        .collect()
}
