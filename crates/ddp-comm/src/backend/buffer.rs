//! The buffers a backend's collective entry points take: host memory of any [`Element`] type,
//! with the element type erased to a [`DType`] tag so that [`super::CollectiveBackend`] can be
//! a trait object (one selection function returns any backend).
//!
//! Extension point: a backend on device memory (NCCL) needs buffers that are not host slices.
//! It adds its own buffer kind next to these (a device pointer, its dtype and length, and the
//! stream it is ordered on) and the entry points that take it; the host entry points stay as
//! they are, so the TCP, shared-memory and hierarchical backends do not change.

use crate::dtype::{DType, Element};

/// A mutable host buffer of `len` elements of one [`DType`] (input and/or output of a collective).
pub struct HostBuf<'a> {
    dtype: DType,
    bytes: &'a mut [u8],
}

/// A read-only host buffer of elements of one [`DType`] (input of a collective).
#[derive(Clone, Copy)]
pub struct RawHostSlice<'a> {
    dtype: DType,
    bytes: &'a [u8],
}

impl<'a> HostBuf<'a> {
    /// The buffer `s`.
    pub fn new<T: Element>(s: &'a mut [T]) -> Self {
        HostBuf {
            dtype: T::DTYPE,
            bytes: bytemuck::cast_slice_mut(s),
        }
    }

    /// Its element type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Its length in elements.
    pub fn len(&self) -> usize {
        self.bytes.len() / self.dtype.size()
    }

    /// Whether it holds no element.
    pub fn is_empty(&self) -> bool {
        self.bytes.is_empty()
    }

    /// The same buffer for a shorter borrow (to pass it on and use it again afterwards).
    pub fn reborrow(&mut self) -> HostBuf<'_> {
        HostBuf {
            dtype: self.dtype,
            bytes: self.bytes,
        }
    }

    /// Its bytes.
    pub fn bytes(&self) -> &[u8] {
        self.bytes
    }

    /// The elements, typed again. Panics if `T` is not the buffer's element type (a bug of the
    /// caller: dispatch on [`HostBuf::dtype`] first).
    pub fn typed<T: Element>(self) -> &'a mut [T] {
        assert_eq!(
            T::DTYPE,
            self.dtype,
            "HostBuf of {} used as {}",
            self.dtype,
            T::DTYPE
        );
        // Made from a `&mut [T]` in `new`, so the alignment and length fit `T`.
        bytemuck::cast_slice_mut(self.bytes)
    }
}

impl<'a> RawHostSlice<'a> {
    /// The buffer `s`.
    pub fn new<T: Element>(s: &'a [T]) -> Self {
        RawHostSlice {
            dtype: T::DTYPE,
            bytes: bytemuck::cast_slice(s),
        }
    }

    /// Its element type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Its length in elements.
    pub fn len(&self) -> usize {
        self.bytes.len() / self.dtype.size()
    }

    /// Whether it holds no element.
    pub fn is_empty(&self) -> bool {
        self.bytes.is_empty()
    }

    /// The elements, typed again (panics on another `T`, as [`HostBuf::typed`]).
    pub fn typed<T: Element>(self) -> &'a [T] {
        assert_eq!(
            T::DTYPE,
            self.dtype,
            "RawHostSlice of {} used as {}",
            self.dtype,
            T::DTYPE
        );
        bytemuck::cast_slice(self.bytes)
    }
}

/// Run `$body` with `$T` the element type of `$dtype` (a type alias inside each arm), so that
/// code generic over [`Element`] runs on an erased buffer.
macro_rules! with_element {
    ($dtype:expr, $T:ident => $body:expr) => {
        match $dtype {
            $crate::dtype::DType::F32 => {
                type $T = f32;
                $body
            }
            $crate::dtype::DType::F64 => {
                type $T = f64;
                $body
            }
            $crate::dtype::DType::F16 => {
                type $T = half::f16;
                $body
            }
            $crate::dtype::DType::BF16 => {
                type $T = half::bf16;
                $body
            }
            $crate::dtype::DType::I32 => {
                type $T = i32;
                $body
            }
            $crate::dtype::DType::I64 => {
                type $T = i64;
                $body
            }
            $crate::dtype::DType::U8 => {
                type $T = u8;
                $body
            }
        }
    };
}
pub(crate) use with_element;
