//! Hugging Face checkpoint directories, as `save_pretrained` writes them: `config.json` beside
//! `model.safetensors`, or beside `model.safetensors.index.json` and the shards it names.
//!
//! Reading takes every tensor to the host as f32 (F32, F16 and BF16 files), so a model is
//! built from the file in one go and a caller never holds a half-loaded one. Writing puts the
//! tensors back in the dtype the checkpoint had (BF16 rounded to nearest even, as torch).

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use safetensors::tensor::{Dtype, SafeTensors, TensorView};
use serde_json::{Map, Value};

use crate::device::Device;
use crate::error::{Error, Result};
use crate::io::{read_safetensors, write_atomically};
use crate::tensor::{DType, Tensor};

/// The file of a checkpoint's configuration.
pub(crate) const CONFIG: &str = "config.json";
/// The weights of an unsharded checkpoint.
const WEIGHTS: &str = "model.safetensors";
/// The index of a sharded one: `{"weight_map": {tensor name: shard file}}`.
const WEIGHTS_INDEX: &str = "model.safetensors.index.json";

/// How a checkpoint's floating-point tensors are stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WeightDType {
    /// 32-bit floats.
    F32,
    /// IEEE half precision.
    F16,
    /// bfloat16.
    BF16,
}

/// The dtype [`Llama::from_pretrained_with`](crate::models::Llama::from_pretrained_with)
/// gives the parameters it loads: transformers' `dtype` argument of `from_pretrained`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum LoadDType {
    /// Every parameter F32, whatever the file holds (`from_pretrained`): master weights to
    /// train, with `wgrad::autocast` for 16-bit products.
    #[default]
    F32,
    /// Every parameter in the checkpoint's dtype (transformers' `dtype="auto"`): a BF16
    /// checkpoint stays BF16 on the device, half the memory, bit for bit as in the file.
    Checkpoint,
}

impl WeightDType {
    /// The tensor dtype of the same name.
    pub(crate) fn dtype(self) -> DType {
        match self {
            WeightDType::F32 => DType::F32,
            WeightDType::F16 => DType::F16,
            WeightDType::BF16 => DType::BF16,
        }
    }

    /// The name `config.json` gives it (`torch_dtype`).
    fn torch_name(self) -> &'static str {
        match self {
            WeightDType::F32 => "float32",
            WeightDType::F16 => "float16",
            WeightDType::BF16 => "bfloat16",
        }
    }
}

/// A checkpoint's `config.json`, with the path for errors that name a field.
pub(crate) struct Config {
    pub path: PathBuf,
    pub fields: Map<String, Value>,
}

impl Config {
    /// `dir/config.json`, which must be a JSON object.
    pub fn read(op: &'static str, dir: &Path) -> Result<Config> {
        let path = dir.join(CONFIG);
        let text = std::fs::read_to_string(&path).map_err(|e| io_error(op, &path, e))?;
        match serde_json::from_str::<Value>(&text) {
            Ok(Value::Object(fields)) => Ok(Config { path, fields }),
            Ok(_) => Err(io_error(op, &path, "is not a JSON object")),
            Err(e) => Err(io_error(op, &path, format!("is not valid JSON: {e}"))),
        }
    }

    fn error(&self, op: &'static str, msg: String) -> Error {
        io_error(op, &self.path, msg)
    }

    /// Errors unless `"architectures"` (when present) or `"model_type"` names `expected`.
    pub fn expect_model_type(&self, op: &'static str, model_type: &str) -> Result<()> {
        match self.fields.get("model_type").and_then(Value::as_str) {
            Some(t) if t == model_type => Ok(()),
            Some(t) => Err(self.error(
                op,
                format!("field \"model_type\" is {t:?}; {op} reads {model_type:?} checkpoints"),
            )),
            None => Err(self.error(op, "has no field \"model_type\"".to_string())),
        }
    }

    /// A positive integer field; `default` where the field is absent or null.
    pub fn usize(&self, op: &'static str, name: &str, default: Option<usize>) -> Result<usize> {
        match (self.fields.get(name), default) {
            (None | Some(Value::Null), Some(d)) => Ok(d),
            (None | Some(Value::Null), None) => {
                Err(self.error(op, format!("has no field {name:?}")))
            }
            (Some(v), _) => v
                .as_u64()
                .filter(|&n| n > 0)
                .map(|n| n as usize)
                .ok_or_else(|| {
                    self.error(op, format!("field {name:?} is {v}, not a positive integer"))
                }),
        }
    }

    /// A finite number field; `default` where absent or null.
    pub fn f32(&self, op: &'static str, name: &str, default: Option<f32>) -> Result<f32> {
        match (self.fields.get(name), default) {
            (None | Some(Value::Null), Some(d)) => Ok(d),
            (None | Some(Value::Null), None) => {
                Err(self.error(op, format!("has no field {name:?}")))
            }
            (Some(v), _) => v
                .as_f64()
                .filter(|x| x.is_finite())
                .map(|x| x as f32)
                .ok_or_else(|| self.error(op, format!("field {name:?} is {v}, not a number"))),
        }
    }

    /// A boolean field; `default` where absent or null.
    pub fn bool(&self, op: &'static str, name: &str, default: bool) -> Result<bool> {
        match self.fields.get(name) {
            None | Some(Value::Null) => Ok(default),
            Some(Value::Bool(b)) => Ok(*b),
            Some(v) => Err(self.error(op, format!("field {name:?} is {v}, not true or false"))),
        }
    }

    /// A string field; `default` where absent or null.
    pub fn string(&self, op: &'static str, name: &str, default: &str) -> Result<String> {
        match self.fields.get(name) {
            None | Some(Value::Null) => Ok(default.to_string()),
            Some(Value::String(s)) => Ok(s.clone()),
            Some(v) => Err(self.error(op, format!("field {name:?} is {v}, not a string"))),
        }
    }

    /// Errors when field `name` is set to anything but null or one of `allowed`: a feature
    /// the model does not implement, which would otherwise load as a different model.
    pub fn refuse(&self, op: &'static str, name: &str, allowed: &[Value]) -> Result<()> {
        match self.fields.get(name) {
            None | Some(Value::Null) => Ok(()),
            Some(v) if allowed.contains(v) => Ok(()),
            Some(v) => Err(self.error(
                op,
                format!("field {name:?} is {v}, which {op} does not implement"),
            )),
        }
    }

    /// The checkpoint's dtype as the config states it (`torch_dtype`, or `dtype` as newer
    /// transformers write), when it does.
    fn dtype(&self) -> Option<WeightDType> {
        let name = ["torch_dtype", "dtype"]
            .iter()
            .find_map(|k| self.fields.get(*k).and_then(Value::as_str))?;
        match name {
            "float32" => Some(WeightDType::F32),
            "float16" => Some(WeightDType::F16),
            "bfloat16" => Some(WeightDType::BF16),
            _ => None,
        }
    }
}

/// One tensor of a checkpoint, on the host in f32.
struct HostTensor {
    shape: Vec<usize>,
    values: Vec<f32>,
    file: PathBuf,
}

/// A checkpoint's tensors on the host, handed out by name as the model is built.
pub(crate) struct Weights {
    dir: PathBuf,
    tensors: HashMap<String, HostTensor>,
    /// The dtype most of the float tensors had.
    pub dtype: WeightDType,
    /// The dtype [`Weights::take`] gives parameters.
    param_dtype: DType,
}

impl Weights {
    /// The tensors of `dir`: `model.safetensors`, or every shard `model.safetensors.index.json`
    /// names (a shard that is missing, or lacks a tensor the index places in it, is an error).
    pub fn read(op: &'static str, dir: &Path, config: &Config, load: LoadDType) -> Result<Weights> {
        let single = dir.join(WEIGHTS);
        let index = dir.join(WEIGHTS_INDEX);
        let mut tensors = HashMap::new();
        let mut counts = [0usize; 3];
        if single.exists() {
            read_file(op, &single, None, &mut tensors, &mut counts)?;
        } else if index.exists() {
            for (file, names) in shards(op, &index)? {
                read_file(
                    op,
                    &dir.join(&file),
                    Some(&names),
                    &mut tensors,
                    &mut counts,
                )?;
            }
        } else {
            return Err(io_error(
                op,
                dir,
                format!("holds neither {WEIGHTS} nor {WEIGHTS_INDEX}"),
            ));
        }
        let most = [WeightDType::F32, WeightDType::F16, WeightDType::BF16]
            .into_iter()
            .zip(counts)
            .max_by_key(|(_, n)| *n)
            .map(|(d, _)| d)
            .expect("three dtypes");
        let dtype = config.dtype().filter(|_| counts == [0; 3]).unwrap_or(most);
        let param_dtype = match load {
            LoadDType::F32 => DType::F32,
            LoadDType::Checkpoint => dtype.dtype(),
        };
        Ok(Weights {
            dir: dir.to_path_buf(),
            tensors,
            dtype,
            param_dtype,
        })
    }

    /// Whether the checkpoint holds `name`.
    pub fn has(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    /// Tensor `name` as a parameter on `device`; `shape` is what the config implies, and a
    /// tensor of another shape, or none, is an error naming it.
    pub fn take(
        &mut self,
        op: &'static str,
        name: &str,
        shape: &[usize],
        device: &Device,
    ) -> Result<Tensor> {
        let Some(t) = self.tensors.get(name) else {
            return Err(io_error(
                op,
                &self.dir,
                format!("the checkpoint has no tensor {name:?} (shape {shape:?} by config.json)"),
            ));
        };
        if t.shape != shape {
            return Err(Error::Shape {
                op,
                msg: format!(
                    "tensor {name:?} in {} has shape {:?}; config.json makes it {shape:?}",
                    t.file.display(),
                    t.shape
                ),
            });
        }
        // Taken out, so its values move to the device without a copy and what is left is
        // what no parameter took.
        let values = self.tensors.remove(name).expect("present").values;
        let param = Tensor::from_vec(values, shape, device)?;
        let param = match self.param_dtype {
            DType::F32 => param,
            // Exact: the host values are the file's 16-bit ones, widened.
            dtype => param.to_dtype(dtype)?,
        };
        Ok(param.requires_grad_(true))
    }

    /// Errors when the checkpoint holds a tensor no parameter took, other than those `ignore`
    /// accepts (buffers transformers saves and rebuilds, as GPT-2's causal masks): a tensor
    /// the model has no place for means another architecture than the config describes.
    pub fn expect_all_taken(&self, op: &'static str, ignore: impl Fn(&str) -> bool) -> Result<()> {
        let mut left: Vec<&String> = self.tensors.keys().filter(|n| !ignore(n)).collect();
        left.sort();
        match left.is_empty() {
            true => Ok(()),
            false => Err(io_error(
                op,
                &self.dir,
                format!("the checkpoint holds tensors the model built from config.json has no place for: {left:?}"),
            )),
        }
    }
}

/// The shard files of an index and the tensors each should hold, in file order.
fn shards(op: &'static str, index: &Path) -> Result<Vec<(String, Vec<String>)>> {
    let text = std::fs::read_to_string(index).map_err(|e| io_error(op, index, e))?;
    let json: Value = serde_json::from_str(&text)
        .map_err(|e| io_error(op, index, format!("is not valid JSON: {e}")))?;
    let Some(map) = json.get("weight_map").and_then(Value::as_object) else {
        return Err(io_error(op, index, "has no \"weight_map\" object"));
    };
    let mut files: Vec<(String, Vec<String>)> = Vec::new();
    for (name, file) in map {
        let Some(file) = file.as_str().filter(|f| is_plain_file_name(f)) else {
            return Err(io_error(
                op,
                index,
                format!("places tensor {name:?} in {file}, not a file name in the directory"),
            ));
        };
        match files.iter_mut().find(|(f, _)| f == file) {
            Some((_, names)) => names.push(name.clone()),
            None => files.push((file.to_string(), vec![name.clone()])),
        }
    }
    files.sort();
    Ok(files)
}

/// A name with no directory part, so an index cannot reach outside its checkpoint.
fn is_plain_file_name(name: &str) -> bool {
    !name.is_empty() && !name.contains(['/', '\\']) && name != "." && name != ".."
}

/// Reads every tensor of one safetensors file into `tensors`, as f32; `expected` (a shard's
/// names by the index) must all be there. A tensor in two files, or of an unsupported dtype,
/// is an error.
fn read_file(
    op: &'static str,
    path: &Path,
    expected: Option<&[String]>,
    tensors: &mut HashMap<String, HostTensor>,
    counts: &mut [usize; 3],
) -> Result<()> {
    let bytes = read_safetensors(op, path)?;
    let file = SafeTensors::deserialize(&bytes)
        .map_err(|e| io_error(op, path, format!("not a valid safetensors file: {e}")))?;
    for name in expected.unwrap_or_default() {
        if file.tensor(name).is_err() {
            return Err(io_error(
                op,
                path,
                format!("the index places tensor {name:?} here, but the file does not hold it"),
            ));
        }
    }
    for (name, view) in file.tensors() {
        let values = host_f32(&view, counts).ok_or_else(|| {
            io_error(
                op,
                path,
                format!(
                    "tensor {name:?} is {:?}; checkpoints are read in F32, F16 or BF16",
                    view.dtype()
                ),
            )
        })?;
        if tensors.contains_key(&name) {
            return Err(io_error(
                op,
                path,
                format!("tensor {name:?} is in two shard files"),
            ));
        }
        tensors.insert(
            name,
            HostTensor {
                shape: view.shape().to_vec(),
                values,
                file: path.to_path_buf(),
            },
        );
    }
    Ok(())
}

/// A float tensor's values as f32 (16-bit values are exact in f32), counting its dtype.
fn host_f32(view: &TensorView, counts: &mut [usize; 3]) -> Option<Vec<f32>> {
    let halves = || bytemuck::pod_collect_to_vec::<u8, u16>(view.data());
    let (values, slot) = match view.dtype() {
        Dtype::F32 => (bytemuck::pod_collect_to_vec(view.data()), 0),
        Dtype::F16 => (
            halves()
                .into_iter()
                .map(|b| half::f16::from_bits(b).to_f32())
                .collect(),
            1,
        ),
        Dtype::BF16 => (
            halves()
                .into_iter()
                .map(|b| half::bf16::from_bits(b).to_f32())
                .collect(),
            2,
        ),
        _ => return None,
    };
    counts[slot] += 1;
    Some(values)
}

/// Writes `config` and `tensors` to `dir` (created if needed) as `config.json` and one
/// `model.safetensors` in `dtype`, each file atomically.
pub(crate) fn write(
    op: &'static str,
    dir: &Path,
    mut config: Map<String, Value>,
    tensors: &[(String, Tensor)],
    dtype: WeightDType,
) -> Result<()> {
    std::fs::create_dir_all(dir).map_err(|e| io_error(op, dir, e))?;
    let mut bytes: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::with_capacity(tensors.len());
    for (name, t) in tensors {
        let values = t.to_vec()?;
        let encoded = match dtype {
            WeightDType::F32 => bytemuck::cast_slice(&values).to_vec(),
            WeightDType::F16 => values
                .iter()
                .flat_map(|v| half::f16::from_f32(*v).to_bits().to_le_bytes())
                .collect(),
            WeightDType::BF16 => values
                .iter()
                .flat_map(|v| half::bf16::from_f32(*v).to_bits().to_le_bytes())
                .collect(),
        };
        bytes.push((name.clone(), t.shape().to_vec(), encoded));
    }
    let st_dtype = match dtype {
        WeightDType::F32 => Dtype::F32,
        WeightDType::F16 => Dtype::F16,
        WeightDType::BF16 => Dtype::BF16,
    };
    let weights_path = dir.join(WEIGHTS);
    let views = bytes
        .iter()
        .map(|(name, shape, data)| {
            TensorView::new(st_dtype, shape.clone(), data)
                .map(|v| (name.clone(), v))
                .map_err(|e| io_error(op, &weights_path, e))
        })
        .collect::<Result<Vec<_>>>()?;
    let metadata = HashMap::from([("format".to_string(), "pt".to_string())]);
    let encoded = safetensors::serialize(views, Some(metadata))
        .map_err(|e| io_error(op, &weights_path, e))?;
    // Under the key the config had: transformers 5 writes `dtype`, 4 `torch_dtype`.
    let key = match config.contains_key("dtype") {
        true => "dtype",
        false => "torch_dtype",
    };
    config.insert(key.into(), Value::from(dtype.torch_name()));
    let config_path = dir.join(CONFIG);
    let json = serde_json::to_string_pretty(&Value::Object(config))
        .map_err(|e| io_error(op, &config_path, e))?;
    write_atomically(op, &weights_path, &encoded)?;
    // A sharded checkpoint's index would now describe stale shards; the single file replaces it.
    let index = dir.join(WEIGHTS_INDEX);
    if index.exists() {
        std::fs::remove_file(&index).map_err(|e| io_error(op, &index, e))?;
    }
    write_atomically(op, &config_path, format!("{json}\n").as_bytes())
}

/// Values for a parameter of a model built from a configuration alone (no checkpoint),
/// initialised as transformers initialises it.
pub(crate) enum Init {
    /// Normal with mean 0 and this standard deviation (`initializer_range`).
    Normal(f32),
    /// All ones (norm weights).
    Ones,
    /// All zeros (biases).
    Zeros,
}

/// Where a model's parameters come from while it is built: a checkpoint, or fresh values.
pub(crate) enum Source<'a> {
    /// Taken by name from a checkpoint.
    Checkpoint(&'a mut Weights),
    /// Drawn from the global generator.
    Fresh,
}

impl Source<'_> {
    /// Parameter `name` of `shape`.
    pub fn param(
        &mut self,
        op: &'static str,
        name: &str,
        shape: &[usize],
        init: Init,
        device: &Device,
    ) -> Result<Tensor> {
        match self {
            Source::Checkpoint(weights) => weights.take(op, name, shape, device),
            Source::Fresh => {
                let t = match init {
                    Init::Normal(std) => Tensor::normal(shape, 0.0, std, device)?,
                    Init::Ones => Tensor::ones(shape, device)?,
                    Init::Zeros => Tensor::zeros(shape, device)?,
                };
                Ok(t.requires_grad_(true))
            }
        }
    }
}

fn io_error(op: &'static str, path: &Path, msg: impl std::fmt::Display) -> Error {
    Error::Io {
        op,
        path: path.display().to_string(),
        msg: msg.to_string(),
    }
}
