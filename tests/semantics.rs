//! The gradient semantics of docs/semantics.md, case by case (C-1 to C-18). Each test is
//! named after its case and asserts values, handle identity (`Tensor::same`) and storage
//! identity (`storage_id`) exactly as the case says.

mod common;
use common::*;
use wgrad::capture::Step;
use wgrad::{autograd, no_grad, BackwardOptions, Error, Result, Tensor};

fn leaf(values: &[f32]) -> Tensor {
    Tensor::from_slice(values, &[values.len()], device())
        .unwrap()
        .requires_grad_(true)
}

fn values(t: &Tensor) -> Vec<f32> {
    t.to_vec().unwrap()
}

fn inputs(list: &[&Tensor]) -> BackwardOptions {
    BackwardOptions {
        inputs: Some(list.iter().map(|t| (*t).clone()).collect()),
        ..Default::default()
    }
}

/// Runs `sum(3 x)`'s backward with `inputs=[x]`: x's grad gets 3 per element, added in place
/// into a grad it already has (S-3).
fn backward_of_three_x_into(x: &Tensor) {
    x.mul_scalar(3.0)
        .unwrap()
        .sum()
        .unwrap()
        .backward_with(inputs(&[x]))
        .unwrap();
}

/// Writes `value` into `t`'s own buffer, in place.
fn overwrite(t: &Tensor, value: f32) {
    t.copy_(&Tensor::full(t.shape(), value, device()).unwrap())
        .unwrap();
}

#[test]
fn c01_accumulate_grad_of_none_is_a_copy_that_aliases_nothing() {
    let n = Tensor::from_vec(vec![1.0, 2.0, 3.0], &[3], device()).unwrap();
    let out = autograd::accumulate_grad(None, &n).unwrap();
    assert_eq!(values(&out), vec![1.0, 2.0, 3.0]);
    assert_ne!(out.storage_id(), n.storage_id());
    overwrite(&n, 9.0);
    assert_eq!(values(&n), vec![9.0, 9.0, 9.0]);
    assert_eq!(
        values(&out),
        vec![1.0, 2.0, 3.0],
        "writing into n afterwards does not change out"
    );
}

#[test]
fn c02_accumulate_grad_adds_into_a_fresh_buffer_and_leaves_inputs_alone() {
    let g = Tensor::from_vec(vec![1.0, 1.0, 1.0], &[3], device()).unwrap();
    let n = Tensor::from_vec(vec![2.0, 3.0, 4.0], &[3], device()).unwrap();
    let out = autograd::accumulate_grad(Some(&g), &n).unwrap();
    assert_eq!(values(&out), vec![3.0, 4.0, 5.0]);
    assert_eq!(values(&g), vec![1.0, 1.0, 1.0]);
    assert_ne!(out.storage_id(), g.storage_id());
    assert_ne!(out.storage_id(), n.storage_id());
}

#[test]
fn c02_accumulate_grad_with_mismatched_shapes_is_an_error() {
    let g = Tensor::zeros(&[3], device()).unwrap();
    let n = Tensor::zeros(&[4], device()).unwrap();
    let err = autograd::accumulate_grad(Some(&g), &n).unwrap_err();
    assert!(
        matches!(
            err,
            Error::Shape {
                op: "accumulate_grad",
                ..
            }
        ),
        "{err:?}"
    );
    assert!(
        err.to_string().contains("[3]") && err.to_string().contains("[4]"),
        "{err}"
    );
}

#[test]
fn c03_default_backward_swaps_buffer() {
    let x = leaf(&[1.0, 2.0, 3.0]);
    x.mul_scalar(3.0)
        .unwrap()
        .sum()
        .unwrap()
        .backward()
        .unwrap();
    let g = x.grad().unwrap();
    assert_eq!(values(&g), vec![3.0, 3.0, 3.0]);
    let before = g.storage_id();
    x.mul_scalar(3.0)
        .unwrap()
        .sum()
        .unwrap()
        .backward()
        .unwrap();
    let after = x.grad().unwrap();
    assert_eq!(values(&after), vec![6.0, 6.0, 6.0]);
    assert!(Tensor::same(&after, &g), "the grad keeps its handle");
    assert_eq!(
        values(&g),
        vec![6.0, 6.0, 6.0],
        "a kept handle sees the new values"
    );
    assert_ne!(g.storage_id(), before, "the grad's storage is new");
}

/// Grads of `len` elements in four layouts, each with its values: dense with a length that
/// is a multiple of 4 (read four at a time), dense with an odd length, dense from an odd
/// offset into a larger buffer (both read element by element), and a transposed view
/// (walked through its strides).
fn grads_of_every_layout(len: usize, seed: u64) -> Vec<(&'static str, Tensor, Vec<f32>)> {
    let dense = |n: usize, seed| {
        let v = random_vec(n, seed);
        (Tensor::from_slice(&v, &[n], device()).unwrap(), v)
    };
    let (aligned, av) = dense(len, seed);
    let (odd, ov) = dense(len - 1, seed + 1);
    let (wide, wv) = dense(len + 3, seed + 2);
    let offset = wide.narrow(0, 3, len).unwrap();
    let (rows, cols) = (4, len / 4);
    let (square, sv) = dense(len, seed + 3);
    let transposed = square.reshape(&[rows, cols]).unwrap().t().unwrap();
    let tv = (0..len).map(|i| sv[(i % rows) * cols + i / rows]).collect();
    vec![
        ("dense", aligned, av),
        ("dense of odd length", odd, ov),
        ("dense at an odd offset", offset, wv[3..].to_vec()),
        ("transposed", transposed, tv),
    ]
}

#[test]
fn accumulate_grad_adds_grads_of_every_layout() {
    for (what, current, cv) in grads_of_every_layout(4100, 40) {
        let n = current.numel();
        let nv = random_vec(n, 50);
        let new_grad = Tensor::from_slice(&nv, current.shape(), device()).unwrap();
        let out = autograd::accumulate_grad(Some(&current), &new_grad).unwrap();
        let want: Vec<f64> = cv.iter().zip(&nv).map(|(c, g)| (c + g) as f64).collect();
        assert_close(&values(&out), &want, 1e-6, what);
        assert_close(
            &values(&current),
            &cv.iter().map(|&v| v as f64).collect::<Vec<_>>(),
            0.0,
            &format!("{what}: the current grad is left alone"),
        );
    }
}

#[test]
fn backward_with_inputs_adds_in_place_into_grads_of_every_layout() {
    for (what, grad, gv) in grads_of_every_layout(4100, 60) {
        let x = Tensor::zeros(grad.shape(), device())
            .unwrap()
            .requires_grad_(true);
        x.set_grad(Some(grad.clone())).unwrap();
        let storage = grad.storage_id();
        backward_of_three_x_into(&x);
        let after = x.grad().unwrap();
        assert!(Tensor::same(&after, &grad), "{what}: the same handle");
        assert_eq!(after.storage_id(), storage, "{what}: the same storage");
        let want: Vec<f64> = gv.iter().map(|&v| v as f64 + 3.0).collect();
        assert_close(&values(&after), &want, 1e-6, what);
    }
}

#[test]
fn c04_backward_with_inputs_accumulates_in_place() {
    let x = leaf(&[1.0, 2.0, 3.0]);
    backward_of_three_x_into(&x);
    let g = x.grad().unwrap();
    let storage = g.storage_id();
    backward_of_three_x_into(&x);
    let after = x.grad().unwrap();
    assert_eq!(values(&after), vec![6.0, 6.0, 6.0]);
    assert!(Tensor::same(&after, &g));
    assert_eq!(after.storage_id(), storage);
}

#[test]
fn c05_set_grad_then_backward_with_inputs_adds_into_that_handle() {
    let p = Tensor::randn(&[2, 2], 5, device())
        .unwrap()
        .requires_grad_(true);
    p.set_grad(Some(Tensor::ones(&[2, 2], device()).unwrap()))
        .unwrap();
    let r = p.grad().unwrap();
    let storage = r.storage_id();
    p.mul_scalar(3.0)
        .unwrap()
        .sum()
        .unwrap()
        .backward_with(inputs(&[&p]))
        .unwrap();
    let g = p.grad().unwrap();
    assert_eq!(values(&g), vec![4.0; 4]);
    assert!(Tensor::same(&g, &r));
    assert_eq!(g.storage_id(), storage);
}

#[test]
fn c06_grad_never_shares_storage_with_the_grad_output() {
    for listed in [false, true] {
        let x = leaf(&[1.0, 2.0, 3.0]);
        let y = x.mul_scalar(1.0).unwrap();
        let t = Tensor::from_vec(vec![5.0, 6.0, 7.0], &[3], device()).unwrap();
        let options = BackwardOptions {
            inputs: listed.then(|| vec![x.clone()]),
            grad_output: Some(t.clone()),
            retain_graph: false,
        };
        y.backward_with(options).unwrap();
        let g = x.grad().unwrap();
        assert_ne!(g.storage_id(), t.storage_id());
        overwrite(&t, 0.0);
        assert_eq!(values(&g), vec![5.0, 6.0, 7.0], "listed: {listed}");
    }
}

#[test]
fn c07_a_tensor_listed_twice_is_accumulated_once() {
    let w = Tensor::randn(&[3], 7, device())
        .unwrap()
        .requires_grad_(true);
    let loss = |w: &Tensor| w.mul_scalar(2.0).unwrap().sum().unwrap();
    loss(&w).backward_with(inputs(&[&w, &w])).unwrap();
    assert_eq!(values(&w.grad().unwrap()), vec![2.0; 3]);
    let once = leaf(&[0.0, 0.0, 0.0]);
    loss(&once).backward_with(inputs(&[&once])).unwrap();
    assert_eq!(values(&once.grad().unwrap()), values(&w.grad().unwrap()));
}

#[test]
fn c07_a_leaf_used_twice_gets_the_sum_of_both_paths() {
    let w = Tensor::randn(&[3], 8, device())
        .unwrap()
        .requires_grad_(true);
    w.mul(&w).unwrap().sum().unwrap().backward().unwrap();
    let want: Vec<f64> = values(&w).iter().map(|&v| 2.0 * v as f64).collect();
    assert_close(&values(&w.grad().unwrap()), &want, 1e-6, "2w");
}

#[test]
fn c08_only_listed_inputs_get_grads() {
    let a = leaf(&[1.0, 2.0]);
    let b = leaf(&[3.0, 4.0]);
    a.mul(&b)
        .unwrap()
        .sum()
        .unwrap()
        .backward_with(inputs(&[&a]))
        .unwrap();
    assert_eq!(values(&a.grad().unwrap()), vec![3.0, 4.0]);
    assert!(b.grad().is_none());
}

#[test]
fn c08_an_unlisted_leaf_keeps_value_handle_and_storage() {
    let a = leaf(&[1.0, 2.0]);
    let b = leaf(&[3.0, 4.0]);
    let kept = Tensor::from_vec(vec![9.0, 9.0], &[2], device()).unwrap();
    b.set_grad(Some(kept.clone())).unwrap();
    let storage = kept.storage_id();
    a.mul(&b)
        .unwrap()
        .sum()
        .unwrap()
        .backward_with(inputs(&[&a]))
        .unwrap();
    let g = b.grad().unwrap();
    assert!(Tensor::same(&g, &kept));
    assert_eq!(g.storage_id(), storage);
    assert_eq!(values(&g), vec![9.0, 9.0]);
}

#[test]
fn c08_nodes_no_listed_input_depends_on_are_not_run() {
    // b's branch ends in a node whose saved graph was freed: running it would be an error.
    let a = leaf(&[1.0, 2.0]);
    let b = leaf(&[3.0, 4.0]);
    let b_branch = b.exp().unwrap();
    b_branch.sum().unwrap().backward().unwrap(); // frees the exp node
    let loss = a
        .mul_scalar(2.0)
        .unwrap()
        .add(&b_branch)
        .unwrap()
        .sum()
        .unwrap();
    loss.backward_with(inputs(&[&a])).unwrap();
    assert_eq!(values(&a.grad().unwrap()), vec![2.0, 2.0]);
}

#[test]
fn c09_empty_inputs_is_an_error() {
    let x = leaf(&[1.0]);
    let err = x
        .mul_scalar(2.0)
        .unwrap()
        .sum()
        .unwrap()
        .backward_with(inputs(&[]))
        .unwrap_err();
    assert!(
        matches!(err, Error::InvalidArgument { op: "backward", .. }),
        "{err:?}"
    );
    assert!(err.to_string().contains("empty"), "{err}");
}

#[test]
fn c09_an_input_that_does_not_require_grad_is_an_error_and_changes_nothing() {
    let x = leaf(&[1.0, 2.0]);
    let c = Tensor::ones(&[2], device()).unwrap();
    let loss = x.mul(&c).unwrap().sum().unwrap();
    let err = loss.backward_with(inputs(&[&x, &c])).unwrap_err();
    assert!(
        matches!(err, Error::InvalidArgument { op: "backward", .. }),
        "{err:?}"
    );
    assert!(err.to_string().contains("does not require grad"), "{err}");
    assert!(x.grad().is_none(), "no slot changed");
    loss.backward_with(inputs(&[&x])).unwrap();
    assert_eq!(
        values(&x.grad().unwrap()),
        vec![1.0, 1.0],
        "the graph was not freed by the failed call"
    );
}

#[test]
fn c09_an_unreachable_input_keeps_its_slot_without_error() {
    let x = leaf(&[1.0, 2.0]);
    let other = leaf(&[5.0]);
    let kept = Tensor::ones(&[1], device()).unwrap();
    other.set_grad(Some(kept.clone())).unwrap();
    x.sum()
        .unwrap()
        .backward_with(inputs(&[&x, &other]))
        .unwrap();
    assert!(Tensor::same(&other.grad().unwrap(), &kept));
    assert_eq!(values(&kept), vec![1.0]);
    assert_eq!(values(&x.grad().unwrap()), vec![1.0, 1.0]);
}

#[test]
fn c09_a_listed_non_leaf_gets_its_own_grad() {
    let x = leaf(&[1.0, 2.0, 3.0]);
    let h = x.mul_scalar(2.0).unwrap();
    let loss = h.mul(&h).unwrap().sum().unwrap();
    loss.backward_with(inputs(&[&h])).unwrap();
    // d(sum h^2)/dh = 2h = [4, 8, 12]
    assert_eq!(values(&h.grad().unwrap()), vec![4.0, 8.0, 12.0]);
    assert!(x.grad().is_none());
}

#[test]
fn c10_two_backward_calls_through_a_linear_layer_accumulate_twice() {
    let dev = device();
    let x = Tensor::from_vec((0..8).map(|i| i as f32 * 0.5 - 1.0).collect(), &[2, 4], dev).unwrap();
    let weight = Tensor::randn(&[4, 4], 10, dev)
        .unwrap()
        .requires_grad_(true);
    let bias = Tensor::randn(&[4], 11, dev).unwrap().requires_grad_(true);
    let out = x.matmul(&weight.t().unwrap()).unwrap().add(&bias).unwrap();
    let loss = out.sum().unwrap();
    let params = vec![weight.clone(), bias.clone()];
    loss.backward_with(BackwardOptions {
        inputs: Some(params.clone()),
        grad_output: None,
        retain_graph: true,
    })
    .unwrap();
    loss.backward_with(BackwardOptions {
        inputs: Some(params),
        grad_output: None,
        retain_graph: false,
    })
    .unwrap();
    assert_eq!(values(&bias.grad().unwrap()), vec![4.0; 4]);
    let xs = values(&x);
    let col_sums: Vec<f64> = (0..4).map(|j| (xs[j] + xs[4 + j]) as f64).collect();
    let want: Vec<f64> = (0..16).map(|i| 2.0 * col_sums[i % 4]).collect();
    assert_close(&values(&weight.grad().unwrap()), &want, 1e-6, "weight grad");
}

#[test]
fn c11_backward_of_a_non_scalar_without_grad_output_is_an_error() {
    let x = Tensor::randn(&[3], 12, device())
        .unwrap()
        .requires_grad_(true);
    let err = x.mul_scalar(2.0).unwrap().backward().unwrap_err();
    assert!(
        matches!(err, Error::Shape { op: "backward", .. }),
        "{err:?}"
    );
    assert!(
        err.to_string().contains("[3]") && err.to_string().contains("grad_output"),
        "{err}"
    );
    assert!(x.grad().is_none());
}

#[test]
fn c11_a_grad_output_of_the_wrong_shape_is_an_error() {
    let x = Tensor::randn(&[3], 13, device())
        .unwrap()
        .requires_grad_(true);
    let y = x.mul_scalar(2.0).unwrap();
    let options = BackwardOptions {
        grad_output: Some(Tensor::ones(&[4], device()).unwrap()),
        ..Default::default()
    };
    let err = y.backward_with(options).unwrap_err();
    assert!(
        matches!(err, Error::Shape { op: "backward", .. }),
        "{err:?}"
    );
    assert!(
        err.to_string().contains("[4]") && err.to_string().contains("[3]"),
        "{err}"
    );
}

#[test]
fn c11_backward_on_a_tensor_without_a_graph_is_an_error() {
    let err = Tensor::ones(&[3], device())
        .unwrap()
        .sum()
        .unwrap()
        .backward()
        .unwrap_err();
    assert!(
        matches!(err, Error::InvalidArgument { op: "backward", .. }),
        "{err:?}"
    );
    assert!(err.to_string().contains("does not require grad"), "{err}");
}

#[test]
fn c12_a_second_backward_through_a_freed_graph_is_an_error() {
    let x = leaf(&[1.0, 2.0]);
    let y = x.mul(&x).unwrap().sum().unwrap();
    y.backward().unwrap();
    let g = x.grad().unwrap();
    let storage = g.storage_id();
    let err = y.backward().unwrap_err();
    assert!(
        err.to_string()
            .contains("graph already freed; pass retain_graph: true to the first backward"),
        "{err}"
    );
    assert!(
        Tensor::same(&x.grad().unwrap(), &g) && g.storage_id() == storage,
        "the slot is as it was"
    );
    assert_eq!(values(&g), vec![2.0, 4.0]);
}

#[test]
fn c12_a_freed_graph_is_an_error_even_when_it_saved_nothing() {
    let x = leaf(&[1.0, 2.0]);
    let y = x.add_scalar(1.0).unwrap().sum().unwrap();
    y.backward().unwrap();
    assert!(y
        .backward()
        .unwrap_err()
        .to_string()
        .contains("graph already freed"));
}

#[test]
fn c12_retain_graph_lets_a_second_backward_accumulate() {
    let x = leaf(&[1.0, 2.0]);
    let y = x.mul(&x).unwrap().sum().unwrap();
    y.backward_with(BackwardOptions {
        retain_graph: true,
        ..Default::default()
    })
    .unwrap();
    y.backward().unwrap();
    assert_eq!(values(&x.grad().unwrap()), vec![4.0, 8.0], "4x");
}

#[test]
fn c13_no_grad_records_nothing_and_backward_on_its_result_is_an_error() {
    let x = leaf(&[1.0, 2.0]);
    let y = no_grad(|| x.mul_scalar(2.0)).unwrap();
    assert!(!y.requires_grad());
    assert!(y.is_leaf());
    let err = y.sum().unwrap().backward().unwrap_err();
    assert!(err.to_string().contains("does not require grad"), "{err}");
    let guarded = {
        let _guard = autograd::NoGradGuard::new();
        x.exp().unwrap()
    };
    assert!(!guarded.requires_grad());
    assert!(
        x.exp().unwrap().requires_grad(),
        "the guard restores recording"
    );
}

#[test]
fn c13_detach_shares_storage_and_records_nothing() {
    let x = leaf(&[1.0, 2.0]);
    let d = x.detach();
    assert_eq!(d.storage_id(), x.storage_id());
    assert!(!d.requires_grad());
    assert!(!d.mul_scalar(2.0).unwrap().requires_grad());
}

#[test]
fn c14_after_zero_grad_backward_gives_the_single_pass_grad_in_fresh_storage() {
    let x = leaf(&[1.0, 2.0, 3.0]);
    x.mul_scalar(3.0)
        .unwrap()
        .sum()
        .unwrap()
        .backward()
        .unwrap();
    let old = x.grad().unwrap();
    x.zero_grad();
    assert!(x.grad().is_none());
    x.mul_scalar(3.0)
        .unwrap()
        .sum()
        .unwrap()
        .backward()
        .unwrap();
    let new = x.grad().unwrap();
    assert_eq!(values(&new), vec![3.0, 3.0, 3.0]);
    assert!(!Tensor::same(&new, &old));
    assert_ne!(new.storage_id(), old.storage_id());
}

#[test]
fn c14_set_grad_of_the_wrong_shape_is_an_error() {
    let x = leaf(&[1.0, 2.0]);
    let err = x
        .set_grad(Some(Tensor::zeros(&[3], device()).unwrap()))
        .unwrap_err();
    assert!(
        matches!(err, Error::Shape { op: "set_grad", .. }),
        "{err:?}"
    );
    assert!(
        err.to_string().contains("[3]") && err.to_string().contains("[2]"),
        "{err}"
    );
    assert!(x.grad().is_none());
}

#[test]
fn c15_two_bias_free_linear_layers_match_a_hand_computed_grad() {
    let dev = device();
    let x = Tensor::from_vec(vec![1.0, 2.0, -1.0, 0.5], &[2, 2], dev).unwrap();
    let w1 = Tensor::from_vec(vec![0.3, -0.7], &[1, 2], dev)
        .unwrap()
        .requires_grad_(true);
    let w2 = Tensor::from_vec(vec![1.5, -2.0], &[2, 1], dev)
        .unwrap()
        .requires_grad_(true);
    let h = x.matmul(&w1.t().unwrap()).unwrap(); // [2, 1]
    let out = h.matmul(&w2.t().unwrap()).unwrap(); // [2, 2]
    out.sum().unwrap().backward().unwrap();
    // loss = sum_i sum_j h_i w2_j with h_i = x_i . w1
    let (xs, w1v, w2v) = ([[1.0, 2.0], [-1.0, 0.5]], [0.3, -0.7], [1.5, -2.0]);
    let h: Vec<f64> = xs.iter().map(|r| r[0] * w1v[0] + r[1] * w1v[1]).collect();
    let w2_sum: f64 = w2v.iter().sum();
    let want_w1: Vec<f64> = (0..2).map(|k| w2_sum * (xs[0][k] + xs[1][k])).collect();
    let want_w2: Vec<f64> = vec![h[0] + h[1]; 2];
    assert_close(&values(&w1.grad().unwrap()), &want_w1, 1e-6, "w1");
    assert_close(&values(&w2.grad().unwrap()), &want_w2, 1e-6, "w2");
}

#[test]
fn c16_tensors_without_requires_grad_never_get_a_grad() {
    let x = leaf(&[1.0, 2.0]);
    let c = Tensor::from_vec(vec![3.0, 4.0], &[2], device()).unwrap();
    x.mul(&c).unwrap().sum().unwrap().backward().unwrap();
    assert!(c.grad().is_none());
    assert!(!c.requires_grad());
}

#[test]
fn c16_non_leaf_slots_stay_empty_unless_retained() {
    let x = leaf(&[1.0, 2.0]);
    let h = x.mul_scalar(2.0).unwrap();
    let kept = x.mul_scalar(3.0).unwrap();
    kept.retain_grad();
    h.add(&kept).unwrap().sum().unwrap().backward().unwrap();
    assert!(h.grad().is_none());
    assert_eq!(values(&kept.grad().unwrap()), vec![1.0, 1.0]);
    assert_eq!(values(&x.grad().unwrap()), vec![5.0, 5.0]);
}

/// `sum(tanh(w * x))` and its backward, which adds into `w`'s grad (no zero_grad inside).
fn tanh_step(w: &Tensor, x: &Tensor) -> Result<Tensor> {
    let loss = w.mul(x)?.tanh()?.sum()?;
    loss.backward()?;
    Ok(loss)
}

#[test]
fn c17_replays_add_into_the_current_grad_before_and_after_zero_grad() {
    let data = random_vec(6, 3);
    let (p, q) = (leaf(&data), leaf(&data));
    let (x, _) = random_tensor(&[6], 9);
    // Captured while p's grad is set.
    tanh_step(&p, &x).unwrap();
    tanh_step(&q, &x).unwrap();
    let mut step = Step::new(|b: &[Tensor]| tanh_step(&p, &b[0]));
    for call in 0..8 {
        if call >= 4 {
            p.zero_grad();
            q.zero_grad();
        }
        step.run(std::slice::from_ref(&x)).unwrap();
        tanh_step(&q, &x).unwrap();
        let (got, want) = (values(&p.grad().unwrap()), values(&q.grad().unwrap()));
        for (a, b) in got.iter().zip(&want) {
            assert!(
                (a - b).abs() <= 1e-6 * b.abs().max(1.0),
                "call {call}: {a} vs {b}"
            );
        }
    }
    // Calls 2 and 3 replay the plan with a grad in the slot; call 4 captures again (the slot
    // is empty now, a guard); calls 5 to 7 replay that plan.
    assert_eq!(step.stats().replays, 5, "{:?}", step.stats());
}

#[test]
fn c18_autograd_grad_returns_the_grad_and_touches_no_slot() {
    let w = leaf(&[1.0, -2.0, 3.0]);
    let g = Tensor::from_vec(vec![7.0, 7.0, 7.0], &[3], device()).unwrap();
    w.set_grad(Some(g.clone())).unwrap();
    let storage = g.storage_id();
    let loss = w.mul(&w).unwrap().sum().unwrap();
    let grads = autograd::grad(&[loss], std::slice::from_ref(&w), None, false).unwrap();
    assert_eq!(values(grads[0].as_ref().unwrap()), vec![2.0, -4.0, 6.0]);
    let slot = w.grad().unwrap();
    assert!(Tensor::same(&slot, &g));
    assert_eq!(slot.storage_id(), storage);
    assert_eq!(values(&slot), vec![7.0, 7.0, 7.0]);
}

#[test]
fn c18_autograd_grad_of_an_unreached_input_is_none() {
    let w = leaf(&[1.0]);
    let v = leaf(&[2.0]);
    let grads = autograd::grad(
        &[w.mul_scalar(2.0).unwrap().sum().unwrap()],
        &[w.clone(), v.clone()],
        None,
        false,
    )
    .unwrap();
    assert_eq!(values(grads[0].as_ref().unwrap()), vec![2.0]);
    assert!(grads[1].is_none());
    assert!(w.grad().is_none() && v.grad().is_none());
}

#[test]
fn s08_chunked_backward_sums_to_the_full_batch_grad() {
    let dev = device();
    let (x, _) = random_tensor(&[8, 3], 30);
    let w_full = Tensor::randn(&[3, 2], 31, dev)
        .unwrap()
        .requires_grad_(true);
    x.matmul(&w_full)
        .unwrap()
        .tanh()
        .unwrap()
        .sum()
        .unwrap()
        .backward()
        .unwrap();
    let w_chunks = w_full.detach().deep_clone().unwrap().requires_grad_(true);
    for c in 0..4 {
        let chunk = x.narrow(0, c * 2, 2).unwrap();
        chunk
            .matmul(&w_chunks)
            .unwrap()
            .tanh()
            .unwrap()
            .sum()
            .unwrap()
            .backward()
            .unwrap();
    }
    let want: Vec<f64> = values(&w_full.grad().unwrap())
        .iter()
        .map(|&v| v as f64)
        .collect();
    assert_close(&values(&w_chunks.grad().unwrap()), &want, 1e-5, "chunked");
}

#[test]
fn set_grad_rejects_a_broadcast_view() {
    let x = leaf(&[1.0, 2.0]);
    let view = Tensor::ones(&[1], device()).unwrap().expand(&[2]).unwrap();
    let err = x.set_grad(Some(view)).unwrap_err();
    assert!(
        matches!(err, Error::InvalidArgument { op: "set_grad", .. }),
        "{err:?}"
    );
}

#[test]
fn a_strided_grad_handle_keeps_its_handle_under_the_swap() {
    let x = Tensor::randn(&[2, 3], 40, device())
        .unwrap()
        .requires_grad_(true);
    let base = Tensor::zeros(&[3, 2], device()).unwrap();
    let view = base.t().unwrap();
    x.set_grad(Some(view.clone())).unwrap();
    x.mul_scalar(2.0)
        .unwrap()
        .sum()
        .unwrap()
        .backward()
        .unwrap();
    let g = x.grad().unwrap();
    assert!(Tensor::same(&g, &view));
    assert_eq!(values(&g), vec![2.0; 6]);
    assert_eq!(values(&base), vec![0.0; 6], "the old buffer is not written");
}
