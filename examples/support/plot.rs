//! PNG plots of training curves for the examples (plotters; text where a system font exists).

use std::path::{Path, PathBuf};

/// A `--plot` path, checked when the arguments are read (not after the training it plots):
/// the plots are PNGs.
pub fn png_path(path: &str) -> Result<PathBuf, String> {
    let png = Path::new(path)
        .extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("png"));
    if !png {
        return Err(format!(
            "plots are written as PNG: give a path ending in .png, not {path:?}"
        ));
    }
    Ok(PathBuf::from(path))
}

/// A PNG of two series side by side, each `(title, value per point)`, over `x_label`
/// (points numbered from 1).
pub fn plot(
    path: &Path,
    x_label: &str,
    left: (&str, &[f32]),
    right: (&str, &[f32]),
) -> Result<(), Box<dyn std::error::Error>> {
    use plotters::prelude::*;
    let labelled = register_font();
    let root = BitMapBackend::new(path, (900, 360)).into_drawing_area();
    root.fill(&WHITE)?;
    let (left_area, right_area) = root.split_horizontally(450);
    let series = [(left_area, left, RED), (right_area, right, BLUE)];
    for (area, (title, values), color) in series {
        let top = values.iter().cloned().fold(f32::MIN, f32::max).max(1e-6) * 1.1;
        let mut builder = ChartBuilder::on(&area);
        builder
            .margin(12)
            .x_label_area_size(30)
            .y_label_area_size(45);
        if labelled {
            builder.caption(title, ("sans-serif", 20));
        }
        let points = values.len().max(2) as f32;
        let mut chart = builder.build_cartesian_2d(1f32..points, 0f32..top)?;
        let mut mesh = chart.configure_mesh();
        if labelled {
            mesh.x_desc(x_label);
        } else {
            mesh.disable_x_mesh()
                .disable_y_mesh()
                .x_labels(0)
                .y_labels(0);
        }
        mesh.draw()?;
        chart.draw_series(LineSeries::new(
            values.iter().enumerate().map(|(i, &v)| ((i + 1) as f32, v)),
            color.stroke_width(2),
        ))?;
    }
    root.present()?;
    Ok(())
}

/// Registers a system sans-serif font for plot text; false when none is installed (the plot
/// is then drawn without text).
fn register_font() -> bool {
    let candidates = [
        "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
        "/usr/share/fonts/TTF/DejaVuSans.ttf",
        "/System/Library/Fonts/Supplemental/Arial.ttf",
        "C:\\Windows\\Fonts\\arial.ttf",
    ];
    for path in candidates {
        if let Ok(bytes) = std::fs::read(path) {
            let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
            if plotters::style::register_font(
                "sans-serif",
                plotters::style::FontStyle::Normal,
                bytes,
            )
            .is_ok()
            {
                return true;
            }
        }
    }
    false
}
