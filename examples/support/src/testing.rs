//! What the tests of the example programs share: running a program to completion with a
//! deadline, reading and comparing its final `--json` line ([`RunSummary`]), and a free port for
//! a launcher's store.

use crate::summary::RunSummary;

/// A TCP port free on 127.0.0.1 when asked (for a launcher's store).
pub fn free_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap().port()
}

/// The keys of the final JSON line that pin a training run down: two runs that agree on all of
/// them (exactly) trained the same model.
pub const RESULT_KEYS: [&str; 5] = [
    "steps",
    "param_sum",
    "param_l2",
    "final_loss",
    "test_accuracy",
];

/// Asserts that `got` ended exactly where `want` did (every [`RESULT_KEYS`] equal); `what`
/// names the comparison in the failure message.
pub fn assert_same_run(got: &serde_json::Value, want: &serde_json::Value, what: &str) {
    for k in RESULT_KEYS {
        assert_eq!(got[k], want[k], "{what}: {k} differs: {got} vs {want}");
    }
}

/// The keys of the final `--json` line, in their documented order.
pub const JSON_KEYS: [&str; 13] = RunSummary::KEYS;

/// Asserts that `line` is a JSON object with exactly [`JSON_KEYS`], written in that order.
pub fn assert_json_keys_in_order(line: &str) {
    let v: serde_json::Value =
        serde_json::from_str(line).unwrap_or_else(|e| panic!("not JSON ({e}): {line}"));
    assert_eq!(
        v.as_object().map(|o| o.len()),
        Some(JSON_KEYS.len()),
        "{line}"
    );
    let mut at = 0;
    for k in JSON_KEYS {
        let pos = line[at..]
            .find(&format!("\"{k}\":"))
            .unwrap_or_else(|| panic!("{k} missing or out of the documented order: {line}"));
        at += pos;
    }
}

/// How a binary run ended.
pub struct Finished {
    pub success: bool,
    pub stdout: String,
    pub stderr: String,
    pub elapsed: std::time::Duration,
}

impl Finished {
    /// The final `--json` line, parsed (panics, showing the output, when there is none).
    pub fn json(&self) -> serde_json::Value {
        let line = self.stdout.lines().rev().find(|l| l.starts_with('{'));
        let line =
            line.unwrap_or_else(|| panic!("no JSON line:\n{}\n{}", self.stdout, self.stderr));
        serde_json::from_str(line).unwrap()
    }

    /// The final `--json` line as the programs' [`RunSummary`] (panics, showing the output,
    /// when there is none or it is not one).
    pub fn summary(&self) -> RunSummary {
        serde_json::from_value(self.json())
            .unwrap_or_else(|e| panic!("not a run summary ({e}):\n{}", self.stdout))
    }
}

/// Runs `bin` with `args` (its own launcher: no RANK/WORLD_SIZE inherited) to completion, with
/// a deadline of `deadline_s` seconds (killed and failed on overrun).
pub fn run_bin(bin: &str, args: &[&str], deadline_s: u64) -> Finished {
    use std::io::Read;
    use std::process::{Command, Stdio};
    use std::time::{Duration, Instant};
    let start = Instant::now();
    let mut child = Command::new(bin)
        .args(args)
        .env_remove("RANK")
        .env_remove("WORLD_SIZE")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let pump = |mut src: Box<dyn Read + Send>| {
        std::thread::spawn(move || {
            let mut s = String::new();
            let _ = src.read_to_string(&mut s);
            s
        })
    };
    let out = pump(Box::new(child.stdout.take().unwrap()));
    let err = pump(Box::new(child.stderr.take().unwrap()));
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if start.elapsed() > Duration::from_secs(deadline_s) {
            let _ = child.kill();
            let _ = child.wait();
            panic!("{bin} {args:?} did not finish in {deadline_s} s");
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    Finished {
        success: status.success(),
        stdout: out.join().unwrap(),
        stderr: err.join().unwrap(),
        elapsed: start.elapsed(),
    }
}

/// Runs `bin` (either program) with `args` to completion (300 s at most) and returns its
/// summary, failing with its output when it failed.
pub fn run_summary(bin: &str, args: &[&str]) -> RunSummary {
    let f = run_bin(bin, args, 300);
    assert!(
        f.success,
        "{bin} {args:?} failed:\n{}\n{}",
        f.stdout, f.stderr
    );
    f.summary()
}

/// `--hook diloco:4` and `--hook streaming-diloco:4:2:1` in `bin` (either program) at world 2
/// for 3 epochs (69 steps): the replicas end identical (the last step is followed by a final
/// synchronization), the model learns and differs from plain DDP's, and the bytes sent are
/// DDP's bytes of one step per synchronization — the 17 of steps 4 to 68 and the final one —
/// instead of one per step; streaming sends them as bf16, half as many.
pub fn check_diloco_trains(bin: &str) {
    let run = |hook: &str| {
        run_summary(
            bin,
            &[
                "--nproc",
                "2",
                "--epochs",
                "3",
                "--json",
                "--log-every",
                "0",
                "--hook",
                hook,
            ],
        )
    };
    let ddp = run("none");
    let dl = run("diloco:4");
    let st = run("streaming-diloco:4:2:1");
    for (s, hook) in [(&dl, "diloco:4:0.7:0.9"), (&st, "streaming-diloco:4:2:1")] {
        assert_eq!(s.hook, hook);
        assert_eq!(s.steps, 69, "{hook}: {s:?}");
        assert!(
            s.replicas_identical && s.max_param_diff == 0.0,
            "{hook}: {s:?}"
        );
        assert!(s.test_accuracy >= 0.85, "{hook} did not learn: {s:?}");
        assert_ne!(s.param_sum, ddp.param_sum, "{hook} trained as DDP: {s:?}");
    }
    let per_step = ddp.bytes_per_step;
    let want = per_step * 18.0 / 69.0;
    assert!(
        (dl.bytes_per_step - want).abs() <= 1e-9 * per_step,
        "DiLoCo sent {} bytes per step, want {want} (DDP {per_step})",
        dl.bytes_per_step
    );
    assert!(
        (st.bytes_per_step - want / 2.0).abs() <= 1e-9 * per_step,
        "streaming DiLoCo sent {} bytes per step, want {} (bf16)",
        st.bytes_per_step,
        want / 2.0
    );
}

/// DiLoCo (AdamW, outer lr 0.5 and momentum 0.8) and streaming DiLoCo (SGD with momentum) in
/// `bin` (either program), stopped at step 30 — between synchronizations, streaming with a
/// fragment's all-reduce in flight — and resumed from the checkpoint: the same run as the
/// uninterrupted one, bit for bit (every rank's own parameters and optimizer state are in it).
/// Resumed with 3 and with 1 process instead, it goes on (rank 2 from the last
/// synchronization) and ends synchronized.
pub fn check_diloco_resumes_exactly(bin: &str) {
    let cases: [(&str, &[&str]); 2] = [
        ("diloco:4:0.5:0.8", &["--optimizer", "adamw"]),
        ("streaming-diloco:4:2:1", &["--momentum", "0.5"]),
    ];
    for (hook, opt) in cases {
        let dir = std::env::temp_dir().join(format!(
            "ddp-diloco-resume-{}-{}",
            hook.replace(':', "-"),
            std::process::id()
        ));
        let d = dir.to_str().unwrap();
        let run = |nproc: &str, more: &[&str]| {
            let args = [
                &[
                    "--nproc",
                    nproc,
                    "--epochs",
                    "3",
                    "--json",
                    "--log-every",
                    "0",
                ][..],
                &["--hook", hook],
                opt,
                more,
            ]
            .concat();
            run_bin(bin, &args, 300)
        };
        let full = run("2", &[]);
        let part = run("2", &["--max-steps", "30", "--checkpoint-dir", d]);
        // The step-30 checkpoint, for resumes at other world sizes (the resume below writes
        // later ones into `dir`).
        let at30 = dir.with_extension("at30");
        copy_files(&dir, &at30);
        let resumed = run("2", &["--checkpoint-dir", d, "--resume"]);
        let _ = std::fs::remove_dir_all(&dir);
        for f in [&full, &part, &resumed] {
            assert!(f.success, "{hook}: {}\n{}", f.stdout, f.stderr);
        }
        let part = part.summary();
        assert_eq!(part.steps, 30, "{hook}");
        assert!(part.replicas_identical, "{hook}: {part:?}");
        assert!(resumed.stdout.contains("at step 30"), "{}", resumed.stdout);
        assert_same_run(&resumed.json(), &full.json(), hook);
        // At another world size: a joining rank starts from the last synchronization (step 28),
        // a departed rank's progress is dropped; the run ends synchronized.
        for (nproc, said) in [
            (
                "3",
                "ranks 2..3 join between synchronizations from the parameters of the last \
                   synchronization (step 28)",
            ),
            (
                "1",
                "the progress of ranks 1..2 since the last synchronization is dropped",
            ),
        ] {
            let copy = at30.with_extension(format!("w{nproc}"));
            copy_files(&at30, &copy);
            let other = run(
                nproc,
                &["--checkpoint-dir", copy.to_str().unwrap(), "--resume"],
            );
            let _ = std::fs::remove_dir_all(&copy);
            assert!(
                other.success && other.stderr.contains(said),
                "{hook}: resumed with {nproc}:\n{}\n{}",
                other.stdout,
                other.stderr
            );
            assert!(other.summary().replicas_identical, "{hook} at {nproc}");
        }
        let _ = std::fs::remove_dir_all(&at30);
    }
}

/// Copies the files of directory `from` (not below) into `to` (created).
fn copy_files(from: &std::path::Path, to: &std::path::Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        if e.file_type().unwrap().is_file() {
            std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
        }
    }
}
