//! Post-local SGD (Lin et al., 2018): PyTorch's `post_localSGD_hook` with
//! `PostLocalSGDState` ([`PostLocalSgdHook`]) and `PeriodicModelAverager`
//! ([`PeriodicModelAverager`]).
//!
//! For the first `start_local_sgd_iter` steps gradients are averaged as usual; afterwards each
//! rank steps on its own gradients (or on their average over a subgroup, e.g. the ranks of one
//! host) and the averager averages the *parameters* every `period` steps after its `warmup_steps`:
//!
//! ```text
//!  step:      0 … warmup-1 │ warmup  warmup+1 … warmup+period  …
//!  gradients: all-reduced  │ local   local      local
//!  params:    (identical)  │ avg     –          avg           (averager.average_parameters)
//! ```
//!
//! Between averagings the replicas differ, so a replica check is meaningful right after an
//! averaging step only ([`PeriodicModelAverager::average_now`] averages at the end of a run).

use crate::adapter::ParamAccess;
use crate::error::{Error, Result};
use crate::reducer::{
    AllReduceHook, BucketWork, CommHook, GradBucket, HookState, HostBuffer, ParamSpec,
};
use ddp_comm::{DType, ProcessGroup, ReduceOp};

/// PyTorch's `post_localSGD_hook` with its `PostLocalSGDState(process_group, subgroup,
/// start_localSGD_iter)`.
pub struct PostLocalSgdHook {
    subgroup: Option<ProcessGroup>,
    start_local_sgd_iter: u64,
    iter: u64,
    sent: u64,
}

impl PostLocalSgdHook {
    /// Global averaging for `start_local_sgd_iter` steps, then none (each rank keeps its own
    /// gradients).
    pub fn new(start_local_sgd_iter: u64) -> PostLocalSgdHook {
        PostLocalSgdHook {
            subgroup: None,
            start_local_sgd_iter,
            iter: 0,
            sent: 0,
        }
    }

    /// After the warm-up, average gradients over `subgroup` (e.g. the ranks of this host)
    /// instead of not at all (PyTorch's `post_local_gradient_allreduce`).
    pub fn with_subgroup(mut self, subgroup: ProcessGroup) -> PostLocalSgdHook {
        self.subgroup = Some(subgroup);
        self
    }

    /// Steps counted so far (until local SGD starts, as PyTorch's `iter`).
    pub fn iter(&self) -> u64 {
        self.iter
    }
}

impl CommHook for PostLocalSgdHook {
    fn run(&mut self, pg: &ProcessGroup, bucket: GradBucket) -> BucketWork {
        let bytes = (bucket.buffer().len() * bucket.buffer().dtype().size()) as u64;
        if self.iter < self.start_local_sgd_iter {
            if bucket.is_last() {
                self.iter += 1;
            }
            self.sent += bytes;
            return AllReduceHook.run(pg, bucket);
        }
        match &self.subgroup {
            Some(sub) => {
                self.sent += bytes;
                bucket.into_buffer().all_reduce(sub, ReduceOp::Avg)
            }
            None => BucketWork::ready(Ok(bucket.into_buffer())),
        }
    }

    fn take_sent_bytes(&mut self) -> Option<u64> {
        Some(std::mem::take(&mut self.sent))
    }

    fn state_dict(&self) -> HookState {
        let mut s = HookState::new("post_local_sgd");
        s.counters.insert("iter".into(), self.iter);
        s
    }

    fn load_state_dict(&mut self, state: &HookState) -> Result<()> {
        state.expect_kind("post_local_sgd")?;
        self.iter = state.counter("iter")?;
        Ok(())
    }
}

/// PyTorch's `PeriodicModelAverager(period, warmup_steps)`: call
/// [`average_parameters`](Self::average_parameters) after every optimizer step; from step
/// `warmup_steps` on, every `period`-th call averages the parameters over the group.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeriodicModelAverager {
    period: u64,
    warmup_steps: u64,
    step: u64,
    sent: u64,
}

impl PeriodicModelAverager {
    /// An averager; `period` must be at least 1 (1 averages after every step).
    pub fn new(period: u64, warmup_steps: u64) -> Result<PeriodicModelAverager> {
        if period == 0 {
            return Err(Error::InvalidArgument(
                "PeriodicModelAverager: period must be at least 1".into(),
            ));
        }
        Ok(PeriodicModelAverager {
            period,
            warmup_steps,
            step: 0,
            sent: 0,
        })
    }

    /// Calls made so far (PyTorch's `step`).
    pub fn step(&self) -> u64 {
        self.step
    }

    /// Payload bytes of parameter averaging so far (per rank).
    pub fn bytes_sent(&self) -> u64 {
        self.sent
    }

    /// Whether the next [`average_parameters`](Self::average_parameters) call averages (a
    /// framework whose parameters must be copied out first copies them only then).
    pub fn is_due(&self) -> bool {
        self.step >= self.warmup_steps
            && (self.step - self.warmup_steps).is_multiple_of(self.period)
    }

    /// Averages the parameters if this step is an averaging step; returns whether it did. A
    /// collective on averaging steps: every rank must call it after every optimizer step.
    pub fn average_parameters<P: ParamAccess + ?Sized>(
        &mut self,
        pg: &ProcessGroup,
        params: &P,
    ) -> std::result::Result<bool, P::Error> {
        let due = self.is_due();
        self.step += 1;
        if due {
            self.average_now(pg, params)?;
        }
        Ok(due)
    }

    /// Averages the parameters now (e.g. at the end of training, so that every replica holds the
    /// same model). A collective.
    pub fn average_now<P: ParamAccess + ?Sized>(
        &mut self,
        pg: &ProcessGroup,
        params: &P,
    ) -> std::result::Result<(), P::Error> {
        let specs: Vec<ParamSpec> = crate::adapter::param_specs(params)?;
        for dtype in [DType::F32, DType::F64, DType::F16, DType::BF16] {
            let idx: Vec<usize> = (0..specs.len())
                .filter(|&i| specs[i].dtype == dtype)
                .collect();
            let total: usize = idx.iter().map(|&i| specs[i].numel()).sum();
            if total == 0 {
                continue;
            }
            let mut flat = HostBuffer::zeros(dtype, total);
            let mut off = 0;
            for &i in &idx {
                let v = params.read_param(i)?;
                flat.write(off, v.as_host_slice(), false)
                    .map_err(|e| Error::InvalidArgument(format!("{}: {e}", specs[i])))?;
                off += specs[i].numel();
            }
            self.sent += (total * dtype.size()) as u64;
            let avg = flat
                .all_reduce(pg, ReduceOp::Avg)
                .wait()
                .map_err(Error::Comm)?;
            let avg = avg.as_host().expect("a host buffer stays on the host");
            let mut off = 0;
            for &i in &idx {
                let n = specs[i].numel();
                params.write_param(i, avg.range(off, n))?;
                off += n;
            }
        }
        Ok(())
    }

    /// The averager's state for a checkpoint.
    pub fn state_dict(&self) -> HookState {
        let mut s = HookState::new("periodic_model_averager");
        s.counters.insert("step".into(), self.step);
        s
    }

    /// Restores [`state_dict`](Self::state_dict).
    pub fn load_state_dict(&mut self, state: &HookState) -> Result<()> {
        state.expect_kind("periodic_model_averager")?;
        self.step = state.counter("step")?;
        Ok(())
    }
}
