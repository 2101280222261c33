//! Static node rendezvous through the TCP store (`ddp_comm::store`).
//!
//! The launcher on node 0 hosts the store (the workers' rank 0 then connects to it as a client,
//! `DDP_STORE_HOSTED=1`); every launcher, node 0 included, connects as a client. Per attempt
//! (restart round) `K`, under `ddprun/RUN_ID/`:
//!
//! - `K/node/R`   node `R` joined: its worker count, `--nnodes`, `--max-restarts`, host and pid.
//!   Ranks are assigned in node order, so nodes may run different numbers of workers.
//! - `K/failed`   first failure of the round (first writer wins): `restart` or `final`, the node,
//!   and a one-line description. Every node polls it and stops (and restarts) its workers.
//! - `K/done/R`   all workers of node `R` succeeded.
//! - `left/R`     node `R`'s launcher is finishing; node 0 keeps the store up until every node of
//!   the last round has left, so that nobody loses it while reading the job's outcome.

use crate::cli::Config;
use ddp_comm::env::{list_bounded, LIST_SHOWN, MAX_WORLD_SIZE};
use ddp_comm::store::{ServerOptions, Store, StoreOptions, StoreServer, TcpStore, SECRET_ENV};
use std::cell::RefCell;
use std::net::{IpAddr, TcpListener, ToSocketAddrs};
use std::time::{Duration, Instant};

/// Why a launcher stops waiting or running before its workers are done.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Stop {
    /// The launcher received this signal.
    Signal(i32),
    /// Another node reported a failure for this round.
    Remote(RemoteFailure),
    /// Rendezvous or store problem (message names what is wrong).
    Error(String),
    /// Elastic jobs: the membership changes (a node waits to join), so the workers stop and every
    /// node joins the next round; not a failure.
    Rejoin(String),
    /// Elastic jobs: an arriving node finds the job already finished.
    JobDone(String),
}

/// A failure reported by some node through the store.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RemoteFailure {
    pub node_rank: usize,
    /// Whether the reporting node is restarting the group (`false`: the job is over).
    pub restart: bool,
    pub what: String,
}

/// One node's entry of a round.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeInfo {
    pub node_rank: usize,
    pub nproc: usize,
    pub nnodes: usize,
    pub max_restarts: u32,
    pub host: String,
    pub pid: u32,
}

impl NodeInfo {
    fn encode(&self) -> String {
        format!(
            "nproc={};nnodes={};max_restarts={};pid={};host={}",
            self.nproc, self.nnodes, self.max_restarts, self.pid, self.host
        )
    }

    fn decode(node_rank: usize, s: &str) -> Option<NodeInfo> {
        let mut info = NodeInfo {
            node_rank,
            nproc: 0,
            nnodes: 0,
            max_restarts: 0,
            host: String::new(),
            pid: 0,
        };
        for part in s.splitn(5, ';') {
            let (k, v) = part.split_once('=')?;
            match k {
                "nproc" => info.nproc = v.parse().ok()?,
                "nnodes" => info.nnodes = v.parse().ok()?,
                "max_restarts" => info.max_restarts = v.parse().ok()?,
                "pid" => info.pid = v.parse().ok()?,
                "host" => info.host = v.to_string(),
                _ => return None,
            }
        }
        Some(info)
    }
}

/// The outcome of a completed round: where this node's workers sit in the job.
#[derive(Debug, Clone)]
pub struct Round {
    pub attempt: u32,
    /// Global rank of this node's local rank 0.
    pub rank_offset: usize,
    pub world_size: usize,
    pub nodes: Vec<NodeInfo>,
}

/// Ranks are given out in node order.
pub fn assign(nodes: &[NodeInfo], node_rank: usize) -> (usize, usize) {
    let offset = nodes.iter().take(node_rank).map(|n| n.nproc).sum();
    let world = nodes.iter().map(|n| n.nproc).sum();
    (offset, world)
}

/// `host:port` with brackets for IPv6 literals.
pub fn join_host_port(host: &str, port: u16) -> String {
    if host.contains(':') && !host.starts_with('[') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    }
}

/// Address workers are given and the address node 0 binds, for a `--master-addr`.
/// Loopback masters bind themselves; any other master binds every interface so that other
/// nodes can connect whatever name they use for node 0.
pub fn addresses(master_addr: &str) -> (String, String) {
    if master_addr == "localhost" {
        return ("127.0.0.1".into(), "127.0.0.1".into());
    }
    match master_addr.parse::<IpAddr>() {
        Ok(ip) if ip.is_loopback() => (master_addr.into(), master_addr.into()),
        Ok(IpAddr::V6(_)) => (master_addr.into(), "::".into()),
        _ => (master_addr.into(), "0.0.0.0".into()),
    }
}

/// The address node 0's store listens on for a `--master-addr`: the address itself when it is
/// one of this machine's (a name: the first of its addresses that is, unless they are all
/// loopback ones, as a host name mapped to 127.0.1.1 is, which other nodes cannot reach),
/// else every interface ([`addresses`]). `Err`: a name that does not resolve here, where the
/// workers will need it.
pub fn bind_address(master_addr: &str) -> Result<String, String> {
    let (_, fallback) = addresses(master_addr);
    if fallback != "0.0.0.0" && fallback != "::" {
        return Ok(fallback); // loopback
    }
    let local = |ip: IpAddr| TcpListener::bind((ip, 0)).is_ok();
    if let Ok(ip) = master_addr.parse::<IpAddr>() {
        return Ok(if local(ip) { ip.to_string() } else { fallback });
    }
    let resolved: Vec<IpAddr> = (master_addr, 0)
        .to_socket_addrs()
        .map_err(|e| {
            format!(
                "--master-addr/--rdzv-endpoint host `{master_addr}` does not resolve on node 0 \
                 ({e}); its workers, which reach the store there, could not start"
            )
        })?
        .map(|a| a.ip())
        .collect();
    Ok(resolved
        .into_iter()
        .find(|&ip| !ip.is_loopback() && local(ip))
        .map_or(fallback, |ip| ip.to_string()))
}

/// A launcher's connection to the rendezvous store (and, on node 0, the store itself).
pub struct Rendezvous {
    // Declared before `server` so the client is closed before the server shuts down.
    store: TcpStore,
    server: Option<StoreServer>,
    /// What workers get as MASTER_ADDR / MASTER_PORT.
    pub master_addr: String,
    pub master_port: u16,
    /// `host:port` of the store, for messages.
    pub endpoint: String,
    run_id: String,
    node_rank: usize,
    nnodes: usize,
    max_restarts: u32,
    host: String,
    /// Node ranks seen in the latest round this launcher joined (empty: never joined one).
    last_round: RefCell<Vec<usize>>,
}

/// Connect a launcher's client to the store at `connect_addr` (named `endpoint` in messages),
/// retrying until `wait` passes; `timeout` bounds each operation. `interrupted` is polled while
/// waiting for the store to come up.
#[allow(clippy::too_many_arguments)]
pub(crate) fn connect_store(
    connect_addr: &str,
    endpoint: &str,
    secret: Option<String>,
    wait: Duration,
    timeout: Duration,
    hosted_by: &str,
    hint: &str,
    interrupted: &mut dyn FnMut() -> Option<i32>,
) -> Result<TcpStore, Stop> {
    let deadline = Instant::now() + wait;
    let mut pause = Duration::from_millis(200);
    loop {
        let remaining = deadline.saturating_duration_since(Instant::now());
        let opts = StoreOptions {
            secret: secret.clone(),
            timeout,
            connect_timeout: remaining
                .min(Duration::from_secs(2))
                .max(Duration::from_millis(100)),
        };
        match TcpStore::connect(connect_addr, opts) {
            Ok(s) => return Ok(s),
            // A refusal by a running store (e.g. wrong DDP_STORE_SECRET) or a malformed
            // address will not go away by retrying.
            Err(e @ (ddp_comm::Error::Store { .. } | ddp_comm::Error::Config(_))) => {
                return Err(Stop::Error(format!(
                    "cannot join the rendezvous store at {endpoint}: {e}"
                )))
            }
            Err(e) => {
                if let Some(sig) = interrupted() {
                    return Err(Stop::Signal(sig));
                }
                if Instant::now() >= deadline {
                    return Err(Stop::Error(format!(
                        "cannot reach the rendezvous store at {endpoint} ({hosted_by}) within \
                         {wait:?} (--rdzv-timeout): {e}. {hint}"
                    )));
                }
                let left = deadline.saturating_duration_since(Instant::now());
                pause = pause.min(left);
                eprintln!(
                    "ddprun: the rendezvous store at {endpoint} ({hosted_by}) is not reachable \
                     yet: {e}; retrying in {pause:.1?} ({left:.0?} left of --rdzv-timeout)"
                );
                std::thread::sleep(pause);
                pause = (pause * 2).min(Duration::from_secs(2));
            }
        }
    }
}

pub(crate) fn store_error(endpoint: &str, what: &str, e: impl std::fmt::Display) -> String {
    format!("rendezvous store at {endpoint}: {what}: {e}")
}

impl Rendezvous {
    /// Records that global rank `rank` of round `round` exited (`how`), for its peers still
    /// waiting for it in the process group's rendezvous (see [`note_exit`]).
    pub(crate) fn note_exit(&self, round: u32, rank: usize, how: &str) {
        note_exit(&self.store, round, rank, how);
    }

    /// Host the store (node 0) and connect to it, retrying until `cfg.rdzv_timeout`.
    /// `interrupted` is polled while waiting for the store to come up.
    pub fn start(
        cfg: &Config,
        host: &str,
        interrupted: &mut dyn FnMut() -> Option<i32>,
    ) -> Result<Rendezvous, Stop> {
        let secret = std::env::var(SECRET_ENV).ok().filter(|s| !s.is_empty());
        let (worker_addr, _) = addresses(&cfg.master_addr);
        let (server, port, connect_host) = if cfg.node_rank == 0 {
            let bind_addr = bind_address(&cfg.master_addr).map_err(Stop::Error)?;
            let bind = join_host_port(&bind_addr, cfg.master_port);
            let opts = ServerOptions {
                secret: secret.clone(),
                max_bytes: Some(cfg.store_max_bytes),
                ..ServerOptions::default()
            };
            let server = StoreServer::bind_with(&bind, opts).map_err(|e| {
                let msg = e.to_string();
                let hint = if msg.to_lowercase().contains("in use") {
                    "; for a single-node job, --standalone or --master-port 0 picks a free port"
                } else {
                    ""
                };
                Stop::Error(format!(
                    "{msg} (node 0 hosts the rendezvous store at --master-addr {} --master-port {}){hint}",
                    cfg.master_addr, cfg.master_port
                ))
            })?;
            let port = server.local_addr().port();
            let connect_host = match bind_addr.as_str() {
                "0.0.0.0" => "127.0.0.1".to_string(),
                "::" => "::1".to_string(),
                other => other.to_string(),
            };
            (Some(server), port, connect_host)
        } else {
            (None, cfg.master_port, worker_addr.clone())
        };
        let endpoint = join_host_port(&worker_addr, port);
        let connect_addr = join_host_port(&connect_host, port);
        let store = connect_store(
            &connect_addr,
            &endpoint,
            secret,
            cfg.rdzv_timeout,
            cfg.rdzv_timeout,
            "hosted by node 0's ddprun",
            "Is node 0 started, and are --master-addr/--master-port right and reachable from \
             this host?",
            interrupted,
        )?;
        Ok(Rendezvous {
            store,
            server,
            master_addr: worker_addr,
            master_port: port,
            endpoint,
            run_id: cfg.run_id.clone(),
            node_rank: cfg.node_rank,
            nnodes: cfg.nnodes,
            max_restarts: cfg.max_restarts,
            host: host.to_string(),
            last_round: RefCell::new(Vec::new()),
        })
    }

    fn key(&self, attempt: u32, rest: &str) -> String {
        format!("ddprun/{}/{attempt}/{rest}", self.run_id)
    }

    fn err(&self, what: &str, e: impl std::fmt::Display) -> Stop {
        Stop::Error(store_error(&self.endpoint, what, e))
    }

    /// Join round `attempt` with `nproc` local workers and wait (up to `timeout`) until all
    /// nodes have joined. The error names the nodes that did not arrive.
    pub fn join(
        &self,
        attempt: u32,
        nproc: usize,
        timeout: Duration,
        poll: Duration,
        interrupted: &mut dyn FnMut() -> Option<i32>,
    ) -> Result<Round, Stop> {
        let me = NodeInfo {
            node_rank: self.node_rank,
            nproc,
            nnodes: self.nnodes,
            max_restarts: self.max_restarts,
            host: self.host.clone(),
            pid: std::process::id(),
        };
        if let Some(server) = &self.server {
            // PyTorch workers of this round get their own namespace in the store (node 0 joins
            // a round before any worker of it starts), so a restarted group never reads the
            // addresses and counters of the one before.
            server.set_torch_prefix(&format!("torch/{}/{attempt}/", self.run_id));
        }
        let my_key = self.key(attempt, &format!("node/{}", self.node_rank));
        let mine = me.encode();
        let now = self
            .store
            .compare_set(&my_key, b"", mine.as_bytes())
            .map_err(|e| self.err(&format!("joining round {attempt}"), e))?;
        if now != mine.as_bytes() {
            let other = String::from_utf8_lossy(&now);
            return Err(Stop::Error(format!(
                "another launcher already joined run {} as node rank {} ({other}); give each \
                 node its own --node-rank in 0..{} (or a different --run-id per job)",
                self.run_id, self.node_rank, self.nnodes
            )));
        }
        let deadline = Instant::now() + timeout;
        let mut nodes: Vec<Option<NodeInfo>> = vec![None; self.nnodes];
        nodes[self.node_rank] = Some(me);
        *self.last_round.borrow_mut() = vec![self.node_rank];
        loop {
            for (r, slot) in nodes.iter_mut().enumerate() {
                if slot.is_some() {
                    continue;
                }
                let key = self.key(attempt, &format!("node/{r}"));
                if self
                    .store
                    .check(&key)
                    .map_err(|e| self.err("waiting for nodes", e))?
                {
                    let v = self
                        .store
                        .get(&key)
                        .map_err(|e| self.err("waiting for nodes", e))?;
                    let v = String::from_utf8_lossy(&v);
                    let info = NodeInfo::decode(r, &v).ok_or_else(|| {
                        Stop::Error(format!("node {r} published an unreadable entry `{v}`"))
                    })?;
                    self.last_round.borrow_mut().push(r);
                    self.check_compatible(&info)?;
                    *slot = Some(info);
                }
            }
            if nodes.iter().all(Option::is_some) {
                let nodes: Vec<NodeInfo> = nodes.into_iter().map(Option::unwrap).collect();
                let (rank_offset, world_size) = assign(&nodes, self.node_rank);
                if world_size > MAX_WORLD_SIZE {
                    return Err(Stop::Error(format!(
                        "the nodes' workers add up to a world size of {world_size}, more than \
                         ddp-rs supports (at most {MAX_WORLD_SIZE})"
                    )));
                }
                return Ok(Round {
                    attempt,
                    rank_offset,
                    world_size,
                    nodes,
                });
            }
            if let Some(f) = self.failure(attempt)? {
                return Err(Stop::Remote(f));
            }
            if let Some(sig) = interrupted() {
                return Err(Stop::Signal(sig));
            }
            if Instant::now() >= deadline {
                let missing: Vec<usize> = nodes
                    .iter()
                    .enumerate()
                    .filter(|(_, n)| n.is_none())
                    .map(|(r, _)| r)
                    .collect();
                let joined = list_bounded(
                    nodes
                        .iter()
                        .flatten()
                        .map(|n| format!("{} ({})", n.node_rank, n.host)),
                    LIST_SHOWN,
                );
                return Err(Stop::Error(format!(
                    "rendezvous timed out after {timeout:?} (--rdzv-timeout): node{} {} of \
                     --nnodes {} never arrived at the store {} (run id {}, attempt {attempt}); \
                     joined: {}. Start `ddprun --node-rank N` with the same --nnodes, \
                     --master-addr, --master-port and --run-id on the missing node(s).",
                    if missing.len() == 1 { "" } else { "s" },
                    list_bounded(&missing, LIST_SHOWN),
                    self.nnodes,
                    self.endpoint,
                    self.run_id,
                    joined
                )));
            }
            std::thread::sleep(poll.min(deadline.saturating_duration_since(Instant::now())));
        }
    }

    fn check_compatible(&self, other: &NodeInfo) -> Result<(), Stop> {
        let mismatch = |what: &str, mine: String, theirs: String| {
            Err(Stop::Error(format!(
                "node {} (host {}) was started with {what} {theirs} but this node (node {}) with \
                 {what} {mine}; every node needs the same value",
                other.node_rank, other.host, self.node_rank
            )))
        };
        if other.nnodes != self.nnodes {
            return mismatch(
                "--nnodes",
                self.nnodes.to_string(),
                other.nnodes.to_string(),
            );
        }
        if other.max_restarts != self.max_restarts {
            return mismatch(
                "--max-restarts",
                self.max_restarts.to_string(),
                other.max_restarts.to_string(),
            );
        }
        Ok(())
    }

    /// Publish this node's failure for round `attempt` (first report wins). A launcher that
    /// never joined a round (e.g. a rejected duplicate node rank) reports nothing.
    pub fn report_failure(&self, attempt: u32, restart: bool, what: &str) {
        if self.last_round.borrow().is_empty() {
            return;
        }
        let v = format!(
            "{}\n{}\n{}",
            if restart { "restart" } else { "final" },
            self.node_rank,
            what
        );
        // Best effort: if the store is gone, the other nodes will notice that themselves.
        let _ = self
            .store
            .compare_set(&self.key(attempt, "failed"), b"", v.as_bytes());
    }

    /// The failure reported for round `attempt`, if any (including this node's own).
    pub fn failure(&self, attempt: u32) -> Result<Option<RemoteFailure>, Stop> {
        if self.nnodes == 1 {
            return Ok(None);
        }
        let key = self.key(attempt, "failed");
        let lost = |e| self.err("lost contact (did node 0's ddprun exit?)", e);
        if !self.store.check(&key).map_err(lost)? {
            return Ok(None);
        }
        let v = self.store.get(&key).map_err(lost)?;
        let v = String::from_utf8_lossy(&v);
        let mut parts = v.splitn(3, '\n');
        let restart = parts.next() == Some("restart");
        let node_rank = parts.next().and_then(|n| n.parse().ok()).unwrap_or(0);
        let what = parts.next().unwrap_or("").to_string();
        Ok(Some(RemoteFailure {
            node_rank,
            restart,
            what,
        }))
    }

    /// Publish that every worker of this node succeeded in round `attempt`.
    pub fn report_done(&self, attempt: u32) -> Result<(), Stop> {
        self.store
            .set(
                &self.key(attempt, &format!("done/{}", self.node_rank)),
                b"1",
            )
            .map_err(|e| self.err("reporting success", e))
    }

    /// Node ranks that have not reported success for round `attempt` yet.
    pub fn not_done(&self, attempt: u32) -> Result<Vec<usize>, Stop> {
        let mut missing = Vec::new();
        for r in 0..self.nnodes {
            let key = self.key(attempt, &format!("done/{r}"));
            if !self
                .store
                .check(&key)
                .map_err(|e| self.err("lost contact (did node 0's ddprun exit?)", e))?
            {
                missing.push(r);
            }
        }
        Ok(missing)
    }

    /// Leave the job. Node 0 keeps hosting the store until every node of the latest round has
    /// left or `linger` passes, so that the others can still read the job's outcome.
    pub fn finish(self, linger: Duration) {
        let members = self.last_round.take();
        if members.is_empty() {
            return; // never joined (e.g. a rejected duplicate node rank): nothing to announce
        }
        let key = |r: usize| format!("ddprun/{}/left/{r}", self.run_id);
        let _ = self.store.set(&key(self.node_rank), b"1");
        if self.server.is_none() {
            return;
        }
        let deadline = Instant::now() + linger;
        for r in members {
            while Instant::now() < deadline {
                match self.store.check(&key(r)) {
                    Ok(false) => std::thread::sleep(Duration::from_millis(20)),
                    _ => break,
                }
            }
        }
    }
}

/// Records in `store` that global rank `rank` of rendezvous round `round` exited (`how`): a
/// peer still waiting for it to join the process group fails at once, naming it, instead of
/// running into the timeout (`ddp_comm::process_group::exited_key`). Best effort: a store that
/// cannot be reached only loses the shortcut.
pub(crate) fn note_exit(store: &dyn ddp_comm::store::Store, round: u32, rank: usize, how: &str) {
    let key = ddp_comm::process_group::exited_key(round, rank);
    let _ = store.set(&key, how.as_bytes());
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn node_info_roundtrip_and_rank_assignment() {
        let n = |r, nproc| NodeInfo {
            node_rank: r,
            nproc,
            nnodes: 3,
            max_restarts: 1,
            host: "h;x=y".into(),
            pid: 9,
        };
        let a = n(1, 4);
        assert_eq!(NodeInfo::decode(1, &a.encode()), Some(a));
        assert_eq!(NodeInfo::decode(1, "garbage"), None);
        let nodes = [n(0, 2), n(1, 4), n(2, 1)];
        assert_eq!(assign(&nodes, 0), (0, 7));
        assert_eq!(assign(&nodes, 2), (6, 7));
    }

    #[test]
    fn bind_addresses() {
        assert_eq!(
            addresses("127.0.0.1"),
            ("127.0.0.1".into(), "127.0.0.1".into())
        );
        assert_eq!(
            addresses("localhost"),
            ("127.0.0.1".into(), "127.0.0.1".into())
        );
        assert_eq!(addresses("10.0.0.1"), ("10.0.0.1".into(), "0.0.0.0".into()));
        assert_eq!(addresses("node01"), ("node01".into(), "0.0.0.0".into()));
        assert_eq!(addresses("fe80::1"), ("fe80::1".into(), "::".into()));
        assert_eq!(join_host_port("::1", 5), "[::1]:5");
        assert_eq!(join_host_port("h", 5), "h:5");
    }
}
