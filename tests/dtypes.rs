//! F16 and BF16 tensors (docs/ops.md, "DTypes"): stored two to a 32-bit word, cast to and from
//! every dtype on the device, rounded as torch rounds, and refused by the kernels that do not
//! read them yet with a dtype error rather than a wrong answer.

mod common;
use common::*;
use half::{bf16, f16};
use wgrad::{DType, Error, Tensor};

/// `tools/dtype_fixtures.py`: f32 bit patterns and torch's `.half()` and `.bfloat16()` of them.
struct RoundTrips {
    f32: Vec<u32>,
    f16: Vec<u16>,
    bf16: Vec<u16>,
}

fn round_trips() -> RoundTrips {
    let text = include_str!("fixtures/dtype_round_trips.json");
    let json: serde_json::Value = serde_json::from_str(text).unwrap();
    let list = |key: &str| -> Vec<u64> {
        json[key]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap())
            .collect()
    };
    RoundTrips {
        f32: list("f32").into_iter().map(|v| v as u32).collect(),
        f16: list("f16").into_iter().map(|v| v as u16).collect(),
        bf16: list("bf16").into_iter().map(|v| v as u16).collect(),
    }
}

fn f32_tensor_of_bits(bits: &[u32]) -> Tensor {
    let values: Vec<f32> = bits.iter().map(|&b| f32::from_bits(b)).collect();
    let n = values.len();
    Tensor::from_vec(values, &[n], device()).unwrap()
}

fn bits_of(values: &[f32]) -> Vec<u32> {
    values.iter().map(|v| v.to_bits()).collect()
}

/// The 16-bit patterns of `x` cast to `dtype` (F16 or BF16) on the device.
fn cast_bits(x: &Tensor, dtype: DType) -> Vec<u16> {
    let y = x.to_dtype(dtype).unwrap();
    match dtype {
        DType::F16 => y
            .to_vec_f16()
            .unwrap()
            .into_iter()
            .map(f16::to_bits)
            .collect(),
        _ => y
            .to_vec_bf16()
            .unwrap()
            .into_iter()
            .map(bf16::to_bits)
            .collect(),
    }
}

/// Each fixture value cast to `dtype` equals torch's bits.
fn assert_casts_as_torch(dtype: DType, torch: impl Fn(&RoundTrips) -> &Vec<u16>) {
    let fixture = round_trips();
    let got = cast_bits(&f32_tensor_of_bits(&fixture.f32), dtype);
    for (i, (g, w)) in got.iter().zip(torch(&fixture)).enumerate() {
        assert_eq!(
            g, w,
            "f32 {:#010x}: {dtype:?} {g:#06x}, torch {w:#06x}",
            fixture.f32[i]
        );
    }
}

#[test]
fn f32_to_f16_rounds_as_torch_bit_for_bit() {
    assert_casts_as_torch(DType::F16, |f| &f.f16);
}

#[test]
fn f32_to_bf16_rounds_as_torch_bit_for_bit() {
    assert_casts_as_torch(DType::BF16, |f| &f.bf16);
}

#[test]
fn f16_and_bf16_to_f32_on_the_device_are_exact() {
    let fixture = round_trips();
    let halves: Vec<f16> = fixture.f16.iter().map(|&b| f16::from_bits(b)).collect();
    let n = halves.len();
    let h = Tensor::from_vec_f16(halves.clone(), &[n], device()).unwrap();
    let got = h.to_dtype(DType::F32).unwrap().to_vec().unwrap();
    let want: Vec<f32> = halves.iter().map(|&v| f32::from(v)).collect();
    // NaN compares by bits too: the cast keeps sign and payload's top bits as torch.
    assert_eq!(bits_of(&got), bits_of(&want), "F16 -> F32");

    let brains: Vec<bf16> = fixture.bf16.iter().map(|&b| bf16::from_bits(b)).collect();
    let b = Tensor::from_vec_bf16(brains.clone(), &[n], device()).unwrap();
    let got = b.to_dtype(DType::F32).unwrap().to_vec().unwrap();
    let want: Vec<f32> = brains.iter().map(|&v| f32::from(v)).collect();
    assert_eq!(bits_of(&got), bits_of(&want), "BF16 -> F32");
}

#[test]
fn sixteen_bit_values_upload_and_read_back_as_they_are() {
    // An odd count: the last word holds one element.
    let values: Vec<f16> = (0..7)
        .map(|i| f16::from_f32(i as f32 * 0.5 - 1.0))
        .collect();
    let t = Tensor::from_vec_f16(values.clone(), &[7], device()).unwrap();
    assert_eq!(t.dtype(), DType::F16);
    assert_eq!(t.to_vec_f16().unwrap(), values);
    assert_eq!(
        t.to_vec().unwrap(),
        values.iter().map(|&v| f32::from(v)).collect::<Vec<_>>()
    );
    let b: Vec<bf16> = (0..5).map(|i| bf16::from_f32(i as f32 * 1e30)).collect();
    let t = Tensor::from_vec_bf16(b.clone(), &[5], device()).unwrap();
    assert_eq!(t.to_vec_bf16().unwrap(), b);
}

#[test]
fn views_of_16_bit_tensors_read_and_copy_at_odd_offsets() {
    // [3, 5] of halves; its transpose and a narrow starting inside a word.
    let values: Vec<f32> = (0..15).map(|i| i as f32).collect();
    let h = Tensor::from_vec(values.clone(), &[3, 5], device())
        .unwrap()
        .to_dtype(DType::F16)
        .unwrap();
    let t = h.t().unwrap();
    let want_t: Vec<f32> = (0..5)
        .flat_map(|c| (0..3).map(move |r| (r * 5 + c) as f32))
        .collect();
    assert_eq!(t.to_vec().unwrap(), want_t);
    let dense = t.contiguous().unwrap();
    assert!(dense.is_contiguous());
    assert_eq!(dense.dtype(), DType::F16);
    assert_eq!(dense.to_vec().unwrap(), want_t);
    let narrow = h.reshape(&[15]).unwrap().narrow(0, 3, 7).unwrap();
    assert_eq!(narrow.to_vec().unwrap(), values[3..10].to_vec());
    assert_eq!(
        narrow.to_dtype(DType::BF16).unwrap().to_vec().unwrap(),
        values[3..10].to_vec()
    );
}

/// `base` (a 16-bit `[rows, cols]` of `values`) with `view_of(base)` written from `src`'s
/// values, read back as f32; and the host's answer, where `position(i)` is the flat index of
/// the view's element `i` in `base`.
fn write_into_view(
    dtype: DType,
    (rows, cols): (usize, usize),
    view_of: impl Fn(&Tensor) -> Tensor,
    position: impl Fn(usize) -> usize,
) -> (Vec<f32>, Vec<f32>) {
    let values: Vec<f32> = (0..rows * cols).map(|i| i as f32).collect();
    let base = Tensor::from_vec(values.clone(), &[rows, cols], device())
        .unwrap()
        .to_dtype(dtype)
        .unwrap();
    let view = view_of(&base);
    let n = view.numel();
    let incoming: Vec<f32> = (0..n).map(|i| -1.0 - i as f32).collect();
    let src = Tensor::from_vec(incoming.clone(), view.shape(), device())
        .unwrap()
        .to_dtype(dtype)
        .unwrap();
    view.copy_(&src).unwrap();
    let mut want = values;
    for (i, v) in incoming.into_iter().enumerate() {
        want[position(i)] = v;
    }
    (base.to_vec().unwrap(), want)
}

#[test]
fn copy_into_a_strided_16_bit_view_writes_its_elements_and_keeps_the_others() {
    for dtype in [DType::F16, DType::BF16] {
        // Columns 1..4 of each row of 5: runs starting and ending inside words.
        let (got, want) = write_into_view(
            dtype,
            (3, 5),
            |b| b.narrow(1, 1, 3).unwrap(),
            |i| (i / 3) * 5 + 1 + i % 3,
        );
        assert_eq!(got, want, "{dtype:?} narrow");
        // The transpose of [4, 3]: every element a stride of 3 from the next.
        let (got, want) =
            write_into_view(dtype, (4, 3), |b| b.t().unwrap(), |i| (i % 4) * 3 + i / 4);
        assert_eq!(got, want, "{dtype:?} transpose");
        // Every other column of the transpose of a narrow: strides of 2 and 10.
        let (got, want) = write_into_view(
            dtype,
            (5, 10),
            |b| {
                let v = b.narrow(0, 1, 3).unwrap().t().unwrap();
                v.reshape(&[5, 2, 3]).unwrap().narrow(1, 0, 1).unwrap()
            },
            |i| (i % 3 + 1) * 10 + 2 * (i / 3),
        );
        assert_eq!(got, want, "{dtype:?} strided");
    }
}

#[test]
fn copy_into_a_strided_16_bit_view_of_its_own_source_reads_the_source_first() {
    for dtype in [DType::F16, DType::BF16] {
        // Columns 0..3 into columns 1..4 of the same rows: each row shifts right by one.
        let values: Vec<f32> = (0..15).map(|i| i as f32).collect();
        let x = Tensor::from_vec(values, &[3, 5], device())
            .unwrap()
            .to_dtype(dtype)
            .unwrap();
        let src = x.narrow(1, 0, 3).unwrap().t().unwrap();
        x.narrow(1, 1, 3).unwrap().t().unwrap().copy_(&src).unwrap();
        let want: Vec<f32> = (0..3)
            .flat_map(|r| [0, 0, 1, 2, 4].map(|c| (r * 5 + c) as f32))
            .collect();
        assert_eq!(x.to_vec().unwrap(), want, "{dtype:?}");
    }
}

#[test]
fn the_grad_of_a_narrow_along_a_later_dim_of_a_16_bit_tensor_is_16_bit() {
    for dtype in [DType::F16, DType::BF16] {
        // The grad is written into the middle columns of zeros: a strided region.
        let x = Tensor::from_vec((0..10).map(|i| i as f32).collect(), &[2, 5], device())
            .unwrap()
            .to_dtype(dtype)
            .unwrap()
            .requires_grad_(true);
        x.narrow(1, 1, 3)
            .unwrap()
            .sum()
            .unwrap()
            .backward()
            .unwrap();
        let grad = x.grad().unwrap();
        assert_eq!(grad.dtype(), dtype);
        let want = [0.0, 1.0, 1.0, 1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0];
        assert_eq!(grad.to_vec().unwrap(), want, "{dtype:?}");
    }
}

#[test]
fn copy_into_a_strided_f16_view_keeps_its_neighbours_bits() {
    // A signalling NaN beside the written element: a round trip through f32 would quiet it.
    let nan = f16::from_bits(0x7C01);
    let base = Tensor::from_vec_f16(vec![nan, f16::ONE, nan, f16::ONE], &[2, 2], device()).unwrap();
    let column = base.narrow(1, 1, 1).unwrap();
    let src = Tensor::from_vec_f16(vec![f16::from_f32(2.5); 2], &[2, 1], device()).unwrap();
    column.copy_(&src).unwrap();
    let bits: Vec<u16> = (base.to_vec_f16().unwrap().iter())
        .map(|v| v.to_bits())
        .collect();
    assert_eq!(bits, [0x7C01, 0x4100, 0x7C01, 0x4100]);
}

#[test]
fn casts_between_every_pair_of_dtypes() {
    let values = [0.0f32, 1.0, 2.5, 7.0, 300.0, 65504.0];
    let x = Tensor::from_slice(&values, &[6], device()).unwrap();
    for from in [DType::F32, DType::F16, DType::BF16, DType::U32] {
        for to in [DType::F32, DType::F16, DType::BF16, DType::U32] {
            let y = x.to_dtype(from).unwrap().to_dtype(to).unwrap();
            assert_eq!(y.dtype(), to);
            let got = match to {
                DType::U32 => y
                    .to_vec_u32()
                    .unwrap()
                    .into_iter()
                    .map(|v| v as f32)
                    .collect(),
                _ => y.to_vec().unwrap(),
            };
            // 2.5 truncates to 2 through U32; 65504 is a half but BF16 rounds it to 65536,
            // which F16 holds as inf.
            let want: Vec<f32> = values
                .iter()
                .map(|&v| {
                    let v = match from {
                        DType::BF16 => f32::from(bf16::from_f32(v)),
                        DType::U32 => v.trunc(),
                        _ => v,
                    };
                    match to {
                        DType::F16 => f32::from(f16::from_f32(v)),
                        DType::BF16 => f32::from(bf16::from_f32(v)),
                        DType::U32 => v.trunc(),
                        _ => v,
                    }
                })
                .collect();
            assert_eq!(got, want, "{from:?} -> {to:?}");
        }
    }
}

#[test]
fn a_cast_past_65536_elements_covers_them_all() {
    let n = 70_001;
    // Whole numbers below 256: exact in both 16-bit dtypes.
    let values: Vec<f32> = (0..n).map(|i| (i % 251) as f32).collect();
    let x = Tensor::from_vec(values.clone(), &[n], device()).unwrap();
    let h = x.to_dtype(DType::F16).unwrap();
    let wrong = |got: Vec<f32>| got.iter().zip(&values).filter(|(g, w)| g != w).count();
    assert_eq!(wrong(h.to_vec().unwrap()), 0, "F32 -> F16");
    let b = h.to_dtype(DType::BF16).unwrap();
    assert_eq!(wrong(b.to_vec().unwrap()), 0, "F16 -> BF16");
}

#[test]
fn empty_and_single_element_16_bit_tensors() {
    let e = Tensor::from_vec_f16(vec![], &[0, 3], device()).unwrap();
    assert_eq!(e.to_dtype(DType::F32).unwrap().shape(), &[0, 3]);
    assert!(e.to_vec().unwrap().is_empty());
    let one = Tensor::from_vec_bf16(vec![bf16::from_f32(-2.0)], &[], device()).unwrap();
    assert_eq!(one.item().unwrap(), -2.0);
}

#[test]
fn the_grad_of_a_cast_comes_back_in_the_source_dtype() {
    let (x, _) = random_tensor(&[4, 3], 3);
    let x = x.requires_grad_(true);
    let y = x
        .to_dtype(DType::BF16)
        .unwrap()
        .to_dtype(DType::F32)
        .unwrap();
    y.mul_scalar(3.0)
        .unwrap()
        .sum()
        .unwrap()
        .backward()
        .unwrap();
    let grad = x.grad().unwrap();
    assert_eq!(grad.dtype(), DType::F32);
    assert_eq!(grad.to_vec().unwrap(), vec![3.0; 12]);
}

type Op = fn(&[Tensor]) -> wgrad::Result<Tensor>;

/// Four indices, one repeated.
fn indices() -> wgrad::Result<Tensor> {
    Tensor::from_vec_u32(vec![2, 0, 2, 1], &[4], device())
}

/// The op families without 16-bit kernels of their own, which run on 16-bit tensors in f32
/// and round their result once (norms, indexing, joining, sorting, padding, the losses), and
/// attention and convolutions beside them.
fn families_through_f32() -> Vec<(&'static str, &'static [&'static [usize]], Op)> {
    vec![
        ("layer_norm", &[&[5, 24], &[24], &[24]], |t| {
            t[0].layer_norm(&t[1], &t[2], 1e-5)
        }),
        ("rms_norm", &[&[5, 24], &[24]], |t| {
            t[0].rms_norm(&t[1], 1e-6)
        }),
        ("group_norm", &[&[2, 4, 3, 3], &[4], &[4]], |t| {
            t[0].group_norm(2, Some(&t[1]), Some(&t[2]), 1e-5)
        }),
        ("index_select rows", &[&[3, 7]], |t| {
            t[0].index_select(0, &indices()?)
        }),
        ("index_select columns", &[&[3, 7]], |t| {
            t[0].index_select(1, &indices()?)
        }),
        ("gather", &[&[4, 5]], |t| {
            t[0].gather(1, &indices()?.unsqueeze(1)?)
        }),
        ("cat along dim 1", &[&[3, 5], &[3, 2]], |t| {
            Tensor::cat(&[t[0].clone(), t[1].clone()], 1)
        }),
        ("cumsum", &[&[3, 9]], |t| t[0].cumsum(1)),
        ("sort", &[&[3, 9]], |t| Ok(t[0].sort(1, true)?.0)),
        ("pad2d", &[&[1, 2, 3, 3]], |t| t[0].pad2d((1, 0, 2, 1), 0.5)),
        ("cross_entropy", &[&[4, 6]], |t| {
            wgrad::nn::loss::cross_entropy(&t[0], &indices()?)
        }),
        ("conv2d", &[&[2, 3, 6, 6], &[4, 3, 3, 3], &[4]], |t| {
            t[0].conv2d(&t[1], Some(&t[2]), 1, 1)
        }),
        ("scatter_add", &[&[3, 5], &[3, 4]], |t| {
            let at = vec![4, 0, 4, 1, 2, 2, 3, 0, 1, 1, 0, 4];
            let at = Tensor::from_vec_u32(at, &[3, 4], device())?;
            t[0].scatter_add(1, &at, &t[1])
        }),
        ("index_add", &[&[3, 5], &[4, 5]], |t| {
            t[0].index_add(0, &indices()?, &t[1])
        }),
        ("batch_norm", &[&[4, 3, 2, 2]], |t| {
            use wgrad::nn::Module;
            wgrad::nn::BatchNorm2d::new(3, device())?.forward(&t[0])
        }),
        (
            "attention",
            &[&[2, 2, 5, 8], &[2, 2, 5, 8], &[2, 2, 5, 8]],
            |t| t[0].scaled_dot_product_attention(&t[1], &t[2], true),
        ),
    ]
}

#[test]
fn every_other_op_family_runs_on_16_bit_tensors_as_on_their_f32_values() {
    for dtype in [DType::F16, DType::BF16] {
        let rel = if dtype == DType::F16 { 1e-3 } else { 8e-3 };
        for (name, shapes, op) in families_through_f32() {
            let (got, want) = sixteen_bit_against_f32(dtype, shapes, op);
            assert_close(&got, &want, rel, &format!("{name} {dtype:?}"));
        }
    }
}

#[test]
fn every_other_op_family_gives_16_bit_leaves_grads_of_their_dtype() {
    for (name, shapes, op) in families_through_f32() {
        let leaves = |dtype: DType| -> Vec<Tensor> {
            shapes
                .iter()
                .enumerate()
                .map(|(i, s)| {
                    let (t, _) = random_tensor(s, 60 + i as u64);
                    let rounded = t.to_dtype(DType::BF16).unwrap().to_dtype(dtype).unwrap();
                    rounded.requires_grad_(true)
                })
                .collect()
        };
        // The grads of sum(out * w), w the same BF16 values on both paths: the out grads are
        // equal, so the input grads differ by the last rounding alone.
        let grads = |inputs: &[Tensor]| -> Vec<Tensor> {
            let out = op(inputs).unwrap().to_dtype(DType::F32).unwrap();
            let (w, _) = random_tensor(out.shape(), 99);
            let w = w
                .to_dtype(DType::BF16)
                .unwrap()
                .to_dtype(DType::F32)
                .unwrap();
            out.mul(&w).unwrap().sum().unwrap().backward().unwrap();
            inputs.iter().map(|t| t.grad().unwrap()).collect()
        };
        let narrow = leaves(DType::BF16);
        let wide = leaves(DType::F32);
        for (i, (g, w)) in grads(&narrow).iter().zip(grads(&wide)).enumerate() {
            assert_eq!(g.dtype(), DType::BF16, "{name}: grad {i}");
            let want: Vec<f64> = w.to_vec().unwrap().into_iter().map(f64::from).collect();
            assert_close(
                &g.to_vec().unwrap(),
                &want,
                8e-3,
                &format!("{name}: grad {i}"),
            );
        }
    }
}

/// `f` of `values` as `dtype` (cast to f32 to compare) beside `f` of the same rounded values
/// in f32: the 16-bit path computes in f32 and rounds its result once.
fn sixteen_bit_against_f32(
    dtype: DType,
    shapes: &[&[usize]],
    f: impl Fn(&[Tensor]) -> wgrad::Result<Tensor>,
) -> (Vec<f32>, Vec<f64>) {
    let inputs: Vec<Tensor> = shapes
        .iter()
        .enumerate()
        .map(|(i, s)| random_tensor(s, 20 + i as u64).0.to_dtype(dtype).unwrap())
        .collect();
    let wide: Vec<Tensor> = inputs
        .iter()
        .map(|t| t.to_dtype(DType::F32).unwrap())
        .collect();
    let out = f(&inputs).unwrap();
    assert_eq!(out.dtype(), dtype, "the result keeps the inputs' dtype");
    let want = f(&wide)
        .unwrap()
        .to_vec()
        .unwrap()
        .into_iter()
        .map(f64::from)
        .collect();
    (out.to_vec().unwrap(), want)
}

#[test]
fn elementwise_matmul_reduction_softmax_and_pooling_run_on_16_bit_tensors() {
    type Op = fn(&[Tensor]) -> wgrad::Result<Tensor>;
    let cases: [(&str, &[&[usize]], Op); 9] = [
        ("max_pool2d", &[&[1, 2, 6, 6]], |t| t[0].max_pool2d(2, 2)),
        ("avg_pool2d", &[&[1, 2, 6, 6]], |t| t[0].avg_pool2d(3, 1)),
        ("adaptive_avg_pool2d", &[&[2, 3, 5, 5]], |t| {
            t[0].adaptive_avg_pool2d((1, 1))
        }),
        ("exp", &[&[3, 5]], |t| t[0].exp()),
        ("tanh of a sum", &[&[3, 5], &[5]], |t| {
            t[0].add(&t[1])?.tanh()
        }),
        ("mul", &[&[4, 1], &[1, 6]], |t| t[0].mul(&t[1])),
        ("matmul", &[&[2, 7, 9], &[9, 5]], |t| t[0].matmul(&t[1])),
        ("sum_dims", &[&[6, 40]], |t| t[0].sum_dims(&[1], false)),
        ("softmax", &[&[3, 17]], |t| t[0].softmax(1)),
    ];
    for dtype in [DType::F16, DType::BF16] {
        let rel = if dtype == DType::F16 { 1e-3 } else { 8e-3 };
        for (name, shapes, op) in &cases {
            let (got, want) = sixteen_bit_against_f32(dtype, shapes, op);
            assert_close(&got, &want, rel, &format!("{name} {dtype:?}"));
        }
    }
}

#[test]
fn matmul_reads_16_bit_operands_in_every_layout() {
    // The kernels read 16-bit A and B as they are: row- and column-major views, odd element
    // offsets (an element in a word's high half), a k tail, batches, the small kernel, and k
    // past one kernel's loop (summed over chunks in f32 before the one rounding).
    type Op = fn(&[Tensor]) -> wgrad::Result<Tensor>;
    let cases: [(&str, &[&[usize]], Op); 9] = [
        ("dense", &[&[64, 40], &[40, 96]], |t| t[0].matmul(&t[1])),
        ("both transposed", &[&[40, 64], &[96, 40]], |t| {
            t[0].t()?.matmul(&t[1].t()?)
        }),
        ("odd offsets", &[&[33, 41], &[38, 29]], |t| {
            t[0].narrow(1, 1, 37)?.matmul(&t[1].narrow(0, 1, 37)?)
        }),
        ("k tail", &[&[24, 37], &[37, 20]], |t| t[0].matmul(&t[1])),
        ("ragged columns", &[&[24, 32], &[32, 30]], |t| {
            t[0].matmul(&t[1])
        }),
        ("narrow, transposed out", &[&[300, 32], &[32, 8]], |t| {
            t[0].matmul(&t[1])
        }),
        ("batched", &[&[3, 17, 12], &[3, 12, 9]], |t| {
            t[0].matmul(&t[1])
        }),
        ("vector", &[&[50], &[50, 7]], |t| t[0].matmul(&t[1])),
        ("long k", &[&[2, 20000], &[20000, 3]], |t| {
            t[0].matmul(&t[1])
        }),
    ];
    for dtype in [DType::F16, DType::BF16] {
        let rel = if dtype == DType::F16 { 1e-3 } else { 8e-3 };
        for (name, shapes, op) in &cases {
            let (got, want) = sixteen_bit_against_f32(dtype, shapes, op);
            assert_close(&got, &want, rel, &format!("matmul {name} {dtype:?}"));
        }
    }
}

/// The bits of `t` (any dtype) as u32s, to compare results bit for bit.
fn bits(t: &Tensor) -> Vec<u32> {
    match t.dtype() {
        DType::U32 => t.to_vec_u32().unwrap(),
        DType::F32 => bits_of(&t.to_vec().unwrap()),
        DType::F16 => t
            .to_vec_f16()
            .unwrap()
            .iter()
            .map(|h| h.to_bits() as u32)
            .collect(),
        DType::BF16 => t
            .to_vec_bf16()
            .unwrap()
            .iter()
            .map(|h| h.to_bits() as u32)
            .collect(),
    }
}

/// `f` on 16-bit tensors (read and written as they are) against `f` on their F32 values with
/// the result rounded once: equal bit for bit, since both compute in f32.
fn assert_16_bit_kernel_equals_f32_then_rounded(
    name: &str,
    shapes: &[&[usize]],
    f: impl Fn(&[Tensor]) -> wgrad::Result<Tensor>,
) {
    for dtype in [DType::F16, DType::BF16] {
        let inputs: Vec<Tensor> = shapes
            .iter()
            .enumerate()
            .map(|(i, s)| {
                let (t, _) = random_tensor(s, 40 + i as u64);
                t.mul_scalar(3.0).unwrap().to_dtype(dtype).unwrap()
            })
            .collect();
        let wide: Vec<Tensor> = inputs
            .iter()
            .map(|t| t.to_dtype(DType::F32).unwrap())
            .collect();
        let got = f(&inputs).unwrap();
        let want = f(&wide).unwrap();
        let want = match want.dtype() {
            DType::F32 => want.to_dtype(dtype).unwrap(),
            _ => want,
        };
        assert_eq!(got.dtype(), want.dtype(), "{name} {dtype:?}: dtype");
        assert_eq!(got.shape(), want.shape(), "{name} {dtype:?}: shape");
        assert_eq!(bits(&got), bits(&want), "{name} {dtype:?}");
    }
}

#[test]
fn unary_kernels_read_and_write_16_bit_elements_in_every_layout() {
    type Op = fn(&[Tensor]) -> wgrad::Result<Tensor>;
    let cases: [(&str, &[&[usize]], Op); 7] = [
        ("odd length", &[&[3, 5]], |t| t[0].exp()),
        ("whole vec4s", &[&[64, 64]], |t| t[0].gelu()),
        ("transposed view", &[&[40, 33]], |t| t[0].t()?.tanh()),
        ("odd offset, contiguous", &[&[101]], |t| {
            t[0].narrow(0, 1, 99)?.sigmoid()
        }),
        ("a mask out", &[&[7, 9]], |t| t[0].gt_scalar(0.5)),
        ("one element", &[&[1]], |t| t[0].relu()),
        ("past 65,536", &[&[70_001]], |t| t[0].mul_scalar(0.5)),
    ];
    for (name, shapes, op) in cases {
        assert_16_bit_kernel_equals_f32_then_rounded(name, shapes, op);
    }
}

#[test]
fn binary_kernels_read_and_write_16_bit_elements_in_every_layout() {
    type Op = fn(&[Tensor]) -> wgrad::Result<Tensor>;
    let cases: [(&str, &[&[usize]], Op); 8] = [
        ("odd length", &[&[3, 5], &[3, 5]], |t| t[0].mul(&t[1])),
        ("whole vec4s", &[&[64, 64], &[64, 64]], |t| t[0].add(&t[1])),
        ("a bias over rows", &[&[33, 12], &[12]], |t| t[0].add(&t[1])),
        ("a bias over channels", &[&[2, 3, 5, 5], &[3, 1, 1]], |t| {
            t[0].sub(&t[1])
        }),
        ("transposed views", &[&[21, 13], &[13, 21]], |t| {
            t[0].t()?.div(&t[1])
        }),
        ("odd offsets", &[&[99], &[99]], |t| {
            t[0].narrow(0, 1, 97)?.maximum(&t[1].narrow(0, 2, 97)?)
        }),
        ("a comparison mask", &[&[7, 9], &[9]], |t| t[0].gt(&t[1])),
        ("past 65,536", &[&[70_001], &[70_001]], |t| t[0].mul(&t[1])),
    ];
    for (name, shapes, op) in cases {
        assert_16_bit_kernel_equals_f32_then_rounded(name, shapes, op);
    }
}

#[test]
fn a_16_bit_matmul_reads_its_operands_in_place_and_stores_its_product_in_16_bits() {
    // On a device of its own, so that no other test's dispatches count.
    let dev = wgrad::Device::new().unwrap();
    let operand = |shape: &[usize], seed| {
        let t = Tensor::randn(shape, seed, &dev).unwrap();
        t.to_dtype(DType::F16).unwrap()
    };
    let dispatches = |a: &Tensor, b: &Tensor| {
        dev.synchronize().unwrap();
        let before = dev.stats().dispatches;
        let out = a.matmul(b).unwrap();
        dev.synchronize().unwrap();
        assert_eq!(out.dtype(), DType::F16);
        dev.stats().dispatches - before
    };
    // Columns in whole fours: one dispatch, no casts of the operands or of the product.
    assert_eq!(
        dispatches(&operand(&[32, 48], 1), &operand(&[48, 40], 2)),
        1
    );
    // A ragged last group of columns: the product is stored in F32 and rounded after.
    assert_eq!(
        dispatches(&operand(&[32, 48], 1), &operand(&[48, 39], 2)),
        2
    );
}

#[test]
fn matmul_of_two_float_dtypes_under_autocast_is_f32() {
    let (a, a_values) = random_tensor(&[5, 8], 31);
    let (b, _) = random_tensor(&[8, 6], 32);
    let b = b.to_dtype(DType::BF16).unwrap();
    let want = a.matmul(&b.to_dtype(DType::F32).unwrap()).unwrap();
    // Outside autocast the mixed product is an error; inside, autocast casts `a` to F16 for
    // a matmul, and an F16 times BF16 product is F32.
    assert!(a.matmul(&b).is_err());
    let got = wgrad::autocast(DType::F16, || a.matmul(&b)).unwrap();
    assert_eq!(got.dtype(), DType::F32);
    let a16: Vec<f32> = a_values
        .iter()
        .map(|&v| f16::from_f32(v).to_f32())
        .collect();
    let a16 = Tensor::from_slice(&a16, &[5, 8], device()).unwrap();
    let want16 = a16.matmul(&b.to_dtype(DType::F32).unwrap()).unwrap();
    assert_eq!(got.to_vec().unwrap(), want16.to_vec().unwrap());
    let want: Vec<f64> = want.to_vec().unwrap().into_iter().map(f64::from).collect();
    assert_close(
        &got.to_vec().unwrap(),
        &want,
        2e-2,
        "mixed product near the f32 one",
    );
}

#[test]
fn grads_of_16_bit_leaves_stay_16_bit() {
    let (a, a_values) = random_tensor(&[4, 6], 1);
    let (b, _) = random_tensor(&[6, 3], 2);
    // The grad of sum(tanh(a b)) for `a`, a leaf of its own dtype.
    let grad_of = |a: Tensor, b: &Tensor| -> Tensor {
        let a = a.requires_grad_(true);
        let loss = a.matmul(b).unwrap().tanh().unwrap().sum().unwrap();
        loss.backward().unwrap();
        a.grad().unwrap()
    };
    let a16 = a.to_dtype(DType::BF16).unwrap();
    let b16 = b.to_dtype(DType::BF16).unwrap();
    let grad = grad_of(a16.clone(), &b16);
    assert_eq!(grad.dtype(), DType::BF16);
    // Against the f32 grad of the same rounded values.
    let a32 = a16.detach().to_dtype(DType::F32).unwrap();
    let b32 = b16.to_dtype(DType::F32).unwrap();
    let want: Vec<f64> = grad_of(a32, &b32)
        .to_vec()
        .unwrap()
        .into_iter()
        .map(f64::from)
        .collect();
    assert_close(&grad.to_vec().unwrap(), &want, 2e-2, "BF16 grad");
    assert_eq!(a_values.len(), 24);
}

#[test]
fn cat_along_the_first_dim_joins_16_bit_tensors_of_odd_lengths() {
    let a = Tensor::from_slice(&[1.0, 2.0, 3.0], &[3], device()).unwrap();
    let b = Tensor::from_slice(&[4.0, 5.0], &[2], device()).unwrap();
    let (a, b) = (
        a.to_dtype(DType::F16).unwrap(),
        b.to_dtype(DType::F16).unwrap(),
    );
    let joined = Tensor::cat(&[a, b.clone(), b], 0).unwrap();
    assert_eq!(joined.dtype(), DType::F16);
    assert_eq!(
        joined.to_vec().unwrap(),
        vec![1.0, 2.0, 3.0, 4.0, 5.0, 4.0, 5.0]
    );
}

#[test]
fn float_inputs_of_two_dtypes_are_an_error_naming_the_op() {
    let h = Tensor::from_vec_f16(vec![f16::ONE; 3], &[3], device()).unwrap();
    let f = Tensor::ones(&[3], device()).unwrap();
    match h.add(&f) {
        Err(Error::DType { op, msg }) => {
            assert_eq!(op, "add");
            assert!(msg.contains("F16") && msg.contains("F32"), "{msg}");
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_16_bit_tensor_displays_its_values() {
    let h = Tensor::from_vec_f16(
        vec![f16::from_f32(1.5), f16::from_f32(-2.0)],
        &[2],
        device(),
    )
    .unwrap();
    assert_eq!(
        h.to_string(),
        "tensor([ 1.5000, -2.0000], dtype=torch.float16)"
    );
    let b = h.to_dtype(DType::BF16).unwrap();
    assert_eq!(
        b.to_string(),
        "tensor([ 1.5000, -2.0000], dtype=torch.bfloat16)"
    );
}

#[test]
fn copy_into_a_16_bit_run_inside_words_keeps_its_neighbours() {
    let h = Tensor::from_vec_f16(vec![f16::ZERO; 9], &[9], device()).unwrap();
    let src = Tensor::from_slice(&[1.0, 2.0, 3.0], &[3], device())
        .unwrap()
        .to_dtype(DType::F16)
        .unwrap();
    // Elements 3..6: the run starts in the second half of a word and ends in the first.
    h.narrow(0, 3, 3).unwrap().copy_(&src).unwrap();
    assert_eq!(
        h.to_vec().unwrap(),
        vec![0.0, 0.0, 0.0, 1.0, 2.0, 3.0, 0.0, 0.0, 0.0]
    );
}

/// A module whose parameters are 16-bit, as mixed precision will keep some.
#[derive(wgrad::Module)]
struct Halves {
    h: Tensor,
    b: Tensor,
}

impl Halves {
    fn forward(&self, x: &Tensor) -> wgrad::Result<Tensor> {
        Ok(x.clone())
    }
}

#[test]
fn checkpoints_keep_16_bit_tensors_in_their_dtype() {
    let values: Vec<f32> = (0..5).map(|i| i as f32 * 0.3 - 0.7).collect();
    let x = Tensor::from_slice(&values, &[5], device()).unwrap();
    let module = Halves {
        h: x.to_dtype(DType::F16).unwrap(),
        b: x.to_dtype(DType::BF16).unwrap(),
    };
    let path =
        std::env::temp_dir().join(format!("wgrad-halves-{}.safetensors", std::process::id()));
    wgrad::io::save(&path, &module).unwrap();
    let bytes = std::fs::read(&path).unwrap();
    let file = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    assert_eq!(file.tensor("h").unwrap().dtype(), safetensors::Dtype::F16);
    assert_eq!(file.tensor("b").unwrap().dtype(), safetensors::Dtype::BF16);

    // Into 16-bit parameters: the same bits.
    let fresh = Halves {
        h: Tensor::from_vec_f16(vec![f16::ZERO; 5], &[5], device()).unwrap(),
        b: Tensor::from_vec_bf16(vec![bf16::ZERO; 5], &[5], device()).unwrap(),
    };
    wgrad::io::load(&path, &fresh).unwrap();
    assert_eq!(
        fresh.h.to_vec_f16().unwrap(),
        module.h.to_vec_f16().unwrap()
    );
    assert_eq!(
        fresh.b.to_vec_bf16().unwrap(),
        module.b.to_vec_bf16().unwrap()
    );

    // Into F32 parameters: converted exactly.
    let wide = Halves {
        h: Tensor::zeros(&[5], device()).unwrap(),
        b: Tensor::zeros(&[5], device()).unwrap(),
    };
    wgrad::io::load(&path, &wide).unwrap();
    assert_eq!(wide.h.dtype(), DType::F32);
    assert_eq!(wide.h.to_vec().unwrap(), module.h.to_vec().unwrap());
    assert_eq!(wide.b.to_vec().unwrap(), module.b.to_vec().unwrap());
    std::fs::remove_file(&path).unwrap();
}

#[test]
fn an_optimizer_step_on_a_16_bit_parameter_is_an_error_that_changes_nothing() {
    use wgrad::optim::{AdamConfig, AdamW, Optimizer};
    let p = Tensor::from_vec_f16(vec![f16::ONE; 4], &[4], device())
        .unwrap()
        .requires_grad_(true);
    p.mul_scalar(2.0)
        .unwrap()
        .to_dtype(DType::F32)
        .unwrap()
        .sum()
        .unwrap()
        .backward()
        .unwrap();
    let mut opt = AdamW::new(vec![p.clone()], AdamConfig::default());
    let err = opt.step().unwrap_err();
    assert!(err.to_string().contains("F16"), "{err}");
    assert_eq!(p.to_vec().unwrap(), vec![1.0; 4]);
}

#[test]
fn a_captured_step_installs_the_grads_of_16_bit_leaves_in_their_dtype() {
    use wgrad::capture::Step;
    let w = random_tensor(&[6, 4], 71).0.to_dtype(DType::BF16).unwrap();
    let w = w.requires_grad_(true);
    let x = random_tensor(&[3, 6], 72).0.to_dtype(DType::BF16).unwrap();
    let mut train = |b: &[Tensor]| -> wgrad::Result<Tensor> {
        w.zero_grad();
        let loss = b[0].matmul(&w)?.to_dtype(DType::F32)?.sum()?;
        loss.backward()?;
        Ok(loss)
    };
    train(std::slice::from_ref(&x)).unwrap();
    let eager = w.grad().unwrap().to_vec().unwrap();
    let mut step = Step::new(&mut train);
    for _ in 0..3 {
        step.run(std::slice::from_ref(&x)).unwrap();
    }
    assert!(step.stats().replays >= 1, "{:?}", step.stats());
    let grad = w.grad().unwrap();
    assert_eq!(grad.dtype(), DType::BF16);
    assert_eq!(grad.to_vec().unwrap(), eager);
}

#[test]
fn f16_reads_take_the_path_the_device_was_given() {
    let integer = env!("CARGO_CRATE_NAME") == "dtypes_integer_f16_reads"
        || std::env::var("WGRAD_F16_READS").is_ok_and(|v| v.eq_ignore_ascii_case("integer"));
    let named = std::env::var("WGRAD_F16_READS").ok();
    let want = match (integer, named.as_deref()) {
        (true, _) => wgrad::F16Reads::Integer,
        (false, Some(v)) if v.eq_ignore_ascii_case("hardware") => wgrad::F16Reads::Hardware,
        _ if device().shader_f16() => wgrad::F16Reads::Native,
        _ => wgrad::F16Reads::Hardware,
    };
    assert_eq!(device().f16_reads(), want);
}
