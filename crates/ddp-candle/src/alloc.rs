//! Host memory between steps for candle on the CPU: candle allocates a fresh buffer for the
//! result of every tensor operation and frees it when the tensor drops, so one training step
//! allocates and frees the model's size several times over. The policy and its measurements are
//! `ddp-core`'s ([`ddp_core::alloc`]), re-exported here; call [`retain_freed_memory`] at start, before
//! building the model (every reducer calls it too, later).

pub use ddp_core::alloc::{release_freed_memory, retain_freed_memory, retained};
