//! `loss_curves`: validation loss (solid, marked) and training loss (thin) versus step of
//! language-model runs, every run overlaid in its own colour: `train-gpt --metrics` and
//! `bench/peers/torch_gpt.py --metrics` lines (`step`, `val_loss`, `train_loss`).

use crate::charts::{caption, color, drawn, legend, line_mark, DynResult, FONT, MAX_MARKED};
use crate::input::Evals;
use crate::scale::{series, Axis, Series};
use plotters::coord::Shift;
use plotters::prelude::*;

/// Validation and training loss versus step, one colour per run.
pub fn loss_curves<DB: DrawingBackend>(
    root: &DrawingArea<DB, Shift>,
    runs: &[Evals],
) -> DynResult<()>
where
    DB::ErrorType: 'static,
{
    let pick = |get: fn(&crate::input::EvalPoint) -> Option<f64>| -> Vec<Series> {
        runs.iter()
            .map(|r| series(r.points.iter().filter_map(|p| Some((p.step, get(p)?)))))
            .collect()
    };
    let (val, train) = (pick(|p| p.val_loss), pick(|p| p.train_loss));
    let all: Vec<(f64, f64)> = val
        .iter()
        .chain(&train)
        .flat_map(|s| s.points.iter().copied())
        .collect();
    let x = Axis::fit(all.iter().map(|p| p.0), (0.0, 1.0), 0.0, false);
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
        .x_desc("step (optimizer steps)")
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
