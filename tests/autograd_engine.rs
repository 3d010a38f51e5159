//! The engine's resource behaviour: saved buffers freed after backward, flat memory over
//! training iterations, deep graphs, and threads. Tests here read device-wide counters, so
//! each one holds `serial()`.

mod common;
use common::*;
use std::sync::{Mutex, MutexGuard};
use wgrad::{nn, Device, Tensor};

fn serial() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

fn live_plus_pooled(dev: &Device) -> u64 {
    let s = dev.stats();
    s.live_bytes + s.pooled_bytes
}

#[test]
fn backward_without_retain_graph_returns_saved_buffers_to_the_pool() {
    let _s = serial();
    let dev = device();
    let w = Tensor::randn(&[256, 256], 1, dev)
        .unwrap()
        .requires_grad_(true);
    let x = Tensor::randn(&[64, 256], 2, dev).unwrap();
    dev.synchronize().unwrap();
    let before = dev.stats().live_bytes;
    let h = x.matmul(&w).unwrap().tanh().unwrap(); // saves x, w and tanh's output
    let loss = h.exp().unwrap().sum().unwrap(); // saves exp's output
    drop(h);
    let with_graph = dev.stats().live_bytes;
    assert!(
        with_graph >= before + 2 * 64 * 256 * 4,
        "the graph holds its saved tensors"
    );
    loss.backward().unwrap();
    drop(loss);
    dev.synchronize().unwrap();
    let after = dev.stats().live_bytes;
    // What stays live is w's new grad (one [256, 256] buffer); everything the graph saved
    // went back to the pool.
    assert_eq!(
        after,
        before + 256 * 256 * 4,
        "before {before}, with graph {with_graph}, after {after}"
    );
    assert!(dev.stats().pooled_bytes > 0);
}

#[test]
fn add_and_sub_keep_neither_operand_alive() {
    let _s = serial();
    let dev = device();
    let x = Tensor::randn(&[64, 256], 3, dev)
        .unwrap()
        .requires_grad_(true);
    dev.synchronize().unwrap();
    let before = dev.stats().live_bytes;
    // Two temporaries whose only consumers are an add and a sub: their grads need the shapes
    // alone, so once the handles drop the buffers go back to the pool (a residual stream's
    // branch outputs are not held until backward).
    let a = x.mul_scalar(2.0).unwrap();
    let b = x.mul_scalar(3.0).unwrap();
    let y = a.add(&x).unwrap().sub(&b).unwrap();
    drop((a, b));
    dev.synchronize().unwrap();
    let one = 64 * 256 * 4;
    // Only y remains: a, b and the add's output (the sub's operand) are gone.
    assert_eq!(dev.stats().live_bytes, before + one);
    let loss = y.sum().unwrap();
    loss.backward().unwrap();
    let want = vec![0.0f32; 64 * 256]; // d/dx (2x + x - 3x) = 0
    assert_eq!(x.grad().unwrap().to_vec().unwrap(), want);
}

#[test]
fn a_thousand_training_iterations_of_a_small_mlp_keep_device_memory_flat() {
    let _s = serial();
    let dev = device();
    let w1 = Tensor::randn(&[32, 16], 4, dev)
        .unwrap()
        .mul_scalar(0.2)
        .unwrap()
        .requires_grad_(true);
    let b1 = Tensor::zeros(&[32], dev).unwrap().requires_grad_(true);
    let w2 = Tensor::randn(&[4, 32], 5, dev)
        .unwrap()
        .mul_scalar(0.2)
        .unwrap()
        .requires_grad_(true);
    let x = Tensor::randn(&[8, 16], 6, dev).unwrap();
    let labels = Tensor::from_labels(vec![0, 1, 2, 3, 0, 1, 2, 3], dev).unwrap();
    let params = [w1.clone(), b1.clone(), w2.clone()];
    let step = || {
        let h = x
            .matmul(&w1.t().unwrap())
            .unwrap()
            .add(&b1)
            .unwrap()
            .relu()
            .unwrap();
        let loss = nn::loss::cross_entropy(&h.matmul(&w2.t().unwrap()).unwrap(), &labels).unwrap();
        loss.backward().unwrap();
        // A plain SGD step, in place.
        wgrad::no_grad(|| {
            for p in &params {
                let g = p.grad().unwrap();
                p.copy_(&p.sub(&g.mul_scalar(0.1).unwrap()).unwrap())
                    .unwrap();
                p.zero_grad();
            }
        });
        loss
    };
    let first = step().item().unwrap();
    for _ in 0..20 {
        step();
    }
    dev.synchronize().unwrap();
    let warm = live_plus_pooled(dev);
    let created = dev.stats().buffers_created;
    let mut last = 0.0;
    for i in 0..1000 {
        let loss = step();
        if i % 250 == 249 {
            last = loss.item().unwrap();
        }
    }
    dev.synchronize().unwrap();
    assert_eq!(live_plus_pooled(dev), warm, "device memory grew");
    assert_eq!(
        dev.stats().buffers_created,
        created,
        "buffers were created after warm-up"
    );
    assert!(last < first * 0.5, "the loss fell: {first} -> {last}");
}

#[test]
fn backward_through_a_10000_op_chain_succeeds() {
    let _s = serial();
    let dev = device();
    let x = Tensor::from_vec(vec![1.0, 2.0], &[2], dev)
        .unwrap()
        .requires_grad_(true);
    let mut y = x.clone();
    for i in 0..10_000 {
        y = if i % 2 == 0 {
            y.mul_scalar(1.0001).unwrap()
        } else {
            y.add_scalar(0.5).unwrap()
        };
    }
    y.sum().unwrap().backward().unwrap();
    let want = 1.0001f64.powi(5000);
    assert_close(
        &x.grad().unwrap().to_vec().unwrap(),
        &[want, want],
        1e-4,
        "10,000-op chain",
    );
    drop(y); // dropping the chain does not recurse 10,000 deep either
}

#[test]
fn two_threads_train_two_models_on_one_device_without_interfering() {
    let _s = serial();
    let dev = device().clone();
    let train = |seed: u64, dev: Device| {
        std::thread::spawn(move || {
            let w = Tensor::randn(&[8, 4], seed, &dev)
                .unwrap()
                .requires_grad_(true);
            let x = Tensor::randn(&[16, 8], seed + 100, &dev).unwrap();
            for _ in 0..50 {
                x.matmul(&w)
                    .unwrap()
                    .tanh()
                    .unwrap()
                    .sum()
                    .unwrap()
                    .backward()
                    .unwrap();
            }
            // The same grad computed once, with a fresh leaf: 50 times it must match.
            let w2 = w.detach().deep_clone().unwrap().requires_grad_(true);
            x.matmul(&w2)
                .unwrap()
                .tanh()
                .unwrap()
                .sum()
                .unwrap()
                .backward()
                .unwrap();
            let once: Vec<f64> = w2
                .grad()
                .unwrap()
                .to_vec()
                .unwrap()
                .iter()
                .map(|&g| 50.0 * g as f64)
                .collect();
            (w.grad().unwrap().to_vec().unwrap(), once)
        })
    };
    let (a, b) = (train(1, dev.clone()), train(2, dev));
    for handle in [a, b] {
        let (got, want) = handle.join().unwrap();
        assert_close(&got, &want, 1e-4, "50 accumulations");
    }
}

#[test]
fn tensors_are_send_and_sync() {
    fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<Tensor>();
    assert_send_sync::<Device>();
}
