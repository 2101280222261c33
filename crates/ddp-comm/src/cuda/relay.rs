//! The CUDA implementations of the relay path's traits: a `CudaSlice` as a
//! [`RelaySource`]/[`RelayBuffer`] (copies on the communication stream, after the event recorded
//! on the compute stream when the collective was issued), and pinned host memory as
//! [`HostRelay`].

use super::{driver_err, CudaElement};
use crate::device::relay::{HostRelay, RelayBuffer, RelaySource};
use crate::Result;
use cudarc::driver::{CudaContext, CudaEvent, CudaSlice, CudaStream, PinnedHostSlice};
use std::sync::Arc;

/// A device buffer (`S`: `CudaSlice<T>`, `&CudaSlice<T>` or `&mut CudaSlice<T>`) with the stream
/// its copies run on and the event they wait for.
pub(crate) struct OnStream<S> {
    pub(crate) buf: S,
    pub(crate) stream: Arc<CudaStream>,
    pub(crate) ready: Arc<CudaEvent>,
    pub(crate) rank: usize,
}

fn download<T: CudaElement>(s: &OnStream<impl AsRef<CudaSlice<T>>>, host: &mut [T]) -> Result<()> {
    let r = s.rank;
    s.stream
        .wait(&s.ready)
        .map_err(driver_err("cuStreamWaitEvent", r))?;
    s.stream
        .memcpy_dtoh(s.buf.as_ref(), host)
        .map_err(driver_err("cuMemcpyDtoHAsync", r))?;
    s.stream
        .synchronize()
        .map_err(driver_err("cuStreamSynchronize", r))
}

fn upload<T: CudaElement>(s: &mut OnStream<impl AsMut<CudaSlice<T>>>, host: &[T]) -> Result<()> {
    let r = s.rank;
    s.stream
        .wait(&s.ready)
        .map_err(driver_err("cuStreamWaitEvent", r))?;
    s.stream
        .memcpy_htod(host, s.buf.as_mut())
        .map_err(driver_err("cuMemcpyHtoDAsync", r))?;
    // The relay memory is reused by the next collective: the copy must be done.
    s.stream
        .synchronize()
        .map_err(driver_err("cuStreamSynchronize", r))
}

/// `AsRef`/`AsMut` for the three forms of a slice.
pub(crate) struct Owned<T>(pub(crate) CudaSlice<T>);
pub(crate) struct Shared<'a, T>(pub(crate) &'a CudaSlice<T>);
pub(crate) struct Exclusive<'a, T>(pub(crate) &'a mut CudaSlice<T>);

impl<T> AsRef<CudaSlice<T>> for Owned<T> {
    fn as_ref(&self) -> &CudaSlice<T> {
        &self.0
    }
}
impl<T> AsMut<CudaSlice<T>> for Owned<T> {
    fn as_mut(&mut self) -> &mut CudaSlice<T> {
        &mut self.0
    }
}
impl<T> AsRef<CudaSlice<T>> for Shared<'_, T> {
    fn as_ref(&self) -> &CudaSlice<T> {
        self.0
    }
}
impl<T> AsRef<CudaSlice<T>> for Exclusive<'_, T> {
    fn as_ref(&self) -> &CudaSlice<T> {
        self.0
    }
}
impl<T> AsMut<CudaSlice<T>> for Exclusive<'_, T> {
    fn as_mut(&mut self) -> &mut CudaSlice<T> {
        self.0
    }
}

macro_rules! relay_impls {
    ($($ty:ty),*) => {$(
        impl<T: CudaElement> RelaySource<T> for OnStream<$ty> {
            fn len(&self) -> usize {
                self.buf.as_ref().len()
            }
            fn download(&self, host: &mut [T]) -> Result<()> {
                download(self, host)
            }
        }
    )*};
}
relay_impls!(Owned<T>, Shared<'_, T>, Exclusive<'_, T>);

impl<T: CudaElement> RelayBuffer<T> for OnStream<Owned<T>> {
    fn upload(&mut self, host: &[T]) -> Result<()> {
        upload(self, host)
    }
}

impl<T: CudaElement> RelayBuffer<T> for OnStream<Exclusive<'_, T>> {
    fn upload(&mut self, host: &[T]) -> Result<()> {
        upload(self, host)
    }
}

/// Page-locked host memory, so that the copies run at full PCIe/NVLink-C2C speed; grows to the
/// largest collective seen.
pub(crate) struct PinnedRelay {
    pub(crate) ctx: Arc<CudaContext>,
    pub(crate) buf: Option<PinnedHostSlice<u8>>,
    pub(crate) rank: usize,
}

impl HostRelay for PinnedRelay {
    fn get(&mut self, bytes: usize) -> Result<&mut [u8]> {
        if self.buf.as_ref().is_none_or(|b| b.len() < bytes) {
            self.buf = None;
            // SAFETY: the memory is uninitialised bytes; every byte handed out is written (by a
            // download or a receive) before it is read, and u8 has no invalid values.
            let b = unsafe { self.ctx.alloc_pinned::<u8>(bytes.max(1 << 20)) }
                .map_err(driver_err("cuMemHostAlloc", self.rank))?;
            self.buf = Some(b);
        }
        let b = self.buf.as_mut().expect("allocated above");
        let s = b
            .as_mut_slice()
            .map_err(driver_err("cuMemHostAlloc", self.rank))?;
        Ok(&mut s[..bytes])
    }
}
