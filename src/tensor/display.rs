//! `Display` for tensors, as PyTorch prints them: `tensor([[1.0000, 2.5000], ...])`, four
//! decimals (scientific where magnitudes are far apart), whole numbers as `1.`, dims past six
//! elements elided to their first and last three when the tensor holds more than 1,000, and
//! `dtype=torch.uint32` (or the 16-bit dtype) / `requires_grad=True` after the values, as torch
//! names them. Reads the values back from the device.

use std::fmt;

use crate::tensor::{DType, Tensor};

/// More elements than this are elided.
const THRESHOLD: usize = 1000;
/// Elements kept at each end of an elided dim.
const EDGE: usize = 3;
/// Columns a printed row wraps at.
const LINE_WIDTH: usize = 80;

/// How every element is written: as a whole number, fixed with 4 decimals, or scientific.
#[derive(Clone, Copy)]
enum Style {
    Whole,
    Fixed,
    Scientific,
}

/// PyTorch's choice: scientific when the finite nonzero magnitudes span more than 1e3 or
/// reach 1e8 (or, for fractions, go below 1e-4); else whole numbers as `1.`, others fixed.
fn style_of(values: &[f64]) -> Style {
    let magnitudes: Vec<f64> = values
        .iter()
        .filter(|v| v.is_finite() && **v != 0.0)
        .map(|v| v.abs())
        .collect();
    let max = magnitudes.iter().cloned().fold(0.0, f64::max);
    let min = magnitudes.iter().cloned().fold(f64::INFINITY, f64::min);
    let wide = !magnitudes.is_empty() && (max / min > 1e3 || max > 1e8);
    let whole = values
        .iter()
        .filter(|v| v.is_finite())
        .all(|v| v.fract() == 0.0);
    match (wide, whole) {
        (true, _) => Style::Scientific,
        (false, true) => Style::Whole,
        (false, false) if !magnitudes.is_empty() && min < 1e-4 => Style::Scientific,
        (false, false) => Style::Fixed,
    }
}

fn element(v: f64, style: Style, integer: bool) -> String {
    if integer {
        return format!("{v}");
    }
    if v.is_nan() {
        return "nan".into();
    }
    if v.is_infinite() {
        return if v > 0.0 { "inf".into() } else { "-inf".into() };
    }
    match style {
        Style::Whole => format!("{v:.0}."),
        Style::Fixed => format!("{v:.4}"),
        Style::Scientific => {
            // C's %.4e, as torch prints: a signed exponent of at least two digits.
            let text = format!("{v:.4e}");
            let (mantissa, exponent) = text.split_once('e').expect("{:e} writes an e");
            let exponent: i32 = exponent.parse().expect("an integer exponent");
            let sign = if exponent < 0 { '-' } else { '+' };
            format!("{mantissa}e{sign}{:02}", exponent.abs())
        }
    }
}

/// Writes the sub-tensor of `shape` at `values` (row-major, padded to one width), elided when
/// `elide`, its opening bracket at column `indent`; a row wraps as PyTorch wraps it at 80
/// columns.
fn write_dims(out: &mut String, values: &[String], shape: &[usize], elide: bool, indent: usize) {
    if shape.is_empty() {
        out.push_str(&values[0]);
        return;
    }
    let n = shape[0];
    let inner: usize = shape[1..].iter().product();
    let shown: Vec<Option<usize>> = if elide && n > 2 * EDGE {
        (0..EDGE)
            .map(Some)
            .chain([None])
            .chain((n - EDGE..n).map(Some))
            .collect()
    } else {
        (0..n).map(Some).collect()
    };
    out.push('[');
    if shape.len() == 1 {
        let width = values.first().map_or(0, |v| v.len());
        let per_line = (LINE_WIDTH.saturating_sub(indent) / (width + 2)).max(1);
        let items: Vec<&str> = shown
            .iter()
            .map(|i| i.map_or(" ...", |i| values[i].as_str()))
            .collect();
        for (k, line) in items.chunks(per_line).enumerate() {
            if k > 0 {
                out.push_str(",\n");
                out.push_str(&" ".repeat(indent + 1));
            }
            out.push_str(&line.join(", "));
        }
    } else {
        for (k, i) in shown.iter().enumerate() {
            if k > 0 {
                out.push(',');
                out.push_str(&"\n".repeat(shape.len() - 1));
                out.push_str(&" ".repeat(indent + 1));
            }
            match i {
                None => out.push_str("..."),
                Some(i) => write_dims(
                    out,
                    &values[i * inner..(i + 1) * inner],
                    &shape[1..],
                    elide,
                    indent + 1,
                ),
            }
        }
    }
    out.push(']');
}

impl fmt::Display for Tensor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let integer = self.dtype() == DType::U32;
        let values: Vec<f64> = match self.dtype() {
            DType::U32 => match self.to_vec_u32() {
                Ok(v) => v.into_iter().map(f64::from).collect(),
                Err(e) => return write!(f, "tensor(<unreadable: {e}>)"),
            },
            DType::F32 | DType::F16 | DType::BF16 => match self.to_vec() {
                Ok(v) => v.into_iter().map(f64::from).collect(),
                Err(e) => return write!(f, "tensor(<unreadable: {e}>)"),
            },
        };
        let style = style_of(&values);
        let texts: Vec<String> = values.iter().map(|&v| element(v, style, integer)).collect();
        let width = texts.iter().map(|t| t.len()).max().unwrap_or(0);
        let padded: Vec<String> = texts.iter().map(|t| format!("{t:>width$}")).collect();
        let mut body = String::new();
        if self.numel() == 0 && !self.shape().is_empty() {
            body.push_str("[]");
        } else {
            let elide = self.numel() > THRESHOLD;
            // The first bracket's column.
            write_dims(&mut body, &padded, self.shape(), elide, "tensor(".len());
        }
        let mut extras = Vec::new();
        if self.numel() == 0 && self.rank() > 1 {
            extras.push(format!("size={:?}", self.shape()));
        }
        // The dtype where it is not the default, as torch prints it.
        match self.dtype() {
            DType::F32 => {}
            DType::U32 => extras.push("dtype=torch.uint32".to_string()),
            DType::F16 => extras.push("dtype=torch.float16".to_string()),
            DType::BF16 => extras.push("dtype=torch.bfloat16".to_string()),
        }
        if self.requires_grad() {
            extras.push("requires_grad=True".to_string());
        }
        match extras.is_empty() {
            true => write!(f, "tensor({body})"),
            false => write!(f, "tensor({body}, {})", extras.join(", ")),
        }
    }
}
