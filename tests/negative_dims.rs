//! Every op that takes a dim takes a negative one, counted from the back as PyTorch counts
//! it, and gives what the dim counted from the front gives; one past the front is an error
//! naming the op. A 0-d tensor takes dim 0 or -1 as a dim of size 1, as torch does.

mod common;
use common::*;
use wgrad::{Error, Tensor};

/// Asserts two results hold the same values and shape.
fn same(a: wgrad::Result<Tensor>, b: wgrad::Result<Tensor>, what: &str) {
    let (a, b) = (a.unwrap(), b.unwrap());
    assert_eq!(a.shape(), b.shape(), "{what}");
    match a.dtype() {
        wgrad::DType::U32 => assert_eq!(a.to_vec_u32().unwrap(), b.to_vec_u32().unwrap(), "{what}"),
        _ => assert_eq!(a.to_vec().unwrap(), b.to_vec().unwrap(), "{what}"),
    }
}

#[test]
fn reductions_and_row_ops_count_negative_dims_from_the_back() {
    let (x, _) = random_tensor(&[2, 3, 4], 1);
    same(x.softmax(-1), x.softmax(2), "softmax");
    same(x.log_softmax(-2), x.log_softmax(1), "log_softmax");
    same(
        x.sum_dims(&[-1, -3], true),
        x.sum_dims(&[2, 0], true),
        "sum_dims",
    );
    same(
        x.mean_dims(&[-2], false),
        x.mean_dims(&[1], false),
        "mean_dims",
    );
    same(
        x.max_dims(&[-1], false),
        x.max_dims(&[2], false),
        "max_dims",
    );
    same(
        x.min_dims(&[-1], false),
        x.min_dims(&[2], false),
        "min_dims",
    );
    same(
        x.logsumexp(&[-1], false),
        x.logsumexp(&[2], false),
        "logsumexp",
    );
    same(
        x.var_dims(&[-1], 1, false),
        x.var_dims(&[2], 1, false),
        "var_dims",
    );
    same(
        x.std_dims(&[-1], 0, true),
        x.std_dims(&[2], 0, true),
        "std_dims",
    );
    same(x.cumsum(-1), x.cumsum(2), "cumsum");
    same(x.argmax(-1, false), x.argmax(2, false), "argmax");
    same(x.argmin(-2, false), x.argmin(1, false), "argmin");
    same(
        x.sort(-1, true).map(|s| s.0),
        x.sort(2, true).map(|s| s.0),
        "sort",
    );
    same(
        x.topk(2, -1).map(|s| s.1),
        x.topk(2, 2).map(|s| s.1),
        "topk",
    );
    // usize, i64 and isize variables are dims too.
    let (d_usize, d_i64, d_isize): (usize, i64, isize) = (2, -1, -1);
    same(x.softmax(d_i64), x.softmax(d_usize), "i64 dim");
    same(x.softmax(d_isize), x.softmax(d_usize), "isize dim");
}

#[test]
fn shape_ops_count_negative_dims_from_the_back() {
    let (x, _) = random_tensor(&[2, 3, 4], 2);
    same(x.transpose(-2, -1), x.transpose(1, 2), "transpose");
    same(x.permute(&[-1, 0, -2]), x.permute(&[2, 0, 1]), "permute");
    same(x.narrow(-1, 1, 2), x.narrow(2, 1, 2), "narrow");
    same(x.flip(&[-1]), x.flip(&[2]), "flip");
    same(x.flatten(-2), x.flatten(1), "flatten");
    assert_eq!(x.unsqueeze(-1).unwrap().shape(), &[2, 3, 4, 1]);
    assert_eq!(x.unsqueeze(-4).unwrap().shape(), &[1, 2, 3, 4]);
    same(x.unsqueeze(-1), x.unsqueeze(3), "unsqueeze");
    same(
        x.unsqueeze(-1).and_then(|u| u.squeeze(-1)),
        Ok(x.clone()),
        "squeeze",
    );
    let parts = x.split(&[1, 3], -1).unwrap();
    assert_eq!(parts[1].shape(), &[2, 3, 3]);
    assert_eq!(x.chunk(2, -1).unwrap()[0].shape(), &[2, 3, 2]);
    assert_eq!(x.unbind(-1).unwrap().len(), 4);
    same(
        Tensor::cat(&[x.clone(), x.clone()], -1),
        Tensor::cat(&[x.clone(), x.clone()], 2),
        "cat",
    );
    same(
        Tensor::stack(&[x.clone(), x.clone()], -1),
        Tensor::stack(&[x.clone(), x.clone()], 3),
        "stack",
    );
}

#[test]
fn indexing_ops_count_negative_dims_from_the_back() {
    let dev = device();
    let (x, _) = random_tensor(&[2, 5], 3);
    let idx = Tensor::from_vec_u32(vec![4, 0, 2, 2, 1, 3], &[2, 3], dev).unwrap();
    same(x.gather(-1, &idx), x.gather(1, &idx), "gather");
    let rows = Tensor::from_labels(vec![3, 1], dev).unwrap();
    same(
        x.index_select(-1, &rows),
        x.index_select(1, &rows),
        "index_select",
    );
    let (src, _) = random_tensor(&[2, 3], 4);
    same(
        x.scatter_add(-1, &idx, &src),
        x.scatter_add(1, &idx, &src),
        "scatter_add",
    );
    let (cols, _) = random_tensor(&[2, 2], 5);
    same(
        x.index_add(-1, &rows, &cols),
        x.index_add(1, &rows, &cols),
        "index_add",
    );
}

#[test]
fn a_negative_dim_past_the_front_is_an_error_naming_the_op() {
    let (x, _) = random_tensor(&[2, 3], 6);
    for (result, op) in [
        (x.softmax(-3), "softmax"),
        (x.sum_dims(&[-3], false), "sum"),
        (x.transpose(0, -3), "transpose"),
        (x.unsqueeze(-4), "unsqueeze"),
        (Tensor::cat(std::slice::from_ref(&x), -3), "cat"),
    ] {
        match result {
            Err(e @ Error::Shape { .. }) => {
                let msg = e.to_string();
                assert!(msg.starts_with(op) && msg.contains("-"), "{msg}");
            }
            other => panic!(
                "{op}: expected a shape error, got {:?}",
                other.map(|t| t.shape().to_vec())
            ),
        }
    }
}

#[test]
fn ops_along_a_dim_take_dim_0_or_minus_1_of_a_0_d_tensor_as_a_dim_of_one() {
    let dev = device();
    let s = Tensor::full(&[], 2.5, dev).unwrap().requires_grad_(true);
    type Along = fn(&Tensor) -> wgrad::Result<Tensor>;
    // (op, its value on 2.5, its grad there)
    let ops: [(&str, Along, f32, f32); 11] = [
        ("sum", |t| t.sum_dims(&[-1], false), 2.5, 1.0),
        ("mean", |t| t.mean_dims(&[0], true), 2.5, 1.0),
        ("max", |t| t.max_dims(&[-1], false), 2.5, 1.0),
        ("min", |t| t.min_dims(&[0], false), 2.5, 1.0),
        ("logsumexp", |t| t.logsumexp(&[-1], false), 2.5, 1.0),
        ("softmax", |t| t.softmax(-1), 1.0, 0.0),
        ("log_softmax", |t| t.log_softmax(0), 0.0, 0.0),
        ("cumsum", |t| t.cumsum(-1), 2.5, 1.0),
        ("flip", |t| t.flip(&[-1]), 2.5, 1.0),
        ("sort", |t| Ok(t.sort(-1, true)?.0), 2.5, 1.0),
        ("topk", |t| Ok(t.topk(1, 0)?.0), 2.5, 1.0),
    ];
    for (name, op, value, grad) in ops {
        s.zero_grad();
        let out = op(&s).unwrap();
        assert_eq!(out.shape(), &[] as &[usize], "{name}");
        assert_eq!(out.to_vec().unwrap(), vec![value], "{name}");
        out.backward().unwrap();
        assert_eq!(
            s.grad().unwrap().to_vec().unwrap(),
            vec![grad],
            "{name} grad"
        );
    }
    for index in [s.argmax(-1, false).unwrap(), s.argmin(0, true).unwrap()] {
        assert_eq!(index.shape(), &[] as &[usize]);
        assert_eq!(index.to_vec_u32().unwrap(), vec![0]);
    }
    // A 0-d tensor has no dim 1 nor -2.
    assert!(s.sum_dims(&[1], false).is_err());
    assert!(s.softmax(-2).is_err());
}
