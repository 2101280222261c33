//! `ddp-bench trace-cost`: what one timeline span costs the thread that records it, with tracing
//! off (one relaxed atomic load) and on (two clock reads and an append under a lock), so that a
//! training step's tracing overhead is about (spans per step) × (cost per span).

use crate::train::Error;
use crate::TraceCostArgs;
use ddp_comm::{init_process_group, InitOptions};
use ddp_core::trace;
use std::time::Instant;

/// Median ns per `trace::span` guard over `args.reps` runs of `args.spans` spans.
fn per_span(args: &TraceCostArgs) -> f64 {
    let mut ns: Vec<f64> = (0..args.reps)
        .map(|_| {
            let t = Instant::now();
            for i in 0..args.spans {
                let _s = trace::span("bench", "bench").arg("i", i);
                std::hint::black_box(&i);
            }
            t.elapsed().as_nanos() as f64 / args.spans as f64
        })
        .collect();
    ns.sort_by(f64::total_cmp);
    ns[ns.len() / 2]
}

pub fn run(args: &TraceCostArgs) -> Result<(), Error> {
    let pg = init_process_group(InitOptions::default())?;
    let off = per_span(args);
    let dir = std::env::temp_dir().join(format!("ddp-trace-cost-{}", std::process::id()));
    trace::start(&pg, &dir)?;
    let on = per_span(args);
    let path = trace::finish(&pg)?;
    if let Some(p) = &path {
        std::fs::remove_file(p)?;
    }
    std::fs::remove_dir_all(&dir).ok();
    println!(
        "# ddp-bench trace-cost  {} spans x {} reps (median)",
        args.spans, args.reps
    );
    println!("span with tracing off: {off:.1} ns   on: {on:.1} ns");
    Ok(())
}
