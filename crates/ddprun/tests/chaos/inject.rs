//! Applying a trial's fault to the running job, and finding what a trial left behind.

use super::*;
use crate::common::marked::{kill_marked, marked, Marked};

/// The environment variable marking every process of a trial (see [`common::marked`]).
pub const MARK_ENV: &str = "CHAOS_TRIAL_MARK";

/// Live training workers of the trial, by rank.
pub fn workers(mark: &str) -> Vec<Marked> {
    let mut v: Vec<Marked> = marked(MARK_ENV, mark)
        .into_iter()
        .filter(|p| p.rank.is_some() && p.argv0.ends_with("train-digits") && p.state != 'Z')
        .collect();
    v.sort_by_key(|p| p.rank);
    v
}

pub fn signal(pid: i32, sig: i32) {
    // SAFETY: plain kill(2) of a process of this trial (found by its marker, or a launcher this
    // test started).
    unsafe { libc::kill(pid, sig) };
}

/// Undoes whatever a trial may have left, also when it panics: kills its processes (stopped
/// ones too) and sets both ends of the link up again.
pub struct TrialGuard<'a> {
    pub mark: String,
    pub hosts: &'a TwoHosts,
}

impl Drop for TrialGuard<'_> {
    fn drop(&mut self) {
        kill_marked(MARK_ENV, &self.mark);
        for i in 0..2 {
            let _ = self.hosts.set_link(i, true);
        }
    }
}

/// `ddp-rs-*` shared-memory segments in `dir`.
pub fn segments(dir: &Path) -> BTreeSet<String> {
    let prefix = ddp_comm::transport::shm::NAME_PREFIX;
    std::fs::read_dir(dir)
        .map(|d| {
            d.flatten()
                .filter_map(|e| e.file_name().to_str().map(str::to_string))
                .filter(|n| n.starts_with(prefix))
                .collect()
        })
        .unwrap_or_default()
}

/// Fill the filesystem holding `path` (a file written until the disk is full).
pub fn fill(path: &Path) -> std::io::Result<u64> {
    use std::io::Write;
    let mut f = std::fs::File::create(path)?;
    let chunk = vec![0u8; 4096];
    let mut n = 0;
    loop {
        match f.write(&chunk) {
            Ok(0) => break,
            Ok(k) => n += k as u64,
            Err(e) if e.raw_os_error() == Some(libc::ENOSPC) => break,
            Err(e) => return Err(e),
        }
    }
    Ok(n)
}

/// The fault of a trial: applied at its moment, undone after its span.
pub struct Injector<'p> {
    pub plan: &'p Plan,
    pub start: Instant,
    pub at: Instant,
    pub filler: PathBuf,
    /// When it was applied (or found not applicable).
    pub injected: Option<Instant>,
    pub undo_at: Option<Instant>,
    /// What was done, for the trial's line.
    pub what: String,
    /// Launchers killed on purpose.
    pub killed: BTreeSet<usize>,
    pub stopped: Option<i32>,
}

impl<'p> Injector<'p> {
    pub fn new(plan: &'p Plan, start: Instant, at: Instant, filler: PathBuf) -> Self {
        Injector {
            plan,
            start,
            at,
            filler,
            injected: None,
            undo_at: None,
            what: "none".into(),
            killed: BTreeSet::new(),
            stopped: None,
        }
    }

    /// Apply or undo the fault when its time has come.
    pub fn step(&mut self, now: Instant, lab: &Lab, launchers: &mut [Running], mark: &str) {
        let plan = self.plan;
        if plan.kind != Kind::None && self.injected.is_none() && now >= self.at {
            self.apply(now, lab, launchers, mark);
        }
        if self.undo_at.is_some_and(|u| now >= u) {
            self.undo_at = None;
            match plan.kind {
                Kind::StopRank => {
                    // Only if it is still there (not a reused pid).
                    let pid = self.stopped.unwrap();
                    if workers(mark).iter().any(|w| w.pid == pid) {
                        signal(pid, libc::SIGCONT);
                    }
                }
                Kind::Partition => lab.hosts.set_link(plan.side, true).expect("link up"),
                Kind::FullDisk => std::fs::remove_file(&self.filler).expect("free the tmpfs"),
                _ => {}
            }
        }
    }

    pub fn apply(&mut self, now: Instant, lab: &Lab, launchers: &mut [Running], mark: &str) {
        let plan = self.plan;
        let span = Duration::from_secs_f64(plan.span);
        // A rank fault needs a live rank: wait for one up to 2 s (between rounds), else the
        // fault is not applied.
        let rank_fault = matches!(plan.kind, Kind::KillRank | Kind::StopRank);
        let ws = if rank_fault { workers(mark) } else { vec![] };
        if rank_fault && ws.is_empty() {
            if now >= self.at + Duration::from_secs(2) {
                self.what = format!("{} not applied: no live rank", plan.kind.name());
                self.injected = Some(now);
            }
            return;
        }
        let t = secs(now - self.start);
        self.what = match plan.kind {
            Kind::KillRank | Kind::StopRank => {
                let w = &ws[(plan.pick % ws.len() as u64) as usize];
                let rank = w.rank.unwrap();
                if plan.kind == Kind::KillRank {
                    signal(w.pid, libc::SIGKILL);
                    format!("kill -9 rank {rank} at {t}")
                } else {
                    signal(w.pid, libc::SIGSTOP);
                    self.stopped = Some(w.pid);
                    self.undo_at = plan.undo.then_some(now + span);
                    let then = if plan.undo {
                        "then SIGCONT"
                    } else {
                        "left stopped"
                    };
                    format!("SIGSTOP rank {rank} at {t} for {:.1}s, {then}", plan.span)
                }
            }
            Kind::KillLauncher | Kind::KillStoreHost => {
                let i = if plan.kind == Kind::KillStoreHost {
                    0
                } else {
                    1
                };
                if launchers[i].exited() {
                    format!(
                        "{} not applied: launcher {i} already exited",
                        plan.kind.name()
                    )
                } else {
                    signal(launchers[i].pid(), libc::SIGKILL);
                    self.killed.insert(i);
                    let what = if i == 0 {
                        "store host's launcher"
                    } else {
                        "launcher"
                    };
                    format!("kill -9 the {what} (host {i}) at {t}")
                }
            }
            Kind::Partition => {
                lab.hosts.set_link(plan.side, false).expect("link down");
                self.undo_at = Some(now + span);
                format!(
                    "link down (host {} end) at {t} for {:.1}s",
                    plan.side, plan.span
                )
            }
            Kind::FullDisk => {
                let n = fill(&self.filler).expect("fill the checkpoint tmpfs");
                self.undo_at = plan.undo.then_some(now + span);
                let then = if plan.undo {
                    format!("freed after {:.1}s", plan.span)
                } else {
                    "left full".into()
                };
                format!("checkpoint tmpfs filled ({n} bytes) at {t}, {then}")
            }
            Kind::None => unreachable!(),
        };
        self.injected = Some(now);
    }

    /// After the trial: a link still down goes up again.
    pub fn finish(&mut self, lab: &Lab) {
        if self.undo_at.take().is_some() && self.plan.kind == Kind::Partition {
            lab.hosts.set_link(self.plan.side, true).expect("link up");
        }
    }
}

/// What a trial left behind: processes (waited for 5 s), shared-memory segments (removed once
/// reported), a checkpoint that does not load; temporary files only as notes.
pub fn leftovers(
    lab: &Lab,
    mark: &str,
    ckpt: &Path,
    shm_before: &[BTreeSet<String>],
    problems: &mut Vec<String>,
    notes: &mut Vec<String>,
) {
    let left_deadline = Instant::now() + Duration::from_secs(5);
    let mut left = marked(MARK_ENV, mark);
    while !left.is_empty() && Instant::now() < left_deadline {
        std::thread::sleep(Duration::from_millis(50));
        left = marked(MARK_ENV, mark);
    }
    if !left.is_empty() {
        let what: Vec<String> = left
            .iter()
            .map(|p| {
                format!(
                    "pid {} {} rank {:?} state {}",
                    p.pid, p.argv0, p.rank, p.state
                )
            })
            .collect();
        problems.push(format!(
            "ORPHAN: processes of the trial left 5 s after the launchers: {}",
            what.join("; ")
        ));
    }
    kill_marked(MARK_ENV, mark);
    for (i, d) in lab.shm.iter().enumerate() {
        let leaked: Vec<String> = segments(d).difference(&shm_before[i]).cloned().collect();
        if !leaked.is_empty() {
            problems.push(format!("SHM LEAK on host {i}: {leaked:?}"));
            for n in &leaked {
                let _ = std::fs::remove_file(d.join(n));
            }
        }
    }
    let Ok(entries) = std::fs::read_dir(ckpt) else {
        return;
    };
    let names: Vec<String> = entries
        .flatten()
        .filter_map(|e| e.file_name().to_str().map(str::to_string))
        .collect();
    for n in names.iter().filter(|n| *n != "checkpoint.safetensors") {
        notes.push(format!(
            "the checkpoint directory holds a leftover file {n}"
        ));
    }
    if names.iter().any(|n| n == "checkpoint.safetensors") {
        match ddp_core::checkpoint::load(ckpt) {
            Ok(Some(c)) if c.meta.step > 0 => {}
            Ok(other) => problems.push(format!(
                "CHECKPOINT does not load as one: {:?}",
                other.map(|c| c.meta.step)
            )),
            Err(e) => problems.push(format!("CHECKPOINT does not load: {e}")),
        }
    }
}
