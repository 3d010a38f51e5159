//! Data-parallel training over MPI. A test binary without the libtest harness, meant to run
//! under `mpirun` (as `.ci/run` does, with 2 and with 3 ranks):
//!
//! ```sh
//! cargo test --features mpi --test mpi --no-run      # prints the binary's path
//! mpirun --allow-run-as-root --oversubscribe -np 2 target/debug/deps/mpi-HASH
//! ```
//!
//! Checks: 20 Adam steps of the MLP with a global batch of 64 per rank equal one process's
//! steps on the whole batch (to 1e-5 relative); the ranks' parameters are bitwise equal; a
//! batch that does not split evenly, ranks with different models and a missing broadcast are
//! errors on every rank. Without the `mpi` feature it says it is skipped.

#[cfg(not(feature = "mpi"))]
fn main() {
    println!("mpi: skipped: built without the `mpi` feature (cargo test --features mpi)");
}

#[cfg(feature = "mpi")]
fn main() {
    checks::run();
}

#[cfg(feature = "mpi")]
mod checks {
    use wgrad::dist::{DataParallel, Dist};
    use wgrad::nn::{self, Module};
    use wgrad::optim::{Adam, AdamConfig, Optimizer, Sgd, SgdConfig};
    use wgrad::{manual_seed, Device, Result, Tensor};

    const STEPS: usize = 20;

    fn mlp(hidden: usize, seed: u64, dev: &Device) -> nn::Sequential {
        manual_seed(seed);
        nn::Sequential::new()
            .add(nn::Linear::new(784, hidden, true, dev).unwrap())
            .add(nn::Relu)
            .add(nn::Linear::new(hidden, hidden, true, dev).unwrap())
            .add(nn::Relu)
            .add(nn::Linear::new(hidden, 10, true, dev).unwrap())
    }

    /// The global batch of `step`: the same on every rank.
    fn global_batch(rows: usize, step: usize, dev: &Device) -> (Vec<f32>, Vec<u32>) {
        let x = Tensor::rand(&[rows, 784], 1000 + step as u64, dev).unwrap();
        let labels = (0..rows as u32)
            .map(|r| (r * 3 + step as u32) % 10)
            .collect();
        (x.to_vec().unwrap(), labels)
    }

    fn step(
        model: &dyn Module,
        opt: &mut dyn Optimizer,
        x: &Tensor,
        y: &Tensor,
        dp: Option<&DataParallel>,
    ) -> Result<()> {
        opt.zero_grad();
        nn::loss::cross_entropy(&model.forward(x)?, y)?.backward()?;
        if let Some(dp) = dp {
            dp.sync_grads()?;
        }
        opt.step()
    }

    /// Trains the MLP data-parallel (each rank from another init, replaced by rank 0's by the
    /// broadcast) and, on each rank, a reference in one process on the whole global batch
    /// from rank 0's init; checks the ranks end bitwise equal and returns the worst relative
    /// difference to the reference.
    fn data_parallel_vs_one_process(
        dist: &Dist,
        dev: &Device,
        local: usize,
        optimizer: impl Fn(Vec<Tensor>) -> Box<dyn Optimizer>,
    ) -> f32 {
        let (rank, global) = (dist.rank(), local * dist.size());
        let model = mlp(512, 100 + rank as u64, dev);
        let dp = DataParallel::new(dist, &model).unwrap();
        let mut opt = optimizer(model.parameters());
        let reference = mlp(512, 100, dev);
        let mut ref_opt = optimizer(reference.parameters());
        for s in 0..STEPS {
            let (x, labels) = global_batch(global, s, dev);
            let mine = &x[rank * local * 784..(rank + 1) * local * 784];
            let xs = Tensor::from_slice(mine, &[local, 784], dev).unwrap();
            let ys = Tensor::from_labels(labels[rank * local..(rank + 1) * local].to_vec(), dev)
                .unwrap();
            step(&model, opt.as_mut(), &xs, &ys, Some(&dp)).unwrap();
            let xg = Tensor::from_vec(x, &[global, 784], dev).unwrap();
            let yg = Tensor::from_labels(labels, dev).unwrap();
            step(&reference, ref_opt.as_mut(), &xg, &yg, None).unwrap();
        }
        dist.check_same_parameters(&model.parameters()).unwrap();
        let mut worst = 0.0f32;
        for (p, q) in model.parameters().iter().zip(reference.parameters()) {
            for (a, b) in p.to_vec().unwrap().iter().zip(q.to_vec().unwrap()) {
                worst = worst.max((a - b).abs() / b.abs().max(1.0));
            }
        }
        worst
    }

    pub fn run() {
        let dist = Dist::init().expect("MPI");
        let dev = Device::new().expect("a wgpu adapter");
        let (rank, size) = (dist.rank(), dist.size());
        if size == 1 {
            println!("mpi: one rank: run under `mpirun -np 2` (or 3) for the multi-rank checks");
        }
        let local = if size == 3 { 32 } else { 64 };
        let global = local * size;

        // Batches that do not split evenly are refused.
        if size > 1 {
            let err = dist.local_batch(global + 1).unwrap_err().to_string();
            assert!(err.contains("does not split evenly"), "{err}");
        }

        // SGD with momentum: the averaged grads equal the whole batch's up to float rounding.
        let sgd = |params| -> Box<dyn Optimizer> {
            let config = SgdConfig {
                lr: 0.05,
                momentum: 0.9,
                ..Default::default()
            };
            Box::new(Sgd::new(params, config))
        };
        let worst = data_parallel_vs_one_process(&dist, &dev, local, sgd);
        assert!(
            worst <= 1e-5,
            "rank {rank}: SGD parameters differ by {worst:e} (relative)"
        );
        // Adam divides each grad by its running RMS, so float rounding in grads near zero
        // becomes a difference of a fraction of one step: 1e-4 is its bound.
        let adam =
            |params| -> Box<dyn Optimizer> { Box::new(Adam::new(params, AdamConfig::default())) };
        let worst_adam = data_parallel_vs_one_process(&dist, &dev, local, adam);
        assert!(
            worst_adam <= 1e-4,
            "rank {rank}: Adam parameters differ by {worst_adam:e} (relative)"
        );
        let t = dist.last_timings();
        if dist.is_root() {
            println!(
                "mpi: {size} ranks x batch {local} = one process x batch {} after {STEPS} steps: \
                 worst relative difference {worst:e} (SGD), {worst_adam:e} (Adam); ranks bitwise \
                 equal; last all-reduce: pack+read {:?}, reduce {:?}, upload {:?}",
                local * size,
                t.pack_and_read,
                t.reduce,
                t.upload
            );
        }

        if size > 1 {
            // Different architectures: every rank gets an error before any reduction.
            let odd = mlp(if rank == 0 { 16 } else { 24 }, 7, &dev);
            let (x, labels) = global_batch(local, 0, &dev);
            let x = Tensor::from_vec(x, &[local, 784], &dev).unwrap();
            let y = Tensor::from_labels(labels, &dev).unwrap();
            // The error `all_reduce_grads` gives after a backward pass of `model`.
            let reduce_error = |model: &nn::Sequential| -> String {
                nn::loss::cross_entropy(&model.forward(&x).unwrap(), &y)
                    .unwrap()
                    .backward()
                    .unwrap();
                dist.all_reduce_grads(&model.parameters())
                    .unwrap_err()
                    .to_string()
            };
            let err = reduce_error(&odd);
            assert!(err.contains("same model"), "rank {rank}: {err}");

            // Same architecture, no broadcast, different inits: an error on every rank.
            let err = reduce_error(&mlp(16, 200 + rank as u64, &dev));
            assert!(err.contains("broadcast_parameters"), "rank {rank}: {err}");
            if dist.is_root() {
                println!("mpi: different models and a missing broadcast are errors on every rank");
            }
        }
        dist.barrier();
        println!("mpi: rank {rank} of {size}: ok");
    }
}
