//! The step profile behind the bottleneck report.
//!
//! A training loop drives a [`StepProfiler`]: [`begin_step`](StepProfiler::begin_step), each
//! phase through [`phase`](StepProfiler::phase) (data loading, forward, backward, optimizer;
//! also a timeline span when tracing is on), the reducer's wait for communication through
//! [`add_comm_wait`](StepProfiler::add_comm_wait), then [`end_step`](StepProfiler::end_step).
//! At the end [`StepProfiler::report`] (a collective) gathers every rank's steps and splits each
//! rank's mean step into:
//!
//! - **waiting for the slowest rank**: a gradient collective cannot finish before the last rank
//!   joins it, so in each step a rank whose *busy* time (step minus communication wait) is
//!   shorter than the busiest rank's waits the difference — at most its whole communication
//!   wait;
//! - **exposed communication**: the rest of the communication wait;
//! - **data loading** and **optimizer**: their phases;
//! - **compute**: what remains (forward, backward and anything else of the step).
//!
//! The busiest rank is the straggler, reported with how much longer its busy time is than the
//! median of the others'. The share of communication hidden under the backward pass is
//! [`BottleneckReport::hidden_share`]: communication time hidden behind backward ÷ total
//! communication time, `1 - exposed / (collective time - waiting)`, where the collective time is
//! what the group's engine thread spent in collectives during the step
//! ([`super::CommObserver`]). The first step (warm-up) is left out when there are at least three.

use super::{observe, record_span, CommObserver};
use crate::error::{Error, Result};
use ddp_comm::ProcessGroup;
use serde::{Deserialize, Serialize};
use std::fmt;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A phase of a training step (the name of its timeline span).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// Loading and preparing a batch.
    Data,
    /// The forward pass (where `DDP_DEBUG_SLOW_RANK` sleeps).
    Forward,
    /// Backward and gradient synchronization.
    Backward,
    /// The optimizer step.
    Optimizer,
    /// Saving a checkpoint (outside the step accounting).
    Checkpoint,
    /// Evaluation (outside the step accounting).
    Eval,
}

impl Phase {
    pub fn name(self) -> &'static str {
        match self {
            Phase::Data => "data",
            Phase::Forward => "forward",
            Phase::Backward => "backward",
            Phase::Optimizer => "optimizer",
            Phase::Checkpoint => "checkpoint",
            Phase::Eval => "eval",
        }
    }
}

/// One step's times, in seconds.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
struct StepRecord {
    total: f64,
    data: f64,
    optimizer: f64,
    comm_wait: f64,
    comm_busy: f64,
}

const FIELDS: usize = 5;

impl StepRecord {
    fn to_array(self) -> [f64; FIELDS] {
        [
            self.total,
            self.data,
            self.optimizer,
            self.comm_wait,
            self.comm_busy,
        ]
    }
    fn from_slice(v: &[f64]) -> StepRecord {
        StepRecord {
            total: v[0],
            data: v[1],
            optimizer: v[2],
            comm_wait: v[3],
            comm_busy: v[4],
        }
    }
}

/// Steps kept per rank (40 bytes each); later ones are not profiled.
const MAX_STEPS: usize = 1 << 20;

/// Per-step timing of one rank (see the module doc).
pub struct StepProfiler {
    comm: Arc<CommObserver>,
    records: Vec<StepRecord>,
    /// The open step: its start, its record so far, the collective time at its start.
    open: Option<(Instant, StepRecord, Duration)>,
    step: u64,
}

impl StepProfiler {
    /// A profiler counting `pg`'s collectives (installs ddp's observer on `pg`).
    pub fn new(pg: &ProcessGroup) -> StepProfiler {
        StepProfiler {
            comm: observe(pg),
            records: Vec::new(),
            open: None,
            step: 0,
        }
    }

    /// Starts a step (ends an open one first).
    pub fn begin_step(&mut self) {
        self.end_step();
        self.open = Some((Instant::now(), StepRecord::default(), self.comm.busy()));
    }

    /// Runs `f` as `phase` of the open step: timed, and a timeline span when tracing is on.
    /// [`Phase::Forward`] first sleeps when `DDP_DEBUG_SLOW_RANK` names this rank.
    pub fn phase<R>(&mut self, phase: Phase, f: impl FnOnce() -> R) -> R {
        let start = Instant::now();
        if phase == Phase::Forward {
            super::debug::slow_forward();
        }
        let r = f();
        let end = Instant::now();
        if super::enabled() {
            let args = vec![("step", self.step.into())];
            record_span(phase.name(), "train", start, end, args);
        }
        if let Some((_, rec, _)) = &mut self.open {
            let s = (end - start).as_secs_f64();
            match phase {
                Phase::Data => rec.data += s,
                Phase::Optimizer => rec.optimizer += s,
                _ => {}
            }
        }
        r
    }

    /// Adds time the step spent blocked waiting for gradient communication (the reducer's
    /// `StepStats::comm_wait`).
    pub fn add_comm_wait(&mut self, wait: Duration) {
        if let Some((_, rec, _)) = &mut self.open {
            rec.comm_wait += wait.as_secs_f64();
        }
    }

    /// Ends the open step, if any.
    pub fn end_step(&mut self) {
        if let Some((start, mut rec, busy0)) = self.open.take() {
            let end = Instant::now();
            rec.total = (end - start).as_secs_f64();
            rec.comm_busy = (self.comm.busy().saturating_sub(busy0)).as_secs_f64();
            if super::enabled() {
                record_span("step", "step", start, end, vec![("step", self.step.into())]);
            }
            self.step += 1;
            if self.records.len() < MAX_STEPS {
                self.records.push(rec);
            }
        }
    }

    /// Steps profiled so far.
    pub fn steps(&self) -> usize {
        self.records.len()
    }

    /// The bottleneck report over every rank of `pg` (a collective; every rank gets it).
    pub fn report(&mut self, pg: &ProcessGroup) -> Result<BottleneckReport> {
        self.end_step();
        let mut bytes = Vec::with_capacity(self.records.len() * FIELDS * 8);
        for r in &self.records {
            for v in r.to_array() {
                bytes.extend_from_slice(&v.to_le_bytes());
            }
        }
        let parts = pg.all_gather_bytes(&bytes)?;
        let ranks = parts
            .iter()
            .map(|p| {
                if p.len() % (FIELDS * 8) != 0 {
                    return Err(Error::InvalidArgument(
                        "step profile: a rank sent a truncated profile".into(),
                    ));
                }
                let vals: Vec<f64> = p
                    .chunks_exact(8)
                    .map(|b| f64::from_le_bytes(b.try_into().expect("8 bytes")))
                    .collect();
                Ok(vals
                    .chunks_exact(FIELDS)
                    .map(StepRecord::from_slice)
                    .collect())
            })
            .collect::<Result<Vec<Vec<StepRecord>>>>()?;
        Ok(BottleneckReport::from_steps(&ranks))
    }
}

/// One rank's mean step, split (milliseconds).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RankBreakdown {
    pub rank: usize,
    pub step_ms: f64,
    pub compute_ms: f64,
    pub data_ms: f64,
    pub optimizer_ms: f64,
    pub exposed_comm_ms: f64,
    pub waiting_ms: f64,
    /// Time the group's engine spent in collectives per step (hidden or not).
    pub collective_ms: f64,
    /// Busy time per step: everything but the communication wait.
    pub busy_ms: f64,
    /// Share of this rank's communication hidden under the backward pass (0..1).
    pub hidden_comm_share: f64,
}

/// The slowest rank and how much slower it is.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Straggler {
    pub rank: usize,
    pub busy_ms: f64,
    /// Median busy time of the other ranks.
    pub others_busy_ms: f64,
    pub slower_by_ms: f64,
    pub slower_by_pct: f64,
    /// Whether it is slower by more than [`STRAGGLER_PCT`] percent.
    pub significant: bool,
}

/// A rank more than this many percent busier than the median of the others is a straggler.
pub const STRAGGLER_PCT: f64 = 10.0;

/// Where every rank's mean step goes (see the module doc).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BottleneckReport {
    pub world_size: usize,
    /// Steps averaged over (the same on every rank).
    pub steps: usize,
    pub ranks: Vec<RankBreakdown>,
    pub straggler: Option<Straggler>,
    /// Mean over the ranks of their hidden communication share.
    pub hidden_comm_share: f64,
}

impl BottleneckReport {
    fn from_steps(ranks: &[Vec<StepRecord>]) -> BottleneckReport {
        let world = ranks.len();
        let n = ranks.iter().map(Vec::len).min().unwrap_or(0);
        let skip = usize::from(n >= 3);
        let steps = n - skip;
        let mut sums = vec![[0f64; 9]; world];
        for s in skip..n {
            let busy: Vec<f64> = ranks
                .iter()
                .map(|r| (r[s].total - r[s].comm_wait).max(0.0))
                .collect();
            let slowest = busy.iter().copied().fold(0.0, f64::max);
            for (r, recs) in ranks.iter().enumerate() {
                let rec = recs[s];
                let waiting = (slowest - busy[r]).clamp(0.0, rec.comm_wait);
                let exposed = rec.comm_wait - waiting;
                let compute = (rec.total - rec.data - rec.optimizer - rec.comm_wait).max(0.0);
                let comm_actual = (rec.comm_busy - waiting).max(exposed);
                let v = [
                    rec.total,
                    compute,
                    rec.data,
                    rec.optimizer,
                    exposed,
                    waiting,
                    rec.comm_busy,
                    busy[r],
                    comm_actual,
                ];
                for (acc, x) in sums[r].iter_mut().zip(v) {
                    *acc += x;
                }
            }
        }
        let per = |x: f64| {
            if steps > 0 {
                x * 1e3 / steps as f64
            } else {
                0.0
            }
        };
        let rows: Vec<RankBreakdown> = sums
            .iter()
            .enumerate()
            .map(|(rank, s)| RankBreakdown {
                rank,
                step_ms: per(s[0]),
                compute_ms: per(s[1]),
                data_ms: per(s[2]),
                optimizer_ms: per(s[3]),
                exposed_comm_ms: per(s[4]),
                waiting_ms: per(s[5]),
                collective_ms: per(s[6]),
                busy_ms: per(s[7]),
                hidden_comm_share: BottleneckReport::hidden_share(s[4], s[8]),
            })
            .collect();
        let straggler = (world > 1 && steps > 0).then(|| {
            let top = rows
                .iter()
                .max_by(|a, b| a.busy_ms.total_cmp(&b.busy_ms))
                .expect("world > 1");
            let mut others: Vec<f64> = rows
                .iter()
                .filter(|r| r.rank != top.rank)
                .map(|r| r.busy_ms)
                .collect();
            others.sort_by(f64::total_cmp);
            let median = others[others.len() / 2];
            let by = top.busy_ms - median;
            let pct = if median > 0.0 {
                100.0 * by / median
            } else {
                0.0
            };
            Straggler {
                rank: top.rank,
                busy_ms: top.busy_ms,
                others_busy_ms: median,
                slower_by_ms: by,
                slower_by_pct: pct,
                significant: pct > STRAGGLER_PCT,
            }
        });
        let hidden = rows.iter().map(|r| r.hidden_comm_share).sum::<f64>() / world.max(1) as f64;
        BottleneckReport {
            world_size: world,
            steps,
            ranks: rows,
            straggler,
            hidden_comm_share: hidden,
        }
    }

    /// The share of communication hidden behind the backward pass, the one definition every
    /// output of ddp-rs prints (this report, `train-digits`' summary, `ddp-plot`'s step
    /// breakdown): communication time hidden behind backward ÷ total communication time,
    /// `1 - exposed / comm`, in 0..=1 (1 when there was no communication). `exposed` is the
    /// communication wait that was not waiting for the slowest rank; `comm` is the time the
    /// group's engine spent in collectives less that waiting (at least `exposed`).
    pub fn hidden_share(exposed: f64, comm: f64) -> f64 {
        if comm > 0.0 {
            (1.0 - exposed / comm).clamp(0.0, 1.0)
        } else {
            1.0
        }
    }

    /// The job's figure ([`hidden_share`](Self::hidden_share), mean over ranks) as every output
    /// prints it: `communication hidden under backward: 17% (mean over ranks)`.
    pub fn hidden_comm_line(&self) -> String {
        format!(
            "communication hidden under backward: {:.0}% (mean over ranks)",
            100.0 * self.hidden_comm_share
        )
    }

    /// The report as one JSON object.
    pub fn to_json(&self) -> serde_json::Value {
        serde_json::to_value(self).expect("the report serializes")
    }
}

impl fmt::Display for BottleneckReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "bottleneck report: mean step over {} steps, per rank (ms)",
            self.steps
        )?;
        writeln!(
            f,
            "  rank     step  compute     data optimizer exposed_comm waiting_for_slowest  hidden_comm"
        )?;
        for r in &self.ranks {
            writeln!(
                f,
                "  {:>4} {:>8.2} {:>8.2} {:>8.2} {:>9.2} {:>12.2} {:>19.2} {:>11.0}%",
                r.rank,
                r.step_ms,
                r.compute_ms,
                r.data_ms,
                r.optimizer_ms,
                r.exposed_comm_ms,
                r.waiting_ms,
                100.0 * r.hidden_comm_share
            )?;
        }
        match &self.straggler {
            Some(s) if s.significant => write!(
                f,
                "  straggler: rank {} — busy {:.2} ms/step vs {:.2} ms (median of the others): \
                 {:.2} ms ({:.0}%) slower",
                s.rank, s.busy_ms, s.others_busy_ms, s.slower_by_ms, s.slower_by_pct
            )?,
            Some(s) => write!(
                f,
                "  no straggler: the busiest rank ({}) is {:.0}% above the median of the others \
                 (threshold {STRAGGLER_PCT}%)",
                s.rank, s.slower_by_pct
            )?,
            None => write!(f, "  no straggler: a single rank")?,
        }
        write!(f, "\n  {}", self.hidden_comm_line())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(total: f64, data: f64, opt: f64, wait: f64, busy: f64) -> StepRecord {
        StepRecord {
            total,
            data,
            optimizer: opt,
            comm_wait: wait,
            comm_busy: busy,
        }
    }

    #[test]
    fn the_rank_that_waits_least_is_the_straggler_and_the_others_wait_for_it() {
        // Rank 1 computes 50 ms longer; rank 0 waits for it inside its communication wait.
        let r0 = vec![rec(0.060, 0.001, 0.002, 0.053, 0.054); 5];
        let r1 = vec![rec(0.060, 0.001, 0.002, 0.003, 0.004); 5];
        let rep = BottleneckReport::from_steps(&[r0, r1]);
        assert_eq!(rep.steps, 4);
        let s = rep.straggler.as_ref().unwrap();
        assert_eq!(s.rank, 1);
        assert!(s.significant);
        assert!((s.slower_by_ms - 50.0).abs() < 1e-6, "{s:?}");
        let r0 = &rep.ranks[0];
        assert!((r0.waiting_ms - 50.0).abs() < 1e-6, "{r0:?}");
        assert!((r0.exposed_comm_ms - 3.0).abs() < 1e-6, "{r0:?}");
        assert!((r0.compute_ms - 4.0).abs() < 1e-6, "{r0:?}");
        assert_eq!(rep.ranks[1].waiting_ms, 0.0);
        // Collective time 4 ms, of which 3 ms exposed: a quarter hidden.
        assert!((rep.ranks[1].hidden_comm_share - 0.25).abs() < 1e-6);
        let text = rep.to_string();
        assert!(text.contains("straggler: rank 1"), "{text}");
    }

    #[test]
    fn even_ranks_have_no_straggler() {
        let r = vec![rec(0.010, 0.0, 0.001, 0.002, 0.002); 4];
        let rep = BottleneckReport::from_steps(&[r.clone(), r]);
        assert!(!rep.straggler.unwrap().significant);
    }
}
