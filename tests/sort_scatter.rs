//! sort, topk and scatter_add against host references (torch's rules: stable ties, NaN the
//! largest; repeated indices adding up), their grads against finite differences, past the
//! loop-split length, and their errors.

mod common;
use common::*;
use wgrad::{Error, Tensor};

/// torch's stable sort of one row on the host: (values, positions).
fn sort_ref(row: &[f32], descending: bool) -> (Vec<f32>, Vec<u32>) {
    let key = |x: f32| if x.is_nan() { f32::INFINITY } else { x };
    let mut order: Vec<usize> = (0..row.len()).collect();
    order.sort_by(|&a, &b| {
        let (x, y) = (row[a], row[b]);
        // NaN after +inf ascending (before it descending); then position.
        let by_value = match (x.is_nan(), y.is_nan()) {
            (true, false) => std::cmp::Ordering::Greater,
            (false, true) => std::cmp::Ordering::Less,
            _ => key(x).partial_cmp(&key(y)).unwrap(),
        };
        let by_value = if descending {
            by_value.reverse()
        } else {
            by_value
        };
        by_value.then(a.cmp(&b))
    });
    (
        order.iter().map(|&i| row[i]).collect(),
        order.iter().map(|&i| i as u32).collect(),
    )
}

/// The rows of `x` `[a, b, c]` along `dim`, each as the list of its flat positions.
fn lines(shape: [usize; 3], dim: usize) -> Vec<Vec<usize>> {
    let st = strides(&shape);
    let others: Vec<usize> = (0..3).filter(|&d| d != dim).collect();
    let mut out = Vec::new();
    for i in 0..shape[others[0]] {
        for j in 0..shape[others[1]] {
            let base = i * st[others[0]] + j * st[others[1]];
            out.push((0..shape[dim]).map(|k| base + k * st[dim]).collect());
        }
    }
    out
}

/// Values with ties (rounded to tenths) and a NaN, so that stability and NaN order are checked.
fn tied_values(n: usize, seed: u64) -> Vec<f32> {
    let mut v: Vec<f32> = random_vec(n, seed)
        .iter()
        .map(|x| (x * 10.0).round() / 10.0)
        .collect();
    v[n / 2] = f32::NAN;
    v
}

#[test]
fn sort_along_each_dim_is_torchs_stable_sort_with_nan_largest() {
    let shape = [3, 5, 4];
    let xv = tied_values(60, 1);
    let x = Tensor::from_slice(&xv, &shape, device()).unwrap();
    for dim in 0..3 {
        for descending in [false, true] {
            let (values, indices) = x.sort(dim, descending).unwrap();
            assert_eq!(values.shape(), &shape);
            let (got_v, got_i) = (values.to_vec().unwrap(), indices.to_vec_u32().unwrap());
            for line in lines(shape, dim) {
                let row: Vec<f32> = line.iter().map(|&at| xv[at]).collect();
                let (want_v, want_i) = sort_ref(&row, descending);
                let got_row_v: Vec<f32> = line.iter().map(|&at| got_v[at]).collect();
                let got_row_i: Vec<u32> = line.iter().map(|&at| got_i[at]).collect();
                let what = format!("dim {dim} descending {descending} row {row:?}");
                assert_eq!(got_row_i, want_i, "{what}");
                let same = got_row_v
                    .iter()
                    .zip(&want_v)
                    .all(|(a, b)| a == b || (a.is_nan() && b.is_nan()));
                assert!(same, "{what}: {got_row_v:?} vs {want_v:?}");
            }
        }
    }
}

#[test]
fn topk_keeps_the_k_largest_first() {
    let (x, xv) = random_tensor(&[4, 9], 2);
    let (values, indices) = x.topk(3, 1).unwrap();
    assert_eq!(values.shape(), &[4, 3]);
    let (got_v, got_i) = (values.to_vec().unwrap(), indices.to_vec_u32().unwrap());
    for r in 0..4 {
        let (want_v, want_i) = sort_ref(&xv[r * 9..(r + 1) * 9], true);
        assert_eq!(&got_v[r * 3..(r + 1) * 3], &want_v[..3]);
        assert_eq!(&got_i[r * 3..(r + 1) * 3], &want_i[..3]);
    }
    // Along dim 0, and k = 0 and k = the whole dim.
    let (v0, _) = x.topk(2, 0).unwrap();
    assert_eq!(v0.shape(), &[2, 9]);
    assert_eq!(x.topk(0, 1).unwrap().0.shape(), &[4, 0]);
    let (all, _) = x.topk(9, 1).unwrap();
    let (sorted, _) = x.sort(1, true).unwrap();
    assert_eq!(all.to_vec().unwrap(), sorted.to_vec().unwrap());
}

#[test]
fn sort_and_topk_of_rows_of_a_larger_tensor_read_those_rows() {
    // narrow(0, ..) is a dense view that starts inside its buffer: the kernels must read from
    // its first element, not from the buffer's (they sorted row 0 whichever row was asked).
    let (x, xv) = random_tensor(&[5, 7], 3);
    for start in 0..5 {
        let rows = x.narrow(0, start, 5 - start).unwrap();
        let (values, indices) = rows.sort(1, false).unwrap();
        let (top, top_at) = rows.topk(2, 1).unwrap();
        let (got_v, got_i) = (values.to_vec().unwrap(), indices.to_vec_u32().unwrap());
        let (got_top, got_top_at) = (top.to_vec().unwrap(), top_at.to_vec_u32().unwrap());
        for r in 0..5 - start {
            let row = &xv[(start + r) * 7..(start + r + 1) * 7];
            let (want_v, want_i) = sort_ref(row, false);
            assert_eq!(
                &got_v[r * 7..(r + 1) * 7],
                &want_v[..],
                "sort, rows from {start}"
            );
            assert_eq!(
                &got_i[r * 7..(r + 1) * 7],
                &want_i[..],
                "sort, rows from {start}"
            );
            let (want_top, want_top_at) = sort_ref(row, true);
            assert_eq!(
                &got_top[r * 2..(r + 1) * 2],
                &want_top[..2],
                "topk, rows from {start}"
            );
            assert_eq!(
                &got_top_at[r * 2..(r + 1) * 2],
                &want_top_at[..2],
                "topk, rows from {start}"
            );
        }
    }
}

/// Rows past 65,536 with ties and NaNs, of a length that leaves a short last run at every
/// merge, sorted stably both ways.
#[test]
fn sort_of_rows_past_65536_with_ties_is_stable_both_ways() {
    let n = 70_001;
    let row = tied_values(n, 9);
    let x = Tensor::from_vec(row.clone(), &[1, n], device()).unwrap();
    for descending in [false, true] {
        let (values, indices) = x.sort(1, descending).unwrap();
        let (want_v, want_i) = sort_ref(&row, descending);
        let got_v = values.to_vec().unwrap();
        let same = got_v
            .iter()
            .zip(&want_v)
            .all(|(g, w)| g == w || (g.is_nan() && w.is_nan()));
        assert!(same, "descending {descending}: values");
        assert_eq!(
            indices.to_vec_u32().unwrap(),
            want_i,
            "descending {descending}"
        );
    }
}

#[test]
fn sort_of_a_long_row_matches_the_host() {
    let n = 40_000;
    let (x, xv) = random_tensor(&[1, n], 3);
    let (values, indices) = x.sort(1, false).unwrap();
    let (want_v, want_i) = sort_ref(&xv, false);
    assert_eq!(values.to_vec().unwrap(), want_v);
    assert_eq!(indices.to_vec_u32().unwrap(), want_i);
    let (top, at) = x.topk(5, 1).unwrap();
    let (want_v, want_i) = sort_ref(&xv, true);
    assert_eq!(top.to_vec().unwrap(), want_v[..5].to_vec());
    assert_eq!(at.to_vec_u32().unwrap(), want_i[..5].to_vec());
}

/// top-k sampling's shape: a few of a long row with ties and NaNs, in any order of the row,
/// grads at the k positions only.
#[test]
fn topk_of_a_vocabulary_sized_row_matches_the_host() {
    let n = 30_000;
    let mut tied = tied_values(n, 5);
    for at in [7, 20_000, 29_999] {
        tied[at] = f32::NAN;
    }
    let ascending: Vec<f32> = (0..n).map(|i| i as f32).collect();
    for (what, row) in [("ties and NaNs", tied), ("ascending", ascending)] {
        let x = Tensor::from_vec(row.clone(), &[1, n], device())
            .unwrap()
            .requires_grad_(true);
        let (top, at) = x.topk(40, 1).unwrap();
        let (want_v, want_i) = sort_ref(&row, true);
        let got_v = top.to_vec().unwrap();
        for (g, w) in got_v.iter().zip(&want_v[..40]) {
            assert!(g == w || (g.is_nan() && w.is_nan()), "{what}: {got_v:?}");
        }
        assert_eq!(at.to_vec_u32().unwrap(), want_i[..40].to_vec(), "{what}");
        // The sum is NaN where NaNs were kept; its grad is 1 at each kept position all the same.
        top.sum().unwrap().backward().unwrap();
        let grad = x.grad().unwrap().to_vec().unwrap();
        let mut want = vec![0.0; n];
        for &i in &want_i[..40] {
            want[i as usize] = 1.0;
        }
        assert_eq!(grad, want, "{what}: grads");
    }
}

#[test]
fn sort_and_topk_send_grads_to_the_positions_they_took() {
    for n in [1, 3] {
        // Distinct values, so that finite differences do not reorder them.
        let values: Vec<f32> = (0..n * 6)
            .map(|i| ((i * 7) % (n * 6)) as f32 * 0.3 - 1.0)
            .collect();
        gradcheck(
            &format!("sort batch {n}"),
            &[(vec![n, 6], values.clone())],
            |t| Ok(t[0].sort(1, false)?.0),
        );
        gradcheck(
            &format!("topk batch {n}"),
            &[(vec![n, 6], values.clone())],
            |t| Ok(t[0].topk(2, 1)?.0),
        );
        // A transposed view, sorted along dim 0.
        gradcheck(
            &format!("topk of a view {n}"),
            &[(vec![n, 6], values.clone())],
            |t| Ok(t[0].t()?.topk(1, 1)?.0),
        );
        // Along a dim that is not last: the grad comes back in the input's layout.
        gradcheck(
            &format!("sort along dim 0 {n}"),
            &[(vec![6, n], values.clone())],
            |t| Ok(t[0].sort(0, true)?.0),
        );
        gradcheck(
            &format!("topk along dim 0 {n}"),
            &[(vec![6, n], values)],
            |t| Ok(t[0].topk(2, 0)?.0),
        );
    }
}

#[test]
fn sort_and_topk_reject_bad_dims_and_k() {
    let (x, _) = random_tensor(&[2, 3], 4);
    let err = x.topk(4, 1).unwrap_err();
    assert!(matches!(err, Error::Shape { op: "topk", .. }), "{err}");
    assert!(err.to_string().contains("[2, 3]"), "{err}");
    assert!(x.sort(2, false).is_err());
    let labels = Tensor::from_labels(vec![1, 2], device()).unwrap();
    assert!(matches!(labels.sort(0, false), Err(Error::DType { .. })));
}

/// torch's scatter_add on the host for `dim` 1 of `[rows, cols]`.
fn scatter_add_ref(
    x: &[f32],
    cols: usize,
    index: &[u32],
    src: &[f32],
    src_cols: usize,
) -> Vec<f64> {
    let mut out: Vec<f64> = x.iter().map(|&v| v as f64).collect();
    for (at, (&i, &s)) in index.iter().zip(src).enumerate() {
        out[(at / src_cols) * cols + i as usize] += s as f64;
    }
    out
}

#[test]
fn scatter_add_adds_repeated_indices_up() {
    let dev = device();
    let (x, xv) = random_tensor(&[3, 5], 5);
    let (src, sv) = random_tensor(&[3, 4], 6);
    let index_values = vec![0, 4, 4, 1, 2, 2, 2, 2, 3, 0, 1, 3];
    let index = Tensor::from_vec_u32(index_values.clone(), &[3, 4], dev).unwrap();
    let got = x.scatter_add(1, &index, &src).unwrap();
    let want = scatter_add_ref(&xv, 5, &index_values, &sv, 4);
    assert_close(&got.to_vec().unwrap(), &want, 1e-6, "scatter_add dim 1");
    // Along dim 0: out[index[i][j]][j] += src[i][j].
    let rows = Tensor::from_vec_u32(vec![2, 0, 1, 2, 0, 0, 0, 1], &[2, 4], dev).unwrap();
    let (src0, s0) = random_tensor(&[2, 4], 7);
    let got = x.scatter_add(0, &rows, &src0).unwrap().to_vec().unwrap();
    let mut want: Vec<f64> = xv.iter().map(|&v| v as f64).collect();
    for (at, &r) in [2u32, 0, 1, 2, 0, 0, 0, 1].iter().enumerate() {
        want[r as usize * 5 + at % 4] += s0[at] as f64;
    }
    assert_close(&got, &want, 1e-6, "scatter_add dim 0");
}

/// Where the input times the lookups along the dim is large (a permutation of long rows,
/// rows of indices fewer than the input's), gather's grad and scatter_add scatter each
/// lookup atomically: the same sums as the host's, repeated indices included.
#[test]
fn gather_grads_and_scatter_add_over_long_rows_match_the_host() {
    let dev = device();
    let (rows, cols, picked_rows) = (4, 1500, 3);
    let (x, xv) = random_tensor(&[rows, cols], 21);
    // Every index twice or not at all, shuffled by a multiplicative step.
    let index_values: Vec<u32> = (0..picked_rows * cols)
        .map(|i| ((i * 7919) % cols / 2 * 2) as u32)
        .collect();
    let index = Tensor::from_vec_u32(index_values.clone(), &[picked_rows, cols], dev).unwrap();
    let (src, sv) = random_tensor(&[picked_rows, cols], 22);
    let got = x.scatter_add(1, &index, &src).unwrap();
    let mut want = scatter_add_ref(&xv[..picked_rows * cols], cols, &index_values, &sv, cols);
    want.extend(xv[picked_rows * cols..].iter().map(|&v| v as f64));
    assert_close(
        &got.to_vec().unwrap(),
        &want,
        1e-5,
        "scatter_add over long rows",
    );

    let leaf = x.detach().requires_grad_(true);
    let picked = leaf.gather(1, &index).unwrap();
    picked.mul(&src).unwrap().sum().unwrap().backward().unwrap();
    let zeros = vec![0.0; rows * cols];
    let mut want = scatter_add_ref(&zeros[..picked_rows * cols], cols, &index_values, &sv, cols);
    want.extend(std::iter::repeat_n(0.0, (rows - picked_rows) * cols));
    assert_close(
        &leaf.grad().unwrap().to_vec().unwrap(),
        &want,
        1e-5,
        "gather grad",
    );
}

#[test]
fn scatter_add_gradcheck() {
    let dev = device();
    for n in [1, 3] {
        let index: Vec<u32> = (0..n * 4).map(|i| (i * 3 % 5) as u32).collect();
        gradcheck(
            &format!("scatter_add batch {n}"),
            &[
                (vec![n, 5], values_in(n * 5, -1.0, 1.0, 8)),
                // The source, transposed: a non-contiguous view.
                (vec![4, n], values_in(n * 4, -1.0, 1.0, 9)),
            ],
            |t| {
                let index = Tensor::from_vec_u32(index.clone(), &[n, 4], dev)?;
                t[0].scatter_add(1, &index, &t[1].t()?)
            },
        );
    }
}

#[test]
fn scatter_add_rejects_bad_indices_and_shapes() {
    let dev = device();
    let x = Tensor::zeros(&[2, 3], dev).unwrap();
    let src = Tensor::ones(&[2, 2], dev).unwrap();
    let far = Tensor::from_vec_u32(vec![0, 3, 1, 1], &[2, 2], dev).unwrap();
    let err = x.scatter_add(1, &far, &src).unwrap_err();
    assert!(
        matches!(
            err,
            Error::Index {
                op: "scatter_add",
                ..
            }
        ),
        "{err}"
    );
    let short = Tensor::from_vec_u32(vec![0, 1], &[2, 1], dev).unwrap();
    let err = x.scatter_add(1, &short, &src).unwrap_err();
    assert!(err.to_string().contains("[2, 1]"), "{err}");
    let wide = Tensor::from_vec_u32(vec![0; 8], &[4, 2], dev).unwrap();
    assert!(x
        .scatter_add(1, &wide, &Tensor::ones(&[4, 2], dev).unwrap())
        .is_err());
}
