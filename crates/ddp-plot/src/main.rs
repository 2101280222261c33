//! `ddp-plot INPUT... --out DIR`: pictures (SVG and PNG) of training runs and benchmarks.
//!
//! - `train-digits --metrics FILE` lines → `loss_accuracy` (loss and held-out accuracy versus
//!   step) and `throughput` (samples/s and communication wait versus step), every run overlaid;
//! - `train-gpt --metrics` and `bench/peers/torch_gpt.py --metrics` lines → `loss_curves`, and
//!   `loss_vs_time` (every line has `elapsed_s`) and `loss_vs_bytes` (the runs with `comm_bytes`)
//!   (validation and training loss versus step, every run overlaid, each named after its file
//!   less what all the files' names share);
//! - a bottleneck report (the metrics file's last line, `report.json` of `--trace`, or
//!   `--report FILE`) → `step_breakdown` (each rank's mean step stacked: compute, data,
//!   optimizer, exposed communication, waiting for the slowest rank);
//! - `ddp-bench allreduce ... --json` output, and the peers' (`bench/peers`) → `busbw` (bus
//!   bandwidth versus size, each file a series named after it).
//!
//! Non-finite values (NaN, ±inf, written as `null` by serde_json or as `NaN`/`Infinity` by
//! Python) are skipped, counted on stderr and in the chart's title; axes fit any finite values
//! (a log10 axis for values spanning many decades, `1e30`-style labels); each series is
//! decimated to a few thousand points keeping every bucket's minimum and maximum, so a long run
//! still makes a small SVG with its spikes (module `scale`).
//!
//! Text needs a TrueType font: `DDP_PLOT_FONT`, else DejaVu Sans or Liberation Sans from the
//! usual system places (Debian: `fonts-dejavu-core`).

#![forbid(unsafe_code)]

mod charts;
mod curves;
mod input;
mod scale;

use clap::Parser;
use plotters::prelude::*;
use std::path::{Path, PathBuf};

/// Pictures (SVG and PNG) of ddp-rs metrics files, bottleneck reports and collective sweeps.
#[derive(Parser)]
#[command(name = "ddp-plot", version)]
struct Cli {
    /// Metrics files (train-digits --metrics, train-gpt --metrics), reports (report.json) and
    /// sweeps (ddp-bench ... --json output, one file per series).
    #[arg(required = true)]
    inputs: Vec<PathBuf>,
    /// Directory for the pictures (created if missing).
    #[arg(long)]
    out: PathBuf,
    /// Picture size in pixels, WIDTHxHEIGHT.
    #[arg(long, default_value = "900x520", value_parser = parse_size)]
    size: (u32, u32),
}

fn parse_size(s: &str) -> Result<(u32, u32), String> {
    let (w, h) = s
        .split_once('x')
        .ok_or_else(|| format!("`{s}`: expected WIDTHxHEIGHT, e.g. 900x520"))?;
    let p = |v: &str| match v.parse::<u32>() {
        Ok(n) if (200..=8000).contains(&n) => Ok(n),
        _ => Err(format!("`{s}`: each side must be 200 to 8000 pixels")),
    };
    Ok((p(w)?, p(h)?))
}

/// Where a TrueType font is looked for after `DDP_PLOT_FONT`.
const FONT_PATHS: &[&str] = &[
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/TTF/DejaVuSans.ttf",
    "/usr/share/fonts/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/dejavu-sans-fonts/DejaVuSans.ttf",
    "/usr/share/fonts/truetype/liberation/LiberationSans-Regular.ttf",
    "/usr/share/fonts/liberation-sans/LiberationSans-Regular.ttf",
    "/System/Library/Fonts/Supplemental/Arial.ttf",
    "/Library/Fonts/Arial.ttf",
];

/// Registers the first usable font as plotters' `sans-serif`.
fn register_font() -> Result<PathBuf, String> {
    let env = std::env::var_os("DDP_PLOT_FONT").map(PathBuf::from);
    let candidates = env
        .iter()
        .cloned()
        .chain(FONT_PATHS.iter().map(PathBuf::from));
    for path in candidates {
        let Ok(bytes) = std::fs::read(&path) else {
            continue;
        };
        // plotters keeps fonts for the life of the process.
        let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
        if plotters::style::register_font("sans-serif", FontStyle::Normal, bytes).is_ok() {
            return Ok(path);
        }
    }
    Err(format!(
        "no TrueType font found for the labels: set DDP_PLOT_FONT=/path/to/font.ttf or install \
         one (Debian/Ubuntu: apt-get install fonts-dejavu-core){}",
        env.map_or(String::new(), |p| format!(
            " ({} is not usable)",
            p.display()
        ))
    ))
}

/// Draws `$draw(area, $arg)` as `$out/$name.svg` and `$out/$name.png`.
macro_rules! both {
    ($out:expr, $size:expr, $name:expr, $draw:path, $arg:expr, $made:expr) => {{
        let svg = $out.join(format!("{}.svg", $name));
        {
            let root = SVGBackend::new(&svg, $size).into_drawing_area();
            root.fill(&WHITE)?;
            $draw(&root, $arg)?;
            root.present()?;
        }
        let png = $out.join(format!("{}.png", $name));
        {
            let root = BitMapBackend::new(&png, $size).into_drawing_area();
            root.fill(&WHITE)?;
            $draw(&root, $arg)?;
            root.present()?;
        }
        $made.push(svg);
        $made.push(png);
    }};
}

fn run(cli: &Cli) -> charts::DynResult<Vec<PathBuf>> {
    let mut inputs = input::Inputs::default();
    for path in &cli.inputs {
        input::read(path, &mut inputs)?;
    }
    warn_nonfinite(&inputs);
    register_font()?;
    std::fs::create_dir_all(&cli.out).map_err(|e| format!("--out {}: {e}", cli.out.display()))?;
    let (out, size) = (cli.out.as_path(), cli.size);
    let mut made = Vec::new();
    if !inputs.metrics.is_empty() {
        both!(
            out,
            size,
            "loss_accuracy",
            charts::loss_accuracy,
            &inputs.metrics,
            made
        );
        both!(
            out,
            size,
            "throughput",
            charts::throughput,
            &inputs.metrics,
            made
        );
    }
    if !inputs.evals.is_empty() {
        shorten_labels(&mut inputs.evals);
        both!(
            out,
            size,
            "loss_curves",
            curves::loss_curves,
            &inputs.evals,
            made
        );
        if inputs.evals.iter().all(|r| curves::Along::Time.has(r)) {
            both!(
                out,
                size,
                "loss_vs_time",
                curves::loss_vs_time,
                &inputs.evals,
                made
            );
        }
        // The runs that counted their bytes (train-gpt's; not the PyTorch peer's).
        let counted: Vec<_> = inputs
            .evals
            .iter()
            .filter(|r| curves::Along::Bytes.has(r))
            .cloned()
            .collect();
        if !counted.is_empty() {
            both!(
                out,
                size,
                "loss_vs_bytes",
                curves::loss_vs_bytes,
                &counted,
                made
            );
        }
    }
    let several = inputs.reports.len() > 1;
    for r in &inputs.reports {
        let name = match several {
            true => format!("step_breakdown_{}", sanitize(&r.label)),
            false => "step_breakdown".to_string(),
        };
        both!(out, size, name, charts::step_breakdown, r, made);
    }
    if !inputs.sweeps.is_empty() {
        both!(out, size, "busbw", charts::busbw, &inputs.sweeps, made);
    }
    Ok(made)
}

/// Says on stderr which inputs had non-finite values, and how many of each field.
fn warn_nonfinite(inputs: &input::Inputs) {
    let sets = inputs
        .metrics
        .iter()
        .map(|m| (&m.label, m.nonfinite()))
        .chain(inputs.evals.iter().map(|e| (&e.label, e.nonfinite())))
        .chain(inputs.sweeps.iter().map(|s| (&s.label, s.nonfinite())));
    for (label, counts) in sets.filter(|(_, c)| !c.is_empty()) {
        let total: usize = counts.iter().map(|c| c.1).sum();
        let each: Vec<String> = counts.iter().map(|(k, n)| format!("{k} {n}")).collect();
        eprintln!(
            "ddp-plot: {label}: skipped {total} non-finite values (NaN or infinite): {}",
            each.join(", ")
        );
    }
    for r in inputs.reports.iter().filter(|r| r.skipped > 0) {
        eprintln!(
            "ddp-plot: {}: {} non-finite values in the bottleneck report, drawn as 0",
            r.label, r.skipped
        );
    }
}

/// The runs' labels less a `.metrics` ending and what they all begin with (up to a `-`, `_` or
/// `.`), so that `gpt-20261207-candle-w2.metrics` and `gpt-20261207-pytorch-w2.metrics` read
/// `candle-w2` and `pytorch-w2`.
fn shorten_labels(runs: &mut [input::Evals]) {
    for r in runs.iter_mut() {
        if let Some(s) = r.label.strip_suffix(".metrics") {
            r.label = s.to_string();
        }
    }
    if runs.len() < 2 {
        return;
    }
    let first = runs[0].label.clone();
    let mut common = first.len();
    for r in &runs[1..] {
        common = common.min(
            first
                .bytes()
                .zip(r.label.bytes())
                .take_while(|(a, b)| a == b)
                .count(),
        );
    }
    let cut = first[..common].rfind(['-', '_', '.']).map_or(0, |i| i + 1);
    if runs.iter().all(|r| r.label.len() > cut) {
        for r in runs.iter_mut() {
            r.label = r.label[cut..].to_string();
        }
    }
}

/// A label as a file-name part.
fn sanitize(label: &str) -> String {
    label
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '_' {
                c
            } else {
                '_'
            }
        })
        .collect()
}

fn main() {
    let cli = Cli::parse();
    match run(&cli) {
        Ok(made) => {
            for p in made {
                println!("{}", display(&p));
            }
        }
        Err(e) => {
            eprintln!("ddp-plot: error: {e}");
            std::process::exit(1);
        }
    }
}

fn display(p: &Path) -> String {
    p.display().to_string()
}
