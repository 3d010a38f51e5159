//! Creation, readback, views and layout: shapes, identity, aliasing and bad input.

mod common;
use common::*;
use wgrad::{DType, Error, Tensor};

#[test]
fn from_vec_round_trips_values_and_shape() {
    let t = Tensor::from_vec(vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0], &[2, 3], device()).unwrap();
    assert_eq!(t.shape(), &[2, 3]);
    assert_eq!(t.dtype(), DType::F32);
    assert_eq!(t.to_vec().unwrap(), vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
}

#[test]
fn from_vec_with_wrong_length_names_op_and_shape() {
    let err = Tensor::from_vec(vec![1.0; 5], &[2, 3], device()).unwrap_err();
    assert!(
        matches!(err, Error::InvalidArgument { op: "from_vec", .. }),
        "{err:?}"
    );
    assert!(
        err.to_string().contains("5 values") && err.to_string().contains("[2, 3]"),
        "{err}"
    );
}

#[test]
fn fills_and_arange_hold_their_values() {
    let dev = device();
    assert_eq!(
        Tensor::zeros(&[3], dev).unwrap().to_vec().unwrap(),
        vec![0.0; 3]
    );
    assert_eq!(
        Tensor::ones(&[2, 2], dev).unwrap().to_vec().unwrap(),
        vec![1.0; 4]
    );
    assert_eq!(
        Tensor::full(&[2], -2.5, dev).unwrap().to_vec().unwrap(),
        vec![-2.5; 2]
    );
    let n = 70001;
    let a = Tensor::arange(n, dev).unwrap().to_vec().unwrap();
    assert!(a.iter().enumerate().all(|(i, &v)| v == i as f32));
}

#[test]
fn rand_and_randn_are_reproducible_from_the_seed() {
    let dev = device();
    let a = Tensor::randn(&[1000], 7, dev).unwrap().to_vec().unwrap();
    let b = Tensor::randn(&[1000], 7, dev).unwrap().to_vec().unwrap();
    let c = Tensor::randn(&[1000], 8, dev).unwrap().to_vec().unwrap();
    assert_eq!(a, b);
    assert_ne!(a, c);
    let mean = a.iter().map(|&x| x as f64).sum::<f64>() / 1000.0;
    let var = a.iter().map(|&x| (x as f64 - mean).powi(2)).sum::<f64>() / 1000.0;
    assert!(
        mean.abs() < 0.1 && (var - 1.0).abs() < 0.15,
        "mean {mean} var {var}"
    );
    let u = Tensor::rand(&[1000], 7, dev).unwrap().to_vec().unwrap();
    assert!(u.iter().all(|&x| (0.0..1.0).contains(&x)));
}

#[test]
fn item_reads_one_element_and_rejects_more() {
    let dev = device();
    assert_eq!(Tensor::full(&[], 3.5, dev).unwrap().item().unwrap(), 3.5);
    assert_eq!(
        Tensor::full(&[1, 1], 2.0, dev).unwrap().item().unwrap(),
        2.0
    );
    let err = Tensor::zeros(&[2], dev).unwrap().item().unwrap_err();
    assert!(
        matches!(err, Error::Shape { op: "item", .. }) && err.to_string().contains("[2]"),
        "{err}"
    );
}

#[test]
fn labels_are_u32_and_read_back_as_u32() {
    let l = Tensor::from_labels(vec![3, 0, 7], device()).unwrap();
    assert_eq!(l.dtype(), DType::U32);
    assert_eq!(l.to_vec_u32().unwrap(), vec![3, 0, 7]);
    assert!(matches!(
        l.to_vec().unwrap_err(),
        Error::DType { op: "to_vec", .. }
    ));
}

#[test]
fn ranks_zero_to_six_and_empty_tensors_work() {
    let dev = device();
    for rank in 0..=6 {
        let shape: Vec<usize> = (0..rank).map(|d| d % 3 + 1).collect();
        let (t, data) = random_tensor(&shape, rank as u64);
        assert_eq!(t.shape(), shape.as_slice());
        let doubled = t.mul_scalar(2.0).unwrap();
        let want: Vec<f64> = data.iter().map(|&x| 2.0 * x as f64).collect();
        assert_close(
            &doubled.to_vec().unwrap(),
            &want,
            0.0,
            &format!("rank {rank}"),
        );
    }
    let empty = Tensor::zeros(&[0, 4], dev).unwrap();
    assert_eq!(empty.numel(), 0);
    assert_eq!(empty.exp().unwrap().to_vec().unwrap(), Vec::<f32>::new());
    assert_eq!(
        empty.sum_dims(&[0], false).unwrap().to_vec().unwrap(),
        vec![0.0; 4]
    );
    assert_eq!(
        Tensor::from_vec(vec![], &[3, 0], dev).unwrap().shape(),
        &[3, 0]
    );
}

#[test]
fn transpose_permute_narrow_expand_are_views_of_the_same_storage() {
    let (t, data) = random_tensor(&[2, 3, 4], 5);
    let id = t.storage_id();
    let tr = t.transpose(0, 2).unwrap();
    let pe = t.permute(&[1, 2, 0]).unwrap();
    let na = t.narrow(2, 1, 2).unwrap();
    let ex = t.narrow(0, 0, 1).unwrap().expand(&[5, 3, 4]).unwrap();
    for v in [&tr, &pe, &na, &ex] {
        assert_eq!(v.storage_id(), id);
        assert!(!Tensor::same(v, &t));
    }
    assert_eq!(tr.shape(), &[4, 3, 2]);
    assert_eq!(pe.shape(), &[3, 4, 2]);
    let at = |i: usize, j: usize, k: usize| data[i * 12 + j * 4 + k];
    let got = tr.to_vec().unwrap();
    assert_eq!(got[3 * 6 + 2 * 2 + 1], at(1, 2, 3));
    let got = pe.to_vec().unwrap();
    assert_eq!(got[2 * 8 + 3 * 2 + 1], at(1, 2, 3));
    let got = na.to_vec().unwrap();
    assert_eq!(got.len(), 12);
    assert_eq!(got[5 * 2 + 1], at(1, 2, 2));
    let got = ex.to_vec().unwrap();
    assert_eq!(got.len(), 60);
    assert_eq!(got[4 * 12 + 2 * 4 + 3], at(0, 2, 3));
}

#[test]
fn reshape_is_a_view_when_contiguous_and_a_copy_otherwise() {
    let (t, data) = random_tensor(&[4, 6], 6);
    let r = t.reshape(&[2, 12]).unwrap();
    assert_eq!(r.storage_id(), t.storage_id());
    assert_eq!(r.to_vec().unwrap(), data);
    let tt = t.t().unwrap();
    let c = tt.reshape(&[24]).unwrap();
    assert_ne!(c.storage_id(), t.storage_id());
    let want: Vec<f32> = (0..24).map(|i| data[(i % 4) * 6 + i / 4]).collect();
    assert_eq!(c.to_vec().unwrap(), want);
    let err = t.reshape(&[5, 5]).unwrap_err();
    assert!(
        matches!(err, Error::Shape { op: "reshape", .. }) && err.to_string().contains("[4, 6]"),
        "{err}"
    );
}

/// Host copy of `data` (row-major `shape`) permuted by `order`.
fn permuted(data: &[f32], shape: &[usize], order: &[usize]) -> Vec<f32> {
    let strides: Vec<usize> = (0..shape.len())
        .map(|d| shape[d + 1..].iter().product())
        .collect();
    let out_shape: Vec<usize> = order.iter().map(|&d| shape[d]).collect();
    let n: usize = shape.iter().product();
    (0..n)
        .map(|mut i| {
            let mut at = 0;
            for k in (0..order.len()).rev() {
                at += (i % out_shape[k]) * strides[order[k]];
                i /= out_shape[k];
            }
            data[at]
        })
        .collect()
}

#[test]
fn contiguous_copies_of_permuted_views_hold_the_permuted_values() {
    // Heads of 32 and 4 (the copy moves four-element groups), of 3 and 1 (one element at a
    // time), rows that wrap several times per step (inner dims under 8), and one past the
    // 64 items an invocation copies.
    let cases: [(&[usize], &[usize]); 6] = [
        (&[12, 64, 4, 32], &[0, 2, 1, 3]),
        (&[2, 5, 3, 4], &[0, 2, 1, 3]),
        (&[2, 5, 3, 3], &[0, 2, 1, 3]),
        (&[3, 7, 1], &[1, 0, 2]),
        (&[2, 3, 2, 5, 2], &[4, 2, 0, 3, 1]),
        (&[300, 257], &[1, 0]),
    ];
    for (seed, (shape, order)) in cases.into_iter().enumerate() {
        let (t, data) = random_tensor(shape, seed as u64);
        let got = t.permute(order).unwrap().contiguous().unwrap();
        assert_eq!(
            got.to_vec().unwrap(),
            permuted(&data, shape, order),
            "{shape:?} permuted by {order:?}"
        );
    }
}

#[test]
fn contiguous_copies_of_slices_at_any_offset_hold_the_slice() {
    let (t, data) = random_tensor(&[6, 40], 9);
    // Columns from 8 (groups of four line up) and from 2 or 3 (they do not), 4 or 5 wide.
    for (start, len) in [(8, 16), (2, 16), (3, 5), (0, 4), (36, 4)] {
        let got = t.narrow(1, start, len).unwrap().contiguous().unwrap();
        let want: Vec<f32> = (0..6)
            .flat_map(|r| data[r * 40 + start..r * 40 + start + len].to_vec())
            .collect();
        assert_eq!(got.to_vec().unwrap(), want, "columns {start}..+{len}");
    }
}

#[test]
fn fills_of_every_length_mod_four_fill_every_element() {
    let dev = device();
    for n in [1, 2, 3, 5, 16_383, 16_385, 65_539] {
        let got = Tensor::full(&[n], 1.5, dev).unwrap().to_vec().unwrap();
        assert!(got.iter().all(|&v| v == 1.5), "full of {n}");
        let got = Tensor::arange(n, dev).unwrap().to_vec().unwrap();
        assert!(
            got.iter().enumerate().all(|(i, &v)| v == i as f32),
            "arange of {n}"
        );
    }
}

#[test]
fn contiguous_returns_the_same_tensor_when_already_contiguous() {
    let (t, _) = random_tensor(&[3, 3], 1);
    assert!(Tensor::same(&t.contiguous().unwrap(), &t));
    let c = t.t().unwrap().contiguous().unwrap();
    assert!(c.is_contiguous());
    assert_ne!(c.storage_id(), t.storage_id());
}

#[test]
fn views_with_bad_dims_or_ranges_are_shape_errors() {
    let t = Tensor::zeros(&[2, 3], device()).unwrap();
    assert!(matches!(
        t.transpose(0, 2).unwrap_err(),
        Error::Shape {
            op: "transpose",
            ..
        }
    ));
    assert!(matches!(
        t.permute(&[0, 0]).unwrap_err(),
        Error::Shape { op: "permute", .. }
    ));
    assert!(matches!(
        t.narrow(1, 2, 2).unwrap_err(),
        Error::Shape { op: "narrow", .. }
    ));
    assert!(matches!(
        t.expand(&[4, 3]).unwrap_err(),
        Error::Shape { op: "expand", .. }
    ));
    assert!(matches!(
        t.squeeze(1).unwrap_err(),
        Error::Shape { op: "squeeze", .. }
    ));
    let t3 = Tensor::zeros(&[2, 3, 4], device()).unwrap();
    assert!(matches!(t3.t().unwrap_err(), Error::Shape { op: "t", .. }));
}

#[test]
fn tensor_larger_than_the_largest_buffer_is_a_too_large_error() {
    let dev = device();
    let limit = dev.max_tensor_bytes();
    let elements = (limit / 4 + 1) as usize;
    let err = Tensor::zeros(&[elements], dev).unwrap_err();
    match &err {
        Error::TooLarge {
            op: "zeros",
            bytes,
            limit: l,
        } => {
            assert_eq!(*bytes, elements as u64 * 4);
            assert_eq!(*l, limit);
        }
        other => panic!("expected TooLarge, got {other:?}"),
    }
    assert!(err.to_string().contains("zeros"), "{err}");
}

#[test]
fn cat_joins_along_a_dim_and_checks_the_others() {
    let (a, da) = random_tensor(&[2, 3], 1);
    let (b, db) = random_tensor(&[2, 5], 2);
    let c = Tensor::cat(&[a.clone(), b.clone()], 1).unwrap();
    assert_eq!(c.shape(), &[2, 8]);
    let got = c.to_vec().unwrap();
    for i in 0..2 {
        assert_eq!(&got[i * 8..i * 8 + 3], &da[i * 3..i * 3 + 3]);
        assert_eq!(&got[i * 8 + 3..i * 8 + 8], &db[i * 5..i * 5 + 5]);
    }
    let rows = Tensor::cat(&[a.clone(), a.t().unwrap().t().unwrap()], 0).unwrap();
    assert_eq!(rows.to_vec().unwrap(), [da.clone(), da].concat());
    let err = Tensor::cat(&[a, b], 0).unwrap_err();
    assert!(
        matches!(err, Error::Shape { op: "cat", .. }) && err.to_string().contains("[2, 5]"),
        "{err}"
    );
    assert!(matches!(
        Tensor::cat(&[], 0).unwrap_err(),
        Error::InvalidArgument { op: "cat", .. }
    ));
}

#[test]
fn cat_of_labels_keeps_u32() {
    let a = Tensor::from_labels(vec![1, 2], device()).unwrap();
    let b = Tensor::from_labels(vec![9], device()).unwrap();
    assert_eq!(
        Tensor::cat(&[a, b], 0).unwrap().to_vec_u32().unwrap(),
        vec![1, 2, 9]
    );
}

#[test]
fn deep_clone_copies_values_into_storage_that_aliases_nothing() {
    let (t, data) = random_tensor(&[3, 5], 4);
    for source in [t.clone(), t.narrow(1, 1, 3).unwrap(), t.t().unwrap()] {
        let c = source.deep_clone().unwrap();
        assert_ne!(c.storage_id(), t.storage_id());
        assert_eq!(c.shape(), source.shape());
        assert_eq!(c.to_vec().unwrap(), source.to_vec().unwrap());
    }
    assert_eq!(t.deep_clone().unwrap().to_vec().unwrap(), data);
}

#[test]
fn copy_writes_in_place_into_every_alias() {
    let (t, _) = random_tensor(&[2, 3], 8);
    let alias = t.t().unwrap();
    let id = t.storage_id();
    t.copy_(
        &Tensor::arange(6, device())
            .unwrap()
            .reshape(&[2, 3])
            .unwrap(),
    )
    .unwrap();
    assert_eq!(t.storage_id(), id);
    assert_eq!(t.to_vec().unwrap(), vec![0.0, 1.0, 2.0, 3.0, 4.0, 5.0]);
    assert_eq!(alias.to_vec().unwrap(), vec![0.0, 3.0, 1.0, 4.0, 2.0, 5.0]);
    alias
        .copy_(&t.t().unwrap().mul_scalar(2.0).unwrap())
        .unwrap();
    assert_eq!(t.to_vec().unwrap(), vec![0.0, 2.0, 4.0, 6.0, 8.0, 10.0]);
}

#[test]
fn copy_checks_shape_and_refuses_leaves_that_require_grad() {
    let t = Tensor::zeros(&[2], device()).unwrap();
    let err = t
        .copy_(&Tensor::zeros(&[3], device()).unwrap())
        .unwrap_err();
    assert!(matches!(err, Error::Shape { op: "copy_", .. }), "{err:?}");
    let p = Tensor::zeros(&[2], device()).unwrap().requires_grad_(true);
    let ones = Tensor::ones(&[2], device()).unwrap();
    assert!(matches!(
        p.copy_(&ones).unwrap_err(),
        Error::InvalidArgument { op: "copy_", .. }
    ));
    wgrad::no_grad(|| p.copy_(&ones)).unwrap();
    assert_eq!(p.to_vec().unwrap(), vec![1.0, 1.0]);
}

/// `Display` prints as PyTorch 2.15 does (the strings are its `str()` of the same tensors).
#[test]
fn display_prints_values_as_pytorch() {
    let dev = device();
    let f = |v: Vec<f32>, s: &[usize]| Tensor::from_vec(v, s, dev).unwrap().to_string();
    assert_eq!(
        f(vec![1.0, 2.5, 3.0, 4.0], &[2, 2]),
        "tensor([[1.0000, 2.5000],\n        [3.0000, 4.0000]])"
    );
    assert_eq!(f(vec![1.0, 2.0, 3.0], &[3]), "tensor([1., 2., 3.])");
    assert_eq!(f(vec![1e-6, 1.0], &[2]), "tensor([1.0000e-06, 1.0000e+00])");
    assert_eq!(f(vec![3.5], &[]), "tensor(3.5000)");
    assert_eq!(f(vec![f32::NAN, 1.25], &[2]), "tensor([   nan, 1.2500])");
    assert_eq!(f(vec![], &[0]), "tensor([])");
    assert_eq!(
        f(vec![0.0; 24], &[2, 3, 4]),
        "tensor([[[0., 0., 0., 0.],\n         [0., 0., 0., 0.],\n         [0., 0., 0., 0.]],\n\n        [[0., 0., 0., 0.],\n         [0., 0., 0., 0.],\n         [0., 0., 0., 0.]]])"
    );
    let long: Vec<f32> = (0..2000).map(|i| i as f32).collect();
    assert_eq!(
        f(long.clone(), &[2000]),
        "tensor([0.0000e+00, 1.0000e+00, 2.0000e+00,  ..., 1.9970e+03, 1.9980e+03,\n        1.9990e+03])"
    );
    assert_eq!(
        f(long, &[40, 50]),
        "tensor([[0.0000e+00, 1.0000e+00, 2.0000e+00,  ..., 4.7000e+01, 4.8000e+01,\n         4.9000e+01],\n        [5.0000e+01, 5.1000e+01, 5.2000e+01,  ..., 9.7000e+01, 9.8000e+01,\n         9.9000e+01],\n        [1.0000e+02, 1.0100e+02, 1.0200e+02,  ..., 1.4700e+02, 1.4800e+02,\n         1.4900e+02],\n        ...,\n        [1.8500e+03, 1.8510e+03, 1.8520e+03,  ..., 1.8970e+03, 1.8980e+03,\n         1.8990e+03],\n        [1.9000e+03, 1.9010e+03, 1.9020e+03,  ..., 1.9470e+03, 1.9480e+03,\n         1.9490e+03],\n        [1.9500e+03, 1.9510e+03, 1.9520e+03,  ..., 1.9970e+03, 1.9980e+03,\n         1.9990e+03]])"
    );
    let labels = Tensor::from_vec_u32(vec![1, 2, 3, 40], &[2, 2], dev).unwrap();
    assert_eq!(
        labels.to_string(),
        "tensor([[ 1,  2],\n        [ 3, 40]], dtype=torch.uint32)"
    );
    let leaf = Tensor::from_vec(vec![1.5, 2.0], &[2], dev)
        .unwrap()
        .requires_grad_(true);
    assert_eq!(
        leaf.to_string(),
        "tensor([1.5000, 2.0000], requires_grad=True)"
    );
}

/// torch's `uniform_(1, 0)` and `normal(0, -1)` are errors; wgrad's drew from a range turned
/// around and a normal with its sign flipped.
#[test]
fn uniform_with_low_above_high_and_normal_with_negative_std_are_errors() {
    let dev = device();
    for (what, got) in [
        ("uniform", Tensor::uniform(&[3], 1.0, 0.0, dev)),
        ("uniform", Tensor::uniform(&[3], 0.0, f32::INFINITY, dev)),
        ("normal", Tensor::normal(&[3], 0.0, -1.0, dev)),
        ("normal", Tensor::normal(&[3], f32::NAN, 1.0, dev)),
    ] {
        match got {
            Err(Error::InvalidArgument { op, .. }) => assert_eq!(op, what),
            other => panic!("{what}: expected an InvalidArgument error, got {other:?}"),
        }
    }
    assert_eq!(
        Tensor::normal(&[2], 3.0, 0.0, dev)
            .unwrap()
            .to_vec()
            .unwrap(),
        vec![3.0, 3.0]
    );
    assert_eq!(
        Tensor::uniform(&[2], 2.0, 2.0, dev)
            .unwrap()
            .to_vec()
            .unwrap(),
        vec![2.0, 2.0]
    );
}
