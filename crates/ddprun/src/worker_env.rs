//! The environment contract between `ddprun` and its workers: torchrun's variable names (so job
//! scripts and `ddp_comm::env::EnvConfig` work unchanged), `DDP_STORE_HOSTED=1`,
//! `DDP_FAULT_TOLERANCE=1` under `--fault-tolerance`, `DDP_FT_JOIN=1` for the workers of a node
//! admitted into a running elastic round, and the per-worker thread-count defaults.

/// Where one worker sits in the job.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Placement {
    /// Global rank.
    pub rank: usize,
    /// Rank among the workers of this node.
    pub local_rank: usize,
    /// Total number of workers on all nodes.
    pub world_size: usize,
    /// Number of workers on this node.
    pub local_world_size: usize,
    /// Rank of this node (torchrun's `GROUP_RANK`).
    pub node_rank: usize,
    /// Number of nodes (torchrun's `GROUP_WORLD_SIZE`).
    pub nnodes: usize,
}

/// Job-wide facts shared by every worker of one attempt.
#[derive(Debug, Clone)]
pub struct JobInfo {
    pub master_addr: String,
    pub master_port: u16,
    /// Failures restarted so far, 0 for the first run (`TORCHELASTIC_RESTART_COUNT`).
    pub restart_count: u32,
    /// Rendezvous round (`DDP_RDZV_ROUND`): unique per round of the job, so that workers keep
    /// each round's store keys apart; equals `restart_count` in a static job, and also counts
    /// the rounds that an elastic job's membership changes start.
    pub rdzv_round: u32,
    pub max_restarts: u32,
    pub run_id: String,
    /// CPU cores available on this node.
    pub cores: usize,
    /// `--fault-tolerance`: workers get `DDP_FAULT_TOLERANCE=1` (the launcher lets the survivors
    /// of a failure go on, so they may regroup in place).
    pub fault_tolerance: bool,
    /// The workers join a running job (`DDP_FT_JOIN=1`: they call
    /// `ddp_comm::process_group::join_process_group`, not `init_process_group`): this node was
    /// admitted into a running elastic round under `--fault-tolerance`. Their `RANK`,
    /// `WORLD_SIZE`, `GROUP_RANK` and `GROUP_WORLD_SIZE` are placeholders; the job assigns the
    /// rank when it takes them in.
    pub ft_join: bool,
}

/// Variables to set for the worker at `p`. `inherited` looks up the launcher's own environment:
/// `OMP_NUM_THREADS` and `RAYON_NUM_THREADS` are only added when the user has not set them;
/// `DDP_FAULT_TOLERANCE=1` only when [`JobInfo::fault_tolerance`] is on, `DDP_FT_JOIN=1` only
/// with [`JobInfo::ft_join`].
pub fn worker_env(
    p: &Placement,
    job: &JobInfo,
    inherited: impl Fn(&str) -> Option<String>,
) -> Vec<(String, String)> {
    let mut env: Vec<(String, String)> = [
        ("RANK", p.rank.to_string()),
        ("LOCAL_RANK", p.local_rank.to_string()),
        ("WORLD_SIZE", p.world_size.to_string()),
        ("LOCAL_WORLD_SIZE", p.local_world_size.to_string()),
        ("GROUP_RANK", p.node_rank.to_string()),
        ("GROUP_WORLD_SIZE", p.nnodes.to_string()),
        ("ROLE_RANK", p.rank.to_string()),
        ("ROLE_WORLD_SIZE", p.world_size.to_string()),
        ("ROLE_NAME", "default".to_string()),
        ("MASTER_ADDR", job.master_addr.clone()),
        ("MASTER_PORT", job.master_port.to_string()),
        ("TORCHELASTIC_RESTART_COUNT", job.restart_count.to_string()),
        ("DDP_RDZV_ROUND", job.rdzv_round.to_string()),
        ("TORCHELASTIC_MAX_RESTARTS", job.max_restarts.to_string()),
        ("TORCHELASTIC_RUN_ID", job.run_id.clone()),
        ("TORCHELASTIC_USE_AGENT_STORE", "True".to_string()),
        ("DDP_STORE_HOSTED", "1".to_string()),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect();
    if job.fault_tolerance {
        env.push(("DDP_FAULT_TOLERANCE".to_string(), "1".to_string()));
    }
    if job.ft_join {
        env.push(("DDP_FT_JOIN".to_string(), "1".to_string()));
    }
    let threads = (job.cores / p.local_world_size.max(1)).max(1).to_string();
    for var in ["OMP_NUM_THREADS", "RAYON_NUM_THREADS"] {
        if inherited(var).is_none() {
            env.push((var.to_string(), threads.clone()));
        }
    }
    env
}

#[cfg(test)]
mod tests {
    use super::*;
    use ddp_comm::env::{EnvConfig, Launcher};
    use std::collections::HashMap;

    fn job() -> JobInfo {
        JobInfo {
            master_addr: "10.0.0.1".into(),
            master_port: 1234,
            restart_count: 2,
            rdzv_round: 5,
            max_restarts: 3,
            run_id: "job7".into(),
            cores: 8,
            fault_tolerance: false,
            ft_join: false,
        }
    }

    #[test]
    fn env_is_what_ddp_comm_reads() {
        let p = Placement {
            rank: 5,
            local_rank: 1,
            world_size: 6,
            local_world_size: 3,
            node_rank: 1,
            nnodes: 2,
        };
        let env: HashMap<_, _> = worker_env(&p, &job(), |_| None).into_iter().collect();
        assert_eq!(env["GROUP_RANK"], "1");
        assert_eq!(env["TORCHELASTIC_RUN_ID"], "job7");
        assert_eq!(env["TORCHELASTIC_MAX_RESTARTS"], "3");
        assert_eq!(env["OMP_NUM_THREADS"], "2"); // 8 cores / 3 workers
        assert_eq!(env["RAYON_NUM_THREADS"], "2");
        let c = EnvConfig::from_lookup(|k| env.get(k).cloned()).unwrap();
        assert_eq!(c.launcher, Launcher::Torchrun);
        assert_eq!(
            (c.rank, c.world_size, c.local_rank, c.local_world_size),
            (5, 6, 1, 3)
        );
        assert_eq!((c.master_addr.as_str(), c.master_port), ("10.0.0.1", 1234));
        assert!(c.store_hosted);
        assert_eq!(c.restart_count, 2);
        assert_eq!(c.rdzv_round, 5, "store keys are namespaced by the round");
        assert!(
            !env.contains_key("DDP_FAULT_TOLERANCE"),
            "only with --fault-tolerance"
        );
    }

    #[test]
    fn fault_tolerance_is_passed_on_only_when_on() {
        let p = Placement {
            rank: 1,
            local_rank: 1,
            world_size: 3,
            local_world_size: 3,
            node_rank: 0,
            nnodes: 1,
        };
        let on = JobInfo {
            fault_tolerance: true,
            ..job()
        };
        let vars = |job: &JobInfo| -> Vec<String> {
            worker_env(&p, job, |_| None)
                .into_iter()
                .filter(|(k, _)| k == "DDP_FAULT_TOLERANCE")
                .map(|(_, v)| v)
                .collect()
        };
        assert_eq!(vars(&on), ["1"]);
        assert!(vars(&job()).is_empty());
    }

    #[test]
    fn a_joining_worker_gets_ft_join_and_a_parsable_placeholder_rank() {
        // Admitted into round 4 after nodes with 3 workers in all: placeholder rank 3 of 4.
        let p = Placement {
            rank: 3,
            local_rank: 0,
            world_size: 4,
            local_world_size: 1,
            node_rank: 3,
            nnodes: 4,
        };
        let joining = JobInfo {
            fault_tolerance: true,
            ft_join: true,
            rdzv_round: 4,
            ..job()
        };
        let env: HashMap<_, _> = worker_env(&p, &joining, |_| None).into_iter().collect();
        assert_eq!(env["DDP_FT_JOIN"], "1");
        assert_eq!(env["DDP_FAULT_TOLERANCE"], "1");
        assert_eq!(env["DDP_STORE_HOSTED"], "1");
        // What join_process_group parses: the running round's store namespace.
        let c = EnvConfig::from_lookup(|k| env.get(k).cloned()).unwrap();
        assert_eq!((c.rank, c.world_size, c.rdzv_round), (3, 4, 4));
        assert!(c.store_hosted);
        let plain: HashMap<_, _> = worker_env(&p, &job(), |_| None).into_iter().collect();
        assert!(!plain.contains_key("DDP_FT_JOIN"));
    }

    #[test]
    fn user_thread_settings_win_and_minimum_is_one() {
        let p = Placement {
            rank: 0,
            local_rank: 0,
            world_size: 16,
            local_world_size: 16,
            node_rank: 0,
            nnodes: 1,
        };
        let env: HashMap<_, _> = worker_env(&p, &job(), |k| {
            (k == "OMP_NUM_THREADS").then(|| "4".to_string())
        })
        .into_iter()
        .collect();
        assert!(
            !env.contains_key("OMP_NUM_THREADS"),
            "user's value is inherited, not overridden"
        );
        assert_eq!(env["RAYON_NUM_THREADS"], "1"); // 8 cores / 16 workers, at least 1
    }
}
