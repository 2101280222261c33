//! Seeing what training does, end to end with real worker processes: the merged timeline
//! (`--trace`), the bottleneck report naming a rank slowed on purpose (`DDP_DEBUG_SLOW_RANK`),
//! the progress display on a pseudo-terminal and on a pipe, and the metrics file.

use serde_json::Value;
use std::collections::BTreeMap;
use std::io::Read;
use std::os::fd::OwnedFd;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_train-digits");
const DEADLINE: Duration = Duration::from_secs(120);

fn command(args: &[&str], env: &[(&str, &str)]) -> Command {
    let mut cmd = Command::new(BIN);
    cmd.args(args)
        .env_remove("RANK")
        .env_remove("WORLD_SIZE")
        .env_remove("DDP_TRACE")
        .env_remove("DDP_PROGRESS")
        .env_remove("DDP_DEBUG_SLOW_RANK")
        .env_remove("DDP_DEBUG_CLOCK_SKEW")
        .envs(env.iter().copied())
        .stdin(Stdio::null());
    cmd
}

/// Waits for `child` at most [`DEADLINE`] (killed on overrun); panics unless it succeeded.
fn wait_ok(mut child: Child, out: std::thread::JoinHandle<Vec<u8>>, what: &str) -> String {
    let start = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if start.elapsed() > DEADLINE {
            let _ = child.kill();
            let _ = child.wait();
            panic!("{what} did not finish within {DEADLINE:?}");
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    let out = String::from_utf8_lossy(&out.join().unwrap()).into_owned();
    assert!(status.success(), "{what} failed ({status}):\n{out}");
    out
}

fn read_all(mut src: impl Read + Send + 'static) -> std::thread::JoinHandle<Vec<u8>> {
    std::thread::spawn(move || {
        let mut v = Vec::new();
        // A pseudo-terminal's master reports EIO once the last writer has gone: the end.
        let mut buf = [0u8; 4096];
        loop {
            match src.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => v.extend_from_slice(&buf[..n]),
            }
        }
        v
    })
}

/// Runs train-digits with stdout and stderr on one pipe; returns the output.
fn run_piped(args: &[&str], env: &[(&str, &str)]) -> String {
    let (reader, writer) = std::io::pipe().unwrap();
    let mut cmd = command(args, env);
    cmd.stdout(writer.try_clone().unwrap()).stderr(writer);
    let child = cmd.spawn().unwrap();
    drop(cmd); // our copies of the write end: EOF once the processes exit
    wait_ok(child, read_all(reader), &format!("train-digits {args:?}"))
}

/// Runs train-digits with stdout on a pseudo-terminal (stderr piped away); returns what the
/// terminal received.
fn run_on_pty(args: &[&str], env: &[(&str, &str)]) -> String {
    use rustix::pty::{grantpt, openpt, ptsname, unlockpt, OpenptFlags};
    let master: OwnedFd = openpt(OpenptFlags::RDWR | OpenptFlags::NOCTTY).unwrap();
    grantpt(&master).unwrap();
    unlockpt(&master).unwrap();
    let name = ptsname(&master, Vec::new()).unwrap();
    let size = rustix::termios::Winsize {
        ws_row: 24,
        ws_col: 120,
        ws_xpixel: 0,
        ws_ypixel: 0,
    };
    rustix::termios::tcsetwinsize(&master, size).unwrap();
    let slave = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(name.to_str().unwrap())
        .unwrap();
    let mut cmd = command(args, env);
    cmd.env("TERM", "xterm").stdout(slave).stderr(Stdio::null());
    let child = cmd.spawn().unwrap();
    drop(cmd);
    wait_ok(
        child,
        read_all(std::fs::File::from(master)),
        "train-digits on a pty",
    )
}

fn load_trace(dir: &std::path::Path) -> Value {
    let text = std::fs::read_to_string(dir.join("trace.json")).expect("trace.json written");
    serde_json::from_str(&text).expect("the merged trace is JSON")
}

fn num(e: &Value, k: &str) -> f64 {
    e[k].as_f64()
        .unwrap_or_else(|| panic!("{k} missing in {e}"))
}

#[test]
fn merged_trace_holds_every_rank_with_buckets_inside_backward_and_aligned_clocks() {
    let dir = tempfile::tempdir().unwrap();
    let trace_dir = dir.path().join("trace");
    // Rank 1's trace clock runs 250 ms ahead, as another host's would: the merge must undo it.
    let out = run_piped(
        &[
            "--nproc",
            "2",
            "--epochs",
            "1",
            "--max-steps",
            "12",
            "--backward",
            "staged",
            "--hidden",
            "256",
            "--trace",
            trace_dir.to_str().unwrap(),
            "--checkpoint-dir",
            dir.path().join("ckpt").to_str().unwrap(),
        ],
        &[("DDP_DEBUG_CLOCK_SKEW", "1:250ms")],
    );
    assert!(out.contains("timeline of every rank"), "{out}");
    let trace = load_trace(&trace_dir);
    let events = trace["traceEvents"].as_array().expect("traceEvents");

    // Every rank has its process track and each kind of span.
    for pid in 0..2u64 {
        let names: Vec<&str> = events
            .iter()
            .filter(|e| e["pid"] == pid && e["ph"] != "M")
            .filter_map(|e| e["name"].as_str())
            .collect();
        for want in [
            "data",
            "forward",
            "backward",
            "optimizer",
            "checkpoint",
            "all_reduce",
            "bucket 0",
            "bucket 0 ready",
            "wait bucket 0",
            "end of trace (barrier)",
        ] {
            assert!(names.contains(&want), "rank {pid} has no `{want}` event");
        }
        assert!(events.iter().any(|e| e["ph"] == "M"
            && e["pid"] == pid
            && e["args"]["name"] == format!("rank {pid}")));
    }

    // Each bucket's flight (launch to the end of the wait for it) lies inside the backward of
    // its step, on the same rank.
    let mut backward: BTreeMap<(u64, u64), (f64, f64)> = BTreeMap::new();
    for e in events
        .iter()
        .filter(|e| e["name"] == "backward" && e["ph"] == "X")
    {
        let (ts, dur) = (num(e, "ts"), num(e, "dur"));
        let key = (
            e["pid"].as_u64().unwrap(),
            e["args"]["step"].as_u64().unwrap(),
        );
        backward.insert(key, (ts, ts + dur));
    }
    let mut begins: BTreeMap<(u64, String), f64> = BTreeMap::new();
    let mut checked = 0;
    for e in events.iter().filter(|e| e["cat"] == "bucket") {
        let pid = e["pid"].as_u64().unwrap();
        let id = e["id"].as_str().unwrap_or_default().to_string();
        match e["ph"].as_str().unwrap() {
            "b" => {
                begins.insert((pid, id), num(e, "ts"));
            }
            "e" => {
                let b = begins[&(pid, id.clone())];
                let step = u64::from_str_radix(id.trim_start_matches("0x"), 16).unwrap() >> 16;
                let (s, t) = backward[&(pid, step)];
                // Timestamps are microseconds with nanosecond fractions: allow 1 us rounding.
                assert!(
                    b >= s - 1e-3 && num(e, "ts") <= t + 1e-3,
                    "rank {pid} bucket {id} [{b}, {}] outside its backward [{s}, {t}]",
                    num(e, "ts")
                );
                checked += 1;
            }
            _ => {}
        }
    }
    assert!(checked >= 2 * 12, "only {checked} bucket flights checked");

    // Clock alignment: the final barrier releases every rank at (almost) the same moment. The
    // offset estimate errs by at most half its round trip (otherData.clock_sync); a barrier
    // releases the ranks within one message latency of each other; 5 ms more covers a woken
    // thread waiting for a CPU on a loaded 2-core CI machine. Without alignment the ends would
    // be 250 ms apart.
    let sync = trace["otherData"]["clock_sync"].as_array().unwrap();
    assert_eq!(sync.len(), 2);
    let rtt_ms = num(&sync[1], "rtt_ns") / 1e6;
    let offset_ms = num(&sync[1], "offset_ns") / 1e6;
    assert!(
        (offset_ms + 250.0).abs() < 50.0,
        "rank 1's offset {offset_ms} ms does not undo its 250 ms skew"
    );
    let barrier_end = |pid: u64| {
        let e = events
            .iter()
            .find(|e| e["pid"] == pid && e["name"] == "barrier" && e["cat"] == "collective")
            .unwrap_or_else(|| panic!("rank {pid}: no barrier collective"));
        num(e, "ts") + num(e, "dur")
    };
    let skew_ms = (barrier_end(0) - barrier_end(1)).abs() / 1e3;
    let bound_ms = rtt_ms / 2.0 + 5.0;
    assert!(
        skew_ms <= bound_ms,
        "barrier ends {skew_ms:.3} ms apart across ranks (bound {bound_ms:.3} ms)"
    );

    // The report is written next to the trace.
    let report: Value =
        serde_json::from_str(&std::fs::read_to_string(trace_dir.join("report.json")).unwrap())
            .unwrap();
    assert_eq!(report["ranks"].as_array().unwrap().len(), 2);
}

/// Runs with `slow` (`RANK:DURATION`) and returns the report.
fn report_with_slow_rank(slow: &str) -> (Value, String) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("report.json");
    let out = run_piped(
        &[
            "--nproc",
            "3",
            "--epochs",
            "1",
            "--max-steps",
            "12",
            "--quiet",
            "--report",
            path.to_str().unwrap(),
        ],
        &[("DDP_DEBUG_SLOW_RANK", slow)],
    );
    let text = std::fs::read_to_string(&path).expect("report written");
    (serde_json::from_str(&text).unwrap(), out)
}

#[test]
fn bottleneck_report_names_the_rank_slowed_on_purpose() {
    for (slow_rank, spec) in [(1u64, "1:40ms"), (2, "2:40ms")] {
        let (report, out) = report_with_slow_rank(spec);
        let s = &report["straggler"];
        assert_eq!(s["rank"], slow_rank, "{report}");
        assert_eq!(s["significant"], true, "{report}");
        // It sleeps 40 ms per forward: the others are slower by less than that, and by most of it.
        let by = num(s, "slower_by_ms");
        assert!((25.0..60.0).contains(&by), "slower by {by} ms: {report}");
        // The others spend that time waiting for it, not communicating.
        for r in report["ranks"].as_array().unwrap() {
            if r["rank"] != slow_rank {
                assert!(num(r, "waiting_ms") > 25.0, "{r}");
            }
        }
        assert!(
            out.contains(&format!("straggler: rank {slow_rank}")),
            "the printed report does not name rank {slow_rank}:\n{out}"
        );
        // --quiet: no progress lines.
        assert!(!out.contains("progress:"), "{out}");
    }
}

#[test]
fn progress_is_a_bar_on_a_terminal_and_lines_on_a_pipe() {
    let args = ["--nproc", "2", "--epochs", "2", "--log-every", "1"];
    let tty = run_on_pty(&args, &[]);
    assert!(tty.contains("ETA"), "no bar on the terminal:\n{tty}");
    assert!(
        tty.contains('\r') || tty.contains("\x1b["),
        "the bar does not redraw in place:\n{tty:?}"
    );
    assert!(
        !tty.contains("progress: "),
        "plain lines on a terminal:\n{tty}"
    );
    assert!(tty.contains("held-out accuracy"), "{tty}");

    let piped = run_piped(&args, &[]);
    let lines = piped
        .lines()
        .filter(|l| l.starts_with("progress: epoch"))
        .count();
    assert!(lines >= 5, "{lines} progress lines on a pipe:\n{piped}");
    assert!(!piped.contains("\x1b["), "escape codes on a pipe:\n{piped}");
    assert!(piped.contains("ETA"), "{piped}");
}

#[test]
fn metrics_file_has_step_lines_with_accuracy_and_the_report() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("metrics.jsonl");
    run_piped(
        &[
            "--nproc",
            "2",
            "--epochs",
            "2",
            "--quiet",
            "--metrics",
            path.to_str().unwrap(),
            "--metrics-every",
            "5",
        ],
        &[],
    );
    let lines: Vec<Value> = std::fs::read_to_string(&path)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).expect("each line is JSON"))
        .collect();
    let steps: Vec<&Value> = lines.iter().filter(|l| l["kind"] == "step").collect();
    // 23 steps per epoch at batch 32 over 2 ranks: steps 5..20 of each epoch, plus its end.
    assert!(steps.len() >= 8, "{} step lines", steps.len());
    for s in &steps {
        for k in [
            "step",
            "loss",
            "lr",
            "samples_per_s",
            "comm_wait_ms",
            "bytes_sent",
        ] {
            assert!(s[k].is_number(), "{k} missing in {s}");
        }
    }
    let with_acc: Vec<f64> = steps
        .iter()
        .filter_map(|s| s["accuracy"].as_f64())
        .collect();
    assert_eq!(with_acc.len(), 2, "one accuracy per epoch");
    assert!(with_acc.iter().all(|a| (0.0..=1.0).contains(a)));
    let sent: Vec<u64> = steps
        .iter()
        .map(|s| s["bytes_sent"].as_u64().unwrap())
        .collect();
    assert!(
        sent.windows(2).all(|w| w[0] < w[1]),
        "bytes sent grows: {sent:?}"
    );
    let report = lines.last().unwrap();
    assert_eq!(report["kind"], "report");
    assert_eq!(report["ranks"].as_array().unwrap().len(), 2);
}
