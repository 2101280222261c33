//! What rank 0 shows while training: a progress bar on a terminal (`indicatif`: epoch, step,
//! loss, samples/s, ETA) or plain periodic lines when stdout is not a terminal (CI, logs,
//! `ddprun`'s prefixed output), nothing with `--quiet`; and the `--metrics FILE` log, one JSON
//! line per logged step, that `ddp-plot` draws.

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use std::fs::File;
use std::io::{IsTerminal, Write};
use std::path::Path;
use std::time::{Duration, Instant};

/// Overrides the terminal detection: `bar`, `lines` or `off`.
pub const PROGRESS_ENV: &str = "DDP_PROGRESS";

/// How progress is shown.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    Bar,
    Lines,
    Off,
}

/// Rank 0's progress display.
pub struct Progress {
    mode: Mode,
    bar: Option<ProgressBar>,
    total: u64,
    /// Plain mode prints a line every this many steps (a tenth of the run).
    line_every: u64,
    epochs: u64,
    start: Instant,
    first_step: u64,
}

impl Progress {
    /// `total` steps in the run (`first_step` of them already done by a resumed run).
    pub fn new(rank: usize, quiet: bool, total: u64, first_step: u64, epochs: u64) -> Progress {
        let mode = match std::env::var(PROGRESS_ENV).ok().as_deref() {
            _ if rank != 0 || quiet => Mode::Off,
            Some("bar") => Mode::Bar,
            Some("lines") => Mode::Lines,
            Some("off") => Mode::Off,
            _ if std::io::stdout().is_terminal() => Mode::Bar,
            _ => Mode::Lines,
        };
        let bar = (mode == Mode::Bar).then(|| {
            let bar = ProgressBar::with_draw_target(Some(total), ProgressDrawTarget::stdout());
            bar.set_style(
                ProgressStyle::with_template(
                    "{prefix} [{bar:30.cyan/blue}] {pos}/{len} steps  {msg}  ETA {eta}",
                )
                .expect("a valid template")
                .progress_chars("=> "),
            );
            bar.set_position(first_step);
            bar
        });
        Progress {
            mode,
            bar,
            total,
            line_every: (total / 10).max(1),
            epochs,
            start: Instant::now(),
            first_step,
        }
    }

    /// After step `step` (1-based count of steps done) of epoch `epoch` (0-based).
    pub fn step(&mut self, epoch: u64, step: u64, loss: f64, samples_per_s: f64) {
        match self.mode {
            Mode::Off => {}
            Mode::Bar => {
                if let Some(bar) = &self.bar {
                    bar.set_prefix(format!("epoch {}/{}", epoch + 1, self.epochs));
                    bar.set_message(format!("loss {loss:.4}  {samples_per_s:.0} samples/s"));
                    bar.set_position(step);
                }
            }
            Mode::Lines => {
                if step.is_multiple_of(self.line_every) || step == self.total {
                    let done = step.saturating_sub(self.first_step) as f64;
                    let left = self.total.saturating_sub(step) as f64;
                    let eta = self.start.elapsed().as_secs_f64() / done.max(1.0) * left;
                    println!(
                        "progress: epoch {}/{}  step {step}/{}  loss {loss:.4}  {samples_per_s:.0} \
                         samples/s  ETA {eta:.0}s",
                        epoch + 1,
                        self.epochs,
                        self.total
                    );
                }
            }
        }
    }

    /// Prints `line` above the bar, or as a line; nothing when off.
    pub fn println(&self, line: &str) {
        match (&self.bar, self.mode) {
            (Some(bar), _) => bar.println(line),
            (None, Mode::Lines) => println!("{line}"),
            _ => {}
        }
    }

    /// Removes the bar (the summary follows on clean lines).
    pub fn finish(&mut self) {
        if let Some(bar) = self.bar.take() {
            bar.finish_and_clear();
        }
    }
}

/// One logged step of the metrics file.
#[derive(Debug, Clone, Copy)]
pub struct StepMetrics {
    pub step: u64,
    pub epoch: u64,
    pub loss: f64,
    pub accuracy: Option<f64>,
    pub lr: f64,
    /// Rank 0's bytes handed to collectives so far: gradients, local SGD's model averaging,
    /// DiLoCo's pseudo-gradients.
    pub bytes_sent: u64,
}

/// Rank 0's `--metrics FILE`: appends one JSON line every `every` steps (and at each epoch's end
/// with the held-out accuracy), with the throughput and the mean communication wait since the
/// previous line; `ddp-plot` draws it.
pub struct MetricsLog {
    file: File,
    every: u64,
    world: usize,
    start: Instant,
    last: Instant,
    samples: u64,
    wait: Duration,
    steps: u64,
}

impl MetricsLog {
    pub fn open(path: &Path, every: u64, world: usize) -> std::io::Result<MetricsLog> {
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)?;
        let now = Instant::now();
        Ok(MetricsLog {
            file,
            every: every.max(1),
            world,
            start: now,
            last: now,
            samples: 0,
            wait: Duration::ZERO,
            steps: 0,
        })
    }

    /// Counts a step of `samples` local samples that waited `wait` for communication.
    pub fn count(&mut self, samples: usize, wait: Duration) {
        self.samples += samples as u64;
        self.wait += wait;
        self.steps += 1;
    }

    /// Whether step `step` is logged (without an accuracy).
    pub fn due(&self, step: u64) -> bool {
        step.is_multiple_of(self.every)
    }

    /// Appends `m` with the throughput (all ranks: local × world size) since the last line.
    pub fn write(&mut self, m: StepMetrics) -> std::io::Result<()> {
        let now = Instant::now();
        let dt = (now - self.last).as_secs_f64();
        let sps = if dt > 0.0 {
            (self.samples * self.world as u64) as f64 / dt
        } else {
            0.0
        };
        let wait_ms = self.wait.as_secs_f64() * 1e3 / self.steps.max(1) as f64;
        let mut line = serde_json::json!({
            "kind": "step",
            "step": m.step,
            "epoch": m.epoch,
            "time_s": (now - self.start).as_secs_f64(),
            "loss": m.loss,
            "lr": m.lr,
            "samples_per_s": sps,
            "comm_wait_ms": wait_ms,
            "bytes_sent": m.bytes_sent,
            "world_size": self.world,
        });
        if let Some(a) = m.accuracy {
            line["accuracy"] = a.into();
        }
        writeln!(self.file, "{line}")?;
        (self.last, self.samples, self.wait, self.steps) = (now, 0, Duration::ZERO, 0);
        Ok(())
    }

    /// Appends the bottleneck report (`kind: report`), for the per-rank bar of `ddp-plot`.
    pub fn write_report(&mut self, report: &ddprs::trace::BottleneckReport) -> std::io::Result<()> {
        let mut v = report.to_json();
        v["kind"] = "report".into();
        writeln!(self.file, "{v}")?;
        self.file.flush()
    }
}
