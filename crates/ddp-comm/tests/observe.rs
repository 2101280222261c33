//! The observer hook: a group with an observer reports each collective (operation, sequence
//! number, bytes, start before end, success) on the thread that runs it (the engine thread for
//! async work; a blocking collective issued while the group is idle runs, and is reported, on
//! the caller's thread); once per group.

use ddp_comm::observe::{CollectiveEvent, CollectiveObserver};
use ddp_comm::testing::run_ranks;
use ddp_comm::ReduceOp;
use std::sync::{Arc, Mutex};

/// Operation, sequence number, bytes, success, thread name.
type Seen = (String, u64, u64, bool, String);

#[derive(Default)]
struct Log(Mutex<Vec<Seen>>);

impl CollectiveObserver for Log {
    fn collective(&self, e: &CollectiveEvent<'_>) {
        assert!(e.start <= e.end);
        let thread = std::thread::current().name().unwrap_or("").to_string();
        self.0.lock().unwrap().push((
            e.op_name().to_string(),
            e.fingerprint.seq,
            e.bytes,
            e.ok,
            thread,
        ));
    }
}

#[test]
fn every_collective_reaches_the_groups_observer_on_the_thread_that_runs_it() {
    let logs = run_ranks(2, |pg| {
        let log = Arc::new(Log::default());
        // Collectives before the observer is set are not reported.
        pg.barrier().unwrap();
        assert!(!pg.has_observer());
        assert!(pg.set_observer(log.clone()));
        assert!(
            !pg.set_observer(Arc::new(Log::default())),
            "a second observer"
        );
        let mut v = vec![1.0f32; 1000];
        pg.all_reduce(&mut v, ReduceOp::Sum).unwrap();
        let w = pg.all_reduce_async(vec![1u8; 10], ReduceOp::Max);
        w.wait().unwrap();
        pg.barrier().unwrap();
        let events = log.0.lock().unwrap().clone();
        events
    });
    for (rank, events) in logs.iter().enumerate() {
        let ops: Vec<(&str, u64, bool)> = events
            .iter()
            .map(|(op, _, bytes, ok, _)| (op.as_str(), *bytes, *ok))
            .collect();
        assert_eq!(
            ops,
            [
                ("all_reduce", 4000, true),
                ("all_reduce", 10, true),
                ("barrier", 0, true)
            ],
            "rank {rank}"
        );
        let seqs: Vec<u64> = events.iter().map(|e| e.1).collect();
        assert!(seqs.windows(2).all(|w| w[1] == w[0] + 1), "{seqs:?}");
        // The async all-reduce ran on the engine thread; the blocking ones, issued while the
        // group was idle, on the caller's (the rank's thread here, which is unnamed).
        let threads: Vec<&str> = events.iter().map(|e| e.4.as_str()).collect();
        assert!(threads[1].starts_with("ddp-comm-r"), "{events:?}");
        assert!(
            threads
                .iter()
                .all(|t| t.is_empty() || t.starts_with("ddp-comm-r")),
            "{events:?}"
        );
    }
}
