//! The launcher's entry: the set-up every job needs (orphan guard, signal handlers, descriptor
//! limit, child subreaper), then the static agent ([`crate::agent`]) or the elastic one
//! ([`crate::elastic`]). Above both, so that neither depends on the other's entry.

use crate::agent::{hostname, Housekeeping};
use crate::cli::Config;
use crate::guard::{self, Guard};
use crate::signals;

/// Run the job described by `cfg`; returns the launcher's exit status.
pub fn run(cfg: &Config) -> i32 {
    // Before anything else: the guard must not inherit the store socket or worker pipes.
    let guard = Guard::start()
        .map_err(|e| eprintln!("ddprun: warning: cannot start the orphan guard ({e}); processes started by workers may outlive a SIGKILLed launcher"))
        .ok();
    signals::install();
    // Here rather than in `main` so that programs using `ddprun::spawn` get it too: the store
    // and a pipe per worker stream need descriptors, and workers inherit the raised limit.
    ddp_comm::store::raise_fd_limit();
    // Children this process already had (a program calling `spawn`) are never swept.
    let mut keep = guard::children();
    if !guard::become_subreaper() {
        eprintln!("ddprun: warning: cannot become a child subreaper; processes that workers leave behind outside their process group may survive them");
    }
    keep.extend(guard.as_ref().map(Guard::pid));
    let house = Housekeeping { guard, keep };
    let host = hostname();
    if cfg.elastic.is_some() {
        crate::elastic::run(cfg, &host, &house)
    } else {
        crate::agent::run_static(cfg, &host, &house)
    }
}
