//! The small ops that convolutions and attention lean on: masked_fill, tril/triu and their
//! masks, pad2d and dropout, against CPU references and finite differences (S-13).

mod common;
use common::*;
use wgrad::{Error, Tensor};

#[test]
fn masked_fill_broadcasts_the_mask_and_keeps_the_rest() {
    let dev = device();
    let (x, xv) = random_tensor(&[2, 3, 4], 1);
    let mask = Tensor::triu_mask(3, 4, 1, dev).unwrap();
    let got = x.masked_fill(&mask, -7.5).unwrap().to_vec().unwrap();
    let want: Vec<f64> = (0..24)
        .map(|i| {
            let (r, c) = ((i / 4) % 3, i % 4);
            if c > r {
                -7.5
            } else {
                xv[i] as f64
            }
        })
        .collect();
    assert_close(&got, &want, 0.0, "masked_fill");
}

#[test]
fn masked_fill_passes_the_grad_where_the_mask_is_zero() {
    let dev = device();
    let mask_values = vec![1, 0, 0, 1, 0, 1];
    gradcheck(
        "masked_fill",
        &[(vec![2, 3], values_in(6, -1.0, 1.0, 2))],
        |t| {
            let mask = Tensor::from_vec_u32(mask_values.clone(), &[2, 3], dev)?;
            t[0].masked_fill(&mask, 3.0)
        },
    );
}

#[test]
fn masked_fill_rejects_a_mask_that_does_not_broadcast_to_the_input() {
    let dev = device();
    let x = Tensor::zeros(&[2, 3], dev).unwrap();
    let big = Tensor::from_vec_u32(vec![0; 12], &[2, 2, 3], dev).unwrap();
    let err = x.masked_fill(&big, 0.0).unwrap_err();
    assert!(
        matches!(
            err,
            Error::Shape {
                op: "masked_fill",
                ..
            }
        ),
        "{err}"
    );
    assert!(err.to_string().contains("[2, 2, 3]"), "{err}");
    let f32_mask = Tensor::zeros(&[2, 3], dev).unwrap();
    assert!(matches!(
        x.masked_fill(&f32_mask, 0.0),
        Err(Error::DType { .. })
    ));
}

#[test]
fn tril_and_triu_keep_their_triangles() {
    let (x, xv) = random_tensor(&[2, 4, 5], 3);
    for diagonal in [-1i64, 0, 2] {
        let lower = x.tril(diagonal).unwrap().to_vec().unwrap();
        let upper = x.triu(diagonal).unwrap().to_vec().unwrap();
        for i in 0..40 {
            let (r, c) = ((i / 5) % 4, i % 5);
            let keep_lower = c as i64 <= r as i64 + diagonal;
            let keep_upper = c as i64 >= r as i64 + diagonal;
            assert_eq!(
                lower[i],
                if keep_lower { xv[i] } else { 0.0 },
                "tril {diagonal} at {i}"
            );
            assert_eq!(
                upper[i],
                if keep_upper { xv[i] } else { 0.0 },
                "triu {diagonal} at {i}"
            );
        }
    }
    assert!(Tensor::zeros(&[3], device()).unwrap().tril(0).is_err());
}

#[test]
fn pad2d_matches_reference_and_its_grad_checks() {
    let (x, xv) = random_tensor(&[2, 3, 4], 4);
    let got = x.pad2d((1, 2, 0, 1), 0.5).unwrap();
    assert_eq!(got.shape(), &[2, 4, 7]);
    let got = got.to_vec().unwrap();
    for b in 0..2 {
        for r in 0..4 {
            for c in 0..7 {
                let want = if r < 3 && (1..5).contains(&c) {
                    xv[(b * 3 + r) * 4 + c - 1]
                } else {
                    0.5
                };
                assert_eq!(got[(b * 4 + r) * 7 + c], want, "at {b} {r} {c}");
            }
        }
    }
    gradcheck(
        "pad2d",
        &[(vec![1, 2, 3], values_in(6, -1.0, 1.0, 5))],
        |t| t[0].pad2d((2, 1, 1, 2), -1.0),
    );
    let err = Tensor::zeros(&[4], device())
        .unwrap()
        .pad2d((1, 1, 1, 1), 0.0)
        .unwrap_err();
    assert!(err.to_string().contains("pad2d"), "{err}");
}

#[test]
fn dropout_zeroes_about_p_and_scales_the_rest() {
    let dev = device();
    let x = Tensor::ones(&[10_000], dev).unwrap();
    wgrad::manual_seed(5);
    let a = x.dropout(0.25).unwrap().to_vec().unwrap();
    wgrad::manual_seed(5);
    let b = x.dropout(0.25).unwrap().to_vec().unwrap();
    assert_eq!(a, b, "the same seed gives the same mask");
    let dropped = a.iter().filter(|&&v| v == 0.0).count();
    assert!(
        (2200..2800).contains(&dropped),
        "{dropped} of 10000 dropped at p = 0.25"
    );
    assert!(a.iter().all(|&v| v == 0.0 || (v - 1.0 / 0.75).abs() < 1e-6));
    assert!(x.dropout(1.0).is_err());
    assert_eq!(x.dropout(0.0).unwrap().to_vec().unwrap(), vec![1.0; 10_000]);
}

#[test]
fn stack_adds_a_dim_and_its_grad_splits_back() {
    let dev = device();
    let a = Tensor::from_vec(vec![1.0, 2.0], &[2], dev).unwrap();
    let b = Tensor::from_vec(vec![3.0, 4.0], &[2], dev).unwrap();
    let rows = Tensor::stack(&[a.clone(), b.clone()], 0).unwrap();
    assert_eq!(rows.shape(), &[2, 2]);
    assert_eq!(rows.to_vec().unwrap(), vec![1.0, 2.0, 3.0, 4.0]);
    let cols = Tensor::stack(&[a, b], 1).unwrap();
    assert_eq!(cols.to_vec().unwrap(), vec![1.0, 3.0, 2.0, 4.0]);
    gradcheck(
        "stack",
        &[
            (vec![2, 3], values_in(6, -1.0, 1.0, 6)),
            (vec![2, 3], values_in(6, -1.0, 1.0, 7)),
        ],
        |t| Tensor::stack(t, 1),
    );
    let c = Tensor::zeros(&[3], dev).unwrap();
    let err = Tensor::stack(&[c.clone(), Tensor::zeros(&[2], dev).unwrap()], 0).unwrap_err();
    assert!(err.to_string().contains("stack"), "{err}");
    assert!(Tensor::stack(&[c], 2).is_err());
}
