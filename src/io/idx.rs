//! MNIST-format IDX files (`train-images-idx3-ubyte` and friends), plain or gzip-compressed.

use std::io::Read;
use std::path::Path;

use crate::error::Result;
use crate::io::io_error;

const IMAGES_MAGIC: u32 = 0x0000_0803;
const LABELS_MAGIC: u32 = 0x0000_0801;

/// The file's bytes, gunzipped when it starts with the gzip magic.
fn read_maybe_gzip(op: &'static str, path: &Path) -> Result<Vec<u8>> {
    let raw = std::fs::read(path).map_err(|e| io_error(op, path, e))?;
    if raw.starts_with(&[0x1f, 0x8b]) {
        let mut out = Vec::new();
        flate2::read::GzDecoder::new(&raw[..])
            .read_to_end(&mut out)
            .map_err(|e| io_error(op, path, format!("bad gzip data: {e}")))?;
        return Ok(out);
    }
    Ok(raw)
}

fn be_u32(bytes: &[u8], at: usize) -> u32 {
    u32::from_be_bytes([bytes[at], bytes[at + 1], bytes[at + 2], bytes[at + 3]])
}

/// Checks the magic number and reads `dims` big-endian sizes; returns them and the payload.
fn parse<'a>(
    op: &'static str,
    path: &Path,
    bytes: &'a [u8],
    magic: u32,
    dims: usize,
) -> Result<(Vec<usize>, &'a [u8])> {
    let header = 4 + 4 * dims;
    if bytes.len() < header {
        return Err(io_error(
            op,
            path,
            format!(
                "truncated: {} bytes, the header alone needs {header}",
                bytes.len()
            ),
        ));
    }
    let found = be_u32(bytes, 0);
    if found != magic {
        return Err(io_error(
            op,
            path,
            format!("bad magic number {found:#010x}, expected {magic:#010x}"),
        ));
    }
    let sizes: Vec<usize> = (0..dims)
        .map(|d| be_u32(bytes, 4 + 4 * d) as usize)
        .collect();
    let expected: usize = sizes.iter().product();
    let payload = &bytes[header..];
    if payload.len() < expected {
        return Err(io_error(
            op,
            path,
            format!(
                "truncated: header says {sizes:?} ({expected} bytes of data), file has {}",
                payload.len()
            ),
        ));
    }
    Ok((sizes, &payload[..expected]))
}

/// Reads an IDX3 image file: `(pixels scaled to [0, 1], count, rows, cols)`, row-major,
/// one image after another. Any image size.
pub fn read_idx_images(path: impl AsRef<Path>) -> Result<(Vec<f32>, usize, usize, usize)> {
    const OP: &str = "read_idx_images";
    let path = path.as_ref();
    let bytes = read_maybe_gzip(OP, path)?;
    let (sizes, payload) = parse(OP, path, &bytes, IMAGES_MAGIC, 3)?;
    Ok((unit_scaled(payload), sizes[0], sizes[1], sizes[2]))
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
    let bytes = read_maybe_gzip(OP, path)?;
    let (_, payload) = parse(OP, path, &bytes, LABELS_MAGIC, 1)?;
    Ok(payload.iter().map(|&b| b as u32).collect())
}
