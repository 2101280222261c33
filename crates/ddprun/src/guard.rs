//! Keeping what the workers start from outliving the launcher.
//!
//! Each worker leads its own process group and gets SIGKILL from the kernel when the launcher
//! dies (parent-death signal, [`crate::process`]). A worker's own children get no such signal, so
//! two more layers cover them:
//!
//! - **The guard** ([`Guard`]): a small process forked when the launcher starts (before any
//!   worker, thread of ours or store socket exists) that holds one end of a socket pair. The
//!   launcher sends it each worker's process group id. However the launcher dies, SIGKILL
//!   included, the kernel closes the launcher's end; the guard reads end of file and SIGKILLs
//!   every group it was told about. A clean launcher tells it to exit without killing.
//! - **Child subreaper** ([`become_subreaper`], [`reap_adopted`]): processes orphaned by a
//!   worker, including ones that left its process group (`setsid`, daemons), are reparented to the
//!   launcher instead of init; at the end of every attempt the launcher kills and reaps them.
//!
//! Not guaranteed after a SIGKILL of the launcher: a process that left its worker's process group
//! (the guard only knows the groups) is reparented to the next subreaper or init and keeps
//! running; so is everything when the guard itself is killed too (e.g. `kill -9` of every
//! process of the user, or of the guard's own group). Only a cgroup or PID namespace (a
//! container, `systemd-run --scope`, Slurm's cgroup plugin) can contain those.

use std::time::{Duration, Instant};

/// Most process groups the guard tracks at once (the most local workers `ddprun` accepts).
const MAX_GROUPS: usize = crate::cli::MAX_LOCAL_WORKERS;

/// The launcher's handle on the guard process; dropping it lets the guard exit without killing.
pub struct Guard {
    fd: i32,
    pid: i32,
}

fn errno() -> i32 {
    std::io::Error::last_os_error().raw_os_error().unwrap_or(0)
}

impl Guard {
    /// Fork the guard. Call it before threads that matter exist and before opening descriptors
    /// the guard should not hold (it closes every inherited descriptor anyway).
    pub fn start() -> Result<Guard, String> {
        let mut fds = [0i32; 2];
        // SAFETY: socketpair writes two descriptors into the array we pass.
        let rc = unsafe {
            libc::socketpair(
                libc::AF_UNIX,
                libc::SOCK_STREAM | libc::SOCK_CLOEXEC,
                0,
                fds.as_mut_ptr(),
            )
        };
        if rc != 0 {
            return Err(format!("socketpair: {}", std::io::Error::last_os_error()));
        }
        let (ours, theirs) = (fds[0], fds[1]);
        // SAFETY: the child runs only async-signal-safe code (`guard_main`: close, setpgid,
        // signal, read, kill, _exit, no allocation), as required after fork in a process that
        // may have other threads.
        let pid = unsafe { libc::fork() };
        if pid == 0 {
            // SAFETY: in the freshly forked child; see guard_main.
            unsafe { guard_main(theirs) }
        }
        // SAFETY: closing the child's end, which this process no longer needs.
        unsafe { libc::close(theirs) };
        if pid < 0 {
            let e = std::io::Error::last_os_error();
            // SAFETY: closing our own descriptor.
            unsafe { libc::close(ours) };
            return Err(format!("fork: {e}"));
        }
        Ok(Guard { fd: ours, pid })
    }

    /// The guard's pid.
    pub fn pid(&self) -> i32 {
        self.pid
    }

    fn send(&self, v: i32) {
        let b = v.to_ne_bytes();
        loop {
            // SAFETY: writing 4 bytes from a live buffer to our socket; MSG_NOSIGNAL: a dead
            // guard gives EPIPE instead of killing the launcher with SIGPIPE.
            let n = unsafe { libc::send(self.fd, b.as_ptr().cast(), b.len(), libc::MSG_NOSIGNAL) };
            if n >= 0 || errno() != libc::EINTR {
                // 4 bytes on a stream socket with buffer room are written whole; a guard that
                // is gone cannot be helped.
                return;
            }
        }
    }

    /// Kill process group `pgid` if the launcher dies.
    pub fn watch(&self, pgid: i32) {
        if pgid > 0 {
            self.send(pgid);
        }
    }

    /// Stop tracking `pgid` (its processes are gone; the id may be reused).
    pub fn forget(&self, pgid: i32) {
        if pgid > 0 {
            self.send(-pgid);
        }
    }
}

impl Drop for Guard {
    fn drop(&mut self) {
        self.send(0);
        // SAFETY: closing our own descriptor once.
        unsafe { libc::close(self.fd) };
        // The guard exits at once on 0 or end of file; bounded anyway.
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            // SAFETY: reaping our own child; WNOHANG never blocks.
            let r = unsafe { libc::waitpid(self.pid, std::ptr::null_mut(), libc::WNOHANG) };
            if r != 0 || Instant::now() >= deadline {
                return;
            }
            std::thread::sleep(Duration::from_millis(2));
        }
    }
}

/// The guard process: record process groups (`+pgid` watch, `-pgid` forget, `0` exit quietly),
/// and SIGKILL the recorded ones at end of file (the launcher died).
///
/// # Safety
/// Only in the child right after `fork`: uses async-signal-safe calls only and never returns.
unsafe fn guard_main(fd: i32) -> ! {
    // SAFETY: the caller guarantees we are the forked child; everything below is an
    // async-signal-safe libc call (close_range/close, setpgid, signal, read, kill, _exit) or
    // plain arithmetic on stack arrays, with pointers into live stack buffers.
    unsafe {
        // Hold nothing of the launcher's: its stdout/stderr pipes, sockets, files.
        let fd_u = fd as libc::c_uint;
        let below = fd == 0 || libc::syscall(libc::SYS_close_range, 0, fd_u - 1, 0) == 0;
        let above = libc::syscall(libc::SYS_close_range, fd_u + 1, libc::c_uint::MAX, 0) == 0;
        if !(below && above) {
            for other in 0..4096 {
                if other != fd {
                    libc::close(other);
                }
            }
        }
        // Out of the launcher's process group: a Ctrl-C or a group signal meant for the launcher
        // must not remove the guard before the launcher has cleaned up.
        libc::setpgid(0, 0);
        for sig in [libc::SIGINT, libc::SIGQUIT, libc::SIGHUP, libc::SIGPIPE] {
            libc::signal(sig, libc::SIG_IGN);
        }
        libc::signal(libc::SIGTERM, libc::SIG_DFL);
        let mut groups = [0i32; MAX_GROUPS];
        let mut buf = [0u8; 4];
        let mut have = 0usize;
        loop {
            let n = libc::read(fd, buf.as_mut_ptr().add(have).cast(), 4 - have);
            if n < 0 && *libc::__errno_location() == libc::EINTR {
                continue;
            }
            if n <= 0 {
                break;
            }
            have += n as usize;
            if have < 4 {
                continue;
            }
            have = 0;
            match i32::from_ne_bytes(buf) {
                0 => libc::_exit(0),
                v if v > 0 => {
                    if let Some(slot) = groups.iter_mut().find(|g| **g == 0) {
                        *slot = v;
                    }
                }
                v => {
                    for g in groups.iter_mut().filter(|g| **g == -v) {
                        *g = 0;
                    }
                }
            }
        }
        for &g in groups.iter().filter(|&&g| g > 0) {
            libc::kill(-g, libc::SIGKILL);
        }
        libc::_exit(0)
    }
}

/// Make this process the child subreaper of its descendants (Linux 3.4+): orphans of workers are
/// reparented here, not to init. Returns whether it worked.
pub fn become_subreaper() -> bool {
    // SAFETY: plain prctl on this process.
    unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0 }
}

/// Pids of this process's children (any state), from `/proc`.
pub fn children() -> Vec<i32> {
    let me = std::process::id() as i32;
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    dir.filter_map(|e| e.ok()?.file_name().to_str()?.parse::<i32>().ok())
        .filter(|&pid| parent_of(pid) == Some(me))
        .collect()
}

/// Parent pid from `/proc/PID/stat` (`None` when the process is gone).
fn parent_of(pid: i32) -> Option<i32> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // After the command name (in parentheses, may contain spaces): state, then ppid.
    s.rsplit_once(')')?
        .1
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()
}

/// SIGKILL and reap every child of this process not in `keep` (processes adopted as subreaper,
/// workers' leftovers); waits at most about a second for them. Returns how many were killed.
pub fn reap_adopted(keep: &[i32]) -> usize {
    let adopted: Vec<i32> = children()
        .into_iter()
        .filter(|p| !keep.contains(p))
        .collect();
    for &pid in &adopted {
        // SAFETY: signalling a child of ours.
        unsafe { libc::kill(pid, libc::SIGKILL) };
    }
    let deadline = Instant::now() + Duration::from_secs(1);
    let mut left = adopted.clone();
    while !left.is_empty() && Instant::now() < deadline {
        // SAFETY: reaping children of ours; WNOHANG never blocks.
        left.retain(|&pid| unsafe { libc::waitpid(pid, std::ptr::null_mut(), libc::WNOHANG) } == 0);
        if !left.is_empty() {
            std::thread::sleep(Duration::from_millis(5));
        }
    }
    adopted.len()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parent_of_a_child_is_us() {
        let mut c = std::process::Command::new("sleep")
            .arg("5")
            .spawn()
            .unwrap();
        let pid = c.id() as i32;
        assert_eq!(parent_of(pid), Some(std::process::id() as i32));
        assert!(children().contains(&pid));
        c.kill().unwrap();
        c.wait().unwrap();
        assert!(!children().contains(&pid));
    }
}
