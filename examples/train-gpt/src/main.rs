//! `train-gpt`: nanoGPT's character-level GPT on Shakespeare's plays (`data/`), data-parallel
//! with ddp-rs, on candle (`--framework candle`, through `ddprs::candle`) or Burn
//! (`--framework burn`, through `ddprs::burn`): the same data, split, flags and final JSON line.
//! The defaults are nanoGPT's `shakespeare_char` recipe in its small CPU configuration (4
//! layers, 4 heads, 128-dim embeddings, context 64, batch 12 per rank, 2000 steps, dropout 0).
//!
//! Run directly, it spawns `--nproc` local workers of itself (`ddprs::launcher::spawn`); under
//! `ddprun`, torchrun-style environments, Slurm or `mpirun` it is one worker.

#![forbid(unsafe_code)]

mod config;
mod data;
mod fault;
mod gpt_burn;
mod gpt_candle;
mod outer;
mod report;
mod saver;
mod train_burn;
mod train_candle;

use clap::Parser;
use config::{Args, Framework};
use ddprs::comm::process_group::RegroupOptions;
use ddprs::launcher::output::ConsoleStyle;
use ddprs::launcher::spawn::{spawn, SpawnOptions};

fn main() {
    let args = Args::parse();
    if let Err(e) = args.check() {
        eprintln!("train-gpt: error: {e}");
        std::process::exit(2);
    }
    if ddprs::comm::env::EnvConfig::from_env().is_err() {
        if args.joining() {
            eprintln!(
                "train-gpt: error: --join needs the running job's store: set MASTER_ADDR, \
                 MASTER_PORT, RANK and WORLD_SIZE as for a worker (RANK and WORLD_SIZE are \
                 not used: the job assigns them)"
            );
            std::process::exit(2);
        }
        std::process::exit(spawn(&SpawnOptions {
            console: ConsoleStyle::Rank0Stdout,
            fault_tolerance: args.fault_tolerance,
            ..SpawnOptions::new(args.nproc)
        }));
    }
    if let Err(e) = worker(&args) {
        let rank = std::env::var("RANK").unwrap_or_default();
        eprintln!("train-gpt rank {rank}: error: {e}");
        std::process::exit(1);
    }
}

fn worker(args: &Args) -> Result<(), Box<dyn std::error::Error>> {
    let init = ddprs::InitOptions {
        timeout: std::time::Duration::from_secs_f64(args.timeout),
        ..Default::default()
    };
    let mut pg = match args.joining() {
        true => {
            let opts = RegroupOptions::from_env()?;
            ddprs::comm::process_group::join_process_group(init, &opts)?.group
        }
        false => ddprs::init_process_group(init)?,
    };
    ddprs::trace::start_from_env(&pg, args.trace.as_deref())?;
    let report = match args.framework {
        Framework::Candle => train_candle::run(args, &mut pg, args.joining())?,
        Framework::Burn => train_burn::run(args, &pg)?,
    };
    if let Some(path) = ddprs::trace::finish(&pg)? {
        println!("timeline of every rank: {}", path.display());
    }
    report.print();
    Ok(())
}
