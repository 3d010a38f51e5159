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
    assert!(x.dropout(1.5).is_err() && x.dropout(-0.1).is_err() && x.dropout(f32::NAN).is_err());
    assert_eq!(x.dropout(0.0).unwrap().to_vec().unwrap(), vec![1.0; 10_000]);
}

#[test]
fn dropout_of_every_element_gives_zeros_and_a_zero_grad() {
    // torch's dropout at p = 1 multiplies by 0 (so NaN stays NaN) rather than scale by 1 / 0.
    let x = Tensor::from_slice(&[1.5, -2.0, f32::NAN, 0.0], &[4], device())
        .unwrap()
        .requires_grad_(true);
    let y = x.dropout(1.0).unwrap();
    let got = y.to_vec().unwrap();
    assert_eq!(&got[..2], &[0.0, 0.0]);
    assert!(got[2].is_nan());
    assert_eq!(got[3], 0.0);
    y.sum().unwrap().backward().unwrap();
    assert_eq!(x.grad().unwrap().to_vec().unwrap(), vec![0.0; 4]);
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

// split and chunk: views recorded as one node with one output per piece.

#[test]
fn split_gives_views_of_consecutive_pieces() {
    let (x, xv) = random_tensor(&[2, 7, 3], 31);
    let pieces = x.split(&[2, 0, 5], 1).unwrap();
    let shapes: Vec<Vec<usize>> = pieces.iter().map(|p| p.shape().to_vec()).collect();
    assert_eq!(shapes, vec![vec![2, 2, 3], vec![2, 0, 3], vec![2, 5, 3]]);
    for (piece, (start, len)) in pieces.iter().zip([(0, 2), (2, 0), (2, 5)]) {
        let want: Vec<f64> = (0..2)
            .flat_map(|b| (start..start + len).flat_map(move |r| (0..3).map(move |c| (b, r, c))))
            .map(|(b, r, c)| xv[b * 21 + r * 3 + c] as f64)
            .collect();
        assert_close(&piece.to_vec().unwrap(), &want, 0.0, "split piece");
        assert_eq!(piece.storage_id(), x.storage_id(), "a piece is a view");
    }
}

#[test]
fn chunk_sizes_follow_pytorch() {
    let dev = device();
    let sizes = |n: usize, chunks: usize| -> Vec<usize> {
        Tensor::zeros(&[n, 2], dev)
            .unwrap()
            .chunk(chunks, 0)
            .unwrap()
            .iter()
            .map(|p| p.shape()[0])
            .collect()
    };
    assert_eq!(sizes(10, 3), vec![4, 4, 2]);
    assert_eq!(sizes(6, 3), vec![2, 2, 2]);
    assert_eq!(sizes(5, 4), vec![2, 2, 1]); // fewer pieces than asked, as PyTorch
    assert_eq!(sizes(2, 5), vec![1, 1]);
    assert_eq!(sizes(0, 3), vec![0]);
}

#[test]
fn split_backward_matches_finite_differences_with_every_piece_used() {
    gradcheck(
        "split",
        &[(vec![3, 5], values_in(15, -1.0, 1.0, 32))],
        |t| {
            let p = t[0].split(&[1, 3, 1], 1)?;
            // Each piece reaches the loss through a different op.
            let a = p[0].exp()?;
            let b = p[1].mul(&p[1])?;
            let c = p[2].neg()?;
            Tensor::cat(&[c, b, a], 1)
        },
    );
}

#[test]
fn split_backward_gives_zeros_to_pieces_no_grad_reached() {
    let (x, _) = random_tensor(&[4, 6], 33);
    let x = x.requires_grad_(true);
    let pieces = x.chunk(3, 1).unwrap();
    pieces[1]
        .mul_scalar(3.0)
        .unwrap()
        .sum()
        .unwrap()
        .backward()
        .unwrap();
    let got = x.grad().unwrap().to_vec().unwrap();
    let want: Vec<f64> = (0..24)
        .map(|i| if (2..4).contains(&(i % 6)) { 3.0 } else { 0.0 })
        .collect();
    assert_close(&got, &want, 0.0, "split grad");
}

#[test]
fn split_sums_the_grads_of_a_piece_used_twice() {
    let (x, xv) = random_tensor(&[2, 4], 34);
    let x = x.requires_grad_(true);
    let p = x.split(&[3, 1], 1).unwrap();
    // d/dx of sum(p0 * p0 + p0) + sum(p1) = 2 x + 1 on p0, 1 on p1.
    p[0].mul(&p[0])
        .unwrap()
        .add(&p[0])
        .unwrap()
        .sum()
        .unwrap()
        .add(&p[1].sum().unwrap())
        .unwrap()
        .backward()
        .unwrap();
    let want: Vec<f64> = (0..8)
        .map(|i| {
            if i % 4 < 3 {
                2.0 * xv[i] as f64 + 1.0
            } else {
                1.0
            }
        })
        .collect();
    assert_close(
        &x.grad().unwrap().to_vec().unwrap(),
        &want,
        1e-6,
        "split grad",
    );
}

#[test]
fn split_backward_writes_the_grad_once_instead_of_padding_each_piece() {
    // A device of its own: the dispatch counter is shared by every test on a device.
    let dev = wgrad::Device::new().unwrap();
    let run = |use_split: bool| -> u64 {
        let x = Tensor::from_slice(&random_vec(96, 35), &[8, 12], &dev)
            .unwrap()
            .requires_grad_(true);
        let pieces = if use_split {
            x.split(&[4, 4, 4], 1).unwrap()
        } else {
            (0..3).map(|i| x.narrow(1, 4 * i, 4).unwrap()).collect()
        };
        let loss = pieces[0]
            .mul(&pieces[1])
            .unwrap()
            .add(&pieces[2])
            .unwrap()
            .sum()
            .unwrap();
        dev.synchronize().unwrap();
        let before = dev.stats().dispatches;
        loss.backward().unwrap();
        dev.synchronize().unwrap();
        dev.stats().dispatches - before
    };
    let (narrowed, split) = (run(false), run(true));
    // narrow: a fill and a copy per piece, and two adds to sum them; split: the pieces' grads
    // copied into one tensor.
    assert!(
        split + 4 <= narrowed,
        "split's backward took {split} dispatches, narrow's {narrowed}"
    );
}

#[test]
fn a_split_piece_can_retain_its_grad_and_be_an_input_of_autograd_grad() {
    let (x, _) = random_tensor(&[3, 4], 36);
    let x = x.requires_grad_(true);
    let p = x.split(&[1, 3], 1).unwrap();
    p[1].retain_grad();
    let loss = p[1].mul_scalar(2.0).unwrap().sum().unwrap();
    let by_grad = wgrad::autograd::grad(std::slice::from_ref(&loss), &p[1..], None, true).unwrap();
    assert_close(
        &by_grad[0].as_ref().unwrap().to_vec().unwrap(),
        &[2.0; 9],
        0.0,
        "autograd::grad of the second piece",
    );
    loss.backward().unwrap();
    assert_close(
        &p[1].grad().unwrap().to_vec().unwrap(),
        &[2.0; 9],
        0.0,
        "retained",
    );
    assert!(
        p[0].grad().is_none(),
        "the first piece did not retain its grad"
    );
}

#[test]
fn split_and_chunk_reject_bad_sizes_naming_the_shape() {
    let x = Tensor::zeros(&[2, 5], device()).unwrap();
    for err in [
        x.split(&[2, 2], 1).unwrap_err(),
        x.split(&[], 1).unwrap_err(),
        x.split(&[5], 2).unwrap_err(),
        x.split(&[usize::MAX, 6], 1).unwrap_err(),
    ] {
        assert!(matches!(err, Error::Shape { op: "split", .. }), "{err}");
        assert!(err.to_string().contains("[2, 5]"), "{err}");
    }
    let err = x.chunk(0, 1).unwrap_err();
    assert!(
        matches!(err, Error::InvalidArgument { op: "chunk", .. }),
        "{err}"
    );
    assert!(matches!(
        x.chunk(2, 3),
        Err(Error::Shape { op: "chunk", .. })
    ));
}

#[test]
fn unbind_gives_each_slice_and_its_grad_lands_in_place() {
    let (x, xv) = random_tensor(&[3, 4], 37);
    let x = x.requires_grad_(true);
    let rows = x.unbind(0).unwrap();
    assert_eq!(rows.len(), 3);
    for (r, row) in rows.iter().enumerate() {
        assert_eq!(row.shape(), &[4]);
        let want: Vec<f64> = xv[r * 4..r * 4 + 4].iter().map(|&v| v as f64).collect();
        assert_close(&row.to_vec().unwrap(), &want, 0.0, "unbind row");
    }
    // Only the last row reaches the loss, scaled by 5.
    rows[2]
        .mul_scalar(5.0)
        .unwrap()
        .sum()
        .unwrap()
        .backward()
        .unwrap();
    let want: Vec<f64> = (0..12).map(|i| if i >= 8 { 5.0 } else { 0.0 }).collect();
    assert_close(
        &x.grad().unwrap().to_vec().unwrap(),
        &want,
        0.0,
        "unbind grad",
    );
    let columns = x.unbind(1).unwrap();
    assert_eq!(columns.len(), 4);
    assert_eq!(columns[0].shape(), &[3]);
    assert!(Tensor::zeros(&[0, 2], device())
        .unwrap()
        .unbind(0)
        .unwrap()
        .is_empty());
    assert!(matches!(
        x.unbind(2),
        Err(Error::Shape { op: "unbind", .. })
    ));
}

#[test]
fn pieces_of_one_split_can_be_the_roots_of_one_backward() {
    let (x, _) = random_tensor(&[2, 5], 38);
    let x = x.requires_grad_(true);
    let p = x.split(&[2, 3], 1).unwrap();
    let (g0, g0v) = random_tensor(&[2, 2], 39);
    let (g1, g1v) = random_tensor(&[2, 3], 40);
    let grads = wgrad::autograd::grad(&p, std::slice::from_ref(&x), Some(&[g0, g1]), true).unwrap();
    let want: Vec<f64> = (0..2)
        .flat_map(|r| {
            let (a, b) = (&g0v[r * 2..r * 2 + 2], &g1v[r * 3..r * 3 + 3]);
            a.iter().chain(b).map(|&v| v as f64).collect::<Vec<_>>()
        })
        .collect();
    let got = grads[0].as_ref().unwrap().to_vec().unwrap();
    assert_close(&got, &want, 0.0, "grads of both pieces as roots");
    // The graph was retained: a second backward through the same split adds up (S-8).
    let loss = p[1].sum().unwrap();
    for _ in 0..2 {
        loss.backward_with(wgrad::BackwardOptions {
            retain_graph: true,
            ..Default::default()
        })
        .unwrap();
    }
    let want: Vec<f64> = (0..10)
        .map(|i| if i % 5 >= 2 { 2.0 } else { 0.0 })
        .collect();
    assert_close(
        &x.grad().unwrap().to_vec().unwrap(),
        &want,
        0.0,
        "two backwards",
    );
}
