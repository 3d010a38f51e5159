//! The capture passes: rewrites of a draft's commands that make a plan fewer, fuller
//! launches, run in order from one list ([`run_passes`]), each reporting how many commands it
//! removed. A pass decides; the WGSL of the kernels it makes is written by `codegen.rs` and
//! validated with naga before it is compiled (one that fails leaves its launches as they
//! were). On software adapters an elementwise kernel is bound by instructions per load and
//! every launch has a fixed cost, so the way past both is fewer passes over memory and fewer
//! launches.
//!
//! Adding a pass is one file here and one entry in [`run_passes`]'s list.

mod copies;
mod elementwise;
mod epilogue;
mod merge;

use std::collections::{HashMap, HashSet};

use super::ir::{Command, Draft, Launch};
use super::PassStats;
use crate::device::Device;

/// A capture pass: rewrites a draft's commands and returns how many it removed.
type Pass = fn(&mut Draft, &Device) -> usize;

/// Runs the passes over `draft`, in order, and what each removed. Epilogues go before
/// elementwise runs: a run that a matmul or a norm can store needs no kernel of its own.
pub(super) fn run_passes(draft: &mut Draft, device: &Device) -> PassStats {
    let mut stats = PassStats::default();
    let passes: [(Pass, &mut usize); 4] = [
        (
            |d, _| copies::forward_copies(d),
            &mut stats.copies_forwarded,
        ),
        (epilogue::fuse_epilogues, &mut stats.epilogues),
        (elementwise::fuse_elementwise, &mut stats.fused),
        (merge::merge_parts, &mut stats.merged),
    ];
    for (pass, removed) in passes {
        *removed = pass(draft, device);
    }
    stats
}

/// The most storage buffers a generated elementwise or epilogue kernel may bind, with room
/// to spare.
fn max_fused_buffers(device: &Device) -> usize {
    (device.inner.limits.max_storage_buffers_per_shader_stage as usize).min(8)
}

/// The indices of the launches that bind each value, in order.
fn users_by_value(draft: &Draft) -> HashMap<usize, Vec<usize>> {
    let mut users: HashMap<usize, Vec<usize>> = HashMap::new();
    for (at, command) in draft.commands.iter().enumerate() {
        for v in launch_values(command) {
            users.entry(v).or_default().push(at);
        }
    }
    users
}

/// A pass's edits to a draft, by the indices of the draft it read: commands removed, and
/// commands put in another's place.
#[derive(Default)]
struct Rewrite {
    removed: HashSet<usize>,
    replaced: HashMap<usize, Command>,
}

impl Rewrite {
    /// Removes the commands at `removed` and puts `launch` in the place of the last of
    /// `members` (which are removed but for that one).
    fn collapse(
        &mut self,
        removed: impl IntoIterator<Item = usize>,
        members: &[usize],
        launch: Launch,
    ) {
        let last = *members.last().expect("one or more members");
        self.removed.extend(removed);
        self.removed
            .extend(members.iter().copied().filter(|&m| m != last));
        self.replaced.insert(last, Command::Launch(launch));
    }

    /// Applies the edits; returns how many commands they removed.
    fn apply(mut self, draft: &mut Draft) -> usize {
        let before = draft.commands.len();
        let commands = std::mem::take(&mut draft.commands);
        for (at, command) in commands.into_iter().enumerate() {
            if self.removed.contains(&at) {
                continue;
            }
            draft
                .commands
                .push(self.replaced.remove(&at).unwrap_or(command));
        }
        before - draft.commands.len()
    }
}

fn launch_values(command: &Command) -> Vec<usize> {
    command.buffers().into_iter().copied().collect()
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
            |v| a.written().contains(&&v),
            &launch_values(b),
            |v| b.written().contains(&&v),
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
