//! Reading the inputs: JSON lines from `train-digits --metrics` (`kind: step` lines and the
//! bottleneck report, `kind: report`, also `report.json`/`--report` files), from `train-gpt
//! --metrics` and the PyTorch GPT peer's (`step` with `val_loss`: evaluations), and from
//! `ddp-bench <collective> --json` or the peers' sweeps (`bytes`, `busbw_gbs`). Every other line
//! (headers, text) is skipped.
//!
//! Non-finite values are kept as such (the charts skip and count them): `null` where a number
//! belongs (serde_json, hence `train-digits --metrics`, writes NaN and ±inf as `null`), the
//! `NaN`/`Infinity`/`-Infinity` tokens of Python's `json.dumps`, and numbers too large for an
//! f64 (`1e999`).

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

/// One evaluation of a language-model run (`train-gpt --metrics`, the PyTorch peer's).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct EvalPoint {
    pub step: f64,
    pub val_loss: Option<f64>,
    pub train_loss: Option<f64>,
    /// Seconds since the run started (`elapsed_s`), when the line has it.
    pub elapsed_s: Option<f64>,
    /// Payload bytes sent so far (`comm_bytes`, `train-gpt`'s), when the line has it.
    pub comm_bytes: Option<f64>,
}

/// A language-model run's evaluations, labelled by its file.
#[derive(Debug, Clone, PartialEq)]
pub struct Evals {
    pub label: String,
    pub points: Vec<EvalPoint>,
}

impl Evals {
    /// The non-finite values of every field.
    pub fn nonfinite(&self) -> NonFinite {
        let bad = |v: Option<f64>| usize::from(v.is_some_and(|x| !x.is_finite()));
        let (mut s, mut v, mut t) = (0, 0, 0);
        for p in &self.points {
            s += usize::from(!p.step.is_finite());
            v += bad(p.val_loss);
            t += bad(p.train_loss);
        }
        [("step", s), ("val_loss", v), ("train_loss", t)]
            .into_iter()
            .filter(|(_, n)| *n > 0)
            .collect()
    }
}

/// Count of non-finite values per field, the fields with none left out.
pub type NonFinite = Vec<(&'static str, usize)>;

impl Metrics {
    /// The non-finite values of every field (a non-finite step counts once, as `step`).
    pub fn nonfinite(&self) -> NonFinite {
        let bad = |v: Option<f64>| usize::from(v.is_some_and(|x| !x.is_finite()));
        let mut n = [0usize; 5];
        for p in &self.points {
            if !p.step.is_finite() {
                n[0] += 1;
                continue;
            }
            n[1] += bad(p.loss);
            n[2] += bad(p.accuracy);
            n[3] += bad(p.samples_per_s);
            n[4] += bad(p.comm_wait_ms);
        }
        ["step", "loss", "accuracy", "samples_per_s", "comm_wait_ms"]
            .into_iter()
            .zip(n)
            .filter(|(_, n)| *n > 0)
            .collect()
    }
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
    /// Non-finite values read (drawn as 0).
    pub skipped: usize,
}

/// A collective sweep: (bytes, busbw GB/s) per size.
#[derive(Debug, Clone, PartialEq)]
pub struct Sweep {
    pub label: String,
    pub points: Vec<(f64, f64)>,
}

impl Sweep {
    /// Rows with a non-finite size or bandwidth.
    pub fn nonfinite(&self) -> NonFinite {
        let n = self
            .points
            .iter()
            .filter(|(b, bw)| !b.is_finite() || !bw.is_finite())
            .count();
        [("bytes/busbw_gbs", n)]
            .into_iter()
            .filter(|(_, n)| *n > 0)
            .collect()
    }
}

/// Everything read from the inputs.
#[derive(Debug, Default)]
pub struct Inputs {
    pub metrics: Vec<Metrics>,
    pub evals: Vec<Evals>,
    pub reports: Vec<Report>,
    pub sweeps: Vec<Sweep>,
}

/// The number at `v[k]`: `None` when absent, NaN for `null` (a non-finite value written by
/// serde_json), ±inf/NaN for the spelled-out tokens [`parse_line`] turns into strings.
fn f(v: &Value, k: &str) -> Option<f64> {
    match v.get(k)? {
        Value::Null => Some(f64::NAN),
        Value::String(s) => match s.as_str() {
            "NaN" => Some(f64::NAN),
            "Infinity" => Some(f64::INFINITY),
            "-Infinity" => Some(f64::NEG_INFINITY),
            _ => None,
        },
        n => n.as_f64(),
    }
}

/// One JSON line; when plain JSON fails, again with the bare `NaN`, `Infinity`, `-Infinity`
/// tokens and overflowing numbers (`1e999`) outside strings turned into the strings `"NaN"`,
/// `"Infinity"`, `"-Infinity"` (which [`f`] reads back as non-finite numbers).
fn parse_line(line: &str) -> Option<Value> {
    if let Ok(v) = serde_json::from_str(line) {
        return Some(v);
    }
    let mut out = String::with_capacity(line.len() + 16);
    let mut rest = line;
    let mut in_string = false;
    while let Some(c) = rest.chars().next() {
        if in_string {
            out.push(c);
            rest = &rest[c.len_utf8()..];
            if c == '\\' {
                if let Some(e) = rest.chars().next() {
                    out.push(e);
                    rest = &rest[e.len_utf8()..];
                }
            } else if c == '"' {
                in_string = false;
            }
            continue;
        }
        if c == '"' {
            in_string = true;
            out.push(c);
            rest = &rest[1..];
            continue;
        }
        let token_len = rest
            .find(|ch: char| !(ch.is_ascii_alphanumeric() || matches!(ch, '-' | '+' | '.')))
            .unwrap_or(rest.len());
        if token_len == 0 {
            out.push(c);
            rest = &rest[c.len_utf8()..];
            continue;
        }
        let token = &rest[..token_len];
        let marker = match token {
            "NaN" | "-NaN" => Some("NaN"),
            "Infinity" | "+Infinity" => Some("Infinity"),
            "-Infinity" => Some("-Infinity"),
            _ => match token.parse::<f64>() {
                Ok(x) if x == f64::INFINITY => Some("Infinity"),
                Ok(x) if x == f64::NEG_INFINITY => Some("-Infinity"),
                _ => None,
            },
        };
        match marker {
            Some(m) => {
                out.push('"');
                out.push_str(m);
                out.push('"');
            }
            None => out.push_str(token),
        }
        rest = &rest[token_len..];
    }
    serde_json::from_str(&out).ok()
}

fn report(label: &str, v: &Value) -> Option<Report> {
    let mut skipped = 0;
    let mut finite = |x: f64| {
        if x.is_finite() {
            x
        } else {
            skipped += 1;
            0.0
        }
    };
    let ranks: Vec<RankSplit> = v
        .get("ranks")?
        .as_array()?
        .iter()
        .map(|r| {
            Some(RankSplit {
                rank: r.get("rank")?.as_u64()? as usize,
                compute: finite(f(r, "compute_ms")?),
                data: finite(f(r, "data_ms")?),
                optimizer: finite(f(r, "optimizer_ms")?),
                exposed_comm: finite(f(r, "exposed_comm_ms")?),
                waiting: finite(f(r, "waiting_ms")?),
            })
        })
        .collect::<Option<Vec<_>>>()?;
    let s = &v["straggler"];
    let straggler = (s["significant"] == true)
        .then(|| Some((s["rank"].as_u64()? as usize, finite(f(s, "slower_by_pct")?))))
        .flatten();
    let hidden_comm_share = finite(f(v, "hidden_comm_share").unwrap_or(0.0));
    Some(Report {
        label: label.to_string(),
        ranks,
        straggler,
        hidden_comm_share,
        skipped,
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
    let mut evals = Evals {
        label: label.clone(),
        points: Vec::new(),
    };
    let mut used = 0;
    for line in text.lines().map(str::trim).filter(|l| l.starts_with('{')) {
        let Some(v) = parse_line(line) else {
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
        } else if let (Some(step), true) = (f(&v, "step"), v.get("val_loss").is_some()) {
            evals.points.push(EvalPoint {
                step,
                val_loss: f(&v, "val_loss"),
                train_loss: f(&v, "train_loss"),
                elapsed_s: f(&v, "elapsed_s"),
                comm_bytes: f(&v, "comm_bytes"),
            });
            used += 1;
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
            "{}: no metrics lines (train-digits --metrics), evaluations (train-gpt --metrics), \
             bottleneck report or collective sweep rows (ddp-bench ... --json) in it",
            path.display()
        ));
    }
    if !metrics.points.is_empty() {
        into.metrics.push(metrics);
    }
    if !evals.points.is_empty() {
        into.evals.push(evals);
    }
    if !sweep.points.is_empty() {
        sweep.points.sort_by(|a, b| a.0.total_cmp(&b.0));
        into.sweeps.push(sweep);
    }
    Ok(())
}
