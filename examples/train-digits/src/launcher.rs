//! Local launcher: `train-digits` run directly starts `--nproc` workers of itself with
//! [`ddprs::launcher::spawn`], torchrun-style: the same worker environment, supervision and exit status as
//! `ddprun --standalone --nproc-per-node N train-digits ...` (a free `MASTER_PORT`; workers die
//! with the launcher, SIGINT/SIGTERM forwarded, the first failure stops the others and is
//! summarized with its rank, exit code or signal and stderr tail; exit status 1 then, 128+N
//! after signal N).
//!
//! Rank 0's stdout is passed through unprefixed (so `--json`'s last line stays
//! machine-readable); everything else goes to stderr prefixed with `[rankN]: `.

use ddprs::launcher::output::ConsoleStyle;
use ddprs::launcher::spawn::{spawn, SpawnOptions};

/// Start `nproc` workers running this program with this process's arguments; returns the exit
/// status.
pub fn launch(nproc: usize) -> i32 {
    spawn(&SpawnOptions {
        console: ConsoleStyle::Rank0Stdout,
        ..SpawnOptions::new(nproc)
    })
}
