//! matmul against a CPU f64 reference: odd shapes, batches, broadcasting, transposed views.

mod common;
use common::*;
use wgrad::{Device, Error, KernelFlavor, Tensor};

/// Reference product of row-major `a` [batch, m, k] and `b` [batch, k, n].
fn matmul_ref(a: &[f32], b: &[f32], batch: usize, m: usize, k: usize, n: usize) -> Vec<f64> {
    let mut out = vec![0.0; batch * m * n];
    for p in 0..batch {
        for i in 0..m {
            for j in 0..n {
                out[(p * m + i) * n + j] = (0..k)
                    .map(|l| a[(p * m + i) * k + l] as f64 * b[(p * k + l) * n + j] as f64)
                    .sum();
            }
        }
    }
    out
}

fn transpose_host(x: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    (0..rows * cols)
        .map(|i| x[(i % rows) * cols + i / rows])
        .collect()
}

#[test]
fn matmul_matches_reference_on_odd_shapes() {
    for (m, k, n) in [
        (1, 1, 1),
        (7, 13, 5),
        (33, 1, 65),
        (129, 31, 257),
        (64, 64, 64),
        (1, 300, 3),
    ] {
        let (a, da) = random_tensor(&[m, k], 1);
        let (b, db) = random_tensor(&[k, n], 2);
        let got = a.matmul(&b).unwrap();
        assert_eq!(got.shape(), &[m, n]);
        assert_close(
            &got.to_vec().unwrap(),
            &matmul_ref(&da, &db, 1, m, k, n),
            1e-5,
            &format!("{m}x{k}x{n}"),
        );
    }
}

#[test]
fn matmul_of_transposed_views_matches_reference() {
    let (m, k, n) = (19, 23, 17);
    let (at, dat) = random_tensor(&[k, m], 3); // A stored transposed
    let (bt, dbt) = random_tensor(&[n, k], 4); // B stored transposed
    let (a, b) = (at.t().unwrap(), bt.t().unwrap());
    let (da, db) = (transpose_host(&dat, k, m), transpose_host(&dbt, n, k));
    let want = matmul_ref(&da, &db, 1, m, k, n);
    let got = a.matmul(&b).unwrap();
    assert_close(&got.to_vec().unwrap(), &want, 1e-5, "A^T B^T");
}

#[test]
fn batched_matmul_matches_reference_per_batch() {
    let (batch, m, k, n) = (3, 9, 14, 11);
    let (a, da) = random_tensor(&[batch, m, k], 5);
    let (b, db) = random_tensor(&[batch, k, n], 6);
    let got = a.matmul(&b).unwrap();
    assert_eq!(got.shape(), &[batch, m, n]);
    assert_close(
        &got.to_vec().unwrap(),
        &matmul_ref(&da, &db, batch, m, k, n),
        1e-5,
        "batched",
    );
}

#[test]
fn batch_dims_broadcast_against_a_matrix_and_across_ranks() {
    let (a, da) = random_tensor(&[2, 3, 5, 4], 7);
    let (w, dw) = random_tensor(&[4, 6], 8);
    let got = a.matmul(&w).unwrap();
    assert_eq!(got.shape(), &[2, 3, 5, 6]);
    let wb: Vec<f32> = (0..6).flat_map(|_| dw.clone()).collect();
    assert_close(
        &got.to_vec().unwrap(),
        &matmul_ref(&da, &wb, 6, 5, 4, 6),
        1e-5,
        "[2,3,5,4] x [4,6]",
    );

    let (x, dx) = random_tensor(&[2, 1, 3, 4], 9);
    let (y, dy) = random_tensor(&[5, 4, 2], 10);
    let got = x.matmul(&y).unwrap();
    assert_eq!(got.shape(), &[2, 5, 3, 2]);
    let mut xs = Vec::new();
    let mut ys = Vec::new();
    for p in 0..2 {
        for q in 0..5 {
            xs.extend_from_slice(&dx[p * 12..p * 12 + 12]);
            ys.extend_from_slice(&dy[q * 8..q * 8 + 8]);
        }
    }
    assert_close(
        &got.to_vec().unwrap(),
        &matmul_ref(&xs, &ys, 10, 3, 4, 2),
        1e-5,
        "broadcast batch",
    );
}

#[test]
fn batched_matmul_reads_transposed_batch_views() {
    let (batch, m, k, n) = (4, 6, 10, 7);
    let (bt, dbt) = random_tensor(&[batch, n, k], 11);
    let (a, da) = random_tensor(&[batch, m, k], 12);
    let got = a.matmul(&bt.transpose(1, 2).unwrap()).unwrap();
    let db: Vec<f32> = (0..batch)
        .flat_map(|p| transpose_host(&dbt[p * n * k..(p + 1) * n * k], n, k))
        .collect();
    assert_close(
        &got.to_vec().unwrap(),
        &matmul_ref(&da, &db, batch, m, k, n),
        1e-5,
        "batched A B^T",
    );
}

#[test]
fn one_dimensional_operands_follow_pytorch() {
    let (v, dv) = random_tensor(&[4], 13);
    let (mtx, dm) = random_tensor(&[4, 3], 14);
    let vm = v.matmul(&mtx).unwrap();
    assert_eq!(vm.shape(), &[3]);
    assert_close(
        &vm.to_vec().unwrap(),
        &matmul_ref(&dv, &dm, 1, 1, 4, 3),
        1e-5,
        "v @ M",
    );
    let mv = mtx.t().unwrap().matmul(&v).unwrap();
    assert_eq!(mv.shape(), &[3]);
    assert_close(
        &mv.to_vec().unwrap(),
        &matmul_ref(&dv, &dm, 1, 1, 4, 3),
        1e-5,
        "M^T @ v",
    );
    let dot = v.matmul(&v).unwrap();
    assert_eq!(dot.shape(), &[] as &[usize]);
    let want: f64 = dv.iter().map(|&x| (x as f64).powi(2)).sum();
    assert_close(&dot.to_vec().unwrap(), &[want], 1e-5, "dot");
}

#[test]
fn matmul_with_empty_inner_dim_is_zeros() {
    let a = Tensor::zeros(&[3, 0], device()).unwrap();
    let b = Tensor::zeros(&[0, 2], device()).unwrap();
    assert_eq!(a.matmul(&b).unwrap().to_vec().unwrap(), vec![0.0; 6]);
    let e = Tensor::zeros(&[0, 4], device())
        .unwrap()
        .matmul(&Tensor::zeros(&[4, 2], device()).unwrap())
        .unwrap();
    assert_eq!(e.shape(), &[0, 2]);
}

#[test]
fn matmul_of_mismatched_inner_dims_names_both_shapes() {
    let a = Tensor::zeros(&[3, 4], device()).unwrap();
    let b = Tensor::zeros(&[5, 2], device()).unwrap();
    let err = a.matmul(&b).unwrap_err();
    assert!(matches!(err, Error::Shape { op: "matmul", .. }), "{err:?}");
    assert!(
        err.to_string().contains("[3, 4]") && err.to_string().contains("[5, 2]"),
        "{err}"
    );
    let s = Tensor::zeros(&[], device()).unwrap();
    assert!(matches!(
        s.matmul(&a).unwrap_err(),
        Error::Shape { op: "matmul", .. }
    ));
}

/// Checks `a @ b` for row-major and transposed storage of each operand against the reference.
fn check_every_layout(dev: &Device, batch: usize, m: usize, k: usize, n: usize) {
    let da = random_vec(batch * m * k, 21);
    let db = random_vec(batch * k * n, 22);
    let want = matmul_ref(&da, &db, batch, m, k, n);
    let a_rows = Tensor::from_slice(&da, &[batch, m, k], dev).unwrap();
    let b_rows = Tensor::from_slice(&db, &[batch, k, n], dev).unwrap();
    let stored_transposed = |t: &Tensor| {
        t.transpose(1, 2)
            .unwrap()
            .contiguous()
            .unwrap()
            .transpose(1, 2)
            .unwrap()
    };
    let (a_cols, b_cols) = (stored_transposed(&a_rows), stored_transposed(&b_rows));
    for (an, a) in [("A", &a_rows), ("A^T^T", &a_cols)] {
        for (bn, b) in [("B", &b_rows), ("B^T^T", &b_cols)] {
            let got = a.matmul(b).unwrap().to_vec().unwrap();
            // f32 sums over long k drift further from the f64 reference.
            let tol = if k > 256 { 1e-4 } else { 1e-5 };
            assert_close(&got, &want, tol, &format!("{an} {bn} {batch}x{m}x{k}x{n}"));
        }
    }
}

#[test]
fn small_products_of_every_layout_share_one_kernel() {
    // A dim under 16 (a 10-class head: its forward, its input grad with k = 10, its weight
    // grad with m = 10) takes one kernel whatever the layouts, alignment and tail, so a
    // model's first step compiles one pipeline for all of them. A private device counts only
    // this test's pipelines.
    let dev = Device::new().unwrap();
    if dev.kernel_flavor() != KernelFlavor::Cpu {
        return; // GPUs run one tiled kernel for every product already
    }
    check_every_layout(&dev, 1, 64, 128, 10);
    let copies = dev.stats().pipelines; // the product's, and the strided copy's
    for (batch, m, k, n) in [
        (1, 64, 10, 128),
        (1, 10, 64, 128),
        (2, 8, 12, 10),
        (3, 8, 5, 4),
        (1, 13, 7, 6),
        (1, 1, 1, 1),
        (1, 40, 64, 12),
    ] {
        check_every_layout(&dev, batch, m, k, n);
    }
    assert_eq!(
        dev.stats().pipelines,
        copies,
        "one kernel for every small product"
    );
}

#[test]
fn every_operand_layout_matches_reference_at_aligned_and_ragged_sizes() {
    // Row-major and transposed storage for each operand, at sizes that allow four-wide reads
    // (multiples of 4 and 8) and at ragged ones, with a k that leaves a remainder of 4, and
    // with four-wide reads of A but an N that is not a multiple of 4 (ragged output rows; wide
    // enough, or M small enough, that the product is not computed transposed), and with an M
    // that leaves the last tile of 32 rows mostly empty (72: its last 24 rows clamped). Shapes
    // with a dim under 16 and at most 256K multiply-adds take the small-product kernel; the
    // rest (every dim 16 or more, or more multiply-adds) the register kernels, with a k tail,
    // a 16-row tile (M <= 16), a narrow product computed transposed, and A^T read four rows
    // at a time with M a multiple of 4 but not of 8 among them.
    for (batch, m, k, n) in [
        (2, 72, 20, 36),
        (1, 16, 12, 20),
        (2, 24, 9, 36),
        (1, 40, 64, 12),
        (3, 8, 5, 4),
        (1, 13, 7, 6),
        (1, 16, 8, 66),
        (2, 8, 12, 10),
        (1, 17, 19, 18),
        (1, 16, 17, 66),
        (1, 24, 1001, 90),
        (1, 10, 2400, 100),
        (1, 2048, 96, 12),
        (1, 64, 9, 4000),
        (1, 128, 512, 10),
        (1, 84, 96, 128),
        (1, 12, 256, 128),
        (2, 20, 64, 160),
    ] {
        check_every_layout(device(), batch, m, k, n);
    }
}

/// A random tensor on `dev` (a private device) and its data.
fn tensor_on(dev: &Device, shape: &[usize], seed: u64) -> (Tensor, Vec<f32>) {
    let data = random_vec(shape.iter().product(), seed);
    (Tensor::from_slice(&data, shape, dev).unwrap(), data)
}

/// `a` ([m, k], row-major data `da`) times `b` ([k, n], `db`) on `dev`, checked against the
/// reference; returns the pipelines the device has compiled by then.
fn checked_product(dev: &Device, a: &Tensor, da: &[f32], b: &Tensor, db: &[f32]) -> usize {
    let (m, k, n) = (a.shape()[0], a.shape()[1], b.shape()[1]);
    let got = a.matmul(b).unwrap().to_vec().unwrap();
    let tol = if k > 256 { 1e-4 } else { 1e-5 };
    assert_close(
        &got,
        &matmul_ref(da, db, 1, m, k, n),
        tol,
        &format!("{m}x{k}x{n}"),
    );
    dev.stats().pipelines
}

#[test]
fn an_output_of_odd_width_compiles_no_module_beyond_an_aligned_ones() {
    // A head over a vocabulary of 65 (its forward, x W^T) and a layer of 64 outputs read their
    // operands alike and differ only in whether each output group of 4 is one aligned store,
    // which the kernel decides as it stores: one module for both. Sizes keep both products on
    // one entry point in every kernel flavour. A private device counts only this test's
    // pipelines.
    let dev = Device::new().unwrap();
    let tensor = |shape: &[usize], seed| tensor_on(&dev, shape, seed);
    let (x, dx) = tensor(&[768, 128], 31);
    let (w64, dw64) = tensor(&[64, 128], 32);
    let (w65, dw65) = tensor(&[65, 128], 33);
    let aligned = checked_product(
        &dev,
        &x,
        &dx,
        &w64.t().unwrap(),
        &transpose_host(&dw64, 64, 128),
    );
    let odd = checked_product(
        &dev,
        &x,
        &dx,
        &w65.t().unwrap(),
        &transpose_host(&dw65, 65, 128),
    );
    assert_eq!(odd, aligned, "the odd width compiled a pipeline of its own");
}

#[test]
fn products_reading_a_by_element_share_one_module_whatever_their_k() {
    // A head over a vocabulary of 65: its input grad (out grad [768, 65] times W, k = 65, a k
    // tail) and its weight grad (out grad^T times the input, k = 768, no tail) both read A
    // element by element (its row stride or column stride is 65). The masked partial last
    // step is a no-op where K has none, so both run one module. Sizes keep both products on
    // one entry point in every kernel flavour.
    let dev = Device::new().unwrap();
    let tensor = |shape: &[usize], seed| tensor_on(&dev, shape, seed);
    let (grad, dgrad) = tensor(&[768, 65], 34);
    let (w, dw) = tensor(&[65, 64], 35);
    let (x, dx) = tensor(&[768, 64], 36);
    let input_grad = checked_product(&dev, &grad, &dgrad, &w, &dw);
    let grad_t = grad.t().unwrap();
    let weight_grad = checked_product(&dev, &grad_t, &transpose_host(&dgrad, 768, 65), &x, &dx);
    assert_eq!(
        weight_grad, input_grad,
        "the weight grad compiled a pipeline of its own"
    );
}
