//! [`BurnParams`]: Burn's side of the adapter contract of `ddp-core` ([`ddp_core::adapter::ParamAccess`]).
//!
//! Burn gives every parameter a random [`ParamId`] per process, so ids cannot name a parameter
//! across ranks. The order and the names here come from the module's *structure* instead: a
//! [`ModuleVisitor`] walks the module (fields in declaration order, `Vec`/tuple/array elements by
//! index) and names each trainable float parameter by its path (`fc1.weight`, `layers.0.bias`).
//! That walk is the same on every rank for the same model type. The ids are kept only to find
//! gradients in this process's `GradientsParams`, and are refreshed from the module before every
//! backward (an optimizer step keeps them; loading a record replaces them with the record's).
//!
//! ```text
//!   module ──visit (paths)──► [fc1.weight, fc1.bias, fc2.weight, fc2.bias]  same on every rank
//!                                   │ ParamId (this process only)
//!   loss.backward() ─► GradientsParams ─with_grad─► Reducer ─finish─► put_grad ─► GradientsParams
//! ```

use crate::{Error, Result};
use burn::module::{Module, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::optim::GradientsParams;
use burn::tensor::{Bytes, DType, Device, Tensor, TensorData};
use ddp_core::adapter::ParamAccess;
use ddp_core::reducer::{HostBuffer, HostSlice, ParamSpec};
use std::cell::RefCell;

/// One trainable parameter: structural path, id in this process, shape, dtype, device.
#[derive(Debug, Clone)]
struct Entry {
    path: String,
    id: ParamId,
    shape: Vec<usize>,
    dtype: DType,
    /// Device of the parameter's gradient (the parameter's device without autodiff).
    grad_device: Device,
}

/// The trainable float parameters of a Burn module in structural order (see the module doc),
/// plus a pending area for values read from and written to the module (start-up broadcast,
/// replica checks).
#[derive(Debug)]
pub struct BurnParams {
    entries: Vec<Entry>,
    /// Values of the parameters as last read by [`BurnParams::capture`], or as written by
    /// `write_param`; [`BurnParams::apply`] writes them into a module.
    pending: RefCell<Vec<Option<HostBuffer>>>,
    /// Gradients taken out of a `GradientsParams` by [`BurnParams::take_grads`] for one
    /// synchronized hand-over to the reducer (owned, so burn-flex gives their data without a
    /// copy); `with_grad` reads them first.
    taken: RefCell<Vec<Option<TensorData>>>,
}

/// Runs `$body` with `const $d: usize` set to `$rank` (Burn's tensors carry their rank in the
/// type; parameters of rank 1 to 8 are supported).
macro_rules! with_rank {
    ($rank:expr, $path:expr, |$d:ident| $body:expr) => {
        with_rank!(@arms $rank, $path, $d, $body, [1 2 3 4 5 6 7 8])
    };
    (@arms $rank:expr, $path:expr, $d:ident, $body:expr, [$($n:literal)*]) => {
        match $rank {
            $($n => {
                const $d: usize = $n;
                $body
            })*
            r => Err(Error::Unsupported(format!(
                "parameter `{}` has rank {r}; ddp-burn supports ranks 1 to 8",
                $path
            ))),
        }
    };
}

fn comm_dtype(path: &str, dtype: DType) -> Result<ddp_comm::DType> {
    match dtype {
        DType::F32 => Ok(ddp_comm::DType::F32),
        DType::F64 => Ok(ddp_comm::DType::F64),
        other => Err(Error::Unsupported(format!(
            "parameter `{path}` has dtype {other:?}; ddp-burn averages F32 and F64 parameters"
        ))),
    }
}

/// Flat host copy of `data` (a parameter or gradient called `path`).
fn host_buffer(path: &str, data: &TensorData) -> Result<HostBuffer> {
    with_host_slice(path, data, |s| s.to_buffer())
}

fn with_host_slice<R>(
    path: &str,
    data: &TensorData,
    f: impl FnOnce(HostSlice<'_>) -> R,
) -> Result<R> {
    let bad = |e| Error::Unsupported(format!("parameter `{path}`: cannot read its data: {e:?}"));
    match data.dtype() {
        DType::F32 => Ok(f(HostSlice::of(data.as_slice::<f32>().map_err(bad)?))),
        DType::F64 => Ok(f(HostSlice::of(data.as_slice::<f64>().map_err(bad)?))),
        other => Err(Error::Unsupported(format!(
            "parameter `{path}` has dtype {other:?}; ddp-burn averages F32 and F64 parameters"
        ))),
    }
}

fn tensor_data(e: &Entry, values: HostSlice<'_>) -> Result<TensorData> {
    let wrong = || {
        Error::Unsupported(format!(
            "parameter `{}`: got {} values of {:?} for shape {:?} of {:?}",
            e.path,
            values.len(),
            values.dtype(),
            e.shape,
            e.dtype
        ))
    };
    if values.len() != e.shape.iter().product::<usize>() {
        return Err(wrong());
    }
    match e.dtype {
        DType::F32 => Ok(TensorData::new(
            values.get::<f32>().ok_or_else(wrong)?.to_vec(),
            e.shape.clone(),
        )),
        DType::F64 => Ok(TensorData::new(
            values.get::<f64>().ok_or_else(wrong)?.to_vec(),
            e.shape.clone(),
        )),
        _ => Err(wrong()),
    }
}

/// [`tensor_data`] taking the values over (no copy when their dtype is the parameter's).
fn owned_tensor_data(e: &Entry, values: HostBuffer) -> Result<TensorData> {
    let n: usize = e.shape.iter().product();
    match (values, e.dtype) {
        (HostBuffer::F32(v), DType::F32) if v.len() == n => Ok(TensorData::new(v, e.shape.clone())),
        (HostBuffer::F64(v), DType::F64) if v.len() == n => Ok(TensorData::new(v, e.shape.clone())),
        (v, _) => tensor_data(e, v.as_host_slice()),
    }
}

/// Collects the structure (and optionally the values) of a module's trainable float parameters.
struct Walk {
    path: Vec<String>,
    entries: Vec<Entry>,
    values: Option<Vec<Result<HostBuffer>>>,
}

impl ModuleVisitor for Walk {
    fn enter_module(&mut self, name: &str, _container_type: &str) {
        self.path.push(name.to_string());
    }

    fn exit_module(&mut self, _name: &str, _container_type: &str) {
        self.path.pop();
    }

    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        if !param.is_require_grad() {
            return; // frozen parameters and buffers are not averaged
        }
        let value = param.val();
        let path = self.path.join(".");
        if let Some(values) = &mut self.values {
            values.push(host_buffer(&path, &value.clone().into_data()));
        }
        self.entries.push(Entry {
            path,
            id: param.id,
            shape: value.dims().to_vec(),
            dtype: value.dtype(),
            grad_device: value.device().inner(),
        });
    }
}

fn walk<M: Module>(module: &M, with_values: bool) -> Walk {
    let mut w = Walk {
        path: Vec::new(),
        entries: Vec::new(),
        values: with_values.then(Vec::new),
    };
    module.visit(&mut w);
    w
}

/// Views of ranges of the trainable parameters' flat values, in walk order (see
/// [`BurnParams::ranges`]).
struct Ranges<'a> {
    /// `(parameter, first element, elements)`.
    want: &'a [(usize, usize, usize)],
    next: usize,
    out: Vec<Option<Tensor<1>>>,
}

impl ModuleVisitor for Ranges<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        if !param.is_require_grad() {
            return;
        }
        let i = self.next;
        self.next += 1;
        for (k, &(p, offset, len)) in self.want.iter().enumerate() {
            if p == i {
                let t = param.val().inner();
                let n = t.dims().iter().product::<usize>();
                self.out[k] = Some(t.reshape([n]).narrow(0, offset, len));
            }
        }
    }
}

/// Buffers and the parameters that become windows of them: `(buffer, [(parameter, first
/// element)])` (see [`BurnParams::apply_windows`]).
pub(crate) type Windows = Vec<(Vec<f32>, Vec<(usize, usize)>)>;

/// Writes pending values into the trainable parameters, in walk order.
struct Apply<'a> {
    entries: &'a [Entry],
    values: Vec<Option<HostBuffer>>,
    /// Tensor data to take as it is (e.g. windows of a shared buffer); before `values`.
    data: Vec<Option<TensorData>>,
    next: usize,
    error: Option<Error>,
}

impl ModuleMapper for Apply<'_> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        if !param.is_require_grad() {
            return param;
        }
        let i = self.next;
        self.next += 1;
        if let Some(data) = self.data.get_mut(i).and_then(Option::take) {
            let id = param.id;
            let device = param.val().device();
            return param.transform_for_load(Tensor::from_data(data, &device), id);
        }
        let (Some(e), Some(Some(v))) = (
            self.entries.get(i),
            self.values.get_mut(i).map(Option::take),
        ) else {
            return param;
        };
        match owned_tensor_data(e, v) {
            Ok(data) => {
                let id = param.id;
                let device = param.val().device();
                param.transform_for_load(Tensor::from_data(data, &device), id)
            }
            Err(err) => {
                self.error.get_or_insert(err);
                param
            }
        }
    }
}

impl BurnParams {
    /// The trainable float parameters of `module` in structural order. Fails, naming the
    /// parameter, on a path used twice or a dtype other than F32/F64.
    pub fn new<M: Module>(module: &M) -> Result<Self> {
        let entries = walk(module, false).entries;
        let mut seen = std::collections::HashSet::new();
        for e in &entries {
            if !seen.insert(e.path.as_str()) {
                return Err(Error::Unsupported(format!(
                    "parameter path `{}` appears twice in the module; ddp-burn names parameters \
                     by their path",
                    e.path
                )));
            }
            comm_dtype(&e.path, e.dtype)?;
        }
        let pending = RefCell::new(vec![None; entries.len()]);
        let taken = RefCell::new(vec![None; entries.len()]);
        Ok(BurnParams {
            entries,
            pending,
            taken,
        })
    }

    /// Moves every parameter's gradient out of `grads` into this adapter's hand-over slots,
    /// until [`clear_taken`](Self::clear_taken): a gradient that `GradientsParams` still shares
    /// is copied by `into_data`, an owned one is not (burn-flex; `docs/benchmarks.md`,
    /// "Candle, Burn and PyTorch on CPUs"). For a synchronized step only, whose local gradients are not returned.
    pub(crate) fn take_grads(&self, grads: &mut GradientsParams) -> Result<()> {
        let mut taken = self.taken.borrow_mut();
        for (e, slot) in self.entries.iter().zip(taken.iter_mut()) {
            *slot = with_rank!(e.shape.len(), e.path, |D| Ok(grads
                .remove::<D>(e.id)
                .map(|g| g.into_data())))?;
        }
        Ok(())
    }

    /// The averaged gradients as zero-copy windows of the reducer's bucket buffers (each
    /// buffer shared behind an `Arc` by Burn's `Bytes`, one view per parameter, freed with the
    /// last gradient that uses it; a backend that writes to one copies it first), instead of
    /// copying them out (`docs/benchmarks.md`, "Candle, Burn and PyTorch on CPUs").
    pub(crate) fn grads_from_buckets(
        &self,
        taken: impl IntoIterator<Item = ddp_core::reducer::TakenBucket>,
    ) -> Result<GradientsParams> {
        let mut out = GradientsParams::new();
        for (buffer, layout) in taken {
            let (bytes, esz) = match buffer {
                HostBuffer::F32(v) => (Bytes::from_elems(v), 4),
                HostBuffer::F64(v) => (Bytes::from_elems(v), 8),
                other => {
                    return Err(Error::Unsupported(format!(
                        "a {} gradient bucket for Burn parameters (f32 and f64 only)",
                        other.dtype()
                    )))
                }
            };
            let shared = bytes.shared();
            for p in layout.iter() {
                let e = &self.entries[p.index];
                let view = shared
                    .view(p.offset * esz, (p.offset + p.numel) * esz)
                    .map_err(|v| {
                        Error::Unsupported(format!("a view of `{}`'s gradient: {v:?}", e.path))
                    })?;
                let data = TensorData::from_bytes(view, e.shape.clone(), e.dtype);
                with_rank!(e.shape.len(), e.path, |D| {
                    out.register::<D>(e.id, Tensor::from_data(data, &e.grad_device));
                    Ok(())
                })?;
            }
        }
        Ok(out)
    }

    /// Moves every parameter's gradient in `from` into `into` (added to one already there).
    pub(crate) fn merge_grads(
        &self,
        mut from: GradientsParams,
        into: &mut GradientsParams,
    ) -> Result<()> {
        for e in &self.entries {
            with_rank!(e.shape.len(), e.path, |D| {
                if let Some(g) = from.remove::<D>(e.id) {
                    let g = match into.remove::<D>(e.id) {
                        Some(prev) => prev + g,
                        None => g,
                    };
                    into.register::<D>(e.id, g);
                }
                Ok(())
            })?;
        }
        Ok(())
    }

    /// Empties the hand-over slots filled by [`take_grads`](Self::take_grads).
    pub(crate) fn clear_taken(&self) {
        self.taken.borrow_mut().iter_mut().for_each(|t| *t = None);
    }

    /// The device of parameter `index`'s gradient (its device without autodiff).
    pub(crate) fn grad_device(&self, index: usize) -> &Device {
        &self.entries[index].grad_device
    }

    /// PyTorch's `clip_grad_norm_` over whole gradients (every rank holds them all): scales
    /// them by `max_norm / (norm + 1e-6)` when that is below 1; returns the global L2 norm.
    pub(crate) fn clip_grad_norm(&self, grads: &mut GradientsParams, max_norm: f64) -> Result<f64> {
        let mut sq = 0f64;
        for i in 0..self.entries.len() {
            self.with_grad(grads, i, |s| {
                sq += match (s.get::<f32>(), s.get::<f64>()) {
                    (Some(v), _) => v.iter().map(|&x| f64::from(x) * f64::from(x)).sum(),
                    (_, Some(v)) => v.iter().map(|&x| x * x).sum(),
                    _ => 0.0,
                }
            })?;
        }
        let norm = sq.sqrt();
        let coef = max_norm / (norm + 1e-6);
        if coef < 1.0 {
            for e in &self.entries {
                with_rank!(e.shape.len(), e.path, |D| {
                    if let Some(g) = grads.remove::<D>(e.id) {
                        grads.register::<D>(e.id, g.mul_scalar(coef));
                    }
                    Ok(())
                })?;
            }
        }
        Ok(norm)
    }

    /// Holds `values` pending for parameter `index` (taken over: [`apply`](Self::apply) moves them
    /// into the tensor), checking their length and dtype now.
    pub(crate) fn set_pending(&self, index: usize, values: HostBuffer) -> Result<()> {
        let e = &self.entries[index];
        let n: usize = e.shape.iter().product();
        let fits = matches!(
            (&values, e.dtype),
            (HostBuffer::F32(_), DType::F32) | (HostBuffer::F64(_), DType::F64)
        );
        if !fits || values.len() != n {
            return Err(Error::Unsupported(format!(
                "parameter `{}`: got {} values of {} for shape {:?} of {:?}",
                e.path,
                values.len(),
                values.dtype(),
                e.shape,
                e.dtype
            )));
        }
        self.pending.borrow_mut()[index] = Some(values);
        Ok(())
    }

    /// The parameter paths, in order.
    pub fn names(&self) -> Vec<&str> {
        self.entries.iter().map(|e| e.path.as_str()).collect()
    }

    /// Re-reads the parameter ids from `module` (after a record was loaded, or for a module
    /// rebuilt by the user), checking that it has the same parameters as at construction.
    pub fn refresh_ids<M: Module>(&mut self, module: &M) -> Result<()> {
        let now = walk(module, false).entries;
        self.check_same(&now)?;
        for (e, n) in self.entries.iter_mut().zip(now) {
            e.id = n.id;
        }
        Ok(())
    }

    fn check_same(&self, now: &[Entry]) -> Result<()> {
        if now.len() != self.entries.len() {
            return Err(Error::Unsupported(format!(
                "the module now has {} trainable parameters, {} when it was wrapped",
                now.len(),
                self.entries.len()
            )));
        }
        for (e, n) in self.entries.iter().zip(now) {
            if (&e.path, &e.shape, e.dtype) != (&n.path, &n.shape, n.dtype) {
                return Err(Error::Unsupported(format!(
                    "parameter `{}` (shape {:?}, {:?}) is now `{}` (shape {:?}, {:?}); the \
                     module's structure must not change once wrapped",
                    e.path, e.shape, e.dtype, n.path, n.shape, n.dtype
                )));
            }
        }
        Ok(())
    }

    /// Elements `offset..offset + len` of each `(parameter, offset, len)` of `want` in
    /// `module`, flat, as views without autodiff (nothing is copied).
    pub(crate) fn ranges<M: Module>(
        &self,
        module: &M,
        want: &[(usize, usize, usize)],
    ) -> Result<Vec<Tensor<1>>> {
        let mut r = Ranges {
            want,
            next: 0,
            out: vec![None; want.len()],
        };
        module.visit(&mut r);
        r.out
            .into_iter()
            .zip(want)
            .map(|(v, (p, _, _))| {
                v.ok_or_else(|| {
                    Error::Unsupported(format!("the module has no trainable parameter {p}"))
                })
            })
            .collect()
    }

    /// Parameter `index`'s values in `module`, flat (one copy of that parameter only).
    pub(crate) fn read_one<M: Module>(&self, module: &M, index: usize) -> Result<HostBuffer> {
        let e = &self.entries[index];
        let n = e.shape.iter().product();
        let mut view = self.ranges(module, &[(index, 0, n)])?;
        let view = view.pop().expect("one range asked");
        host_buffer(&e.path, &view.into_data())
    }

    /// Reads every parameter's value from `module` into the pending area (for `read_param`).
    pub fn capture<M: Module>(&self, module: &M) -> Result<()> {
        let w = walk(module, true);
        self.check_same(&w.entries)?;
        let values = w.values.unwrap_or_default();
        *self.pending.borrow_mut() = values
            .into_iter()
            .map(|v| v.map(Some))
            .collect::<Result<_>>()?;
        Ok(())
    }

    /// Writes the pending values (from `write_param`) into `module`'s parameters, keeping their
    /// ids, devices and `require_grad`, and clears the pending area.
    pub fn apply<M: Module>(&self, module: M) -> Result<M> {
        let values = std::mem::replace(
            &mut *self.pending.borrow_mut(),
            vec![None; self.entries.len()],
        );
        let mut mapper = Apply {
            entries: &self.entries,
            values,
            data: Vec::new(),
            next: 0,
            error: None,
        };
        let module = module.map(&mut mapper);
        match mapper.error {
            Some(e) => Err(e),
            None => Ok(module),
        }
    }

    /// Makes f32 parameters windows of `buffers` (each `(buffer, [(parameter, first element)])`,
    /// shared behind an `Arc` by Burn's `Bytes`, freed with the last parameter that uses it; a
    /// backend that writes to one copies it first), not copies: ZeRO stage 1's all-gathered
    /// buckets become the parameters as they are.
    pub(crate) fn apply_windows<M: Module>(&self, module: M, buffers: Windows) -> Result<M> {
        let mut data: Vec<Option<TensorData>> = vec![None; self.entries.len()];
        for (buffer, params) in buffers {
            let shared = Bytes::from_elems(buffer).shared();
            for (p, offset) in params {
                let e = &self.entries[p];
                let n: usize = e.shape.iter().product();
                if e.dtype != DType::F32 {
                    return Err(Error::Unsupported(format!(
                        "parameter `{}` is {:?}, not f32",
                        e.path, e.dtype
                    )));
                }
                let view = shared.view(offset * 4, (offset + n) * 4).map_err(|v| {
                    Error::Unsupported(format!("a view of `{}`'s values: {v:?}", e.path))
                })?;
                data[p] = Some(TensorData::from_bytes(view, e.shape.clone(), e.dtype));
            }
        }
        let mut mapper = Apply {
            entries: &self.entries,
            values: vec![None; self.entries.len()],
            data,
            next: 0,
            error: None,
        };
        let module = module.map(&mut mapper);
        match mapper.error {
            Some(e) => Err(e),
            None => Ok(module),
        }
    }

    /// Takes the pending values (after [`capture`](Self::capture)), clearing them.
    pub fn take_pending(&self) -> Vec<Option<HostBuffer>> {
        std::mem::replace(
            &mut *self.pending.borrow_mut(),
            vec![None; self.entries.len()],
        )
    }

    /// Whether any value is pending (written or captured, not yet applied or taken).
    pub(crate) fn has_pending(&self) -> bool {
        self.pending.borrow().iter().any(Option::is_some)
    }
}

/// The parameters of a wrapped module as a [`ParamAccess`] that reads the module itself: what
/// [`DistributedDataParallel::with_params`](crate::DistributedDataParallel::with_params) hands to
/// code written against `ParamAccess` that reads and sets parameter values (e.g. `ddp-core`'s
/// DiLoCo outer loop). [`read_param`](ParamAccess::read_param) copies one parameter's current
/// value out of the module when asked (nothing is captured up front);
/// [`write_param`](ParamAccess::write_param) holds the new values, which `with_params` writes
/// into the module once its closure returns. Specs and gradients are [`BurnParams`]'.
pub struct ModuleParams<'a, M: Module> {
    pub(crate) params: &'a BurnParams,
    pub(crate) module: &'a M,
}

impl<M: Module> ParamAccess for ModuleParams<'_, M> {
    type Grads = GradientsParams;
    type Error = Error;

    fn param_count(&self) -> usize {
        self.params.param_count()
    }

    fn spec(&self, index: usize) -> Result<ParamSpec> {
        self.params.spec(index)
    }

    fn with_grad<R>(
        &self,
        grads: &GradientsParams,
        index: usize,
        f: impl FnOnce(HostSlice<'_>) -> R,
    ) -> Result<Option<R>> {
        self.params.with_grad(grads, index, f)
    }

    fn put_grad(&self, out: &mut GradientsParams, index: usize, grad: HostSlice<'_>) -> Result<()> {
        self.params.put_grad(out, index, grad)
    }

    fn read_param(&self, index: usize) -> Result<HostBuffer> {
        self.params.read_one(self.module, index)
    }

    fn write_param(&self, index: usize, values: HostSlice<'_>) -> Result<()> {
        self.params.write_param(index, values)
    }
}

impl ParamAccess for BurnParams {
    type Grads = GradientsParams;
    type Error = Error;

    fn param_count(&self) -> usize {
        self.entries.len()
    }

    fn spec(&self, index: usize) -> Result<ParamSpec> {
        let e = &self.entries[index];
        Ok(ParamSpec::new(
            e.path.clone(),
            e.shape.clone(),
            comm_dtype(&e.path, e.dtype)?,
        ))
    }

    fn with_grad<R>(
        &self,
        grads: &GradientsParams,
        index: usize,
        f: impl FnOnce(HostSlice<'_>) -> R,
    ) -> Result<Option<R>> {
        let e = &self.entries[index];
        if let Some(d) = &self.taken.borrow()[index] {
            return with_host_slice(&e.path, d, f).map(Some);
        }
        let data = with_rank!(e.shape.len(), e.path, |D| Ok(grads
            .get::<D>(e.id)
            .map(|g| g.into_data())))?;
        match data {
            Some(d) => with_host_slice(&e.path, &d, f).map(Some),
            None => Ok(None),
        }
    }

    fn put_grad(&self, out: &mut GradientsParams, index: usize, grad: HostSlice<'_>) -> Result<()> {
        let e = &self.entries[index];
        let data = tensor_data(e, grad)?;
        with_rank!(e.shape.len(), e.path, |D| {
            out.register::<D>(e.id, Tensor::from_data(data, &e.grad_device));
            Ok(())
        })
    }

    /// A gradient taken for a synchronized hand-over is dropped once the reducer holds it:
    /// Burn's backward gives every gradient at once, and they leave as the buckets fill instead
    /// of being held whole next to them (4Ψ bytes less at the peak for f32 parameters). A
    /// gradient still in `grads` (under `no_sync`, returned as the local gradients) is kept.
    fn release_grad(&self, _grads: &mut GradientsParams, index: usize) {
        self.taken.borrow_mut()[index] = None;
    }

    fn read_param(&self, index: usize) -> Result<HostBuffer> {
        self.pending.borrow()[index].clone().ok_or_else(|| {
            Error::Unsupported(format!(
                "parameter `{}` was not captured before reading it",
                self.entries[index].path
            ))
        })
    }

    fn write_param(&self, index: usize, values: HostSlice<'_>) -> Result<()> {
        self.set_pending(index, values.to_buffer())
    }
}
