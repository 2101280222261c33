//! `ddp-bench --json` output carries every documented key (README, `bench/peers/README.md`):
//! sweeps `bytes time_us algbw_gbs busbw_gbs wrong` per size, `train` a last line with
//! `world_size samples_per_s step_ms comm_wait_ms`.

use std::process::Command;
use std::time::{Duration, Instant};

const BENCH: &str = env!("CARGO_BIN_EXE_ddp-bench");

/// Run `ddp-bench args`, at most 120 s; its stdout lines that are JSON objects.
fn json_lines(args: &[&str]) -> Vec<serde_json::Map<String, serde_json::Value>> {
    stdout(args)
        .lines()
        .filter(|l| l.starts_with('{'))
        .map(|l| match serde_json::from_str(l).unwrap() {
            serde_json::Value::Object(m) => m,
            other => panic!("not an object: {other}"),
        })
        .collect()
}

/// Run `ddp-bench args`, at most 120 s; its stdout (it must succeed).
fn stdout(args: &[&str]) -> String {
    let mut child = Command::new(BENCH)
        .args(args)
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(120);
    while child.try_wait().unwrap().is_none() {
        if Instant::now() > deadline {
            child.kill().ok();
            panic!("ddp-bench {args:?} still running after 120 s");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "ddp-bench {args:?}: {:?}", out.status);
    String::from_utf8(out.stdout).unwrap()
}

fn assert_keys(row: &serde_json::Map<String, serde_json::Value>, keys: &[&str]) {
    for k in keys {
        assert!(
            row.get(*k).is_some_and(|v| v.is_number()),
            "missing or non-numeric {k:?} in {row:?}"
        );
    }
}

#[test]
fn sweeps_print_one_json_object_per_size_with_every_key() {
    for op in ["allreduce", "all_gather", "reduce_scatter", "broadcast"] {
        let args = [
            op,
            "--nproc",
            "2",
            "--min-bytes",
            "1K",
            "--max-bytes",
            "16K",
            "--iters",
            "3",
            "--warmup",
            "1",
            "--json",
        ];
        let rows = json_lines(&args);
        let sizes: Vec<u64> = rows.iter().map(|r| r["bytes"].as_u64().unwrap()).collect();
        assert_eq!(sizes, [1024, 4096, 16384], "{op}");
        for row in &rows {
            assert_keys(
                row,
                &["bytes", "time_us", "algbw_gbs", "busbw_gbs", "wrong"],
            );
            assert_eq!(row["wrong"], 0, "{op}: {row:?}");
        }
    }
}

#[test]
fn train_prints_a_json_line_with_every_key() {
    let args = [
        "train", "--nproc", "1", "--hidden", "16", "--layers", "1", "--batch", "4", "--steps", "2",
        "--warmup", "0", "--json",
    ];
    let rows = json_lines(&args);
    let last = rows.last().expect("a JSON line");
    assert_keys(
        last,
        &["world_size", "samples_per_s", "step_ms", "comm_wait_ms"],
    );
    assert_eq!(last["world_size"], 1);
}

/// `ddp-bench train` at world 2 on a small model (hidden 32, 2 layers, batch 4, 2 steps after
/// 1 warmup) with `extra` appended; its JSON lines.
fn small_zero_train(extra: &[&str]) -> Vec<serde_json::Map<String, serde_json::Value>> {
    let mut args = vec![
        "train", "--nproc", "2", "--hidden", "32", "--layers", "2", "--batch", "4", "--steps", "2",
        "--warmup", "1",
    ];
    args.extend_from_slice(extra);
    json_lines(&args)
}

/// `--zero 0..3` with AdamW at world 2: every stage reports its peak RSS and bytes per step
/// (stages 1 and 2 as much as DDP, stage 3 between 1x and 1.5x), stage 3 also its largest unit;
/// every run checks that the ranks' parameters end identical.
#[test]
fn train_with_zero_stages_reports_memory_and_bytes() {
    let mut bytes = Vec::new();
    for zero in ["0", "1", "2", "3"] {
        let rows = small_zero_train(&["--optimizer", "adamw", "--zero", zero, "--json"]);
        let last = rows.last().expect("a JSON line");
        assert_keys(last, &["peak_rss_bytes", "bytes_per_step", "params"]);
        assert_eq!(last["zero"].as_u64(), Some(zero.parse().unwrap()));
        bytes.push(last["bytes_per_step"].as_f64().unwrap());
        if zero == "3" {
            // 784x32 + 32 (the largest layer).
            assert_eq!(last["largest_unit_params"], 784 * 32 + 32);
        }
    }
    assert_eq!(bytes[1], bytes[2]);
    assert!(
        bytes[3] > bytes[1] && bytes[3] <= 1.5 * bytes[1] * 1.01,
        "{bytes:?}"
    );
    // Stage 3's backward prefetch moves when gathers start, not what is sent.
    for prefetch in ["post", "none"] {
        let rows = small_zero_train(&["--zero", "3", "--json", "--backward-prefetch", prefetch]);
        let last = rows.last().expect("a JSON line");
        assert_eq!(last["backward_prefetch"], prefetch);
        assert_eq!(last["bytes_per_step"].as_f64(), Some(bytes[3]));
    }
}

/// `--framework burn`, plain and with comm hooks: the hook runs (PowerSGD and local SGD send
/// less than plain DDP; every run checks that the replicas end identical).
#[test]
fn train_with_burn_prints_a_json_line_with_every_key() {
    let mut bytes = Vec::new();
    for hook in ["none", "powersgd:1:0", "localsgd:4:0"] {
        let args = [
            "train",
            "--framework",
            "burn",
            "--nproc",
            "2",
            "--hidden",
            "16",
            "--layers",
            "2",
            "--batch",
            "4",
            "--steps",
            "4",
            "--warmup",
            "1",
            "--json",
            "--hook",
            hook,
        ];
        let rows = json_lines(&args);
        let last = rows.last().expect("a JSON line");
        assert_keys(
            last,
            &[
                "world_size",
                "samples_per_s",
                "step_ms",
                "comm_wait_ms",
                "bytes_per_step",
            ],
        );
        assert_eq!(last["world_size"], 2);
        assert_eq!(last["framework"], "burn");
        assert_eq!(last["hook"], hook);
        bytes.push(last["bytes_per_step"].as_f64().unwrap());
    }
    assert!(bytes[1] < bytes[0] && bytes[2] < bytes[0], "{bytes:?}");
}

/// `--hook diloco:4` in both frameworks: the outer loop runs (the replicas end identical: every
/// run checks), and over 8 timed steps (2 synchronizations) it sends 1/4 of plain DDP's bytes
/// per step, in the table and in the JSON; streaming DiLoCo (bf16) half of that.
#[test]
fn train_with_diloco_sends_a_quarter_of_ddps_bytes_in_both_frameworks() {
    for framework in ["candle", "burn"] {
        let mut bytes = Vec::new();
        for hook in ["none", "diloco:4", "streaming-diloco:4:2:1"] {
            let out = stdout(&[
                "train",
                "--framework",
                framework,
                "--nproc",
                "2",
                "--hidden",
                "16",
                "--layers",
                "2",
                "--batch",
                "4",
                "--steps",
                "8",
                "--warmup",
                "0",
                "--json",
                "--hook",
                hook,
            ]);
            let json = out.lines().rev().find(|l| l.starts_with('{')).unwrap();
            let row: serde_json::Value = serde_json::from_str(json).unwrap();
            assert!(row["hook"].as_str().unwrap().starts_with(hook), "{row}");
            let b = row["bytes_per_step"].as_f64().unwrap();
            assert!(
                out.contains(&format!("bytes/step {b:.0}")),
                "{framework} {hook}: the table lacks bytes/step {b}:\n{out}"
            );
            bytes.push(b);
        }
        let (ddp, dl, st) = (bytes[0], bytes[1], bytes[2]);
        assert!(ddp > 0.0, "{framework}: {bytes:?}");
        assert_eq!(dl, ddp / 4.0, "{framework}: DiLoCo vs DDP {bytes:?}");
        assert_eq!(st, dl / 2.0, "{framework}: streaming vs DiLoCo {bytes:?}");
    }
}
