//! The records of the elastic rendezvous in the store ([`super::rdzv`]): a node's entry
//! ([`Member`], `node/ID`), a closed round's membership ([`Closed`], `r/R/closed`) and why a round
//! ended ([`End`], `r/R/end`), each with its text encoding.

use crate::rendezvous::{RemoteFailure, Stop};

/// One node's entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Member {
    pub id: u64,
    pub nproc: usize,
    pub min: usize,
    pub max: usize,
    pub max_restarts: u32,
    /// `--fault-tolerance` (every node needs the same).
    pub ft: bool,
    pub pid: u32,
    pub host: String,
}

impl Member {
    /// The store value of the entry.
    pub fn encode(&self) -> String {
        format!(
            "nproc={};min={};max={};max_restarts={};ft={};pid={};host={}",
            self.nproc,
            self.min,
            self.max,
            self.max_restarts,
            u8::from(self.ft),
            self.pid,
            self.host
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
            ft: false,
            pid: 0,
            host: String::new(),
        };
        for part in s.splitn(7, ';') {
            let (k, v) = part.split_once('=')?;
            match k {
                "nproc" => m.nproc = v.parse().ok()?,
                "min" => m.min = v.parse().ok()?,
                "max" => m.max = v.parse().ok()?,
                "max_restarts" => m.max_restarts = v.parse().ok()?,
                "ft" => m.ft = v == "1",
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
    pub(super) fn encode(&self) -> String {
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
    pub(super) fn encode(&self) -> String {
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
            ft: false,
            pid: 77,
            host: "h;x=y".into(),
        };
        assert_eq!(Member::decode(3, &m.encode()), Some(m.clone()));
        let ft = Member { ft: true, ..m };
        assert_eq!(Member::decode(3, &ft.encode()), Some(ft));
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
