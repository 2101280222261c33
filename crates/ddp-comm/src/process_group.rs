//! Process groups: who is in a job, and the public collective API.
//!
//! [`init_process_group`] resolves rank and world size (env or explicit), hosts or joins the
//! rendezvous store, connects the transport ([`Backend`]: TCP mesh, shared memory, or for a
//! group spanning hosts the hierarchical one of [`crate::transport::hierarchical`]; see
//! [`ProcessGroup::topology`]) and starts the group's background thread. Every
//! collective is a job queued to that thread, so collectives on one group complete in the
//! order issued and compute continues while `*_async` ones run. A failed collective aborts the
//! group: peers are told (their pending and later collectives fail with an error naming this
//! rank), and every later call on this group fails with [`Error::Aborted`] carrying the cause.
//!
//! Each collective has a blocking form over slices and an `*_async` form over owned `Vec`s
//! returning a [`Work`]. Subgroups come from [`ProcessGroup::new_group`].

use crate::algorithms::{direct, hierarchical, recursive_doubling, ring, tree, AllReduceAlgorithm};
use crate::dtype::{DType, Element, ReduceOp};
use crate::env::EnvConfig;
use crate::store::{PrefixStore, Store, StoreOptions, StoreServer, TcpStore};
use crate::transport::shm;
use crate::transport::tcp::TcpTransport;
use crate::transport::{Fingerprint, OpKind, Transport};
use crate::work::{self, Work};
use crate::{Error, Result};
use std::net::{IpAddr, Ipv4Addr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
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
    /// Transport (default: env `DDP_BACKEND` = auto|tcp|shm, else auto).
    pub backend: Option<Backend>,
    /// This process's host identity for `auto` / `shm` (default: [`shm::host_id`], from the
    /// hostname, boot id and the `/dev/shm` mount). Ranks with equal ids must be able to share
    /// memory through `/dev/shm`; tests set distinct ids to simulate hosts within one process.
    pub host_id: Option<String>,
    /// Network interface whose address peers use to reach this rank over TCP (default: env
    /// `DDP_SOCKET_IFNAME`, PyTorch's `GLOO_SOCKET_IFNAME`; else the address this process uses
    /// to reach the store). For hosts with several networks: keep the data on the fast one.
    pub socket_ifname: Option<String>,
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
        }
    }
}

/// Which transport a group uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Backend {
    /// Shared memory when every rank of the group is on this host; hierarchical when the ranks
    /// span hosts and some host has two or more; TCP when every rank is on its own host.
    #[default]
    Auto,
    /// TCP (loopback or network), like torch's gloo.
    Tcp,
    /// Shared memory; initialization fails if the ranks are not all on one host.
    Shm,
    /// What [`ProcessGroup::backend`] reports for a group spanning hosts under `auto`: a TCP
    /// mesh for every collective, plus shared memory inside each host for all-reduce
    /// ([`crate::transport::hierarchical`]). Requested, it is the same as `Auto`.
    Hierarchical,
}

impl Backend {
    /// Parse `auto`, `tcp` (alias `gloo`) or `shm`.
    pub fn parse(s: &str) -> Option<Self> {
        match s.trim().to_ascii_lowercase().as_str() {
            "auto" | "" => Some(Backend::Auto),
            "tcp" | "gloo" => Some(Backend::Tcp),
            "shm" => Some(Backend::Shm),
            _ => None,
        }
    }

    /// The backend named by env `DDP_BACKEND` (auto when unset).
    pub fn from_env() -> Result<Self> {
        match std::env::var("DDP_BACKEND") {
            Ok(v) => Backend::parse(&v).ok_or_else(|| {
                Error::Config(format!("DDP_BACKEND={v:?}: expected auto, tcp or shm"))
            }),
            Err(_) => Ok(Backend::Auto),
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

type Job = Box<dyn FnOnce(&mut Engine) + Send>;

/// A collective's body, run on the group's thread.
type CollectiveFn<'a, R> = Box<dyn FnOnce(&mut dyn Transport) -> Result<R> + Send + 'a>;

/// State owned by the background thread: the transport and the sequence counters.
struct Engine {
    transport: Box<dyn Transport>,
    seq: u64,
    /// Per peer: messages sent to it, messages received from it (send/recv sequence numbers).
    p2p: Vec<(u64, u64)>,
    broken: Option<Error>,
}

impl Engine {
    fn run<R>(
        &mut self,
        mut fp: Fingerprint,
        timeout: Duration,
        f: impl FnOnce(&mut dyn Transport) -> Result<R>,
    ) -> Result<R> {
        if let Some(cause) = &self.broken {
            return Err(Error::Aborted(Box::new(cause.clone())));
        }
        if fp.op == OpKind::SendRecv {
            let peer = fp.root as usize;
            let counters = self.p2p.get_mut(peer).ok_or_else(|| {
                Error::InvalidArgument(format!("peer rank {peer} is out of range"))
            })?;
            // `count` carries the direction: the sender's "sent" must meet the receiver's "received".
            let c = if fp.reduce.is_some() {
                &mut counters.0
            } else {
                &mut counters.1
            };
            fp.seq = *c;
            *c += 1;
            fp.reduce = None;
            fp.root = Fingerprint::NO_ROOT;
        } else {
            fp.seq = self.seq;
            self.seq += 1;
        }
        self.transport.begin(fp, Instant::now() + timeout);
        match f(&mut *self.transport) {
            Ok(v) => Ok(v),
            Err(e) => {
                tracing::error!("{e}");
                self.transport.abort(&e);
                self.broken = Some(e.clone());
                Err(e)
            }
        }
    }
}

struct Inner {
    rank: usize,
    size: usize,
    /// Group rank → rank in the default (world) group.
    global_ranks: Vec<usize>,
    jobs: Mutex<Option<mpsc::Sender<Job>>>,
    thread: Mutex<Option<JoinHandle<()>>>,
    /// Store namespaced for this group; subgroups namespace further.
    store: Arc<dyn Store>,
    /// Keeps the store server alive when this process hosts it.
    _server: Option<Arc<StoreServer>>,
    subgroups: AtomicU64,
    algorithm: AllReduceAlgorithm,
    /// Requested backend (subgroups resolve it again) and the one in use.
    requested_backend: Backend,
    backend: Backend,
    /// What the transport is, for people ([`ProcessGroup::topology`]).
    topology: String,
    /// This process's host id (subgroups compare it again).
    host_id: String,
    local_ip: IpAddr,
    default_timeout: Duration,
}

impl Drop for Inner {
    fn drop(&mut self) {
        self.jobs.lock().unwrap().take();
        if let Some(t) = self.thread.lock().unwrap().take() {
            let _ = t.join();
        }
    }
}

/// A group of ranks that run collectives together. Cheap to clone (shared handle).
#[derive(Clone)]
pub struct ProcessGroup {
    inner: Arc<Inner>,
    timeout: Duration,
}

impl std::fmt::Debug for ProcessGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProcessGroup")
            .field("rank", &self.inner.rank)
            .field("size", &self.inner.size)
            .field("global_ranks", &self.inner.global_ranks)
            .finish()
    }
}

/// Start the default process group (see [`InitOptions`]).
pub fn init_process_group(opts: InitOptions) -> Result<ProcessGroup> {
    let secret = opts.secret.clone().or_else(|| {
        std::env::var(crate::store::SECRET_ENV)
            .ok()
            .filter(|s| !s.is_empty())
    });
    let backend = match opts.backend {
        Some(b) => b,
        None => Backend::from_env()?,
    };
    let host_id = opts.host_id.clone().unwrap_or_else(shm::host_id);
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

    let (rank, size, store, server, local_ip, restart) = if let Some(store) = opts.store.clone() {
        let (rank, size) = explicit_rank_world(opts.rank, opts.world_size, "a store")?;
        (rank, size, store, None, IpAddr::V4(Ipv4Addr::LOCALHOST), 0)
    } else {
        let (rank, size, host, port, hosted, restart) = match opts.init_method.as_deref() {
            None | Some("env://") => {
                let mut env = EnvConfig::from_env()?;
                if let Some(r) = opts.rank {
                    env.rank = r;
                }
                if let Some(w) = opts.world_size {
                    env.world_size = w;
                }
                let (rank, size) =
                    explicit_rank_world(Some(env.rank), Some(env.world_size), "env://")?;
                (
                    rank,
                    size,
                    env.master_addr,
                    env.master_port,
                    env.store_hosted,
                    env.restart_count,
                )
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
                (
                    rank,
                    size,
                    host.trim_matches(['[', ']']).to_string(),
                    port,
                    false,
                    0,
                )
            }
            Some(m) => {
                return Err(Error::Config(format!(
                    "unsupported init method {m:?}: use env:// or tcp://host:port"
                )))
            }
        };
        let server = if rank == 0 && !hosted {
            let bind_host = if is_loopback(&host) {
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
            &format!("{}:{port}", bracket(&host)),
            StoreOptions {
                secret: secret.clone(),
                timeout: opts.timeout,
                connect_timeout: opts.timeout,
            },
        )?;
        let ip = client.local_addr().ip();
        (
            rank,
            size,
            Arc::new(client) as Arc<dyn Store>,
            server,
            ip,
            restart,
        )
    };
    let ifname = opts.socket_ifname.clone().or_else(|| {
        std::env::var(SOCKET_IFNAME_ENV)
            .ok()
            .filter(|s| !s.trim().is_empty())
    });
    let local_ip = match ifname {
        Some(name) => crate::transport::tcp::interface_ip(name.trim())?,
        None => local_ip,
    };
    let store: Arc<dyn Store> =
        Arc::new(PrefixStore::new(format!("attempt{restart}/default"), store));
    ProcessGroup::connect(
        rank,
        size,
        (0..size).collect(),
        store,
        server,
        local_ip,
        algorithm,
        backend,
        host_id,
        opts.timeout,
    )
}

/// First rendezvous step: every rank announces itself with its world size and waits for all
/// others, so that a missing rank or a world-size disagreement is reported (on every rank that
/// sees it, naming the ranks) before any transport is built.
/// `hosting`: this process serves the store, so on a mismatch it lingers (up to 2 s) until the
/// other arrived ranks have read the verdict.
fn check_membership(
    store: &dyn Store,
    rank: usize,
    size: usize,
    timeout: Duration,
    hosting: bool,
) -> Result<()> {
    const MISMATCH: &str = "members/mismatch";
    const SEEN: &str = "members/mismatch_seen";
    store.set(&format!("members/{rank}"), size.to_string().as_bytes())?;
    let deadline = Instant::now() + timeout;
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
        let mut still = Vec::new();
        for &r in &missing {
            let key = format!("members/{r}");
            if !store.check(&key)? {
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
                    "rank(s) {missing:?} to join the rendezvous (world size {size}; this is rank {rank})"
                ),
                timeout,
            });
        }
        std::thread::sleep(Duration::from_millis(5));
    }
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

impl ProcessGroup {
    #[allow(clippy::too_many_arguments)]
    fn connect(
        rank: usize,
        size: usize,
        global_ranks: Vec<usize>,
        store: Arc<dyn Store>,
        server: Option<Arc<StoreServer>>,
        local_ip: IpAddr,
        algorithm: AllReduceAlgorithm,
        backend: Backend,
        host_id: String,
        timeout: Duration,
    ) -> Result<ProcessGroup> {
        check_membership(&*store, rank, size, timeout, server.is_some())?;
        let mut transport: Box<dyn Transport> = match backend {
            Backend::Tcp => Box::new(TcpTransport::connect_mesh(
                &*store, rank, size, local_ip, timeout,
            )?),
            _ => shm::connect_auto(
                &store,
                rank,
                size,
                local_ip,
                timeout,
                backend == Backend::Shm,
                &host_id,
            )?,
        };
        let (transport_backend, topology) = if let Some(h) = transport.hierarchical() {
            (Backend::Hierarchical, h.describe())
        } else if transport.shm().is_some() {
            (Backend::Shm, format!("shm: {size} ranks on one host"))
        } else {
            (Backend::Tcp, format!("tcp: {size} ranks, full mesh"))
        };
        tracing::debug!("rank {rank} of a group of global ranks {global_ranks:?}: {topology}");
        let (tx, rx) = mpsc::channel::<Job>();
        let mut engine = Engine {
            transport,
            seq: 0,
            p2p: vec![(0, 0); size],
            broken: None,
        };
        let thread = std::thread::Builder::new()
            .name(format!("ddp-comm-r{}", global_ranks[rank]))
            .spawn(move || {
                for job in rx {
                    let run = std::panic::AssertUnwindSafe(|| job(&mut engine));
                    if std::panic::catch_unwind(run).is_err() {
                        let e = Error::Io {
                            context: "collective".into(),
                            message: "internal panic in the communication thread".into(),
                        };
                        engine.transport.abort(&e);
                        engine.broken = Some(e);
                    }
                }
            })
            .map_err(|e| Error::io("spawning the communication thread", e))?;
        Ok(ProcessGroup {
            inner: Arc::new(Inner {
                rank,
                size,
                global_ranks,
                jobs: Mutex::new(Some(tx)),
                thread: Mutex::new(Some(thread)),
                store,
                _server: server,
                subgroups: AtomicU64::new(0),
                algorithm,
                requested_backend: backend,
                backend: transport_backend,
                topology,
                host_id,
                local_ip,
                default_timeout: timeout,
            }),
            timeout,
        })
    }

    /// This process's rank in the group.
    pub fn rank(&self) -> usize {
        self.inner.rank
    }

    /// Number of ranks in the group.
    pub fn size(&self) -> usize {
        self.inner.size
    }

    /// The rank in the default group of this group's rank `group_rank`.
    pub fn global_rank(&self, group_rank: usize) -> Option<usize> {
        self.inner.global_ranks.get(group_rank).copied()
    }

    /// This group's rank of the default group's rank `global_rank`, if it is a member.
    pub fn group_rank(&self, global_rank: usize) -> Option<usize> {
        self.inner
            .global_ranks
            .iter()
            .position(|&g| g == global_rank)
    }

    /// The store this group uses (namespaced to the group).
    pub fn store(&self) -> &Arc<dyn Store> {
        &self.inner.store
    }

    /// The transport this group uses: [`Backend::Tcp`], [`Backend::Shm`] or
    /// [`Backend::Hierarchical`] (`auto` resolved).
    pub fn backend(&self) -> Backend {
        self.inner.backend
    }

    /// The transport in words, e.g. `tcp: 4 ranks, full mesh`, `shm: 3 ranks on one host` or
    /// `hierarchical: 2 hosts x [2, 2] ranks, shm inside a host, tcp between`.
    pub fn topology(&self) -> &str {
        &self.inner.topology
    }

    /// The timeout of collectives issued through this handle.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// A handle to the same group whose collectives use `timeout`.
    pub fn with_timeout(&self, timeout: Duration) -> ProcessGroup {
        ProcessGroup {
            inner: self.inner.clone(),
            timeout,
        }
    }

    /// Create a subgroup of `ranks` (this group's numbering; sorted, as in PyTorch). Every rank
    /// of this group must call it with the same ranks, in the same order of `new_group` calls;
    /// members get `Some(group)`, others `None`.
    pub fn new_group(&self, ranks: &[usize]) -> Result<Option<ProcessGroup>> {
        let mut ranks = ranks.to_vec();
        ranks.sort_unstable();
        if ranks.windows(2).any(|w| w[0] == w[1]) {
            return Err(Error::InvalidArgument(format!(
                "new_group: duplicate ranks in {ranks:?}"
            )));
        }
        if let Some(&bad) = ranks.iter().find(|&&r| r >= self.size()) {
            return Err(Error::InvalidArgument(format!(
                "new_group: rank {bad} is not in this group of size {}",
                self.size()
            )));
        }
        let k = self.inner.subgroups.fetch_add(1, Ordering::SeqCst);
        let Some(my) = ranks.iter().position(|&r| r == self.rank()) else {
            return Ok(None);
        };
        let store: Arc<dyn Store> = Arc::new(PrefixStore::new(
            format!("group{k}"),
            self.inner.store.clone(),
        ));
        let global = ranks.iter().map(|&r| self.inner.global_ranks[r]).collect();
        ProcessGroup::connect(
            my,
            ranks.len(),
            global,
            store,
            None,
            self.inner.local_ip,
            self.inner.algorithm,
            self.inner.requested_backend,
            self.inner.host_id.clone(),
            self.inner.default_timeout,
        )
        .map(Some)
    }

    fn fingerprint(
        &self,
        op: OpKind,
        dtype: DType,
        reduce: Option<ReduceOp>,
        count: usize,
        root: Option<usize>,
    ) -> Fingerprint {
        Fingerprint {
            seq: 0,
            op,
            dtype,
            reduce,
            count: count as u64,
            root: root.map_or(Fingerprint::NO_ROOT, |r| r as u32),
        }
    }

    fn check_root(&self, root: usize) -> Result<()> {
        if root >= self.size() {
            return Err(Error::InvalidArgument(format!(
                "root rank {root} is not in this group of size {}",
                self.size()
            )));
        }
        Ok(())
    }

    /// Queue `f` on the group's thread; the returned work completes with its result.
    fn spawn<R: std::marker::Send + 'static>(
        &self,
        fp: Fingerprint,
        f: impl FnOnce(&mut dyn Transport) -> Result<R> + std::marker::Send + 'static,
    ) -> Work<R> {
        let (work, done) = work::pending::<R>(format!("{fp} on rank {}", self.rank()));
        let timeout = self.timeout;
        let job: Job =
            Box::new(move |engine: &mut Engine| done.complete(engine.run(fp, timeout, f)));
        if let Some(tx) = self.inner.jobs.lock().unwrap().as_ref() {
            // A send error drops the job, which completes the work with an error.
            let _ = tx.send(job);
        }
        work
    }

    /// Run `f` on the group's thread (after everything queued before it) and wait for it.
    fn blocking<R: std::marker::Send + 'static>(
        &self,
        fp: Fingerprint,
        f: impl FnOnce(&mut dyn Transport) -> Result<R> + std::marker::Send,
    ) -> Result<R> {
        let boxed: CollectiveFn<'_, R> = Box::new(f);
        // SAFETY: `f` may borrow the caller's buffers. We wait below until the work completes,
        // which happens only after `f` ran or was dropped unrun (its completer fires on drop),
        // so the borrows never outlive this call.
        let boxed: CollectiveFn<'static, R> = unsafe { std::mem::transmute(boxed) };
        self.spawn(fp, boxed).wait()
    }

    // ----- all_reduce -------------------------------------------------------------------------

    /// Reduce `buf` across all ranks with `op`; every rank gets the result.
    pub fn all_reduce<T: Element>(&self, buf: &mut [T], op: ReduceOp) -> Result<()> {
        let algo = self.inner.algorithm;
        let fp = self.fingerprint(OpKind::AllReduce, T::DTYPE, Some(op), buf.len(), None);
        self.blocking(fp, move |t| exec_all_reduce(t, buf, op, algo))
    }

    /// Async [`ProcessGroup::all_reduce`]; the work returns the buffer.
    pub fn all_reduce_async<T: Element>(&self, mut buf: Vec<T>, op: ReduceOp) -> Work<Vec<T>> {
        let algo = self.inner.algorithm;
        let fp = self.fingerprint(OpKind::AllReduce, T::DTYPE, Some(op), buf.len(), None);
        self.spawn(fp, move |t| {
            exec_all_reduce(t, &mut buf, op, algo).map(|()| buf)
        })
    }

    // ----- broadcast --------------------------------------------------------------------------

    /// Copy `root`'s `buf` into every rank's `buf`.
    pub fn broadcast<T: Element>(&self, buf: &mut [T], root: usize) -> Result<()> {
        self.check_root(root)?;
        let fp = self.fingerprint(OpKind::Broadcast, T::DTYPE, None, buf.len(), Some(root));
        self.blocking(fp, move |t| exec_broadcast(t, buf, root))
    }

    /// Async [`ProcessGroup::broadcast`].
    pub fn broadcast_async<T: Element>(&self, mut buf: Vec<T>, root: usize) -> Work<Vec<T>> {
        if let Err(e) = self.check_root(root) {
            return Work::ready("broadcast", Err(e));
        }
        let fp = self.fingerprint(OpKind::Broadcast, T::DTYPE, None, buf.len(), Some(root));
        self.spawn(fp, move |t| exec_broadcast(t, &mut buf, root).map(|()| buf))
    }

    // ----- reduce -----------------------------------------------------------------------------

    /// Reduce every rank's `buf` into `root`'s `buf` (other ranks' buffers are unchanged).
    pub fn reduce<T: Element>(&self, buf: &mut [T], op: ReduceOp, root: usize) -> Result<()> {
        self.check_root(root)?;
        let fp = self.fingerprint(OpKind::Reduce, T::DTYPE, Some(op), buf.len(), Some(root));
        self.blocking(fp, move |t| exec_reduce(t, buf, op, root))
    }

    /// Async [`ProcessGroup::reduce`].
    pub fn reduce_async<T: Element>(
        &self,
        mut buf: Vec<T>,
        op: ReduceOp,
        root: usize,
    ) -> Work<Vec<T>> {
        if let Err(e) = self.check_root(root) {
            return Work::ready("reduce", Err(e));
        }
        let fp = self.fingerprint(OpKind::Reduce, T::DTYPE, Some(op), buf.len(), Some(root));
        self.spawn(fp, move |t| {
            exec_reduce(t, &mut buf, op, root).map(|()| buf)
        })
    }

    // ----- all_gather -------------------------------------------------------------------------

    /// Concatenate every rank's `input` (rank order) into `output` (`input.len() * size`).
    pub fn all_gather<T: Element>(&self, input: &[T], output: &mut [T]) -> Result<()> {
        let fp = self.fingerprint(OpKind::AllGather, T::DTYPE, None, input.len(), None);
        self.blocking(fp, move |t| exec_all_gather(t, input, output))
    }

    /// Async [`ProcessGroup::all_gather`]; the work returns the gathered vector.
    pub fn all_gather_async<T: Element>(&self, input: Vec<T>) -> Work<Vec<T>> {
        let fp = self.fingerprint(OpKind::AllGather, T::DTYPE, None, input.len(), None);
        let n = input.len() * self.size();
        self.spawn(fp, move |t| {
            let mut out = vec![T::zeroed(); n];
            exec_all_gather(t, &input, &mut out).map(|()| out)
        })
    }

    // ----- reduce_scatter ---------------------------------------------------------------------

    /// Reduce `input` (`output.len() * size` elements) across ranks; rank `r` gets block `r`.
    pub fn reduce_scatter<T: Element>(
        &self,
        input: &[T],
        output: &mut [T],
        op: ReduceOp,
    ) -> Result<()> {
        let fp = self.fingerprint(OpKind::ReduceScatter, T::DTYPE, Some(op), input.len(), None);
        self.blocking(fp, move |t| exec_reduce_scatter(t, input, output, op))
    }

    /// Async [`ProcessGroup::reduce_scatter`]; the work returns this rank's block.
    pub fn reduce_scatter_async<T: Element>(&self, input: Vec<T>, op: ReduceOp) -> Work<Vec<T>> {
        let fp = self.fingerprint(OpKind::ReduceScatter, T::DTYPE, Some(op), input.len(), None);
        let n = input.len() / self.size();
        self.spawn(fp, move |t| {
            let mut out = vec![T::zeroed(); n];
            exec_reduce_scatter(t, &input, &mut out, op).map(|()| out)
        })
    }

    // ----- gather / scatter / all_to_all ------------------------------------------------------

    /// Gather every rank's `input` into `output` on `root` (`output` is required there and
    /// ignored elsewhere; length `input.len() * size`).
    pub fn gather<T: Element>(
        &self,
        input: &[T],
        output: Option<&mut [T]>,
        root: usize,
    ) -> Result<()> {
        self.check_root(root)?;
        let fp = self.fingerprint(OpKind::Gather, T::DTYPE, None, input.len(), Some(root));
        let rank = self.rank();
        self.blocking(fp, move |t| {
            if rank == root {
                let out = output.ok_or_else(|| {
                    Error::InvalidArgument("gather: the root must pass an output buffer".into())
                })?;
                check_len("gather output", out.len(), input.len() * t.size())?;
                direct::gather(t, input, Some(out), root)
            } else {
                direct::gather(t, input, None, root)
            }
        })
    }

    /// Async [`ProcessGroup::gather`]; the work returns `Some(gathered)` on the root.
    pub fn gather_async<T: Element>(&self, input: Vec<T>, root: usize) -> Work<Option<Vec<T>>> {
        if let Err(e) = self.check_root(root) {
            return Work::ready("gather", Err(e));
        }
        let fp = self.fingerprint(OpKind::Gather, T::DTYPE, None, input.len(), Some(root));
        let rank = self.rank();
        let n = input.len() * self.size();
        self.spawn(fp, move |t| {
            if rank == root {
                let mut out = vec![T::zeroed(); n];
                direct::gather(t, &input, Some(&mut out), root).map(|()| Some(out))
            } else {
                direct::gather(t, &input, None, root).map(|()| None)
            }
        })
    }

    /// Scatter `root`'s `input` (`output.len() * size`; ignored elsewhere): rank `r` gets block `r`.
    pub fn scatter<T: Element>(
        &self,
        input: Option<&[T]>,
        output: &mut [T],
        root: usize,
    ) -> Result<()> {
        self.check_root(root)?;
        let fp = self.fingerprint(OpKind::Scatter, T::DTYPE, None, output.len(), Some(root));
        let rank = self.rank();
        self.blocking(fp, move |t| {
            exec_scatter(t, input.filter(|_| rank == root), output, root)
        })
    }

    /// Async [`ProcessGroup::scatter`] of `count` elements per rank; the work returns this rank's block.
    pub fn scatter_async<T: Element>(
        &self,
        input: Option<Vec<T>>,
        count: usize,
        root: usize,
    ) -> Work<Vec<T>> {
        if let Err(e) = self.check_root(root) {
            return Work::ready("scatter", Err(e));
        }
        let fp = self.fingerprint(OpKind::Scatter, T::DTYPE, None, count, Some(root));
        let input = input.filter(|_| self.rank() == root);
        self.spawn(fp, move |t| {
            let mut out = vec![T::zeroed(); count];
            exec_scatter(t, input.as_deref(), &mut out, root).map(|()| out)
        })
    }

    /// All-to-all with equal blocks: block `j` of `input` goes to rank `j`, block `i` of
    /// `output` comes from rank `i` (both `n * size` elements).
    pub fn all_to_all<T: Element>(&self, input: &[T], output: &mut [T]) -> Result<()> {
        let fp = self.fingerprint(OpKind::AllToAll, T::DTYPE, None, input.len(), None);
        self.blocking(fp, move |t| exec_all_to_all(t, input, output))
    }

    /// Async [`ProcessGroup::all_to_all`]; the work returns the output.
    pub fn all_to_all_async<T: Element>(&self, input: Vec<T>) -> Work<Vec<T>> {
        let fp = self.fingerprint(OpKind::AllToAll, T::DTYPE, None, input.len(), None);
        self.spawn(fp, move |t| {
            let mut out = vec![T::zeroed(); input.len()];
            exec_all_to_all(t, &input, &mut out).map(|()| out)
        })
    }

    // ----- barrier, send / recv ---------------------------------------------------------------

    /// Wait until every rank has reached the barrier.
    pub fn barrier(&self) -> Result<()> {
        self.barrier_async().wait()
    }

    /// Async [`ProcessGroup::barrier`].
    pub fn barrier_async(&self) -> Work<()> {
        let fp = self.fingerprint(OpKind::Barrier, DType::U8, None, 0, None);
        self.spawn(fp, |t| {
            recursive_doubling::all_reduce::<u8>(t, &mut [], ReduceOp::Sum)
        })
    }

    /// Send `buf` to rank `dst` (matched by a [`ProcessGroup::recv`] of the same length there).
    pub fn send<T: Element>(&self, buf: &[T], dst: usize) -> Result<()> {
        self.check_peer(dst)?;
        let fp = self.p2p_fingerprint::<T>(buf.len(), dst, true);
        self.blocking(fp, move |t| t.send(dst, crate::algorithms::bytes(buf)))
    }

    /// Receive into `buf` from rank `src`.
    pub fn recv<T: Element>(&self, buf: &mut [T], src: usize) -> Result<()> {
        self.check_peer(src)?;
        let fp = self.p2p_fingerprint::<T>(buf.len(), src, false);
        self.blocking(fp, move |t| t.recv(src, bytemuck::cast_slice_mut(buf)))
    }

    /// Async [`ProcessGroup::send`].
    pub fn send_async<T: Element>(&self, buf: Vec<T>, dst: usize) -> Work<Vec<T>> {
        if let Err(e) = self.check_peer(dst) {
            return Work::ready("send", Err(e));
        }
        let fp = self.p2p_fingerprint::<T>(buf.len(), dst, true);
        self.spawn(fp, move |t| {
            t.send(dst, crate::algorithms::bytes(&buf)).map(|()| buf)
        })
    }

    /// Async [`ProcessGroup::recv`] of `count` elements.
    pub fn recv_async<T: Element>(&self, count: usize, src: usize) -> Work<Vec<T>> {
        if let Err(e) = self.check_peer(src) {
            return Work::ready("recv", Err(e));
        }
        let fp = self.p2p_fingerprint::<T>(count, src, false);
        self.spawn(fp, move |t| {
            let mut buf = vec![T::zeroed(); count];
            t.recv(src, bytemuck::cast_slice_mut(&mut buf))
                .map(|()| buf)
        })
    }

    fn check_peer(&self, peer: usize) -> Result<()> {
        if peer >= self.size() || peer == self.rank() {
            return Err(Error::InvalidArgument(format!(
                "send/recv peer {peer} must be another rank of this group of size {} (this is rank {})",
                self.size(),
                self.rank()
            )));
        }
        Ok(())
    }

    /// The engine replaces `seq` with the per-pair counter; `reduce: Some` marks a send.
    fn p2p_fingerprint<T: Element>(&self, count: usize, peer: usize, is_send: bool) -> Fingerprint {
        let mut fp = self.fingerprint(OpKind::SendRecv, T::DTYPE, None, count, Some(peer));
        fp.reduce = is_send.then_some(ReduceOp::Sum);
        fp
    }

    // ----- serialized objects -----------------------------------------------------------------

    /// Broadcast a byte string of any length from `root` (`data` is ignored on other ranks).
    pub fn broadcast_bytes(&self, data: &[u8], root: usize) -> Result<Vec<u8>> {
        self.check_root(root)?;
        let fp = self.fingerprint(OpKind::Broadcast, DType::U8, None, 0, Some(root));
        let mine = (self.rank() == root).then(|| data.to_vec());
        self.blocking(fp, move |t| {
            let mut len = [mine.as_ref().map_or(0, |d| d.len() as i64)];
            exec_broadcast(t, &mut len, root)?;
            let mut out = mine.unwrap_or_else(|| vec![0u8; len[0] as usize]);
            exec_broadcast(t, &mut out, root)?;
            Ok(out)
        })
    }

    /// Gather a byte string of any length from every rank, in rank order, on every rank.
    pub fn all_gather_bytes(&self, data: &[u8]) -> Result<Vec<Vec<u8>>> {
        let fp = self.fingerprint(OpKind::AllGather, DType::U8, None, 0, None);
        let rank = self.rank();
        self.blocking(fp, move |t| {
            let p = t.size();
            let mut lens = vec![0i64; p];
            lens[rank] = data.len() as i64;
            ring::all_gather(t, &mut lens)?;
            let max = lens.iter().copied().max().unwrap_or(0) as usize;
            let mut all = vec![0u8; max * p];
            all[rank * max..rank * max + data.len()].copy_from_slice(data);
            ring::all_gather(t, &mut all)?;
            Ok((0..p)
                .map(|i| all[i * max..i * max + lens[i] as usize].to_vec())
                .collect())
        })
    }
}

fn check_len(what: &str, got: usize, want: usize) -> Result<()> {
    if got != want {
        return Err(Error::InvalidArgument(format!(
            "{what} has {got} elements, expected {want}"
        )));
    }
    Ok(())
}

fn exec_all_reduce<T: Element>(
    t: &mut dyn Transport,
    buf: &mut [T],
    op: ReduceOp,
    algo: AllReduceAlgorithm,
) -> Result<()> {
    if algo == AllReduceAlgorithm::Auto {
        if let Some(shm) = t.shm() {
            return crate::algorithms::shm_direct::all_reduce(shm, buf, op);
        }
    }
    if let Some(mut wide) = T::widen(buf) {
        exec_all_reduce::<f32>(t, &mut wide, op, algo)?;
        T::narrow(&wide, buf);
        return Ok(());
    }
    if algo == AllReduceAlgorithm::Auto {
        if let Some(h) = t.hierarchical() {
            return hierarchical::all_reduce(h, buf, op);
        }
    }
    match algo.resolve(std::mem::size_of_val(buf), t.size()) {
        AllReduceAlgorithm::Ring => ring::all_reduce(t, buf, op)?,
        _ => recursive_doubling::all_reduce(t, buf, op)?,
    }
    if op == ReduceOp::Avg {
        T::div_by(buf, t.size());
    }
    Ok(())
}

fn exec_broadcast<T: Element>(t: &mut dyn Transport, buf: &mut [T], root: usize) -> Result<()> {
    match t.hierarchical() {
        Some(h) => hierarchical::broadcast(h, buf, root),
        None => tree::broadcast(t, buf, root),
    }
}

fn exec_reduce<T: Element>(
    t: &mut dyn Transport,
    buf: &mut [T],
    op: ReduceOp,
    root: usize,
) -> Result<()> {
    if let Some(mut wide) = T::widen(buf) {
        exec_reduce::<f32>(t, &mut wide, op, root)?;
        if t.rank() == root {
            T::narrow(&wide, buf);
        }
        return Ok(());
    }
    tree::reduce(t, buf, op, root)?;
    if op == ReduceOp::Avg && t.rank() == root {
        T::div_by(buf, t.size());
    }
    Ok(())
}

fn exec_all_gather<T: Element>(t: &mut dyn Transport, input: &[T], output: &mut [T]) -> Result<()> {
    let (r, n) = (t.rank(), input.len());
    check_len("all_gather output", output.len(), n * t.size())?;
    output[r * n..(r + 1) * n].copy_from_slice(input);
    ring::all_gather(t, output)
}

fn exec_reduce_scatter<T: Element>(
    t: &mut dyn Transport,
    input: &[T],
    output: &mut [T],
    op: ReduceOp,
) -> Result<()> {
    let (r, n, p) = (t.rank(), output.len(), t.size());
    check_len("reduce_scatter input", input.len(), n * p)?;
    if let Some(shm) = t.shm() {
        if crate::algorithms::shm_direct::reduce_scatter(shm, input, output, op)? {
            return Ok(());
        }
    }
    if let Some(mut wide) = T::widen(input) {
        ring::reduce_scatter(t, &mut wide, op)?;
        if op == ReduceOp::Avg {
            f32::div_by(&mut wide[r * n..(r + 1) * n], p);
        }
        T::narrow(&wide[r * n..(r + 1) * n], output);
        return Ok(());
    }
    let mut work = input.to_vec();
    ring::reduce_scatter(t, &mut work, op)?;
    output.copy_from_slice(&work[r * n..(r + 1) * n]);
    if op == ReduceOp::Avg {
        T::div_by(output, p);
    }
    Ok(())
}

fn exec_scatter<T: Element>(
    t: &mut dyn Transport,
    input: Option<&[T]>,
    output: &mut [T],
    root: usize,
) -> Result<()> {
    if t.rank() == root {
        let inp = input.ok_or_else(|| {
            Error::InvalidArgument("scatter: the root must pass an input buffer".into())
        })?;
        check_len("scatter input", inp.len(), output.len() * t.size())?;
        direct::scatter(t, Some(inp), output, root)
    } else {
        direct::scatter(t, None, output, root)
    }
}

fn exec_all_to_all<T: Element>(t: &mut dyn Transport, input: &[T], output: &mut [T]) -> Result<()> {
    let p = t.size();
    if !input.len().is_multiple_of(p) {
        return Err(Error::InvalidArgument(format!(
            "all_to_all input has {} elements, not a multiple of the group size {p}",
            input.len()
        )));
    }
    check_len("all_to_all output", output.len(), input.len())?;
    direct::all_to_all(t, input, output)
}
