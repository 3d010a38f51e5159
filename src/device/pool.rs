//! `BufferPool`: storage buffers grouped by size class, so that a training loop that allocates
//! the same shapes every step reuses the same buffers and device memory stays flat.

use std::collections::HashMap;

/// Smallest buffer the pool hands out, in bytes. Also the size used for empty tensors, since
/// wgpu does not bind zero-sized buffers.
const MIN_BYTES: u64 = 256;

/// Largest size class that is a power of two; above it there are four classes per octave.
const LAST_POW2_CLASS: u64 = 64 << 10;

/// The size class a request of `bytes` is rounded up to: powers of two up to 64 KiB, then four
/// classes per octave (so at most 25% of a buffer past 64 KiB is slack: a [384, 128] f16
/// weight takes 96 KiB, not 128).
pub(crate) fn size_class(bytes: u64) -> u64 {
    let bytes = bytes.max(MIN_BYTES);
    let pow2 = bytes.next_power_of_two();
    if pow2 <= LAST_POW2_CLASS {
        return pow2;
    }
    let quarter = pow2 / 8; // classes at 4/8, 5/8, 6/8, 7/8 and 8/8 of pow2
    bytes.div_ceil(quarter) * quarter
}

/// Free storage buffers waiting for reuse, keyed by size class, plus byte counters for
/// `Device::stats`.
#[derive(Default)]
pub(crate) struct BufferPool {
    free: HashMap<u64, Vec<wgpu::Buffer>>,
    /// Bytes in buffers currently owned by a tensor.
    pub live_bytes: u64,
    /// Bytes in buffers waiting in `free`.
    pub pooled_bytes: u64,
    /// Buffers ever created (a pool miss creates one).
    pub created: u64,
    /// The most `live_bytes` have been since the device started or the last reset.
    pub peak_live_bytes: u64,
}

impl BufferPool {
    /// A free buffer of exactly `class` bytes, if the pool holds one. The caller counts it live.
    pub fn take(&mut self, class: u64) -> Option<wgpu::Buffer> {
        let buffer = self.free.get_mut(&class)?.pop()?;
        self.pooled_bytes -= class;
        self.add_live(class);
        Some(buffer)
    }

    /// Counts a buffer the device has just created for a pool miss.
    pub fn note_created(&mut self, class: u64) {
        self.created += 1;
        self.add_live(class);
    }

    fn add_live(&mut self, class: u64) {
        self.live_bytes += class;
        self.peak_live_bytes = self.peak_live_bytes.max(self.live_bytes);
    }

    /// Returns a buffer whose last tensor has dropped.
    pub fn give_back(&mut self, buffer: wgpu::Buffer) {
        let class = buffer.size();
        self.live_bytes -= class;
        self.pooled_bytes += class;
        self.free.entry(class).or_default().push(buffer);
    }

    /// Frees every pooled buffer (wgpu releases the memory once the GPU is done with it).
    pub fn clear(&mut self) {
        self.free.clear();
        self.pooled_bytes = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::size_class;

    #[test]
    fn size_classes_round_up_with_bounded_slack() {
        assert_eq!(size_class(0), 256);
        assert_eq!(size_class(4), 256);
        assert_eq!(size_class(257), 512);
        assert_eq!(size_class(1 << 16), 1 << 16);
        assert_eq!(size_class((1 << 16) + 1), (1 << 17) / 8 * 5);
        assert_eq!(size_class(96 << 10), 96 << 10);
        assert_eq!(size_class(1 << 20), 1 << 20);
        assert_eq!(size_class((1 << 20) + 1), (1 << 21) / 8 * 5);
        for bytes in [70_000u64, 700_000, 3_000_000, 64 << 20, (64 << 20) + 4] {
            let class = size_class(bytes);
            assert!(
                class >= bytes && class <= bytes + bytes / 4 + 256,
                "{bytes} -> {class}"
            );
        }
    }
}
