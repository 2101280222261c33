//! The staged backward for Burn (`ddp_candle`'s `forward_backward_staged`): the model is run as a
//! sequence of stages, each fed a detached copy of the previous stage's output, and the
//! backward goes one stage at a time, last first, each stage's gradients handed to the reducer
//! (and their buckets reduced) before the stage before it computes.
//!
//! ```text
//!  forward:  x ─► stage 0 ─► h1 ┆ h1.detach().require_grad() ─► stage 1 ─► ... ─► loss
//!  backward: loss.backward() ─► stage S-1's gradients ─► Reducer (buckets start) ┆ ∂loss/∂h
//!            (out · ∂loss/∂out).sum().backward() ─► stage S-2's gradients ─► ...
//! ```
//!
//! Burn 0.22's `backward` returns every gradient of a graph at once; cut into stages, only one
//! stage's gradients exist at a time, which is what lets ZeRO stage 2 keep gradients at their
//! shard (`ZeroDdp::forward_backward_staged`), and the buckets of later stages are reduced while
//! earlier stages compute. The surrogate `(out · g).sum()` has the stage's parameters' gradients
//! of the whole loss (the chain rule at the cut), so the result equals a plain backward up to
//! rounding. Each parameter must be used by one stage only.

use crate::{DistributedDataParallel, Error, Result};
use burn::module::Module;
use burn::optim::GradientsParams;
use burn::tensor::Tensor;
use ddp::reducer::StepStats;

/// One stage of a staged forward: from the module and the stage's input, its output.
pub type Stage<'a, M, const D: usize> = &'a dyn Fn(&M, Tensor<D>) -> Tensor<D>;

impl<M: Module> DistributedDataParallel<M> {
    /// Forward through `stages` from `input`, `loss_fn` on the last output, then the backward
    /// stage by stage (see the module doc), each stage's gradients reduced while the stages
    /// before it compute. Returns the gradients averaged over all ranks (under
    /// [`no_sync`](Self::no_sync): this rank's own, accumulated) and the loss, detached.
    pub fn forward_backward_staged<const D: usize, const L: usize>(
        &mut self,
        stages: &[Stage<'_, M, D>],
        input: Tensor<D>,
        loss_fn: impl FnOnce(Tensor<D>) -> Tensor<L>,
    ) -> Result<(GradientsParams, Tensor<L>)> {
        let (local, loss) = self.staged_marks(stages, input, loss_fn)?;
        let stats = self.reducer.finish()?;
        Ok((self.reduced_grads(stats, local)?, loss))
    }

    /// [`forward_backward_staged`](Self::forward_backward_staged) leaving the reduced buckets in
    /// the reducer (for ZeRO); the step's statistics and the loss.
    pub(crate) fn reduce_staged<const D: usize, const L: usize>(
        &mut self,
        stages: &[Stage<'_, M, D>],
        input: Tensor<D>,
        loss_fn: impl FnOnce(Tensor<D>) -> Tensor<L>,
    ) -> Result<(StepStats, Tensor<L>)> {
        let (_, loss) = self.staged_marks(stages, input, loss_fn)?;
        Ok((self.reducer.finish()?, loss))
    }

    /// The staged forward and backward, every stage's gradients marked in the reducer; the
    /// local gradients when not synchronizing (accumulated over the stages), and the loss.
    fn staged_marks<const D: usize, const L: usize>(
        &mut self,
        stages: &[Stage<'_, M, D>],
        input: Tensor<D>,
        loss_fn: impl FnOnce(Tensor<D>) -> Tensor<L>,
    ) -> Result<(GradientsParams, Tensor<L>)> {
        if stages.is_empty() {
            return Err(Error::Unsupported(
                "forward_backward_staged: no stages given".into(),
            ));
        }
        self.reducer.prepare_for_backward()?;
        let module = self
            .module
            .take()
            .expect("the module is present between calls");
        let r = self.staged_with(&module, stages, input, loss_fn);
        self.module = Some(module);
        r
    }

    fn staged_with<const D: usize, const L: usize>(
        &mut self,
        module: &M,
        stages: &[Stage<'_, M, D>],
        input: Tensor<D>,
        loss_fn: impl FnOnce(Tensor<D>) -> Tensor<L>,
    ) -> Result<(GradientsParams, Tensor<L>)> {
        self.params.refresh_ids(module)?;
        let _s = ddp::trace::span("staged backward", "ddp");
        // Forward: every stage after the first starts from a detached copy of its input.
        let mut inputs = Vec::with_capacity(stages.len());
        let mut outputs = Vec::with_capacity(stages.len());
        let mut h = input;
        for (i, stage) in stages.iter().enumerate() {
            let x = if i == 0 { h } else { h.detach().require_grad() };
            let y = stage(module, x.clone());
            inputs.push(x);
            outputs.push(y.clone());
            h = y;
        }
        let last = outputs.pop().expect("at least one stage");
        let loss = loss_fn(last);
        let mut grads = loss.backward();
        let mut local = GradientsParams::new();
        for s in (0..stages.len()).rev() {
            let g_in = match s {
                0 => None,
                _ => Some(inputs[s].grad_remove(&mut grads).ok_or_else(|| {
                    Error::Unsupported(format!(
                        "forward_backward_staged: stage {s}'s output does not depend on its input"
                    ))
                })?),
            };
            let mut stage_grads = GradientsParams::from_grads(grads, module);
            self.hand_over(&mut stage_grads)?;
            self.params.merge_grads(stage_grads, &mut local)?;
            let Some(g) = g_in else {
                break;
            };
            let out = outputs.pop().expect("one output per stage");
            grads = (out * Tensor::from_inner(g)).sum().backward();
        }
        Ok((local, loss.detach()))
    }
}
