//! Every differentiable op's backward against central finite differences (S-13), on random
//! inputs including broadcast shapes, views and batched matmul.

mod common;
use common::*;
use wgrad::{nn, Tensor};

fn input(shape: &[usize], seed: u64) -> (Vec<usize>, Vec<f32>) {
    let n = shape.iter().product();
    (shape.to_vec(), values_in(n, -1.0, 1.0, seed))
}

fn positive(shape: &[usize], seed: u64) -> (Vec<usize>, Vec<f32>) {
    let n = shape.iter().product();
    (shape.to_vec(), values_in(n, 0.5, 2.0, seed))
}

/// Values whose magnitudes stay away from 0 (for relu's kink) and from each other (for max).
fn spread(shape: &[usize], seed: u64) -> (Vec<usize>, Vec<f32>) {
    let n: usize = shape.iter().product();
    let mut v: Vec<f32> = (0..n)
        .map(|i| (i as f32 + 1.0) * 0.37 * if i % 2 == 0 { 1.0 } else { -1.0 })
        .collect();
    // a deterministic shuffle
    let order = random_vec(n, seed);
    let mut idx: Vec<usize> = (0..n).collect();
    idx.sort_by(|&a, &b| order[a].partial_cmp(&order[b]).unwrap());
    v = idx.iter().map(|&i| v[i]).collect();
    (shape.to_vec(), v)
}

#[test]
fn unary_ops() {
    let x = || vec![input(&[2, 3], 1)];
    gradcheck("neg", &x(), |t| t[0].neg());
    gradcheck("exp", &x(), |t| t[0].exp());
    gradcheck("tanh", &x(), |t| t[0].tanh());
    gradcheck("sigmoid", &x(), |t| t[0].sigmoid());
    gradcheck("gelu", &[input(&[7], 2)], |t| t[0].mul_scalar(2.0)?.gelu());
    gradcheck("gelu_tanh", &[input(&[7], 2)], |t| {
        t[0].mul_scalar(2.0)?.gelu_tanh()
    });
    gradcheck("relu", &[spread(&[6], 3)], |t| t[0].relu());
    gradcheck("log", &[positive(&[5], 4)], |t| t[0].log());
    gradcheck("sqrt", &[positive(&[5], 5)], |t| t[0].sqrt());
    gradcheck("powf 3", &x(), |t| t[0].powf(3.0));
    gradcheck("powf 2.5", &[positive(&[4], 6)], |t| t[0].powf(2.5));
    gradcheck("powf 0", &x(), |t| t[0].powf(0.0));
    gradcheck("abs", &[spread(&[6], 8)], |t| t[0].abs());
    gradcheck("erf", &x(), |t| t[0].erf());
    // spread values are multiples of 0.37, away from the bounds
    gradcheck("clamp", &[spread(&[8], 9)], |t| t[0].clamp(-1.0, 1.5));
    gradcheck("sin", &x(), |t| t[0].mul_scalar(3.0)?.sin());
    gradcheck("cos", &x(), |t| t[0].mul_scalar(3.0)?.cos());
    gradcheck("rsqrt", &[positive(&[5], 10)], |t| t[0].rsqrt());
    gradcheck("silu", &[input(&[7], 11)], |t| t[0].mul_scalar(4.0)?.silu());
    gradcheck("softplus", &[input(&[7], 12)], |t| {
        t[0].mul_scalar(4.0)?.softplus()
    });
    gradcheck("softplus past its threshold", &[positive(&[3], 13)], |t| {
        t[0].add_scalar(20.0)?.softplus()
    });
    gradcheck("leaky_relu", &[spread(&[6], 14)], |t| t[0].leaky_relu(0.2));
}

#[test]
fn new_elementwise_ops_on_batches_of_one_and_three_and_transposed_views() {
    for batch in [1usize, 3] {
        let x = || vec![input(&[batch, 5], 60 + batch as u64)];
        // `t()` makes a transposed, non-contiguous input.
        gradcheck("sin of a view", &x(), |t| t[0].t()?.mul_scalar(2.0)?.sin());
        gradcheck("silu of a view", &x(), |t| {
            t[0].t()?.mul_scalar(3.0)?.silu()
        });
        gradcheck("softplus of a view", &x(), |t| t[0].t()?.softplus());
        gradcheck("leaky_relu of a view", &[spread(&[batch, 5], 61)], |t| {
            t[0].t()?.leaky_relu(0.05)
        });
        let pair = || vec![input(&[batch, 5], 62), input(&[5], 63)];
        gradcheck(
            "minimum broadcast",
            &[spread(&[batch, 5], 64), spread(&[5], 65)],
            |t| t[0].minimum(&t[1]),
        );
        gradcheck(
            "pow base and exponent",
            &[positive(&[batch, 5], 66), input(&[5], 67)],
            |t| t[0].pow(&t[1].mul_scalar(2.0)?),
        );
        gradcheck(
            "pow of a view",
            &[positive(&[5, batch], 68), input(&[batch, 5], 69)],
            |t| t[0].t()?.pow(&t[1]),
        );
        gradcheck("where_cond", &pair(), |t| {
            let mask = t[1].gt_scalar(0.0)?;
            mask.where_cond(&t[0].t()?.t()?, &t[1].mul_scalar(3.0)?)
        });
    }
}

#[test]
fn scalar_ops() {
    let x = || vec![input(&[4], 7)];
    gradcheck("add_scalar", &x(), |t| t[0].add_scalar(1.5));
    gradcheck("sub_scalar", &x(), |t| t[0].sub_scalar(1.5));
    gradcheck("mul_scalar", &x(), |t| t[0].mul_scalar(-2.5));
    gradcheck("div_scalar", &x(), |t| t[0].div_scalar(4.0));
}

#[test]
fn binary_ops_with_broadcasting() {
    for (sa, sb) in [
        (vec![2, 3], vec![2, 3]),
        (vec![2, 3], vec![3]),
        (vec![3, 1], vec![1, 4]),
        (vec![], vec![2, 2]),
    ] {
        let pair = || vec![input(&sa, 10), input(&sb, 11)];
        gradcheck(&format!("add {sa:?} {sb:?}"), &pair(), |t| t[0].add(&t[1]));
        gradcheck(&format!("sub {sa:?} {sb:?}"), &pair(), |t| t[0].sub(&t[1]));
        gradcheck(&format!("mul {sa:?} {sb:?}"), &pair(), |t| t[0].mul(&t[1]));
        gradcheck(
            &format!("div {sa:?} {sb:?}"),
            &[input(&sa, 12), positive(&sb, 13)],
            |t| t[0].div(&t[1]),
        );
        gradcheck(
            &format!("maximum {sa:?} {sb:?}"),
            &[spread(&sa, 14), input(&sb, 15)],
            |t| t[0].maximum(&t[1]),
        );
    }
}

#[test]
fn matmul_plain_batched_broadcast_and_transposed() {
    gradcheck(
        "matmul 3x4 4x2",
        &[input(&[3, 4], 20), input(&[4, 2], 21)],
        |t| t[0].matmul(&t[1]),
    );
    gradcheck(
        "matmul batched",
        &[input(&[2, 3, 4], 22), input(&[2, 4, 2], 23)],
        |t| t[0].matmul(&t[1]),
    );
    gradcheck(
        "matmul broadcast batch",
        &[input(&[2, 2, 3], 24), input(&[3, 2], 25)],
        |t| t[0].matmul(&t[1]),
    );
    gradcheck(
        "matmul A B^T view",
        &[input(&[3, 4], 26), input(&[2, 4], 27)],
        |t| t[0].matmul(&t[1].t()?),
    );
    gradcheck(
        "matmul A^T view",
        &[input(&[4, 3], 28), input(&[4, 2], 29)],
        |t| t[0].t()?.matmul(&t[1]),
    );
    gradcheck(
        "vector @ matrix",
        &[input(&[4], 30), input(&[4, 3], 31)],
        |t| t[0].matmul(&t[1]),
    );
    gradcheck(
        "matrix @ vector",
        &[input(&[3, 4], 32), input(&[4], 33)],
        |t| t[0].matmul(&t[1]),
    );
    gradcheck("dot", &[input(&[5], 34), input(&[5], 35)], |t| {
        t[0].matmul(&t[1])
    });
}

#[test]
fn reductions() {
    let x = || vec![input(&[2, 3, 2], 40)];
    gradcheck("sum", &x(), |t| t[0].sum());
    gradcheck("sum dims keepdim", &x(), |t| t[0].sum_dims(&[0, 2], true));
    gradcheck("sum dim", &x(), |t| t[0].sum_dims(&[1], false));
    gradcheck("mean", &x(), |t| t[0].mean());
    gradcheck("mean dims", &x(), |t| t[0].mean_dims(&[2], false));
    gradcheck("max", &[spread(&[2, 3, 2], 41)], |t| t[0].max());
    gradcheck("max dims", &[spread(&[2, 3, 2], 42)], |t| {
        t[0].max_dims(&[1], true)
    });
    gradcheck("sum of a transposed view", &x(), |t| {
        t[0].transpose(0, 2)?.sum_dims(&[0], false)
    });
}

#[test]
fn max_splits_its_grad_evenly_among_ties() {
    let x = Tensor::from_vec(vec![1.0, 3.0, 3.0, 2.0], &[4], device())
        .unwrap()
        .requires_grad_(true);
    x.max().unwrap().backward().unwrap();
    assert_eq!(
        x.grad().unwrap().to_vec().unwrap(),
        vec![0.0, 0.5, 0.5, 0.0]
    );
    let y = Tensor::from_vec(vec![2.0, 2.0], &[2], device())
        .unwrap()
        .requires_grad_(true);
    let z = Tensor::from_vec(vec![2.0, 1.0], &[2], device())
        .unwrap()
        .requires_grad_(true);
    y.maximum(&z).unwrap().sum().unwrap().backward().unwrap();
    assert_eq!(y.grad().unwrap().to_vec().unwrap(), vec![0.5, 1.0]);
    assert_eq!(z.grad().unwrap().to_vec().unwrap(), vec![0.5, 0.0]);
}

#[test]
fn softmax_log_softmax_and_cross_entropy() {
    gradcheck("softmax dim 1", &[input(&[3, 4], 50)], |t| t[0].softmax(1));
    gradcheck("softmax dim 0", &[input(&[3, 4], 51)], |t| t[0].softmax(0));
    gradcheck("log_softmax dim 1", &[input(&[3, 4], 52)], |t| {
        t[0].log_softmax(1)
    });
    gradcheck("log_softmax dim 0", &[input(&[3, 4], 53)], |t| {
        t[0].log_softmax(0)
    });
    let labels = Tensor::from_labels(vec![2, 0, 3], device()).unwrap();
    gradcheck("cross_entropy", &[input(&[3, 4], 54)], |t| {
        nn::loss::cross_entropy(&t[0], &labels)
    });
    // Enough rows that CPU adapters run one invocation per row.
    let many: Vec<u32> = (0..70).map(|i| i % 5).collect();
    let many = Tensor::from_labels(many, device()).unwrap();
    gradcheck("cross_entropy 70 rows", &[input(&[70, 5], 55)], |t| {
        nn::loss::cross_entropy(&t[0], &many)
    });
}

#[test]
fn softmax_backward_on_many_rows() {
    // 70 rows: the one-invocation-per-row kernels on CPU adapters. Checked against the
    // backward of the same function written with elementwise ops.
    let (x, _) = random_tensor(&[70, 6], 56);
    let g = random_tensor(&[70, 6], 57).0;
    for log in [false, true] {
        let a = x.detach().deep_clone().unwrap().requires_grad_(true);
        let fused = if log { a.log_softmax(1) } else { a.softmax(1) }.unwrap();
        fused.mul(&g).unwrap().sum().unwrap().backward().unwrap();
        let b = x.detach().deep_clone().unwrap().requires_grad_(true);
        let shifted = b.sub(&b.max_dims(&[1], true).unwrap().detach()).unwrap();
        let lse = shifted
            .exp()
            .unwrap()
            .sum_dims(&[1], true)
            .unwrap()
            .log()
            .unwrap();
        let log_p = shifted.sub(&lse).unwrap();
        let composed = if log { log_p } else { log_p.exp().unwrap() };
        composed.mul(&g).unwrap().sum().unwrap().backward().unwrap();
        let want: Vec<f64> = b
            .grad()
            .unwrap()
            .to_vec()
            .unwrap()
            .iter()
            .map(|&v| v as f64)
            .collect();
        assert_close(
            &a.grad().unwrap().to_vec().unwrap(),
            &want,
            1e-4,
            &format!("log: {log}"),
        );
    }
}

#[test]
fn views_and_copies() {
    let x = || vec![input(&[2, 3, 4], 60)];
    gradcheck("transpose", &x(), |t| t[0].transpose(0, 2));
    gradcheck("permute", &x(), |t| t[0].permute(&[1, 2, 0]));
    gradcheck("narrow", &x(), |t| t[0].narrow(2, 1, 2));
    gradcheck("reshape", &x(), |t| t[0].reshape(&[6, 4]));
    gradcheck("reshape of a view", &x(), |t| {
        t[0].transpose(0, 1)?.reshape(&[24])
    });
    gradcheck("unsqueeze squeeze", &x(), |t| {
        t[0].unsqueeze(1)?.mul_scalar(2.0)?.squeeze(1)
    });
    gradcheck("contiguous", &x(), |t| {
        t[0].permute(&[2, 0, 1])?.contiguous()
    });
    gradcheck("deep_clone", &x(), |t| t[0].deep_clone());
    gradcheck("t", &[input(&[3, 2], 61)], |t| t[0].t());
    gradcheck("expand", &[input(&[3, 1], 62)], |t| t[0].expand(&[2, 3, 4]));
    gradcheck("cat", &[input(&[2, 3], 63), input(&[2, 2], 64)], |t| {
        Tensor::cat(&[t[0].clone(), t[1].clone()], 1)
    });
}

#[test]
fn index_select_and_gather_add_repeated_indices() {
    let idx = Tensor::from_vec_u32(vec![2, 0, 2], &[3], device()).unwrap();
    gradcheck("index_select dim 1", &[input(&[2, 3, 2], 70)], |t| {
        t[0].index_select(1, &idx)
    });
    gradcheck("index_select dim 0", &[input(&[3, 2], 71)], |t| {
        t[0].index_select(0, &idx)
    });
    let gidx = Tensor::from_vec_u32(vec![1, 1, 0, 2, 2, 0], &[2, 3], device()).unwrap();
    gradcheck("gather dim 1", &[input(&[2, 4], 72)], |t| {
        t[0].gather(1, &gidx)
    });
    let gidx0 = Tensor::from_vec_u32(vec![1, 0, 1], &[1, 3], device()).unwrap();
    gradcheck("gather dim 0", &[input(&[2, 4], 73)], |t| {
        t[0].gather(0, &gidx0)
    });
}

#[test]
fn a_small_mlp_end_to_end() {
    let labels = Tensor::from_labels(vec![1, 0, 2, 1], device()).unwrap();
    gradcheck(
        "mlp",
        &[
            input(&[4, 3], 80),
            input(&[5, 3], 81),
            input(&[5], 82),
            input(&[3, 5], 83),
        ],
        |t| {
            let h = t[0].matmul(&t[1].t()?)?.add(&t[2])?.tanh()?;
            nn::loss::cross_entropy(&h.matmul(&t[3].t()?)?, &labels)
        },
    );
}
