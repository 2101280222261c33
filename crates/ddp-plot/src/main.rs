//! `ddp-plot INPUT... --out DIR`: pictures (SVG and PNG) of training runs and benchmarks.
//!
//! - `train-digits --metrics FILE` lines → `loss_accuracy` (loss and held-out accuracy versus
//!   step) and `throughput` (samples/s and communication wait versus step), every run overlaid;
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
mod input;
mod scale;

use clap::Parser;
use plotters::prelude::*;
use std::path::{Path, PathBuf};

/// Pictures (SVG and PNG) of ddp-rs metrics files, bottleneck reports and collective sweeps.
#[derive(Parser)]
#[command(name = "ddp-plot", version)]
struct Cli {
    /// Metrics files (train-digits --metrics), reports (report.json) and sweeps
    /// (ddp-bench ... --json output, one file per series).
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
