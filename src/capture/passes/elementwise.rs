//! Elementwise runs: launches that describe themselves as elementwise (unary and binary ops,
//! backward rules, `accumulate_grad`'s clone-then-add) over the same output shape join a
//! group while each reads the group's earlier results in place (same element, no view).
//! Values only the group uses stay in registers; the rest are written. A launch between
//! members that touches none of the group's values stays where it is, before the fused
//! kernel, which takes the place of the group's last member.

use std::collections::{HashMap, HashSet};

use super::{launch_values, max_fused_buffers, users_by_value, Rewrite};
use crate::capture::codegen::{fused_source, generated_pipeline, validate};
use crate::capture::ir::{Command, Draft, Launch};
use crate::device::Device;
use crate::kernel::{groups, Elementwise, Fusion, CONTIGUOUS_PER_GROUP};
use crate::tensor::layout::row_major_strides;
use crate::tensor::Layout;

/// The most launches one fused kernel takes in.
const MAX_MEMBERS: usize = 32;

/// A run of elementwise launches being gathered.
#[derive(Clone)]
pub(super) struct Group {
    pub members: Vec<usize>,
    pub shape: Vec<usize>,
    /// Values the members write, in order.
    pub produced: Vec<usize>,
    /// Values the members read from memory.
    pub read: HashSet<usize>,
}

impl Group {
    fn touches(&self, value: usize) -> bool {
        self.read.contains(&value) || self.produced.contains(&value)
    }
}

/// Reads the element at the output's own index: how a member may read an earlier member's
/// result from a register.
pub(super) fn reads_in_place(layout: &Layout, shape: &[usize]) -> bool {
    layout.shape == shape && layout.offset == 0 && layout.strides == row_major_strides(shape)
}

/// Fuses each run of two or more elementwise launches into one generated kernel. Returns how
/// many launches it removed.
pub(super) fn fuse_elementwise(draft: &mut Draft, device: &Device) -> usize {
    let max_buffers = max_fused_buffers(device);
    let users = users_by_value(draft);
    let mut rewrite = Rewrite::default();
    for group in elementwise_runs(draft, &users, max_buffers) {
        let Some((group, outputs)) = fit(group, draft, &users, max_buffers, None, 2) else {
            continue;
        };
        let launches: Vec<&Elementwise<usize>> =
            group.members.iter().map(|&u| member(draft, u)).collect();
        if let Some(launch) = fused_launch(&launches, &outputs, &group.shape, device) {
            rewrite.collapse([], &group.members, launch);
        }
    }
    rewrite.apply(draft)
}

/// The draft's runs of elementwise launches that may fuse, in order: a run grows while each
/// next launch joins it (see [`joins`]); anything else that touches its values ends it.
pub(super) fn elementwise_runs(
    draft: &Draft,
    users: &HashMap<usize, Vec<usize>>,
    max_buffers: usize,
) -> Vec<Group> {
    let mut groups: Vec<Group> = Vec::new();
    let mut open: Option<Group> = None;
    for (at, command) in draft.commands.iter().enumerate() {
        let fusible = match command {
            Command::Launch(Launch {
                fusion: Some(Fusion::Elementwise(f)),
                ..
            }) => Some(f),
            _ => None,
        };
        if let (Some(f), Some(group)) = (fusible, open.as_mut()) {
            if joins(group, at, f, max_buffers, draft, users) {
                add(group, at, f);
                continue;
            }
        }
        if let Some(group) = &open {
            if fusible.is_some() || launch_values(command).iter().any(|&v| group.touches(v)) {
                groups.extend(open.take());
            }
        }
        if let Some(f) = fusible {
            let mut group = Group {
                members: Vec::new(),
                shape: f.shape.clone(),
                produced: Vec::new(),
                read: HashSet::new(),
            };
            add(&mut group, at, f);
            open = Some(group);
        }
    }
    groups.extend(open);
    groups
}

/// The group trimmed from its end until its kernel binds at most `max_buffers` buffers, and
/// the values it must write; `None` when fewer than `min_members` are left, or when it would
/// write nothing. `in_register` is a value the kernel has in a register, not in memory (the
/// product an epilogue consumes).
pub(super) fn fit(
    mut group: Group,
    draft: &Draft,
    users: &HashMap<usize, Vec<usize>>,
    max_buffers: usize,
    in_register: Option<usize>,
    min_members: usize,
) -> Option<(Group, Vec<usize>)> {
    while group.members.len() >= min_members.max(1) {
        let members: HashSet<usize> = group.members.iter().copied().collect();
        let outputs: Vec<usize> = group
            .produced
            .iter()
            .copied()
            .filter(|&v| {
                !draft.is_intermediate(v) || users[&v].iter().any(|at| !members.contains(at))
            })
            .collect();
        let produced: HashSet<usize> = group.produced.iter().copied().collect();
        let reads: HashSet<usize> = group
            .members
            .iter()
            .flat_map(|&at| match &draft.commands[at] {
                Command::Launch(Launch {
                    fusion: Some(Fusion::Elementwise(f)),
                    ..
                }) => f.operands.iter().map(|(v, _)| *v).collect::<Vec<_>>(),
                _ => Vec::new(),
            })
            .filter(|v| !produced.contains(v) && Some(*v) != in_register)
            .collect();
        if reads.len() + outputs.len() <= max_buffers {
            return (!outputs.is_empty()).then_some((group, outputs));
        }
        group.members.pop();
        group.produced.pop();
    }
    None
}

/// Whether the launch at `at` may join `group`: same shape, earlier results read in place,
/// and the buffers the fused kernel would bind within `max_buffers`.
fn joins(
    group: &Group,
    at: usize,
    f: &Elementwise<usize>,
    max_buffers: usize,
    draft: &Draft,
    users: &HashMap<usize, Vec<usize>>,
) -> bool {
    if f.shape != group.shape || group.members.len() >= MAX_MEMBERS {
        return false;
    }
    let mut new_reads = 0;
    for (v, layout) in &f.operands {
        if group.produced.contains(v) {
            if !reads_in_place(layout, &group.shape) {
                return false;
            }
        } else if !group.read.contains(v) {
            new_reads += 1;
        }
    }
    // Results that must be written: seen outside the plan, or used by an earlier launch that
    // is not a member, or by a later one that cannot join (another kind or shape). Later
    // elementwise launches of this shape are expected to join; `fit` trims the group where
    // one does not.
    let shape = &group.shape;
    let outside = |u: usize| -> bool {
        if u == at || group.members.contains(&u) {
            return false;
        }
        match &draft.commands[u] {
            Command::Launch(Launch {
                fusion: Some(Fusion::Elementwise(g)),
                ..
            }) => u < at || g.shape != *shape,
            _ => true,
        }
    };
    let written = group
        .produced
        .iter()
        .chain(std::iter::once(&f.output))
        .filter(|&&v| !draft.is_intermediate(v) || users[&v].iter().any(|&u| outside(u)))
        .count();
    group.read.len() + new_reads + written <= max_buffers
}

fn add(group: &mut Group, at: usize, f: &Elementwise<usize>) {
    group.members.push(at);
    for (v, _) in &f.operands {
        if !group.produced.contains(v) {
            group.read.insert(*v);
        }
    }
    group.produced.push(f.output);
}

/// The generated kernel for `launches` (in order), writing `outputs`, or `None` when naga
/// rejects it (the members then run unfused).
fn fused_launch(
    launches: &[&Elementwise<usize>],
    outputs: &[usize],
    shape: &[usize],
    device: &Device,
) -> Option<Launch> {
    let (source, bindings) = fused_source(launches, outputs, shape)?;
    if let Err(e) = validate(&source) {
        log::debug!("capture: a fused kernel failed validation, left unfused: {e}");
        return None;
    }
    let n: usize = shape.iter().product();
    let pipeline = generated_pipeline(device, "fused", "main", &source);
    let names: Vec<&str> = launches.iter().map(|f| f.expr.as_str()).collect();
    log::trace!(
        "capture: fused {} launches: {}",
        names.len(),
        names.join("; ")
    );
    Some(Launch {
        op: "fused elementwise",
        fusion: None,
        pipeline,
        bindings,
        // Generated kernels bind whole buffers: a launch that binds windows is never
        // fused (`tape::record_launch`).
        windows: Vec::new(),
        params: bytemuck::bytes_of(&(n as u32)).to_vec(),
        dynamic_params: None,
        workgroups: groups(n, CONTIGUOUS_PER_GROUP),
        encoded: None,
    })
}

/// The elementwise description of member `at`.
pub(super) fn member(draft: &Draft, at: usize) -> &Elementwise<usize> {
    match &draft.commands[at] {
        Command::Launch(Launch {
            fusion: Some(Fusion::Elementwise(f)),
            ..
        }) => f,
        _ => unreachable!("members are fusible launches"),
    }
}
