//! Unary, scalar and broadcasting binary ops against CPU f64 references.

mod common;
use common::*;
use wgrad::{DType, Error, Tensor};

// The acceptance sizes of the foundation issue, plus 70004: four-wide reads over several workgroups with a partial last one.
const SIZES: [usize; 10] = [0, 1, 7, 255, 256, 257, 1023, 4097, 70001, 70004];

type UnaryCase = (
    &'static str,
    fn(&Tensor) -> wgrad::Result<Tensor>,
    fn(f64) -> f64,
    f64,
);

fn unary_cases() -> Vec<UnaryCase> {
    vec![
        ("neg", Tensor::neg, |x| -x, 0.0),
        ("exp", Tensor::exp, f64::exp, 1e-6),
        (
            "log",
            |t| t.add_scalar(1.5)?.log(),
            |x| (x + 1.5).ln(),
            1e-6,
        ),
        ("relu", Tensor::relu, |x| x.max(0.0), 0.0),
        ("tanh", Tensor::tanh, f64::tanh, 1e-6),
        (
            "sigmoid",
            Tensor::sigmoid,
            |x| 1.0 / (1.0 + (-x).exp()),
            1e-6,
        ),
        ("gelu", Tensor::gelu, gelu_ref, 1e-6),
        (
            "gelu_tanh",
            Tensor::gelu_tanh,
            |x| {
                0.5 * x
                    * (1.0
                        + ((2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x.powi(3))).tanh())
            },
            1e-6,
        ),
        (
            "sqrt",
            |t| t.add_scalar(1.0)?.sqrt(),
            |x| (x + 1.0).sqrt(),
            1e-6,
        ),
        ("powf", |t| t.powf(3.0), |x| x.powi(3), 1e-6),
        ("add_scalar", |t| t.add_scalar(0.25), |x| x + 0.25, 1e-7),
        ("sub_scalar", |t| t.sub_scalar(0.25), |x| x - 0.25, 1e-7),
        ("mul_scalar", |t| t.mul_scalar(-3.0), |x| x * -3.0, 1e-7),
        ("div_scalar", |t| t.div_scalar(3.0), |x| x / 3.0, 1e-7),
        ("abs", Tensor::abs, f64::abs, 0.0),
        (
            "sign",
            Tensor::sign,
            |x| if x == 0.0 { 0.0 } else { x.signum() },
            0.0,
        ),
        ("erf", Tensor::erf, erf, 1e-6),
        ("clamp", |t| t.clamp(-0.3, 0.5), |x| x.clamp(-0.3, 0.5), 0.0),
        (
            "sin",
            |t| t.mul_scalar(4.0)?.sin(),
            |x| (4.0 * x).sin(),
            1e-6,
        ),
        (
            "cos",
            |t| t.mul_scalar(4.0)?.cos(),
            |x| (4.0 * x).cos(),
            1e-6,
        ),
        (
            "rsqrt",
            |t| t.add_scalar(1.5)?.rsqrt(),
            |x| 1.0 / (x + 1.5).sqrt(),
            1e-6,
        ),
        (
            "silu",
            |t| t.mul_scalar(8.0)?.silu(),
            |x| 8.0 * x / (1.0 + (-8.0 * x).exp()),
            1e-6,
        ),
        (
            "softplus",
            |t| t.mul_scalar(30.0)?.softplus(),
            |x| {
                let x = 30.0 * x;
                if x > 20.0 {
                    x
                } else {
                    x.exp().ln_1p()
                }
            },
            1e-6,
        ),
        (
            "leaky_relu",
            |t| t.leaky_relu(0.1),
            |x| if x > 0.0 { x } else { 0.1 * x },
            1e-7,
        ),
    ]
}

#[test]
fn unary_ops_match_cpu_reference_at_every_size() {
    for (name, op, reference, tol) in unary_cases() {
        for (i, &n) in SIZES.iter().enumerate() {
            let (t, data) = random_tensor(&[n], i as u64);
            let want: Vec<f64> = data.iter().map(|&x| reference(x as f64)).collect();
            let got = op(&t).unwrap();
            assert_eq!(got.shape(), &[n]);
            assert_close(
                &got.to_vec().unwrap(),
                &want,
                tol.max(1e-6) * 2.0,
                &format!("{name} n={n}"),
            );
        }
    }
}

#[test]
fn unary_ops_work_at_ranks_zero_to_four() {
    for shape in [vec![], vec![5], vec![3, 4], vec![2, 3, 5], vec![2, 1, 3, 4]] {
        let (t, data) = random_tensor(&shape, 9);
        let got = t.exp().unwrap();
        assert_eq!(got.shape(), shape.as_slice());
        let want: Vec<f64> = data.iter().map(|&x| (x as f64).exp()).collect();
        assert_close(
            &got.to_vec().unwrap(),
            &want,
            2e-6,
            &format!("exp {shape:?}"),
        );
    }
}

#[test]
fn unary_op_reads_a_transposed_view() {
    let (t, data) = random_tensor(&[7, 13], 3);
    let got = t.t().unwrap().tanh().unwrap();
    assert_eq!(got.shape(), &[13, 7]);
    let mut want = vec![0.0; 91];
    for i in 0..7 {
        for j in 0..13 {
            want[j * 7 + i] = (data[i * 13 + j] as f64).tanh();
        }
    }
    assert_close(&got.to_vec().unwrap(), &want, 2e-6, "tanh of transpose");
}

#[test]
fn unary_op_reads_an_expanded_view_and_its_grad_sums_over_the_expansion() {
    // A [3, 1] column expanded to [3, 5] (stride 0 along the 5), then exp: each row repeats
    // its element, and the grad of the column sums its row's grads.
    let (col, data) = random_tensor(&[3, 1], 4);
    let col = col.requires_grad_(true);
    let y = col.expand(&[3, 5]).unwrap().exp().unwrap();
    let want: Vec<f64> = (0..15).map(|i| (data[i / 5] as f64).exp()).collect();
    assert_close(
        &y.to_vec().unwrap(),
        &want,
        2e-6,
        "exp of an expanded column",
    );
    y.sum().unwrap().backward().unwrap();
    let grad: Vec<f64> = data.iter().map(|&x| 5.0 * (x as f64).exp()).collect();
    assert_close(
        &col.grad().unwrap().to_vec().unwrap(),
        &grad,
        2e-6,
        "grad through the expansion",
    );
}

#[test]
fn unary_op_reads_a_transposed_16_bit_view_in_its_dtype() {
    let (t, data) = random_tensor(&[5, 9], 5);
    let half = t.to_dtype(DType::F16).unwrap();
    let got = half.t().unwrap().neg().unwrap();
    assert_eq!((got.shape(), got.dtype()), (&[9usize, 5][..], DType::F16));
    let mut want = vec![0.0; 45];
    for i in 0..5 {
        for j in 0..9 {
            want[j * 5 + i] = -(half::f16::from_f32(data[i * 9 + j]).to_f32() as f64);
        }
    }
    assert_close(
        &got.to_vec().unwrap(),
        &want,
        0.0,
        "neg of a transposed F16 view",
    );
}

#[test]
fn powf_handles_negative_bases_and_zero_exponent() {
    let t = Tensor::from_vec(vec![-2.0, 0.0, 3.0], &[3], device()).unwrap();
    assert_eq!(t.powf(2.0).unwrap().to_vec().unwrap(), vec![4.0, 0.0, 9.0]);
    assert_eq!(
        t.powf(3.0).unwrap().to_vec().unwrap(),
        vec![-8.0, 0.0, 27.0]
    );
    assert_eq!(t.powf(0.0).unwrap().to_vec().unwrap(), vec![1.0, 1.0, 1.0]);
    assert!(t.powf(0.5).unwrap().to_vec().unwrap()[0].is_nan());
}

/// torch computes x^2, x^3, x^-1, x^-2, x^0.5 and x^-0.5 with products, a reciprocal and
/// square roots: correctly rounded, bit for bit the f32 arithmetic on the host.
#[test]
fn powers_torch_takes_without_pow_are_correctly_rounded() {
    let values = vec![-100.0f32, -7.3, -1.5, 0.3, 1.7, 3.3, 88.8, 100.0, 12345.678];
    let x = Tensor::from_vec(values.clone(), &[values.len()], device()).unwrap();
    type Host = fn(f32) -> f32;
    let cases: [(f32, Host); 7] = [
        (1.0, |v| v),
        (2.0, |v| v * v),
        (3.0, |v| v * v * v),
        (-1.0, |v| 1.0 / v),
        (-2.0, |v| 1.0 / (v * v)),
        (0.5, f32::sqrt),
        (-0.5, |v| 1.0 / v.sqrt()),
    ];
    for (p, host) in cases {
        let got = x.powf(p).unwrap().to_vec().unwrap();
        let want: Vec<f32> = values.iter().map(|&v| host(v)).collect();
        for (g, w) in got.iter().zip(&want) {
            assert!(
                g.to_bits() == w.to_bits() || (g.is_nan() && w.is_nan()),
                "x^{p}: {got:?} vs {want:?}"
            );
        }
    }
}

#[test]
fn sign_of_nan_is_nan_as_torch() {
    let x = Tensor::from_vec(vec![f32::NAN, -2.0, 0.0, 3.0], &[4], device()).unwrap();
    let got = x.sign().unwrap().to_vec().unwrap();
    assert!(got[0].is_nan(), "{got:?}");
    assert_eq!(&got[1..], &[-1.0, 0.0, 1.0]);
}

#[test]
fn sigmoid_and_tanh_stay_finite_for_large_inputs() {
    let t = Tensor::from_vec(vec![-1000.0, -90.0, 90.0, 1000.0], &[4], device()).unwrap();
    assert_eq!(
        t.sigmoid().unwrap().to_vec().unwrap(),
        vec![0.0, 0.0, 1.0, 1.0]
    );
    assert_eq!(
        t.tanh().unwrap().to_vec().unwrap(),
        vec![-1.0, -1.0, 1.0, 1.0]
    );
}

type BinaryCase = (
    &'static str,
    fn(&Tensor, &Tensor) -> wgrad::Result<Tensor>,
    fn(f64, f64) -> f64,
);

fn binary_cases() -> Vec<BinaryCase> {
    vec![
        ("add", Tensor::add, |a, b| a + b),
        ("sub", Tensor::sub, |a, b| a - b),
        ("mul", Tensor::mul, |a, b| a * b),
        (
            "div",
            |a, b| a.div(&b.add_scalar(3.0)?),
            |a, b| a / (b + 3.0),
        ),
        ("maximum", Tensor::maximum, f64::max),
        ("minimum", Tensor::minimum, f64::min),
    ]
}

/// The reference of `a op b` under NumPy broadcasting.
fn broadcast_ref(
    a: &[f32],
    sa: &[usize],
    b: &[f32],
    sb: &[usize],
    f: fn(f64, f64) -> f64,
) -> (Vec<usize>, Vec<f64>) {
    let rank = sa.len().max(sb.len());
    let pad = |s: &[usize]| [vec![1; rank - s.len()], s.to_vec()].concat();
    let (pa, pb) = (pad(sa), pad(sb));
    let shape: Vec<usize> = pa
        .iter()
        .zip(&pb)
        .map(|(&x, &y)| if x == 1 { y } else { x })
        .collect();
    let n: usize = shape.iter().product();
    let (ta, tb) = (strides(&pa), strides(&pb));
    let out = (0..n)
        .map(|i| {
            let idx = unravel(i, &shape);
            let ia: usize = idx
                .iter()
                .enumerate()
                .map(|(d, &x)| if pa[d] == 1 { 0 } else { x * ta[d] })
                .sum();
            let ib: usize = idx
                .iter()
                .enumerate()
                .map(|(d, &x)| if pb[d] == 1 { 0 } else { x * tb[d] })
                .sum();
            f(a[ia] as f64, b[ib] as f64)
        })
        .collect();
    (shape, out)
}

#[test]
fn binary_ops_match_cpu_reference_at_every_size() {
    for (name, op, f) in binary_cases() {
        for (i, &n) in SIZES.iter().enumerate() {
            let (a, da) = random_tensor(&[n], 100 + i as u64);
            let (b, db) = random_tensor(&[n], 200 + i as u64);
            let f = if name == "div" {
                |a: f64, b: f64| a / (b + 3.0)
            } else {
                f
            };
            let (_, want) = broadcast_ref(&da, &[n], &db, &[n], f);
            assert_close(
                &op(&a, &b).unwrap().to_vec().unwrap(),
                &want,
                2e-7,
                &format!("{name} n={n}"),
            );
        }
    }
}

#[test]
fn binary_ops_broadcast_like_numpy() {
    let pairs: [(&[usize], &[usize]); 7] = [
        (&[3, 4], &[4]),
        (&[3, 1], &[1, 5]),
        (&[2, 3, 4], &[3, 1]),
        (&[], &[2, 3]),
        (&[4, 1, 3, 1], &[2, 1, 5]),
        (&[257, 33], &[257, 1]),
        (&[0, 3], &[1, 3]),
    ];
    for (k, (sa, sb)) in pairs.iter().enumerate() {
        for (name, op, f) in binary_cases() {
            let (a, da) = random_tensor(sa, k as u64);
            let (b, db) = random_tensor(sb, 50 + k as u64);
            let f = if name == "div" {
                |a: f64, b: f64| a / (b + 3.0)
            } else {
                f
            };
            let (shape, want) = broadcast_ref(&da, sa, &db, sb, f);
            let got = op(&a, &b).unwrap();
            assert_eq!(got.shape(), shape.as_slice(), "{name} {sa:?} {sb:?}");
            assert_close(
                &got.to_vec().unwrap(),
                &want,
                2e-7,
                &format!("{name} {sa:?} {sb:?}"),
            );
        }
    }
}

#[test]
fn binary_op_reads_transposed_and_narrowed_views() {
    let (a, da) = random_tensor(&[5, 9], 1);
    let (b, db) = random_tensor(&[9, 5], 2);
    let got = a
        .add(&b.t().unwrap())
        .unwrap()
        .narrow(1, 2, 4)
        .unwrap()
        .mul(&a.narrow(1, 0, 4).unwrap())
        .unwrap();
    let mut want = Vec::new();
    for i in 0..5 {
        for j in 0..4 {
            let s = da[i * 9 + j + 2] as f64 + db[(j + 2) * 5 + i] as f64;
            want.push(s * da[i * 9 + j] as f64);
        }
    }
    assert_close(&got.to_vec().unwrap(), &want, 1e-6, "views");
}

#[test]
fn std_ops_traits_on_references_return_results() {
    let a = Tensor::from_vec(vec![1.0, 2.0], &[2], device()).unwrap();
    let b = Tensor::from_vec(vec![4.0, 8.0], &[2], device()).unwrap();
    assert_eq!((&a + &b).unwrap().to_vec().unwrap(), vec![5.0, 10.0]);
    assert_eq!((&a - &b).unwrap().to_vec().unwrap(), vec![-3.0, -6.0]);
    assert_eq!((&a * &b).unwrap().to_vec().unwrap(), vec![4.0, 16.0]);
    assert_eq!((&b / &a).unwrap().to_vec().unwrap(), vec![4.0, 4.0]);
    assert_eq!((-&a).unwrap().to_vec().unwrap(), vec![-1.0, -2.0]);
}

#[test]
fn binary_op_on_shapes_that_do_not_broadcast_names_op_and_shapes() {
    let a = Tensor::zeros(&[3, 4], device()).unwrap();
    let b = Tensor::zeros(&[5], device()).unwrap();
    let err = a.add(&b).unwrap_err();
    assert!(matches!(err, Error::Shape { op: "add", .. }), "{err:?}");
    let msg = err.to_string();
    assert!(
        msg.contains("add") && msg.contains("[3, 4]") && msg.contains("[5]"),
        "{msg}"
    );
}

#[test]
fn elementwise_op_on_u32_tensor_is_a_dtype_error() {
    let labels = Tensor::from_labels(vec![1, 2], device()).unwrap();
    let err = labels.exp().unwrap_err();
    assert!(matches!(err, Error::DType { op: "exp", .. }), "{err:?}");
    let x = Tensor::zeros(&[2], device()).unwrap();
    assert!(matches!(
        x.mul(&labels).unwrap_err(),
        Error::DType { op: "mul", .. }
    ));
}

#[test]
fn binary_ops_on_contiguous_slices_at_any_offset() {
    let (a, da) = random_tensor(&[64], 1);
    let (b, db) = random_tensor(&[64], 2);
    for (start, len) in [(4, 16), (3, 16), (8, 13), (0, 64)] {
        let got = a
            .narrow(0, start, len)
            .unwrap()
            .sub(&b.narrow(0, 64 - len, len).unwrap())
            .unwrap();
        let want: Vec<f64> = (0..len)
            .map(|i| da[start + i] as f64 - db[64 - len + i] as f64)
            .collect();
        assert_close(
            &got.to_vec().unwrap(),
            &want,
            1e-7,
            &format!("slice {start}+{len}"),
        );
    }
}

#[test]
fn unary_ops_on_contiguous_slices_at_any_offset() {
    let (a, da) = random_tensor(&[64], 3);
    for (start, len) in [(4, 16), (3, 16), (8, 13), (0, 64)] {
        let got = a.narrow(0, start, len).unwrap().exp().unwrap();
        let want: Vec<f64> = (0..len).map(|i| (da[start + i] as f64).exp()).collect();
        assert_close(
            &got.to_vec().unwrap(),
            &want,
            2e-6,
            &format!("slice {start}+{len}"),
        );
    }
}

#[test]
fn a_row_broadcast_on_either_side_at_any_offset_matches_reference() {
    let (x, dx) = random_tensor(&[3, 8], 5);
    let (bias, db) = random_tensor(&[12], 6);
    for start in [0, 1, 4] {
        let b = bias.narrow(0, start, 8).unwrap();
        let got = x.add(&b).unwrap().to_vec().unwrap();
        let want: Vec<f64> = (0..24)
            .map(|i| dx[i] as f64 + db[start + i % 8] as f64)
            .collect();
        assert_close(&got, &want, 1e-7, &format!("x + bias[{start}..]"));
        let got = b.sub(&x).unwrap().to_vec().unwrap();
        let want: Vec<f64> = (0..24)
            .map(|i| db[start + i % 8] as f64 - dx[i] as f64)
            .collect();
        assert_close(&got, &want, 1e-7, &format!("bias[{start}..] - x"));
    }
}

/// A channel bias `[C, 1, 1]` over `[N, C, H, W]` (each bias element held for H W outputs),
/// at any offset and on either side, with H W a multiple of 4 (four outputs per load) and not.
#[test]
fn a_channel_bias_on_either_side_at_any_offset_matches_reference() {
    let (bias, db) = random_tensor(&[9], 7);
    for (hw, side) in [(16, 4), (9, 3)] {
        let (x, dx) = random_tensor(&[2, 5, side, side], 8);
        for start in [0, 1, 4] {
            let b = bias
                .narrow(0, start, 5)
                .unwrap()
                .reshape(&[5, 1, 1])
                .unwrap();
            let bias_of = |i: usize| db[start + (i / hw) % 5] as f64;
            let got = x.add(&b).unwrap().to_vec().unwrap();
            let want: Vec<f64> = (0..10 * hw).map(|i| dx[i] as f64 + bias_of(i)).collect();
            assert_close(&got, &want, 1e-7, &format!("x + bias[{start}..] over {hw}"));
            let got = b.sub(&x).unwrap().to_vec().unwrap();
            let want: Vec<f64> = (0..10 * hw).map(|i| bias_of(i) - dx[i] as f64).collect();
            assert_close(&got, &want, 1e-7, &format!("bias[{start}..] - x over {hw}"));
        }
    }
}

#[test]
fn clamp_keeps_nan_and_rejects_crossed_bounds() {
    let dev = device();
    let x = Tensor::from_vec(vec![f32::NAN, -2.0, 2.0], &[3], dev).unwrap();
    let y = x.clamp(-1.0, 1.0).unwrap().to_vec().unwrap();
    assert!(y[0].is_nan());
    assert_eq!(&y[1..], &[-1.0, 1.0]);
    let err = x.clamp(1.0, -1.0).unwrap_err().to_string();
    assert!(err.contains("clamp") && err.contains("min 1"), "{err}");
}

#[test]
fn pow_with_a_tensor_exponent_matches_reference_and_broadcasts() {
    for &n in &[1usize, 7, 4097, 70001] {
        let (a, da) = random_tensor(&[n], 300);
        let (b, db) = random_tensor(&[n], 301);
        let got = a
            .add_scalar(1.5)
            .unwrap()
            .pow(&b.mul_scalar(2.0).unwrap())
            .unwrap();
        let want: Vec<f64> = da
            .iter()
            .zip(&db)
            .map(|(&a, &b)| (a as f64 + 1.5).powf(2.0 * b as f64))
            .collect();
        assert_close(&got.to_vec().unwrap(), &want, 2e-6, &format!("pow n={n}"));
    }
    // Negative bases with integral exponents, 0^0, and an exponent row broadcast over rows.
    let a = Tensor::from_vec(vec![-2.0, 0.0, 3.0, -1.5, 0.0, 2.0], &[2, 3], device()).unwrap();
    let e = Tensor::from_vec(vec![3.0, 0.0, 0.5], &[3], device()).unwrap();
    let got = a.pow(&e).unwrap().to_vec().unwrap();
    let want = [-8.0, 1.0, 3f64.sqrt(), -3.375, 1.0, 2f64.sqrt()];
    assert_close(&got, &want, 1e-6, "pow broadcast");
}

/// torch's special cases: the base's grad is 0 where the exponent is 0 (at 0^0 too, not
/// 0 * inf), the exponent's 0 where the base is 0 and the exponent >= 0 (inf * log 0 = -inf
/// below), NaN for the log of a negative base.
#[test]
fn pow_grads_at_zero_follow_torch() {
    let a = Tensor::from_vec(vec![0.0, 0.0, 2.0, -2.0, 0.0], &[5], device())
        .unwrap()
        .requires_grad_(true);
    let b = Tensor::from_vec(vec![2.0, 0.0, 0.5, 2.0, -1.0], &[5], device())
        .unwrap()
        .requires_grad_(true);
    a.pow(&b).unwrap().sum().unwrap().backward().unwrap();
    let da = a.grad().unwrap().to_vec().unwrap();
    let db = b.grad().unwrap().to_vec().unwrap();
    let want_da = [0.0, 0.0, 0.5 / 2f64.sqrt(), -4.0, f64::NEG_INFINITY];
    let want_db = [
        0.0,
        0.0,
        2f64.sqrt() * 2f64.ln(),
        f64::NAN,
        f64::NEG_INFINITY,
    ];
    assert_close(&da, &want_da, 1e-6, "pow: base grad");
    assert_close(&db, &want_db, 1e-6, "pow: exponent grad");
}

/// A comparison's name, the op, and its host reference.
type CompareCase<Op> = (&'static str, Op, fn(f32, f32) -> bool);
type Compare = fn(&Tensor, &Tensor) -> wgrad::Result<Tensor>;
type CompareScalar = fn(&Tensor, f32) -> wgrad::Result<Tensor>;

#[test]
fn comparisons_give_u32_masks_that_broadcast() {
    let a = Tensor::from_vec(vec![1.0, 2.0, 3.0, f32::NAN, 2.0, -1.0], &[2, 3], device()).unwrap();
    let b = Tensor::from_vec(vec![2.0, 2.0, 2.0], &[3], device()).unwrap();
    let cases: [CompareCase<Compare>; 6] = [
        ("eq", Tensor::eq, |a, b| a == b),
        ("ne", Tensor::ne, |a, b| a != b),
        ("lt", Tensor::lt, |a, b| a < b),
        ("le", Tensor::le, |a, b| a <= b),
        ("gt", Tensor::gt, |a, b| a > b),
        ("ge", Tensor::ge, |a, b| a >= b),
    ];
    let av = a.to_vec().unwrap();
    for (name, op, reference) in cases {
        let mask = op(&a, &b).unwrap();
        assert_eq!(mask.dtype(), wgrad::DType::U32, "{name}");
        assert_eq!(mask.shape(), &[2, 3], "{name}");
        let want: Vec<u32> = av.iter().map(|&x| reference(x, 2.0) as u32).collect();
        assert_eq!(mask.to_vec_u32().unwrap(), want, "{name}");
    }
}

/// The six comparisons with a scalar and their host references.
fn scalar_comparisons() -> [CompareCase<CompareScalar>; 6] {
    [
        ("eq_scalar", Tensor::eq_scalar, |a, b| a == b),
        ("ne_scalar", Tensor::ne_scalar, |a, b| a != b),
        ("lt_scalar", Tensor::lt_scalar, |a, b| a < b),
        ("le_scalar", Tensor::le_scalar, |a, b| a <= b),
        ("gt_scalar", Tensor::gt_scalar, |a, b| a > b),
        ("ge_scalar", Tensor::ge_scalar, |a, b| a >= b),
    ]
}

#[test]
fn scalar_comparisons_match_the_tensor_forms() {
    let (x, data) = random_tensor(&[70001], 310);
    let cases = scalar_comparisons();
    let s = data[17];
    for (name, op, reference) in cases {
        let want: Vec<u32> = data.iter().map(|&x| reference(x, s) as u32).collect();
        assert_eq!(op(&x, s).unwrap().to_vec_u32().unwrap(), want, "{name}");
    }
}

#[test]
fn scalar_comparisons_of_u32_token_ids_are_exact_and_refuse_values_past_2_pow_24() {
    let dev = device();
    // Ids up to 2^24 - 1, a marker past them (IGNORE_INDEX), the pad 0.
    let ids: Vec<u32> = vec![0, 7, (1 << 24) - 1, u32::MAX, 0, 1 << 23];
    let tokens = Tensor::from_vec_u32(ids.clone(), &[2, 3], dev).unwrap();
    let cases = scalar_comparisons();
    for s in [0.0, 7.0, ((1 << 24) - 1) as f32, (1 << 23) as f32] {
        for (name, op, reference) in cases {
            let want: Vec<u32> = ids
                .iter()
                .map(|&v| reference(v as f64 as f32, s) as u32)
                .collect();
            let mask = op(&tokens, s).unwrap();
            assert_eq!(mask.to_vec_u32().unwrap(), want, "{name} {s}");
        }
    }
    // A mask of real tokens, as transformers' `input_ids != pad`.
    let mask = tokens.ne_scalar(0.0).unwrap();
    assert_eq!(mask.to_vec_u32().unwrap(), vec![0, 1, 1, 1, 0, 1]);
    // Values past 2^24 other than the largest, or of unknown range, do not compare exactly.
    let wide = Tensor::from_vec_u32(vec![1 << 25, 3, u32::MAX], &[3], dev).unwrap();
    let err = wide.eq_scalar(3.0).unwrap_err();
    assert!(err.to_string().contains("exact below 2^24"), "{err}");
    let unknown = Tensor::ones(&[2], dev)
        .unwrap()
        .to_dtype(DType::U32)
        .unwrap();
    let err = unknown.ne_scalar(0.0).unwrap_err();
    assert!(err.to_string().contains("unknown range"), "{err}");
}

#[test]
fn where_cond_picks_by_mask_and_keeps_nan_out_of_the_branch_not_taken() {
    let dev = device();
    let mask = Tensor::from_vec_u32(vec![1, 0, 1], &[3], dev).unwrap();
    let a = Tensor::from_vec(
        vec![1.0, f32::NAN, f32::INFINITY, 4.0, f32::NAN, 6.0],
        &[2, 3],
        dev,
    )
    .unwrap()
    .requires_grad_(true);
    let b = Tensor::from_vec(vec![f32::NAN], &[1], dev)
        .unwrap()
        .requires_grad_(true);
    let y = mask.where_cond(&a, &b).unwrap();
    let got = y.to_vec().unwrap();
    assert_eq!(got[0], 1.0);
    assert!(got[1].is_nan(), "b's NaN where the mask is 0");
    assert_eq!(got[2], f32::INFINITY);
    assert_eq!(got[3], 4.0);
    assert!(got[4].is_nan());
    assert_eq!(got[5], 6.0);
    y.sum().unwrap().backward().unwrap();
    assert_eq!(
        a.grad().unwrap().to_vec().unwrap(),
        vec![1.0, 0.0, 1.0, 1.0, 0.0, 1.0]
    );
    // b was broadcast to both rows' middle element: its grad sums them.
    assert_eq!(b.grad().unwrap().to_vec().unwrap(), vec![2.0]);
}

#[test]
fn where_cond_with_shapes_that_do_not_broadcast_names_op_and_shapes() {
    let dev = device();
    let mask = Tensor::from_vec_u32(vec![1, 0, 1], &[3], dev).unwrap();
    let err = mask
        .where_cond(
            &Tensor::zeros(&[2], dev).unwrap(),
            &Tensor::zeros(&[3], dev).unwrap(),
        )
        .unwrap_err();
    let msg = err.to_string();
    assert!(
        msg.contains("where_cond") && msg.contains("[3]") && msg.contains("[2]"),
        "{msg}"
    );
    let f32_mask = Tensor::zeros(&[3], dev).unwrap();
    assert!(matches!(
        f32_mask.where_cond(&f32_mask, &f32_mask),
        Err(Error::DType { .. })
    ));
}

#[test]
fn to_dtype_casts_f32_and_u32_both_ways() {
    let dev = device();
    let x = Tensor::from_vec(vec![2.9, -0.5, -3.7, 0.0, 7.0, f32::NAN, 1e10], &[7], dev).unwrap();
    let u = x.to_dtype(wgrad::DType::U32).unwrap();
    assert_eq!(u.dtype(), wgrad::DType::U32);
    // Toward zero; negatives and NaN to 0, past u32::MAX to the largest f32 below it.
    assert_eq!(
        u.to_vec_u32().unwrap(),
        vec![2, 0, 0, 0, 7, 0, 4_294_967_040]
    );
    let labels = Tensor::from_vec_u32(vec![0, 3, 16_777_217, 5], &[4], dev).unwrap();
    let f = labels.to_dtype(wgrad::DType::F32).unwrap();
    assert_eq!(f.to_vec().unwrap(), vec![0.0, 3.0, 16_777_216.0, 5.0]);
    // The same dtype is the tensor itself.
    assert!(Tensor::same(&x.to_dtype(wgrad::DType::F32).unwrap(), &x));
    // Accuracy without the host: argmax == labels, as f32, averaged.
    let logits = Tensor::from_vec(vec![0.1, 0.9, 0.8, 0.2, 0.3, 0.7], &[3, 2], dev).unwrap();
    let labels = Tensor::from_vec_u32(vec![1, 0, 0], &[3], dev).unwrap();
    let hits = logits
        .argmax(1, false)
        .unwrap()
        .to_dtype(wgrad::DType::F32)
        .unwrap()
        .eq(&labels.to_dtype(wgrad::DType::F32).unwrap())
        .unwrap();
    let accuracy = hits.to_dtype(wgrad::DType::F32).unwrap().mean().unwrap();
    assert!((accuracy.item().unwrap() - 2.0 / 3.0).abs() < 1e-6);
}

#[test]
fn minimum_propagates_nan_as_torch() {
    let dev = device();
    let a = Tensor::from_vec(vec![f32::NAN, 1.0, 2.0], &[3], dev).unwrap();
    let b = Tensor::from_vec(vec![0.0, f32::NAN, -1.0], &[3], dev).unwrap();
    let got = a.minimum(&b).unwrap().to_vec().unwrap();
    assert!(got[0].is_nan() && got[1].is_nan());
    assert_eq!(got[2], -1.0);
}

/// Words whose f32 bit patterns are awkward (a denormal, a NaN, infinity) and values past
/// 2^24, where an f32 comparison of the values would round.
const AWKWARD_WORDS: [u32; 8] = [
    0,
    1,
    16_777_216,
    16_777_217,
    0x7F80_0000,
    0x7F80_0001,
    0xFFFF_FFFE,
    u32::MAX,
];

#[test]
fn comparisons_of_two_u32_tensors_compare_their_values_exactly() {
    let dev = device();
    // Every pair of awkward words: a column against a row, broadcast.
    let n = AWKWARD_WORDS.len();
    let a = Tensor::from_vec_u32(AWKWARD_WORDS.to_vec(), &[n, 1], dev).unwrap();
    let b = Tensor::from_vec_u32(AWKWARD_WORDS.to_vec(), &[1, n], dev).unwrap();
    type Compare = fn(&Tensor, &Tensor) -> wgrad::Result<Tensor>;
    type Reference = fn(u32, u32) -> bool;
    let cases: [(&str, Compare, Reference); 6] = [
        ("eq", Tensor::eq, |x, y| x == y),
        ("ne", Tensor::ne, |x, y| x != y),
        ("lt", Tensor::lt, |x, y| x < y),
        ("le", Tensor::le, |x, y| x <= y),
        ("gt", Tensor::gt, |x, y| x > y),
        ("ge", Tensor::ge, |x, y| x >= y),
    ];
    for (name, op, reference) in cases {
        let mask = op(&a, &b).unwrap();
        assert_eq!(mask.dtype(), DType::U32);
        let want: Vec<u32> = AWKWARD_WORDS
            .iter()
            .flat_map(|&x| AWKWARD_WORDS.iter().map(move |&y| reference(x, y) as u32))
            .collect();
        assert_eq!(mask.to_vec_u32().unwrap(), want, "{name}");
    }
}

#[test]
fn accuracy_is_predicted_classes_equal_to_labels() {
    let dev = device();
    let logits = Tensor::from_vec(vec![0.1, 0.9, 0.8, 0.2, 0.3, 0.7], &[3, 2], dev).unwrap();
    let labels = Tensor::from_vec_u32(vec![1, 0, 0], &[3], dev).unwrap();
    let hits = logits.argmax(1, false).unwrap().eq(&labels).unwrap();
    assert_eq!(hits.to_vec_u32().unwrap(), vec![1, 1, 0]);
    let accuracy = hits.to_dtype(DType::F32).unwrap().mean().unwrap();
    assert!((accuracy.item().unwrap() - 2.0 / 3.0).abs() < 1e-6);
}

#[test]
fn a_u32_tensor_compared_with_a_float_one_is_an_error_naming_both() {
    let dev = device();
    let labels = Tensor::from_vec_u32(vec![1, 0], &[2], dev).unwrap();
    let x = Tensor::zeros(&[2], dev).unwrap();
    for err in [labels.lt(&x).unwrap_err(), x.lt(&labels).unwrap_err()] {
        let msg = err.to_string();
        assert!(
            matches!(err, Error::InvalidArgument { op: "lt", .. }),
            "{msg}"
        );
        assert!(msg.contains("U32") && msg.contains("F32"), "{msg}");
    }
}

#[test]
fn where_cond_of_u32_branches_picks_their_words_exactly() {
    let dev = device();
    let n = AWKWARD_WORDS.len();
    let mask = Tensor::from_vec_u32((0..n as u32).map(|i| i % 2).collect(), &[n], dev).unwrap();
    let a = Tensor::from_vec_u32(AWKWARD_WORDS.to_vec(), &[n], dev).unwrap();
    let reversed: Vec<u32> = AWKWARD_WORDS.iter().rev().copied().collect();
    let b = Tensor::from_vec_u32(reversed.clone(), &[n], dev).unwrap();
    let got = mask.where_cond(&a, &b).unwrap();
    assert_eq!(got.dtype(), DType::U32);
    let want: Vec<u32> = (0..n)
        .map(|i| match i % 2 {
            1 => AWKWARD_WORDS[i],
            _ => reversed[i],
        })
        .collect();
    assert_eq!(got.to_vec_u32().unwrap(), want);
    // Labels with padding marked for the loss to ignore (torch.where(mask, labels, -100)):
    // the result's range is both branches', so the loss's check admits the marker.
    let labels = Tensor::from_vec_u32(vec![2, 0, 1], &[3], dev).unwrap();
    let keep = Tensor::from_vec_u32(vec![1, 1, 0], &[3], dev).unwrap();
    let ignore = Tensor::from_vec_u32(vec![wgrad::nn::loss::IGNORE_INDEX], &[1], dev).unwrap();
    let marked = keep.where_cond(&labels, &ignore).unwrap();
    assert_eq!(
        marked.to_vec_u32().unwrap(),
        vec![2, 0, wgrad::nn::loss::IGNORE_INDEX]
    );
    let logits = Tensor::zeros(&[3, 3], dev).unwrap();
    let options = wgrad::nn::loss::CrossEntropyOptions {
        ignore_index: Some(wgrad::nn::loss::IGNORE_INDEX),
        ..Default::default()
    };
    let loss = wgrad::nn::loss::cross_entropy_with(&logits, &marked, &options).unwrap();
    assert!((loss.item().unwrap() - 3f32.ln()).abs() < 1e-6);
    // A u32 branch with a float one is an error.
    let x = Tensor::zeros(&[3], dev).unwrap();
    assert!(matches!(
        keep.where_cond(&labels, &x),
        Err(Error::DType {
            op: "where_cond",
            ..
        })
    ));
}
