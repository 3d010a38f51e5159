//! softmax, log_softmax, cross_entropy, index_select and gather against CPU references.

mod common;
use common::*;
use wgrad::{nn, Error, Tensor};

fn softmax_rows(data: &[f32], rows: usize, cols: usize) -> Vec<f64> {
    let mut out = Vec::with_capacity(rows * cols);
    for r in 0..rows {
        let row: Vec<f64> = data[r * cols..(r + 1) * cols]
            .iter()
            .map(|&x| x as f64)
            .collect();
        let m = row.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let s: f64 = row.iter().map(|x| (x - m).exp()).sum();
        out.extend(row.iter().map(|x| (x - m).exp() / s));
    }
    out
}

#[test]
fn index_select_gather_and_flip_move_u32_values_exactly_and_keep_them_indices() {
    let dev = device();
    // Word patterns that are f32 NaNs, infinities and subnormals must come through as they are.
    let words = [
        0,
        1,
        7,
        0x7FC0_0001,
        0x7F80_0000,
        0x8000_0000,
        0xFFFF_FFFF,
        0x0040_0000,
    ];
    let table = Tensor::from_vec_u32(words.to_vec(), &[4, 2], dev).unwrap();
    let rows = Tensor::from_labels(vec![3, 0, 3, 1], dev).unwrap();
    let picked = table.index_select(0, &rows).unwrap();
    assert_eq!(picked.dtype(), wgrad::DType::U32);
    let want: Vec<u32> = [3, 0, 3, 1]
        .iter()
        .flat_map(|&r| [words[2 * r], words[2 * r + 1]])
        .collect();
    assert_eq!(picked.to_vec_u32().unwrap(), want);
    let columns = Tensor::from_vec_u32(vec![1, 1, 0, 0, 1, 0, 0, 1], &[4, 2], dev).unwrap();
    let gathered = table.gather(1, &columns).unwrap();
    let want: Vec<u32> = (0..8)
        .map(|i| words[2 * (i / 2) + [1, 1, 0, 0, 1, 0, 0, 1][i]])
        .collect();
    assert_eq!(gathered.to_vec_u32().unwrap(), want);
    let flipped = table.flip(&[0, 1]).unwrap();
    let want: Vec<u32> = words.iter().rev().copied().collect();
    assert_eq!(flipped.to_vec_u32().unwrap(), want);
    // A batch of token rows picked on the device feeds an embedding: the picks keep the
    // table's range.
    let tokens = Tensor::from_vec_u32((0..40).map(|i| i % 10).collect(), &[5, 8], dev).unwrap();
    let batch = tokens.index_select(0, &rows).unwrap();
    let embedding = nn::Embedding::new(10, 3, dev).unwrap();
    use nn::Module;
    assert_eq!(embedding.forward(&batch).unwrap().shape(), &[4, 8, 3]);
    let too_small = nn::Embedding::new(9, 3, dev).unwrap();
    assert!(too_small.forward(&batch).is_err());
}

#[test]
fn softmax_along_a_leading_dim() {
    let (t, data) = random_tensor(&[4, 3], 2);
    let got = t.softmax(0).unwrap();
    assert_eq!(got.shape(), &[4, 3]);
    let tr: Vec<f32> = (0..12).map(|i| data[(i % 4) * 3 + i / 4]).collect();
    let want_t = softmax_rows(&tr, 3, 4);
    let want: Vec<f64> = (0..12).map(|i| want_t[(i % 3) * 4 + i / 3]).collect();
    assert_close(&got.to_vec().unwrap(), &want, 1e-5, "softmax dim 0");
}

#[test]
fn softmax_of_large_logits_stays_finite() {
    let t = Tensor::from_vec(vec![1e4, -1e4, 0.0, 3e38, 3e38, -3e38], &[2, 3], device()).unwrap();
    let got = t.softmax(1).unwrap().to_vec().unwrap();
    assert!(got.iter().all(|x| x.is_finite()), "{got:?}");
    assert_close(&got, &[1.0, 0.0, 0.0, 0.5, 0.5, 0.0], 1e-6, "large softmax");
    let log = t.log_softmax(1).unwrap().to_vec().unwrap();
    assert_eq!(log[0], 0.0);
    assert!(
        (log[3] + 2f32.ln()).abs() < 1e-6 && (log[4] + 2f32.ln()).abs() < 1e-6,
        "{log:?}"
    );
}

#[test]
fn cross_entropy_is_the_mean_negative_log_likelihood() {
    let (n, c) = (37, 10);
    let (logits, data) = random_tensor(&[n, c], 5);
    let logits = logits.mul_scalar(30.0).unwrap();
    let labels: Vec<u32> = (0..n as u32).map(|i| (i * 7) % c as u32).collect();
    let l = Tensor::from_labels(labels.clone(), device()).unwrap();
    let loss = nn::loss::cross_entropy(&logits, &l).unwrap();
    assert_eq!(loss.shape(), &[] as &[usize]);
    let scaled: Vec<f32> = data.iter().map(|x| x * 30.0).collect();
    let p = softmax_rows(&scaled, n, c);
    let want: f64 = (0..n)
        .map(|i| -p[i * c + labels[i] as usize].ln())
        .sum::<f64>()
        / n as f64;
    assert_close(&[loss.item().unwrap()], &[want], 1e-5, "cross_entropy");
}

#[test]
fn cross_entropy_with_a_label_out_of_range_names_label_and_classes() {
    let logits = Tensor::zeros(&[2, 3], device()).unwrap();
    let labels = Tensor::from_labels(vec![0, 3], device()).unwrap();
    let err = nn::loss::cross_entropy(&logits, &labels).unwrap_err();
    assert!(
        matches!(
            err,
            Error::Index {
                op: "cross_entropy",
                ..
            }
        ),
        "{err:?}"
    );
    assert!(
        err.to_string().contains("label 3") && err.to_string().contains("3 classes"),
        "{err}"
    );
}

#[test]
fn cross_entropy_with_mismatched_shapes_or_dtypes_is_an_error() {
    let logits = Tensor::zeros(&[2, 3], device()).unwrap();
    let err = nn::loss::cross_entropy(
        &logits,
        &Tensor::from_labels(vec![0, 1, 2], device()).unwrap(),
    )
    .unwrap_err();
    assert!(
        matches!(
            err,
            Error::Shape {
                op: "cross_entropy",
                ..
            }
        ) && err.to_string().contains("[2, 3]"),
        "{err}"
    );
    let err =
        nn::loss::cross_entropy(&logits, &Tensor::zeros(&[2], device()).unwrap()).unwrap_err();
    assert!(
        matches!(
            err,
            Error::DType {
                op: "cross_entropy",
                ..
            }
        ),
        "{err:?}"
    );
}

#[test]
fn index_select_picks_slices_in_order() {
    let (t, data) = random_tensor(&[5, 4, 3], 6);
    let idx = Tensor::from_vec_u32(vec![3, 0, 3], &[3], device()).unwrap();
    let got = t.index_select(1, &idx).unwrap();
    assert_eq!(got.shape(), &[5, 3, 3]);
    let got = got.to_vec().unwrap();
    for i in 0..5 {
        for (j, &s) in [3usize, 0, 3].iter().enumerate() {
            for k in 0..3 {
                assert_eq!(got[(i * 3 + j) * 3 + k], data[(i * 4 + s) * 3 + k]);
            }
        }
    }
    let rows = t
        .permute(&[2, 1, 0])
        .unwrap()
        .index_select(0, &Tensor::from_vec_u32(vec![2], &[1], device()).unwrap())
        .unwrap();
    assert_eq!(rows.shape(), &[1, 4, 5]);
}

#[test]
fn index_select_grad_sums_the_grads_of_repeated_picks_along_long_rows() {
    // Rows of 37 (runs of 16, 16 and 5 elements), two outer slices, row 3 picked three times,
    // row 1 never.
    let (shape, picks) = ([2usize, 4, 37], [3u32, 0, 3, 2, 3]);
    let (x, _) = random_tensor(&shape, 30);
    let x = x.requires_grad_(true);
    let idx = Tensor::from_vec_u32(picks.to_vec(), &[5], device()).unwrap();
    let (g, gs) = random_tensor(&[2, 5, 37], 31);
    let y = x.index_select(1, &idx).unwrap();
    y.mul(&g).unwrap().sum().unwrap().backward().unwrap();
    let mut want = vec![0.0f64; 2 * 4 * 37];
    for o in 0..2 {
        for (j, &p) in picks.iter().enumerate() {
            for k in 0..37 {
                want[(o * 4 + p as usize) * 37 + k] += gs[(o * 5 + j) * 37 + k] as f64;
            }
        }
    }
    assert_close(
        &x.grad().unwrap().to_vec().unwrap(),
        &want,
        1e-6,
        "index_select grad",
    );
}

#[test]
fn index_select_grad_sums_more_lookups_of_one_row_than_one_launch_takes() {
    // 16,000 lookups into 8 rows of 20 (runs of 16 and 4), row 5 picked by all but every
    // seventh: the sum runs over several launches of the kernel (in one, row 5's invocations
    // would loop past the 65,535 iterations Mesa 22.3 allows).
    let (rows, features, lookups) = (8usize, 20usize, 16_000usize);
    let picks: Vec<u32> = (0..lookups)
        .map(|j| if j % 7 == 0 { (j % rows) as u32 } else { 5 })
        .collect();
    let (x, _) = random_tensor(&[rows, features], 32);
    let x = x.requires_grad_(true);
    let idx = Tensor::from_vec_u32(picks.clone(), &[lookups], device()).unwrap();
    let (g, gs) = random_tensor(&[lookups, features], 33);
    let y = x.index_select(0, &idx).unwrap();
    y.mul(&g).unwrap().sum().unwrap().backward().unwrap();
    let mut want = vec![0.0f64; rows * features];
    for (j, &p) in picks.iter().enumerate() {
        for k in 0..features {
            want[p as usize * features + k] += gs[j * features + k] as f64;
        }
    }
    assert_close(
        &x.grad().unwrap().to_vec().unwrap(),
        &want,
        2e-3,
        "index_select grad over 16,000 lookups",
    );
}

#[test]
fn gather_follows_pytorch() {
    let (t, data) = random_tensor(&[3, 5], 7);
    let idx = Tensor::from_vec_u32(vec![4, 0, 1, 1, 2, 3], &[3, 2], device()).unwrap();
    let got = t.gather(1, &idx).unwrap().to_vec().unwrap();
    let want: Vec<f32> = vec![
        data[4],
        data[0],
        data[5 + 1],
        data[5 + 1],
        data[10 + 2],
        data[10 + 3],
    ];
    assert_eq!(got, want);
    let idx0 = Tensor::from_vec_u32(vec![2, 0, 1], &[1, 3], device()).unwrap();
    assert_eq!(
        t.gather(0, &idx0).unwrap().to_vec().unwrap(),
        vec![data[10], data[1], data[5 + 2]]
    );
    let tt = t.t().unwrap();
    let idx_t = Tensor::from_vec_u32(vec![2, 1], &[1, 2], device()).unwrap();
    assert_eq!(
        tt.gather(1, &idx_t).unwrap().to_vec().unwrap(),
        vec![data[10], data[5]]
    );
}

#[test]
fn indices_out_of_range_or_of_the_wrong_dtype_are_errors() {
    let t = Tensor::zeros(&[3, 4], device()).unwrap();
    let idx = Tensor::from_vec_u32(vec![0, 4], &[2], device()).unwrap();
    let err = t.index_select(1, &idx).unwrap_err();
    assert!(
        matches!(
            err,
            Error::Index {
                op: "index_select",
                ..
            }
        ),
        "{err:?}"
    );
    assert!(
        err.to_string().contains("index 4") && err.to_string().contains("size 4"),
        "{err}"
    );
    let err = t
        .gather(
            0,
            &Tensor::from_vec_u32(vec![3], &[1, 1], device()).unwrap(),
        )
        .unwrap_err();
    assert!(matches!(err, Error::Index { op: "gather", .. }), "{err:?}");
    let err = t
        .index_select(0, &Tensor::zeros(&[1], device()).unwrap())
        .unwrap_err();
    assert!(
        matches!(
            err,
            Error::DType {
                op: "index_select",
                ..
            }
        ),
        "{err:?}"
    );
}

#[test]
fn softmax_and_log_softmax_match_reference_on_the_last_dim() {
    // Few rows (a workgroup per row) and enough rows that CPU adapters give each row its own
    // invocation, with row lengths that do and do not allow four-wide reads, and a slice.
    let cases = [
        (1, 1),
        (3, 7),
        (5, 255),
        (2, 257),
        (4, 1023),
        (1, 4097),
        (70, 12),
        (65, 7),
        (128, 1024),
    ];
    for (rows, cols) in cases {
        let (t, data) = random_tensor(&[rows, cols], 40 + cols as u64);
        let t = t.mul_scalar(20.0).unwrap();
        let scaled: Vec<f32> = data.iter().map(|x| x * 20.0).collect();
        let want = softmax_rows(&scaled, rows, cols);
        assert_close(
            &t.softmax(1).unwrap().to_vec().unwrap(),
            &want,
            1e-5,
            &format!("softmax {rows}x{cols}"),
        );
        let want_log: Vec<f64> = want.iter().map(|p| p.ln()).collect();
        assert_close(
            &t.log_softmax(1).unwrap().to_vec().unwrap(),
            &want_log,
            1e-4,
            &format!("log_softmax {rows}x{cols}"),
        );
        let offset = t
            .narrow(1, 4.min(cols - 1), cols - 4.min(cols - 1))
            .unwrap();
        let k = offset.shape()[1];
        let sub: Vec<f32> = (0..rows)
            .flat_map(|r| scaled[r * cols + cols - k..(r + 1) * cols].to_vec())
            .collect();
        assert_close(
            &offset.softmax(1).unwrap().to_vec().unwrap(),
            &softmax_rows(&sub, rows, k),
            1e-5,
            "narrowed",
        );
    }
}

#[test]
fn cross_entropy_over_a_large_batch_matches_reference() {
    for (n, c) in [(100, 10), (96, 12)] {
        let (logits, data) = random_tensor(&[n, c], 50 + c as u64);
        let labels: Vec<u32> = (0..n as u32).map(|i| (i * 5 + 1) % c as u32).collect();
        let loss = nn::loss::cross_entropy(
            &logits,
            &Tensor::from_labels(labels.clone(), device()).unwrap(),
        )
        .unwrap();
        let p = softmax_rows(&data, n, c);
        let want: f64 = (0..n)
            .map(|i| -p[i * c + labels[i] as usize].ln())
            .sum::<f64>()
            / n as f64;
        assert_close(
            &[loss.item().unwrap()],
            &[want],
            1e-5,
            &format!("cross_entropy {n}x{c}"),
        );
    }
}
