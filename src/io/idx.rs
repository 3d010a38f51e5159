//! MNIST-format IDX files (`train-images-idx3-ubyte` and friends), plain or gzip-compressed.

use std::io::Read;
use std::path::Path;

use crate::error::Result;
use crate::io::{io_error, open_with_size};

const IMAGES_MAGIC: u32 = 0x0000_0803;
const LABELS_MAGIC: u32 = 0x0000_0801;

/// The sizes and payload of the IDX file at `path` (gunzipped when it starts with the gzip
/// magic), read lazily: the header first, its dims multiplied with overflow checks, then the
/// payload it announces and no more (a gzip stream that inflates past it is never inflated,
/// a plain file too short for it fails before its payload is read).
fn read_idx(
    op: &'static str,
    path: &Path,
    magic: u32,
    dims: usize,
) -> Result<(Vec<usize>, Vec<u8>)> {
    use std::io::BufRead;
    let fail = |msg: String| io_error(op, path, msg);
    let (file, size) = open_with_size(op, path)?;
    let mut buffered = std::io::BufReader::new(file);
    let gzip = buffered
        .fill_buf()
        .map_err(|e| io_error(op, path, e))?
        .starts_with(&[0x1f, 0x8b]);
    let mut reader: Box<dyn Read> = match gzip {
        true => Box::new(flate2::read::GzDecoder::new(buffered)),
        false => Box::new(buffered),
    };
    let header_len = 4 + 4 * dims;
    let mut header = Vec::with_capacity(header_len);
    (&mut reader)
        .take(header_len as u64)
        .read_to_end(&mut header)
        .map_err(|e| fail(format!("bad gzip data: {e}")))?;
    if header.len() < header_len {
        return Err(fail(format!(
            "truncated: {} bytes, the header alone needs {header_len}",
            header.len()
        )));
    }
    let found = be_u32(&header, 0);
    if found != magic {
        return Err(fail(format!(
            "bad magic number {found:#010x}, expected {magic:#010x}"
        )));
    }
    let sizes: Vec<usize> = (0..dims)
        .map(|d| be_u32(&header, 4 + 4 * d) as usize)
        .collect();
    let expected = sizes
        .iter()
        .try_fold(1usize, |n, &d| n.checked_mul(d))
        .ok_or_else(|| fail(format!("the header's sizes {sizes:?} overflow")))?;
    let available = size.map(|s| s.saturating_sub(header_len as u64));
    if !gzip && available.is_some_and(|a| (expected as u64) > a) {
        return Err(fail(format!(
            "truncated: header says {sizes:?} ({expected} bytes of data), file has {}",
            available.unwrap_or(0)
        )));
    }
    let mut payload = Vec::new();
    reader
        .take(expected as u64)
        .read_to_end(&mut payload)
        .map_err(|e| fail(format!("bad gzip data: {e}")))?;
    if payload.len() < expected {
        return Err(fail(format!(
            "truncated: header says {sizes:?} ({expected} bytes of data), file has {}",
            payload.len()
        )));
    }
    Ok((sizes, payload))
}

fn be_u32(bytes: &[u8], at: usize) -> u32 {
    u32::from_be_bytes([bytes[at], bytes[at + 1], bytes[at + 2], bytes[at + 3]])
}

/// Reads an IDX3 image file: `(pixels scaled to [0, 1], count, rows, cols)`, row-major,
/// one image after another. Any image size.
pub fn read_idx_images(path: impl AsRef<Path>) -> Result<(Vec<f32>, usize, usize, usize)> {
    const OP: &str = "read_idx_images";
    let path = path.as_ref();
    let (sizes, payload) = read_idx(OP, path, IMAGES_MAGIC, 3)?;
    Ok((unit_scaled(&payload), sizes[0], sizes[1], sizes[2]))
}

/// Bytes scaled to `[0, 1]`, converted on every core: writing a training set's floats (188 MB
/// for Fashion-MNIST) costs about half as much as gunzipping it.
fn unit_scaled(bytes: &[u8]) -> Vec<f32> {
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let mut pixels = vec![0.0f32; bytes.len()];
    let chunk = bytes.len().div_ceil(threads).max(1 << 16);
    std::thread::scope(|scope| {
        for (out, src) in pixels.chunks_mut(chunk).zip(bytes.chunks(chunk)) {
            scope.spawn(move || {
                for (o, &b) in out.iter_mut().zip(src) {
                    *o = b as f32 / 255.0;
                }
            });
        }
    });
    pixels
}

/// Reads an IDX1 label file.
pub fn read_idx_labels(path: impl AsRef<Path>) -> Result<Vec<u32>> {
    const OP: &str = "read_idx_labels";
    let path = path.as_ref();
    let (_, payload) = read_idx(OP, path, LABELS_MAGIC, 1)?;
    Ok(payload.iter().map(|&b| b as u32).collect())
}
