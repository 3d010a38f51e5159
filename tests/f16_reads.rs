//! The three ways kernels read F16 elements (`F16Reads`) give the same bits: WGSL `f16`
//! bindings (where the adapter has `SHADER_F16`), packed words through the adapter's
//! conversions, and packed words in integer arithmetic; and each gives torch's values. Each
//! test switches the shared device's path, so they take one lock.

mod common;

use std::sync::Mutex;

use common::{device, random_vec};
use half::f16;
use wgrad::{DType, F16Reads, Tensor};

static PATH: Mutex<()> = Mutex::new(());

/// The paths this adapter has: `Native` only with `SHADER_F16`.
fn paths() -> Vec<F16Reads> {
    let mut paths = vec![F16Reads::Hardware, F16Reads::Integer];
    if device().shader_f16() {
        paths.insert(0, F16Reads::Native);
    }
    paths
}

/// `n` random F16 values in [-4, 4), with subnormals, a negative zero, the largest half,
/// infinities and a NaN among them where `specials` (and as many as `n` allows).
fn halves(n: usize, seed: u64, specials: bool) -> Vec<f16> {
    let awkward = [
        f16::from_bits(0x0001), // smallest subnormal
        f16::from_bits(0x83ff), // largest negative subnormal
        f16::from_bits(0x8000), // -0
        f16::MAX,
        f16::INFINITY,
        f16::NEG_INFINITY,
        f16::NAN,
        f16::from_f32(1.0e-5), // subnormal
    ];
    let mut values: Vec<f16> = (random_vec(n, seed).into_iter())
        .map(|x| f16::from_f32(4.0 * x))
        .collect();
    if specials {
        for (i, s) in awkward.iter().enumerate().take(n) {
            values[(i * 7919 + 3) % n] = *s;
        }
    }
    values
}

/// `run()`'s result as F32 bits on every path this adapter has, checked equal, once.
fn same_bits_on_every_path(run: impl Fn() -> wgrad::Result<Tensor>) -> Vec<u32> {
    let _lock = PATH.lock().unwrap_or_else(|e| e.into_inner());
    let dev = device();
    let before = dev.f16_reads();
    let mut first: Option<(F16Reads, Vec<u32>)> = None;
    for path in paths() {
        dev.set_f16_reads(path).unwrap();
        let out = run().unwrap().to_dtype(DType::F32).unwrap();
        let bits: Vec<u32> = out
            .to_vec()
            .unwrap()
            .into_iter()
            .map(f32::to_bits)
            .collect();
        match &first {
            None => first = Some((path, bits)),
            Some((p, want)) => {
                assert_eq!(want.len(), bits.len());
                let at = (want.iter().zip(&bits)).position(|(a, b)| a != b);
                assert_eq!(at, None, "{path:?} differs from {p:?} at this element");
            }
        }
    }
    dev.set_f16_reads(before).unwrap();
    first.unwrap().1
}

/// `got` (F32 bits) equals `want` exactly, NaN for NaN.
fn assert_exact(got: &[u32], want: &[f32]) {
    assert_eq!(got.len(), want.len());
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let g = f32::from_bits(*g);
        assert!(
            g.to_bits() == w.to_bits() || (g.is_nan() && w.is_nan()),
            "element {i}: {g} against {w}"
        );
    }
}

#[test]
fn an_f16_unary_op_reads_subnormals_infinities_and_nan_alike_on_every_path() {
    // Lengths in whole fours read four elements at a time.
    for n in [0, 1, 7, 8, 65_544, 70_001] {
        let x = halves(n, 1, true);
        let got =
            same_bits_on_every_path(|| Tensor::from_vec_f16(x.clone(), &[n], device())?.neg());
        let want: Vec<f32> = x.iter().map(|h| -h.to_f32()).collect();
        assert_exact(&got, &want);
    }
}

#[test]
fn an_f16_binary_op_reads_both_operands_alike_on_every_path() {
    // [n, 3] + [3] (the right side broadcast) and a strided left side (a transposed view).
    for n in [1, 4, 5, 4099] {
        let a = halves(3 * n, 2, true);
        let b = halves(3, 3, false);
        let got = same_bits_on_every_path(|| {
            let a = Tensor::from_vec_f16(a.clone(), &[n, 3], device())?;
            let b = Tensor::from_vec_f16(b.clone(), &[3], device())?;
            a.add(&b)
        });
        let want: Vec<f32> = (0..3 * n)
            .map(|i| f16::from_f32(a[i].to_f32() + b[i % 3].to_f32()).to_f32())
            .collect();
        assert_exact(&got, &want);

        let got = same_bits_on_every_path(|| {
            let a = Tensor::from_vec_f16(a.clone(), &[n, 3], device())?;
            a.sub(&a.flip(&[0, 1])?.contiguous()?)
        });
        let want: Vec<f32> = (0..3 * n)
            .map(|i| f16::from_f32(a[i].to_f32() - a[3 * n - 1 - i].to_f32()).to_f32())
            .collect();
        assert_exact(&got, &want);

        let got = same_bits_on_every_path(|| {
            let a = Tensor::from_vec_f16(a.clone(), &[3, n], device())?.transpose(0, 1)?;
            let b = Tensor::from_vec_f16(b.clone(), &[3], device())?;
            a.mul(&b)
        });
        let want: Vec<f32> = (0..3 * n)
            .map(|i| {
                let (row, col) = (i / 3, i % 3);
                f16::from_f32(a[col * n + row].to_f32() * b[col].to_f32()).to_f32()
            })
            .collect();
        assert_exact(&got, &want);
    }
}

#[test]
fn an_f16_matmul_reads_both_operands_alike_on_every_path() {
    // Small, tiled, and with a transposed operand; subnormals among the inputs.
    for (m, k, n) in [(1, 1, 1), (5, 7, 3), (65, 130, 67), (128, 64, 132)] {
        let a = halves(m * k, 4, false);
        let mut b = halves(k * n, 5, false);
        b[0] = f16::from_bits(0x0003);
        let got = same_bits_on_every_path(|| {
            let a = Tensor::from_vec_f16(a.clone(), &[m, k], device())?;
            let b = Tensor::from_vec_f16(b.clone(), &[n, k], device())?.transpose(0, 1)?;
            a.matmul(&b)
        });
        for (i, g) in got.iter().enumerate() {
            let (r, c) = (i / n, i % n);
            let exact: f64 = (0..k)
                .map(|j| a[r * k + j].to_f64() * b[c * k + j].to_f64())
                .sum();
            let g = f32::from_bits(*g) as f64;
            // The product is stored in F16: within its rounding (and f32 accumulation).
            let tol = 1e-3 * exact.abs().max(1.0) * (k as f64).sqrt();
            assert!(
                (g - exact).abs() <= tol,
                "[{r}, {c}] of {m}x{k}x{n}: {g} against {exact}"
            );
        }
    }
}

#[test]
fn native_f16_reads_need_shader_f16_and_keep_the_path_otherwise() {
    let _lock = PATH.lock().unwrap_or_else(|e| e.into_inner());
    let dev = device();
    let before = dev.f16_reads();
    match dev.shader_f16() {
        true => {
            dev.set_f16_reads(F16Reads::Native).unwrap();
            assert_eq!(dev.f16_reads(), F16Reads::Native);
        }
        false => {
            let err = dev.set_f16_reads(F16Reads::Native).unwrap_err().to_string();
            assert!(
                err.contains("SHADER_F16") && err.contains("set_f16_reads"),
                "{err}"
            );
            assert_eq!(dev.f16_reads(), before);
        }
    }
    dev.set_f16_reads(before).unwrap();
}
