//! Elastic `ddprun` (`--nnodes MIN:MAX`): several launchers on 127.0.0.1 acting as nodes, every
//! one started with the same flags (no `--node-rank`). Rounds form at MAX at once or after the
//! last call; a node that arrives later is admitted at the next round; a launcher killed or
//! stopped (SIGSTOP: its connection stays open, only the heartbeat tells) is dropped and the
//! others go on at the smaller world size; below MIN every launcher exits naming the cause; the
//! launcher serving the store is the one node the job cannot lose.

mod common;

use common::*;
use std::collections::BTreeSet;
use std::path::Path;
use std::time::{Duration, Instant};

const LIMIT: Duration = Duration::from_secs(40);
/// `--heartbeat-timeout` of these tests.
const HEARTBEAT: f64 = 2.0;

/// An elastic launcher: `--nnodes RANGE` on the store at 127.0.0.1:`port`, one worker running
/// `sh -c script`, short timeouts.
fn node(port: u16, range: &str, extra: &[&str], script: &str) -> Running {
    let endpoint = format!("127.0.0.1:{port}");
    let run_id = format!("elastic-{port}");
    let hb = HEARTBEAT.to_string();
    let mut args = vec![
        "--nnodes",
        range,
        "--rdzv-endpoint",
        &endpoint,
        "--run-id",
        &run_id,
        "--rdzv-timeout",
        "10",
        "--rdzv-last-call",
        "0.5",
        "--heartbeat-timeout",
        &hb,
        "--monitor-interval",
        "0.05",
        "--stop-grace-period",
        "2",
    ];
    args.extend_from_slice(extra);
    args.extend_from_slice(&["--", "sh", "-c", script]);
    Running::start(ddprun(&args))
}

/// Start the first launcher (it serves the store), then the others.
fn nodes(port: u16, range: &str, n: usize, extra: &[&str], script: &str) -> Vec<Running> {
    let mut v = vec![node(port, range, extra, script)];
    std::thread::sleep(Duration::from_millis(300));
    v.extend((1..n).map(|_| node(port, range, extra, script)));
    v
}

/// Worker script: in round 0 record its pid in `DIR/r0_RANK` and sleep until stopped; in later
/// rounds print `rR RANK WORLD_SIZE GROUP_RANK GROUP_WORLD_SIZE RESTART_COUNT`, record the pid in
/// `DIR/rR_RANK` and exit 0 after `later_sleep`.
fn script(dir: &Path, later_sleep: &str) -> String {
    format!(
        "d={}; echo $$ > $d/r${{DDP_RDZV_ROUND}}_$RANK; \
         if [ \"$DDP_RDZV_ROUND\" = 0 ]; then exec sleep 30; fi; \
         echo \"r$DDP_RDZV_ROUND $RANK $WORLD_SIZE $GROUP_RANK $GROUP_WORLD_SIZE \
         $TORCHELASTIC_RESTART_COUNT\"; sleep {later_sleep}",
        dir.display()
    )
}

fn pid_files(dir: &Path, round: u32, world: usize) -> Vec<std::path::PathBuf> {
    (0..world)
        .map(|r| dir.join(format!("r{round}_{r}")))
        .collect()
}

/// `rR ...` lines of every run's stdout, sorted.
fn round_lines(runs: &[&Run], round: u32) -> Vec<String> {
    let mut v: Vec<String> = runs
        .iter()
        .flat_map(|r| r.stdout.lines())
        .filter_map(|l| l.split_once("]: ").map(|(_, rest)| rest.to_string()))
        .filter(|l| l.starts_with(&format!("r{round} ")))
        .collect();
    v.sort();
    v
}

fn all(runs: &[Run]) -> String {
    runs.iter()
        .map(|r| r.to_string())
        .collect::<Vec<_>>()
        .join("\n=====\n")
}

fn signal(pid: i32, sig: i32) {
    // SAFETY: plain kill(2) of a child process this test started.
    assert_eq!(unsafe { libc::kill(pid, sig) }, 0);
}

#[test]
fn three_nodes_form_one_round_of_three_without_waiting_for_the_last_call() {
    let port = free_port();
    let s = "echo \"env $RANK $WORLD_SIZE $GROUP_RANK $GROUP_WORLD_SIZE $LOCAL_WORLD_SIZE \
             $TORCHELASTIC_RESTART_COUNT $DDP_RDZV_ROUND\"";
    // A last call of 20 s: reaching MAX must close the round at once.
    let extra = ["--rdzv-last-call", "20"];
    let start = Instant::now();
    let mut v = vec![node(port, "2:3", &extra, s)];
    v.push(node(
        port,
        "2:3",
        &["--rdzv-last-call", "20", "--nproc-per-node", "2"],
        s,
    ));
    v.push(node(port, "2:3", &extra, s));
    let runs: Vec<Run> = v.into_iter().map(|n| n.finish(LIMIT)).collect();
    let text = all(&runs);
    assert!(runs.iter().all(|r| r.code() == Some(0)), "{text}");
    assert!(start.elapsed() < Duration::from_secs(15), "{text}");
    let mut ranks = BTreeSet::new();
    let mut groups = BTreeSet::new();
    for r in &runs {
        for l in lines_with(&r.stdout, "[rank") {
            let f: Vec<&str> = l.split_whitespace().collect();
            assert_eq!(
                &f[1..],
                &["env", f[2], "4", f[4], "3", f[6], "0", "0"][..],
                "{l}\n{text}"
            );
            ranks.insert(f[2].parse::<usize>().unwrap());
            groups.insert(f[4].parse::<usize>().unwrap());
        }
    }
    assert_eq!(ranks, (0..4).collect(), "{text}");
    assert_eq!(groups, (0..3).collect(), "{text}");
    assert_eq!(
        runs.iter()
            .filter(|r| r.stderr.contains("serving the rendezvous store"))
            .count(),
        1,
        "exactly one launcher serves the store: {text}"
    );
}

#[test]
fn a_late_node_is_admitted_at_the_next_round_without_using_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let s = script(dir.path(), "0");
    // --max-restarts 0: a round started for a join must not count as a failure.
    let mut v = nodes(port, "2:3", 2, &[], &s);
    let r0 = wait_for_pids(&pid_files(dir.path(), 0, 2), Duration::from_secs(15));
    assert!(
        !dir.path().join("r0_2").exists(),
        "round 0 ran with two nodes"
    );
    v.push(node(port, "2:3", &[], &s));
    let runs: Vec<Run> = v.into_iter().map(|n| n.finish(LIMIT)).collect();
    let text = all(&runs);
    assert!(runs.iter().all(|r| r.code() == Some(0)), "{text}");
    let refs: Vec<&Run> = runs.iter().collect();
    let lines = round_lines(&refs, 1);
    assert_eq!(lines.len(), 3, "{text}");
    for (rank, l) in lines.iter().enumerate() {
        assert_eq!(l, &format!("r1 {rank} 3 {rank} 3 0"), "{text}");
    }
    assert!(
        runs[0].stderr.contains("not counted as a restart"),
        "{text}"
    );
    assert_all_gone(&r0, Duration::from_secs(5), "round 0's workers");
}

/// Three launchers of `--nnodes 2:3`; the third (not the store's) gets `sig` during round 0, and
/// `then` is called with it once round 1 runs (its workers sleep `later_sleep`). Returns the runs
/// of the first two, the time from the signal to round 1's workers running, and the pids of
/// round 0's workers.
fn lose_third_node(
    sig: i32,
    later_sleep: &str,
    then: impl FnOnce(Running),
) -> (Vec<Run>, Duration, Vec<i32>) {
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let s = script(dir.path(), later_sleep);
    // A long last call: round 0 must have all three (it closes at MAX at once), however slowly
    // the launchers start on a loaded machine.
    let extra = ["--max-restarts", "1", "--rdzv-last-call", "5"];
    let mut v = nodes(port, "2:3", 3, &extra, &s);
    let r0 = wait_for_pids(&pid_files(dir.path(), 0, 3), Duration::from_secs(15));
    let third = v.pop().unwrap();
    let at = Instant::now();
    signal(third.pid(), sig);
    wait_for_pids(&pid_files(dir.path(), 1, 2), Duration::from_secs(15));
    let detected = at.elapsed();
    then(third);
    let runs: Vec<Run> = v.into_iter().map(|n| n.finish(LIMIT)).collect();
    let text = all(&runs);
    assert!(runs.iter().all(|r| r.code() == Some(0)), "{text}");
    let refs: Vec<&Run> = runs.iter().collect();
    // Renumbered: world 2, ranks and node ranks 0 and 1, one restart used.
    assert_eq!(
        round_lines(&refs, 1),
        ["r1 0 2 0 2 1", "r1 1 2 1 2 1"],
        "{text}"
    );
    assert!(!dir.path().join("r1_2").exists(), "{text}");
    (runs, detected, r0)
}

/// The largest `no heartbeat for X s` a run reports.
fn reported_age(text: &str) -> Option<f64> {
    text.match_indices("no heartbeat for ")
        .filter_map(|(i, m)| {
            let rest = &text[i + m.len()..];
            rest[..rest.find('s')?].parse::<f64>().ok()
        })
        .reduce(f64::max)
}

#[test]
fn a_killed_launcher_is_dropped_and_the_others_finish_at_world_two() {
    let (runs, detected, r0) = lose_third_node(libc::SIGKILL, "0", |third| {
        let gone = third.finish(LIMIT);
        assert_eq!(gone.status.code(), None, "killed: {gone}");
    });
    let text = all(&runs);
    assert!(text.contains("lost: no heartbeat"), "{text}");
    eprintln!("kill -9 of a launcher: round 1 running {detected:?} later");
    assert!(
        detected < Duration::from_secs_f64(HEARTBEAT + 4.0),
        "detected in {detected:?}: {text}"
    );
    // The killed launcher's worker died with it (parent-death signal), the others were stopped.
    assert_all_gone(&r0, Duration::from_secs(5), "round 0's workers");
}

#[test]
fn a_stopped_launcher_is_detected_by_its_heartbeat_within_the_bound() {
    // Resumed once the others went on (they are in round 1 for 3 s), it finds itself declared
    // dead, stops its worker and exits 1.
    let (runs, detected, r0) = lose_third_node(libc::SIGSTOP, "3", |third| {
        signal(third.pid(), libc::SIGCONT);
        let back = third.finish(LIMIT);
        assert_eq!(back.code(), Some(1), "{back}");
        assert!(back.stderr.contains("declared this node dead"), "{back}");
    });
    let text = all(&runs);
    let age = reported_age(&text).unwrap_or_else(|| panic!("no detection reported: {text}"));
    eprintln!(
        "SIGSTOP of a launcher: declared dead at a heartbeat age of {age:.2}s, round 1 running \
         {detected:?} later"
    );
    // Detected within --heartbeat-timeout plus two polls (and scheduling slack on 2 cores).
    assert!((HEARTBEAT..HEARTBEAT + 2.0).contains(&age), "{age}: {text}");
    assert!(
        detected >= Duration::from_secs_f64(HEARTBEAT * 0.8)
            && detected < Duration::from_secs_f64(HEARTBEAT + 4.0),
        "{detected:?}: {text}"
    );
    assert_all_gone(&r0, Duration::from_secs(5), "round 0's workers");
}

#[test]
fn below_min_every_launcher_exits_naming_the_lost_node() {
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let s = script(dir.path(), "0");
    let extra = ["--max-restarts", "2", "--rdzv-timeout", "3"];
    let mut v = nodes(port, "3:4", 3, &extra, &s);
    wait_for_pids(&pid_files(dir.path(), 0, 3), Duration::from_secs(15));
    let third = v.pop().unwrap();
    let at = Instant::now();
    signal(third.pid(), libc::SIGKILL);
    let runs: Vec<Run> = v.into_iter().map(|n| n.finish(LIMIT)).collect();
    let took = at.elapsed();
    let _ = third.finish(LIMIT);
    let text = all(&runs);
    for r in &runs {
        assert_eq!(r.code(), Some(1), "{text}");
        assert!(
            r.stderr.contains("2 live node(s) joined")
                && r.stderr
                    .contains("fewer than the minimum 3 of --nnodes 3:4")
                && r.stderr.contains("lost since the round before")
                && r.stderr.contains("no heartbeat"),
            "{text}"
        );
    }
    // Heartbeat timeout, then the 3 s rendezvous timeout, then a clean exit.
    assert!(
        took < Duration::from_secs_f64(HEARTBEAT + 3.0 + 5.0),
        "{took:?}: {text}"
    );
}

#[test]
fn a_node_short_of_min_gives_up_after_the_rendezvous_timeout() {
    let port = free_port();
    let run = node(port, "2:3", &["--rdzv-timeout", "1.5"], "true").finish(LIMIT);
    assert_eq!(run.code(), Some(1), "{run}");
    assert!(
        run.stderr.contains("rendezvous round 0 timed out")
            && run.stderr.contains("1 live node(s) joined")
            && run
                .stderr
                .contains("fewer than the minimum 2 of --nnodes 2:3"),
        "{run}"
    );
}

#[test]
fn losing_the_launcher_that_serves_the_store_ends_the_job() {
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let s = script(dir.path(), "0");
    let extra = ["--max-restarts", "3", "--rdzv-last-call", "5"];
    let mut v = nodes(port, "1:2", 2, &extra, &s);
    let r0 = wait_for_pids(&pid_files(dir.path(), 0, 2), Duration::from_secs(15));
    let host = v.remove(0);
    signal(host.pid(), libc::SIGKILL);
    let other = v.pop().unwrap().finish(LIMIT);
    let _ = host.finish(LIMIT);
    assert_eq!(other.code(), Some(1), "{other}");
    assert!(
        other
            .stderr
            .contains("lost contact with the rendezvous store")
            && other
                .stderr
                .contains("cannot outlive the node that serves its store"),
        "{other}"
    );
    assert_all_gone(&r0, Duration::from_secs(5), "round 0's workers");
}

/// The line of `text` that contains `key`, after the `[rankN]: ` prefix.
fn line_with<'a>(text: &'a str, key: &str) -> Option<&'a str> {
    text.lines()
        .rev()
        .find(|l| l.contains(key))
        .map(|l| l.split_once("]: ").map_or(l, |(_, rest)| rest))
}

/// The number after `before` in `line`.
fn number_after(line: &str, before: &str) -> usize {
    let at = line
        .find(before)
        .unwrap_or_else(|| panic!("{before:?} in {line}"));
    let digits: String = line[at + before.len()..]
        .chars()
        .take_while(char::is_ascii_digit)
        .collect();
    digits
        .parse()
        .unwrap_or_else(|_| panic!("a number after {before:?} in {line}"))
}

/// train-digits under elastic launchers (one worker each) sharing a checkpoint directory.
struct Digits {
    binary: String,
    _dir: tempfile::TempDir,
    ckpt: std::path::PathBuf,
    endpoint: String,
    run_id: String,
}

/// Training images of the digits set, and the run's epochs and batch size per rank.
const IMAGES: usize = 1437;
const EPOCHS: usize = 10;
const BATCH: usize = 32;

impl Digits {
    /// `None` (after saying so) when the example is not built: its binary sits next to ddprun
    /// when the workspace (or train-digits) is built.
    fn new(test: &str) -> Option<Digits> {
        let binary = Path::new(DDPRUN).with_file_name("train-digits");
        if !binary.exists() {
            skip(test, &format!("{} not built", binary.display()));
            return None;
        }
        let dir = tempfile::tempdir().unwrap();
        let port = free_port();
        Some(Digits {
            binary: binary.to_str().unwrap().to_string(),
            ckpt: dir.path().join("ckpt"),
            _dir: dir,
            endpoint: format!("127.0.0.1:{port}"),
            run_id: format!("digits-{port}"),
        })
    }

    /// A launcher of `--nnodes 2:3` with `extra` flags. Rank 1 takes 20 ms per forward, so that
    /// the run lasts long enough to change the world in it; checkpoints every 4 steps; lr 0.1 for
    /// a global batch of 96 (`--scale-lr 96`).
    fn launcher(&self, extra: &[&str]) -> Running {
        let hb = HEARTBEAT.to_string();
        let (e, b) = (EPOCHS.to_string(), BATCH.to_string());
        let mut args = vec![
            "--nnodes",
            "2:3",
            "--rdzv-endpoint",
            &self.endpoint,
            "--run-id",
            &self.run_id,
            "--rdzv-timeout",
            "20",
            "--heartbeat-timeout",
            &hb,
            "--stop-grace-period",
            "2",
        ];
        args.extend_from_slice(extra);
        args.extend_from_slice(&[
            "--",
            &self.binary,
            "--epochs",
            &e,
            "--batch-size",
            &b,
            "--momentum",
            "0.9",
            "--lr",
            "0.1",
            "--scale-lr",
            "96",
            "--checkpoint-dir",
            self.ckpt.to_str().unwrap(),
            "--resume",
            "--checkpoint-every",
            "4",
            "--timeout-s",
            "20",
            "--json",
            "--quiet",
        ]);
        let mut c = ddprun(&args);
        c.env("DDP_DEBUG_SLOW_RANK", "1:20ms");
        Running::start(c)
    }

    /// Wait until a checkpoint exists, and a little longer (the run goes on past it).
    fn wait_for_checkpoint(&self, v: &mut Vec<Running>) {
        let file = self.ckpt.join("checkpoint.safetensors");
        let deadline = Instant::now() + Duration::from_secs(30);
        while !file.exists() {
            let ended = v.iter_mut().any(|n| n.child.try_wait().unwrap().is_some());
            if ended || Instant::now() > deadline {
                let runs: Vec<Run> = std::mem::take(v)
                    .into_iter()
                    .map(|n| n.finish(LIMIT))
                    .collect();
                panic!(
                    "no checkpoint within 30 s, or a launcher exited: {}",
                    all(&runs)
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        std::thread::sleep(Duration::from_millis(300));
    }

    /// The job went from world `from` to world `to`, resumed from a checkpoint of world `from`
    /// at the right sampler position, and reached the accuracy; returns the resume line.
    fn check(runs: &[Run], from: usize, to: usize) {
        let text = all(runs);
        assert!(runs.iter().all(|r| r.code() == Some(0)), "{text}");
        let out: String = runs.iter().map(|r| r.stdout.as_str()).collect();
        let resumed = line_with(&out, &format!("re-sharded over {to} ranks"))
            .unwrap_or_else(|| panic!("no resume at world {to}: {text}"));
        assert!(
            resumed.contains(&format!("(written at world size {from})")),
            "{resumed}"
        );
        let (step, epoch) = (
            number_after(resumed, "at step "),
            number_after(resumed, "epoch "),
        );
        let global = number_after(resumed, &format!("epoch {epoch}, ")).min(IMAGES);
        let json = line_with(&out, "\"world_size\"").unwrap_or_else(|| panic!("no JSON: {text}"));
        let field = |k: &str| {
            let at = json
                .find(&format!("\"{k}\":"))
                .unwrap_or_else(|| panic!("{k} in {json}"));
            let rest = &json[at + k.len() + 3..];
            rest[..rest.find([',', '}']).unwrap()].to_string()
        };
        eprintln!("{resumed}\n{json}");
        assert_eq!(field("world_size"), to.to_string(), "{json}");
        assert_eq!(field("replicas_identical"), "true", "{json}");
        let acc: f64 = field("test_accuracy").parse().unwrap();
        assert!(acc >= 0.95, "{json}");
        // --scale-lr 96: lr 0.1 × 32 × W / 96 at world W.
        let header = |w: usize| line_with(&out, &format!("world_size {w} on cpu")).unwrap_or("");
        let lr = |w: usize| format!("sgd lr {}", 0.1 * (BATCH * w) as f64 / 96.0);
        assert!(header(from).contains(&lr(from)), "{text}");
        assert!(header(to).contains(&lr(to)), "{text}");
        // The sampler went on where the world of `from` stopped: the rest of that epoch split
        // over `to` ranks, then whole epochs of ceil(IMAGES / to) per rank.
        let rest = (IMAGES - global).div_ceil(to).div_ceil(BATCH);
        let whole = IMAGES.div_ceil(to).div_ceil(BATCH) * (EPOCHS - epoch - 1);
        assert_eq!(
            field("steps"),
            (step + rest + whole).to_string(),
            "{resumed}\n{json}"
        );
    }
}

#[test]
fn train_digits_loses_a_node_and_finishes_at_world_two_from_its_checkpoint() {
    let Some(job) = Digits::new("train_digits_loses_a_node_and_finishes_at_world_two") else {
        return;
    };
    // Round 0 closes at MAX; round 1 (the lost node not yet declared dead) after the last call.
    let extra = ["--max-restarts", "1", "--rdzv-last-call", "1"];
    let mut v = vec![job.launcher(&extra)];
    std::thread::sleep(Duration::from_millis(300));
    v.push(job.launcher(&extra));
    v.push(job.launcher(&extra));
    // Kill the third launcher mid-run (its worker dies with it).
    job.wait_for_checkpoint(&mut v);
    let third = v.pop().unwrap();
    signal(third.pid(), libc::SIGKILL);
    let _ = third.finish(LIMIT);
    let runs: Vec<Run> = v
        .into_iter()
        .map(|n| n.finish(Duration::from_secs(90)))
        .collect();
    Digits::check(&runs, 3, 2);
}

#[test]
fn train_digits_admits_a_node_and_finishes_at_world_three_from_its_checkpoint() {
    let Some(job) = Digits::new("train_digits_admits_a_node_and_finishes_at_world_three") else {
        return;
    };
    // Round 0 starts with two after the last call; the third, started mid-run, is admitted at
    // round 1 without using a restart (none are allowed).
    let extra = ["--max-restarts", "0", "--rdzv-last-call", "0.5"];
    let mut v = vec![job.launcher(&extra)];
    std::thread::sleep(Duration::from_millis(300));
    v.push(job.launcher(&extra));
    job.wait_for_checkpoint(&mut v);
    v.push(job.launcher(&extra));
    let runs: Vec<Run> = v
        .into_iter()
        .map(|n| n.finish(Duration::from_secs(90)))
        .collect();
    Digits::check(&runs, 2, 3);
}

#[test]
fn a_hung_store_host_ends_the_job_within_the_bound() {
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let s = script(dir.path(), "0");
    let extra = ["--max-restarts", "3", "--rdzv-last-call", "5"];
    let mut v = nodes(port, "1:2", 2, &extra, &s);
    let r0 = wait_for_pids(&pid_files(dir.path(), 0, 2), Duration::from_secs(15));
    let host = v.remove(0);
    let at = Instant::now();
    signal(host.pid(), libc::SIGSTOP);
    let other = v.pop().unwrap().finish(LIMIT);
    let took = at.elapsed();
    signal(host.pid(), libc::SIGKILL);
    let _ = host.finish(LIMIT);
    eprintln!("SIGSTOP of the store's launcher: the other exited {took:?} later");
    assert_eq!(other.code(), Some(1), "{other}");
    assert!(
        other
            .stderr
            .contains("lost contact with the rendezvous store"),
        "{other}"
    );
    // The store's answers stop: noticed within the heartbeat timeout + the 5 s reply margin.
    assert!(
        took < Duration::from_secs_f64(HEARTBEAT + 5.0 + 4.0),
        "{took:?}: {other}"
    );
    assert_all_gone(&r0, Duration::from_secs(5), "round 0's workers");
}

#[test]
fn a_lost_node_uses_a_restart_and_with_none_left_the_job_ends() {
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let s = script(dir.path(), "0");
    let extra = ["--max-restarts", "0", "--rdzv-last-call", "5"];
    let mut v = nodes(port, "2:3", 3, &extra, &s);
    let r0 = wait_for_pids(&pid_files(dir.path(), 0, 3), Duration::from_secs(15));
    let third = v.pop().unwrap();
    signal(third.pid(), libc::SIGKILL);
    let runs: Vec<Run> = v.into_iter().map(|n| n.finish(LIMIT)).collect();
    let _ = third.finish(LIMIT);
    let text = all(&runs);
    for r in &runs {
        assert_eq!(r.code(), Some(1), "{text}");
        assert!(
            r.stderr.contains("no heartbeat") && r.stderr.contains("no restarts left"),
            "{text}"
        );
    }
    assert!(!dir.path().join("r1_0").exists(), "no round 1: {text}");
    assert_all_gone(&r0, Duration::from_secs(5), "round 0's workers");
}

#[test]
fn a_node_beyond_max_waits_as_a_spare_and_says_why_it_was_never_admitted() {
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let s = script(dir.path(), "0");
    // Two of --nnodes 1:2 run round 0 (closed at MAX); a third is never admitted.
    let extra = ["--rdzv-last-call", "5"];
    let mut v = nodes(port, "1:2", 2, &extra, &s);
    let r0 = wait_for_pids(&pid_files(dir.path(), 0, 2), Duration::from_secs(15));
    let spare = node(port, "1:2", &["--rdzv-timeout", "1.5"], &s).finish(LIMIT);
    assert_eq!(spare.code(), Some(1), "{spare}");
    assert!(
        spare
            .stderr
            .contains("round 0 runs with the maximum of 2 nodes")
            && spare.stderr.contains("was never admitted"),
        "{spare}"
    );
    assert!(
        !dir.path().join("r1_0").exists(),
        "the spare did not restart round 0"
    );
    // SIGTERM to both: each exits 143, or 1 when it saw the other leave first.
    for n in &v {
        signal(n.pid(), libc::SIGTERM);
    }
    for n in v.drain(..) {
        let r = n.finish(LIMIT);
        assert!(matches!(r.code(), Some(1 | 143)), "{r}");
    }
    assert_all_gone(&r0, Duration::from_secs(5), "round 0's workers");
}

#[test]
fn pytorch_workers_grow_from_two_to_three_nodes_with_a_fresh_store_namespace() {
    let ok = std::process::Command::new("python3")
        .args([
            "-c",
            "import torch.distributed as d; assert d.is_available()",
        ])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !ok {
        note_skip(
            "pytorch_workers_grow_from_two_to_three_nodes_with_a_fresh_store_namespace",
            "python3 cannot import torch.distributed",
        );
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    // Each worker counts itself in PyTorch's store (TORCHELASTIC_USE_AGENT_STORE: the
    // launcher's store); round 0 then sleeps until the third node's arrival stops it.
    let script = r#"import os, time, torch
import torch.distributed as dist
dist.init_process_group('gloo')
r = int(os.environ['DDP_RDZV_ROUND'])
n = dist.distributed_c10d._get_default_store().add('arrived', 1)
t = torch.ones(1)
dist.all_reduce(t)
dist.barrier()
print(f'round {r}: rank {dist.get_rank()}/{dist.get_world_size()} arrived {n} sum {t.item():g}', flush=True)
if r == 0:
    open('DIR/r0_' + os.environ['RANK'], 'w').write(f'{os.getpid()}\n')
    time.sleep(60)
dist.destroy_process_group()
"#
    .replace("DIR", &dir.path().display().to_string());
    let port = free_port();
    let endpoint = format!("127.0.0.1:{port}");
    let run_id = format!("torch-{port}");
    let launcher = || {
        Running::start(ddprun(&[
            "--nnodes",
            "2:3",
            "--rdzv-endpoint",
            &endpoint,
            "--run-id",
            &run_id,
            "--rdzv-timeout",
            "60",
            "--rdzv-last-call",
            "0.5",
            "--stop-grace-period",
            "2",
            "--",
            "python3",
            "-c",
            &script,
        ]))
    };
    let mut v = vec![launcher()];
    std::thread::sleep(Duration::from_millis(300));
    v.push(launcher());
    let r0 = wait_for_pids(&pid_files(dir.path(), 0, 2), Duration::from_secs(60));
    v.push(launcher());
    let runs: Vec<Run> = v
        .into_iter()
        .map(|n| n.finish(Duration::from_secs(120)))
        .collect();
    let text = all(&runs);
    assert!(runs.iter().all(|r| r.code() == Some(0)), "{text}");
    let mut lines: Vec<&str> = runs
        .iter()
        .flat_map(|r| r.stdout.lines())
        .filter_map(|l| l.split_once("]: round 1: ").map(|x| x.1))
        .collect();
    lines.sort();
    // Counted from zero again in round 1: its own namespace, not on top of round 0's keys.
    let mut arrived: Vec<&str> = lines
        .iter()
        .filter_map(|l| l.split(" arrived ").nth(1))
        .collect();
    arrived.sort();
    assert_eq!(arrived, ["1 sum 3", "2 sum 3", "3 sum 3"], "{text}");
    assert_all_gone(&r0, Duration::from_secs(5), "round 0's workers");
}

#[test]
fn a_worker_failure_restarts_every_node_at_the_same_size_using_a_restart() {
    let port = free_port();
    let s = "if [ \"$DDP_RDZV_ROUND\" = 0 ]; then \
               if [ \"$GROUP_RANK\" = 1 ]; then echo 'node 1 breaks' >&2; exit 3; fi; \
               exec sleep 30; fi; \
             echo \"r$DDP_RDZV_ROUND $RANK $WORLD_SIZE $TORCHELASTIC_RESTART_COUNT\"";
    let extra = ["--max-restarts", "1", "--rdzv-last-call", "5"];
    let v = nodes(port, "2:3", 3, &extra, s);
    let runs: Vec<Run> = v.into_iter().map(|n| n.finish(LIMIT)).collect();
    let text = all(&runs);
    assert!(runs.iter().all(|r| r.code() == Some(0)), "{text}");
    let refs: Vec<&Run> = runs.iter().collect();
    // Every node rejoined at once (no last call): round 1 has all three, one restart used.
    assert_eq!(
        round_lines(&refs, 1),
        ["r1 0 3 1", "r1 1 3 1", "r1 2 3 1"],
        "{text}"
    );
    assert!(
        text.contains("exit code 3") && text.contains("node 1 breaks"),
        "{text}"
    );
    assert!(
        runs.iter().all(|r| r.elapsed < Duration::from_secs(12)),
        "the sleeping workers were stopped and nobody waited for the last call: {text}"
    );
}
