//! Block-by-block backward for models given as a sequence of blocks (blocks).
//!
//! candle computes a whole backward in one `Tensor::backward` call and has no per-parameter hooks,
//! so to hand gradients to the reducer while backward is still running the model is cut at block
//! boundaries:
//! - forward runs block by block; the input of every block but the first is a *detached copy* of
//!   the previous block's output turned into a `Var` (a leaf that receives a gradient);
//! - backward of the loss covers only the last block and yields its parameters' gradients plus the
//!   gradient w.r.t. its input;
//! - block `i` then runs backward on the surrogate `(output_i * grad_input_{i+1}.detach()).sum()`,
//!   whose gradient w.r.t. `output_i` is exactly `grad_input_{i+1}`, and so on down to block 0.
//!
//! Every block's gradients are passed to a callback as soon as that block is done. The inter-block
//! gradients are detached explicitly: a leaf's gradient in candle can still carry a graph (when
//! `CANDLE_GRAD_DO_NOT_DETACH` is set), and differentiating through it again would be wrong and slow.
//! The result equals a plain `loss.backward()` bit for bit: `d sum(o * g) / d o` is computed as
//! `1 * g`, which is exact.

use crate::{nn, Error, Result};
use candle_core::backprop::GradStore;
use candle_core::{Module, Tensor, Var};

/// Runs forward and a block-wise backward. `on_block_grads(i, grads)` is called for block
/// `i = n-1, ..., 0` right after that block's backward, with a store holding the gradients of the
/// variables used by block `i` (and, for the last block, anything `loss_fn` used). Returns the loss
/// and the output of the last block, both detached.
///
/// A parameter shared by two blocks receives its gradient in two pieces (one per block).
pub fn blockwise_forward_backward<L, F>(
    blocks: &[&dyn Module],
    input: &Tensor,
    loss_fn: L,
    on_block_grads: F,
) -> Result<(Tensor, Tensor)>
where
    L: FnOnce(&Tensor) -> candle_core::Result<Tensor>,
    F: FnMut(usize, &mut GradStore) -> Result<()>,
{
    blockwise_backward(blocks, input, loss_fn, &[], on_block_grads)
}

/// [`blockwise_forward_backward`] whose backwards take the gradients of `weights` straight from
/// `ddp_candle::nn::Linear` (`nn::backward_capturing`: the same stores, without candle's
/// `zeros + g` copy of each).
pub(crate) fn blockwise_backward<L, F>(
    blocks: &[&dyn Module],
    input: &Tensor,
    loss_fn: L,
    weights: &[&Tensor],
    mut on_block_grads: F,
) -> Result<(Tensor, Tensor)>
where
    L: FnOnce(&Tensor) -> candle_core::Result<Tensor>,
    F: FnMut(usize, &mut GradStore) -> Result<()>,
{
    let n = blocks.len();
    if n == 0 {
        return Err(Error::Unsupported(
            "blockwise backward needs at least one block".into(),
        ));
    }
    let mut inputs: Vec<Option<Var>> = Vec::with_capacity(n);
    let mut outputs: Vec<Tensor> = Vec::with_capacity(n);
    for (i, block) in blocks.iter().enumerate() {
        let leaf = if i == 0 {
            None
        } else {
            Some(Var::from_tensor(&outputs[i - 1].detach())?)
        };
        let x = match &leaf {
            Some(v) => v.as_tensor(),
            None => input,
        };
        let out = block.forward(x)?;
        inputs.push(leaf);
        outputs.push(out);
    }
    let output = outputs[n - 1].clone();
    let loss = loss_fn(&output)?;
    let mut grads = nn::backward_capturing(&loss, weights)?;
    let mut grad_in = take_input_grad(&mut grads, &inputs[n - 1]);
    on_block_grads(n - 1, &mut grads)?;
    drop(grads);
    for i in (0..n - 1).rev() {
        // The later block does not depend on its input: no gradient reaches earlier blocks.
        let Some(g) = grad_in.take() else { break };
        let surrogate = (&outputs[i] * g.detach())?.sum_all()?;
        let mut grads = nn::backward_capturing(&surrogate, weights)?;
        grad_in = take_input_grad(&mut grads, &inputs[i]);
        on_block_grads(i, &mut grads)?;
    }
    Ok((loss.detach(), output.detach()))
}

fn take_input_grad(grads: &mut GradStore, leaf: &Option<Var>) -> Option<Tensor> {
    leaf.as_ref().and_then(|v| grads.remove(v.as_tensor()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device, D};
    use candle_nn::{Linear, VarBuilder, VarMap};

    fn mlp(vm: &VarMap) -> (Linear, Linear, Linear) {
        let vb = VarBuilder::from_varmap(vm, DType::F32, &Device::Cpu);
        (
            candle_nn::linear(8, 16, vb.pp("l1")).unwrap(),
            candle_nn::linear(16, 12, vb.pp("l2")).unwrap(),
            candle_nn::linear(12, 4, vb.pp("l3")).unwrap(),
        )
    }

    #[test]
    fn blockwise_equals_plain_backward_bitwise() {
        let vm = VarMap::new();
        let (l1, l2, l3) = mlp(&vm);
        let x = Tensor::randn(0f32, 1.0, (5, 8), &Device::Cpu).unwrap();
        let y = Tensor::new(&[0u32, 3, 1, 2, 3], &Device::Cpu).unwrap();
        let s1 = |t: &Tensor| l1.forward(t)?.relu();
        let s2 = |t: &Tensor| l2.forward(t)?.tanh();
        let s3 = |t: &Tensor| l3.forward(t);
        let loss_fn = |o: &Tensor| candle_nn::loss::cross_entropy(o, &y);

        let plain_loss = loss_fn(&s3(&s2(&s1(&x).unwrap()).unwrap()).unwrap()).unwrap();
        let plain = plain_loss.backward().unwrap();

        let mut seen = Vec::new();
        let mut blockwise = std::collections::HashMap::new();
        let blocks: [&dyn Module; 3] = [&s1, &s2, &s3];
        let (loss, out) = blockwise_forward_backward(&blocks, &x, loss_fn, |i, g| {
            seen.push(i);
            for (name, var) in vm.data().lock().unwrap().iter() {
                if let Some(t) = g.get(var.as_tensor()) {
                    assert!(blockwise.insert(name.clone(), t.clone()).is_none());
                }
            }
            Ok(())
        })
        .unwrap();
        assert_eq!(seen, vec![2, 1, 0]);
        assert_eq!(out.dims(), &[5, 4]);
        assert_eq!(
            loss.to_scalar::<f32>().unwrap(),
            plain_loss.to_scalar::<f32>().unwrap()
        );
        let data = vm.data().lock().unwrap();
        assert_eq!(blockwise.len(), 6);
        for (name, var) in data.iter() {
            let a = plain.get(var.as_tensor()).unwrap().flatten_all().unwrap();
            let b = blockwise[name].flatten_all().unwrap();
            assert_eq!(
                a.to_vec1::<f32>().unwrap(),
                b.to_vec1::<f32>().unwrap(),
                "gradient of {name} differs"
            );
        }
        // Gradients are real (non-zero) for every block.
        for t in blockwise.values() {
            let m = t.abs().unwrap().max(D::Minus1).unwrap();
            assert!(
                m.flatten_all()
                    .unwrap()
                    .max(0)
                    .unwrap()
                    .to_scalar::<f32>()
                    .unwrap()
                    > 0.0
            );
        }
    }

    #[test]
    fn block_that_ignores_its_input_stops_the_backward() {
        let vm = VarMap::new();
        let (l1, _l2, l3) = mlp(&vm);
        let x = Tensor::ones((2, 8), DType::F32, &Device::Cpu).unwrap();
        let s1 = |t: &Tensor| l1.forward(t);
        let zeros = Tensor::zeros((2, 12), DType::F32, &Device::Cpu).unwrap();
        let s2 = |_: &Tensor| Ok(zeros.clone());
        let s3 = |t: &Tensor| l3.forward(t);
        let blocks: [&dyn Module; 3] = [&s1, &s2, &s3];
        let mut calls = Vec::new();
        blockwise_forward_backward(
            &blocks,
            &x,
            |o| o.sum_all(),
            |i, _| {
                calls.push(i);
                Ok(())
            },
        )
        .unwrap();
        assert_eq!(calls, vec![2, 1]);
    }
}
