//! DiLoCo (Douillard et al., 2023) and streaming DiLoCo (Douillard et al., 2025): training over
//! slow links by synchronizing every `H` steps instead of every step.
//!
//! Each rank runs `H` *inner* steps on its own (its gradients not reduced: the DDP runs with
//! [`PostLocalSgdHook::new(0)`](super::PostLocalSgdHook), and the inner optimizer, e.g. AdamW, is
//! the adapter's, untouched). Then the ranks all-reduce the *pseudo-gradient* — the parameters
//! at the last synchronization (the *anchor*) minus the local ones — and an *outer* optimizer,
//! SGD with Nesterov momentum (lr 0.7, momentum 0.9 by default, the paper's), steps the anchor
//! with it; every rank sets its parameters to the new anchor. The outer step is computed from
//! the same averaged pseudo-gradient and the same state on every rank, so the replicas are
//! bit-identical after each synchronization.
//!
//! ```text
//!  inner steps:  s = 1 … H          (local: no gradient communication)
//!  at s ≡ 0 (H): Δ = avg_ranks(anchor − θ)        one all-reduce of the parameters' size
//!                m = μ·m + Δ;  u = Δ + μ·m (Nesterov) or m
//!                θ = anchor = anchor − lr·u
//! ```
//!
//! **Streaming** (F fragments, contiguous groups of parameters in registration order, of about
//! equal size): fragment `i` is synchronized at steps `s ≡ (i+1)·H/F (mod H)`, so the bytes of one
//! synchronization are spread over `F` moments of the cycle (peak bandwidth ≤ 1/F of DiLoCo's);
//! with an overlap `τ` its all-reduce runs while the next `τ` inner steps compute, and the outer
//! update replaces the fragment's parameters `τ` steps later (the paper's α = 0: the fragment's
//! local progress during the overlap is dropped, so the fragment is identical on every rank
//! right after). Pseudo-gradients can be sent as bf16 ([`DiLoCoConfig::comm`]). F = 1, τ = 0 is
//! DiLoCo.
//!
//! Call [`DiLoCo::step`] after every inner optimizer step (a collective on synchronization
//! steps). The state (anchor, momentum, step, in-flight fragments) goes into checkpoints through
//! [`DiLoCo::state_dict`], which completes in-flight all-reduces so that a resumed run applies
//! exactly what the uninterrupted one applies; [`local_state`](super::local_state) puts every
//! rank's own inner state beside it and resumes at the same world size exactly, or at another
//! with joining ranks started from the last synchronization.

use crate::adapter::ParamAccess;
use crate::checkpoint::TensorData;
use crate::error::{Error, Result};
use crate::reducer::{HookState, HostSlice};
use ddp_comm::{DType, ProcessGroup, ReduceOp, Work};
use half::bf16;

/// What the pseudo-gradients are sent as.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PseudoGradDtype {
    /// f32 (exact averaging).
    #[default]
    F32,
    /// bf16 (half the bytes; averaged in f32 by the all-reduce, rounded once each way).
    Bf16,
}

/// DiLoCo's settings.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DiLoCoConfig {
    /// Inner steps between two synchronizations of a fragment (`H`).
    pub inner_steps: u64,
    /// Outer learning rate (0.7).
    pub outer_lr: f64,
    /// Outer momentum (0.9).
    pub momentum: f64,
    /// Nesterov momentum (true, as the paper).
    pub nesterov: bool,
    /// Fragments (`F`, streaming DiLoCo; 1: DiLoCo).
    pub fragments: usize,
    /// Inner steps a fragment's all-reduce overlaps before its update applies (`τ`, < H/F).
    pub overlap: u64,
    /// What pseudo-gradients are sent as.
    pub comm: PseudoGradDtype,
}

impl DiLoCoConfig {
    /// DiLoCo with the paper's outer optimizer: every `h` steps, lr 0.7, Nesterov momentum 0.9.
    pub fn new(h: u64) -> Self {
        DiLoCoConfig {
            inner_steps: h,
            outer_lr: 0.7,
            momentum: 0.9,
            nesterov: true,
            fragments: 1,
            overlap: 0,
            comm: PseudoGradDtype::F32,
        }
    }

    /// Streaming DiLoCo: `fragments` fragments, each all-reduce overlapping `overlap` inner
    /// steps, pseudo-gradients in bf16.
    pub fn streaming(h: u64, fragments: usize, overlap: u64) -> Self {
        DiLoCoConfig {
            fragments,
            overlap,
            comm: PseudoGradDtype::Bf16,
            ..Self::new(h)
        }
    }

    /// Whether the settings are valid (named in the error when not).
    pub fn check(&self) -> Result<()> {
        let bad = |m: String| Err(Error::InvalidArgument(format!("DiLoCo: {m}")));
        if self.inner_steps == 0 {
            return bad("H (inner steps) must be at least 1".into());
        }
        if self.fragments == 0 || self.fragments as u64 > self.inner_steps {
            return bad(format!(
                "fragments must be in 1..=H ({}), got {}",
                self.inner_steps, self.fragments
            ));
        }
        if self.overlap >= (self.inner_steps / self.fragments as u64).max(1) {
            return bad(format!(
                "the overlap τ = {} must be below H/F = {}",
                self.overlap,
                self.inner_steps / self.fragments as u64
            ));
        }
        if !(self.outer_lr.is_finite() && self.outer_lr > 0.0) {
            return bad(format!("outer lr {} must be positive", self.outer_lr));
        }
        if !(0.0..1.0).contains(&self.momentum) {
            return bad(format!(
                "outer momentum {} must be in [0, 1)",
                self.momentum
            ));
        }
        Ok(())
    }

    /// The step offset of fragment `i` within a cycle: `(i+1)·H/F` (F = 1: H).
    fn offset(&self, i: usize) -> u64 {
        (i as u64 + 1) * self.inner_steps / self.fragments as u64
    }
}

/// An all-reduce of a fragment's pseudo-gradient in flight, or completed by `state_dict`.
enum Flight {
    F32(Work<Vec<f32>>),
    Bf16(Work<Vec<bf16>>),
    Done(Vec<f32>),
}

struct Pending {
    fragment: usize,
    apply_at: u64,
    flight: Flight,
}

/// DiLoCo's outer loop (see the module doc).
pub struct DiLoCo {
    cfg: DiLoCoConfig,
    /// Inner steps taken.
    step: u64,
    /// Per parameter: the parameters at the fragment's last synchronization.
    anchor: Vec<Vec<f32>>,
    /// Per parameter: the outer momentum.
    momentum: Vec<Vec<f32>>,
    /// Per fragment: its parameters (registration order).
    fragments: Vec<Vec<usize>>,
    pending: Vec<Pending>,
    /// Per fragment: the inner step its last all-reduce was launched at.
    launched: Vec<u64>,
    sent: u64,
}

impl DiLoCo {
    /// The outer loop over `params` (f32 parameters), anchored at their current values: build it
    /// after the DDP wrapper (whose construction makes the replicas equal).
    pub fn new<P: ParamAccess + ?Sized>(
        cfg: DiLoCoConfig,
        params: &P,
    ) -> std::result::Result<DiLoCo, P::Error> {
        cfg.check()?;
        let n = params.param_count();
        let mut anchor = Vec::with_capacity(n);
        let mut sizes = Vec::with_capacity(n);
        for i in 0..n {
            let spec = params.spec(i)?;
            if spec.dtype != DType::F32 {
                return Err(Error::InvalidArgument(format!(
                    "DiLoCo: parameter {spec} is {}; f32 parameters only",
                    spec.dtype
                ))
                .into());
            }
            anchor.push(read_f32(params, i)?);
            sizes.push(spec.numel());
        }
        let fragments = split(&sizes, cfg.fragments);
        Ok(DiLoCo {
            launched: vec![0; fragments.len()],
            cfg,
            step: 0,
            momentum: sizes.iter().map(|&s| vec![0.0; s]).collect(),
            anchor,
            fragments,
            pending: Vec::new(),
            sent: 0,
        })
    }

    pub fn config(&self) -> &DiLoCoConfig {
        &self.cfg
    }

    /// Inner steps taken so far.
    pub fn inner_step(&self) -> u64 {
        self.step
    }

    /// Payload bytes of pseudo-gradients sent so far (per rank).
    pub fn bytes_sent(&self) -> u64 {
        self.sent
    }

    /// The parameters (registration order) of each fragment.
    pub fn fragments(&self) -> &[Vec<usize>] {
        &self.fragments
    }

    /// A rank joining between synchronizations (a new rank after a change of world size, a
    /// process replacing a lost one): after [`load_state_dict`](Self::load_state_dict) of a live
    /// rank's outer state, sets its parameters to the anchor — each fragment as it was last
    /// synchronized, the point the other ranks' local progress is measured from. Its inner steps
    /// start there; at the next synchronization its pseudo-gradient averages with theirs. Local.
    pub fn restore_anchor<P: ParamAccess + ?Sized>(
        &self,
        params: &P,
    ) -> std::result::Result<(), P::Error> {
        for (i, anchor) in self.anchor.iter().enumerate() {
            params.write_param(i, HostSlice::of(&anchor[..]))?;
        }
        Ok(())
    }

    /// The last inner step at which a synchronization began (fragment 0's, streaming: the
    /// earliest of the fragments'); 0 before the first.
    pub fn last_sync_step(&self) -> u64 {
        self.launched.iter().copied().min().unwrap_or(0)
    }

    /// After an inner optimizer step: launches the pseudo-gradient all-reduce of each fragment
    /// due now and applies the outer update of each one whose overlap is over. Returns the
    /// fragments updated at this step. A collective on synchronization steps: every rank calls
    /// it after every inner step.
    pub fn step<P: ParamAccess + ?Sized>(
        &mut self,
        pg: &ProcessGroup,
        params: &P,
    ) -> std::result::Result<Vec<usize>, P::Error> {
        self.step += 1;
        let s = self.step;
        for f in 0..self.fragments.len() {
            let o = self.cfg.offset(f);
            if s >= o && (s - o).is_multiple_of(self.cfg.inner_steps) {
                self.launch(pg, params, f)?;
            }
        }
        let mut applied = Vec::new();
        let due: Vec<Pending> = {
            let (due, rest) = std::mem::take(&mut self.pending)
                .into_iter()
                .partition(|p| p.apply_at <= s);
            self.pending = rest;
            due
        };
        for p in due {
            let avg = p.flight.finish()?;
            self.apply(params, p.fragment, &avg)?;
            applied.push(p.fragment);
        }
        Ok(applied)
    }

    /// Starts fragment `f`'s all-reduce of `anchor − θ`.
    fn launch<P: ParamAccess + ?Sized>(
        &mut self,
        pg: &ProcessGroup,
        params: &P,
        f: usize,
    ) -> std::result::Result<(), P::Error> {
        let total: usize = self.fragments[f]
            .iter()
            .map(|&i| self.anchor[i].len())
            .sum();
        let mut delta = Vec::with_capacity(total);
        for &i in &self.fragments[f] {
            let local = read_f32(params, i)?;
            delta.extend(self.anchor[i].iter().zip(&local).map(|(a, l)| a - l));
        }
        let flight = match self.cfg.comm {
            PseudoGradDtype::F32 => {
                self.sent += 4 * total as u64;
                Flight::F32(pg.all_reduce_async(delta, ReduceOp::Avg))
            }
            PseudoGradDtype::Bf16 => {
                self.sent += 2 * total as u64;
                let half: Vec<bf16> = delta.into_iter().map(bf16::from_f32).collect();
                Flight::Bf16(pg.all_reduce_async(half, ReduceOp::Avg))
            }
        };
        self.launched[f] = self.step;
        self.pending.push(Pending {
            fragment: f,
            apply_at: self.step + self.cfg.overlap,
            flight,
        });
        Ok(())
    }

    /// The outer SGD step of fragment `f` with the averaged pseudo-gradient `avg`: the new
    /// anchor, written to the parameters.
    fn apply<P: ParamAccess + ?Sized>(
        &mut self,
        params: &P,
        f: usize,
        avg: &[f32],
    ) -> std::result::Result<(), P::Error> {
        let (lr, mu, nesterov) = (
            self.cfg.outer_lr as f32,
            self.cfg.momentum as f32,
            self.cfg.nesterov,
        );
        let mut off = 0;
        for &i in &self.fragments[f] {
            let (anchor, m) = (&mut self.anchor[i], &mut self.momentum[i]);
            let g = &avg[off..off + anchor.len()];
            off += anchor.len();
            for ((a, m), &g) in anchor.iter_mut().zip(m.iter_mut()).zip(g) {
                *m = mu * *m + g;
                let u = if nesterov { g + mu * *m } else { *m };
                *a -= lr * u;
            }
            params.write_param(i, HostSlice::of(&anchor[..]))?;
        }
        Ok(())
    }

    /// Ends the run synchronized: completes the fragments in flight, then gives every fragment
    /// trained since its last synchronization a last outer step now, so that every replica
    /// holds the same model. A collective. Returns the fragments updated.
    pub fn finish<P: ParamAccess + ?Sized>(
        &mut self,
        pg: &ProcessGroup,
        params: &P,
    ) -> std::result::Result<Vec<usize>, P::Error> {
        let mut applied = Vec::new();
        for p in std::mem::take(&mut self.pending) {
            let avg = p.flight.finish()?;
            self.apply(params, p.fragment, &avg)?;
            applied.push(p.fragment);
        }
        for f in 0..self.fragments.len() {
            if self.launched[f] < self.step {
                self.launch(pg, params, f)?;
                let p = self.pending.pop().expect("just launched");
                let avg = p.flight.finish()?;
                self.apply(params, f, &avg)?;
                applied.push(f);
            }
        }
        Ok(applied)
    }

    /// The outer state for a checkpoint: step, anchor, momentum, and the averaged
    /// pseudo-gradients of fragments still in flight (their all-reduces are completed here, a
    /// collective when any is in flight; every rank calls it at the same step).
    pub fn state_dict(&mut self) -> Result<HookState> {
        let mut s = HookState::new("diloco");
        s.counters.insert("step".into(), self.step);
        for (f, &at) in self.launched.iter().enumerate() {
            s.counters.insert(format!("launched.{f}"), at);
        }
        for (i, (a, m)) in self.anchor.iter().zip(&self.momentum).enumerate() {
            s.tensors.insert(
                format!("anchor.{i}"),
                TensorData::new(vec![a.len()], a.clone())?,
            );
            s.tensors.insert(
                format!("momentum.{i}"),
                TensorData::new(vec![m.len()], m.clone())?,
            );
        }
        for (k, p) in self.pending.iter_mut().enumerate() {
            let flight = std::mem::replace(&mut p.flight, Flight::Done(Vec::new()));
            let avg = flight.finish()?;
            s.counters
                .insert(format!("pending.{k}.fragment"), p.fragment as u64);
            s.counters
                .insert(format!("pending.{k}.apply_at"), p.apply_at);
            s.tensors.insert(
                format!("pending.{k}"),
                TensorData::new(vec![avg.len()], avg.clone())?,
            );
            p.flight = Flight::Done(avg);
        }
        Ok(s)
    }

    /// Restores [`state_dict`](Self::state_dict) (the same parameters and configuration).
    pub fn load_state_dict(&mut self, state: &HookState) -> Result<()> {
        state.expect_kind("diloco")?;
        let tensor = |name: &str, len: usize| -> Result<Vec<f32>> {
            let t = state
                .tensors
                .get(name)
                .ok_or_else(|| Error::Mismatch(format!("DiLoCo state has no tensor {name:?}")))?;
            if t.data.len() != len {
                return Err(Error::Mismatch(format!(
                    "DiLoCo state {name:?} has {} values, the parameter {len}",
                    t.data.len()
                )));
            }
            Ok(t.data.clone())
        };
        let mut anchor = Vec::with_capacity(self.anchor.len());
        let mut momentum = Vec::with_capacity(self.anchor.len());
        for (i, a) in self.anchor.iter().enumerate() {
            anchor.push(tensor(&format!("anchor.{i}"), a.len())?);
            momentum.push(tensor(&format!("momentum.{i}"), a.len())?);
        }
        let mut pending = Vec::new();
        for k in 0.. {
            let Some(&fragment) = state.counters.get(&format!("pending.{k}.fragment")) else {
                break;
            };
            let fragment = fragment as usize;
            let len = self
                .fragments
                .get(fragment)
                .ok_or_else(|| Error::Mismatch(format!("DiLoCo state: no fragment {fragment}")))?
                .iter()
                .map(|&i| self.anchor[i].len())
                .sum();
            pending.push(Pending {
                fragment,
                apply_at: state.counter(&format!("pending.{k}.apply_at"))?,
                flight: Flight::Done(tensor(&format!("pending.{k}"), len)?),
            });
        }
        let launched = (0..self.fragments.len())
            .map(|f| state.counter(&format!("launched.{f}")))
            .collect::<Result<Vec<_>>>()?;
        self.step = state.counter("step")?;
        self.launched = launched;
        self.anchor = anchor;
        self.momentum = momentum;
        self.pending = pending;
        Ok(())
    }
}

impl Flight {
    fn finish(self) -> Result<Vec<f32>> {
        Ok(match self {
            Flight::F32(w) => w.wait()?,
            Flight::Bf16(w) => w.wait()?.into_iter().map(f32::from).collect(),
            Flight::Done(v) => v,
        })
    }
}

fn read_f32<P: ParamAccess + ?Sized>(
    params: &P,
    i: usize,
) -> std::result::Result<Vec<f32>, P::Error> {
    let v = params.read_param(i)?;
    Ok(v.as_slice::<f32>()
        .ok_or_else(|| Error::InvalidArgument(format!("DiLoCo: parameter {i} is not f32")))?
        .to_vec())
}

/// `sizes` (registration order) cut into `min(n, len)` contiguous, non-empty groups of about
/// equal total size.
fn split(sizes: &[usize], n: usize) -> Vec<Vec<usize>> {
    let n = n.min(sizes.len()).max(1);
    let total: usize = sizes.iter().sum();
    let mut out: Vec<Vec<usize>> = vec![Vec::new()];
    let mut acc = 0usize;
    for (i, &s) in sizes.iter().enumerate() {
        let g = out.len() - 1;
        let left = sizes.len() - i;
        let groups_left = n - out.len();
        // The current group has its share, or the parameters left just fill the groups left.
        if !out[g].is_empty() && g + 1 < n && (acc * n >= (g + 1) * total || left <= groups_left) {
            out.push(Vec::new());
        }
        out.last_mut().expect("one group at least").push(i);
        acc += s;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::split;

    #[test]
    fn fragments_are_contiguous_non_empty_and_balanced() {
        let sizes = [10, 10, 10, 10, 10, 10, 10, 10];
        assert_eq!(
            split(&sizes, 4),
            vec![vec![0, 1], vec![2, 3], vec![4, 5], vec![6, 7]]
        );
        assert_eq!(split(&sizes, 1), vec![(0..8).collect::<Vec<_>>()]);
        // One huge parameter first: the others still spread over the other fragments.
        let g = split(&[1000, 1, 1, 1], 3);
        assert_eq!(g.len(), 3, "{g:?}");
        assert_eq!(g.concat(), vec![0, 1, 2, 3]);
        for n in 1..6 {
            let g = split(&[3, 7, 1, 9, 2], n);
            assert_eq!(g.concat(), vec![0, 1, 2, 3, 4], "{n}: {g:?}");
            assert!(g.iter().all(|v| !v.is_empty()));
        }
    }
}
