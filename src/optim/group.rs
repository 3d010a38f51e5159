//! Parameter groups: parameters that take their own learning rate or weight decay (the usual
//! "no weight decay on biases and norms"), in one optimizer with one `step`.

use crate::error::{Error, Result};
use crate::tensor::Tensor;

/// Parameters with their own learning rate and weight decay, as a PyTorch param group; what a
/// group leaves unset comes from the optimizer's config.
///
/// ```
/// # fn main() -> wgrad::Result<()> {
/// use wgrad::nn::{self, Module};
/// use wgrad::optim::{AdamConfig, AdamW, Optimizer, ParamGroup};
/// let dev = wgrad::Device::new()?;
/// let lin = nn::Linear::new(4, 2, true, &dev)?;
/// let params = lin.parameters();
/// let groups = vec![
///     ParamGroup::new(vec![params[0].clone()]).weight_decay(0.1),
///     ParamGroup::new(vec![params[1].clone()]).weight_decay(0.0).lr(1e-2),
/// ];
/// let mut opt = AdamW::with_groups(groups, AdamConfig { lr: 1e-3, ..Default::default() });
/// opt.set_lr(5e-4); // every group follows: the bias group's lr becomes 5e-3
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
pub struct ParamGroup {
    pub(crate) params: Vec<Tensor>,
    lr: Option<f32>,
    weight_decay: Option<f32>,
}

impl ParamGroup {
    /// A group of `params` (handles to the parameters themselves).
    pub fn new(params: Vec<Tensor>) -> ParamGroup {
        ParamGroup {
            params,
            lr: None,
            weight_decay: None,
        }
    }

    /// The group's learning rate at the optimizer's base learning rate. Schedules and
    /// `set_lr` scale it with the base: it keeps its ratio to the base rate.
    pub fn lr(mut self, lr: f32) -> ParamGroup {
        self.lr = Some(lr);
        self
    }

    /// The group's weight decay.
    pub fn weight_decay(mut self, weight_decay: f32) -> ParamGroup {
        self.weight_decay = Some(weight_decay);
        self
    }
}

/// What one parameter's updates take from its group: its learning rate as a multiple of the
/// optimizer's base rate, and its weight decay (`None`: the config's).
#[derive(Debug, Clone, Copy)]
pub(crate) struct GroupSettings {
    pub lr_scale: f32,
    pub weight_decay: Option<f32>,
}

impl GroupSettings {
    /// The learning rate at base rate `lr`.
    pub fn lr(&self, lr: f32) -> f32 {
        lr * self.lr_scale
    }

    /// The weight decay, the config's `weight_decay` where the group sets none.
    pub fn weight_decay(&self, weight_decay: f32) -> f32 {
        self.weight_decay.unwrap_or(weight_decay)
    }
}

impl GroupSettings {
    /// The settings as one scalar of a saved state: the scale's bits, then the decay's or `-`.
    pub fn saved(&self) -> String {
        let decay = self
            .weight_decay
            .map_or("-".to_string(), crate::optim::bits);
        format!("{}:{decay}", crate::optim::bits(self.lr_scale))
    }

    /// The settings [`GroupSettings::saved`] wrote, or `None` for another text.
    pub fn restored(text: &str) -> Option<GroupSettings> {
        let (scale, decay) = text.split_once(':')?;
        let f = |t: &str| u32::from_str_radix(t, 16).ok().map(f32::from_bits);
        Some(GroupSettings {
            lr_scale: f(scale)?,
            weight_decay: match decay {
                "-" => None,
                d => Some(f(d)?),
            },
        })
    }
}

/// The groups' settings of a saved state, one per parameter, or an error naming the first
/// one missing or unreadable.
pub(crate) fn restored_groups(
    state: &crate::optim::OptimizerState,
    count: usize,
) -> Result<Vec<GroupSettings>> {
    (0..count)
        .map(|i| {
            let text = state.scalar(&format!("{i}.group"))?;
            GroupSettings::restored(text).ok_or_else(|| Error::InvalidArgument {
                op: "Optimizer::load_state",
                msg: format!("parameter {i}'s group settings {text:?} do not read"),
            })
        })
        .collect()
}

/// The parameters of `groups` in order, each with its group's settings (`base_lr` is the
/// config's learning rate, which a group's rate is a multiple of), or why the groups are
/// invalid: an empty group, a group rate that is not finite and non-negative (or any group
/// rate when the base rate is 0: it would be no multiple of it), a weight decay that is not
/// finite and non-negative. (A parameter in two groups is refused at `step`, as any
/// parameter listed twice.)
pub(crate) fn flatten(
    op: &'static str,
    groups: Vec<ParamGroup>,
    base_lr: f32,
) -> (Vec<Tensor>, Vec<GroupSettings>, Option<Error>) {
    let mut params = Vec::new();
    let mut settings = Vec::new();
    let mut invalid = None;
    for (g, group) in groups.into_iter().enumerate() {
        let fail = |msg: String| Some(Error::InvalidArgument { op, msg });
        if group.params.is_empty() {
            invalid = invalid.or_else(|| fail(format!("parameter group {g} is empty")));
        }
        if let Some(lr) = group.lr {
            if !(lr.is_finite() && lr >= 0.0) {
                invalid = invalid
                    .or_else(|| fail(format!("group {g}: lr must be finite and >= 0, got {lr}")));
            } else if base_lr == 0.0 {
                invalid = invalid.or_else(|| {
                    fail(format!(
                        "group {g}: lr {lr} is kept as a multiple of the config's lr, which is \
                         0; give the config the base rate and schedule it down instead"
                    ))
                });
            }
        }
        if let Some(wd) = group.weight_decay {
            if !(wd.is_finite() && wd >= 0.0) {
                invalid = invalid.or_else(|| {
                    fail(format!(
                        "group {g}: weight_decay must be finite and >= 0, got {wd}"
                    ))
                });
            }
        }
        let lr_scale = group.lr.map_or(1.0, |lr| lr / base_lr);
        for p in group.params {
            params.push(p);
            settings.push(GroupSettings {
                lr_scale,
                weight_decay: group.weight_decay,
            });
        }
    }
    (params, settings, invalid)
}

/// `invalid` as the error of a step: groups that were refused at construction stay refused.
pub(crate) fn check_groups(invalid: &Option<Error>) -> Result<()> {
    match invalid {
        Some(e) => Err(e.clone()),
        None => Ok(()),
    }
}
