//! The caller's side of an all-gather whose result the caller places
//! ([`crate::ProcessGroup::all_gather_in_place_to`]): [`Place`], the byte-level callback every
//! backend and the shared-memory algorithm ([`crate::algorithms::shm_direct::all_gather_to`])
//! take, [`place_from`] (the reads served out of a gathered buffer) and the range check both
//! paths apply to each read.
//!
//! A leaf below `backend` and `algorithms` (it needs only the error type), so an algorithm takes
//! a placement without depending on the backends that call it.

use crate::{Error, Result};

/// The caller's side of [`CollectiveBackend::all_gather_in_place_to`]: given `read(offset,
/// dst)`, it reads the ranges of the gathered buffer it wants into its own memory.
///
/// [`CollectiveBackend::all_gather_in_place_to`]: crate::backend::CollectiveBackend::all_gather_in_place_to
pub type Place<'a> =
    &'a mut (dyn FnMut(&mut dyn FnMut(usize, &mut [u8]) -> Result<()>) -> Result<()> + Send);

/// [`CollectiveBackend::all_gather_in_place_to`]'s reads out of the gathered buffer `bytes`
/// (elements of `esz` bytes); a range outside it is an error naming it.
///
/// [`CollectiveBackend::all_gather_in_place_to`]: crate::backend::CollectiveBackend::all_gather_in_place_to
pub fn place_from(bytes: &[u8], esz: usize, place: Place<'_>) -> Result<()> {
    place(&mut |offset, dst| {
        let start = placed_range(offset, dst.len(), bytes.len(), esz)?;
        dst.copy_from_slice(&bytes[start..start + dst.len()]);
        Ok(())
    })
}

/// The first byte of a `read(offset, dst)` of `n` bytes out of a gathered buffer of `len`
/// bytes (elements of `esz`), or the error naming a range outside it or not whole elements.
pub(crate) fn placed_range(offset: usize, n: usize, len: usize, esz: usize) -> Result<usize> {
    let start = offset * esz;
    if start + n > len || !n.is_multiple_of(esz) {
        return Err(Error::InvalidArgument(format!(
            "all_gather_in_place_to: {n} bytes at element {offset} asked of a gathered buffer \
             of {} elements",
            len / esz
        )));
    }
    Ok(start)
}
