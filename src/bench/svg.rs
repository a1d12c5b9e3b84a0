//! Pictures of a run: per scenario, the lateness CDF on a log scale (with `raw`'s on
//! the same axes) and closes per second over time.

use std::path::{Path, PathBuf};

use anyhow::Context;
use plotters::prelude::*;

use super::report::{Report, ScenarioReport};

/// Writes `<scenario>-lateness.svg` and `<scenario>-closes.svg` into `dir` (created if
/// needed) for every scenario that has them; returns the files written.
pub fn write(report: &Report, dir: &Path) -> anyhow::Result<Vec<PathBuf>> {
    std::fs::create_dir_all(dir)
        .with_context(|| format!("cannot create --svg {}", dir.display()))?;
    let raw = report.scenarios.iter().find(|s| s.scenario == "raw");
    let mut written = Vec::new();
    for s in &report.scenarios {
        if !s.samples.is_empty() {
            let path = dir.join(format!("{}-lateness.svg", s.scenario));
            lateness(&path, s, raw.filter(|r| r.scenario != s.scenario))?;
            written.push(path);
        }
        if !s.closes_per_s.is_empty() {
            let path = dir.join(format!("{}-closes.svg", s.scenario));
            closes(&path, s)?;
            written.push(path);
        }
    }
    Ok(written)
}

/// The empirical CDF, at most about 1,000 points (every k-th sample and the last), so
/// a picture of 100,000 closes stays small.
fn cdf(samples: &[f64]) -> Vec<(f64, f64)> {
    let mut v: Vec<f64> = samples.iter().map(|x| x.max(0.1)).collect();
    v.sort_by(|a, b| a.total_cmp(b));
    let n = v.len();
    let step = n.div_ceil(1_000).max(1);
    v.iter()
        .enumerate()
        .filter(|(i, _)| i % step == 0 || *i + 1 == n)
        .map(|(i, x)| (*x, (i + 1) as f64 / n as f64))
        .collect()
}

fn lateness(path: &Path, s: &ScenarioReport, raw: Option<&ScenarioReport>) -> anyhow::Result<()> {
    let root = SVGBackend::new(path, (800, 500)).into_drawing_area();
    root.fill(&WHITE).map_err(plot_error)?;
    let mut max = s.samples.iter().copied().fold(1.0_f64, f64::max);
    if let Some(r) = raw {
        max = r.samples.iter().copied().fold(max, f64::max);
    }
    let mut chart = ChartBuilder::on(&root)
        .caption(format!("{}: lateness CDF", s.scenario), ("sans-serif", 20))
        .margin(10)
        .x_label_area_size(40)
        .y_label_area_size(50)
        .build_cartesian_2d((0.1_f64..max * 1.2).log_scale(), 0.0_f64..1.0)
        .map_err(plot_error)?;
    chart
        .configure_mesh()
        .x_desc("lateness (ms, log scale)")
        .y_desc("fraction closed")
        .draw()
        .map_err(plot_error)?;
    chart
        .draw_series(LineSeries::new(cdf(&s.samples), &BLUE))
        .map_err(plot_error)?
        .label(s.scenario.clone())
        .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], BLUE));
    if let Some(r) = raw {
        chart
            .draw_series(LineSeries::new(cdf(&r.samples), &RED))
            .map_err(plot_error)?
            .label("raw broker")
            .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], RED));
    }
    chart
        .configure_series_labels()
        .background_style(WHITE)
        .border_style(BLACK)
        .draw()
        .map_err(plot_error)?;
    root.present().map_err(plot_error)?;
    Ok(())
}

fn closes(path: &Path, s: &ScenarioReport) -> anyhow::Result<()> {
    let root = SVGBackend::new(path, (800, 400)).into_drawing_area();
    root.fill(&WHITE).map_err(plot_error)?;
    let top = s.closes_per_s.iter().copied().fold(1.0_f64, f64::max) * 1.1;
    let end = s.closes_per_s.len() as f64 / 10.0;
    let mut chart = ChartBuilder::on(&root)
        .caption(
            format!("{}: closes per second", s.scenario),
            ("sans-serif", 20),
        )
        .margin(10)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(0.0_f64..end.max(0.1), 0.0_f64..top)
        .map_err(plot_error)?;
    chart
        .configure_mesh()
        .x_desc("seconds from the first close")
        .y_desc("closes/s (100 ms buckets)")
        .draw()
        .map_err(plot_error)?;
    let points = s
        .closes_per_s
        .iter()
        .enumerate()
        .map(|(i, v)| (i as f64 / 10.0, *v));
    chart
        .draw_series(LineSeries::new(points, &BLUE))
        .map_err(plot_error)?;
    root.present().map_err(plot_error)?;
    Ok(())
}

fn plot_error<E: std::fmt::Debug>(e: E) -> anyhow::Error {
    anyhow::anyhow!("cannot draw the picture: {e:?}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cdf_is_thinned_and_ends_at_one() {
        let samples: Vec<f64> = (0..100_000).map(f64::from).collect();
        let points = cdf(&samples);
        assert!(points.len() <= 1_001, "{}", points.len());
        assert_eq!(points.last(), Some(&(99_999.0, 1.0)));
        assert!(
            points
                .windows(2)
                .all(|w| w[0].0 <= w[1].0 && w[0].1 < w[1].1)
        );
        assert_eq!(cdf(&[0.0]), vec![(0.1, 1.0)]);
    }
}
