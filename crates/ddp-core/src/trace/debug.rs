//! Debug hooks that make a problem on purpose, for tests and demonstrations of the timeline and
//! the bottleneck report:
//!
//! - `DDP_DEBUG_SLOW_RANK=RANK:DURATION` (e.g. `1:50ms`): [`slow_forward`] sleeps that long on
//!   that rank — a straggler. Training loops call it in their forward.
//! - `DDP_DEBUG_CLOCK_SKEW=RANK:DURATION` (e.g. `1:250ms`): that rank's trace clock runs ahead
//!   by that much, as another host's clock would; the merged timeline must still line up.
//!
//! `RANK` is the global rank (the `RANK` variable the launcher sets); `DURATION` is a number
//! with `us`, `ms` or `s`.

use std::sync::OnceLock;
use std::time::Duration;

/// The variable naming a rank to slow down and by how much per forward.
pub const SLOW_RANK_ENV: &str = "DDP_DEBUG_SLOW_RANK";
/// The variable naming a rank whose trace clock is skewed, and by how much.
pub const CLOCK_SKEW_ENV: &str = "DDP_DEBUG_CLOCK_SKEW";

/// Parses `RANK:DURATION` (`1:50ms`, `0:2s`, `3:500us`).
pub fn parse_rank_duration(s: &str) -> Result<(usize, Duration), String> {
    let (rank, d) = s
        .split_once(':')
        .ok_or_else(|| format!("`{s}`: expected RANK:DURATION, e.g. 1:50ms"))?;
    let rank = rank
        .trim()
        .parse()
        .map_err(|_| format!("`{s}`: `{rank}` is not a rank"))?;
    let d = d.trim();
    let (num, scale) = if let Some(n) = d.strip_suffix("us") {
        (n, 1e-6)
    } else if let Some(n) = d.strip_suffix("ms") {
        (n, 1e-3)
    } else if let Some(n) = d.strip_suffix('s') {
        (n, 1.0)
    } else {
        return Err(format!("`{s}`: `{d}` needs a unit (us, ms or s)"));
    };
    let v: f64 = num
        .trim()
        .parse()
        .map_err(|_| format!("`{s}`: `{num}` is not a number"))?;
    if !(0.0..=3600.0).contains(&(v * scale)) {
        return Err(format!("`{s}`: the duration must be between 0 and 1 hour"));
    }
    Ok((rank, Duration::from_secs_f64(v * scale)))
}

/// This process's rank as the launcher set it (`RANK`), if any.
fn env_rank() -> Option<usize> {
    std::env::var("RANK").ok()?.parse().ok()
}

/// The duration `var` names for this process's rank (parsed once per variable by the caller).
fn for_this_rank(var: &str) -> Option<Duration> {
    let v = std::env::var(var).ok().filter(|v| !v.is_empty())?;
    match parse_rank_duration(&v) {
        Ok((rank, d)) if Some(rank) == env_rank() => Some(d),
        Ok(_) => None,
        Err(e) => {
            tracing::warn!("{var} ignored: {e}");
            None
        }
    }
}

/// Sleeps for the `DDP_DEBUG_SLOW_RANK` duration when it names this rank (otherwise returns at
/// once after the first call: the variable is read once).
pub fn slow_forward() {
    static SLOW: OnceLock<Option<Duration>> = OnceLock::new();
    if let Some(d) = SLOW.get_or_init(|| for_this_rank(SLOW_RANK_ENV)) {
        std::thread::sleep(*d);
    }
}

/// The `DDP_DEBUG_CLOCK_SKEW` of this rank in nanoseconds (0 when unset).
pub(crate) fn clock_skew_ns() -> i64 {
    static SKEW: OnceLock<i64> = OnceLock::new();
    *SKEW.get_or_init(|| for_this_rank(CLOCK_SKEW_ENV).map_or(0, |d| d.as_nanos() as i64))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rank_durations_parse_and_bad_ones_are_named() {
        assert_eq!(
            parse_rank_duration("1:50ms").unwrap(),
            (1, Duration::from_millis(50))
        );
        assert_eq!(
            parse_rank_duration("0:2s").unwrap(),
            (0, Duration::from_secs(2))
        );
        assert_eq!(
            parse_rank_duration("3:500us").unwrap(),
            (3, Duration::from_micros(500))
        );
        for bad in ["1", "x:5ms", "1:5", "1:fast ms", "1:-5ms", "1:2h"] {
            let e = parse_rank_duration(bad).unwrap_err();
            assert!(e.contains(bad), "{e}");
        }
    }
}
