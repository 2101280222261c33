//! Signals: catching SIGINT/SIGTERM/SIGHUP/SIGQUIT sent to the launcher (so they can be forwarded
//! to every worker instead of orphaning them), sending signals to worker process groups, and
//! naming signals for humans.

use std::sync::atomic::{AtomicI32, Ordering};

/// The last caught signal not yet taken by [`take_pending`] (0 = none).
static PENDING: AtomicI32 = AtomicI32::new(0);

/// Signals the launcher catches and forwards to its workers.
pub const FORWARDED: [i32; 4] = [libc::SIGINT, libc::SIGTERM, libc::SIGHUP, libc::SIGQUIT];

extern "C" fn on_signal(sig: libc::c_int) {
    // Only an atomic store: async-signal-safe.
    PENDING.store(sig, Ordering::SeqCst);
}

/// Install the catching handlers for [`FORWARDED`] signals. Workers get default dispositions
/// back at `exec`.
pub fn install() {
    for sig in FORWARDED {
        // SAFETY: a zeroed sigaction with a plain handler and an empty mask is valid; the handler
        // only performs an atomic store.
        unsafe {
            let mut sa: libc::sigaction = std::mem::zeroed();
            sa.sa_sigaction = on_signal as *const () as libc::sighandler_t;
            sa.sa_flags = libc::SA_RESTART;
            libc::sigemptyset(&mut sa.sa_mask);
            libc::sigaction(sig, &sa, std::ptr::null_mut());
        }
    }
}

/// The signal caught since the last call, if any.
pub fn take_pending() -> Option<i32> {
    match PENDING.swap(0, Ordering::SeqCst) {
        0 => None,
        s => Some(s),
    }
}

/// Send `sig` to the process group led by `pgid` (each worker leads its own group, so this
/// reaches the processes it started too). Errors (group already gone) are ignored.
pub fn signal_group(pgid: i32, sig: i32) {
    if pgid > 0 {
        // SAFETY: plain syscall; a negative pid addresses a process group.
        unsafe {
            libc::kill(-pgid, sig);
        }
    }
}

/// `SIGSEGV`-style name of a signal number (or `signal N` when unknown).
pub fn signal_name(sig: i32) -> String {
    let name = match sig {
        libc::SIGHUP => "SIGHUP",
        libc::SIGINT => "SIGINT",
        libc::SIGQUIT => "SIGQUIT",
        libc::SIGILL => "SIGILL",
        libc::SIGTRAP => "SIGTRAP",
        libc::SIGABRT => "SIGABRT",
        libc::SIGBUS => "SIGBUS",
        libc::SIGFPE => "SIGFPE",
        libc::SIGKILL => "SIGKILL",
        libc::SIGUSR1 => "SIGUSR1",
        libc::SIGSEGV => "SIGSEGV",
        libc::SIGUSR2 => "SIGUSR2",
        libc::SIGPIPE => "SIGPIPE",
        libc::SIGALRM => "SIGALRM",
        libc::SIGTERM => "SIGTERM",
        libc::SIGCHLD => "SIGCHLD",
        libc::SIGCONT => "SIGCONT",
        libc::SIGSTOP => "SIGSTOP",
        libc::SIGTSTP => "SIGTSTP",
        libc::SIGTTIN => "SIGTTIN",
        libc::SIGTTOU => "SIGTTOU",
        libc::SIGURG => "SIGURG",
        libc::SIGXCPU => "SIGXCPU",
        libc::SIGXFSZ => "SIGXFSZ",
        libc::SIGVTALRM => "SIGVTALRM",
        libc::SIGPROF => "SIGPROF",
        libc::SIGWINCH => "SIGWINCH",
        libc::SIGIO => "SIGIO",
        libc::SIGSYS => "SIGSYS",
        _ => return format!("signal {sig}"),
    };
    name.to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names() {
        assert_eq!(signal_name(libc::SIGSEGV), "SIGSEGV");
        assert_eq!(signal_name(9), "SIGKILL");
        assert_eq!(signal_name(200), "signal 200");
    }
}
