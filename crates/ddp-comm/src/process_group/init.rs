//! Starting a group: [`init_process_group`] resolves [`InitOptions`] (explicit, or the
//! environment of torchrun, Slurm or OpenMPI) into a [`Rendezvous`] (rank, world size, the
//! store, hosted or joined), checks membership through the store, and hands a [`GroupPlan`] to
//! [`ProcessGroup::connect`](super::ProcessGroup), which selects the backend
//! ([`crate::backend::select`]) and starts the engine thread.

use super::ProcessGroup;
use crate::algorithms::AllReduceAlgorithm;
use crate::backend::{Backend, BackendPlan};
use crate::env::EnvConfig;
use crate::store::{PrefixStore, Store, StoreOptions, StoreServer, TcpStore};
use crate::transport::stall::warn_after_from_env;
use crate::{Error, Result};
use std::net::{IpAddr, Ipv4Addr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Env var naming the network interface of the TCP transport ([`InitOptions::socket_ifname`]).
pub const SOCKET_IFNAME_ENV: &str = "DDP_SOCKET_IFNAME";

/// Default collective timeout: 30 minutes, as torch.distributed's gloo backend.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(30 * 60);

/// How to start a process group. `Default` reads everything from the environment.
#[derive(Clone)]
pub struct InitOptions {
    /// `env://` (default: `MASTER_ADDR`, `MASTER_PORT`, `RANK`, `WORLD_SIZE`, or Slurm/OpenMPI
    /// variables) or `tcp://host:port` (then `rank` and `world_size` are required, or read from
    /// `RANK` / `WORLD_SIZE`).
    pub init_method: Option<String>,
    pub rank: Option<usize>,
    pub world_size: Option<usize>,
    /// Timeout of rendezvous and of every collective (per call: [`ProcessGroup::with_timeout`]).
    pub timeout: Duration,
    /// Use this store instead of hosting or connecting to one.
    pub store: Option<Arc<dyn Store>>,
    /// Shared store secret (default: env `DDP_STORE_SECRET`).
    pub secret: Option<String>,
    /// All-reduce algorithm (default: env `DDP_ALLREDUCE_ALGO` = auto|ring|rd, else auto).
    /// A forced one runs flat over the group's TCP or shm message transport (no shm fast path,
    /// no hierarchical all-reduce).
    pub allreduce_algorithm: Option<AllReduceAlgorithm>,
    /// Backend asked for (default: env `DDP_BACKEND` = auto|tcp|shm|mpi, else auto); what it
    /// resolves to is [`ProcessGroup::topology`](super::ProcessGroup::topology). `mpi` (crate
    /// feature `mpi`) takes rank and world size from `MPI_COMM_WORLD` and uses no store, so
    /// `init_method`, `store` and `secret` are ignored with it.
    pub backend: Option<Backend>,
    /// This process's host identity for `auto` / `shm` (default: [`crate::host::host_id`], from the
    /// hostname, boot id and the `/dev/shm` mount). Ranks with equal ids must be able to share
    /// memory through `/dev/shm`; tests set distinct ids to simulate hosts within one process.
    pub host_id: Option<String>,
    /// Network interface whose address peers use to reach this rank over TCP (default: env
    /// `DDP_SOCKET_IFNAME`, PyTorch's `GLOO_SOCKET_IFNAME`; else the address this process uses
    /// to reach the store). For hosts with several networks: keep the data on the fast one.
    pub socket_ifname: Option<String>,
    /// A collective still waiting after this long logs a warning naming the ranks it waits
    /// for, and repeats it every such interval (default: env `DDP_WARN_AFTER_SECS`, else 60 s;
    /// `Some(Duration::ZERO)` turns it off).
    pub warn_after: Option<Duration>,
}

impl Default for InitOptions {
    fn default() -> Self {
        InitOptions {
            init_method: None,
            rank: None,
            world_size: None,
            timeout: DEFAULT_TIMEOUT,
            store: None,
            secret: None,
            allreduce_algorithm: None,
            backend: None,
            host_id: None,
            socket_ifname: None,
            warn_after: None,
        }
    }
}

impl InitOptions {
    /// Explicit `tcp://host:port` rendezvous for `rank` of `world_size`.
    pub fn tcp(addr: &str, rank: usize, world_size: usize) -> Self {
        InitOptions {
            init_method: Some(format!("tcp://{addr}")),
            rank: Some(rank),
            world_size: Some(world_size),
            ..Default::default()
        }
    }

    /// Rendezvous through an existing store.
    pub fn with_store(store: Arc<dyn Store>, rank: usize, world_size: usize) -> Self {
        InitOptions {
            store: Some(store),
            rank: Some(rank),
            world_size: Some(world_size),
            ..Default::default()
        }
    }
}

/// Everything a group needs to connect: the backend's plan, plus the group's place in the
/// default group and the store server it keeps alive.
pub(crate) struct GroupPlan {
    pub backend: BackendPlan,
    /// Group rank → rank in the default (world) group.
    pub global_ranks: Vec<usize>,
    /// The store server, when this process hosts it.
    pub server: Option<Arc<StoreServer>>,
    /// Where the group's regroupings meet (default groups only; see `ProcessGroup::regroup`).
    pub regroup: Option<super::RegroupBase>,
}

/// Where the rendezvous happens, resolved from the options and the environment.
struct Rendezvous {
    rank: usize,
    size: usize,
    store: Arc<dyn Store>,
    server: Option<Arc<StoreServer>>,
    /// The address this process reaches the store from.
    local_ip: IpAddr,
    /// Restart attempt (torchelastic), namespacing the store keys.
    restart: u32,
}

/// Start the default process group (see [`InitOptions`]).
pub fn init_process_group(opts: InitOptions) -> Result<ProcessGroup> {
    let backend = match opts.backend {
        Some(b) => b,
        None => Backend::from_env()?,
    };
    if backend == Backend::Mpi {
        return init_mpi(&opts, warn_after(&opts)?);
    }
    ProcessGroup::connect(plan_default_group(&opts, backend, true)?)
}

/// `opts.warn_after`, else the environment's (`None`: off).
fn warn_after(opts: &InitOptions) -> Result<Option<Duration>> {
    match opts.warn_after {
        Some(d) => Ok((!d.is_zero()).then_some(d)),
        None => warn_after_from_env(),
    }
}

/// The plan of the default group of a store-based backend: the rendezvous resolved, the store
/// hosted (when `may_host` and this is rank 0 of a job whose launcher does not host it) or
/// joined. A process joining a running job ([`super::regroup`]) never hosts.
pub(super) fn plan_default_group(
    opts: &InitOptions,
    backend: Backend,
    may_host: bool,
) -> Result<GroupPlan> {
    let secret = opts.secret.clone().or_else(|| {
        std::env::var(crate::store::SECRET_ENV)
            .ok()
            .filter(|s| !s.is_empty())
    });
    let host_id = opts.host_id.clone().unwrap_or_else(crate::host::host_id);
    let algorithm = match opts.allreduce_algorithm {
        Some(a) => a,
        None => match std::env::var("DDP_ALLREDUCE_ALGO") {
            Ok(v) => AllReduceAlgorithm::parse(&v).ok_or_else(|| {
                Error::Config(format!(
                    "DDP_ALLREDUCE_ALGO={v:?}: expected auto, ring or rd"
                ))
            })?,
            Err(_) => AllReduceAlgorithm::Auto,
        },
    };
    let warn_after = warn_after(opts)?;
    let rdzv = rendezvous(opts, secret, may_host)?;
    let ifname = opts.socket_ifname.clone().or_else(|| {
        std::env::var(SOCKET_IFNAME_ENV)
            .ok()
            .filter(|s| !s.trim().is_empty())
    });
    let local_ip = match ifname {
        Some(name) => crate::transport::tcp::interface_ip(name.trim())?,
        None => rdzv.local_ip,
    };
    let store: Arc<dyn Store> = Arc::new(PrefixStore::new(
        format!("attempt{}/default", rdzv.restart),
        rdzv.store,
    ));
    Ok(GroupPlan {
        backend: BackendPlan {
            store: store.clone(),
            rank: rdzv.rank,
            size: rdzv.size,
            local_ip,
            timeout: opts.timeout,
            backend,
            algorithm,
            host_id,
            warn_after,
        },
        global_ranks: (0..rdzv.size).collect(),
        server: rdzv.server,
        regroup: Some(super::RegroupBase {
            store,
            generation: 0,
        }),
    })
}

/// The default group of backend `mpi`: `MPI_COMM_WORLD` (rank and world size from MPI).
#[cfg(feature = "mpi")]
fn init_mpi(opts: &InitOptions, warn_after: Option<Duration>) -> Result<ProcessGroup> {
    ProcessGroup::connect_mpi(&crate::backend::mpi::MpiPlan {
        rank: opts.rank,
        world_size: opts.world_size,
        timeout: opts.timeout,
        warn_after,
    })
}

#[cfg(not(feature = "mpi"))]
fn init_mpi(_: &InitOptions, _: Option<Duration>) -> Result<ProcessGroup> {
    Err(Error::Config(
        "backend mpi: this build of ddp-comm has no MPI support; build with the `mpi` feature \
         (e.g. `--features ddp-comm/mpi`, which needs an MPI library such as libopenmpi-dev)"
            .into(),
    ))
}

/// Where the store is: explicit, `env://` or `tcp://host:port`.
struct StoreAddr {
    rank: usize,
    size: usize,
    host: String,
    port: u16,
    /// The launcher hosts the store (rank 0 joins it as a client).
    hosted: bool,
    restart: u32,
}

/// Resolve rank, world size and the store from `opts` and the environment; host the store on
/// rank 0 unless a launcher does, and connect to it.
fn rendezvous(opts: &InitOptions, secret: Option<String>, may_host: bool) -> Result<Rendezvous> {
    let env_num = |name: &str| -> Result<Option<usize>> {
        std::env::var(name)
            .ok()
            .map(|v| {
                v.trim().parse().map_err(|_| {
                    Error::Config(format!("{name}={v:?} is not a non-negative integer"))
                })
            })
            .transpose()
    };
    if let Some(store) = opts.store.clone() {
        let (rank, size) = explicit_rank_world(opts.rank, opts.world_size, "a store")?;
        return Ok(Rendezvous {
            rank,
            size,
            store,
            server: None,
            local_ip: IpAddr::V4(Ipv4Addr::LOCALHOST),
            restart: 0,
        });
    }
    let at = match opts.init_method.as_deref() {
        None | Some("env://") => {
            let mut env = EnvConfig::from_env()?;
            if let Some(r) = opts.rank {
                env.rank = r;
            }
            if let Some(w) = opts.world_size {
                env.world_size = w;
            }
            let (rank, size) = explicit_rank_world(Some(env.rank), Some(env.world_size), "env://")?;
            StoreAddr {
                rank,
                size,
                host: env.master_addr,
                port: env.master_port,
                hosted: env.store_hosted,
                restart: env.rdzv_round,
            }
        }
        Some(m) if m.starts_with("tcp://") => {
            let rest = &m["tcp://".len()..];
            let (host, port) = rest.rsplit_once(':').ok_or_else(|| {
                Error::Config(format!("init method {m:?}: expected tcp://host:port"))
            })?;
            let port: u16 = port.parse().map_err(|_| {
                Error::Config(format!("init method {m:?}: {port:?} is not a port number"))
            })?;
            let (rank, size) = explicit_rank_world(
                opts.rank.or(env_num("RANK")?),
                opts.world_size.or(env_num("WORLD_SIZE")?),
                m,
            )?;
            StoreAddr {
                rank,
                size,
                host: host.trim_matches(['[', ']']).to_string(),
                port,
                hosted: false,
                restart: 0,
            }
        }
        Some(m) => {
            return Err(Error::Config(format!(
                "unsupported init method {m:?}: use env:// or tcp://host:port"
            )))
        }
    };
    let (host, port) = (&at.host, at.port);
    let server = if at.rank == 0 && !at.hosted && may_host {
        let bind_host = if is_loopback(host) {
            host.as_str()
        } else {
            "0.0.0.0"
        };
        Some(Arc::new(StoreServer::bind(
            &format!("{}:{port}", bracket(bind_host)),
            secret.clone(),
        )?))
    } else {
        None
    };
    let client = TcpStore::connect(
        &format!("{}:{port}", bracket(host)),
        StoreOptions {
            secret,
            timeout: opts.timeout,
            connect_timeout: opts.timeout,
        },
    )?;
    Ok(Rendezvous {
        rank: at.rank,
        size: at.size,
        local_ip: client.local_addr().ip(),
        store: Arc::new(client),
        server,
        restart: at.restart,
    })
}

/// The store key where a launcher records that the worker of global rank `rank`, started for
/// restart attempt `restart`, exited (the value says how, e.g. `exit code 0`): ranks still
/// waiting for it to join the default group's rendezvous then fail at once, naming it, instead
/// of waiting for the timeout. `ddprun` writes it.
pub fn exited_key(restart: u32, rank: usize) -> String {
    format!("attempt{restart}/default/members/{rank}/exited")
}

/// First rendezvous step: every rank claims its rank, announces itself with its world size and
/// waits for all others, so that a rank given to two processes (the second to claim it fails,
/// naming both, as on shared memory), a missing rank or a world-size disagreement is reported
/// (on every rank that sees it, naming the ranks) before any transport is built.
/// `hosting`: this process serves the store, so on a mismatch it lingers (up to 2 s) until the
/// other arrived ranks have read the verdict.
pub(super) fn check_membership(
    store: &dyn Store,
    rank: usize,
    size: usize,
    timeout: Duration,
    hosting: bool,
) -> Result<()> {
    const MISMATCH: &str = "members/mismatch";
    const SEEN: &str = "members/mismatch_seen";
    claim_rank(store, rank, size)?;
    store.set(&format!("members/{rank}"), size.to_string().as_bytes())?;
    let deadline = Instant::now() + timeout;
    let mut next_exit_check = Instant::now();
    let mut missing: Vec<usize> = (0..size).filter(|&r| r != rank).collect();
    let fail = |msg: String| -> Result<()> {
        store.add(SEEN, 1)?;
        if hosting {
            let until = Instant::now() + Duration::from_secs(2);
            let arrived = (0..size)
                .filter(|r| store.check(&format!("members/{r}")).unwrap_or(false))
                .count() as i64;
            while store.add(SEEN, 0)? < arrived && Instant::now() < until {
                std::thread::sleep(Duration::from_millis(10));
            }
        }
        Err(Error::Config(msg))
    };
    loop {
        if store.check(MISMATCH)? {
            let msg = store.get(MISMATCH)?;
            return fail(String::from_utf8_lossy(&msg).into_owned());
        }
        // A launcher records a worker that exited before the others finished: waiting for it
        // to join would only run into the timeout (checked every 50 ms, not every poll).
        let look_for_exits = Instant::now() >= next_exit_check;
        if look_for_exits {
            next_exit_check = Instant::now() + Duration::from_millis(50);
        }
        let mut still = Vec::new();
        for &r in &missing {
            let key = format!("members/{r}");
            if !store.check(&key)? {
                let exited = format!("members/{r}/exited");
                if look_for_exits && store.check(&exited)? {
                    let how = String::from_utf8_lossy(&store.get(&exited)?).into_owned();
                    return Err(Error::Config(format!(
                        "rank {r} exited ({how}) without joining the rendezvous, so the group \
                         of world size {size} cannot form (this is rank {rank}): it returned or \
                         failed before calling init_process_group"
                    )));
                }
                still.push(r);
                continue;
            }
            let theirs = String::from_utf8_lossy(&store.get(&key)?).into_owned();
            if theirs != size.to_string() {
                let msg = format!(
                    "world size mismatch: rank {r} was started with world size {theirs}, rank {rank} with {size}"
                );
                store.set(MISMATCH, msg.as_bytes())?;
                return fail(msg);
            }
        }
        missing = still;
        if missing.is_empty() {
            return Ok(());
        }
        if Instant::now() >= deadline {
            return Err(Error::Timeout {
                what: format!(
                    "rank(s) [{}] to join the rendezvous (world size {size}; this is rank {rank})",
                    crate::env::list_bounded(&missing, crate::env::LIST_SHOWN)
                ),
                timeout,
            });
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Claim `rank` in the store: fails, naming both processes, if another process claimed it.
fn claim_rank(store: &dyn Store, rank: usize, size: usize) -> Result<()> {
    static CLAIMS: AtomicU64 = AtomicU64::new(0);
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default()
        .as_nanos();
    let who = format!(
        "pid {} on host {:?}",
        std::process::id(),
        crate::host::hostname()
    );
    // The first line makes the claim unique (threads of one process claim too, in tests).
    let mine = format!("{now}-{}\n{who}", CLAIMS.fetch_add(1, Ordering::Relaxed));
    let got = store.compare_set(&format!("members/{rank}/claim"), b"", mine.as_bytes())?;
    if got != mine.as_bytes() {
        let theirs = String::from_utf8_lossy(&got);
        let theirs = theirs.split_once('\n').map_or(&*theirs, |(_, w)| w);
        return Err(Error::Config(format!(
            "rank {rank} (world size {size}) was claimed by {theirs} and again by {who}: two processes were given the same rank?"
        )));
    }
    Ok(())
}

fn explicit_rank_world(
    rank: Option<usize>,
    world: Option<usize>,
    how: &str,
) -> Result<(usize, usize)> {
    let world = world.ok_or_else(|| Error::Config(format!("world size is required with {how}")))?;
    let rank = rank.ok_or_else(|| Error::Config(format!("rank is required with {how}")))?;
    if world == 0 {
        return Err(Error::Config(
            "world size is 0; it must be at least 1".into(),
        ));
    }
    if rank >= world {
        return Err(Error::Config(format!(
            "rank {rank} is not below world size {world}"
        )));
    }
    Ok((rank, world))
}

fn is_loopback(host: &str) -> bool {
    host == "localhost" || host.parse::<IpAddr>().is_ok_and(|ip| ip.is_loopback())
}

fn bracket(host: &str) -> String {
    if host.contains(':') {
        format!("[{host}]")
    } else {
        host.to_string()
    }
}
