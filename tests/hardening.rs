//! Regression tests for what fuzzing and a new user's tries found: empty dims, NaN, u32
//! tensors that require grad, huge views, 1-D operands in batched matmul, repeated dims,
//! sizes, strides, paddings and diagonals whose arithmetic would overflow.

mod common;
use common::*;
use wgrad::nn::{self, Module};
use wgrad::{Error, Tensor};

#[test]
fn reshape_of_an_empty_tensor_is_a_view_not_a_recursion() {
    let z = Tensor::zeros(&[2, 0], device()).unwrap();
    assert_eq!(z.reshape(&[0]).unwrap().shape(), &[0]);
    assert_eq!(z.reshape(&[0, 5]).unwrap().shape(), &[0, 5]);
    assert!(z.is_contiguous());
}

#[test]
fn backward_through_ops_on_empty_dims_gives_empty_grads() {
    let e = Tensor::zeros(&[2, 0, 3], device())
        .unwrap()
        .requires_grad_(true);
    let losses = [
        e.sum_dims(&[1], false).unwrap().sum().unwrap(),
        e.unsqueeze(0).unwrap().sum().unwrap(),
        e.expand(&[2, 2, 0, 3]).unwrap().sum().unwrap(),
        e.max_dims(&[2], false).unwrap().sum().unwrap(),
    ];
    for loss in losses {
        e.zero_grad();
        loss.backward().unwrap();
        assert_eq!(e.grad().unwrap().shape(), &[2, 0, 3]);
    }
}

#[test]
fn matmul_with_empty_batch_dims_and_embedding_of_no_tokens() {
    let dev = device();
    let a = Tensor::zeros(&[2, 0, 3, 2], dev).unwrap();
    let b = Tensor::zeros(&[2, 2], dev).unwrap();
    assert_eq!(a.matmul(&b).unwrap().shape(), &[2, 0, 3, 2]);
    let emb = nn::Embedding::new(5, 3, dev).unwrap();
    let none = Tensor::from_vec_u32(vec![], &[2, 0], dev).unwrap();
    assert_eq!(emb.forward(&none).unwrap().shape(), &[2, 0, 3]);
}

#[test]
fn batched_matmul_with_a_1d_operand_has_the_right_grads() {
    gradcheck(
        "[2,3,4] @ [4]",
        &[
            (vec![2, 3, 4], values_in(24, -1.0, 1.0, 1)),
            (vec![4], values_in(4, -1.0, 1.0, 2)),
        ],
        |t| t[0].matmul(&t[1]),
    );
    gradcheck(
        "[4] @ [2,4,3]",
        &[
            (vec![4], values_in(4, -1.0, 1.0, 3)),
            (vec![2, 4, 3], values_in(24, -1.0, 1.0, 4)),
        ],
        |t| t[0].matmul(&t[1]),
    );
}

#[test]
fn expand_past_u32_elements_is_an_error() {
    let one = Tensor::zeros(&[1, 1], device()).unwrap();
    let err = one.expand(&[1 << 32, 1 << 32]).unwrap_err();
    assert!(
        matches!(err, Error::InvalidArgument { op: "expand", .. }),
        "{err}"
    );
}

#[test]
fn relu_tanh_maximum_and_max_propagate_nan() {
    let dev = device();
    let x = Tensor::from_vec(vec![1.0, f32::NAN, -3.0, 2.0], &[4], dev).unwrap();
    assert!(x.relu().unwrap().to_vec().unwrap()[1].is_nan());
    assert!(x.tanh().unwrap().to_vec().unwrap()[1].is_nan());
    let zeros = Tensor::zeros(&[4], dev).unwrap();
    let maximum = x.maximum(&zeros).unwrap().to_vec().unwrap();
    assert!(maximum[1].is_nan() && maximum[2] == 0.0);
    assert!(x.max().unwrap().item().unwrap().is_nan());
    // A long row takes the chunked reduction: NaN survives the second pass too.
    let long: Vec<f32> = (0..70_000)
        .map(|i| if i == 50_000 { f32::NAN } else { i as f32 })
        .collect();
    let long = Tensor::from_vec(long, &[70_000], dev).unwrap();
    assert!(long.max().unwrap().item().unwrap().is_nan());
}

#[test]
fn argmax_picks_the_first_nan_on_every_backend() {
    let x = Tensor::from_vec(vec![1.0, 5.0, f32::NAN, 7.0, f32::NAN], &[5], device()).unwrap();
    assert_eq!(x.argmax(0, false).unwrap().to_vec_u32().unwrap(), vec![2]);
}

#[test]
fn a_u32_tensor_never_requires_grad_nor_takes_a_grad() {
    let idx = Tensor::from_vec_u32(vec![1, 2], &[2], device())
        .unwrap()
        .requires_grad_(true);
    assert!(!idx.requires_grad());
    let grad = Tensor::ones(&[2], device()).unwrap();
    let err = idx.set_grad(Some(grad)).unwrap_err();
    assert!(matches!(err, Error::DType { op: "set_grad", .. }), "{err}");
    assert_eq!(idx.to_vec_u32().unwrap(), vec![1, 2]);
}

#[test]
fn a_dim_named_twice_in_a_reduction_is_an_error() {
    let x = Tensor::ones(&[2, 3], device()).unwrap();
    let err = x.sum_dims(&[0, 0], false).unwrap_err();
    assert!(
        matches!(err, Error::InvalidArgument { op: "sum", .. }),
        "{err}"
    );
    assert!(x.mean_dims(&[1, 1], true).is_err());
}

#[test]
fn layer_norm_rejects_a_negative_eps() {
    let err = nn::LayerNorm::new(4, -1e-5, device()).err().unwrap();
    assert!(err.to_string().contains("eps"), "{err}");
    let x = Tensor::ones(&[2, 4], device()).unwrap();
    let (w, b) = (
        Tensor::ones(&[4], device()).unwrap(),
        Tensor::zeros(&[4], device()).unwrap(),
    );
    assert!(x.layer_norm(&w, &b, f32::NAN).is_err());
}

#[test]
fn a_grad_output_on_another_device_is_an_error() {
    let other = wgrad::Device::software().unwrap();
    let x = Tensor::ones(&[2], device()).unwrap().requires_grad_(true);
    let y = x.mul_scalar(2.0).unwrap();
    let g = Tensor::ones(&[2], &other).unwrap();
    let err = y
        .backward_with(wgrad::BackwardOptions {
            grad_output: Some(g),
            ..Default::default()
        })
        .unwrap_err();
    assert!(err.to_string().contains("device"), "{err}");
    assert!(x.grad().is_none());
}

/// Asserts that `result` is an `InvalidArgument` naming `op` whose message holds `needle`.
fn expect_invalid(result: wgrad::Result<Tensor>, op: &str, needle: &str) {
    match result {
        Err(Error::InvalidArgument { op: got, msg }) if got == op && msg.contains(needle) => {}
        other => panic!("{op}: expected an InvalidArgument with {needle:?}, got {other:?}"),
    }
}

#[test]
fn repeats_and_paddings_that_overflow_a_dim_are_errors() {
    let x = Tensor::ones(&[3, 4], device()).unwrap();
    expect_invalid(x.repeat(&[usize::MAX, 1]), "repeat", "overflow");
    expect_invalid(x.pad2d((usize::MAX, 1, 0, 0), 0.0), "pad2d", "overflow");
}

#[test]
fn strides_paddings_dilations_and_kernels_past_u32_are_errors() {
    let dev = device();
    let img = Tensor::ones(&[1, 1, 3, 4], dev).unwrap();
    let w = Tensor::ones(&[1, 1, 2, 2], dev).unwrap();
    let past = u32::MAX as usize + 1;
    let conv = |o: wgrad::Conv2dOptions| img.conv2d_with(&w, None, o);
    let default = wgrad::Conv2dOptions::default();
    for (what, o) in [
        (
            "stride",
            wgrad::Conv2dOptions {
                stride: (1, past),
                ..default
            },
        ),
        (
            "padding",
            wgrad::Conv2dOptions {
                padding: (usize::MAX / 2, 0),
                ..default
            },
        ),
        (
            "dilation",
            wgrad::Conv2dOptions {
                dilation: (past, past),
                ..default
            },
        ),
    ] {
        expect_invalid(conv(o), "conv2d", what);
    }
    let up = wgrad::ConvTranspose2dOptions {
        stride: usize::MAX,
        ..Default::default()
    };
    expect_invalid(
        img.conv_transpose2d(&w, None, &up),
        "conv_transpose2d",
        "stride",
    );
    let pool = wgrad::Pool2dOptions {
        kernel: 2,
        stride: 1,
        padding: usize::MAX,
        ceil_mode: true,
        count_include_pad: false,
    };
    expect_invalid(
        img.max_pool2d_with(&pool),
        "max_pool2d",
        "padding at most half",
    );
    let pool = wgrad::Pool2dOptions {
        kernel: past,
        padding: 0,
        ..pool
    };
    expect_invalid(img.avg_pool2d_with(&pool), "avg_pool2d", "kernel");
}

#[test]
fn a_transposed_convolution_whose_output_side_passes_u32_is_an_error() {
    let dev = device();
    let x = Tensor::ones(&[1, 1, 1, 3], dev).unwrap();
    let w = Tensor::ones(&[1, 1, 1, 1], dev).unwrap();
    let o = wgrad::ConvTranspose2dOptions {
        stride: u32::MAX as usize,
        ..Default::default()
    };
    match x.conv_transpose2d(&w, None, &o) {
        Err(Error::Shape {
            op: "conv_transpose2d",
            msg,
        }) => {
            assert!(msg.contains("past any tensor's"), "{msg}")
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn resampling_to_sides_past_any_tensor_is_an_error() {
    let img = Tensor::ones(&[1, 1, 3, 4], device()).unwrap();
    let nearest = wgrad::Interpolate::Nearest;
    expect_invalid(
        img.interpolate((usize::MAX, 2), nearest),
        "interpolate",
        "elements",
    );
    let err = img.adaptive_avg_pool2d((1 << 31, 1)).unwrap_err();
    assert!(
        matches!(
            err,
            Error::TooLarge {
                op: "adaptive_avg_pool2d",
                ..
            }
        ),
        "{err}"
    );
}

#[test]
fn rotary_positions_and_upsampling_past_usize_are_errors() {
    let dev = device();
    let rope = nn::RotaryEmbedding::new(4, 8, 10_000.0, dev).unwrap();
    let x = Tensor::ones(&[2, 4], dev).unwrap();
    let err = rope.apply(&x, usize::MAX).unwrap_err();
    assert!(matches!(err, Error::Shape { .. }), "{err}");
    let img = Tensor::ones(&[1, 1, 3, 4], dev).unwrap();
    let up = nn::Upsample::new(usize::MAX, wgrad::Interpolate::Nearest);
    expect_invalid(up.forward(&img), "interpolate", "elements");
}

#[test]
fn logsumexp_over_a_dim_past_the_rank_is_an_error() {
    let x = Tensor::ones(&[3, 4], device()).unwrap();
    match x.logsumexp(&[5usize], false) {
        Err(Error::Shape {
            op: "logsumexp", ..
        }) => {}
        other => panic!("{other:?}"),
    }
}

#[test]
fn triangles_of_extreme_diagonals_keep_all_or_nothing() {
    let x = Tensor::ones(&[3, 4], device()).unwrap();
    let all = vec![1.0; 12];
    let none = vec![0.0; 12];
    assert_eq!(x.tril(i64::MAX).unwrap().to_vec().unwrap(), all);
    assert_eq!(x.tril(i64::MIN).unwrap().to_vec().unwrap(), none);
    assert_eq!(x.triu(i64::MIN).unwrap().to_vec().unwrap(), all);
    assert_eq!(x.triu(i64::MAX).unwrap().to_vec().unwrap(), none);
    let err = Tensor::tril_mask(usize::MAX, 2, 0, device()).unwrap_err();
    assert!(
        matches!(
            err,
            Error::InvalidArgument {
                op: "tril_mask",
                ..
            }
        ),
        "{err}"
    );
}

#[test]
fn tensors_too_large_for_the_adapter_fail_before_taking_host_memory() {
    let dev = device();
    let err = Tensor::rand(&[u32::MAX as usize], 0, dev).unwrap_err();
    assert!(matches!(err, Error::TooLarge { op: "rand", .. }), "{err}");
    let err = Tensor::randn(&[1 << 31], 0, dev).unwrap_err();
    assert!(matches!(err, Error::TooLarge { op: "randn", .. }), "{err}");
    let err = nn::Linear::new(60_000, 60_000, true, dev).err().unwrap();
    assert!(matches!(err, Error::TooLarge { .. }), "{err}");
}

#[test]
fn sgd_rejects_nan_dampening_and_nesterov_without_momentum() {
    use wgrad::optim::{Optimizer, Sgd, SgdConfig};
    let p = Tensor::ones(&[2], device()).unwrap().requires_grad_(true);
    p.set_grad(Some(Tensor::ones(&[2], device()).unwrap()))
        .unwrap();
    let bad = [
        SgdConfig {
            dampening: f32::NAN,
            ..Default::default()
        },
        SgdConfig {
            nesterov: true,
            momentum: 0.0,
            ..Default::default()
        },
    ];
    for config in bad {
        let err = Sgd::new(vec![p.clone()], config).step().unwrap_err();
        assert!(err.to_string().contains("Sgd::step"), "{err}");
        assert_eq!(
            p.to_vec().unwrap(),
            vec![1.0, 1.0],
            "the parameter is unchanged"
        );
    }
}

#[test]
fn load_rejects_tensors_the_module_lacks_unless_told_to_skip_them() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("wide.safetensors");
    let wide = nn::Sequential::new()
        .add(nn::Linear::new(2, 2, true, device()).unwrap())
        .add(nn::Linear::new(2, 2, true, device()).unwrap());
    wgrad::io::save(&path, &wide).unwrap();
    let narrow = nn::Sequential::new().add(nn::Linear::new(2, 2, true, device()).unwrap());
    let before = narrow.parameters()[0].to_vec().unwrap();
    let err = wgrad::io::load(&path, &narrow).unwrap_err().to_string();
    assert!(err.contains("1.weight") && err.contains("strict"), "{err}");
    assert_eq!(
        narrow.parameters()[0].to_vec().unwrap(),
        before,
        "unchanged on error"
    );
    let options = wgrad::io::LoadOptions { strict: false };
    let skipped = wgrad::io::load_with(&path, &narrow, options).unwrap();
    assert_eq!(skipped, vec!["1.bias".to_string(), "1.weight".to_string()]);
    assert_eq!(
        narrow.parameters()[0].to_vec().unwrap(),
        wide.parameters()[0].to_vec().unwrap()
    );
}

#[test]
fn save_removes_temporary_files_of_dead_writers() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("model.safetensors");
    // A pid far above any Linux pid_max: no such writer is alive.
    let stale = dir.path().join(".wgrad-4294967-a1b2c3.tmp");
    std::fs::write(&stale, b"half a checkpoint").unwrap();
    // A live writer's (this process's) temporary, and a file that only looks like one.
    let live = dir
        .path()
        .join(format!(".wgrad-{}-d4e5f6.tmp", std::process::id()));
    std::fs::write(&live, b"being written").unwrap();
    let other = dir.path().join(".wgrad-notes.txt");
    std::fs::write(&other, b"not ours").unwrap();
    let model = nn::Linear::new(2, 2, true, device()).unwrap();
    wgrad::io::save(&path, &model).unwrap();
    if std::path::Path::new("/proc/self").exists() {
        assert!(!stale.exists(), "the dead writer's temporary file is gone");
    }
    assert!(live.exists(), "a live writer's temporary is left alone");
    assert!(other.exists(), "a file that is no temporary is left alone");
    let names: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    assert!(
        names.contains(&"model.safetensors".to_string()),
        "{names:?}"
    );
}

/// llvmpipe ends an invocation's loops after 65,535 iterations, silently. Rows, products and
/// lookups past that length are split across invocations, on both kernel flavours.
#[test]
fn lengths_past_65536_give_right_values_on_both_kernel_flavours() {
    let dev = device();
    let default_flavor = dev.kernel_flavor();
    let (m, n) = (64, 100_000);
    // Every row alike: small values, and a peak near the end.
    let row: Vec<f32> = (0..n)
        .map(|i| {
            if i == n - 3 {
                5.0
            } else {
                ((i * 7919) % 1000) as f32 / 1000.0
            }
        })
        .collect();
    let lse = 5.0
        + row
            .iter()
            .map(|&x| (x as f64 - 5.0).exp())
            .sum::<f64>()
            .ln();
    let sum: f64 = row.iter().map(|&x| x as f64).sum();
    for flavor in [wgrad::KernelFlavor::Cpu, wgrad::KernelFlavor::Gpu] {
        dev.set_kernel_flavor(flavor);
        let what = format!("{flavor:?}");
        let x = Tensor::from_vec(row.repeat(m), &[m, n], dev)
            .unwrap()
            .requires_grad_(true);
        let sums = x
            .softmax(1)
            .unwrap()
            .sum_dims(&[1], false)
            .unwrap()
            .to_vec()
            .unwrap();
        assert_close(&sums, &vec![1.0; m], 1e-4, &format!("softmax rows, {what}"));
        let argmax = x.argmax(1, false).unwrap().to_vec_u32().unwrap();
        assert_eq!(argmax, vec![n as u32 - 3; m], "argmax, {what}");
        let row_sums = x.sum_dims(&[1], false).unwrap().to_vec().unwrap();
        assert_close(&row_sums, &vec![sum; m], 1e-4, &format!("sum, {what}"));
        let labels = Tensor::from_labels(vec![7; m], dev).unwrap();
        let loss = wgrad::nn::loss::cross_entropy(&x, &labels).unwrap();
        let want = lse - row[7] as f64;
        assert_close(
            &[loss.item().unwrap()],
            &[want],
            1e-4,
            &format!("cross_entropy, {what}"),
        );
        loss.backward().unwrap();
        // Each row's grad is (softmax - one-hot) / m: it sums to 0; at the peak it is p / m.
        let grad = x.grad().unwrap();
        let grad_sums = grad.sum_dims(&[1], false).unwrap().to_vec().unwrap();
        assert_close(
            &grad_sums,
            &vec![0.0; m],
            1e-5,
            &format!("cross_entropy grad, {what}"),
        );
        let peak = grad.narrow(1, n - 3, 1).unwrap().to_vec().unwrap()[0] as f64;
        let p = (5.0 - lse).exp() / m as f64;
        assert!(
            (peak - p).abs() < 1e-6,
            "cross_entropy grad at the peak, {what}: {peak} vs {p}"
        );

        let k = 70_000;
        let a = Tensor::full(&[2, k], 0.5, dev).unwrap();
        let b = Tensor::ones(&[k, 3], dev).unwrap();
        let product = a.matmul(&b).unwrap().to_vec().unwrap();
        assert_close(
            &product,
            &[35_000.0; 6],
            1e-6,
            &format!("matmul K = {k}, {what}"),
        );

        let table = Tensor::ones(&[5, 2], dev).unwrap().requires_grad_(true);
        let repeated = Tensor::from_vec_u32(vec![3; k], &[k], dev).unwrap();
        let looked_up = table.index_select(0, &repeated).unwrap();
        looked_up.sum().unwrap().backward().unwrap();
        let mut want = vec![0.0; 10];
        want[6] = k as f64;
        want[7] = k as f64;
        let got = table.grad().unwrap().to_vec().unwrap();
        assert_close(&got, &want, 1e-6, &format!("index_select backward, {what}"));
        let column = Tensor::ones(&[2, 1], dev).unwrap().requires_grad_(true);
        let zeros = Tensor::from_vec_u32(vec![0; 2 * k], &[2, k], dev).unwrap();
        column
            .gather(1, &zeros)
            .unwrap()
            .sum()
            .unwrap()
            .backward()
            .unwrap();
        let got = column.grad().unwrap().to_vec().unwrap();
        assert_close(
            &got,
            &[k as f64; 2],
            1e-6,
            &format!("gather backward, {what}"),
        );
    }
    dev.set_kernel_flavor(default_flavor);
}

/// An Embedding's backward costs work in the lookups, not in table rows x lookups: a table
/// of 10,000 rows over 8,192 tokens (a minute before, by gathering per table element) gets
/// the right grads, repeated rows summed.
#[test]
fn embedding_backward_over_a_large_table_scatters_and_sums_repeats() {
    let dev = device();
    let (rows, dim, tokens) = (10_000, 64, 8_192);
    let emb = nn::Embedding::new(rows, dim, dev).unwrap();
    let ids: Vec<u32> = (0..tokens as u32).map(|t| (t * 7919) % 97 * 100).collect();
    let idx = Tensor::from_vec_u32(ids.clone(), &[tokens], dev).unwrap();
    let (g, gv) = random_tensor(&[tokens, dim], 11);
    emb.forward(&idx)
        .unwrap()
        .mul(&g)
        .unwrap()
        .sum()
        .unwrap()
        .backward()
        .unwrap();
    let mut want = vec![0.0f64; rows * dim];
    for (t, &row) in ids.iter().enumerate() {
        for c in 0..dim {
            want[row as usize * dim + c] += gv[t * dim + c] as f64;
        }
    }
    let got = emb.weight.grad().unwrap().to_vec().unwrap();
    assert_close(&got, &want, 1e-4, "embedding grad");
}

/// Index ops trust the bound a u32 tensor was made with; copy_ may not bring values past it.
#[test]
fn copy_into_an_index_tensor_cannot_pass_its_bound() {
    let dev = device();
    let idx = Tensor::from_vec_u32(vec![0, 1, 2], &[3], dev).unwrap();
    let big = Tensor::from_vec_u32(vec![0, 9, 1], &[3], dev).unwrap();
    let err = idx.copy_(&big).unwrap_err();
    assert!(
        matches!(err, Error::InvalidArgument { op: "copy_", .. }),
        "{err}"
    );
    assert_eq!(idx.to_vec_u32().unwrap(), vec![0, 1, 2], "unchanged");
    let small = Tensor::from_vec_u32(vec![2, 2, 0], &[3], dev).unwrap();
    idx.copy_(&small).unwrap();
    assert_eq!(idx.to_vec_u32().unwrap(), vec![2, 2, 0]);
    let table = Tensor::ones(&[3, 2], dev).unwrap();
    assert!(table.index_select(0, &idx).is_ok());
}
