//! Where the ranks of a group run: this process's host identity ([`host_id`]) and the layout
//! of the group over hosts ([`host_layout`], agreed through the store). Backend selection
//! ([`crate::backend::select`]) decides from the layout between TCP, shared memory and
//! hierarchical; the hierarchical transport uses it to find each host's ranks and leader.

use crate::store::Store;
use crate::{Error, Result};
use std::time::Duration;

/// Directory of POSIX shared memory: part of this host's identity ([`host_id`]), and where the
/// shared-memory transport keeps its segments (plain files there).
pub(crate) const SHM_DIR: &str = "/dev/shm";

/// This host's identity for backend selection: hostname, boot id, and the device and inode of
/// `/dev/shm` (containers on one machine with separate `/dev/shm` mounts differ).
pub fn host_id() -> String {
    use std::os::unix::fs::MetadataExt;
    let host = hostname();
    let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .map(|s| s.trim().to_string())
        .unwrap_or_default();
    match std::fs::metadata(SHM_DIR) {
        Ok(m) => format!("{host}/{boot}/{}:{}", m.dev(), m.ino()),
        // No shared memory here: an id no other process shares, so `auto` picks TCP.
        Err(_) => format!("{host}/{boot}/no-shm/{}", std::process::id()),
    }
}

/// This host's name (empty if unknown).
pub fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_string())
        .unwrap_or_default()
}

/// Which host every rank of a group runs on, decided once by rank 0 from the host ids every
/// rank publishes ([`host_layout`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostLayout {
    /// Host index of every rank. Hosts are numbered in the order of their lowest rank, so host
    /// 0 holds rank 0 and the hosts' lowest ranks (their leaders) ascend with the index.
    pub host_of: Vec<usize>,
    /// When the ranks are not all on one host: a rank on another host than rank 0's, as
    /// `rank 2 runs on host "b/..." and rank 0 on "a/..."`.
    pub mismatch: Option<String>,
}

impl HostLayout {
    /// Number of hosts.
    pub fn hosts(&self) -> usize {
        self.host_of.iter().max().map_or(0, |&h| h + 1)
    }

    /// The ranks on host `h`, ascending.
    pub fn ranks_on(&self, h: usize) -> Vec<usize> {
        (0..self.host_of.len())
            .filter(|&r| self.host_of[r] == h)
            .collect()
    }
}

/// Where the ranks of the group run: every rank publishes `id` (usually [`host_id`]), rank 0
/// numbers the distinct ids and publishes the layout, the others read it.
pub fn host_layout(
    store: &dyn Store,
    rank: usize,
    size: usize,
    id: &str,
    timeout: Duration,
) -> Result<HostLayout> {
    if size == 1 {
        return Ok(HostLayout {
            host_of: vec![0],
            mismatch: None,
        });
    }
    store.set(&format!("host/{rank}"), id.as_bytes())?;
    // Published as "h0,h1,...\n<mismatch or empty>".
    let verdict = if rank == 0 {
        let mut ids = vec![id.as_bytes().to_vec()];
        let mut mismatch = String::new();
        for r in 1..size {
            let other = store
                .get_timeout(&format!("host/{r}"), timeout)
                .map_err(|e| {
                    e.waiting_for(|| format!("rank {r} to join the rendezvous (world size {size})"))
                })?;
            if other != id.as_bytes() && mismatch.is_empty() {
                mismatch = format!(
                    "rank {r} runs on host {:?} and rank 0 on {id:?}",
                    String::from_utf8_lossy(&other)
                );
            }
            ids.push(other);
        }
        let mut distinct: Vec<&[u8]> = Vec::new();
        let host_of: Vec<String> = ids
            .iter()
            .map(|i| {
                let h = distinct.iter().position(|d| *d == i.as_slice());
                h.unwrap_or_else(|| {
                    distinct.push(i);
                    distinct.len() - 1
                })
                .to_string()
            })
            .collect();
        let host_of = host_of.join(",");
        let v = format!("{host_of}\n{mismatch}");
        store.set("host/verdict", v.as_bytes())?;
        v
    } else {
        let v = store.get_timeout("host/verdict", timeout).map_err(|e| {
            e.waiting_for(|| {
                format!("rank 0 to compare the hosts of the group (world size {size})")
            })
        })?;
        String::from_utf8_lossy(&v).into_owned()
    };
    let malformed = || Error::Io {
        context: "host layout".into(),
        message: format!("rank 0 published a malformed layout {verdict:?}"),
    };
    let (hosts, mismatch) = verdict.split_once('\n').ok_or_else(malformed)?;
    let host_of = hosts
        .split(',')
        .map(|h| h.parse::<usize>().map_err(|_| malformed()))
        .collect::<Result<Vec<_>>>()?;
    if host_of.len() != size {
        return Err(malformed());
    }
    Ok(HostLayout {
        host_of,
        mismatch: (!mismatch.is_empty()).then(|| mismatch.to_string()),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::run_with_store;

    #[test]
    fn host_layout_numbers_hosts_by_lowest_rank_and_names_a_remote_rank() {
        let ids = ["a/boot", "b/boot", "a/boot", "c/boot", "b/boot"];
        let t = Duration::from_secs(10);
        let out = run_with_store(5, t, |r, st| host_layout(&*st, r, 5, ids[r], t).unwrap());
        for l in &out {
            assert_eq!(l, &out[0]);
            assert_eq!(l.host_of, [0, 1, 0, 2, 1]);
            assert_eq!((l.hosts(), l.ranks_on(1)), (3, vec![1, 4]));
            let v = l.mismatch.as_deref().expect("mismatch detected");
            assert!(v.contains("rank 1") && v.contains("b/boot"), "{v}");
        }
        let one = run_with_store(1, t, |r, st| host_layout(&*st, r, 1, "x", t).unwrap());
        assert_eq!((&one[0].host_of, &one[0].mismatch), (&vec![0], &None));
    }
}
