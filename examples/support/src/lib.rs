//! What `train-digits` (candle) and `train-digits-burn` (Burn) share, so that the two programs
//! differ only where their frameworks do:
//!
//! - [`data`]: the UCI digits, embedded, and the fixed 80/20 split;
//! - [`outer`]: DiLoCo's and post-local SGD's outer loop: its step, every rank's own state in
//!   the plain checkpoints, and where a run's last synchronization goes;
//! - [`flags`]: the common flags ([`flags::CommonArgs`], flattened into each program's `Args`)
//!   and their value parsers;
//! - [`resume`]: which checkpoint of a directory a run resumes from (plain or save set);
//! - [`summary`]: the end of a run, the text lines and the final `--json` line
//!   ([`summary::RunSummary`], which the tests and scripts read);
//! - [`testing`]: the helpers of both programs' tests (run to completion, compare final lines).

#![forbid(unsafe_code)]

pub mod data;
pub mod flags;
pub mod outer;
pub mod resume;
pub mod summary;
pub mod testing;
