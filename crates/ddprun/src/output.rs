//! Worker output: one reader thread per worker stream that copies each line to the launcher's
//! console with a `[rankN]: ` prefix (unless redirected or filtered), to the rank's log file
//! (when redirected or teed), and, for stderr, into a ring buffer of the last lines used by the
//! failure summary.

use std::collections::VecDeque;
use std::fs::File;
use std::io::{BufRead, BufReader, Read, Write};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

/// Lines of stderr kept per worker for the failure summary.
pub const TAIL_LINES: usize = 20;
/// Longest line kept in the tail (longer ones are cut, with a marker).
const TAIL_LINE_MAX: usize = 2000;

/// The last lines a worker wrote to stderr.
#[derive(Debug, Default)]
pub struct Tail {
    lines: VecDeque<String>,
}

impl Tail {
    fn push(&mut self, line: &[u8]) {
        let line = trim_newline(line);
        let mut s = String::from_utf8_lossy(&line[..line.len().min(TAIL_LINE_MAX)]).into_owned();
        if line.len() > TAIL_LINE_MAX {
            s.push_str(" [...]");
        }
        if self.lines.len() == TAIL_LINES {
            self.lines.pop_front();
        }
        self.lines.push_back(s);
    }

    /// The kept lines, oldest first.
    pub fn lines(&self) -> Vec<String> {
        self.lines.iter().cloned().collect()
    }
}

/// Which launcher stream a worker stream is shown on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Console {
    Stdout,
    Stderr,
}

/// How worker output is laid out on the launcher's console.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ConsoleStyle {
    /// Every line on the stream the worker wrote it to, prefixed `[rankN]: ` (`ddprun`'s layout).
    #[default]
    Prefixed,
    /// Rank 0's stdout unprefixed on stdout, so that a program's machine-readable output (e.g. a
    /// last JSON line) stays parseable; every other stream prefixed on stderr.
    Rank0Stdout,
}

impl ConsoleStyle {
    /// Console stream and prefix of a worker's stdout and stderr (before redirects and filters).
    pub fn streams(self, rank: usize) -> ((Console, String), (Console, String)) {
        let prefix = format!("[rank{rank}]: ");
        let out = match self {
            ConsoleStyle::Prefixed => (Console::Stdout, prefix.clone()),
            ConsoleStyle::Rank0Stdout if rank == 0 => (Console::Stdout, String::new()),
            ConsoleStyle::Rank0Stdout => (Console::Stderr, prefix.clone()),
        };
        (out, (Console::Stderr, prefix))
    }
}

/// Where the lines of one worker stream go.
pub struct Sink {
    /// Show on the console with this prefix (`None`: redirected or filtered out).
    pub console: Option<(Console, String)>,
    /// Append to this log file.
    pub file: Option<File>,
    /// Keep the last lines here.
    pub tail: Option<Arc<Mutex<Tail>>>,
}

fn trim_newline(line: &[u8]) -> &[u8] {
    let line = line.strip_suffix(b"\n").unwrap_or(line);
    line.strip_suffix(b"\r").unwrap_or(line)
}

impl Sink {
    fn line(&mut self, line: &[u8]) {
        if let Some(f) = &mut self.file {
            // A full disk must not stop the job; the console still has the output.
            let _ = f.write_all(line);
            if !line.ends_with(b"\n") {
                let _ = f.write_all(b"\n");
            }
        }
        if let Some((console, prefix)) = &self.console {
            let mut buf = Vec::with_capacity(prefix.len() + line.len() + 1);
            buf.extend_from_slice(prefix.as_bytes());
            buf.extend_from_slice(line);
            if !line.ends_with(b"\n") {
                buf.push(b'\n');
            }
            // One write under the lock keeps lines of different ranks whole. A closed console
            // (e.g. `ddprun ... | head`) is ignored so that workers never block on a full pipe.
            let _ = match console {
                Console::Stdout => {
                    let mut out = std::io::stdout().lock();
                    out.write_all(&buf).and_then(|_| out.flush())
                }
                Console::Stderr => std::io::stderr().lock().write_all(&buf),
            };
        }
        if let Some(tail) = &self.tail {
            tail.lock().unwrap_or_else(|e| e.into_inner()).push(line);
        }
    }
}

/// Copy `stream` line by line into `sink` on a new thread, until end of file.
pub fn spawn_reader(
    name: String,
    stream: impl Read + Send + 'static,
    mut sink: Sink,
) -> std::io::Result<JoinHandle<()>> {
    std::thread::Builder::new().name(name).spawn(move || {
        let mut reader = BufReader::with_capacity(64 * 1024, stream);
        let mut line = Vec::with_capacity(1024);
        loop {
            line.clear();
            match reader.read_until(b'\n', &mut line) {
                Ok(0) => break,
                Ok(_) => sink.line(&line),
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(_) => break,
            }
        }
        if let Some(f) = &mut sink.file {
            let _ = f.flush();
        }
    })
}

/// Directory of one rank's logs for one attempt: `LOG_DIR/RUN_ID/attempt_K/RANK`.
pub fn rank_log_dir(log_dir: &Path, run_id: &str, attempt: u32, rank: usize) -> PathBuf {
    log_dir
        .join(run_id)
        .join(format!("attempt_{attempt}"))
        .join(rank.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tail_keeps_last_lines_and_strips_newlines() {
        let mut t = Tail::default();
        for i in 0..(TAIL_LINES + 5) {
            t.push(format!("line {i}\r\n").as_bytes());
        }
        let lines = t.lines();
        assert_eq!(lines.len(), TAIL_LINES);
        assert_eq!(lines[0], "line 5");
        assert_eq!(lines.last().unwrap(), &format!("line {}", TAIL_LINES + 4));
        t.push(&vec![b'x'; TAIL_LINE_MAX + 10]);
        assert!(t.lines().last().unwrap().ends_with(" [...]"));
    }

    #[test]
    fn reader_writes_file_and_tail_including_unterminated_last_line() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("out.log");
        let tail = Arc::new(Mutex::new(Tail::default()));
        let sink = Sink {
            console: None,
            file: Some(File::create(&path).unwrap()),
            tail: Some(tail.clone()),
        };
        let data: &[u8] = b"first\nsecond\nno newline";
        spawn_reader("t".into(), data, sink)
            .unwrap()
            .join()
            .unwrap();
        assert_eq!(
            std::fs::read_to_string(&path).unwrap(),
            "first\nsecond\nno newline\n"
        );
        assert_eq!(
            tail.lock().unwrap().lines(),
            ["first", "second", "no newline"]
        );
    }

    #[test]
    fn console_styles() {
        let p = |c, s: &str| (c, s.to_string());
        assert_eq!(
            ConsoleStyle::Prefixed.streams(1),
            (
                p(Console::Stdout, "[rank1]: "),
                p(Console::Stderr, "[rank1]: ")
            )
        );
        assert_eq!(
            ConsoleStyle::Rank0Stdout.streams(0),
            (p(Console::Stdout, ""), p(Console::Stderr, "[rank0]: "))
        );
        assert_eq!(
            ConsoleStyle::Rank0Stdout.streams(2),
            (
                p(Console::Stderr, "[rank2]: "),
                p(Console::Stderr, "[rank2]: ")
            )
        );
    }

    #[test]
    fn log_layout() {
        let p = rank_log_dir(Path::new("/l"), "job", 2, 7);
        assert_eq!(p, Path::new("/l/job/attempt_2/7"));
    }
}
