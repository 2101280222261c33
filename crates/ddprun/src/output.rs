//! Worker output: one reader thread per worker stream that passes the bytes on as they arrive:
//! to the launcher's console with a `[rankN]: ` prefix at the start of every line (unless
//! redirected or filtered), to the rank's log file (when redirected or teed), and, for stderr,
//! into a ring buffer of the last lines used by the failure summary.
//!
//! Whole lines are written in one piece, so that the lines of different ranks never mix. The
//! unfinished end of a line (a prompt, a progress bar redrawn with `\r`) is held back at most
//! [`HOLD_TIME`] and [`HOLD_BYTES`] waiting for the rest of its line, then shown as it is: the
//! launcher's memory stays bounded whatever a worker writes. A `\r` starts a new line for the
//! prefix too (a redrawn progress bar keeps its prefix). When another rank writes to the console
//! in the middle of a shown partial line, that line is ended first and resumes with its prefix.

use std::collections::VecDeque;
use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, RawFd};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Lines of stderr kept per worker for the failure summary.
pub const TAIL_LINES: usize = 20;
/// Longest line kept in the tail (longer ones are cut, with a marker).
const TAIL_LINE_MAX: usize = 2000;
/// Most bytes of an unfinished line held back waiting for its end (more is shown at once).
pub const HOLD_BYTES: usize = 64 * 1024;
/// Longest time the unfinished end of a line is held back before it is shown.
pub const HOLD_TIME: Duration = Duration::from_millis(100);
/// Bytes read from a worker's pipe at a time.
const READ_CHUNK: usize = 64 * 1024;

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
    Stdout = 0,
    Stderr = 1,
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

/// Where the console's cursor is for one worker stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum At {
    /// At the start of a line: the next byte gets the prefix.
    LineStart,
    /// Just after a `\r`: the next byte gets the prefix unless it is the `\n` of a `\r\n`.
    AfterCr,
    /// Inside a line.
    Mid,
}

/// Per console (stdout, stderr): the id of the worker stream whose partial line ends the
/// console's current line (`None`: the console is at a line start). Held while writing.
static OPEN_LINE: [Mutex<Option<u64>>; 2] = [Mutex::new(None), Mutex::new(None)];
static NEXT_STREAM_ID: AtomicU64 = AtomicU64::new(1);

/// `bytes` with `prefix` inserted at every line start, the cursor state moved along. A `\r`
/// starts a line too, except before `\n`.
fn prefixed(bytes: &[u8], prefix: &[u8], at: &mut At, out: &mut Vec<u8>) {
    let mut rest = bytes;
    while !rest.is_empty() {
        let needs_prefix = match *at {
            At::LineStart => true,
            At::AfterCr => rest[0] != b'\n',
            At::Mid => false,
        };
        if needs_prefix {
            out.extend_from_slice(prefix);
        }
        // Up to and including the next line end (`\n` or `\r`), or everything.
        let end = rest
            .iter()
            .position(|&b| b == b'\n' || b == b'\r')
            .map_or(rest.len(), |i| i + 1);
        out.extend_from_slice(&rest[..end]);
        *at = match rest[end - 1] {
            b'\n' => At::LineStart,
            b'\r' => At::AfterCr,
            _ => At::Mid,
        };
        rest = &rest[end..];
    }
}

/// One worker stream's state while its bytes are passed on to a [`Sink`].
struct Stream {
    sink: Sink,
    id: u64,
    /// Console cursor state of this stream's own output.
    at: At,
    /// Whether the last byte written to the log file ended a line.
    file_at_line_start: bool,
    /// The stderr tail's current line (at most a little over `TAIL_LINE_MAX` bytes kept).
    tail_line: Vec<u8>,
    /// Scratch buffer of the prefixed console text.
    out: Vec<u8>,
}

impl Stream {
    fn new(sink: Sink) -> Stream {
        Stream {
            sink,
            id: NEXT_STREAM_ID.fetch_add(1, Ordering::Relaxed),
            at: At::LineStart,
            file_at_line_start: true,
            tail_line: Vec::new(),
            out: Vec::new(),
        }
    }

    /// Pass `bytes` on to the file, the console and the tail.
    fn write(&mut self, bytes: &[u8]) {
        if bytes.is_empty() {
            return;
        }
        if let Some(f) = &mut self.sink.file {
            // A full disk must not stop the job; the console still has the output.
            let _ = f.write_all(bytes);
            self.file_at_line_start = bytes.ends_with(b"\n");
        }
        if let Some((console, prefix)) = &self.sink.console {
            let slot = &OPEN_LINE[*console as usize];
            let mut open = slot.lock().unwrap_or_else(|e| e.into_inner());
            self.out.clear();
            match *open {
                Some(id) if id == self.id => {}
                Some(_) => {
                    // Another stream's partial line is on the console: end it.
                    self.out.push(b'\n');
                    self.at = At::LineStart;
                }
                // Someone else's whole lines came after our partial one.
                None => self.at = At::LineStart,
            }
            prefixed(bytes, prefix.as_bytes(), &mut self.at, &mut self.out);
            *open = (self.at != At::LineStart).then_some(self.id);
            write_console(*console, &self.out);
        }
        if let Some(tail) = self.sink.tail.clone() {
            let mut rest = bytes;
            while !rest.is_empty() {
                let end = rest.iter().position(|&b| b == b'\n');
                let part = &rest[..end.map_or(rest.len(), |i| i + 1)];
                let room = (TAIL_LINE_MAX + 2).saturating_sub(self.tail_line.len());
                self.tail_line
                    .extend_from_slice(&part[..part.len().min(room)]);
                if end.is_some() {
                    self.push_tail_line(tail.clone());
                }
                rest = &rest[part.len()..];
            }
        }
    }

    /// Push the tail's current line. One cut short keeps `TAIL_LINE_MAX + 2` bytes and no line
    /// end, so [`Tail::push`] still sees it as too long and marks it.
    fn push_tail_line(&mut self, tail: Arc<Mutex<Tail>>) {
        tail.lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(&self.tail_line);
        self.tail_line.clear();
    }

    /// End of the stream: finish an unterminated last line everywhere.
    fn finish(mut self) {
        if let Some(f) = &mut self.sink.file {
            if !self.file_at_line_start {
                let _ = f.write_all(b"\n");
            }
            let _ = f.flush();
        }
        if let Some((console, _)) = &self.sink.console {
            let mut open = OPEN_LINE[*console as usize]
                .lock()
                .unwrap_or_else(|e| e.into_inner());
            if *open == Some(self.id) {
                *open = None;
                write_console(*console, b"\n");
            }
        }
        if let Some(tail) = self.sink.tail.clone() {
            if !self.tail_line.is_empty() {
                self.push_tail_line(tail);
            }
        }
    }
}

/// One write under the stream's lock keeps lines of different ranks whole. A closed console
/// (e.g. `ddprun ... | head`) is ignored so that workers never block on a full pipe.
fn write_console(console: Console, bytes: &[u8]) {
    let _ = match console {
        Console::Stdout => {
            let mut out = std::io::stdout().lock();
            out.write_all(bytes).and_then(|_| out.flush())
        }
        Console::Stderr => std::io::stderr().lock().write_all(bytes),
    };
}

/// Whether `fd` becomes readable (or closed) within `timeout`.
fn readable_within(fd: RawFd, timeout: Duration) -> bool {
    let mut p = libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    let ms = timeout.as_millis().clamp(1, i32::MAX as u128) as i32;
    // SAFETY: one valid pollfd for the duration of the call.
    let rc = unsafe { libc::poll(&mut p, 1, ms) };
    // An error (EINTR) counts as readable: the caller just reads (and blocks) again.
    rc != 0
}

/// Copy `stream` into `sink` on a new thread as the bytes arrive, until end of file: whole
/// lines at once, the unfinished end of a line after at most [`HOLD_TIME`] (or once it holds
/// [`HOLD_BYTES`]). Memory used is bounded whatever the stream carries.
pub fn spawn_reader(
    name: String,
    mut stream: impl Read + AsRawFd + Send + 'static,
    sink: Sink,
) -> std::io::Result<JoinHandle<()>> {
    std::thread::Builder::new().name(name).spawn(move || {
        let fd = stream.as_raw_fd();
        let mut s = Stream::new(sink);
        let mut buf = vec![0u8; READ_CHUNK];
        // The unfinished end of the last line read, and since when it waits.
        let mut held: Vec<u8> = Vec::new();
        let mut held_since = Instant::now();
        loop {
            if !held.is_empty() {
                let left = HOLD_TIME.saturating_sub(held_since.elapsed());
                if left.is_zero() || !readable_within(fd, left) {
                    s.write(&held);
                    held.clear();
                    continue;
                }
            }
            let n = match stream.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(_) => break,
            };
            let data = &buf[..n];
            let rest = match data.iter().rposition(|&b| b == b'\n') {
                Some(i) => {
                    // Whole lines: with what was held, in one write.
                    held.extend_from_slice(&data[..=i]);
                    s.write(&held);
                    held.clear();
                    &data[i + 1..]
                }
                None => data,
            };
            if held.len() + rest.len() > HOLD_BYTES {
                held.extend_from_slice(rest);
                s.write(&held);
                held.clear();
            } else if !rest.is_empty() {
                if held.is_empty() {
                    held_since = Instant::now();
                }
                held.extend_from_slice(rest);
            }
            if held.capacity() > 2 * HOLD_BYTES + READ_CHUNK {
                held = Vec::new();
            }
        }
        s.write(&held);
        s.finish();
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
        let (mut w, r) = std::os::unix::net::UnixStream::pair().unwrap();
        let reader = spawn_reader("t".into(), r, sink).unwrap();
        w.write_all(b"first\nsecond\nno newline").unwrap();
        drop(w);
        reader.join().unwrap();
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
    fn prefixes_at_line_starts_and_after_carriage_returns() {
        let mut at = At::LineStart;
        let mut out = Vec::new();
        for part in [&b"a\nb"[..], b"c\r\n", b"10%\r", b"20%\r", b"\n"] {
            prefixed(part, b"P: ", &mut at, &mut out);
        }
        assert_eq!(out, b"P: a\nP: bc\r\nP: 10%\rP: 20%\r\n");
        assert_eq!(at, At::LineStart);
    }

    #[test]
    fn tail_keeps_long_lines_cut_and_marked() {
        let tail = Arc::new(Mutex::new(Tail::default()));
        let mut s = Stream::new(Sink {
            console: None,
            file: None,
            tail: Some(tail.clone()),
        });
        // One line in many pieces, far longer than what the tail keeps.
        for _ in 0..100 {
            s.write(&[b'y'; 1000]);
        }
        s.write(b"\nlast");
        assert!(s.tail_line.capacity() < 4 * TAIL_LINE_MAX);
        s.finish();
        let lines = tail.lock().unwrap().lines();
        assert_eq!(lines.len(), 2);
        assert_eq!(lines[0], format!("{} [...]", "y".repeat(TAIL_LINE_MAX)));
        assert_eq!(lines[1], "last");
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
