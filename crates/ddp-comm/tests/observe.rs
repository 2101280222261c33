//! The observer hook: a group with an observer reports each collective (operation, sequence
//! number, bytes, start before end, success) on its engine thread; once per group.

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
fn every_collective_reaches_the_groups_observer_on_its_engine_thread() {
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
        assert!(
            events.iter().all(|e| e.4.starts_with("ddp-comm-r")),
            "not on the engine thread: {events:?}"
        );
    }
}
