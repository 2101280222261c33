//! What the tests of both programs share: running a program to completion with a deadline, and
//! reading and comparing its final `--json` line ([`RunSummary`]).

use crate::summary::RunSummary;

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
