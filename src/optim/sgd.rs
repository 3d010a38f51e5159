//! Stochastic gradient descent with momentum, Nesterov momentum and weight decay.

use std::sync::{Arc, Mutex};

use crate::error::{Error, Result};
use crate::optim::group::{check_groups, flatten, restored_groups, GroupSettings};
use crate::optim::{
    bits, check_distinct, check_hyper, lock, run_update, shapes_of, zero_grads, Optimizer,
    OptimizerState, ParamGroup, SgdParams,
};
use crate::tensor::tape;
use crate::tensor::Tensor;

/// `Sgd`'s hyperparameters, with PyTorch's meanings and defaults.
#[derive(Debug, Clone, Copy)]
pub struct SgdConfig {
    /// Learning rate.
    pub lr: f32,
    /// Momentum factor (0: plain SGD).
    pub momentum: f32,
    /// Dampening for momentum.
    pub dampening: f32,
    /// Nesterov momentum (needs momentum > 0 and dampening 0).
    pub nesterov: bool,
    /// L2 penalty added to the grad.
    pub weight_decay: f32,
}

impl Default for SgdConfig {
    fn default() -> Self {
        SgdConfig {
            lr: 1e-2,
            momentum: 0.0,
            dampening: 0.0,
            nesterov: false,
            weight_decay: 0.0,
        }
    }
}

/// SGD as `torch.optim.SGD`.
pub struct Sgd {
    params: Vec<Tensor>,
    /// Each parameter's group settings.
    groups: Vec<GroupSettings>,
    /// Why the groups were refused, returned by every step.
    invalid: Option<Error>,
    /// Shared with the params of a captured step's updates, which read it at each replay.
    config: Arc<Mutex<SgdConfig>>,
    momentum_buffers: Vec<Option<Tensor>>,
}

impl Sgd {
    /// SGD over `params` (handles to the parameters themselves).
    pub fn new(params: Vec<Tensor>, config: SgdConfig) -> Sgd {
        Sgd::with_groups(vec![ParamGroup::new(params)], config)
    }

    /// SGD over parameter groups, each with its own learning rate and weight decay (the
    /// config's where it sets none). Invalid groups (empty, a bad rate) make every `step` an
    /// error that changes nothing.
    pub fn with_groups(groups: Vec<ParamGroup>, config: SgdConfig) -> Sgd {
        let (params, groups, invalid) = flatten("Sgd::step", groups, config.lr);
        let momentum_buffers = params.iter().map(|_| None).collect();
        Sgd {
            params,
            groups,
            invalid,
            config: Arc::new(Mutex::new(config)),
            momentum_buffers,
        }
    }
}

fn check_config(c: &SgdConfig) -> Result<()> {
    const OP: &str = "Sgd::step";
    check_hyper(OP, "lr", c.lr)?;
    check_hyper(OP, "momentum", c.momentum)?;
    check_hyper(OP, "weight_decay", c.weight_decay)?;
    check_hyper(OP, "dampening", c.dampening)?;
    if c.nesterov && (c.momentum == 0.0 || c.dampening != 0.0) {
        return Err(Error::InvalidArgument {
            op: OP,
            msg: format!(
                "Nesterov momentum needs momentum > 0 and dampening 0, got momentum {} and \
                 dampening {}",
                c.momentum, c.dampening
            ),
        });
    }
    Ok(())
}

impl Optimizer for Sgd {
    fn step(&mut self) -> Result<()> {
        const OP: &str = "Sgd::step";
        let c = *lock(&self.config);
        check_config(&c)?;
        check_groups(&self.invalid)?;
        check_distinct(OP, &self.params)?;
        // A replay checks the config of its own step.
        let shared = self.config.clone();
        tape::on_replay(move || check_config(&lock(&shared)));
        let per_param = self.params.iter().zip(&self.groups);
        for ((param, group), buffer) in per_param.zip(&mut self.momentum_buffers) {
            let Some(grad) = param.grad() else { continue };
            let first = buffer.is_none();
            let shared = self.config.clone();
            let group = *group;
            // Read at each replay: the base rate a schedule sets, scaled for the group.
            let params = move |n| {
                let c = *lock(&shared);
                SgdParams {
                    n,
                    lr: group.lr(c.lr),
                    weight_decay: group.weight_decay(c.weight_decay),
                    momentum: c.momentum,
                    dampening: c.dampening,
                    flags: c.nesterov as u32 | (first as u32) << 1,
                }
            };
            if c.momentum == 0.0 {
                run_update(OP, "sgd", param, &grad, &[], params)?;
                continue;
            }
            let state = match buffer {
                Some(state) => state.clone(),
                None => Tensor::zeros(param.shape(), param.device())?,
            };
            run_update(OP, "sgd_momentum", param, &grad, &[&state], params)?;
            *buffer = Some(state);
        }
        Ok(())
    }

    fn zero_grad(&mut self) {
        zero_grads(&self.params);
    }

    fn parameters(&self) -> Vec<Tensor> {
        self.params.clone()
    }

    fn lr(&self) -> f32 {
        lock(&self.config).lr
    }

    /// Sets the base learning rate: every group's rate keeps its ratio to it.
    fn set_lr(&mut self, lr: f32) {
        lock(&self.config).lr = lr;
    }

    fn state(&self) -> OptimizerState {
        let mut scalars = vec![("lr".to_string(), bits(lock(&self.config).lr))];
        scalars.extend(
            self.groups
                .iter()
                .enumerate()
                .map(|(i, g)| (format!("{i}.group"), g.saved())),
        );
        let tensors = self
            .momentum_buffers
            .iter()
            .enumerate()
            .filter_map(|(i, b)| b.clone().map(|b| (format!("{i}.momentum_buffer"), b)))
            .collect();
        OptimizerState {
            kind: "Sgd".into(),
            shapes: shapes_of(&self.params),
            scalars,
            tensors,
        }
    }

    fn load_state(&mut self, state: &OptimizerState) -> Result<()> {
        state.expect("Sgd", &shapes_of(&self.params))?;
        let lr = state.scalar_f32("lr")?;
        let groups = restored_groups(state, self.params.len())?;
        let mut buffers = Vec::with_capacity(self.params.len());
        for (i, p) in self.params.iter().enumerate() {
            let saved = state.tensor(&format!("{i}.momentum_buffer"), p.shape())?;
            buffers.push(saved.map(|t| t.detach()));
        }
        lock(&self.config).lr = lr;
        self.groups = groups;
        self.momentum_buffers = buffers;
        Ok(())
    }
}
