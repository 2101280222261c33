//! Command-line interface: torchrun's flag names (both `--dash-case` and `--snake_case`
//! spellings, and the `PET_*` environment variables torchrun reads) parsed by clap, then checked
//! and resolved into a [`Config`] the launcher runs from.

use crate::output::ConsoleStyle;
use clap::Parser;
use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::time::Duration;

/// Default rendezvous port, as in torchrun.
pub const DEFAULT_MASTER_PORT: u16 = 29500;

/// Most worker processes one launcher starts (`--nproc-per-node`, `SpawnOptions::nprocs`).
pub const MAX_LOCAL_WORKERS: usize = 4096;

/// Most nodes a job may have (`--nnodes`).
pub const MAX_NODES: usize = 65536;

/// Check a local worker count: at least 1, at most [`MAX_LOCAL_WORKERS`].
pub fn check_local_workers(n: usize) -> Result<usize, String> {
    match n {
        0 => Err("must be at least 1".into()),
        n if n > MAX_LOCAL_WORKERS => Err(format!(
            "{n} worker processes is more than one launcher starts (at most {MAX_LOCAL_WORKERS})"
        )),
        n => Ok(n),
    }
}

const AFTER_HELP: &str = "\
Examples:
  ddprun --nproc-per-node 4 ./target/release/train --epochs 10
  ddprun --standalone --nproc-per-node auto -- ./train
  # two nodes (run one on each host):
  ddprun --nnodes 2 --node-rank 0 --master-addr 10.0.0.1 --nproc-per-node 8 ./train
  ddprun --nnodes 2 --node-rank 1 --master-addr 10.0.0.1 --nproc-per-node 8 ./train
  # elastic, 2 to 4 nodes, the same command on every node (the first launcher on 10.0.0.1 to
  # bind the port serves the store; a lost node uses one restart, a joining node none):
  ddprun --nnodes 2:4 --rdzv-endpoint 10.0.0.1:29500 --run-id job7 --max-restarts 3 ./train

Each worker gets RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR,
MASTER_PORT, TORCHELASTIC_RESTART_COUNT, TORCHELASTIC_MAX_RESTARTS, TORCHELASTIC_RUN_ID,
DDP_RDZV_ROUND and DDP_STORE_HOSTED=1 (the launcher on node 0 hosts the rendezvous store), plus OMP_NUM_THREADS and
RAYON_NUM_THREADS = max(1, cores / local workers) unless already set, and DDP_FAULT_TOLERANCE=1
with --fault-tolerance (plus DDP_FT_JOIN=1, and placeholder ranks, for the workers of a node
that joins a running elastic round: they call join_process_group). DDP_STORE_SECRET, when set, is the shared secret of the store (set it to
the same value on every node).

Exit status: 0 when every worker of every node succeeded (with --fault-tolerance: when the
workers that failed did so before the first one finished); 1 when a worker failed (after the
restarts allowed by --max-restarts) or the rendezvous failed; 128+N when the launcher was stopped
by signal N (it is forwarded to the workers first); 2 for command-line errors.";

/// `ddprun`: launch and supervise the worker processes of a ddp-rs job (torchrun's contract).
#[derive(Parser, Debug, Clone)]
#[command(name = "ddprun", version, after_long_help = AFTER_HELP, args_override_self = true)]
pub struct Args {
    /// Worker processes on this node: a number, `auto` or `cpu` (both: the number of CPU cores
    /// available to this process).
    #[arg(long = "nproc-per-node", alias = "nproc_per_node", env = "PET_NPROC_PER_NODE",
          default_value = "1", value_name = "N|auto|cpu", value_parser = parse_nproc)]
    pub nproc_per_node: Nproc,

    /// Number of nodes (one `ddprun` per node): `N`, or an elastic range `MIN:MAX` (ranks are
    /// then assigned at each rendezvous round; no --node-rank).
    #[arg(long, env = "PET_NNODES", default_value = "1", value_name = "N|MIN:MAX", value_parser = parse_nnodes)]
    pub nnodes: NodeRange,

    /// Rank of this node, in `0..nnodes` (default 0). Node 0 hosts the rendezvous store. Omit it
    /// with --rdzv-endpoint and --run-id for an elastic job.
    #[arg(
        long = "node-rank",
        alias = "node_rank",
        env = "PET_NODE_RANK",
        value_name = "R"
    )]
    pub node_rank: Option<usize>,

    /// Elastic jobs: seconds a rendezvous round stays open for more nodes once MIN have joined
    /// (torchrun's `--rdzv-conf last_call_timeout`, 30 s there).
    #[arg(long = "rdzv-last-call", alias = "rdzv_last_call", env = "PET_RDZV_LAST_CALL",
          default_value_t = 5.0, value_name = "SECS", value_parser = parse_secs)]
    pub rdzv_last_call: f64,

    /// Elastic jobs: a node whose launcher has not beaten its heartbeat in the store for this many
    /// seconds is treated as dead (hung, stopped or partitioned), even if its connection is open.
    #[arg(long = "heartbeat-timeout", alias = "heartbeat_timeout", env = "PET_HEARTBEAT_TIMEOUT",
          default_value_t = 15.0, value_name = "SECS", value_parser = parse_secs)]
    pub heartbeat_timeout: f64,

    /// Address of node 0, where the rendezvous store listens (workers get it as MASTER_ADDR).
    #[arg(
        long = "master-addr",
        alias = "master_addr",
        env = "PET_MASTER_ADDR",
        default_value = "127.0.0.1",
        value_name = "ADDR"
    )]
    pub master_addr: String,

    /// Port of the rendezvous store on node 0 (MASTER_PORT); 0 picks a free port (single node only).
    #[arg(long = "master-port", alias = "master_port", env = "PET_MASTER_PORT",
          default_value_t = DEFAULT_MASTER_PORT, value_name = "PORT")]
    pub master_port: u16,

    /// `HOST:PORT` of the rendezvous store: the same as --master-addr and --master-port together.
    #[arg(
        long = "rdzv-endpoint",
        alias = "rdzv_endpoint",
        env = "PET_RDZV_ENDPOINT",
        value_name = "HOST:PORT"
    )]
    pub rdzv_endpoint: Option<String>,

    /// Accepted for torchrun compatibility: ddprun always rendezvouses through its TCP store
    /// (static with --node-rank, elastic with --nnodes MIN:MAX).
    #[arg(long = "rdzv-backend", alias = "rdzv_backend", env = "PET_RDZV_BACKEND",
          value_parser = ["static", "c10d"], value_name = "static|c10d")]
    pub rdzv_backend: Option<String>,

    /// Seconds to wait for the store and for every node to join a rendezvous round before giving up
    /// with an error that names what is missing.
    #[arg(long = "rdzv-timeout", alias = "rdzv_timeout", env = "PET_RDZV_TIMEOUT",
          default_value_t = 900.0, value_name = "SECS", value_parser = parse_secs)]
    pub rdzv_timeout: f64,

    /// Job id, the same on every node (TORCHELASTIC_RUN_ID; names the log directory).
    /// Default `none`, as in torchrun; with --standalone a random id.
    #[arg(
        long = "run-id",
        alias = "run_id",
        visible_alias = "rdzv-id",
        alias = "rdzv_id",
        env = "PET_RDZV_ID",
        value_name = "ID"
    )]
    pub run_id: Option<String>,

    /// Single-node job on a free local port: no --master-addr/--master-port/--nnodes needed.
    #[arg(long, env = "PET_STANDALONE")]
    pub standalone: bool,

    /// Restart the whole worker group (on every node) up to K times after a failure; each
    /// restart is a fresh rendezvous round with TORCHELASTIC_RESTART_COUNT incremented.
    #[arg(
        long = "max-restarts",
        alias = "max_restarts",
        env = "PET_MAX_RESTARTS",
        default_value_t = 0,
        value_name = "K"
    )]
    pub max_restarts: u32,

    /// A worker that fails no longer stops the others: the survivors regroup in place (the
    /// workers must support it: ddp-rs's `--fault-tolerance` training loops do), and the job
    /// succeeds when the last workers finish with status 0 (it fails when a worker fails after
    /// one has finished, or none finishes). Workers get DDP_FAULT_TOLERANCE=1. Elastic jobs
    /// (--nnodes MIN:MAX, the flag on every node): a lost node no longer starts a new round
    /// while MIN nodes remain, and a node that arrives while a round runs joins it in place
    /// (its workers get DDP_FT_JOIN=1) while fewer than MAX run. A node whose workers fail is
    /// handled as without the flag.
    #[arg(long = "fault-tolerance", alias = "fault_tolerance", env = "DDP_FAULT_TOLERANCE",
          value_parser = clap::builder::BoolishValueParser::new())]
    pub fault_tolerance: bool,

    /// Seconds between checks of the workers, signals and the other nodes.
    #[arg(long = "monitor-interval", alias = "monitor_interval", env = "PET_MONITOR_INTERVAL",
          default_value_t = 0.1, value_name = "SECS", value_parser = parse_secs)]
    pub monitor_interval: f64,

    /// Seconds between SIGTERM and SIGKILL when stopping workers.
    #[arg(long = "stop-grace-period", alias = "stop_grace_period", default_value_t = 5.0,
          value_name = "SECS", value_parser = parse_secs)]
    pub stop_grace_period: f64,

    /// Send worker output to log files only: 0 none, 1 stdout, 2 stderr, 3 both; or per local
    /// rank, e.g. `0:1,1:2`. Implies a log directory (a temporary one without --log-dir).
    #[arg(short = 'r', long, env = "PET_REDIRECTS", value_name = "0-3|LR:V,..",
          value_parser = parse_std_spec)]
    pub redirects: Option<StdSpec>,

    /// Copy worker output to log files and also show it: same values as --redirects.
    /// Default 3 when --log-dir is given, else 0.
    #[arg(short = 't', long, env = "PET_TEE", value_name = "0-3|LR:V,..",
          value_parser = parse_std_spec)]
    pub tee: Option<StdSpec>,

    /// Directory for per-rank logs: DIR/RUN_ID/attempt_K/RANK/{stdout,stderr}.log.
    #[arg(
        long = "log-dir",
        alias = "log_dir",
        env = "PET_LOG_DIR",
        value_name = "DIR"
    )]
    pub log_dir: Option<PathBuf>,

    /// Most bytes (keys and values together) the rendezvous store hosted by this launcher holds:
    /// a write past it is refused to the process that made it, with an error naming this cap.
    #[arg(long = "store-max-bytes", alias = "store_max_bytes", env = "DDP_STORE_MAX_BYTES",
          default_value_t = ddp_comm::store::DEFAULT_MAX_BYTES, value_name = "BYTES",
          value_parser = crate::validate::int_in::<u64>(1, u64::MAX))]
    pub store_max_bytes: u64,

    /// Only show the console output of these local ranks (e.g. `0` or `0,2`); logs keep everything.
    #[arg(long = "local-ranks-filter", alias = "local_ranks_filter",
          env = "PET_LOCAL_RANKS_FILTER", value_name = "LR,..", value_parser = parse_rank_set)]
    pub local_ranks_filter: Option<BTreeSet<usize>>,

    /// The worker program and its arguments (after `--`, or directly).
    #[arg(required = true, num_args = 1.., trailing_var_arg = true, allow_hyphen_values = true,
          value_name = "PROGRAM [ARGS]...")]
    pub program: Vec<String>,
}

/// `--nproc-per-node`: a count or `auto`/`cpu`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Nproc {
    Count(usize),
    /// Number of CPU cores available to this process.
    Cpu,
}

impl Nproc {
    /// The number of workers this resolves to on this host.
    pub fn resolve(self) -> usize {
        match self {
            Nproc::Count(n) => n,
            Nproc::Cpu => available_cores(),
        }
    }
}

/// CPU cores this process may run on (affinity and cgroup limits respected).
pub fn available_cores() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// Which standard streams a redirect/tee value covers (torchrun's `Std`: 1 stdout, 2 stderr, 3 both).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Streams {
    pub stdout: bool,
    pub stderr: bool,
}

impl Streams {
    pub const NONE: Streams = Streams {
        stdout: false,
        stderr: false,
    };
    pub const ALL: Streams = Streams {
        stdout: true,
        stderr: true,
    };

    fn from_digit(s: &str) -> Result<Streams, String> {
        match s.trim() {
            "0" => Ok(Streams::NONE),
            "1" => Ok(Streams {
                stdout: true,
                stderr: false,
            }),
            "2" => Ok(Streams {
                stdout: false,
                stderr: true,
            }),
            "3" => Ok(Streams::ALL),
            other => Err(format!(
                "`{other}` is not a stream selector: use 0 (none), 1 (stdout), 2 (stderr) or 3 (both)"
            )),
        }
    }

    /// Whether any stream is selected.
    pub fn any(self) -> bool {
        self.stdout || self.stderr
    }
}

/// A `--redirects`/`--tee` value: one selector for all local ranks, or per local rank.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct StdSpec {
    pub all: Streams,
    pub per_local_rank: BTreeMap<usize, Streams>,
}

impl StdSpec {
    /// Streams selected for `local_rank`.
    pub fn for_local_rank(&self, local_rank: usize) -> Streams {
        self.per_local_rank
            .get(&local_rank)
            .copied()
            .unwrap_or(self.all)
    }

    /// Whether any local rank has any stream selected.
    pub fn any(&self) -> bool {
        self.all.any() || self.per_local_rank.values().any(|s| s.any())
    }
}

fn parse_std_spec(s: &str) -> Result<StdSpec, String> {
    if !s.contains(':') {
        return Ok(StdSpec {
            all: Streams::from_digit(s)?,
            per_local_rank: BTreeMap::new(),
        });
    }
    let mut per_local_rank = BTreeMap::new();
    for part in s.split(',') {
        let (lr, v) = part
            .split_once(':')
            .ok_or_else(|| format!("`{part}` is not LOCAL_RANK:VALUE (e.g. `0:3,1:1`)"))?;
        let lr = lr
            .trim()
            .parse::<usize>()
            .map_err(|_| format!("`{lr}` is not a local rank in `{part}`"))?;
        per_local_rank.insert(lr, Streams::from_digit(v)?);
    }
    Ok(StdSpec {
        all: Streams::NONE,
        per_local_rank,
    })
}

fn parse_nproc(s: &str) -> Result<Nproc, String> {
    match s.trim() {
        "auto" | "cpu" => Ok(Nproc::Cpu),
        "gpu" => Err(
            "`gpu` is not supported: ddprun workers run on CPU; use a number, `auto` or `cpu`"
                .into(),
        ),
        n => match n.parse::<usize>() {
            Ok(n) => check_local_workers(n).map(Nproc::Count),
            Err(_) => Err(format!("`{n}` is not a number, `auto` or `cpu`")),
        },
    }
}

/// `--nnodes`: `N` (static, or `N:N`) or an elastic range `MIN:MAX`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NodeRange {
    pub min: usize,
    pub max: usize,
}

fn parse_nnodes(s: &str) -> Result<NodeRange, String> {
    let parse = |v: &str| {
        v.trim()
            .parse::<usize>()
            .ok()
            .filter(|&n| (1..=MAX_NODES).contains(&n))
            .ok_or_else(|| format!("`{v}` is not a node count (1..={MAX_NODES})"))
    };
    match s.split_once(':') {
        None => parse(s).map(|n| NodeRange { min: n, max: n }),
        Some((lo, hi)) => {
            let (min, max) = (parse(lo)?, parse(hi)?);
            if min > max {
                return Err(format!(
                    "`{s}`: the minimum {min} is above the maximum {max} (use MIN:MAX)"
                ));
            }
            Ok(NodeRange { min, max })
        }
    }
}

fn parse_secs(s: &str) -> Result<f64, String> {
    crate::validate::secs(s)
}

fn parse_rank_set(s: &str) -> Result<BTreeSet<usize>, String> {
    s.split(',')
        .map(|p| {
            p.trim()
                .parse::<usize>()
                .map_err(|_| format!("`{p}` is not a local rank"))
        })
        .collect()
}

/// An elastic job's settings (`--nnodes MIN:MAX`, or no `--node-rank` with `--rdzv-endpoint`
/// and `--run-id`).
#[derive(Debug, Clone, PartialEq)]
pub struct Elastic {
    pub min_nodes: usize,
    pub max_nodes: usize,
    /// How long a round stays open for more nodes once `min_nodes` joined.
    pub last_call: Duration,
    /// A node whose heartbeat has not advanced for this long is dead.
    pub heartbeat_timeout: Duration,
}

/// Everything the launcher needs, checked and resolved.
#[derive(Debug, Clone)]
pub struct Config {
    /// Workers on this node.
    pub nproc_per_node: usize,
    pub nnodes: usize,
    pub node_rank: usize,
    /// Address workers and other nodes use to reach the store.
    pub master_addr: String,
    /// Requested store port; 0 = let the OS pick (single node).
    pub master_port: u16,
    pub run_id: String,
    pub max_restarts: u32,
    /// `--fault-tolerance`: a failed worker does not stop the others; the survivors go on.
    pub fault_tolerance: bool,
    pub monitor_interval: Duration,
    pub rdzv_timeout: Duration,
    pub stop_grace_period: Duration,
    pub redirects: StdSpec,
    pub tee: StdSpec,
    /// Where per-rank logs go; `Some` whenever any stream is redirected or teed.
    pub log_dir: Option<PathBuf>,
    pub local_ranks_filter: Option<BTreeSet<usize>>,
    /// Console layout of worker output (`ddprun` itself: [`ConsoleStyle::Prefixed`]).
    pub console: ConsoleStyle,
    /// Program and arguments.
    pub program: Vec<String>,
    /// `Some` for an elastic job (then `nnodes` is the maximum and `node_rank` unused).
    pub elastic: Option<Elastic>,
    /// Most bytes (keys and values) the store this launcher hosts holds (`--store-max-bytes`).
    pub store_max_bytes: u64,
}

impl Args {
    /// Check the flags against each other and resolve defaults into a [`Config`].
    pub fn into_config(self) -> Result<Config, String> {
        let mut master_addr = self.master_addr;
        let mut master_port = self.master_port;
        if let Some(ep) = &self.rdzv_endpoint {
            let (host, port) = split_endpoint(ep)?;
            master_addr = host;
            master_port = port.unwrap_or(DEFAULT_MASTER_PORT);
        }
        let range = self.nnodes;
        let mut nnodes = range.max;
        let mut run_id = self.run_id;
        // torchrun's c10d rendezvous: a range, or the same flags on every node (no --node-rank)
        // with an endpoint and a job id.
        let elastic = !self.standalone
            && (range.min < range.max
                || (range.max > 1
                    && self.node_rank.is_none()
                    && self.rdzv_endpoint.is_some()
                    && run_id.is_some()));
        if elastic {
            if let Some(r) = self.node_rank {
                return Err(format!(
                    "--node-rank {r} cannot be combined with the elastic --nnodes {}:{}: ranks are \
                     assigned at each rendezvous round (start every node with the same flags)",
                    range.min, range.max
                ));
            }
            if run_id.is_none() {
                return Err(format!(
                    "an elastic job (--nnodes {}:{}) needs a --run-id (the same on every node)",
                    range.min, range.max
                ));
            }
        }
        let node_rank = self.node_rank.unwrap_or(0);
        if self.standalone {
            if nnodes != 1 {
                return Err(format!(
                    "--standalone runs a single node, but --nnodes is {nnodes}"
                ));
            }
            nnodes = 1;
            master_addr = "127.0.0.1".into();
            master_port = 0;
            if run_id.is_none() {
                run_id = Some(random_run_id());
            }
        }
        if node_rank >= nnodes {
            return Err(format!(
                "--node-rank {node_rank} is out of range for --nnodes {nnodes} (valid: 0..={})",
                nnodes - 1
            ));
        }
        if master_port == 0 && nnodes > 1 {
            return Err(format!(
                "--master-port 0 (pick a free port) only works for a single node; with --nnodes \
                 {nnodes} every node must be given the same fixed --master-port"
            ));
        }
        if master_addr.trim().is_empty() {
            return Err("--master-addr is empty".into());
        }
        if self.rdzv_endpoint.is_none() {
            check_host(&master_addr)
                .map_err(|why| format!("--master-addr `{master_addr}` is refused: {why}"))?;
        }
        let run_id = run_id.unwrap_or_else(|| "none".into());
        if run_id.is_empty() || run_id.contains(['/', '\0']) || run_id == "." || run_id == ".." {
            return Err(format!(
                "--run-id `{run_id}` must be non-empty and contain no `/` (it names a log directory)"
            ));
        }
        let redirects = self.redirects.unwrap_or_default();
        let tee = match (self.tee, &self.log_dir) {
            (Some(t), _) => t,
            // Asking for a log directory means asking for logs: tee everything by default.
            (None, Some(_)) if !redirects.any() => StdSpec {
                all: Streams::ALL,
                per_local_rank: BTreeMap::new(),
            },
            (None, _) => StdSpec::default(),
        };
        let log_dir = match self.log_dir {
            Some(d) => Some(d),
            None if redirects.any() || tee.any() => {
                let d = std::env::temp_dir().join(format!("ddprun-{}", std::process::id()));
                eprintln!(
                    "ddprun: --redirects/--tee without --log-dir: writing worker logs under {}",
                    d.display()
                );
                Some(d)
            }
            None => None,
        };
        Ok(Config {
            nproc_per_node: self.nproc_per_node.resolve(),
            nnodes,
            node_rank,
            master_addr,
            master_port,
            run_id,
            max_restarts: self.max_restarts,
            fault_tolerance: self.fault_tolerance,
            monitor_interval: Duration::from_secs_f64(self.monitor_interval),
            rdzv_timeout: Duration::from_secs_f64(self.rdzv_timeout),
            stop_grace_period: Duration::from_secs_f64(self.stop_grace_period),
            redirects,
            tee,
            log_dir,
            local_ranks_filter: self.local_ranks_filter,
            console: ConsoleStyle::Prefixed,
            program: self.program,
            store_max_bytes: self.store_max_bytes,
            elastic: elastic.then(|| Elastic {
                min_nodes: range.min,
                max_nodes: range.max,
                last_call: Duration::from_secs_f64(self.rdzv_last_call),
                heartbeat_timeout: Duration::from_secs_f64(self.heartbeat_timeout),
            }),
        })
    }
}

/// `host:port`, `[v6]:port` or a bare host → (host, port); anything else is refused with a
/// message naming the flag, the value and what is wrong with it.
fn split_endpoint(ep: &str) -> Result<(String, Option<u16>), String> {
    let flag = "--rdzv-endpoint";
    let bad = |why: String| format!("{flag} `{ep}` is not HOST or HOST:PORT: {why}");
    let port = |p: &str| {
        p.parse::<u16>()
            .map_err(|_| bad(format!("`{p}` is not a port (0..=65535)")))
    };
    let (host, port) = if let Some(rest) = ep.strip_prefix('[') {
        let (host, tail) = rest
            .split_once(']')
            .ok_or_else(|| bad("the `[` of an IPv6 address is not closed".into()))?;
        if host.parse::<std::net::Ipv6Addr>().is_err() {
            return Err(bad(format!("`{host}` is not an IPv6 address")));
        }
        let port = match tail.strip_prefix(':') {
            Some(p) => Some(port(p)?),
            None if tail.is_empty() => None,
            None => return Err(bad(format!("`{tail}` after `]` is not `:PORT`"))),
        };
        (host, port)
    } else {
        match ep.rsplit_once(':') {
            Some((h, p)) if !h.contains(':') => (h, Some(port(p)?)),
            _ => (ep, None),
        }
    };
    check_host(host).map_err(bad)?;
    Ok((host.to_string(), port))
}

/// An IP address, or a host name (RFC 1123 labels of letters, digits, `-` and `_`, 1 to 63
/// characters each, at most 253 in all); `Err` says why not.
pub fn check_host(host: &str) -> Result<(), String> {
    if host.is_empty() {
        return Err("the host is empty".into());
    }
    if host.parse::<std::net::IpAddr>().is_ok() {
        return Ok(());
    }
    let name = host.strip_suffix('.').unwrap_or(host);
    let label_ok = |l: &str| {
        (1..=63).contains(&l.len())
            && !l.starts_with('-')
            && !l.ends_with('-')
            && l.bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
    };
    if name.len() <= 253 && name.split('.').all(label_ok) {
        Ok(())
    } else {
        let shown: String = host.chars().take(80).collect();
        let more = if shown.len() < host.len() { "..." } else { "" };
        Err(format!(
            "`{shown}`{more} is not a host name or an IP address"
        ))
    }
}

/// A run id unlikely to collide: time and pid based (no RNG dependency needed).
pub(crate) fn random_run_id() -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    format!(
        "standalone-{:x}-{:x}",
        std::process::id(),
        nanos & 0xffff_ffff_ffff
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(a: &[&str]) -> Result<Args, clap::Error> {
        Args::try_parse_from(std::iter::once("ddprun").chain(a.iter().copied()))
    }

    #[test]
    fn torchrun_spellings_and_program_forms() {
        let a = args(&[
            "--nproc_per_node=3",
            "--master_port",
            "1234",
            "--",
            "./w",
            "-x",
            "--y",
        ])
        .unwrap();
        assert_eq!(a.nproc_per_node, Nproc::Count(3));
        assert_eq!(a.master_port, 1234);
        assert_eq!(a.program, ["./w", "-x", "--y"]);
        let a = args(&["--nproc-per-node", "auto", "./w", "--nnodes", "2"]).unwrap();
        assert_eq!(a.nproc_per_node, Nproc::Cpu);
        // Flags after the program belong to the program.
        assert_eq!(a.program, ["./w", "--nnodes", "2"]);
        assert_eq!(a.nnodes, NodeRange { min: 1, max: 1 });
        assert!(args(&["--nproc-per-node", "0", "./w"]).is_err());
        assert_eq!(
            args(&["--nnodes", "1:4", "./w"]).unwrap().nnodes,
            NodeRange { min: 1, max: 4 }
        );
        assert!(args(&["--nnodes", "3:2", "./w"])
            .unwrap_err()
            .to_string()
            .contains("above the maximum"));
        assert_eq!(
            args(&["--nnodes", "2:2", "./w"]).unwrap().nnodes,
            NodeRange { min: 2, max: 2 }
        );
        assert!(args(&[]).is_err(), "a program is required");
    }

    #[test]
    fn std_specs() {
        let a = args(&["--redirects", "3", "--tee", "0:1,2:2", "w"]).unwrap();
        assert_eq!(a.redirects.unwrap().for_local_rank(5), Streams::ALL);
        let t = a.tee.unwrap();
        assert_eq!(
            t.for_local_rank(0),
            Streams {
                stdout: true,
                stderr: false
            }
        );
        assert_eq!(t.for_local_rank(1), Streams::NONE);
        assert_eq!(
            t.for_local_rank(2),
            Streams {
                stdout: false,
                stderr: true
            }
        );
        assert!(args(&["--redirects", "4", "w"]).is_err());
    }

    #[test]
    fn config_resolution_and_errors() {
        let c = args(&["--standalone", "w"]).unwrap().into_config().unwrap();
        assert_eq!(
            (c.master_port, c.nnodes, c.master_addr.as_str()),
            (0, 1, "127.0.0.1")
        );
        assert!(c.run_id.starts_with("standalone-"));
        let e = args(&["--nnodes", "2", "--node-rank", "2", "w"])
            .unwrap()
            .into_config();
        assert!(e.unwrap_err().contains("--node-rank 2 is out of range"));
        let e = args(&["--nnodes", "2", "--master-port", "0", "w"])
            .unwrap()
            .into_config();
        assert!(e.unwrap_err().contains("only works for a single node"));
        let c = args(&["--rdzv-endpoint", "10.1.2.3:4567", "w"])
            .unwrap()
            .into_config()
            .unwrap();
        assert_eq!((c.master_addr.as_str(), c.master_port), ("10.1.2.3", 4567));
        let c = args(&["--rdzv-endpoint", "[::1]:5", "w"])
            .unwrap()
            .into_config()
            .unwrap();
        assert_eq!((c.master_addr.as_str(), c.master_port), ("::1", 5));
        // --log-dir alone tees everything; --redirects wins over the default tee.
        let c = args(&["--log-dir", "/tmp/x", "w"])
            .unwrap()
            .into_config()
            .unwrap();
        assert_eq!(c.tee.all, Streams::ALL);
        let c = args(&["--log-dir", "/tmp/x", "-r", "1", "w"])
            .unwrap()
            .into_config()
            .unwrap();
        assert_eq!((c.tee.all, c.redirects.all.stdout), (Streams::NONE, true));
        assert!(args(&["--run-id", "a/b", "w"])
            .unwrap()
            .into_config()
            .is_err());
        // Elastic: a range, or no --node-rank with an endpoint and a run id.
        let c = args(&[
            "--nnodes",
            "2:3",
            "--rdzv-endpoint",
            "h:5",
            "--run-id",
            "j",
            "w",
        ])
        .unwrap()
        .into_config()
        .unwrap();
        let e = c.elastic.unwrap();
        assert_eq!((e.min_nodes, e.max_nodes, c.nnodes), (2, 3, 3));
        let c = args(&[
            "--nnodes",
            "2",
            "--rdzv-endpoint",
            "h:5",
            "--run-id",
            "j",
            "w",
        ])
        .unwrap()
        .into_config()
        .unwrap();
        assert_eq!(c.elastic.map(|e| e.min_nodes), Some(2));
        let c = args(&[
            "--nnodes",
            "2",
            "--node-rank",
            "1",
            "--rdzv-endpoint",
            "h:5",
            "w",
        ])
        .unwrap()
        .into_config()
        .unwrap();
        assert!(c.elastic.is_none(), "static with --node-rank");
        let e = args(&["--nnodes", "1:2", "--node-rank", "0", "--run-id", "j", "w"])
            .unwrap()
            .into_config();
        assert!(e.unwrap_err().contains("cannot be combined"));
        let e = args(&["--nnodes", "1:2", "w"]).unwrap().into_config();
        assert!(e.unwrap_err().contains("needs a --run-id"));
    }
}
