//! `Storage`: one GPU buffer (or a window of one) and the id tests use to see whether two
//! tensors alias.

use std::sync::Arc;

use crate::device::{BufferSlice, Device};

/// A GPU buffer owned by one or more tensors. When the last owner drops, the buffer goes back
/// to the device's pool (work already recorded that reads it still runs first).
///
/// A *window* is a byte range of another storage's buffer, which kernels bind instead of the
/// whole buffer: how ops reach tensors larger than one binding may be. It keeps its parent
/// alive and gives nothing back to the pool.
pub(crate) struct Storage {
    buffer: Option<wgpu::Buffer>,
    id: u64,
    device: Device,
    /// For a window: the parent, and the byte offset and length of the range.
    window: Option<(Arc<Storage>, u64, u64)>,
}

impl Storage {
    /// A pooled buffer of at least `bytes` bytes, with undefined contents.
    pub fn alloc(op: &'static str, bytes: u64, device: &Device) -> crate::Result<Storage> {
        let buffer = device.inner.alloc(op, bytes)?;
        let id = device.inner.new_storage_id();
        super::tape::note_alloc(id);
        Ok(Storage {
            buffer: Some(buffer),
            id,
            device: device.clone(),
            window: None,
        })
    }

    /// The `bytes` bytes of `parent` from byte `offset` (a multiple of the adapter's storage
    /// offset alignment, 256 at most).
    pub fn window(parent: &Arc<Storage>, offset: u64, bytes: u64) -> Storage {
        let base = parent.base();
        let root = match &parent.window {
            Some((root, _, _)) => root.clone(),
            None => parent.clone(),
        };
        Storage {
            buffer: Some(parent.buffer().clone()),
            id: parent.device.inner.new_storage_id(),
            device: parent.device.clone(),
            window: Some((root, base + offset, bytes)),
        }
    }

    pub fn buffer(&self) -> &wgpu::Buffer {
        self.buffer
            .as_ref()
            .expect("storage buffer is present until drop")
    }

    /// Where this storage's bytes start in its buffer (0 unless it is a window).
    pub fn base(&self) -> u64 {
        self.window.as_ref().map_or(0, |(_, offset, _)| *offset)
    }

    /// How many bytes kernels see.
    pub fn bytes(&self) -> u64 {
        self.window
            .as_ref()
            .map_or_else(|| self.buffer().size(), |(_, _, bytes)| *bytes)
    }

    /// True for a window of another storage.
    pub fn is_window(&self) -> bool {
        self.window.is_some()
    }

    /// The storage that owns the buffer: a window's root, or the storage itself.
    pub fn root(self: &Arc<Storage>) -> Arc<Storage> {
        match &self.window {
            Some((root, _, _)) => root.clone(),
            None => self.clone(),
        }
    }

    /// The range a kernel binds.
    pub fn slice(&self) -> BufferSlice<'_> {
        BufferSlice {
            buffer: self.buffer(),
            offset: self.base(),
            size: self.bytes(),
        }
    }

    pub fn id(&self) -> u64 {
        self.id
    }
}

impl Drop for Storage {
    fn drop(&mut self) {
        super::tape::note_release(self.id);
        if let Some(buffer) = self.buffer.take() {
            if self.window.is_none() {
                self.device.inner.release(buffer);
            }
        }
    }
}
