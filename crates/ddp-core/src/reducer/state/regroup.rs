//! Moving a reducer to the group a job regrouped into (in-place recovery, see
//! `ddp_comm::process_group::regroup`): the step that failed is dropped, the buckets start over
//! on the new group.

use super::{BucketState, Reducer};
use crate::error::{Error, Result};
use crate::reducer::buffer::{BucketBuffer, HostBuffer};
use crate::reducer::spec::verify_param_specs;
use ddp_comm::ProcessGroup;
use std::time::Duration;

impl Reducer {
    /// Continue on `pg` (the group a regrouping formed): whatever the current step had reduced
    /// or accumulated is dropped (a failed collective left its buckets' buffers lost, and no
    /// optimizer step may be taken on a partial sum), every bucket gets a fresh zeroed host
    /// buffer sized for the new world, the divisor becomes the new world size, and the next
    /// backward starts a new step. The step counter, statistics, bucket assignment and the
    /// comm hook stay (a hook keeping per-rank state must be told of the new group by its
    /// owner). Device buckets cannot be rebuilt here (an error).
    ///
    /// A collective on `pg`, the same one [`Reducer::new`] runs (the parameter specs checked
    /// across ranks), so that a newcomer building its reducer on `pg` meets the survivors
    /// calling this.
    pub fn regroup(&mut self, pg: &ProcessGroup) -> Result<()> {
        if self
            .buckets
            .iter()
            .any(|b| matches!(b.state, BucketState::Idle(BucketBuffer::Device(_))))
        {
            return Err(Error::InvalidArgument(
                "regroup: device bucket buffers cannot be rebuilt in place; rebuild the DDP \
                 wrapper on the new group"
                    .into(),
            ));
        }
        verify_param_specs(pg, &self.specs)?;
        let world = pg.size();
        for b in &mut self.buckets {
            // An in-flight work on the old group finishes (failed or not) when dropped here.
            b.state = BucketState::Idle(BucketBuffer::Host(HostBuffer::zeros_padded(
                b.dtype, b.numel, world,
            )));
            b.pending = b.params.len();
            b.launched = None;
        }
        for s in &mut self.slots {
            s.marked = false;
            s.accumulated = false;
        }
        self.pg = pg.clone();
        self.next_launch = 0;
        self.current = None;
        self.backward_start = None;
        self.results_valid = false;
        self.failed = None;
        self.divisor = world;
        self.local_nonfinite = None;
        self.waited_upto = 0;
        self.early_wait = Duration::ZERO;
        Ok(())
    }
}
