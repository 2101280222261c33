//! Value parsers for command-line flags with clear errors, shared by `ddprun`,
//! `ddp-allreduce-check`, `ddp-bench` and `train-digits` (usable as clap `value_parser`s):
//! whole numbers in a range, finite positive or non-negative numbers, seconds.

/// Parser of a whole number in `min..=max` (`-1`, `` and `1e3` are refused with a message
/// naming the range).
pub fn int_in<T: TryFrom<u64>>(min: u64, max: u64) -> impl Fn(&str) -> Result<T, String> + Clone {
    move |s: &str| {
        let v: u64 = s
            .trim()
            .parse()
            .map_err(|_| format!("`{s}` is not a whole number in {min}..={max}"))?;
        if !(min..=max).contains(&v) {
            return Err(format!("{v} is out of range: use {min}..={max}"));
        }
        T::try_from(v).map_err(|_| format!("{v} is too large for this machine"))
    }
}

/// A finite number (`NaN`, `inf` refused).
pub fn finite(s: &str) -> Result<f64, String> {
    match s.trim().parse::<f64>() {
        Ok(v) if v.is_finite() => Ok(v),
        _ => Err(format!("`{s}` is not a finite number")),
    }
}

/// A finite number greater than 0.
pub fn positive(s: &str) -> Result<f64, String> {
    let v = finite(s)?;
    if v > 0.0 {
        Ok(v)
    } else {
        Err(format!("{v} must be greater than 0"))
    }
}

/// A finite number, 0 or more.
pub fn non_negative(s: &str) -> Result<f64, String> {
    let v = finite(s)?;
    if v >= 0.0 {
        Ok(v)
    } else {
        Err(format!("{v} must be 0 or more"))
    }
}

/// Longest duration any flag accepts: a year (and far from what `Instant` arithmetic can hold).
pub const MAX_SECS: u64 = 365 * 24 * 3600;

/// A positive number of seconds, at most [`MAX_SECS`].
pub fn secs(s: &str) -> Result<f64, String> {
    match positive(s) {
        Ok(v) if v <= MAX_SECS as f64 => Ok(v),
        Ok(v) => Err(format!(
            "{v} seconds is more than a year (at most {MAX_SECS})"
        )),
        Err(_) => Err(format!("`{s}` is not a positive number of seconds")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_and_bad_values() {
        let p = int_in::<usize>(1, 10);
        assert_eq!(p("10"), Ok(10));
        assert!(p("0").unwrap_err().contains("1..=10"));
        assert!(p("-1").unwrap_err().contains("not a whole number"));
        assert!(p("").is_err());
        assert!(p("18446744073709551616").is_err());
        assert!(int_in::<u8>(0, 1000)("300")
            .unwrap_err()
            .contains("too large"));
        assert_eq!(positive("0.5"), Ok(0.5));
        assert!(positive("0").is_err() && positive("NaN").is_err() && positive("inf").is_err());
        assert_eq!(non_negative("0"), Ok(0.0));
        assert!(non_negative("-0.1").is_err());
        assert!(secs("1e308").unwrap_err().contains("more than a year"));
        assert!(secs("-1")
            .unwrap_err()
            .contains("positive number of seconds"));
    }
}
