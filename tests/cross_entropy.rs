//! `nn::loss::cross_entropy_with`: ignore_index, label smoothing, class weights, the three
//! reductions and logits `[N, C, d1, ..]`, against an f64 CPU reference of torch's formula
//! (loss and grad) on both kernel flavours, against finite differences, and its errors.

mod common;
use common::*;
use wgrad::nn::loss::{
    cross_entropy, cross_entropy_with, nll_with, CrossEntropyOptions, NllOptions, Reduction,
    IGNORE_INDEX,
};
use wgrad::{Device, Error, KernelFlavor, Tensor};

/// Torch's options on the host side.
#[derive(Clone, Default)]
struct Options {
    ignore_index: Option<u32>,
    label_smoothing: f64,
    weight: Option<Vec<f32>>,
    reduction: Reduction,
}

/// Per-row losses and their grads (d row loss / d logits) of `x` `[m, c]` for `y`, torch's
/// formula: `(1 - s) w[y] (lse - x[y]) + s / c sum_k w[k] (lse - x[k])`, 0 when ignored.
fn rows_reference(x: &[f32], y: &[u32], c: usize, o: &Options) -> (Vec<f64>, Vec<f64>) {
    let w = |k: usize| o.weight.as_ref().map_or(1.0, |w| w[k] as f64);
    let s = o.label_smoothing;
    let mut losses = vec![0.0; y.len()];
    let mut grads = vec![0.0; x.len()];
    for (i, &label) in y.iter().enumerate() {
        if o.ignore_index == Some(label) {
            continue;
        }
        let row: Vec<f64> = x[i * c..(i + 1) * c].iter().map(|&v| v as f64).collect();
        let m = row.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let lse = m + row.iter().map(|v| (v - m).exp()).sum::<f64>().ln();
        let t = label as usize;
        let w_sum: f64 = (0..c).map(w).sum();
        losses[i] = (1.0 - s) * w(t) * (lse - row[t])
            + s / c as f64 * (0..c).map(|k| w(k) * (lse - row[k])).sum::<f64>();
        for k in 0..c {
            let p = (row[k] - lse).exp();
            let one = if k == t { 1.0 } else { 0.0 };
            grads[i * c + k] = (1.0 - s) * w(t) * (p - one) + s / c as f64 * (p * w_sum - w(k));
        }
    }
    (losses, grads)
}

/// The loss and the logits' grad of `x` `[m, c]` under the reduction: what `sum`/`mean` of
/// the rows give, the grad of `None` taken against an out grad of `g`.
fn reference(x: &[f32], y: &[u32], c: usize, o: &Options, g: &[f32]) -> (Vec<f64>, Vec<f64>) {
    let (losses, row_grads) = rows_reference(x, y, c, o);
    let w = |k: u32| o.weight.as_ref().map_or(1.0, |w| w[k as usize] as f64);
    let per_row: Vec<f64> = match o.reduction {
        Reduction::None => g.iter().map(|&v| v as f64).collect(),
        Reduction::Sum => vec![1.0; y.len()],
        Reduction::Mean => {
            let total: f64 = y
                .iter()
                .filter(|&&t| o.ignore_index != Some(t))
                .map(|&t| w(t))
                .sum();
            vec![1.0 / total; y.len()]
        }
    };
    let grads = row_grads
        .iter()
        .enumerate()
        .map(|(at, d)| d * per_row[at / c])
        .collect();
    let loss = match o.reduction {
        Reduction::None => losses,
        _ => vec![losses.iter().zip(&per_row).map(|(l, f)| l * f).sum()],
    };
    (loss, grads)
}

/// Checks one call on `dev` of logits `[n, c]` against the reference.
fn check(dev: &Device, n: usize, c: usize, o: &Options, what: &str) {
    let what = format!("{what} n {n} c {c} flavor {:?}", dev.kernel_flavor());
    let xv: Vec<f32> = random_vec(n * c, 11).iter().map(|v| v * 3.0).collect();
    let labels = labels_for(n, c, o);
    let x = Tensor::from_slice(&xv, &[n, c], dev)
        .unwrap()
        .requires_grad_(true);
    let y = Tensor::from_vec_u32(labels.clone(), &[n], dev).unwrap();
    let weight = o
        .weight
        .as_ref()
        .map(|w| Tensor::from_slice(w, &[c], dev).unwrap());
    let opts = CrossEntropyOptions {
        ignore_index: o.ignore_index,
        label_smoothing: o.label_smoothing as f32,
        weight: weight.as_ref(),
        reduction: o.reduction,
    };
    let loss = cross_entropy_with(&x, &y, &opts).unwrap();
    let gv = random_vec(n, 12);
    if o.reduction == Reduction::None {
        assert_eq!(loss.shape(), &[n], "{what}");
        loss.mul(&Tensor::from_slice(&gv, &[n], dev).unwrap())
            .unwrap()
            .sum()
            .unwrap()
            .backward()
            .unwrap();
    } else {
        assert_eq!(loss.shape(), &[] as &[usize], "{what}");
        loss.backward().unwrap();
    }
    let (want_loss, want_grad) = reference(&xv, &labels, c, o, &gv);
    assert_close(
        &loss.to_vec().unwrap(),
        &want_loss,
        1e-5,
        &format!("loss, {what}"),
    );
    let grad = x.grad().unwrap().to_vec().unwrap();
    assert_close(&grad, &want_grad, 1e-5, &format!("grad, {what}"));
}

/// Labels of `n` rows of `c` classes; where `o` ignores a marker past the classes (torch's
/// -100), every fourth row holds the marker instead.
fn labels_for(n: usize, c: usize, o: &Options) -> Vec<u32> {
    (0..n)
        .map(|i| match o.ignore_index {
            Some(marker) if marker as usize >= c && i % 4 == 2 => marker,
            _ => ((i * 3 + 1) % c) as u32,
        })
        .collect()
}

/// The calls on the shared device (the serial row kernels past 64 rows on lavapipe) and on one
/// forced to the GPU flavour (a workgroup per row).
fn on_both_flavours(calls: impl Fn(&Device)) {
    calls(device());
    let gpu = Device::software().unwrap();
    gpu.set_kernel_flavor(KernelFlavor::Gpu);
    calls(&gpu);
}

fn weights(c: usize) -> Vec<f32> {
    values_in(c, 0.2, 2.0, 13)
}

#[test]
fn ignore_index_drops_rows_from_the_loss_and_the_mean() {
    on_both_flavours(|dev| {
        for n in [5, 70] {
            let o = Options {
                ignore_index: Some(0),
                ..Default::default()
            };
            check(dev, n, 7, &o, "ignore_index");
        }
    });
}

#[test]
fn an_ignore_index_past_the_classes_marks_targets_as_torchs_minus_100_does() {
    on_both_flavours(|dev| {
        for marker in [IGNORE_INDEX, 1000] {
            for reduction in [Reduction::Mean, Reduction::Sum, Reduction::None] {
                for n in [5, 70] {
                    let plain = Options {
                        ignore_index: Some(marker),
                        reduction,
                        ..Default::default()
                    };
                    check(dev, n, 7, &plain, "marker");
                    let every_option = Options {
                        label_smoothing: 0.2,
                        weight: Some(weights(7)),
                        ..plain
                    };
                    check(dev, n, 7, &every_option, "marker with every option");
                }
            }
        }
    });
}

#[test]
fn a_label_past_the_classes_other_than_the_ignore_index_is_an_error() {
    let dev = device();
    let x = Tensor::zeros(&[3, 10], dev).unwrap();
    let opts = CrossEntropyOptions {
        ignore_index: Some(100),
        ..Default::default()
    };
    for (labels, needle) in [
        (
            vec![3, 100, 12],
            "label 12 is out of range for 10 classes and is not the ignore_index 100",
        ),
        (vec![3, 200, 100], "label 200"),
        (vec![3, 200, 5], "label 200"),
    ] {
        let y = Tensor::from_labels(labels, dev).unwrap();
        let e = expect_error(cross_entropy_with(&x, &y, &opts), needle);
        assert!(matches!(e, Error::Index { .. }), "{e:?}");
    }
    // Without an ignore_index, the marker is a label like any other.
    let y = Tensor::from_labels(vec![3, IGNORE_INDEX, 1], dev).unwrap();
    expect_error(cross_entropy(&x, &y), &format!("label {IGNORE_INDEX}"));
}

#[test]
fn index_ops_refuse_labels_that_hold_the_ignore_marker() {
    let dev = device();
    let y = Tensor::from_labels(vec![3, IGNORE_INDEX, 1], dev).unwrap();
    let table = Tensor::zeros(&[10, 2], dev).unwrap();
    let e = table.index_select(0, &y).unwrap_err();
    assert!(
        matches!(
            e,
            Error::Index {
                op: "index_select",
                ..
            }
        ),
        "{e:?}"
    );
}

#[test]
fn labels_joined_or_sliced_keep_their_ignore_marker() {
    let dev = device();
    let x = Tensor::randn(&[6, 5], 3, dev).unwrap();
    let a = Tensor::from_labels(vec![4, IGNORE_INDEX, 0], dev).unwrap();
    let b = Tensor::from_labels(vec![IGNORE_INDEX, 2, 1], dev).unwrap();
    let opts = CrossEntropyOptions {
        ignore_index: Some(IGNORE_INDEX),
        reduction: Reduction::None,
        ..Default::default()
    };
    let joined = Tensor::cat(&[a.clone(), b], 0).unwrap();
    let losses = cross_entropy_with(&x, &joined, &opts)
        .unwrap()
        .to_vec()
        .unwrap();
    assert_eq!(losses[1], 0.0);
    assert_eq!(losses[3], 0.0);
    assert!(
        losses
            .iter()
            .enumerate()
            .all(|(i, &l)| i == 1 || i == 3 || l > 0.0),
        "{losses:?}"
    );
    let rows = x.narrow(0, 0, 2).unwrap();
    let head = a.narrow(0, 0, 2).unwrap();
    let losses = cross_entropy_with(&rows, &head, &opts)
        .unwrap()
        .to_vec()
        .unwrap();
    assert_eq!(losses[1], 0.0);
    // A marker other than the one the loss ignores still fails it.
    let other = CrossEntropyOptions {
        ignore_index: Some(7),
        ..opts
    };
    expect_error(cross_entropy_with(&x, &joined, &other), "ignore_index 7");
}

/// `nll_with` of a `log_softmax` is `cross_entropy_with`, option for option (smoothing
/// aside), values and grads: for `[N, C]` and `[N, C, d]` logits, a class or a marker
/// ignored, class weights or none, each reduction.
#[test]
fn nll_with_options_of_a_log_softmax_is_cross_entropy_with_them() {
    let dev = device();
    let w = Tensor::from_slice(&weights(5), &[5], dev).unwrap();
    for (shape, labels) in [
        (vec![6, 5], vec![4, 0, IGNORE_INDEX, 2, 2, 1]),
        (vec![2, 5, 3], vec![1, IGNORE_INDEX, 4, 0, 3, 3]),
    ] {
        let target_shape: Vec<usize> = [shape[0]].into_iter().chain(shape[2..].to_vec()).collect();
        for ignore_index in [None, Some(IGNORE_INDEX), Some(3)] {
            // The marker where it is ignored, else class 3 in its place.
            let marked: Vec<u32> = labels
                .iter()
                .map(|&l| match (l, ignore_index) {
                    (IGNORE_INDEX, Some(IGNORE_INDEX)) => l,
                    (IGNORE_INDEX, _) => 3,
                    _ => l,
                })
                .collect();
            let y = Tensor::from_vec_u32(marked, &target_shape, dev).unwrap();
            for weight in [None, Some(&w)] {
                for reduction in [Reduction::Mean, Reduction::Sum, Reduction::None] {
                    let what = format!(
                        "{shape:?} {ignore_index:?} weighted {} {reduction:?}",
                        weight.is_some()
                    );
                    let grads = |use_nll: bool| {
                        let x = Tensor::from_slice(&random_vec(30, 21), &shape, dev)
                            .unwrap()
                            .requires_grad_(true);
                        let loss = if use_nll {
                            let opts = NllOptions {
                                ignore_index,
                                weight,
                                reduction,
                            };
                            nll_with(&x.log_softmax(1).unwrap(), &y, &opts).unwrap()
                        } else {
                            let opts = CrossEntropyOptions {
                                ignore_index,
                                weight,
                                reduction,
                                ..Default::default()
                            };
                            cross_entropy_with(&x, &y, &opts).unwrap()
                        };
                        let values = loss.to_vec().unwrap();
                        loss.sum().unwrap().backward().unwrap();
                        (values, x.grad().unwrap().to_vec().unwrap())
                    };
                    let ((nll_values, nll_grad), (ce_values, ce_grad)) =
                        (grads(true), grads(false));
                    let as_f64 = |v: &[f32]| v.iter().map(|&x| x as f64).collect::<Vec<_>>();
                    assert_close(
                        &nll_values,
                        &as_f64(&ce_values),
                        1e-5,
                        &format!("loss, {what}"),
                    );
                    assert_close(&nll_grad, &as_f64(&ce_grad), 1e-5, &format!("grad, {what}"));
                }
            }
        }
    }
    // 16-bit log-probabilities give a loss of their dtype, computed in f32.
    let x = Tensor::from_slice(&random_vec(10, 22), &[2, 5], dev).unwrap();
    let y = Tensor::from_labels(vec![4, IGNORE_INDEX], dev).unwrap();
    let opts = NllOptions {
        ignore_index: Some(IGNORE_INDEX),
        ..Default::default()
    };
    let log_probs = x.log_softmax(1).unwrap();
    let wide = nll_with(&log_probs, &y, &opts).unwrap().item().unwrap();
    let half = log_probs.to_dtype(wgrad::DType::BF16).unwrap();
    let narrow = nll_with(&half, &y, &opts).unwrap();
    assert_eq!(narrow.dtype(), wgrad::DType::BF16);
    let narrow = narrow.to_dtype(wgrad::DType::F32).unwrap().item().unwrap();
    assert!(
        (narrow - wide).abs() <= 0.02 * wide.abs(),
        "{narrow} vs {wide}"
    );
    // A marker that is not the ignore_index is a target out of range.
    let marked = Tensor::from_labels(vec![1, IGNORE_INDEX], dev).unwrap();
    let log_probs = Tensor::zeros(&[2, 5], dev).unwrap();
    let err = nll_with(&log_probs, &marked, &NllOptions::default()).unwrap_err();
    let msg = err.to_string();
    assert!(
        msg.starts_with("nll: ") && msg.contains("target 4294967295"),
        "{msg}"
    );
}

#[test]
fn label_smoothing_matches_torch_formula() {
    on_both_flavours(|dev| {
        for n in [3, 70] {
            let o = Options {
                label_smoothing: 0.1,
                ..Default::default()
            };
            check(dev, n, 9, &o, "label_smoothing");
        }
        let o = Options {
            label_smoothing: 1.0,
            ..Default::default()
        };
        check(dev, 4, 5, &o, "label_smoothing 1");
    });
}

#[test]
fn class_weights_weigh_rows_and_the_mean() {
    on_both_flavours(|dev| {
        for n in [6, 70] {
            let o = Options {
                weight: Some(weights(6)),
                ..Default::default()
            };
            check(dev, n, 6, &o, "weight");
        }
    });
}

#[test]
fn every_option_together_under_each_reduction() {
    on_both_flavours(|dev| {
        for reduction in [Reduction::Mean, Reduction::Sum, Reduction::None] {
            for n in [1, 9, 70] {
                let o = Options {
                    ignore_index: Some(2),
                    label_smoothing: 0.2,
                    weight: Some(weights(5)),
                    reduction,
                };
                check(dev, n, 5, &o, &format!("all options {reduction:?}"));
            }
        }
    });
}

#[test]
fn plain_cross_entropy_is_the_default_options() {
    let dev = device();
    let (x, _) = random_tensor(&[10, 4], 20);
    let y = Tensor::from_vec_u32(vec![0, 1, 2, 3, 0, 1, 2, 3, 0, 1], &[10], dev).unwrap();
    let plain = cross_entropy(&x, &y).unwrap().item().unwrap();
    let with = cross_entropy_with(&x, &y, &CrossEntropyOptions::default())
        .unwrap()
        .item()
        .unwrap();
    assert_eq!(plain, with);
    let o = Options::default();
    let (want, _) = reference(&x.to_vec().unwrap(), &y.to_vec_u32().unwrap(), 4, &o, &[]);
    assert_close(&[plain], &want, 1e-6, "plain cross_entropy");
}

/// `[N, C, H, W]` logits (segmentation) with `[N, H, W]` targets give what the rows with the
/// classes last give; `None` keeps the targets' shape.
#[test]
fn logits_with_extra_dims_take_classes_on_dim_1() {
    let dev = device();
    let (n, c, h, w) = (2, 3, 4, 5);
    let (x, xv) = random_tensor(&[n, c, h, w], 21);
    let labels: Vec<u32> = (0..n * h * w).map(|i| (i % c) as u32).collect();
    let y = Tensor::from_vec_u32(labels.clone(), &[n, h, w], dev).unwrap();
    let opts = CrossEntropyOptions {
        ignore_index: Some(1),
        label_smoothing: 0.05,
        reduction: Reduction::None,
        ..Default::default()
    };
    let got = cross_entropy_with(&x, &y, &opts).unwrap();
    assert_eq!(got.shape(), &[n, h, w]);
    // The same logits with the classes moved last, on the host.
    let mut rows = vec![0.0; xv.len()];
    for b in 0..n {
        for k in 0..c {
            for p in 0..h * w {
                rows[(b * h * w + p) * c + k] = xv[(b * c + k) * h * w + p];
            }
        }
    }
    let o = Options {
        ignore_index: Some(1),
        label_smoothing: 0.05,
        ..Default::default()
    };
    let (want, _) = rows_reference(&rows, &labels, c, &o);
    assert_close(&got.to_vec().unwrap(), &want, 1e-5, "[N, C, H, W]");
}

#[test]
fn cross_entropy_with_options_passes_gradcheck() {
    let dev = device();
    for (n, extra) in [(1, vec![]), (3, vec![2])] {
        let mut shape = vec![n, 4];
        shape.extend(&extra);
        let m: usize = n * extra.iter().product::<usize>();
        let mut target_shape = vec![n];
        target_shape.extend(&extra);
        let labels: Vec<u32> = (0..m).map(|i| (i * 3 % 4) as u32).collect();
        let weight = Tensor::from_slice(&weights(4), &[4], dev).unwrap();
        gradcheck(
            &format!("cross_entropy_with {shape:?}"),
            &[(shape.clone(), values_in(n * 4 * m / n, -2.0, 2.0, 30))],
            |x| {
                let y = Tensor::from_vec_u32(labels.clone(), &target_shape, device())?;
                let opts = CrossEntropyOptions {
                    ignore_index: Some(3),
                    label_smoothing: 0.1,
                    weight: Some(&weight),
                    reduction: Reduction::Mean,
                };
                cross_entropy_with(&x[0], &y, &opts)
            },
        );
    }
}

#[test]
fn cross_entropy_with_options_of_a_view_passes_gradcheck() {
    let dev = device();
    let labels = vec![2u32, 0, 1];
    // Logits [3, 4] read as the transpose of a [4, 3] leaf.
    gradcheck(
        "cross_entropy_with of a view",
        &[(vec![4, 3], values_in(12, -2.0, 2.0, 31))],
        |x| {
            let y = Tensor::from_vec_u32(labels.clone(), &[3], dev)?;
            let opts = CrossEntropyOptions {
                ignore_index: Some(1),
                label_smoothing: 0.2,
                ..Default::default()
            };
            cross_entropy_with(&x[0].t()?, &y, &opts)
        },
    );
}

/// With every target ignored the mean is 0 / 0: NaN, as torch gives; the sum is 0.
#[test]
fn every_target_ignored_gives_nan_mean_and_zero_sum() {
    let dev = device();
    let (x, _) = random_tensor(&[3, 4], 40);
    let x = x.requires_grad_(true);
    let y = Tensor::from_vec_u32(vec![2, 2, 2], &[3], dev).unwrap();
    let mut opts = CrossEntropyOptions {
        ignore_index: Some(2),
        ..Default::default()
    };
    let mean = cross_entropy_with(&x, &y, &opts).unwrap();
    assert!(mean.item().unwrap().is_nan());
    opts.reduction = Reduction::Sum;
    let sum = cross_entropy_with(&x, &y, &opts).unwrap();
    assert_eq!(sum.item().unwrap(), 0.0);
    sum.backward().unwrap();
    assert!(x
        .grad()
        .unwrap()
        .to_vec()
        .unwrap()
        .iter()
        .all(|&g| g == 0.0));
}

fn expect_error(result: wgrad::Result<Tensor>, needle: &str) -> Error {
    match result {
        Err(e) => {
            let msg = e.to_string();
            assert!(msg.contains("cross_entropy"), "{msg}");
            assert!(msg.contains(needle), "{msg} lacks {needle}");
            e
        }
        Ok(t) => panic!("expected an error, got a tensor of shape {:?}", t.shape()),
    }
}

#[test]
fn bad_options_are_errors_naming_the_shapes() {
    let dev = device();
    let x = Tensor::zeros(&[2, 3, 4], dev).unwrap();
    let y = Tensor::from_vec_u32(vec![0; 8], &[2, 4], dev).unwrap();
    let with = |x: &Tensor, y: &Tensor, opts: CrossEntropyOptions| cross_entropy_with(x, y, &opts);
    let bad_y = Tensor::from_vec_u32(vec![0; 6], &[2, 3], dev).unwrap();
    expect_error(with(&x, &bad_y, Default::default()), "[2, 3]");
    let smoothing = CrossEntropyOptions {
        label_smoothing: 1.5,
        ..Default::default()
    };
    expect_error(with(&x, &y, smoothing), "label_smoothing");
    let w = Tensor::ones(&[4], dev).unwrap();
    let short = CrossEntropyOptions {
        weight: Some(&w),
        ..Default::default()
    };
    expect_error(with(&x, &y, short), "[4]");
    let out_of_range = Tensor::from_vec_u32(vec![5; 8], &[2, 4], dev).unwrap();
    let e = expect_error(with(&x, &out_of_range, Default::default()), "label 5");
    assert!(matches!(e, Error::Index { .. }));
}
