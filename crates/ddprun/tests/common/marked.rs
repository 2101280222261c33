//! Processes found by an environment marker: a test sets `NAME=VALUE` on the processes it
//! starts, everything they start inherits it, and `/proc/PID/environ` tells them apart from
//! every other process on the machine, however they were reparented (an orphan check).

/// A process carrying the marker.
#[derive(Debug)]
pub struct Marked {
    pub pid: i32,
    /// Its `RANK` variable, if any (a worker).
    pub rank: Option<usize>,
    /// `argv[0]`.
    pub argv0: String,
    /// The state letter of `/proc/PID/stat` (`T` stopped, `Z` zombie).
    pub state: char,
}

/// Every process whose environment holds `name=value`.
pub fn marked(name: &str, value: &str) -> Vec<Marked> {
    let want = format!("{name}={value}");
    let mut v = Vec::new();
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return v;
    };
    for e in dir.flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else {
            continue;
        };
        let Ok(env) = std::fs::read(format!("/proc/{pid}/environ")) else {
            continue;
        };
        let vars: Vec<&[u8]> = env.split(|&b| b == 0).collect();
        if !vars.contains(&want.as_bytes()) {
            continue;
        }
        let rank = vars
            .iter()
            .find_map(|v| v.strip_prefix(b"RANK="))
            .and_then(|r| std::str::from_utf8(r).ok()?.parse().ok());
        let argv0 = std::fs::read(format!("/proc/{pid}/cmdline"))
            .ok()
            .and_then(|c| c.split(|&b| b == 0).next().map(|a| a.to_vec()))
            .map(|a| String::from_utf8_lossy(&a).into_owned())
            .unwrap_or_default();
        let Some(state) = super::proc_state(pid) else {
            continue;
        };
        v.push(Marked {
            pid,
            rank,
            argv0,
            state,
        });
    }
    v
}

/// SIGKILL every process carrying the marker (cleanup, stopped processes included).
pub fn kill_marked(name: &str, value: &str) {
    for p in marked(name, value) {
        // SAFETY: plain kill(2) of a process that carries this test's marker.
        unsafe { libc::kill(p.pid, libc::SIGKILL) };
    }
}
