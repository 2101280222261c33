//! The end of a run, as both programs print it: a few lines of text, then (with `--json`) the
//! run summary [`RunSummary`] as the last line of output, one JSON object whose keys and order
//! are documented (`examples/train-digits/README.md`) and parsed by the tests and the
//! benchmark scripts.

use ddprs::comm::{ProcessGroup, ReduceOp};
use ddprs::reducer::TotalStats;
use serde::{Deserialize, Deserializer, Serialize};
use std::time::Duration;

/// The final `--json` line of `train-digits` and `train-digits-burn`, its fields in the
/// documented order (serde writes them in declaration order). A non-finite number is written
/// as `null` (serde_json's way) and read back as NaN.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunSummary {
    pub world_size: usize,
    /// Optimizer steps in total (across resumes).
    pub steps: u64,
    /// Held-out accuracy at the end (rank 0's replica).
    #[serde(deserialize_with = "nan_if_null")]
    pub test_accuracy: f64,
    /// Mean cross-entropy over the whole training set at the end.
    #[serde(deserialize_with = "nan_if_null")]
    pub final_loss: f64,
    /// Global samples per second of training time.
    #[serde(deserialize_with = "nan_if_null")]
    pub samples_per_s: f64,
    pub replicas_identical: bool,
    /// Largest absolute difference of a parameter between two ranks.
    #[serde(deserialize_with = "nan_if_null")]
    pub max_param_diff: f64,
    #[serde(deserialize_with = "nan_if_null")]
    pub param_sum: f64,
    #[serde(deserialize_with = "nan_if_null")]
    pub param_l2: f64,
    /// The communication hook, as `--hook` spells it.
    pub hook: String,
    /// Bytes rank 0 sent per step of this run (gradients, model averaging, DiLoCo's
    /// pseudo-gradients).
    #[serde(deserialize_with = "nan_if_null")]
    pub bytes_per_step: f64,
    /// The slowest rank's training time, evaluations for `--target-accuracy` excluded.
    #[serde(deserialize_with = "nan_if_null")]
    pub train_time_s: f64,
    /// When the held-out accuracy reached `--target-accuracy`; `null` when it did not (or
    /// without it).
    pub time_to_target_s: Option<f64>,
}

fn nan_if_null<'de, D: Deserializer<'de>>(d: D) -> Result<f64, D::Error> {
    Ok(Option::<f64>::deserialize(d)?.unwrap_or(f64::NAN))
}

impl RunSummary {
    /// The keys of the line, in their order.
    pub const KEYS: [&'static str; 13] = [
        "world_size",
        "steps",
        "test_accuracy",
        "final_loss",
        "samples_per_s",
        "replicas_identical",
        "max_param_diff",
        "param_sum",
        "param_l2",
        "hook",
        "bytes_per_step",
        "train_time_s",
        "time_to_target_s",
    ];

    /// The summary as one line of compact JSON.
    pub fn to_json_line(&self) -> String {
        serde_json::to_string(self).expect("a run summary serializes")
    }

    /// The summary in `line` (the last line of a `--json` run's output).
    pub fn from_json_line(line: &str) -> Result<RunSummary, serde_json::Error> {
        serde_json::from_str(line)
    }
}

/// The run's throughput, a collective: `(samples_per_s, train_time_s)`, every rank's samples
/// of this run summed, over the slowest rank's training time (0 samples/s when that is 0).
pub fn throughput(
    pg: &ProcessGroup,
    local_samples: u64,
    train_time: Duration,
) -> ddprs::comm::Result<(f64, f64)> {
    let mut counts = [local_samples as f64, train_time.as_secs_f64()];
    pg.all_reduce(&mut counts[..1], ReduceOp::Sum)?;
    pg.all_reduce(&mut counts[1..], ReduceOp::Max)?;
    let samples_per_s = if counts[1] > 0.0 {
        counts[0] / counts[1]
    } else {
        0.0
    };
    Ok((samples_per_s, counts[1]))
}

/// What the text lines before the summary say besides its fields.
pub struct Details {
    /// Held-out images.
    pub test_images: usize,
    /// Mean cross-entropy over the held-out images.
    pub test_loss: f64,
    /// Steps of this run (the summary's `steps` count across resumes).
    pub steps_run: u64,
    /// Rank 0's gradient synchronization.
    pub stats: TotalStats,
    /// Said after the synchronization figures (train-digits: the communication hidden under
    /// backward, from the bottleneck report).
    pub overlap: Option<String>,
    /// The replica check, described (`ddprs::verify`'s description).
    pub replicas: String,
}

/// Prints the end of the run on rank 0: accuracy and losses, steps and throughput, gradient
/// synchronization, the replica check, then with `json` the summary as the last line.
pub fn print(summary: &RunSummary, details: &Details, json: bool) {
    let s = summary;
    println!(
        "held-out accuracy {:.4} ({} images), test loss {:.4}, final train loss {:.4}",
        s.test_accuracy, details.test_images, details.test_loss, s.final_loss
    );
    println!(
        "{} steps ({} this run) in {:.2}s: {:.0} samples/s over {} ranks",
        s.steps, details.steps_run, s.train_time_s, s.samples_per_s, s.world_size
    );
    let stats = &details.stats;
    if stats.steps > 0 {
        let wait = stats.comm_wait.as_secs_f64() * 1e3 / stats.steps as f64;
        let total = stats.total.as_secs_f64() * 1e3 / stats.steps as f64;
        let mut line = format!(
            "gradient sync (rank 0): {wait:.3} ms/step waiting for communication of {total:.3} \
             ms/step backward+communication"
        );
        if let Some(overlap) = &details.overlap {
            line = format!("{line}; {overlap}");
        }
        println!("{line}");
    }
    println!(
        "replica check: {} (max |param difference| across ranks = {:e})",
        details.replicas, s.max_param_diff
    );
    if json {
        println!("{}", s.to_json_line());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn summary() -> RunSummary {
        RunSummary {
            world_size: 2,
            steps: 45,
            test_accuracy: 0.9527777777777777,
            final_loss: 0.1,
            samples_per_s: 12345.678,
            replicas_identical: true,
            max_param_diff: 0.0,
            param_sum: -1.5e-7,
            param_l2: 1.0,
            hook: "powersgd:1:1000".into(),
            bytes_per_step: 1e20,
            train_time_s: 0.25,
            time_to_target_s: None,
        }
    }

    /// The line the programs wrote by hand before this type: `"key":value` pairs of
    /// `serde_json::Value`s, joined by commas.
    fn by_hand(s: &RunSummary) -> String {
        let time_to_target: serde_json::Value = s
            .time_to_target_s
            .map_or(serde_json::Value::Null, Into::into);
        let fields: [(&str, serde_json::Value); 13] = [
            ("world_size", s.world_size.into()),
            ("steps", s.steps.into()),
            ("test_accuracy", s.test_accuracy.into()),
            ("final_loss", s.final_loss.into()),
            ("samples_per_s", s.samples_per_s.into()),
            ("replicas_identical", s.replicas_identical.into()),
            ("max_param_diff", s.max_param_diff.into()),
            ("param_sum", s.param_sum.into()),
            ("param_l2", s.param_l2.into()),
            ("hook", s.hook.clone().into()),
            ("bytes_per_step", s.bytes_per_step.into()),
            ("train_time_s", s.train_time_s.into()),
            ("time_to_target_s", time_to_target),
        ];
        let body: Vec<String> = fields.iter().map(|(k, v)| format!("\"{k}\":{v}")).collect();
        format!("{{{}}}", body.join(","))
    }

    #[test]
    fn the_line_is_the_hand_written_one_byte_for_byte() {
        let mut s = summary();
        assert_eq!(s.to_json_line(), by_hand(&s));
        s.time_to_target_s = Some(0.125);
        s.final_loss = f64::NAN;
        s.param_l2 = f64::INFINITY;
        s.hook = "say \"hi\"\n".into();
        assert_eq!(s.to_json_line(), by_hand(&s));
        assert!(s.to_json_line().contains("\"final_loss\":null"));
    }

    #[test]
    fn keys_are_written_in_the_documented_order() {
        let line = summary().to_json_line();
        let mut at = 0;
        for k in RunSummary::KEYS {
            at += line[at..]
                .find(&format!("\"{k}\":"))
                .unwrap_or_else(|| panic!("{k} out of order: {line}"));
        }
        let v: serde_json::Value = serde_json::from_str(&line).unwrap();
        assert_eq!(v.as_object().unwrap().len(), RunSummary::KEYS.len());
    }

    #[test]
    fn reads_back_what_it_writes_nulls_as_nan() {
        // Numbers exact in few digits (serde_json's default parser, as every reader of these
        // lines has it, may be one ulp off on others: 0.9527777777777777 reads back as ...76).
        let s = RunSummary {
            test_accuracy: 0.953125,
            samples_per_s: 12345.5,
            param_sum: -0.125,
            ..summary()
        };
        assert_eq!(RunSummary::from_json_line(&s.to_json_line()).unwrap(), s);
        let mut t = summary();
        t.final_loss = f64::NAN;
        t.time_to_target_s = Some(3.5);
        let back = RunSummary::from_json_line(&t.to_json_line()).unwrap();
        assert!(back.final_loss.is_nan());
        assert_eq!(back.time_to_target_s, Some(3.5));
        assert!(RunSummary::from_json_line("{\"world_size\":2}").is_err());
    }
}
