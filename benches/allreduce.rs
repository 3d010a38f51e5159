//! `Dist::all_reduce_grads` at the MLP's 0.67M parameters and at 10M, split into pack +
//! read-back, reduction and upload. Run it under MPI (built with the `mpi` feature):
//!
//! ```sh
//! cargo bench --features mpi --bench allreduce --no-run     # prints the binary's path
//! mpirun --allow-run-as-root --oversubscribe -np 2 target/release/deps/allreduce-HASH
//! ```

use std::time::{Duration, Instant};

use wgrad::dist::Dist;
use wgrad::{Device, Tensor};

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn main() {
    let dist = Dist::init().expect("MPI");
    let dev = Device::new().expect("a wgpu adapter");
    if dist.is_root() {
        println!("adapter: {}; {} ranks", dev.info(), dist.size());
    }
    let mlp = vec![784 * 512, 512, 512 * 512, 512, 512 * 10, 10];
    let ten_million = vec![2_500_000; 4];
    for (name, sizes) in [("MLP 784-512-512-10", mlp), ("10M parameters", ten_million)] {
        let params: Vec<Tensor> = sizes
            .iter()
            .map(|&n| Tensor::zeros(&[n], &dev).unwrap().requires_grad_(true))
            .collect();
        let count: usize = sizes.iter().sum();
        let (mut pack, mut reduce, mut upload, mut total) = (vec![], vec![], vec![], vec![]);
        for rep in 0..13 {
            for (i, p) in params.iter().enumerate() {
                let seed = (dist.rank() * 100 + i) as u64;
                p.set_grad(Some(Tensor::rand(p.shape(), seed, &dev).unwrap()))
                    .unwrap();
            }
            dev.synchronize().unwrap();
            dist.barrier();
            let start = Instant::now();
            dist.all_reduce_grads(&params).unwrap();
            dev.synchronize().unwrap();
            let elapsed = start.elapsed();
            let t = dist.last_timings();
            if rep >= 3 {
                pack.push(t.pack_and_read);
                reduce.push(t.reduce);
                // Scaling, uploading and installing, until the device has the grads.
                upload.push(elapsed - t.pack_and_read - t.reduce);
                total.push(elapsed);
            }
        }
        if dist.is_root() {
            let mb = count as f64 * 4.0 / 1e6;
            println!(
                "{name} ({count} parameters, {mb:.1} MB of grads): all_reduce_grads {:.2?} = pack + \
                 read-back {:.2?}, reduction {:.2?}, upload {:.2?} (medians of 10)",
                median(total),
                median(pack),
                median(reduce),
                median(upload),
            );
        }
    }
}
