//! Integrity of checkpoint files on a real file system: checksums (every single-bit flip of a file
//! is an error), non-finite values, forged metadata (valid checksums, impossible positions), the
//! format-1 files of earlier versions, the directory writability probe, and optimizer state.

use std::collections::BTreeMap;
use std::fs;
use std::path::Path;
use std::sync::{Arc, Mutex};

use ddp_core::checkpoint::{
    self, ensure_writable, OptimizerState, OptimizerStateDict, RunPlan, TrainingState, META_KEY,
};
use ddp_core::{Checkpoint, CheckpointMeta, SamplerState};
use serde_json::{json, Value};

type Tensors = BTreeMap<String, (Vec<usize>, Vec<u8>)>;

fn sample() -> Checkpoint {
    let mut ck = Checkpoint::new(CheckpointMeta {
        step: 50,
        epoch: 2,
        sampler: SamplerState {
            epoch: 2,
            consumed: 128,
        },
        rng_state: 7,
        world_size: 2,
        extra: json!({"lr": 0.2, "batch_size": 32}),
    });
    ck.insert(
        "fc1.weight",
        vec![3, 4],
        (0..12).map(|i| i as f32 - 5.5).collect(),
    )
    .unwrap();
    ck.insert("fc1.bias", vec![3], vec![0.25, -0.0, 1e-3])
        .unwrap();
    let mut state = OptimizerStateDict::new("toy", 50);
    state.hyper.insert("lr".into(), 0.2);
    state
        .insert("fc1.bias", "momentum_buffer", vec![3], vec![0.5, 0.1, -2.0])
        .unwrap();
    ck.set_optimizer_state(state).unwrap();
    ck
}

/// 1437 images over 2 ranks = 719 per rank, batches of 32: 23 steps per epoch (train-digits).
fn plan() -> RunPlan {
    RunPlan {
        world_size: 2,
        samples_per_epoch: 719,
        batch_size: 32,
        epochs: 6,
        max_steps: None,
        hyper: json!({"lr": 0.2, "batch_size": 32}),
        rng_state: 7,
    }
}

fn header(bytes: &[u8]) -> (usize, Value) {
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    (n, serde_json::from_slice(&bytes[8..8 + n]).unwrap())
}

/// Byte range of tensor `name`'s data in a safetensors file.
fn data_range(bytes: &[u8], name: &str) -> std::ops::Range<usize> {
    let (n, h) = header(bytes);
    let o = &h[name]["data_offsets"];
    8 + n + o[0].as_u64().unwrap() as usize..8 + n + o[1].as_u64().unwrap() as usize
}

/// Writes a safetensors file with metadata `meta` and `tensors`; with `sealed`, as a forger who
/// knows the format would: every tensor checksum and the metadata checksum recomputed.
fn write_file(path: &Path, mut meta: Value, tensors: &Tensors, sealed: bool) {
    let obj = meta.as_object_mut().unwrap();
    obj.remove("meta_crc32");
    if sealed {
        let sums: serde_json::Map<String, Value> = tensors
            .iter()
            .map(|(k, (shape, data))| {
                let crc = format!("{:08x}", crc32fast::hash(data));
                (k.clone(), json!({"shape": shape, "crc32": crc}))
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
        .map(|(k, (shape, data))| {
            let v =
                safetensors::tensor::TensorView::new(safetensors::Dtype::F32, shape.clone(), data)
                    .unwrap();
            (k.clone(), v)
        })
        .collect();
    let info = Some(std::collections::HashMap::from([(META_KEY.to_string(), s)]));
    fs::write(path, safetensors::serialize(views, &info).unwrap()).unwrap();
}

/// Reads the metadata and tensors of `path`, lets `edit` change them, writes them back sealed.
fn forge(path: &Path, edit: impl FnOnce(&mut Value, &mut Tensors)) {
    let bytes = fs::read(path).unwrap();
    let (_, h) = header(&bytes);
    let mut meta: Value =
        serde_json::from_str(h["__metadata__"][META_KEY].as_str().unwrap()).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut tensors: Tensors = st
        .tensors()
        .into_iter()
        .map(|(k, v)| (k, (v.shape().to_vec(), v.data().to_vec())))
        .collect();
    edit(&mut meta, &mut tensors);
    write_file(path, meta, &tensors, true);
}

fn saved() -> (tempfile::TempDir, std::path::PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let path = checkpoint::save_atomic(dir.path(), &sample()).unwrap();
    (dir, path)
}

fn load_err(dir: &Path) -> String {
    checkpoint::load(dir).unwrap_err().to_string()
}

#[test]
fn flipped_bit_in_a_tensor_is_an_error_naming_the_tensor() {
    let (dir, path) = saved();
    let good = fs::read(&path).unwrap();
    for name in ["fc1.weight", "fc1.bias", "optim.fc1.bias.momentum_buffer"] {
        let range = data_range(&good, name);
        // Every bit of every byte of the tensor, through the file for the first, in memory after.
        for (k, i) in range.clone().enumerate() {
            for bit in 0..8 {
                let mut bad = good.clone();
                bad[i] ^= 1 << bit;
                let e = if k == 0 && bit == 0 {
                    fs::write(&path, &bad).unwrap();
                    load_err(dir.path())
                } else {
                    Checkpoint::from_bytes(&bad, &path.display().to_string())
                        .unwrap_err()
                        .to_string()
                };
                assert!(e.contains(&format!("{name:?}")), "{e}");
                assert!(e.contains("checksum"), "{e}");
                assert!(e.contains(&path.display().to_string()), "{e}");
            }
        }
    }
}

#[test]
fn flipped_bit_anywhere_in_the_header_is_an_error() {
    let (dir, path) = saved();
    let good = fs::read(&path).unwrap();
    let (n, h) = header(&good);
    let meta = h["__metadata__"][META_KEY].as_str().unwrap();
    assert!(meta.contains("\"meta_crc32\":\""), "{meta}");
    // One flip through the file: a digit of rng_state inside the metadata.
    let at = good
        .windows(11)
        .position(|w| w == b"rng_state\\\"")
        .unwrap()
        + 12;
    let mut bad = good.clone();
    bad[at] ^= 1;
    fs::write(&path, &bad).unwrap();
    let e = load_err(dir.path());
    assert!(e.contains("metadata checksum mismatch"), "{e}");
    // Every bit of every header byte: never a silent load.
    for i in 0..8 + n {
        for bit in 0..8 {
            let mut bad = good.clone();
            bad[i] ^= 1 << bit;
            if let Ok(c) = Checkpoint::from_bytes(&bad, "flipped") {
                panic!("flip of bit {bit} of byte {i} loaded silently: {c:?}");
            }
        }
    }
}

#[test]
fn nan_or_infinity_in_a_tensor_is_an_error_naming_it() {
    for bad_value in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
        let (dir, path) = saved();
        forge(&path, |_, t| {
            let data = &mut t.get_mut("fc1.weight").unwrap().1;
            data[20..24].copy_from_slice(&bad_value.to_le_bytes());
        });
        let e = load_err(dir.path());
        assert!(
            e.contains("\"fc1.weight\"") && e.contains("non-finite"),
            "{e}"
        );
        assert!(e.contains("element 5 of 12"), "{e}");
    }
    // Saving one is refused too, and the checkpoint on disk is kept.
    let (dir, _) = saved();
    let mut ck = sample();
    ck.insert("fc2.weight", vec![2], vec![1.0, f32::NAN])
        .unwrap();
    let e = checkpoint::save_atomic(dir.path(), &ck)
        .unwrap_err()
        .to_string();
    assert!(e.contains("\"fc2.weight\"") && e.contains("NaN"), "{e}");
    assert_eq!(checkpoint::load(dir.path()).unwrap().unwrap(), sample());
}

#[test]
fn forged_step_near_u64_max_is_an_error_not_a_wrap() {
    let (dir, path) = saved();
    forge(&path, |m, _| m["step"] = json!(u64::MAX - 2));
    let e = load_err(dir.path());
    assert!(
        e.contains("step = 18446744073709551613") && e.contains("out of range"),
        "{e}"
    );
    // Nor through the plan check, whose arithmetic is checked.
    let mut meta = plan().meta(&TrainingState {
        step: 0,
        epoch: u64::MAX / 2,
        consumed: 0,
    });
    let e = plan().check(&meta).unwrap_err().to_string();
    assert!(e.contains("out of range"), "{e}");
    meta.epoch = 1 << 60;
    meta.sampler.epoch = 1 << 60;
    meta.step = 23 << 60; // wraps to a small number if multiplied unchecked
    assert!(plan().check(&meta).is_err());
    // Saving such metadata is refused.
    let mut ck = sample();
    ck.meta.step = u64::MAX - 2;
    let e = checkpoint::save_atomic(dir.path(), &ck)
        .unwrap_err()
        .to_string();
    assert!(e.contains("out of range"), "{e}");
}

#[test]
fn forged_positions_that_would_skip_or_corrupt_training_are_refused() {
    let (dir, path) = saved();
    let ok = plan().check(&checkpoint::load(dir.path()).unwrap().unwrap().meta);
    assert_eq!(
        ok.unwrap(),
        TrainingState {
            step: 50,
            epoch: 2,
            consumed: 128
        }
    );
    let cases: [(&str, Value, &str); 7] = [
        ("step", json!(43), "expected step 50"),
        (
            "epoch",
            json!(1000),
            "sampler epoch 2 differs from epoch 1000",
        ),
        (
            "sampler",
            json!({"epoch": 5, "consumed": 0}),
            "is after epoch",
        ),
        (
            "sampler",
            json!({"epoch": 2, "consumed": 720}),
            "720 samples consumed",
        ),
        (
            "sampler",
            json!({"epoch": 2, "consumed": 100}),
            "100 samples consumed",
        ),
        ("world_size", json!(0), "world_size = 0"),
        ("extra", json!({"lr": 0.5, "batch_size": 32}), "lr = 0.5"),
    ];
    for (key, value, want) in cases {
        let (dir, path) = saved();
        forge(&path, |m, _| m[key] = value.clone());
        let e = match checkpoint::load(dir.path()) {
            Err(e) => e.to_string(),
            Ok(c) => plan().check(&c.unwrap().meta).unwrap_err().to_string(),
        };
        assert!(e.contains(want), "{key} = {value}: {e}");
    }
    // A consistent position past the end of the run: nothing would be trained.
    forge(&path, |m, _| {
        m["epoch"] = json!(1000);
        m["step"] = json!(23_000);
        m["sampler"] = json!({"epoch": 1000, "consumed": 0});
    });
    let c = checkpoint::load(dir.path()).unwrap().unwrap();
    let e = plan().check(&c.meta).unwrap_err().to_string();
    assert!(
        e.contains("epoch 1000 is past the end of this run (6 epochs)"),
        "{e}"
    );
    let p = RunPlan {
        max_steps: Some(40),
        ..plan()
    };
    let e = p.check(&sample().meta).unwrap_err().to_string();
    assert!(e.contains("past this run's max_steps 40"), "{e}");
}

/// Captures `tracing` output of the current thread.
#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl std::io::Write for Captured {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[test]
fn format_1_checkpoint_without_checksums_loads_with_a_warning() {
    let dir = tempfile::tempdir().unwrap();
    let path = checkpoint::checkpoint_path(dir.path());
    // Written as ddp did before checksums: format_version 1, no "tensors", no seal; AdamW's step
    // as a tensor of two 24-bit halves.
    let meta = json!({
        "format_version": 1, "step": 50, "epoch": 2,
        "sampler": {"epoch": 2, "consumed": 128},
        "rng_state": 7, "world_size": 2, "extra": {"lr": 0.2, "batch_size": 32},
    });
    let f = |v: &[f32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
    let tensors: Tensors = [
        ("fc1.bias".to_string(), (vec![3], f(&[0.25, -0.0, 1e-3]))),
        ("optim.__adamw.step".to_string(), (vec![2], f(&[0.0, 50.0]))),
    ]
    .into();
    write_file(&path, meta, &tensors, false);

    let captured = Captured::default();
    let writer = captured.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_writer(move || writer.clone())
        .with_ansi(false)
        .finish();
    let ck = tracing::subscriber::with_default(subscriber, || checkpoint::load(dir.path()))
        .unwrap()
        .unwrap();
    let log = String::from_utf8(captured.0.lock().unwrap().clone()).unwrap();
    assert!(
        log.contains("WARN") && log.contains("no checksums"),
        "{log}"
    );
    assert!(log.contains(&path.display().to_string()), "{log}");
    assert_eq!(ck.get("fc1.bias").unwrap().data, vec![0.25, -0.0, 1e-3]);
    assert_eq!(plan().check(&ck.meta).unwrap().step, 50);
    let state = ck.optimizer_state();
    assert_eq!(state.kind, "");
    assert_eq!(state.tensors["__adamw.step"].data, vec![0.0, 50.0]);

    // Non-finite values are refused in old files too; a version-1 file with checksums is not one.
    let mut nan = tensors.clone();
    nan.get_mut("fc1.bias").unwrap().1 = f(&[f32::NAN, 0.0, 0.0]);
    write_file(
        &path,
        json!({"format_version": 1, "world_size": 1, "step": 0, "epoch": 0,
        "sampler": {"epoch": 0, "consumed": 0}, "rng_state": 0}),
        &nan,
        false,
    );
    assert!(load_err(dir.path()).contains("\"fc1.bias\""));
    forge(&path, |m, t| {
        t.get_mut("fc1.bias").unwrap().1 = f(&[1.0, 0.0, 0.0]);
        m["format_version"] = json!(1);
    });
    assert!(load_err(dir.path()).contains("later version"));
}

/// A checkpoint of a later format version, whose metadata this release cannot parse, is refused
/// naming its version and the ones this release reads, not called corrupted.
#[test]
fn a_newer_format_version_is_refused_naming_both_versions() {
    let dir = tempfile::tempdir().unwrap();
    let path = checkpoint::checkpoint_path(dir.path());
    let f = |v: &[f32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
    let tensors: Tensors = [("w".to_string(), (vec![1], f(&[1.0])))].into();
    write_file(
        &path,
        json!({"format_version": 3, "position": {"new": "layout"}}),
        &tensors,
        false,
    );
    let e = load_err(dir.path());
    assert!(e.contains("format version 3") && e.contains("newer"), "{e}");
    assert!(
        e.contains(&format!("to {}", checkpoint::FORMAT_VERSION)),
        "{e}"
    );
    assert!(
        e.contains(&path.display().to_string()) && !e.contains("corrupted"),
        "{e}"
    );
}

#[test]
fn unwritable_checkpoint_directory_is_found_before_training() {
    let dir = tempfile::tempdir().unwrap();
    // A path through a regular file fails for root too (chmod would not).
    let file = dir.path().join("a-file");
    fs::write(&file, b"x").unwrap();
    let under_file = file.join("ckpt");
    let e = ensure_writable(&under_file).unwrap_err().to_string();
    assert!(
        e.contains("not writable") && e.contains(&under_file.display().to_string()),
        "{e}"
    );
    let e = ensure_writable(Path::new("/proc/ddp-ckpt-test"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("not writable"), "{e}");
    // A writable one is created, and the probe leaves nothing behind but the directory's lock.
    let fresh = dir.path().join("new/ckpt");
    ensure_writable(&fresh).unwrap();
    let left: Vec<_> = fs::read_dir(&fresh)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(left, [ddp_core::checkpoint::LOCK_FILE]);
}

#[test]
fn temporary_files_of_interrupted_saves_are_removed_at_start() {
    // A rank 0 killed mid-save (or mid-probe) leaves its temporary file; the next start removes
    // it and nothing else.
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    for name in [
        ".checkpoint.safetensors.tmp.4242",
        ".ddp-write-probe.4243",
        "checkpoint.safetensors",
        "notes.txt",
        ".checkpoint.safetensors.tmpfoo",
    ] {
        fs::write(d.join(name), b"x").unwrap();
    }
    ensure_writable(d).unwrap();
    let mut left: Vec<String> = fs::read_dir(d)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    left.sort();
    assert_eq!(
        left,
        [
            ".checkpoint.safetensors.tmpfoo",
            ddp_core::checkpoint::LOCK_FILE,
            "checkpoint.safetensors",
            "notes.txt"
        ]
    );
}

/// A framework-free optimizer: one momentum buffer per parameter, on the host.
struct Toy {
    kind: &'static str,
    step: u64,
    bufs: BTreeMap<String, Vec<f32>>,
}

impl OptimizerState for Toy {
    type Error = ddp_core::Error;
    fn kind(&self) -> &str {
        self.kind
    }
    fn state_dict(&self) -> ddp_core::Result<OptimizerStateDict> {
        let mut s = OptimizerStateDict::new(self.kind, self.step);
        s.hyper.insert("lr".into(), 0.1);
        for (p, b) in &self.bufs {
            s.insert(p, "momentum_buffer", vec![b.len()], b.clone())?;
        }
        Ok(s)
    }
    fn load_state_dict(&mut self, s: &OptimizerStateDict) -> ddp_core::Result<()> {
        self.step = s.step;
        for (p, b) in &mut self.bufs {
            *b = s.get(p, "momentum_buffer").unwrap().data.clone();
        }
        Ok(())
    }
}

#[test]
fn optimizer_state_round_trips_through_a_file_and_kind_is_checked() {
    let dir = tempfile::tempdir().unwrap();
    let opt = Toy {
        kind: "toy",
        step: 9,
        bufs: [("w".to_string(), vec![1.5, -2.0])].into(),
    };
    let mut ck = Checkpoint::new(plan().meta(&TrainingState::default()));
    ck.save_optimizer(&opt).unwrap();
    assert_eq!(
        ck.get("optim.w.momentum_buffer").unwrap().data,
        vec![1.5, -2.0]
    );
    checkpoint::save_atomic(dir.path(), &ck).unwrap();
    let back = checkpoint::load(dir.path()).unwrap().unwrap();
    assert_eq!(back, ck);
    assert_eq!(back.optimizer.as_ref().unwrap().hyper["lr"], 0.1);
    let mut fresh = Toy {
        kind: "toy",
        step: 0,
        bufs: [("w".to_string(), vec![0.0, 0.0])].into(),
    };
    back.load_optimizer(&mut fresh).unwrap();
    assert_eq!((fresh.step, &fresh.bufs), (9, &opt.bufs));
    let mut other = Toy {
        kind: "adamw",
        ..fresh
    };
    let e = back.load_optimizer(&mut other).unwrap_err().to_string();
    assert!(
        e.contains("toy optimizer state") && e.contains("adamw"),
        "{e}"
    );
}

#[test]
fn blobs_round_trip_and_a_flipped_bit_in_one_is_an_error_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    let mut ck = sample();
    let model: Vec<u8> = (0..=255u8).cycle().take(1000).collect();
    ck.insert_blob("burn.model", model.clone());
    ck.insert_blob("burn.empty", Vec::new());
    let path = checkpoint::save_atomic(dir.path(), &ck).unwrap();
    let back = checkpoint::load(dir.path()).unwrap().unwrap();
    assert_eq!(back, ck);
    assert_eq!(back.require_blob("burn.model").unwrap(), &model[..]);
    let e = back.require_blob("burn.optimizer").unwrap_err().to_string();
    assert!(e.contains("\"burn.optimizer\""), "{e}");
    // The blob is shared through `resume_or_start`'s broadcast like the rest (same bytes).
    assert_eq!(
        Checkpoint::from_bytes(&ck.to_bytes().unwrap(), "mem").unwrap(),
        ck
    );

    let good = fs::read(&path).unwrap();
    let range = data_range(&good, "burn.model");
    for i in [range.start, range.start + 500, range.end - 1] {
        for bit in 0..8 {
            let mut bad = good.clone();
            bad[i] ^= 1 << bit;
            let e = Checkpoint::from_bytes(&bad, "flipped")
                .unwrap_err()
                .to_string();
            assert!(e.contains("\"burn.model\""), "{e}");
            assert!(e.contains("checksum"), "{e}");
        }
    }
    // A blob may not shadow a tensor.
    let mut clash = sample();
    clash.insert_blob("fc1.bias", vec![1, 2, 3]);
    let e = clash.to_bytes().unwrap_err().to_string();
    assert!(e.contains("\"fc1.bias\"") && e.contains("unique"), "{e}");
}
