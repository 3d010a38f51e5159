//! Adam and AdamW.

use std::sync::{Arc, Mutex};

use crate::error::Result;
use crate::optim::group::{check_groups, flatten, restored_groups, GroupSettings};
use crate::optim::{
    bits, check_distinct, check_hyper, lock, run_update, shapes_of, zero_grads, AdamParams,
    Optimizer, OptimizerState, ParamGroup,
};
use crate::tensor::tape;
use crate::tensor::Tensor;

/// Adam's and AdamW's hyperparameters, with PyTorch's meanings and Adam's defaults. PyTorch's
/// AdamW defaults to `weight_decay: 0.01`; here it is whatever the config says.
#[derive(Debug, Clone, Copy)]
pub struct AdamConfig {
    /// Learning rate.
    pub lr: f32,
    /// Decay rates of the first and second moment estimates.
    pub betas: (f32, f32),
    /// Added to the denominator for stability.
    pub eps: f32,
    /// Adam: L2 penalty added to the grad. AdamW: decoupled decay of the parameter.
    pub weight_decay: f32,
}

impl Default for AdamConfig {
    fn default() -> Self {
        AdamConfig {
            lr: 1e-3,
            betas: (0.9, 0.999),
            eps: 1e-8,
            weight_decay: 0.0,
        }
    }
}

/// The hyperparameters and the step count, shared with the params of a captured step's
/// updates: a replay advances the count and reads the learning rate of its own step.
struct AdamHyper {
    config: AdamConfig,
    steps: u64,
}

impl AdamHyper {
    fn check(&self, op: &'static str) -> Result<()> {
        let c = self.config;
        check_hyper(op, "lr", c.lr)?;
        check_hyper(op, "eps", c.eps)?;
        check_hyper(op, "weight_decay", c.weight_decay)?;
        for beta in [c.betas.0, c.betas.1] {
            if !(0.0..1.0).contains(&beta) {
                return Err(crate::Error::InvalidArgument {
                    op,
                    msg: format!("betas must be in [0, 1), got {:?}", c.betas),
                });
            }
        }
        Ok(())
    }

    /// Checks the config and counts one more step.
    fn advance(&mut self, op: &'static str) -> Result<()> {
        self.check(op)?;
        self.steps += 1;
        Ok(())
    }

    /// The update's params for a parameter of `group`.
    fn params(&self, n: u32, decoupled: bool, group: GroupSettings) -> AdamParams {
        let c = self.config;
        let t = self.steps as i32;
        AdamParams {
            n,
            lr: group.lr(c.lr),
            weight_decay: group.weight_decay(c.weight_decay),
            beta1: c.betas.0,
            beta2: c.betas.1,
            eps: c.eps,
            bias_correction1: (1.0 - (c.betas.0 as f64).powi(t)) as f32,
            bias_correction2: (1.0 - (c.betas.1 as f64).powi(t)) as f32,
            flags: (decoupled as u32) << 2,
        }
    }
}

/// The state both optimizers share: moments per parameter and the hyperparameters.
struct AdamState {
    params: Vec<Tensor>,
    /// Each parameter's group settings.
    groups: Vec<GroupSettings>,
    /// Why the groups were refused, returned by every step.
    invalid: Option<crate::Error>,
    hyper: Arc<Mutex<AdamHyper>>,
    moments: Vec<Option<(Tensor, Tensor)>>,
}

impl AdamState {
    fn new(op: &'static str, groups: Vec<ParamGroup>, config: AdamConfig) -> AdamState {
        let (params, groups, invalid) = flatten(op, groups, config.lr);
        let moments = params.iter().map(|_| None).collect();
        AdamState {
            params,
            groups,
            invalid,
            hyper: Arc::new(Mutex::new(AdamHyper { config, steps: 0 })),
            moments,
        }
    }

    fn step(&mut self, op: &'static str, decoupled: bool) -> Result<()> {
        check_groups(&self.invalid)?;
        check_distinct(op, &self.params)?;
        lock(&self.hyper).advance(op)?;
        let shared = self.hyper.clone();
        tape::on_replay(move || lock(&shared).advance(op));
        let per_param = self.params.iter().zip(&self.groups);
        for ((param, group), moments) in per_param.zip(&mut self.moments) {
            let Some(grad) = param.grad() else { continue };
            let (m, v) = match moments {
                Some(state) => state.clone(),
                None => (
                    Tensor::zeros(param.shape(), param.device())?,
                    Tensor::zeros(param.shape(), param.device())?,
                ),
            };
            let shared = self.hyper.clone();
            let group = *group;
            let params = move |n| lock(&shared).params(n, decoupled, group);
            run_update(op, "adam", param, &grad, &[&m, &v], params)?;
            *moments = Some((m, v));
        }
        Ok(())
    }
}

impl AdamState {
    fn state(&self, kind: &str) -> OptimizerState {
        let hyper = lock(&self.hyper);
        let mut scalars = vec![
            ("lr".to_string(), bits(hyper.config.lr)),
            ("steps".to_string(), hyper.steps.to_string()),
        ];
        scalars.extend(
            self.groups
                .iter()
                .enumerate()
                .map(|(i, g)| (format!("{i}.group"), g.saved())),
        );
        let mut tensors = Vec::new();
        for (i, m) in self.moments.iter().enumerate() {
            if let Some((m, v)) = m {
                tensors.push((format!("{i}.exp_avg"), m.clone()));
                tensors.push((format!("{i}.exp_avg_sq"), v.clone()));
            }
        }
        OptimizerState {
            kind: kind.into(),
            shapes: shapes_of(&self.params),
            scalars,
            tensors,
        }
    }

    fn load_state(&mut self, kind: &str, state: &OptimizerState) -> Result<()> {
        state.expect(kind, &shapes_of(&self.params))?;
        let lr = state.scalar_f32("lr")?;
        let steps = state.scalar_u64("steps")?;
        let groups = restored_groups(state, self.params.len())?;
        let mut moments = Vec::with_capacity(self.params.len());
        for (i, p) in self.params.iter().enumerate() {
            let m = state.tensor(&format!("{i}.exp_avg"), p.shape())?;
            let v = state.tensor(&format!("{i}.exp_avg_sq"), p.shape())?;
            moments.push(match (m, v) {
                (Some(m), Some(v)) => Some((m.detach(), v.detach())),
                (None, None) => None,
                _ => {
                    return Err(crate::Error::InvalidArgument {
                        op: "Optimizer::load_state",
                        msg: format!("parameter {i} has one of its two moments saved"),
                    })
                }
            });
        }
        let mut hyper = lock(&self.hyper);
        hyper.config.lr = lr;
        hyper.steps = steps;
        drop(hyper);
        self.groups = groups;
        self.moments = moments;
        Ok(())
    }
}

/// Adam as `torch.optim.Adam` (weight decay as an L2 term in the grad).
pub struct Adam(AdamState);

/// AdamW as `torch.optim.AdamW` (weight decay applied to the parameter, decoupled).
pub struct AdamW(AdamState);

impl Adam {
    /// Adam over `params` (handles to the parameters themselves).
    pub fn new(params: Vec<Tensor>, config: AdamConfig) -> Adam {
        Adam::with_groups(vec![ParamGroup::new(params)], config)
    }

    /// Adam over parameter groups, each with its own learning rate and weight decay (the
    /// config's where it sets none). Invalid groups make every `step` an error that changes
    /// nothing.
    pub fn with_groups(groups: Vec<ParamGroup>, config: AdamConfig) -> Adam {
        Adam(AdamState::new("Adam::step", groups, config))
    }
}

impl AdamW {
    /// AdamW over `params` (handles to the parameters themselves).
    pub fn new(params: Vec<Tensor>, config: AdamConfig) -> AdamW {
        AdamW::with_groups(vec![ParamGroup::new(params)], config)
    }

    /// AdamW over parameter groups (the usual: weight decay on weights, none on biases and
    /// norms), each with its own learning rate and weight decay.
    pub fn with_groups(groups: Vec<ParamGroup>, config: AdamConfig) -> AdamW {
        AdamW(AdamState::new("AdamW::step", groups, config))
    }
}

macro_rules! impl_optimizer {
    ($ty:ident, $kind:literal, $op:literal, $decoupled:literal) => {
        impl Optimizer for $ty {
            fn step(&mut self) -> Result<()> {
                self.0.step($op, $decoupled)
            }

            fn zero_grad(&mut self) {
                zero_grads(&self.0.params);
            }

            fn parameters(&self) -> Vec<Tensor> {
                self.0.params.clone()
            }

            fn lr(&self) -> f32 {
                lock(&self.0.hyper).config.lr
            }

            fn set_lr(&mut self, lr: f32) {
                lock(&self.0.hyper).config.lr = lr;
            }

            fn state(&self) -> OptimizerState {
                self.0.state($kind)
            }

            fn load_state(&mut self, state: &OptimizerState) -> Result<()> {
                self.0.load_state($kind, state)
            }
        }
    };
}

impl_optimizer!(Adam, "Adam", "Adam::step", false);
impl_optimizer!(AdamW, "AdamW", "AdamW::step", true);
