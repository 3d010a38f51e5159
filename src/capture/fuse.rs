//! Fusion: passes over a captured plan that make it fewer, fuller launches. This file decides;
//! the WGSL of the kernels it makes is written by `codegen.rs`.
//!
//! On software adapters an elementwise kernel is bound by instructions per load and every
//! launch has a fixed cost, so the only way past them is fewer passes over memory and fewer
//! launches. Three passes, each producing kernels validated with naga before they are compiled
//! (one that fails leaves its launches as they were):
//!
//! - **Elementwise runs** ([`fuse`]): launches that describe themselves as elementwise (unary
//!   and binary ops, backward rules, `accumulate_grad`'s clone-then-add) over the same output
//!   shape join a group while each reads the group's earlier results in place (same element,
//!   no view). Values only the group uses stay in registers; the rest are written. A launch
//!   between members that touches none of the group's values stays where it is, before the
//!   fused kernel, which takes the place of the group's last member.
//! - **Epilogues** (in [`fuse`]): a group whose first member reads, in place, the output of a
//!   launch with an `EPILOGUE SECTION` (matmul, LayerNorm's forward) runs in that launch's
//!   stores instead: the section is replaced by stores that compute the group's values from
//!   the one in the register. The launch moves to the group's last member, so it may only move
//!   past launches that neither write what it reads nor touch what else it writes.
//! - **Merged parts** ([`merge_parts`]): consecutive launches of one pipeline whose entry point
//!   runs a function of its module's `MEMBER SECTION` (an optimizer's update of each parameter,
//!   serial reductions) become one launch with a copy of the section per member, each with its
//!   own names, bindings and param block, over workgroups of its own.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use crate::capture::codegen::{
    epilogue_source, fused_source, generated_pipeline, merged_source, validate,
};
use crate::capture::plan::{Command, Draft, Launch};
use crate::device::Device;
use crate::kernel::{
    groups, Elementwise, EpilogueSite, Fusion, MergeSite, CONTIGUOUS_PER_GROUP, MAX_SLOTS,
};
use crate::tensor::layout::row_major_strides;
use crate::tensor::tape::HostBytes;
use crate::tensor::Layout;

/// The most launches one fused kernel takes in.
const MAX_MEMBERS: usize = 32;

/// A run of elementwise launches being gathered.
#[derive(Clone)]
struct Group {
    members: Vec<usize>,
    shape: Vec<usize>,
    /// Values the members write, in order.
    produced: Vec<usize>,
    /// Values the members read from memory.
    read: HashSet<usize>,
}

impl Group {
    fn touches(&self, value: usize) -> bool {
        self.read.contains(&value) || self.produced.contains(&value)
    }
}

/// Reads the element at the output's own index: how a member may read an earlier member's
/// result from a register.
fn reads_in_place(layout: &Layout, shape: &[usize]) -> bool {
    layout.shape == shape && layout.offset == 0 && layout.strides == row_major_strides(shape)
}

fn launch_values(command: &Command) -> Vec<usize> {
    command.buffers().into_iter().copied().collect()
}

/// Whether launch `l` may write `value`: bound where its module declares `read_write`.
fn launch_writes(l: &Launch, value: usize) -> bool {
    l.bindings
        .iter()
        .any(|&(b, v)| v == value && l.pipeline.writable.contains(&b))
}

/// Whether `command` may write `value`.
fn writes(command: &Command, value: usize) -> bool {
    match command {
        Command::Launch(l) => launch_writes(l, value),
        Command::Upload(upload) => upload.target == value,
        Command::Copy(copy) => copy.dst.0 == value,
        Command::Hook(_) => false,
    }
}

/// Removes copies of a whole intermediate into a value the step makes and nothing used
/// before (`accumulate_grad` of an empty slot copies the engine's new grad into the grad it
/// installs): the launches that wrote and read the intermediate use the copy's target
/// instead. Returns how many copies it removed.
pub(crate) fn forward_copies(draft: &mut Draft) -> usize {
    let mut removed = 0;
    let mut at = 0;
    while at < draft.commands.len() {
        let Command::Copy(copy) = &draft.commands[at] else {
            at += 1;
            continue;
        };
        let (src, dst) = (copy.src.0, copy.dst.0);
        let whole = copy.src.1 == 0 && copy.dst.1 == 0;
        let same_size =
            draft.made_bytes(dst).is_some() && draft.made_bytes(src) == draft.made_bytes(dst);
        let uses = |v: usize, range: std::ops::Range<usize>| {
            range
                .into_iter()
                .any(|i| launch_values(&draft.commands[i]).contains(&v))
        };
        let forwardable = whole
            && same_size
            && draft.is_intermediate(src)
            && !uses(src, at + 1..draft.commands.len())
            && !uses(dst, 0..at);
        if !forwardable {
            at += 1;
            continue;
        }
        for command in &mut draft.commands[..at] {
            rename(command, src, dst);
        }
        draft.commands.remove(at);
        removed += 1;
    }
    removed
}

/// Makes `command` use value `to` wherever it used `from`.
fn rename(command: &mut Command, from: usize, to: usize) {
    let swap = |v: &mut usize| {
        if *v == from {
            *v = to;
        }
    };
    match command {
        Command::Launch(l) => {
            l.bindings.iter_mut().for_each(|(_, v)| swap(v));
            if let Some(Fusion::Elementwise(f)) = &mut l.fusion {
                f.operands.iter_mut().for_each(|(v, _)| swap(v));
                swap(&mut f.output);
            }
        }
        Command::Upload(upload) => swap(&mut upload.target),
        Command::Copy(copy) => {
            swap(&mut copy.src.0);
            swap(&mut copy.dst.0);
        }
        Command::Hook(_) => {}
    }
}

/// Fuses the draft's elementwise runs in place. Returns how many launches it removed.
pub(crate) fn fuse(draft: &mut Draft, device: &Device) -> usize {
    // The most storage buffers a kernel may bind, with room to spare.
    let max_buffers = (device.inner.limits.max_storage_buffers_per_shader_stage as usize).min(8);
    let mut users: HashMap<usize, Vec<usize>> = HashMap::new();
    for (at, command) in draft.commands.iter().enumerate() {
        for v in launch_values(command) {
            users.entry(v).or_default().push(at);
        }
    }
    let mut fused: HashMap<usize, Command> = HashMap::new(); // at the last member's index
    let mut removed: HashSet<usize> = HashSet::new();
    for group in elementwise_runs(draft, &users, max_buffers) {
        if let Some((at, members, launch)) = epilogue(&group, draft, &users, max_buffers, device) {
            let last = *members.last().expect("one or more");
            removed.insert(at);
            removed.extend(members.iter().copied().filter(|&m| m != last));
            fused.insert(last, Command::Launch(launch));
            continue;
        }
        let Some((group, outputs)) = fit(group, draft, &users, max_buffers, None, 2) else {
            continue;
        };
        let launches: Vec<&Elementwise<usize>> =
            group.members.iter().map(|&u| member(draft, u)).collect();
        let Some(launch) = fused_launch(&launches, &outputs, &group.shape, device) else {
            continue;
        };
        let last = *group.members.last().expect("two or more");
        removed.extend(group.members.iter().copied().filter(|&at| at != last));
        fused.insert(last, Command::Launch(launch));
    }
    let before = draft.commands.len();
    let commands = std::mem::take(&mut draft.commands);
    for (at, command) in commands.into_iter().enumerate() {
        if removed.contains(&at) {
            continue;
        }
        draft.commands.push(fused.remove(&at).unwrap_or(command));
    }
    before - draft.commands.len()
}

/// The draft's runs of elementwise launches that may fuse, in order: a run grows while each
/// next launch joins it (see [`joins`]); anything else that touches its values ends it.
fn elementwise_runs(
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

/// Whether the launch at `at` may join `group`: same shape, earlier results read in place,
/// and the buffers the fused kernel would bind within `max_buffers`.
/// The group trimmed from its end until its kernel binds at most `max_buffers` buffers, and
/// the values it must write; `None` when fewer than `min_members` are left, or when it would
/// write nothing. `in_register` is a value the kernel has in a register, not in memory (the
/// product an epilogue consumes).
fn fit(
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
        params: bytemuck::bytes_of(&(n as u32)).to_vec(),
        dynamic_params: None,
        workgroups: groups(n, CONTIGUOUS_PER_GROUP),
        encoded: None,
    })
}

/// The elementwise description of member `at`.
fn member(draft: &Draft, at: usize) -> &Elementwise<usize> {
    match &draft.commands[at] {
        Command::Launch(Launch {
            fusion: Some(Fusion::Elementwise(f)),
            ..
        }) => f,
        _ => unreachable!("members are fusible launches"),
    }
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
        params: producer.params.clone(),
        dynamic_params: producer.dynamic_params.clone(),
        workgroups: producer.workgroups,
        encoded: None,
    })
}

/// Whether `a` and `b` may run in either order: neither writes a value the other touches,
/// and no host hook passes a launch whose params are computed at replay (a replay runs hooks
/// and those params' closures in plan order: an optimizer's hook advances the step count its
/// updates' params read).
fn commute(a: &Command, b: &Command) -> bool {
    let hook_and_dynamic = |x: &Command, y: &Command| {
        matches!(x, Command::Hook(_))
            && matches!(y, Command::Launch(l) if l.dynamic_params.is_some())
    };
    !hook_and_dynamic(a, b)
        && !hook_and_dynamic(b, a)
        && writes_apart(
            &launch_values(a),
            |v| writes(a, v),
            &launch_values(b),
            |v| writes(b, v),
        )
}

/// As [`commute`], for two launches of a merged run (no hook between them).
fn launches_commute(a: &Launch, b: &Launch) -> bool {
    let values = |l: &Launch| -> Vec<usize> { l.bindings.iter().map(|&(_, v)| v).collect() };
    writes_apart(
        &values(a),
        |v| launch_writes(a, v),
        &values(b),
        |v| launch_writes(b, v),
    )
}

/// Whether neither of two commands (the values each touches, and which of them it writes)
/// writes a value the other touches.
fn writes_apart(
    a: &[usize],
    a_writes: impl Fn(usize) -> bool,
    b: &[usize],
    b_writes: impl Fn(usize) -> bool,
) -> bool {
    !a.iter().any(|&v| a_writes(v) && b.contains(&v))
        && !b.iter().any(|&v| b_writes(v) && a.contains(&v))
}

/// The most launches one merged launch takes.
const MAX_PARTS: usize = 8;

/// Merges runs of consecutive launches of one pipeline that run a part of their module's
/// MEMBER SECTION (an optimizer's update of each parameter, a backward pass's reductions)
/// into launches of one generated kernel each: a copy of the section per launch, with its own
/// names, bindings and param slots, each over workgroups of its own. A run is first ordered
/// by dependency (a two-pass reduction's second pass after every first pass of the run), and
/// as many independent launches go into one as the device's storage bindings and the 63
/// param slots allow. Returns how many launches it removed.
pub(crate) fn merge_parts(draft: &mut Draft, device: &Device) -> usize {
    let max_buffers = device.inner.limits.max_storage_buffers_per_shader_stage as usize;
    let before = draft.commands.len();
    let mut commands = Vec::with_capacity(before);
    let mut run: Vec<Launch> = Vec::new();
    for command in std::mem::take(&mut draft.commands) {
        match command {
            Command::Launch(l) if matches!(l.fusion, Some(Fusion::Merge(_))) => {
                if run
                    .first()
                    .is_some_and(|r| !Arc::ptr_eq(&r.pipeline, &l.pipeline))
                {
                    commands.extend(merged_run(std::mem::take(&mut run), max_buffers, device));
                }
                run.push(l);
            }
            other => {
                commands.extend(merged_run(std::mem::take(&mut run), max_buffers, device));
                commands.push(other);
            }
        }
    }
    commands.extend(merged_run(run, max_buffers, device));
    draft.commands = commands;
    before - draft.commands.len()
}

/// The launches of `run` (consecutive, one pipeline) by dependency level, each level's
/// launches merged as far as the budget allows.
fn merged_run(run: Vec<Launch>, max_buffers: usize, device: &Device) -> Vec<Command> {
    // A launch's level: one past the highest level of an earlier launch it does not commute
    // with. Launches of one level are independent of each other.
    let mut levels: Vec<usize> = Vec::with_capacity(run.len());
    for (j, launch) in run.iter().enumerate() {
        let level = (0..j)
            .filter(|&i| !launches_commute(&run[i], launch))
            .map(|i| levels[i] + 1)
            .max()
            .unwrap_or(0);
        levels.push(level);
    }
    let mut by_level: Vec<Vec<Launch>> = Vec::new();
    for (launch, level) in run.into_iter().zip(levels) {
        if by_level.len() <= level {
            by_level.resize_with(level + 1, Vec::new);
        }
        by_level[level].push(launch);
    }
    let mut out = Vec::new();
    for level in by_level {
        let mut chunk: Vec<Launch> = Vec::new();
        for launch in level {
            if !fits_chunk(&chunk, &launch, max_buffers) {
                out.extend(merged(std::mem::take(&mut chunk), device));
            }
            chunk.push(launch);
        }
        out.extend(merged(chunk, device));
    }
    out
}

fn merge_site(launch: &Launch) -> &MergeSite {
    match &launch.fusion {
        Some(Fusion::Merge(site)) => site,
        _ => unreachable!("runs hold mergeable launches"),
    }
}

/// Whether `next` may join `chunk` (independent launches of one pipeline; an empty chunk
/// takes anything): room for its buffers and params.
fn fits_chunk(chunk: &[Launch], next: &Launch, max_buffers: usize) -> bool {
    let buffers: usize =
        chunk.iter().map(|l| l.bindings.len()).sum::<usize>() + next.bindings.len();
    chunk.len() < MAX_PARTS
        && (chunk.len() + 1) * merge_site(next).param_slots <= MAX_SLOTS
        && buffers <= max_buffers
}

/// One launch for `run` (the launch itself when it holds one; `run` unmerged when the
/// generated kernel fails naga's validation).
fn merged(run: Vec<Launch>, device: &Device) -> Vec<Command> {
    let unmerged = |run: Vec<Launch>| run.into_iter().map(Command::Launch).collect();
    if run.len() < 2 {
        return unmerged(run);
    }
    let site = merge_site(&run[0]);
    let members: Vec<(&[(u32, usize)], u32)> = (run.iter())
        .map(|l| (l.bindings.as_slice(), l.workgroups))
        .collect();
    let Some(module) = merged_source(&run[0].pipeline.source, site, &members) else {
        return unmerged(run);
    };
    let (src, bindings, workgroups) = (module.source, module.bindings, module.workgroups);
    if let Err(e) = validate(&src) {
        log::debug!("capture: a merged launch failed validation, left unmerged: {e}");
        return unmerged(run);
    }
    let (params, dynamic_params) = merged_params(&run, site.param_slots * 4);
    let pipeline = generated_pipeline(device, "merged", "main", &src);
    vec![Command::Launch(Launch {
        op: run[0].op,
        fusion: None,
        pipeline,
        bindings,
        params,
        dynamic_params,
        workgroups,
        encoded: None,
    })]
}

/// The params of a merged launch: each launch's in a block of `slot_bytes` of its own, and,
/// when any launch computes its params at replay, the function that packs them then.
fn merged_params(run: &[Launch], slot_bytes: usize) -> (Vec<u8>, Option<HostBytes>) {
    let pack = move |blocks: Vec<Vec<u8>>| -> Vec<u8> {
        let mut out = Vec::with_capacity(blocks.len() * slot_bytes);
        for mut block in blocks {
            block.resize(slot_bytes, 0);
            out.extend(block);
        }
        out
    };
    let params = pack(run.iter().map(|l| l.params.clone()).collect());
    let dynamic_params = run.iter().any(|l| l.dynamic_params.is_some()).then(|| {
        let parts: Vec<(Vec<u8>, Option<HostBytes>)> = run
            .iter()
            .map(|l| (l.params.clone(), l.dynamic_params.clone()))
            .collect();
        let dynamic: HostBytes = Arc::new(move || {
            pack(
                parts
                    .iter()
                    .map(|(fixed, f)| f.as_ref().map_or_else(|| fixed.clone(), |f| f()))
                    .collect(),
            )
        });
        dynamic
    });
    (params, dynamic_params)
}
