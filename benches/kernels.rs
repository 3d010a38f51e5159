//! Kernel benches on whatever adapter `Device::new()` picks. Each iteration records the op and
//! waits for it (`synchronize`), so the figures include one submission per iteration.
//!
//! matmul reports GFLOP/s as criterion's "elem/s" (2 m n k per product); the memory-bound
//! benches report bytes read + written per second, beside `copy_buffer_to_buffer`
//! (`deep_clone` of a contiguous tensor), the ceiling for elementwise work.

use std::time::Duration;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use wgrad::{DType, Device, F16Reads, Tensor};

fn device() -> Device {
    let dev = Device::new().expect("a wgpu adapter");
    eprintln!(
        "adapter: {} (kernel flavor {:?})",
        dev.info(),
        dev.kernel_flavor()
    );
    dev
}

fn matmul(c: &mut Criterion, dev: &Device) {
    let mut group = c.benchmark_group("matmul");
    for n in [256usize, 512, 1024] {
        let a = Tensor::randn(&[n, n], 1, dev).unwrap();
        let b = Tensor::randn(&[n, n], 2, dev).unwrap();
        group.throughput(Throughput::Elements(2 * (n * n * n) as u64));
        group.bench_with_input(BenchmarkId::from_parameter(n), &n, |bench, _| {
            bench.iter(|| {
                let _c = a.matmul(&b).unwrap();
                dev.synchronize().unwrap();
            })
        });
    }
    group.finish();
}

fn memory_bound(c: &mut Criterion, dev: &Device) {
    const N: usize = 16 << 20;
    let bytes = (N * 4) as u64;
    let a = Tensor::randn(&[N], 1, dev).unwrap();
    let b = Tensor::randn(&[N], 2, dev).unwrap();
    let square = Tensor::randn(&[4096, 4096], 3, dev).unwrap();
    let logits = Tensor::randn(&[4096, 1024], 4, dev).unwrap();
    let mut group = c.benchmark_group("memory");

    group.throughput(Throughput::Bytes(2 * bytes));
    group.bench_function("copy_buffer_to_buffer_16M", |bench| {
        bench.iter(|| {
            let _c = a.deep_clone().unwrap();
            dev.synchronize().unwrap();
        })
    });
    group.throughput(Throughput::Bytes(3 * bytes));
    group.bench_function("add_16M", |bench| {
        bench.iter(|| {
            let _c = a.add(&b).unwrap();
            dev.synchronize().unwrap();
        })
    });
    group.throughput(Throughput::Bytes(bytes));
    group.bench_function("sum_all_16M", |bench| {
        bench.iter(|| {
            let _s = a.sum().unwrap();
            dev.synchronize().unwrap();
        })
    });
    group.bench_function("sum_last_axis_4096x4096", |bench| {
        bench.iter(|| {
            let _s = square.sum_dims(&[1], false).unwrap();
            dev.synchronize().unwrap();
        })
    });
    group.throughput(Throughput::Bytes(2 * (4096 * 1024 * 4) as u64));
    group.bench_function("softmax_4096x1024", |bench| {
        bench.iter(|| {
            let _s = logits.softmax(1).unwrap();
            dev.synchronize().unwrap();
        })
    });
    group.finish();
}

/// RMSNorm forward + backward over a Llama-sized activation, fused against the same math
/// composed of elementwise ops and reductions (the ops issue's bar: fused at most 0.5x).
fn rms_norm(c: &mut Criterion, dev: &Device) {
    let x = Tensor::randn(&[2048, 512], 5, dev)
        .unwrap()
        .requires_grad_(true);
    let w = Tensor::ones(&[512], dev).unwrap().requires_grad_(true);
    let mut group = c.benchmark_group("rms_norm_fwd_bwd_2048x512");
    let run = |f: &dyn Fn() -> wgrad::Result<Tensor>| {
        x.zero_grad();
        w.zero_grad();
        f().unwrap().sum().unwrap().backward().unwrap();
        dev.synchronize().unwrap();
    };
    group.bench_function("fused", |bench| {
        bench.iter(|| run(&|| x.rms_norm(&w, 1e-6)))
    });
    group.bench_function("composed", |bench| {
        bench.iter(|| {
            run(&|| {
                let mean_square = x.mul(&x)?.mean_dims(&[1], true)?;
                x.mul(&mean_square.add_scalar(1e-6)?.rsqrt()?)?.mul(&w)
            })
        })
    });
    group.finish();
}

/// GroupNorm forward + backward over a U-Net activation `[8, 64, 32, 32]` in 32 groups, each
/// group a row of LayerNorm's fused kernels, against the same math composed of reductions and
/// elementwise ops (how group_norm ran before).
fn group_norm(c: &mut Criterion, dev: &Device) {
    let (n, ch, hw, groups) = (8, 64, 32, 32);
    let x = Tensor::randn(&[n, ch, hw, hw], 7, dev)
        .unwrap()
        .requires_grad_(true);
    let w = Tensor::ones(&[ch], dev).unwrap().requires_grad_(true);
    let b = Tensor::zeros(&[ch], dev).unwrap().requires_grad_(true);
    let mut group = c.benchmark_group("group_norm_fwd_bwd_8x64x32x32_g32");
    let run = |f: &dyn Fn() -> wgrad::Result<Tensor>| {
        for t in [&x, &w, &b] {
            t.zero_grad();
        }
        f().unwrap().sum().unwrap().backward().unwrap();
        dev.synchronize().unwrap();
    };
    group.bench_function("fused_rows", |bench| {
        bench.iter(|| run(&|| x.group_norm(groups, Some(&w), Some(&b), 1e-5)))
    });
    group.bench_function("composed", |bench| {
        bench.iter(|| {
            run(&|| {
                let rows = x.reshape(&[n, groups, ch / groups * hw * hw])?;
                let centred = rows.sub(&rows.mean_dims(&[2], true)?)?;
                let var = centred.mul(&centred)?.mean_dims(&[2], true)?;
                let normed = centred.mul(&var.add_scalar(1e-5)?.rsqrt()?)?;
                let normed = normed.reshape(&[n, ch, hw, hw])?;
                normed
                    .mul(&w.reshape(&[1, ch, 1, 1])?)?
                    .add(&b.reshape(&[1, ch, 1, 1])?)
            })
        })
    });
    group.finish();
}

/// Rotary embeddings forward + backward over a Llama-sized q `[B 4, H 8, T 256, D 64]`, the
/// fused kernel against the same math composed as Hugging Face writes it, `x cos +
/// rotate_half(x) sin` with host-free tables (the ops issue's bar: fused at most 0.5x).
fn rope(c: &mut Criterion, dev: &Device) {
    let (b, h, t, d) = (4, 8, 256, 64);
    let x = Tensor::randn(&[b, h, t, d], 6, dev)
        .unwrap()
        .requires_grad_(true);
    let rope = wgrad::nn::RotaryEmbedding::new(d, t, 10000.0, dev).unwrap();
    // The composition's tables [T, D]: angles position * theta^(-2j / D), the halves repeated.
    let (cos, sin) = {
        let half = d / 2;
        let inv_freq: Vec<f32> = (0..half)
            .map(|j| 10000f32.powf(-((2 * j) as f32) / d as f32))
            .collect();
        let angles: Vec<f32> = (0..t)
            .flat_map(|p| (0..d).map(move |j| (p, j)))
            .map(|(p, j)| p as f32 * inv_freq[j % half])
            .collect();
        let angles = Tensor::from_vec(angles, &[t, d], dev).unwrap();
        (angles.cos().unwrap(), angles.sin().unwrap())
    };
    let mut group = c.benchmark_group("rope_fwd_bwd_4x8x256x64");
    let run = |f: &dyn Fn() -> wgrad::Result<Tensor>| {
        x.zero_grad();
        f().unwrap().sum().unwrap().backward().unwrap();
        dev.synchronize().unwrap();
    };
    group.bench_function("fused", |bench| bench.iter(|| run(&|| rope.apply(&x, 0))));
    group.bench_function("composed", |bench| {
        bench.iter(|| {
            run(&|| {
                let half = d / 2;
                let rotated =
                    Tensor::cat(&[x.narrow(3, half, half)?.neg()?, x.narrow(3, 0, half)?], 3)?;
                x.mul(&cos)?.add(&rotated.mul(&sin)?)
            })
        })
    });
    group.finish();
}

/// The F16 read paths in one run (WGSL `f16` bindings where the adapter has `SHADER_F16`,
/// packed words through the adapter's conversions, integer arithmetic): a 512 matmul of F16
/// operands and an F16 `exp` over 4M elements (its result F16 too).
fn f16_reads(c: &mut Criterion, dev: &Device) {
    const N: usize = 4 << 20;
    let mut group = c.benchmark_group("f16_reads");
    let a = Tensor::randn(&[512, 512], 1, dev)
        .unwrap()
        .to_dtype(DType::F16)
        .unwrap();
    let b = Tensor::randn(&[512, 512], 2, dev)
        .unwrap()
        .to_dtype(DType::F16)
        .unwrap();
    let x = Tensor::randn(&[N], 3, dev)
        .unwrap()
        .to_dtype(DType::F16)
        .unwrap();
    let default_reads = dev.f16_reads();
    for reads in [F16Reads::Native, F16Reads::Hardware, F16Reads::Integer] {
        if dev.set_f16_reads(reads).is_err() {
            continue; // Native, on an adapter without SHADER_F16
        }
        group.throughput(Throughput::Elements(2 * 512 * 512 * 512));
        group.bench_function(format!("matmul_512/{reads:?}"), |bench| {
            bench.iter(|| {
                let _c = a.matmul(&b).unwrap();
                dev.synchronize().unwrap();
            })
        });
        group.throughput(Throughput::Bytes((N * 4) as u64));
        group.bench_function(format!("exp_4M/{reads:?}"), |bench| {
            bench.iter(|| {
                let _y = x.exp().unwrap();
                dev.synchronize().unwrap();
            })
        });
    }
    dev.set_f16_reads(default_reads).unwrap();
    group.finish();
}

fn benches(c: &mut Criterion) {
    let dev = device();
    matmul(c, &dev);
    memory_bound(c, &dev);
    rms_norm(c, &dev);
    group_norm(c, &dev);
    rope(c, &dev);
    f16_reads(c, &dev);
}

criterion_group! {
    name = kernels;
    config = Criterion::default().sample_size(10).warm_up_time(Duration::from_secs(1)).measurement_time(Duration::from_secs(3));
    targets = benches
}
criterion_main!(kernels);
