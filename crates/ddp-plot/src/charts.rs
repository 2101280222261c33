//! The four pictures, each drawn once against any plotters backend (SVG and PNG):
//! loss and accuracy versus step, throughput and communication wait versus step, the per-rank
//! stacked split of the mean step, and busbw versus message size.

use crate::input::{Metrics, Report, Sweep};
use plotters::coord::Shift;
use plotters::prelude::*;
use std::error::Error;

pub type DynResult<T> = Result<T, Box<dyn Error>>;

const FONT: &str = "sans-serif";

fn color(i: usize) -> RGBColor {
    const C: [RGBColor; 8] = [
        RGBColor(31, 119, 180),
        RGBColor(255, 127, 14),
        RGBColor(44, 160, 44),
        RGBColor(214, 39, 40),
        RGBColor(148, 103, 189),
        RGBColor(140, 86, 75),
        RGBColor(227, 119, 194),
        RGBColor(127, 127, 127),
    ];
    C[i % C.len()]
}

fn max_of(v: impl Iterator<Item = f64>) -> f64 {
    v.filter(|x| x.is_finite()).fold(0.0, f64::max)
}

/// "run " before a series name when several runs share a chart.
fn prefix(runs: usize, label: &str) -> String {
    if runs > 1 {
        format!("{label}: ")
    } else {
        String::new()
    }
}

/// Training loss (left axis) and held-out accuracy (right axis) versus step.
pub fn loss_accuracy<DB: DrawingBackend>(
    root: &DrawingArea<DB, Shift>,
    runs: &[Metrics],
) -> DynResult<()>
where
    DB::ErrorType: 'static,
{
    let pts = || runs.iter().flat_map(|r| r.points.iter());
    let max_step = max_of(pts().map(|p| p.step)).max(1.0);
    let max_loss = max_of(pts().filter_map(|p| p.loss)).max(1e-3) * 1.1;
    let mut chart = ChartBuilder::on(root)
        .caption("Training loss and held-out accuracy", (FONT, 24))
        .margin(15)
        .x_label_area_size(50)
        .y_label_area_size(70)
        .right_y_label_area_size(70)
        .build_cartesian_2d(0f64..max_step, 0f64..max_loss)?
        .set_secondary_coord(0f64..max_step, 0f64..1.0);
    chart
        .configure_mesh()
        .x_desc("step (optimizer steps)")
        .x_label_formatter(&|v| format!("{v:.0}"))
        .y_desc("training loss (cross-entropy, rank 0)")
        .label_style((FONT, 15))
        .axis_desc_style((FONT, 17))
        .draw()?;
    chart
        .configure_secondary_axes()
        .y_desc("held-out accuracy (fraction correct)")
        .label_style((FONT, 15))
        .axis_desc_style((FONT, 17))
        .draw()?;
    for (i, run) in runs.iter().enumerate() {
        let p = prefix(runs.len(), &run.label);
        let (lc, ac) = (color(2 * i), color(2 * i + 1));
        let loss: Vec<(f64, f64)> = run
            .points
            .iter()
            .filter_map(|q| Some((q.step, q.loss?)))
            .collect();
        chart
            .draw_series(LineSeries::new(loss, lc.stroke_width(2)))?
            .label(format!("{p}training loss (left axis)"))
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], lc.stroke_width(2)));
        let acc: Vec<(f64, f64)> = run
            .points
            .iter()
            .filter_map(|q| Some((q.step, q.accuracy?)))
            .collect();
        if !acc.is_empty() {
            chart
                .draw_secondary_series(LineSeries::new(acc, ac.stroke_width(2)).point_size(4))?
                .label(format!("{p}held-out accuracy (right axis)"))
                .legend(move |(x, y)| Circle::new((x + 10, y), 4, ac.filled()));
        }
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .label_font((FONT, 15))
        .position(SeriesLabelPosition::MiddleRight)
        .draw()?;
    Ok(())
}

/// Throughput (left axis) and rank 0's communication wait (right axis) versus step.
pub fn throughput<DB: DrawingBackend>(
    root: &DrawingArea<DB, Shift>,
    runs: &[Metrics],
) -> DynResult<()>
where
    DB::ErrorType: 'static,
{
    let pts = || runs.iter().flat_map(|r| r.points.iter());
    let max_step = max_of(pts().map(|p| p.step)).max(1.0);
    let max_sps = max_of(pts().filter_map(|p| p.samples_per_s)).max(1.0) * 1.15;
    let max_wait = max_of(pts().filter_map(|p| p.comm_wait_ms)).max(0.01) * 1.15;
    let mut chart = ChartBuilder::on(root)
        .caption("Throughput and communication wait", (FONT, 24))
        .margin(15)
        .x_label_area_size(50)
        .y_label_area_size(80)
        .right_y_label_area_size(70)
        .build_cartesian_2d(0f64..max_step, 0f64..max_sps)?
        .set_secondary_coord(0f64..max_step, 0f64..max_wait);
    chart
        .configure_mesh()
        .x_desc("step (optimizer steps)")
        .x_label_formatter(&|v| format!("{v:.0}"))
        .y_desc("throughput (samples/s, all ranks)")
        .y_label_formatter(&|v| format!("{v:.0}"))
        .label_style((FONT, 15))
        .axis_desc_style((FONT, 17))
        .draw()?;
    chart
        .configure_secondary_axes()
        .y_desc("communication wait (ms/step, rank 0)")
        .label_style((FONT, 15))
        .axis_desc_style((FONT, 17))
        .draw()?;
    for (i, run) in runs.iter().enumerate() {
        let p = prefix(runs.len(), &run.label);
        let (tc, wc) = (color(2 * i), color(2 * i + 1));
        let sps: Vec<(f64, f64)> = run
            .points
            .iter()
            .filter_map(|q| Some((q.step, q.samples_per_s?)))
            .collect();
        chart
            .draw_series(LineSeries::new(sps, tc.stroke_width(2)).point_size(3))?
            .label(format!("{p}samples/s (left axis)"))
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], tc.stroke_width(2)));
        let wait: Vec<(f64, f64)> = run
            .points
            .iter()
            .filter_map(|q| Some((q.step, q.comm_wait_ms?)))
            .collect();
        chart
            .draw_secondary_series(LineSeries::new(wait, wc.stroke_width(2)))?
            .label(format!("{p}comm wait, ms/step (right axis)"))
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], wc.stroke_width(2)));
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .label_font((FONT, 15))
        .position(SeriesLabelPosition::LowerRight)
        .draw()?;
    Ok(())
}

/// A layer of the stacked bars: its name, colour and value.
type Layer = (&'static str, RGBColor, fn(&crate::input::RankSplit) -> f64);

/// The mean step of every rank, stacked: compute, data loading, optimizer, exposed
/// communication, waiting for the slowest rank.
pub fn step_breakdown<DB: DrawingBackend>(
    root: &DrawingArea<DB, Shift>,
    report: &Report,
) -> DynResult<()>
where
    DB::ErrorType: 'static,
{
    let n = report.ranks.len() as u32;
    let layers: [Layer; 5] = [
        (
            "compute (forward + backward)",
            RGBColor(31, 119, 180),
            |r| r.compute,
        ),
        ("data loading", RGBColor(255, 187, 0), |r| r.data),
        ("optimizer", RGBColor(44, 160, 44), |r| r.optimizer),
        ("exposed communication", RGBColor(214, 39, 40), |r| {
            r.exposed_comm
        }),
        (
            "waiting for the slowest rank",
            RGBColor(170, 170, 170),
            |r| r.waiting,
        ),
    ];
    let total = |r: &crate::input::RankSplit| layers.iter().map(|l| (l.2)(r)).sum::<f64>();
    let top = max_of(report.ranks.iter().map(total)).max(1e-3) * 1.45;
    let caption = match report.straggler {
        Some((rank, pct)) => {
            format!("Mean step per rank: rank {rank} is the straggler (+{pct:.0}%)")
        }
        None => "Mean step per rank: no straggler".to_string(),
    };
    let mut chart = ChartBuilder::on(root)
        .caption(caption, (FONT, 24))
        .margin(15)
        .x_label_area_size(50)
        .y_label_area_size(70)
        // A discrete range is inclusive: 0..n-1 holds n segments.
        .build_cartesian_2d((0..n.saturating_sub(1)).into_segmented(), 0f64..top)?;
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_desc(format!(
            "rank ({:.0}% of communication hidden under backward)",
            100.0 * report.hidden_comm_share
        ))
        .y_desc("time per step (ms)")
        .x_label_formatter(&|v| match v {
            SegmentValue::CenterOf(r) => format!("rank {r}"),
            _ => String::new(),
        })
        .label_style((FONT, 15))
        .axis_desc_style((FONT, 17))
        .draw()?;
    let mut base = vec![0f64; n as usize];
    for (name, c, get) in layers {
        let below = base.clone();
        let tops: Vec<(u32, f64)> = report
            .ranks
            .iter()
            .enumerate()
            .map(|(i, r)| (i as u32, below[i] + get(r)))
            .collect();
        for (i, r) in report.ranks.iter().enumerate() {
            base[i] += get(r);
        }
        chart
            .draw_series(
                Histogram::vertical(&chart)
                    .style(c.filled())
                    .margin(30)
                    .baseline_func(move |x: &SegmentValue<u32>| match x {
                        SegmentValue::Exact(i) | SegmentValue::CenterOf(i) => {
                            below.get(*i as usize).copied().unwrap_or(0.0)
                        }
                        SegmentValue::Last => 0.0,
                    })
                    .data(tops),
            )?
            .label(name)
            .legend(move |(x, y)| Rectangle::new([(x, y - 6), (x + 14, y + 6)], c.filled()));
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .label_font((FONT, 15))
        .position(SeriesLabelPosition::UpperRight)
        .draw()?;
    Ok(())
}

/// `1024` → `1 KiB`.
fn bytes_label(b: f64) -> String {
    let units = ["B", "KiB", "MiB", "GiB"];
    let mut v = b;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < units.len() {
        v /= 1024.0;
        u += 1;
    }
    if (v - v.round()).abs() < 1e-9 {
        format!("{v:.0} {}", units[u])
    } else {
        format!("{v:.1} {}", units[u])
    }
}

/// Bus bandwidth versus message size, every sweep overlaid.
pub fn busbw<DB: DrawingBackend>(root: &DrawingArea<DB, Shift>, sweeps: &[Sweep]) -> DynResult<()>
where
    DB::ErrorType: 'static,
{
    // x is log2(bytes), so that the ticks fall on powers of two.
    let sizes = || sweeps.iter().flat_map(|s| s.points.iter().map(|p| p.0));
    let lo = sizes().filter(|b| *b > 0.0).fold(f64::INFINITY, f64::min);
    let lo = if lo.is_finite() {
        lo.log2().floor()
    } else {
        0.0
    };
    let hi = max_of(sizes()).log2().ceil().max(lo + 1.0);
    let top = max_of(sweeps.iter().flat_map(|s| s.points.iter().map(|p| p.1))).max(1e-3) * 1.15;
    let mut chart = ChartBuilder::on(root)
        .caption("all_reduce bus bandwidth by message size", (FONT, 24))
        .margin(15)
        .margin_right(40)
        .x_label_area_size(50)
        .y_label_area_size(70)
        .build_cartesian_2d(lo..hi, 0f64..top)?;
    chart
        .configure_mesh()
        .x_desc("message size (bytes per rank, log scale)")
        .y_desc("bus bandwidth (GB/s)")
        .x_labels(((hi - lo) / 2.0) as usize + 1)
        .x_label_formatter(&|x| bytes_label(x.exp2()))
        .label_style((FONT, 15))
        .axis_desc_style((FONT, 17))
        .draw()?;
    for (i, s) in sweeps.iter().enumerate() {
        let c = color(i);
        let pts: Vec<(f64, f64)> = s
            .points
            .iter()
            .filter(|p| p.0 > 0.0)
            .map(|p| (p.0.log2(), p.1))
            .collect();
        chart
            .draw_series(LineSeries::new(pts, c.stroke_width(2)).point_size(4))?
            .label(s.label.clone())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], c.stroke_width(2)));
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .label_font((FONT, 15))
        .position(SeriesLabelPosition::UpperLeft)
        .draw()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    #[test]
    fn byte_labels() {
        assert_eq!(super::bytes_label(1024.0), "1 KiB");
        assert_eq!(super::bytes_label(64.0 * 1024.0 * 1024.0), "64 MiB");
        assert_eq!(super::bytes_label(1536.0), "1.5 KiB");
        assert_eq!(super::bytes_label(512.0), "512 B");
    }
}
