//! What a run prints: a line per evaluation (and the `--metrics` JSON lines), the final JSON
//! line (`--json`), the sample.

use crate::config::Args;
use ddprs::{ProcessGroup, ReduceOp};
use serde::Serialize;
use std::io::Write;

/// One evaluation (rank 0 holds the validation loss).
#[derive(Debug, Clone, Serialize)]
pub struct Eval {
    pub step: u64,
    pub train_loss: f64,
    pub val_loss: Option<f64>,
    pub elapsed_s: f64,
    pub tokens_per_s: f64,
    /// Payload bytes this rank had sent to collectives by then (gradients, pseudo-gradients).
    pub comm_bytes: u64,
}

/// The final JSON line.
#[derive(Debug, Clone, Serialize)]
pub struct Summary {
    pub framework: crate::config::Framework,
    pub world_size: usize,
    pub steps: u64,
    pub val_loss: Option<f64>,
    pub train_loss: Option<f64>,
    pub tokens_per_s: f64,
    pub ms_per_step: f64,
    pub param_sum: f64,
    pub param_l2: f64,
    pub replicas_identical: bool,
    pub peak_rss_bytes: u64,
    pub tied: bool,
    pub zero: u8,
    pub hook: String,
    pub n_layer: usize,
    pub n_embd: usize,
    pub block_size: usize,
    pub batch_size: usize,
    /// Mean time a checkpoint save stalled the step on rank 0 (ms; absent without saves).
    pub checkpoint_stall_ms: Option<f64>,
    pub checkpoint_async: bool,
    /// `--fault-tolerance`: each regrouping (absent when there was none).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub regroups: Vec<crate::fault::RegroupRecord>,
    /// `--fault-tolerance`: steps that failed and were dropped (trained again).
    pub failed_steps: u64,
    /// The step this process started training at (0, or a resumed checkpoint's).
    pub start_step: u64,
    /// When this process completed its first step (Unix time, ms).
    pub first_step_unix_ms: Option<u64>,
    /// Payload bytes rank 0 sent to collectives (gradients, pseudo-gradients).
    pub comm_bytes: u64,
}

pub struct Report {
    rank: usize,
    json: bool,
    metrics: Option<std::fs::File>,
    last: Option<Eval>,
    pub summary: Option<Summary>,
    pub sample: Option<String>,
    args: Args,
    world: usize,
    tied: bool,
    /// See [`Summary::regroups`].
    pub regroups: Vec<crate::fault::RegroupRecord>,
    /// See [`Summary::failed_steps`].
    pub failed_steps: u64,
    /// See [`Summary::start_step`].
    pub start_step: u64,
    /// Payload bytes this rank has sent to collectives so far (set by the training loop).
    pub comm_bytes: u64,
    /// See [`Summary::first_step_unix_ms`].
    pub first_step_unix_ms: Option<u64>,
}

/// This process's peak resident memory (`VmHWM`), in bytes.
pub fn peak_rss_bytes() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map_or(0, |kb| kb * 1024)
}

impl Report {
    pub fn new(args: &Args, rank: usize, world: usize, tied: bool) -> Report {
        let metrics = args.metrics.as_ref().filter(|_| rank == 0).map(|p| {
            std::fs::File::create(p).unwrap_or_else(|e| panic!("--metrics {}: {e}", p.display()))
        });
        Report {
            rank,
            json: args.json,
            metrics,
            last: None,
            summary: None,
            sample: None,
            args: args.clone(),
            world,
            tied,
            regroups: Vec::new(),
            failed_steps: 0,
            start_step: 0,
            first_step_unix_ms: None,
            comm_bytes: 0,
        }
    }

    /// This process's place after a regrouping.
    pub fn set_group(&mut self, rank: usize, world: usize) {
        self.rank = rank;
        self.world = world;
    }

    /// Records the evaluation after step `step` (`val_loss` on rank 0), with the throughput of
    /// the `timed_steps` steps trained in `train_time` seconds since `t0`.
    pub fn eval_at(
        &mut self,
        step: u64,
        train_loss: f64,
        val_loss: Option<f64>,
        t0: std::time::Instant,
        timed_steps: u64,
        train_time: f64,
    ) {
        let a = &self.args;
        let tokens = (timed_steps * (a.batch_size * a.block_size * self.world) as u64) as f64;
        self.eval(Eval {
            step,
            train_loss,
            val_loss,
            elapsed_s: t0.elapsed().as_secs_f64(),
            tokens_per_s: tokens / train_time,
            comm_bytes: self.comm_bytes,
        });
    }

    pub fn eval(&mut self, e: Eval) {
        if self.rank == 0 {
            let val = e
                .val_loss
                .map_or(String::new(), |v| format!(", val loss {v:.4}"));
            println!(
                "step {}: train loss {:.4}{val}, {:.0} tokens/s",
                e.step, e.train_loss, e.tokens_per_s
            );
            if let Some(f) = self.metrics.as_mut() {
                let _ = writeln!(f, "{}", serde_json::to_string(&e).unwrap());
            }
        }
        self.last = Some(e);
    }

    /// Completes the summary (a collective: the peak memory is the largest rank's).
    #[allow(clippy::too_many_arguments)]
    pub fn finish(
        &mut self,
        pg: &ProcessGroup,
        steps: u64,
        param_sum: f64,
        param_l2: f64,
        replicas_identical: bool,
        train_time: f64,
        timed_steps: u64,
    ) -> ddprs::Result<()> {
        let mut rss = [peak_rss_bytes() as f64];
        pg.all_reduce(&mut rss, ReduceOp::Max)?;
        let a = &self.args;
        let tokens = (timed_steps * (a.batch_size * a.block_size * self.world) as u64) as f64;
        self.summary = Some(Summary {
            framework: a.framework,
            world_size: self.world,
            steps,
            val_loss: self.last.as_ref().and_then(|e| e.val_loss),
            train_loss: self.last.as_ref().map(|e| e.train_loss),
            tokens_per_s: if train_time > 0.0 {
                tokens / train_time
            } else {
                0.0
            },
            ms_per_step: if timed_steps > 0 {
                1e3 * train_time / timed_steps as f64
            } else {
                0.0
            },
            param_sum,
            param_l2,
            replicas_identical,
            peak_rss_bytes: rss[0] as u64,
            tied: self.tied,
            zero: a.zero,
            hook: a.hook.to_string(),
            n_layer: a.n_layer,
            n_embd: a.n_embd,
            block_size: a.block_size,
            batch_size: a.batch_size,
            checkpoint_stall_ms: None,
            checkpoint_async: a.checkpoint_async.is_some(),
            regroups: self.regroups.clone(),
            failed_steps: self.failed_steps,
            start_step: self.start_step,
            first_step_unix_ms: self.first_step_unix_ms,
            comm_bytes: self.comm_bytes,
        });
        Ok(())
    }

    /// Records the mean checkpoint stall (after [`finish`](Self::finish)).
    pub fn checkpoint_stall(&mut self, ms: Option<f64>) {
        if let Some(s) = &mut self.summary {
            s.checkpoint_stall_ms = ms;
        }
    }

    /// Rank 0's final output: the sample, then the JSON line.
    pub fn print(&self) {
        if self.rank != 0 {
            return;
        }
        if let Some(s) = &self.sample {
            println!("--- sample ---\n{s}\n--- end of sample ---");
        }
        if let Some(s) = &self.summary {
            if self.json {
                println!("{}", serde_json::to_string(s).unwrap());
            } else if let Some(v) = s.val_loss {
                println!(
                    "final validation loss {v:.4} after {} steps ({:.0} tokens/s, world {})",
                    s.steps, s.tokens_per_s, s.world_size
                );
            }
        }
    }
}
