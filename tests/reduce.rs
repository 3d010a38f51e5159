//! sum, mean, max and argmax against CPU f64 references.

mod common;
use common::*;
use wgrad::{Device, Error, Tensor};

// The acceptance sizes of the foundation issue, plus 70004: four-wide reads over several workgroups with a partial last one.
const SIZES: [usize; 10] = [0, 1, 7, 255, 256, 257, 1023, 4097, 70001, 70004];

/// Reference reduction of `data` (shape `shape`) over `dims` with `f` starting from `init`.
fn reduce_ref(
    data: &[f32],
    shape: &[usize],
    dims: &[usize],
    init: f64,
    f: fn(f64, f64) -> f64,
) -> Vec<f64> {
    let out_shape: Vec<usize> = shape
        .iter()
        .enumerate()
        .map(|(d, &n)| if dims.contains(&d) { 1 } else { n })
        .collect();
    let mut out = vec![init; out_shape.iter().product()];
    let os = strides(&out_shape);
    for (i, &x) in data.iter().enumerate() {
        let idx = unravel(i, shape);
        let o: usize = idx
            .iter()
            .enumerate()
            .map(|(d, &v)| if dims.contains(&d) { 0 } else { v * os[d] })
            .sum();
        out[o] = f(out[o], x as f64);
    }
    out
}

#[test]
fn sum_mean_max_of_all_elements_at_every_size() {
    for (i, &n) in SIZES.iter().enumerate() {
        let (t, data) = random_tensor(&[n], i as u64);
        let sum: f64 = data.iter().map(|&x| x as f64).sum();
        let s = t.sum().unwrap();
        assert_eq!(s.shape(), &[] as &[usize]);
        assert_close(&s.to_vec().unwrap(), &[sum], 1e-5, &format!("sum n={n}"));
        let mean = if n == 0 { f64::NAN } else { sum / n as f64 };
        assert_close(
            &t.mean().unwrap().to_vec().unwrap(),
            &[mean],
            1e-5,
            &format!("mean n={n}"),
        );
        if n > 0 {
            let max = data.iter().fold(f64::NEG_INFINITY, |m, &x| m.max(x as f64));
            assert_close(
                &t.max().unwrap().to_vec().unwrap(),
                &[max],
                0.0,
                &format!("max n={n}"),
            );
        }
    }
}

#[test]
fn column_sums_and_maxes_read_four_columns_at_a_time_or_one_alike() {
    // [rows, cols] reduced over the rows (a bias grad's sum over the batch): four adjacent
    // columns per invocation where cols and the offset are multiples of 4 (few rows, several
    // chunks and one pass with more than 1,024 groups of four), else column by column (odd
    // cols, an odd offset).
    let cases: [(usize, usize, usize); 6] = [
        (0, 6, 8),
        (0, 3000, 12),
        (4, 17, 64),
        (0, 3, 4100),
        (0, 9, 7),
        (1, 300, 16),
    ];
    for (offset, rows, cols) in cases {
        let (flat, data) = random_tensor(&[offset + rows * cols], (rows + cols) as u64);
        let x = flat
            .narrow(0, offset, rows * cols)
            .unwrap()
            .reshape(&[rows, cols])
            .unwrap();
        let data = &data[offset..];
        let what = format!("[{rows}, {cols}] at offset {offset}");
        let sum = reduce_ref(data, &[rows, cols], &[0], 0.0, |a, b| a + b);
        let got = x.sum_dims(&[0], false).unwrap().to_vec().unwrap();
        assert_close(&got, &sum, 1e-4, &format!("sum of {what}"));
        let max = reduce_ref(data, &[rows, cols], &[0], f64::NEG_INFINITY, f64::max);
        let got = x.max_dims(&[0], false).unwrap().to_vec().unwrap();
        assert_close(&got, &max, 0.0, &format!("max of {what}"));
    }
}

#[test]
fn reductions_over_dims_with_and_without_keepdim() {
    let shapes_dims: [(&[usize], &[usize]); 8] = [
        (&[5, 7], &[0]),
        (&[5, 7], &[1]),
        (&[3, 4, 5], &[0, 2]),
        (&[3, 4, 5], &[1]),
        (&[2, 3, 4, 5], &[1, 3]),
        (&[2, 3, 4, 5], &[0, 1, 2, 3]),
        (&[2000, 3], &[0]),
        (&[3, 9000], &[1]),
    ];
    for (k, (shape, dims)) in shapes_dims.iter().enumerate() {
        let (t, data) = random_tensor(shape, k as u64);
        let kcount: usize = dims.iter().map(|&d| shape[d]).product();
        let sum = reduce_ref(&data, shape, dims, 0.0, |a, b| a + b);
        let max = reduce_ref(&data, shape, dims, f64::NEG_INFINITY, f64::max);
        let kept: Vec<usize> = shape
            .iter()
            .enumerate()
            .map(|(d, &n)| if dims.contains(&d) { 1 } else { n })
            .collect();
        let dropped: Vec<usize> = shape
            .iter()
            .enumerate()
            .filter(|(d, _)| !dims.contains(d))
            .map(|(_, &n)| n)
            .collect();
        let s = t.sum_dims(dims, true).unwrap();
        assert_eq!(s.shape(), kept.as_slice());
        assert_close(
            &s.to_vec().unwrap(),
            &sum,
            1e-5,
            &format!("sum {shape:?} {dims:?}"),
        );
        let m = t.mean_dims(dims, false).unwrap();
        assert_eq!(m.shape(), dropped.as_slice());
        let mean: Vec<f64> = sum.iter().map(|s| s / kcount as f64).collect();
        assert_close(
            &m.to_vec().unwrap(),
            &mean,
            1e-5,
            &format!("mean {shape:?} {dims:?}"),
        );
        assert_close(
            &t.max_dims(dims, false).unwrap().to_vec().unwrap(),
            &max,
            0.0,
            &format!("max {shape:?} {dims:?}"),
        );
    }
}

/// A reduction over dims that no single matrix view covers (a conv bias's grad: `[N, C, H, W]`
/// over N, H and W) reads its input where it lies, a run of adjacent dims at a time, instead of
/// making a dense copy of it first.
#[test]
fn reductions_over_separated_dims_make_no_dense_copy_of_their_input() {
    // Its own device, so that the peak below counts this test's buffers only.
    let dev = Device::new().unwrap();
    let shape = [16, 8, 12, 12];
    let data = random_vec(shape.iter().product(), 21);
    let t = Tensor::from_vec(data.clone(), &shape, &dev).unwrap();
    for dims in [&[0, 2, 3][..], &[0, 3], &[1, 3]] {
        dev.synchronize().unwrap();
        dev.reset_peak_memory();
        let before = dev.stats().live_bytes;
        let s = t.sum_dims(dims, false).unwrap();
        dev.synchronize().unwrap();
        let extra = dev.stats().peak_live_bytes - before;
        let input_bytes = (data.len() * 4) as u64;
        assert!(
            extra < input_bytes / 4,
            "sum over {dims:?} of {shape:?} held {extra} bytes beside its input of {input_bytes}"
        );
        let want = reduce_ref(&data, &shape, dims, 0.0, |a, b| a + b);
        assert_close(&s.to_vec().unwrap(), &want, 1e-5, &format!("sum {dims:?}"));
    }
}

#[test]
fn reductions_read_transposed_views() {
    let (t, data) = random_tensor(&[6, 10], 3);
    let tt = t.t().unwrap(); // [10, 6]
    let got = tt.sum_dims(&[1], false).unwrap();
    let want: Vec<f64> = (0..10)
        .map(|j| (0..6).map(|i| data[i * 10 + j] as f64).sum())
        .collect();
    assert_close(
        &got.to_vec().unwrap(),
        &want,
        1e-5,
        "sum of transpose over dim 1",
    );
    let got = t
        .permute(&[1, 0])
        .unwrap()
        .unsqueeze(0)
        .unwrap()
        .expand(&[3, 10, 6])
        .unwrap()
        .sum_dims(&[0, 2], false)
        .unwrap();
    let want: Vec<f64> = want.iter().map(|w| 3.0 * w).collect();
    assert_close(
        &got.to_vec().unwrap(),
        &want,
        1e-5,
        "sum of an expanded view",
    );
}

#[test]
fn sum_of_a_rank_zero_tensor_is_itself() {
    let s = Tensor::full(&[], 4.0, device()).unwrap();
    assert_eq!(s.sum().unwrap().item().unwrap(), 4.0);
    assert_eq!(s.max().unwrap().item().unwrap(), 4.0);
}

#[test]
fn max_over_an_empty_dim_is_an_error_and_bad_dims_are_shape_errors() {
    let t = Tensor::zeros(&[0, 3], device()).unwrap();
    let err = t.max_dims(&[0], false).unwrap_err();
    assert!(
        matches!(err, Error::Shape { op: "max", .. }) && err.to_string().contains("[0, 3]"),
        "{err}"
    );
    let u = Tensor::zeros(&[2, 3], device()).unwrap();
    let err = u.sum_dims(&[2], false).unwrap_err();
    assert!(
        matches!(err, Error::Shape { op: "sum", .. }) && err.to_string().contains("[2, 3]"),
        "{err}"
    );
}

#[test]
fn argmax_returns_the_first_maximum_as_u32() {
    let t = Tensor::from_vec(
        vec![1.0, 5.0, 5.0, -1.0, 0.0, 2.0, 2.0, 9.0],
        &[2, 4],
        device(),
    )
    .unwrap();
    assert_eq!(
        t.argmax(1, false).unwrap().to_vec_u32().unwrap(),
        vec![1, 3]
    );
    assert_eq!(
        t.argmax(0, false).unwrap().to_vec_u32().unwrap(),
        vec![0, 0, 0, 1]
    );
    let k = t.argmax(1, true).unwrap();
    assert_eq!(k.shape(), &[2, 1]);
    let (r, data) = random_tensor(&[37, 1029], 4);
    let got = r.argmax(1, false).unwrap().to_vec_u32().unwrap();
    for (i, &g) in got.iter().enumerate() {
        let row = &data[i * 1029..(i + 1) * 1029];
        let best = row
            .iter()
            .enumerate()
            .fold(0, |b, (j, &x)| if x > row[b] { j } else { b });
        assert_eq!(g as usize, best, "row {i}");
    }
}
