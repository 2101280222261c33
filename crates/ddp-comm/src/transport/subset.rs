//! [`Subset`]: some ranks of a transport seen as a group of their own, renumbered `0..k` in the
//! order given, so that any algorithm runs unchanged among them (the hierarchical all-reduce
//! runs ring / recursive doubling among the hosts' leaders over the group's TCP mesh this way).
//!
//! ```text
//!  parent ranks   0   1   2   3   4          ranks = [0, 2, 4]
//!  subset ranks   0       1       2          send to subset 2 = send to parent 4
//! ```
//!
//! Messages travel on the parent's connections, tagged with the parent's current fingerprint;
//! errors name parent ranks. Aborting the subset aborts the parent.

use super::{Fingerprint, RecvFrom, SendTo, Transport};
use crate::{Error, Result};
use std::time::Instant;

/// The ranks `ranks` of `parent` (which must include the parent's own rank).
pub struct Subset<'a> {
    parent: &'a mut dyn Transport,
    ranks: &'a [usize],
    rank: usize,
}

impl<'a> Subset<'a> {
    /// The view of `ranks` (parent numbering, distinct); `None` if this rank is not among them.
    pub fn new(parent: &'a mut dyn Transport, ranks: &'a [usize]) -> Option<Subset<'a>> {
        let rank = ranks.iter().position(|&r| r == parent.rank())?;
        Some(Subset {
            parent,
            ranks,
            rank,
        })
    }

    fn parent_rank(&self, r: usize, what: &str) -> Result<usize> {
        self.ranks.get(r).copied().ok_or_else(|| {
            Error::InvalidArgument(format!(
                "{what} rank {r}: not in this subset of {} ranks",
                self.ranks.len()
            ))
        })
    }
}

impl Transport for Subset<'_> {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.ranks.len()
    }

    fn begin(&mut self, fp: Fingerprint, deadline: Instant) {
        self.parent.begin(fp, deadline);
    }

    fn exchange(&mut self, sends: &mut [SendTo<'_>], recvs: &mut [RecvFrom<'_>]) -> Result<()> {
        let mut s = Vec::with_capacity(sends.len());
        for x in sends.iter() {
            s.push(SendTo {
                to: self.parent_rank(x.to, "send to")?,
                data: x.data,
            });
        }
        let mut r = Vec::with_capacity(recvs.len());
        for x in recvs.iter_mut() {
            r.push(RecvFrom {
                from: self.parent_rank(x.from, "receive from")?,
                buf: &mut *x.buf,
            });
        }
        self.parent.exchange(&mut s, &mut r)
    }

    fn abort(&mut self, cause: &Error) {
        self.parent.abort(cause);
    }
}
