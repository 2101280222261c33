//! ZeRO stage 3 (FSDP-style): parameters sharded too, gathered one *unit* at a time.
//!
//! A unit is a group of parameters used together (a layer, or a block of a blockwise model). Its
//! parameters are laid out flat, in the order given, as one bucket of a [`ShardLayout`]: rank
//! `r` owns chunk `r` of every unit, exactly as stages 1 and 2 own chunks of the reducer's
//! buckets, so the same sharded checkpoints (parameter space, any world size) serve every stage.
//!
//! One step of `n` units (the framework adapter computes, this module communicates):
//!
//! ```text
//!  forward   gather u0 ─► [u0 fwd, no graph]  ─► free u0 ─► ... ─► gather u(n-1)
//!              └─ gather u1 in flight ─┘  (prefetch: the next unit's all-gather overlaps compute)
//!  backward  [u(n-1): fwd with graph, loss, backward] ─► reduce-scatter its gradient (async)
//!              ─► free ─► gather u(n-2) (already in flight) ─► recompute fwd, backward ─► ...
//!  step      the owner steps its chunks; nothing is gathered until the next forward
//! ```
//!
//! The last unit stays gathered from its forward to its backward, every other unit is gathered
//! twice. Per step a rank sends, ring model, `(N-1)/N` of: all-gather Ψ (forward) + all-gather
//! Ψ - Ψ_last (backward) + reduce-scatter Ψ, at most 1.5× DDP's all-reduce (2Ψ): see
//! [`stage3_bytes_per_step`].

use super::layout::ShardLayout;
use crate::error::{Error, Result};
use crate::reducer::{BucketInfo, ParamSpec};
use ddp_comm::{DType, ProcessGroup, ReduceOp, Work};
use std::collections::{BTreeMap, VecDeque};

/// The [`ShardLayout`] of stage 3: one bucket per unit, `units[u]` listing its parameters (indices
/// into `specs`) in flat order. Every parameter must be in exactly one unit; an error names the
/// first that is not, or is in two.
pub fn unit_layout(
    specs: &[ParamSpec],
    units: &[Vec<usize>],
    world: usize,
    rank: usize,
) -> Result<ShardLayout> {
    let mut owner: Vec<Option<usize>> = vec![None; specs.len()];
    for (u, params) in units.iter().enumerate() {
        if params.is_empty() {
            return Err(Error::InvalidArgument(format!(
                "ZeRO stage 3: unit {u} has no parameters"
            )));
        }
        for &p in params {
            let Some(slot) = owner.get_mut(p) else {
                return Err(Error::InvalidArgument(format!(
                    "ZeRO stage 3: unit {u} names parameter {p}, the model has {}",
                    specs.len()
                )));
            };
            if let Some(other) = slot.replace(u) {
                return Err(Error::InvalidArgument(format!(
                    "ZeRO stage 3: parameter `{}` is in unit {other} and unit {u}; a parameter \
                     must belong to a single unit",
                    specs[p].name
                )));
            }
        }
    }
    if let Some(p) = owner.iter().position(Option::is_none) {
        return Err(Error::InvalidArgument(format!(
            "ZeRO stage 3: parameter `{}` is in no unit; every parameter must belong to one",
            specs[p].name
        )));
    }
    let infos: Vec<BucketInfo> = units
        .iter()
        .map(|ps| BucketInfo {
            dtype: DType::F32,
            params: ps.clone(),
            numel: ps.iter().map(|&p| specs[p].numel()).sum(),
        })
        .collect();
    ShardLayout::new(specs, &infos, world, rank)
}

/// Bytes this rank sends per synchronized stage-3 step (ring model, padded chunks): two
/// all-gathers of every unit but the last (one), and a reduce-scatter of every unit.
pub fn stage3_bytes_per_step(layout: &ShardLayout) -> u64 {
    let n = layout.world_size() as u64;
    let units = layout.buckets();
    units
        .iter()
        .enumerate()
        .map(|(u, b)| {
            let per = (n - 1) * b.chunk_len(layout.world_size()) as u64 * 4;
            let gathers = if u + 1 == units.len() { 1 } else { 2 };
            per * (gathers + 1)
        })
        .sum()
}

/// Reduce-scatters in flight at most, by default: a unit's full gradient waits in its
/// collective's input until it is sent, so when communication is slower than compute an
/// unbounded queue would hold every unit's gradient (the whole model's) at once.
pub const MAX_SCATTERS_IN_FLIGHT: usize = 2;

/// The per-unit collectives of one stage-3 step, with the prefetch of gathers and the reduce-
/// scatters in flight (at most [`MAX_SCATTERS_IN_FLIGHT`]; starting one more waits for the
/// oldest) until [`finish`](Self::finish). Counts the bytes it sends.
pub struct UnitComm<'a> {
    pg: &'a ProcessGroup,
    layout: &'a ShardLayout,
    gathers: BTreeMap<usize, Work<Vec<f32>>>,
    scatters: VecDeque<(usize, Work<Vec<f32>>)>,
    /// This rank's reduced chunk of every unit, allocated at the first reduce-scatter (by the
    /// calling thread, all together: the chunks that live until the optimizer step are not
    /// interleaved with the step's transient buffers in the heap).
    grads: Option<Vec<Vec<f32>>>,
    /// Whether each unit's chunk in `grads` was filled.
    scattered: Vec<bool>,
    max_scatters: usize,
    divisor: usize,
    bytes: usize,
}

impl<'a> UnitComm<'a> {
    /// Gradients are summed over the ranks and divided by `divisor` (the world size, or Join's
    /// number of ranks with data).
    pub fn new(pg: &'a ProcessGroup, layout: &'a ShardLayout, divisor: usize) -> Result<Self> {
        if pg.size() != layout.world_size() || pg.rank() != layout.rank() {
            return Err(Error::InvalidArgument(format!(
                "UnitComm: the layout is for rank {} of {}, the process group is rank {} of {}",
                layout.rank(),
                layout.world_size(),
                pg.rank(),
                pg.size()
            )));
        }
        if divisor == 0 {
            return Err(Error::InvalidArgument("UnitComm: divisor 0".into()));
        }
        Ok(UnitComm {
            pg,
            layout,
            gathers: BTreeMap::new(),
            scatters: VecDeque::new(),
            grads: None,
            scattered: vec![false; layout.buckets().len()],
            max_scatters: MAX_SCATTERS_IN_FLIGHT,
            divisor,
            bytes: 0,
        })
    }

    /// At most `n` (at least 1) reduce-scatters in flight.
    pub fn with_max_scatters_in_flight(mut self, n: usize) -> Self {
        self.max_scatters = n.max(1);
        self
    }

    /// Units of the layout.
    pub fn units(&self) -> usize {
        self.layout.buckets().len()
    }

    fn check(&self, unit: usize, what: &str) -> Result<()> {
        if unit >= self.units() {
            return Err(Error::InvalidArgument(format!(
                "UnitComm::{what}: unit {unit} of {}",
                self.units()
            )));
        }
        Ok(())
    }

    /// Starts the all-gather of `unit` from this rank's `chunk` of it (no-op if one is already in
    /// flight). A collective: every rank must start the same units in the same order.
    pub fn prefetch(&mut self, unit: usize, chunk: Vec<f32>) -> Result<()> {
        self.check(unit, "prefetch")?;
        if self.gathers.contains_key(&unit) {
            return Ok(());
        }
        let c = self.layout.buckets()[unit].chunk_len(self.layout.world_size());
        let (lo, hi) = self.layout.buckets()[unit].owned(self.layout.world_size(), self.rank());
        if chunk.len() != hi - lo {
            return Err(Error::InvalidArgument(format!(
                "UnitComm::prefetch: unit {unit}: {} values given, rank {} owns {}",
                chunk.len(),
                self.rank(),
                hi - lo
            )));
        }
        let mut chunk = chunk;
        chunk.resize(c, 0.0);
        self.bytes += c * 4 * (self.layout.world_size() - 1);
        self.gathers.insert(unit, self.pg.all_gather_async(chunk));
        Ok(())
    }

    fn rank(&self) -> usize {
        self.layout.rank()
    }

    /// Whether `unit`'s gather has been started and not yet taken.
    pub fn in_flight(&self, unit: usize) -> bool {
        self.gathers.contains_key(&unit)
    }

    /// Waits for `unit`'s gather (started by [`prefetch`](Self::prefetch)) and returns the
    /// unit's flat values (its parameters in unit order, padding cut).
    pub fn gathered(&mut self, unit: usize) -> Result<Vec<f32>> {
        self.check(unit, "gathered")?;
        let work = self.gathers.remove(&unit).ok_or_else(|| {
            Error::InvalidArgument(format!(
                "UnitComm::gathered: unit {unit} was not prefetched"
            ))
        })?;
        let mut full = work.wait()?;
        full.truncate(self.layout.buckets()[unit].numel);
        Ok(full)
    }

    /// The parameters of `unit` in `flat` (its values or gradient, unit order): `(param index,
    /// values)` per parameter.
    pub fn split<'f>(&self, unit: usize, flat: &'f [f32]) -> Vec<(usize, &'f [f32])> {
        self.layout.buckets()[unit]
            .slots
            .iter()
            .map(|s| (s.param, &flat[s.offset..s.offset + s.numel]))
            .collect()
    }

    /// Starts the reduce-scatter of `unit`'s flat gradient (unit order, `numel` elements), after
    /// waiting for the oldest one if the limit is reached; its owned chunk comes back from
    /// [`finish`](Self::finish). A collective.
    pub fn reduce_scatter(&mut self, unit: usize, mut grad: Vec<f32>) -> Result<()> {
        self.check(unit, "reduce_scatter")?;
        let b = &self.layout.buckets()[unit];
        if grad.len() != b.numel {
            return Err(Error::InvalidArgument(format!(
                "UnitComm::reduce_scatter: unit {unit}: a gradient of {} elements for {}",
                grad.len(),
                b.numel
            )));
        }
        let world = self.layout.world_size();
        let c = b.chunk_len(world);
        grad.resize(c * world, 0.0);
        if self.grads.is_none() {
            let chunks = self.layout.chunks();
            self.grads = Some(chunks.iter().map(|c| vec![0f32; c.len()]).collect());
        }
        let op = if self.divisor == world {
            ReduceOp::Avg
        } else {
            ReduceOp::Sum
        };
        self.bytes += c * 4 * (world - 1);
        self.scatters
            .push_back((unit, self.pg.reduce_scatter_async(grad, op)));
        while self.scatters.len() > self.max_scatters {
            self.wait_oldest()?;
        }
        Ok(())
    }

    /// Waits for the oldest reduce-scatter in flight and keeps this rank's averaged chunk.
    fn wait_oldest(&mut self) -> Result<()> {
        let Some((unit, w)) = self.scatters.pop_front() else {
            return Ok(());
        };
        let v = w.wait()?;
        let world = self.layout.world_size();
        let out = &mut self.grads.as_mut().expect("allocated by reduce_scatter")[unit];
        let n = out.len();
        out.copy_from_slice(&v[..n]);
        drop(v);
        if self.divisor != world {
            let d = self.divisor as f32;
            for g in out.iter_mut() {
                *g /= d;
            }
        }
        self.scattered[unit] = true;
        Ok(())
    }

    /// Bytes sent so far (ring model).
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// Waits for every reduce-scatter and returns this rank's averaged gradient chunk of every
    /// unit (in unit order, as `ShardLayout::chunks`); a unit that was not reduce-scattered is
    /// an error naming it. Gathers still in flight are waited for and dropped.
    pub fn finish(mut self) -> Result<Vec<Vec<f32>>> {
        let mut failed = None;
        for (_, w) in std::mem::take(&mut self.gathers) {
            if let Err(e) = w.wait() {
                failed = failed.or(Some(Error::Comm(e)));
            }
        }
        while !self.scatters.is_empty() {
            if let Err(e) = self.wait_oldest() {
                failed = failed.or(Some(e));
            }
        }
        if let Some(e) = failed {
            return Err(e);
        }
        if let Some(u) = self.scattered.iter().position(|&s| !s) {
            return Err(Error::InvalidArgument(format!(
                "UnitComm::finish: unit {u} was not reduce-scattered"
            )));
        }
        Ok(self.grads.take().unwrap_or_default())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ddp_comm::testing::run_ranks;

    fn specs(sizes: &[usize]) -> Vec<ParamSpec> {
        sizes
            .iter()
            .enumerate()
            .map(|(i, &n)| ParamSpec::new(format!("p{i}"), vec![n], DType::F32))
            .collect()
    }

    #[test]
    fn every_parameter_in_exactly_one_unit_or_a_named_error() {
        let s = specs(&[3, 4, 5]);
        assert!(unit_layout(&s, &[vec![0, 1], vec![2]], 2, 0).is_ok());
        let e = unit_layout(&s, &[vec![0, 1], vec![1, 2]], 2, 0).unwrap_err();
        assert!(
            e.to_string().contains("`p1` is in unit 0 and unit 1"),
            "{e}"
        );
        let e = unit_layout(&s, &[vec![0], vec![2]], 2, 0).unwrap_err();
        assert!(e.to_string().contains("`p1` is in no unit"), "{e}");
        let e = unit_layout(&s, &[vec![0, 1, 2], vec![]], 2, 0).unwrap_err();
        assert!(e.to_string().contains("unit 1 has no parameters"), "{e}");
    }

    #[test]
    fn bytes_are_one_and_a_half_ddp_but_the_last_units_second_gather() {
        // Two units of 10 and 6 elements at world 2: chunks 5 and 3.
        let l = unit_layout(&specs(&[10, 6]), &[vec![0], vec![1]], 2, 0).unwrap();
        assert_eq!(stage3_bytes_per_step(&l), (5 * 3 + 3 * 2) * 4);
    }

    /// Gathers prefetched out of order come back whole; reduce-scatters leave each owner the
    /// average (or the sum over the Join divisor) of its chunk.
    #[test]
    fn gathers_and_reduce_scatters_per_unit_among_real_ranks() {
        for world in [1, 2, 3] {
            for divisor in [world, 1] {
                run_ranks(world, |pg| {
                    let s = specs(&[7, 2, 5]);
                    let l = unit_layout(&s, &[vec![2, 0], vec![1]], world, pg.rank()).unwrap();
                    let full = |u: usize| -> Vec<f32> {
                        (0..l.buckets()[u].numel)
                            .map(|i| (u * 100 + i) as f32)
                            .collect()
                    };
                    // With the Join divisor, one reduce-scatter in flight at a time.
                    let mut comm = UnitComm::new(&pg, &l, divisor)
                        .unwrap()
                        .with_max_scatters_in_flight(if divisor == 1 { 1 } else { 2 });
                    for u in [1, 0] {
                        let (lo, hi) = l.buckets()[u].owned(world, pg.rank());
                        comm.prefetch(u, full(u)[lo..hi].to_vec()).unwrap();
                        comm.prefetch(u, vec![]).unwrap(); // already in flight: ignored
                    }
                    for u in [0, 1] {
                        assert_eq!(comm.gathered(u).unwrap(), full(u));
                        assert!(comm.gathered(u).is_err(), "taken once");
                    }
                    let flat0 = full(0);
                    let split = comm.split(0, &flat0);
                    assert_eq!(split[0].0, 2);
                    assert_eq!(split[1], (0, &flat0[5..]));
                    for u in [1, 0] {
                        let g = full(u).iter().map(|v| v * (pg.rank() + 1) as f32).collect();
                        comm.reduce_scatter(u, g).unwrap();
                    }
                    let ranks_sum: f32 = (1..=world).map(|r| r as f32).sum();
                    let got = comm.finish().unwrap();
                    for (u, chunk) in got.iter().enumerate() {
                        let (lo, hi) = l.buckets()[u].owned(world, pg.rank());
                        let want: Vec<f32> = full(u)[lo..hi]
                            .iter()
                            .map(|v| v * ranks_sum / divisor as f32)
                            .collect();
                        assert_eq!(chunk.len(), want.len());
                        for (a, b) in chunk.iter().zip(&want) {
                            assert!((a - b).abs() <= 1e-5 * b.abs().max(1.0), "{a} vs {b}");
                        }
                    }
                });
            }
        }
    }

    #[test]
    fn a_unit_not_reduce_scattered_is_named() {
        run_ranks(2, |pg| {
            let l = unit_layout(&specs(&[4, 4]), &[vec![0], vec![1]], 2, pg.rank()).unwrap();
            let mut comm = UnitComm::new(&pg, &l, 2).unwrap();
            comm.reduce_scatter(1, vec![1.0; 4]).unwrap();
            let e = comm.finish().unwrap_err().to_string();
            assert!(e.contains("unit 0 was not reduce-scattered"), "{e}");
        });
    }
}
