//! Starting the benchmark's local worker processes: this binary re-executed with the torchrun
//! environment. Rank 0's output is passed through; if any worker fails, the others are killed
//! and the exit code is non-zero.

use std::process::{Child, Command};
use std::time::Duration;

/// Whether this process is a worker (a launcher or `run_local` set `RANK` and `WORLD_SIZE`).
pub fn is_worker() -> bool {
    std::env::var_os("RANK").is_some() && std::env::var_os("WORLD_SIZE").is_some()
}

/// Spawn `nproc` workers running the same command line; returns the exit code.
pub fn run_local(nproc: usize) -> i32 {
    let port = match std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()) {
        Ok(a) => a.port(),
        Err(e) => {
            eprintln!("ddp-bench: cannot find a free port: {e}");
            return 1;
        }
    };
    let exe = std::env::current_exe().expect("current executable");
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut children: Vec<Child> = Vec::new();
    for rank in 0..nproc {
        let mut cmd = Command::new(&exe);
        cmd.args(&args)
            .env("RANK", rank.to_string())
            .env("LOCAL_RANK", rank.to_string())
            .env("WORLD_SIZE", nproc.to_string())
            .env("LOCAL_WORLD_SIZE", nproc.to_string())
            .env("MASTER_ADDR", "127.0.0.1")
            .env("MASTER_PORT", port.to_string());
        // One compute thread per rank unless the user says otherwise (candle reads this).
        if std::env::var_os("RAYON_NUM_THREADS").is_none() {
            cmd.env("RAYON_NUM_THREADS", "1");
        }
        if rank != 0 {
            cmd.stdout(std::process::Stdio::null());
        }
        match cmd.spawn() {
            Ok(c) => children.push(c),
            Err(e) => {
                eprintln!("ddp-bench: cannot start worker {rank}: {e}");
                children.iter_mut().for_each(|c| drop(c.kill()));
                return 1;
            }
        }
    }
    // Supervise: the first failure stops everyone.
    let mut done = vec![false; nproc];
    let mut code = 0;
    while done.iter().any(|d| !d) {
        for (rank, c) in children.iter_mut().enumerate() {
            if done[rank] {
                continue;
            }
            if let Ok(Some(status)) = c.try_wait() {
                done[rank] = true;
                if !status.success() && code == 0 {
                    eprintln!(
                        "ddp-bench: worker rank {rank} failed ({status}); stopping the others"
                    );
                    code = 1;
                }
            }
        }
        if code != 0 {
            children.iter_mut().for_each(|c| drop(c.kill()));
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    children.iter_mut().for_each(|c| drop(c.wait()));
    code
}
