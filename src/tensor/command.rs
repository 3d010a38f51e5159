//! The one command type of a captured step, from the tape to the replay: what a step does to
//! the device, in order, naming buffers by `N`. The tape names them as the storages it saw
//! ([`TapedStorage`](crate::tensor::tape::TapedStorage)); a capture draft renames them to
//! values (`usize`) with [`Command::named`], its passes rewrite the list, and laying out the
//! plan fills in each launch's and upload's encoding.

use std::sync::{Arc, Mutex};

use crate::device::CachedPipeline;
use crate::tensor::fusion::Fusion;
use crate::tensor::tape::{HostBytes, ReplayHook};

/// One thing a step does to the device.
// Launches are nearly every command: boxing them to shrink the rare uploads and copies would
// cost an allocation per launch.
#[allow(clippy::large_enum_variant)]
pub(crate) enum Command<N> {
    Launch(Launch<N>),
    /// Host data copied into a buffer.
    Upload(Upload<N>),
    /// A buffer-to-buffer copy.
    Copy(BufferCopy<N>),
    /// Host work a replay runs again at its place (an optimizer's step count).
    Hook(ReplayHook),
}

/// A kernel launch.
pub(crate) struct Launch<N> {
    pub op: &'static str,
    pub pipeline: Arc<CachedPipeline>,
    pub bindings: Vec<(u32, N)>,
    /// The bindings that bind a byte range of their buffer rather than all of it (windows of
    /// a tensor larger than one binding); most launches have none.
    pub windows: Vec<(u32, ByteRange)>,
    /// The params as they were at capture.
    pub params: Vec<u8>,
    /// Recomputes the params at each replay, for params that change per step.
    pub dynamic_params: Option<HostBytes>,
    pub workgroups: u32,
    /// What the fuser may do with it (`None`: nothing).
    pub fusion: Option<Fusion<N>>,
    /// Set when the plan is laid out.
    pub encoded: Option<EncodedLaunch>,
}

/// A byte range of a buffer: what a launch binds of a tensor larger than one binding.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct ByteRange {
    pub offset: u64,
    pub bytes: u64,
}

/// What laying out a plan makes once for a launch.
pub(crate) struct EncodedLaunch {
    /// Where its params sit in the plan's params buffer.
    pub params_offset: u64,
    /// Built once when every binding is fixed; otherwise built per replay, reusing one of the
    /// last two when the replay's buffers are the same (grads alternate between two buffers
    /// when a step accumulates into them).
    pub bind_group: Option<wgpu::BindGroup>,
    pub recent: Mutex<Vec<(Vec<wgpu::Buffer>, wgpu::BindGroup)>>,
}

/// Host data copied into `target`.
pub(crate) struct Upload<N> {
    pub target: N,
    pub data: Vec<u8>,
    /// Recomputes the data at each replay.
    pub dynamic: Option<HostBytes>,
    /// The buffer a replay copies the data from; set when the plan is laid out.
    pub staging: Option<wgpu::Buffer>,
}

/// A copy of `bytes` bytes between two buffers, at byte offsets.
pub(crate) struct BufferCopy<N> {
    pub src: (N, u64),
    pub dst: (N, u64),
    pub bytes: u64,
}

impl<N> Command<N> {
    /// The same command with every buffer named by `name` instead.
    pub fn named<M>(self, mut name: impl FnMut(N) -> M) -> Command<M> {
        match self {
            Command::Launch(l) => Command::Launch(Launch {
                op: l.op,
                pipeline: l.pipeline,
                bindings: (l.bindings.into_iter())
                    .map(|(b, n)| (b, name(n)))
                    .collect(),
                windows: l.windows,
                params: l.params,
                dynamic_params: l.dynamic_params,
                workgroups: l.workgroups,
                fusion: l.fusion.map(|f| f.named(&mut name)),
                encoded: l.encoded,
            }),
            Command::Upload(u) => Command::Upload(Upload {
                target: name(u.target),
                data: u.data,
                dynamic: u.dynamic,
                staging: u.staging,
            }),
            Command::Copy(c) => Command::Copy(BufferCopy {
                src: (name(c.src.0), c.src.1),
                dst: (name(c.dst.0), c.dst.1),
                bytes: c.bytes,
            }),
            Command::Hook(hook) => Command::Hook(hook),
        }
    }

    /// The buffers it touches, in binding order.
    pub fn buffers(&self) -> Vec<&N> {
        match self {
            Command::Launch(l) => l.bindings.iter().map(|(_, n)| n).collect(),
            Command::Upload(u) => vec![&u.target],
            Command::Copy(c) => vec![&c.src.0, &c.dst.0],
            Command::Hook(_) => Vec::new(),
        }
    }

    /// The buffers it may write.
    pub fn written(&self) -> Vec<&N> {
        match self {
            Command::Launch(l) => l.written().collect(),
            Command::Upload(u) => vec![&u.target],
            Command::Copy(c) => vec![&c.dst.0],
            Command::Hook(_) => Vec::new(),
        }
    }
}

impl<N> Launch<N> {
    /// The range of its buffer that `binding` binds: a window's, or all of `whole` bytes.
    pub fn range(&self, binding: u32, whole: u64) -> ByteRange {
        (self.windows.iter()).find(|(b, _)| *b == binding).map_or(
            ByteRange {
                offset: 0,
                bytes: whole,
            },
            |(_, range)| *range,
        )
    }

    /// The buffers it may write: those bound where its module declares `read_write`.
    pub fn written(&self) -> impl Iterator<Item = &N> {
        (self.bindings.iter())
            .filter(|(binding, _)| self.pipeline.writable.contains(binding))
            .map(|(_, n)| n)
    }
}
