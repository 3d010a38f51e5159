//! Regression tests for what fuzzing and a new user's tries found: empty dims, NaN, u32
//! tensors that require grad, huge views, 1-D operands in batched matmul, repeated dims.

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
