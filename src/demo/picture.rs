//! The demo's picture, an SVG file: on the left the distribution of close lateness
//! (a histogram, milliseconds), on the right deadlines falling due and closes per
//! time slice over the run (two lines that lie on top of each other when lapse keeps
//! its promise). The SVG backend writes text as `<text>` elements, so no font files
//! or system libraries are needed.

use std::path::Path;

use plotters::prelude::*;

use super::report::Closes;

const BARS: usize = 40;
const SLICES: usize = 60;

/// Writes the picture to `path`.
/// Fails, naming `--svg`, when the picture could not be written to `path`: checked
/// before the run, so that a typo costs seconds, not the whole demo. A file that did
/// not exist is removed again.
pub fn check_writable(path: &Path) -> Result<(), crate::config::ConfigError> {
    let existed = path.exists();
    let problem = |e: std::io::Error| crate::config::ConfigError {
        key: "--svg".into(),
        problem: format!("cannot write the picture to {}: {e}", path.display()),
    };
    if path.is_dir() {
        return Err(problem(std::io::Error::other("it is a directory")));
    }
    std::fs::OpenOptions::new()
        .append(true)
        .create(true)
        .open(path)
        .map_err(problem)?;
    if !existed {
        let _ = std::fs::remove_file(path);
    }
    Ok(())
}

pub fn draw(path: &Path, closes: &Closes, title: &str) -> anyhow::Result<()> {
    let root = SVGBackend::new(path, (1280, 520)).into_drawing_area();
    root.fill(&WHITE).map_err(to_anyhow)?;
    let root = root.titled(title, ("sans-serif", 22)).map_err(to_anyhow)?;
    let (left, right) = root.split_horizontally(640);
    lateness(&left, &closes.lateness_ms)?;
    over_time(&right, closes)?;
    root.present().map_err(to_anyhow)?;
    Ok(())
}

/// The histogram's range ends a little past the 99th percentile, so one outlier does
/// not squash the rest; later closes are counted in the last bar.
fn lateness<DB: DrawingBackend>(
    area: &DrawingArea<DB, plotters::coord::Shift>,
    sorted: &[f64],
) -> anyhow::Result<()>
where
    DB::ErrorType: 'static,
{
    let p99 = sorted
        .get((sorted.len() * 99 / 100).min(sorted.len().saturating_sub(1)))
        .copied()
        .unwrap_or(1.0);
    let end = (p99 * 1.25).max(1.0);
    let width = end / BARS as f64;
    let mut counts = [0u32; BARS];
    for v in sorted {
        counts[((v / width) as usize).min(BARS - 1)] += 1;
    }
    let beyond = sorted.iter().filter(|v| **v >= end).count();
    let top = counts.iter().copied().max().unwrap_or(0).max(1);
    let caption = if beyond > 0 {
        format!("Close lateness, ms ({beyond} at or beyond {end:.0} ms in the last bar)")
    } else {
        "Close lateness, ms (close time minus deadline)".to_string()
    };
    let mut chart = frame(area, caption, end, top, ("lateness (ms)", "orders closed"))?;
    chart
        .draw_series(counts.iter().enumerate().map(|(i, n)| {
            let x0 = i as f64 * width;
            Rectangle::new([(x0, 0), (x0 + width, *n)], BLUE.mix(0.6).filled())
        }))
        .map_err(to_anyhow)?
        .label("closes per lateness bucket")
        .legend(|(x, y)| Rectangle::new([(x, y - 5), (x + 12, y + 5)], BLUE.mix(0.6).filled()));
    legend(&mut chart)
}

fn over_time<DB: DrawingBackend>(
    area: &DrawingArea<DB, plotters::coord::Shift>,
    closes: &Closes,
) -> anyhow::Result<()>
where
    DB::ErrorType: 'static,
{
    let span = closes
        .closed_s
        .iter()
        .chain(&closes.due_s)
        .copied()
        .fold(1.0f64, f64::max);
    let slice = span / SLICES as f64;
    let per_slice = |times: &[f64]| {
        let mut counts = vec![0u32; SLICES + 1];
        for t in times {
            counts[((t.max(0.0) / slice) as usize).min(SLICES)] += 1;
        }
        counts
    };
    let due = per_slice(&closes.due_s);
    let closed = per_slice(&closes.closed_s);
    let top = due.iter().chain(&closed).copied().max().unwrap_or(0).max(1);
    let mut chart = frame(
        area,
        format!("Deadlines falling due and closes, per {slice:.2} s"),
        span + slice,
        top,
        ("seconds since the start", "orders"),
    )?;
    let points = |counts: Vec<u32>| {
        counts
            .into_iter()
            .enumerate()
            .map(move |(i, n)| ((i as f64 + 0.5) * slice, n))
    };
    chart
        .draw_series(LineSeries::new(points(due), RED.stroke_width(2)))
        .map_err(to_anyhow)?
        .label("deadlines falling due")
        .legend(|(x, y)| PathElement::new([(x, y), (x + 16, y)], RED.stroke_width(2)));
    chart
        .draw_series(LineSeries::new(points(closed), BLUE.stroke_width(2)))
        .map_err(to_anyhow)?
        .label("closes")
        .legend(|(x, y)| PathElement::new([(x, y), (x + 16, y)], BLUE.stroke_width(2)));
    legend(&mut chart)
}

type Chart<'a, DB> = ChartContext<
    'a,
    DB,
    Cartesian2d<plotters::coord::types::RangedCoordf64, plotters::coord::types::RangedCoordu32>,
>;

/// The frame both charts share: caption, margins, x from 0 to `x_end`, y from 0 to
/// `top` with a tenth of headroom, and the axis descriptions.
fn frame<'a, DB: DrawingBackend>(
    area: &'a DrawingArea<DB, plotters::coord::Shift>,
    caption: String,
    x_end: f64,
    top: u32,
    (x_desc, y_desc): (&str, &str),
) -> anyhow::Result<Chart<'a, DB>>
where
    DB::ErrorType: 'static,
{
    let mut chart = ChartBuilder::on(area)
        .caption(caption, ("sans-serif", 16))
        .margin(15)
        .x_label_area_size(40)
        .y_label_area_size(55)
        .build_cartesian_2d(0f64..x_end, 0u32..top + top / 10 + 1)
        .map_err(to_anyhow)?;
    chart
        .configure_mesh()
        .x_desc(x_desc)
        .y_desc(y_desc)
        .draw()
        .map_err(to_anyhow)?;
    Ok(chart)
}

/// The legend of a chart's series, in the one style of both charts.
fn legend<'a, DB: DrawingBackend + 'a>(chart: &mut Chart<'a, DB>) -> anyhow::Result<()>
where
    DB::ErrorType: 'static,
{
    chart
        .configure_series_labels()
        .border_style(BLACK)
        .background_style(WHITE.mix(0.8))
        .draw()
        .map_err(to_anyhow)?;
    Ok(())
}

fn to_anyhow<E: std::error::Error + Send + Sync + 'static>(
    e: plotters::drawing::DrawingAreaErrorKind<E>,
) -> anyhow::Error {
    anyhow::anyhow!("cannot draw the picture: {e}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn draws_both_series_into_a_well_formed_svg() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("demo.svg");
        let closes = Closes {
            due_s: vec![1.0, 1.5, 2.0, 3.0],
            closed_s: vec![1.01, 1.52, 2.005, 3.2],
            lateness_ms: vec![5.0, 10.0, 20.0, 200.0],
        };
        draw(&path, &closes, "test").unwrap();
        let svg = std::fs::read_to_string(&path).unwrap();
        assert!(svg.trim_start().starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
        assert!(svg.matches("<polyline").count() >= 2, "{svg}");
        assert!(svg.contains("<rect"));
        assert!(svg.contains("Close lateness"));
    }
}
