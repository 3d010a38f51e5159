//! nn modules: shapes, values against CPU references, initialisation, modes and grads. Tests
//! that build layers hold `serial()`, since the global seed is shared.

mod common;
use common::*;
use std::sync::{Mutex, MutexGuard};
use wgrad::nn::{self, Module};
use wgrad::{manual_seed, Error, Tensor};

fn serial() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

#[test]
fn linear_computes_x_w_transpose_plus_b() {
    let _s = serial();
    let lin = nn::Linear::new(3, 2, true, device()).unwrap();
    assert_eq!(lin.weight.shape(), &[2, 3]);
    let (x, xs) = random_tensor(&[4, 3], 1);
    let (w, b) = (
        lin.weight.to_vec().unwrap(),
        lin.bias.as_ref().unwrap().to_vec().unwrap(),
    );
    let want: Vec<f64> = (0..8)
        .map(|i| {
            b[i % 2] as f64
                + (0..3)
                    .map(|k| xs[(i / 2) * 3 + k] as f64 * w[(i % 2) * 3 + k] as f64)
                    .sum::<f64>()
        })
        .collect();
    assert_close(
        &lin.forward(&x).unwrap().to_vec().unwrap(),
        &want,
        1e-6,
        "linear",
    );
}

#[test]
fn linear_init_is_kaiming_uniform_and_repeats_under_manual_seed() {
    let _s = serial();
    manual_seed(42);
    let a = nn::Linear::new(64, 32, true, device()).unwrap();
    manual_seed(42);
    let b = nn::Linear::new(64, 32, true, device()).unwrap();
    let (wa, wb) = (a.weight.to_vec().unwrap(), b.weight.to_vec().unwrap());
    assert_eq!(wa, wb);
    let bound = 1.0 / 8.0;
    assert!(wa.iter().all(|w| w.abs() <= bound), "within 1/sqrt(in)");
    let spread = wa.iter().map(|w| w.abs()).fold(0.0f32, f32::max);
    assert!(spread > 0.9 * bound, "uses the whole range: {spread}");
    assert!(a.weight.requires_grad() && a.weight.is_leaf());
    let c = nn::Linear::new(64, 32, true, device()).unwrap();
    assert_ne!(
        c.weight.to_vec().unwrap(),
        wa,
        "the next layer gets the next numbers"
    );
}

#[test]
fn a_linear_layer_with_no_inputs_or_no_outputs_works_as_torch() {
    let dev = device();
    // No inputs: weight [3, 0], bias 0 (torch draws it from [0, 0]); the output is the bias.
    let empty_in = nn::Linear::new(0, 3, true, dev).unwrap();
    assert_eq!(empty_in.weight.shape(), &[3, 0]);
    let x = Tensor::zeros(&[2, 0], dev).unwrap();
    let y = empty_in.forward(&x).unwrap();
    assert_eq!(y.to_vec().unwrap(), vec![0.0; 6]);
    y.sum().unwrap().backward().unwrap();
    assert_eq!(
        empty_in
            .bias
            .as_ref()
            .unwrap()
            .grad()
            .unwrap()
            .to_vec()
            .unwrap(),
        vec![2.0; 3]
    );
    // An optimizer steps the empty weight beside the bias.
    use wgrad::optim::Optimizer;
    let mut opt = wgrad::optim::AdamW::new(
        empty_in.parameters(),
        wgrad::optim::AdamConfig {
            lr: 0.5,
            ..Default::default()
        },
    );
    opt.step().unwrap();
    assert_eq!(
        empty_in.bias.as_ref().unwrap().to_vec().unwrap(),
        vec![-0.5; 3]
    );
    // No outputs: an empty result, and the input's grad is zeros.
    let empty_out = nn::Linear::new(4, 0, true, dev).unwrap();
    let x = Tensor::ones(&[2, 4], dev).unwrap().requires_grad_(true);
    let y = empty_out.forward(&x).unwrap();
    assert_eq!(y.shape(), &[2, 0]);
    y.sum().unwrap().backward().unwrap();
    assert_eq!(x.grad().unwrap().to_vec().unwrap(), vec![0.0; 8]);
}

#[test]
fn parameters_are_the_handles_themselves_weight_first() {
    let _s = serial();
    let lin = nn::Linear::new(2, 2, true, device()).unwrap();
    let params = lin.parameters();
    assert!(Tensor::same(&params[0], &lin.weight));
    assert!(Tensor::same(&params[1], lin.bias.as_ref().unwrap()));
    assert_eq!(
        nn::Linear::new(2, 2, false, device())
            .unwrap()
            .parameters()
            .len(),
        1
    );
}

#[test]
fn sequential_names_parameters_by_position() {
    let _s = serial();
    let dev = device();
    let net = nn::Sequential::new()
        .add(nn::Linear::new(4, 3, true, dev).unwrap())
        .add(nn::Relu)
        .add(nn::Linear::new(3, 2, false, dev).unwrap());
    let names: Vec<String> = net.named_parameters().into_iter().map(|(n, _)| n).collect();
    assert_eq!(names, vec!["0.weight", "0.bias", "2.weight"]);
    assert_eq!(
        net.forward(&Tensor::ones(&[5, 4], dev).unwrap())
            .unwrap()
            .shape(),
        &[5, 2]
    );
}

#[test]
fn c15_sequential_of_two_bias_free_linears_matches_a_hand_computed_grad() {
    let _s = serial();
    let dev = device();
    let net = nn::Sequential::new()
        .add(nn::Linear::new(2, 1, false, dev).unwrap())
        .add(nn::Linear::new(1, 2, false, dev).unwrap());
    let x = Tensor::from_vec(vec![1.0, 2.0, -1.0, 0.5], &[2, 2], dev).unwrap();
    net.forward(&x).unwrap().sum().unwrap().backward().unwrap();
    let p = net.parameters();
    let (w1, w2) = (p[0].to_vec().unwrap(), p[1].to_vec().unwrap());
    let xs = [[1.0f64, 2.0], [-1.0, 0.5]];
    let h: Vec<f64> = xs
        .iter()
        .map(|r| r[0] * w1[0] as f64 + r[1] * w1[1] as f64)
        .collect();
    let w2_sum = w2[0] as f64 + w2[1] as f64;
    let want_w1: Vec<f64> = (0..2).map(|k| w2_sum * (xs[0][k] + xs[1][k])).collect();
    assert_close(
        &p[0].grad().unwrap().to_vec().unwrap(),
        &want_w1,
        1e-6,
        "w1",
    );
    assert_close(
        &p[1].grad().unwrap().to_vec().unwrap(),
        &[h[0] + h[1], h[0] + h[1]],
        1e-6,
        "w2",
    );
}

#[test]
fn dropout_zeroes_and_rescales_in_training_and_passes_through_in_eval() {
    let _s = serial();
    let dev = device();
    let drop = nn::Dropout::new(0.25).unwrap();
    let x = Tensor::ones(&[4000], dev).unwrap();
    let y = drop.forward(&x).unwrap().to_vec().unwrap();
    let zeros = y.iter().filter(|&&v| v == 0.0).count();
    assert!(y.iter().all(|&v| v == 0.0 || (v - 1.0 / 0.75).abs() < 1e-6));
    assert!((zeros as f64 / 4000.0 - 0.25).abs() < 0.03, "{zeros} zeros");
    drop.eval();
    assert!(Tensor::same(&drop.forward(&x).unwrap(), &x));
    drop.train();
    manual_seed(7);
    let a = drop.forward(&x).unwrap().to_vec().unwrap();
    manual_seed(7);
    assert_eq!(
        drop.forward(&x).unwrap().to_vec().unwrap(),
        a,
        "seeded masks repeat"
    );
    assert!(matches!(
        nn::Dropout::new(1.5),
        Err(Error::InvalidArgument { .. })
    ));
    // p = 1 drops everything, as torch's Dropout(1.0) does.
    let all = nn::Dropout::new(1.0).unwrap();
    assert_eq!(
        all.forward(&x).unwrap().to_vec().unwrap(),
        vec![0.0; x.numel()]
    );
}

#[test]
fn sequential_eval_reaches_nested_dropout() {
    let _s = serial();
    let net = nn::Sequential::new().add(nn::Dropout::new(0.5).unwrap());
    let x = Tensor::ones(&[100], device()).unwrap();
    net.eval();
    assert_eq!(net.forward(&x).unwrap().to_vec().unwrap(), vec![1.0; 100]);
}

#[test]
fn layer_norm_matches_reference_and_its_grads_check() {
    let _s = serial();
    let ln = nn::LayerNorm::new(5, 1e-5, device()).unwrap();
    let (x, xs) = random_tensor(&[3, 5], 9);
    let mut want = Vec::new();
    for r in 0..3 {
        let row: Vec<f64> = xs[r * 5..r * 5 + 5].iter().map(|&v| v as f64).collect();
        let mean = row.iter().sum::<f64>() / 5.0;
        let var = row.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / 5.0;
        want.extend(row.iter().map(|v| (v - mean) / (var + 1e-5).sqrt()));
    }
    assert_close(
        &ln.forward(&x).unwrap().to_vec().unwrap(),
        &want,
        1e-5,
        "layer_norm",
    );
    gradcheck(
        "layer_norm",
        &[
            (vec![3, 5], values_in(15, -1.0, 1.0, 10)),
            (vec![5], values_in(5, 0.5, 1.5, 11)),
            (vec![5], values_in(5, -0.5, 0.5, 12)),
        ],
        |t| t[0].layer_norm(&t[1], &t[2], 1e-5),
    );
    gradcheck(
        "layer_norm of a 3-d input",
        &[
            (vec![2, 3, 7], values_in(42, -1.0, 1.0, 13)),
            (vec![7], values_in(7, 0.5, 1.5, 14)),
            (vec![7], values_in(7, -0.5, 0.5, 15)),
        ],
        |t| t[0].layer_norm(&t[1], &t[2], 1e-5),
    );
    let err = ln
        .forward(&Tensor::zeros(&[3, 4], device()).unwrap())
        .unwrap_err();
    assert!(
        matches!(
            err,
            Error::Shape {
                op: "layer_norm",
                ..
            }
        ),
        "{err:?}"
    );
    assert!(nn::LayerNorm::new(5, -1.0, device()).is_err());
}

#[test]
fn layer_norm_of_rows_of_equal_values_is_the_bias() {
    // A row of equal values has no deviation, so every output is the bias, as torch gives it.
    // The row's mean in f32 (its sum over its length) can land an ulp or two off the value,
    // and 1 / sqrt(eps) magnified that: 0.2501131 for 0.25 (the fuzzer's case 58222).
    let values = [-2.8354403f32, 0.7, 1.0 / 3.0, 12345.679, -0.015];
    for len in [3, 7, 64, 1000] {
        let data: Vec<f32> = values.iter().flat_map(|&v| vec![v; len]).collect();
        let x = Tensor::from_slice(&data, &[values.len(), len], device()).unwrap();
        let weight = Tensor::full(&[len], 1.5, device()).unwrap();
        let bias = Tensor::full(&[len], 0.25, device()).unwrap();
        let y = x
            .layer_norm(&weight, &bias, 1e-5)
            .unwrap()
            .to_vec()
            .unwrap();
        for (i, &v) in y.iter().enumerate() {
            assert!(
                (v - 0.25).abs() <= 1e-6,
                "rows of {len}: element {i} is {v}, want 0.25"
            );
        }
    }
}

#[test]
fn layer_norm_input_grad_of_a_constant_sum_is_zero() {
    // Each row's outputs sum to len * bias whatever x is, so the input grad of their sum is 0.
    // Rows far from 0 with a small spread round their f32 mean an ulp off, so the xhat the
    // backward recomputes sums to no exact 0; 1 / sigma magnified that: the fuzzer's case
    // 1352498 read 0.017 where finite differences read 2e-8.
    for (base, spread) in [(1.3f32, 0.01f32), (1000.0, 0.01), (-37.5, 0.003)] {
        // 20,000 is past the fused kernels' rows: the composed ops'.
        for len in [2, 5, 64, 1000, 20_000] {
            let data: Vec<f32> = (0..3 * len)
                .map(|i| base + spread * ((i * 7 % 11) as f32 / 10.0 - 0.5))
                .collect();
            let x = Tensor::from_slice(&data, &[3, len], device())
                .unwrap()
                .requires_grad_(true);
            let weight = Tensor::full(&[len], 1.5, device()).unwrap();
            let bias = Tensor::full(&[len], 0.25, device()).unwrap();
            x.layer_norm(&weight, &bias, 1e-5)
                .unwrap()
                .sum()
                .unwrap()
                .backward()
                .unwrap();
            let grad = x.grad().unwrap().to_vec().unwrap();
            let worst = grad.iter().fold(0f32, |m, g| m.max(g.abs()));
            assert!(
                worst <= 1e-4,
                "rows of {len} at {base} +- {spread}: grad up to {worst}, want 0"
            );
        }
    }
}

#[test]
fn batch_norm_and_group_norm_input_grads_of_a_constant_sum_are_zero() {
    // As for LayerNorm: each channel's (group's) outputs sum to a constant, so the grad is 0;
    // values far from 0 with a small spread read 14 (BatchNorm) and 10 (GroupNorm) before
    // their backward took the co-moment and the composed ops centred twice.
    let _s = serial();
    for (base, spread) in [(1.3f32, 0.01f32), (1000.0, 0.01), (-37.5, 0.003)] {
        for (n, c, h) in [(2, 1, 1), (4, 3, 5), (16, 2, 64)] {
            let what = format!("[{n}, {c}, {h}, 1] at {base} +- {spread}");
            let data: Vec<f32> = (0..n * c * h)
                .map(|i| base + spread * ((i * 7 % 11) as f32 / 10.0 - 0.5))
                .collect();
            let fresh = || {
                Tensor::from_slice(&data, &[n, c, h, 1], device())
                    .unwrap()
                    .requires_grad_(true)
            };
            let worst = |x: &Tensor| {
                let g = x.grad().unwrap().to_vec().unwrap();
                g.iter().fold(0f32, |m, v| m.max(v.abs()))
            };
            let x = fresh();
            let bn = nn::BatchNorm2d::new(c, device()).unwrap();
            bn.forward(&x).unwrap().sum().unwrap().backward().unwrap();
            assert!(worst(&x) <= 1e-4, "BatchNorm2d over {what}: {}", worst(&x));
            let x = fresh();
            let gn = x.group_norm(1, None, None, 1e-5).unwrap();
            gn.sum().unwrap().backward().unwrap();
            assert!(worst(&x) <= 1e-4, "group_norm over {what}: {}", worst(&x));
        }
    }
}

/// Rows longer than the fused kernel takes are normalised by the composed ops: same values.
/// LayerNorm of rows of `len` on the host (biased variance), scaled and shifted.
fn layer_norm_reference(x: &[f32], len: usize, w: &[f32], b: &[f32]) -> Vec<f64> {
    x.chunks(len)
        .flat_map(|row| {
            let mean = row.iter().map(|&v| v as f64).sum::<f64>() / len as f64;
            let var = row.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / len as f64;
            row.iter()
                .enumerate()
                .map(move |(i, &v)| {
                    (v as f64 - mean) / (var + 1e-5).sqrt() * w[i] as f64 + b[i] as f64
                })
                .collect::<Vec<_>>()
        })
        .collect()
}

/// The weight and bias grads of a norm over `rows` of `len` with upstream grad `g`, on the
/// host: column sums of `g * xhat` and of `g` (`center` false: RMSNorm, no mean).
fn norm_param_grads(x: &[f32], g: &[f32], len: usize, center: bool) -> (Vec<f64>, Vec<f64>) {
    let (mut gw, mut gb) = (vec![0.0f64; len], vec![0.0f64; len]);
    for (row, g_row) in x.chunks(len).zip(g.chunks(len)) {
        let mean = match center {
            true => row.iter().map(|&v| v as f64).sum::<f64>() / len as f64,
            false => 0.0,
        };
        let var = row.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / len as f64;
        for j in 0..len {
            let xhat = (row[j] as f64 - mean) / (var + 1e-5).sqrt();
            gw[j] += g_row[j] as f64 * xhat;
            gb[j] += g_row[j] as f64;
        }
    }
    (gw, gb)
}

/// The weight and bias grads are summed over chunks of 64 rows and then over the chunks: many
/// chunks, a last partial one, rows of odd length, and more rows than one loop may count.
#[test]
fn norm_weight_and_bias_grads_sum_over_every_row() {
    let _s = serial();
    for (rows, len) in [(1, 8), (64, 8), (200, 7), (130, 12), (70_001, 3)] {
        let (x, xs) = random_tensor(&[rows, len], 21);
        let (g, gs) = random_tensor(&[rows, len], 22);
        let w = Tensor::ones(&[len], device()).unwrap().requires_grad_(true);
        let b = Tensor::zeros(&[len], device())
            .unwrap()
            .requires_grad_(true);
        let loss = |y: Tensor| y.mul(&g).unwrap().sum().unwrap();
        loss(x.layer_norm(&w, &b, 1e-5).unwrap())
            .backward()
            .unwrap();
        let (want_w, want_b) = norm_param_grads(&xs, &gs, len, true);
        let what = format!("layer_norm [{rows}, {len}]");
        let tol = 1e-5 * (rows as f64).sqrt();
        assert_close(&w.grad().unwrap().to_vec().unwrap(), &want_w, tol, &what);
        assert_close(&b.grad().unwrap().to_vec().unwrap(), &want_b, tol, &what);

        let w = Tensor::ones(&[len], device()).unwrap().requires_grad_(true);
        loss(x.rms_norm(&w, 1e-5).unwrap()).backward().unwrap();
        let (want_w, _) = norm_param_grads(&xs, &gs, len, false);
        let what = format!("rms_norm [{rows}, {len}]");
        assert_close(&w.grad().unwrap().to_vec().unwrap(), &want_w, tol, &what);
    }
}

#[test]
fn layer_norm_reads_rows_whole_or_element_by_element_alike() {
    let _s = serial();
    // Rows of 8 from offset 0 and 8 (read four at a time), from offset 5 (element by element),
    // rows of 131 (not a multiple of 4), and the longest rows the fused kernels take, either
    // way (their loops stay under llvmpipe's 65,535 iterations per invocation).
    let (flat, data) = random_tensor(&[5 + 2 * 16_384], 21);
    let cases = [
        (0, 6, 8),
        (8, 5, 8),
        (5, 6, 8),
        (0, 6, 131),
        (0, 2, 16_384),
        (1, 2, 16_383),
    ];
    for (offset, rows, len) in cases {
        let x = rows_of(&flat, offset, rows, len);
        let (w, ws) = random_tensor(&[len], 22);
        let (b, bs) = random_tensor(&[len], 23);
        let want = layer_norm_reference(&data[offset..offset + rows * len], len, &ws, &bs);
        let got = x.layer_norm(&w, &b, 1e-5).unwrap().to_vec().unwrap();
        assert_close(
            &got,
            &want,
            1e-4,
            &format!("rows of {len} at offset {offset}"),
        );
    }
    gradcheck(
        "layer_norm of rows of 8",
        &[
            (vec![3, 8], values_in(24, -1.0, 1.0, 24)),
            (vec![8], values_in(8, 0.5, 1.5, 25)),
            (vec![8], values_in(8, -0.5, 0.5, 26)),
        ],
        |t| t[0].layer_norm(&t[1], &t[2], 1e-5),
    );
}

#[test]
fn layer_norm_of_rows_past_the_fused_length_matches_reference() {
    let len = 20_000;
    let (x, xs) = random_tensor(&[2, len], 16);
    let w = Tensor::full(&[len], 2.0, device()).unwrap();
    let b = Tensor::full(&[len], 0.5, device()).unwrap();
    let mut want = Vec::new();
    for r in 0..2 {
        let row: Vec<f64> = xs[r * len..(r + 1) * len]
            .iter()
            .map(|&v| v as f64)
            .collect();
        let mean = row.iter().sum::<f64>() / len as f64;
        let var = row.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / len as f64;
        want.extend(
            row.iter()
                .map(|v| (v - mean) / (var + 1e-5).sqrt() * 2.0 + 0.5),
        );
    }
    let got = x.layer_norm(&w, &b, 1e-5).unwrap().to_vec().unwrap();
    assert_close(&got, &want, 1e-4, "long-row layer_norm");
}

#[test]
fn embedding_looks_up_rows_and_adds_grads_of_repeated_indices() {
    let _s = serial();
    let emb = nn::Embedding::new(5, 3, device()).unwrap();
    let idx = Tensor::from_vec_u32(vec![4, 1, 4, 0], &[2, 2], device()).unwrap();
    let out = emb.forward(&idx).unwrap();
    assert_eq!(out.shape(), &[2, 2, 3]);
    let w = emb.weight.to_vec().unwrap();
    let got = out.to_vec().unwrap();
    for (i, &row) in [4usize, 1, 4, 0].iter().enumerate() {
        assert_eq!(&got[i * 3..i * 3 + 3], &w[row * 3..row * 3 + 3]);
    }
    out.sum().unwrap().backward().unwrap();
    let g = emb.weight.grad().unwrap().to_vec().unwrap();
    assert_eq!(
        g,
        vec![1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 2.0, 2.0, 2.0]
    );
    // An id past the table is an error naming the Embedding and its rows (it named the
    // index_select it runs on).
    let bad = Tensor::from_vec_u32(vec![5], &[1], device()).unwrap();
    let err = emb.forward(&bad).unwrap_err();
    assert!(
        matches!(
            err,
            Error::Index {
                op: "Embedding",
                ..
            }
        ),
        "{err:?}"
    );
    assert!(
        err.to_string().contains("id 5") && err.to_string().contains("5 rows"),
        "{err}"
    );
    let floats = Tensor::zeros(&[2], device()).unwrap();
    let err = emb.forward(&floats).unwrap_err();
    assert!(
        matches!(
            err,
            Error::DType {
                op: "Embedding",
                ..
            }
        ),
        "{err:?}"
    );
}

#[test]
fn mse_is_the_mean_squared_difference() {
    let a = Tensor::from_vec(vec![1.0, 2.0, 3.0], &[3], device()).unwrap();
    let b = Tensor::from_vec(vec![1.0, 0.0, 6.0], &[3], device()).unwrap();
    assert!((nn::loss::mse(&a, &b).unwrap().item().unwrap() - 13.0 / 3.0).abs() < 1e-6);
    gradcheck(
        "mse",
        &[
            (vec![4], values_in(4, -1.0, 1.0, 1)),
            (vec![4], values_in(4, -1.0, 1.0, 2)),
        ],
        |t| nn::loss::mse(&t[0], &t[1]),
    );
    let err = nn::loss::mse(&a, &Tensor::zeros(&[2], device()).unwrap()).unwrap_err();
    assert!(matches!(err, Error::Shape { op: "mse", .. }), "{err:?}");
}

/// PyTorch's BatchNorm2d in training mode on the CPU: (output, batch mean, unbiased var).
fn batch_norm_reference(x: &[f32], [n, c, h, w]: [usize; 4]) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
    let count = (n * h * w) as f64;
    let at = |b: usize, ch: usize, i: usize| x[(b * c + ch) * h * w + i] as f64;
    let mut out = vec![0.0; x.len()];
    let (mut means, mut vars) = (Vec::new(), Vec::new());
    for ch in 0..c {
        let values: Vec<f64> = (0..n)
            .flat_map(|b| (0..h * w).map(move |i| (b, i)))
            .map(|(b, i)| at(b, ch, i))
            .collect();
        let mean = values.iter().sum::<f64>() / count;
        let var = values.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / count;
        for b in 0..n {
            for i in 0..h * w {
                out[(b * c + ch) * h * w + i] = (at(b, ch, i) - mean) / (var + 1e-5).sqrt();
            }
        }
        means.push(mean);
        vars.push(var * count / (count - 1.0));
    }
    (out, means, vars)
}

#[test]
fn batch_norm_2d_trains_on_batch_statistics_and_updates_running_ones() {
    let _s = serial();
    let bn = nn::BatchNorm2d::new(3, device()).unwrap();
    let (x, xs) = random_tensor(&[2, 3, 4, 5], 21);
    let (want, means, vars) = batch_norm_reference(&xs, [2, 3, 4, 5]);
    assert_close(
        &bn.forward(&x).unwrap().to_vec().unwrap(),
        &want,
        1e-4,
        "batch norm",
    );
    let running_mean: Vec<f64> = means.iter().map(|m| 0.1 * m).collect();
    let running_var: Vec<f64> = vars.iter().map(|v| 0.9 + 0.1 * v).collect();
    assert_close(
        &bn.running_mean.to_vec().unwrap(),
        &running_mean,
        1e-4,
        "running_mean",
    );
    assert_close(
        &bn.running_var.to_vec().unwrap(),
        &running_var,
        1e-4,
        "running_var",
    );
    // Evaluation mode normalises with the running statistics and leaves them alone.
    bn.eval();
    let got = bn.forward(&x).unwrap().to_vec().unwrap();
    let eval_want: Vec<f64> = (0..xs.len())
        .map(|i| {
            let ch = (i / 20) % 3;
            (xs[i] as f64 - running_mean[ch]) / (running_var[ch] + 1e-5).sqrt()
        })
        .collect();
    assert_close(&got, &eval_want, 1e-4, "batch norm in eval mode");
    assert_close(
        &bn.running_mean.to_vec().unwrap(),
        &running_mean,
        1e-4,
        "running_mean kept",
    );
}

/// BatchNorm2d's output, running statistics and input grad against the CPU, on values whose
/// mean is far from 0 (a naive sum of squares would lose them).
fn check_batch_norm_2d(shape: [usize; 4], seed: u64) {
    let what = format!("BatchNorm2d over {shape:?}");
    let channels = shape[1];
    let (_, xs) = random_tensor(&shape, seed);
    let xs: Vec<f32> = xs.iter().map(|v| 3.0 + v).collect();
    let x = Tensor::from_slice(&xs, &shape, device())
        .unwrap()
        .requires_grad_(true);
    let bn = nn::BatchNorm2d::new(channels, device()).unwrap();
    let y = bn.forward(&x).unwrap();
    let (want, means, vars) = batch_norm_reference(&xs, shape);
    assert_close(
        &y.to_vec().unwrap(),
        &want,
        1e-4,
        &format!("{what}: output"),
    );
    let running_mean: Vec<f64> = means.iter().map(|m| 0.1 * m).collect();
    assert_close(
        &bn.running_mean.to_vec().unwrap(),
        &running_mean,
        1e-5,
        &format!("{what}: running_mean"),
    );
    let running_var: Vec<f64> = vars.iter().map(|v| 0.9 + 0.1 * v).collect();
    assert_close(
        &bn.running_var.to_vec().unwrap(),
        &running_var,
        1e-5,
        &format!("{what}: running_var"),
    );
    // d/dx of sum(y g) = rstd (g - mean(g) - xhat mean(g xhat)) per channel (weight 1).
    let (g, gs) = random_tensor(&shape, seed + 1);
    y.mul(&g).unwrap().sum().unwrap().backward().unwrap();
    let pixels = shape[2] * shape[3];
    let count = (shape[0] * pixels) as f64;
    let channel = |i: usize| (i / pixels) % channels;
    let mut mean_g = vec![0.0f64; channels];
    let mut mean_g_xhat = vec![0.0f64; channels];
    for i in 0..xs.len() {
        mean_g[channel(i)] += gs[i] as f64 / count;
        mean_g_xhat[channel(i)] += gs[i] as f64 * want[i] / count;
    }
    let grad: Vec<f64> = (0..xs.len())
        .map(|i| {
            let c = channel(i);
            let rstd = 1.0 / (vars[c] * (count - 1.0) / count + 1e-5).sqrt();
            rstd * (gs[i] as f64 - mean_g[c] - want[i] * mean_g_xhat[c])
        })
        .collect();
    assert_close(
        &x.grad().unwrap().to_vec().unwrap(),
        &grad,
        1e-4,
        &format!("{what}: input grad"),
    );
}

/// A channel of more values than one workgroup reduces (16,384) is summed in parts and the
/// parts merged.
#[test]
fn batch_norm_2d_over_many_parts_matches_cpu_reference() {
    let _s = serial();
    check_batch_norm_2d([5, 2, 61, 67], 26); // 20,435 values per channel: the second part ragged
}

/// The kernels step through a channel's values and an invocation's items without dividing
/// per value: planes smaller than a step (1, 2 and 6 pixels, more channels than a step's
/// planes and fewer), and planes that do not divide a step (272 pixels).
#[test]
fn batch_norm_2d_over_small_and_ragged_planes_matches_cpu_reference() {
    let _s = serial();
    for (i, shape) in [
        [3, 5, 1, 1],
        [64, 3, 1, 2],
        [7, 3, 2, 3],
        [2, 4, 16, 17],
        [40, 11, 1, 1],
    ]
    .into_iter()
    .enumerate()
    {
        check_batch_norm_2d(shape, 40 + 2 * i as u64);
    }
}

#[test]
fn batch_norm_2d_gradcheck() {
    let _s = serial();
    gradcheck(
        "BatchNorm2d",
        &[
            (vec![2, 2, 3, 3], values_in(36, -1.0, 1.0, 22)),
            (vec![2], values_in(2, 0.5, 1.5, 23)),
            (vec![2], values_in(2, -0.5, 0.5, 24)),
        ],
        |t| {
            let mut bn = nn::BatchNorm2d::new(2, device())?;
            bn.weight = t[1].clone();
            bn.bias = t[2].clone();
            bn.forward(&t[0])
        },
    );
}

#[test]
fn batch_norm_2d_buffers_round_trip_through_a_checkpoint() {
    let _s = serial();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("bn.safetensors");
    let bn = nn::BatchNorm2d::new(2, device()).unwrap();
    bn.forward(&random_tensor(&[3, 2, 2, 2], 25).0).unwrap();
    wgrad::io::save(&path, &bn).unwrap();
    let fresh = nn::BatchNorm2d::new(2, device()).unwrap();
    wgrad::io::load(&path, &fresh).unwrap();
    assert_eq!(
        fresh.running_mean.to_vec().unwrap(),
        bn.running_mean.to_vec().unwrap()
    );
    assert_eq!(
        fresh.running_var.to_vec().unwrap(),
        bn.running_var.to_vec().unwrap()
    );
    assert_ne!(fresh.running_var.to_vec().unwrap(), vec![1.0, 1.0]);
    let err = bn
        .forward(&Tensor::zeros(&[2, 3, 2, 2], device()).unwrap())
        .unwrap_err();
    assert!(err.to_string().contains("BatchNorm2d"), "{err}");
}

/// `rows` rows of `len` elements of the 1-d `flat`, from `offset` on.
fn rows_of(flat: &Tensor, offset: usize, rows: usize, len: usize) -> Tensor {
    flat.narrow(0, offset, rows * len)
        .unwrap()
        .reshape(&[rows, len])
        .unwrap()
}

/// RMSNorm of rows of `len` on the host, scaled by `w`.
fn rms_norm_reference(x: &[f32], len: usize, w: &[f32], eps: f64) -> Vec<f64> {
    x.chunks(len)
        .flat_map(|row| {
            let ms = row.iter().map(|&v| (v as f64).powi(2)).sum::<f64>() / len as f64;
            let scale = 1.0 / (ms + eps).sqrt();
            row.iter()
                .enumerate()
                .map(move |(i, &v)| v as f64 * scale * w[i] as f64)
                .collect::<Vec<_>>()
        })
        .collect()
}

#[test]
fn rms_norm_matches_reference_at_any_row_length_and_offset() {
    // Rows read four at a time (offsets 0, 8), element by element (offset 5, rows of 131),
    // the longest fused rows, and rows past them (the composed ops).
    let (flat, data) = random_tensor(&[5 + 2 * 20_000], 70);
    let cases = [
        (0, 6, 8),
        (8, 5, 8),
        (5, 6, 8),
        (0, 3, 131),
        (0, 1, 1),
        (1, 2, 16_383),
        (0, 2, 20_000),
    ];
    for (offset, rows, len) in cases {
        let x = rows_of(&flat, offset, rows, len);
        let (w, ws) = random_tensor(&[len], 71);
        let want = rms_norm_reference(&data[offset..offset + rows * len], len, &ws, 1e-6);
        let got = x.rms_norm(&w, 1e-6).unwrap().to_vec().unwrap();
        assert_close(
            &got,
            &want,
            1e-4,
            &format!("rms_norm rows of {len} at {offset}"),
        );
    }
}

#[test]
fn rms_norm_grads_check() {
    for (shape, len) in [(vec![1, 5], 5), (vec![3, 8], 8), (vec![2, 3, 7], 7)] {
        let n: usize = shape.iter().product();
        gradcheck(
            &format!("rms_norm {shape:?}"),
            &[
                (shape.clone(), values_in(n, -1.0, 1.0, 72)),
                (vec![len], values_in(len, 0.5, 1.5, 73)),
            ],
            |t| t[0].rms_norm(&t[1], 1e-5),
        );
    }
    // A transposed (non-contiguous) input.
    gradcheck(
        "rms_norm of a view",
        &[
            (vec![6, 3], values_in(18, -1.0, 1.0, 74)),
            (vec![6], values_in(6, 0.5, 1.5, 75)),
        ],
        |t| t[0].t()?.rms_norm(&t[1], 1e-5),
    );
    // Past the fused length: the composed ops' grads agree with the fused rule's shape.
    let x = Tensor::ones(&[1, 20_000], device())
        .unwrap()
        .requires_grad_(true);
    let w = Tensor::ones(&[20_000], device())
        .unwrap()
        .requires_grad_(true);
    x.rms_norm(&w, 1e-6)
        .unwrap()
        .sum()
        .unwrap()
        .backward()
        .unwrap();
    assert_eq!(w.grad().unwrap().shape(), &[20_000]);
}

#[test]
fn rms_norm_module_has_one_weight_and_names_bad_shapes() {
    let norm = nn::RmsNorm::new(4, 1e-6, device()).unwrap();
    let names: Vec<String> = norm
        .named_parameters()
        .into_iter()
        .map(|(n, _)| n)
        .collect();
    assert_eq!(names, vec!["weight"]);
    let err = norm
        .forward(&Tensor::zeros(&[2, 3], device()).unwrap())
        .unwrap_err();
    let msg = err.to_string();
    assert!(
        msg.contains("rms_norm") && msg.contains("[2, 3]") && msg.contains("[4]"),
        "{msg}"
    );
    assert!(nn::RmsNorm::new(4, f32::NAN, device()).is_err());
}

#[test]
fn embedding_padding_rows_read_as_zeros_and_get_no_grad() {
    let emb = nn::Embedding::with_padding_idx(5, 3, 2, device()).unwrap();
    let w = emb.weight.to_vec().unwrap();
    assert_eq!(w[6..9], [0.0, 0.0, 0.0]);
    assert!(w[..6].iter().any(|&v| v != 0.0));
    let tokens = Tensor::from_vec_u32(vec![2, 1, 2, 4], &[2, 2], device()).unwrap();
    let out = emb.forward(&tokens).unwrap();
    assert_eq!(out.shape(), &[2, 2, 3]);
    let values = out.to_vec().unwrap();
    assert_eq!(values[..3], [0.0, 0.0, 0.0]);
    assert_eq!(values[3..6], w[3..6]);
    out.sum().unwrap().backward().unwrap();
    let grad = emb.weight.grad().unwrap().to_vec().unwrap();
    assert_eq!(
        grad,
        [0., 0., 0., 1., 1., 1., 0., 0., 0., 0., 0., 0., 1., 1., 1.]
    );
    assert!(nn::Embedding::with_padding_idx(5, 3, 5, device()).is_err());
}

#[test]
fn batch_norm_1d_normalises_features_and_sequences_per_channel() {
    let _s = serial();
    // [N, C] is [N, C, 1, 1] to the reference, [N, C, L] is [N, C, L, 1].
    for (shape, as_images) in [(vec![5, 3], [5, 3, 1, 1]), (vec![2, 3, 4], [2, 3, 4, 1])] {
        let bn = nn::BatchNorm1d::new(3, device()).unwrap();
        let (x, xs) = random_tensor(&shape, 26);
        let (want, means, vars) = batch_norm_reference(&xs, as_images);
        let what = format!("BatchNorm1d {shape:?}");
        assert_close(
            &bn.forward(&x).unwrap().to_vec().unwrap(),
            &want,
            1e-4,
            &what,
        );
        let running_var: Vec<f64> = vars.iter().map(|v| 0.9 + 0.1 * v).collect();
        assert_close(&bn.running_var.to_vec().unwrap(), &running_var, 1e-4, &what);
        let running_mean: Vec<f64> = means.iter().map(|m| 0.1 * m).collect();
        assert_close(
            &bn.running_mean.to_vec().unwrap(),
            &running_mean,
            1e-4,
            &what,
        );
        assert_eq!(bn.named_buffers().len(), 3);
    }
}

#[test]
fn batch_norm_1d_gradcheck_and_bad_input() {
    let _s = serial();
    gradcheck(
        "BatchNorm1d",
        &[
            (vec![3, 2, 3], values_in(18, -1.0, 1.0, 27)),
            (vec![2], values_in(2, 0.5, 1.5, 28)),
        ],
        |t| {
            let mut bn = nn::BatchNorm1d::new(2, device())?;
            bn.weight = t[1].clone();
            bn.forward(&t[0])
        },
    );
    let bn = nn::BatchNorm1d::new(2, device()).unwrap();
    for shape in [vec![2, 2, 2, 2], vec![4, 3], vec![4]] {
        let err = bn
            .forward(&Tensor::zeros(&shape, device()).unwrap())
            .unwrap_err();
        assert!(err.to_string().contains("BatchNorm1d"), "{err}");
        assert!(err.to_string().contains(&format!("{shape:?}")), "{err}");
    }
}

/// torch's group_norm on the host: `[n, c, rest]` normalised over each group's channels and
/// positions, then scaled and shifted per channel.
fn group_norm_reference(
    x: &[f32],
    (n, c, rest): (usize, usize, usize),
    groups: usize,
    w: &[f32],
    b: &[f32],
) -> Vec<f64> {
    let per = c / groups * rest;
    let mut out = vec![0.0; x.len()];
    for g in 0..n * groups {
        let values: Vec<f64> = x[g * per..(g + 1) * per]
            .iter()
            .map(|&v| v as f64)
            .collect();
        let mean = values.iter().sum::<f64>() / per as f64;
        let var = values.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / per as f64;
        for (i, v) in values.iter().enumerate() {
            let at = g * per + i;
            let ch = (at / rest) % c;
            out[at] = (v - mean) / (var + 1e-5).sqrt() * w[ch] as f64 + b[ch] as f64;
        }
    }
    out
}

#[test]
fn group_norm_matches_torchs_formula() {
    let _s = serial();
    for (shape, groups) in [
        (vec![2, 6, 3, 4], 3),
        (vec![1, 4, 5], 2),
        (vec![3, 4], 4),
        (vec![2, 6, 2, 2], 1),
        // Groups of 17,000: past the fused row kernels, the composed ops.
        (vec![1, 2, 8500], 1),
        (vec![0, 4, 3], 2),
        (vec![2, 4, 0], 2),
    ] {
        let c = shape[1];
        let rest: usize = shape[2..].iter().product();
        let (x, xs) = random_tensor(&shape, 29);
        let (w, ws) = random_tensor(&[c], 30);
        let (b, bs) = random_tensor(&[c], 31);
        let got = x.group_norm(groups, Some(&w), Some(&b), 1e-5).unwrap();
        let want = group_norm_reference(&xs, (shape[0], c, rest), groups, &ws, &bs);
        assert_close(
            &got.to_vec().unwrap(),
            &want,
            1e-4,
            &format!("group_norm {shape:?} / {groups}"),
        );
        // The module starts at weight 1, bias 0.
        let module = nn::GroupNorm::new(groups, c, 1e-5, device()).unwrap();
        let plain = group_norm_reference(
            &xs,
            (shape[0], c, rest),
            groups,
            &vec![1.0; c],
            &vec![0.0; c],
        );
        assert_close(
            &module.forward(&x).unwrap().to_vec().unwrap(),
            &plain,
            1e-4,
            "GroupNorm",
        );
        assert_eq!(module.parameters().len(), 2);
    }
}

#[test]
fn group_norm_of_empty_inputs_has_empty_grads() {
    let _s = serial();
    for shape in [[0, 4, 3], [2, 4, 0]] {
        let x = Tensor::zeros(&shape, device())
            .unwrap()
            .requires_grad_(true);
        let w = Tensor::ones(&[4], device()).unwrap().requires_grad_(true);
        let y = x.group_norm(2, Some(&w), None, 1e-5).unwrap();
        y.sum().unwrap().backward().unwrap();
        assert_eq!(x.grad().unwrap().shape(), &shape);
        assert_eq!(w.grad().unwrap().to_vec().unwrap(), vec![0.0; 4]);
    }
}

#[test]
fn group_norm_gradcheck_batch_1_and_3_and_a_view() {
    let _s = serial();
    for n in [1, 3] {
        gradcheck(
            &format!("group_norm batch {n}"),
            &[
                (vec![n, 4, 3], values_in(n * 12, -1.0, 1.0, 32)),
                (vec![4], values_in(4, 0.5, 1.5, 33)),
                (vec![4], values_in(4, -0.5, 0.5, 34)),
            ],
            |t| t[0].group_norm(2, Some(&t[1]), Some(&t[2]), 1e-5),
        );
    }
    gradcheck(
        "group_norm of a view",
        &[(vec![3, 4, 2], values_in(24, -1.0, 1.0, 35))],
        |t| t[0].permute(&[2, 1, 0])?.group_norm(2, None, None, 1e-5),
    );
}

#[test]
fn group_norm_rejects_groups_that_do_not_divide_channels() {
    let _s = serial();
    let x = Tensor::zeros(&[2, 6, 3], device()).unwrap();
    for groups in [4, 0] {
        let err = x.group_norm(groups, None, None, 1e-5).unwrap_err();
        assert!(
            matches!(
                err,
                Error::Shape {
                    op: "group_norm",
                    ..
                }
            ),
            "{err}"
        );
        assert!(err.to_string().contains("[2, 6, 3]"), "{err}");
    }
    let w = Tensor::ones(&[3], device()).unwrap();
    let err = x.group_norm(3, Some(&w), None, 1e-5).unwrap_err();
    assert!(err.to_string().contains("[3]"), "{err}");
    assert!(nn::GroupNorm::new(4, 6, 1e-5, device()).is_err());
    assert!(x.group_norm(3, None, None, f32::NAN).is_err());
}

#[test]
fn batch_norm_options_follow_pytorch() {
    let _s = serial();
    let dev = device();
    let (a, av) = random_tensor(&[4, 2, 3], 50);
    let (b, bv) = random_tensor(&[4, 2, 3], 51);
    // momentum None: the running mean is the plain average of the batches' means.
    let cumulative = nn::BatchNorm1d::with_options(
        2,
        nn::BatchNormOptions {
            momentum: None,
            ..Default::default()
        },
        dev,
    )
    .unwrap();
    cumulative.forward(&a).unwrap();
    cumulative.forward(&b).unwrap();
    let channel_mean = |v: &[f32], c: usize| {
        (0..4)
            .flat_map(|n| (0..3).map(move |l| v[(n * 2 + c) * 3 + l] as f64))
            .sum::<f64>()
            / 12.0
    };
    let want: Vec<f64> = (0..2)
        .map(|c| (channel_mean(&av, c) + channel_mean(&bv, c)) / 2.0)
        .collect();
    assert_close(
        &cumulative.running_mean.to_vec().unwrap(),
        &want,
        1e-5,
        "cumulative mean",
    );
    assert_eq!(cumulative.num_batches_tracked.item().unwrap(), 2.0);
    let names: Vec<String> = cumulative
        .named_buffers()
        .into_iter()
        .map(|(n, _)| n)
        .collect();
    assert_eq!(
        names,
        ["running_mean", "running_var", "num_batches_tracked"]
    );
    // affine false: no parameters, the output only normalised; no tracking: no buffers, batch
    // statistics in eval mode too.
    let bare = nn::BatchNorm1d::with_options(
        2,
        nn::BatchNormOptions {
            affine: false,
            track_running_stats: false,
            ..Default::default()
        },
        dev,
    )
    .unwrap();
    assert!(bare.parameters().is_empty() && bare.named_buffers().is_empty());
    let train_out = bare.forward(&a).unwrap().to_vec().unwrap();
    bare.eval();
    assert_eq!(bare.forward(&a).unwrap().to_vec().unwrap(), train_out);
    let bad = nn::BatchNormOptions {
        momentum: Some(1.5),
        ..Default::default()
    };
    assert!(nn::BatchNorm2d::with_options(2, bad, dev).is_err());
}

#[test]
fn normal_and_uniform_draw_from_the_global_generator() {
    let _s = serial();
    let dev = device();
    manual_seed(3);
    let a = Tensor::normal(&[10_000], 1.0, 2.0, dev)
        .unwrap()
        .to_vec()
        .unwrap();
    let b = Tensor::normal(&[10_000], 1.0, 2.0, dev)
        .unwrap()
        .to_vec()
        .unwrap();
    assert_ne!(a, b, "a second call draws new values");
    manual_seed(3);
    assert_eq!(
        Tensor::normal(&[10_000], 1.0, 2.0, dev)
            .unwrap()
            .to_vec()
            .unwrap(),
        a
    );
    let mean = a.iter().map(|&v| v as f64).sum::<f64>() / a.len() as f64;
    let std = (a.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / a.len() as f64).sqrt();
    assert!(
        (mean - 1.0).abs() < 0.1 && (std - 2.0).abs() < 0.1,
        "{mean} {std}"
    );
    let u = Tensor::uniform(&[10_000], -3.0, 5.0, dev)
        .unwrap()
        .to_vec()
        .unwrap();
    assert!(u.iter().all(|&v| (-3.0..5.0).contains(&v)));
    assert!(u.iter().any(|&v| v < -2.9) && u.iter().any(|&v| v > 4.9));
}

#[test]
fn nn_init_writes_in_place_within_torchs_bounds() {
    let _s = serial();
    let dev = device();
    let lin = nn::Linear::new(300, 200, true, dev).unwrap();
    let w = &lin.weight;
    let storage = format!("{w:?}");
    let max_abs = |t: &Tensor| t.to_vec().unwrap().iter().fold(0f32, |m, v| m.max(v.abs()));
    nn::init::kaiming_uniform_(w, 0.0).unwrap();
    let bound = (2.0f32).sqrt() * (3.0f32 / 300.0).sqrt();
    assert!(
        max_abs(w) <= bound && max_abs(w) > 0.9 * bound,
        "{}",
        max_abs(w)
    );
    nn::init::xavier_uniform_(w, 1.0).unwrap();
    let bound = (6.0f32 / 500.0).sqrt();
    assert!(max_abs(w) <= bound && max_abs(w) > 0.9 * bound);
    nn::init::trunc_normal_(w, 0.0, 0.02, -0.04, 0.04).unwrap();
    assert!(max_abs(w) <= 0.04);
    nn::init::normal_(w, 0.0, 0.02).unwrap();
    assert!(
        max_abs(w) > 0.04,
        "an untruncated normal reaches past two deviations"
    );
    nn::init::constant_(w, 0.5).unwrap();
    assert!(w.to_vec().unwrap().iter().all(|&v| v == 0.5));
    let bias = lin.bias.as_ref().unwrap();
    nn::init::zeros_(bias).unwrap();
    assert!(bias.to_vec().unwrap().iter().all(|&v| v == 0.0));
    nn::init::ones_(bias).unwrap();
    nn::init::uniform_(bias, 2.0, 3.0).unwrap();
    assert!(bias
        .to_vec()
        .unwrap()
        .iter()
        .all(|&v| (2.0..3.0).contains(&v)));
    // The same tensors, still parameters: in place.
    assert_eq!(format!("{w:?}"), storage);
    assert!(w.requires_grad());
    assert!(
        nn::init::kaiming_uniform_(bias, 0.0).is_err(),
        "no fans below two dims"
    );
    assert!(nn::init::trunc_normal_(w, 0.0, 1.0, 1.0, -1.0).is_err());
}
