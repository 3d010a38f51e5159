//! Parity with PyTorch: the CNN of examples/cnn.rs (narrower, on 12x12 images) and one
//! pre-norm transformer block of examples/gpt.rs, with the weights and batch PyTorch used, give
//! PyTorch's loss and every grad (parameters and input) to 1e-4 relative. The fixtures are
//! written by `tools/pytorch_parity.py` (PyTorch in float64) and committed.

mod common;
use common::*;
use std::path::{Path, PathBuf};
use wgrad::nn::{self, Module};
use wgrad::Tensor;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(format!("{name}.safetensors"))
}

/// Every tensor of a fixture file: name -> (shape, values).
fn read(path: &Path) -> std::collections::HashMap<String, (Vec<usize>, Vec<f32>)> {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let file = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    file.tensors()
        .into_iter()
        .map(|(name, view)| {
            let values = bytemuck::pod_collect_to_vec::<u8, f32>(view.data());
            (name, (view.shape().to_vec(), values))
        })
        .collect()
}

/// Checks the loss, the input's grad and every parameter's grad against the fixture.
fn check(
    name: &str,
    model: &dyn Module,
    loss_of: impl Fn(&Tensor, &std::collections::HashMap<String, (Vec<usize>, Vec<f32>)>) -> Tensor,
) {
    let path = fixture(name);
    // The fixture also holds the batch, the loss and the grads: load skips those.
    let skipped =
        wgrad::io::load_with(&path, model, wgrad::io::LoadOptions { strict: false }).unwrap();
    assert!(
        skipped
            .iter()
            .all(|n| !n.contains("weight") || n.starts_with("grad.")),
        "{skipped:?}"
    );
    let want = read(&path);
    let (shape, values) = &want["input"];
    let x = Tensor::from_slice(values, shape, device())
        .unwrap()
        .requires_grad_(true);
    let loss = loss_of(&x, &want);
    let f64s = |v: &[f32]| v.iter().map(|&x| x as f64).collect::<Vec<f64>>();
    assert_close(
        &[loss.item().unwrap()],
        &f64s(&want["loss"].1),
        1e-4,
        &format!("{name}: loss"),
    );
    loss.backward().unwrap();
    let mut checked = 0;
    let params = model.named_parameters();
    let inputs = params.iter().map(|(n, t)| (n.clone(), t.clone()));
    for (param, tensor) in inputs.chain([("input".to_string(), x.clone())]) {
        let (shape, grad) = &want[&format!("grad.{param}")];
        assert_eq!(tensor.shape(), shape.as_slice(), "{name}: {param} shape");
        let got = tensor
            .grad()
            .unwrap_or_else(|| panic!("{name}: {param} got no grad"));
        assert_close(
            &got.to_vec().unwrap(),
            &f64s(grad),
            1e-4,
            &format!("{name}: grad of {param}"),
        );
        checked += 1;
    }
    assert_eq!(checked, params.len() + 1);
}

#[test]
fn cnn_loss_and_grads_match_pytorch() {
    let dev = device();
    let model = nn::Sequential::new()
        .add(nn::Conv2d::new(1, 4, 3, 1, 1, dev).unwrap())
        .add(nn::Relu)
        .add(nn::MaxPool2d::new(2, 2))
        .add(nn::Conv2d::new(4, 8, 3, 1, 1, dev).unwrap())
        .add(nn::Relu)
        .add(nn::MaxPool2d::new(2, 2))
        .add(nn::Flatten)
        .add(nn::Linear::new(72, 16, true, dev).unwrap())
        .add(nn::Relu)
        .add(nn::Linear::new(16, 10, true, dev).unwrap());
    check("parity_cnn", &model, |x, want| {
        let labels: Vec<u32> = want["labels"].1.iter().map(|&l| l as u32).collect();
        let labels = Tensor::from_labels(labels, dev).unwrap();
        nn::loss::cross_entropy(&model.forward(x).unwrap(), &labels).unwrap()
    });
}

#[test]
fn transformer_block_loss_and_grads_match_pytorch() {
    let dev = device();
    let block = nn::TransformerBlock::new(16, 4, true, 0.0, dev).unwrap();
    check("parity_block", &block, |x, want| {
        let (shape, probe) = &want["probe"];
        let probe = Tensor::from_slice(probe, shape, dev).unwrap();
        block
            .forward(x)
            .unwrap()
            .mul(&probe)
            .unwrap()
            .sum()
            .unwrap()
    });
}
