//! Elastic jobs (`--nnodes MIN:MAX`, torchrun's c10d rendezvous): every node is started with the
//! same flags, ranks are assigned at each rendezvous round ([`rdzv`]), a lost node (dead, or
//! silent past `--heartbeat-timeout`: [`heartbeat`]) makes the others go on at the smaller world
//! size while at least MIN remain, and a node that arrives while a round runs is admitted at the
//! next one (the running workers are stopped, as torchrun does, and restarted with it). With
//! `--fault-tolerance` neither starts a new round: the workers change membership in place.
//!
//! With `--fault-tolerance` (on every node: it is checked like `--nnodes`) the workers regroup
//! themselves through the job's store (`ddp_comm::process_group::regroup`), so:
//!
//! - **A lost node** (declared dead by its heartbeat, or stopped by a signal) does not end the
//!   round: every other launcher says so once (`node id 2 (...) lost: no heartbeat ...;
//!   --fault-tolerance: the workers go on in place`) and keeps its workers running; no new
//!   round, no restart used. Only when fewer than MIN live nodes remain does the round end as
//!   without the flag.
//! - **An arriving node** joins the running round `R` itself: the round's `r/R/closed` entry in
//!   the rendezvous store (its member list) existing while `r/R/end` does not is what "round `R`
//!   runs" means, so the arriving launcher appends its node id to that list (compare-and-set)
//!   if fewer than MAX of the listed nodes are live and none is done yet. It then starts its
//!   workers with `DDP_FT_JOIN=1`, `DDP_RDZV_ROUND=R` and the usual `MASTER_ADDR`/`MASTER_PORT`
//!   (the running workers' store is the rendezvous store itself, which every launcher reaches
//!   at its `--rdzv-endpoint`, so no address needs recording), with placeholder ranks: its slot
//!   after every node listed before it (lost ones included), so that they stay unique within
//!   the round (log directories, exit notes). The workers call `join_process_group` and get
//!   their rank when the running job takes them in at a step boundary. The running launchers do
//!   nothing but report the arrival and, from then on, watch the new node's heartbeat and wait
//!   for its workers at the end. A node that would exceed MAX waits as a spare for the next
//!   round, and is admitted in place as soon as a node is lost.
//!
//! A node whose own workers fail still ends the round (`--max-restarts` decides), as does the
//! loss of the node serving the store: the store goes with it.
//!
//! `--max-restarts` counts failures as torchrun does: a worker failure or a lost node uses one,
//! a round started for arriving nodes does not.

pub mod heartbeat;
pub mod rdzv;
pub mod records;

use crate::agent::{logs_note, signal_exit, supervise, Housekeeping, Launch, Outcome};
use crate::cli::Config;
use crate::rendezvous::{RemoteFailure, Stop};
use crate::signals::{self, signal_name};
use crate::summary::{format_summary, SummaryContext};
use rdzv::{ElasticRdzv, End, Round};
use std::time::Duration;

/// Poll period while waiting for other nodes in a rendezvous round.
const RDZV_POLL: Duration = Duration::from_millis(50);

/// What the control loop does after a round.
enum Next {
    /// Join this round.
    Join(u32),
    Exit(i32),
}

/// Run an elastic job (`cfg.elastic` is set); returns the launcher's exit status.
pub(crate) fn run(cfg: &Config, host: &str, house: &Housekeeping) -> i32 {
    let conf = cfg.elastic.clone().expect("an elastic configuration");
    let rdzv = match ElasticRdzv::start(cfg, &conf, host, &mut signals::take_pending) {
        Ok(r) => r,
        Err(Stop::Signal(sig)) => {
            eprintln!(
                "ddprun: received {} while connecting to the store; exiting",
                signal_name(sig)
            );
            return signal_exit(sig);
        }
        Err(e) => {
            eprintln!("ddprun: error: {}", describe(&e));
            return 1;
        }
    };
    eprintln!(
        "ddprun: elastic node id {} ({host}, pid {}): {} the rendezvous store at {}, --nnodes \
         {}:{}, run id {}, last call {:?}, heartbeat timeout {:?}",
        rdzv.me.id,
        rdzv.me.pid,
        if rdzv.hosts_store() {
            "serving"
        } else {
            "using"
        },
        rdzv.endpoint,
        conf.min_nodes,
        conf.max_nodes,
        cfg.run_id,
        conf.last_call,
        conf.heartbeat_timeout
    );
    let mut next = match rdzv.first_round() {
        Ok(r) => Next::Join(r),
        Err(e) => {
            eprintln!("ddprun: error: {}", describe(&e));
            Next::Exit(1)
        }
    };
    let code = loop {
        match next {
            Next::Join(round) => next = run_round(cfg, &rdzv, host, round, house),
            Next::Exit(code) => break code,
        }
    };
    rdzv.finish(cfg.stop_grace_period + Duration::from_secs(30));
    code
}

fn describe(stop: &Stop) -> String {
    match stop {
        Stop::Signal(sig) => format!("stopped by {}", signal_name(*sig)),
        Stop::Remote(f) => f.what.clone(),
        Stop::Error(e) | Stop::Rejoin(e) | Stop::JobDone(e) => e.clone(),
    }
}

fn run_round(
    cfg: &Config,
    rdzv: &ElasticRdzv,
    host: &str,
    round: u32,
    house: &Housekeeping,
) -> Next {
    let r = match rdzv.join(round, RDZV_POLL, &mut signals::take_pending) {
        Ok(r) => r,
        Err(stop) => return after_stop(cfg, rdzv, round, None, stop),
    };
    let last = r.rank_offset + cfg.nproc_per_node - 1;
    if r.joined {
        eprintln!(
            "ddprun: round {}: node id {} ({host}) joins the running round in place \
             (--fault-tolerance): its {} worker(s) get DDP_FT_JOIN=1 and their ranks from the job \
             (placeholders {}..={last}), store {}, run id {}, restart count {}{}",
            r.round,
            rdzv.me.id,
            cfg.nproc_per_node,
            r.rank_offset,
            rdzv.endpoint,
            cfg.run_id,
            r.restarts,
            logs_note(cfg)
        );
    } else {
        eprintln!(
            "ddprun: round {}: node {} of {} ({host}): ranks {}..={last} of world size {}, store \
             {}, run id {}, restart count {}{}",
            r.round,
            r.node_rank,
            r.members.len(),
            r.rank_offset,
            r.world_size,
            rdzv.endpoint,
            cfg.run_id,
            r.restarts,
            logs_note(cfg)
        );
    }
    let launch = Launch {
        master_addr: rdzv.master_addr.clone(),
        master_port: rdzv.master_port,
        restart_count: r.restarts,
        round: r.round,
        rank_offset: r.rank_offset,
        world_size: r.world_size,
        node_rank: r.node_rank,
        nnodes: r.members.len(),
        ft_join: r.joined,
    };
    let mut poll = || match rdzv.poll(&r) {
        Ok(None) => None,
        Ok(Some(end)) => Some(end_stop(&r, end)),
        Err(stop) => Some(stop),
    };
    let mut note = |rank: usize, how: &str| {
        // A joining worker's rank is a placeholder: nobody waits for it under that number.
        if !r.joined {
            rdzv.note_exit(r.round, rank, how)
        }
    };
    let outcome = supervise(
        cfg,
        &launch,
        host,
        house.guard.as_ref(),
        &mut poll,
        &mut note,
    );
    house.sweep();
    match outcome {
        Outcome::Success => {
            let waited = rdzv
                .report_done(r.round)
                .and_then(|()| wait_for_members(cfg, rdzv, &r));
            match waited {
                Ok(()) => {
                    rdzv.set_finished(r.round);
                    Next::Exit(0)
                }
                Err(stop) => after_stop(cfg, rdzv, r.round, Some(&r), stop),
            }
        }
        Outcome::Failed(failures) => {
            let restart = r.restarts < cfg.max_restarts;
            let mine = End::Failure {
                restart,
                node: rdzv.me.id,
                what: failures[0].one_line(),
            };
            let end = rdzv.end_round(r.round, &mine).unwrap_or(mine.clone());
            let (next_text, next) = match &end {
                End::Failure { restart: true, .. } => (
                    format!(
                        "ddprun: rejoining the rendezvous (restart {} of at most {})",
                        r.restarts + 1,
                        cfg.max_restarts
                    ),
                    Next::Join(r.round + 1),
                ),
                End::Join(_) => (
                    "ddprun: nodes wait to join: rejoining the rendezvous".to_string(),
                    Next::Join(r.round + 1),
                ),
                End::Failure { .. } if cfg.max_restarts == 0 => (
                    "ddprun: exiting with status 1 (use --max-restarts K to go on after failures)"
                        .to_string(),
                    Next::Exit(1),
                ),
                End::Failure { .. } => (
                    format!(
                        "ddprun: no restarts left (--max-restarts {}); exiting with status 1",
                        cfg.max_restarts
                    ),
                    Next::Exit(1),
                ),
            };
            let ctx = SummaryContext {
                run_id: &cfg.run_id,
                attempt: r.restarts,
                max_restarts: cfg.max_restarts,
                next: &next_text,
            };
            eprintln!("{}", format_summary(&ctx, &failures));
            next
        }
        Outcome::Stopped(stop) => after_stop(cfg, rdzv, r.round, Some(&r), stop),
        Outcome::SpawnFailed(e) => {
            eprintln!("ddprun: error: {e}");
            let what = format!("{}: {e}", rdzv.me.describe());
            let _ = rdzv.end_round(
                r.round,
                &End::Failure {
                    restart: false,
                    node: rdzv.me.id,
                    what,
                },
            );
            Next::Exit(1)
        }
    }
}

/// A round's end as the supervision loop's reason to stop.
fn end_stop(r: &Round, end: End) -> Stop {
    end.into_stop(|id| {
        r.members
            .iter()
            .position(|m| m.id == id)
            .unwrap_or(usize::MAX)
    })
}

/// After this node's workers all succeeded: wait until every member's have (or the round ends).
fn wait_for_members(cfg: &Config, rdzv: &ElasticRdzv, r: &Round) -> Result<(), Stop> {
    let mut announced = false;
    loop {
        let mut missing = Vec::new();
        for (rank, m) in rdzv.members_now(r)?.iter().enumerate() {
            if rdzv.is_done(r.round, m.id)? {
                continue;
            }
            // --fault-tolerance: a lost node is not waited for (the others went on without it).
            if !(rdzv.fault_tolerance && rdzv.gone(m.id)?) {
                missing.push(rank.to_string());
            }
        }
        if missing.is_empty() {
            return Ok(());
        }
        if let Some(end) = rdzv.poll(r)? {
            return Err(end_stop(r, end));
        }
        if let Some(sig) = signals::take_pending() {
            return Err(Stop::Signal(sig));
        }
        if !announced {
            eprintln!(
                "ddprun: this node's workers finished; waiting for node(s) {}",
                ddp_comm::env::list_bounded(&missing, ddp_comm::env::LIST_SHOWN)
            );
            announced = true;
        }
        std::thread::sleep(cfg.monitor_interval);
    }
}

/// Decide what to do after round `round` was cut short or could not form (workers stopped).
fn after_stop(cfg: &Config, rdzv: &ElasticRdzv, round: u32, r: Option<&Round>, stop: Stop) -> Next {
    match stop {
        Stop::Signal(sig) => {
            let what = format!(
                "{} left the job: stopped by {}",
                rdzv.me.describe(),
                signal_name(sig)
            );
            if let (Some(_), true) = (r, rdzv.fault_tolerance) {
                // The others go on in place without this node (they end the round themselves
                // if fewer than MIN remain).
                rdzv.leave_in_place(&what);
            } else if let Some(r) = r {
                // The others go on without this node if restarts and MIN allow.
                let _ = rdzv.end_round(
                    r.round,
                    &End::Failure {
                        restart: r.restarts < cfg.max_restarts,
                        node: rdzv.me.id,
                        what: what.clone(),
                    },
                );
            }
            eprintln!("ddprun: {what}; exiting with status {}", signal_exit(sig));
            Next::Exit(signal_exit(sig))
        }
        Stop::Error(e) => {
            eprintln!("ddprun: error: {e}");
            Next::Exit(1)
        }
        Stop::JobDone(e) => {
            eprintln!("ddprun: {e}; nothing to do, exiting with status 0");
            Next::Exit(0)
        }
        Stop::Rejoin(what) => {
            eprintln!(
                "ddprun: round {round}: {what}; stopped this node's workers for a new rendezvous \
                 round (a membership change, not counted as a restart)"
            );
            Next::Join(round + 1)
        }
        Stop::Remote(RemoteFailure { restart, what, .. }) => {
            let restarts = r.map_or(0, |r| r.restarts);
            if restart {
                eprintln!(
                    "ddprun: round {round} failed: {what}; rejoining the rendezvous (restart {} \
                     of at most {})",
                    restarts + 1,
                    cfg.max_restarts
                );
                Next::Join(round + 1)
            } else {
                eprintln!(
                    "ddprun: round {round} failed: {what}; no restarts left (--max-restarts {}); \
                     stopped this node's workers; exiting with status 1",
                    cfg.max_restarts
                );
                Next::Exit(1)
            }
        }
    }
}
