//! In-memory classification datasets: MNIST-format directories and synthetic sets.

use std::path::{Path, PathBuf};

use rand::{Rng, SeedableRng};
use rand_distr::{Distribution, Normal};

use crate::error::{Error, Result};
use crate::io::idx::{read_idx_images, read_idx_labels};
use crate::io::io_error;

/// Examples as rows of `features` f32 values, with a u32 class label each.
#[derive(Debug, Clone)]
pub struct Dataset {
    /// `len() * features` values, one example after another.
    pub inputs: Vec<f32>,
    /// One label per example, below `classes`.
    pub labels: Vec<u32>,
    /// Values per example.
    pub features: usize,
    /// Number of classes.
    pub classes: usize,
}

impl Dataset {
    /// Number of examples.
    pub fn len(&self) -> usize {
        self.labels.len()
    }

    /// True when there are no examples.
    pub fn is_empty(&self) -> bool {
        self.labels.is_empty()
    }

    /// Examples `indices` as `(inputs, labels)`, for one batch.
    pub fn batch(&self, indices: &[usize]) -> (Vec<f32>, Vec<u32>) {
        let mut inputs = Vec::with_capacity(indices.len() * self.features);
        for &i in indices {
            inputs.extend_from_slice(&self.inputs[i * self.features..(i + 1) * self.features]);
        }
        (inputs, indices.iter().map(|&i| self.labels[i]).collect())
    }
}

/// `dir/name`, or `dir/name.gz` when only that exists.
fn find(dir: &Path, name: &str) -> Result<PathBuf> {
    let plain = dir.join(name);
    let gz = dir.join(format!("{name}.gz"));
    match (plain.exists(), gz.exists()) {
        (true, _) => Ok(plain),
        (false, true) => Ok(gz),
        _ => Err(io_error(
            "load_idx_dir",
            &plain,
            format!("missing (looked for {name} and {name}.gz)"),
        )),
    }
}

fn load_split(dir: &Path, images: &str, labels: &str) -> Result<Dataset> {
    let images_path = find(dir, images)?;
    let (inputs, count, rows, cols) = read_idx_images(&images_path)?;
    let labels = read_idx_labels(find(dir, labels)?)?;
    if labels.len() != count {
        return Err(Error::InvalidArgument {
            op: "load_idx_dir",
            msg: format!(
                "{} has {count} images but its label file has {} labels",
                images_path.display(),
                labels.len()
            ),
        });
    }
    let classes = labels.iter().max().map_or(0, |&m| m as usize + 1);
    Ok(Dataset {
        inputs,
        labels,
        features: rows * cols,
        classes,
    })
}

/// The train and test splits of an MNIST-format directory: `train-images-idx3-ubyte`,
/// `train-labels-idx1-ubyte`, `t10k-images-idx3-ubyte`, `t10k-labels-idx1-ubyte`, each
/// optionally gzip-compressed (`.gz`).
pub fn load_idx_dir(dir: impl AsRef<Path>) -> Result<(Dataset, Dataset)> {
    let dir = dir.as_ref();
    if !dir.is_dir() {
        return Err(io_error("load_idx_dir", dir, "not a directory"));
    }
    // The two splits decompress on two threads: gunzipping the train images is most of a
    // training run's start-up.
    let (train, test) = std::thread::scope(|scope| {
        let test =
            scope.spawn(|| load_split(dir, "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"));
        let train = load_split(dir, "train-images-idx3-ubyte", "train-labels-idx1-ubyte");
        let test = test
            .join()
            .unwrap_or_else(|panic| std::panic::resume_unwind(panic));
        (train, test)
    });
    let (mut train, mut test) = (train?, test?);
    if train.features != test.features {
        return Err(Error::InvalidArgument {
            op: "load_idx_dir",
            msg: format!(
                "train images have {} pixels, test images {}",
                train.features, test.features
            ),
        });
    }
    let classes = train.classes.max(test.classes);
    train.classes = classes;
    test.classes = classes;
    Ok((train, test))
}

/// A seeded synthetic classification set that no linear model separates: `classes`
/// interleaved spiral arms in the plane, with Gaussian noise, as `(train, test)` of `n_train`
/// and `n_test` examples.
pub fn synthetic_spirals(
    classes: usize,
    n_train: usize,
    n_test: usize,
    seed: u64,
) -> (Dataset, Dataset) {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let noise = Normal::new(0.0f32, 0.025).expect("valid normal");
    let mut make = |n: usize| {
        let mut inputs = Vec::with_capacity(2 * n);
        let mut labels = Vec::with_capacity(n);
        for _ in 0..n {
            let class = rng.random_range(0..classes);
            let t: f32 = rng.random::<f32>();
            let radius = 0.1 + t;
            let angle = 3.0 * t * std::f32::consts::PI
                + class as f32 * 2.0 * std::f32::consts::PI / classes as f32;
            inputs.push(radius * angle.cos() + noise.sample(&mut rng));
            inputs.push(radius * angle.sin() + noise.sample(&mut rng));
            labels.push(class as u32);
        }
        Dataset {
            inputs,
            labels,
            features: 2,
            classes,
        }
    };
    let train = make(n_train);
    let test = make(n_test);
    (train, test)
}

/// Side of the images [`synthetic_shapes`] draws.
pub const SHAPES_SIDE: usize = 16;

/// A seeded synthetic image set for convolutional models: `SHAPES_SIDE x SHAPES_SIDE` images
/// (rows of pixels in `[0, 1]`, as IDX images load) of four classes drawn at random places
/// and sizes over Gaussian noise: a horizontal bar, a vertical bar, a square outline and a
/// diagonal cross. `(train, test)` of `n_train` and `n_test` examples.
pub fn synthetic_shapes(n_train: usize, n_test: usize, seed: u64) -> (Dataset, Dataset) {
    const SIDE: usize = SHAPES_SIDE;
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let noise = Normal::new(0.0f32, 0.15).expect("valid normal");
    let mut make = |n: usize| {
        let mut inputs = Vec::with_capacity(n * SIDE * SIDE);
        let mut labels = Vec::with_capacity(n);
        for _ in 0..n {
            let class = rng.random_range(0..4u32);
            let size = rng.random_range(5..=10usize);
            let (top, left) = (
                rng.random_range(0..=SIDE - size),
                rng.random_range(0..=SIDE - size),
            );
            let mut image = [0.0f32; SIDE * SIDE];
            for i in 0..size {
                let mid = size / 2;
                let pixels = match class {
                    0 => vec![(mid, i)],
                    1 => vec![(i, mid)],
                    2 => vec![(0, i), (size - 1, i), (i, 0), (i, size - 1)],
                    _ => vec![(i, i), (i, size - 1 - i)],
                };
                for (y, x) in pixels {
                    image[(top + y) * SIDE + left + x] = 1.0;
                }
            }
            inputs.extend(
                image
                    .iter()
                    .map(|&v| (v + noise.sample(&mut rng)).clamp(0.0, 1.0)),
            );
            labels.push(class);
        }
        Dataset {
            inputs,
            labels,
            features: SIDE * SIDE,
            classes: 4,
        }
    };
    let train = make(n_train);
    let test = make(n_test);
    (train, test)
}
