//! Optimizers against a CPU reference: five steps of SGD with momentum (and Nesterov, weight
//! decay), Adam and AdamW on a small MLP match the same model and optimizer written here in
//! f64, to 1e-4.

mod common;
use common::*;
use wgrad::nn::{self, Module};
use wgrad::optim::{self, LrSchedule, Optimizer};
use wgrad::{Error, Tensor};

const N: usize = 6;
const IN: usize = 4;
const HIDDEN: usize = 8;
const OUT: usize = 3;
const LABELS: [u32; N] = [0, 2, 1, 1, 0, 2];

/// The MLP's parameters on the host: w1 [HIDDEN, IN], b1, w2 [OUT, HIDDEN], b2.
type Params = [Vec<f64>; 4];

/// Loss grads of the MLP `tanh(x W1^T + b1) W2^T + b2` under mean cross-entropy, in f64.
fn cpu_grads(p: &Params, x: &[f64]) -> Params {
    let (w1, b1, w2, b2) = (&p[0], &p[1], &p[2], &p[3]);
    let mut g = [
        vec![0.0; HIDDEN * IN],
        vec![0.0; HIDDEN],
        vec![0.0; OUT * HIDDEN],
        vec![0.0; OUT],
    ];
    for r in 0..N {
        let h: Vec<f64> = (0..HIDDEN)
            .map(|j| (b1[j] + (0..IN).map(|k| x[r * IN + k] * w1[j * IN + k]).sum::<f64>()).tanh())
            .collect();
        let logits: Vec<f64> = (0..OUT)
            .map(|o| b2[o] + (0..HIDDEN).map(|j| h[j] * w2[o * HIDDEN + j]).sum::<f64>())
            .collect();
        let m = logits.iter().cloned().fold(f64::MIN, f64::max);
        let z: f64 = logits.iter().map(|l| (l - m).exp()).sum();
        let dlogits: Vec<f64> = (0..OUT)
            .map(|o| {
                ((logits[o] - m).exp() / z - if o == LABELS[r] as usize { 1.0 } else { 0.0 })
                    / N as f64
            })
            .collect();
        for o in 0..OUT {
            g[3][o] += dlogits[o];
            for j in 0..HIDDEN {
                g[2][o * HIDDEN + j] += dlogits[o] * h[j];
            }
        }
        for j in 0..HIDDEN {
            let dh: f64 = (0..OUT)
                .map(|o| dlogits[o] * w2[o * HIDDEN + j])
                .sum::<f64>()
                * (1.0 - h[j] * h[j]);
            g[1][j] += dh;
            for k in 0..IN {
                g[0][j * IN + k] += dh * x[r * IN + k];
            }
        }
    }
    g
}

/// One optimizer's update rule on the host, with its state.
trait CpuOptimizer {
    fn update(&mut self, params: &mut Params, grads: &Params);
}

struct CpuSgd {
    lr: f64,
    momentum: f64,
    nesterov: bool,
    weight_decay: f64,
    buffers: Option<Params>,
}

impl CpuOptimizer for CpuSgd {
    fn update(&mut self, params: &mut Params, grads: &Params) {
        let first = self.buffers.is_none();
        let buffers = self.buffers.get_or_insert_with(|| grads.clone());
        for t in 0..4 {
            for i in 0..params[t].len() {
                let g = grads[t][i] + self.weight_decay * params[t][i];
                buffers[t][i] = if first {
                    g
                } else {
                    self.momentum * buffers[t][i] + g
                };
                let step = if self.nesterov {
                    g + self.momentum * buffers[t][i]
                } else {
                    buffers[t][i]
                };
                params[t][i] -= self.lr * step;
            }
        }
    }
}

struct CpuAdam {
    lr: f64,
    betas: (f64, f64),
    eps: f64,
    weight_decay: f64,
    decoupled: bool,
    moments: Option<(Params, Params)>,
    steps: i32,
}

impl CpuOptimizer for CpuAdam {
    fn update(&mut self, params: &mut Params, grads: &Params) {
        self.steps += 1;
        let zeros = || grads.clone().map(|v| vec![0.0; v.len()]);
        let (m, v) = self.moments.get_or_insert_with(|| (zeros(), zeros()));
        let (bc1, bc2) = (
            1.0 - self.betas.0.powi(self.steps),
            1.0 - self.betas.1.powi(self.steps),
        );
        for t in 0..4 {
            for i in 0..params[t].len() {
                let mut g = grads[t][i];
                if self.decoupled {
                    params[t][i] *= 1.0 - self.lr * self.weight_decay;
                } else {
                    g += self.weight_decay * params[t][i];
                }
                m[t][i] = self.betas.0 * m[t][i] + (1.0 - self.betas.0) * g;
                v[t][i] = self.betas.1 * v[t][i] + (1.0 - self.betas.1) * g * g;
                params[t][i] -= self.lr / bc1 * m[t][i] / (v[t][i].sqrt() / bc2.sqrt() + self.eps);
            }
        }
    }
}

fn model() -> nn::Sequential {
    let dev = device();
    nn::Sequential::new()
        .add(nn::Linear::new(IN, HIDDEN, true, dev).unwrap())
        .add(nn::Tanh)
        .add(nn::Linear::new(HIDDEN, OUT, true, dev).unwrap())
}

fn host(params: &[Tensor]) -> Params {
    let v: Vec<Vec<f64>> = params
        .iter()
        .map(|p| p.to_vec().unwrap().iter().map(|&x| x as f64).collect())
        .collect();
    [v[0].clone(), v[1].clone(), v[2].clone(), v[3].clone()]
}

/// Five steps on the device and on the host from the same start; the parameters must agree.
fn five_steps_match(
    name: &str,
    make: impl Fn(Vec<Tensor>) -> Box<dyn Optimizer>,
    mut cpu: impl CpuOptimizer,
) {
    let net = model();
    let params = net.parameters();
    let (x, xs) = random_tensor(&[N, IN], 3);
    let x64: Vec<f64> = xs.iter().map(|&v| v as f64).collect();
    let labels = Tensor::from_labels(LABELS.to_vec(), device()).unwrap();
    let mut reference = host(&params);
    let mut opt = make(params.clone());
    for step in 0..5 {
        opt.zero_grad();
        nn::loss::cross_entropy(&net.forward(&x).unwrap(), &labels)
            .unwrap()
            .backward()
            .unwrap();
        opt.step().unwrap();
        let grads = cpu_grads(&reference, &x64);
        cpu.update(&mut reference, &grads);
        for (i, (p, want)) in params.iter().zip(&reference).enumerate() {
            assert_close(
                &p.to_vec().unwrap(),
                want,
                1e-4,
                &format!("{name} step {step} param {i}"),
            );
        }
    }
}

#[test]
fn sgd_with_momentum_matches_the_cpu_reference() {
    let config = optim::SgdConfig {
        lr: 0.1,
        momentum: 0.9,
        ..Default::default()
    };
    let cpu = CpuSgd {
        lr: 0.1,
        momentum: 0.9,
        nesterov: false,
        weight_decay: 0.0,
        buffers: None,
    };
    five_steps_match(
        "sgd momentum",
        |p| Box::new(optim::Sgd::new(p, config)),
        cpu,
    );
}

#[test]
fn sgd_with_nesterov_and_weight_decay_matches_the_cpu_reference() {
    let config = optim::SgdConfig {
        lr: 0.05,
        momentum: 0.8,
        nesterov: true,
        weight_decay: 0.01,
        ..Default::default()
    };
    let cpu = CpuSgd {
        lr: 0.05,
        momentum: 0.8,
        nesterov: true,
        weight_decay: 0.01,
        buffers: None,
    };
    five_steps_match(
        "sgd nesterov",
        |p| Box::new(optim::Sgd::new(p, config)),
        cpu,
    );
}

#[test]
fn plain_sgd_matches_the_cpu_reference() {
    let config = optim::SgdConfig {
        lr: 0.2,
        ..Default::default()
    };
    let cpu = CpuSgd {
        lr: 0.2,
        momentum: 0.0,
        nesterov: false,
        weight_decay: 0.0,
        buffers: None,
    };
    five_steps_match("sgd", |p| Box::new(optim::Sgd::new(p, config)), cpu);
}

#[test]
fn adam_matches_the_cpu_reference() {
    let config = optim::AdamConfig {
        lr: 0.01,
        weight_decay: 0.001,
        ..Default::default()
    };
    let cpu = CpuAdam {
        lr: 0.01,
        betas: (0.9, 0.999),
        eps: 1e-8,
        weight_decay: 0.001,
        decoupled: false,
        moments: None,
        steps: 0,
    };
    five_steps_match("adam", |p| Box::new(optim::Adam::new(p, config)), cpu);
}

#[test]
fn adamw_matches_the_cpu_reference() {
    let config = optim::AdamConfig {
        lr: 0.01,
        weight_decay: 0.1,
        ..Default::default()
    };
    let cpu = CpuAdam {
        lr: 0.01,
        betas: (0.9, 0.999),
        eps: 1e-8,
        weight_decay: 0.1,
        decoupled: true,
        moments: None,
        steps: 0,
    };
    five_steps_match("adamw", |p| Box::new(optim::AdamW::new(p, config)), cpu);
}

#[test]
fn a_step_updates_parameters_in_place_and_zero_grad_empties_the_slots() {
    let net = model();
    let params = net.parameters();
    let ids: Vec<u64> = params.iter().map(|p| p.storage_id()).collect();
    let mut opt = optim::Adam::new(params.clone(), optim::AdamConfig::default());
    let (x, _) = random_tensor(&[N, IN], 4);
    let before = params[0].to_vec().unwrap();
    net.forward(&x).unwrap().sum().unwrap().backward().unwrap();
    opt.step().unwrap();
    assert_ne!(params[0].to_vec().unwrap(), before);
    assert_eq!(
        params.iter().map(|p| p.storage_id()).collect::<Vec<_>>(),
        ids,
        "storage never changes"
    );
    assert!(Tensor::same(&net.parameters()[0], &params[0]));
    opt.zero_grad();
    assert!(params.iter().all(|p| p.grad().is_none()));
}

#[test]
fn a_non_finite_learning_rate_is_an_error_that_leaves_parameters_alone() {
    let net = model();
    let params = net.parameters();
    let (x, _) = random_tensor(&[N, IN], 5);
    net.forward(&x).unwrap().sum().unwrap().backward().unwrap();
    let before = params[0].to_vec().unwrap();
    let mut opt = optim::Sgd::new(
        params.clone(),
        optim::SgdConfig {
            lr: f32::NAN,
            ..Default::default()
        },
    );
    let err = opt.step().unwrap_err();
    assert!(
        matches!(
            err,
            Error::InvalidArgument {
                op: "Sgd::step",
                ..
            }
        ) && err.to_string().contains("lr"),
        "{err}"
    );
    assert_eq!(params[0].to_vec().unwrap(), before);
}

#[test]
fn clip_grad_norm_scales_grads_to_the_max_norm() {
    let a = Tensor::zeros(&[2], device()).unwrap().requires_grad_(true);
    let b = Tensor::zeros(&[1], device()).unwrap().requires_grad_(true);
    a.set_grad(Some(
        Tensor::from_vec(vec![3.0, 0.0], &[2], device()).unwrap(),
    ))
    .unwrap();
    b.set_grad(Some(Tensor::from_vec(vec![4.0], &[1], device()).unwrap()))
        .unwrap();
    let norm = optim::clip_grad_norm(&[a.clone(), b.clone()], 1.0).unwrap();
    assert!((norm.item().unwrap() - 5.0).abs() < 1e-5);
    assert_close(&a.grad().unwrap().to_vec().unwrap(), &[0.6, 0.0], 1e-5, "a");
    assert_close(&b.grad().unwrap().to_vec().unwrap(), &[0.8], 1e-5, "b");
    // Under the limit, nothing changes.
    optim::clip_grad_norm(&[a.clone(), b.clone()], 10.0).unwrap();
    assert_close(
        &b.grad().unwrap().to_vec().unwrap(),
        &[0.8],
        1e-5,
        "b unchanged",
    );
}

/// `clip_grad_norm(params, f32::INFINITY)` is torch's idiom for the grads' norm alone (a
/// coefficient of 1); a max_norm of 0 zeroes the grads; a negative or NaN one is an error.
#[test]
fn clip_grad_norm_to_infinity_measures_and_to_zero_zeroes() {
    let a = Tensor::zeros(&[2], device()).unwrap().requires_grad_(true);
    a.set_grad(Some(
        Tensor::from_vec(vec![3.0, -4.0], &[2], device()).unwrap(),
    ))
    .unwrap();
    let norm = optim::clip_grad_norm(std::slice::from_ref(&a), f32::INFINITY).unwrap();
    assert_eq!(norm.item().unwrap(), 5.0);
    assert_eq!(a.grad().unwrap().to_vec().unwrap(), vec![3.0, -4.0]);
    let norm = optim::clip_grad_norm(std::slice::from_ref(&a), 0.0).unwrap();
    assert_eq!(norm.item().unwrap(), 5.0);
    assert_eq!(a.grad().unwrap().to_vec().unwrap(), vec![0.0, 0.0]);
    for bad in [-1.0, f32::NAN, f32::NEG_INFINITY] {
        let err = optim::clip_grad_norm(std::slice::from_ref(&a), bad).unwrap_err();
        assert!(err.to_string().contains("max_norm must be >= 0"), "{err}");
    }
}

/// torch's `clip_grad_norm_` over parameters without grads returns a norm of 0 and changes
/// nothing (a frozen model's step); with no parameters at all wgrad has no device for it.
#[test]
fn clip_grad_norm_without_grads_is_a_norm_of_zero() {
    let a = Tensor::zeros(&[2], device()).unwrap().requires_grad_(true);
    let norm = optim::clip_grad_norm(std::slice::from_ref(&a), 1.0).unwrap();
    assert_eq!(norm.shape(), &[] as &[usize]);
    assert_eq!(norm.item().unwrap(), 0.0);
    assert!(a.grad().is_none());
    let err = optim::clip_grad_norm(&[], 1.0).unwrap_err();
    assert!(
        matches!(
            err,
            Error::InvalidArgument {
                op: "clip_grad_norm",
                ..
            }
        ),
        "{err}"
    );
}

/// Makes an optimizer over the parameters it is given.
type MakeOptimizer = fn(Vec<Tensor>) -> Box<dyn Optimizer>;

#[test]
fn a_schedule_that_ends_at_a_rate_of_zero_trains_through_its_last_step() {
    // CosineLr's min_lr of 0 (torch's eta_min default) gives the last step a rate of 0: the
    // step runs, as torch's does, and moves nothing (no decay at rate 0 either).
    let makers: [(&str, MakeOptimizer); 3] = [
        ("sgd", |p| {
            Box::new(optim::Sgd::new(
                p,
                optim::SgdConfig {
                    lr: 0.1,
                    momentum: 0.9,
                    weight_decay: 0.1,
                    ..Default::default()
                },
            ))
        }),
        ("adam", |p| {
            Box::new(optim::Adam::new(p, optim::AdamConfig::default()))
        }),
        ("adamw", |p| {
            Box::new(optim::AdamW::new(
                p,
                optim::AdamConfig {
                    weight_decay: 0.1,
                    ..Default::default()
                },
            ))
        }),
    ];
    let schedule = optim::CosineLr {
        base_lr: 0.1,
        min_lr: 0.0,
        total_steps: 3,
    };
    let (x, _) = random_tensor(&[N, IN], 8);
    let labels = Tensor::from_labels(LABELS.to_vec(), device()).unwrap();
    for (name, make) in makers {
        let net = model();
        let params = net.parameters();
        let mut opt = make(params.clone());
        for step in 0..=3 {
            opt.set_lr(schedule.lr(step));
            opt.zero_grad();
            nn::loss::cross_entropy(&net.forward(&x).unwrap(), &labels)
                .unwrap()
                .backward()
                .unwrap();
            let before: Vec<Vec<f32>> = params.iter().map(|p| p.to_vec().unwrap()).collect();
            opt.step()
                .unwrap_or_else(|e| panic!("{name}, step {step}: {e}"));
            let after: Vec<Vec<f32>> = params.iter().map(|p| p.to_vec().unwrap()).collect();
            assert_eq!(
                before == after,
                step == 3,
                "{name}, step {step} at lr {}",
                schedule.lr(step)
            );
        }
    }
}

#[test]
fn a_negative_learning_rate_is_an_error() {
    let net = model();
    let mut opt = optim::Sgd::new(
        net.parameters(),
        optim::SgdConfig {
            lr: -0.1,
            ..Default::default()
        },
    );
    let err = opt.step().unwrap_err();
    assert!(
        err.to_string().contains("lr must be finite and >= 0"),
        "{err}"
    );
    let mut adam = optim::Adam::new(net.parameters(), optim::AdamConfig::default());
    adam.set_lr(-0.1);
    assert!(adam.step().is_err());
    // A group's rate is a multiple of the base rate, so a base of 0 leaves it none.
    let mut grouped = optim::Sgd::with_groups(
        vec![optim::ParamGroup::new(net.parameters()).lr(0.1)],
        optim::SgdConfig {
            lr: 0.0,
            ..Default::default()
        },
    );
    let err = grouped.step().unwrap_err();
    assert!(
        err.to_string().contains("multiple of the config's lr"),
        "{err}"
    );
}

#[test]
fn warmup_then_cosine_follows_transformers_cosine_schedule_with_warmup() {
    // transformers' get_cosine_schedule_with_warmup(num_warmup_steps=10,
    // num_training_steps=50): step / 10 during the warmup, then 0.5 (1 + cos(pi progress)).
    let (warmup, total, base) = (10usize, 50usize, 3e-4f64);
    let want = |step: usize| {
        if step < warmup {
            base * step as f64 / warmup as f64
        } else {
            let progress = (step - warmup) as f64 / (total - warmup) as f64;
            base * 0.5 * (1.0 + (std::f64::consts::PI * progress).cos())
        }
    };
    let schedule = optim::Warmup {
        steps: warmup,
        schedule: optim::CosineLr {
            base_lr: base as f32,
            min_lr: 0.0,
            total_steps: total - warmup,
        },
    };
    for step in 0..=total {
        let got = schedule.lr(step) as f64;
        assert!(
            (got - want(step)).abs() <= 1e-7 * base,
            "step {step}: {got} vs {}",
            want(step)
        );
    }
    assert_eq!(schedule.lr(total + 5), 0.0);
    // No warmup: the schedule alone.
    let plain = optim::Warmup {
        steps: 0,
        schedule: schedule.schedule,
    };
    assert_eq!(plain.lr(0), base as f32);
}

#[test]
fn cosine_and_step_schedules_follow_pytorch() {
    let cosine = optim::CosineLr {
        base_lr: 0.1,
        min_lr: 0.0,
        total_steps: 10,
    };
    assert!((cosine.lr(0) - 0.1).abs() < 1e-7);
    assert!((cosine.lr(5) - 0.05).abs() < 1e-7);
    assert!(cosine.lr(10).abs() < 1e-7 && cosine.lr(20).abs() < 1e-7);
    let step = optim::StepLr {
        base_lr: 1.0,
        step_size: 3,
        gamma: 0.5,
    };
    assert_eq!(
        [step.lr(0), step.lr(2), step.lr(3), step.lr(7)],
        [1.0, 1.0, 0.5, 0.25]
    );
}

/// A language model's embedding with its head tied to it, the PyTorch way: the head's weight
/// is the embedding's tensor.
struct TiedLm {
    embed: nn::Embedding,
    head: nn::Linear,
}

impl TiedLm {
    fn new() -> TiedLm {
        let embed = nn::Embedding::new(6, 4, device()).unwrap();
        let head = nn::Linear {
            weight: embed.weight.clone(),
            bias: None,
        };
        TiedLm { embed, head }
    }

    fn loss(&self) -> Tensor {
        let tokens = Tensor::from_labels(vec![1, 4, 4, 0], device()).unwrap();
        let logits = self
            .head
            .forward(&self.embed.forward(&tokens).unwrap())
            .unwrap();
        let targets = Tensor::from_labels(vec![4, 0, 2, 1], device()).unwrap();
        nn::loss::cross_entropy(&logits, &targets).unwrap()
    }
}

impl Module for TiedLm {
    fn forward(&self, x: &Tensor) -> wgrad::Result<Tensor> {
        self.head.forward(&self.embed.forward(x)?)
    }

    fn named_parameters(&self) -> Vec<(String, Tensor)> {
        let mut named = vec![("embed.weight".to_string(), self.embed.weight.clone())];
        named.extend(
            self.head
                .named_parameters()
                .into_iter()
                .map(|(n, t)| (format!("head.{n}"), t)),
        );
        named
    }
}

#[test]
fn a_tied_weight_is_listed_once_and_moves_once_per_step() {
    let model = TiedLm::new();
    assert_eq!(model.named_parameters().len(), 2);
    let params = model.parameters();
    assert_eq!(params.len(), 1);
    assert!(Tensor::same(&params[0], &model.embed.weight));
    let before = model.embed.weight.to_vec().unwrap();
    let mut opt = optim::Sgd::new(
        params,
        optim::SgdConfig {
            lr: 0.1,
            ..Default::default()
        },
    );
    model.loss().backward().unwrap();
    let grad = model.embed.weight.grad().unwrap().to_vec().unwrap();
    opt.step().unwrap();
    let after = model.embed.weight.to_vec().unwrap();
    let want: Vec<f64> = before
        .iter()
        .zip(&grad)
        .map(|(w, g)| *w as f64 - 0.1 * *g as f64)
        .collect();
    assert_close(&after, &want, 1e-6, "one step of lr x grad");
}

#[test]
fn optimizers_refuse_a_parameter_listed_twice_and_leave_it_alone() {
    let model = TiedLm::new();
    let w = model.embed.weight.clone();
    model.loss().backward().unwrap();
    let before = w.to_vec().unwrap();
    let twice = vec![w.clone(), w.clone()];
    let mut sgd = optim::Sgd::new(twice.clone(), Default::default());
    let err = sgd.step().unwrap_err();
    assert!(
        matches!(
            err,
            Error::InvalidArgument {
                op: "Sgd::step",
                ..
            }
        ),
        "{err}"
    );
    assert!(err.to_string().contains("[6, 4]"), "{err}");
    let mut adam = optim::AdamW::new(twice, Default::default());
    assert!(adam.step().is_err());
    assert_eq!(w.to_vec().unwrap(), before);
}

#[test]
fn clip_grad_norm_counts_a_tied_weight_once_as_torch() {
    let model = TiedLm::new();
    model.loss().backward().unwrap();
    let w = &model.embed.weight;
    let grad = w.grad().unwrap().to_vec().unwrap();
    // torch.nn.utils.clip_grad_norm_(model.parameters(), ..): the one tensor's norm.
    let want = grad.iter().map(|g| (*g as f64).powi(2)).sum::<f64>().sqrt();
    let norm = optim::clip_grad_norm(&[w.clone(), w.clone()], 1e-3).unwrap();
    assert_close(&[norm.item().unwrap()], &[want], 1e-5, "norm");
    let clipped = w.grad().unwrap().to_vec().unwrap();
    let scale = 1e-3 / (want + 1e-6);
    let want_clipped: Vec<f64> = grad.iter().map(|g| *g as f64 * scale).collect();
    assert_close(&clipped, &want_clipped, 1e-5, "scaled once");
}

/// Two layers' worth of parameters: weights and biases.
fn weights_and_biases() -> (Vec<Tensor>, Vec<Tensor>) {
    let model = model();
    let named = model.named_parameters();
    let (w, b): (Vec<_>, Vec<_>) = named.into_iter().partition(|(n, _)| n.ends_with("weight"));
    (
        w.into_iter().map(|(_, t)| t).collect(),
        b.into_iter().map(|(_, t)| t).collect(),
    )
}

/// Copies of `params` that are leaves of their own, with the same values.
fn copies(params: &[Tensor]) -> Vec<Tensor> {
    params
        .iter()
        .map(|p| {
            Tensor::from_slice(&p.to_vec().unwrap(), p.shape(), device())
                .unwrap()
                .requires_grad_(true)
        })
        .collect()
}

/// Gives every parameter the grad `0.1 (i + 1)` times its values, so steps differ per tensor.
fn set_grads(params: &[Tensor]) {
    for (i, p) in params.iter().enumerate() {
        p.set_grad(Some(p.mul_scalar(0.1 * (i + 1) as f32).unwrap().detach()))
            .unwrap();
    }
}

#[test]
fn parameter_groups_equal_one_optimizer_per_group() {
    let (w, b) = weights_and_biases();
    let (w2, b2) = (copies(&w), copies(&b));
    let config = optim::AdamConfig {
        lr: 1e-2,
        weight_decay: 0.1,
        ..Default::default()
    };
    let groups = vec![
        optim::ParamGroup::new(w.clone()),
        optim::ParamGroup::new(b.clone()).weight_decay(0.0).lr(3e-2),
    ];
    let mut grouped = optim::AdamW::with_groups(groups, config);
    let mut for_weights = optim::AdamW::new(w2.clone(), config);
    let mut for_biases = optim::AdamW::new(
        b2.clone(),
        optim::AdamConfig {
            lr: 3e-2,
            weight_decay: 0.0,
            ..config
        },
    );
    for step in 0..4 {
        if step == 2 {
            // A schedule's new base rate reaches every group, ratios kept.
            grouped.set_lr(5e-3);
            for_weights.set_lr(5e-3);
            for_biases.set_lr(1.5e-2);
        }
        let all: Vec<Tensor> = w.iter().chain(&b).cloned().collect();
        let all2: Vec<Tensor> = w2.iter().chain(&b2).cloned().collect();
        set_grads(&all);
        set_grads(&all2);
        grouped.step().unwrap();
        for_weights.step().unwrap();
        for_biases.step().unwrap();
        for (a, c) in all.iter().zip(&all2) {
            let want: Vec<f64> = c.to_vec().unwrap().iter().map(|&v| v as f64).collect();
            assert_close(&a.to_vec().unwrap(), &want, 1e-6, &format!("step {step}"));
        }
    }
    assert_eq!(grouped.lr(), 5e-3);
}

#[test]
fn bad_groups_make_every_step_an_error_that_changes_nothing() {
    let (w, b) = weights_and_biases();
    set_grads(&w);
    let before: Vec<Vec<f32>> = w.iter().map(|p| p.to_vec().unwrap()).collect();
    let cases: Vec<(Vec<optim::ParamGroup>, &str)> = vec![
        (
            vec![
                optim::ParamGroup::new(w.clone()),
                optim::ParamGroup::new(vec![]),
            ],
            "group 1 is empty",
        ),
        (
            vec![
                optim::ParamGroup::new(w.clone()),
                optim::ParamGroup::new(vec![w[0].clone()]),
            ],
            "one tensor",
        ),
        (vec![optim::ParamGroup::new(w.clone()).lr(f32::NAN)], "lr"),
        (
            vec![optim::ParamGroup::new(b.clone()).weight_decay(-1.0)],
            "weight_decay",
        ),
    ];
    for (groups, needle) in cases {
        let mut sgd = optim::Sgd::with_groups(groups.clone(), Default::default());
        let err = sgd.step().unwrap_err();
        assert!(err.to_string().contains(needle), "{err}");
        let mut adam = optim::Adam::with_groups(groups, Default::default());
        assert!(adam.step().is_err());
    }
    for (p, v) in w.iter().zip(&before) {
        assert_eq!(&p.to_vec().unwrap(), v);
    }
}

/// AdamW over `model`'s weights (decay 0.1) and biases (no decay, 3x the rate), or over all
/// its parameters in one group.
fn grouped_adamw(model: &nn::Sequential, grouped: bool) -> optim::AdamW {
    let (w, b): (Vec<_>, Vec<_>) = model
        .named_parameters()
        .into_iter()
        .partition(|(n, _)| n.ends_with("weight"));
    let strip = |v: Vec<(String, Tensor)>| v.into_iter().map(|(_, t)| t).collect::<Vec<_>>();
    let groups = match grouped {
        true => vec![
            optim::ParamGroup::new(strip(w)),
            optim::ParamGroup::new(strip(b)).weight_decay(0.0).lr(3e-3),
        ],
        false => vec![optim::ParamGroup::new(model.parameters())],
    };
    let config = optim::AdamConfig {
        weight_decay: 0.1,
        ..Default::default()
    };
    optim::AdamW::with_groups(groups, config)
}

#[test]
fn a_captured_step_with_groups_equals_eager_in_as_many_launches_as_with_one() {
    use wgrad::capture::Step;
    let (x, _) = random_tensor(&[8, 4], 3);
    let y = Tensor::from_labels((0..8).map(|i| i % 3).collect(), device()).unwrap();
    let train = |model: &nn::Sequential, opt: &mut optim::AdamW, inputs: &[Tensor]| {
        opt.zero_grad();
        let loss = nn::loss::cross_entropy(&model.forward(&inputs[0])?, &inputs[1])?;
        loss.backward()?;
        opt.step()?;
        Ok(loss)
    };
    // (dispatches per replay, losses) of 5 captured calls.
    let captured = |model: &nn::Sequential, grouped: bool| {
        let mut opt = grouped_adamw(model, grouped);
        let mut step = Step::new(|inputs: &[Tensor]| train(model, &mut opt, inputs));
        let losses: Vec<f32> = (0..5)
            .map(|_| step.run(&[x.clone(), y.clone()]).unwrap().item().unwrap())
            .collect();
        assert_eq!(step.stats().replays, 3);
        (step.stats().replay_dispatches, losses)
    };
    let eager_model = model();
    let twin = model();
    wgrad::no_grad(|| {
        for (a, b) in twin.parameters().iter().zip(eager_model.parameters()) {
            a.copy_(&b)?;
        }
        wgrad::Result::Ok(())
    })
    .unwrap();
    let mut opt = grouped_adamw(&eager_model, true);
    let want: Vec<f32> = (0..5)
        .map(|_| {
            train(&eager_model, &mut opt, &[x.clone(), y.clone()])
                .unwrap()
                .item()
                .unwrap()
        })
        .collect();
    let (two, got) = captured(&twin, true);
    let want: Vec<f64> = want.iter().map(|&v| v as f64).collect();
    assert_close(&got, &want, 1e-5, "captured losses with groups");
    let (one, _) = captured(&model(), false);
    assert_eq!(one, two, "dispatches per replay, one group vs two");
}
