//! `ddp-plot` on hostile metrics, through the binary: non-finite values (NaN, ±inf, as serde_json
//! writes them (`null`) and as Python does (`NaN`, `Infinity`), and `1e999`) are skipped and
//! counted, finite extremes (`1e30`) give short finite axis labels, and a run of a million
//! logged steps makes a small SVG that still reaches its spike.

use std::io::Write;
use std::path::Path;
use std::process::{Command, Output};

const BIN: &str = env!("CARGO_BIN_EXE_ddp-plot");

fn plot(input: &Path, out: &Path) -> Option<Output> {
    let o = Command::new(BIN)
        .arg(input)
        .arg("--out")
        .arg(out)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&o.stderr);
    if stderr.contains("no TrueType font found") {
        eprintln!("SKIPPED: {stderr}");
        return None;
    }
    assert!(o.status.success(), "ddp-plot failed: {stderr}");
    Some(o)
}

/// The text of every `<text>` element of an SVG.
fn texts(svg: &str) -> Vec<String> {
    svg.split("<text")
        .skip(1)
        .filter_map(|t| {
            let body = &t[t.find('>')? + 1..];
            Some(body[..body.find("</text>")?].trim().to_string())
        })
        .collect()
}

fn check_svg(path: &Path) -> (String, Vec<String>) {
    let svg = std::fs::read_to_string(path).unwrap();
    assert!(svg.trim_start().starts_with("<svg"), "{}", path.display());
    assert!(svg.trim_end().ends_with("</svg>"), "{}", path.display());
    let t = texts(&svg);
    assert!(!t.is_empty(), "no text in {}", path.display());
    for label in &t {
        let low = label.to_lowercase();
        assert!(
            !low.contains("nan") && !low.contains("inf"),
            "{}: label `{label}`",
            path.display()
        );
        // Every number drawn (axis labels) is finite and short: `1e30`, not 31 digits.
        if let Ok(v) = label.trim().parse::<f64>() {
            assert!(v.is_finite(), "{}: label `{label}`", path.display());
            assert!(
                label.len() <= 10,
                "{}: long label `{label}`",
                path.display()
            );
        }
    }
    (svg, t)
}

#[test]
fn non_finite_values_are_skipped_counted_and_axes_stay_readable() {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("hostile.jsonl");
    let mut lines = Vec::new();
    for step in 1..=40u32 {
        let loss = match step {
            5 => "NaN".to_string(),
            6 => "null".to_string(),
            7 => "Infinity".to_string(),
            8 => "-Infinity".to_string(),
            20 => "1e30".to_string(),
            _ => format!("{}", 2.0 / step as f64),
        };
        let sps = if step == 9 {
            "1e999".into()
        } else {
            "3000.5".to_string()
        };
        let acc = match step {
            10 => r#","accuracy":0.5"#,
            30 => r#","accuracy":NaN"#,
            40 => r#","accuracy":0.9"#,
            _ => "",
        };
        lines.push(format!(
            r#"{{"kind":"step","step":{step},"loss":{loss},"samples_per_s":{sps},"comm_wait_ms":0.5{acc}}}"#
        ));
    }
    // A step that is not a number at all: the whole point is skipped.
    lines.push(r#"{"kind":"step","step":NaN,"loss":1.0}"#.into());
    std::fs::write(&input, lines.join("\n") + "\n").unwrap();
    let Some(o) = plot(&input, dir.path()) else {
        return;
    };
    let stderr = String::from_utf8_lossy(&o.stderr);
    // loss 4 (NaN, null, inf, -inf), accuracy 1, samples/s 1 (1e999), step 1.
    assert!(
        stderr.contains("hostile: skipped 7 non-finite values"),
        "{stderr}"
    );
    assert!(
        stderr.contains("step 1, loss 4, accuracy 1, samples_per_s 1"),
        "{stderr}"
    );
    let (_, loss) = check_svg(&dir.path().join("loss_accuracy.svg"));
    // NaN, null, inf, -inf losses, the NaN accuracy and the NaN step's loss.
    assert!(
        loss.iter()
            .any(|t| t.contains("(6 non-finite points skipped)")),
        "{loss:?}"
    );
    // The 1e30 spike is on the (log) loss axis, labelled as such.
    assert!(loss.iter().any(|t| t == "1e30"), "{loss:?}");
    assert!(loss.iter().any(|t| t.contains("log scale")), "{loss:?}");
    let (_, tp) = check_svg(&dir.path().join("throughput.svg"));
    assert!(
        tp.iter()
            .any(|t| t.contains("(1 non-finite point skipped)")),
        "{tp:?}"
    );
}

#[test]
fn a_million_steps_make_a_small_svg_that_keeps_the_spike() {
    const STEPS: u64 = 1_000_000;
    const SPIKE: u64 = 654_321;
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("long.jsonl");
    {
        let mut f = std::io::BufWriter::new(std::fs::File::create(&input).unwrap());
        for step in 1..=STEPS {
            let loss = if step == SPIKE {
                1e6
            } else {
                1.0 + (step % 7) as f64 / 10.0
            };
            writeln!(
                f,
                r#"{{"kind":"step","step":{step},"loss":{loss},"samples_per_s":{}}}"#,
                3000 + step % 13
            )
            .unwrap();
        }
    }
    let Some(o) = plot(&input, dir.path()) else {
        return;
    };
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(!stderr.contains("non-finite"), "{stderr}");
    for name in ["loss_accuracy", "throughput"] {
        let path = dir.path().join(format!("{name}.svg"));
        let size = std::fs::metadata(&path).unwrap().len();
        assert!(size < 3_000_000, "{name}.svg is {size} bytes");
        check_svg(&path);
    }
    let (svg, labels) = check_svg(&dir.path().join("loss_accuracy.svg"));
    // The axis reaches the spike's decade, and the loss line goes up to the axis top: the
    // y of the `1e6` label is (within the text's height) the smallest y of the drawn line.
    assert!(labels.iter().any(|t| t == "1e6"), "{labels:?}");
    // (The x axis has a `1e6` too, at the bottom: the topmost one is the loss axis's.)
    let label_y = svg
        .split("<text")
        .filter(|t| t.replace(char::is_whitespace, "").contains(">1e6</text>"))
        .filter_map(|t| attr(t, "y"))
        .reduce(f64::min)
        .expect("the 1e6 label's y");
    let line_top = svg
        .split("<polyline")
        .skip(1)
        .filter_map(|p| {
            let pts = p.split("points=\"").nth(1)?.split('"').next()?;
            pts.split_whitespace()
                .filter_map(|xy| xy.split(',').nth(1)?.parse::<f64>().ok())
                .reduce(f64::min)
        })
        .reduce(f64::min)
        .expect("a drawn line");
    assert!(
        (line_top - label_y).abs() < 12.0,
        "the line's top at y {line_top}, the 1e6 label at {label_y}"
    );
}

/// The number in `name="..."` of an SVG element's text.
fn attr(element: &str, name: &str) -> Option<f64> {
    let start = element.find(&format!(" {name}=\""))? + name.len() + 3;
    element[start..].split('"').next()?.parse().ok()
}
