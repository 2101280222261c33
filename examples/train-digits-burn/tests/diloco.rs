//! `train-digits-burn --hook diloco:H` and `--hook streaming-diloco:H:F:TAU` as a user runs them
//! (real worker processes): identical replicas at the end, learning, a fraction of DDP's bytes,
//! an exact resume from a checkpoint taken between synchronizations (the checks are
//! `ddp_example_support::testing`'s, shared with train-digits), and the refusal under
//! `--learner`.

use ddp_example_support::testing;

const BIN: &str = env!("CARGO_BIN_EXE_train-digits-burn");

#[test]
fn diloco_ends_with_identical_replicas_learns_and_sends_a_fraction_of_ddps_bytes() {
    testing::check_diloco_trains(BIN);
}

#[test]
fn diloco_resumes_exactly_between_synchronizations_and_at_other_world_sizes() {
    testing::check_diloco_resumes_exactly(BIN);
}

/// Burn's `Learner` runs its own epoch loop: DiLoCo is refused there, naming the plain loop.
#[test]
fn diloco_under_the_learner_is_refused_naming_the_plain_loop() {
    let f = testing::run_bin(
        BIN,
        &["--nproc", "2", "--learner", "--hook", "diloco:4"],
        120,
    );
    assert!(!f.success, "{}", f.stdout);
    assert!(
        f.stderr.contains("DiLoCo") && f.stderr.contains("run without --learner"),
        "{}",
        f.stderr
    );
}
