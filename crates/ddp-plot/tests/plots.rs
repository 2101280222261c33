//! `ddp-plot` on real outputs: `tests/data/` holds a metrics file of a short `train-digits` run
//! with a rank slowed on purpose (`DDP_DEBUG_SLOW_RANK=1:20ms ... --metrics`) and `ddp-bench
//! allreduce --json` sweeps over TCP and shared memory (see `tests/data/README.md`). The
//! pictures must exist, be valid SVG and PNG, and carry their labels.

use std::path::{Path, PathBuf};
use std::process::Command;

const BIN: &str = env!("CARGO_BIN_EXE_ddp-plot");

fn data(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data")
        .join(name)
}

/// Whether a font for the labels is there (the binary's own search, by its error).
fn font_missing(stderr: &str) -> bool {
    stderr.contains("no TrueType font found")
}

fn plot(inputs: &[PathBuf], out: &Path) -> Option<Vec<String>> {
    let o = Command::new(BIN)
        .args(inputs)
        .arg("--out")
        .arg(out)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&o.stderr);
    if font_missing(&stderr) {
        eprintln!("SKIPPED: {stderr}");
        return None;
    }
    assert!(o.status.success(), "ddp-plot failed: {stderr}");
    Some(
        String::from_utf8(o.stdout)
            .unwrap()
            .lines()
            .map(str::to_string)
            .collect(),
    )
}

fn check_svg(path: &Path, labels: &[&str]) {
    let svg = std::fs::read_to_string(path).unwrap();
    assert!(svg.trim_start().starts_with("<svg"), "{}", path.display());
    assert!(svg.trim_end().ends_with("</svg>"), "{}", path.display());
    assert!(svg.contains("<text"), "no text in {}", path.display());
    for l in labels {
        assert!(svg.contains(l), "{} lacks `{l}`", path.display());
    }
}

/// Decodes the PNG and checks that it is drawn on: many non-white pixels, several colours.
fn check_png(path: &Path) {
    let img = image::open(path)
        .unwrap_or_else(|e| panic!("{} is not a PNG: {e}", path.display()))
        .to_rgb8();
    assert_eq!(img.dimensions(), (900, 520), "{}", path.display());
    let inked = img.pixels().filter(|p| p.0 != [255, 255, 255]).count();
    assert!(
        inked > 900 * 520 / 50,
        "{}: only {inked} pixels drawn",
        path.display()
    );
    let colours: std::collections::HashSet<[u8; 3]> = img
        .pixels()
        .filter(|p| {
            let [r, g, b] = p.0;
            r.abs_diff(g) > 40 || g.abs_diff(b) > 40
        })
        .map(|p| p.0)
        .collect();
    assert!(colours.len() >= 3, "{}: no coloured series", path.display());
}

#[test]
fn metrics_report_and_sweeps_become_labelled_svg_and_png() {
    let out = tempfile::tempdir().unwrap();
    let inputs = [
        data("metrics.jsonl"),
        data("allreduce-tcp.jsonl"),
        data("allreduce-shm.jsonl"),
    ];
    let Some(made) = plot(&inputs, out.path()) else {
        return;
    };
    assert_eq!(made.len(), 8, "{made:?}");
    for (name, labels) in [
        (
            "loss_accuracy",
            &["step", "training loss", "held-out accuracy"][..],
        ),
        ("throughput", &["samples/s", "ms/step"][..]),
        (
            "step_breakdown",
            &[
                "rank 0",
                "rank 1",
                "straggler",
                "waiting for the slowest rank",
                "ms",
            ][..],
        ),
        (
            "busbw",
            &["GB/s", "allreduce-tcp", "allreduce-shm", "MiB"][..],
        ),
    ] {
        let svg = out.path().join(format!("{name}.svg"));
        let png = out.path().join(format!("{name}.png"));
        assert!(made.contains(&svg.display().to_string()), "{made:?}");
        check_svg(&svg, labels);
        check_png(&png);
    }
}

#[test]
fn unusable_inputs_are_named() {
    let dir = tempfile::tempdir().unwrap();
    let bad = dir.path().join("notes.txt");
    std::fs::write(&bad, "hello\n{\"nothing\": 1}\n").unwrap();
    let o = Command::new(BIN)
        .arg(&bad)
        .arg("--out")
        .arg(dir.path())
        .output()
        .unwrap();
    assert!(!o.status.success());
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(stderr.contains("notes.txt"), "{stderr}");
}

/// Evaluation lines of `train-gpt --metrics` (serde_json's spacing) and of the PyTorch peer
/// (Python's, keys in another order) become one `loss_curves` picture with a series per file,
/// named after the file less the prefix they share.
#[test]
fn language_model_evaluations_become_loss_curves() {
    let dir = tempfile::tempdir().unwrap();
    let ours = dir.path().join("gpt-20261207-candle-w2.metrics.jsonl");
    let peer = dir.path().join("gpt-20261207-pytorch-w2.metrics.jsonl");
    let mut a = String::new();
    let mut b = String::new();
    for k in 1..=8 {
        let (step, v) = (250 * k, 4.3 / (1.0 + k as f64 * 0.3));
        a += &format!(
            "{{\"step\":{step},\"train_loss\":{},\"val_loss\":{v},\"elapsed_s\":{k}.5,\
             \"comm_bytes\":{}}}\n",
            v * 0.95,
            k * 3_200_000
        );
        b += &format!(
            "{{\"step\": {step}, \"train_loss\": {}, \"elapsed_s\": {k}.1, \"val_loss\": {}}}\n",
            v * 0.94,
            v * 1.01
        );
    }
    std::fs::write(&ours, a).unwrap();
    std::fs::write(&peer, b).unwrap();
    let out = dir.path().join("out");
    let Some(made) = plot(&[ours, peer], &out) else {
        return;
    };
    assert!(
        made.iter().any(|m| m.ends_with("loss_curves.svg")),
        "{made:?}"
    );
    check_svg(
        &out.join("loss_curves.svg"),
        &[
            "candle-w2: validation",
            "pytorch-w2: validation",
            "Validation loss",
            "step (optimizer steps)",
        ],
    );
    check_png(&out.join("loss_curves.png"));
    // Both files have elapsed_s: against time too; only ours counted its bytes.
    check_svg(
        &out.join("loss_vs_time.svg"),
        &[
            "candle-w2: validation",
            "pytorch-w2: validation",
            "wall-clock time (s)",
        ],
    );
    check_svg(
        &out.join("loss_vs_bytes.svg"),
        &["candle-w2: validation", "bytes sent per rank"],
    );
    let bytes = std::fs::read_to_string(out.join("loss_vs_bytes.svg")).unwrap();
    assert!(
        !bytes.contains("pytorch-w2"),
        "a run without bytes in the bytes picture"
    );
}

/// DDP's bytes against DiLoCo's (1/100 of them, nothing sent before the first synchronization):
/// the bytes picture gets a log axis (labels by decade), and DiLoCo's curve is drawn from its
/// first synchronization on.
#[test]
fn loss_against_bytes_spanning_decades_gets_a_log_axis() {
    let dir = tempfile::tempdir().unwrap();
    let mut files = Vec::new();
    for (name, per_step) in [("ddp", 3_200_000u64), ("local-diloco", 32_000)] {
        let path = dir.path().join(format!("{name}.metrics.jsonl"));
        let mut text = String::new();
        for k in 1..=8u64 {
            // DiLoCo's first evaluation comes before its first synchronization.
            let sent = if name == "local-diloco" {
                (k - 1) * 2 * per_step
            } else {
                k * per_step
            };
            text += &format!(
                "{{\"step\":{},\"train_loss\":2.0,\"val_loss\":{},\"elapsed_s\":{k},\
                 \"comm_bytes\":{sent}}}\n",
                k * 250,
                3.0 - 0.1 * k as f64
            );
        }
        std::fs::write(&path, text).unwrap();
        files.push(path);
    }
    let out = dir.path().join("out");
    if plot(&files, &out).is_none() {
        return;
    }
    // 6.4e4 to 2.56e7: labels 1e5, 1e6, 1e7 on a log axis (a linear one writes 0.5, 1, ...).
    check_svg(
        &out.join("loss_vs_bytes.svg"),
        &[
            "ddp: validation",
            "local-diloco: validation",
            "1e5",
            "1e6",
            "1e7",
        ],
    );
}
