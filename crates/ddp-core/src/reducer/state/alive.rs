//! A bound on the gradient buckets alive during a synchronized backward
//! ([`Reducer::set_max_bucket_bytes_alive`]): ZeRO stage 2 fills a bucket only once the one
//! before it is reduced and cut to its shard.
//!
//! ```text
//!  no limit (PyTorch's DDP)      bucket k filling │ k-1, k-2 ... in flight, all full-size
//!  limit = one bucket            bucket k filling │ k-1 waited for at k's first gradient
//!                                                 │ (its result: the shard, kept for finish)
//! ```

use super::{Bucket, BucketState, Reducer};
use crate::reducer::buffer::BucketWork;
use std::time::Instant;

impl Reducer {
    /// Bounds the gradient buckets alive in a synchronized backward: when the backward starts
    /// filling a bucket, the oldest buckets in flight are waited for (their hooks' results kept
    /// for `finish`) until those still in flight and this one together hold at most `bytes`
    /// (one bucket alone always proceeds). `None` (the default, as PyTorch's DDP) waits for
    /// nothing before `finish`. For hooks whose result is smaller than the bucket (ZeRO stage
    /// 2's reduce-scatter keeps this rank's shard): with buckets of `bucket_cap_mb` and this
    /// limit at the cap, a bucket is filled only once the one before it is reduced and cut to
    /// its shard, so a backward holds one bucket of gradients beyond its shards rather than
    /// two (the reduction still overlaps the computation of the next gradients, not their copy
    /// into the bucket).
    pub fn set_max_bucket_bytes_alive(&mut self, bytes: Option<usize>) {
        self.alive_limit = bytes;
    }

    /// The bucket cap this reducer was built with (`ReducerOptions::bucket_cap_mb`), in bytes.
    pub fn bucket_cap_bytes(&self) -> usize {
        self.bucket_cap
    }

    /// The limit set by [`set_max_bucket_bytes_alive`](Self::set_max_bucket_bytes_alive).
    pub fn max_bucket_bytes_alive(&self) -> Option<usize> {
        self.alive_limit
    }

    /// Before bucket `bi` is first written in this backward: waits for the oldest buckets in
    /// flight while they and `bi` exceed the limit (see `set_max_bucket_bytes_alive`).
    pub(super) fn limit_alive(&mut self, bi: usize) {
        let Some(limit) = self.alive_limit else {
            return;
        };
        let bytes = |b: &Bucket| b.numel * b.dtype.size();
        self.waited_upto = self.waited_upto.min(self.next_launch);
        let mut alive: usize = self.buckets[self.waited_upto..self.next_launch]
            .iter()
            .map(bytes)
            .sum();
        let mine = bytes(&self.buckets[bi]);
        while self.waited_upto < self.next_launch && alive + mine > limit {
            let b = &mut self.buckets[self.waited_upto];
            if let BucketState::InFlight(work) = std::mem::replace(&mut b.state, BucketState::Lost)
            {
                let t = Instant::now();
                let result = work.wait();
                self.early_wait += t.elapsed();
                b.state = BucketState::InFlight(BucketWork::ready(result));
            }
            alive -= bytes(b);
            self.waited_upto += 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::reducer::{GradBucket, ParamSpec, Reducer, ReducerOptions};
    use ddp_comm::{DType, ProcessGroup, ReduceOp};
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;

    const N: usize = 1024;

    /// Rank `r`'s gradient of parameter `p`, element `k`.
    fn grad(r: usize, p: usize, k: usize) -> f32 {
        (r + 1) as f32 * 0.5 + p as f32 + k as f32 * 0.25
    }

    /// Four one-parameter buckets of 4 KiB; the hook sums and counts the buckets whose result
    /// was waited for. Returns, for each bucket in launch order, how many results had been
    /// waited for just after its first gradient was marked (two steps).
    fn waited_at_each_first_mark(limit: Option<usize>) -> Vec<Vec<Vec<usize>>> {
        let cfg = ddp_comm::testing::LocalGroup::default();
        ddp_comm::testing::run_local_group(2, cfg, |pg| {
            let rank = pg.rank();
            let specs = (0..4)
                .map(|p| ParamSpec::new(format!("p{p}"), vec![N], DType::F32))
                .collect();
            let cap = (N * 4) as f64 / (1024.0 * 1024.0);
            let opts = ReducerOptions {
                bucket_cap_mb: cap,
                first_bucket_cap_mb: cap,
            };
            let mut red = Reducer::new(&pg, specs, opts).unwrap();
            assert_eq!(red.bucket_cap_bytes(), N * 4);
            let buckets = red.buckets();
            assert_eq!(buckets.len(), 4, "one parameter per bucket");
            red.set_max_bucket_bytes_alive(limit);
            assert_eq!(red.max_bucket_bytes_alive(), limit);
            let waited = Arc::new(AtomicUsize::new(0));
            let w = waited.clone();
            red.register_comm_hook(move |pg: &ProcessGroup, b: GradBucket| {
                let w = w.clone();
                b.into_buffer()
                    .all_reduce(pg, ReduceOp::Sum)
                    .then(move |buf| {
                        w.fetch_add(1, Ordering::SeqCst);
                        Ok(buf)
                    })
            })
            .unwrap();
            let mut steps = Vec::new();
            for step in 0..2 {
                waited.store(0, Ordering::SeqCst);
                let mut seen = Vec::new();
                for b in &buckets {
                    let p = b.params[0];
                    let g: Vec<f32> = (0..N)
                        .map(|k| grad(rank, p, k) * (step + 1) as f32)
                        .collect();
                    red.mark_ready(p, &g).unwrap();
                    seen.push(waited.load(Ordering::SeqCst));
                }
                red.finish().unwrap();
                assert_eq!(
                    waited.load(Ordering::SeqCst),
                    4,
                    "every bucket's result, once"
                );
                for p in 0..4 {
                    let got = red.grad::<f32>(p).unwrap();
                    for (k, v) in got.iter().enumerate() {
                        let want = (grad(0, p, k) + grad(1, p, k)) * (step + 1) as f32;
                        assert_eq!(*v, want, "step {step} p{p}[{k}]");
                    }
                }
                steps.push(seen);
            }
            steps
        })
    }

    #[test]
    fn without_a_limit_nothing_is_waited_for_before_finish() {
        for r in waited_at_each_first_mark(None) {
            assert_eq!(r, vec![vec![0, 0, 0, 0]; 2]);
        }
    }

    #[test]
    fn a_one_bucket_limit_waits_for_the_previous_bucket_before_filling_the_next() {
        for r in waited_at_each_first_mark(Some(N * 4)) {
            assert_eq!(r, vec![vec![0, 1, 2, 3]; 2]);
        }
    }

    #[test]
    fn a_two_bucket_limit_keeps_one_in_flight() {
        for r in waited_at_each_first_mark(Some(N * 8)) {
            assert_eq!(r, vec![vec![0, 0, 1, 2]; 2]);
        }
    }
}
