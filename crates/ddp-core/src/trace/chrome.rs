//! The Chrome trace format (`chrome://tracing`, Perfetto): each rank turns its events into JSON
//! on rank 0's clock; rank 0 writes them as one file, a process track per rank (`pid` = rank)
//! and a thread lane per recording thread, with each rank's clock alignment under
//! `otherData.clock_sync`.

use super::{ClockSync, Event, Kind, Recorder};
use crate::error::{Error, Result};
use serde_json::{json, Map, Value};
use std::io::Write;
use std::path::Path;

fn args(e: &Event) -> Value {
    Value::Object(
        e.args
            .iter()
            .map(|(k, v)| (k.to_string(), v.clone()))
            .collect::<Map<_, _>>(),
    )
}

/// Microseconds on rank 0's clock.
fn us(ns: i64, sync: &ClockSync) -> f64 {
    (ns + sync.offset_ns) as f64 / 1e3
}

/// One rank's part: `{"rank", "offset_ns", "rtt_ns", "dropped", "events": [...]}` as bytes.
pub(super) fn rank_events(rec: &Recorder, sync: &ClockSync) -> Vec<u8> {
    let pid = rec.rank;
    let mut events = Vec::with_capacity(rec.events.len() + rec.threads.len() + 2);
    events.push(json!({"ph": "M", "pid": pid, "name": "process_name",
        "args": {"name": format!("rank {pid}")}}));
    events.push(json!({"ph": "M", "pid": pid, "name": "process_sort_index",
        "args": {"sort_index": pid}}));
    for (tid, name) in &rec.threads {
        events.push(
            json!({"ph": "M", "pid": pid, "tid": tid, "name": "thread_name",
            "args": {"name": name}}),
        );
    }
    for e in &rec.events {
        let ts = us(e.ts_ns, sync);
        match e.kind {
            Kind::Complete => events.push(json!({"ph": "X", "pid": pid, "tid": e.tid,
                "name": e.name, "cat": e.cat, "ts": ts, "dur": e.dur_ns as f64 / 1e3,
                "args": args(e)})),
            Kind::Instant => events.push(json!({"ph": "i", "s": "t", "pid": pid, "tid": e.tid,
                "name": e.name, "cat": e.cat, "ts": ts, "args": args(e)})),
            Kind::Async => {
                let id = format!("0x{:x}", e.id);
                events.push(json!({"ph": "b", "pid": pid, "tid": e.tid, "id": id,
                    "name": e.name, "cat": e.cat, "ts": ts, "args": args(e)}));
                events.push(json!({"ph": "e", "pid": pid, "tid": e.tid, "id": id,
                    "name": e.name, "cat": e.cat, "ts": us(e.ts_ns + e.dur_ns, sync)}));
            }
        }
    }
    let part = json!({
        "rank": pid,
        "offset_ns": sync.offset_ns,
        "rtt_ns": sync.rtt_ns,
        "dropped": rec.dropped,
        "events": events,
    });
    serde_json::to_vec(&part).expect("JSON values serialize")
}

/// Rank 0: writes every rank's part (in rank order) as one Chrome trace.
pub(super) fn write_merged(path: &Path, parts: &[Vec<u8>]) -> Result<()> {
    let io = |e: std::io::Error| Error::InvalidArgument(format!("{}: {e}", path.display()));
    let mut f = std::io::BufWriter::new(std::fs::File::create(path).map_err(io)?);
    let mut sync = Vec::with_capacity(parts.len());
    f.write_all(b"{\"displayTimeUnit\":\"ms\",\"traceEvents\":[")
        .map_err(io)?;
    let mut first = true;
    for bytes in parts {
        let mut part: Value = serde_json::from_slice(bytes)
            .map_err(|e| Error::InvalidArgument(format!("a rank's trace is not JSON: {e}")))?;
        let events = part["events"].take();
        for e in events.as_array().into_iter().flatten() {
            if !first {
                f.write_all(b",\n").map_err(io)?;
            }
            first = false;
            serde_json::to_writer(&mut f, e).map_err(|e| io(e.into()))?;
        }
        sync.push(part);
    }
    let other = json!({"clock_sync": sync, "producer": "ddp-rs"});
    write!(f, "],\"otherData\":{other}}}").map_err(io)?;
    f.flush().map_err(io)
}
