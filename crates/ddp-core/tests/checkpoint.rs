//! Checkpoint files on a real file system: round trip, interrupted saves, damaged files.

use std::fs;

use ddp_core::checkpoint::{self, checkpoint_path, CHECKPOINT_FILE};
use ddp_core::{Checkpoint, CheckpointMeta, SamplerState};

fn sample(step: u64) -> Checkpoint {
    let mut ck = Checkpoint::new(CheckpointMeta {
        step,
        epoch: 3,
        sampler: SamplerState {
            epoch: 3,
            consumed: 17,
        },
        rng_state: 0xDEAD_BEEF_0000_0001,
        world_size: 2,
        extra: serde_json::json!({"lr": 0.05, "hidden": [64, 32], "note": "é"}),
    });
    let w: Vec<f32> = (0..12).map(|i| i as f32 * 0.5 - step as f32).collect();
    ck.insert("fc1.weight", vec![3, 4], w.clone()).unwrap();
    ck.insert("fc1.bias", vec![3], vec![f32::MIN_POSITIVE, -0.0, f32::MAX])
        .unwrap();
    ck.insert("scalar", vec![], vec![step as f32]).unwrap();
    ck.insert("empty", vec![0, 5], vec![]).unwrap();
    ck.insert(Checkpoint::optim_key("fc1.weight", "m"), vec![3, 4], w)
        .unwrap();
    ck
}

#[test]
fn round_trip_preserves_tensors_and_meta_bit_for_bit() {
    let dir = tempfile::tempdir().unwrap();
    let ck = sample(42);
    let path = checkpoint::save_atomic(dir.path(), &ck).unwrap();
    assert_eq!(path, dir.path().join(CHECKPOINT_FILE));

    let back = checkpoint::load(dir.path())
        .unwrap()
        .expect("checkpoint present");
    assert_eq!(back, ck);
    let b = back.get("fc1.bias").unwrap();
    assert_eq!(
        b.data[1].to_bits(),
        (-0.0f32).to_bits(),
        "sign of zero kept"
    );
    assert_eq!(
        back.require("optim.fc1.weight.m").unwrap().shape,
        vec![3, 4]
    );
    let params: Vec<&str> = back.params().map(|(n, _)| n).collect();
    assert_eq!(params, vec!["empty", "fc1.bias", "fc1.weight", "scalar"]);
    back.meta.check_world_size(2).unwrap();
    let e = back.meta.check_world_size(4).unwrap_err().to_string();
    assert!(
        e.contains("world_size 2") && e.contains("world_size 4"),
        "{e}"
    );
    let e = back.require("fc2.weight").unwrap_err().to_string();
    assert!(e.contains("fc2.weight"), "{e}");

    // Deterministic bytes, and only the checkpoint file is left in the directory.
    assert_eq!(fs::read(&path).unwrap(), ck.to_bytes().unwrap());
    let names: Vec<_> = fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(names, vec![CHECKPOINT_FILE]);
}

#[test]
fn file_is_plain_safetensors_with_meta_in_header() {
    let dir = tempfile::tempdir().unwrap();
    let path = checkpoint::save_atomic(dir.path(), &sample(1)).unwrap();
    let bytes = fs::read(path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let w = st.tensor("fc1.weight").unwrap();
    assert_eq!(w.dtype(), safetensors::Dtype::F32);
    assert_eq!(w.shape(), &[3, 4]);
    assert_eq!(&w.data()[4..8], &(0.5f32 - 1.0).to_le_bytes());
    let (_, header) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
    let meta: serde_json::Value =
        serde_json::from_str(&header.metadata().as_ref().unwrap()[checkpoint::META_KEY]).unwrap();
    assert_eq!(meta["step"], 1);
    assert_eq!(meta["sampler"]["consumed"], 17);
    assert_eq!(meta["extra"]["hidden"][1], 32);
}

#[test]
fn missing_checkpoint_is_none_and_save_creates_the_directory() {
    let dir = tempfile::tempdir().unwrap();
    assert!(checkpoint::load(dir.path()).unwrap().is_none());
    let nested = dir.path().join("a/b");
    assert!(checkpoint::load(&nested).unwrap().is_none());
    checkpoint::save_atomic(&nested, &sample(2)).unwrap();
    assert_eq!(checkpoint::load(&nested).unwrap().unwrap().meta.step, 2);
}

#[test]
fn save_replaces_the_previous_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    checkpoint::save_atomic(dir.path(), &sample(1)).unwrap();
    checkpoint::save_atomic(dir.path(), &sample(2)).unwrap();
    assert_eq!(checkpoint::load(dir.path()).unwrap().unwrap(), sample(2));
}

#[test]
fn interrupted_save_leaves_previous_checkpoint_intact() {
    let dir = tempfile::tempdir().unwrap();
    checkpoint::save_atomic(dir.path(), &sample(10)).unwrap();

    // A writer killed mid-save leaves a half-written temp file and never renames it.
    let next = sample(11).to_bytes().unwrap();
    let tmp = dir.path().join(".checkpoint.safetensors.tmp.99999");
    fs::write(&tmp, &next[..next.len() / 2]).unwrap();
    assert_eq!(checkpoint::load(dir.path()).unwrap().unwrap(), sample(10));

    // The next save succeeds and the stale temp file does not confuse anything.
    checkpoint::save_atomic(dir.path(), &sample(12)).unwrap();
    assert_eq!(checkpoint::load(dir.path()).unwrap().unwrap(), sample(12));
}

#[test]
fn killed_writer_process_never_exposes_a_torn_checkpoint() {
    // A real child process saves 4 MiB checkpoints in a loop and is SIGKILLed at some point;
    // whatever the moment, the directory holds a complete checkpoint from one of its saves.
    let dir = tempfile::tempdir().unwrap();
    let exe = std::env::current_exe().unwrap();
    let (mut loaded, mut killed_mid_write) = (0, 0);
    for delay_ms in [20u64, 60, 100, 150, 200, 300, 400, 600] {
        // Temp files of earlier children, so that one left now is this child's.
        for entry in fs::read_dir(dir.path()).unwrap() {
            let path = entry.unwrap().path();
            if path.file_name().unwrap() != CHECKPOINT_FILE {
                fs::remove_file(path).unwrap();
            }
        }
        let mut child = std::process::Command::new(&exe)
            .args(["--exact", "checkpoint_writer_child", "--ignored"])
            .env("DDP_CKPT_CHILD_DIR", dir.path())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        std::thread::sleep(std::time::Duration::from_millis(delay_ms));
        child.kill().unwrap();
        child.wait().unwrap();
        let temp_left = fs::read_dir(dir.path())
            .unwrap()
            .any(|e| e.unwrap().file_name() != CHECKPOINT_FILE);
        if let Some(ck) = checkpoint::load(dir.path()).unwrap() {
            let step = ck.meta.step;
            assert_eq!(ck, big(step), "checkpoint of step {step} is torn");
            loaded += 1;
            killed_mid_write += temp_left as u32;
        }
        if loaded > 0 && killed_mid_write > 0 {
            break;
        }
    }
    assert!(loaded > 0, "the writer child never completed a checkpoint");
    eprintln!("{loaded} loads after kills, {killed_mid_write} with a save interrupted mid-write");
}

fn big(step: u64) -> Checkpoint {
    let mut ck = Checkpoint::new(CheckpointMeta {
        step,
        ..Default::default()
    });
    let n = 1 << 20;
    ck.insert(
        "w",
        vec![n],
        (0..n).map(|i| (i as u64 + step) as f32).collect(),
    )
    .unwrap();
    ck
}

/// Child of `killed_writer_process_never_exposes_a_torn_checkpoint`; does nothing when run alone.
#[test]
#[ignore]
fn checkpoint_writer_child() {
    let Some(dir) = std::env::var_os("DDP_CKPT_CHILD_DIR") else {
        return;
    };
    for step in 0..200 {
        checkpoint::save_atomic(std::path::Path::new(&dir), &big(step)).unwrap();
    }
}

#[test]
fn corrupted_checkpoint_is_a_clear_error_naming_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = checkpoint::save_atomic(dir.path(), &sample(5)).unwrap();
    let bytes = fs::read(&path).unwrap();

    // Truncated.
    fs::write(&path, &bytes[..bytes.len() - 3]).unwrap();
    let e = checkpoint::load(dir.path()).unwrap_err().to_string();
    assert!(e.contains(&path.display().to_string()), "{e}");
    assert!(e.contains("corrupted"), "{e}");

    // Garbage.
    fs::write(&path, b"definitely not a checkpoint").unwrap();
    let e = checkpoint::load(dir.path()).unwrap_err().to_string();
    assert!(e.contains(&path.display().to_string()), "{e}");

    // Empty.
    fs::write(&path, b"").unwrap();
    assert!(checkpoint::load(dir.path()).is_err());
}

#[test]
fn foreign_safetensors_files_are_rejected_clearly() {
    let dir = tempfile::tempdir().unwrap();
    let path = checkpoint_path(dir.path());

    // A valid safetensors file without our metadata.
    let data = [0u8; 8];
    let view =
        safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![2], &data).unwrap();
    fs::write(&path, safetensors::serialize([("w", view)], &None).unwrap()).unwrap();
    let e = checkpoint::load(dir.path()).unwrap_err().to_string();
    assert!(e.contains("ddp_meta") && e.contains(CHECKPOINT_FILE), "{e}");

    // Our metadata but an f64 tensor.
    let meta = sample(0).to_bytes().unwrap();
    let (_, header) = safetensors::SafeTensors::read_metadata(&meta).unwrap();
    let info = header.metadata().clone();
    let data = [0u8; 16];
    let view =
        safetensors::tensor::TensorView::new(safetensors::Dtype::F64, vec![2], &data).unwrap();
    fs::write(
        &path,
        safetensors::serialize([("w64", view)], &info).unwrap(),
    )
    .unwrap();
    let e = checkpoint::load(dir.path()).unwrap_err().to_string();
    assert!(e.contains("w64") && e.contains("F64"), "{e}");
}

#[test]
fn inconsistent_tensors_are_refused_before_writing() {
    let mut ck = sample(0);
    let e = ck
        .insert("bad", vec![2, 2], vec![1.0; 3])
        .unwrap_err()
        .to_string();
    assert!(e.contains("bad") && e.contains("[2, 2]"), "{e}");
    ck.tensors.insert(
        "bad".into(),
        ddp_core::TensorData {
            shape: vec![5],
            data: vec![0.0; 4],
        },
    );
    let dir = tempfile::tempdir().unwrap();
    assert!(checkpoint::save_atomic(dir.path(), &ck).is_err());
    assert!(checkpoint::load(dir.path()).unwrap().is_none());
}

#[test]
fn only_rank0_writes() {
    let dir = tempfile::tempdir().unwrap();
    assert_eq!(
        checkpoint::save_if_rank0(1, dir.path(), &sample(7)).unwrap(),
        None
    );
    assert!(checkpoint::load(dir.path()).unwrap().is_none());
    let p = checkpoint::save_if_rank0(0, dir.path(), &sample(7)).unwrap();
    assert_eq!(p, Some(checkpoint_path(dir.path())));
    assert_eq!(checkpoint::load(dir.path()).unwrap().unwrap().meta.step, 7);
}
