//! Learning-rate scaling for data-parallel training.
//!
//! With `world_size` ranks each consuming `per_rank_batch` samples per step, one optimizer step sees a
//! global batch of `per_rank_batch × world_size` samples (DDP averages the gradients over ranks, so
//! the update equals one step on the global batch). The *linear scaling rule* (Goyal et al., 2017,
//! "Accurate, Large Minibatch SGD") keeps the per-sample learning signal constant by scaling the
//! learning rate in proportion to the global batch. For large factors it is usually combined with a
//! few epochs of warm-up; that schedule is left to the training loop.

/// The global batch size of one data-parallel step: `per_rank_batch × world_size`.
pub fn global_batch_size(per_rank_batch: usize, world_size: usize) -> usize {
    per_rank_batch * world_size
}

/// Scales `base_lr`, tuned for a batch of `base_batch` samples, linearly to the global batch
/// `per_rank_batch × world_size`:
///
/// `lr = base_lr × (per_rank_batch × world_size) / base_batch`
///
/// ```
/// // Tuned at lr 0.1 for batch 32 on one process; 4 ranks × 32 samples each → global batch 128.
/// assert_eq!(ddp_core::scale_lr_linear(0.1, 32, 4, 32), 0.4);
/// // Keeping the *global* batch at 32 with 4 ranks (8 each) keeps the learning rate.
/// assert_eq!(ddp_core::scale_lr_linear(0.1, 8, 4, 32), 0.1);
/// ```
///
/// # Panics
/// If `base_batch` is 0 (the reference batch size must be positive).
pub fn scale_lr_linear(
    base_lr: f64,
    per_rank_batch: usize,
    world_size: usize,
    base_batch: usize,
) -> f64 {
    assert!(
        base_batch > 0,
        "scale_lr_linear: base_batch must be > 0 (it is the batch size base_lr was tuned for)"
    );
    base_lr * global_batch_size(per_rank_batch, world_size) as f64 / base_batch as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn global_batch_is_per_rank_times_world() {
        assert_eq!(global_batch_size(64, 1), 64);
        assert_eq!(global_batch_size(64, 8), 512);
        assert_eq!(global_batch_size(0, 8), 0);
    }

    #[test]
    fn linear_scaling_follows_global_batch() {
        // Single process at the base batch: unchanged.
        assert_eq!(scale_lr_linear(0.1, 32, 1, 32), 0.1);
        // Doubling the world doubles the global batch and the learning rate.
        assert!((scale_lr_linear(0.1, 32, 2, 32) - 0.2).abs() < 1e-15);
        // Goyal et al.: lr 0.1 per 256 samples, 8 GPUs × 32 = 256 → 0.1; 32 × 32 = 1024 → 0.4.
        assert!((scale_lr_linear(0.1, 32, 8, 256) - 0.1).abs() < 1e-15);
        assert!((scale_lr_linear(0.1, 32, 32, 256) - 0.4).abs() < 1e-15);
        // Smaller global batch than the reference scales down.
        assert!((scale_lr_linear(0.01, 16, 1, 64) - 0.0025).abs() < 1e-15);
    }

    #[test]
    #[should_panic(expected = "base_batch must be > 0")]
    fn zero_base_batch_panics() {
        scale_lr_linear(0.1, 32, 2, 0);
    }
}
