//! The elastic rendezvous through the TCP store (torchrun's c10d backend, in spirit).
//!
//! Every launcher is started with the same flags. The first one on the endpoint's host to bind
//! its port serves the store; all connect to it as clients. Keys, under `ddprun/RUN_ID/elastic/`:
//!
//! - `ids`: a counter giving each launcher its node id; `node/ID`: its worker count, `--nnodes`
//!   range, `--max-restarts`, host and pid; `hb/ID`: its heartbeat counter ([`super::heartbeat`]).
//! - `dead/ID`: why node `ID` was declared dead (first writer wins; under `--fault-tolerance`
//!   also a node stopped by a signal, which leaves without ending the round); `left/ID`: it
//!   exited.
//! - `r/R/tickets`, `r/R/t/K`: nodes joining round `R` take ticket `K` (their order in the round).
//! - `r/R/closed`: the round's members in ticket order and its restart count (first writer
//!   wins: whoever closes it decides who is in; a node not listed waits for round `R + 1`).
//!   A round closes once `min` live nodes joined and then `max` did, the last call passed, or
//!   (after round 0) every live member of the round before rejoined; never before round `R - 1`
//!   has ended, so nodes waiting to join cannot start a job of their own. Under
//!   `--fault-tolerance` the list grows while the round runs: a node that arrives appends itself
//!   (compare-and-set on the whole value) when the round has fewer than `max` live members and
//!   no member's workers are done, and its workers join the running ones in place. A closed,
//!   not ended `r/R/closed` is thus "round `R` is running": its number is `DDP_RDZV_ROUND`, and
//!   its workers' store is this store (the `--rdzv-endpoint` every launcher connects to).
//! - `r/R/end`: why round `R` ended (first writer wins): `restart`/`final` for a failure (a
//!   worker, a lost node; restarts counted as torchrun does) or `join` (nodes wait in `R + 1`:
//!   membership grows, not counted). `r/R/done/ID`: node `ID`'s workers all succeeded.
//! - `current`: the latest closed round (a hint for arriving nodes); `finished`: the job is done.

use super::heartbeat::{Beater, Watch};
pub use super::records::{Closed, End, Member};
use crate::cli::{Config, Elastic};
use crate::rendezvous::{addresses, connect_store, join_host_port, RemoteFailure, Stop};
use ddp_comm::store::{Store, StoreServer, TcpStore, SECRET_ENV};
use std::cell::{Cell, RefCell};
use std::collections::{HashMap, HashSet};
use std::net::ToSocketAddrs;
use std::time::{Duration, Instant};

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
    /// `--fault-tolerance`: this node was admitted into the round while it ran (its workers
    /// join the running job: `DDP_FT_JOIN=1`); its ranks are placeholders, its slot after every
    /// node listed in the round before it.
    pub joined: bool,
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
    /// `--fault-tolerance`: lost nodes do not end the round, arriving nodes join it in place.
    pub fault_tolerance: bool,
    watch: RefCell<Watch>,
    /// Members of the latest round this node was in (the store's host waits for them to leave).
    last_members: RefCell<Vec<Member>>,
    /// That round (`--fault-tolerance`: its membership is read again, it may have grown).
    last_round: Cell<Option<u32>>,
    /// Node entries read so far (they never change).
    known: RefCell<HashMap<u64, Member>>,
    /// `--fault-tolerance`: nodes whose loss, or arrival in place, this node has reported.
    reported_lost: RefCell<HashSet<u64>>,
    reported_joined: RefCell<HashSet<u64>>,
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
            ft: cfg.fault_tolerance,
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
            fault_tolerance: cfg.fault_tolerance,
            watch: RefCell::new(Watch::default()),
            last_members: RefCell::new(Vec::new()),
            last_round: Cell::new(None),
            known: RefCell::new(HashMap::new()),
            reported_lost: RefCell::new(HashSet::new()),
            reported_joined: RefCell::new(HashSet::new()),
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

    /// Node `id`'s entry (read once: entries never change).
    pub fn member(&self, id: u64) -> Result<Member, Stop> {
        if let Some(m) = self.known.borrow().get(&id) {
            return Ok(m.clone());
        }
        let v = self.read(&format!("node/{id}"))?.ok_or_else(|| {
            Stop::Error(format!("node id {id} joined but never published its entry"))
        })?;
        let m = Member::decode(id, &v).ok_or_else(|| {
            Stop::Error(format!("node id {id} published an unreadable entry `{v}`"))
        })?;
        self.known.borrow_mut().insert(id, m.clone());
        Ok(m)
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
            if let Some((Some(c), None)) = &prev {
                // Round `round - 1` runs: this node arrives. Its flags must match the running
                // nodes' (a mismatch stops this node only).
                for &id in &c.members {
                    self.check_compatible(&self.member(id)?)?;
                }
                if let Some(r) = self.admit_in_place(round - 1)? {
                    return Ok(r);
                }
            }
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
                    if let Some(r) = self.place(round, &c, false)? {
                        return Ok(r);
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
                if matches!(prev, Some((Some(_), None))) {
                    // A node lost meanwhile may have made room in the running round.
                    if let Some(r) = self.admit_in_place(round - 1)? {
                        return Ok(r);
                    }
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

    /// This node's place in `round`, closed as `c` (`None` when it is not listed).
    fn place(&self, round: u32, c: &Closed, joined: bool) -> Result<Option<Round>, Stop> {
        let Some(node_rank) = c.members.iter().position(|&id| id == self.me.id) else {
            return Ok(None);
        };
        let all: Vec<Member> = c
            .members
            .iter()
            .map(|&id| self.member(id))
            .collect::<Result<_, _>>()?;
        let rank_offset = all[..node_rank].iter().map(|m| m.nproc).sum();
        let world_size = all.iter().map(|m| m.nproc).sum();
        *self.last_members.borrow_mut() = all.clone();
        self.last_round.set(Some(round));
        Ok(Some(Round {
            round,
            restarts: c.restarts,
            members: all,
            node_rank,
            rank_offset,
            world_size,
            joined,
        }))
    }

    /// `--fault-tolerance`: admit this arriving node into round `running` while it runs, if it
    /// still runs (closed, not ended, no member's workers done yet) and has fewer than MAX
    /// live members (and at least MIN: below, it is about to end). Admission appends this
    /// node to the round's `closed` list (compare-and-set, so two arriving nodes never both
    /// take the last place); nothing else changes for the running nodes.
    fn admit_in_place(&self, running: u32) -> Result<Option<Round>, Stop> {
        if !self.fault_tolerance {
            return Ok(None);
        }
        let key = self.key(&format!("r/{running}/closed"));
        loop {
            let Some(raw) = self.read(&format!("r/{running}/closed"))? else {
                return Ok(None);
            };
            if self.check(&format!("r/{running}/end"))? || self.check("finished")? {
                return Ok(None);
            }
            let c = Closed::decode(&raw).ok_or_else(|| {
                Stop::Error(format!("round {running} has an unreadable entry `{raw}`"))
            })?;
            if c.members.contains(&self.me.id) {
                return Ok(None);
            }
            let mut live = 0;
            let mut gone = Vec::new();
            for &id in &c.members {
                self.check_compatible(&self.member(id)?)?;
                if self.is_done(running, id)? {
                    // The job is finishing: its workers would not take this node's in.
                    return Ok(None);
                }
                if self.gone(id)? {
                    gone.push(id);
                } else {
                    live += 1;
                }
            }
            if live >= self.conf.max_nodes || live < self.conf.min_nodes {
                return Ok(None);
            }
            let mut grown = c.clone();
            grown.members.push(self.me.id);
            let want = grown.encode();
            let now = self
                .store
                .compare_set(&key, raw.as_bytes(), want.as_bytes())
                .map_err(|e| self.lost(e))?;
            if now == want.as_bytes() {
                // Lost before this node came: not this node's news.
                self.reported_lost.borrow_mut().extend(gone);
                return self.place(running, &grown, true);
            }
            // Another node joined (or the round changed) meanwhile: look again.
        }
    }

    /// The members of the running round `r`: with `--fault-tolerance` as the store lists them
    /// now (nodes admitted in place included, lost ones too), else those it closed with.
    pub fn members_now(&self, r: &Round) -> Result<Vec<Member>, Stop> {
        if !self.fault_tolerance {
            return Ok(r.members.clone());
        }
        let Some(c) = self.closed(r.round)? else {
            return Ok(r.members.clone());
        };
        c.members.iter().map(|&id| self.member(id)).collect()
    }

    /// Whether node `id` is gone from the job: declared dead, or its launcher left.
    pub fn gone(&self, id: u64) -> Result<bool, Stop> {
        Ok(self.dead(id)?.is_some() || self.left(id)?)
    }

    /// `--fault-tolerance`: this node leaves the running round (`what`: why) without ending it;
    /// the others see it as lost and go on in place.
    pub fn leave_in_place(&self, what: &str) {
        let _ = self.first_writer(&format!("dead/{}", self.me.id), what);
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
            if out.iter().any(|m: &Member| m.id == id) {
                // A second ticket: taken again after it was admitted in place (--fault-tolerance).
                continue;
            }
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
        let flags = |m: &Member| (m.min, m.max, m.max_restarts, m.ft);
        if flags(m) == flags(&self.me) {
            return Ok(());
        }
        let ft = |m: &Member| if m.ft { " --fault-tolerance" } else { "" };
        Err(Stop::Error(format!(
            "{} was started with --nnodes {}:{} --max-restarts {}{} but this node with --nnodes \
             {}:{} --max-restarts {}{}; every node needs the same values",
            m.describe(),
            m.min,
            m.max,
            m.max_restarts,
            ft(m),
            self.me.min,
            self.me.max,
            self.me.max_restarts,
            ft(&self.me)
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
        if self.fault_tolerance {
            return self.poll_in_place(r);
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

    /// [`ElasticRdzv::poll`] under `--fault-tolerance`: a lost node (dead, or its launcher
    /// left before its workers were done) is reported once and does not end the round while at
    /// least MIN nodes remain; a node admitted in place is reported once; nodes waiting for the
    /// next round admit themselves ([`ElasticRdzv::join`]), so they do not end it either.
    fn poll_in_place(&self, r: &Round) -> Result<Option<End>, Stop> {
        let members = self.members_now(r)?;
        let mut live = 0;
        let mut last_lost: Option<(u64, String)> = None;
        let mut lost_now = Vec::new();
        let mut joined_now = Vec::new();
        for m in &members {
            if m.id != self.me.id
                && !r.members.iter().any(|k| k.id == m.id)
                && self.reported_joined.borrow_mut().insert(m.id)
            {
                joined_now.push(m.describe());
            }
            if m.id == self.me.id || self.is_done(r.round, m.id)? {
                live += 1;
                continue;
            }
            let why = match self.dead(m.id)? {
                Some(why) => Some(why),
                None if self.left(m.id)? => Some(format!("{} left the job", m.describe())),
                None => self.stale(m)?,
            };
            let Some(why) = why else {
                live += 1;
                continue;
            };
            if self.reported_lost.borrow_mut().insert(m.id) {
                lost_now.push(why.clone());
            }
            last_lost = Some((m.id, why));
        }
        let (min, max) = (self.conf.min_nodes, self.conf.max_nodes);
        if live < min {
            let (node, why) = last_lost.unwrap_or((self.me.id, "nodes were lost".into()));
            let end = End::Failure {
                restart: r.restarts < self.max_restarts,
                node,
                what: format!(
                    "{why}; {live} live node(s) remain, fewer than the minimum {min} of --nnodes \
                     {min}:{max}"
                ),
            };
            return self.end_round(r.round, &end).map(Some);
        }
        for what in joined_now {
            eprintln!(
                "ddprun: round {}: {what} joined the running round in place (--fault-tolerance): \
                 the workers take it in ({live} of at most {max} nodes run)",
                r.round
            );
        }
        for why in lost_now {
            eprintln!(
                "ddprun: round {}: {why}; --fault-tolerance: the workers go on in place ({live} \
                 of at most {max} nodes run, no new round)",
                r.round
            );
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
        let mut members = self.last_members.take();
        if let (true, Some(round)) = (self.fault_tolerance, self.last_round.get()) {
            // The round may have grown since this node joined it.
            if let Ok(Some(c)) = self.closed(round) {
                members.extend(
                    c.members
                        .iter()
                        .filter(|&&id| !members.iter().any(|m| m.id == id))
                        .filter_map(|&id| self.member(id).ok())
                        .collect::<Vec<_>>(),
                );
            }
        }
        for m in members {
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
