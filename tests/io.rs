//! Checkpoints (safetensors) and MNIST-format IDX files, on real files in temporary
//! directories.

mod common;
use common::*;
use std::io::Write;
use std::path::Path;
use wgrad::nn::{self, Module};
use wgrad::{io, Error, Tensor};

fn mlp() -> nn::Sequential {
    let dev = device();
    nn::Sequential::new()
        .add(nn::Linear::new(3, 4, true, dev).unwrap())
        .add(nn::Relu)
        .add(nn::Linear::new(4, 2, true, dev).unwrap())
}

fn snapshot(m: &dyn Module) -> Vec<Vec<u32>> {
    m.parameters()
        .iter()
        .map(|p| p.to_vec().unwrap().iter().map(|v| v.to_bits()).collect())
        .collect()
}

#[test]
fn a_checkpoint_round_trip_gives_bit_identical_parameters() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("model.safetensors");
    let net = mlp();
    let saved = snapshot(&net);
    io::save(&path, &net).unwrap();
    let other = mlp();
    assert_ne!(snapshot(&other), saved);
    let ids: Vec<u64> = other.parameters().iter().map(|p| p.storage_id()).collect();
    io::load(&path, &other).unwrap();
    assert_eq!(snapshot(&other), saved);
    assert_eq!(
        other
            .parameters()
            .iter()
            .map(|p| p.storage_id())
            .collect::<Vec<_>>(),
        ids,
        "loaded in place"
    );
    let names: Vec<String> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into())
        .collect();
    assert_eq!(
        names,
        vec!["model.safetensors"],
        "no temporary file is left behind"
    );
}

#[test]
fn a_checkpoint_is_a_standard_safetensors_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("m.safetensors");
    let net = mlp();
    io::save(&path, &net).unwrap();
    let bytes = std::fs::read(&path).unwrap();
    let header_len = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header = std::str::from_utf8(&bytes[8..8 + header_len]).unwrap();
    for name in ["0.weight", "0.bias", "2.weight", "2.bias"] {
        assert!(header.contains(&format!("\"{name}\"")), "{header}");
    }
    assert!(
        header.contains("\"F32\"") && header.contains("[4,3]"),
        "{header}"
    );
}

/// A checkpoint gets the permissions any new file gets (the umask's), not a temporary
/// file's private ones: others can read it where they can read the user's other files.
#[cfg(unix)]
#[test]
fn a_checkpoint_has_the_permissions_of_a_new_file() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("m.safetensors");
    io::save(&path, &mlp()).unwrap();
    let plain = dir.path().join("plain");
    std::fs::File::create(&plain).unwrap();
    let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode(&path), mode(&plain));
}

fn assert_unchanged_after(net: &dyn Module, err: Error, needle: &str, before: &[Vec<u32>]) {
    assert!(err.to_string().contains(needle), "{err}");
    assert_eq!(snapshot(net), before, "the module is unchanged");
}

#[test]
fn loading_a_checkpoint_with_a_missing_tensor_names_it_and_changes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("linear.safetensors");
    io::save(&path, &nn::Linear::new(3, 4, true, device()).unwrap()).unwrap();
    let net = mlp();
    let before = snapshot(&net);
    let err = io::load(&path, &net).unwrap_err();
    assert!(matches!(err, Error::Io { op: "io::load", .. }), "{err:?}");
    assert_unchanged_after(&net, err, "\"0.weight\"", &before);
}

#[test]
fn loading_a_checkpoint_with_a_wrong_shape_names_the_tensor_and_changes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("wide.safetensors");
    let wide = nn::Sequential::new()
        .add(nn::Linear::new(3, 4, true, device()).unwrap())
        .add(nn::Relu)
        .add(nn::Linear::new(4, 5, true, device()).unwrap());
    io::save(&path, &wide).unwrap();
    let net = mlp();
    let before = snapshot(&net);
    let err = io::load(&path, &net).unwrap_err();
    assert!(
        matches!(err, Error::Shape { op: "io::load", .. }),
        "{err:?}"
    );
    assert_unchanged_after(&net, err, "\"2.weight\"", &before);
}

#[test]
fn loading_a_corrupt_file_is_an_error_that_changes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("corrupt.safetensors");
    let net = mlp();
    io::save(&path, &net).unwrap();
    let mut bytes = std::fs::read(&path).unwrap();
    bytes.truncate(bytes.len() / 2);
    std::fs::write(&path, &bytes).unwrap();
    let other = mlp();
    let before = snapshot(&other);
    let err = io::load(&path, &other).unwrap_err();
    assert!(matches!(err, Error::Io { op: "io::load", .. }), "{err:?}");
    assert_unchanged_after(&other, err, "corrupt.safetensors", &before);
    std::fs::write(&path, b"not a checkpoint at all").unwrap();
    assert!(matches!(
        io::load(&path, &other).unwrap_err(),
        Error::Io { .. }
    ));
    assert!(matches!(
        io::load(dir.path().join("absent"), &other).unwrap_err(),
        Error::Io { .. }
    ));
}

/// Writes an IDX file (optionally gzipped) with `magic`, `dims` and `payload`.
fn write_idx(path: &Path, magic: u32, dims: &[u32], payload: &[u8], gzip: bool) {
    let mut bytes = magic.to_be_bytes().to_vec();
    for d in dims {
        bytes.extend_from_slice(&d.to_be_bytes());
    }
    bytes.extend_from_slice(payload);
    let file = std::fs::File::create(path).unwrap();
    if gzip {
        let mut enc = flate2::write::GzEncoder::new(file, flate2::Compression::default());
        enc.write_all(&bytes).unwrap();
        enc.finish().unwrap();
    } else {
        let mut file = file;
        file.write_all(&bytes).unwrap();
    }
}

/// A small MNIST-format directory: `train` and `test` images of 3x4 pixels.
fn write_idx_dir(dir: &Path, train: usize, test: usize, gzip: bool) {
    let suffix = if gzip { ".gz" } else { "" };
    for (prefix, n) in [("train", train), ("t10k", test)] {
        let pixels: Vec<u8> = (0..n * 12).map(|i| (i * 7 % 256) as u8).collect();
        let labels: Vec<u8> = (0..n).map(|i| (i % 10) as u8).collect();
        write_idx(
            &dir.join(format!("{prefix}-images-idx3-ubyte{suffix}")),
            0x803,
            &[n as u32, 3, 4],
            &pixels,
            gzip,
        );
        write_idx(
            &dir.join(format!("{prefix}-labels-idx1-ubyte{suffix}")),
            0x801,
            &[n as u32],
            &labels,
            gzip,
        );
    }
}

#[test]
fn an_idx_directory_loads_plain_and_gzipped() {
    for gzip in [false, true] {
        let dir = tempfile::tempdir().unwrap();
        write_idx_dir(dir.path(), 25, 12, gzip);
        let (train, test) = io::load_idx_dir(dir.path()).unwrap();
        assert_eq!(
            (train.len(), test.len(), train.features, train.classes),
            (25, 12, 12, 10)
        );
        assert_eq!(train.inputs[1], 7.0 / 255.0);
        assert_eq!(test.labels[11], 1);
        let (inputs, labels) = train.batch(&[2, 0]);
        assert_eq!(labels, vec![2, 0]);
        assert_eq!(inputs[..12], train.inputs[24..36]);
    }
}

#[test]
fn idx_errors_name_the_file_and_the_problem() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path();
    write_idx(&p.join("bad-magic"), 0x804, &[1, 2, 2], &[0; 4], false);
    let err = io::read_idx_images(p.join("bad-magic")).unwrap_err();
    assert!(
        matches!(err, Error::Io { .. })
            && err.to_string().contains("bad magic number")
            && err.to_string().contains("bad-magic"),
        "{err}"
    );
    write_idx(&p.join("short"), 0x803, &[3, 2, 2], &[0; 5], false);
    let err = io::read_idx_images(p.join("short")).unwrap_err();
    assert!(err.to_string().contains("truncated"), "{err}");
    std::fs::write(p.join("tiny"), [0u8, 0]).unwrap();
    assert!(io::read_idx_labels(p.join("tiny"))
        .unwrap_err()
        .to_string()
        .contains("truncated"));
    // Image and label counts that disagree.
    let mismatched = tempfile::tempdir().unwrap();
    write_idx_dir(mismatched.path(), 5, 5, false);
    write_idx(
        &mismatched.path().join("train-labels-idx1-ubyte"),
        0x801,
        &[4],
        &[0; 4],
        false,
    );
    let err = io::load_idx_dir(mismatched.path()).unwrap_err();
    assert!(
        err.to_string().contains("5 images") && err.to_string().contains("4 labels"),
        "{err}"
    );
    // A missing directory or file.
    assert!(matches!(
        io::load_idx_dir(p.join("nope")).unwrap_err(),
        Error::Io { .. }
    ));
    let err = io::load_idx_dir(p).unwrap_err();
    assert!(err.to_string().contains("train-images-idx3-ubyte"), "{err}");
}

#[test]
fn the_synthetic_set_is_seeded_balanced_enough_and_labelled_in_range() {
    let (train, test) = io::synthetic_spirals(4, 2000, 500, 3);
    let (again, _) = io::synthetic_spirals(4, 2000, 500, 3);
    assert_eq!(train.inputs, again.inputs);
    assert_eq!(
        (train.len(), test.len(), train.features, train.classes),
        (2000, 500, 2, 4)
    );
    for class in 0..4 {
        let count = train.labels.iter().filter(|&&l| l == class).count();
        assert!(count > 400, "class {class}: {count}");
    }
    let (other, _) = io::synthetic_spirals(4, 2000, 500, 4);
    assert_ne!(other.inputs, train.inputs);
}

#[test]
fn the_synthetic_set_defeats_a_linear_classifier() {
    // Least squares on one-hot targets, solved on the host: a linear model stays far from
    // the accuracy an MLP reaches.
    let (train, _) = io::synthetic_spirals(4, 2000, 0, 5);
    let mut correct = 0;
    let x: Vec<[f64; 3]> = (0..train.len())
        .map(|i| {
            [
                train.inputs[2 * i] as f64,
                train.inputs[2 * i + 1] as f64,
                1.0,
            ]
        })
        .collect();
    let mut xtx = [[0.0; 3]; 3];
    let mut xty = [[0.0; 4]; 3];
    for (i, row) in x.iter().enumerate() {
        for a in 0..3 {
            for b in 0..3 {
                xtx[a][b] += row[a] * row[b];
            }
            xty[a][train.labels[i] as usize] += row[a];
        }
    }
    // Solve xtx w = xty by Gaussian elimination.
    let mut aug: Vec<Vec<f64>> = (0..3)
        .map(|a| [xtx[a].to_vec(), xty[a].to_vec()].concat())
        .collect();
    for c in 0..3 {
        let pivot = aug[c][c];
        for v in aug[c].iter_mut() {
            *v /= pivot;
        }
        for r in 0..3 {
            if r != c {
                let f = aug[r][c];
                let row_c = aug[c].clone();
                for (v, pc) in aug[r].iter_mut().zip(row_c) {
                    *v -= f * pc;
                }
            }
        }
    }
    for (i, row) in x.iter().enumerate() {
        let scores: Vec<f64> = (0..4)
            .map(|k| (0..3).map(|a| row[a] * aug[a][3 + k]).sum())
            .collect();
        let best = (0..4)
            .max_by(|&a, &b| scores[a].partial_cmp(&scores[b]).unwrap())
            .unwrap();
        correct += (best as u32 == train.labels[i]) as usize;
    }
    let acc = correct as f64 / train.len() as f64;
    assert!(acc < 0.6, "a linear model reaches {acc}");
}

/// The net of `tools/pytorch_checkpoints.py`, in wgrad.
fn batch_norm_net() -> nn::Sequential {
    let dev = device();
    let conv = wgrad::Conv2dOptions::square(1, 1);
    nn::Sequential::new()
        .add(nn::Conv2d::with_options(3, 4, (3, 3), conv, false, dev).unwrap())
        .add(nn::BatchNorm2d::new(4, dev).unwrap())
        .add(nn::Relu)
        .add(nn::Flatten)
        .add(nn::Linear::new(4 * 4 * 4, 3, true, dev).unwrap())
}

fn fixture(name: &str) -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

/// PyTorch's state_dict of a conv + BatchNorm net (int64 num_batches_tracked included) loads
/// into wgrad strictly and gives PyTorch's eval output; wgrad's checkpoint of the same net has
/// exactly PyTorch's names and shapes, so PyTorch loads it with `strict=True`
/// (`tools/pytorch_checkpoints.py target/wgrad_batchnorm_net.safetensors` shows it).
#[test]
fn batch_norm_checkpoints_load_into_pytorch_and_back() {
    let net = batch_norm_net();
    wgrad::io::load(fixture("torch_batchnorm_net.safetensors"), &net).unwrap();
    net.eval();
    let probe = std::fs::read(fixture("torch_batchnorm_net_probe.safetensors")).unwrap();
    let probe = safetensors::SafeTensors::deserialize(&probe).unwrap();
    let tensor = |name: &str| {
        let view = probe.tensor(name).unwrap();
        let values: Vec<f32> = bytemuck::pod_collect_to_vec(view.data());
        (view.shape().to_vec(), values)
    };
    let (shape, input) = tensor("input");
    let (_, want) = tensor("output");
    let x = Tensor::from_slice(&input, &shape, device()).unwrap();
    let got = net.forward(&x).unwrap().to_vec().unwrap();
    let want: Vec<f64> = want.iter().map(|&v| v as f64).collect();
    assert_close(&got, &want, 1e-5, "eval output of PyTorch's weights");
    // 2 batches tracked, as PyTorch counted them.
    let buffers = net.named_buffers();
    let tracked = buffers
        .iter()
        .find(|(n, _)| n == "1.num_batches_tracked")
        .unwrap();
    assert_eq!(tracked.1.item().unwrap(), 2.0);
    // wgrad's checkpoint: PyTorch's names and shapes, nothing more or less.
    let out = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("target/wgrad_batchnorm_net.safetensors");
    wgrad::io::save(&out, &net).unwrap();
    let names_and_shapes = |path: &std::path::Path| {
        let bytes = std::fs::read(path).unwrap();
        let file = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let mut all: Vec<(String, Vec<usize>)> = file
            .tensors()
            .into_iter()
            .map(|(n, v)| (n, v.shape().to_vec()))
            .collect();
        all.sort();
        all
    };
    assert_eq!(
        names_and_shapes(&out),
        names_and_shapes(&fixture("torch_batchnorm_net.safetensors"))
    );
}
