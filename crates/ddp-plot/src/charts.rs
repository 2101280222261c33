//! Four of the pictures, each drawn once against any plotters backend (SVG and PNG):
//! loss and accuracy versus step, throughput and communication wait versus step, the per-rank
//! stacked split of the mean step, and busbw versus message size (the fifth, loss curves of
//! language-model runs, is [`crate::curves`]).

use crate::input::{Metrics, Report, StepPoint, Sweep};
use crate::scale::{number_label, series, Axis, Series, LOG_DECADES};
use plotters::chart::DualCoordChartContext;
use plotters::coord::types::RangedCoordf64;
use plotters::coord::{CoordTranslate, Shift};
use plotters::prelude::*;
use std::error::Error;

pub type DynResult<T> = Result<T, Box<dyn Error>>;

pub(crate) const FONT: &str = "sans-serif";

pub(crate) fn color(i: usize) -> RGBColor {
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

/// `caption`, with the number of non-finite points left out when there are any.
pub(crate) fn caption(caption: &str, skipped: usize) -> String {
    match skipped {
        0 => caption.to_string(),
        1 => format!("{caption} (1 non-finite point skipped)"),
        n => format!("{caption} ({n} non-finite points skipped)"),
    }
}

/// Markers are drawn on series this short only (a marker per point of a long run is most of
/// an SVG's size and hides the line).
pub(crate) const MAX_MARKED: usize = 200;

/// One run's two series of a two-axis chart: `(step, left)` and `(step, right)`, finite and
/// decimated.
fn two_series(
    run: &Metrics,
    left: fn(&StepPoint) -> Option<f64>,
    right: fn(&StepPoint) -> Option<f64>,
) -> (Series, Series) {
    let get = |g: fn(&StepPoint) -> Option<f64>| {
        series(run.points.iter().filter_map(move |q| Some((q.step, g(q)?))))
    };
    (get(left), get(right))
}

/// The finite series of every run (left and right), their axes and the skipped count.
struct TwoAxes {
    series: Vec<(Series, Series)>,
    x: Axis,
    left: Axis,
    right: Axis,
    skipped: usize,
}

/// One run's share of a two-axis chart: its legend prefix, its colours (left, right) and its
/// two series.
type RunSeries<'s> = (String, (RGBColor, RGBColor), &'s Series, &'s Series);

impl TwoAxes {
    /// Each run with its legend prefix, colours and series, in order.
    fn per_run<'s>(&'s self, runs: &'s [Metrics]) -> impl Iterator<Item = RunSeries<'s>> + 's {
        let n = runs.len();
        (runs.iter().zip(&self.series).enumerate()).map(move |(i, (run, (l, r)))| {
            (
                prefix(n, &run.label),
                (color(2 * i), color(2 * i + 1)),
                l,
                r,
            )
        })
    }
}

fn two_axes(
    runs: &[Metrics],
    left: fn(&StepPoint) -> Option<f64>,
    right: fn(&StepPoint) -> Option<f64>,
    left_fit: ((f64, f64), f64),
    right_fit: ((f64, f64), f64),
) -> TwoAxes {
    let series: Vec<(Series, Series)> = runs.iter().map(|r| two_series(r, left, right)).collect();
    let all = |side: fn(&(Series, Series)) -> &Series| {
        series
            .iter()
            .flat_map(move |s| side(s).points.iter().copied())
            .collect::<Vec<_>>()
    };
    let (l, r) = (all(|s| &s.0), all(|s| &s.1));
    let x = Axis::fit(l.iter().chain(&r).map(|p| p.0), (0.0, 1.0), 0.0, None);
    let left = Axis::fit(
        l.iter().map(|p| p.1),
        left_fit.0,
        left_fit.1,
        Some(LOG_DECADES),
    );
    let right = Axis::fit(
        r.iter().map(|p| p.1),
        right_fit.0,
        right_fit.1,
        Some(LOG_DECADES),
    );
    let skipped = series.iter().map(|s| s.0.skipped + s.1.skipped).sum();
    TwoAxes {
        series,
        x,
        left,
        right,
        skipped,
    }
}

/// `pts` as drawn on `x` and `y` (points a log axis cannot show left out).
pub(crate) fn drawn(pts: &[(f64, f64)], x: &Axis, y: &Axis) -> Vec<(f64, f64)> {
    pts.iter()
        .map(|&(a, b)| (x.to(a), y.to(b)))
        .filter(|(a, b)| a.is_finite() && b.is_finite())
        .collect()
}

/// A two-axis chart versus step: its title, what its axes show (their words, the values of a
/// step they plot, the fit of each axis: [`Axis::fit`]'s empty range and headroom).
struct TwoAxisSpec {
    title: &'static str,
    /// Room for the left axis' labels (pixels).
    left_width: u32,
    left: &'static str,
    right: &'static str,
    left_value: fn(&StepPoint) -> Option<f64>,
    right_value: fn(&StepPoint) -> Option<f64>,
    left_fit: ((f64, f64), f64),
    right_fit: ((f64, f64), f64),
}

/// A chart of two value axes over one step axis.
type TwoAxisChart<'a, DB> = DualCoordChartContext<
    'a,
    DB,
    Cartesian2d<RangedCoordf64, RangedCoordf64>,
    Cartesian2d<RangedCoordf64, RangedCoordf64>,
>;

/// The series of `runs` for a two-axis chart versus step and its frame (caption, step axis,
/// left and right axes, their labels), ready for the series.
fn two_axis_chart<'a, DB: DrawingBackend>(
    root: &'a DrawingArea<DB, Shift>,
    runs: &[Metrics],
    text: &TwoAxisSpec,
) -> DynResult<(TwoAxisChart<'a, DB>, TwoAxes)>
where
    DB::ErrorType: 'static,
{
    let ax = two_axes(
        runs,
        text.left_value,
        text.right_value,
        text.left_fit,
        text.right_fit,
    );
    let (x, left, right) = (&ax.x, &ax.left, &ax.right);
    let mut chart = ChartBuilder::on(root)
        .caption(caption(text.title, ax.skipped), (FONT, 24))
        .margin(15)
        .x_label_area_size(50)
        .y_label_area_size(text.left_width)
        .right_y_label_area_size(70)
        .build_cartesian_2d(x.range(), left.range())?
        .set_secondary_coord(x.range(), right.range());
    chart
        .configure_mesh()
        .x_desc("step (optimizer steps)")
        .x_label_formatter(&|v| x.label(v))
        .y_desc(left.desc(text.left))
        .y_labels(left.labels())
        .y_label_formatter(&|v| left.label(v))
        .label_style((FONT, 15))
        .axis_desc_style((FONT, 17))
        .draw()?;
    chart
        .configure_secondary_axes()
        .y_desc(right.desc(text.right))
        .y_labels(right.labels())
        .y_label_formatter(&|v| right.label(v))
        .label_style((FONT, 15))
        .axis_desc_style((FONT, 17))
        .draw()?;
    Ok((chart, ax))
}

/// The legend box of a chart, at `position`.
pub(crate) fn legend<'a, DB: DrawingBackend + 'a, CT: CoordTranslate>(
    chart: &mut ChartContext<'a, DB, CT>,
    position: SeriesLabelPosition,
) -> DynResult<()>
where
    DB::ErrorType: 'static,
{
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .label_font((FONT, 15))
        .position(position)
        .draw()?;
    Ok(())
}

/// A line series' mark in the legend, in colour `c`.
pub(crate) fn line_mark(c: RGBColor) -> impl Fn((i32, i32)) -> PathElement<(i32, i32)> {
    move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], c.stroke_width(2))
}

/// The axes of [`loss_accuracy`].
const LOSS_ACCURACY: TwoAxisSpec = TwoAxisSpec {
    title: "Training loss and held-out accuracy",
    left_width: 70,
    left: "training loss (cross-entropy, rank 0)",
    right: "held-out accuracy (fraction correct)",
    left_value: |q| q.loss,
    right_value: |q| q.accuracy,
    left_fit: ((0.0, 1e-3), 0.1),
    right_fit: ((0.0, 1.0), 0.0),
};

/// Training loss (left axis) and held-out accuracy (right axis) versus step.
pub fn loss_accuracy<DB: DrawingBackend>(
    root: &DrawingArea<DB, Shift>,
    runs: &[Metrics],
) -> DynResult<()>
where
    DB::ErrorType: 'static,
{
    let (mut chart, ax) = two_axis_chart(root, runs, &LOSS_ACCURACY)?;
    let (x, left, right) = (&ax.x, &ax.left, &ax.right);
    for (p, (lc, ac), loss, acc) in ax.per_run(runs) {
        chart
            .draw_series(LineSeries::new(
                drawn(&loss.points, x, left),
                lc.stroke_width(2),
            ))?
            .label(format!("{p}training loss (left axis)"))
            .legend(line_mark(lc));
        if !acc.points.is_empty() {
            let marks = if acc.points.len() <= MAX_MARKED { 4 } else { 0 };
            chart
                .draw_secondary_series(
                    LineSeries::new(drawn(&acc.points, x, right), ac.stroke_width(2))
                        .point_size(marks),
                )?
                .label(format!("{p}held-out accuracy (right axis)"))
                .legend(move |(x, y)| Circle::new((x + 10, y), 4, ac.filled()));
        }
    }
    legend(&mut chart, SeriesLabelPosition::MiddleRight)
}

/// The axes of [`throughput`].
const THROUGHPUT: TwoAxisSpec = TwoAxisSpec {
    title: "Throughput and communication wait",
    left_width: 80,
    left: "throughput (samples/s, all ranks)",
    right: "communication wait (ms/step, rank 0)",
    left_value: |q| q.samples_per_s,
    right_value: |q| q.comm_wait_ms,
    left_fit: ((0.0, 1.0), 0.15),
    right_fit: ((0.0, 0.01), 0.15),
};

/// Throughput (left axis) and rank 0's communication wait (right axis) versus step.
pub fn throughput<DB: DrawingBackend>(
    root: &DrawingArea<DB, Shift>,
    runs: &[Metrics],
) -> DynResult<()>
where
    DB::ErrorType: 'static,
{
    let (mut chart, ax) = two_axis_chart(root, runs, &THROUGHPUT)?;
    let (x, left, right) = (&ax.x, &ax.left, &ax.right);
    for (p, (tc, wc), sps, wait) in ax.per_run(runs) {
        let marks = if sps.points.len() <= MAX_MARKED { 3 } else { 0 };
        chart
            .draw_series(
                LineSeries::new(drawn(&sps.points, x, left), tc.stroke_width(2)).point_size(marks),
            )?
            .label(format!("{p}samples/s (left axis)"))
            .legend(line_mark(tc));
        chart
            .draw_secondary_series(LineSeries::new(
                drawn(&wait.points, x, right),
                wc.stroke_width(2),
            ))?
            .label(format!("{p}comm wait, ms/step (right axis)"))
            .legend(line_mark(wc));
    }
    legend(&mut chart, SeriesLabelPosition::LowerRight)
}

/// The job's share of communication hidden under backward as every ddp-rs output prints it
/// (`ddp_core::trace::BottleneckReport::hidden_comm_line`, which defines it: hidden communication
/// time ÷ total communication time, mean over ranks).
pub fn hidden_comm_line(share: f64) -> String {
    format!(
        "communication hidden under backward: {:.0}% (mean over ranks)",
        100.0 * share
    )
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
    // The sum of huge finite values may overflow: the axis then ends at f64::MAX.
    let total =
        |r: &crate::input::RankSplit| layers.iter().map(|l| (l.2)(r)).sum::<f64>().min(f64::MAX);
    let y = Axis::fit(report.ranks.iter().map(total), (0.0, 1e-3), 0.45, None);
    let title = match report.straggler {
        Some((rank, pct)) => format!(
            "Mean step per rank: rank {rank} is the straggler (+{}%)",
            number_label(pct.round())
        ),
        None => "Mean step per rank: no straggler".to_string(),
    };
    let mut chart = ChartBuilder::on(root)
        .caption(caption(&title, report.skipped), (FONT, 24))
        .margin(15)
        .x_label_area_size(50)
        .y_label_area_size(70)
        // A discrete range is inclusive: 0..n-1 holds n segments.
        .build_cartesian_2d((0..n.saturating_sub(1)).into_segmented(), y.range())?;
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_desc(format!(
            "rank — {}",
            hidden_comm_line(report.hidden_comm_share)
        ))
        .y_desc("time per step (ms)")
        .y_label_formatter(&|v| y.label(v))
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
            .map(|(i, r)| (i as u32, below[i] + y.to(get(r))))
            .collect();
        for (i, r) in report.ranks.iter().enumerate() {
            base[i] += y.to(get(r));
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
    legend(&mut chart, SeriesLabelPosition::UpperRight)
}

/// `1024` → `1 KiB`; beyond EiB, `1.2e30 B`.
fn bytes_label(b: f64) -> String {
    let units = ["B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"];
    let mut v = b;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < units.len() {
        v /= 1024.0;
        u += 1;
    }
    if v >= 1024.0 || !v.is_finite() {
        format!("{} B", number_label(b))
    } else if (v - v.round()).abs() < 1e-9 {
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
    // Sizes must be positive for the log axis; non-finite rows are skipped and counted.
    let all: Vec<Series> = sweeps
        .iter()
        .map(|s| {
            series(
                s.points
                    .iter()
                    .copied()
                    .filter(|p| p.0 > 0.0 || p.0.is_nan()),
            )
        })
        .collect();
    let skipped = all.iter().map(|s| s.skipped).sum();
    // x is log2(bytes), so that the ticks fall on powers of two.
    let sizes = || all.iter().flat_map(|s| s.points.iter().map(|p| p.0));
    let lo = sizes().fold(f64::INFINITY, f64::min);
    let lo = if lo.is_finite() {
        lo.log2().floor()
    } else {
        0.0
    };
    let hi = max_of(sizes()).log2().ceil().max(lo + 1.0);
    let y = Axis::fit(
        all.iter().flat_map(|s| s.points.iter().map(|p| p.1)),
        (0.0, 1e-3),
        0.15,
        Some(LOG_DECADES),
    );
    let mut chart = ChartBuilder::on(root)
        .caption(
            caption("all_reduce bus bandwidth by message size", skipped),
            (FONT, 24),
        )
        .margin(15)
        .margin_right(40)
        .x_label_area_size(50)
        .y_label_area_size(70)
        .build_cartesian_2d(lo..hi, y.range())?;
    chart
        .configure_mesh()
        .x_desc("message size (bytes per rank, log scale)")
        .y_desc(y.desc("bus bandwidth (GB/s)"))
        .x_labels((((hi - lo) / 2.0) as usize + 1).min(12))
        .x_label_formatter(&|x| bytes_label(x.exp2()))
        .y_labels(y.labels())
        .y_label_formatter(&|v| y.label(v))
        .label_style((FONT, 15))
        .axis_desc_style((FONT, 17))
        .draw()?;
    for (i, (s, pts)) in sweeps.iter().zip(&all).enumerate() {
        let c = color(i);
        let pts: Vec<(f64, f64)> = pts
            .points
            .iter()
            .map(|p| (p.0.log2(), y.to(p.1)))
            .filter(|p| p.1.is_finite())
            .collect();
        let marks = if pts.len() <= MAX_MARKED { 4 } else { 0 };
        chart
            .draw_series(LineSeries::new(pts, c.stroke_width(2)).point_size(marks))?
            .label(s.label.clone())
            .legend(line_mark(c));
    }
    legend(&mut chart, SeriesLabelPosition::UpperLeft)
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
