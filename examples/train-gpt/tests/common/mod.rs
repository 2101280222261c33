//! What the train-gpt test files share.

/// A small model that still has every part (2 blocks, 2 heads, tied head, context 16), evaluated
/// on 2 batches of windows.
pub const SMALL_MODEL: &[&str] = &[
    "--n-layer",
    "2",
    "--n-head",
    "2",
    "--n-embd",
    "32",
    "--block-size",
    "16",
    "--eval-iters",
    "2",
];
