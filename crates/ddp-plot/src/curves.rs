//! `loss_curves`: validation loss (solid, marked) and training loss (thin) versus step of
//! language-model runs, every run overlaid in its own colour: `train-gpt --metrics` and
//! `bench/peers/torch_gpt.py --metrics` lines (`step`, `val_loss`, `train_loss`). The same
//! against wall-clock time (`loss_vs_time`, from `elapsed_s`) and against the bytes each run
//! sent (`loss_vs_bytes`, from `comm_bytes`, a log axis when the runs span decades: DDP against
//! DiLoCo).

use crate::charts::{caption, color, drawn, legend, line_mark, DynResult, FONT, MAX_MARKED};
use crate::input::{EvalPoint, Evals};
use crate::scale::{series, Axis, Series};
use plotters::coord::Shift;
use plotters::prelude::*;

/// Bytes spanning more than this many decades get a log axis: DDP's against DiLoCo's differ by
/// the synchronization interval (50 to 500x), and a linear axis crushes DiLoCo's curves into its
/// first pixels.
const BYTES_LOG_DECADES: f64 = 2.0;

/// What the curves are drawn along.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Along {
    Step,
    Time,
    Bytes,
}

impl Along {
    fn x(self, p: &EvalPoint) -> Option<f64> {
        match self {
            Along::Step => Some(p.step),
            Along::Time => p.elapsed_s,
            Along::Bytes => p.comm_bytes,
        }
    }

    fn desc(self) -> &'static str {
        match self {
            Along::Step => "step (optimizer steps)",
            Along::Time => "wall-clock time (s)",
            Along::Bytes => "bytes sent per rank",
        }
    }

    /// Whether every point of `run` has this axis's value.
    pub fn has(self, run: &Evals) -> bool {
        !run.points.is_empty() && run.points.iter().all(|p| self.x(p).is_some())
    }
}

/// Validation and training loss versus step, one colour per run.
pub fn loss_curves<DB: DrawingBackend>(
    root: &DrawingArea<DB, Shift>,
    runs: &[Evals],
) -> DynResult<()>
where
    DB::ErrorType: 'static,
{
    loss_along(root, runs, Along::Step)
}

/// Validation and training loss versus wall-clock time.
pub fn loss_vs_time<DB: DrawingBackend>(
    root: &DrawingArea<DB, Shift>,
    runs: &[Evals],
) -> DynResult<()>
where
    DB::ErrorType: 'static,
{
    loss_along(root, runs, Along::Time)
}

/// Validation and training loss versus the bytes each run sent.
pub fn loss_vs_bytes<DB: DrawingBackend>(
    root: &DrawingArea<DB, Shift>,
    runs: &[Evals],
) -> DynResult<()>
where
    DB::ErrorType: 'static,
{
    loss_along(root, runs, Along::Bytes)
}

fn loss_along<DB: DrawingBackend>(
    root: &DrawingArea<DB, Shift>,
    runs: &[Evals],
    along: Along,
) -> DynResult<()>
where
    DB::ErrorType: 'static,
{
    // Against bytes, an evaluation before a run sent anything (DiLoCo before its first
    // synchronization) has no place on a log axis: left out.
    let placed = |x: f64| along != Along::Bytes || x > 0.0;
    let pick = |get: fn(&EvalPoint) -> Option<f64>| -> Vec<Series> {
        runs.iter()
            .map(|r| {
                series(r.points.iter().filter_map(|p| {
                    let x = along.x(p).filter(|&x| placed(x))?;
                    Some((x, get(p)?))
                }))
            })
            .collect()
    };
    let (val, train) = (pick(|p| p.val_loss), pick(|p| p.train_loss));
    let all: Vec<(f64, f64)> = val
        .iter()
        .chain(&train)
        .flat_map(|s| s.points.iter().copied())
        .collect();
    let x = Axis::fit(
        all.iter().map(|p| p.0),
        (0.0, 1.0),
        0.0,
        (along == Along::Bytes).then_some(BYTES_LOG_DECADES),
    );
    let y = Axis::fit_span(all.iter().map(|p| p.1), 0.05);
    let skipped = val.iter().chain(&train).map(|s| s.skipped).sum();
    let title = "Validation loss (solid) and training loss (thin)";
    let mut chart = ChartBuilder::on(root)
        .caption(caption(title, skipped), (FONT, 24))
        .margin(15)
        .x_label_area_size(50)
        .y_label_area_size(70)
        .build_cartesian_2d(x.range(), y.range())?;
    chart
        .configure_mesh()
        .x_desc(along.desc())
        .x_label_formatter(&|v| x.label(v))
        .y_desc(y.desc("loss (cross-entropy per token)"))
        .y_labels(y.labels())
        .y_label_formatter(&|v| y.label(v))
        .label_style((FONT, 15))
        .axis_desc_style((FONT, 17))
        .draw()?;
    for (i, run) in runs.iter().enumerate() {
        let c = color(i);
        if !train[i].points.is_empty() {
            let thin = c.mix(0.45).stroke_width(1);
            chart.draw_series(LineSeries::new(drawn(&train[i].points, &x, &y), thin))?;
        }
        let marks = if val[i].points.len() <= MAX_MARKED {
            3
        } else {
            0
        };
        chart
            .draw_series(
                LineSeries::new(drawn(&val[i].points, &x, &y), c.stroke_width(2)).point_size(marks),
            )?
            .label(format!("{}: validation", run.label))
            .legend(line_mark(c));
    }
    legend(&mut chart, SeriesLabelPosition::UpperRight)
}
