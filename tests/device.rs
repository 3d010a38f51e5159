//! The device layer: adapter info, batched submission, the buffer pool, the matmul kernels,
//! and sharing one device between threads. Tests here read device-wide counters, so each one
//! holds `serial()` to keep the others in this binary from running alongside it.

mod common;
use common::*;
use std::sync::{Mutex, MutexGuard};
use wgrad::{nn, Device, KernelFlavor, Tensor};

fn serial() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

/// CI runs the GPU kernels' tests a second time with `WGRAD_SUBGROUPS=off`, so that their
/// subgroup-free forms run on lavapipe too: the device must then have no subgroups.
#[test]
fn wgrad_subgroups_off_leaves_the_device_without_subgroups() {
    let _s = serial();
    if std::env::var("WGRAD_SUBGROUPS").is_ok_and(|v| v.eq_ignore_ascii_case("off")) {
        assert_eq!(device().subgroup_size(), None);
    }
}

#[test]
fn info_names_the_adapter_backend_and_type() {
    let _s = serial();
    let info = device().info();
    assert!(!info.name.is_empty());
    let shown = info.to_string();
    eprintln!("adapter: {shown}");
    assert!(
        shown.contains(&info.name) && shown.contains(&format!("{:?}", info.backend)),
        "{shown}"
    );
    // CI names the driver it set up (`WGRAD_EXPECT_DRIVER="Mesa 25"`): a run on another one
    // fails here rather than passing on the wrong adapter.
    if let Ok(expected) = std::env::var("WGRAD_EXPECT_DRIVER") {
        assert!(
            shown.contains(&expected),
            "expected a {expected} adapter, got {shown}"
        );
    }
}

#[test]
fn software_device_is_a_software_adapter() {
    let _s = serial();
    let dev = Device::software().expect("CI machines have lavapipe or llvmpipe");
    assert!(dev.info().is_software(), "{}", dev.info());
}

#[test]
fn a_chain_of_100_elementwise_ops_is_a_few_submissions() {
    let _s = serial();
    let dev = device();
    let mut x = Tensor::ones(&[1000], dev).unwrap();
    dev.synchronize().unwrap();
    let before = dev.stats();
    for _ in 0..100 {
        x = x.add_scalar(1.0).unwrap();
    }
    let after_record = dev.stats();
    let values = x.to_vec().unwrap();
    let after = dev.stats();
    assert!(values.iter().all(|&v| v == 101.0));
    assert_eq!(after_record.dispatches - before.dispatches, 100);
    let submits = after.submits - before.submits;
    assert!(submits <= 8, "100 ops took {submits} submissions");
}

#[test]
fn a_pipelines_first_dispatch_is_submitted_at_once() {
    // So that a software driver compiles it while the host records what follows. A private
    // device: its pipelines are new to it.
    let dev = Device::new().unwrap();
    let a = Tensor::ones(&[64], &dev).unwrap();
    let before = dev.stats().submits;
    let _b = a.exp().unwrap();
    assert_eq!(dev.stats().submits, before + 1, "exp's first dispatch");
    let _c = a.exp().unwrap();
    assert_eq!(
        dev.stats().submits,
        before + 1,
        "exp's second dispatch waits"
    );
}

#[test]
fn no_submission_happens_until_the_host_needs_data() {
    let _s = serial();
    let dev = device();
    let ops = |a: &Tensor| a.exp().unwrap().mul(a).unwrap();
    ops(&Tensor::ones(&[64], dev).unwrap()); // the pipelines' first dispatches submit
    dev.synchronize().unwrap();
    let before = dev.stats();
    let a = Tensor::ones(&[64], dev).unwrap();
    let _b = ops(&a);
    assert_eq!(dev.stats().submits, before.submits);
    dev.synchronize().unwrap();
    assert_eq!(dev.stats().submits, before.submits + 1);
}

#[test]
fn an_op_loop_keeps_device_memory_flat_after_warmup() {
    let _s = serial();
    let dev = device();
    let w = Tensor::randn(&[64, 32], 1, dev).unwrap();
    let b = Tensor::randn(&[32], 2, dev).unwrap();
    let x = Tensor::randn(&[16, 64], 3, dev).unwrap();
    let step = || {
        let h = x.matmul(&w).unwrap().add(&b).unwrap().relu().unwrap();
        h.softmax(1).unwrap().sum().unwrap()
    };
    for _ in 0..10 {
        step();
    }
    dev.synchronize().unwrap();
    let warm = dev.stats();
    for i in 0..1000 {
        let s = step();
        if i % 250 == 0 {
            s.item().unwrap();
        }
    }
    dev.synchronize().unwrap();
    let after = dev.stats();
    assert_eq!(
        after.live_bytes + after.pooled_bytes,
        warm.live_bytes + warm.pooled_bytes,
        "{warm:?} -> {after:?}"
    );
    assert_eq!(after.buffers_created, warm.buffers_created);
}

#[test]
fn dropped_tensors_return_their_buffers_to_the_pool() {
    let _s = serial();
    let dev = device();
    let before = dev.stats();
    let t = Tensor::zeros(&[1 << 16], dev).unwrap();
    let during = dev.stats();
    assert!(during.live_bytes >= before.live_bytes + (1 << 18));
    let view = t.narrow(0, 0, 10).unwrap();
    drop(t);
    assert_eq!(
        dev.stats().live_bytes,
        during.live_bytes,
        "a view keeps the buffer alive"
    );
    drop(view);
    let after = dev.stats();
    assert_eq!(after.live_bytes, before.live_bytes);
    assert!(after.pooled_bytes >= 1 << 18);
}

#[test]
fn peak_memory_is_the_most_live_bytes_since_the_last_reset() {
    let _s = serial();
    let dev = device();
    dev.reset_peak_memory();
    let start = dev.stats();
    assert_eq!(start.peak_live_bytes, start.live_bytes);
    let big = Tensor::zeros(&[1 << 20], dev).unwrap();
    let with_big = dev.stats().live_bytes;
    drop(big);
    let after = dev.stats();
    assert_eq!(after.live_bytes, start.live_bytes);
    assert_eq!(
        after.peak_live_bytes, with_big,
        "the peak outlives the tensor"
    );
    assert!(after.peak_live_bytes >= start.live_bytes + (4 << 20));
    dev.reset_peak_memory();
    assert_eq!(dev.stats().peak_live_bytes, start.live_bytes);
}

#[test]
fn pipelines_are_compiled_once_per_kernel() {
    let _s = serial();
    let dev = device();
    let x = Tensor::ones(&[10], dev).unwrap();
    x.sigmoid().unwrap();
    let before = dev.stats().pipelines;
    for _ in 0..10 {
        x.sigmoid().unwrap();
    }
    assert_eq!(dev.stats().pipelines, before);
}

#[test]
fn both_matmul_kernels_match_the_reference() {
    let _s = serial();
    let dev = Device::software().unwrap();
    let (m, k, n) = (70, 45, 131);
    let da = random_vec(m * k, 1);
    let db = random_vec(k * n, 2);
    let a = Tensor::from_slice(&da, &[m, k], &dev).unwrap();
    let bt = Tensor::from_slice(&db, &[k, n], &dev)
        .unwrap()
        .t()
        .unwrap()
        .contiguous()
        .unwrap()
        .t()
        .unwrap();
    let want: Vec<f64> = (0..m * n)
        .map(|i| {
            (0..k)
                .map(|l| da[(i / n) * k + l] as f64 * db[l * n + i % n] as f64)
                .sum()
        })
        .collect();
    for flavor in [KernelFlavor::Cpu, KernelFlavor::Gpu] {
        dev.set_kernel_flavor(flavor);
        assert_eq!(dev.kernel_flavor(), flavor);
        assert_close(
            &a.matmul(&bt).unwrap().to_vec().unwrap(),
            &want,
            1e-5,
            &format!("{flavor:?}"),
        );
        let batched = a.unsqueeze(0).unwrap().expand(&[3, m, k]).unwrap();
        let got = batched.matmul(&bt).unwrap().to_vec().unwrap();
        assert_close(
            &got[2 * m * n..],
            &want,
            1e-5,
            &format!("{flavor:?} batched"),
        );
    }
}

/// Runs the ops that have CPU and GPU kernels, forward and backward, with `flavor` on a
/// fresh software device, and returns every result.
fn flavored_results(flavor: KernelFlavor) -> Vec<Vec<f32>> {
    let dev = Device::software().unwrap();
    dev.set_kernel_flavor(flavor);
    let data = random_vec(96 * 70, 11);
    let x = Tensor::from_slice(&data, &[96, 70], &dev)
        .unwrap()
        .mul_scalar(4.0)
        .unwrap()
        .requires_grad_(true);
    let labels = Tensor::from_labels((0..96).map(|i| i % 70).collect(), &dev).unwrap();
    let mut out = Vec::new();
    let mut push = |t: Tensor| out.push(t.to_vec().unwrap());
    push(x.sum().unwrap());
    push(x.sum_dims(&[1], false).unwrap());
    push(x.sum_dims(&[0], true).unwrap());
    push(x.mean_dims(&[1], false).unwrap());
    push(x.max_dims(&[1], false).unwrap());
    push(x.max().unwrap());
    push(x.softmax(1).unwrap());
    push(x.log_softmax(1).unwrap());
    push(x.softmax(0).unwrap());
    let loss = nn::loss::cross_entropy(&x, &labels).unwrap();
    push(loss.clone());
    let w = Tensor::from_slice(&random_vec(96 * 70, 12), &[96, 70], &dev).unwrap();
    loss.add(&x.log_softmax(1).unwrap().mul(&w).unwrap().sum().unwrap())
        .unwrap()
        .add(&x.softmax(0).unwrap().mul(&w).unwrap().sum().unwrap())
        .unwrap()
        .backward()
        .unwrap();
    push(x.grad().unwrap());
    let big = Tensor::from_slice(&random_vec(3 * 9000, 13), &[3, 9000], &dev).unwrap();
    push(big.sum_dims(&[1], false).unwrap());
    out
}

#[test]
fn gpu_flavored_reductions_and_row_kernels_match_the_cpu_ones() {
    let _s = serial();
    let cpu = flavored_results(KernelFlavor::Cpu);
    let gpu = flavored_results(KernelFlavor::Gpu);
    for (i, (c, g)) in cpu.iter().zip(&gpu).enumerate() {
        let want: Vec<f64> = c.iter().map(|&v| v as f64).collect();
        assert_close(g, &want, 1e-4, &format!("result {i}"));
    }
}

#[test]
fn two_threads_share_one_device_without_interfering() {
    let _s = serial();
    let dev = device();
    let work = |seed: u64| {
        let dev = dev.clone();
        std::thread::spawn(move || {
            let a = Tensor::randn(&[256, 256], seed, &dev).unwrap();
            let mut acc = Tensor::zeros(&[256, 256], &dev).unwrap();
            for _ in 0..20 {
                acc = acc.add(&a.matmul(&a).unwrap()).unwrap();
            }
            let total = acc.sum().unwrap().item().unwrap();
            let single = a.matmul(&a).unwrap().sum().unwrap().item().unwrap();
            (total, single)
        })
    };
    let (t1, t2) = (work(1), work(2));
    for (total, single) in [t1.join().unwrap(), t2.join().unwrap()] {
        assert!(
            (total - 20.0 * single).abs() <= 1e-3 * total.abs().max(1.0),
            "{total} vs 20 x {single}"
        );
    }
}

/// One thread compiles a fresh device's kernels while another reads values back from it: the
/// device serialises the wgpu calls that take GL's context lock (compiling, submitting,
/// polling, creating buffers) on a lock of its own, and a thread waiting there must neither
/// deadlock nor disturb the other's results.
#[test]
fn a_thread_compiling_kernels_and_one_reading_share_a_fresh_device() {
    let _s = serial();
    let dev = Device::new().unwrap();
    let x = Tensor::from_vec((0..64).map(|i| i as f32 / 64.0).collect(), &[8, 8], &dev).unwrap();
    let compiling = {
        let x = x.clone();
        std::thread::spawn(move || {
            let y = x.exp().unwrap().tanh().unwrap().sigmoid().unwrap();
            let y = y.softmax(1).unwrap().cumsum(0).unwrap().gelu().unwrap();
            y.to_vec().unwrap()
        })
    };
    let reading = {
        let x = x.clone();
        std::thread::spawn(move || {
            (0..20)
                .map(|_| x.sum().unwrap().item().unwrap())
                .collect::<Vec<f32>>()
        })
    };
    let got = compiling.join().unwrap();
    let sums = reading.join().unwrap();
    let want: Vec<f64> = {
        let v: Vec<f64> = (0..64).map(|i| i as f64 / 64.0).collect();
        let sig = |t: f64| 1.0 / (1.0 + (-t).exp());
        let y: Vec<f64> = v.iter().map(|&t| sig(t.exp().tanh())).collect();
        let mut soft = vec![0.0; 64];
        for r in 0..8 {
            let row = &y[r * 8..r * 8 + 8];
            let total: f64 = row.iter().map(|t| t.exp()).sum();
            for c in 0..8 {
                soft[r * 8 + c] = row[c].exp() / total;
            }
        }
        let mut cum = soft.clone();
        for r in 1..8 {
            for c in 0..8 {
                cum[r * 8 + c] += cum[(r - 1) * 8 + c];
            }
        }
        cum.iter().map(|&t| gelu_ref(t)).collect()
    };
    assert_close(
        &got,
        &want,
        1e-4,
        "exp, tanh, sigmoid, softmax, cumsum, gelu",
    );
    let total: f32 = (0..64).map(|i| i as f32 / 64.0).sum();
    for s in sums {
        assert!((s - total).abs() <= 1e-4 * total, "sum {s}, want {total}");
    }
}

#[test]
fn matmul_reads_transposed_operands_without_copying_them() {
    let _s = serial();
    let dev = device();
    let a = Tensor::randn(&[40, 30], 1, dev).unwrap();
    let b = Tensor::randn(&[50, 40], 2, dev).unwrap();
    let before = dev.stats();
    let _c = a.t().unwrap().matmul(&b.t().unwrap()).unwrap();
    assert_eq!(
        dev.stats().dispatches - before.dispatches,
        1,
        "one matmul kernel and no copies"
    );
}

#[test]
fn the_grad_of_a_transposed_weight_needs_no_strided_copy() {
    let _s = serial();
    let dev = device();
    // Both dims of the weight at least 64, so no product here takes the narrow-output path.
    let x = Tensor::randn(&[16, 80], 1, dev).unwrap();
    let w = Tensor::randn(&[72, 80], 2, dev)
        .unwrap()
        .requires_grad_(true);
    let loss = x.matmul(&w.t().unwrap()).unwrap().sum().unwrap();
    dev.synchronize().unwrap();
    let before = dev.stats().dispatches;
    loss.backward().unwrap();
    // The seed grad (a fill of ones) and g^T x written in the weight's own layout; the grad is
    // then installed by a buffer copy, with no strided-copy kernel.
    assert_eq!(dev.stats().dispatches - before, 2);
    assert!(w.grad().unwrap().is_contiguous());
}
