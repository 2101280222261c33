//! In-place regrouping: a job's processes form a new default group without a restart —
//! torchft's quorum, over the job's own rendezvous store.
//!
//! - **A rank is lost.** The survivors' collective fails naming it (the group aborts, as every
//!   failed group does); each survivor calls [`ProcessGroup::regroup`] with that error and gets
//!   a smaller group of the processes still here.
//! - **A process joins.** It calls [`join_process_group`]; the running group notices at its next
//!   step boundary ([`ProcessGroup::joiners_waiting`], a one-byte broadcast from rank 0), every
//!   member calls [`ProcessGroup::regroup`] with no error, and the group that forms includes the
//!   newcomer, numbered after the members.
//!
//! What the processes agree on, under the key prefix `ft/g{G}/` of the job's store for the new
//! generation `G` (the default group is generation 0):
//!
//! ```text
//!   survivor: [lost/{r} += 1, lost_count += 1]   (the peer its error names, when gone)
//!             arrived += 1 → idx; who/{idx} = "s {old rank}"
//!             idx 1 (the decider): open = old size; waits until arrived = old size − lost +
//!             joiners, or the window passes; members = idx order (survivors by old rank, then
//!             newcomers); ft/generation = G
//!   newcomer: joiners += 1; waits for open; arrived += 1 → idx; who/{idx} = "j"
//!   all:      wait for members; not listed → arrived too late: Error::Excluded (a newcomer
//!             tries the next generation); listed → connect rank = position, as a new group
//! ```
//!
//! The decider is always a survivor (newcomers arrive only once `open` exists), so it knows the
//! old size. The window (default 1 s, [`WINDOW_ENV`]) bounds how long survivors wait for a
//! member that did not report: a survivor still computing reaches its failed collective within
//! one step, so the window should exceed a step's compute time. A process cut off from the
//! others (a partition) is excluded if it reaches the store late, or fails on the store.
//!
//! What it needs: a store that outlives the ranks (`ddprun` hosts it; a job whose rank 0 hosts
//! the store cannot survive losing rank 0), the default group (not a subgroup, not MPI). What the
//! training state does across a regroup (drop the failed step, resynchronize, re-shard the data)
//! is the training loop's: `ddp-core`'s `fault` module.

use super::init::{plan_default_group, GroupPlan};
use super::{InitOptions, ProcessGroup, RegroupBase};
use crate::backend::{Backend, BackendPlan};
use crate::store::{PrefixStore, Store};
use crate::{Error, Result};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Env var turning fault tolerance on for a job (`1`); `ddprun --fault-tolerance` sets it for its
/// workers. Read by training loops, not by this module.
pub const FAULT_TOLERANCE_ENV: &str = "DDP_FAULT_TOLERANCE";

/// Env var of [`RegroupOptions::window`], in milliseconds.
pub const WINDOW_ENV: &str = "DDP_FT_WINDOW_MS";

/// Default [`RegroupOptions::window`].
pub const DEFAULT_WINDOW: Duration = Duration::from_secs(1);

/// Whether [`FAULT_TOLERANCE_ENV`] is set to `1` (or `true`).
pub fn fault_tolerance_from_env() -> bool {
    std::env::var(FAULT_TOLERANCE_ENV)
        .map(|v| matches!(v.trim(), "1" | "true"))
        .unwrap_or(false)
}

/// How a regrouping waits and what it accepts.
#[derive(Debug, Clone)]
pub struct RegroupOptions {
    /// How long the first survivor to arrive waits for the others before closing the new
    /// membership; it closes at once when every process it expects has arrived (default
    /// [`DEFAULT_WINDOW`], env [`WINDOW_ENV`]).
    pub window: Duration,
    /// The fewest members the new group may have (default 1): fewer, and every arrived process
    /// fails with [`Error::Excluded`].
    pub min_size: usize,
}

impl Default for RegroupOptions {
    fn default() -> Self {
        RegroupOptions {
            window: DEFAULT_WINDOW,
            min_size: 1,
        }
    }
}

impl RegroupOptions {
    /// The defaults, with the window from [`WINDOW_ENV`] when set.
    pub fn from_env() -> Result<Self> {
        let mut opts = RegroupOptions::default();
        if let Ok(v) = std::env::var(WINDOW_ENV) {
            let ms: u64 = v.trim().parse().map_err(|_| {
                Error::Config(format!(
                    "{WINDOW_ENV}={v:?} is not a number of milliseconds"
                ))
            })?;
            opts.window = Duration::from_millis(ms);
        }
        Ok(opts)
    }
}

/// A group formed by a regrouping, and who is in it.
#[derive(Debug)]
pub struct Regrouped {
    /// The new default group: rank `i < survivors.len()` is the survivor that had rank
    /// `survivors[i]`, the ranks after it are the newcomers.
    pub group: ProcessGroup,
    /// Its generation (the default group of `init_process_group` is 0).
    pub generation: u64,
    /// The old ranks of the members that were in the previous group, in their new order.
    pub survivors: Vec<usize>,
    /// How many newcomers joined.
    pub joined: usize,
    /// The old ranks not in the new group.
    pub lost: Vec<usize>,
    /// This process's rank in the previous group (`None` for a newcomer).
    pub previous_rank: Option<usize>,
}

/// What a process brings to the meeting.
#[derive(Clone, Copy)]
enum Arrival {
    /// A member of the old group of `size`, its `rank`, and the peer its failure says is gone.
    Survivor {
        rank: usize,
        size: usize,
        lost: Option<usize>,
    },
    Newcomer,
}

/// One member of a decided membership.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Member {
    Survivor { idx: usize, rank: usize },
    Newcomer { idx: usize },
}

impl Member {
    fn idx(self) -> usize {
        match self {
            Member::Survivor { idx, .. } | Member::Newcomer { idx } => idx,
        }
    }
}

fn key(g: u64, what: &str) -> String {
    format!("ft/g{g}/{what}")
}

const GENERATION_KEY: &str = "ft/generation";

impl ProcessGroup {
    /// Form a new group of the processes still here (and any that asked to join): a collective
    /// over whoever arrives within the window (see the module doc). `cause`: the error of the
    /// collective that failed, whose lost peer lets the membership close without waiting out
    /// the window; `None` when regrouping to let newcomers in. This group (aborted or not) should
    /// be dropped afterwards; the new one replaces it everywhere.
    pub fn regroup(&self, cause: Option<&Error>, opts: &RegroupOptions) -> Result<Regrouped> {
        let (Some(base), Some(plan)) = (&self.inner.regroup, &self.inner.plan) else {
            return Err(Error::Config(
                "regroup: only a default group (from init_process_group, join_process_group or \
                 a regrouping) of a store-based backend can regroup, not a subgroup or MPI"
                    .into(),
            ));
        };
        let g = base.generation + 1;
        let arrival = Arrival::Survivor {
            rank: self.rank(),
            size: self.size(),
            lost: cause.and_then(Error::lost_peer),
        };
        let (members, me) =
            meet(&*base.store, g, arrival, opts, plan.timeout)?.ok_or_else(|| Error::Excluded {
                generation: g,
                message: format!(
                    "rank {} arrived after the new membership closed (the others formed a \
                     group without it; window {:?})",
                    self.rank(),
                    opts.window
                ),
            })?;
        connect(
            base,
            plan,
            g,
            &members,
            me,
            Some(self.rank()),
            self.inner._server.clone(),
            self.size(),
        )
    }

    /// Whether a process is waiting to join this group ([`join_process_group`]): rank 0 looks
    /// at the store and tells the others (a one-byte broadcast, so every rank gets the same
    /// answer). Call it at step boundaries; when `true`, every rank calls
    /// [`regroup`](Self::regroup)`(None, ..)`.
    pub fn joiners_waiting(&self) -> Result<bool> {
        let Some(base) = &self.inner.regroup else {
            return Err(Error::Config(
                "joiners_waiting: only a default group can take newcomers".into(),
            ));
        };
        let mut flag = [0u8];
        if self.rank() == 0 {
            flag[0] = base.store.check(&key(base.generation + 1, "joiners"))? as u8;
        }
        self.broadcast(&mut flag, 0)?;
        Ok(flag[0] == 1)
    }

    /// The generation of this group (0 for `init_process_group`'s, one more per regrouping).
    pub fn generation(&self) -> u64 {
        self.inner.regroup.as_ref().map_or(0, |b| b.generation)
    }
}

/// Join a running job as a newcomer: connect to its store as `init_process_group` would (from
/// `opts` and the environment; `RANK` and `WORLD_SIZE` are only needed to find the store, the
/// group assigns the rank), announce this process, and wait until the job's next regrouping
/// takes it in. Never hosts the store. Retries the generation after when it arrives late;
/// fails after the timeout of `opts`.
pub fn join_process_group(opts: InitOptions, ropts: &RegroupOptions) -> Result<Regrouped> {
    let backend = match opts.backend {
        Some(b) => b,
        None => Backend::from_env()?,
    };
    if backend == Backend::Mpi {
        return Err(Error::Config(
            "join_process_group: an MPI job cannot take newcomers (MPI_COMM_WORLD is fixed)".into(),
        ));
    }
    let plan = plan_default_group(&opts, backend, false)?;
    let base = plan
        .regroup
        .clone()
        .expect("a default group's plan regroups");
    let deadline = Instant::now() + plan.backend.timeout;
    loop {
        let current = match base.store.check(GENERATION_KEY)? {
            true => parse_u64(&base.store.get(GENERATION_KEY)?, GENERATION_KEY)?,
            false => 0,
        };
        let g = current + 1;
        base.store.add(&key(g, "joiners"), 1)?;
        let left = deadline.saturating_duration_since(Instant::now());
        if let Some((members, me)) = meet(&*base.store, g, Arrival::Newcomer, ropts, left)? {
            return connect(&base, &plan.backend, g, &members, me, None, None, 0);
        }
        if Instant::now() >= deadline {
            return Err(Error::Timeout {
                what: "a running job to take this process in".into(),
                timeout: plan.backend.timeout,
            });
        }
    }
}

/// Arrive at generation `g` and wait for its membership: `Some((members, my index))` when this
/// process is in it, `None` when it arrived too late.
fn meet(
    store: &dyn Store,
    g: u64,
    arrival: Arrival,
    opts: &RegroupOptions,
    timeout: Duration,
) -> Result<Option<(Vec<Member>, usize)>> {
    let waiting = |what: String| move |e: Error| e.waiting_for(|| what);
    let who = match arrival {
        Arrival::Survivor { rank, lost, .. } => {
            if let Some(d) = lost {
                if store.add(&key(g, &format!("lost/{d}")), 1)? == 1 {
                    store.add(&key(g, "lost_count"), 1)?;
                }
            }
            format!("s {rank}")
        }
        Arrival::Newcomer => {
            store
                .wait(&[&key(g, "open")], timeout)
                .map_err(waiting(format!(
                    "the running job to open generation {g} to newcomers"
                )))?;
            "j".to_string()
        }
    };
    let idx = store.add(&key(g, "arrived"), 1)? as usize;
    store.set(&key(g, &format!("who/{idx}")), who.as_bytes())?;
    if idx == 1 {
        let Arrival::Survivor { size, .. } = arrival else {
            unreachable!("newcomers arrive after the first survivor opened the generation");
        };
        store.set(&key(g, "open"), size.to_string().as_bytes())?;
        decide(store, g, size, opts, timeout)?;
    }
    store
        .wait(&[&key(g, "members")], timeout)
        .map_err(waiting(format!(
            "the membership of generation {g} (decided by the first survivor to arrive)"
        )))?;
    let text = String::from_utf8_lossy(&store.get(&key(g, "members"))?).into_owned();
    if let Some(msg) = text.strip_prefix("error: ") {
        return Err(Error::Excluded {
            generation: g,
            message: msg.to_string(),
        });
    }
    let members = parse_members(&text)?;
    Ok(members
        .iter()
        .position(|m| m.idx() == idx)
        .map(|me| (members, me)))
}

/// The decider's part: wait for the expected arrivals or the window, then write the
/// membership (or why there is none) and the generation.
fn decide(
    store: &dyn Store,
    g: u64,
    old_size: usize,
    opts: &RegroupOptions,
    timeout: Duration,
) -> Result<()> {
    let start = Instant::now();
    let arrived = loop {
        let arrived = store.add(&key(g, "arrived"), 0)? as usize;
        let joiners = store.add(&key(g, "joiners"), 0)? as usize;
        let lost = store.add(&key(g, "lost_count"), 0)? as usize;
        if arrived + lost >= old_size + joiners || start.elapsed() >= opts.window {
            break arrived;
        }
        std::thread::sleep(Duration::from_millis(2));
    };
    let mut members = Vec::with_capacity(arrived);
    for idx in 1..=arrived {
        let k = key(g, &format!("who/{idx}"));
        store.wait(&[&k], timeout)?;
        let who = String::from_utf8_lossy(&store.get(&k)?).into_owned();
        members.push(match who.strip_prefix("s ") {
            Some(r) => Member::Survivor {
                idx,
                rank: parse_u64(r.as_bytes(), &k)? as usize,
            },
            None => Member::Newcomer { idx },
        });
    }
    // Survivors keep their order; newcomers follow in arrival order.
    members.sort_by_key(|m| match *m {
        Member::Survivor { rank, .. } => (0, rank),
        Member::Newcomer { idx } => (1, idx),
    });
    let text = if members.len() < opts.min_size {
        format!(
            "error: only {} process(es) arrived within {:?}, fewer than the minimum of {}",
            members.len(),
            opts.window,
            opts.min_size
        )
    } else {
        members
            .iter()
            .map(|m| match *m {
                Member::Survivor { idx, rank } => format!("{idx} s {rank}"),
                Member::Newcomer { idx } => format!("{idx} j"),
            })
            .collect::<Vec<_>>()
            .join("\n")
    };
    store.set(&key(g, "members"), text.as_bytes())?;
    store.set(GENERATION_KEY, g.to_string().as_bytes())?;
    Ok(())
}

fn parse_members(text: &str) -> Result<Vec<Member>> {
    let bad = || Error::Internal(format!("regroup: unreadable membership {text:?}"));
    text.lines()
        .map(|line| {
            let mut it = line.split(' ');
            let idx = it.next().and_then(|s| s.parse().ok()).ok_or_else(bad)?;
            match (it.next(), it.next()) {
                (Some("s"), Some(r)) => Ok(Member::Survivor {
                    idx,
                    rank: r.parse().map_err(|_| bad())?,
                }),
                (Some("j"), None) => Ok(Member::Newcomer { idx }),
                _ => Err(bad()),
            }
        })
        .collect()
}

fn parse_u64(bytes: &[u8], what: &str) -> Result<u64> {
    String::from_utf8_lossy(bytes)
        .trim()
        .parse()
        .map_err(|_| Error::Internal(format!("store key {what}: not a number")))
}

/// Connect the group of generation `g` as member `me` of `members`.
#[allow(clippy::too_many_arguments)] // the old group's parts, each used once
fn connect(
    base: &RegroupBase,
    plan: &BackendPlan,
    g: u64,
    members: &[Member],
    me: usize,
    previous_rank: Option<usize>,
    server: Option<Arc<crate::store::StoreServer>>,
    old_size: usize,
) -> Result<Regrouped> {
    let store: Arc<dyn Store> = Arc::new(PrefixStore::new(
        format!("ft/g{g}/group"),
        base.store.clone(),
    ));
    let size = members.len();
    let group = ProcessGroup::connect(GroupPlan {
        backend: BackendPlan {
            store,
            rank: me,
            size,
            local_ip: plan.local_ip,
            timeout: plan.timeout,
            backend: plan.backend,
            algorithm: plan.algorithm,
            host_id: plan.host_id.clone(),
            warn_after: plan.warn_after,
        },
        global_ranks: (0..size).collect(),
        server,
        regroup: Some(RegroupBase {
            store: base.store.clone(),
            generation: g,
        }),
    })?;
    let survivors: Vec<usize> = members
        .iter()
        .filter_map(|m| match *m {
            Member::Survivor { rank, .. } => Some(rank),
            Member::Newcomer { .. } => None,
        })
        .collect();
    let lost = (0..old_size).filter(|r| !survivors.contains(r)).collect();
    Ok(Regrouped {
        group,
        generation: g,
        joined: size - survivors.len(),
        survivors,
        lost,
        previous_rank,
    })
}
