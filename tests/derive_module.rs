//! `#[derive(Module)]` (docs/ops.md, "Modules"): a struct's parameters, buffers and train/eval
//! switch come from its fields, named as PyTorch names the same structure.

mod common;
use common::*;
use wgrad::nn::{self, Module};
use wgrad::{Conv2dOptions, Result, Tensor};

/// A block as a ResNet or U-Net port writes one: conv, norm, dropout, an optional shortcut.
#[derive(Module)]
struct Block {
    conv: nn::Conv2d,
    bn: nn::BatchNorm2d,
    dropout: nn::Dropout,
    shortcut: Option<nn::Conv2d>,
}

impl Block {
    fn new(c_in: usize, c_out: usize) -> Result<Block> {
        let dev = device();
        let same = Conv2dOptions::square(1, 1);
        Ok(Block {
            conv: nn::Conv2d::with_options(c_in, c_out, (3, 3), same, false, dev)?,
            bn: nn::BatchNorm2d::new(c_out, dev)?,
            dropout: nn::Dropout::new(0.5)?,
            shortcut: match c_in != c_out {
                true => Some(nn::Conv2d::new(c_in, c_out, 1, 1, 0, dev)?),
                false => None,
            },
        })
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let h = self
            .dropout
            .forward(&self.bn.forward(&self.conv.forward(x)?)?)?;
        match &self.shortcut {
            Some(shortcut) => h.add(&shortcut.forward(x)?),
            None => h.add(x),
        }
    }
}

/// Nested modules, a Vec of blocks, an absent Option, a tensor of its own, a buffer and a
/// skipped field. `tools/pytorch_module_names.py` builds the same structure in PyTorch.
#[derive(Module)]
struct Net {
    stem: nn::Conv2d,
    blocks: Vec<Block>,
    head: nn::Linear,
    extra: Option<nn::Linear>,
    scale: Tensor,
    #[module(buffer)]
    steps: Tensor,
    #[module(skip)]
    width: usize,
}

impl Net {
    fn new() -> Result<Net> {
        let dev = device();
        Ok(Net {
            stem: nn::Conv2d::new(1, 2, 3, 1, 1, dev)?,
            blocks: vec![Block::new(2, 4)?, Block::new(4, 4)?],
            head: nn::Linear::new(4, 3, true, dev)?,
            extra: None,
            scale: Tensor::ones(&[3], dev)?.requires_grad_(true),
            steps: Tensor::zeros(&[1], dev)?,
            width: 4,
        })
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let mut h = self.stem.forward(x)?;
        for block in &self.blocks {
            h = block.forward(&h)?;
        }
        let pooled = h
            .adaptive_avg_pool2d((1, 1))?
            .reshape(&[x.shape()[0], self.width])?;
        self.head.forward(&pooled)?.mul(&self.scale)
    }
}

fn names(named: Vec<(String, Tensor)>) -> Vec<String> {
    named.into_iter().map(|(name, _)| name).collect()
}

/// What `tools/pytorch_module_names.py` printed for the same structure (torch 2.x): a
/// module's own tensors first, then each child's in the order they were assigned.
const PYTORCH_PARAMETERS: [&str; 13] = [
    "scale",
    "stem.weight",
    "stem.bias",
    "blocks.0.conv.weight",
    "blocks.0.bn.weight",
    "blocks.0.bn.bias",
    "blocks.0.shortcut.weight",
    "blocks.0.shortcut.bias",
    "blocks.1.conv.weight",
    "blocks.1.bn.weight",
    "blocks.1.bn.bias",
    "head.weight",
    "head.bias",
];

const PYTORCH_BUFFERS: [&str; 7] = [
    "steps",
    "blocks.0.bn.running_mean",
    "blocks.0.bn.running_var",
    "blocks.0.bn.num_batches_tracked",
    "blocks.1.bn.running_mean",
    "blocks.1.bn.running_var",
    "blocks.1.bn.num_batches_tracked",
];

#[test]
fn derived_parameter_names_equal_pytorch_names() {
    let net = Net::new().unwrap();
    assert_eq!(names(net.named_parameters()), PYTORCH_PARAMETERS);
}

#[test]
fn derived_buffer_names_equal_pytorch_names() {
    let net = Net::new().unwrap();
    assert_eq!(names(net.named_buffers()), PYTORCH_BUFFERS);
}

#[test]
fn derived_parameters_are_the_fields_tensors() {
    let net = Net::new().unwrap();
    let params = net.parameters();
    assert!(Tensor::same(&params[0], &net.scale));
    assert!(Tensor::same(&params[1], &net.stem.weight));
    assert!(Tensor::same(&params[12], net.head.bias.as_ref().unwrap()));
}

#[test]
fn eval_reaches_every_batch_norm_and_dropout() {
    let net = Net::new().unwrap();
    let (x, _) = random_tensor(&[2, 1, 5, 5], 7);
    let running = |net: &Net| -> Vec<Vec<f32>> {
        net.blocks
            .iter()
            .map(|b| b.bn.running_mean.to_vec().unwrap())
            .collect()
    };

    net.eval();
    let before = running(&net);
    let first = net.forward(&x).unwrap().to_vec().unwrap();
    let second = net.forward(&x).unwrap().to_vec().unwrap();
    assert_eq!(first, second, "eval: dropout passes its input through");
    assert_eq!(
        running(&net),
        before,
        "eval: BatchNorm keeps its running statistics"
    );
    let ones = Tensor::ones(&[64], device()).unwrap();
    for block in &net.blocks {
        assert_eq!(
            block.dropout.forward(&ones).unwrap().to_vec().unwrap(),
            vec![1.0; 64]
        );
    }

    net.train();
    net.forward(&x).unwrap();
    assert_ne!(
        running(&net),
        before,
        "train: BatchNorm updates its running statistics"
    );
    let dropped = net.blocks[1]
        .dropout
        .forward(&ones)
        .unwrap()
        .to_vec()
        .unwrap();
    assert!(dropped.contains(&0.0), "train: dropout drops");
}

/// A head tied to an embedding the PyTorch way: one tensor, two fields.
#[derive(Module)]
struct TiedLm {
    embed: nn::Embedding,
    head: nn::Linear,
}

impl TiedLm {
    fn forward(&self, tokens: &Tensor) -> Result<Tensor> {
        self.head.forward(&self.embed.forward(tokens)?)
    }
}

#[test]
fn a_tied_tensor_is_listed_once_at_its_first_name() {
    let embed = nn::Embedding::new(10, 4, device()).unwrap();
    let head = nn::Linear {
        weight: embed.weight.clone(),
        bias: None,
    };
    let lm = TiedLm { embed, head };
    assert_eq!(names(lm.named_parameters()), ["embed.weight"]);
    assert_eq!(lm.parameters().len(), 1);
    let tokens = Tensor::from_vec_u32(vec![1, 2, 3], &[1, 3], device()).unwrap();
    assert_eq!(lm.forward(&tokens).unwrap().shape(), &[1, 3, 10]);
}

#[test]
fn module_list_names_its_modules_by_position() {
    let dev = device();
    let mut list: nn::ModuleList = nn::ModuleList::new();
    list.push(Box::new(nn::Linear::new(2, 3, true, dev).unwrap()));
    list.push(Box::new(nn::Relu));
    list.push(Box::new(nn::LayerNorm::new(3, 1e-5, dev).unwrap()));
    assert_eq!(
        names(list.named_parameters()),
        ["0.weight", "0.bias", "2.weight", "2.bias"]
    );
    assert_eq!(list.len(), 3);
}

#[test]
fn module_list_forward_is_an_error_naming_it() {
    let list: nn::ModuleList<nn::Linear> = (0..2)
        .map(|_| nn::Linear::new(2, 2, false, device()))
        .collect::<Result<_>>()
        .unwrap();
    let err = list
        .forward(&Tensor::ones(&[1, 2], device()).unwrap())
        .unwrap_err();
    assert!(err.to_string().contains("ModuleList::forward"), "{err}");
}

#[test]
fn a_module_list_field_is_named_as_a_vec_field() {
    #[derive(Module)]
    struct Stack {
        layers: nn::ModuleList<nn::Linear>,
    }
    impl Stack {
        fn forward(&self, x: &Tensor) -> Result<Tensor> {
            self.layers
                .iter()
                .try_fold(x.clone(), |h, layer| layer.forward(&h))
        }
    }
    let layers = (0..2)
        .map(|_| nn::Linear::new(2, 2, false, device()))
        .collect::<Result<_>>()
        .unwrap();
    let stack = Stack { layers };
    assert_eq!(
        names(stack.named_parameters()),
        ["layers.0.weight", "layers.1.weight"]
    );
    let y = stack
        .forward(&Tensor::ones(&[1, 2], device()).unwrap())
        .unwrap();
    assert_eq!(y.shape(), &[1, 2]);
}

#[test]
fn sequential_still_names_layers_by_position() {
    let dev = device();
    let seq = nn::Sequential::new()
        .add(nn::Linear::new(2, 3, true, dev).unwrap())
        .add(nn::Relu)
        .add(nn::BatchNorm1d::new(3, dev).unwrap());
    assert_eq!(
        names(seq.named_parameters()),
        ["0.weight", "0.bias", "2.weight", "2.bias"]
    );
    assert_eq!(
        names(seq.named_buffers()),
        ["2.running_mean", "2.running_var", "2.num_batches_tracked"]
    );
}
