//! The gradient [`Reducer`]: PyTorch DDP's bucketed, pipelined gradient all-reduce over flat
//! buffers, independent of any tensor framework (c10d's `reducer.cpp`).
//!
//! By concern:
//! - [`spec`]: [`ParamSpec`] (name, shape, dtype) and the cross-rank check that every replica
//!   registered the same parameters in the same order ([`verify_param_specs`]); start-up helpers
//!   [`broadcast_coalesced`] and [`sync_seed`].
//! - [`assign`]: bucket assignment ([`compute_bucket_assignment`]): reverse registration order,
//!   per dtype, 1 MiB first bucket and 25 MiB others (PyTorch's defaults).
//! - [`buffer`]: the bucket buffers — a closed enum over host dtypes ([`HostBuffer`]) or a
//!   [`DeviceBucket`] — and [`BucketWork`], a bucket whose reduction is in flight.
//! - [`device`]: gradients in device memory ([`DeviceSlice`]: flatten into and unflatten out
//!   of device buckets without a host round trip) and [`CpuBucket`], the CPU implementation
//!   of [`DeviceBucket`] that runs that path on every machine.
//! - [`hook`]: how a full bucket is reduced ([`CommHook`], default [`AllReduceHook`];
//!   [`Reducer::register_comm_hook`]).
//! - [`state`]: the per-step state machine ([`Reducer::mark_ready`], [`Reducer::finish`],
//!   `no_sync`, Join's divisor) and its timing ([`StepStats`]); in its private `state::finite`,
//!   the optional check that the averaged gradients are finite ([`Reducer::set_check_finite`],
//!   [`Error::NonFinite`](crate::Error::NonFinite)).
//!
//! ```text
//!  backward ──mark_ready(i, grad)──► bucket buffer (copy / add under no_sync)
//!                                       │ all gradients in, in bucket order
//!                                       ▼
//!                        CommHook::run(pg, GradBucket) ──► BucketWork (in flight)
//!                                                              │ finish(): wait
//!                                                              ▼
//!                        averaged buffer ──► [finite check] ──► grad(i) / with_grad(i)
//! ```

pub mod assign;
pub mod buffer;
pub mod device;
pub mod hook;
pub mod spec;
pub mod state;
#[cfg(test)]
mod tests;

pub use assign::{
    compute_bucket_assignment, ReducerOptions, DEFAULT_BUCKET_CAP_MB, DEFAULT_FIRST_BUCKET_CAP_MB,
};
pub use buffer::{BucketBuffer, BucketWork, DeviceBucket, HostBuffer, HostSlice, PendingBucket};
#[cfg(feature = "cuda")]
pub use device::CudaView;
pub use device::{CpuBucket, DeviceSlice};
pub use hook::{AllReduceHook, BucketParam, CommHook, GradBucket, HookState, ShardRange};
pub use spec::{
    broadcast_coalesced, require_trainable, sync_seed, verify_param_specs, ParamSpec,
    BROADCAST_BUCKET_BYTES,
};
pub use state::{BucketInfo, Reducer, StepStats, TakenBucket, TotalStats};
