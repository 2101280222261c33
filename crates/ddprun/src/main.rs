//! The `ddprun` binary: see the library crate for the implementation and `--help` for usage.

fn main() {
    let filter = tracing_subscriber::EnvFilter::try_from_env("DDPRUN_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .try_init();
    // The soft descriptor limit is raised to the hard one in `launch::run` (shared with
    // `ddprun::spawn`; see ddp_comm::store::raise_fd_limit).
    std::process::exit(ddprun::main_with_args(std::env::args()));
}
