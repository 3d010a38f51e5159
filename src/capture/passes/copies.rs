//! Copy forwarding: a whole copy of an intermediate into a value the step makes is removed,
//! and the intermediate's writers write that value instead.

use super::launch_values;
use crate::capture::ir::{Command, Draft};
use crate::kernel::Fusion;

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
