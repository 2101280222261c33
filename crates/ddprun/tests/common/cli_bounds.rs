//! Boundary values for every numeric flag of a binary: each run must end (bounded), never panic
//! (exit status 101, `panicked at`), never die by a signal, and name the problem when it fails.
//! Shared by the CLI tests of `ddprun`, `ddp-allreduce-check`, `ddp-bench` and `train-digits`
//! (included with `#[path]`).
#![allow(dead_code)]

use std::io::Read;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// `usize`/`u64`, `u32`, `u16` and `f64` maxima as flag values.
pub const U64_MAX: &str = "18446744073709551615";
pub const U32_MAX: &str = "4294967295";
pub const U16_MAX: &str = "65535";
pub const F64_MAX: &str = "1.7976931348623157e308";

/// 0, 1, the type's maximum, negative, empty.
pub fn boundary_values(max: &'static str) -> [&'static str; 5] {
    ["0", "1", max, "-1", ""]
}

/// One binary under test: its path, arguments that come first (a subcommand) and the quick
/// defaults for every flag (left out for the flag being tested), environment.
pub struct Binary<'a> {
    pub path: &'a str,
    pub lead: &'a [&'a str],
    pub base: &'a [(&'a str, &'a str)],
    pub trail: &'a [&'a str],
    pub env: &'a [(&'a str, String)],
    pub limit: Duration,
}

/// What one run gave.
#[derive(Debug)]
pub struct Outcome {
    pub args: Vec<String>,
    pub code: Option<i32>,
    pub stderr: String,
}

impl Binary<'_> {
    /// Run with `flag value` (and the base values of the other flags).
    pub fn run(&self, flag: &str, value: &str) -> Outcome {
        let mut args: Vec<String> = self.lead.iter().map(|s| s.to_string()).collect();
        for (f, v) in self.base.iter().filter(|(f, _)| *f != flag) {
            args.push(f.to_string());
            args.push(v.to_string());
        }
        args.push(flag.to_string());
        args.push(value.to_string());
        args.extend(self.trail.iter().map(|s| s.to_string()));
        let mut child = Command::new(self.path)
            .args(&args)
            .env_remove("RANK")
            .env_remove("WORLD_SIZE")
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {}: {e}", self.path));
        let mut err = child.stderr.take().unwrap();
        let reader = std::thread::spawn(move || {
            let mut s = String::new();
            let _ = err.read_to_string(&mut s);
            s
        });
        let deadline = Instant::now() + self.limit;
        let status = loop {
            if let Some(s) = child.try_wait().unwrap() {
                break s;
            }
            if Instant::now() >= deadline {
                // SAFETY: plain kill(2) of the process this test started (a launcher forwards it).
                unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
                let _ = child.wait();
                panic!(
                    "{} {args:?} did not finish within {:?}",
                    self.path, self.limit
                );
            }
            std::thread::sleep(Duration::from_millis(10));
        };
        Outcome {
            args,
            code: status.code(),
            stderr: reader.join().unwrap(),
        }
    }

    /// Every boundary value of every `(flag, type max)`: no panic, no signal, a clear error.
    /// Returns the outcomes for further checks.
    pub fn check_all(&self, flags: &[(&str, &'static str)]) -> Vec<Outcome> {
        let mut all = Vec::new();
        for &(flag, max) in flags {
            for value in boundary_values(max) {
                let o = self.run(flag, value);
                let who = format!("{} {:?}", self.path, o.args);
                assert_ne!(o.code, Some(101), "{who} panicked:\n{}", o.stderr);
                assert!(!o.stderr.contains("panicked at"), "{who}:\n{}", o.stderr);
                assert!(o.code.is_some(), "{who} died by a signal:\n{}", o.stderr);
                if o.code != Some(0) {
                    // Clear: says it is an error, or names the flag.
                    assert!(
                        o.stderr.to_lowercase().contains("error") || o.stderr.contains(flag),
                        "{who} failed ({:?}) without an error message:\n{}",
                        o.code,
                        o.stderr
                    );
                }
                all.push(o);
            }
        }
        all
    }
}

/// The outcome of `flag value` among `all`.
pub fn outcome<'a>(all: &'a [Outcome], flag: &str, value: &str) -> &'a Outcome {
    all.iter()
        .find(|o| o.args.windows(2).any(|w| w[0] == flag && w[1] == value))
        .unwrap_or_else(|| panic!("no run with {flag} {value}"))
}
