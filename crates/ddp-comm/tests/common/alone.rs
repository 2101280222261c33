//! `in_own_process`: runs one test of this binary in a child process of its own, for tests
//! that measure or exhaust something process-wide (bytes written per process, the descriptor
//! table of a server they flood) and so must not share the process with the binary's other
//! tests, which `cargo test` runs as threads of one process (nextest already gives each test its
//! own process; the child is cheap there too).

/// In the parent: re-runs test `name` alone in a child process, asserts that it passed, and
/// returns `false` (the caller returns). In the child: returns `true` (the caller runs the
/// test body).
pub fn in_own_process(name: &str) -> bool {
    const CHILD: &str = "DDP_TEST_IN_OWN_PROCESS";
    if std::env::var(CHILD).is_ok_and(|v| v == name) {
        return true;
    }
    let out = std::process::Command::new(std::env::current_exe().expect("the test binary"))
        .args(["--exact", name, "--nocapture", "--test-threads=1"])
        .env(CHILD, name)
        .output()
        .expect("re-running the test binary");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.contains("1 passed"),
        "{name}, run alone in a child process, failed:\n{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    false
}
