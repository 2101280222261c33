//! The seeded fault-injection suite: randomized trials of a real training job (`train-digits`
//! with checkpoints) under `ddprun` on two "hosts" (network namespaces joined by a veth pair, TCP
//! between them, each with its own `/dev/shm`), 1 or 2 workers per host, static (`--nnodes 2
//! --max-restarts K`) or elastic (`--nnodes 1:2`). Each trial injects one fault at a random moment:
//!
//! - `kill -9` of a random rank, or of the launcher that does not serve the store;
//! - SIGSTOP of a random rank for longer than the collective timeout (then SIGCONT, or left
//!   stopped for the launchers to deal with);
//! - the veth link set down, then up again (a partition, shorter or longer than the timeouts);
//! - the checkpoint directory on a tiny tmpfs that the test fills up (freed again, or not);
//! - `kill -9` of the launcher serving the rendezvous store.
//!
//! and checks how the trial ended: within its bound (no hang), either (1) completed (restarts
//! or elasticity allowing) with the final parameters of an uninterrupted run of the same
//! configuration (`param_sum`, `param_l2` of train-digits' JSON) or, at a changed world size, a
//! held-out accuracy of at least 0.9, or (2) every launcher exited non-zero with a message naming
//! the cause. After every trial: no process of the trial left (an environment marker, searched in
//! `/proc`), no shared-memory segment left in either host's `/dev/shm`, and the checkpoint left
//! in the directory loads (`ddp_core::checkpoint::load`, checksums and metadata checked).
//!
//! `CHAOS_SEED` (default 1717) and `CHAOS_TRIALS` (default 7: each fault kind once, plus one)
//! choose the trials; `CHAOS_ONLY=K` runs trial K of the seed alone. Trial K is a function of
//! (seed, K) only, so a printed `chaos seed S trial K` line is reproduced by
//! `CHAOS_SEED=S CHAOS_ONLY=K cargo test --workspace --test chaos -- --nocapture` (the same fault
//! at the same moment; the interleaving with the job's own timing is the machine's).
//!
//! Needs root, `ip`, `unshare` and `mount`: without them it prints `SKIPPED chaos: ...` and
//! passes, unless `DDP_TEST_REQUIRE_ALL=1`.

mod common;
#[path = "chaos/inject.rs"]
mod inject;
#[path = "chaos/plan.rs"]
mod plan;

use common::netns::{missing_prerequisite, Tmpfs, TwoHosts};
use common::*;
use inject::*;
use plan::*;
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// Collective (and worker rendezvous) timeout of train-digits, `--timeout-s`.
const COLLECTIVE_TIMEOUT: f64 = 3.0;
/// Elastic `--heartbeat-timeout`.
const HEARTBEAT: f64 = 2.0;
/// `--rdzv-timeout` (static launchers also bound each store operation by it).
const RDZV_TIMEOUT: f64 = 8.0;
/// The timeout of a trial: what the slowest detection path may take (a silent store host is
/// noticed after the heartbeat timeout plus 5 s; a lost node's round then waits for the
/// rendezvous timeout). A trial must end within its fault's span + this + 10 s + the work the
/// restarts may redo.
const TRIAL_TIMEOUT: f64 = COLLECTIVE_TIMEOUT + HEARTBEAT + 5.0 + RDZV_TIMEOUT;
/// Accuracy a run resumed at a changed world size must reach.
const MIN_ACCURACY: f64 = 0.9;
/// Size of the tmpfs holding the checkpoint directory in full-disk trials (a checkpoint of this
/// model is about 12 KiB).
const CKPT_TMPFS: &str = "size=1m";
const DEFAULT_SEED: u64 = 1717;
const DEFAULT_TRIALS: usize = 7;

/// `eprintln!` past the test harness's capture: the trial lines (and their seed) show in every
/// run, not only when the suite fails.
macro_rules! say {
    ($($t:tt)*) => {{
        use std::io::Write;
        let _ = writeln!(std::io::stderr().lock(), $($t)*);
    }};
}

/// An uninterrupted run of one configuration: its summary and how long it took.
struct Baseline {
    json: serde_json::Value,
    duration: Duration,
}

/// How a trial ended, as the harness judged it.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
enum Outcome {
    /// Completed at the planned world size with the uninterrupted run's parameters.
    Exact,
    /// Completed at world size N (changed by elasticity) with the accuracy.
    Shrunk(usize),
    /// Every launcher exited non-zero naming the cause.
    Failed,
    /// Something the suite forbids happened (a hang, an orphan, a leak, a wrong result, ...).
    Broken,
}

struct Trial {
    plan: Plan,
    outcome: Outcome,
    fault: String,
    /// Fault start to the first failure any process reported.
    detected: Option<Duration>,
    /// Fault start to the exit of the last launcher.
    ended: Duration,
    problems: Vec<String>,
    /// What is worth saying but not a failure (a temporary file an interrupted save left).
    notes: Vec<String>,
    json: Option<serde_json::Value>,
    duration: Duration,
}

/// The shared setup: two hosts, their `/dev/shm` directories, the work directory.
struct Lab {
    digits: String,
    work: PathBuf,
    shm: [PathBuf; 2],
    hosts: TwoHosts,
    seed: u64,
}

impl Lab {
    /// The launcher of host `i` for `plan`, its checkpoints in `ckpt`, marked with `mark`.
    fn launcher(&self, plan: &Plan, i: usize, port: u16, ckpt: &Path, mark: &str) -> Running {
        let (node, nproc, restarts) = (
            i.to_string(),
            plan.nproc.to_string(),
            plan.max_restarts.to_string(),
        );
        let endpoint = format!("{}:{port}", TwoHosts::ADDRS[0]);
        let port = port.to_string();
        let run_id = format!("chaos-{}", plan.trial);
        let (rdzv, hb, coll) = (
            RDZV_TIMEOUT.to_string(),
            HEARTBEAT.to_string(),
            COLLECTIVE_TIMEOUT.to_string(),
        );
        let mut args: Vec<&str> = match plan.mode {
            Mode::Static => vec![
                "--nnodes",
                "2",
                "--node-rank",
                &node,
                "--master-addr",
                TwoHosts::ADDRS[0],
                "--master-port",
                &port,
            ],
            Mode::Elastic => vec![
                "--nnodes",
                "1:2",
                "--rdzv-endpoint",
                &endpoint,
                "--rdzv-last-call",
                "2",
                "--heartbeat-timeout",
                &hb,
            ],
        };
        args.extend_from_slice(&[
            "--run-id",
            &run_id,
            "--nproc-per-node",
            &nproc,
            "--max-restarts",
            &restarts,
            "--rdzv-timeout",
            &rdzv,
            "--stop-grace-period",
            "1",
            "--monitor-interval",
            "0.05",
            "--",
            &self.digits,
            "--epochs",
            "5",
            "--hidden",
            "16",
            "--lr",
            "0.2",
            "--scale-lr",
            "64",
            "--momentum",
            "0.9",
            "--checkpoint-dir",
            ckpt.to_str().unwrap(),
            "--resume",
            "--checkpoint-every",
            "5",
            "--timeout-s",
            &coll,
            "--log-every",
            "0",
            "--quiet",
            "--json",
        ]);
        // Rank 1 takes longer per step, so that a run lasts about 3 s at either world size and
        // faults land in it.
        let slow = format!("1:{}ms", 15 * plan.world());
        self.hosts.ddprun_env(
            i,
            &args,
            &[(MARK_ENV, mark), ("DDP_DEBUG_SLOW_RANK", slow.as_str())],
        )
    }
}

/// Whether a stderr line reports a failure (for the detection time).
fn reports_failure(l: &Line) -> bool {
    l.stderr
        && (l.text.contains("error")
            || l.text.contains("worker failure")
            || l.text.contains("reported a failure")
            || l.text.contains("lost")
            || l.text.contains("failed"))
}

/// The summary line (`{"world_size":...}`) a rank 0 printed last, over all launchers.
fn last_json(runs: &[Run]) -> Option<serde_json::Value> {
    runs.iter()
        .flat_map(|r| r.lines.iter())
        .filter(|l| !l.stderr && l.text.contains("\"world_size\""))
        .max_by_key(|l| l.at)
        .and_then(|l| serde_json::from_str(&l.text[l.text.find('{')?..]).ok())
}

fn secs(d: Duration) -> String {
    format!("{:.2}s", d.as_secs_f64())
}

/// Run one trial (or, for `Kind::None`, a reference run) and judge it.
fn run_trial(lab: &Lab, plan: &Plan, baseline: Option<&Baseline>) -> Trial {
    let mark = format!("{}-{}-{}", std::process::id(), lab.seed, plan.trial);
    let guard = TrialGuard {
        mark: mark.clone(),
        hosts: &lab.hosts,
    };
    let mut problems = Vec::new();
    let mut notes = Vec::new();
    let dir = lab
        .work
        .join(format!("trial-{}-{}", plan.trial, plan.kind.name()));
    let fs_root = dir.join("fs");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&fs_root).unwrap();
    let mount = (plan.kind == Kind::FullDisk)
        .then(|| Tmpfs::mount(&fs_root, CKPT_TMPFS).expect("mount the checkpoint tmpfs"));
    let ckpt = fs_root.join("ckpt");
    let filler = fs_root.join("filler");
    let shm_before: Vec<BTreeSet<String>> = lab.shm.iter().map(|d| segments(d)).collect();
    let port = 29500 + (plan.trial % 500) as u16;

    let start = Instant::now();
    let mut launchers = vec![lab.launcher(plan, 0, port, &ckpt, &mark)];
    std::thread::sleep(Duration::from_millis(200));
    launchers.push(lab.launcher(plan, 1, port, &ckpt, &mark));

    // The fault, at its moment; undone after its span.
    let full = baseline.map_or(Duration::from_secs(60), |b| b.duration);
    let fault_at = start + full.mul_f64(plan.at);
    let span = Duration::from_secs_f64(plan.span);
    let redo = full.mul_f64(plan.max_restarts as f64 + 1.0);
    let mut deadline = fault_at + span + Duration::from_secs_f64(TRIAL_TIMEOUT + 10.0) + redo;
    if plan.kind == Kind::None {
        deadline = start + Duration::from_secs(90);
    }
    let mut fault = Injector::new(plan, start, fault_at, filler);
    loop {
        let now = Instant::now();
        let all_exited = launchers.iter_mut().all(|l| l.exited());
        if all_exited || now >= deadline {
            if !all_exited {
                problems.push(format!(
                    "HANG: launchers still running {} after the fault (bound {})",
                    secs(now.saturating_duration_since(fault_at)),
                    secs(deadline - fault_at)
                ));
            }
            break;
        }
        fault.step(now, lab, &mut launchers, &mark);
        std::thread::sleep(Duration::from_millis(20));
    }
    fault.finish(lab);
    let (injected, killed) = (fault.injected, fault.killed.clone());
    let starts: Vec<Instant> = launchers.iter().map(Running::started).collect();
    let runs: Vec<Run> = launchers
        .into_iter()
        .map(|l| l.finish_by(Instant::now()).unwrap_or_else(|r| r))
        .collect();
    let end = runs
        .iter()
        .zip(starts)
        .map(|(r, s)| s + r.elapsed)
        .max()
        .unwrap();
    let fault_time = injected.unwrap_or(end);
    let ended = end.saturating_duration_since(fault_time);
    let detected = runs
        .iter()
        .flat_map(|r| r.lines.iter())
        .filter(|l| l.at >= fault_time && reports_failure(l))
        .map(|l| l.at - fault_time)
        .min();

    // Nothing of the trial may be left: processes, shared memory, unloadable checkpoints.
    leftovers(lab, &mark, &ckpt, &shm_before, &mut problems, &mut notes);
    drop(guard);
    drop(mount);

    // How it ended.
    let survivors: Vec<&Run> = runs
        .iter()
        .enumerate()
        .filter(|(i, _)| !killed.contains(i))
        .map(|(_, r)| r)
        .collect();
    let json = last_json(&runs);
    let outcome = if survivors.iter().any(|r| r.code() == Some(0)) {
        judge_completed(plan, &survivors, json.as_ref(), baseline, &mut problems)
    } else {
        judge_failed(plan, &survivors, &mut problems, &mut notes)
    };
    let outcome = if problems.is_empty() {
        outcome
    } else {
        Outcome::Broken
    };
    if outcome == Outcome::Broken || std::env::var_os("CHAOS_VERBOSE").is_some() {
        let all: Vec<String> = runs.iter().map(|r| r.to_string()).collect();
        problems.push(format!("launchers' output:\n{}", all.join("\n=====\n")));
    }
    Trial {
        plan: plan.clone(),
        outcome,
        fault: fault.what,
        detected: injected.and(detected),
        ended,
        problems,
        notes,
        json,
        duration: end - start,
    }
}

/// The job completed (some launcher exited 0): check its result.
fn judge_completed(
    plan: &Plan,
    survivors: &[&Run],
    json: Option<&serde_json::Value>,
    baseline: Option<&Baseline>,
    problems: &mut Vec<String>,
) -> Outcome {
    for r in survivors.iter().filter(|r| r.code() != Some(0)) {
        if plan.mode == Mode::Static {
            problems.push(format!(
                "a static job completed but a launcher exited {:?}",
                r.code()
            ));
        } else if !DROPPED.iter().any(|d| r.stderr.contains(d)) {
            problems.push(format!(
                "an elastic node left the completed job with {:?} without saying it was \
                 dropped ({DROPPED:?})",
                r.code()
            ));
        }
    }
    let Some(json) = json else {
        problems.push("completed without a summary line".into());
        return Outcome::Broken;
    };
    if json["replicas_identical"] != true {
        problems.push(format!("replicas differ: {json}"));
    }
    let world = json["world_size"].as_u64().unwrap_or(0) as usize;
    let resharded = survivors
        .iter()
        .any(|r| r.stdout.contains("re-sharded over"));
    if world == plan.world() && !resharded {
        let Some(b) = baseline else {
            return Outcome::Exact; // the reference run itself
        };
        for k in ["steps", "param_sum", "param_l2"] {
            if json[k] != b.json[k] {
                problems.push(format!(
                    "{k} {} differs from the uninterrupted run's {}",
                    json[k], b.json[k]
                ));
            }
        }
        Outcome::Exact
    } else {
        let acc = json["test_accuracy"].as_f64().unwrap_or(0.0);
        if acc < MIN_ACCURACY {
            problems.push(format!(
                "accuracy {acc} < {MIN_ACCURACY} at world size {world}"
            ));
        }
        if plan.mode == Mode::Static {
            problems.push(format!("a static job changed its world size: {json}"));
        }
        Outcome::Shrunk(world)
    }
}

/// Every launcher exited non-zero: each must name the cause.
fn judge_failed(
    plan: &Plan,
    survivors: &[&Run],
    problems: &mut Vec<String>,
    causes_seen: &mut Vec<String>,
) -> Outcome {
    if plan.kind == Kind::None {
        problems.push("the uninterrupted run failed".into());
        return Outcome::Broken;
    }
    let (direct, relayed) = causes(plan.kind);
    if !survivors
        .iter()
        .any(|r| direct.iter().any(|d| r.stderr.contains(d)))
        && !survivors.is_empty()
    {
        problems.push(format!("no launcher names the fault (any of {direct:?})"));
    }
    for r in survivors {
        if !direct.iter().chain(relayed).any(|d| r.stderr.contains(d)) {
            problems.push(format!(
                "a launcher exited {:?} without naming a cause (any of {direct:?} or {relayed:?})",
                r.code()
            ));
        }
    }
    // Each launcher's first line naming the cause, for the trial's report.
    for (i, r) in survivors.iter().enumerate() {
        let line = r
            .stderr
            .lines()
            .find(|l| direct.iter().chain(relayed).any(|d| l.contains(d)));
        if let Some(l) = line {
            causes_seen.push(format!("launcher {i}: {}", l.trim()));
        }
    }
    Outcome::Failed
}

fn env_u64(name: &str) -> Option<u64> {
    let v = std::env::var(name).ok()?;
    Some(
        v.trim()
            .parse()
            .unwrap_or_else(|_| panic!("{name}={v:?} is not a number")),
    )
}

#[test]
fn plans_are_a_function_of_the_seed_and_cover_every_fault() {
    let a: Vec<String> = (0..12).map(|k| format!("{:?}", Plan::draw(5, k))).collect();
    let b: Vec<String> = (0..12).map(|k| format!("{:?}", Plan::draw(5, k))).collect();
    assert_eq!(a, b);
    assert_ne!(
        format!("{:?}", Plan::draw(5, 3)),
        format!("{:?}", Plan::draw(6, 3))
    );
    let pairs: BTreeSet<(Kind, Mode)> = (0..12)
        .map(|k| Plan::draw(5, k))
        .map(|p| (p.kind, p.mode))
        .collect();
    assert_eq!(pairs.len(), 12, "every fault under both modes: {pairs:?}");
}

#[test]
fn chaos() {
    if let Some(why) = missing_prerequisite() {
        skip("chaos", &why);
        return;
    }
    let digits = Path::new(DDPRUN).with_file_name("train-digits");
    if !digits.exists() {
        skip("chaos", &format!("{} not built", digits.display()));
        return;
    }
    let seed = env_u64("CHAOS_SEED").unwrap_or(DEFAULT_SEED);
    let trials = env_u64("CHAOS_TRIALS").map_or(DEFAULT_TRIALS, |n| n as usize);
    let only = env_u64("CHAOS_ONLY").map(|k| k as usize);
    let which: Vec<usize> = only.map_or_else(|| (0..trials).collect(), |k| vec![k]);

    let tmp = tempfile::tempdir().unwrap();
    let shm = [tmp.path().join("shm0"), tmp.path().join("shm1")];
    let _shm_mounts: Vec<Tmpfs> = shm
        .iter()
        .map(|d| Tmpfs::mount(d, "size=256m").expect("mount a tmpfs for a host's /dev/shm"))
        .collect();
    let hosts = TwoHosts::named("chaos")
        .expect("set up two network namespaces")
        .with_shm_dirs(shm.clone());
    let lab = Lab {
        digits: digits.to_str().unwrap().to_string(),
        work: tmp.path().join("work"),
        shm,
        hosts,
        seed,
    };
    say!(
        "chaos seed {seed}: {} trial(s); rerun one with CHAOS_SEED={seed} CHAOS_ONLY=K",
        which.len()
    );
    let suite = Instant::now();
    let mut baselines: BTreeMap<(Mode, usize), Baseline> = BTreeMap::new();
    let mut results: Vec<Trial> = Vec::new();
    for k in which {
        let plan = Plan::draw(seed, k);
        let key = (plan.mode, plan.nproc);
        if let std::collections::btree_map::Entry::Vacant(slot) = baselines.entry(key) {
            let b = run_trial(&lab, &Plan::baseline(plan.mode, plan.nproc), None);
            let json = b.json.clone().filter(|_| b.outcome == Outcome::Exact);
            let json = json.unwrap_or_else(|| {
                panic!(
                    "the uninterrupted run ({}) failed: {}",
                    b.plan.config(),
                    b.problems.join("\n")
                )
            });
            assert!(
                json["test_accuracy"].as_f64().unwrap() >= MIN_ACCURACY,
                "{json}"
            );
            say!(
                "chaos baseline {}: {} ({}), param_sum {} param_l2 {}",
                b.plan.config(),
                secs(b.duration),
                json["world_size"],
                json["param_sum"],
                json["param_l2"]
            );
            slot.insert(Baseline {
                json,
                duration: b.duration,
            });
        }
        let t = run_trial(&lab, &plan, baselines.get(&key));
        let outcome = match &t.outcome {
            Outcome::Exact => "completed, parameters equal to the uninterrupted run's".into(),
            Outcome::Shrunk(w) => format!(
                "completed at world size {w}, accuracy {}",
                t.json
                    .as_ref()
                    .map_or("?".into(), |j| j["test_accuracy"].to_string())
            ),
            Outcome::Failed => "every launcher exited non-zero naming the cause".into(),
            Outcome::Broken => format!("BROKEN: {}", t.problems.join("\n")),
        };
        let outcome = match (&t.outcome, std::env::var_os("CHAOS_VERBOSE")) {
            (Outcome::Broken, _) | (_, None) => outcome,
            _ => format!("{outcome}\n{}", t.problems.join("\n")),
        };
        say!(
            "chaos seed {seed} trial {k}: fault {} ({}) outcome {outcome}; detected {}, ended {} \
             after the fault",
            t.fault,
            plan.config(),
            t.detected.map_or("-".into(), secs),
            secs(t.ended)
        );
        for n in &t.notes {
            say!("  note: {n}");
        }
        results.push(t);
    }

    // The tally, per fault kind.
    say!(
        "chaos seed {seed}: {} trial(s) in {}",
        results.len(),
        secs(suite.elapsed())
    );
    for kind in KINDS {
        let of: Vec<&Trial> = results.iter().filter(|t| t.plan.kind == kind).collect();
        if of.is_empty() {
            continue;
        }
        let count = |f: &dyn Fn(&Outcome) -> bool| of.iter().filter(|t| f(&t.outcome)).count();
        let worst = |f: &dyn Fn(&Trial) -> Option<Duration>| {
            of.iter()
                .filter_map(|&t| f(t))
                .max()
                .map_or("-".into(), secs)
        };
        say!(
            "  {:<16} {:>3} trials: {} exact, {} completed at a smaller world, {} failed naming \
             the cause, {} broken; worst detection {}, worst end {} after the fault",
            kind.name(),
            of.len(),
            count(&|o| *o == Outcome::Exact),
            count(&|o| matches!(o, Outcome::Shrunk(_))),
            count(&|o| *o == Outcome::Failed),
            count(&|o| *o == Outcome::Broken),
            worst(&|t| t.detected),
            worst(&|t| Some(t.ended)),
        );
    }
    let broken: Vec<String> = results
        .iter()
        .filter(|t| t.outcome == Outcome::Broken)
        .map(|t| format!("trial {} ({})", t.plan.trial, t.fault))
        .collect();
    assert!(
        broken.is_empty(),
        "chaos seed {seed}: broken trials (rerun with CHAOS_SEED={seed} CHAOS_ONLY=K): {}",
        broken.join(", ")
    );
}
