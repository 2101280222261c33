//! Process resource limits the launcher adjusts at start.

/// Raise the soft limit on open files (`RLIMIT_NOFILE`) to the hard limit, as Python's
/// torchrun effectively gets from most distributions: the launcher holds two pipes per worker and
/// a store connection per worker and node, and workers inherit the raised limit (a TCP mesh
/// needs a socket per peer). Returns the new soft limit, or `None` when it could not be read or
/// raised (the old limit then stays; nothing else changes).
pub fn raise_nofile_limit() -> Option<u64> {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes into the valid, properly typed struct we pass.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } != 0 {
        return None;
    }
    if lim.rlim_cur < lim.rlim_max {
        let raised = libc::rlimit {
            rlim_cur: lim.rlim_max,
            rlim_max: lim.rlim_max,
        };
        // SAFETY: setrlimit only reads the struct we pass.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) } != 0 {
            return None;
        }
        lim = raised;
    }
    Some(lim.rlim_cur)
}

#[cfg(test)]
mod tests {
    #[test]
    fn soft_limit_reaches_the_hard_limit() {
        let soft = super::raise_nofile_limit().expect("getrlimit works");
        let mut lim = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        // SAFETY: as above.
        assert_eq!(unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) }, 0);
        assert_eq!(lim.rlim_cur, lim.rlim_max);
        assert_eq!(soft, lim.rlim_cur);
    }
}
