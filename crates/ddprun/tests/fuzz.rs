//! Fuzzing the launcher's configuration: torchrun's flags, whose `PET_*` environment variables
//! (`PET_NPROC_PER_NODE`, `PET_NNODES`, `PET_MASTER_PORT`, ...) go through the same parsers.
//! Random flags with random values (numbers in and out of range, huge, negative, empty, ranges,
//! host:port pairs, any text) must give a configuration or a clear error, never a panic.
//!
//! `FUZZ_CASES` sets the number of command lines (default small, for CI); a long pass:
//! `FUZZ_CASES=1000000 cargo test -p ddprun --test fuzz`.

use clap::Parser;
use ddp_comm::fuzzing::cases;
use ddprun::Args;
use proptest::collection::vec;
use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};

const FLAGS: &[&str] = &[
    "--nproc-per-node",
    "--nnodes",
    "--node-rank",
    "--master-addr",
    "--master-port",
    "--rdzv-endpoint",
    "--rdzv-backend",
    "--rdzv-timeout",
    "--run-id",
    "--max-restarts",
    "--monitor-interval",
    "--stop-grace-period",
    "--rdzv-last-call",
    "--heartbeat-timeout",
    "--redirects",
    "--tee",
    "--log-dir",
    "--local-ranks-filter",
];

fn value() -> impl Strategy<Value = String> {
    prop_oneof![
        (0u64..10).prop_map(|n| n.to_string()),
        any::<u64>().prop_map(|n| n.to_string()),
        any::<i64>().prop_map(|n| n.to_string()),
        any::<f64>().prop_map(|x| x.to_string()),
        Just("99999999999999999999999".to_string()),
        Just("1e400".to_string()),
        Just("NaN".to_string()),
        Just("auto".to_string()),
        Just("gpu".to_string()),
        Just(String::new()),
        (0u32..5, 0u32..5).prop_map(|(a, b)| format!("{a}:{b}")),
        Just("[::1]:29500".to_string()),
        Just("host:99999".to_string()),
        Just("0:1,1:3".to_string()),
        Just("c10d".to_string()),
        "[0-9:,\\[\\]a-z.-]{0,12}",
        "\\PC{0,16}",
    ]
}

#[test]
fn any_flags_give_a_configuration_or_a_clear_error() {
    let strat = (
        vec((proptest::sample::select(FLAGS), value()), 0..6),
        any::<bool>(),
    );
    let mut runner = TestRunner::new(Config {
        cases: cases(10_000),
        failure_persistence: None,
        ..Config::default()
    });
    let (configs, refused) = (std::cell::Cell::new(0u64), std::cell::Cell::new(0u64));
    runner
        .run(&strat, |(flags, standalone)| {
            let mut argv = vec!["ddprun".to_string()];
            if standalone {
                argv.push("--standalone".into());
            }
            for (f, v) in flags {
                argv.push(format!("{f}={v}"));
            }
            argv.push("true".into());
            match Args::try_parse_from(&argv) {
                Ok(args) => match args.into_config() {
                    Ok(cfg) => {
                        configs.set(configs.get() + 1);
                        prop_assert!(cfg.nproc_per_node >= 1, "{argv:?}");
                        prop_assert!(cfg.node_rank < cfg.nnodes, "{argv:?}");
                    }
                    Err(e) => {
                        refused.set(refused.get() + 1);
                        prop_assert!(!e.is_empty(), "{argv:?}");
                    }
                },
                Err(e) => {
                    refused.set(refused.get() + 1);
                    prop_assert!(!e.to_string().is_empty());
                }
            }
            Ok(())
        })
        .unwrap();
    eprintln!(
        "ddprun flags: {} configurations, {} refused",
        configs.get(),
        refused.get()
    );
}

/// Elastic rendezvous entries come from other launchers through the store: any text decodes to
/// an entry or to nothing (a clear error at the caller), never a panic; entries round-trip.
#[test]
fn elastic_store_entries_decode_or_are_refused() {
    use ddprun::elastic::rdzv::{Closed, End, Member};
    let text = prop_oneof![
        "\\PC{0,40}",
        "[0-9a-z=;,\n]{0,40}",
        (any::<u64>(), any::<i64>(), "[0-9,]{0,20}").prop_map(|(a, b, c)| format!("{a}\n{b}\n{c}")),
        "(nproc|min|max|max_restarts|pid|host)=[0-9a-z-]{0,20}(;[a-z_]{0,12}=[0-9a-z]{0,20}){0,6}",
    ];
    let mut runner = TestRunner::new(Config {
        cases: cases(20_000),
        failure_persistence: None,
        ..Config::default()
    });
    runner
        .run(&(text, any::<u64>()), |(s, id)| {
            let _ = Member::decode(id, &s);
            let _ = Closed::decode(&s);
            let _ = End::decode(&s);
            Ok(())
        })
        .unwrap();
    let member = (any::<u64>(), any::<usize>(), any::<u32>(), "\\PC{0,20}");
    runner
        .run(&member, |(id, n, r, host)| {
            let m = Member {
                id,
                nproc: n,
                min: n / 2,
                max: n,
                max_restarts: r,
                ft: r % 2 == 1,
                pid: r,
                host,
            };
            prop_assert_eq!(Member::decode(id, &m.encode()), Some(m));
            Ok(())
        })
        .unwrap();
}
