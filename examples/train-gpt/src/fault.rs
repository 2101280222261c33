//! `--fault-tolerance` and `--join`: what the training loop records of each regrouping, and how
//! it finds the communication failure under an error.
//!
//! A regrouping (`ddprs::comm::process_group::regroup`) forms the new group; the DDP then drops
//! the failed step and every member takes the most advanced survivor's state
//! (`DdpCore::sync_state`); the windows are re-sharded by the number all ranks consumed, exactly
//! as a checkpoint written at the old world size and resumed at the new one is.

use serde::Serialize;
use std::time::{SystemTime, UNIX_EPOCH};

/// One regrouping, as the final JSON line reports it (`regroups`).
#[derive(Debug, Clone, Serialize)]
pub struct RegroupRecord {
    /// The new group's generation (1 for the first regrouping).
    pub generation: u64,
    /// `lost` (a collective failed) or `joined` (newcomers were taken in).
    pub cause: &'static str,
    /// Steps completed by the state training went on from.
    pub step: u64,
    /// The new world size.
    pub world_size: usize,
    /// Ranks (of the previous group) no longer in the job.
    pub lost: Vec<usize>,
    /// Processes that joined.
    pub joined: usize,
    /// Whether a state was sent (members at different steps, or a newcomer).
    pub state_sent: bool,
    /// From the failure (or the decision to take newcomers in) to the state agreed, in s.
    pub regroup_s: f64,
    /// When the failure was seen (Unix time, ms).
    pub detected_unix_ms: u64,
    /// When the first step at the new world size completed (Unix time, ms).
    pub first_step_unix_ms: Option<u64>,
}

/// Now, in ms since the Unix epoch (benchmarks compare it with the time of a kill).
pub fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// The communication failure under a training step's error, if that is what it is.
pub fn comm_error(e: &(dyn std::error::Error + 'static)) -> Option<ddprs::comm::Error> {
    if let Some(e) = e.downcast_ref::<ddprs::candle::Error>() {
        return e.comm().cloned();
    }
    if let Some(e) = e.downcast_ref::<ddprs::Error>() {
        return e.comm().cloned();
    }
    e.downcast_ref::<ddprs::comm::Error>().cloned()
}

/// Debug hook of the fault-tolerance tests and `bench/ft.sh`: with
/// `TRAIN_GPT_DEBUG_PID_DIR=DIR`, each worker writes its pid to `DIR/rank{RANK}.pid` once it has
/// joined the group (so that a test can SIGKILL a chosen rank at a random moment of its
/// training) and the number of steps it has completed to `DIR/rank{RANK}.step` after each step.
pub struct Beacon {
    step_file: Option<std::path::PathBuf>,
}

impl Beacon {
    pub fn from_env(rank: usize) -> Beacon {
        let Ok(dir) = std::env::var("TRAIN_GPT_DEBUG_PID_DIR") else {
            return Beacon { step_file: None };
        };
        let dir = std::path::Path::new(&dir);
        let path = dir.join(format!("rank{rank}.pid"));
        let tmp = path.with_extension("tmp");
        if std::fs::write(&tmp, std::process::id().to_string()).is_ok() {
            let _ = std::fs::rename(tmp, path);
        }
        Beacon {
            step_file: Some(dir.join(format!("rank{rank}.step"))),
        }
    }

    /// `done` steps completed.
    pub fn step(&self, done: u64) {
        if let Some(f) = &self.step_file {
            let _ = std::fs::write(f, done.to_string());
        }
    }
}
