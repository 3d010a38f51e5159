//! Tensors larger than one kernel binding (`Device::max_binding_bytes`, 128 MiB on lavapipe):
//! ops that bind windows of them give the values they give on small tensors, and the others
//! are a `TooLarge` error naming the op. Its own binary: each test holds several hundred MB.
//! Shapes follow the binding size, so under `WGRAD_MAX_BINDING_BYTES=1048576` (CI) the same
//! tests run the same windowed paths on tensors of a few MB.

mod common;
use common::*;
use wgrad::nn::{self, Module};
use wgrad::optim::{Adam, AdamConfig, Optimizer};
use wgrad::{DType, Error, Pool2dOptions, Tensor};

/// Elements of an f32 tensor a little larger than one binding.
fn past_binding() -> usize {
    (device().max_binding_bytes() / 4) as usize + 1000
}

/// Values of `t` at `positions` (read back through `index_select` on a flat view).
fn at(t: &Tensor, positions: &[usize]) -> Vec<f32> {
    let flat = t.reshape(&[t.numel()]).unwrap();
    let idx = Tensor::from_vec_u32(
        positions.iter().map(|&p| p as u32).collect(),
        &[positions.len()],
        device(),
    )
    .unwrap();
    flat.unsqueeze(1)
        .unwrap()
        .index_select(0, &idx)
        .unwrap()
        .to_vec()
        .unwrap()
}

#[test]
fn elementwise_ops_and_fills_past_one_binding_are_right_at_both_ends() {
    // Not a multiple of 4: the last window ends inside a four-element group.
    let n = past_binding() + 3;
    let dev = device();
    let a = Tensor::arange(n, dev).unwrap();
    let b = Tensor::full(&[n], 2.0, dev).unwrap();
    let y = a.mul(&b).unwrap().sub_scalar(3.0).unwrap().relu().unwrap();
    let probes = [0, 1, 2, n / 3, n / 2, n - 2, n - 1];
    let want: Vec<f32> = probes
        .iter()
        .map(|&i| (2.0 * i as f32 - 3.0).max(0.0))
        .collect();
    assert_eq!(at(&y, &probes), want);
    // accumulate_grad's clone-then-add over windows.
    let sum = wgrad::autograd::accumulate_grad(Some(&y), &b).unwrap();
    let want: Vec<f32> = want.iter().map(|v| v + 2.0).collect();
    assert_eq!(at(&sum, &probes), want);
}

#[test]
fn a_gpt2_sized_embedding_trains_with_adam() {
    let dev = device();
    let emb = nn::Embedding::new(50_257, 768, dev).unwrap();
    assert!(emb.weight.numel() * 4 > dev.max_binding_bytes() as usize);
    let rows = [0u32, 7, 25_000, 50_256, 7];
    let before = emb
        .weight
        .index_select(0, &Tensor::from_vec_u32(rows.to_vec(), &[5], dev).unwrap())
        .unwrap()
        .to_vec()
        .unwrap();
    let mut opt = Adam::new(
        emb.parameters(),
        AdamConfig {
            lr: 0.01,
            ..AdamConfig::default()
        },
    );
    let idx = Tensor::from_vec_u32(rows.to_vec(), &[5], dev).unwrap();
    // loss = sum(rows * c), so each picked row's grad is c (twice for row 7).
    let c = Tensor::full(&[5, 768], 0.5, dev).unwrap();
    opt.zero_grad();
    emb.forward(&idx)
        .unwrap()
        .mul(&c)
        .unwrap()
        .sum()
        .unwrap()
        .backward()
        .unwrap();
    let grad = emb.weight.grad().unwrap();
    let g = grad
        .index_select(
            0,
            &Tensor::from_vec_u32(vec![7, 8, 50_256], &[3], dev).unwrap(),
        )
        .unwrap()
        .to_vec()
        .unwrap();
    assert!(g[..768].iter().all(|&v| v == 1.0), "row 7 is picked twice");
    assert!(
        g[768..1536].iter().all(|&v| v == 0.0),
        "row 8 is not picked"
    );
    assert!(g[1536..].iter().all(|&v| v == 0.5));
    opt.step().unwrap();
    // Adam's first step moves every element with a grad by lr (m / sqrt(v) = sign(g)).
    let after = emb.weight.index_select(0, &idx).unwrap().to_vec().unwrap();
    for (i, (a, b)) in after.iter().zip(&before).enumerate() {
        assert!((b - a - 0.01).abs() < 1e-5, "element {i}: {b} -> {a}");
    }
    // Rows without a grad do not move.
    let untouched = Tensor::from_vec_u32(vec![1, 49_000], &[2], dev).unwrap();
    let moved = emb.weight.index_select(0, &untouched).unwrap();
    opt.step().unwrap();
    assert_eq!(
        moved.to_vec().unwrap(),
        emb.weight
            .index_select(0, &untouched)
            .unwrap()
            .to_vec()
            .unwrap()
    );
}

#[test]
fn reductions_past_one_binding_combine_their_windows() {
    let n = past_binding();
    let dev = device();
    let ones = Tensor::ones(&[n], dev).unwrap().requires_grad_(true);
    let total = ones.sum().unwrap();
    assert_eq!(total.item().unwrap(), n as f32);
    // Its backward broadcasts the grad over the whole tensor, a window at a time.
    total.backward().unwrap();
    assert_eq!(at(&ones.grad().unwrap(), &[0, n / 2, n - 1]), vec![1.0; 3]);
    // Over the last dim of [rows, 1000]: each row's sum (rows laid end to end).
    let rows = n / 1000 + 1;
    let x = Tensor::ones(&[rows, 1000], dev).unwrap();
    let row_sums = x.sum_dims(&[1], false).unwrap();
    assert_eq!(row_sums.shape(), &[rows]);
    assert_eq!(at(&row_sums, &[0, rows / 2, rows - 1]), vec![1000.0; 3]);
    // The max over the first dim: partial maxima combined.
    let x = Tensor::arange(rows * 1000, dev)
        .unwrap()
        .reshape(&[rows, 1000])
        .unwrap();
    let column_max = x.max_dims(&[0], false).unwrap();
    let want: Vec<f32> = [0usize, 999]
        .iter()
        .map(|c| ((rows - 1) * 1000 + c) as f32)
        .collect();
    assert_eq!(at(&column_max, &[0, 999]), want);
}

#[test]
fn matmul_past_one_binding_splits_the_outer_dimension() {
    let dev = device();
    // A tall A: [rows, 64] x [64, 3].
    let rows = past_binding() / 64 + 1;
    let a = Tensor::ones(&[rows, 64], dev).unwrap();
    let b = Tensor::from_vec((0..192).map(|i| (i % 3) as f32).collect(), &[64, 3], dev).unwrap();
    let out = a.matmul(&b).unwrap();
    assert_eq!(out.shape(), &[rows, 3]);
    let last = rows * 3 - 3;
    assert_eq!(
        at(&out, &[0, 1, 2, last, last + 1, last + 2]),
        vec![0.0, 64.0, 128.0, 0.0, 64.0, 128.0]
    );
    // A tied output layer: h [2, 64] x W^T, with W [rows, 64] past one binding.
    let h = Tensor::ones(&[2, 64], dev).unwrap();
    let logits = h.matmul(&a.t().unwrap()).unwrap();
    assert_eq!(logits.shape(), &[2, rows]);
    assert_eq!(at(&logits, &[0, rows - 1, 2 * rows - 1]), vec![64.0; 3]);
}

#[test]
fn a_small_broadcast_operand_of_an_output_past_one_binding_is_copied_dense() {
    let dev = device();
    // A bias row over [rows, 1000], and a per-row scale [rows, 1]: each copied dense first.
    let rows = past_binding() / 1000 + 1;
    let x = Tensor::arange(rows * 1000, dev)
        .unwrap()
        .reshape(&[rows, 1000])
        .unwrap();
    let row = Tensor::arange(1000, dev).unwrap();
    let scale = Tensor::arange(rows, dev)
        .unwrap()
        .reshape(&[rows, 1])
        .unwrap();
    let y = row.add(&x).unwrap().mul(&scale).unwrap();
    let probes = [0, 999, 1000, rows * 500 + 123, rows * 1000 - 1];
    // In f32, as the kernels add and multiply (the values pass 2^24).
    let want: Vec<f32> = probes
        .iter()
        .map(|&i| (i as f32 + (i % 1000) as f32) * (i / 1000) as f32)
        .collect();
    assert_eq!(at(&y, &probes), want);
}

#[test]
fn casts_past_one_binding_convert_every_window() {
    let dev = device();
    // Integers below 2048 are exact in F16; an odd length ends inside a 16-bit word.
    let n = past_binding() | 1;
    let x = Tensor::from_vec((0..n).map(|i| (i % 2048) as f32).collect(), &[n], dev).unwrap();
    let half = x.to_dtype(DType::F16).unwrap();
    // A 16-bit binary op past one binding reads its operands as F32 copies, then casts back.
    let doubled = half.add(&half).unwrap().to_dtype(DType::F32).unwrap();
    let probes = [0, 1, 2047, 2048, n / 2, n - 2, n - 1];
    let want: Vec<f32> = probes.iter().map(|&i| (i % 2048) as f32).collect();
    assert_eq!(at(&half.to_dtype(DType::F32).unwrap(), &probes), want);
    let twice: Vec<f32> = want.iter().map(|v| 2.0 * v).collect();
    assert_eq!(at(&doubled, &probes), twice);
}

/// `[images, channels, pixels]` values that differ per channel in mean and spread.
fn channel_values(images: usize, channels: usize, pixels: usize) -> Vec<f32> {
    (0..images * channels * pixels)
        .map(|i| {
            let c = (i / pixels) % channels;
            ((i * 7919) % 1009) as f32 / 100.0 * (c + 1) as f32 + 3.0 * c as f32
        })
        .collect()
}

#[test]
fn batch_norm_past_one_binding_trains_over_windows_of_whole_images() {
    let dev = device();
    // Three images of two channels, each image within a binding and the three past it: two
    // windows, the second starting where a binding cannot (an odd number of pixels).
    let (images, channels) = (3, 2);
    let pixels = (past_binding() / (images * channels)) | 1;
    let host = channel_values(images, channels, pixels);
    let x = Tensor::from_vec(host.clone(), &[images, channels, pixels], dev)
        .unwrap()
        .requires_grad_(true);
    let bn = nn::BatchNorm1d::new(channels, dev).unwrap();
    let out = bn.forward(&x).unwrap();
    // The loss weighs each output by a pattern, so the input grad is not the trivial 0.
    let pattern: Vec<f32> = (0..host.len()).map(|i| (i % 7) as f32 - 3.0).collect();
    let r = Tensor::from_vec(pattern.clone(), x.shape(), dev).unwrap();
    out.mul(&r).unwrap().sum().unwrap().backward().unwrap();

    // The CPU reference, in f64: per channel mean, biased variance, xhat, and the grads.
    let count = (images * pixels) as f64;
    let of_channel = |c: usize| {
        (0..images).flat_map(move |n| {
            let first = (n * channels + c) * pixels;
            first..first + pixels
        })
    };
    let got = out.to_vec().unwrap();
    let grad = x.grad().unwrap().to_vec().unwrap();
    let (weight_grad, bias_grad) = (
        bn.weight.grad().unwrap().to_vec().unwrap(),
        bn.bias.grad().unwrap().to_vec().unwrap(),
    );
    let running_var = bn.running_var.to_vec().unwrap();
    for c in 0..channels {
        let mean = of_channel(c).map(|i| host[i] as f64).sum::<f64>() / count;
        let var = of_channel(c)
            .map(|i| (host[i] as f64 - mean).powi(2))
            .sum::<f64>()
            / count;
        let rstd = 1.0 / (var + 1e-5).sqrt();
        let xhat = |i: usize| (host[i] as f64 - mean) * rstd;
        let mean_g = of_channel(c).map(|i| pattern[i] as f64).sum::<f64>() / count;
        let mean_g_xhat = of_channel(c)
            .map(|i| pattern[i] as f64 * xhat(i))
            .sum::<f64>()
            / count;
        for i in of_channel(c) {
            assert!(
                (got[i] as f64 - xhat(i)).abs() < 1e-4,
                "out[{i}]: {}",
                got[i]
            );
            let want = rstd * (pattern[i] as f64 - mean_g - xhat(i) * mean_g_xhat);
            assert!(
                (grad[i] as f64 - want).abs() < 1e-4,
                "grad[{i}]: {}",
                grad[i]
            );
        }
        // Sums over the channel's values: within f32 rounding of the sum of their magnitudes.
        let close = |got: f32, want: f64, magnitudes: f64, what: &str| {
            assert!(
                (got as f64 - want).abs() < 1e-6 * magnitudes,
                "channel {c}'s {what}: {got}, want {want}"
            );
        };
        let magnitudes = |f: &dyn Fn(usize) -> f64| of_channel(c).map(|i| f(i).abs()).sum();
        let g_xhat = |i: usize| pattern[i] as f64 * xhat(i);
        let g = |i: usize| pattern[i] as f64;
        close(
            weight_grad[c],
            mean_g_xhat * count,
            magnitudes(&g_xhat),
            "weight grad",
        );
        close(bias_grad[c], mean_g * count, magnitudes(&g), "bias grad");
        let want_var = 0.9 + 0.1 * var * count / (count - 1.0);
        close(running_var[c], want_var, want_var, "running var");
    }

    // In evaluation mode it reads the running statistics through broadcasting ops.
    bn.set_training(false);
    let eval = bn.forward(&x.detach()).unwrap();
    let mean = bn.running_mean.to_vec().unwrap();
    let probes = [0, pixels, host.len() - 1];
    for (&i, got) in probes.iter().zip(at(&eval, &probes)) {
        let c = (i / pixels) % channels;
        let want = (host[i] - mean[c]) / (running_var[c] + 1e-5).sqrt();
        assert!((got - want).abs() < 1e-4, "eval[{i}]: {got}, want {want}");
    }
}

/// A conv, ReLU and padded max pool of `x` with `w`, and the grads of `sum(out * pattern)`
/// for `x` and `w`: (out, x grad, w grad).
fn conv_relu_pool_and_grads(x: &Tensor, w: &Tensor) -> (Tensor, Tensor, Tensor) {
    let x = x.detach().requires_grad_(true);
    let w = w.detach().requires_grad_(true);
    let pool = Pool2dOptions {
        padding: 1,
        ..Pool2dOptions::new(3, 2)
    };
    let out = x
        .conv2d(&w, None, 1, 1)
        .unwrap()
        .relu()
        .unwrap()
        .max_pool2d_with(&pool)
        .unwrap();
    // The same weights for every image.
    let per_image = out.numel() / out.shape()[0];
    let pattern: Vec<f32> = (0..out.numel())
        .map(|i| ((i % per_image * 31) % 11) as f32 - 5.0)
        .collect();
    let pattern = Tensor::from_vec(pattern, out.shape(), x.device()).unwrap();
    weighted_sum_backward(&out, &pattern);
    (out, x.grad().unwrap(), w.grad().unwrap())
}

#[test]
fn a_conv_relu_pool_past_one_binding_matches_its_images_one_at_a_time() {
    let dev = device();
    // The conv's output for both images is past one binding, each image's within one: the
    // batch runs windowed (pool planes, the padded image's strided interior, conv chunks)
    // and each image alone runs as any small tensor does. Small integers keep every sum
    // exact, so the two agree bit for bit whatever order their kernels add in (the batch's
    // conv takes another kernel than one image's; rounding would break the pool's ties
    // differently).
    let side = (dev.max_binding_bytes() as f64 / 128.0).sqrt() as usize + 6;
    let (images, channels) = (2, 16);
    let binding = dev.max_binding_bytes() as usize;
    assert!(images * channels * side * side * 4 > binding);
    assert!(channels * side * side * 4 <= binding);
    let n = images * 3 * side * side;
    let x: Vec<f32> = (0..n).map(|i| ((i * 7919) % 9) as f32 - 4.0).collect();
    let x = Tensor::from_vec(x, &[images, 3, side, side], dev).unwrap();
    let w: Vec<f32> = (0..channels * 27)
        .map(|i| ((i * 13) % 5) as f32 - 2.0)
        .collect();
    let w = Tensor::from_vec(w, &[channels, 3, 3, 3], dev).unwrap();
    let (out, x_grad, w_grad) = conv_relu_pool_and_grads(&x, &w);

    let mut w_grad_sum = vec![0.0f64; channels * 27];
    for i in 0..images {
        let (out_i, x_grad_i, w_grad_i) = conv_relu_pool_and_grads(&x.narrow(0, i, 1).unwrap(), &w);
        let per_image = |t: &Tensor| slice_values(t, 0, i);
        assert_eq!(
            per_image(&out),
            out_i.to_vec().unwrap(),
            "image {i}'s output"
        );
        assert_eq!(
            per_image(&x_grad),
            x_grad_i.to_vec().unwrap(),
            "image {i}'s input grad"
        );
        for (sum, g) in w_grad_sum.iter_mut().zip(w_grad_i.to_vec().unwrap()) {
            *sum += g as f64;
        }
    }
    for (j, (got, want)) in w_grad.to_vec().unwrap().iter().zip(&w_grad_sum).enumerate() {
        assert!(
            (*got as f64 - want).abs() < 1e-4 * want.abs().max(1.0),
            "weight grad {j}: {got}, want {want}"
        );
    }
}

#[test]
fn ops_that_cannot_window_a_tensor_past_one_binding_are_too_large_errors() {
    let dev = device();
    let big = Tensor::zeros(&[past_binding()], dev).unwrap();
    // A broadcast operand past one binding is not windowed.
    let two = Tensor::zeros(&[2, 1], dev).unwrap();
    let err = big
        .reshape(&[1, past_binding()])
        .unwrap()
        .add(&two)
        .unwrap_err();
    assert!(matches!(err, Error::TooLarge { op: "add", .. }), "{err}");
    // The error counts the broadcast operand's bytes, which are past the limit.
    let Error::TooLarge { bytes, limit, .. } = err else {
        unreachable!()
    };
    assert!(bytes > limit, "{bytes} bytes, limit {limit}");
    // BatchNorm binds whole images: one image past a binding is too large.
    let x = Tensor::zeros(&[1, 1, past_binding()], dev).unwrap();
    let err = nn::BatchNorm1d::new(1, dev)
        .unwrap()
        .forward(&x)
        .unwrap_err();
    assert!(
        matches!(err, Error::TooLarge { op: "BatchNorm1d", bytes, limit } if bytes > limit),
        "{err}"
    );
}

#[test]
fn a_strided_view_whose_one_slice_spans_past_one_binding_copies_runs_within_it() {
    let dev = device();
    // Each column of [n / 8, 8] spans the whole buffer: the transpose copies a column at a
    // time, in runs of its elements.
    let n = past_binding();
    assert_eq!(n % 8, 0);
    let x = Tensor::arange(n, dev).unwrap();
    let xt = x
        .reshape(&[n / 8, 8])
        .unwrap()
        .t()
        .unwrap()
        .contiguous()
        .unwrap();
    assert_eq!(xt.shape(), &[8, n / 8]);
    // xt[c][r] = x[r * 8 + c].
    let cells = [(0, 0), (0, n / 8 - 1), (3, n / 16), (7, 0), (7, n / 8 - 1)];
    let got: Vec<usize> = cells.iter().map(|&(c, r)| c * (n / 8) + r).collect();
    let want: Vec<usize> = cells.iter().map(|&(c, r)| r * 8 + c).collect();
    assert_eq!(at(&xt, &got), at(&x, &want));
}

#[test]
fn a_strided_view_past_one_binding_copies_a_run_of_slices_at_a_time() {
    let dev = device();
    // The transpose of [rows, 1000]: each of its 1000 slices spans just under a binding.
    let rows = past_binding() / 1000;
    let x = Tensor::arange(rows * 1000, dev)
        .unwrap()
        .reshape(&[rows, 1000])
        .unwrap();
    let xt = x.t().unwrap().contiguous().unwrap();
    assert_eq!(xt.shape(), &[1000, rows]);
    // xt[c][r] = x[r][c] = r * 1000 + c.
    let probes = [
        (0, 0),
        (0, rows - 1),
        (999, 0),
        (517, rows / 2),
        (999, rows - 1),
    ];
    let flat: Vec<usize> = probes.iter().map(|&(c, r)| c * rows + r).collect();
    let want: Vec<f32> = probes.iter().map(|&(c, r)| (r * 1000 + c) as f32).collect();
    assert_eq!(at(&xt, &flat), want);
    // A padded image's interior, written into a buffer past one binding.
    let side = (dev.max_binding_bytes() as f64 / 16.0).sqrt() as usize + 4;
    let images = Tensor::ones(&[2, 2, side, side], dev).unwrap();
    assert!(images.numel() * 4 > dev.max_binding_bytes() as usize);
    let padded = images.pad2d((1, 2, 3, 4), -1.0).unwrap();
    let (h, w) = (side + 7, side + 3);
    let at_pixel = |n: usize, c: usize, y: usize, x: usize| ((n * 2 + c) * h + y) * w + x;
    let probes = [
        at_pixel(0, 0, 0, 0),
        at_pixel(0, 0, 3, 1),
        at_pixel(1, 1, side + 2, side),
        at_pixel(1, 1, side + 3, side),
        at_pixel(1, 1, side + 2, side + 1),
    ];
    assert_eq!(at(&padded, &probes), vec![-1.0, 1.0, 1.0, -1.0, -1.0]);
}

/// Rows and vocabulary of logits a little past one binding, each half within one: a real
/// vocabulary (32,000) where one binding holds 40 of its rows.
fn lm_head_shape() -> (usize, usize) {
    let floats = (device().max_binding_bytes() / 4) as usize;
    let vocab = (floats / 40).min(32_000);
    let rows = floats / vocab * 21 / 20 + 2;
    assert!(rows * vocab > floats && (rows - rows / 2) * vocab <= floats);
    (rows, vocab)
}

/// The values of slice `i` of `t` along `dim`.
fn slice_values(t: &Tensor, dim: usize, i: usize) -> Vec<f32> {
    t.narrow(dim, i, 1)
        .unwrap()
        .contiguous()
        .unwrap()
        .to_vec()
        .unwrap()
}

/// `n` values in [-0.5, 0.5), a different run of them per `seed`.
fn values(n: usize, seed: usize) -> Vec<f32> {
    (0..n)
        .map(|i| (((i + seed) * 7919) % 1013) as f32 / 1013.0 - 0.5)
        .collect()
}

/// A language model's head over a real vocabulary, with its loss: `h @ w^T` and the mean
/// cross-entropy against `labels`, scaled by `scale`; returns the loss after its backward.
fn lm_head_loss(h: &Tensor, w: &Tensor, labels: &[u32], scale: f32) -> f32 {
    let labels = Tensor::from_vec_u32(labels.to_vec(), &[labels.len()], h.device()).unwrap();
    let logits = h.matmul(&w.t().unwrap()).unwrap();
    let loss = nn::loss::cross_entropy(&logits, &labels)
        .unwrap()
        .mul_scalar(scale)
        .unwrap();
    loss.backward().unwrap();
    loss.item().unwrap()
}

#[test]
fn a_language_model_head_past_one_binding_trains_as_its_halves_do() {
    let dev = device();
    // Logits [rows, vocab] are past one binding ([1102, 32000] at 128 MiB); each half's are
    // within one. The product runs in runs of rows, its grads as runs of the logits' rows
    // (h's) and of k (w's), the loss and its grad in windows of rows.
    let (rows, vocab) = lm_head_shape();
    let width = 16;
    let labels: Vec<u32> = (0..rows as u32).map(|i| i * 7919 % vocab as u32).collect();
    let h_values = values(rows * width, 1);
    let w = Tensor::from_vec(values(vocab * width, 2), &[vocab, width], dev)
        .unwrap()
        .requires_grad_(true);
    let h = Tensor::from_vec(h_values.clone(), &[rows, width], dev)
        .unwrap()
        .requires_grad_(true);
    let whole = lm_head_loss(&h, &w, &labels, 1.0);
    let (h_grad, w_grad) = (h.grad().unwrap().to_vec().unwrap(), w.grad().unwrap());

    // The same mean as the sum of the halves' means, each weighed by its share of the rows.
    let w_halves = w.detach().requires_grad_(true);
    let half = rows / 2;
    let mut halves_loss = 0.0;
    let mut h_grad_halves = Vec::new();
    for (first, count) in [(0, half), (half, rows - half)] {
        let h_half = Tensor::from_vec(
            h_values[first * width..(first + count) * width].to_vec(),
            &[count, width],
            dev,
        )
        .unwrap()
        .requires_grad_(true);
        let share = count as f32 / rows as f32;
        let labels_half = &labels[first..first + count];
        halves_loss += lm_head_loss(&h_half, &w_halves, labels_half, share);
        h_grad_halves.extend(h_half.grad().unwrap().to_vec().unwrap());
    }
    assert!(
        (whole - halves_loss).abs() < 1e-5 * whole.abs(),
        "{whole} vs {halves_loss}"
    );
    let close = |got: &[f32], want: &[f32], what: &str| {
        let scale = want.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            assert!((g - w).abs() <= 1e-4 * scale, "{what}[{i}]: {g} vs {w}");
        }
    };
    close(&h_grad, &h_grad_halves, "h grad");
    let w_grad_halves = w_halves.grad().unwrap().to_vec().unwrap();
    close(&w_grad.to_vec().unwrap(), &w_grad_halves, "w grad");
}

#[test]
fn argmax_of_logits_past_one_binding_matches_the_cpu() {
    let dev = device();
    let (rows, vocab) = (1100, 32_000);
    let values: Vec<f32> = (0..rows * vocab)
        .map(|i| ((i * 7919) % 100_003) as f32)
        .collect();
    let logits = Tensor::from_vec(values.clone(), &[rows, vocab], dev).unwrap();
    let picked = logits.argmax(-1, false).unwrap().to_vec_u32().unwrap();
    let want: Vec<u32> = values
        .chunks(vocab)
        .map(|row| {
            // The first maximum, as torch.
            let best = row.iter().cloned().fold(f32::MIN, f32::max);
            row.iter().position(|&v| v == best).unwrap() as u32
        })
        .collect();
    assert_eq!(picked, want);
}

#[test]
fn nll_of_log_probs_past_one_binding_equals_the_cross_entropy() {
    let dev = device();
    // log_softmax then nll (gather of each row's label, and its backward) against the fused
    // cross-entropy, over logits past one binding.
    let (rows, vocab) = (1100, 32_000);
    let values: Vec<f32> = (0..rows * vocab)
        .map(|i| ((i * 7919) % 1009) as f32 / 100.0)
        .collect();
    let labels: Vec<u32> = (0..rows as u32).map(|i| i * 7919 % vocab as u32).collect();
    let labels = Tensor::from_vec_u32(labels, &[rows], dev).unwrap();
    let loss_and_grad = |fused: bool| {
        let logits = Tensor::from_vec(values.clone(), &[rows, vocab], dev)
            .unwrap()
            .requires_grad_(true);
        let loss = match fused {
            true => nn::loss::cross_entropy(&logits, &labels).unwrap(),
            false => nn::loss::nll(&logits.log_softmax(-1).unwrap(), &labels).unwrap(),
        };
        loss.backward().unwrap();
        let grad = logits.grad().unwrap();
        let probes: Vec<usize> = [0, 1, vocab, rows * vocab / 2, rows * vocab - 1]
            .into_iter()
            .chain((0..rows).map(|r| r * vocab + (r * 7919) % vocab))
            .collect();
        (loss.item().unwrap(), at(&grad, &probes))
    };
    let (fused, fused_grad) = loss_and_grad(true);
    let (composed, composed_grad) = loss_and_grad(false);
    assert!(
        (fused - composed).abs() < 1e-5 * fused.abs(),
        "{fused} vs {composed}"
    );
    for (i, (a, b)) in fused_grad.iter().zip(&composed_grad).enumerate() {
        assert!((a - b).abs() < 1e-7, "grad probe {i}: {a} vs {b}");
    }
}

#[test]
fn layer_norm_and_rms_norm_past_one_binding_match_their_halves() {
    let dev = device();
    // Rows of 1024 features, 33,000 of them past one binding: the composed ops (which bind
    // windows) stand in for the fused kernels (which bind the rows whole).
    let (rows, width) = (33_000, 1024);
    assert!(rows * width * 4 > dev.max_binding_bytes() as usize);
    let values: Vec<f32> = (0..rows * width)
        .map(|i| ((i * 7919) % 1009) as f32 / 100.0 - 5.0)
        .collect();
    let weight: Vec<f32> = (0..width).map(|j| 0.5 + (j % 7) as f32 / 7.0).collect();
    let weight = Tensor::from_vec(weight, &[width], dev).unwrap();
    let bias = Tensor::full(&[width], 0.25, dev).unwrap();
    for rms in [false, true] {
        let norm = |x: &Tensor| match rms {
            true => x.rms_norm(&weight, 1e-5),
            false => x.layer_norm(&weight, &bias, 1e-5),
        };
        let x = Tensor::from_vec(values.clone(), &[rows, width], dev)
            .unwrap()
            .requires_grad_(true);
        let y = norm(&x).unwrap();
        // Weighs each output by its column, so each row's grad is not the trivial 0.
        let pattern: Vec<f32> = (0..width).map(|j| (j % 5) as f32 - 2.0).collect();
        let pattern = Tensor::from_vec(pattern, &[width], dev).unwrap();
        y.mul(&pattern).unwrap().sum().unwrap().backward().unwrap();
        let probes = [0, 1, width + 3, rows * width / 2 + 17, rows * width - 1];
        let (y_probes, grad_probes) = (at(&y, &probes), at(&x.grad().unwrap(), &probes));
        // The same rows, each half alone (within one binding: the fused kernels).
        let half = rows / 2;
        for (first, count) in [(0, half), (half, rows - half)] {
            let part = &values[first * width..(first + count) * width];
            let x_half = Tensor::from_vec(part.to_vec(), &[count, width], dev)
                .unwrap()
                .requires_grad_(true);
            let y_half = norm(&x_half).unwrap();
            y_half
                .mul(&pattern)
                .unwrap()
                .sum()
                .unwrap()
                .backward()
                .unwrap();
            let grad_half = x_half.grad().unwrap();
            for (i, &p) in probes.iter().enumerate() {
                if (first * width..(first + count) * width).contains(&p) {
                    let local = [p - first * width];
                    let (want_y, want_g) = (at(&y_half, &local)[0], at(&grad_half, &local)[0]);
                    assert!((y_probes[i] - want_y).abs() < 1e-4, "rms {rms} y[{p}]");
                    assert!(
                        (grad_probes[i] - want_g).abs() < 1e-4,
                        "rms {rms} grad[{p}]"
                    );
                }
            }
        }
    }
}

#[test]
fn an_embedding_whose_output_is_past_one_binding_looks_up_and_trains() {
    let dev = device();
    // 33,000 lookups of rows of 1024: the output is past one binding, the table is not.
    let (lookups, vocab, width) = (33_000, 100, 1024);
    let emb = nn::Embedding::new(vocab, width, dev).unwrap();
    let ids: Vec<u32> = (0..lookups as u32).map(|i| i * 7 % vocab as u32).collect();
    let ids_tensor = Tensor::from_vec_u32(ids.clone(), &[lookups], dev).unwrap();
    let y = emb.forward(&ids_tensor).unwrap();
    assert_eq!(y.shape(), &[lookups, width]);
    let table = emb.weight.to_vec().unwrap();
    let probes = [
        0,
        width + 5,
        (lookups / 2) * width + 1000,
        lookups * width - 1,
    ];
    let want: Vec<f32> = probes
        .iter()
        .map(|&p| table[ids[p / width] as usize * width + p % width])
        .collect();
    assert_eq!(at(&y, &probes), want);
    // The sum's grad counts each row's lookups, in every column.
    y.sum().unwrap().backward().unwrap();
    let grad = emb.weight.grad().unwrap().to_vec().unwrap();
    for row in [0, 1, 57, vocab - 1] {
        let count = ids.iter().filter(|&&id| id as usize == row).count() as f32;
        assert_eq!(grad[row * width], count, "row {row}");
        assert_eq!(grad[row * width + width - 1], count, "row {row}");
    }
}

/// One training step of a language model's head: the cross-entropy of `h @ w^T` against
/// `labels`, its backward, and an Adam step of `w`; returns the loss.
fn lm_head_step(h: &Tensor, labels: &Tensor, w: &Tensor, opt: &mut Adam) -> wgrad::Result<Tensor> {
    opt.zero_grad();
    let logits = h.matmul(&w.t()?)?;
    let loss = nn::loss::cross_entropy(&logits, labels)?;
    loss.backward()?;
    opt.step()?;
    Ok(loss)
}

#[test]
fn a_captured_step_past_one_binding_replays_as_it_ran_eagerly() {
    let dev = device();
    // Logits, their softmax and grad are past one binding: every op on them binds windows,
    // which the plan binds as the same ranges of its own buffers.
    let (rows, vocab) = lm_head_shape();
    let width = 16;
    let w_eager = Tensor::from_vec(values(vocab * width, 2), &[vocab, width], dev)
        .unwrap()
        .requires_grad_(true);
    let w_captured = Tensor::from_vec(values(vocab * width, 2), &[vocab, width], dev)
        .unwrap()
        .requires_grad_(true);
    let config = AdamConfig {
        lr: 0.01,
        ..AdamConfig::default()
    };
    let mut eager_opt = Adam::new(vec![w_eager.clone()], config);
    let mut opt = Adam::new(vec![w_captured.clone()], config);
    let mut step =
        wgrad::capture::Step::new(|b: &[Tensor]| lm_head_step(&b[0], &b[1], &w_captured, &mut opt));
    for call in 0..4 {
        let h = Tensor::from_vec(values(rows * width, 10 + call), &[rows, width], dev).unwrap();
        let labels: Vec<u32> = (0..rows as u32)
            .map(|i| (i * 7919 + call as u32 * 13) % vocab as u32)
            .collect();
        let labels = Tensor::from_vec_u32(labels, &[rows], dev).unwrap();
        let want = lm_head_step(&h, &labels, &w_eager, &mut eager_opt)
            .unwrap()
            .item()
            .unwrap();
        let got = step.run(&[h, labels]).unwrap().item().unwrap();
        assert!(
            (got - want).abs() <= 1e-6 * want.abs(),
            "call {call}: loss {got} vs {want}"
        );
    }
    assert_eq!(step.stats().replays, 2, "{:?}", step.stats());
    let (got, want) = (w_captured.to_vec().unwrap(), w_eager.to_vec().unwrap());
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert!(
            (g - w).abs() <= 1e-6 * w.abs().max(1.0),
            "w[{i}]: {g} vs {w}"
        );
    }
}

/// `sum(sdpa(q, k, v) * pattern)` backward with a padding mask and causal, returning the
/// output (q, k and v are made leaves requiring grad).
fn attention_and_grads(q: &Tensor, k: &Tensor, v: &Tensor, keep: &Tensor) -> Tensor {
    let opts = wgrad::SdpaOptions {
        causal: true,
        mask: Some(keep),
        scale: None,
    };
    let out = q.scaled_dot_product_attention_with(k, v, &opts).unwrap();
    let (t, d) = (out.shape()[2], out.shape()[3]);
    let pattern: Vec<f32> = (0..t * d).map(|i| ((i * 13) % 7) as f32 - 3.0).collect();
    let pattern = Tensor::from_vec(pattern, &[1, 1, t, d], q.device()).unwrap();
    weighted_sum_backward(&out, &pattern);
    out
}

/// Runs the backward of `sum(out * pattern)`.
fn weighted_sum_backward(out: &Tensor, pattern: &Tensor) {
    (out.mul(pattern).unwrap().sum().unwrap())
        .backward()
        .unwrap();
}

#[test]
fn attention_past_one_binding_matches_its_heads_alone() {
    let dev = device();
    // q [2, heads, 32, 8] with each batch row past one binding: attention splits the batch,
    // then each row's heads in whole groups of grouped-query heads (2 per k/v head).
    let (t, d) = (32, 8);
    let heads = (dev.max_binding_bytes() as usize / (t * d * 4) + 8).next_multiple_of(2);
    let leaf = |shape: &[usize], seed: usize| {
        let n = shape.iter().product();
        Tensor::from_vec(values(n, seed), shape, dev)
            .unwrap()
            .requires_grad_(true)
    };
    let q = leaf(&[2, heads, t, d], 1);
    let k = leaf(&[2, heads / 2, t, d], 2);
    let v = leaf(&[2, heads / 2, t, d], 3);
    // Row 1's last 5 keys are padding.
    let keep: Vec<u32> = (0..2 * t).map(|i| u32::from(i < 2 * t - 5)).collect();
    let keep = Tensor::from_vec_u32(keep, &[2, 1, 1, t], dev).unwrap();
    let out = attention_and_grads(&q, &k, &v, &keep);
    let slice = |x: &Tensor, b: usize, h: usize, n: usize| {
        x.narrow(0, b, 1)
            .unwrap()
            .narrow(1, h, n)
            .unwrap()
            .contiguous()
            .unwrap()
    };
    for (b, h) in [(0, 0), (1, heads / 2), (1, heads - 2)] {
        // Copies in buffers of their own, so the references bind no window.
        let part = |x: &Tensor, h, n| {
            let s = slice(x, b, h, n);
            (Tensor::from_vec(s.to_vec().unwrap(), s.shape(), dev).unwrap()).requires_grad_(true)
        };
        let (q_s, k_s, v_s) = (part(&q, h, 2), part(&k, h / 2, 1), part(&v, h / 2, 1));
        let out_s = attention_and_grads(&q_s, &k_s, &v_s, &keep.narrow(0, b, 1).unwrap());
        let close = |got: &Tensor, want: &Tensor, what: &str| {
            let (got, want) = (got.to_vec().unwrap(), want.to_vec().unwrap());
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                assert!(
                    (g - w).abs() <= 1e-5 * w.abs().max(1.0),
                    "{what} ({b}, {h})[{i}]: {g} vs {w}"
                );
            }
        };
        close(&slice(&out, b, h, 2), &out_s, "out");
        close(
            &slice(&q.grad().unwrap(), b, h, 2),
            &q_s.grad().unwrap(),
            "q grad",
        );
        close(
            &slice(&k.grad().unwrap(), b, h / 2, 1),
            &k_s.grad().unwrap(),
            "k grad",
        );
        close(
            &slice(&v.grad().unwrap(), b, h / 2, 1),
            &v_s.grad().unwrap(),
            "v grad",
        );
    }
}

/// `sum(p * x)`, its backward and an Adam step of `p`; returns the loss.
fn dot_step(p: &Tensor, x: &Tensor, opt: &mut Adam) -> wgrad::Result<Tensor> {
    opt.zero_grad();
    let loss = p.mul(x)?.sum()?;
    loss.backward()?;
    opt.step()?;
    Ok(loss)
}

#[test]
fn a_captured_adam_step_of_a_parameter_past_one_binding_replays_as_it_ran_eagerly() {
    let dev = device();
    // The parameter, its grad and Adam's two moments are each past one binding: the step's
    // product, sum, grad and update all bind windows of buffers the plan holds or makes.
    let n = past_binding();
    let parameter = || {
        Tensor::from_vec(values(n, 5), &[n], dev)
            .unwrap()
            .requires_grad_(true)
    };
    let (p_eager, p_captured) = (parameter(), parameter());
    let config = AdamConfig {
        lr: 0.01,
        ..AdamConfig::default()
    };
    let mut eager_opt = Adam::new(vec![p_eager.clone()], config);
    let mut opt = Adam::new(vec![p_captured.clone()], config);
    let mut step = wgrad::capture::Step::new(|b: &[Tensor]| dot_step(&p_captured, &b[0], &mut opt));
    for call in 0..4 {
        let x = Tensor::from_vec(values(n, 20 + call), &[n], dev).unwrap();
        let want = dot_step(&p_eager, &x, &mut eager_opt)
            .unwrap()
            .item()
            .unwrap();
        let got = step.run(&[x]).unwrap().item().unwrap();
        assert!(
            (got - want).abs() <= 1e-6 * want.abs().max(1.0),
            "call {call}: loss {got} vs {want}"
        );
    }
    assert_eq!(step.stats().replays, 2, "{:?}", step.stats());
    let (got, want) = (p_captured.to_vec().unwrap(), p_eager.to_vec().unwrap());
    let differ = got.iter().zip(&want).position(|(g, w)| g != w);
    assert_eq!(
        differ, None,
        "the parameters differ from element {differ:?} on"
    );
}

#[test]
fn topk_and_sort_past_one_binding_match_the_host_in_runs_of_rows() {
    let dev = device();
    let len = 1000;
    let rows = past_binding() / len + 1;
    let host = values(rows * len, 7);
    let x = Tensor::from_vec(host.clone(), &[rows, len], dev)
        .unwrap()
        .requires_grad_(true);
    // Stable, largest first: ties in position order.
    let ranked = |line: &[f32]| -> Vec<usize> {
        let mut order: Vec<usize> = (0..line.len()).collect();
        order.sort_by(|&a, &b| line[b].total_cmp(&line[a]));
        order
    };
    let (top, positions) = x.topk(3, 1).unwrap();
    assert_eq!(top.shape(), &[rows, 3]);
    let c = Tensor::full(&[rows, 3], 2.0, dev).unwrap();
    top.mul(&c).unwrap().sum().unwrap().backward().unwrap();
    let grad = x.grad().unwrap();
    for r in [0, rows / 2, rows - 1] {
        let line = &host[r * len..(r + 1) * len];
        let want: Vec<usize> = ranked(line)[..3].to_vec();
        let got = positions.narrow(0, r, 1).unwrap().contiguous().unwrap();
        let got: Vec<usize> = got
            .to_vec_u32()
            .unwrap()
            .iter()
            .map(|&i| i as usize)
            .collect();
        assert_eq!(got, want, "row {r}'s top 3");
        let row_grad = grad
            .narrow(0, r, 1)
            .unwrap()
            .contiguous()
            .unwrap()
            .to_vec()
            .unwrap();
        for (i, g) in row_grad.iter().enumerate() {
            assert_eq!(
                *g,
                if want.contains(&i) { 2.0 } else { 0.0 },
                "row {r}, grad {i}"
            );
        }
    }
    // Along the first dim: each column sorted, ascending.
    let (sorted, _) = x.detach().sort(0, false).unwrap();
    for col in [0, 517, len - 1] {
        let mut want: Vec<f32> = (0..rows).map(|r| host[r * len + col]).collect();
        want.sort_by(f32::total_cmp);
        let got = sorted
            .narrow(1, col, 1)
            .unwrap()
            .contiguous()
            .unwrap()
            .to_vec()
            .unwrap();
        assert_eq!(got, want, "column {col}");
    }
}

#[test]
fn attention_of_an_empty_view_of_a_buffer_past_one_binding_is_empty() {
    let dev = device();
    // No rows of a buffer past one binding: nothing to bind, so nothing to split.
    let n = past_binding() / 64 * 64;
    let big = Tensor::zeros(&[n / 64, 4, 16], dev).unwrap();
    let none = big.narrow(0, 1, 0).unwrap();
    let out = none
        .scaled_dot_product_attention(&none, &none, true)
        .unwrap();
    assert_eq!(out.shape(), &[0, 4, 16]);
}

#[test]
fn attention_of_strided_views_of_a_buffer_filling_one_binding_matches_dense_copies() {
    let dev = device();
    // Rows of 4 features in a buffer that fills one binding: q and k are their first 3, v
    // their last. q's span, all of the buffer but its last element, is past what a window
    // of it may cover, while the buffer binds whole. (The check for windows and the one for
    // a call disagreed on it: attention chunked itself until the stack overflowed.)
    let (t, d) = (8, 3);
    let heads = dev.max_binding_bytes() as usize / (t * (d + 1) * 4);
    let stored = Tensor::from_vec(values(heads * t * (d + 1), 1), &[1, heads, t, d + 1], dev)
        .unwrap()
        .requires_grad_(true);
    let (qk, v) = (
        stored.narrow(3, 0, d).unwrap(),
        stored.narrow(3, d, 1).unwrap(),
    );
    let dense = |x: &Tensor| {
        let values = x.contiguous().unwrap().to_vec().unwrap();
        (Tensor::from_vec(values, x.shape(), dev).unwrap()).requires_grad_(true)
    };
    let (dense_qk, dense_v) = (dense(&qk), dense(&v));
    let pattern: Vec<f32> = (0..t).map(|i| ((i * 13) % 7) as f32 - 3.0).collect();
    let pattern = Tensor::from_vec(pattern, &[1, 1, t, 1], dev).unwrap();
    let out = qk.scaled_dot_product_attention(&qk, &v, true).unwrap();
    weighted_sum_backward(&out, &pattern);
    let want = (dense_qk.scaled_dot_product_attention(&dense_qk, &dense_v, true)).unwrap();
    weighted_sum_backward(&want, &pattern);
    assert_eq!(out.to_vec().unwrap(), want.to_vec().unwrap(), "out");
    let grad = stored.grad().unwrap();
    for (features, want, what) in [
        (grad.narrow(3, 0, d).unwrap(), &dense_qk, "q and k grad"),
        (grad.narrow(3, d, 1).unwrap(), &dense_v, "v grad"),
    ] {
        assert_eq!(
            features.contiguous().unwrap().to_vec().unwrap(),
            want.grad().unwrap().to_vec().unwrap(),
            "{what}"
        );
    }
}

#[test]
fn gather_and_argmax_of_an_empty_view_of_a_buffer_past_one_binding_are_empty() {
    let dev = device();
    // No slices of a buffer past one binding: one empty run, not none joined (an error).
    let n = past_binding() / 64 * 64;
    let big = Tensor::zeros(&[n / 64, 4, 16], dev).unwrap();
    let none = big.narrow(0, 1, 0).unwrap();
    let indices = Tensor::from_vec_u32(Vec::new(), &[0, 2, 16], dev).unwrap();
    assert_eq!(none.gather(1, &indices).unwrap().shape(), &[0, 2, 16]);
    assert_eq!(none.argmax(2, false).unwrap().shape(), &[0, 4]);
}

#[test]
fn copy_into_a_strided_f16_view_past_one_binding_writes_every_run() {
    let dev = device();
    // Columns 1..4 of rows of 5 halves, the buffer past one binding: runs of rows, each
    // written into a window, every row's run starting inside a word.
    let rows = (dev.max_binding_bytes() as usize / 10 + 1000) / 2 * 2 + 1;
    let base = Tensor::zeros(&[rows, 5], dev)
        .unwrap()
        .to_dtype(DType::F16)
        .unwrap();
    let incoming: Vec<f32> = (0..rows * 3).map(|i| (i % 2000) as f32).collect();
    let src = Tensor::from_vec(incoming, &[rows, 3], dev)
        .unwrap()
        .to_dtype(DType::F16)
        .unwrap();
    base.narrow(1, 1, 3).unwrap().copy_(&src).unwrap();
    let flat = base.to_dtype(DType::F32).unwrap();
    for row in [0, 1, rows / 2, rows - 2, rows - 1] {
        let want: Vec<f32> = (0..5)
            .map(|c| match c {
                1..=3 => ((row * 3 + c - 1) % 2000) as f32,
                _ => 0.0,
            })
            .collect();
        let positions: Vec<usize> = (0..5).map(|c| row * 5 + c).collect();
        assert_eq!(at(&flat, &positions), want, "row {row}");
    }
}

#[test]
fn attention_of_a_small_leaf_with_keys_in_a_buffer_past_one_binding_leaves_it_a_leaf() {
    let dev = device();
    // q fits one binding; k and v are two heads of a buffer past it, bound as windows. q
    // was given a node of its own (its own window was q itself), and the next backward
    // through it failed: "trying to backward through the graph a second time".
    let heads = past_binding() / (8 * 4) + 2;
    let big = Tensor::from_vec(values(heads * 8 * 4, 2), &[heads, 8, 4], dev).unwrap();
    let kv = big.narrow(0, heads - 2, 2).unwrap().unsqueeze(0).unwrap();
    let q = Tensor::from_vec(values(2 * 8 * 4, 1), &[1, 2, 8, 4], dev)
        .unwrap()
        .requires_grad_(true);
    let mut grads = Vec::new();
    for _ in 0..2 {
        q.zero_grad();
        let out = q.scaled_dot_product_attention(&kv, &kv, true).unwrap();
        out.sum().unwrap().backward().unwrap();
        grads.push(q.grad().unwrap().to_vec().unwrap());
    }
    assert!(q.is_leaf());
    assert_eq!(grads[0], grads[1]);
}

#[test]
fn a_product_of_two_operands_past_one_binding_matches_the_host() {
    let dev = device();
    // x [64, k] and w [64, k], each past one binding: x @ w^T takes runs of x's rows, each
    // times runs of w's rows; the grads c @ w and c^T @ x take runs of k.
    let k = (dev.max_binding_bytes() / 4 / 64) as usize + 1;
    let (xs, ws) = (values(64 * k, 3), values(64 * k, 4));
    let leaf = |v: &[f32]| {
        Tensor::from_vec(v.to_vec(), &[64, k], dev)
            .unwrap()
            .requires_grad_(true)
    };
    let (x, w) = (leaf(&xs), leaf(&ws));
    let out = x.matmul(&w.t().unwrap()).unwrap();
    let cs: Vec<f32> = (0..64 * 64).map(|i| (i % 5) as f32 - 2.0).collect();
    let c = Tensor::from_vec(cs.clone(), &[64, 64], dev).unwrap();
    weighted_sum_backward(&out, &c);
    let close = |got: f32, want: f64, what: &str| {
        assert!(
            (got as f64 - want).abs() <= 1e-4 * want.abs().max(1.0),
            "{what}: {got} vs {want}"
        );
    };
    let got = out.to_vec().unwrap();
    for (i, j) in [(0, 0), (5, 63), (63, 17)] {
        let want: f64 = (0..k)
            .map(|l| xs[i * k + l] as f64 * ws[j * k + l] as f64)
            .sum();
        close(got[i * 64 + j], want, &format!("out[{i}][{j}]"));
    }
    // x's grad c @ w, and w's grad c^T @ x, at a few elements.
    let probes = [0, 1, k / 2, k - 1];
    let flat = |row: usize| probes.map(|l| row * k + l);
    for row in [0, 63] {
        let got = at(&x.grad().unwrap(), &flat(row));
        for (p, &l) in probes.iter().enumerate() {
            let want: f64 = (0..64)
                .map(|j| cs[row * 64 + j] as f64 * ws[j * k + l] as f64)
                .sum();
            close(got[p], want, &format!("x grad[{row}][{l}]"));
        }
        let got = at(&w.grad().unwrap(), &flat(row));
        for (p, &l) in probes.iter().enumerate() {
            let want: f64 = (0..64)
                .map(|i| cs[i * 64 + row] as f64 * xs[i * k + l] as f64)
                .sum();
            close(got[p], want, &format!("w grad[{row}][{l}]"));
        }
    }
}

#[test]
fn rotary_embeddings_past_one_binding_match_their_heads_alone() {
    let dev = device();
    // x [heads, 64, 32] past one binding: windows of whole sequences, each from position 3.
    let (t, d) = (64, 32);
    let heads = past_binding() / (t * d) + 1;
    let host = values(heads * t * d, 9);
    let x = Tensor::from_vec(host.clone(), &[heads, t, d], dev)
        .unwrap()
        .requires_grad_(true);
    let rope = nn::RotaryEmbedding::new(d, t + 3, 10_000.0, dev).unwrap();
    let out = rope.apply(&x, 3).unwrap();
    let c = Tensor::from_vec(values(t * d, 10), &[1, t, d], dev).unwrap();
    weighted_sum_backward(&out, &c);
    for h in [0, heads / 2, heads - 1] {
        let head = &host[h * t * d..(h + 1) * t * d];
        let alone = Tensor::from_vec(head.to_vec(), &[1, t, d], dev)
            .unwrap()
            .requires_grad_(true);
        let out_alone = rope.apply(&alone, 3).unwrap();
        weighted_sum_backward(&out_alone, &c);
        let slice = |x: &Tensor| slice_values(x, 0, h);
        assert_eq!(
            slice(&out),
            out_alone.to_vec().unwrap(),
            "head {h}'s output"
        );
        assert_eq!(
            slice(&x.grad().unwrap()),
            alone.grad().unwrap().to_vec().unwrap(),
            "head {h}'s grad"
        );
    }
}

#[test]
fn a_small_table_looked_up_past_one_binding_takes_its_grad_in_runs() {
    let dev = device();
    // A table of 8 wide rows, looked up by more tokens than one binding holds rows of: the
    // lookups and the scatter of their grad go in runs.
    let width = 4096;
    let tokens = (dev.max_binding_bytes() as usize) / (width * 4) + 1;
    let emb = nn::Embedding::new(8, width, dev).unwrap();
    let ids: Vec<u32> = (0..tokens as u32).map(|i| i * 3 % 8).collect();
    let ids = Tensor::from_vec_u32(ids, &[tokens], dev).unwrap();
    let out = emb.forward(&ids).unwrap();
    assert!(out.numel() * 4 > dev.max_binding_bytes() as usize);
    out.sum().unwrap().backward().unwrap();
    // Each row's grad is how often it was looked up, in every feature.
    let grad = emb.weight.grad().unwrap().to_vec().unwrap();
    for row in 0..8 {
        let count = (0..tokens).filter(|i| i * 3 % 8 == row).count() as f32;
        assert!(
            grad[row * width..(row + 1) * width]
                .iter()
                .all(|&g| g == count),
            "row {row}"
        );
    }
}

#[test]
fn attention_over_heads_of_a_packed_projection_past_one_binding_copies_each_chunk() {
    let dev = device();
    // q, k and v are heads of one packed [1, T, 3 H D] projection past one binding: each head
    // spans nearly all of it, so each chunk of heads is copied dense before it attends.
    let (t, d) = (64, 8);
    let heads = (dev.max_binding_bytes() as usize / 4 / (t - 1) / 3) / d + 1;
    let width = heads * d;
    let host = values(t * 3 * width, 11);
    let qkv = Tensor::from_vec(host.clone(), &[1, t, 3 * width], dev)
        .unwrap()
        .requires_grad_(true);
    let part = |i: usize| {
        (qkv.narrow(2, i * width, width).unwrap())
            .reshape(&[1, t, heads, d])
            .unwrap()
            .transpose(1, 2)
            .unwrap()
    };
    let q = part(0);
    // Row t - 1 of q's last head ends (t - 1) rows of 3 H D after row 0 of its first begins.
    let span = (t - 1) * 3 * width + width;
    assert!(
        span * 4 > dev.max_binding_bytes() as usize,
        "q spans past one binding"
    );
    let out = q
        .scaled_dot_product_attention(&part(1), &part(2), true)
        .unwrap();
    let c = Tensor::from_vec(values(t * d, 12), &[1, 1, t, d], dev).unwrap();
    weighted_sum_backward(&out, &c);
    let grad = qkv.grad().unwrap().to_vec().unwrap();
    for h in [0, heads / 2, heads - 1] {
        // Head h's rows of q, k and v, as tensors of their own.
        let head = |i: usize| -> Vec<f32> {
            (0..t)
                .flat_map(|r| {
                    let at = r * 3 * width + i * width + h * d;
                    host[at..at + d].to_vec()
                })
                .collect()
        };
        let alone: Vec<Tensor> = (0..3)
            .map(|i| {
                Tensor::from_vec(head(i), &[1, 1, t, d], dev)
                    .unwrap()
                    .requires_grad_(true)
            })
            .collect();
        let out_alone =
            (alone[0].scaled_dot_product_attention(&alone[1], &alone[2], true)).unwrap();
        weighted_sum_backward(&out_alone, &c);
        let got = out
            .narrow(1, h, 1)
            .unwrap()
            .contiguous()
            .unwrap()
            .to_vec()
            .unwrap();
        assert_eq!(got, out_alone.to_vec().unwrap(), "head {h}'s output");
        for (i, tensor) in alone.iter().enumerate() {
            let want = tensor.grad().unwrap().to_vec().unwrap();
            let got: Vec<f32> = (0..t)
                .flat_map(|r| {
                    let at = r * 3 * width + i * width + h * d;
                    grad[at..at + d].to_vec()
                })
                .collect();
            assert_eq!(got, want, "head {h}'s grad of part {i}");
        }
    }
}

#[test]
fn a_product_of_an_empty_view_of_a_buffer_past_one_binding_is_empty() {
    let dev = device();
    let n = past_binding() / 8 * 8;
    let big = Tensor::zeros(&[n / 8, 8], dev).unwrap();
    let w = Tensor::ones(&[8, 3], dev).unwrap();
    let none = big.narrow(0, 1, 0).unwrap();
    assert_eq!(none.matmul(&w).unwrap().shape(), &[0, 3]);
    // No k: zeros.
    let no_k = big.narrow(1, 0, 0).unwrap();
    let zeros = no_k.matmul(&Tensor::zeros(&[0, 3], dev).unwrap()).unwrap();
    assert_eq!(zeros.to_vec().unwrap(), vec![0.0; n / 8 * 3]);
}
