//! The adapter contract: what a tensor framework implements so that the framework-agnostic
//! machinery of this crate (the [`Reducer`], start-up broadcast) can drive its models, and the
//! shared driver functions built on it.
//!
//! A framework adapter (`ddp-candle`, `ddp-burn`) implements [`ParamAccess`] for its
//! list of named parameters:
//! - parameter specs in registration order ([`ParamAccess::spec`]), the same on every rank;
//! - flat host views of a backward's gradients ([`ParamAccess::with_grad`]), ideally borrowed
//!   without a copy;
//! - writing averaged gradients back into the framework's gradient container
//!   ([`ParamAccess::put_grad`]);
//! - optionally, gradients in device memory ([`ParamAccess::with_device_grad`],
//!   [`ParamAccess::put_device_grad`]): with device buckets the drivers flatten into and
//!   unflatten out of them on the device, and fall back to the host views otherwise;
//! - reading and writing parameter values ([`ParamAccess::read_param`],
//!   [`ParamAccess::write_param`]).
//!
//! Then the same code serves every framework: [`param_specs`] for [`Reducer::new`],
//! [`mark_grads`] after a backward (reverse registration order, so buckets fill in backward
//! order), [`averaged_grads`] after [`Reducer::finish`], and [`broadcast_params`] at start-up.
//! Flat views are [`HostSlice`]s, the closed enum over the collective dtypes.
//!
//! ```text
//!   framework backward ──► Grads ──mark_grads──► Reducer ──finish──► averaged_grads ──► Grads
//!        (candle GradStore)      (with_grad: HostSlice)               (put_grad)   (optimizer)
//! ```
//!
//! Above the drivers, [`DdpCore`] is the framework-agnostic half of a DDP wrapper (process
//! group, reducer, `no_sync`'s [`NoSync`] guard, the [`Join`](crate::Join) step, statistics,
//! the checkpoint tail), which each adapter's `DistributedDataParallel` embeds and exposes
//! through `Deref` (module [`core`]).

pub mod core;

pub use self::core::{DdpCore, DdpWrapper, Deferred, NoSync, StateSync};

use crate::error::Result;
use crate::reducer::{DeviceSlice, HostBuffer, HostSlice, ParamSpec, Reducer};
use ddp_comm::{DType, Element, ProcessGroup};
use half::{bf16, f16};

/// A framework's named parameters in a fixed registration order (see the module doc).
pub trait ParamAccess {
    /// The framework's gradients of one backward (candle: `GradStore`).
    type Grads;
    /// The adapter's error type; it carries this crate's errors.
    type Error: From<crate::Error>;

    /// Number of parameters.
    fn param_count(&self) -> usize;

    /// Name, shape and dtype of parameter `index` (registration order).
    fn spec(&self, index: usize) -> Result<ParamSpec, Self::Error>;

    /// Calls `f` with the gradient of parameter `index` in `grads` as a flat, row-major host
    /// slice; `Ok(None)` when `grads` holds no gradient for it.
    fn with_grad<R>(
        &self,
        grads: &Self::Grads,
        index: usize,
        f: impl FnOnce(HostSlice<'_>) -> R,
    ) -> Result<Option<R>, Self::Error>;

    /// Stores `grad` (flat, row-major) as the gradient of parameter `index` in `out`.
    fn put_grad(
        &self,
        out: &mut Self::Grads,
        index: usize,
        grad: HostSlice<'_>,
    ) -> Result<(), Self::Error>;

    /// Calls `f` with the gradient of parameter `index` in `grads` as device memory, when it
    /// lives on a device the reducer's device buckets take (flatten on the device, no host
    /// copy). `Ok(None)` when there is no such gradient (absent, or in host memory): the
    /// drivers then use [`with_grad`](Self::with_grad). Default: `Ok(None)`.
    fn with_device_grad<R>(
        &self,
        grads: &Self::Grads,
        index: usize,
        f: impl FnOnce(DeviceSlice<'_>) -> R,
    ) -> Result<Option<R>, Self::Error> {
        let _ = (grads, index, f);
        Ok(None)
    }

    /// Stores `grad` (device memory, a view into a device bucket) as the gradient of parameter
    /// `index` in `out` with a device copy (the unflatten); `Ok(false)` when this adapter cannot
    /// take that memory (the drivers then copy through the host with
    /// [`put_grad`](Self::put_grad)). Default: `Ok(false)`.
    fn put_device_grad(
        &self,
        out: &mut Self::Grads,
        index: usize,
        grad: DeviceSlice<'_>,
    ) -> Result<bool, Self::Error> {
        let _ = (out, index, grad);
        Ok(false)
    }

    /// Called by [`mark_grads`] once the reducer holds parameter `index`'s gradient: an adapter
    /// may drop its own from `grads`, so that a backward's gradients leave the framework's
    /// container as they enter the buckets instead of both being held whole (candle does: 4Ψ
    /// bytes less at the peak for f32 parameters). Default: keep it.
    fn release_grad(&self, grads: &mut Self::Grads, index: usize) {
        let _ = (grads, index);
    }

    /// The values of parameter `index`, flat and row-major.
    fn read_param(&self, index: usize) -> Result<HostBuffer, Self::Error>;

    /// Sets parameter `index` from flat, row-major `values`.
    fn write_param(&self, index: usize, values: HostSlice<'_>) -> Result<(), Self::Error>;
}

/// Every parameter's spec, in registration order (for [`Reducer::new`]).
pub fn param_specs<P: ParamAccess + ?Sized>(params: &P) -> Result<Vec<ParamSpec>, P::Error> {
    (0..params.param_count()).map(|i| params.spec(i)).collect()
}

/// Hands every gradient present in `grads` to the reducer, last parameter first (backward
/// order). `before(index, grads)` runs before each one is handed over (to reject it, or to keep
/// a local copy); [`ParamAccess::release_grad`] after.
pub fn mark_grads<P: ParamAccess + ?Sized>(
    params: &P,
    reducer: &mut Reducer,
    grads: &mut P::Grads,
    mut before: impl FnMut(usize, &P::Grads) -> Result<(), P::Error>,
) -> Result<(), P::Error> {
    for i in (0..params.param_count()).rev() {
        let held: &P::Grads = grads;
        if reducer.is_device_bucket(i) {
            let mut checked = Ok(());
            let marked = params.with_device_grad(held, i, |g| {
                checked = before(i, held);
                match &checked {
                    Ok(()) => reducer.mark_ready_device(i, g),
                    Err(_) => Ok(()),
                }
            })?;
            if let Some(r) = marked {
                checked?;
                r?;
                params.release_grad(grads, i);
                continue;
            }
        }
        let mut checked = Ok(());
        let marked = params.with_grad(held, i, |g| {
            checked = before(i, held);
            match &checked {
                Ok(()) => reducer.mark_ready_flat(i, g),
                Err(_) => Ok(()),
            }
        })?;
        checked?;
        if let Some(r) = marked {
            r?;
            params.release_grad(grads, i);
        }
    }
    Ok(())
}

/// The averaged gradients of every parameter after a synchronized [`Reducer::finish`], in the
/// framework's container.
pub fn averaged_grads<P>(params: &P, reducer: &Reducer) -> Result<P::Grads, P::Error>
where
    P: ParamAccess + ?Sized,
    P::Grads: Default,
{
    let mut out = P::Grads::default();
    for i in 0..params.param_count() {
        let on_device = reducer.with_device_grad(i, |g| params.put_device_grad(&mut out, i, g))?;
        if !matches!(on_device, Some(Ok(true))) {
            on_device.transpose()?;
            reducer.with_grad(i, |g| params.put_grad(&mut out, i, g))??;
        }
    }
    Ok(out)
}

/// Copies rank `root`'s parameter values to every rank (a collective; every rank must hold
/// parameters of the same specs): consecutive parameters of one dtype are read into one flat
/// buffer, broadcast and written back, in groups of at most [`PARAM_BROADCAST_BYTES`] (or one
/// parameter), so that the host copy alive at any time is one group.
pub fn broadcast_params<P: ParamAccess + ?Sized>(
    params: &P,
    pg: &ProcessGroup,
    root: usize,
) -> Result<(), P::Error> {
    broadcast_params_in_groups(params, pg, root, PARAM_BROADCAST_BYTES)
}

/// Group size of [`broadcast_params`]: 32 MiB. PyTorch flattens 250 MB buckets
/// ([`crate::reducer::BROADCAST_BUCKET_BYTES`]) on the device; here each group is a host copy of the
/// parameters on top of the model, which at 250 MiB would be a whole model twice over
/// for the ZeRO benchmark (set the run's peak resident memory). Broadcasting 32 MiB at a time costs a few more
/// messages, once, at start-up.
pub const PARAM_BROADCAST_BYTES: usize = 32 * 1024 * 1024;

/// [`broadcast_params`] with groups of at most `cap` bytes: each group's values are read into
/// one flat buffer (the only copy alive), broadcast, and written back.
fn broadcast_params_in_groups<P: ParamAccess + ?Sized>(
    params: &P,
    pg: &ProcessGroup,
    root: usize,
    cap: usize,
) -> Result<(), P::Error> {
    fn group<T: Element, P: ParamAccess + ?Sized>(
        params: &P,
        pg: &ProcessGroup,
        root: usize,
        range: std::ops::Range<usize>,
        elems: usize,
    ) -> Result<(), P::Error> {
        let mut flat: Vec<T> = Vec::with_capacity(elems);
        for i in range.clone() {
            let v = params.read_param(i)?;
            let s = v.as_slice::<T>().ok_or_else(|| {
                crate::Error::InvalidArgument(format!(
                    "parameter {i} reads as {}, its spec says {}",
                    v.dtype(),
                    T::DTYPE
                ))
            })?;
            flat.extend_from_slice(s);
        }
        pg.broadcast(&mut flat, root).map_err(crate::Error::from)?;
        let mut off = 0;
        for i in range {
            let n = params.spec(i)?.numel();
            params.write_param(i, HostSlice::of(&flat[off..off + n]))?;
            off += n;
        }
        Ok(())
    }
    let n = params.param_count();
    let mut start = 0;
    while start < n {
        let first = params.spec(start)?;
        let (dtype, mut bytes) = (first.dtype, first.numel() * first.dtype.size());
        let mut end = start + 1;
        while end < n {
            let next = params.spec(end)?;
            let b = next.numel() * next.dtype.size();
            if next.dtype != dtype || bytes + b > cap {
                break;
            }
            bytes += b;
            end += 1;
        }
        let elems = bytes / dtype.size();
        match dtype {
            DType::F32 => group::<f32, P>(params, pg, root, start..end, elems)?,
            DType::F64 => group::<f64, P>(params, pg, root, start..end, elems)?,
            DType::F16 => group::<f16, P>(params, pg, root, start..end, elems)?,
            DType::BF16 => group::<bf16, P>(params, pg, root, start..end, elems)?,
            DType::I32 => group::<i32, P>(params, pg, root, start..end, elems)?,
            DType::I64 => group::<i64, P>(params, pg, root, start..end, elems)?,
            DType::U8 => group::<u8, P>(params, pg, root, start..end, elems)?,
        }
        start = end;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reducer::ReducerOptions;
    use ddp_comm::DType;
    use std::cell::RefCell;
    use std::collections::HashMap;

    /// The smallest framework: named `f32` vectors, gradients in a map.
    pub(super) struct Toy {
        pub(super) params: Vec<(String, RefCell<Vec<f32>>)>,
    }

    impl ParamAccess for Toy {
        type Grads = HashMap<usize, Vec<f32>>;
        type Error = crate::Error;
        fn param_count(&self) -> usize {
            self.params.len()
        }
        fn spec(&self, i: usize) -> Result<ParamSpec> {
            let (name, v) = &self.params[i];
            Ok(ParamSpec::new(
                name.clone(),
                vec![v.borrow().len()],
                DType::F32,
            ))
        }
        fn with_grad<R>(
            &self,
            grads: &Self::Grads,
            i: usize,
            f: impl FnOnce(HostSlice<'_>) -> R,
        ) -> Result<Option<R>> {
            Ok(grads.get(&i).map(|g| f(HostSlice::of(&g[..]))))
        }
        fn put_grad(&self, out: &mut Self::Grads, i: usize, g: HostSlice<'_>) -> Result<()> {
            out.insert(i, g.get::<f32>().unwrap().to_vec());
            Ok(())
        }
        fn release_grad(&self, grads: &mut Self::Grads, i: usize) {
            grads.remove(&i);
        }
        fn read_param(&self, i: usize) -> Result<HostBuffer> {
            Ok(HostBuffer::from(self.params[i].1.borrow().clone()))
        }
        fn write_param(&self, i: usize, v: HostSlice<'_>) -> Result<()> {
            *self.params[i].1.borrow_mut() = v.get::<f32>().unwrap().to_vec();
            Ok(())
        }
    }

    #[test]
    fn parameters_are_broadcast_in_groups_of_the_cap_whatever_their_sizes() {
        // Sizes around a cap of 3 elements (12 bytes): one larger than the cap, an empty one,
        // groups that fill the cap exactly and one that would overflow it.
        let sizes = [1usize, 2, 5, 0, 3, 1, 1, 2];
        for cap in [12, 4, 1 << 20] {
            ddp_comm::testing::run_ranks(3, |pg| {
                let r = pg.rank() as f32;
                let toy = Toy {
                    params: sizes
                        .iter()
                        .enumerate()
                        .map(|(i, &n)| {
                            let v = (0..n).map(|k| r * 100.0 + i as f32 * 10.0 + k as f32);
                            (format!("p{i}"), RefCell::new(v.collect()))
                        })
                        .collect(),
                };
                broadcast_params_in_groups(&toy, &pg, 2, cap).unwrap();
                for (i, &n) in sizes.iter().enumerate() {
                    let want: Vec<f32> =
                        (0..n).map(|k| 200.0 + i as f32 * 10.0 + k as f32).collect();
                    assert_eq!(*toy.params[i].1.borrow(), want, "p{i}, cap {cap}");
                }
            });
        }
    }

    #[test]
    fn the_shared_driver_runs_a_toy_framework_across_ranks() {
        let out = ddp_comm::testing::run_ranks(3, |pg| {
            let r = pg.rank() as f32;
            let toy = Toy {
                params: vec![
                    ("a".into(), RefCell::new(vec![r; 3])),
                    ("b".into(), RefCell::new(vec![r * 10.0; 2])),
                ],
            };
            broadcast_params(&toy, &pg, 1).unwrap();
            assert_eq!(*toy.params[0].1.borrow(), vec![1.0; 3]);
            assert_eq!(*toy.params[1].1.borrow(), vec![10.0; 2]);
            let specs = param_specs(&toy).unwrap();
            let mut red = Reducer::new(&pg, specs, ReducerOptions::default()).unwrap();
            // Parameter b has a gradient on rank 0 only; a counts on every rank.
            let local = || {
                let mut grads = HashMap::new();
                grads.insert(0, vec![r + 1.0; 3]);
                if pg.rank() == 0 {
                    grads.insert(1, vec![6.0; 2]);
                }
                grads
            };
            let mut grads = local();
            let mut order = Vec::new();
            mark_grads(&toy, &mut red, &mut grads, |i, _| {
                order.push(i);
                Ok(())
            })
            .unwrap();
            assert_eq!(order, if pg.rank() == 0 { vec![1, 0] } else { vec![0] });
            // Each gradient was released once the reducer held it.
            assert!(grads.is_empty(), "{grads:?}");
            red.finish().unwrap();
            let avg = averaged_grads(&toy, &red).unwrap();
            assert_eq!(avg[&0], vec![2.0; 3]);
            assert_eq!(avg[&1], vec![2.0; 2]);
            // `before` can refuse a parameter: nothing of it reaches the reducer.
            let e = mark_grads(&toy, &mut red, &mut local(), |i, _| match i {
                0 => Err(crate::Error::InvalidArgument("no a".into())),
                _ => Ok(()),
            })
            .unwrap_err();
            assert!(e.to_string().contains("no a"));
            avg
        });
        assert!(out.iter().all(|a| a == &out[0]));
    }
}
