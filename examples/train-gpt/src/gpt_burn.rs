//! nanoGPT's model in Burn, the same architecture as [`crate::gpt_candle`]: token and position
//! embeddings, pre-LayerNorm blocks (causal multi-head self-attention, GELU MLP), final
//! LayerNorm, and a head tied to the token embedding (the embedding's `Param` used twice: Burn's
//! autodiff sums the two uses' gradients into the one parameter, which DDP reduces once).
//! Initialization is nanoGPT's scheme (normal 0.02, residual projections 0.02/sqrt(2 n_layer))
//! from Burn's generator seeded by `--seed`.

use crate::config::GptConfig;
use burn::module::{Module, Param};
use burn::nn::{
    loss::CrossEntropyLossConfig, Dropout, DropoutConfig, Embedding, EmbeddingConfig, Initializer,
    LayerNorm, LayerNormConfig, Linear, LinearConfig,
};
use burn::tensor::activation::{gelu, softmax};
use burn::tensor::{Bool, Device, Int, Tensor, TensorData};

#[derive(Module, Debug)]
pub struct Block {
    ln_1: LayerNorm,
    c_attn: Linear,
    attn_proj: Linear,
    ln_2: LayerNorm,
    c_fc: Linear,
    mlp_proj: Linear,
    drop: Dropout,
    n_head: usize,
}

#[derive(Module, Debug)]
pub struct Gpt {
    wte: Embedding,
    wpe: Embedding,
    blocks: Vec<Block>,
    ln_f: LayerNorm,
    /// `Some` when the head is not tied (`--untied`).
    lm_head: Option<Param<Tensor<2>>>,
    drop: Dropout,
    n_embd: usize,
    block_size: usize,
}

fn linear(i: usize, o: usize, std: f64, bias: bool, device: &Device) -> Linear {
    LinearConfig::new(i, o)
        .with_bias(bias)
        .with_initializer(Initializer::Normal { mean: 0.0, std })
        .init(device)
}

fn layer_norm(n: usize, bias: bool, device: &Device) -> LayerNorm {
    LayerNormConfig::new(n).with_bias(bias).init(device)
}

impl Gpt {
    pub fn new(cfg: &GptConfig, dropout: f64, seed: u64, device: &Device) -> Gpt {
        device.seed(seed);
        let (c, std) = (cfg.n_embd, 0.02);
        let proj_std = 0.02 / (2.0 * cfg.n_layer as f64).sqrt();
        let emb = |n| {
            EmbeddingConfig::new(n, c)
                .with_initializer(Initializer::Normal { mean: 0.0, std })
                .init(device)
        };
        let wte = emb(cfg.vocab_size);
        let wpe = emb(cfg.block_size);
        let blocks = (0..cfg.n_layer)
            .map(|_| Block {
                ln_1: layer_norm(c, cfg.bias, device),
                c_attn: linear(c, 3 * c, std, cfg.bias, device),
                attn_proj: linear(c, c, proj_std, cfg.bias, device),
                ln_2: layer_norm(c, cfg.bias, device),
                c_fc: linear(c, 4 * c, std, cfg.bias, device),
                mlp_proj: linear(4 * c, c, proj_std, cfg.bias, device),
                drop: DropoutConfig::new(dropout).init(),
                n_head: cfg.n_head,
            })
            .collect();
        let lm_head = (!cfg.tied).then(|| {
            Param::from_tensor(Tensor::random(
                [cfg.vocab_size, c],
                burn::tensor::Distribution::Normal(0.0, std),
                device,
            ))
        });
        Gpt {
            wte,
            wpe,
            blocks,
            ln_f: layer_norm(c, cfg.bias, device),
            lm_head,
            drop: DropoutConfig::new(dropout).init(),
            n_embd: c,
            block_size: cfg.block_size,
        }
    }

    pub fn tied(&self) -> bool {
        self.lm_head.is_none()
    }

    /// Logits `[b, t, vocab]` of ids `[b, t]`.
    pub fn forward(&self, idx: Tensor<2, Int>) -> Tensor<3> {
        let [b, t] = idx.dims();
        let device = idx.device();
        let c = self.n_embd;
        let pos = Tensor::<1, Int>::arange(0..t as i64, &device).reshape([1, t]);
        let mut x = self
            .drop
            .forward(self.wte.forward(idx) + self.wpe.forward(pos));
        // `true` strictly above the diagonal (a key after the query): masked.
        let mask = Tensor::<2, Bool>::tril_mask([t, t], 0, &device).reshape([1, 1, t, t]);
        for blk in &self.blocks {
            let qkv = blk.c_attn.forward(blk.ln_1.forward(x.clone()));
            let nh = blk.n_head;
            let hs = c / nh;
            let heads = |i: usize| {
                qkv.clone()
                    .narrow(2, i * c, c)
                    .reshape([b, t, nh, hs])
                    .swap_dims(1, 2)
            };
            let (q, k, v) = (heads(0), heads(1), heads(2));
            let att = q.matmul(k.swap_dims(2, 3)) * (1.0 / (hs as f64).sqrt());
            let att = att.mask_fill(mask.clone().expand([b, nh, t, t]), f32::NEG_INFINITY);
            let att = blk.drop.forward(softmax(att, 3));
            let y = att.matmul(v).swap_dims(1, 2).reshape([b, t, c]);
            x = x + blk.drop.forward(blk.attn_proj.forward(y));
            let h = gelu(blk.c_fc.forward(blk.ln_2.forward(x.clone())));
            x = x + blk.drop.forward(blk.mlp_proj.forward(h));
        }
        let x = self.ln_f.forward(x);
        let head = match &self.lm_head {
            Some(w) => w.val(),
            None => self.wte.weight.val(),
        };
        x.matmul(head.transpose().unsqueeze::<3>())
    }

    /// Mean cross-entropy of the logits of `x` against `y`.
    pub fn loss(&self, x: Tensor<2, Int>, y: Tensor<2, Int>) -> Tensor<1> {
        let logits = self.forward(x);
        let [b, t, v] = logits.dims();
        CrossEntropyLossConfig::new()
            .init(&logits.device())
            .forward(logits.reshape([b * t, v]), y.reshape([b * t]))
    }

    /// `n` characters sampled after `prompt` (temperature 1), from a seeded generator.
    pub fn generate(&self, prompt: &[u32], n: usize, seed: u64, device: &Device) -> Vec<u32> {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let mut ids = prompt.to_vec();
        for _ in 0..n {
            let start = ids.len().saturating_sub(self.block_size);
            let ctx: Vec<i64> = ids[start..].iter().map(|&i| i as i64).collect();
            let len = ctx.len();
            let idx = Tensor::<2, Int>::from_data(TensorData::new(ctx, [1, len]), device);
            let logits = self.forward(idx);
            let [_, _, v] = logits.dims();
            let last = logits.slice([0..1, len - 1..len, 0..v]).reshape([v]);
            let probs: Vec<f32> = softmax(last, 0).into_data().try_to_vec::<f32>().unwrap();
            ids.push(crate::data::sample_index(&probs, rng.gen()) as u32);
        }
        ids[prompt.len()..].to_vec()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(tied: bool) -> GptConfig {
        GptConfig::tiny(tied)
    }

    /// Causal: the logits at positions before `k` do not depend on the token at `k` (nor
    /// after), and the logits at `k` do.
    #[test]
    fn attention_is_causal() {
        let device = Device::flex().autodiff();
        let model = Gpt::new(&cfg(true), 0.0, 5, &device);
        let run = |ids: Vec<i64>| -> Vec<f32> {
            let x = Tensor::<2, Int>::from_data(TensorData::new(ids, [1, 6]), &device);
            model.forward(x).into_data().try_to_vec().unwrap()
        };
        let (a, b) = (run(vec![1, 2, 3, 4, 5, 6]), run(vec![1, 2, 3, 9, 5, 6]));
        let v = 11;
        assert_eq!(a[..3 * v], b[..3 * v], "positions 0..3 saw position 3");
        assert_ne!(
            a[3 * v..4 * v],
            b[3 * v..4 * v],
            "position 3 did not see itself"
        );
    }

    /// As candle's: the tied gradient equals the embedding use's plus the head use's, measured
    /// on the same model untied with the head a copy of the embedding.
    #[test]
    fn tied_gradient_is_the_sum_of_the_embedding_and_head_gradients() {
        let device = Device::flex().autodiff();
        let ids = |f: fn(i64) -> i64| {
            let v: Vec<i64> = (0..12).map(f).collect();
            Tensor::<2, Int>::from_data(TensorData::new(v, [2, 6]), &device)
        };
        let (x, y) = (ids(|i| i * 7 % 11), ids(|i| i * 5 % 11));
        let tied = Gpt::new(&cfg(true), 0.0, 5, &device);
        let g = tied.loss(x.clone(), y.clone()).backward();
        let g_tied: Vec<f32> = tied
            .wte
            .weight
            .grad(&g)
            .unwrap()
            .into_data()
            .try_to_vec()
            .unwrap();

        // The same model (a clone: Burn initializes parameters lazily, so a second model of the
        // same seed need not draw the same values), its head a copy of the embedding.
        let mut untied = tied.clone();
        untied.lm_head = Some(Param::from_tensor(
            tied.wte.weight.val().detach().require_grad(),
        ));
        let g = untied.loss(x, y).backward();
        let emb: Vec<f32> = untied
            .wte
            .weight
            .grad(&g)
            .unwrap()
            .into_data()
            .try_to_vec()
            .unwrap();
        let head: Vec<f32> = untied
            .lm_head
            .as_ref()
            .unwrap()
            .grad(&g)
            .unwrap()
            .into_data()
            .try_to_vec()
            .unwrap();
        let norm = |v: &[f32]| v.iter().map(|x| x * x).sum::<f32>().sqrt();
        assert!(
            norm(&emb) > 1e-4 && norm(&head) > 1e-4,
            "both uses have a gradient"
        );
        for ((t, e), h) in g_tied.iter().zip(&emb).zip(&head) {
            assert!(
                (t - (e + h)).abs() <= 1e-6 + 1e-5 * t.abs(),
                "tied {t} vs {e} + {h}"
            );
        }
    }
}
