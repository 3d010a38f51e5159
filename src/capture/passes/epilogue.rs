//! Epilogues: a run of elementwise launches whose first member reads, in place, the output of
//! a launch with an `EPILOGUE SECTION` (matmul, LayerNorm's forward and backward) runs in
//! that launch's stores instead: the section is replaced by stores that compute the run's
//! values from the one in the register. The launch moves to the run's last member, so it
//! may only move past launches that neither write what it reads nor touch what else it
//! writes.

use std::collections::{HashMap, HashSet};

use super::elementwise::{elementwise_runs, fit, member, reads_in_place, Group};
use super::{commute, max_fused_buffers, users_by_value, Rewrite};
use crate::capture::codegen::{epilogue_source, generated_pipeline, validate};
use crate::capture::ir::{Command, Draft, Launch};
use crate::device::Device;
use crate::kernel::{Elementwise, EpilogueSite, Fusion};
use crate::tensor::Layout;

/// Runs each run of elementwise launches that consumes a launch's product in place in that
/// launch's stores (see [`epilogue`]). Returns how many launches it removed.
pub(super) fn fuse_epilogues(draft: &mut Draft, device: &Device) -> usize {
    let max_buffers = max_fused_buffers(device);
    let users = users_by_value(draft);
    let mut rewrite = Rewrite::default();
    for group in elementwise_runs(draft, &users, max_buffers) {
        if let Some((at, members, launch)) = epilogue(&group, draft, &users, max_buffers, device) {
            rewrite.collapse([at], &members, launch);
        }
    }
    rewrite.apply(draft)
}

/// The launch with an epilogue site that makes a value the group's first member reads: its
/// index, the launch and the site.
fn producer_of<'a>(
    group: &Group,
    draft: &'a Draft,
) -> Option<(usize, &'a Launch, &'a EpilogueSite<usize>)> {
    let first = group.members[0];
    member(draft, first).operands.iter().find_map(|(v, _)| {
        (0..first).rev().find_map(|u| match &draft.commands[u] {
            Command::Launch(l) => match &l.fusion {
                Some(Fusion::Epilogue(site)) if site.output == *v => Some((u, l, site)),
                _ => None,
            },
            _ => None,
        })
    })
}

/// How the group's members read the product `m`: each at its own element (`Some(None)`), or
/// all as the transpose of a 2-D `[rows, cols]` product (`Some(Some((rows, cols)))`: a narrow
/// product is computed transposed, a classifier head); `None` when neither, so no fusion.
fn how_members_read(group: &Group, draft: &Draft, m: usize) -> Option<Option<(usize, usize)>> {
    let reads_of_m: Vec<&Layout> = group
        .members
        .iter()
        .flat_map(|&u| member(draft, u).operands.iter())
        .filter(|(v, _)| *v == m)
        .map(|(_, layout)| layout)
        .collect();
    let transposed = match group.shape[..] {
        [rows, cols] => {
            let layout = Layout {
                shape: vec![rows, cols],
                strides: vec![1, rows],
                offset: 0,
            };
            (!reads_of_m.is_empty() && reads_of_m.iter().all(|l| **l == layout))
                .then_some((rows, cols))
        }
        _ => None,
    };
    let in_place = reads_of_m.iter().all(|l| reads_in_place(l, &group.shape));
    (transposed.is_some() || in_place).then_some(transposed)
}

/// Fuses `group` into the launch that makes the value its first member reads, when that
/// launch has an epilogue site and only the group reads its output, in place: returns the
/// launch's index, the members fused, and the launch that replaces them all at the last
/// member's place.
fn epilogue(
    group: &Group,
    draft: &Draft,
    users: &HashMap<usize, Vec<usize>>,
    max_buffers: usize,
    device: &Device,
) -> Option<(usize, Vec<usize>, Launch)> {
    let (at, producer, site) = producer_of(group, draft)?;
    let m = site.output;
    let numel: usize = group.shape.iter().product();
    if numel != site.numel {
        return None;
    }
    let transposed = how_members_read(group, draft, m)?;
    // The producer's own operands stay bound (see `epilogue_launch`).
    let operands = producer.bindings.iter().filter(|&&(_, v)| v != m).count();
    // `m` itself is written too when the plan's output or a later launch reads it (one more
    // buffer); then no launch between the producer and the group's end may read it.
    let budget = max_buffers.checked_sub(operands)?;
    let read_elsewhere = |members: &[usize]| {
        !draft.is_intermediate(m) || users[&m].iter().any(|u| *u != at && !members.contains(u))
    };
    let reserve = usize::from(read_elsewhere(&group.members));
    let (group, mut outputs) = fit(
        group.clone(),
        draft,
        users,
        budget.checked_sub(reserve)?,
        Some(m),
        1,
    )?;
    let last = *group.members.last().expect("one or more");
    if read_elsewhere(&group.members) {
        let read_early = users[&m]
            .iter()
            .any(|&u| u != at && u < last && !group.members.contains(&u));
        // A transposed epilogue stores in the group's order, not in `m`'s.
        if reserve == 0 || read_early || transposed.is_some() {
            return None;
        }
        outputs.insert(0, m);
    }
    let members: HashSet<usize> = group.members.iter().copied().collect();
    // The producer moves to the last member's place: past launches that commute with it
    // only (none writes what it reads, nor touches what else it writes: LayerNorm's row
    // statistics).
    let moved_past = (at + 1..last)
        .filter(|u| !members.contains(u))
        .any(|u| !commute(&draft.commands[u], &draft.commands[at]));
    if moved_past {
        return None;
    }
    let launches: Vec<&Elementwise<usize>> =
        group.members.iter().map(|&u| member(draft, u)).collect();
    let fused = epilogue_launch(producer, site, &launches, &outputs, transposed, device)?;
    Some((at, group.members, fused))
}

/// The producer with `launches` run in its stores, writing `outputs` (the first at the
/// producer's output binding), as one generated launch; `None` when its module does not
/// validate (the group then stays unfused).
fn epilogue_launch(
    producer: &Launch,
    site: &EpilogueSite<usize>,
    launches: &[&Elementwise<usize>],
    outputs: &[usize],
    transposed: Option<(usize, usize)>,
    device: &Device,
) -> Option<Launch> {
    let m = site.output;
    let output_binding = producer
        .bindings
        .iter()
        .find(|&&(_, v)| v == m)
        .map(|&(b, _)| b)?;
    let (source, extra) = epilogue_source(
        &producer.pipeline.source,
        site,
        launches,
        outputs,
        transposed,
    )?;
    if let Err(e) = validate(&source) {
        log::debug!("capture: an epilogue failed validation, left unfused: {e}");
        return None;
    }
    let pipeline = generated_pipeline(device, "epilogue", site.entry, &source);
    // The producer's own operands stay bound; its output becomes the first written value.
    let mut bindings: Vec<(u32, usize)> = (producer.bindings.iter().copied())
        .filter(|&(_, v)| v != m)
        .collect();
    bindings.push((output_binding, outputs[0]));
    bindings.extend(extra);
    Some(Launch {
        op: producer.op,
        fusion: None,
        pipeline,
        bindings,
        // Generated kernels bind whole buffers: a launch that binds windows is never
        // fused (`tape::record_launch`).
        windows: Vec::new(),
        params: producer.params.clone(),
        dynamic_params: producer.dynamic_params.clone(),
        workgroups: producer.workgroups,
        encoded: None,
    })
}
