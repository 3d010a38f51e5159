//! Hugging Face checkpoints: tiny random-weight Llama and GPT-2 models that transformers
//! wrote (tools/hf_fixtures.py), with the logits, loss, grads and greedy tokens transformers
//! computed, checked here without Python. tests/fixtures/hf/<model>/ holds each checkpoint
//! and its reference.safetensors.

mod common;
use common::device;

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use safetensors::tensor::{Dtype, SafeTensors};
use wgrad::capture::Step;
use wgrad::models::{Gpt2, Llama, LoadDType, Sampling};
use wgrad::nn::{self, Module};
use wgrad::optim::{Optimizer, Sgd, SgdConfig};
use wgrad::{DType, Error, Tensor};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/hf")
        .join(name)
}

/// What transformers computed: each tensor's shape and values (integers as f64 too).
struct Reference(HashMap<String, (Vec<usize>, Vec<f64>)>);

impl Reference {
    fn read(model: &str) -> Reference {
        let bytes = std::fs::read(fixture(model).join("reference.safetensors")).unwrap();
        let file = SafeTensors::deserialize(&bytes).unwrap();
        let mut tensors = HashMap::new();
        for (name, view) in file.tensors() {
            let values: Vec<f64> = match view.dtype() {
                Dtype::F32 => bytemuck::pod_collect_to_vec::<u8, f32>(view.data())
                    .into_iter()
                    .map(f64::from)
                    .collect(),
                Dtype::I64 => bytemuck::pod_collect_to_vec::<u8, i64>(view.data())
                    .into_iter()
                    .map(|v| v as f64)
                    .collect(),
                other => panic!("{name}: {other:?}"),
            };
            tensors.insert(name, (view.shape().to_vec(), values));
        }
        Reference(tensors)
    }

    fn values(&self, name: &str) -> &[f64] {
        &self
            .0
            .get(name)
            .unwrap_or_else(|| panic!("reference has no {name}"))
            .1
    }

    /// An integer tensor (tokens, targets, mask) as u32 on the device.
    fn u32s(&self, name: &str) -> Tensor {
        let (shape, values) = &self.0[name];
        let ints = values.iter().map(|&v| v as u32).collect();
        Tensor::from_vec_u32(ints, shape, device()).unwrap()
    }
}

/// Asserts `got` is within `1e-4 (1 + |want|)` of `want` everywhere.
fn assert_matches(got: &[f32], want: &[f64], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let worst = got
        .iter()
        .zip(want)
        .map(|(&g, &w)| (g as f64 - w).abs() / (1.0 + w.abs()))
        .fold(0.0, f64::max);
    assert!(
        worst <= 1e-4,
        "{what}: off by {worst:e} (relative to 1 + |want|)"
    );
}

fn load(model: &str) -> Box<dyn LanguageModel> {
    match model {
        "gpt2" => Box::new(Gpt2::from_pretrained(fixture(model), device()).unwrap()),
        _ => Box::new(Llama::from_pretrained(fixture(model), device()).unwrap()),
    }
}

/// What the tests ask of both models.
trait LanguageModel: Module {
    fn forward_with(&self, tokens: &Tensor, mask: Option<&Tensor>) -> wgrad::Result<Tensor>;
    fn generate(&self, prompt: &Tensor, n: usize, s: &Sampling) -> wgrad::Result<Tensor>;
    fn save_pretrained(&self, dir: &Path) -> wgrad::Result<()>;
    fn vocab(&self) -> usize;
}

impl LanguageModel for Llama {
    fn forward_with(&self, tokens: &Tensor, mask: Option<&Tensor>) -> wgrad::Result<Tensor> {
        Llama::forward_with(self, tokens, mask)
    }
    fn generate(&self, prompt: &Tensor, n: usize, s: &Sampling) -> wgrad::Result<Tensor> {
        Llama::generate(self, prompt, n, s)
    }
    fn save_pretrained(&self, dir: &Path) -> wgrad::Result<()> {
        Llama::save_pretrained(self, dir)
    }
    fn vocab(&self) -> usize {
        self.config.vocab_size
    }
}

impl LanguageModel for Gpt2 {
    fn forward_with(&self, tokens: &Tensor, mask: Option<&Tensor>) -> wgrad::Result<Tensor> {
        Gpt2::forward_with(self, tokens, mask)
    }
    fn generate(&self, prompt: &Tensor, n: usize, s: &Sampling) -> wgrad::Result<Tensor> {
        Gpt2::generate(self, prompt, n, s)
    }
    fn save_pretrained(&self, dir: &Path) -> wgrad::Result<()> {
        Gpt2::save_pretrained(self, dir)
    }
    fn vocab(&self) -> usize {
        self.config.vocab_size
    }
}

const MODELS: [&str; 3] = ["llama_gqa", "llama_tied_bf16", "gpt2"];

fn loss_of(model: &dyn LanguageModel, tokens: &Tensor, targets: &Tensor) -> wgrad::Result<Tensor> {
    let logits = model.forward(tokens)?;
    let n = targets.numel();
    nn::loss::cross_entropy(
        &logits.reshape(&[n, model.vocab()])?,
        &targets.reshape(&[n])?,
    )
}

#[test]
fn logits_match_transformers() {
    for name in MODELS {
        let (model, reference) = (load(name), Reference::read(name));
        let logits = model.forward(&reference.u32s("tokens")).unwrap();
        assert_eq!(logits.shape(), &[2, 8, 64], "{name}");
        assert_matches(&logits.to_vec().unwrap(), reference.values("logits"), name);
    }
}

#[test]
fn padded_batches_match_transformers_attention_mask() {
    for name in MODELS {
        let (model, reference) = (load(name), Reference::read(name));
        let mask = reference.u32s("mask");
        let logits = model
            .forward_with(&reference.u32s("tokens"), Some(&mask))
            .unwrap();
        assert_matches(
            &logits.to_vec().unwrap(),
            reference.values("masked_logits"),
            name,
        );
        // The padding changes the padded row's last positions only through the mask.
        let unmasked = model
            .forward(&reference.u32s("tokens"))
            .unwrap()
            .to_vec()
            .unwrap();
        assert_ne!(
            unmasked,
            logits.to_vec().unwrap(),
            "{name}: the mask changed nothing"
        );
    }
}

#[test]
fn loss_and_every_grad_match_transformers() {
    for name in MODELS {
        let (model, reference) = (load(name), Reference::read(name));
        let loss = loss_of(
            &*model,
            &reference.u32s("tokens"),
            &reference.u32s("targets"),
        )
        .unwrap();
        assert_matches(&[loss.item().unwrap()], reference.values("loss"), name);
        loss.backward().unwrap();
        let named = model.named_parameters();
        let mut theirs: Vec<&str> = reference
            .0
            .keys()
            .filter_map(|k| k.strip_prefix("grad."))
            .collect();
        let mut ours: Vec<&str> = named.iter().map(|(n, _)| n.as_str()).collect();
        theirs.sort();
        ours.sort();
        assert_eq!(ours, theirs, "{name}: parameter names");
        for (param, t) in &named {
            let grad = t
                .grad()
                .unwrap_or_else(|| panic!("{name}: {param} has no grad"));
            assert_matches(
                &grad.to_vec().unwrap(),
                reference.values(&format!("grad.{param}")),
                &format!("{name}: grad of {param}"),
            );
        }
    }
}

#[test]
fn tied_head_is_listed_once_under_the_embedding_name() {
    let model = Llama::from_pretrained(fixture("llama_tied_bf16"), device()).unwrap();
    assert!(model.lm_head.is_none());
    let names: Vec<String> = model
        .named_parameters()
        .into_iter()
        .map(|(n, _)| n)
        .collect();
    assert!(names.contains(&"model.embed_tokens.weight".to_string()));
    assert!(!names.iter().any(|n| n.starts_with("lm_head")));
    let untied = Llama::from_pretrained(fixture("llama_gqa"), device()).unwrap();
    assert_eq!(
        untied.named_parameters().last().unwrap().0,
        "lm_head.weight"
    );
}

/// The tensors of a safetensors file: dtype, shape and raw bytes, by name.
fn file_tensors(path: &Path) -> HashMap<String, (Dtype, Vec<usize>, Vec<u8>)> {
    let bytes = std::fs::read(path).unwrap();
    let file = SafeTensors::deserialize(&bytes).unwrap();
    file.tensors()
        .into_iter()
        .map(|(n, v)| (n, (v.dtype(), v.shape().to_vec(), v.data().to_vec())))
        .collect()
}

#[test]
fn save_pretrained_then_from_pretrained_round_trips_bit_exactly() {
    for name in MODELS {
        let model = load(name);
        let dir = tempfile::tempdir().unwrap();
        model.save_pretrained(dir.path()).unwrap();
        let again = load_from(name, dir.path());
        for ((n, a), (m, b)) in model
            .named_parameters()
            .iter()
            .zip(again.named_parameters())
        {
            assert_eq!(n, &m);
            let (a, b) = (a.to_vec().unwrap(), b.to_vec().unwrap());
            assert!(
                a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()),
                "{name}: {n}"
            );
        }
        // The file holds what transformers saved, in its dtype (BF16 stays BF16).
        let saved = file_tensors(&dir.path().join("model.safetensors"));
        let original = match name {
            "gpt2" => None,
            _ => Some(file_tensors(&fixture(name).join("model.safetensors"))),
        };
        if let Some(original) = original {
            assert_eq!(
                saved, original,
                "{name}: the saved tensors differ from transformers'"
            );
        }
        let config: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.path().join("config.json")).unwrap())
                .unwrap();
        let want_dtype = if name.ends_with("bf16") {
            "bfloat16"
        } else {
            "float32"
        };
        assert_eq!(config["dtype"], want_dtype, "{name}");
        assert_eq!(
            config["bos_token_id"], 1,
            "{name}: kept fields are written back"
        );
    }
}

#[test]
fn a_checkpoint_loaded_in_its_own_dtype_keeps_its_bf16_bits() {
    let dir = fixture("llama_tied_bf16");
    let model = Llama::from_pretrained_with(&dir, device(), LoadDType::Checkpoint).unwrap();
    let file = file_tensors(&dir.join("model.safetensors"));
    for (name, p) in model.named_parameters() {
        assert_eq!(p.dtype(), DType::BF16, "{name}");
        let bits: Vec<u8> = p
            .to_vec_bf16()
            .unwrap()
            .iter()
            .flat_map(|h| h.to_bits().to_le_bytes())
            .collect();
        let (dtype, shape, data) = &file[&name];
        assert_eq!(
            (*dtype, shape.as_slice()),
            (Dtype::BF16, p.shape()),
            "{name}"
        );
        assert_eq!(&bits, data, "{name}: the device holds the file's bits");
    }
    // Saved back, the file is transformers' own again.
    let out = tempfile::tempdir().unwrap();
    model.save_pretrained(out.path()).unwrap();
    assert_eq!(file_tensors(&out.path().join("model.safetensors")), file);
}

#[test]
fn a_bf16_model_gives_the_f32_models_logits_within_bf16_rounding() {
    let dir = fixture("llama_tied_bf16");
    let reference = Reference::read("llama_tied_bf16");
    let tokens = reference.u32s("tokens");
    let wide = Llama::from_pretrained(&dir, device()).unwrap();
    let narrow = Llama::from_pretrained_with(&dir, device(), LoadDType::Checkpoint).unwrap();
    let want = wide.forward(&tokens).unwrap().to_vec().unwrap();
    let got = narrow.forward(&tokens).unwrap();
    assert_eq!(
        got.dtype(),
        DType::BF16,
        "the logits keep the model's dtype"
    );
    let got = got.to_vec().unwrap();
    // Every op rounds its result to BF16 (8 bits of mantissa) through two layers: within a
    // few percent of the logits' scale, never an unrelated answer.
    let scale = want.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let worst = got
        .iter()
        .zip(&want)
        .fold(0.0f32, |m, (g, w)| m.max((g - w).abs()));
    assert!(
        worst <= 0.05 * scale,
        "off by {worst} at a scale of {scale}"
    );
}

#[test]
fn a_bf16_model_generates_with_its_kv_cache_as_without() {
    let dir = fixture("llama_tied_bf16");
    let model = Llama::from_pretrained_with(&dir, device(), LoadDType::Checkpoint).unwrap();
    let prompt = Reference::read("llama_tied_bf16").u32s("prompt");
    let cached = model.generate(&prompt, 12, &Sampling::greedy()).unwrap();
    let cached = cached.to_vec_u32().unwrap();
    // The cache holds BF16 keys and values: the same tokens as recomputing each prefix.
    let recomputed = greedy_without_cache(&model, &prompt.to_vec_u32().unwrap(), 12);
    assert_eq!(cached, recomputed);
}

#[test]
fn a_gpt2_checkpoint_of_f32_loads_as_f32_in_its_own_dtype() {
    let model = Gpt2::from_pretrained_with(fixture("gpt2"), device(), LoadDType::Checkpoint);
    for (name, p) in model.unwrap().named_parameters() {
        assert_eq!(p.dtype(), DType::F32, "{name}");
    }
}

fn load_from(name: &str, dir: &Path) -> Box<dyn LanguageModel> {
    match name {
        "gpt2" => Box::new(Gpt2::from_pretrained(dir, device()).unwrap()),
        _ => Box::new(Llama::from_pretrained(dir, device()).unwrap()),
    }
}

/// Greedy tokens by recomputing the whole sequence for every new token.
fn greedy_without_cache(model: &dyn LanguageModel, prompt: &[u32], n: usize) -> Vec<u32> {
    let mut tokens = prompt.to_vec();
    let _no_grad = wgrad::autograd::NoGradGuard::new();
    for _ in 0..n {
        let x = Tensor::from_vec_u32(tokens.clone(), &[1, tokens.len()], device()).unwrap();
        let logits = model.forward(&x).unwrap().to_vec().unwrap();
        let last = &logits[logits.len() - model.vocab()..];
        let best = (0..last.len()).fold(0, |b, i| if last[i] > last[b] { i } else { b });
        tokens.push(best as u32);
    }
    tokens
}

#[test]
fn generate_with_the_kv_cache_gives_the_tokens_of_recomputing_the_prefix() {
    for name in MODELS {
        let (model, reference) = (load(name), Reference::read(name));
        let prompt = reference.u32s("prompt");
        let cached = model.generate(&prompt, 20, &Sampling::greedy()).unwrap();
        assert_eq!(cached.shape(), &[1, 24]);
        let cached = cached.to_vec_u32().unwrap();
        let recomputed = greedy_without_cache(&*model, &prompt.to_vec_u32().unwrap(), 20);
        assert_eq!(cached, recomputed, "{name}");
        let theirs: Vec<u32> = reference
            .values("greedy")
            .iter()
            .map(|&v| v as u32)
            .collect();
        assert_eq!(cached, theirs, "{name}: transformers' greedy generation");
    }
}

#[test]
fn sampling_is_seeded_and_top_k_one_is_greedy() {
    let model = Llama::from_pretrained(fixture("llama_gqa"), device()).unwrap();
    let prompt = Tensor::from_vec_u32(vec![5, 6, 7, 8, 9, 10], &[2, 3], device()).unwrap();
    let warm = |seed| Sampling {
        temperature: 1.5,
        top_k: None,
        top_p: None,
        seed,
    };
    let a = model
        .generate(&prompt, 12, &warm(3))
        .unwrap()
        .to_vec_u32()
        .unwrap();
    let b = model
        .generate(&prompt, 12, &warm(3))
        .unwrap()
        .to_vec_u32()
        .unwrap();
    let c = model
        .generate(&prompt, 12, &warm(4))
        .unwrap()
        .to_vec_u32()
        .unwrap();
    assert_eq!(a, b);
    assert_ne!(a, c);
    let top1 = Sampling {
        temperature: 1.0,
        top_k: Some(1),
        top_p: None,
        seed: 9,
    };
    let greedy = model.generate(&prompt, 12, &Sampling::greedy()).unwrap();
    assert_eq!(
        model
            .generate(&prompt, 12, &top1)
            .unwrap()
            .to_vec_u32()
            .unwrap(),
        greedy.to_vec_u32().unwrap()
    );
}

/// Nucleus sampling keeps the most likely token whatever p: a p below every probability is
/// greedy; a p outside (0, 1] is an error naming generate.
#[test]
fn top_p_below_every_probability_is_greedy() {
    let model = Llama::from_pretrained(fixture("llama_gqa"), device()).unwrap();
    let prompt = Tensor::from_vec_u32(vec![5, 6, 7, 8, 9, 10], &[2, 3], device()).unwrap();
    let nucleus = |top_p| Sampling {
        temperature: 1.5,
        top_k: None,
        top_p: Some(top_p),
        seed: 11,
    };
    let greedy = model.generate(&prompt, 12, &Sampling::greedy()).unwrap();
    let tiny = model.generate(&prompt, 12, &nucleus(1e-7)).unwrap();
    assert_eq!(tiny.to_vec_u32().unwrap(), greedy.to_vec_u32().unwrap());
    // Without the cut, this seed samples away from greedy.
    let whole = model.generate(&prompt, 12, &nucleus(1.0)).unwrap();
    assert_ne!(whole.to_vec_u32().unwrap(), greedy.to_vec_u32().unwrap());
    let err = model.generate(&prompt, 12, &nucleus(0.0)).unwrap_err();
    assert!(err.to_string().contains("top_p"), "{err}");
}

#[test]
fn generating_more_tokens_than_positions_is_an_error_even_past_usize() {
    let prompt = Tensor::from_vec_u32(vec![5, 6], &[1, 2], device()).unwrap();
    for name in MODELS {
        let model = load(name);
        for n in [1_000, usize::MAX] {
            match model.generate(&prompt, n, &Sampling::greedy()) {
                Err(wgrad::Error::Shape { msg, .. }) => {
                    let field = match name {
                        "gpt2" => "(n_positions)",
                        _ => "(max_position_embeddings)",
                    };
                    assert!(msg.contains(field), "{name}: {msg}")
                }
                other => panic!("{name}, {n} tokens: {other:?}"),
            }
        }
    }
}

#[test]
fn captured_training_steps_equal_eager_ones() {
    for name in MODELS {
        let reference = Reference::read(name);
        let (tokens, targets) = (reference.u32s("tokens"), reference.u32s("targets"));
        let run = |capture: bool| -> (Vec<f32>, Vec<f32>) {
            let model = load(name);
            let mut opt = Sgd::new(
                model.parameters(),
                SgdConfig {
                    lr: 0.1,
                    momentum: 0.9,
                    ..Default::default()
                },
            );
            let mut step_fn = |batch: &[Tensor]| {
                opt.zero_grad();
                let loss = loss_of(&*model, &batch[0], &batch[1])?;
                loss.backward()?;
                opt.step()?;
                Ok(loss)
            };
            let mut losses = Vec::new();
            if capture {
                let mut step = Step::new(&mut step_fn);
                for _ in 0..4 {
                    losses.push(
                        step.run(&[tokens.clone(), targets.clone()])
                            .unwrap()
                            .item()
                            .unwrap(),
                    );
                }
                assert_eq!(step.stats().replays, 2, "{name}");
            } else {
                for _ in 0..4 {
                    losses.push(
                        step_fn(&[tokens.clone(), targets.clone()])
                            .unwrap()
                            .item()
                            .unwrap(),
                    );
                }
            }
            let params = model
                .parameters()
                .iter()
                .flat_map(|p| p.to_vec().unwrap())
                .collect();
            (losses, params)
        };
        let (eager, captured) = (run(false), run(true));
        assert!(
            eager.0[3] < eager.0[0],
            "{name}: training lowers the loss {:?}",
            eager.0
        );
        for (a, b) in eager.0.iter().zip(&captured.0) {
            assert!(
                (a - b).abs() <= 1e-5 * (1.0 + a.abs()),
                "{name}: losses {:?} vs {:?}",
                eager.0,
                captured.0
            );
        }
        let worst = eager
            .1
            .iter()
            .zip(&captured.1)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0, f32::max);
        assert!(worst <= 1e-5, "{name}: parameters differ by {worst}");
    }
}

/// A copy of fixture `name` in a temporary directory, with `edit` applied to it.
fn edited_copy(name: &str, edit: impl FnOnce(&Path)) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    for entry in std::fs::read_dir(fixture(name)).unwrap() {
        let path = entry.unwrap().path();
        std::fs::copy(&path, dir.path().join(path.file_name().unwrap())).unwrap();
    }
    edit(dir.path());
    dir
}

fn edit_config(dir: &Path, edit: impl FnOnce(&mut serde_json::Value)) {
    let path = dir.join("config.json");
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    edit(&mut config);
    std::fs::write(path, config.to_string()).unwrap();
}

fn llama_error(dir: &Path) -> String {
    match Llama::from_pretrained(dir, device()) {
        Ok(_) => panic!("{} loaded", dir.display()),
        Err(e) => e.to_string(),
    }
}

#[test]
fn a_directory_without_config_is_an_error_naming_the_file() {
    let dir = edited_copy("llama_gqa", |d| {
        std::fs::remove_file(d.join("config.json")).unwrap()
    });
    assert!(llama_error(dir.path()).contains("config.json"));
}

#[test]
fn a_config_of_another_architecture_is_an_error_naming_the_field() {
    let dir = edited_copy("gpt2", |_| {});
    let msg = llama_error(dir.path());
    assert!(msg.contains("model_type") && msg.contains("gpt2"), "{msg}");
}

#[test]
fn rope_scaling_it_does_not_implement_is_an_error() {
    let dir = edited_copy("llama_gqa", |d| {
        edit_config(
            d,
            |c| {
                c["rope_parameters"] =
                    serde_json::json!({"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0})
            },
        )
    });
    let msg = llama_error(dir.path());
    assert!(
        msg.contains("rope_parameters") && msg.contains("linear"),
        "{msg}"
    );
}

#[test]
fn a_truncated_weights_file_is_an_error_naming_it() {
    let dir = edited_copy("llama_gqa", |d| {
        let path = d.join("model.safetensors");
        let bytes = std::fs::read(&path).unwrap();
        std::fs::write(&path, &bytes[..bytes.len() - 100]).unwrap();
    });
    let msg = llama_error(dir.path());
    assert!(
        msg.contains("model.safetensors") && msg.contains("truncated"),
        "{msg}"
    );
}

#[test]
fn a_shard_index_naming_a_missing_file_is_an_error_naming_it() {
    let dir = edited_copy("gpt2", |d| {
        std::fs::remove_file(d.join("model-00002-of-00004.safetensors")).unwrap()
    });
    let msg = Gpt2::from_pretrained(dir.path(), device())
        .err()
        .unwrap()
        .to_string();
    assert!(msg.contains("model-00002-of-00004.safetensors"), "{msg}");
}

#[test]
fn a_tensor_of_the_wrong_shape_is_an_error_naming_it() {
    let dir = edited_copy("llama_gqa", |d| {
        edit_config(d, |c| c["intermediate_size"] = serde_json::json!(48))
    });
    let msg = llama_error(dir.path());
    assert!(
        msg.contains("model.layers.0.mlp.gate_proj.weight") && msg.contains("[48, 32]"),
        "{msg}"
    );
}

#[test]
fn a_tensor_the_config_has_no_place_for_is_an_error() {
    // One layer by the config, two in the file: loading would silently drop a layer.
    let dir = edited_copy("llama_gqa", |d| {
        edit_config(d, |c| c["num_hidden_layers"] = serde_json::json!(1))
    });
    let msg = llama_error(dir.path());
    assert!(msg.contains("model.layers.1."), "{msg}");
}

#[test]
fn tokens_past_the_vocabulary_are_an_error() {
    let model = Llama::from_pretrained(fixture("llama_gqa"), device()).unwrap();
    let tokens = Tensor::from_vec_u32(vec![1, 64], &[1, 2], device()).unwrap();
    let err = model.forward(&tokens).unwrap_err();
    assert!(matches!(err, Error::Index { .. }), "{err}");
    assert!(err.to_string().contains("vocab_size"), "{err}");
}

#[test]
fn a_sequence_past_max_positions_is_an_error() {
    let model = Gpt2::from_pretrained(fixture("gpt2"), device()).unwrap();
    let tokens = Tensor::from_vec_u32(vec![3; 65], &[1, 65], device()).unwrap();
    let err = model.forward(&tokens).unwrap_err().to_string();
    // GPT-2's config calls the bound n_positions.
    assert!(err.contains("(n_positions)") && err.contains("65"), "{err}");
    let prompt = Tensor::from_vec_u32(vec![3; 60], &[1, 60], device()).unwrap();
    let err = model
        .generate(&prompt, 5, &Sampling::greedy())
        .unwrap_err()
        .to_string();
    assert!(err.contains("64 positions"), "{err}");
}

#[test]
fn a_model_built_from_a_config_trains_and_saves_for_transformers() {
    let mut config = wgrad::models::LlamaConfig::small(48);
    config.num_hidden_layers = 1;
    config.max_position_embeddings = 16;
    let model = Llama::new(config, device()).unwrap();
    let dir = tempfile::tempdir().unwrap();
    model.save_pretrained(dir.path()).unwrap();
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.path().join("config.json")).unwrap())
            .unwrap();
    assert_eq!(config["model_type"], "llama");
    assert_eq!(config["architectures"][0], "LlamaForCausalLM");
    assert_eq!(config["num_key_value_heads"], 2);
    let again = Llama::from_pretrained(dir.path(), device()).unwrap();
    let tokens = Tensor::from_vec_u32((0..16).collect(), &[2, 8], device()).unwrap();
    let (a, b) = (
        model.forward(&tokens).unwrap(),
        again.forward(&tokens).unwrap(),
    );
    assert_eq!(a.to_vec().unwrap(), b.to_vec().unwrap());
}

#[test]
fn token_ids_past_the_vocabulary_are_an_error_naming_the_largest() {
    let mut config = wgrad::models::LlamaConfig::small(48);
    config.num_hidden_layers = 1;
    let model = Llama::new(config, device()).unwrap();
    for (id, needle) in [
        (48, "token ids reach 48 but the vocabulary has 48"),
        (u32::MAX, "token ids reach 4294967295 but"),
    ] {
        let tokens = Tensor::from_vec_u32(vec![3, id, 0, 1], &[2, 2], device()).unwrap();
        let err = model.forward(&tokens).unwrap_err();
        assert!(matches!(err, wgrad::Error::Index { .. }), "{err:?}");
        assert!(err.to_string().contains(needle), "{err}");
    }
}

/// Each model after one training step, saved for transformers with the logits wgrad then
/// computes: `tools/hf_fixtures.py --check target/hf_saved` loads every directory with
/// `AutoModelForCausalLM.from_pretrained` and compares its logits with wgrad's.
#[test]
fn trained_models_save_where_transformers_can_check_them() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("target/hf_saved");
    for name in MODELS {
        let (model, reference) = (load(name), Reference::read(name));
        let (tokens, targets) = (reference.u32s("tokens"), reference.u32s("targets"));
        let mut opt = Sgd::new(
            model.parameters(),
            SgdConfig {
                lr: 0.5,
                ..Default::default()
            },
        );
        loss_of(&*model, &tokens, &targets)
            .unwrap()
            .backward()
            .unwrap();
        opt.step().unwrap();
        let dir = root.join(name);
        model.save_pretrained(&dir).unwrap();
        // What transformers should compute: the saved (possibly BF16-rounded) weights' logits.
        let saved = load_from(name, &dir);
        let logits = saved.forward(&tokens).unwrap();
        let before = model.forward(&tokens).unwrap();
        assert_ne!(
            logits.to_vec().unwrap(),
            reference
                .values("logits")
                .iter()
                .map(|&v| v as f32)
                .collect::<Vec<_>>()
        );
        if !name.ends_with("bf16") {
            assert_eq!(logits.to_vec().unwrap(), before.to_vec().unwrap(), "{name}");
        }
        let tokens_f32: Vec<f32> = tokens
            .to_vec_u32()
            .unwrap()
            .iter()
            .map(|&t| t as f32)
            .collect();
        let values = [
            ("tokens", tokens_f32, vec![2, 8]),
            ("logits", logits.to_vec().unwrap(), vec![2, 8, 64]),
        ];
        let views: Vec<(String, safetensors::tensor::TensorView)> = values
            .iter()
            .map(|(n, v, s)| {
                let view = safetensors::tensor::TensorView::new(
                    Dtype::F32,
                    s.clone(),
                    bytemuck::cast_slice(v),
                )
                .unwrap();
                (n.to_string(), view)
            })
            .collect();
        safetensors::serialize_to_file(views, None, &dir.join("wgrad_logits.safetensors")).unwrap();
    }
}
