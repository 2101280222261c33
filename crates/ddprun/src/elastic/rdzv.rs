//! The elastic rendezvous through the TCP store (torchrun's c10d backend, in spirit).
//!
//! Every launcher is started with the same flags. The first one on the endpoint's host to bind
//! its port serves the store; all connect to it as clients. Keys, under `ddprun/RUN_ID/elastic/`:
//!
//! - `ids`: a counter giving each launcher its node id; `node/ID`: its worker count, `--nnodes`
//!   range, `--max-restarts`, host and pid; `hb/ID`: its heartbeat counter ([`super::heartbeat`]).
//! - `dead/ID`: why node `ID` was declared dead (first writer wins); `left/ID`: it exited.
//! - `r/R/tickets`, `r/R/t/K`: nodes joining round `R` take ticket `K` (their order in the round).
//! - `r/R/closed`: the round's members in ticket order and its restart count (first writer
//!   wins: whoever closes it decides who is in; a node not listed waits for round `R + 1`).
//!   A round closes once `min` live nodes joined and then `max` did, the last call passed, or
//!   (after round 0) every live member of the round before rejoined; never before round `R - 1`
//!   has ended, so nodes waiting to join cannot start a job of their own.
//! - `r/R/end`: why round `R` ended (first writer wins): `restart`/`final` for a failure (a
//!   worker, a lost node; restarts counted as torchrun does) or `join` (nodes wait in `R + 1`:
//!   membership grows, not counted). `r/R/done/ID`: node `ID`'s workers all succeeded.
//! - `current`: the latest closed round (a hint for arriving nodes); `finished`: the job is done.

use super::heartbeat::{Beater, Watch};
use crate::cli::{Config, Elastic};
use crate::rendezvous::{addresses, connect_store, join_host_port, RemoteFailure, Stop};
use ddp_comm::store::{Store, StoreServer, TcpStore, SECRET_ENV};
use std::cell::RefCell;
use std::net::ToSocketAddrs;
use std::time::{Duration, Instant};

/// One node's entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Member {
    pub id: u64,
    pub nproc: usize,
    pub min: usize,
    pub max: usize,
    pub max_restarts: u32,
    pub pid: u32,
    pub host: String,
}

impl Member {
    /// The store value of the entry.
    pub fn encode(&self) -> String {
        format!(
            "nproc={};min={};max={};max_restarts={};pid={};host={}",
            self.nproc, self.min, self.max, self.max_restarts, self.pid, self.host
        )
    }

    /// The entry of node `id` from its store value; `None` when unreadable.
    pub fn decode(id: u64, s: &str) -> Option<Member> {
        let mut m = Member {
            id,
            nproc: 0,
            min: 0,
            max: 0,
            max_restarts: 0,
            pid: 0,
            host: String::new(),
        };
        for part in s.splitn(6, ';') {
            let (k, v) = part.split_once('=')?;
            match k {
                "nproc" => m.nproc = v.parse().ok()?,
                "min" => m.min = v.parse().ok()?,
                "max" => m.max = v.parse().ok()?,
                "max_restarts" => m.max_restarts = v.parse().ok()?,
                "pid" => m.pid = v.parse().ok()?,
                "host" => m.host = v.to_string(),
                _ => return None,
            }
        }
        Some(m)
    }

    /// `node ID (host HOST, pid PID)`.
    pub fn describe(&self) -> String {
        format!("node id {} (host {}, pid {})", self.id, self.host, self.pid)
    }
}

/// A closed round: who is in, in rank order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Closed {
    /// Failures restarted before this round (`TORCHELASTIC_RESTART_COUNT`).
    pub restarts: u32,
    pub members: Vec<u64>,
}

impl Closed {
    fn encode(&self) -> String {
        let ids: Vec<String> = self.members.iter().map(u64::to_string).collect();
        format!("{}\n{}", self.restarts, ids.join(","))
    }

    /// A closed round from its store value; `None` when unreadable.
    pub fn decode(s: &str) -> Option<Closed> {
        let (r, ids) = s.split_once('\n')?;
        let members = ids
            .split(',')
            .map(|i| i.parse().ok())
            .collect::<Option<Vec<u64>>>()?;
        Some(Closed {
            restarts: r.parse().ok()?,
            members,
        })
    }
}

/// Why a round ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum End {
    /// A failure (worker, lost node, a node stopped); `restart`: the others go on.
    Failure {
        restart: bool,
        node: u64,
        what: String,
    },
    /// Nodes wait to join: every member rejoins at the next round (not a failure).
    Join(String),
}

impl End {
    fn encode(&self) -> String {
        match self {
            End::Failure {
                restart,
                node,
                what,
            } => format!(
                "{}\n{node}\n{what}",
                if *restart { "restart" } else { "final" }
            ),
            End::Join(what) => format!("join\n0\n{what}"),
        }
    }

    /// Why a round ended, from its store value (unknown kinds read as a final failure).
    pub fn decode(s: &str) -> End {
        let mut p = s.splitn(3, '\n');
        let kind = p.next().unwrap_or("");
        let node = p.next().and_then(|n| n.parse().ok()).unwrap_or(0);
        let what = p.next().unwrap_or("").to_string();
        match kind {
            "join" => End::Join(what),
            k => End::Failure {
                restart: k == "restart",
                node,
                what,
            },
        }
    }

    /// What the supervision loop makes of it.
    pub fn into_stop(self, node_rank_of: impl Fn(u64) -> usize) -> Stop {
        match self {
            End::Join(what) => Stop::Rejoin(what),
            End::Failure {
                restart,
                node,
                what,
            } => Stop::Remote(RemoteFailure {
                node_rank: node_rank_of(node),
                restart,
                what,
            }),
        }
    }
}

/// This node's place in a closed round.
#[derive(Debug, Clone)]
pub struct Round {
    pub round: u32,
    pub restarts: u32,
    /// Members in rank order.
    pub members: Vec<Member>,
    /// This node's index in `members` (`GROUP_RANK`).
    pub node_rank: usize,
    pub rank_offset: usize,
    pub world_size: usize,
}

/// A launcher's side of the elastic rendezvous.
pub struct ElasticRdzv {
    // The beater and the client go before the server.
    beater: Option<Beater>,
    store: TcpStore,
    server: Option<StoreServer>,
    pub master_addr: String,
    pub master_port: u16,
    pub endpoint: String,
    /// Who serves the store, for messages.
    pub store_owner: String,
    prefix: String,
    pub me: Member,
    pub conf: Elastic,
    max_restarts: u32,
    rdzv_timeout: Duration,
    watch: RefCell<Watch>,
    /// Members of the latest round this node was in (the store's host waits for them to leave).
    last_members: RefCell<Vec<Member>>,
}

/// Try to serve the store on the endpoint's own address: succeeds on the endpoint's host for the
/// first launcher there; elsewhere the address is not local, or the port is taken.
fn try_host(addr: &str, port: u16, secret: Option<String>, max_bytes: u64) -> Option<StoreServer> {
    let addrs = (addr, port).to_socket_addrs().ok()?;
    for a in addrs {
        let opts = ddp_comm::store::ServerOptions {
            secret: secret.clone(),
            max_bytes: Some(max_bytes),
            ..Default::default()
        };
        if let Ok(s) = StoreServer::bind_with(&a.to_string(), opts) {
            return Some(s);
        }
    }
    None
}

impl ElasticRdzv {
    /// Records that global rank `rank` of round `round` exited (`how`), for its peers still
    /// waiting for it in the process group's rendezvous (see [`crate::rendezvous::note_exit`]).
    pub(crate) fn note_exit(&self, round: u32, rank: usize, how: &str) {
        crate::rendezvous::note_exit(&self.store, round, rank, how);
    }

    /// Serve the store if this launcher is the first on the endpoint's host, connect to it,
    /// take a node id and start beating.
    pub fn start(
        cfg: &Config,
        conf: &Elastic,
        host: &str,
        interrupted: &mut dyn FnMut() -> Option<i32>,
    ) -> Result<ElasticRdzv, Stop> {
        let secret = std::env::var(SECRET_ENV).ok().filter(|s| !s.is_empty());
        let (addr, _) = addresses(&cfg.master_addr);
        let server = try_host(&addr, cfg.master_port, secret.clone(), cfg.store_max_bytes);
        let endpoint = join_host_port(&addr, cfg.master_port);
        // Operations are answered at once; a store that stops answering (its host hung) is
        // noticed within the heartbeat timeout plus a few seconds.
        let op_timeout = conf.heartbeat_timeout.max(Duration::from_secs(1));
        let connect = |wait| {
            connect_store(
                &endpoint,
                &endpoint,
                secret.clone(),
                wait,
                op_timeout,
                "served by the first elastic launcher started on that host",
                "Is a launcher started on the endpoint's host, and is --rdzv-endpoint right and \
                 reachable from this host?",
                &mut || None,
            )
        };
        let store = connect_store(
            &endpoint,
            &endpoint,
            secret.clone(),
            cfg.rdzv_timeout,
            op_timeout,
            "served by the first elastic launcher started on that host",
            "Is a launcher started on the endpoint's host, and is --rdzv-endpoint right and \
             reachable from this host?",
            interrupted,
        )?;
        let beat_conn = connect(Duration::from_secs(10))?;
        let prefix = format!("ddprun/{}/elastic/", cfg.run_id);
        let err = |what: &str, e: ddp_comm::Error| {
            Stop::Error(format!("rendezvous store at {endpoint}: {what}: {e}"))
        };
        let id = store
            .add(&format!("{prefix}ids"), 1)
            .map_err(|e| err("taking a node id", e))? as u64;
        let me = Member {
            id,
            nproc: cfg.nproc_per_node,
            min: conf.min_nodes,
            max: conf.max_nodes,
            max_restarts: cfg.max_restarts,
            pid: std::process::id(),
            host: host.to_string(),
        };
        store
            .set(&format!("{prefix}node/{id}"), me.encode().as_bytes())
            .map_err(|e| err("publishing this node", e))?;
        let owner_key = format!("{prefix}store_owner");
        if server.is_some() {
            let v = format!("the launcher with pid {} on {host}", me.pid);
            let _ = store.set(&owner_key, v.as_bytes());
        }
        let store_owner = match store.check(&owner_key) {
            Ok(true) => store
                .get(&owner_key)
                .map(|v| String::from_utf8_lossy(&v).into_owned())
                .unwrap_or_default(),
            _ => "the first launcher started on the endpoint's host".into(),
        };
        let interval = (conf.heartbeat_timeout / 5).max(Duration::from_millis(10));
        let beater = Beater::start(beat_conn, format!("{prefix}hb/{id}"), interval)
            .map_err(|e| Stop::Error(format!("cannot start the heartbeat thread: {e}")))?;
        Ok(ElasticRdzv {
            beater: Some(beater),
            store,
            server,
            master_addr: addr,
            master_port: cfg.master_port,
            endpoint,
            store_owner,
            prefix,
            me,
            conf: conf.clone(),
            max_restarts: cfg.max_restarts,
            rdzv_timeout: cfg.rdzv_timeout,
            watch: RefCell::new(Watch::default()),
            last_members: RefCell::new(Vec::new()),
        })
    }

    /// Whether this launcher serves the store.
    pub fn hosts_store(&self) -> bool {
        self.server.is_some()
    }

    fn key(&self, rest: &str) -> String {
        format!("{}{rest}", self.prefix)
    }

    fn lost(&self, e: ddp_comm::Error) -> Stop {
        Stop::Error(format!(
            "lost contact with the rendezvous store at {} ({e}); it is served by {}, and an \
             elastic job cannot outlive the node that serves its store (as with torchrun's c10d \
             rendezvous)",
            self.endpoint, self.store_owner
        ))
    }

    fn check(&self, rest: &str) -> Result<bool, Stop> {
        self.store.check(&self.key(rest)).map_err(|e| self.lost(e))
    }

    /// The value of a key, `None` when missing.
    fn read(&self, rest: &str) -> Result<Option<String>, Stop> {
        if !self.check(rest)? {
            return Ok(None);
        }
        let v = self.store.get(&self.key(rest)).map_err(|e| self.lost(e))?;
        Ok(Some(String::from_utf8_lossy(&v).into_owned()))
    }

    /// Set `rest` unless it is set; returns the value it has afterwards.
    fn first_writer(&self, rest: &str, v: &str) -> Result<String, Stop> {
        let now = self
            .store
            .compare_set(&self.key(rest), b"", v.as_bytes())
            .map_err(|e| self.lost(e))?;
        Ok(String::from_utf8_lossy(&now).into_owned())
    }

    pub fn member(&self, id: u64) -> Result<Member, Stop> {
        let v = self.read(&format!("node/{id}"))?.ok_or_else(|| {
            Stop::Error(format!("node id {id} joined but never published its entry"))
        })?;
        Member::decode(id, &v)
            .ok_or_else(|| Stop::Error(format!("node id {id} published an unreadable entry `{v}`")))
    }

    pub fn closed(&self, round: u32) -> Result<Option<Closed>, Stop> {
        let Some(v) = self.read(&format!("r/{round}/closed"))? else {
            return Ok(None);
        };
        Closed::decode(&v)
            .map(Some)
            .ok_or_else(|| Stop::Error(format!("round {round} has an unreadable entry `{v}`")))
    }

    pub fn end(&self, round: u32) -> Result<Option<End>, Stop> {
        Ok(self
            .read(&format!("r/{round}/end"))?
            .map(|v| End::decode(&v)))
    }

    /// End `round` for `why` unless it already ended; returns why it ended.
    pub fn end_round(&self, round: u32, why: &End) -> Result<End, Stop> {
        let v = self.first_writer(&format!("r/{round}/end"), &why.encode())?;
        Ok(End::decode(&v))
    }

    /// Why node `id` was declared dead, if it was.
    pub fn dead(&self, id: u64) -> Result<Option<String>, Stop> {
        self.read(&format!("dead/{id}"))
    }

    /// Whether node `id`'s heartbeat is older than the timeout: then it is declared dead (first
    /// declaration wins) and the reason returned.
    pub fn stale(&self, m: &Member) -> Result<Option<String>, Stop> {
        if let Some(why) = self.dead(m.id)? {
            return Ok(Some(why));
        }
        let v = self
            .store
            .add(&self.key(&format!("hb/{}", m.id)), 0)
            .map_err(|e| self.lost(e))?;
        let age = self.watch.borrow_mut().observe(m.id, v);
        if age <= self.conf.heartbeat_timeout {
            return Ok(None);
        }
        let why = format!(
            "{} lost: no heartbeat for {:.2}s (--heartbeat-timeout {:?}; the launcher died, hung \
             or is cut off)",
            m.describe(),
            age.as_secs_f64(),
            self.conf.heartbeat_timeout
        );
        Ok(Some(self.first_writer(&format!("dead/{}", m.id), &why)?))
    }

    /// An error when the other nodes declared this one dead (it was stopped or cut off for
    /// longer than the heartbeat timeout, and they went on without it).
    fn check_alive(&self) -> Result<(), Stop> {
        match self.dead(self.me.id)? {
            None => Ok(()),
            Some(why) => Err(Stop::Error(format!(
                "the other nodes declared this node dead and went on without it ({why})"
            ))),
        }
    }

    /// Whether node `id`'s launcher has left the job.
    pub fn left(&self, id: u64) -> Result<bool, Stop> {
        self.check(&format!("left/{id}"))
    }

    pub fn report_done(&self, round: u32) -> Result<(), Stop> {
        self.store
            .set(&self.key(&format!("r/{round}/done/{}", self.me.id)), b"1")
            .map_err(|e| self.lost(e))
    }

    pub fn is_done(&self, round: u32, id: u64) -> Result<bool, Stop> {
        self.check(&format!("r/{round}/done/{id}"))
    }

    /// Whether nodes wait to join the round after `round`.
    pub fn waiting_after(&self, round: u32) -> Result<bool, Stop> {
        self.check(&format!("r/{}/tickets", round + 1))
    }

    pub fn set_finished(&self, round: u32) {
        let _ = self.first_writer("finished", &round.to_string());
    }

    /// The round an arriving node joins: the open one, or the one after the running one.
    pub fn first_round(&self) -> Result<u32, Stop> {
        let mut r: u32 = self
            .read("current")?
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        loop {
            if !self.check(&format!("r/{r}/closed"))? {
                return Ok(r);
            }
            if !self.check(&format!("r/{r}/end"))? {
                return Ok(r + 1);
            }
            r += 1;
        }
    }

    /// Join round `round` (or a later one, when it closes without this node) and wait until a
    /// round with this node closes. Errors when fewer than `min` live nodes join within
    /// `--rdzv-timeout`, naming the nodes lost since the round before.
    pub fn join(
        &self,
        mut round: u32,
        poll: Duration,
        interrupted: &mut dyn FnMut() -> Option<i32>,
    ) -> Result<Round, Stop> {
        let deadline = Instant::now() + self.rdzv_timeout;
        'rounds: loop {
            if let Some(server) = &self.server {
                server.set_torch_prefix(&format!("torch/{}{round}/", self.prefix));
            }
            let prev = match round {
                0 => None,
                r => Some((self.closed(r - 1)?, self.end(r - 1)?)),
            };
            if let Some((
                _,
                Some(End::Failure {
                    restart: false,
                    what,
                    node,
                }),
            )) = &prev
            {
                return Err(Stop::Remote(RemoteFailure {
                    node_rank: *node as usize,
                    restart: false,
                    what: what.clone(),
                }));
            }
            let restarts = match &prev {
                Some((Some(c), end)) => {
                    c.restarts + u32::from(matches!(end, Some(End::Failure { .. })))
                }
                _ => 0,
            };
            self.check_alive()?;
            let t = self
                .store
                .add(&self.key(&format!("r/{round}/tickets")), 1)
                .map_err(|e| self.lost(e))?;
            self.store
                .set(
                    &self.key(&format!("r/{round}/t/{t}")),
                    self.me.id.to_string().as_bytes(),
                )
                .map_err(|e| self.lost(e))?;
            let mut min_since: Option<Instant> = None;
            let mut members: Vec<Member> = Vec::new();
            loop {
                if self.check("finished")? {
                    return Err(Stop::JobDone(
                        "the job has already finished without this node".into(),
                    ));
                }
                if let Some(c) = self.closed(round)? {
                    if let Some(node_rank) = c.members.iter().position(|&id| id == self.me.id) {
                        let all: Vec<Member> = c
                            .members
                            .iter()
                            .map(|&id| self.member(id))
                            .collect::<Result<_, _>>()?;
                        let rank_offset = all[..node_rank].iter().map(|m| m.nproc).sum();
                        let world_size = all.iter().map(|m| m.nproc).sum();
                        *self.last_members.borrow_mut() = all.clone();
                        return Ok(Round {
                            round,
                            restarts: c.restarts,
                            members: all,
                            node_rank,
                            rank_offset,
                            world_size,
                        });
                    }
                    eprintln!(
                        "ddprun: round {round} started without this node ({} of at most {} \
                         nodes); waiting for round {}",
                        c.members.len(),
                        self.conf.max_nodes,
                        round + 1
                    );
                    round += 1;
                    continue 'rounds;
                }
                members = self.joined(round, &members)?;
                let live = members.len();
                let (min, max) = (self.conf.min_nodes, self.conf.max_nodes);
                if live >= min {
                    min_since.get_or_insert_with(Instant::now);
                } else {
                    min_since = None;
                }
                let prev_ended = round == 0 || self.check(&format!("r/{}/end", round - 1))?;
                let all_back = match &prev {
                    Some((Some(c), _)) => {
                        let mut back = true;
                        for &id in &c.members {
                            // Still expected: alive (its heartbeat moves), not joined, not left.
                            if !members.iter().any(|m| m.id == id)
                                && !self.left(id)?
                                && self.stale(&self.member(id)?)?.is_none()
                            {
                                back = false;
                            }
                        }
                        back
                    }
                    _ => false,
                };
                let last_call = min_since.is_some_and(|t| t.elapsed() >= self.conf.last_call);
                if live >= min && prev_ended && (live >= max || last_call || all_back) {
                    let ids: Vec<u64> = members.iter().take(max).map(|m| m.id).collect();
                    let c = Closed {
                        restarts,
                        members: ids,
                    };
                    self.first_writer(&format!("r/{round}/closed"), &c.encode())?;
                    let _ = self
                        .store
                        .set(&self.key("current"), round.to_string().as_bytes());
                    continue;
                }
                if let Some(sig) = interrupted() {
                    return Err(Stop::Signal(sig));
                }
                if Instant::now() >= deadline {
                    if !prev_ended {
                        return Err(Stop::Error(format!(
                            "rendezvous timed out after {:?} (--rdzv-timeout): round {} runs with \
                             the maximum of {max} nodes (--nnodes {min}:{max}) and did not end, so \
                             this node, waiting for round {round}, was never admitted",
                            self.rdzv_timeout,
                            round - 1
                        )));
                    }
                    return Err(self.too_few(round, &members, prev.and_then(|p| p.0)));
                }
                std::thread::sleep(poll);
            }
        }
    }

    /// The live nodes that joined `round`, in ticket order (`known`: those read before).
    fn joined(&self, round: u32, known: &[Member]) -> Result<Vec<Member>, Stop> {
        let n = self
            .store
            .add(&self.key(&format!("r/{round}/tickets")), 0)
            .map_err(|e| self.lost(e))?;
        let mut out = Vec::new();
        for t in 1..=n.max(0) {
            let Some(id) = self.read(&format!("r/{round}/t/{t}"))? else {
                continue; // between taking the ticket and writing it
            };
            let id: u64 = id
                .parse()
                .map_err(|_| Stop::Error(format!("round {round} ticket {t} is `{id}`")))?;
            let m = match known.iter().find(|m| m.id == id) {
                Some(m) => m.clone(),
                None => {
                    let m = self.member(id)?;
                    self.check_compatible(&m)?;
                    m
                }
            };
            if id == self.me.id || self.stale(&m)?.is_none() {
                out.push(m);
            }
        }
        Ok(out)
    }

    fn check_compatible(&self, m: &Member) -> Result<(), Stop> {
        if (m.min, m.max, m.max_restarts) == (self.me.min, self.me.max, self.me.max_restarts) {
            return Ok(());
        }
        Err(Stop::Error(format!(
            "{} was started with --nnodes {}:{} --max-restarts {} but this node with --nnodes \
             {}:{} --max-restarts {}; every node needs the same values",
            m.describe(),
            m.min,
            m.max,
            m.max_restarts,
            self.me.min,
            self.me.max,
            self.me.max_restarts
        )))
    }

    fn too_few(&self, round: u32, joined: &[Member], prev: Option<Closed>) -> Stop {
        let names = ddp_comm::env::list_bounded(
            joined.iter().map(Member::describe),
            ddp_comm::env::LIST_SHOWN,
        );
        let mut lost = Vec::new();
        for id in prev.map(|c| c.members).unwrap_or_default() {
            if let Ok(Some(why)) = self.dead(id) {
                lost.push(why);
            } else if let Ok(true) = self.left(id) {
                lost.push(format!("node id {id} left the job"));
            }
        }
        Stop::Error(format!(
            "rendezvous round {round} timed out after {:?} (--rdzv-timeout): {} live node(s) \
             joined ({}), fewer than the minimum {} of --nnodes {}:{}{}",
            self.rdzv_timeout,
            joined.len(),
            names,
            self.conf.min_nodes,
            self.conf.min_nodes,
            self.conf.max_nodes,
            if lost.is_empty() {
                String::new()
            } else {
                let more = lost.len().saturating_sub(ddp_comm::env::LIST_SHOWN);
                lost.truncate(ddp_comm::env::LIST_SHOWN);
                let more = if more > 0 {
                    format!("; and {more} more")
                } else {
                    String::new()
                };
                format!("; lost since the round before: {}{more}", lost.join("; "))
            }
        ))
    }

    /// Why the running `round` must stop, if it must: it ended (a failure anywhere, nodes
    /// waiting), this node was declared dead, nodes wait to join (and no node is done yet), or a
    /// member's heartbeat is stale (the round is ended for it).
    pub fn poll(&self, r: &Round) -> Result<Option<End>, Stop> {
        // First: a node declared dead must not go on to rejoin (its tickets would restart the
        // others' round).
        self.check_alive()?;
        if let Some(end) = self.end(r.round)? {
            return Ok(Some(end));
        }
        let mut any_done = false;
        for m in &r.members {
            if m.id == self.me.id {
                continue;
            }
            if self.is_done(r.round, m.id)? || self.left(m.id)? {
                any_done = true;
                continue;
            }
            if let Some(why) = self.stale(m)? {
                let restart = r.restarts < self.max_restarts;
                let end = End::Failure {
                    restart,
                    node: m.id,
                    what: why,
                };
                return self.end_round(r.round, &end).map(Some);
            }
        }
        if !any_done
            && !self.is_done(r.round, self.me.id)?
            && r.members.len() < self.conf.max_nodes
            && self.waiting_after(r.round)?
        {
            let end = End::Join(format!(
                "a node waits to join (the round has {} of at most {} nodes)",
                r.members.len(),
                self.conf.max_nodes
            ));
            return self.end_round(r.round, &end).map(Some);
        }
        Ok(None)
    }

    /// Leave the job: stop beating, say so, and (serving the store) keep it up until every
    /// member of the latest round has left or `linger` passes.
    pub fn finish(mut self, linger: Duration) {
        self.beater.take();
        let _ = self
            .store
            .set(&self.key(&format!("left/{}", self.me.id)), b"1");
        if self.server.is_none() {
            return;
        }
        let deadline = Instant::now() + linger;
        for m in self.last_members.take() {
            while Instant::now() < deadline {
                match self.store.check(&self.key(&format!("left/{}", m.id))) {
                    Ok(false) => {
                        // A member that died (or was declared dead) never leaves.
                        if m.id == self.me.id || !matches!(self.stale(&m), Ok(None)) {
                            break;
                        }
                        std::thread::sleep(Duration::from_millis(20))
                    }
                    _ => break,
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_roundtrip() {
        let m = Member {
            id: 3,
            nproc: 2,
            min: 1,
            max: 4,
            max_restarts: 2,
            pid: 77,
            host: "h;x=y".into(),
        };
        assert_eq!(Member::decode(3, &m.encode()), Some(m));
        assert_eq!(Member::decode(3, "junk"), None);
        let c = Closed {
            restarts: 1,
            members: vec![4, 2, 9],
        };
        assert_eq!(Closed::decode(&c.encode()), Some(c));
        assert_eq!(Closed::decode("1\nx"), None);
        for e in [
            End::Join("w".into()),
            End::Failure {
                restart: true,
                node: 2,
                what: "a\nb".into(),
            },
            End::Failure {
                restart: false,
                node: 0,
                what: String::new(),
            },
        ] {
            assert_eq!(End::decode(&e.encode()), e);
        }
    }
}
