//! conv2d, max_pool2d and avg_pool2d against CPU references in f64, their backward rules
//! against finite differences (S-13), and their errors.

mod common;
use common::*;
use wgrad::nn::{self, Module};
use wgrad::{Conv1dOptions, Conv2dOptions, ConvTranspose2dOptions, Error, Pool2dOptions, Tensor};

/// PyTorch's conv2d on the CPU: x [n, c_in, h, w], w [c_out, c_in / groups, kh, kw].
fn conv_reference(
    x: &[f32],
    xs: [usize; 4],
    w: &[f32],
    ws: [usize; 4],
    bias: Option<&[f32]>,
    o: Conv2dOptions,
) -> (Vec<f64>, [usize; 4]) {
    let [n, c_in, h, wd] = xs;
    let [c_out, cg, kh, kw] = ws;
    let (sh, sw) = o.stride;
    let (ph, pw) = o.padding;
    let (dh, dw) = o.dilation;
    let oh = (h + 2 * ph - (dh * (kh - 1) + 1)) / sh + 1;
    let ow = (wd + 2 * pw - (dw * (kw - 1) + 1)) / sw + 1;
    let per_group_out = c_out / o.groups;
    let mut out = vec![0.0f64; n * c_out * oh * ow];
    for b in 0..n {
        for co in 0..c_out {
            let g = co / per_group_out;
            for y in 0..oh {
                for xo in 0..ow {
                    let mut acc = bias.map_or(0.0, |bv| bv[co] as f64);
                    for ci in 0..cg {
                        let cin = g * cg + ci;
                        for ky in 0..kh {
                            for kx in 0..kw {
                                let iy = (y * sh + ky * dh) as isize - ph as isize;
                                let ix = (xo * sw + kx * dw) as isize - pw as isize;
                                if iy < 0 || ix < 0 || iy >= h as isize || ix >= wd as isize {
                                    continue;
                                }
                                let xv = x[((b * c_in + cin) * h + iy as usize) * wd + ix as usize];
                                let wv = w[((co * cg + ci) * kh + ky) * kw + kx];
                                acc += xv as f64 * wv as f64;
                            }
                        }
                    }
                    out[((b * c_out + co) * oh + y) * ow + xo] = acc;
                }
            }
        }
    }
    (out, [n, c_out, oh, ow])
}

fn options(stride: usize, padding: usize, dilation: usize, groups: usize) -> Conv2dOptions {
    Conv2dOptions {
        stride: (stride, stride),
        padding: (padding, padding),
        dilation: (dilation, dilation),
        groups,
    }
}

/// Options that differ along H and W: `((stride), (padding), (dilation))`.
fn per_axis(
    stride: (usize, usize),
    padding: (usize, usize),
    dilation: (usize, usize),
) -> Conv2dOptions {
    Conv2dOptions {
        stride,
        padding,
        dilation,
        groups: 1,
    }
}

type Case = ([usize; 4], [usize; 4], Conv2dOptions);

/// Each case's conv2d with a bias against the CPU reference, on random values drawn from
/// seeds `seed ..`.
fn check_against_reference(cases: &[Case], seed: u64) {
    for (i, &(xs, ws, o)) in cases.iter().enumerate() {
        let seed = seed + 3 * i as u64;
        let (x, xv) = random_tensor(&xs, seed);
        let (w, wv) = random_tensor(&ws, seed + 1);
        let (b, bv) = random_tensor(&[ws[0]], seed + 2);
        let got = x.conv2d_with(&w, Some(&b), o).unwrap();
        let (want, shape) = conv_reference(&xv, xs, &wv, ws, Some(&bv), o);
        assert_eq!(got.shape(), &shape, "case {i} shape");
        assert_close(
            &got.to_vec().unwrap(),
            &want,
            1e-4,
            &format!("conv2d case {i}"),
        );
    }
}

#[test]
fn conv2d_matches_cpu_reference() {
    let dev = device();
    let cases = [
        ([1, 1, 5, 5], [1, 1, 3, 3], options(1, 0, 1, 1)),
        ([3, 2, 7, 6], [4, 2, 3, 3], options(1, 1, 1, 1)),
        ([2, 3, 9, 8], [5, 3, 3, 2], options(2, 1, 1, 1)),
        ([2, 2, 9, 9], [3, 2, 3, 3], options(1, 2, 2, 1)),
        ([2, 4, 6, 5], [6, 2, 3, 3], options(1, 1, 1, 2)),
        ([1, 3, 28, 28], [8, 3, 5, 5], options(3, 2, 1, 1)),
        ([2, 1, 4, 4], [2, 1, 1, 1], options(1, 0, 1, 1)),
        // Per-axis options and kernels that are not square (col2im's general entry too).
        ([2, 2, 7, 9], [3, 2, 1, 3], per_axis((1, 2), (0, 1), (1, 1))),
        ([1, 3, 6, 8], [2, 3, 3, 2], per_axis((2, 1), (1, 0), (1, 2))),
        ([2, 2, 5, 5], [2, 2, 3, 1], per_axis((1, 1), (2, 0), (2, 1))),
    ];
    check_against_reference(&cases, 10);
    let x = Tensor::zeros(&[0, 2, 5, 5], dev).unwrap();
    let w = Tensor::ones(&[3, 2, 3, 3], dev).unwrap();
    assert_eq!(x.conv2d(&w, None, 1, 1).unwrap().shape(), &[0, 3, 5, 5]);
}

/// Output pixels in whole 4s per image: on 8-wide subgroups the forward reads the column
/// matrix straight from the images (one implicit GEMM, k padded to whole 4s) instead of
/// writing it with im2col. Ragged row and column tiles, channel counts that do and do not
/// fill steps of 4, strides, dilation, groups, a strided input view.
#[test]
fn conv2d_read_from_the_images_matches_cpu_reference() {
    let cases = [
        ([2, 1, 8, 8], [6, 1, 3, 3], options(1, 1, 1, 1)),
        ([2, 3, 8, 8], [5, 3, 3, 3], options(1, 1, 1, 1)),
        ([1, 2, 6, 6], [4, 2, 2, 2], options(2, 0, 1, 1)),
        ([3, 8, 6, 6], [5, 8, 3, 3], options(1, 1, 1, 1)),
        ([2, 4, 9, 8], [20, 4, 3, 3], options(2, 1, 1, 1)),
        ([2, 8, 10, 10], [3, 8, 3, 3], options(1, 2, 2, 1)),
        ([2, 8, 6, 6], [6, 4, 3, 3], options(1, 1, 1, 2)),
        ([1, 4, 28, 28], [8, 4, 5, 5], options(3, 2, 1, 1)),
        ([6, 4, 14, 14], [33, 4, 3, 3], options(1, 1, 1, 1)),
        ([2, 12, 4, 4], [7, 12, 1, 1], options(1, 0, 1, 1)),
        ([2, 3, 8, 8], [5, 3, 1, 3], per_axis((1, 1), (0, 1), (1, 1))),
        (
            [2, 4, 8, 12],
            [6, 4, 3, 3],
            per_axis((2, 1), (1, 2), (1, 2)),
        ),
    ];
    check_against_reference(&cases, 40);
    let (x, xv) = random_tensor(&[2, 4, 6, 6], 70);
    let (w, wv) = random_tensor(&[8, 4, 3, 3], 71);
    let view = x.transpose(2, 3).unwrap().transpose(2, 3).unwrap();
    let got = view.conv2d(&w, None, 1, 1).unwrap();
    let (want, _) = conv_reference(
        &xv,
        [2, 4, 6, 6],
        &wv,
        [8, 4, 3, 3],
        None,
        options(1, 1, 1, 1),
    );
    assert_close(
        &got.to_vec().unwrap(),
        &want,
        1e-4,
        "conv2d of a view read from the images",
    );
}

#[test]
fn conv2d_reads_strided_views_of_its_inputs() {
    let (x, xv) = random_tensor(&[2, 3, 5, 4], 1);
    let (w, wv) = random_tensor(&[2, 3, 3, 3], 2);
    // x.transpose(2, 3) twice is x again, but as a non-contiguous view in between.
    let xt = x.transpose(2, 3).unwrap();
    let got = xt.transpose(2, 3).unwrap().conv2d(&w, None, 1, 1).unwrap();
    let (want, _) = conv_reference(
        &xv,
        [2, 3, 5, 4],
        &wv,
        [2, 3, 3, 3],
        None,
        options(1, 1, 1, 1),
    );
    assert_close(&got.to_vec().unwrap(), &want, 1e-4, "conv2d of a view");
}

#[test]
fn conv2d_gradcheck() {
    for (xs, ws, stride, padding) in [
        ([1, 1, 5, 5], [2, 1, 3, 3], 1, 0),
        ([3, 2, 5, 4], [2, 2, 3, 3], 1, 1),
        ([1, 2, 7, 5], [3, 2, 3, 3], 2, 0),
        ([3, 1, 6, 7], [2, 1, 2, 3], 2, 1),
        ([2, 4, 4, 4], [3, 4, 3, 3], 1, 1),
    ] {
        let name = format!("conv2d x{xs:?} w{ws:?} stride {stride} padding {padding}");
        let bias = [ws[0]];
        gradcheck(
            &name,
            &[
                (xs.to_vec(), values_in(xs.iter().product(), -1.0, 1.0, 1)),
                (ws.to_vec(), values_in(ws.iter().product(), -1.0, 1.0, 2)),
                (bias.to_vec(), values_in(ws[0], -1.0, 1.0, 3)),
            ],
            |t| t[0].conv2d(&t[1], Some(&t[2]), stride, padding),
        );
    }
}

#[test]
fn conv2d_gradcheck_with_dilation_and_groups() {
    gradcheck(
        "conv2d dilation 2 groups 2",
        &[
            (vec![2, 4, 6, 6], values_in(288, -1.0, 1.0, 4)),
            (vec![4, 2, 2, 2], values_in(32, -1.0, 1.0, 5)),
        ],
        |t| t[0].conv2d_with(&t[1], None, options(1, 1, 2, 2)),
    );
}

#[test]
fn conv2d_gradcheck_with_per_axis_options() {
    for (n, o) in [
        (1, per_axis((2, 1), (1, 0), (1, 2))),
        (3, per_axis((1, 2), (0, 2), (2, 1))),
    ] {
        gradcheck(
            &format!("conv2d batch {n} {o:?}"),
            &[
                (vec![n, 2, 5, 6], values_in(n * 60, -1.0, 1.0, 6)),
                (vec![3, 2, 2, 3], values_in(36, -1.0, 1.0, 7)),
            ],
            |t| t[0].conv2d_with(&t[1], None, o),
        );
    }
}

/// The weight grad's k runs over every output pixel of the batch; past one chunk (4,096
/// steps) it is split across invocations and the partial sums added.
#[test]
fn conv2d_weight_grad_over_long_k_matches_cpu() {
    let dev = device();
    let (xs, ws) = ([3, 2, 40, 40], [2, 2, 3, 3]); // k = 3 * 40 * 40 = 4800
    let (x, xv) = random_tensor(&xs, 7);
    let (w, _) = random_tensor(&ws, 8);
    let w = w.requires_grad_(true);
    let y = x.conv2d(&w, None, 1, 1).unwrap();
    let (g, gv) = random_tensor(y.shape(), 9);
    y.mul(&g).unwrap().sum().unwrap().backward().unwrap();
    // d/dw[co, ci, ky, kx] = sum over b, oy, ox of g[b, co, oy, ox] x[b, ci, oy + ky - 1, ox + kx - 1]
    let mut want = vec![0.0f64; 36];
    for co in 0..2 {
        for ci in 0..2 {
            for ky in 0..3 {
                for kx in 0..3 {
                    let mut acc = 0.0;
                    for b in 0..3 {
                        for oy in 0..40 {
                            for ox in 0..40 {
                                let (iy, ix) = (oy + ky, ox + kx);
                                if iy < 1 || ix < 1 || iy > 40 || ix > 40 {
                                    continue;
                                }
                                let gval = gv[((b * 2 + co) * 40 + oy) * 40 + ox] as f64;
                                let xval = xv[((b * 2 + ci) * 40 + iy - 1) * 40 + ix - 1] as f64;
                                acc += gval * xval;
                            }
                        }
                    }
                    want[((co * 2 + ci) * 3 + ky) * 3 + kx] = acc;
                }
            }
        }
    }
    assert_close(
        &w.grad().unwrap().to_vec().unwrap(),
        &want,
        1e-3,
        "weight grad",
    );
    let _ = dev;
}

/// PyTorch's pools on the CPU (no padding).
fn pool_reference(x: &[f32], xs: [usize; 4], k: usize, s: usize, max: bool) -> Vec<f64> {
    let [n, c, h, w] = xs;
    let (oh, ow) = ((h - k) / s + 1, (w - k) / s + 1);
    let mut out = Vec::new();
    for p in 0..n * c {
        for y in 0..oh {
            for xo in 0..ow {
                let vals =
                    (0..k * k).map(|t| x[(p * h + y * s + t / k) * w + xo * s + t % k] as f64);
                out.push(if max {
                    vals.fold(f64::NEG_INFINITY, f64::max)
                } else {
                    vals.sum::<f64>() / (k * k) as f64
                });
            }
        }
    }
    out
}

#[test]
fn pools_match_cpu_reference() {
    for (xs, k, s) in [
        ([2, 3, 8, 8], 2, 2),
        ([1, 2, 7, 9], 3, 2),
        ([2, 1, 5, 5], 3, 1),
        ([1, 1, 1, 1], 1, 1),
    ] {
        let (x, xv) = random_tensor(&xs, 3);
        let got = x.max_pool2d(k, s).unwrap();
        let want = pool_reference(&xv, xs, k, s, true);
        assert_close(
            &got.to_vec().unwrap(),
            &want,
            1e-6,
            &format!("max_pool2d {xs:?} {k} {s}"),
        );
        let got = x.avg_pool2d(k, s).unwrap();
        let want = pool_reference(&xv, xs, k, s, false);
        assert_close(
            &got.to_vec().unwrap(),
            &want,
            1e-5,
            &format!("avg_pool2d {xs:?} {k} {s}"),
        );
    }
}

#[test]
fn pools_of_a_view_of_part_of_a_batch_read_that_part() {
    // Images 1 and 2 of three: a view that starts 2 * 8 * 8 elements into its buffer (the
    // kernels read from the buffer's start, so both pools gave image 0's windows).
    let (x, xv) = random_tensor(&[3, 2, 8, 8], 5);
    let part = x.narrow(0, 1, 2).unwrap();
    let part_values = &xv[2 * 8 * 8..];
    for (k, s) in [(2, 2), (3, 1)] {
        let want = pool_reference(part_values, [2, 2, 8, 8], k, s, true);
        let got = part.max_pool2d(k, s).unwrap().to_vec().unwrap();
        assert_close(&got, &want, 1e-6, &format!("max_pool2d of a view, {k} {s}"));
        let want = pool_reference(part_values, [2, 2, 8, 8], k, s, false);
        let got = part.avg_pool2d(k, s).unwrap().to_vec().unwrap();
        assert_close(&got, &want, 1e-5, &format!("avg_pool2d of a view, {k} {s}"));
    }
}

/// The input grads of both pools for an out grad `g`, on the CPU: each window's grad to its
/// first maximum, or spread evenly over it.
fn pool_backward_reference(
    x: &[f32],
    g: &[f32],
    xs: [usize; 4],
    k: usize,
    s: usize,
    max: bool,
) -> Vec<f64> {
    let [n, c, h, w] = xs;
    let (oh, ow) = ((h - k) / s + 1, (w - k) / s + 1);
    let mut grad = vec![0.0; x.len()];
    for p in 0..n * c {
        for y in 0..oh {
            for xo in 0..ow {
                let go = g[(p * oh + y) * ow + xo] as f64;
                let at = |t: usize| (p * h + y * s + t / k) * w + xo * s + t % k;
                if max {
                    let best = (0..k * k).fold(0, |b, t| if x[at(t)] > x[at(b)] { t } else { b });
                    grad[at(best)] += go;
                } else {
                    (0..k * k).for_each(|t| grad[at(t)] += go / (k * k) as f64);
                }
            }
        }
    }
    grad
}

/// Forward and backward passes over rows longer than one invocation's run (64 elements),
/// windows that straddle two runs, gaps between windows (stride > kernel), and a kernel large
/// enough to shorten the runs.
#[test]
fn pools_over_long_rows_match_cpu_reference() {
    for (xs, k, s) in [
        ([1, 2, 5, 150], 3, 2),
        ([2, 1, 4, 130], 2, 3),
        ([1, 1, 20, 90], 17, 1),
    ] {
        let (x, xv) = random_tensor(&xs, 9);
        for max in [true, false] {
            let x = x.detach().requires_grad_(true);
            let out = if max {
                x.max_pool2d(k, s)
            } else {
                x.avg_pool2d(k, s)
            }
            .unwrap();
            let what = format!("pool {xs:?} {k} {s} max {max}");
            let want = pool_reference(&xv, xs, k, s, max);
            assert_close(&out.to_vec().unwrap(), &want, 1e-5, &what);
            let (g, gv) = random_tensor(out.shape(), 10);
            out.mul(&g).unwrap().sum().unwrap().backward().unwrap();
            let want = pool_backward_reference(&xv, &gv, xs, k, s, max);
            let got = x.grad().unwrap().to_vec().unwrap();
            assert_close(&got, &want, 1e-5, &format!("grad of {what}"));
        }
    }
}

/// Windows that tile the input (stride = kernel, sides in whole windows) take a backward that
/// writes each window whole from its output; this checks it on rows longer than one run, on
/// one window per plane, and beside inputs whose last rows and columns no window covers.
#[test]
fn pool_grads_over_windows_that_tile_the_input_match_cpu_reference() {
    for (xs, k) in [
        ([2, 3, 4, 130], 2),
        ([1, 2, 6, 9], 3),
        ([3, 1, 2, 2], 2),
        ([1, 1, 7, 9], 2),
        ([1, 1, 5, 4], 1),
    ] {
        let (x, xv) = random_tensor(&xs, 11);
        for max in [true, false] {
            let x = x.detach().requires_grad_(true);
            let out = if max {
                x.max_pool2d(k, k)
            } else {
                x.avg_pool2d(k, k)
            }
            .unwrap();
            let (g, gv) = random_tensor(out.shape(), 12);
            out.mul(&g).unwrap().sum().unwrap().backward().unwrap();
            let want = pool_backward_reference(&xv, &gv, xs, k, k, max);
            let got = x.grad().unwrap().to_vec().unwrap();
            assert_close(
                &got,
                &want,
                1e-6,
                &format!("grad of pool {xs:?} {k} max {max}"),
            );
        }
    }
}

#[test]
fn pools_gradcheck() {
    // Distinct values, so that no window has a tie at its maximum.
    let distinct =
        |n: usize| -> Vec<f32> { (0..n).map(|i| ((i * 37) % n) as f32 * 0.1 - 1.0).collect() };
    for (xs, k, s) in [
        ([2, 2, 6, 6], 2, 2),
        ([1, 2, 7, 5], 3, 2),
        ([1, 1, 5, 5], 3, 1),
    ] {
        let n = xs.iter().product();
        gradcheck(
            &format!("max_pool2d {xs:?} {k} {s}"),
            &[(xs.to_vec(), distinct(n))],
            |t| t[0].max_pool2d(k, s),
        );
        gradcheck(
            &format!("avg_pool2d {xs:?} {k} {s}"),
            &[(xs.to_vec(), distinct(n))],
            |t| t[0].avg_pool2d(k, s),
        );
    }
}

#[test]
fn max_pool2d_sends_a_tied_grad_to_the_first_maximum() {
    let dev = device();
    let x = Tensor::from_vec(vec![1.0, 3.0, 3.0, 2.0], &[1, 1, 2, 2], dev)
        .unwrap()
        .requires_grad_(true);
    x.max_pool2d(2, 2)
        .unwrap()
        .sum()
        .unwrap()
        .backward()
        .unwrap();
    assert_eq!(
        x.grad().unwrap().to_vec().unwrap(),
        vec![0.0, 1.0, 0.0, 0.0]
    );
}

#[test]
fn max_pool2d_propagates_nan() {
    let dev = device();
    let x = Tensor::from_vec(vec![1.0, f32::NAN, 3.0, 2.0], &[1, 1, 2, 2], dev).unwrap();
    assert!(x.max_pool2d(2, 2).unwrap().to_vec().unwrap()[0].is_nan());
}

fn expect_error(result: wgrad::Result<Tensor>, op: &str, mentions: &str) {
    match result {
        Err(e @ (Error::Shape { .. } | Error::InvalidArgument { .. })) => {
            let msg = e.to_string();
            assert!(msg.contains(op) && msg.contains(mentions), "{msg}");
        }
        Err(e) => panic!("unexpected error kind: {e}"),
        Ok(t) => panic!("expected an error, got shape {:?}", t.shape()),
    }
}

#[test]
fn conv2d_rejects_bad_input() {
    let dev = device();
    let x = Tensor::zeros(&[2, 3, 5, 5], dev).unwrap();
    let w = Tensor::zeros(&[4, 3, 3, 3], dev).unwrap();
    expect_error(
        Tensor::zeros(&[3, 5, 5], dev)
            .unwrap()
            .conv2d(&w, None, 1, 0),
        "conv2d",
        "[3, 5, 5]",
    );
    expect_error(
        x.conv2d(&Tensor::zeros(&[4, 2, 3, 3], dev).unwrap(), None, 1, 0),
        "conv2d",
        "[4, 2, 3, 3]",
    );
    expect_error(
        x.conv2d(&Tensor::zeros(&[4, 3, 8, 8], dev).unwrap(), None, 1, 1),
        "conv2d",
        "7x7",
    );
    expect_error(x.conv2d(&w, None, 0, 0), "conv2d", "stride");
    expect_error(
        x.conv2d(&w, Some(&Tensor::zeros(&[3], dev).unwrap()), 1, 0),
        "conv2d",
        "bias",
    );
    expect_error(
        x.conv2d_with(&w, None, options(1, 0, 1, 2)),
        "conv2d",
        "group",
    );
}

#[test]
fn pools_reject_bad_input() {
    let dev = device();
    let x = Tensor::zeros(&[1, 1, 4, 4], dev).unwrap();
    expect_error(x.max_pool2d(5, 1), "max_pool2d", "[1, 1, 4, 4]");
    expect_error(x.avg_pool2d(2, 0), "avg_pool2d", "stride");
    expect_error(
        Tensor::zeros(&[4, 4], dev).unwrap().max_pool2d(2, 2),
        "max_pool2d",
        "[4, 4]",
    );
}

/// PyTorch's conv1d on the CPU: x [n, c_in, l], w [c_out, c_in / groups, k].
fn conv1d_reference(
    x: &[f32],
    [n, c_in, l]: [usize; 3],
    w: &[f32],
    [c_out, cg, k]: [usize; 3],
    o: Conv1dOptions,
) -> Vec<f64> {
    let lo = (l + 2 * o.padding - (o.dilation * (k - 1) + 1)) / o.stride + 1;
    let mut out = vec![0.0; n * c_out * lo];
    for b in 0..n {
        for co in 0..c_out {
            let g = co / (c_out / o.groups);
            for p in 0..lo {
                let mut acc = 0.0;
                for ci in 0..cg {
                    for t in 0..k {
                        let at = (p * o.stride + t * o.dilation) as isize - o.padding as isize;
                        if at >= 0 && (at as usize) < l {
                            let xv = x[(b * c_in + g * cg + ci) * l + at as usize] as f64;
                            acc += xv * w[(co * cg + ci) * k + t] as f64;
                        }
                    }
                }
                out[(b * c_out + co) * lo + p] = acc;
            }
        }
    }
    out
}

#[test]
fn conv1d_matches_cpu_reference() {
    for (i, (xs, ws, o)) in [
        ([2, 3, 11], [4, 3, 3], Conv1dOptions::default()),
        (
            [1, 2, 16],
            [2, 2, 5],
            Conv1dOptions {
                stride: 2,
                padding: 2,
                ..Default::default()
            },
        ),
        (
            [3, 4, 9],
            [6, 2, 3],
            Conv1dOptions {
                dilation: 2,
                padding: 1,
                groups: 2,
                stride: 1,
            },
        ),
    ]
    .into_iter()
    .enumerate()
    {
        let (x, xv) = random_tensor(&xs, 80 + i as u64);
        let (w, wv) = random_tensor(&ws, 90 + i as u64);
        let got = x.conv1d_with(&w, None, o).unwrap();
        let want = conv1d_reference(&xv, xs, &wv, ws, o);
        assert_eq!(got.numel(), want.len(), "case {i}");
        assert_close(
            &got.to_vec().unwrap(),
            &want,
            1e-4,
            &format!("conv1d case {i}"),
        );
    }
    let (x, _) = random_tensor(&[1, 1, 4], 99);
    let w = Tensor::ones(&[1, 1, 2], device()).unwrap();
    assert_eq!(x.conv1d(&w, None, 1, 1).unwrap().shape(), &[1, 1, 5]);
}

/// conv1d runs as a 2-d convolution; its errors still name conv1d and the shapes given to it.
#[test]
fn conv1d_errors_name_conv1d_and_its_shapes() {
    let x = Tensor::zeros(&[2, 3, 2], device()).unwrap();
    let cases = [
        (Tensor::zeros(&[4, 3, 3], device()).unwrap(), "does not fit"),
        (Tensor::zeros(&[4, 2, 1], device()).unwrap(), "C_out"),
    ];
    for (w, says) in cases {
        let err = x.conv1d(&w, None, 1, 0).unwrap_err().to_string();
        assert!(err.starts_with("conv1d: "), "{err}");
        assert!(
            err.contains("[2, 3, 2]") && err.contains(&format!("{:?}", w.shape())),
            "{err}"
        );
        assert!(err.contains(says), "{err}");
    }
}

/// A sequence longer than Mesa 22.3 lets one invocation loop (65,535 iterations), past one
/// product's k (16,384) too: forward, input grad and weight grad against the CPU.
#[test]
fn conv1d_over_a_sequence_past_65536_matches_cpu_reference() {
    let (len, c_in, c_out, k) = (70_001, 2, 3, 3);
    let (x, xv) = random_tensor(&[1, c_in, len], 120);
    let (w, wv) = random_tensor(&[c_out, c_in, k], 121);
    let (x, w) = (x.requires_grad_(true), w.requires_grad_(true));
    let o = Conv1dOptions {
        padding: 1,
        ..Default::default()
    };
    let y = x.conv1d_with(&w, None, o).unwrap();
    let want = conv1d_reference(&xv, [1, c_in, len], &wv, [c_out, c_in, k], o);
    assert_close(&y.to_vec().unwrap(), &want, 1e-4, "forward");
    let (g, gv) = random_tensor(y.shape(), 122);
    y.mul(&g).unwrap().sum().unwrap().backward().unwrap();
    // x[i] meets w[t] at output i + 1 - t; w[co, ci, t] meets x[p + t - 1] at output p.
    let mut want_x = vec![0.0f64; c_in * len];
    let mut want_w = vec![0.0f64; c_out * c_in * k];
    for co in 0..c_out {
        for ci in 0..c_in {
            for t in 0..k {
                let wv = wv[(co * c_in + ci) * k + t] as f64;
                for p in 0..len {
                    let Some(i) = (p + t).checked_sub(1).filter(|&i| i < len) else {
                        continue;
                    };
                    let gv = gv[co * len + p] as f64;
                    want_x[ci * len + i] += gv * wv;
                    want_w[(co * c_in + ci) * k + t] += gv * xv[ci * len + i] as f64;
                }
            }
        }
    }
    assert_close(
        &x.grad().unwrap().to_vec().unwrap(),
        &want_x,
        1e-4,
        "input grad",
    );
    assert_close(
        &w.grad().unwrap().to_vec().unwrap(),
        &want_w,
        1e-2,
        "weight grad",
    );
}

#[test]
fn conv1d_gradcheck() {
    for n in [1, 3] {
        gradcheck(
            &format!("conv1d batch {n}"),
            &[
                (vec![n, 2, 7], values_in(n * 14, -1.0, 1.0, 8)),
                (vec![3, 2, 3], values_in(18, -1.0, 1.0, 9)),
                (vec![3], values_in(3, -1.0, 1.0, 10)),
            ],
            |t| t[0].conv1d(&t[1], Some(&t[2]), 2, 1),
        );
    }
}

#[test]
fn conv_modules_take_rectangular_kernels_and_no_bias() {
    let dev = device();
    let options = Conv2dOptions {
        stride: (2, 1),
        padding: (1, 0),
        groups: 2,
        ..Default::default()
    };
    let conv = nn::Conv2d::with_options(4, 6, (3, 1), options, false, dev).unwrap();
    assert_eq!(conv.weight.shape(), &[6, 2, 3, 1]);
    let names: Vec<String> = conv
        .named_parameters()
        .into_iter()
        .map(|(n, _)| n)
        .collect();
    assert_eq!(names, vec!["weight"]);
    // Kaiming-uniform bound 1 / sqrt(C_in / groups kH kW) = 1 / sqrt(6).
    let bound = 1.0 / 6f32.sqrt();
    assert!(conv
        .weight
        .to_vec()
        .unwrap()
        .iter()
        .all(|w| w.abs() <= bound));
    let (x, _) = random_tensor(&[2, 4, 5, 3], 100);
    assert_eq!(conv.forward(&x).unwrap().shape(), &[2, 6, 3, 3]);
    let conv1 = nn::Conv1d::new(4, 2, 3, 1, 1, dev).unwrap();
    assert_eq!(conv1.parameters().len(), 2);
    let seq = x.reshape(&[2, 4, 15]).unwrap();
    let want = seq
        .conv1d(&conv1.weight, conv1.bias.as_ref(), 1, 1)
        .unwrap()
        .to_vec()
        .unwrap();
    assert_eq!(conv1.forward(&seq).unwrap().to_vec().unwrap(), want);
    assert!(nn::Conv2d::with_options(3, 4, (3, 3), options, true, dev).is_err());
    let err = x.conv1d(&conv1.weight, None, 1, 1).unwrap_err();
    assert!(err.to_string().contains("conv1d"), "{err}");
    assert!(err.to_string().contains("[2, 4, 5, 3]"), "{err}");
}

/// PyTorch's conv_transpose2d on the CPU, by scattering: x [n, c_in, h, w], weight
/// [c_in, c_out / groups, kh, kw]; input pixel (iy, ix) adds w's taps at output
/// (iy stride - padding + ky dilation, ...).
fn conv_transpose_reference(
    x: &[f32],
    [n, c_in, h, wd]: [usize; 4],
    w: &[f32],
    [_, cg_out, kh, kw]: [usize; 4],
    o: ConvTranspose2dOptions,
) -> (Vec<f64>, [usize; 4]) {
    let out = |size: usize, k: usize| {
        (size - 1) * o.stride + o.dilation * (k - 1) + o.output_padding + 1 - 2 * o.padding
    };
    let (oh, ow) = (out(h, kh), out(wd, kw));
    let c_out = cg_out * o.groups;
    let cg_in = c_in / o.groups;
    let mut y = vec![0.0f64; n * c_out * oh * ow];
    for b in 0..n {
        for ci in 0..c_in {
            let g = ci / cg_in;
            for iy in 0..h {
                for ix in 0..wd {
                    let xv = x[((b * c_in + ci) * h + iy) * wd + ix] as f64;
                    for co in 0..cg_out {
                        for ky in 0..kh {
                            for kx in 0..kw {
                                let oy =
                                    (iy * o.stride + ky * o.dilation) as isize - o.padding as isize;
                                let ox =
                                    (ix * o.stride + kx * o.dilation) as isize - o.padding as isize;
                                if oy < 0 || ox < 0 || oy >= oh as isize || ox >= ow as isize {
                                    continue;
                                }
                                let wv = w[((ci * cg_out + co) * kh + ky) * kw + kx] as f64;
                                let at = ((b * c_out + g * cg_out + co) * oh + oy as usize) * ow
                                    + ox as usize;
                                y[at] += xv * wv;
                            }
                        }
                    }
                }
            }
        }
    }
    (y, [n, c_out, oh, ow])
}

fn transpose_options(
    stride: usize,
    padding: usize,
    output_padding: usize,
    dilation: usize,
    groups: usize,
) -> ConvTranspose2dOptions {
    ConvTranspose2dOptions {
        stride,
        padding,
        output_padding,
        dilation,
        groups,
    }
}

#[test]
fn conv_transpose2d_matches_cpu_reference() {
    let cases = [
        ([1, 1, 3, 3], [1, 1, 3, 3], transpose_options(1, 0, 0, 1, 1)),
        // A U-Net up block: stride 2, padding 1, output padding 1 doubles the size.
        ([2, 4, 5, 5], [4, 3, 3, 3], transpose_options(2, 1, 1, 1, 1)),
        ([2, 3, 4, 6], [3, 2, 2, 2], transpose_options(2, 0, 0, 1, 1)),
        ([1, 4, 5, 4], [4, 3, 3, 2], transpose_options(3, 2, 1, 2, 1)),
        ([2, 4, 3, 3], [4, 1, 3, 3], transpose_options(1, 1, 0, 1, 2)),
        ([3, 6, 4, 4], [6, 2, 4, 4], transpose_options(2, 1, 0, 1, 3)),
    ];
    for (i, (xs, ws, o)) in cases.into_iter().enumerate() {
        let (x, xv) = random_tensor(&xs, 110 + i as u64);
        let (w, wv) = random_tensor(&ws, 120 + i as u64);
        let c_out = ws[1] * o.groups;
        let (b, bv) = random_tensor(&[c_out], 130 + i as u64);
        let got = x.conv_transpose2d(&w, Some(&b), &o).unwrap();
        let (mut want, shape) = conv_transpose_reference(&xv, xs, &wv, ws, o);
        let pixels = shape[2] * shape[3];
        for (at, v) in want.iter_mut().enumerate() {
            *v += bv[(at / pixels) % c_out] as f64;
        }
        assert_eq!(got.shape(), &shape, "case {i}");
        assert_close(
            &got.to_vec().unwrap(),
            &want,
            1e-4,
            &format!("conv_transpose2d case {i}"),
        );
    }
}

/// With unit stride the input grad is a forward convolution of the out grad with the flipped
/// weight (one implicit GEMM where the matmul kernel reads images: input pixels in whole 4s);
/// either way it is `conv_transpose2d` of the out grad. Padding below, at and above
/// `dilation (k - 1)` along an axis (above it: col2im), dilation, groups, a ResNet layer.
#[test]
fn conv2d_input_grad_with_unit_stride_matches_cpu_reference() {
    let cases = [
        ([2, 3, 8, 8], [5, 3, 3, 3], 1, 1, 1),
        ([2, 4, 6, 6], [6, 4, 3, 3], 0, 1, 1),
        ([2, 8, 10, 10], [3, 8, 3, 3], 2, 2, 1),
        ([2, 8, 6, 6], [6, 4, 3, 3], 1, 1, 2),
        ([1, 4, 8, 8], [8, 4, 5, 5], 2, 1, 1),
        ([2, 3, 8, 8], [5, 3, 1, 3], 1, 1, 1),
        ([2, 12, 4, 4], [7, 12, 1, 1], 0, 1, 1),
        ([2, 3, 5, 5], [4, 3, 3, 3], 1, 1, 1),
        ([3, 16, 28, 28], [16, 16, 3, 3], 1, 1, 1),
    ];
    for (i, (xs, ws, padding, dilation, groups)) in cases.into_iter().enumerate() {
        let seed = 140 + 3 * i as u64;
        let (x, _) = random_tensor(&xs, seed);
        let (w, wv) = random_tensor(&ws, seed + 1);
        let x = x.requires_grad_(true);
        let o = options(1, padding, dilation, groups);
        let y = x.conv2d_with(&w, None, o).unwrap();
        let (g, gv) = random_tensor(y.shape(), seed + 2);
        y.mul(&g).unwrap().sum().unwrap().backward().unwrap();
        let gs = [y.shape()[0], y.shape()[1], y.shape()[2], y.shape()[3]];
        let adjoint = transpose_options(1, padding, 0, dilation, groups);
        let (want, shape) = conv_transpose_reference(&gv, gs, &wv, ws, adjoint);
        assert_eq!(shape, xs, "case {i} shape");
        assert_close(
            &x.grad().unwrap().to_vec().unwrap(),
            &want,
            1e-4,
            &format!("conv2d input grad case {i}"),
        );
    }
}

/// The weight grad of conv2d on the CPU: for each weight, the sum over images and output
/// pixels of the out grad times the input element that weight met (groups of 1).
fn conv_weight_grad_reference(
    x: &[f32],
    xs: [usize; 4],
    g: &[f32],
    gs: [usize; 4],
    ws: [usize; 4],
    o: Conv2dOptions,
) -> Vec<f64> {
    let [n, c_in, h, wd] = xs;
    let [_, c_out, oh, ow] = gs;
    let [_, _, kh, kw] = ws;
    let mut grad = vec![0.0f64; ws.iter().product()];
    for b in 0..n {
        for co in 0..c_out {
            for y in 0..oh {
                for xo in 0..ow {
                    let gv = g[((b * c_out + co) * oh + y) * ow + xo] as f64;
                    for ci in 0..c_in {
                        for ky in 0..kh {
                            for kx in 0..kw {
                                let iy = (y * o.stride.0 + ky * o.dilation.0) as isize
                                    - o.padding.0 as isize;
                                let ix = (xo * o.stride.1 + kx * o.dilation.1) as isize
                                    - o.padding.1 as isize;
                                if iy < 0 || ix < 0 || iy >= h as isize || ix >= wd as isize {
                                    continue;
                                }
                                let xv = x[((b * c_in + ci) * h + iy as usize) * wd + ix as usize];
                                grad[((co * c_in + ci) * kh + ky) * kw + kx] += gv * xv as f64;
                            }
                        }
                    }
                }
            }
        }
    }
    grad
}

/// Each case's conv2d forward, input grad and weight grad against the CPU, on values drawn
/// from seeds `seed ..`; a case is `(x shape, w shape, stride, padding)`, square images.
fn check_grads_against_reference(cases: &[([usize; 4], [usize; 4], usize, usize)], seed: u64) {
    for (i, &(xs, ws, stride, padding)) in cases.iter().enumerate() {
        let seed = seed + 3 * i as u64;
        let (x, xv) = random_tensor(&xs, seed);
        let (w, wv) = random_tensor(&ws, seed + 1);
        let (x, w) = (x.requires_grad_(true), w.requires_grad_(true));
        let o = options(stride, padding, 1, 1);
        let y = x.conv2d_with(&w, None, o).unwrap();
        let (want, gs) = conv_reference(&xv, xs, &wv, ws, None, o);
        assert_eq!(y.shape(), &gs, "case {i} shape");
        let what = format!("case {i}: x {xs:?} w {ws:?} stride {stride} padding {padding}");
        assert_close(
            &y.to_vec().unwrap(),
            &want,
            1e-4,
            &format!("forward, {what}"),
        );
        let (g, gv) = random_tensor(y.shape(), seed + 2);
        y.mul(&g).unwrap().sum().unwrap().backward().unwrap();
        // The adjoint of a strided convolution gives back the input's sides with the output
        // padding that the stride rounded away.
        let output_padding = (xs[2] + 2 * padding - ws[2]) % stride;
        let adjoint = transpose_options(stride, padding, output_padding, 1, 1);
        let (want_x, shape) = conv_transpose_reference(&gv, gs, &wv, ws, adjoint);
        assert_eq!(shape, xs, "case {i} input grad shape");
        let got_x = x.grad().unwrap().to_vec().unwrap();
        assert_close(&got_x, &want_x, 1e-4, &format!("input grad, {what}"));
        let want_w = conv_weight_grad_reference(&xv, xs, &gv, gs, ws, o);
        let got_w = w.grad().unwrap().to_vec().unwrap();
        assert_close(&got_w, &want_w, 1e-3, &format!("weight grad, {what}"));
    }
}

/// Small images (a ResNet's last stages: 1x1 to 7x7 output pixels) run their column
/// matrices a group of images at a time, each product over the group's pixels side by side
/// rather than an image's few, and the weight grad reads them from the images where the
/// matmul kernel can: batches that split into groups and a prime one, strides 1 and 2, pixel
/// counts in and not in whole 4s, one image, one pixel per image, and wide products.
#[test]
fn conv2d_over_small_images_in_groups_matches_cpu_reference() {
    let cases = [
        ([12, 5, 2, 2], [7, 5, 3, 3], 1, 1),
        ([10, 4, 4, 4], [6, 4, 3, 3], 2, 1),
        ([7, 3, 3, 3], [4, 3, 3, 3], 1, 1),
        ([9, 2, 5, 5], [3, 2, 3, 3], 2, 0),
        ([1, 6, 2, 2], [5, 6, 1, 1], 1, 0),
        ([96, 8, 1, 1], [6, 8, 1, 1], 1, 0),
        ([40, 3, 7, 7], [4, 3, 3, 3], 2, 1),
        // Products of 128 and 64 rows and columns (the GPU flavour's block kernels), over
        // images of 8x8, 6x6, 2x2 and 1x1 output pixels.
        ([4, 16, 8, 8], [130, 16, 3, 3], 1, 1),
        ([2, 8, 6, 6], [70, 8, 3, 3], 1, 1),
        ([6, 32, 3, 3], [130, 32, 2, 2], 1, 0),
        ([40, 128, 1, 1], [130, 128, 1, 1], 1, 0),
    ];
    check_grads_against_reference(&cases, 300);
}

/// A strided convolution's input grad sums the column grads back onto each input row a run
/// of elements at a time, stepping through the taps that meet each element: rows longer than
/// one run, strides 2 and 3, a 1x1 kernel that skips elements, a kernel wider than its stride
/// twice over, and padding.
#[test]
fn conv2d_input_grad_with_stride_matches_cpu_reference() {
    let cases = [
        ([2, 3, 150, 150], [2, 3, 3, 3], 2, 1),
        ([2, 4, 70, 70], [3, 4, 1, 1], 2, 0),
        ([1, 2, 67, 67], [3, 2, 5, 5], 3, 2),
        ([3, 2, 9, 9], [2, 2, 7, 7], 2, 3),
    ];
    check_grads_against_reference(&cases, 400);
}

#[test]
fn conv_transpose2d_gradcheck() {
    for (n, o) in [
        (1, transpose_options(2, 1, 1, 1, 1)),
        (3, transpose_options(1, 0, 0, 2, 2)),
    ] {
        gradcheck(
            &format!("conv_transpose2d batch {n} {o:?}"),
            &[
                (vec![n, 2, 3, 4], values_in(n * 24, -1.0, 1.0, 11)),
                (vec![2, 2, 3, 3], values_in(36, -1.0, 1.0, 12)),
                (vec![2 * o.groups], values_in(2 * o.groups, -1.0, 1.0, 13)),
            ],
            |t| t[0].conv_transpose2d(&t[1], Some(&t[2]), &o),
        );
    }
    // A transposed (non-contiguous) input.
    gradcheck(
        "conv_transpose2d of a view",
        &[
            (vec![1, 2, 4, 3], values_in(24, -1.0, 1.0, 14)),
            (vec![2, 1, 2, 2], values_in(8, -1.0, 1.0, 15)),
        ],
        |t| {
            t[0].transpose(2, 3)?
                .conv_transpose2d(&t[1], None, &transpose_options(2, 0, 1, 1, 1))
        },
    );
}

#[test]
fn conv_transpose2d_undoes_a_stride_2_convolutions_size_and_is_its_input_grad() {
    let dev = device();
    let (x, _) = random_tensor(&[2, 3, 9, 9], 140);
    let (w, _) = random_tensor(&[4, 3, 3, 3], 141);
    let down = x.conv2d(&w, None, 2, 1).unwrap();
    let up_options = transpose_options(2, 1, 0, 1, 1);
    let (g, _) = random_tensor(down.shape(), 142);
    // conv2d's input grad for out grad g is conv_transpose2d of g with the same weight.
    let x = x.requires_grad_(true);
    x.conv2d(&w, None, 2, 1)
        .unwrap()
        .mul(&g)
        .unwrap()
        .sum()
        .unwrap()
        .backward()
        .unwrap();
    let up = g.conv_transpose2d(&w, None, &up_options).unwrap();
    assert_eq!(up.shape(), &[2, 3, 9, 9]);
    let want: Vec<f64> = x
        .grad()
        .unwrap()
        .to_vec()
        .unwrap()
        .iter()
        .map(|&v| v as f64)
        .collect();
    assert_close(&up.to_vec().unwrap(), &want, 1e-5, "input grad");
    let module =
        nn::ConvTranspose2d::new(4, 2, 3, transpose_options(2, 1, 1, 1, 1), true, dev).unwrap();
    assert_eq!(module.weight.shape(), &[4, 2, 3, 3]);
    assert_eq!(module.forward(&down).unwrap().shape(), &[2, 2, 10, 10]);
    assert_eq!(module.parameters().len(), 2);
}

#[test]
fn conv_transpose2d_rejects_bad_options_naming_the_shapes() {
    let dev = device();
    let x = Tensor::zeros(&[1, 4, 3, 3], dev).unwrap();
    let w = Tensor::zeros(&[4, 2, 3, 3], dev).unwrap();
    let cases = [
        (transpose_options(2, 0, 2, 1, 1), &w, "output_padding"),
        (transpose_options(1, 0, 0, 1, 3), &w, "divisible"),
        (transpose_options(1, 3, 0, 1, 1), &w, "no output"),
        (transpose_options(0, 0, 0, 1, 1), &w, "stride"),
    ];
    for (o, w, needle) in cases {
        let err = x.conv_transpose2d(w, None, &o).unwrap_err();
        let msg = err.to_string();
        assert!(
            msg.contains("conv_transpose2d") && msg.contains(needle),
            "{msg}"
        );
        assert!(msg.contains("[1, 4, 3, 3]"), "{msg}");
    }
    let wrong_in = Tensor::zeros(&[3, 2, 3, 3], dev).unwrap();
    assert!(x
        .conv_transpose2d(&wrong_in, None, &Default::default())
        .is_err());
    let bias = Tensor::zeros(&[3], dev).unwrap();
    assert!(x
        .conv_transpose2d(&w, Some(&bias), &Default::default())
        .is_err());
}

/// torch's max_pool2d / avg_pool2d of one `[h, w]` plane with padding, ceil mode and
/// count_include_pad, from its kernels' rules: output sides rounded as `Pool2dOptions` says,
/// windows clipped to the input, the average's divisor the window clipped to the padded input
/// (or to the input without count_include_pad).
fn padded_pool_reference(
    plane: &[f32],
    (h, w): (usize, usize),
    o: Pool2dOptions,
    max: bool,
) -> Vec<f64> {
    let out_len = |size: usize| {
        let span = size + 2 * o.padding - o.kernel;
        let mut out = if o.ceil_mode {
            span.div_ceil(o.stride) + 1
        } else {
            span / o.stride + 1
        };
        if o.ceil_mode && (out - 1) * o.stride >= size + o.padding {
            out -= 1;
        }
        out
    };
    let (oh, ow) = (out_len(h), out_len(w));
    let p = o.padding as isize;
    let mut out = Vec::new();
    for oy in 0..oh {
        for ox in 0..ow {
            let y0 = (oy * o.stride) as isize - p;
            let x0 = (ox * o.stride) as isize - p;
            let y1 = (y0 + o.kernel as isize).min(h as isize + p);
            let x1 = (x0 + o.kernel as isize).min(w as isize + p);
            let pool_size = ((y1 - y0) * (x1 - x0)) as f64;
            let (ys, xs) = (y0.max(0), x0.max(0));
            let (ye, xe) = (y1.min(h as isize), x1.min(w as isize));
            let values: Vec<f64> = (ys..ye)
                .flat_map(|y| (xs..xe).map(move |x| (y, x)))
                .map(|(y, x)| plane[y as usize * w + x as usize] as f64)
                .collect();
            out.push(if max {
                values.iter().cloned().fold(f64::NEG_INFINITY, f64::max)
            } else {
                let divisor = if o.count_include_pad {
                    pool_size
                } else {
                    ((ye - ys) * (xe - xs)) as f64
                };
                values.iter().sum::<f64>() / divisor
            });
        }
    }
    out
}

fn pool_options(
    kernel: usize,
    stride: usize,
    padding: usize,
    ceil_mode: bool,
    count_include_pad: bool,
) -> Pool2dOptions {
    Pool2dOptions {
        kernel,
        stride,
        padding,
        ceil_mode,
        count_include_pad,
    }
}

#[test]
fn pools_with_padding_and_ceil_mode_match_torchs_rules() {
    let (h, w) = (7, 6);
    let (x, xv) = random_tensor(&[2, 3, h, w], 160);
    for o in [
        pool_options(3, 2, 1, false, true), // a ResNet stem's max pool
        pool_options(3, 2, 1, false, false),
        pool_options(2, 2, 0, true, true),
        pool_options(3, 2, 0, true, true),
        pool_options(3, 2, 1, true, true),
        pool_options(3, 2, 1, true, false),
        pool_options(4, 3, 2, true, true),
        pool_options(2, 1, 1, false, true),
    ] {
        for max in [true, false] {
            let got = match max {
                true => x.max_pool2d_with(&o),
                false => x.avg_pool2d_with(&o),
            }
            .unwrap();
            let want: Vec<f64> = xv
                .chunks(h * w)
                .flat_map(|plane| padded_pool_reference(plane, (h, w), o, max))
                .collect();
            assert_eq!(got.numel(), want.len(), "{o:?} max {max}");
            assert_close(
                &got.to_vec().unwrap(),
                &want,
                1e-5,
                &format!("{o:?} max {max}"),
            );
        }
    }
}

#[test]
fn pools_with_padding_and_ceil_mode_gradcheck() {
    for n in [1, 3] {
        let o = pool_options(3, 2, 1, true, false);
        for max in [true, false] {
            gradcheck(
                &format!("pool {o:?} max {max} batch {n}"),
                &[(vec![n, 2, 5, 4], values_in(n * 40, -1.0, 1.0, 17))],
                |t| match max {
                    true => t[0].max_pool2d_with(&o),
                    false => t[0].avg_pool2d_with(&o),
                },
            );
        }
    }
    let o = pool_options(2, 2, 1, true, true);
    gradcheck(
        "avg pool of a view",
        &[(vec![1, 1, 5, 3], values_in(15, -1.0, 1.0, 18))],
        |t| t[0].transpose(2, 3)?.avg_pool2d_with(&o),
    );
}

#[test]
fn pool_modules_take_options_and_reject_wide_padding() {
    let (x, _) = random_tensor(&[1, 2, 8, 8], 170);
    let stem = nn::MaxPool2d::with_options(pool_options(3, 2, 1, false, true));
    assert_eq!(stem.forward(&x).unwrap().shape(), &[1, 2, 4, 4]);
    let plain = nn::AvgPool2d::new(2, 2).forward(&x).unwrap();
    assert_eq!(
        plain.to_vec().unwrap(),
        x.avg_pool2d(2, 2).unwrap().to_vec().unwrap()
    );
    let err = x
        .max_pool2d_with(&pool_options(2, 1, 2, false, true))
        .unwrap_err();
    assert!(
        err.to_string().contains("max_pool2d") && err.to_string().contains("padding"),
        "{err}"
    );
    assert!(x
        .avg_pool2d_with(&pool_options(0, 1, 0, false, true))
        .is_err());
}
