//! The one error type every fallible wgrad call returns.

/// Everything that can go wrong in wgrad. Each variant names the op that failed, so a user
/// reading the message knows which line of their code to look at.
#[derive(Debug, Clone, thiserror::Error)]
pub enum Error {
    /// No adapter could be found; the message says what to install.
    #[error("no GPU adapter found: {0}")]
    NoAdapter(String),

    /// Shapes that do not fit the op (mismatched, not broadcastable, wrong rank, bad dim).
    #[error("{op}: {msg}")]
    Shape {
        /// The op that rejected its input.
        op: &'static str,
        /// What was wrong, with the shapes involved.
        msg: String,
    },

    /// A tensor of the wrong element type (f32 where u32 indices were expected, or the reverse).
    #[error("{op}: {msg}")]
    DType {
        /// The op that rejected its input.
        op: &'static str,
        /// What was expected and what was given.
        msg: String,
    },

    /// An index or label outside the range the op can address.
    #[error("{op}: {msg}")]
    Index {
        /// The op that rejected its input.
        op: &'static str,
        /// Which index and which range.
        msg: String,
    },

    /// Any other bad argument (data length, empty input list, non-finite parameter...).
    #[error("{op}: {msg}")]
    InvalidArgument {
        /// The op that rejected its input.
        op: &'static str,
        /// What was wrong.
        msg: String,
    },

    /// A tensor larger than the adapter's largest buffer, or larger than one kernel binding
    /// for an op that cannot split it into windows.
    #[error("{op}: a tensor of {bytes} bytes exceeds the adapter's limit of {limit} bytes (per buffer, or per kernel binding where the op cannot bind windows of it)")]
    TooLarge {
        /// The op that needed the buffer.
        op: &'static str,
        /// Bytes asked for.
        bytes: u64,
        /// The adapter's limit.
        limit: u64,
    },

    /// A file that could not be read or written, or whose contents are not what the op
    /// expects (a corrupt checkpoint, a truncated IDX file).
    #[error("{op}: {path}: {msg}")]
    Io {
        /// The op that touched the file.
        op: &'static str,
        /// The file.
        path: String,
        /// What went wrong.
        msg: String,
    },

    /// A captured step (`capture::Step`) did something a replay cannot repeat, or a replay's
    /// guard or plan failed.
    #[error("{op}: {msg}")]
    Capture {
        /// The op or call that could not be captured.
        op: &'static str,
        /// What happened and what to do instead.
        msg: String,
    },

    /// An error reported by the device: validation, out of memory, internal, or device lost.
    #[error("device error in {op}: {msg}")]
    Device {
        /// The op (or ops submitted together) that caused it.
        op: String,
        /// wgpu's description.
        msg: String,
    },
}

/// `std::result::Result` with wgrad's [`Error`].
pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    /// An input error of an op built on another (conv1d on conv2d) as the caller's: named
    /// `op`, its message after `inputs`, the shapes the caller was given. Other errors (device,
    /// files, capture) pass unchanged.
    pub(crate) fn into_error_of(self, op: &'static str, inputs: String) -> Error {
        let restate = |msg: String| format!("{inputs}: {msg}");
        match self {
            Error::Shape { msg, .. } => Error::Shape {
                op,
                msg: restate(msg),
            },
            Error::DType { msg, .. } => Error::DType {
                op,
                msg: restate(msg),
            },
            Error::Index { msg, .. } => Error::Index {
                op,
                msg: restate(msg),
            },
            Error::InvalidArgument { msg, .. } => Error::InvalidArgument {
                op,
                msg: restate(msg),
            },
            other => other,
        }
    }
}
