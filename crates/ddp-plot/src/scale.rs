//! Axes that fit any finite data, and series small enough to draw.
//!
//! - [`Axis`]: a linear axis, its values divided by a power of ten when they are very large or
//!   very small (plotters then works with numbers near 1, so `1e30` or `f64::MAX` neither
//!   overflow its arithmetic nor print as 31-digit labels), or a log10 axis when positive values
//!   span more than [`LOG_DECADES`] decades (one spike of `1e30` among losses of 2 leaves the
//!   rest of the curve readable). Labels are short: `0.25`, `1500`, `1e30`, `2.5e-7`.
//! - [`series`]: the finite points of a series (the others counted), decimated by [`decimate`]
//!   to at most about [`MAX_POINTS`] points.

use std::ops::Range;

/// Most points drawn per series: a run of millions of logged steps still makes an SVG of a few
/// hundred kilobytes, and every bucket keeps its minimum and maximum (spikes survive).
pub const MAX_POINTS: usize = 4000;

/// Positive values spanning more than this many decades get a log10 axis.
pub const LOG_DECADES: f64 = 4.0;

/// The finite points of a series, decimated, and how many points were skipped as non-finite.
#[derive(Debug, Clone, PartialEq)]
pub struct Series {
    pub points: Vec<(f64, f64)>,
    pub skipped: usize,
}

/// `raw`'s points with both coordinates finite (the others counted in `skipped`), decimated to
/// at most about [`MAX_POINTS`].
pub fn series(raw: impl Iterator<Item = (f64, f64)>) -> Series {
    let mut skipped = 0;
    let finite: Vec<(f64, f64)> = raw
        .filter(|(x, y)| {
            let ok = x.is_finite() && y.is_finite();
            skipped += usize::from(!ok);
            ok
        })
        .collect();
    Series {
        points: decimate(&finite, MAX_POINTS),
        skipped,
    }
}

/// At most about `max` of `points` (in their order): the first and the last, and in each of
/// `max / 2` buckets of consecutive points the one with the smallest and the one with the
/// largest y, so the envelope of the series (its spikes included) is what gets drawn.
pub fn decimate(points: &[(f64, f64)], max: usize) -> Vec<(f64, f64)> {
    let buckets = (max / 2).max(1);
    if points.len() <= max {
        return points.to_vec();
    }
    let size = points.len().div_ceil(buckets);
    let mut out = Vec::with_capacity(2 * buckets + 2);
    out.push(points[0]);
    for (b, chunk) in points.chunks(size).enumerate() {
        let (mut lo, mut hi) = (0, 0);
        for (i, p) in chunk.iter().enumerate() {
            if p.1 < chunk[lo].1 {
                lo = i;
            }
            if p.1 > chunk[hi].1 {
                hi = i;
            }
        }
        let (first, second) = if lo <= hi { (lo, hi) } else { (hi, lo) };
        if b > 0 || first > 0 {
            out.push(chunk[first]);
        }
        if second != first {
            out.push(chunk[second]);
        }
    }
    if out.last() != points.last() {
        out.push(*points.last().expect("not empty"));
    }
    out
}

/// One axis: which values it shows and how they are mapped to the numbers plotters draws.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Axis {
    /// log10 of the values is drawn.
    log: bool,
    /// Linear: values are drawn divided by `10^exp`.
    exp: i32,
    /// The drawn range.
    lo: f64,
    hi: f64,
}

impl Axis {
    /// An axis for `values` (the non-finite ones ignored) from 0 (or the smallest value when
    /// negative) to the largest plus `headroom` (a fraction of the span), with at least `lo..hi`
    /// shown (`min_span`). With `log_above` = `Some(d)`, positive values spanning more than `d`
    /// decades get a log10 axis ([`LOG_DECADES`] for values where a log axis is a last resort).
    pub fn fit(
        values: impl Iterator<Item = f64>,
        min_span: (f64, f64),
        headroom: f64,
        log_above: Option<f64>,
    ) -> Axis {
        let (mut min, mut max, mut min_pos) = (f64::INFINITY, f64::NEG_INFINITY, f64::INFINITY);
        for v in values.filter(|v| v.is_finite()) {
            min = min.min(v);
            max = max.max(v);
            if v > 0.0 {
                min_pos = min_pos.min(v);
            }
        }
        if min > max {
            (min, max, min_pos) = (min_span.0, min_span.1, f64::INFINITY);
        }
        if log_above.is_some_and(|d| min > 0.0 && (max / min_pos).log10() > d) {
            let lo = min_pos.log10().floor();
            let hi = max.log10().ceil().max(lo + 1.0);
            return Axis {
                log: true,
                exp: 0,
                lo,
                hi,
            };
        }
        let lo = min.min(0.0).min(min_span.0);
        let hi = max.max(min_span.1);
        let big = lo.abs().max(hi.abs());
        let exp = if big > 0.0 && !(1e-3..1e5).contains(&big) {
            big.log10().floor() as i32
        } else {
            0
        };
        let scale = |v: f64| v / 10f64.powi(exp);
        let (lo, hi) = (scale(lo), scale(hi));
        let hi = if hi > lo {
            hi + (hi - lo) * headroom
        } else {
            lo + 1.0
        };
        Axis {
            log: false,
            exp,
            lo,
            hi,
        }
    }

    /// An axis over `values` alone, not from 0: their smallest to their largest with `margin`
    /// (a fraction of the span) added on both sides, for curves far from 0 (a loss falling from
    /// 2.5 to 1.8). No values: 0 to 1.
    pub fn fit_span(values: impl Iterator<Item = f64>, margin: f64) -> Axis {
        let (mut min, mut max) = (f64::INFINITY, f64::NEG_INFINITY);
        for v in values.filter(|v| v.is_finite()) {
            min = min.min(v);
            max = max.max(v);
        }
        if min > max {
            (min, max) = (0.0, 1.0);
        }
        let span = if max > min {
            max - min
        } else {
            min.abs().max(1.0)
        };
        let mut axis = Axis::fit([min, max].into_iter(), (min, max), 0.0, None);
        let scale = 10f64.powi(-axis.exp);
        axis.lo = (min - span * margin) * scale;
        axis.hi = (max + span * margin) * scale;
        axis
    }

    /// The drawn range.
    pub fn range(&self) -> Range<f64> {
        self.lo..self.hi
    }

    /// Where `v` is drawn (non-finite for values a log axis cannot show).
    pub fn to(&self, v: f64) -> f64 {
        if self.log {
            if v > 0.0 {
                v.log10()
            } else {
                f64::NAN
            }
        } else {
            v / 10f64.powi(self.exp)
        }
    }

    /// The value at drawn coordinate `x`, as a short label.
    pub fn label(&self, x: &f64) -> String {
        let v = if self.log {
            10f64.powf(*x)
        } else {
            x * 10f64.powi(self.exp)
        };
        number_label(v)
    }

    /// How many labels to ask plotters for (a log axis: about one per decade).
    pub fn labels(&self) -> usize {
        if self.log {
            ((self.hi - self.lo) as usize + 1).clamp(2, 12)
        } else {
            10
        }
    }

    /// `text`, with ", log scale" in its parentheses (or appended) on a log axis.
    pub fn desc(&self, text: &str) -> String {
        match (self.log, text.strip_suffix(')')) {
            (false, _) => text.to_string(),
            (true, Some(t)) => format!("{t}, log scale)"),
            (true, None) => format!("{text} (log scale)"),
        }
    }
}

/// A short label for any finite number: `0`, `0.25`, `1500`, `1e30`, `2.5e-7`, `-3.1e12`.
pub fn number_label(v: f64) -> String {
    let a = v.abs();
    if a == 0.0 || !v.is_finite() {
        return if v.is_finite() {
            "0".into()
        } else {
            "?".into()
        };
    }
    // Round to 4 significant digits first, so 99999.99 is `1e5` and 0.0009999 is `0.001`.
    let r = format!("{v:.3e}")
        .parse::<f64>()
        .ok()
        .filter(|r| r.is_finite())
        .unwrap_or(v);
    if (1e-3..1e5).contains(&r.abs()) {
        let s = format!("{r:.4}");
        let s = s.trim_end_matches('0').trim_end_matches('.');
        if s == "-0" {
            "0".into()
        } else {
            s.into()
        }
    } else {
        let s = format!("{r:.3e}");
        match s.split_once('e') {
            Some((m, e)) => format!("{}e{e}", m.trim_end_matches('0').trim_end_matches('.')),
            None => s,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn labels_are_short() {
        for (v, want) in [
            (0.0, "0"),
            (0.25, "0.25"),
            (1500.0, "1500"),
            (1e30, "1e30"),
            (2.5e-7, "2.5e-7"),
            (-3.1e12, "-3.1e12"),
            (f64::MAX, "1.798e308"),
            (-f64::MAX, "-1.798e308"),
            (99999.99, "1e5"),
            (12.0, "12"),
        ] {
            assert_eq!(number_label(v), want, "{v}");
        }
    }

    #[test]
    fn axes_fit_extremes() {
        // One spike among small positive values: log10, decades as the range.
        let a = Axis::fit(
            [2.0, 1.5, 1e30].into_iter(),
            (0.0, 0.0),
            0.1,
            Some(LOG_DECADES),
        );
        assert_eq!(a.range(), 0.0..30.0);
        assert_eq!(a.label(&30.0), "1e30");
        // The same without log: scaled, so plotters sees small numbers.
        let a = Axis::fit([2.0, 1e30].into_iter(), (0.0, 0.0), 0.1, None);
        assert!(a.range().end < 100.0 && a.range().end.is_finite());
        assert_eq!(a.label(&a.to(1e30)), "1e30");
        let a = Axis::fit(
            [f64::MAX, -f64::MAX].into_iter(),
            (0.0, 0.0),
            0.1,
            Some(LOG_DECADES),
        );
        assert!(a.range().start.is_finite() && a.range().end.is_finite());
        // Bytes of DiLoCo against DDP's (3.3 decades): log only with a lower threshold.
        let bytes = [3.2e6, 1.6e7, 6.4e9];
        assert!(!Axis::fit(bytes.into_iter(), (0.0, 1.0), 0.0, Some(LOG_DECADES)).log);
        let a = Axis::fit(bytes.into_iter(), (0.0, 1.0), 0.0, Some(2.0));
        assert!(a.log && a.range() == (6.0..10.0), "{a:?}");
        // Nothing finite: the minimum span.
        let a = Axis::fit(
            [f64::NAN, f64::INFINITY].into_iter(),
            (0.0, 1.0),
            0.0,
            Some(LOG_DECADES),
        );
        assert_eq!(a.range(), 0.0..1.0);
    }

    #[test]
    fn decimation_keeps_the_envelope() {
        let mut pts: Vec<(f64, f64)> = (0..1_000_000).map(|i| (i as f64, 1.0)).collect();
        pts[123_457].1 = 1e30;
        pts[765_433].1 = -5.0;
        let d = decimate(&pts, 4000);
        assert!(d.len() <= 4002, "{}", d.len());
        assert!(d.contains(&(123_457.0, 1e30)) && d.contains(&(765_433.0, -5.0)));
        assert_eq!((d[0], *d.last().unwrap()), (pts[0], pts[999_999]));
        assert!(
            d.windows(2).all(|w| w[0].0 < w[1].0),
            "in order, no duplicates"
        );
        let s = series([(0.0, f64::NAN), (1.0, 2.0), (f64::INFINITY, 1.0)].into_iter());
        assert_eq!((s.points, s.skipped), (vec![(1.0, 2.0)], 2));
    }
}
