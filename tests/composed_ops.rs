//! Reductions, shape ops, indexing and creation of the ops issue that are built from other
//! ops (min_dims, argmin, logsumexp, var/std, cumsum, flip, repeat, one_hot, index_add, eye,
//! arange_f, adaptive pooling, interpolate): values against f64 host references, grads against
//! finite differences.

mod common;
use common::*;
use wgrad::nn::{self, Module};
use wgrad::{DType, Error, Interpolate, Tensor};

/// `x` of `[rows, cols]` reduced along dim 1 by `f` on the host.
fn rows_ref(x: &[f32], cols: usize, f: impl Fn(&[f64]) -> f64) -> Vec<f64> {
    x.chunks(cols)
        .map(|r| f(&r.iter().map(|&v| v as f64).collect::<Vec<_>>()))
        .collect()
}

#[test]
fn min_dims_and_argmin_match_the_host() {
    let (x, xs) = random_tensor(&[7, 13], 1);
    let want = rows_ref(&xs, 13, |r| r.iter().cloned().fold(f64::INFINITY, f64::min));
    assert_close(
        &x.min_dims(&[1], false).unwrap().to_vec().unwrap(),
        &want,
        0.0,
        "min_dims",
    );
    let want_idx: Vec<u32> = xs
        .chunks(13)
        .map(|r| {
            let m = r.iter().cloned().fold(f32::INFINITY, f32::min);
            r.iter().position(|&v| v == m).unwrap() as u32
        })
        .collect();
    assert_eq!(x.argmin(1, false).unwrap().to_vec_u32().unwrap(), want_idx);
    gradcheck(
        "min_dims",
        &[(vec![3, 5], values_in(15, -1.0, 1.0, 2))],
        |t| t[0].t()?.min_dims(&[0], true),
    );
}

#[test]
fn logsumexp_is_stable_and_its_grad_is_the_softmax() {
    let (x, xs) = random_tensor(&[5, 9], 3);
    let big = x.mul_scalar(100.0).unwrap();
    let want = rows_ref(&xs, 9, |r| {
        let m = r
            .iter()
            .map(|v| v * 100.0)
            .fold(f64::NEG_INFINITY, f64::max);
        m + r.iter().map(|v| (v * 100.0 - m).exp()).sum::<f64>().ln()
    });
    let got = big.logsumexp(&[1], false).unwrap();
    assert_eq!(got.shape(), &[5]);
    assert_close(&got.to_vec().unwrap(), &want, 1e-6, "logsumexp");
    let rows = Tensor::from_vec(
        vec![
            f32::NEG_INFINITY,
            f32::NEG_INFINITY,
            f32::INFINITY,
            0.0,
            f32::NAN,
            1.0,
        ],
        &[3, 2],
        device(),
    )
    .unwrap();
    let got = rows.logsumexp(&[1], true).unwrap();
    assert_eq!(got.shape(), &[3, 1]);
    let got = got.to_vec().unwrap();
    assert_eq!(got[0], f32::NEG_INFINITY);
    assert_eq!(got[1], f32::INFINITY);
    assert!(got[2].is_nan());
    for batch in [1, 3] {
        gradcheck(
            "logsumexp",
            &[(vec![batch, 6], values_in(batch * 6, -2.0, 2.0, 4))],
            |t| t[0].t()?.logsumexp(&[0], false),
        );
    }
}

#[test]
fn var_and_std_take_a_correction() {
    let (x, xs) = random_tensor(&[4, 11], 5);
    for correction in [0usize, 1] {
        let var = |r: &[f64]| {
            let mean = r.iter().sum::<f64>() / r.len() as f64;
            r.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / (r.len() - correction) as f64
        };
        let want = rows_ref(&xs, 11, var);
        let got = x
            .var_dims(&[1], correction, false)
            .unwrap()
            .to_vec()
            .unwrap();
        assert_close(&got, &want, 1e-5, "var_dims");
        let want: Vec<f64> = want.iter().map(|v| v.sqrt()).collect();
        let got = x.std_dims(&[1], correction, true).unwrap();
        assert_eq!(got.shape(), &[4, 1]);
        assert_close(&got.to_vec().unwrap(), &want, 1e-5, "std_dims");
    }
    gradcheck(
        "var_dims",
        &[(vec![3, 4], values_in(12, -1.0, 1.0, 6))],
        |t| t[0].var_dims(&[0, 1], 1, false),
    );
    gradcheck(
        "std_dims",
        &[(vec![3, 4], values_in(12, -1.0, 1.0, 7))],
        |t| t[0].t()?.std_dims(&[1], 0, false),
    );
    assert!(x.var_dims(&[2], 1, false).is_err());
}

/// torch divides by `max(0, count - correction)`: a count not above the correction gives inf
/// (or NaN where the squares sum to 0), never a negative variance.
#[test]
fn var_of_values_far_from_zero_is_exact_to_f32() {
    // The f32 mean of values near 1000 lands an ulp (6e-5) off theirs, and squares taken about
    // it add that error squared: 3.6e-4 of a variance of 1e-5. The corrected two-pass
    // algorithm takes it back out.
    for (base, spread, n) in [
        (1000.0f32, 0.01f32, 1000),
        (-37.5, 0.003, 5),
        (1e4, 0.1, 7000),
    ] {
        let data: Vec<f32> = (0..n)
            .map(|i| base + spread * ((i * 7 % 11) as f32 / 10.0 - 0.5))
            .collect();
        let mean = data.iter().map(|&v| v as f64).sum::<f64>() / n as f64;
        let want = data.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / (n - 1) as f64;
        let x = Tensor::from_slice(&data, &[1, n], device()).unwrap();
        let got = x.var_dims(&[1], 1, false).unwrap().item().unwrap() as f64;
        assert!(
            (got - want).abs() <= 1e-5 * want,
            "{n} values at {base}: {got} vs {want}"
        );
    }
    // Equal values: a variance of 0 (not a rounding error below it, whose std is NaN).
    for value in [0.7f32, 1000.1, -3.3e7] {
        for n in [3, 1000, 70_001] {
            let x = Tensor::full(&[n], value, device()).unwrap();
            let std = x.std_dims(&[0], 1, false).unwrap().item().unwrap();
            assert!(
                (0.0..=1e-6 * value.abs()).contains(&std),
                "{n} x {value}: std {std}"
            );
        }
    }
}

#[test]
fn var_with_a_count_not_above_the_correction_is_inf_or_nan() {
    let x = Tensor::from_vec(vec![1.0, 2.0, 3.0, 4.0, 4.0, 4.0], &[2, 3], device()).unwrap();
    for correction in [3usize, 5] {
        let var = x
            .var_dims(&[1], correction, false)
            .unwrap()
            .to_vec()
            .unwrap();
        assert_eq!(
            var[0],
            f32::INFINITY,
            "var of 1, 2, 3 with correction {correction}"
        );
        assert!(
            var[1].is_nan(),
            "var of 4, 4, 4 with correction {correction}: {}",
            var[1]
        );
        let std = x
            .std_dims(&[1], correction, false)
            .unwrap()
            .to_vec()
            .unwrap();
        assert_eq!(std[0], f32::INFINITY, "std with correction {correction}");
    }
}

/// torch: the variance of no elements is NaN, whatever the correction.
#[test]
fn var_over_an_empty_dim_is_nan() {
    let x = Tensor::zeros(&[0, 5], device()).unwrap();
    for correction in [0usize, 1] {
        let var = x.var_dims(&[0], correction, false).unwrap();
        assert_eq!(var.shape(), &[5]);
        let got = var.to_vec().unwrap();
        assert!(
            got.iter().all(|v| v.is_nan()),
            "correction {correction}: {got:?}"
        );
    }
}

/// torch: the log of an empty sum is -inf, and the grad of the empty input is empty.
#[test]
fn logsumexp_over_an_empty_dim_is_minus_infinity() {
    let x = Tensor::zeros(&[0, 5], device())
        .unwrap()
        .requires_grad_(true);
    let out = x.logsumexp(&[0], false).unwrap();
    assert_eq!(out.shape(), &[5]);
    assert_eq!(out.to_vec().unwrap(), vec![f32::NEG_INFINITY; 5]);
    assert_eq!(x.logsumexp(&[0], true).unwrap().shape(), &[1, 5]);
    out.sum().unwrap().backward().unwrap();
    assert_eq!(x.grad().unwrap().shape(), &[0, 5]);
}

/// Running sums in f64 of `rows` rows of `len` (row-major), from the end when `reverse`.
fn running_sums_ref(xs: &[f32], len: usize, reverse: bool) -> Vec<f64> {
    let mut out = vec![0f64; xs.len()];
    for (row_in, row_out) in xs.chunks(len).zip(out.chunks_mut(len)) {
        let mut run = 0.0;
        let order: Vec<usize> = if reverse {
            (0..len).rev().collect()
        } else {
            (0..len).collect()
        };
        for i in order {
            run += row_in[i] as f64;
            row_out[i] = run;
        }
    }
    out
}

/// Lengths around the kernel's 1,024-element blocks, past Mesa 22.3's 65,535-iteration loops,
/// and past 1,024 blocks (the block totals then take a scan of their own).
#[test]
fn cumsum_of_long_rows_matches_a_running_sum() {
    for (i, &len) in [1usize, 2, 63, 64, 65, 1023, 1024, 1025, 70_001, 1_050_000]
        .iter()
        .enumerate()
    {
        let rows = if len > 100_000 { 1 } else { 3 };
        let (x, xs) = random_tensor(&[rows, len], 40 + i as u64);
        let got = x.cumsum(1).unwrap().to_vec().unwrap();
        let want = running_sums_ref(&xs, len, false);
        // Sums of `len` values in [-1, 1] are within sqrt(len) of 0; f32 keeps 7 digits.
        let tol = 1e-6 * (len as f64).sqrt().max(1.0) * 4.0;
        for (j, (&g, &w)) in got.iter().zip(&want).enumerate() {
            assert!(
                (g as f64 - w).abs() <= tol,
                "len {len}: element {j}: got {g}, want {w}"
            );
        }
    }
}

/// The grad of a running sum is the running sum of the grad from the end; it reaches every
/// element of a row past one block.
#[test]
fn cumsum_grad_is_the_reversed_running_sum_of_the_grad() {
    let len = 2_500;
    let x = Tensor::zeros(&[2, len], device())
        .unwrap()
        .requires_grad_(true);
    let (g, gs) = random_tensor(&[2, len], 77);
    x.cumsum(-1)
        .unwrap()
        .mul(&g)
        .unwrap()
        .sum()
        .unwrap()
        .backward()
        .unwrap();
    let got = x.grad().unwrap().to_vec().unwrap();
    assert_close(&got, &running_sums_ref(&gs, len, true), 1e-4, "cumsum grad");
}

/// Short rows along a middle dim, a view with an offset, an empty dim and a scalar.
#[test]
fn cumsum_of_short_rows_views_and_empty_dims() {
    let (x, xs) = random_tensor(&[5, 3, 4], 12);
    let got = x.narrow(0, 1, 3).unwrap().cumsum(1).unwrap();
    assert_eq!(got.shape(), &[3, 3, 4]);
    let mut want = vec![0f64; 36];
    for a in 0..3 {
        for c in 0..4 {
            let mut run = 0.0;
            for b in 0..3 {
                run += xs[(a + 1) * 12 + b * 4 + c] as f64;
                want[a * 12 + b * 4 + c] = run;
            }
        }
    }
    assert_close(&got.to_vec().unwrap(), &want, 1e-6, "cumsum of a view");
    let empty = Tensor::zeros(&[4, 0], device()).unwrap();
    assert_eq!(empty.cumsum(1).unwrap().shape(), &[4, 0]);
    assert_eq!(empty.cumsum(0).unwrap().shape(), &[4, 0]);
    assert!(x.cumsum(3).is_err());
    let scalar = Tensor::from_vec(vec![2.5], &[], device())
        .unwrap()
        .cumsum(0)
        .unwrap();
    assert_eq!(scalar.shape(), &[] as &[usize]);
    assert_eq!(scalar.to_vec().unwrap(), vec![2.5]);
}

/// Finite differences through a running sum that feeds a product with itself.
#[test]
fn cumsum_grads_agree_with_finite_differences() {
    gradcheck(
        "cumsum then square",
        &[(vec![2, 70], values_in(140, -1.0, 1.0, 11))],
        |t| t[0].cumsum(1)?.mul(&t[0].cumsum(1)?),
    );
}

#[test]
fn cumsum_runs_along_any_dim() {
    let (x, xs) = random_tensor(&[3, 4, 5], 8);
    let got = x.cumsum(1).unwrap();
    assert_eq!(got.shape(), &[3, 4, 5]);
    let mut want = vec![0f64; 60];
    for a in 0..3 {
        for c in 0..5 {
            let mut run = 0.0;
            for b in 0..4 {
                run += xs[a * 20 + b * 5 + c] as f64;
                want[a * 20 + b * 5 + c] = run;
            }
        }
    }
    assert_close(&got.to_vec().unwrap(), &want, 1e-6, "cumsum");
    gradcheck(
        "cumsum",
        &[(vec![2, 5], values_in(10, -1.0, 1.0, 9))],
        |t| t[0].cumsum(1),
    );
    gradcheck(
        "cumsum dim 0",
        &[(vec![1, 4], values_in(4, -1.0, 1.0, 10))],
        |t| t[0].cumsum(0),
    );
}

/// Errors name the op called, not the one it is built from; over another dim the result is
/// empty, not an error.
#[test]
fn min_dims_and_argmin_over_an_empty_dim_are_errors_naming_them() {
    let e = Tensor::zeros(&[0, 5], device()).unwrap();
    let err = e.min_dims(&[0], false).unwrap_err().to_string();
    assert!(err.starts_with("min: ") && err.contains("[0, 5]"), "{err}");
    let err = e.argmin(0, false).unwrap_err().to_string();
    assert!(
        err.starts_with("argmin: ") && err.contains("[0, 5]"),
        "{err}"
    );
    assert_eq!(e.min_dims(&[1], false).unwrap().shape(), &[0]);
    assert_eq!(e.argmin(1, false).unwrap().shape(), &[0]);
}

/// torch rejects a dim named twice rather than flipping it back.
#[test]
fn flip_of_a_dim_named_twice_is_an_error() {
    let x = Tensor::zeros(&[3, 4], device()).unwrap();
    let err = x.flip(&[1, -1]).unwrap_err().to_string();
    assert!(
        err.starts_with("flip: ") && err.contains("more than once"),
        "{err}"
    );
}

/// The error names `nll`, the op called, and its shapes.
#[test]
fn nll_with_a_target_out_of_range_is_an_error_naming_it() {
    let log_probs = Tensor::zeros(&[2, 3], device()).unwrap();
    let targets = Tensor::from_labels(vec![0, 3], device()).unwrap();
    let err = nn::loss::nll(&log_probs, &targets).unwrap_err().to_string();
    assert!(err.starts_with("nll: ") && err.contains("[2, 3]"), "{err}");
}

#[test]
fn flip_and_repeat_move_elements_as_torch() {
    let x = Tensor::from_vec(vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0], &[2, 3], device()).unwrap();
    assert_eq!(
        x.flip(&[1]).unwrap().to_vec().unwrap(),
        vec![3.0, 2.0, 1.0, 6.0, 5.0, 4.0]
    );
    assert_eq!(
        x.flip(&[0, 1]).unwrap().to_vec().unwrap(),
        vec![6.0, 5.0, 4.0, 3.0, 2.0, 1.0]
    );
    let r = x.repeat(&[2, 2]).unwrap();
    assert_eq!(r.shape(), &[4, 6]);
    assert_eq!(
        r.to_vec().unwrap()[..12],
        [1.0, 2.0, 3.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 4.0, 5.0, 6.0]
    );
    assert_eq!(x.repeat(&[3, 1, 1]).unwrap().shape(), &[3, 2, 3]);
    assert!(matches!(
        x.repeat(&[2]),
        Err(Error::Shape { op: "repeat", .. })
    ));
    gradcheck("flip", &[(vec![3, 4], values_in(12, -1.0, 1.0, 11))], |t| {
        t[0].flip(&[0, 1])
    });
    gradcheck(
        "repeat",
        &[(vec![2, 3], values_in(6, -1.0, 1.0, 12))],
        |t| t[0].repeat(&[2, 1, 3]),
    );
}

/// torch's `repeat` on the CPU: element `i` of the output reads the input at each
/// coordinate modulo the input's size along that dim.
fn repeat_reference(x: &[f32], shape: &[usize], repeats: &[usize]) -> Vec<f32> {
    let out: Vec<usize> = shape.iter().zip(repeats).map(|(s, r)| s * r).collect();
    let numel: usize = out.iter().product();
    (0..numel)
        .map(|mut i| {
            let mut at = 0;
            let mut stride = 1;
            for d in (0..out.len()).rev() {
                at += (i % out[d]) % shape[d] * stride;
                stride *= shape[d];
                i /= out[d];
            }
            x[at]
        })
        .collect()
}

#[test]
fn repeat_tiles_tensors_of_every_rank_up_to_six() {
    let dev = device();
    // A rank-4 image batch repeated along channels (it went past six dims inside), and a
    // rank-6 tensor repeated along three dims.
    for (shape, repeats) in [
        (vec![2, 3, 2, 2], vec![1, 2, 1, 1]),
        (vec![2, 3, 2, 2], vec![2, 1, 3, 2]),
        (vec![1, 2, 1, 2, 1, 2], vec![2, 1, 3, 1, 2, 1]),
    ] {
        let n: usize = shape.iter().product();
        let values = values_in(n, -1.0, 1.0, 13);
        let x = Tensor::from_vec(values.clone(), &shape, dev).unwrap();
        let got = x.repeat(&repeats).unwrap();
        let want_shape: Vec<usize> = shape.iter().zip(&repeats).map(|(s, r)| s * r).collect();
        assert_eq!(got.shape(), want_shape.as_slice());
        assert_eq!(
            got.to_vec().unwrap(),
            repeat_reference(&values, &shape, &repeats),
            "repeat {shape:?} by {repeats:?}"
        );
    }
    gradcheck(
        "repeat of a rank-4 tensor",
        &[(vec![1, 2, 2, 2], values_in(8, -1.0, 1.0, 14))],
        |t| t[0].repeat(&[2, 1, 1, 3]),
    );
}

#[test]
fn one_hot_and_index_add_scatter_by_index() {
    let dev = device();
    let labels = Tensor::from_vec_u32(vec![2, 0, 2], &[3], dev).unwrap();
    let hot = Tensor::one_hot(&labels, 4).unwrap();
    assert_eq!(hot.dtype(), DType::U32);
    assert_eq!(
        hot.to_vec_u32().unwrap(),
        vec![0, 0, 1, 0, 1, 0, 0, 0, 0, 0, 1, 0]
    );
    assert!(matches!(
        Tensor::one_hot(&labels, 2),
        Err(Error::Index { op: "one_hot", .. })
    ));

    let base = Tensor::zeros(&[4, 2], dev).unwrap();
    let src = Tensor::from_vec(vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0], &[3, 2], dev).unwrap();
    let out = base.index_add(0, &labels, &src).unwrap();
    assert_eq!(
        out.to_vec().unwrap(),
        vec![3.0, 4.0, 0.0, 0.0, 6.0, 8.0, 0.0, 0.0]
    );
    let cols = Tensor::from_vec_u32(vec![1, 1], &[2], dev).unwrap();
    let out = Tensor::zeros(&[3, 2], dev)
        .unwrap()
        .index_add(
            1,
            &cols,
            &src.t().unwrap().t().unwrap().narrow(1, 0, 2).unwrap(),
        )
        .unwrap();
    assert_eq!(out.to_vec().unwrap(), vec![0.0, 3.0, 0.0, 7.0, 0.0, 11.0]);
    assert!(matches!(
        base.index_add(0, &labels, &base),
        Err(Error::Shape {
            op: "index_add",
            ..
        })
    ));
    gradcheck(
        "index_add",
        &[
            (vec![4, 2], values_in(8, -1.0, 1.0, 13)),
            (vec![3, 2], values_in(6, -1.0, 1.0, 14)),
        ],
        |t| t[0].index_add(0, &labels, &t[1]),
    );
}

#[test]
fn eye_and_arange_f_build_as_torch() {
    let dev = device();
    assert_eq!(
        Tensor::eye(2, dev).unwrap().to_vec().unwrap(),
        vec![1.0, 0.0, 0.0, 1.0]
    );
    assert_eq!(Tensor::eye(0, dev).unwrap().shape(), &[0, 0]);
    let r = Tensor::arange_f(0.5, 2.0, 0.5, dev).unwrap();
    assert_eq!(r.to_vec().unwrap(), vec![0.5, 1.0, 1.5]);
    let down = Tensor::arange_f(1.0, 0.0, -0.3, dev).unwrap();
    assert_close(
        &down.to_vec().unwrap(),
        &[1.0, 0.7, 0.4, 0.1],
        1e-6,
        "arange_f down",
    );
    assert!(Tensor::arange_f(0.0, 1.0, 0.0, dev).is_err());
    assert!(Tensor::arange_f(0.0, 1.0, -1.0, dev).is_err());
}

#[test]
fn l1_smooth_l1_bce_and_nll_losses_match_the_host() {
    use wgrad::nn::loss;
    let dev = device();
    let (p, ps) = random_tensor(&[4, 5], 20);
    let (t, ts) = random_tensor(&[4, 5], 21);
    let pairs: Vec<(f64, f64)> = ps
        .iter()
        .zip(&ts)
        .map(|(&a, &b)| (a as f64, b as f64))
        .collect();
    let mean =
        |f: &dyn Fn(f64, f64) -> f64| pairs.iter().map(|&(a, b)| f(a, b)).sum::<f64>() / 20.0;
    let l1 = loss::l1(&p, &t).unwrap().item().unwrap();
    assert_close(&[l1], &[mean(&|a, b| (a - b).abs())], 1e-6, "l1");
    let huber = |a: f64, b: f64| {
        let d = (a - b).abs();
        if d < 0.5 {
            0.5 * d * d / 0.5
        } else {
            d - 0.25
        }
    };
    let got = loss::smooth_l1(&p, &t, 0.5).unwrap().item().unwrap();
    assert_close(&[got], &[mean(&huber)], 1e-6, "smooth_l1");
    let y = t.add_scalar(1.0).unwrap().mul_scalar(0.5).unwrap(); // targets in [0, 1]
    let logits = p.mul_scalar(30.0).unwrap(); // large logits stay finite
    let bce = |x: f64, t: f64| {
        let (x, y) = (30.0 * x, (t + 1.0) * 0.5);
        x.max(0.0) - x * y + (-x.abs()).exp().ln_1p()
    };
    let got = loss::binary_cross_entropy_with_logits(&logits, &y)
        .unwrap()
        .item()
        .unwrap();
    assert_close(
        &[got],
        &[mean(&bce)],
        1e-5,
        "binary_cross_entropy_with_logits",
    );
    let log_probs = p.log_softmax(1).unwrap();
    let targets = Tensor::from_vec_u32(vec![4, 0, 2, 2], &[4], dev).unwrap();
    let lp = log_probs.to_vec().unwrap();
    let want = -(lp[4] + lp[5] + lp[12] + lp[17]) as f64 / 4.0;
    assert_close(
        &[loss::nll(&log_probs, &targets).unwrap().item().unwrap()],
        &[want],
        1e-6,
        "nll",
    );
    // nll of a log_softmax is cross_entropy.
    let ce = loss::cross_entropy(&p, &targets).unwrap().item().unwrap();
    assert_close(&[ce], &[want], 1e-6, "nll vs cross_entropy");
    assert!(matches!(
        loss::l1(&p, &targets),
        Err(Error::Shape { op: "l1", .. })
    ));
    assert!(matches!(
        loss::nll(&p, &p),
        Err(Error::Shape { op: "nll", .. })
    ));
    assert!(loss::smooth_l1(&p, &t, -1.0).is_err());
}

#[test]
fn loss_grads_check() {
    use wgrad::nn::loss;
    let pair = || {
        vec![
            (vec![3, 4], values_in(12, -1.0, 1.0, 30)),
            (vec![3, 4], values_in(12, -1.0, 1.0, 31)),
        ]
    };
    gradcheck("l1", &pair(), |t| loss::l1(&t[0], &t[1]));
    gradcheck("smooth_l1", &pair(), |t| loss::smooth_l1(&t[0], &t[1], 0.7));
    gradcheck("bce_with_logits", &pair(), |t| {
        loss::binary_cross_entropy_with_logits(
            &t[0].mul_scalar(3.0)?,
            &t[1].add_scalar(1.0)?.mul_scalar(0.5)?,
        )
    });
    let targets = Tensor::from_vec_u32(vec![1, 3, 0], &[3], device()).unwrap();
    gradcheck("nll", &[(vec![3, 4], values_in(12, -1.0, 1.0, 32))], |t| {
        loss::nll(&t[0].log_softmax(1)?, &targets)
    });
}

/// torch's adaptive average pooling of one `[h, w]` image on the host.
fn adaptive_ref(x: &[f32], h: usize, w: usize, oh: usize, ow: usize) -> Vec<f64> {
    let mut out = Vec::new();
    for i in 0..oh {
        let (r0, r1) = (i * h / oh, ((i + 1) * h).div_ceil(oh));
        for j in 0..ow {
            let (c0, c1) = (j * w / ow, ((j + 1) * w).div_ceil(ow));
            let mut sum = 0.0;
            for r in r0..r1 {
                for c in c0..c1 {
                    sum += x[r * w + c] as f64;
                }
            }
            out.push(sum / ((r1 - r0) * (c1 - c0)) as f64);
        }
    }
    out
}

#[test]
fn adaptive_avg_pool2d_uses_torchs_bins() {
    let (x, xs) = random_tensor(&[2, 3, 7, 5], 40);
    for (oh, ow) in [(1, 1), (3, 2), (7, 5), (4, 4)] {
        let got = x.adaptive_avg_pool2d((oh, ow)).unwrap();
        assert_eq!(got.shape(), &[2, 3, oh, ow]);
        let want: Vec<f64> = xs
            .chunks(35)
            .flat_map(|image| adaptive_ref(image, 7, 5, oh, ow))
            .collect();
        assert_close(
            &got.to_vec().unwrap(),
            &want,
            1e-6,
            &format!("adaptive ({oh}, {ow})"),
        );
    }
    gradcheck(
        "adaptive_avg_pool2d",
        &[(vec![1, 2, 5, 3], values_in(30, -1.0, 1.0, 41))],
        |t| t[0].adaptive_avg_pool2d((2, 2)),
    );
    assert!(matches!(
        x.adaptive_avg_pool2d((0, 1)),
        Err(Error::Shape {
            op: "adaptive_avg_pool2d",
            ..
        })
    ));
    assert!(x
        .reshape(&[6, 35])
        .unwrap()
        .adaptive_avg_pool2d((1, 1))
        .is_err());
}

/// torch's source position and weights along one axis for output `i` of `out` from `size`:
/// `(lo, hi, weight of hi)`, in f64.
fn torch_axis(mode: Interpolate, i: usize, out: usize, size: usize) -> (usize, usize, f64) {
    let scale = size as f64 / out as f64;
    match mode {
        Interpolate::Nearest => {
            let src = ((i as f64 * scale).floor() as usize).min(size - 1);
            (src, src, 0.0)
        }
        Interpolate::Bilinear => {
            let src = ((i as f64 + 0.5) * scale - 0.5).max(0.0);
            let lo = (src.floor() as usize).min(size - 1);
            (lo, (lo + 1).min(size - 1), src - lo as f64)
        }
    }
}

/// torch's `interpolate` of one `[h, w]` image to `[oh, ow]` on the host, pixel by pixel.
fn interpolate_ref(
    x: &[f32],
    (h, w): (usize, usize),
    (oh, ow): (usize, usize),
    mode: Interpolate,
) -> Vec<f64> {
    let at = |r: usize, c: usize| x[r * w + c] as f64;
    let mut out = Vec::new();
    for i in 0..oh {
        let (r0, r1, tr) = torch_axis(mode, i, oh, h);
        for j in 0..ow {
            let (c0, c1, tc) = torch_axis(mode, j, ow, w);
            let top = at(r0, c0) * (1.0 - tc) + at(r0, c1) * tc;
            let bottom = at(r1, c0) * (1.0 - tc) + at(r1, c1) * tc;
            out.push(top * (1.0 - tr) + bottom * tr);
        }
    }
    out
}

#[test]
fn interpolate_matches_torchs_pixel_rule_up_and_down() {
    let (x, xs) = random_tensor(&[2, 3, 7, 5], 42);
    for mode in [Interpolate::Nearest, Interpolate::Bilinear] {
        for (oh, ow) in [(14, 10), (3, 2), (7, 5), (9, 13), (1, 1)] {
            let got = x.interpolate((oh, ow), mode).unwrap();
            assert_eq!(got.shape(), &[2, 3, oh, ow]);
            let want: Vec<f64> = xs
                .chunks(35)
                .flat_map(|image| interpolate_ref(image, (7, 5), (oh, ow), mode))
                .collect();
            let what = format!("{mode:?} to ({oh}, {ow})");
            assert_close(&got.to_vec().unwrap(), &want, 1e-5, &what);
        }
    }
}

/// torch.nn.functional.interpolate(torch.tensor([[[[1., 2.], [3., 4.]]]]), size=(4, 4),
/// mode="bilinear", align_corners=False)[0, 0, 0] is [1.0, 1.25, 1.75, 2.0].
#[test]
fn bilinear_upsampling_gives_torchs_values() {
    let x = Tensor::from_vec(vec![1.0, 2.0, 3.0, 4.0], &[1, 1, 2, 2], device()).unwrap();
    let up = x
        .interpolate((4, 4), Interpolate::Bilinear)
        .unwrap()
        .to_vec()
        .unwrap();
    assert_eq!(&up[..4], &[1.0, 1.25, 1.75, 2.0]);
    assert_eq!(&up[4..8], &[1.5, 1.75, 2.25, 2.5]);
}

#[test]
fn interpolate_gradcheck_both_modes_and_a_view() {
    for mode in [Interpolate::Nearest, Interpolate::Bilinear] {
        for n in [1, 3] {
            gradcheck(
                &format!("interpolate {mode:?} batch {n}"),
                &[(vec![n, 2, 3, 4], values_in(n * 24, -1.0, 1.0, 43))],
                |t| t[0].interpolate((5, 7), mode),
            );
        }
        // A transposed (non-contiguous) image.
        gradcheck(
            &format!("interpolate {mode:?} of a view"),
            &[(vec![1, 1, 4, 3], values_in(12, -1.0, 1.0, 44))],
            |t| t[0].transpose(2, 3)?.interpolate((2, 6), mode),
        );
    }
}

#[test]
fn interpolate_rejects_zero_sizes_and_other_ranks() {
    let (x, _) = random_tensor(&[1, 2, 3, 3], 45);
    for size in [(0, 4), (4, 0)] {
        let e = x.interpolate(size, Interpolate::Bilinear).unwrap_err();
        assert!(
            matches!(
                e,
                Error::Shape {
                    op: "interpolate",
                    ..
                }
            ),
            "{e}"
        );
        assert!(e.to_string().contains("[1, 2, 3, 3]"), "{e}");
    }
    let flat = x.reshape(&[2, 9]).unwrap();
    assert!(flat.interpolate((2, 2), Interpolate::Nearest).is_err());
    assert!(nn::Upsample::new(2, Interpolate::Nearest)
        .forward(&flat)
        .is_err());
}

#[test]
fn upsample_scales_by_its_factor_or_to_its_size() {
    let (x, _) = random_tensor(&[2, 3, 4, 5], 46);
    let up = nn::Upsample::new(2, Interpolate::Bilinear)
        .forward(&x)
        .unwrap();
    let want = x.interpolate((8, 10), Interpolate::Bilinear).unwrap();
    assert_eq!(up.to_vec().unwrap(), want.to_vec().unwrap());
    let sized = nn::Upsample::to_size((3, 3), Interpolate::Nearest)
        .forward(&x)
        .unwrap();
    assert_eq!(sized.shape(), &[2, 3, 3, 3]);
    assert!(nn::Upsample::new(2, Interpolate::Nearest)
        .parameters()
        .is_empty());
}
