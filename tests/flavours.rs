//! The ops of the ops issue give the same values and grads on both kernel flavours: the CPU
//! flavour (the shared lavapipe device; its results are checked against f64 references in
//! the ops' own tests) and the GPU flavour (a second software device forced to it, which runs
//! the kernels GPUs and GL get: no subgroups, workgroup-per-row entries, the matmul's block
//! tiles and register tiles, which read a convolution's columns from its images).

mod common;
use common::*;
use wgrad::nn::loss::{cross_entropy_with, CrossEntropyOptions};
use wgrad::{
    Conv1dOptions, Conv2dOptions, ConvTranspose2dOptions, DType, Device, Interpolate, KernelFlavor,
    Pool2dOptions, Result, Tensor,
};

/// An op of leaves to run on each device: the loss of its output against a fixed probe.
type Op = fn(&[Tensor]) -> Result<Tensor>;

/// The output and every leaf's grad of `op` on `dev`, the leaves of `shapes` drawn from seeds.
fn run(dev: &Device, shapes: &[&[usize]], op: Op) -> Vec<Vec<f32>> {
    let leaves: Vec<Tensor> = shapes
        .iter()
        .enumerate()
        .map(|(i, s)| {
            let values = random_vec(s.iter().product(), 10 + i as u64);
            Tensor::from_slice(&values, s, dev)
                .unwrap()
                .requires_grad_(true)
        })
        .collect();
    let out = op(&leaves).unwrap();
    let probe = Tensor::from_slice(&random_vec(out.numel(), 99), out.shape(), dev).unwrap();
    out.mul(&probe).unwrap().sum().unwrap().backward().unwrap();
    let mut results = vec![out.to_vec().unwrap()];
    results.extend(leaves.iter().map(|l| l.grad().unwrap().to_vec().unwrap()));
    results
}

fn assert_flavours_agree(name: &str, shapes: &[&[usize]], op: Op) {
    assert_flavours_agree_within(name, shapes, 1e-4, op);
}

/// As [`assert_flavours_agree`], to relative error `rel` (a 16-bit result may round the other
/// way when the flavours sum in another order).
fn assert_flavours_agree_within(name: &str, shapes: &[&[usize]], rel: f64, op: Op) {
    let cpu = run(device(), shapes, op);
    let gpu_device = Device::software().unwrap();
    gpu_device.set_kernel_flavor(KernelFlavor::Gpu);
    let gpu = run(&gpu_device, shapes, op);
    for (i, (c, g)) in cpu.iter().zip(&gpu).enumerate() {
        let want: Vec<f64> = c.iter().map(|&x| x as f64).collect();
        let what = if i == 0 {
            format!("{name}: output")
        } else {
            format!("{name}: grad {i}")
        };
        assert_close(g, &want, rel, &what);
    }
}

#[test]
fn convolutions_agree_across_flavours() {
    assert_flavours_agree("conv2d per axis", &[&[2, 3, 8, 8], &[4, 3, 3, 1]], |t| {
        let o = Conv2dOptions {
            stride: (2, 1),
            padding: (1, 0),
            dilation: (1, 2),
            groups: 1,
        };
        t[0].conv2d_with(&t[1], None, o)
    });
    assert_flavours_agree(
        "conv_transpose2d",
        &[&[2, 4, 4, 4], &[4, 3, 3, 3], &[3]],
        |t| {
            let o = ConvTranspose2dOptions {
                stride: 2,
                padding: 1,
                output_padding: 1,
                ..Default::default()
            };
            t[0].conv_transpose2d(&t[1], Some(&t[2]), &o)
        },
    );
    assert_flavours_agree("conv1d", &[&[2, 3, 20], &[4, 3, 5]], |t| {
        let o = Conv1dOptions {
            stride: 2,
            padding: 2,
            ..Default::default()
        };
        t[0].conv1d_with(&t[1], None, o)
    });
}

#[test]
fn implicit_gemm_convolutions_agree_across_flavours() {
    // The GPU flavour reads a convolution's column matrix from the images (an implicit GEMM),
    // forward and, with unit stride, for the input grad: on the block tiles with 64 or more
    // output channels (and as many output columns), on register tiles with fewer (the input
    // grads of 5 and 6 channels here, and the 10-channel layer). Partial tiles over several
    // images, k padded to whole 4s (3 x 3 x 5 = 45), k past one panel, padding, stride and
    // dilation.
    fn conv(
        t: &[Tensor],
        stride: (usize, usize),
        padding: (usize, usize),
        dilation: (usize, usize),
    ) -> Result<Tensor> {
        let o = Conv2dOptions {
            stride,
            padding,
            dilation,
            groups: 1,
        };
        t[0].conv2d_with(&t[1], Some(&t[2]), o)
    }
    let padded: Op = |t| conv(t, (1, 1), (1, 1), (1, 1));
    assert_flavours_agree(
        "conv2d 5->70 10x10",
        &[&[3, 5, 10, 10], &[70, 5, 3, 3], &[70]],
        padded,
    );
    assert_flavours_agree(
        "conv2d 64->130 6x6 (input grad on block tiles)",
        &[&[2, 64, 6, 6], &[130, 64, 3, 3], &[130]],
        padded,
    );
    assert_flavours_agree(
        "conv2d 4->128 12x12",
        &[&[2, 4, 12, 12], &[128, 4, 3, 3], &[128]],
        padded,
    );
    assert_flavours_agree(
        "conv2d 3->10 9x12",
        &[&[3, 3, 9, 12], &[10, 3, 3, 3], &[10]],
        padded,
    );
    let strided: Op = |t| conv(t, (2, 2), (1, 1), (1, 1));
    assert_flavours_agree(
        "conv2d stride 2",
        &[&[3, 3, 16, 16], &[64, 3, 3, 3], &[64]],
        strided,
    );
    let dilated: Op = |t| conv(t, (1, 1), (2, 1), (2, 1));
    assert_flavours_agree(
        "conv2d dilation (2, 1)",
        &[&[2, 6, 9, 8], &[72, 6, 3, 3], &[72]],
        dilated,
    );
}

#[test]
fn layer_and_rms_norms_agree_across_flavours() {
    // The GPU flavour gives each row of 512 or more a workgroup (its invocations stride
    // through the row's groups of 4), and a shorter row a subgroup where the device has
    // subgroups (else an invocation, as the CPU flavour does). Rows of several strides,
    // unaligned rows, one feature, and rows whose squares overflow f32 (the rescaled second
    // pass).
    assert_flavours_agree("layer_norm 70x24", &[&[70, 24], &[24], &[24]], |t| {
        t[0].layer_norm(&t[1], &t[2], 1e-5)
    });
    assert_flavours_agree("layer_norm 5x1030", &[&[5, 1030], &[1030], &[1030]], |t| {
        t[0].layer_norm(&t[1], &t[2], 1e-5)
    });
    assert_flavours_agree("rms_norm 3x517", &[&[3, 517], &[517]], |t| {
        t[0].rms_norm(&t[1], 1e-6)
    });
    assert_flavours_agree("rms_norm 65x130", &[&[65, 130], &[130]], |t| {
        t[0].rms_norm(&t[1], 1e-6)
    });
    assert_flavours_agree("layer_norm 3x1", &[&[3, 1], &[1], &[1]], |t| {
        t[0].layer_norm(&t[1], &t[2], 1e-5)
    });
    assert_flavours_agree(
        "layer_norm of short 1e30s",
        &[&[9, 40], &[40], &[40]],
        |t| t[0].mul_scalar(1e30)?.layer_norm(&t[1], &t[2], 1e-5),
    );
    assert_flavours_agree("layer_norm of 1e30s", &[&[4, 600], &[600], &[600]], |t| {
        t[0].mul_scalar(1e30)?.layer_norm(&t[1], &t[2], 1e-5)
    });
    assert_flavours_agree("rms_norm of 1e30s", &[&[4, 601], &[601]], |t| {
        t[0].mul_scalar(1e30)?.rms_norm(&t[1], 1e-6)
    });
}

#[test]
fn norms_rotary_and_resampling_agree_across_flavours() {
    assert_flavours_agree("rms_norm", &[&[70, 24], &[24]], |t| {
        t[0].rms_norm(&t[1], 1e-6)
    });
    assert_flavours_agree("group_norm", &[&[2, 6, 5], &[6], &[6]], |t| {
        t[0].group_norm(3, Some(&t[1]), Some(&t[2]), 1e-5)
    });
    assert_flavours_agree("rope", &[&[2, 3, 9, 8]], |t| {
        wgrad::nn::RotaryEmbedding::new(8, 16, 10000.0, t[0].device())?.apply(&t[0], 2)
    });
    assert_flavours_agree("interpolate", &[&[2, 2, 5, 3]], |t| {
        t[0].interpolate((7, 8), Interpolate::Bilinear)
    });
    assert_flavours_agree("pools", &[&[2, 2, 7, 6]], |t| {
        let o = Pool2dOptions {
            padding: 1,
            ceil_mode: true,
            count_include_pad: false,
            ..Pool2dOptions::new(3, 2)
        };
        t[0].max_pool2d_with(&o)?.add(&t[0].avg_pool2d_with(&o)?)
    });
}

#[test]
fn reductions_agree_across_flavours() {
    // Rows past 65,536 elements reduce in two passes of workgroup rows on the GPU flavour.
    assert_flavours_agree("sum and mean of rows", &[&[3, 70_001]], |t| {
        t[0].sum_dims(&[1], false)?
            .add(&t[0].mean_dims(&[1], false)?)
    });
    assert_flavours_agree("max of rows, odd lengths", &[&[5, 300], &[1, 1]], |t| {
        t[0].max_dims(&[1], true)?.add(&t[1].max_dims(&[1], true)?)
    });
    assert_flavours_agree("sum of a leading dim and of everything", &[&[37, 9]], |t| {
        t[0].sum_dims(&[0], false)?.sum()?.add(&t[0].max()?)
    });
}

#[test]
fn a_max_of_rows_propagates_nan_on_the_gpu_flavour() {
    let dev = Device::software().unwrap();
    dev.set_kernel_flavor(KernelFlavor::Gpu);
    let mut values = random_vec(2 * 1000, 7);
    values[1000 + 517] = f32::NAN;
    let x = Tensor::from_slice(&values, &[2, 1000], &dev).unwrap();
    let max = x.max_dims(&[1], false).unwrap().to_vec().unwrap();
    let want = values[..1000].iter().cloned().fold(f32::MIN, f32::max);
    assert_eq!(max[0], want);
    assert!(max[1].is_nan(), "{max:?}");
}

#[test]
fn softmax_rows_agree_across_flavours() {
    // Short rows (a subgroup each where the device has subgroups), long ones (a workgroup),
    // and fewer rows than a serial workgroup takes (lanes per row on the CPU flavour too).
    for shape in [[70, 65], [9, 1500], [3, 1]] {
        assert_flavours_agree("softmax and log_softmax", &[&shape], |t| {
            t[0].softmax(1)?.add(&t[0].log_softmax(1)?)
        });
    }
    assert_flavours_agree("cross_entropy, long rows", &[&[5, 1500]], |t| {
        let y = Tensor::from_labels(vec![0, 1499, 7, 700, 3], t[0].device())?;
        wgrad::nn::loss::cross_entropy(&t[0], &y)
    });
}

#[test]
fn losses_sorting_and_scatter_agree_across_flavours() {
    assert_flavours_agree("cross_entropy_with", &[&[70, 6]], |t| {
        let labels: Vec<u32> = (0..70).map(|i| (i % 6) as u32).collect();
        let y = Tensor::from_labels(labels, t[0].device())?;
        let weight = Tensor::from_vec(vec![0.5, 1.0, 1.5, 2.0, 1.0, 0.25], &[6], t[0].device())?;
        let opts = CrossEntropyOptions {
            ignore_index: Some(2),
            label_smoothing: 0.1,
            weight: Some(&weight),
            ..Default::default()
        };
        cross_entropy_with(&t[0], &y, &opts)
    });
    assert_flavours_agree("sort and topk", &[&[3, 40]], |t| {
        t[0].sort(1, false)?
            .0
            .narrow(1, 0, 5)?
            .add(&t[0].topk(5, 1)?.0)
    });
    assert_flavours_agree("scatter_add", &[&[3, 5], &[3, 4]], |t| {
        let idx = Tensor::from_vec_u32(
            vec![0, 4, 4, 1, 2, 2, 2, 2, 3, 0, 1, 3],
            &[3, 4],
            t[0].device(),
        )?;
        t[0].scatter_add(1, &idx, &t[1])
    });
}

#[test]
fn matmuls_of_128_by_128_tiles_agree_across_flavours() {
    // Products of at least 128 rows and columns run the GPU flavour's `block_tiled` (128 x 128
    // tiles); their grads read the operands transposed. Odd sizes leave partial tiles and a k
    // tail within a panel.
    assert_flavours_agree("matmul 130x70x200", &[&[130, 70], &[70, 200]], |t| {
        t[0].matmul(&t[1])
    });
    assert_flavours_agree(
        "batched matmul 3x150x260x129",
        &[&[3, 150, 260], &[260, 129]],
        |t| t[0].matmul(&t[1]),
    );
    assert_flavours_agree(
        "matmul of a transposed view",
        &[&[200, 131], &[200, 140]],
        |t| t[0].t()?.matmul(&t[1]),
    );
    // One F16 rounding of the product (and of each grad) apart at most.
    let f16_matmul: Op = |t| {
        let (a, b) = (t[0].to_dtype(DType::F16)?, t[1].to_dtype(DType::F16)?);
        a.matmul(&b)?.to_dtype(DType::F32)
    };
    assert_flavours_agree_within(
        "F16 matmul 129x64x257",
        &[&[129, 64], &[64, 257]],
        1e-3,
        f16_matmul,
    );
}

#[test]
fn matmuls_of_64_by_64_tiles_agree_across_flavours() {
    // Products of 64 to 127 rows or columns (at least 64 of both) run the GPU flavour's
    // `block_tiled_64`; partial tiles, a k tail within a panel, batches and transposed reads.
    assert_flavours_agree("matmul 70x50x100", &[&[70, 50], &[50, 100]], |t| {
        t[0].matmul(&t[1])
    });
    assert_flavours_agree(
        "batched matmul 3x64x37x300",
        &[&[3, 64, 37], &[3, 37, 300]],
        |t| t[0].matmul(&t[1]),
    );
    assert_flavours_agree(
        "matmul of a transposed view",
        &[&[90, 127], &[90, 65]],
        |t| t[0].t()?.matmul(&t[1]),
    );
}

#[test]
fn skinny_matmuls_agree_across_flavours() {
    // Products with a side under 64 run the GPU flavour's `register_tiled`; their grads are
    // skinny too (a 9-tap weight's grad, a 10-class head's).
    assert_flavours_agree("matmul 37x9x300", &[&[37, 9], &[9, 300]], |t| {
        t[0].matmul(&t[1])
    });
    assert_flavours_agree("matmul 300x70x10", &[&[300, 70], &[70, 10]], |t| {
        t[0].matmul(&t[1])
    });
    assert_flavours_agree(
        "batched matmul 5x32x101x9",
        &[&[5, 32, 101], &[5, 101, 9]],
        |t| t[0].matmul(&t[1]),
    );
    assert_flavours_agree("matmul of transposed views", &[&[70, 13], &[90, 70]], |t| {
        t[0].t()?.matmul(&t[1].t()?)
    });
}
