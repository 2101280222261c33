//! `train-digits-burn`: `train-digits` written with Burn — the same MLP (`64 → hidden → 10`,
//! ReLU), the same UCI digits data and fixed 80/20 split, the same flags and the same final
//! `--json` line (all three `ddp_example_support`'s), trained data-parallel with `ddp-burn` on Burn's pure-Rust CPU
//! backend (`burn-flex`).
//!
//! Run directly, it spawns `--nproc` local workers of itself through `ddprs::launcher::spawn`; under
//! `ddprun`, torchrun-style environments, Slurm or `mpirun` (any environment
//! `ddprs::comm::env::EnvConfig` recognises) it is one worker (module [`train`]).

mod learner;
mod model;
mod resume;
mod setup;
mod train;

use clap::{Parser, ValueEnum};
use ddp_example_support::flags::CommonArgs;
use ddprs::launcher::output::ConsoleStyle;
use ddprs::launcher::spawn::{spawn, SpawnOptions};
use ddprs::launcher::validate::int_in;

/// Communication backend (`auto` picks the best available one).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Backend {
    Auto,
    Tcp,
    Shm,
}

/// Data-parallel MLP training on the UCI digits with Burn (1797 8×8 images, fixed 80/20 split).
#[derive(Debug, Clone, Parser)]
#[command(name = "train-digits-burn", version, allow_negative_numbers = true)]
pub struct Args {
    #[command(flatten)]
    pub common: CommonArgs,
    /// Communication backend [default: env DDP_BACKEND, else auto].
    #[arg(long, value_enum)]
    pub backend: Option<Backend>,
    /// Continue from the checkpoint in --checkpoint-dir (a fresh start if there is none). A
    /// checkpoint of another world size resumes too (the rest of its epoch re-sharded over the
    /// new ranks; not a DiLoCo run's, which holds every rank's own state), and any --zero loads any checkpoint of the plain loop: a plain one or a
    /// sharded set, the newer when both are there. --learner resumes its own checkpoints only.
    #[arg(long, requires = "checkpoint_dir")]
    pub resume: bool,
    /// ZeRO stage: 0 (DDP), 1 (optimizer state sharded over the ranks), 2 (+ gradients), with
    /// `ddprs::burn::ZeroDdp`; its checkpoints are sharded sets (one shard per rank).
    #[arg(long, default_value_t = 0, value_parser = int_in::<u8>(0, 2))]
    pub zero: u8,
    /// Train through Burn's own loop (`burn-train`'s `SupervisedTraining` / `Learner`) with
    /// ddp-rs as its training strategy; with --checkpoint-dir Burn's checkpointer writes there.
    #[arg(long)]
    pub learner: bool,
}

fn main() {
    let args = Args::parse();
    // A worker when a launcher (ddprun/torchrun, Slurm, mpirun) set the environment.
    if ddprs::comm::env::EnvConfig::from_env().is_err() {
        std::process::exit(spawn(&SpawnOptions {
            console: ConsoleStyle::Rank0Stdout,
            ..SpawnOptions::new(args.common.nproc)
        }));
    }
    let result = if args.learner {
        learner::run(&args)
    } else {
        train::run(&args)
    };
    if let Err(e) = result {
        let rank = std::env::var("RANK").unwrap_or_default();
        eprintln!("train-digits-burn rank {rank}: error: {e}");
        std::process::exit(1);
    }
}
