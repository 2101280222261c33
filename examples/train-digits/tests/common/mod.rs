//! What the train-digits test binaries share.

/// The keys of the final JSON line that pin a training run down: two runs that agree on all of
/// them (exactly) trained the same model.
pub const RESULT_KEYS: [&str; 5] = [
    "steps",
    "param_sum",
    "param_l2",
    "final_loss",
    "test_accuracy",
];

/// Asserts that `got` ended exactly where `want` did (every [`RESULT_KEYS`] equal); `what`
/// names the comparison in the failure message.
pub fn assert_same_run(got: &serde_json::Value, want: &serde_json::Value, what: &str) {
    for k in RESULT_KEYS {
        assert_eq!(got[k], want[k], "{what}: {k} differs: {got} vs {want}");
    }
}
