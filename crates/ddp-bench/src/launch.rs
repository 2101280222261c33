//! Starting the benchmark's local worker processes: this binary started again by
//! [`ddprun::spawn`] with the torchrun environment, `ddprun`'s supervision and exit status.
//! Rank 0's stdout (the table or JSON rows) is passed through unprefixed.

use ddprun::output::ConsoleStyle;
use ddprun::spawn::SpawnOptions;

pub use ddprun::spawn::is_worker;

/// Spawn `nproc` workers running the same command line; returns the exit status.
pub fn run_local(nproc: usize) -> i32 {
    // One compute thread per rank unless the user says otherwise (candle reads this; inherited,
    // so the launcher's cores-per-worker default does not apply).
    if std::env::var_os("RAYON_NUM_THREADS").is_none() {
        std::env::set_var("RAYON_NUM_THREADS", "1");
    }
    ddprun::spawn::spawn(&SpawnOptions {
        console: ConsoleStyle::Rank0Stdout,
        ..SpawnOptions::new(nproc)
    })
}
