//! Where a worker learns who it is: rank, world size and master address from its environment.
//!
//! Recognised, in this order:
//! 1. torchrun / `ddprun`: `RANK`, `WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`, and when present
//!    `LOCAL_RANK`, `LOCAL_WORLD_SIZE`, `GROUP_RANK`, `TORCHELASTIC_RESTART_COUNT`.
//! 2. Slurm: `SLURM_PROCID`, `SLURM_NTASKS`, `SLURM_LOCALID`, `SLURM_NTASKS_PER_NODE`/
//!    `SLURM_STEP_TASKS_PER_NODE`; master = first host of `SLURM_JOB_NODELIST` unless `MASTER_ADDR` is set.
//! 3. OpenMPI: `OMPI_COMM_WORLD_RANK`, `_SIZE`, `_LOCAL_RANK`, `_LOCAL_SIZE`; master from
//!    `MASTER_ADDR` (default `127.0.0.1`).
//!
//! `MASTER_PORT` defaults to 29500 for Slurm and OpenMPI.

use crate::{Error, Result};

/// Default rendezvous port, as in torchrun.
pub const DEFAULT_MASTER_PORT: u16 = 29500;

/// Largest world size accepted (`WORLD_SIZE`, `SLURM_NTASKS`, `OMPI_COMM_WORLD_SIZE`, and
/// `ddprun`'s total of workers): 65536. Every rank joins one TCP store, which serves at most
/// 4096 connections by default, so a larger world is a typo, not a job; it is refused at once
/// instead of waiting for ranks that never come.
pub const MAX_WORLD_SIZE: usize = 1 << 16;

/// Items shown by [`list_bounded`] before `and K more`.
pub const LIST_SHOWN: usize = 16;

/// `items` joined by `, `, at most `shown` of them, then ` and K more`: error messages that list
/// ranks or keys stay short whatever the world size.
pub fn list_bounded<T: std::fmt::Display>(
    items: impl IntoIterator<Item = T>,
    shown: usize,
) -> String {
    let mut out = String::new();
    let mut more = 0usize;
    for (i, item) in items.into_iter().enumerate() {
        if i < shown {
            if i > 0 {
                out.push_str(", ");
            }
            out.push_str(&item.to_string());
        } else {
            more += 1;
        }
    }
    if more > 0 {
        out.push_str(&format!(" and {more} more"));
    }
    out
}

/// Which launcher the environment came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Launcher {
    /// torchrun-compatible variables (set by `ddprun` or by hand).
    Torchrun,
    Slurm,
    OpenMpi,
}

/// A worker's identity, read from its environment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EnvConfig {
    pub launcher: Launcher,
    pub rank: usize,
    pub world_size: usize,
    pub local_rank: usize,
    pub local_world_size: usize,
    pub master_addr: String,
    pub master_port: u16,
    /// `true` when the launcher already hosts the store (`DDP_STORE_HOSTED=1`, set by `ddprun`):
    /// then rank 0 connects as a client instead of starting a server.
    pub store_hosted: bool,
    /// `TORCHELASTIC_RESTART_COUNT` (0 when absent): failures restarted so far.
    pub restart_count: u32,
    /// `DDP_RDZV_ROUND` (default: `restart_count`): the launcher's rendezvous round, unique per
    /// round of the job; namespaces the rendezvous keys. An elastic `ddprun` starts new rounds on
    /// membership changes too, which torchrun's `TORCHELASTIC_RESTART_COUNT` does not count.
    pub rdzv_round: u32,
}

impl EnvConfig {
    /// Read the process environment.
    pub fn from_env() -> Result<Self> {
        Self::from_lookup(|k| std::env::var(k).ok())
    }

    /// Same as [`EnvConfig::from_env`] over any lookup function (used by tests).
    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Result<Self> {
        let num = |name: &str| -> Result<Option<usize>> {
            match get(name) {
                None => Ok(None),
                Some(v) => v.trim().parse::<usize>().map(Some).map_err(|_| {
                    Error::Config(format!("{name}={v:?} is not a non-negative integer"))
                }),
            }
        };
        let port = |default: Option<u16>| -> Result<u16> {
            match get("MASTER_PORT") {
                Some(v) => match v.trim().parse::<u16>() {
                    // Port 0 asks a server for any free port, but then the other ranks cannot
                    // know it: only a launcher can pick it and pass the real one on.
                    Ok(0) => Err(Error::Config(
                        "MASTER_PORT=0: port 0 means \"any free port\", which the other ranks \
                         cannot learn without a launcher (ddprun --master-port 0 picks one and \
                         sets MASTER_PORT to it); set a fixed MASTER_PORT such as 29500"
                            .into(),
                    )),
                    Ok(p) => Ok(p),
                    Err(_) => Err(Error::Config(format!(
                        "MASTER_PORT={v:?} is not a port number (1..=65535)"
                    ))),
                },
                None => default.ok_or_else(|| Error::Config("MASTER_PORT is not set".into())),
            }
        };
        let store_hosted = get("DDP_STORE_HOSTED").is_some_and(|v| v == "1");
        let restart_count = num("TORCHELASTIC_RESTART_COUNT")?.unwrap_or(0) as u32;
        let rdzv_round =
            num("DDP_RDZV_ROUND")?.map_or(restart_count, |r| r.min(u32::MAX as usize) as u32);

        let (launcher, rank, world_size, local_rank, local_world_size, master_addr, master_port) =
            if let (Some(rank), Some(world)) = (num("RANK")?, num("WORLD_SIZE")?) {
                let addr = get("MASTER_ADDR").ok_or_else(|| {
                    Error::Config("RANK and WORLD_SIZE are set but MASTER_ADDR is not".into())
                })?;
                let local_rank = num("LOCAL_RANK")?.unwrap_or(rank);
                let local_world = num("LOCAL_WORLD_SIZE")?.unwrap_or(world);
                (
                    Launcher::Torchrun,
                    rank,
                    world,
                    local_rank,
                    local_world,
                    addr,
                    port(None)?,
                )
            } else if let (Some(rank), Some(world)) = (num("SLURM_PROCID")?, num("SLURM_NTASKS")?) {
                let addr = match get("MASTER_ADDR") {
                    Some(a) => a,
                    None => match get("SLURM_JOB_NODELIST").or_else(|| get("SLURM_NODELIST")) {
                        // A list naming no host would make every rank connect to nowhere.
                        Some(l) => first_slurm_host(&l).ok_or_else(|| {
                            Error::Config(format!(
                                "the Slurm node list {l:?} names no host; set MASTER_ADDR"
                            ))
                        })?,
                        None => "127.0.0.1".to_string(),
                    },
                };
                let local_rank = num("SLURM_LOCALID")?.unwrap_or(0);
                let local_world = get("SLURM_NTASKS_PER_NODE")
                    .or_else(|| get("SLURM_STEP_TASKS_PER_NODE"))
                    .and_then(|v| v.split(['(', ',']).next()?.trim().parse().ok())
                    .unwrap_or(world);
                let p = port(Some(DEFAULT_MASTER_PORT))?;
                (
                    Launcher::Slurm,
                    rank,
                    world,
                    local_rank,
                    local_world,
                    addr,
                    p,
                )
            } else if let (Some(rank), Some(world)) =
                (num("OMPI_COMM_WORLD_RANK")?, num("OMPI_COMM_WORLD_SIZE")?)
            {
                let addr = get("MASTER_ADDR").unwrap_or_else(|| "127.0.0.1".to_string());
                let local_rank = num("OMPI_COMM_WORLD_LOCAL_RANK")?.unwrap_or(rank);
                let local_world = num("OMPI_COMM_WORLD_LOCAL_SIZE")?.unwrap_or(world);
                let p = port(Some(DEFAULT_MASTER_PORT))?;
                (
                    Launcher::OpenMpi,
                    rank,
                    world,
                    local_rank,
                    local_world,
                    addr,
                    p,
                )
            } else {
                return Err(Error::Config(
                    "no launcher environment found: set RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT \
                     (ddprun/torchrun do this), or run under Slurm (SLURM_PROCID) or mpirun (OMPI_COMM_WORLD_RANK)"
                        .into(),
                ));
            };
        if world_size == 0 {
            return Err(Error::Config(
                "world size is 0; it must be at least 1".into(),
            ));
        }
        if world_size > MAX_WORLD_SIZE {
            return Err(Error::Config(format!(
                "world size {world_size} is more than ddp-rs supports (at most {MAX_WORLD_SIZE}); \
                 check WORLD_SIZE (or SLURM_NTASKS / OMPI_COMM_WORLD_SIZE)"
            )));
        }
        if rank >= world_size {
            return Err(Error::Config(format!(
                "rank {rank} is not below world size {world_size}"
            )));
        }
        Ok(EnvConfig {
            launcher,
            rank,
            world_size,
            local_rank,
            local_world_size,
            master_addr,
            master_port,
            store_hosted,
            restart_count,
            rdzv_round,
        })
    }
}

/// First host name of a Slurm hostlist such as `node[01-04,07],gpu3` → `node01`; `None` when
/// the list names no host (empty, or starting with `,` or `[]`).
pub fn first_slurm_host(list: &str) -> Option<String> {
    let list = list.trim();
    let end = list.find(',').unwrap_or(list.len());
    let host = match list.find('[') {
        Some(open) if open < end => {
            let prefix = &list[..open];
            let inner = &list[open + 1..];
            let first = inner.split([',', ']']).next()?;
            let first = first.split('-').next()?;
            format!("{prefix}{first}")
        }
        _ => list[..end].to_string(),
    };
    let host = host.trim();
    (!host.is_empty()).then(|| host.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn cfg(pairs: &[(&str, &str)]) -> Result<EnvConfig> {
        let m: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        EnvConfig::from_lookup(|k| m.get(k).cloned())
    }

    #[test]
    fn torchrun_env() {
        let c = cfg(&[
            ("RANK", "3"),
            ("WORLD_SIZE", "4"),
            ("LOCAL_RANK", "1"),
            ("LOCAL_WORLD_SIZE", "2"),
            ("MASTER_ADDR", "10.0.0.1"),
            ("MASTER_PORT", "1234"),
        ])
        .unwrap();
        assert_eq!(
            (c.rank, c.world_size, c.local_rank, c.local_world_size),
            (3, 4, 1, 2)
        );
        assert_eq!((c.master_addr.as_str(), c.master_port), ("10.0.0.1", 1234));
        assert_eq!(c.launcher, Launcher::Torchrun);
    }

    #[test]
    fn rendezvous_round_defaults_to_the_restart_count() {
        let base = [("RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "h")];
        let port = ("MASTER_PORT", "1");
        let c = cfg(&[
            base[0],
            base[1],
            base[2],
            port,
            ("TORCHELASTIC_RESTART_COUNT", "2"),
        ]);
        assert_eq!(c.map(|c| (c.restart_count, c.rdzv_round)).unwrap(), (2, 2));
        let c = cfg(&[
            base[0],
            base[1],
            base[2],
            port,
            ("TORCHELASTIC_RESTART_COUNT", "1"),
            ("DDP_RDZV_ROUND", "4"),
        ]);
        assert_eq!(c.map(|c| (c.restart_count, c.rdzv_round)).unwrap(), (1, 4));
        let e = cfg(&[base[0], base[1], base[2], port, ("DDP_RDZV_ROUND", "x")]);
        assert!(e.unwrap_err().to_string().contains("DDP_RDZV_ROUND"));
    }

    #[test]
    fn huge_world_sizes_are_refused_and_lists_are_bounded() {
        let base = [("MASTER_ADDR", "h"), ("MASTER_PORT", "1"), ("RANK", "0")];
        let e = cfg(&[&base[..], &[("WORLD_SIZE", "1000000")]].concat()).unwrap_err();
        let e = e.to_string();
        assert!(
            e.contains("world size 1000000") && e.contains("at most 65536"),
            "{e}"
        );
        let max = MAX_WORLD_SIZE.to_string();
        assert!(cfg(&[&base[..], &[("WORLD_SIZE", max.as_str())]].concat()).is_ok());
        assert_eq!(list_bounded(0..3, 5), "0, 1, 2");
        assert_eq!(list_bounded(0..1_000_000, 3), "0, 1, 2 and 999997 more");
        assert_eq!(list_bounded(Vec::<u8>::new(), 3), "");
    }

    #[test]
    fn invalid_values_are_named() {
        let base = [("MASTER_ADDR", "h"), ("MASTER_PORT", "1")];
        let e = cfg(&[&base[..], &[("RANK", "4"), ("WORLD_SIZE", "4")]].concat()).unwrap_err();
        assert!(
            e.to_string().contains("rank 4 is not below world size 4"),
            "{e}"
        );
        let e = cfg(&[&base[..], &[("RANK", "0"), ("WORLD_SIZE", "0")]].concat()).unwrap_err();
        assert!(e.to_string().contains("world size is 0"), "{e}");
        let e = cfg(&[
            ("RANK", "0"),
            ("WORLD_SIZE", "1"),
            ("MASTER_ADDR", "h"),
            ("MASTER_PORT", "99999"),
        ])
        .unwrap_err();
        assert!(e.to_string().contains("MASTER_PORT=\"99999\""), "{e}");
        let e = cfg(&[
            ("RANK", "0"),
            ("WORLD_SIZE", "2"),
            ("MASTER_ADDR", "h"),
            ("MASTER_PORT", "0"),
        ])
        .unwrap_err();
        assert!(
            e.to_string().contains("MASTER_PORT=0") && e.to_string().contains("launcher"),
            "{e}"
        );
        let e = cfg(&[("RANK", "x"), ("WORLD_SIZE", "1")]).unwrap_err();
        assert!(e.to_string().contains("RANK=\"x\""), "{e}");
        assert!(cfg(&[])
            .unwrap_err()
            .to_string()
            .contains("no launcher environment"));
    }

    #[test]
    fn slurm_and_openmpi_env() {
        let c = cfg(&[
            ("SLURM_PROCID", "5"),
            ("SLURM_NTASKS", "8"),
            ("SLURM_LOCALID", "1"),
            ("SLURM_NTASKS_PER_NODE", "4(x2)"),
            ("SLURM_JOB_NODELIST", "gpu[07-08,11],cpu1"),
        ])
        .unwrap();
        assert_eq!(
            (c.rank, c.world_size, c.local_rank, c.local_world_size),
            (5, 8, 1, 4)
        );
        assert_eq!((c.master_addr.as_str(), c.master_port), ("gpu07", 29500));
        let c = cfg(&[
            ("OMPI_COMM_WORLD_RANK", "1"),
            ("OMPI_COMM_WORLD_SIZE", "2"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "1"),
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "2"),
        ])
        .unwrap();
        assert_eq!(
            (c.launcher, c.rank, c.master_addr.as_str()),
            (Launcher::OpenMpi, 1, "127.0.0.1")
        );
        assert_eq!(first_slurm_host("a1,b2"), Some("a1".into()));
        for nothing in ["", " ", ",a", "[]", "[,1]", " ,"] {
            assert_eq!(first_slurm_host(nothing), None, "{nothing:?}");
        }
    }
}
