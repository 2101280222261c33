//! Reading the inputs: JSON lines from `train-digits --metrics` (`kind: step` lines and the
//! bottleneck report, `kind: report`, also `report.json`/`--report` files) and from
//! `ddp-bench <collective> --json` or the peers' sweeps (`bytes`, `busbw_gbs`). Every other line
//! (headers, text) is skipped.

use serde_json::Value;
use std::path::Path;

/// One logged step of a metrics file.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepPoint {
    pub step: f64,
    pub loss: Option<f64>,
    pub accuracy: Option<f64>,
    pub samples_per_s: Option<f64>,
    pub comm_wait_ms: Option<f64>,
}

/// A run's metrics, labelled by its file.
#[derive(Debug, Clone, PartialEq)]
pub struct Metrics {
    pub label: String,
    pub points: Vec<StepPoint>,
}

/// One rank's mean step (ms), as the bottleneck report splits it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RankSplit {
    pub rank: usize,
    pub compute: f64,
    pub data: f64,
    pub optimizer: f64,
    pub exposed_comm: f64,
    pub waiting: f64,
}

/// A bottleneck report.
#[derive(Debug, Clone, PartialEq)]
pub struct Report {
    pub label: String,
    pub ranks: Vec<RankSplit>,
    /// The straggler, when significant: rank and percent slower.
    pub straggler: Option<(usize, f64)>,
    pub hidden_comm_share: f64,
}

/// A collective sweep: (bytes, busbw GB/s) per size.
#[derive(Debug, Clone, PartialEq)]
pub struct Sweep {
    pub label: String,
    pub points: Vec<(f64, f64)>,
}

/// Everything read from the inputs.
#[derive(Debug, Default)]
pub struct Inputs {
    pub metrics: Vec<Metrics>,
    pub reports: Vec<Report>,
    pub sweeps: Vec<Sweep>,
}

fn f(v: &Value, k: &str) -> Option<f64> {
    v.get(k).and_then(Value::as_f64)
}

fn report(label: &str, v: &Value) -> Option<Report> {
    let ranks = v
        .get("ranks")?
        .as_array()?
        .iter()
        .map(|r| {
            Some(RankSplit {
                rank: r.get("rank")?.as_u64()? as usize,
                compute: f(r, "compute_ms")?,
                data: f(r, "data_ms")?,
                optimizer: f(r, "optimizer_ms")?,
                exposed_comm: f(r, "exposed_comm_ms")?,
                waiting: f(r, "waiting_ms")?,
            })
        })
        .collect::<Option<Vec<_>>>()?;
    let s = &v["straggler"];
    let straggler = (s["significant"] == true)
        .then(|| Some((s["rank"].as_u64()? as usize, f(s, "slower_by_pct")?)))
        .flatten();
    Some(Report {
        label: label.to_string(),
        ranks,
        straggler,
        hidden_comm_share: f(v, "hidden_comm_share").unwrap_or(0.0),
    })
}

/// Reads `path`'s JSON lines into `into`; an error when nothing in it is usable.
pub fn read(path: &Path, into: &mut Inputs) -> Result<(), String> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    let label = path
        .file_stem()
        .map_or_else(|| "input".into(), |s| s.to_string_lossy().into_owned());
    let mut metrics = Metrics {
        label: label.clone(),
        points: Vec::new(),
    };
    let mut sweep = Sweep {
        label: label.clone(),
        points: Vec::new(),
    };
    let mut used = 0;
    for line in text.lines().map(str::trim).filter(|l| l.starts_with('{')) {
        let Ok(v) = serde_json::from_str::<Value>(line) else {
            continue;
        };
        if v["kind"] == "step" {
            if let Some(step) = f(&v, "step") {
                metrics.points.push(StepPoint {
                    step,
                    loss: f(&v, "loss"),
                    accuracy: f(&v, "accuracy"),
                    samples_per_s: f(&v, "samples_per_s"),
                    comm_wait_ms: f(&v, "comm_wait_ms"),
                });
                used += 1;
            }
        } else if let Some(r) = report(&label, &v) {
            into.reports.push(r);
            used += 1;
        } else if let (Some(b), Some(bw)) = (f(&v, "bytes"), f(&v, "busbw_gbs")) {
            sweep.points.push((b, bw));
            used += 1;
        }
    }
    if used == 0 {
        return Err(format!(
            "{}: no metrics lines (train-digits --metrics), bottleneck report or collective \
             sweep rows (ddp-bench ... --json) in it",
            path.display()
        ));
    }
    if !metrics.points.is_empty() {
        into.metrics.push(metrics);
    }
    if !sweep.points.is_empty() {
        sweep.points.sort_by(|a, b| a.0.total_cmp(&b.0));
        into.sweeps.push(sweep);
    }
    Ok(())
}
