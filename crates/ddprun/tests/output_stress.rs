//! `ddprun`'s output prefixing under stress: many ranks writing long lines (longer than a pipe's
//! atomic write) at once, on stdout and stderr. Every console line must be exactly one line of
//! one rank, with that rank's prefix.

mod common;

use common::*;
use std::time::Duration;

const RANKS: usize = 8;
const LINES: usize = 150;
const LEN: usize = 9000; // > PIPE_BUF (4096): the kernel may split each write

/// Every line of `text` is `[rankR]: R I <LEN times R>`; each rank's `I` run 0..LINES in order.
fn check_stream(text: &str, what: &str) {
    let mut next = [0usize; RANKS];
    for (n, line) in text.lines().enumerate() {
        let bad = || format!("{what} line {n} is mixed or cut: {:.120}...", line);
        let rest = line
            .strip_prefix("[rank")
            .unwrap_or_else(|| panic!("{}", bad()));
        let (rank, rest) = rest
            .split_once("]: ")
            .unwrap_or_else(|| panic!("{}", bad()));
        let r: usize = rank.parse().unwrap_or_else(|_| panic!("{}", bad()));
        let mut parts = rest.splitn(3, ' ');
        assert_eq!(parts.next(), Some(rank), "{}", bad());
        assert_eq!(
            parts.next(),
            Some(next[r].to_string().as_str()),
            "{}",
            bad()
        );
        let body = parts.next().unwrap_or_else(|| panic!("{}", bad()));
        let ch = rank.chars().next().unwrap();
        assert!(
            body.len() == LEN && body.chars().all(|c| c == ch),
            "{}",
            bad()
        );
        next[r] += 1;
    }
    assert_eq!(next, [LINES; RANKS], "{what}: lines per rank");
}

#[test]
fn long_lines_of_many_ranks_never_mix() {
    // Each rank builds one long line of its digit, then prints it LINES times to stdout and to
    // stderr, numbered.
    let script = format!(
        "L=$(head -c {LEN} /dev/zero | tr '\\0' \"$RANK\"); i=0; \
         while [ $i -lt {LINES} ]; do echo \"$RANK $i $L\"; echo \"$RANK $i $L\" >&2; \
         i=$((i+1)); done"
    );
    let r = run_sh(RANKS, &[], &script, Duration::from_secs(120));
    assert_eq!(r.code(), Some(0), "exit: {:?}", r.code());
    check_stream(&r.stdout, "stdout");
    // stderr also carries the launcher's own messages: keep the workers' lines.
    let worker_err: String = r
        .stderr
        .lines()
        .filter(|l| l.starts_with("[rank"))
        .map(|l| format!("{l}\n"))
        .collect();
    check_stream(&worker_err, "stderr");
}

/// `ddprun --nproc-per-node 1 --master-port 0 sh -c SCRIPT` with stdout piped and read raw (not
/// line by line) on a thread into the returned buffer; stderr is discarded.
fn start_raw(
    script: &str,
) -> (
    std::process::Child,
    std::sync::Arc<std::sync::Mutex<Vec<u8>>>,
    std::thread::JoinHandle<()>,
) {
    use std::io::Read;
    let mut cmd = sh_command(1, &[], script);
    cmd.stderr(std::process::Stdio::null());
    let mut child = cmd.spawn().unwrap();
    let mut out = child.stdout.take().unwrap();
    let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let s = seen.clone();
    let reader = std::thread::spawn(move || {
        let mut buf = vec![0u8; 1 << 16];
        while let Ok(n @ 1..) = out.read(&mut buf) {
            s.lock().unwrap().extend_from_slice(&buf[..n]);
        }
    });
    (child, seen, reader)
}

/// Wait up to `limit` for `cond`; panic with `what` otherwise.
fn wait_until(limit: Duration, what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = std::time::Instant::now() + limit;
    while !cond() {
        assert!(std::time::Instant::now() < deadline, "{what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn a_partial_line_shows_while_the_worker_still_runs() {
    // A prompt and a progress bar redrawn with `\r`, then the worker waits for the test.
    let dir = tempfile::tempdir().unwrap();
    let go = dir.path().join("go");
    let script = format!(
        "printf 'Continue? '; printf '10%%\\r20%%\\r'; \
         while [ ! -e '{}' ]; do sleep 0.05; done; echo yes",
        go.display()
    );
    let (mut child, seen, reader) = start_raw(&script);
    let text = || String::from_utf8_lossy(&seen.lock().unwrap()).into_owned();
    wait_until(
        Duration::from_secs(60),
        "the partial line never reached the launcher's stdout while the worker waited",
        || text().contains("20%\r"),
    );
    assert!(
        child.try_wait().unwrap().is_none(),
        "the worker must still be waiting"
    );
    // A prefix at each line start: after the `\r`s too.
    assert_eq!(text(), "[rank0]: Continue? 10%\r[rank0]: 20%\r");
    std::fs::write(&go, "").unwrap();
    let status = child.wait().unwrap();
    reader.join().unwrap();
    assert!(status.success(), "{status:?}");
    assert_eq!(
        text(),
        "[rank0]: Continue? 10%\r[rank0]: 20%\r[rank0]: yes\n"
    );
}

/// The launcher's peak resident memory (`VmHWM`), in bytes.
fn peak_rss(pid: u32) -> u64 {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let kb: u64 = s
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().strip_suffix("kB"))
        .and_then(|v| v.trim().parse().ok())
        .expect("VmHWM in /proc/PID/status");
    kb * 1024
}

#[test]
fn a_huge_line_without_newline_keeps_the_launcher_small() {
    const LINE: u64 = 96 << 20;
    const BOUND: u64 = 48 << 20;
    let dir = tempfile::tempdir().unwrap();
    let go = dir.path().join("go");
    // One 96 MiB line with no newline; the worker stays until the test has read the launcher.
    let script = format!(
        "head -c {LINE} /dev/zero | tr '\\0' x; while [ ! -e '{}' ]; do sleep 0.05; done",
        go.display()
    );
    let mut cmd = sh_command(1, &[], &script);
    cmd.stderr(std::process::Stdio::null());
    let mut child = cmd.spawn().unwrap();
    let mut out = child.stdout.take().unwrap();
    let got = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    let g = got.clone();
    let reader = std::thread::spawn(move || {
        use std::io::Read;
        let (mut head, mut other) = (Vec::new(), 0u64);
        let mut buf = vec![0u8; 1 << 16];
        while let Ok(n @ 1..) = out.read(&mut buf) {
            let data = &buf[..n];
            let skip = 9usize.saturating_sub(head.len()).min(n);
            head.extend_from_slice(&data[..skip]);
            other += data[skip..].iter().filter(|&&b| b != b'x').count() as u64;
            g.fetch_add(n as u64, std::sync::atomic::Ordering::Relaxed);
        }
        (head, other)
    });
    let prefix = "[rank0]: ".len() as u64;
    wait_until(
        Duration::from_secs(240),
        "the line did not come through the launcher",
        || got.load(std::sync::atomic::Ordering::Relaxed) >= prefix + LINE,
    );
    let peak = peak_rss(child.id());
    std::fs::write(&go, "").unwrap();
    let status = child.wait().unwrap();
    let (head, other) = reader.join().unwrap();
    assert!(status.success(), "{status:?}");
    assert_eq!(head, b"[rank0]: ", "one prefix, at the start");
    // The line's bytes and the newline that ends it at the end of the stream.
    assert_eq!(other, 1, "only the final newline is not `x`");
    assert_eq!(
        got.load(std::sync::atomic::Ordering::Relaxed),
        prefix + LINE + 1
    );
    assert!(
        peak < BOUND,
        "the launcher's peak RSS was {} MiB passing on a {} MiB line (bound {} MiB)",
        peak >> 20,
        LINE >> 20,
        BOUND >> 20
    );
}
