//! `ddprun`: the ddp-rs launcher, torchrun's flags and worker-environment contract for Rust
//! programs (`ddprun --nproc-per-node 4 ./train`).
//!
//! Modules, in the order a run uses them:
//! - [`cli`]: flags (torchrun's names) → [`cli::Config`].
//! - [`rendezvous`]: node 0 hosts the `ddp_comm` TCP store; every node joins a round per attempt.
//! - [`elastic`]: `--nnodes MIN:MAX`: rounds that shrink and grow, heartbeats through the store.
//! - [`worker_env`]: the variables each worker gets (`RANK`, `WORLD_SIZE`, ...).
//! - [`process`]: spawning and reaping workers (own process group, parent-death signal).
//! - [`output`]: `[rankN]: ` prefixed console output, per-rank log files, stderr tails.
//! - [`signals`]: catching and forwarding SIGINT/SIGTERM, signal names.
//! - [`summary`]: the root-cause report of a failure.
//! - [`agent`]: the control loop tying them together (supervision, stopping, restarts).
//! - [`guard`]: the orphan guard and child subreaper (workers' children die with them).
//! - [`spawn`]: the same launcher started from inside a program (`torch.multiprocessing.spawn`).
//! - [`validate`]: flag value parsers shared by the binaries.

pub mod agent;
pub mod cli;
pub mod elastic;
pub mod guard;
pub mod launch;
pub mod output;
pub mod process;
pub mod rendezvous;
pub mod signals;
pub mod spawn;
pub mod summary;
pub mod validate;
pub mod worker_env;

pub use cli::{Args, Config};

/// Parse `args` (without the program name handling: pass `std::env::args()`), run the job and
/// return the launcher's exit status. Command-line errors print clap's message and return 2.
pub fn main_with_args(args: impl IntoIterator<Item = String>) -> i32 {
    use clap::Parser;
    let args = match Args::try_parse_from(args) {
        Ok(a) => a,
        Err(e) => {
            let code = e.exit_code();
            let _ = e.print();
            return code;
        }
    };
    let cfg = match args.into_config() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("ddprun: error: {e}");
            return 2;
        }
    };
    launch::run(&cfg)
}

/// The book's launcher chapter (`docs/launching.md`), compiled as doctests (`cargo test
/// --workspace` runs them).
#[cfg(doctest)]
#[doc = include_str!("../../../docs/launching.md")]
pub struct BookLaunchingDoctests;
