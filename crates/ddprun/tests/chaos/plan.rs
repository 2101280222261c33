//! The trials of the fault-injection suite, drawn from (seed, trial): the fault, its moment and
//! the configuration; and what the launchers must say when a trial fails.

use super::*;

/// splitmix64: small, seedable, the same everywhere.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64, trial: usize) -> Rng {
        let mut r = Rng(seed ^ (trial as u64 + 1).wrapping_mul(0xA076_1D64_78BD_642F));
        r.next_u64();
        r
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }
    pub fn uniform(&mut self, lo: f64, hi: f64) -> f64 {
        lo + (hi - lo) * (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
    pub fn chance(&mut self) -> bool {
        self.next_u64() & 1 == 1
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Mode {
    Static,
    Elastic,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Kind {
    KillRank,
    KillLauncher,
    StopRank,
    Partition,
    FullDisk,
    KillStoreHost,
    /// No fault: the uninterrupted reference run of a configuration.
    None,
}

pub const KINDS: [Kind; 6] = [
    Kind::KillRank,
    Kind::StopRank,
    Kind::Partition,
    Kind::FullDisk,
    Kind::KillStoreHost,
    Kind::KillLauncher,
];

impl Kind {
    pub fn name(self) -> &'static str {
        match self {
            Kind::KillRank => "kill-rank",
            Kind::KillLauncher => "kill-launcher",
            Kind::StopRank => "stop-rank",
            Kind::Partition => "partition",
            Kind::FullDisk => "full-disk",
            Kind::KillStoreHost => "kill-store-host",
            Kind::None => "none",
        }
    }
}

/// One trial, drawn from (seed, trial) alone.
#[derive(Debug, Clone)]
pub struct Plan {
    pub trial: usize,
    pub mode: Mode,
    /// Workers per host.
    pub nproc: usize,
    pub max_restarts: u32,
    pub kind: Kind,
    /// When the fault starts, as a fraction of the uninterrupted run's duration.
    pub at: f64,
    /// Which of the live ranks (modulo their number).
    pub pick: u64,
    /// SIGSTOP: how long; partition: how long down; full disk: when the filler is removed.
    pub span: f64,
    /// SIGSTOP: SIGCONT at the end (else left stopped); full disk: free it at the end.
    pub undo: bool,
    /// Partition: whose end of the link goes down.
    pub side: usize,
}

impl Plan {
    pub fn draw(seed: u64, trial: usize) -> Plan {
        let mut rng = Rng::new(seed, trial);
        let kind = KINDS[trial % KINDS.len()];
        // Every (fault, mode) pair within 12 trials.
        let mode = if (trial / KINDS.len() + trial).is_multiple_of(2) {
            Mode::Static
        } else {
            Mode::Elastic
        };
        let nproc = 1 + rng.below(2) as usize;
        let max_restarts = 1 + rng.below(2) as u32;
        let at = rng.uniform(0.1, 0.95);
        let pick = rng.next_u64();
        let span = match kind {
            Kind::StopRank => COLLECTIVE_TIMEOUT + rng.uniform(0.5, 3.0),
            Kind::Partition => rng.uniform(0.5, 5.0),
            Kind::FullDisk => rng.uniform(0.5, 4.0),
            _ => 0.0,
        };
        let undo = rng.chance();
        let side = rng.below(2) as usize;
        Plan {
            trial,
            mode,
            nproc,
            max_restarts,
            kind,
            at,
            pick,
            span,
            undo,
            side,
        }
    }

    pub fn baseline(mode: Mode, nproc: usize) -> Plan {
        Plan {
            trial: usize::MAX,
            mode,
            nproc,
            max_restarts: 0,
            kind: Kind::None,
            at: 0.0,
            pick: 0,
            span: 0.0,
            undo: false,
            side: 0,
        }
    }

    pub fn config(&self) -> String {
        let mode = match self.mode {
            Mode::Static => "static --nnodes 2",
            Mode::Elastic => "elastic --nnodes 1:2",
        };
        format!(
            "{mode}, 2 hosts x {} worker(s), --max-restarts {}",
            self.nproc, self.max_restarts
        )
    }

    pub fn world(&self) -> usize {
        2 * self.nproc
    }
}

/// What every launcher that was not killed on purpose must say when a trial fails, per fault:
/// `direct` names the fault itself (at least one launcher says one of these), and each launcher
/// says one of `direct` or `relayed` (the failure of another node, or of the store).
pub fn causes(kind: Kind) -> (&'static [&'static str], &'static [&'static str]) {
    const RELAYED: &[&str] = &[
        "reported a failure",
        "declared this node dead",
        "lost contact",
        "never arrived",
        "no heartbeat",
        "peer rank",
        "timed out",
    ];
    let direct: &'static [&'static str] = match kind {
        Kind::KillRank => &["signal SIGKILL", "peer rank"],
        Kind::KillLauncher => &["never arrived", "no heartbeat", "peer rank", "left the job"],
        Kind::StopRank => &["timed out", "peer rank"],
        Kind::Partition => &["timed out", "no heartbeat", "lost contact", "peer rank"],
        Kind::FullDisk => &["No space left on device"],
        // Elastic launchers say "lost contact with the rendezvous store"; a static one finds the
        // store gone when it rejoins for its restart.
        Kind::KillStoreHost => &["lost contact", "the store closed the connection"],
        Kind::None => &[],
    };
    (direct, RELAYED)
}

/// Lines an elastic node dropped from a job that went on without it exits with.
pub const DROPPED: &[&str] = &[
    "declared this node dead",
    "lost contact with the rendezvous store",
];
