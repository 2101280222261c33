//! End-to-end checks of checkpoint integrity with the real `train-digits` binary: an unwritable
//! checkpoint directory fails at start, damaged or forged checkpoints are refused on resume with
//! a clear error (and left as they were), a checkpoint of format 1 (no checksums) still resumes.

use ddp_example_support::testing as common;

use common::Finished;
use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::time::Duration;

use serde_json::{json, Value};

const BIN: &str = env!("CARGO_BIN_EXE_train-digits");

/// Runs train-digits (its launcher, 2 local workers) with a 120 s deadline.
fn run(args: &[&str]) -> Finished {
    common::run_bin(BIN, args, 120)
}

const COMMON: [&str; 5] = ["--nproc", "2", "--epochs", "3", "--json"];

fn with<'a>(extra: &[&'a str]) -> Vec<&'a str> {
    [&COMMON[..], extra].concat()
}

/// Asserts that a resume failed before training with an error containing every one of `want`.
fn assert_refused(f: &Finished, want: &[&str]) {
    assert!(!f.success, "resume succeeded:\n{}", f.stdout);
    for w in want {
        assert!(f.stderr.contains(w), "error lacks {w:?}:\n{}", f.stderr);
    }
    assert!(
        !f.stdout.contains("resuming from") && !f.stdout.contains("held-out accuracy"),
        "{}",
        f.stdout
    );
}

#[test]
fn unwritable_checkpoint_directory_fails_at_start_before_training() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("not-a-directory");
    std::fs::write(&file, b"x").unwrap();
    // A path through a regular file: not writable even for root (chmod would not stop root).
    let bad = file.join("ckpt");
    let f = run(&with(&["--checkpoint-dir", bad.to_str().unwrap()]));
    assert!(!f.success);
    assert!(
        f.stderr.contains("checkpoint directory is not writable")
            && f.stderr.contains(bad.to_str().unwrap()),
        "{}",
        f.stderr
    );
    // Nothing trained: no banner, no epoch line, no summary.
    assert!(
        !f.stdout.contains("train-digits: world_size") && !f.stdout.contains("epoch "),
        "{}",
        f.stdout
    );
    assert!(f.elapsed < Duration::from_secs(60), "took {:?}", f.elapsed);
}

fn header(bytes: &[u8]) -> (usize, Value) {
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    (n, serde_json::from_slice(&bytes[8..8 + n]).unwrap())
}

type Tensors = BTreeMap<String, (Vec<usize>, Vec<u8>)>;

/// Rewrites the checkpoint as a forger would: `edit` changes metadata and tensors, and every
/// checksum is recomputed (`sealed`), or, without `sealed`, written as format 1 (no checksums).
fn rewrite(path: &Path, sealed: bool, edit: impl FnOnce(&mut Value, &mut Tensors)) {
    let bytes = std::fs::read(path).unwrap();
    let (_, h) = header(&bytes);
    let mut meta: Value =
        serde_json::from_str(h["__metadata__"]["ddp_meta"].as_str().unwrap()).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut tensors: Tensors = st
        .tensors()
        .into_iter()
        .map(|(k, v)| (k, (v.shape().to_vec(), v.data().to_vec())))
        .collect();
    edit(&mut meta, &mut tensors);
    let obj = meta.as_object_mut().unwrap();
    obj.remove("meta_crc32");
    if sealed {
        let sums: serde_json::Map<String, Value> = tensors
            .iter()
            .map(|(k, (s, d))| {
                let crc = format!("{:08x}", crc32fast::hash(d));
                (k.clone(), json!({"shape": s, "crc32": crc}))
            })
            .collect();
        obj.insert("tensors".into(), sums.into());
    }
    let mut s = serde_json::to_string(&meta).unwrap();
    if sealed {
        s.pop();
        s.push_str(",\"meta_crc32\":\"00000000\"}");
        let crc = format!("{:08x}", crc32fast::hash(s.as_bytes()));
        let at = s.len() - 10;
        s.replace_range(at..at + 8, &crc);
    }
    let views: Vec<_> = tensors
        .iter()
        .map(|(k, (shape, d))| {
            let v = safetensors::tensor::TensorView::new(safetensors::Dtype::F32, shape.clone(), d);
            (k.clone(), v.unwrap())
        })
        .collect();
    let info = Some(HashMap::from([("ddp_meta".to_string(), s)]));
    std::fs::write(path, safetensors::serialize(views, &info).unwrap()).unwrap();
}

#[test]
fn damaged_or_forged_checkpoints_are_refused_on_resume_and_kept() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().to_str().unwrap();
    let path = dir.path().join("checkpoint.safetensors");
    let o = ["--optimizer", "sgd", "--momentum", "0.9"];
    let part = run(&with(
        &[&o[..], &["--max-steps", "30", "--checkpoint-dir", d]].concat(),
    ));
    assert!(part.success, "{}", part.stderr);
    let good = std::fs::read(&path).unwrap();
    let resume = with(&[&o[..], &["--resume", "--checkpoint-dir", d]].concat());

    // A flipped bit in a tensor's data.
    let (n, h) = header(&good);
    let at = 8 + n + h["fc2.bias"]["data_offsets"][0].as_u64().unwrap() as usize + 5;
    let mut bad = good.clone();
    bad[at] ^= 0x10;
    std::fs::write(&path, &bad).unwrap();
    let f = run(&resume);
    assert_refused(&f, &["\"fc2.bias\"", "checksum"]);
    assert_eq!(
        std::fs::read(&path).unwrap(),
        bad,
        "the refused file was changed"
    );

    // A flipped bit in the metadata (a digit of the step count).
    let mut bad = good.clone();
    let at = bad.windows(8).position(|w| w == b"\"step\\\":").unwrap();
    bad[at + 8] ^= 1; // "30" -> "20"
    std::fs::write(&path, &bad).unwrap();
    assert_refused(&run(&resume), &["metadata checksum mismatch"]);

    // A NaN in a momentum buffer, checksums recomputed.
    std::fs::write(&path, &good).unwrap();
    rewrite(&path, true, |_, t| {
        let d = &mut t.get_mut("optim.fc1.weight.momentum_buffer").unwrap().1;
        d[..4].copy_from_slice(&f32::NAN.to_le_bytes());
    });
    assert_refused(
        &run(&resume),
        &["\"optim.fc1.weight.momentum_buffer\"", "non-finite"],
    );

    // step = 2^64 - 3: out of range, not wrapped.
    std::fs::write(&path, &good).unwrap();
    rewrite(&path, true, |m, _| m["step"] = json!(u64::MAX - 2));
    assert_refused(
        &run(&resume),
        &["step = 18446744073709551613", "out of range"],
    );

    // A self-consistent position past the end: it would skip training and exit 0.
    std::fs::write(&path, &good).unwrap();
    rewrite(&path, true, |m, _| {
        m["epoch"] = json!(100);
        m["step"] = json!(2300);
        m["sampler"] = json!({"epoch": 100, "consumed": 0});
    });
    assert_refused(
        &run(&resume),
        &["epoch 100 is past the end of this run (3 epochs)"],
    );

    // A step count that does not match the sampler position.
    std::fs::write(&path, &good).unwrap();
    rewrite(&path, true, |m, _| m["step"] = json!(3));
    assert_refused(
        &run(&resume),
        &["step 3 does not match", "expected step 30"],
    );

    // The same checkpoint in format 1 (as written before checksums) still resumes.
    std::fs::write(&path, &good).unwrap();
    rewrite(&path, false, |m, _| {
        m["format_version"] = json!(1);
        let obj = m.as_object_mut().unwrap();
        obj.remove("optimizer");
        obj.remove("tensors");
    });
    let f = run(&resume);
    assert!(f.success, "{}", f.stderr);
    assert!(
        f.stdout.contains("at step 30, epoch 1, 224 samples"),
        "{}",
        f.stdout
    );
}
