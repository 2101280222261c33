//! Value parsers of `train-digits`' (and `train-digits-burn`'s) flags beyond
//! `ddprun::validate`'s: a fraction in [0, 1] and an SGD momentum in [0, 1). Like those, they
//! refuse NaN and ±inf, and clap names the flag and the value in the error (exit status 2).

use ddprun::validate::finite;

/// A finite number in [0, 1] (`--target-accuracy`: a fraction of the held-out images).
pub fn fraction(s: &str) -> Result<f64, String> {
    let v = finite(s)?;
    if (0.0..=1.0).contains(&v) {
        Ok(v)
    } else {
        Err(format!("{v} is not a fraction: use 0 to 1"))
    }
}

/// A finite number in [0, 1) (`--momentum`: at 1 or above the velocity never decays and SGD
/// diverges).
pub fn momentum(s: &str) -> Result<f64, String> {
    let v = finite(s)?;
    if (0.0..1.0).contains(&v) {
        Ok(v)
    } else {
        Err(format!(
            "{v} is out of range: use 0 (plain SGD) up to, not including, 1"
        ))
    }
}
