//! Element types that collectives move and reduce, and the reduction operators.
//!
//! Reductions are written as plain slice loops over `chunks_exact` so that the compiler
//! vectorises them; `f16`/`bf16` are reduced with `f32` accumulation (the process group widens
//! them to `f32` before a reducing collective and narrows the result once at the end; the
//! shared-memory paths widen piece by piece). The `f32` partials are combined in the order of
//! the algorithm that runs (ring, hypercube, binomial tree, or rank order in shared memory), so
//! the result is the `f32` reduction in that order rounded once: exactly the sum rounded once
//! whenever the `f32` sum is exact, and bit-identical on every rank in any case
//! (`tests/half_accumulation.rs`).

use half::{bf16, f16};
use std::fmt;

/// Runtime tag of an element type; part of every collective's fingerprint.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DType {
    F32,
    F64,
    F16,
    BF16,
    I32,
    I64,
    U8,
}

impl DType {
    /// Size of one element in bytes.
    pub fn size(self) -> usize {
        match self {
            DType::F32 | DType::I32 => 4,
            DType::F64 | DType::I64 => 8,
            DType::F16 | DType::BF16 => 2,
            DType::U8 => 1,
        }
    }

    pub(crate) fn code(self) -> u8 {
        self as u8
    }

    pub(crate) fn from_code(code: u8) -> Option<DType> {
        [
            DType::F32,
            DType::F64,
            DType::F16,
            DType::BF16,
            DType::I32,
            DType::I64,
            DType::U8,
        ]
        .get(code as usize)
        .copied()
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = match self {
            DType::F32 => "f32",
            DType::F64 => "f64",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
            DType::I32 => "i32",
            DType::I64 => "i64",
            DType::U8 => "u8",
        };
        f.write_str(s)
    }
}

/// Reduction operator of `all_reduce`, `reduce` and `reduce_scatter`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    Sum,
    /// Sum divided by the number of ranks (integers: truncating division).
    Avg,
    Min,
    Max,
    Product,
}

impl ReduceOp {
    pub(crate) fn code(self) -> u8 {
        self as u8
    }

    pub(crate) fn from_code(code: u8) -> Option<ReduceOp> {
        [
            ReduceOp::Sum,
            ReduceOp::Avg,
            ReduceOp::Min,
            ReduceOp::Max,
            ReduceOp::Product,
        ]
        .get(code as usize)
        .copied()
    }
}

impl fmt::Display for ReduceOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Avg => "avg",
            ReduceOp::Min => "min",
            ReduceOp::Max => "max",
            ReduceOp::Product => "product",
        };
        f.write_str(s)
    }
}

/// A type that collectives can carry. Implemented for `f32, f64, f16, bf16, i32, i64, u8`.
pub trait Element: bytemuck::Pod + PartialOrd + Send + Sync + fmt::Debug + 'static {
    /// The runtime tag.
    const DTYPE: DType;

    /// `dst[i] = dst[i] op src[i]` for `Sum` / `Min` / `Max` / `Product`
    /// (`Avg` reduces like `Sum`; the division happens once at the end, see [`Element::div_by`]).
    fn reduce_into(dst: &mut [Self], src: &[Self], op: ReduceOp);

    /// Divide every element by `n` (used to finish `Avg`).
    fn div_by(buf: &mut [Self], n: usize);

    /// For 16-bit floats: the values widened to `f32`, so reductions accumulate in `f32`.
    /// `None` for every other type (they reduce in their own type).
    fn widen(_buf: &[Self]) -> Option<Vec<f32>> {
        None
    }

    /// Inverse of [`Element::widen`]: round `src` back into `dst`.
    fn narrow(_src: &[f32], _dst: &mut [Self]) {
        unreachable!("narrow is only called for types whose widen returns Some")
    }
}

macro_rules! reduce_loops {
    ($dst:expr, $src:expr, $op:expr, $add:expr, $mul:expr, $min:expr, $max:expr) => {{
        assert_eq!($dst.len(), $src.len(), "reduce_into: length mismatch");
        match $op {
            ReduceOp::Sum | ReduceOp::Avg => $dst
                .iter_mut()
                .zip($src)
                .for_each(|(d, s)| *d = $add(*d, *s)),
            ReduceOp::Product => $dst
                .iter_mut()
                .zip($src)
                .for_each(|(d, s)| *d = $mul(*d, *s)),
            ReduceOp::Min => $dst
                .iter_mut()
                .zip($src)
                .for_each(|(d, s)| *d = $min(*d, *s)),
            ReduceOp::Max => $dst
                .iter_mut()
                .zip($src)
                .for_each(|(d, s)| *d = $max(*d, *s)),
        }
    }};
}

macro_rules! float_element {
    ($t:ty, $dt:expr) => {
        impl Element for $t {
            const DTYPE: DType = $dt;
            fn reduce_into(dst: &mut [Self], src: &[Self], op: ReduceOp) {
                reduce_loops!(
                    dst,
                    src,
                    op,
                    |a, b| a + b,
                    |a, b| a * b,
                    <$t>::min,
                    <$t>::max
                )
            }
            fn div_by(buf: &mut [Self], n: usize) {
                let n = n as $t;
                buf.iter_mut().for_each(|x| *x /= n);
            }
        }
    };
}
float_element!(f32, DType::F32);
float_element!(f64, DType::F64);

macro_rules! int_element {
    ($t:ty, $dt:expr) => {
        impl Element for $t {
            const DTYPE: DType = $dt;
            fn reduce_into(dst: &mut [Self], src: &[Self], op: ReduceOp) {
                reduce_loops!(
                    dst,
                    src,
                    op,
                    <$t>::wrapping_add,
                    <$t>::wrapping_mul,
                    std::cmp::min,
                    std::cmp::max
                )
            }
            fn div_by(buf: &mut [Self], n: usize) {
                let n = n as $t;
                buf.iter_mut().for_each(|x| *x /= n);
            }
        }
    };
}
int_element!(i32, DType::I32);
int_element!(i64, DType::I64);
int_element!(u8, DType::U8);

macro_rules! half_element {
    ($t:ty, $dt:expr) => {
        impl Element for $t {
            const DTYPE: DType = $dt;
            fn reduce_into(dst: &mut [Self], src: &[Self], op: ReduceOp) {
                let f = |a: $t, b: $t, g: fn(f32, f32) -> f32| {
                    <$t>::from_f32(g(a.to_f32(), b.to_f32()))
                };
                reduce_loops!(
                    dst,
                    src,
                    op,
                    |a, b| f(a, b, |x, y| x + y),
                    |a, b| f(a, b, |x, y| x * y),
                    |a, b| f(a, b, f32::min),
                    |a, b| f(a, b, f32::max)
                )
            }
            fn div_by(buf: &mut [Self], n: usize) {
                let n = n as f32;
                buf.iter_mut()
                    .for_each(|x| *x = <$t>::from_f32(x.to_f32() / n));
            }
            fn widen(buf: &[Self]) -> Option<Vec<f32>> {
                Some(buf.iter().map(|x| x.to_f32()).collect())
            }
            fn narrow(src: &[f32], dst: &mut [Self]) {
                dst.iter_mut()
                    .zip(src)
                    .for_each(|(d, s)| *d = <$t>::from_f32(*s));
            }
        }
    };
}
half_element!(f16, DType::F16);
half_element!(bf16, DType::BF16);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reductions_match_scalar_definitions() {
        let mut a = vec![1.0f32, -2.0, 3.0];
        f32::reduce_into(&mut a, &[4.0, 5.0, -6.0], ReduceOp::Max);
        assert_eq!(a, [4.0, 5.0, 3.0]);
        let mut b = vec![3i64, 4];
        i64::reduce_into(&mut b, &[5, -1], ReduceOp::Product);
        assert_eq!(b, [15, -4]);
        let mut c = vec![bf16::from_f32(1.5)];
        bf16::reduce_into(&mut c, &[bf16::from_f32(2.0)], ReduceOp::Sum);
        assert_eq!(c[0].to_f32(), 3.5);
        let mut d = vec![7u8, 9];
        u8::div_by(&mut d, 2);
        assert_eq!(d, [3, 4]);
    }

    #[test]
    fn codes_round_trip() {
        for d in [
            DType::F32,
            DType::F64,
            DType::F16,
            DType::BF16,
            DType::I32,
            DType::I64,
            DType::U8,
        ] {
            assert_eq!(DType::from_code(d.code()), Some(d));
        }
        for op in [
            ReduceOp::Sum,
            ReduceOp::Avg,
            ReduceOp::Min,
            ReduceOp::Max,
            ReduceOp::Product,
        ] {
            assert_eq!(ReduceOp::from_code(op.code()), Some(op));
        }
    }
}
