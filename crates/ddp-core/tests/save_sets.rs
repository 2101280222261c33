//! Save sets on disk, through the public API with real collectives among threads: a failed save
//! removes its partial set and keeps the previous one current; a pointer file naming anything
//! but one set of its directory is refused naming the file; a save removes only its own old sets;
//! a directory is prepared (locked, probed) before a sharded run trains.

use ddp_comm::testing::run_local_group;
use ddp_comm::DType;
use ddp_core::checkpoint::{CheckpointMeta, OptimizerRecord};
use ddp_core::reducer::{BucketInfo, ParamSpec};
use ddp_core::sharding::{self, ChunkState, ShardLayout, ShardState};
use std::path::Path;

fn specs() -> Vec<ParamSpec> {
    vec![
        ParamSpec::new("b", vec![3], DType::F32),
        ParamSpec::new("w", vec![2, 5], DType::F32),
    ]
}

fn layout(world: usize, rank: usize) -> ShardLayout {
    let buckets = [BucketInfo {
        dtype: DType::F32,
        params: vec![1, 0],
        numel: 13,
    }];
    ShardLayout::new(&specs(), &buckets, world, rank).unwrap()
}

/// Rank `rank`'s state: parameter values `base + global element index`.
fn state(layout: &ShardLayout, base: f32) -> ShardState {
    ShardState {
        optimizer: OptimizerRecord::default(),
        chunks: layout
            .chunks()
            .iter()
            .map(|c| ChunkState {
                params: (0..c.len()).map(|i| base + i as f32).collect(),
                slots: Default::default(),
            })
            .collect(),
    }
}

fn meta(step: u64) -> CheckpointMeta {
    CheckpointMeta {
        step,
        world_size: 2,
        ..Default::default()
    }
}

fn entries(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| !n.starts_with('.'))
        .collect();
    v.sort();
    v
}

#[test]
fn a_failed_save_removes_its_partial_set_and_keeps_the_previous_one() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let first = run_local_group(2, Default::default(), |pg| {
        let l = layout(2, pg.rank());
        sharding::prepare_dir(&pg, d).unwrap();
        sharding::save_sharded(&pg, d, &l, &specs(), &state(&l, 1.0), &meta(5)).unwrap()
    });
    let before = entries(d);
    assert_eq!(before.len(), 2, "{before:?}"); // the set and zero_latest
                                               // Rank 1 hands a state of the wrong shape: its save fails after rank 0 wrote its shard.
    let errs = run_local_group(2, Default::default(), |pg| {
        let l = layout(2, pg.rank());
        let mut s = state(&l, 2.0);
        if pg.rank() == 1 {
            s.chunks.push(ChunkState::default());
        }
        sharding::save_sharded(&pg, d, &l, &specs(), &s, &meta(9))
            .unwrap_err()
            .to_string()
    });
    assert!(errs[1].contains("chunk states"), "{errs:?}");
    assert!(errs[0].contains("rank(s) [1]"), "{errs:?}");
    assert_eq!(entries(d), before, "the partial set was left behind");
    assert_eq!(sharding::latest_set(d).unwrap().unwrap(), first[0]);
    let m = sharding::set_meta(d).unwrap().unwrap();
    assert_eq!(m.step, 5);
}

#[test]
fn pointers_outside_the_directory_are_refused_and_saves_remove_only_their_own_sets() {
    let root = tempfile::tempdir().unwrap();
    let d = root.path().join("ck");
    let victim = root.path().join("victim");
    std::fs::create_dir_all(victim.join("rank0")).unwrap();
    std::fs::create_dir_all(&d).unwrap();
    // Set-named but not ours: no index of this format.
    let foreign = "zero-step0000000001-0000000000000001";
    std::fs::create_dir(d.join(foreign)).unwrap();
    for (pointer, why) in [
        (victim.to_str().unwrap().to_string(), "it says"),
        ("../victim".into(), "it says"),
        ("zero-step0000000001-00000000000000zz".into(), "it says"),
        ("".into(), "it is empty"),
        (
            "zero-step0000000002-0000000000000002".into(),
            "cannot be read",
        ),
    ] {
        std::fs::write(d.join("zero_latest"), &pointer).unwrap();
        let e = sharding::latest_set(&d).unwrap_err().to_string();
        assert!(
            e.contains("zero_latest") && e.contains(why),
            "{pointer:?}: {e}"
        );
        // A save over the bad pointer replaces it and deletes nothing it does not own.
        let sets = run_local_group(2, Default::default(), |pg| {
            let l = layout(2, pg.rank());
            sharding::save_sharded(&pg, &d, &l, &specs(), &state(&l, 1.0), &meta(7)).unwrap()
        });
        assert!(
            victim.join("rank0").exists(),
            "{pointer:?} deleted the victim"
        );
        assert!(d.join(foreign).exists());
        assert_eq!(sharding::latest_set(&d).unwrap().unwrap(), sets[0]);
        // Exactly one set of ours: the older ones are gone.
        let ours: Vec<String> = entries(&d)
            .into_iter()
            .filter(|n| sharding::is_set_name(n) && n != foreign)
            .collect();
        assert_eq!(ours.len(), 1, "{ours:?}");
    }
    assert!(!sharding::is_set_name(
        "zero-step0000000001-00000000000000aa/.."
    ));
    assert!(!sharding::is_set_name("zero-step01-00000000000000aa"));
}

#[test]
fn prepare_dir_locks_the_directory_and_refuses_a_path_through_a_file() {
    let root = tempfile::tempdir().unwrap();
    let file = root.path().join("file");
    std::fs::write(&file, b"x").unwrap();
    let errs = run_local_group(2, Default::default(), |pg| {
        sharding::prepare_dir(&pg, &file.join("ck"))
            .unwrap_err()
            .to_string()
    });
    assert!(errs[0].contains("not writable"), "{errs:?}");
    assert!(errs[1].contains("rank(s) [0]"), "{errs:?}");
    let d = root.path().join("ck");
    run_local_group(2, Default::default(), |pg| {
        sharding::prepare_dir(&pg, &d).unwrap();
    });
    let holder = std::fs::read_to_string(d.join(ddp_core::checkpoint::LOCK_FILE)).unwrap();
    assert!(
        holder.contains(&format!("pid {}", std::process::id())),
        "{holder}"
    );
}

/// A set written by a later format (its index otherwise unreadable to this release) is refused
/// with both formats named, not called corrupted; the set stays as it was.
#[test]
fn a_set_of_another_format_is_refused_naming_both_formats() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let set = run_local_group(2, Default::default(), |pg| {
        let l = layout(2, pg.rank());
        sharding::prepare_dir(&pg, d).unwrap();
        sharding::save_sharded(&pg, d, &l, &specs(), &state(&l, 1.0), &meta(5)).unwrap()
    });
    let index = set[0].join("index.json");
    std::fs::write(
        &index,
        br#"{"format": "ddp-zero-9", "everything": ["else", "changed"]}"#,
    )
    .unwrap();
    let e = sharding::consolidate(d).unwrap_err().to_string();
    assert!(
        e.contains("\"ddp-zero-9\"") && e.contains("\"ddp-zero-1\""),
        "{e}"
    );
    assert!(e.contains(&index.display().to_string()), "{e}");
    assert!(!e.contains("not a sharded checkpoint"), "{e}");
}
