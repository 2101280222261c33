//! `ddp-allreduce-check`: a smoke test for a launch setup. Each rank joins the default process
//! group from its environment (ddprun/torchrun, Slurm or OpenMPI variables), all-reduces a
//! buffer filled with `rank + 1`, and checks that every element equals `1 + 2 + ... + world`.
//! Prints one `all_reduce ok` line per rank (ending with the group's topology, e.g. `topology
//! shm: 4 ranks on one host`) and exits 0, or names what went wrong and exits 1.
//!
//! ```text
//! ddprun --nproc-per-node 4 ddp-allreduce-check
//! mpirun -np 4 ddp-allreduce-check
//! ```
//!
//! Options (for tests of restarts): `--elements N` (default 4096), `--timeout SECS` (default
//! 60), `--fail-rank R --fail-attempt K`: rank R exits with status 1 after one successful
//! all-reduce when `TORCHELASTIC_RESTART_COUNT` is K; `--exit-rank R`: rank R exits with status
//! 0 at once, without joining the group (a worker that returns early).

use ddp_comm::env::EnvConfig;
use ddp_comm::{init_process_group, InitOptions, ReduceOp};
use ddprun::validate::{int_in, MAX_SECS};
use std::time::{Duration, Instant};

/// Largest buffer accepted: 1 GiB of f32.
const MAX_ELEMENTS: u64 = 1 << 28;

struct Opts {
    elements: usize,
    timeout: Duration,
    fail_rank: Option<usize>,
    fail_attempt: u32,
    exit_rank: Option<usize>,
}

fn parse_opts() -> Result<Opts, String> {
    let mut o = Opts {
        elements: 4096,
        timeout: Duration::from_secs(60),
        fail_rank: None,
        fail_attempt: 0,
        exit_rank: None,
    };
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut value = |name: &str| args.next().ok_or_else(|| format!("{name} needs a value"));
        let num = |name: &str, v: String, max: u64| {
            int_in::<u64>(0, max)(&v).map_err(|e| format!("{name}: {e}"))
        };
        match a.as_str() {
            "--elements" => {
                o.elements = num("--elements", value("--elements")?, MAX_ELEMENTS)? as usize;
                if o.elements == 0 {
                    return Err("--elements: must be at least 1".into());
                }
            }
            "--timeout" => {
                let t = num("--timeout", value("--timeout")?, MAX_SECS)?;
                if t == 0 {
                    return Err("--timeout: must be at least 1 second".into());
                }
                o.timeout = Duration::from_secs(t);
            }
            "--fail-rank" => {
                o.fail_rank =
                    Some(num("--fail-rank", value("--fail-rank")?, u32::MAX as u64)? as usize)
            }
            "--fail-attempt" => {
                o.fail_attempt =
                    num("--fail-attempt", value("--fail-attempt")?, u32::MAX as u64)? as u32
            }
            "--exit-rank" => {
                o.exit_rank =
                    Some(num("--exit-rank", value("--exit-rank")?, u32::MAX as u64)? as usize)
            }
            "-h" | "--help" => {
                println!(
                    "usage: ddp-allreduce-check [--elements N] [--timeout SECS] \
                     [--fail-rank R --fail-attempt K] [--exit-rank R]"
                );
                std::process::exit(0);
            }
            other => return Err(format!("unknown argument {other:?} (see --help)")),
        }
    }
    Ok(o)
}

fn run(o: &Opts) -> Result<String, String> {
    let env = EnvConfig::from_env().map_err(|e| e.to_string())?;
    if o.exit_rank == Some(env.rank) {
        eprintln!(
            "ddp-allreduce-check: rank {}: exiting with status 0 without joining (--exit-rank)",
            env.rank
        );
        std::process::exit(0);
    }
    let start = Instant::now();
    let pg = init_process_group(InitOptions {
        timeout: o.timeout,
        ..Default::default()
    })
    .map_err(|e| format!("rank {}: init_process_group failed: {e}", env.rank))?;
    let (rank, world) = (pg.rank(), pg.size());
    let init_time = start.elapsed();
    let mut buf = vec![(rank + 1) as f32; o.elements];
    let t = Instant::now();
    pg.all_reduce(&mut buf, ReduceOp::Sum)
        .map_err(|e| format!("rank {rank}: all_reduce failed: {e}"))?;
    let reduce_time = t.elapsed();
    let expected = (world * (world + 1) / 2) as f32;
    if let Some((i, v)) = buf.iter().enumerate().find(|(_, &v)| v != expected) {
        return Err(format!(
            "rank {rank}: element {i} is {v}, expected {expected} (sum of 1..={world})"
        ));
    }
    if o.fail_rank == Some(rank) && env.restart_count == o.fail_attempt {
        // Say why before the group is dropped: closing the connections makes the peers fail,
        // and the launcher stops this process as soon as one of them exits.
        eprintln!(
            "ddp-allreduce-check: rank {rank}: failing on purpose on attempt {} \
             (--fail-rank/--fail-attempt)",
            env.restart_count
        );
        std::process::exit(1);
    }
    pg.barrier()
        .map_err(|e| format!("rank {rank}: barrier failed: {e}"))?;
    Ok(format!(
        "rank {rank}/{world}: all_reduce ok (sum {expected}, {} elements) launcher {:?} \
         master {}:{} attempt {} init {:.0} ms all_reduce {:.1} ms topology {}",
        o.elements,
        env.launcher,
        env.master_addr,
        env.master_port,
        env.restart_count,
        init_time.as_secs_f64() * 1e3,
        reduce_time.as_secs_f64() * 1e3,
        pg.topology()
    ))
}

fn main() {
    let result = match parse_opts() {
        Ok(o) => run(&o),
        Err(e) => {
            eprintln!("ddp-allreduce-check: error: {e}");
            std::process::exit(2);
        }
    };
    match result {
        Ok(line) => println!("{line}"),
        Err(e) => {
            eprintln!("ddp-allreduce-check: {e}");
            std::process::exit(1);
        }
    }
}
