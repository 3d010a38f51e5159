//! The capture tape. While `capture::Step` captures a training step, everything the step does
//! to the device on this thread is written down in order: each kernel launch (pipeline,
//! buffers, params), each upload of host data, each host hook that must run again at every
//! replay (an optimizer's step count), each change to a grad slot, and each train/eval flag the
//! step's modules read. `capture` turns the tape into a plan.
//!
//! Eager code pays one thread-local check per launch; nothing is written unless a tape is open.

use std::cell::RefCell;
use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};

use crate::device::{CachedPipeline, Device};
use crate::error::{Error, Result};
use crate::tensor::command::{BufferCopy, ByteRange, Command, Launch, Upload};
use crate::tensor::fusion::Fusion;
use crate::tensor::{IndexRange, Layout, Storage, Tensor, TensorInner};

thread_local! {
    static TAPE: RefCell<Option<Tape>> = const { RefCell::new(None) };
}

/// Host data computed again at every replay (dropout masks, an optimizer's bias corrections).
pub(crate) type HostBytes = Arc<dyn Fn() -> Vec<u8> + Send + Sync>;

/// Host work a replay runs before its kernels (advancing an optimizer's step count).
pub(crate) type ReplayHook = Box<dyn FnMut() -> Result<()> + Send>;

/// A buffer a taped command touches. Storages made while taping are named by id only (the
/// plan gives them buffers of its own); storages from before are kept alive by the tape.
#[derive(Clone)]
pub(crate) struct TapedStorage {
    pub id: u64,
    /// The buffer's size (its pool size class).
    pub bytes: u64,
    /// The storage itself, for storages that existed before the tape opened.
    pub external: Option<Arc<Storage>>,
}

/// A change to (or read of) a grad slot.
pub(crate) enum SlotEvent {
    /// The engine read `leaf`'s grad: the storage id and layout it had then, if any.
    Read {
        leaf: Tensor,
        grad: Option<(u64, Layout)>,
    },
    /// `zero_grad` or `set_grad(None)`.
    Clear { leaf: Tensor },
    /// `set_grad(Some(grad))`.
    Set { leaf: Tensor, grad: Tensor },
    /// The engine installed the storage `storage` as `leaf`'s grad (S-2's swap, or a new
    /// handle where the slot was empty).
    Install { leaf: Tensor, storage: u64 },
}

/// Everything one captured step did.
pub(crate) struct Tape {
    pub device: Device,
    pub commands: Vec<Command<TapedStorage>>,
    pub slots: Vec<SlotEvent>,
    /// Storages made while taping, and those of them dropped before it closed.
    pub created: HashSet<u64>,
    pub released: HashSet<u64>,
    /// Train/eval flags the step's modules read, with the value they had.
    pub flags: Vec<(Arc<AtomicBool>, bool)>,
    /// `requires_grad` of each tensor from outside the step that a launch read.
    pub requires_grad: Vec<(Weak<TensorInner>, bool)>,
    /// Index checks that passed: the storage of the u32 tensor checked, and the range its
    /// indices had to lie in (an embedding's rows, a loss's classes and ignore_index).
    pub index_limits: Vec<(u64, IndexRange)>,
    /// Why the step cannot be replayed, when the step did something a plan cannot hold.
    pub refused: Option<String>,
}

/// The open tape of this thread: [`Recording::finish`] closes it and returns it, and a
/// recording dropped unfinished (the step's closure panicked) closes it too, so the thread
/// records nothing more and its reads work again.
pub(crate) struct Recording {
    finished: bool,
}

impl Recording {
    /// Closes the tape and returns what it recorded.
    pub(crate) fn finish(mut self) -> Tape {
        self.finished = true;
        TAPE.with(|t| t.borrow_mut().take())
            .expect("a recording's tape is open")
    }
}

impl Drop for Recording {
    fn drop(&mut self) {
        if !self.finished {
            let _ = TAPE.try_with(|t| t.try_borrow_mut().map(|mut tape| tape.take()));
        }
    }
}

/// Opens a tape on this thread for work on `device`, closed when the returned recording is
/// finished or dropped.
pub(crate) fn open(device: &Device) -> Recording {
    TAPE.with(|t| {
        *t.borrow_mut() = Some(Tape {
            device: device.clone(),
            commands: Vec::new(),
            slots: Vec::new(),
            created: HashSet::new(),
            released: HashSet::new(),
            flags: Vec::new(),
            requires_grad: Vec::new(),
            index_limits: Vec::new(),
            refused: None,
        })
    });
    Recording { finished: false }
}

/// True while a tape is open on this thread.
pub(crate) fn is_open() -> bool {
    TAPE.with(|t| t.borrow().is_some())
}

fn with_tape(f: impl FnOnce(&mut Tape)) {
    // `try_with`: storages may drop while the thread's locals are being torn down.
    let _ = TAPE.try_with(|t| {
        if let Ok(mut tape) = t.try_borrow_mut() {
            if let Some(tape) = tape.as_mut() {
                f(tape);
            }
        }
    });
}

pub(crate) fn note_alloc(id: u64) {
    with_tape(|tape| {
        tape.created.insert(id);
    });
}

pub(crate) fn note_release(id: u64) {
    with_tape(|tape| {
        if tape.created.contains(&id) {
            tape.released.insert(id);
        }
    });
}

/// How a tape names `storage`: as the storage that owns its buffer (a window's root, so a
/// plan sees one value per buffer), with the byte range a window binds of it.
fn taped(tape: &Tape, storage: &Arc<Storage>) -> (TapedStorage, Option<ByteRange>) {
    let root = storage.root();
    let id = root.id();
    let taped = TapedStorage {
        id,
        bytes: root.buffer().size(),
        external: (!tape.created.contains(&id)).then(|| root.clone()),
    };
    let range = storage.is_window().then(|| ByteRange {
        offset: storage.base(),
        bytes: storage.bytes(),
    });
    (taped, range)
}

fn check_device(tape: &mut Tape, op: &'static str, device: &Device) {
    if !Device::same(&tape.device, device) && tape.refused.is_none() {
        tape.refused = Some(format!("{op} ran on another device than the step's"));
    }
}

/// Writes down a kernel launch over `tensors` (each beside its binding).
pub(crate) fn record_launch(
    op: &'static str,
    pipeline: &Arc<CachedPipeline>,
    tensors: &[(u32, &Tensor)],
    params: &[u8],
    dynamic_params: Option<HostBytes>,
    workgroups: u32,
    fusion: Option<Fusion<u32>>,
) {
    with_tape(|tape| {
        check_device(tape, op, tensors[0].1.device());
        let mut bindings = Vec::with_capacity(tensors.len());
        let mut windows = Vec::new();
        for (binding, tensor) in tensors {
            let storage = tensor.storage();
            let (entry, range) = taped(tape, &storage);
            if let Some(range) = range {
                windows.push((*binding, range));
            }
            if entry.external.is_some() {
                let known = tape
                    .requires_grad
                    .iter()
                    .any(|(t, _)| Weak::as_ptr(t) == Arc::as_ptr(&tensor.inner));
                if !known {
                    tape.requires_grad
                        .push((Arc::downgrade(&tensor.inner), tensor.requires_grad()));
                }
            }
            bindings.push((*binding, entry));
        }
        // The fuser's descriptor names the launch's storages, as its bindings do. The fuser's
        // kernels bind whole buffers, so a launch that binds windows keeps its own kernel.
        let fusion = fusion.filter(|_| windows.is_empty()).map(|f| {
            f.named(|binding| {
                let (_, storage) = (bindings.iter())
                    .find(|(b, _)| *b == binding)
                    .expect("a fusible launch binds what its descriptor names");
                storage.clone()
            })
        });
        tape.commands.push(Command::Launch(Launch {
            op,
            pipeline: pipeline.clone(),
            bindings,
            windows,
            params: params.to_vec(),
            dynamic_params,
            workgroups,
            fusion,
            encoded: None,
        }));
    });
}

/// Writes down an upload of `data` into `target`.
pub(crate) fn record_upload(target: &Arc<Storage>, data: &[u8], dynamic: Option<HostBytes>) {
    with_tape(|tape| {
        let (target, range) = taped(tape, target);
        if range.is_some() && tape.refused.is_none() {
            tape.refused = Some("the step uploads host data into a window of a buffer".into());
        }
        tape.commands.push(Command::Upload(Upload {
            target,
            data: data.to_vec(),
            dynamic,
            staging: None,
        }));
    });
}

/// Writes down a copy of `bytes` bytes from `src` to `dst` (storages and byte offsets in
/// their buffers).
pub(crate) fn record_copy(src: (&Arc<Storage>, u64), dst: (&Arc<Storage>, u64), bytes: u64) {
    with_tape(|tape| {
        // The offsets are in the buffer, which a window shares with its root.
        let copy = BufferCopy {
            src: (taped(tape, src.0).0, src.1),
            dst: (taped(tape, dst.0).0, dst.1),
            bytes,
        };
        tape.commands.push(Command::Copy(copy));
    });
}

/// Registers host work to run again before each replay's kernels, at this point of the step
/// (kept only while a tape is open).
pub(crate) fn on_replay(hook: impl FnMut() -> Result<()> + Send + 'static) {
    with_tape(|tape| tape.commands.push(Command::Hook(Box::new(hook))));
}

/// Notes that the step read a module's train/eval flag: a replay under another value of the
/// flag would run the wrong kernels, so plans are kept per value.
pub(crate) fn observe_flag(flag: &Arc<AtomicBool>) {
    with_tape(|tape| {
        if !tape.flags.iter().any(|(f, _)| Arc::ptr_eq(f, flag)) {
            tape.flags
                .push((flag.clone(), flag.load(Ordering::Relaxed)));
        }
    });
}

/// Notes that an op checked every index of `indices` to lie in `limit`: a plan may replay
/// any batch whose indices stay in it, since its kernels hold nothing else of the indices.
pub(crate) fn note_index_limit(indices: &Tensor, limit: IndexRange) {
    with_tape(|tape| tape.index_limits.push((indices.storage_id(), limit)));
}

pub(crate) fn note_slot(event: impl FnOnce() -> SlotEvent) {
    with_tape(|tape| tape.slots.push(event()));
}

/// An error when a tape is open: a captured step cannot read device values on the host,
/// since its replays run without the closure and would hand back a stale value.
pub(crate) fn refuse_host_read(op: &'static str) -> Result<()> {
    if is_open() {
        return Err(Error::Capture {
            op,
            msg: "reads a tensor's values on the host while a step is being captured; a replay \
                  cannot repeat a host read. Return the value from the step closure (Step::run \
                  returns it) and read it after run()"
                .into(),
        });
    }
    Ok(())
}
