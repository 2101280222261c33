//! Starting the local workers of the current program from inside it: the role of
//! `torch.multiprocessing.spawn`, with `ddprun`'s supervision.
//!
//! A Rust program cannot hand a closure to a new process, so the workers are the program itself,
//! started again with the same arguments and the worker environment (`RANK`, `WORLD_SIZE`,
//! `MASTER_PORT`, ...; see [`crate::worker_env`]). `main` asks [`is_worker`] and either trains
//! or launches:
//!
//! ```no_run
//! use ddprun::spawn::{self, SpawnOptions};
//!
//! fn train() -> i32 {
//!     // let pg = ddp_comm::init_process_group(Default::default())?; ...
//!     0
//! }
//!
//! fn main() {
//!     // Under `ddprun`/torchrun-style launchers, or as a spawned worker: train.
//!     // Run directly: start 4 workers of this program and supervise them.
//!     std::process::exit(spawn::run_or_spawn(&SpawnOptions::new(4), train));
//! }
//! ```
//!
//! [`spawn`] is `ddprun`'s own launcher loop ([`crate::agent`]) on one node, so the workers get
//! exactly what `ddprun --standalone --nproc-per-node N` gives them:
//!
//! - the rendezvous store hosted by the launcher, on a free port unless
//!   [`SpawnOptions::master_port`] says otherwise;
//! - each worker in its own process group, SIGKILLed by the kernel if the launcher dies
//!   (parent-death signal), and an orphan guard and child subreaper for what the workers start
//!   ([`crate::guard`]);
//! - SIGINT, SIGTERM, SIGHUP and SIGQUIT sent to the launcher forwarded to every worker, SIGKILL
//!   after the grace period;
//! - the first failure stops the others and is summarized (rank, exit code or signal, stderr
//!   tail), with restarts if [`SpawnOptions::max_restarts`] allows; or, with
//!   [`SpawnOptions::fault_tolerance`] (`ddprun --fault-tolerance`), the others go on without
//!   the failed worker;
//! - `ddprun`'s exit status: 0, 1 when a worker failed, 128+N when the launcher got signal N, 2
//!   for invalid options.
//!
//! Call it from the thread that will wait for it (it blocks until the workers are done; the
//! parent-death signal is tied to the calling thread). It installs handlers for the forwarded
//! signals and makes the process a child subreaper for the rest of its life, and at the end of
//! every attempt it kills the children of the process that it did not have when `spawn` was
//! called (workers' orphans adopted as subreaper): use the process as a launcher only.

use crate::cli::{check_local_workers, Config, StdSpec, Streams};
use crate::output::ConsoleStyle;
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

/// How to start the workers. `SpawnOptions::new(n)` (or `Default`, one worker) gives `ddprun`'s
/// defaults on one node with a free port.
#[derive(Debug, Clone)]
pub struct SpawnOptions {
    /// Number of worker processes (`nprocs` of `mp.spawn`), 1 to [`crate::cli::MAX_LOCAL_WORKERS`].
    pub nprocs: usize,
    /// `MASTER_ADDR` the workers get, and where the store listens (default `127.0.0.1`).
    pub master_addr: String,
    /// Store port; 0 (the default) picks a free one.
    pub master_port: u16,
    /// Restart the whole group up to this many times after a failure (default 0).
    pub max_restarts: u32,
    /// `ddprun --fault-tolerance` (default off): a worker that fails no longer stops the others;
    /// the survivors regroup in place (the workers must support it: ddp-rs's
    /// `--fault-tolerance` training loops do) and get `DDP_FAULT_TOLERANCE=1`. The launcher
    /// exits with 0 when the workers that failed did so before the first one finished with
    /// status 0, else 1 with the summary.
    pub fault_tolerance: bool,
    /// Between SIGTERM and SIGKILL when stopping workers (default 5 s).
    pub stop_grace_period: Duration,
    /// Between checks of the workers and signals (default 100 ms).
    pub monitor_interval: Duration,
    /// Console layout of worker output (default [`ConsoleStyle::Prefixed`], `ddprun`'s).
    pub console: ConsoleStyle,
    /// Per-rank log files under `DIR/RUN_ID/attempt_K/RANK/` besides the console.
    pub log_dir: Option<PathBuf>,
    /// Job id (`TORCHELASTIC_RUN_ID`); default a fresh random one.
    pub run_id: Option<String>,
    /// Worker command line; default this executable with this process's arguments.
    pub program: Option<Vec<String>>,
}

impl SpawnOptions {
    /// `nprocs` workers, everything else default.
    pub fn new(nprocs: usize) -> SpawnOptions {
        SpawnOptions {
            nprocs,
            ..SpawnOptions::default()
        }
    }

    /// The launcher configuration these options stand for (errors name the bad option).
    pub fn to_config(&self) -> Result<Config, String> {
        let nproc = check_local_workers(self.nprocs).map_err(|e| format!("nprocs: {e}"))?;
        for (name, d) in [
            ("stop_grace_period", self.stop_grace_period),
            ("monitor_interval", self.monitor_interval),
        ] {
            if d.is_zero() {
                return Err(format!("{name} must be positive"));
            }
        }
        let program = match &self.program {
            Some(p) if p.is_empty() => return Err("program is empty".into()),
            Some(p) => p.clone(),
            None => {
                let exe = std::env::current_exe()
                    .map_err(|e| format!("cannot locate this program's executable: {e}"))?;
                std::iter::once(exe.to_string_lossy().into_owned())
                    .chain(std::env::args().skip(1))
                    .collect()
            }
        };
        let run_id = self
            .run_id
            .clone()
            .unwrap_or_else(crate::cli::random_run_id);
        if run_id.is_empty() || run_id.contains(['/', '\0']) || run_id == "." || run_id == ".." {
            return Err(format!(
                "run id `{run_id}` must be non-empty and contain no `/`"
            ));
        }
        let tee = StdSpec {
            all: if self.log_dir.is_some() {
                Streams::ALL
            } else {
                Streams::NONE
            },
            per_local_rank: BTreeMap::new(),
        };
        Ok(Config {
            nproc_per_node: nproc,
            nnodes: 1,
            node_rank: 0,
            master_addr: self.master_addr.clone(),
            master_port: self.master_port,
            run_id,
            max_restarts: self.max_restarts,
            fault_tolerance: self.fault_tolerance,
            monitor_interval: self.monitor_interval,
            rdzv_timeout: Duration::from_secs(900),
            stop_grace_period: self.stop_grace_period,
            redirects: StdSpec::default(),
            tee,
            log_dir: self.log_dir.clone(),
            local_ranks_filter: None,
            console: self.console,
            program,
            elastic: None,
            store_max_bytes: ddp_comm::store::DEFAULT_MAX_BYTES,
        })
    }
}

impl Default for SpawnOptions {
    fn default() -> SpawnOptions {
        SpawnOptions {
            nprocs: 1,
            master_addr: "127.0.0.1".into(),
            master_port: 0,
            max_restarts: 0,
            fault_tolerance: false,
            stop_grace_period: Duration::from_secs(5),
            monitor_interval: Duration::from_millis(100),
            console: ConsoleStyle::Prefixed,
            log_dir: None,
            run_id: None,
            program: None,
        }
    }
}

/// Whether this process is a worker: `RANK` and `WORLD_SIZE` are set (by [`spawn`], `ddprun`,
/// torchrun or a job script).
pub fn is_worker() -> bool {
    std::env::var_os("RANK").is_some() && std::env::var_os("WORLD_SIZE").is_some()
}

/// Start `opts.nprocs` workers, supervise them until they are done and return the launcher's
/// exit status (`ddprun`'s; 2 with a message on stderr for invalid options).
pub fn spawn(opts: &SpawnOptions) -> i32 {
    match opts.to_config() {
        Ok(cfg) => crate::launch::run(&cfg),
        Err(e) => {
            eprintln!("ddprun::spawn: error: {e}");
            2
        }
    }
}

/// `worker()` when [`is_worker`], else [`spawn`]`(opts)`: the whole `main` of a program that
/// launches itself.
pub fn run_or_spawn(opts: &SpawnOptions, worker: impl FnOnce() -> i32) -> i32 {
    if is_worker() {
        worker()
    } else {
        spawn(opts)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn options_become_a_single_node_config() {
        let c = SpawnOptions::new(3).to_config().unwrap();
        assert_eq!((c.nproc_per_node, c.nnodes, c.master_port), (3, 1, 0));
        assert_eq!(c.master_addr, "127.0.0.1");
        assert!(c.run_id.starts_with("standalone-"));
        assert_eq!(
            c.program[0],
            std::env::current_exe().unwrap().to_string_lossy()
        );
        assert!(!c.tee.any());
        assert!(!c.fault_tolerance, "off unless asked for");
        let c = SpawnOptions {
            fault_tolerance: true,
            ..SpawnOptions::new(2)
        }
        .to_config()
        .unwrap();
        assert!(c.fault_tolerance);
        let c = SpawnOptions {
            log_dir: Some("/tmp/l".into()),
            program: Some(vec!["w".into()]),
            ..SpawnOptions::new(1)
        }
        .to_config()
        .unwrap();
        assert_eq!(
            (c.tee.all, c.program.as_slice()),
            (Streams::ALL, &["w".to_string()][..])
        );
    }

    #[test]
    fn bad_options_are_named() {
        let e = |o: SpawnOptions| o.to_config().unwrap_err();
        assert!(e(SpawnOptions::new(0)).contains("nprocs: must be at least 1"));
        assert!(e(SpawnOptions::new(usize::MAX)).contains("at most 4096"));
        assert!(e(SpawnOptions {
            stop_grace_period: Duration::ZERO,
            ..SpawnOptions::new(1)
        })
        .contains("stop_grace_period"));
        assert!(e(SpawnOptions {
            program: Some(vec![]),
            ..SpawnOptions::new(1)
        })
        .contains("program is empty"));
    }
}
