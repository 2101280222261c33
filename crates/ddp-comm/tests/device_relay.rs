//! The device path relayed through the host (`ddp_comm::device::relay`) with host memory standing in for
//! the device: every collective, op and dtype against the sequential reference over sizes 0, 1,
//! odd and ≥ 4 MiB and world sizes 1..=5, on TCP and shared-memory groups (the same code
//! `CudaGroup` runs when ranks share a GPU or NCCL is missing); relayed and host collectives
//! interleaved keep one order; bad block sizes fail naming the collective.

mod common;

use common::{check_all, run_ranks, run_ranks_on, sizes};
use ddp_comm::device::relay::RelayGroup;
use ddp_comm::process_group::Backend;
use ddp_comm::{Error, ProcessGroup, ReduceOp};
use half::{bf16, f16};
use std::time::Duration;

/// Every dtype; the ≥ 4 MiB case (f32) only at world sizes 1 and 2, to bound the time on
/// loaded 2-core machines.
fn check_relay(pg: ProcessGroup) {
    let g = RelayGroup::with_vec_relay(&pg);
    let seed = 31 + pg.size() as u64;
    check_all::<f32>(&g, seed, &sizes(seed, pg.size() <= 2));
    check_all::<f64>(&g, seed + 1, &sizes(seed + 1, false));
    check_all::<f16>(&g, seed + 2, &sizes(seed + 2, false));
    check_all::<bf16>(&g, seed + 3, &sizes(seed + 3, false));
    check_all::<i32>(&g, seed + 4, &sizes(seed + 4, false));
    check_all::<i64>(&g, seed + 5, &sizes(seed + 5, false));
    check_all::<u8>(&g, seed + 6, &sizes(seed + 6, false));
}

/// One test per world size, each every collective against the reference over TCP.
macro_rules! relay_worlds {
    ($($name:ident: $world:expr),*) => {$(
        #[test]
        fn $name() {
            run_ranks($world, Duration::from_secs(60), check_relay);
        }
    )*};
}

relay_worlds!(
    relay_world_1_matches_reference: 1,
    relay_world_2_matches_reference: 2,
    relay_world_3_matches_reference: 3,
    relay_world_4_matches_reference: 4,
    relay_world_5_matches_reference: 5
);

#[test]
fn relay_over_shared_memory_matches_reference() {
    run_ranks_on(3, Duration::from_secs(60), None, Backend::Shm, check_relay);
}

/// Async relayed collectives and the group's own host collectives run in issue order on every
/// rank (one engine thread, one sequence), so interleaving them is safe.
#[test]
fn relay_and_host_collectives_keep_one_order() {
    run_ranks(3, Duration::from_secs(30), |pg| {
        let g = RelayGroup::with_vec_relay(&pg);
        let r = pg.rank() as i64;
        let works: Vec<_> = (0..20)
            .map(|i| g.all_reduce_async(vec![r + i; 5], ReduceOp::Sum))
            .collect();
        let mut host = vec![r * 10];
        pg.all_reduce(&mut host, ReduceOp::Max).unwrap();
        for (i, w) in works.into_iter().enumerate() {
            assert_eq!(w.wait().unwrap(), vec![3 + 3 * i as i64; 5], "relayed #{i}");
        }
        assert_eq!(host, vec![20]);
    });
}

#[test]
fn relay_block_size_errors_name_the_collective() {
    run_ranks(2, Duration::from_secs(30), |pg| {
        let g = RelayGroup::with_vec_relay(&pg);
        let e = g
            .all_gather(&vec![1.0f32; 3], &mut vec![0.0f32; 5])
            .unwrap_err();
        assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
        let s = e.to_string();
        assert!(
            s.contains("all_gather") && s.contains("expected 3 x 2 ranks = 6"),
            "{s}"
        );
        let e = g
            .reduce_scatter_async(vec![1i32; 7], vec![0i32; 3], ReduceOp::Sum)
            .wait()
            .unwrap_err();
        assert!(e.to_string().contains("reduce_scatter"), "{e}");
        // the group is still usable
        let mut v = vec![1u8; 4];
        g.all_reduce(&mut v, ReduceOp::Sum).unwrap();
        assert_eq!(v, vec![2u8; 4]);
    });
}
