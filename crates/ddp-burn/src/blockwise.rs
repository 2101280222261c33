//! The blockwise backward for Burn (`ddp_candle`'s `forward_backward_blockwise`): the model is run as a
//! sequence of blocks, each fed a detached copy of the previous block's output, and the
//! backward goes one block at a time, last first, each block's gradients handed to the reducer
//! (and their buckets reduced) before the block before it computes.
//!
//! ```text
//!  forward:  x ─► block 0 ─► h1 ┆ h1.detach().require_grad() ─► block 1 ─► ... ─► loss
//!  backward: loss.backward() ─► block S-1's gradients ─► Reducer (buckets start) ┆ ∂loss/∂h
//!            (out · ∂loss/∂out).sum().backward() ─► block S-2's gradients ─► ...
//! ```
//!
//! Burn 0.22's `backward` returns every gradient of a graph at once; cut into blocks, only one
//! block's gradients exist at a time, which is what lets ZeRO stage 2 keep gradients at their
//! shard (`ZeroDdp::forward_backward_blockwise`), and the buckets of later blocks are reduced while
//! earlier blocks compute. The surrogate `(out · g).sum()` has the block's parameters' gradients
//! of the whole loss (the chain rule at the cut), so the result equals a plain backward up to
//! rounding. Each parameter must be used by one block only.

use crate::{DistributedDataParallel, Error, Result};
use burn::module::Module;
use burn::optim::GradientsParams;
use burn::tensor::Tensor;
use ddp_core::reducer::StepStats;

/// One block of a blockwise forward: from the module and the block's input, its output.
pub type Block<'a, M, const D: usize> = &'a dyn Fn(&M, Tensor<D>) -> Tensor<D>;

/// The former name of [`Block`].
#[doc(hidden)]
pub type Stage<'a, M, const D: usize> = Block<'a, M, D>;

impl<M: Module> DistributedDataParallel<M> {
    /// Forward through `blocks` from `input`, `loss_fn` on the last output, then the backward
    /// block by block (see the module doc), each block's gradients reduced while the blocks
    /// before it compute. Returns the gradients averaged over all ranks (under
    /// [`no_sync`](Self::no_sync): this rank's own, accumulated) and the loss, detached.
    pub fn forward_backward_blockwise<const D: usize, const L: usize>(
        &mut self,
        blocks: &[Block<'_, M, D>],
        input: Tensor<D>,
        loss_fn: impl FnOnce(Tensor<D>) -> Tensor<L>,
    ) -> Result<(GradientsParams, Tensor<L>)> {
        let (local, loss) = self.blockwise_marks(blocks, input, loss_fn)?;
        let stats = self.finish()?;
        Ok((self.reduced_grads(stats, local)?, loss))
    }

    /// [`forward_backward_blockwise`](Self::forward_backward_blockwise) leaving the reduced buckets in
    /// the reducer (for ZeRO); the step's statistics and the loss.
    pub(crate) fn reduce_blockwise<const D: usize, const L: usize>(
        &mut self,
        blocks: &[Block<'_, M, D>],
        input: Tensor<D>,
        loss_fn: impl FnOnce(Tensor<D>) -> Tensor<L>,
    ) -> Result<(StepStats, Tensor<L>)> {
        let (_, loss) = self.blockwise_marks(blocks, input, loss_fn)?;
        Ok((self.finish()?, loss))
    }

    /// The blockwise forward and backward, every block's gradients marked in the reducer; the
    /// local gradients when not synchronizing (accumulated over the blocks), and the loss.
    fn blockwise_marks<const D: usize, const L: usize>(
        &mut self,
        blocks: &[Block<'_, M, D>],
        input: Tensor<D>,
        loss_fn: impl FnOnce(Tensor<D>) -> Tensor<L>,
    ) -> Result<(GradientsParams, Tensor<L>)> {
        if blocks.is_empty() {
            return Err(Error::Unsupported(
                "forward_backward_blockwise: no blocks given".into(),
            ));
        }
        self.prepare_for_backward()?;
        let module = self
            .module
            .take()
            .expect("the module is present between calls");
        let r = self.blockwise_with(&module, blocks, input, loss_fn);
        self.module = Some(module);
        r
    }

    fn blockwise_with<const D: usize, const L: usize>(
        &mut self,
        module: &M,
        blocks: &[Block<'_, M, D>],
        input: Tensor<D>,
        loss_fn: impl FnOnce(Tensor<D>) -> Tensor<L>,
    ) -> Result<(GradientsParams, Tensor<L>)> {
        self.params_mut().refresh_ids(module)?;
        let _s = ddp_core::trace::span("blockwise backward", "ddp");
        // Forward: every block after the first starts from a detached copy of its input.
        let mut inputs = Vec::with_capacity(blocks.len());
        let mut outputs = Vec::with_capacity(blocks.len());
        let mut h = input;
        for (i, block) in blocks.iter().enumerate() {
            let x = if i == 0 { h } else { h.detach().require_grad() };
            let y = block(module, x.clone());
            inputs.push(x);
            outputs.push(y.clone());
            h = y;
        }
        let last = outputs.pop().expect("at least one block");
        let loss = loss_fn(last);
        let mut grads = loss.backward();
        let mut local = GradientsParams::new();
        for s in (0..blocks.len()).rev() {
            let g_in = match s {
                0 => None,
                _ => Some(inputs[s].grad_remove(&mut grads).ok_or_else(|| {
                    Error::Unsupported(format!(
                        "forward_backward_blockwise: block {s}'s output does not depend on its input"
                    ))
                })?),
            };
            let mut block_grads = GradientsParams::from_grads(grads, module);
            self.hand_over(&mut block_grads)?;
            self.params().merge_grads(block_grads, &mut local)?;
            let Some(g) = g_in else {
                break;
            };
            let out = outputs.pop().expect("one output per block");
            grads = (out * Tensor::from_inner(g)).sum().backward();
        }
        Ok((local, loss.detach()))
    }
}
