//! Seeing what training does: a per-rank timeline merged into one Chrome trace, and the
//! step profile behind the bottleneck report.
//!
//! - Timeline: [`start`] (or [`start_from_env`] with `DDP_TRACE=DIR`) turns recording on for
//!   this process; [`span`] guards, [`record_span`] and [`instant`] record events on the calling
//!   thread's lane (the reducer records the backward and each bucket, the process group's engine
//!   thread each collective, through [`ddp_comm::observe`]). [`finish`] — a collective — aligns
//!   every rank's clock with rank 0's (module `clock`: NTP-style ping-pong rounds through the
//!   group) and rank 0 writes `DIR/trace.json`, one process track per rank, for Perfetto or
//!   `chrome://tracing` (module `chrome`).
//! - Off (the default), every recording call costs one relaxed atomic load.
//! - Step profile and bottleneck report: module `profile` ([`StepProfiler`], [`BottleneckReport`]).
//! - Debug hooks (a slow rank, a skewed clock) for tests: module `debug`.

mod chrome;
mod clock;
pub mod debug;
mod profile;

pub use clock::ClockSync;
pub use profile::{BottleneckReport, Phase, RankBreakdown, StepProfiler};

use crate::error::{Error, Result};
use ddp_comm::observe::{CollectiveEvent, CollectiveObserver};
use ddp_comm::ProcessGroup;
use serde_json::Value;
use std::borrow::Cow;
use std::cell::Cell;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

/// The environment variable that turns tracing on: the directory for `trace.json`.
pub const TRACE_ENV: &str = "DDP_TRACE";

/// Events kept per process; later ones are counted as dropped (about 100 bytes each).
const MAX_EVENTS: usize = 2_000_000;

static ENABLED: AtomicBool = AtomicBool::new(false);
static RECORDER: Mutex<Option<Recorder>> = Mutex::new(None);

/// Whether this process records a timeline (one relaxed atomic load).
#[inline]
pub fn enabled() -> bool {
    ENABLED.load(Ordering::Relaxed)
}

/// The kind of a recorded event (Chrome's `ph`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    /// A span on its thread's lane (`X`).
    Complete,
    /// A point in time (`i`).
    Instant,
    /// A span that may overlap others (`b`/`e` with an id): gradient buckets in flight.
    Async,
}

/// One recorded event, in nanoseconds of this process's trace clock.
#[derive(Debug, Clone)]
pub(crate) struct Event {
    pub name: Cow<'static, str>,
    pub cat: &'static str,
    pub kind: Kind,
    pub ts_ns: i64,
    pub dur_ns: i64,
    pub tid: u32,
    pub id: u64,
    pub args: Vec<(&'static str, Value)>,
}

struct Recorder {
    dir: PathBuf,
    rank: usize,
    events: Vec<Event>,
    dropped: u64,
    /// Lane number → thread name.
    threads: Vec<(u32, String)>,
}

/// The trace clock: nanoseconds since the first use in this process, plus the debug skew
/// (`DDP_DEBUG_CLOCK_SKEW`, module `debug`).
fn epoch() -> Instant {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    *EPOCH.get_or_init(Instant::now)
}

/// `t` on this process's trace clock (nanoseconds).
pub fn clock_ns(t: Instant) -> i64 {
    let base = epoch();
    let d = if t >= base {
        t.duration_since(base).as_nanos() as i64
    } else {
        -(base.duration_since(t).as_nanos() as i64)
    };
    d + debug::clock_skew_ns()
}

static NEXT_LANE: AtomicU32 = AtomicU32::new(1);
thread_local! {
    static LANE: Cell<u32> = const { Cell::new(0) };
}

/// This thread's lane (Chrome's `tid`), registering its name on first use.
fn lane(rec: &mut Recorder) -> u32 {
    LANE.with(|l| {
        if l.get() == 0 {
            let id = NEXT_LANE.fetch_add(1, Ordering::Relaxed);
            l.set(id);
        }
        let id = l.get();
        if !rec.threads.iter().any(|(t, _)| *t == id) {
            let name = std::thread::current()
                .name()
                .map_or_else(|| format!("thread {id}"), str::to_string);
            rec.threads.push((id, name));
        }
        id
    })
}

fn push(mut e: Event) {
    let mut guard = RECORDER.lock().unwrap_or_else(|p| p.into_inner());
    let Some(rec) = guard.as_mut() else { return };
    if rec.events.len() >= MAX_EVENTS {
        rec.dropped += 1;
        return;
    }
    e.tid = lane(rec);
    rec.events.push(e);
}

/// Records a finished span `[start, end]` on the calling thread's lane (no-op when off).
pub fn record_span(
    name: impl Into<Cow<'static, str>>,
    cat: &'static str,
    start: Instant,
    end: Instant,
    args: Vec<(&'static str, Value)>,
) {
    if !enabled() {
        return;
    }
    let ts = clock_ns(start);
    push(Event {
        name: name.into(),
        cat,
        kind: Kind::Complete,
        ts_ns: ts,
        dur_ns: clock_ns(end) - ts,
        tid: 0,
        id: 0,
        args,
    });
}

/// Records a span that may overlap others of its kind (drawn on its own track, keyed by `id`):
/// a gradient bucket between its launch and the end of the wait for it.
pub fn record_async(
    name: impl Into<Cow<'static, str>>,
    cat: &'static str,
    id: u64,
    start: Instant,
    end: Instant,
    args: Vec<(&'static str, Value)>,
) {
    if !enabled() {
        return;
    }
    let ts = clock_ns(start);
    push(Event {
        name: name.into(),
        cat,
        kind: Kind::Async,
        ts_ns: ts,
        dur_ns: clock_ns(end) - ts,
        tid: 0,
        id,
        args,
    });
}

/// Records a point in time on the calling thread's lane (no-op when off).
pub fn instant(
    name: impl Into<Cow<'static, str>>,
    cat: &'static str,
    args: Vec<(&'static str, Value)>,
) {
    if !enabled() {
        return;
    }
    push(Event {
        name: name.into(),
        cat,
        kind: Kind::Instant,
        ts_ns: clock_ns(Instant::now()),
        dur_ns: 0,
        tid: 0,
        id: 0,
        args,
    });
}

/// A span from [`span`] to the guard's drop, on the calling thread's lane.
#[must_use = "the span ends when the guard is dropped"]
pub struct Span {
    open: Option<OpenSpan>,
}

/// Name, category, start and arguments of a span in progress.
type OpenSpan = (
    &'static str,
    &'static str,
    Instant,
    Vec<(&'static str, Value)>,
);

/// Starts a span named `name` (category `cat`, e.g. `"train"`); it ends when the guard drops.
/// Costs one relaxed atomic load when tracing is off.
#[inline]
pub fn span(name: &'static str, cat: &'static str) -> Span {
    if !enabled() {
        return Span { open: None };
    }
    Span {
        open: Some((name, cat, Instant::now(), Vec::new())),
    }
}

impl Span {
    /// Adds an argument shown with the span.
    pub fn arg(mut self, key: &'static str, value: impl Into<Value>) -> Span {
        if let Some((_, _, _, args)) = &mut self.open {
            args.push((key, value.into()));
        }
        self
    }
}

impl Drop for Span {
    fn drop(&mut self) {
        if let Some((name, cat, start, args)) = self.open.take() {
            record_span(name, cat, start, Instant::now(), args);
        }
    }
}

/// The collective observer of ddp: counts the time every observed group's engine spent in
/// collectives (for the step profile) and, with tracing on, records each as a span on the
/// engine thread's lane.
pub struct CommObserver {
    busy_ns: AtomicU64,
    count: AtomicU64,
}

impl CommObserver {
    /// Nanoseconds spent in collectives so far (every observed group of this process).
    pub fn busy(&self) -> Duration {
        Duration::from_nanos(self.busy_ns.load(Ordering::Relaxed))
    }

    /// Collectives observed so far.
    pub fn count(&self) -> u64 {
        self.count.load(Ordering::Relaxed)
    }
}

impl CollectiveObserver for CommObserver {
    fn collective(&self, e: &CollectiveEvent<'_>) {
        let ns = e.end.saturating_duration_since(e.start).as_nanos() as u64;
        self.busy_ns.fetch_add(ns, Ordering::Relaxed);
        self.count.fetch_add(1, Ordering::Relaxed);
        if enabled() {
            let fp = e.fingerprint;
            record_span(
                e.op_name(),
                "collective",
                e.start,
                e.end,
                vec![
                    ("seq", fp.seq.into()),
                    ("dtype", fp.dtype.to_string().into()),
                    ("count", fp.count.into()),
                    ("bytes", e.bytes.into()),
                    ("ok", e.ok.into()),
                    ("topology", e.topology.to_string().into()),
                ],
            );
        }
    }
}

/// This process's collective observer, installed on `pg` (once per group; a group that already
/// has another observer keeps it and is not counted).
pub fn observe(pg: &ProcessGroup) -> Arc<CommObserver> {
    static COMM: OnceLock<Arc<CommObserver>> = OnceLock::new();
    let obs = COMM
        .get_or_init(|| {
            Arc::new(CommObserver {
                busy_ns: AtomicU64::new(0),
                count: AtomicU64::new(0),
            })
        })
        .clone();
    if !pg.has_observer() {
        pg.set_observer(obs.clone());
    }
    obs
}

/// Turns the timeline on for this process (rank `pg.rank()`), to be merged into
/// `dir/trace.json` by [`finish`]. Every rank of `pg` must call it (and later [`finish`]).
pub fn start(pg: &ProcessGroup, dir: impl Into<PathBuf>) -> Result<()> {
    let dir = dir.into();
    if pg.rank() == 0 {
        std::fs::create_dir_all(&dir).map_err(|e| {
            Error::InvalidArgument(format!("trace directory {}: {e}", dir.display()))
        })?;
    }
    observe(pg);
    epoch();
    *RECORDER.lock().unwrap_or_else(|p| p.into_inner()) = Some(Recorder {
        dir,
        rank: pg.rank(),
        events: Vec::new(),
        dropped: 0,
        threads: Vec::new(),
    });
    ENABLED.store(true, Ordering::Relaxed);
    Ok(())
}

/// [`start`] when `DDP_TRACE` names a directory (or `dir` is given, which wins); returns whether
/// tracing is on. The launcher gives every rank the same environment, so all agree.
pub fn start_from_env(pg: &ProcessGroup, dir: Option<&Path>) -> Result<bool> {
    let dir = match dir {
        Some(d) => Some(d.to_path_buf()),
        None => std::env::var_os(TRACE_ENV)
            .filter(|v| !v.is_empty())
            .map(PathBuf::from),
    };
    match dir {
        Some(d) => start(pg, d).map(|()| true),
        None => Ok(false),
    }
}

/// Stops recording and merges every rank's timeline: a collective over `pg` (every rank that
/// called [`start`] calls it). A barrier ends every rank's recording. Rank 0 writes `DIR/trace.json` and returns its path; other ranks
/// return `None`, as does every rank when tracing was off.
pub fn finish(pg: &ProcessGroup) -> Result<Option<PathBuf>> {
    if enabled() {
        // The last events of every rank: a barrier, which ends at (almost) the same moment
        // everywhere — a visible check of the clock alignment.
        let start = Instant::now();
        pg.barrier()?;
        record_span(
            "end of trace (barrier)",
            "train",
            start,
            Instant::now(),
            Vec::new(),
        );
    }
    let taken = RECORDER.lock().unwrap_or_else(|p| p.into_inner()).take();
    ENABLED.store(false, Ordering::Relaxed);
    let Some(rec) = taken else {
        return Ok(None);
    };
    let sync = clock::estimate(pg, || clock_ns(Instant::now()))?;
    let local = chrome::rank_events(&rec, &sync);
    let all = pg.all_gather_bytes(&local)?;
    if pg.rank() != 0 {
        return Ok(None);
    }
    let path = rec.dir.join("trace.json");
    chrome::write_merged(&path, &all)?;
    Ok(Some(path))
}
