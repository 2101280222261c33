//! The UCI optical digits data set (1797 8×8 images, pixels 0..16, labels 0..9), embedded in the
//! binary from `data/digits.csv.gz` (see `data/README.md` for its origin and license), and the
//! fixed 80/20 train/test split.

use flate2::read::GzDecoder;
use rand::seq::SliceRandom;
use rand::SeedableRng;
use std::io::Read;

/// The gzip-compressed CSV, embedded so the binary runs anywhere without a download.
const DIGITS_CSV_GZ: &[u8] = include_bytes!("../../train-digits/data/digits.csv.gz");

/// Pixels per image.
pub const FEATURES: usize = 64;
/// Number of classes.
pub const CLASSES: usize = 10;
/// Seed of the train/test split: fixed, so every run (whatever `--seed`) is scored on the same
/// held-out images.
pub const SPLIT_SEED: u64 = 20240601;

/// Images (pixels scaled to `[0, 1]`, row-major `len × 64`) and their labels.
#[derive(Debug, Clone, Default)]
pub struct Dataset {
    pub features: Vec<f32>,
    pub labels: Vec<u32>,
}

impl Dataset {
    pub fn len(&self) -> usize {
        self.labels.len()
    }

    pub fn is_empty(&self) -> bool {
        self.labels.is_empty()
    }

    /// The rows `indices`, as a `(features, labels)` pair of flat vectors.
    pub fn gather(&self, indices: &[usize]) -> (Vec<f32>, Vec<u32>) {
        let mut x = Vec::with_capacity(indices.len() * FEATURES);
        let mut y = Vec::with_capacity(indices.len());
        for &i in indices {
            x.extend_from_slice(&self.features[i * FEATURES..(i + 1) * FEATURES]);
            y.push(self.labels[i]);
        }
        (x, y)
    }

    fn subset(&self, indices: &[usize]) -> Dataset {
        let (features, labels) = self.gather(indices);
        Dataset { features, labels }
    }
}

/// Parses the CSV: 65 integers per row (64 pixels 0..16, then the label 0..9), no header.
pub fn parse_csv(text: &str) -> Result<Dataset, String> {
    let mut d = Dataset::default();
    for (lineno, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() {
            continue;
        }
        let values: Vec<u32> = line
            .split(',')
            .map(|v| v.trim().parse::<u32>())
            .collect::<Result<_, _>>()
            .map_err(|e| format!("digits.csv line {}: {e}", lineno + 1))?;
        if values.len() != FEATURES + 1 {
            return Err(format!(
                "digits.csv line {}: {} values, expected {}",
                lineno + 1,
                values.len(),
                FEATURES + 1
            ));
        }
        if let Some(p) = values[..FEATURES].iter().find(|&&p| p > 16) {
            return Err(format!("digits.csv line {}: pixel {p} > 16", lineno + 1));
        }
        let label = values[FEATURES];
        if label as usize >= CLASSES {
            return Err(format!("digits.csv line {}: label {label} > 9", lineno + 1));
        }
        d.features
            .extend(values[..FEATURES].iter().map(|&p| p as f32 / 16.0));
        d.labels.push(label);
    }
    Ok(d)
}

/// The embedded data set.
pub fn load() -> Result<Dataset, String> {
    let mut text = String::new();
    GzDecoder::new(DIGITS_CSV_GZ)
        .read_to_string(&mut text)
        .map_err(|e| format!("cannot decompress the embedded digits.csv.gz: {e}"))?;
    parse_csv(&text)
}

/// `(train, test)`: a shuffle seeded by [`SPLIT_SEED`], then the first 80% for training.
pub fn train_test_split(all: &Dataset) -> (Dataset, Dataset) {
    let mut idx: Vec<usize> = (0..all.len()).collect();
    idx.shuffle(&mut rand::rngs::StdRng::seed_from_u64(SPLIT_SEED));
    let n_train = all.len() * 8 / 10;
    (all.subset(&idx[..n_train]), all.subset(&idx[n_train..]))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn embedded_data_has_1797_valid_rows() {
        let d = load().unwrap();
        assert_eq!(d.len(), 1797);
        assert_eq!(d.features.len(), 1797 * FEATURES);
        assert!(d.features.iter().all(|&p| (0.0..=1.0).contains(&p)));
        let mut counts = [0usize; CLASSES];
        d.labels.iter().for_each(|&l| counts[l as usize] += 1);
        assert!(counts.iter().all(|&c| c > 150), "{counts:?}");
    }

    #[test]
    fn split_is_fixed_disjoint_and_covering() {
        let d = load().unwrap();
        let (a, b) = train_test_split(&d);
        let (a2, b2) = train_test_split(&d);
        assert_eq!((a.len(), b.len()), (1437, 360));
        assert_eq!(a.labels, a2.labels);
        assert_eq!(b.features, b2.features);
        let mut sum = a
            .features
            .iter()
            .chain(&b.features)
            .map(|&x| x as f64)
            .sum::<f64>();
        sum -= d.features.iter().map(|&x| x as f64).sum::<f64>();
        assert!(sum.abs() < 1e-6);
    }

    #[test]
    fn bad_rows_are_rejected_with_line_numbers() {
        let good = format!("{}0", "1,".repeat(64));
        assert_eq!(parse_csv(&good).unwrap().len(), 1);
        let short = "1,2,3";
        assert!(parse_csv(short).unwrap_err().contains("line 1"));
        let bad_label = format!("{}\n{}10", good, "1,".repeat(64));
        assert!(parse_csv(&bad_label).unwrap_err().contains("line 2"));
    }
}
