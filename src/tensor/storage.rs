//! `Storage`: one GPU buffer and the id tests use to see whether two tensors alias.

use crate::device::Device;

/// A GPU buffer owned by one or more tensors. When the last owner drops, the buffer goes back
/// to the device's pool (work already recorded that reads it still runs first).
pub(crate) struct Storage {
    buffer: Option<wgpu::Buffer>,
    id: u64,
    device: Device,
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
        })
    }

    pub fn buffer(&self) -> &wgpu::Buffer {
        self.buffer
            .as_ref()
            .expect("storage buffer is present until drop")
    }

    pub fn id(&self) -> u64 {
        self.id
    }
}

impl Drop for Storage {
    fn drop(&mut self) {
        super::tape::note_release(self.id);
        if let Some(buffer) = self.buffer.take() {
            self.device.inner.release(buffer);
        }
    }
}
