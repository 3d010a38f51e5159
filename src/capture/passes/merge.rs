//! Merged parts: consecutive launches of one pipeline whose entry point runs a function of
//! its module's `MEMBER SECTION` (an optimizer's update of each parameter, serial
//! reductions) become one launch with a copy of the section per member, each with its own
//! names, bindings and param block, over workgroups of its own.

use std::sync::Arc;

use super::writes_apart;
use crate::capture::codegen::{generated_pipeline, merged_source, validate};
use crate::capture::ir::{Command, Draft, Launch};
use crate::device::Device;
use crate::kernel::{Fusion, MergeSite, MAX_SLOTS};
use crate::tensor::tape::HostBytes;

/// As [`commute`], for two launches of a merged run (no hook between them).
fn launches_commute(a: &Launch, b: &Launch) -> bool {
    let values = |l: &Launch| -> Vec<usize> { l.bindings.iter().map(|&(_, v)| v).collect() };
    writes_apart(
        &values(a),
        |v| a.written().any(|&w| w == v),
        &values(b),
        |v| b.written().any(|&w| w == v),
    )
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
pub(super) fn merge_parts(draft: &mut Draft, device: &Device) -> usize {
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
        // Generated kernels bind whole buffers: a launch that binds windows is never
        // fused (`tape::record_launch`).
        windows: Vec::new(),
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
