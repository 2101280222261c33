//! One overlap figure per run: the share of communication hidden behind backward
//! (`ddprs::trace::BottleneckReport::hidden_share`, mean over ranks) is what every output of a
//! `train-digits` run prints or writes — the report's last line, the `gradient sync` summary
//! line, `--report`'s JSON and `--metrics`' last line. The summary used to print another figure
//! (`54% overlapped`, from the reducer's wait ÷ backward time) beside the report's `hidden 6%`.

use std::process::Command;

#[test]
fn every_output_of_a_run_carries_the_same_overlap_figure() {
    let dir = tempfile::tempdir().unwrap();
    let (report, metrics) = (dir.path().join("report.json"), dir.path().join("m.jsonl"));
    let o = Command::new(env!("CARGO_BIN_EXE_train-digits"))
        .args([
            "--nproc",
            "2",
            "--epochs",
            "1",
            "--max-steps",
            "12",
            "--quiet",
        ])
        .args(["--backend", "tcp", "--timeout-s", "60"])
        .arg("--report")
        .arg(&report)
        .arg("--metrics")
        .arg(&metrics)
        .env_remove("RANK")
        .env_remove("WORLD_SIZE")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(
        o.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&o.stderr)
    );
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&report).unwrap()).unwrap();
    let share = json["hidden_comm_share"]
        .as_f64()
        .expect("hidden_comm_share");
    assert!((0.0..=1.0).contains(&share), "{share}");
    // --metrics' last line is the same report.
    let last = std::fs::read_to_string(&metrics).unwrap();
    let last: serde_json::Value = serde_json::from_str(last.lines().last().unwrap()).unwrap();
    assert_eq!(last["kind"], "report");
    assert_eq!(last["hidden_comm_share"].as_f64(), Some(share));
    // Every printed overlap figure is that share, printed one way.
    let want = format!(
        "communication hidden under backward: {:.0}% (mean over ranks)",
        100.0 * share
    );
    let figures: Vec<&str> = stdout
        .lines()
        .filter(|l| {
            let l = l.to_lowercase();
            (l.contains("overlap") || l.contains("hidden")) && l.contains('%')
        })
        .collect();
    assert!(
        figures.len() >= 2,
        "the report's line and the summary's: {stdout}"
    );
    for line in &figures {
        assert!(
            line.contains(&want),
            "`{line}` does not say `{want}`:\n{stdout}"
        );
        assert_eq!(line.matches('%').count(), 1, "one figure in `{line}`");
    }
    assert!(
        figures
            .iter()
            .any(|l| l.starts_with("gradient sync (rank 0)")),
        "{stdout}"
    );
}
