//! nanoGPT's model in candle: token and position embeddings, pre-LayerNorm blocks of causal
//! multi-head self-attention and a GELU MLP, a final LayerNorm, and a language-model head whose
//! weight is the token embedding's (tied: one `Var`, `wte.weight`, used twice; its gradient is
//! the sum of both uses, and DDP reduces it once). Parameter names and initialization are
//! nanoGPT's: normal(0, 0.02) weights, zero biases, unit LayerNorm weights, and the residual
//! projections (`attn.c_proj`, `mlp.c_proj`) at 0.02 / sqrt(2 * n_layer).

use crate::config::GptConfig;
use candle_core::{Device, Module, Result, Tensor, Var, D};
use candle_nn::{Embedding, LayerNorm, Linear, VarMap};
use rand::{Rng, SeedableRng};

/// Dropout with a seeded generator (candle's own draws from an unseeded one), so that a run
/// with dropout is reproducible: the mask of each call comes from `rng`.
pub struct Dropout {
    p: f32,
    rng: Option<rand::rngs::StdRng>,
}

impl Dropout {
    pub fn new(p: f32, seed: u64) -> Dropout {
        Dropout {
            p,
            rng: (p > 0.0).then(|| rand::rngs::StdRng::seed_from_u64(seed)),
        }
    }

    fn apply(&mut self, x: &Tensor, train: bool) -> Result<Tensor> {
        let Some(rng) = self.rng.as_mut().filter(|_| train) else {
            return Ok(x.clone());
        };
        let scale = 1.0 / (1.0 - self.p);
        let mask: Vec<f32> = (0..x.elem_count())
            .map(|_| {
                if rng.gen::<f32>() < self.p {
                    0.0
                } else {
                    scale
                }
            })
            .collect();
        x * Tensor::from_vec(mask, x.shape(), x.device())?
    }
}

struct Block {
    ln_1: LayerNorm,
    c_attn: Linear,
    attn_proj: Linear,
    ln_2: LayerNorm,
    c_fc: Linear,
    mlp_proj: Linear,
    n_head: usize,
}

/// The model; its parameters live in the `VarMap` it was built in.
pub struct Gpt {
    wte: Var,
    wpe: Embedding,
    blocks: Vec<Block>,
    ln_f: LayerNorm,
    /// `Some` when the head is not tied (`--untied`): its own weight, `lm_head.weight`.
    lm_head: Option<Var>,
    mask: Tensor,
    cfg: GptConfig,
}

/// Registers parameters in a `VarMap` with nanoGPT's initialization from a seeded generator.
struct Init<'a> {
    varmap: &'a VarMap,
    rng: rand::rngs::StdRng,
    device: Device,
}

impl Init<'_> {
    fn var(
        &mut self,
        name: &str,
        shape: &[usize],
        values: impl FnMut(&mut rand::rngs::StdRng) -> f32,
    ) -> Result<Var> {
        let mut values = values;
        let n = shape.iter().product();
        let data: Vec<f32> = (0..n).map(|_| values(&mut self.rng)).collect();
        let var = Var::from_tensor(&Tensor::from_vec(data, shape, &self.device)?)?;
        self.varmap
            .data()
            .lock()
            .unwrap()
            .insert(name.to_string(), var.clone());
        Ok(var)
    }

    fn normal(&mut self, name: &str, shape: &[usize], std: f32) -> Result<Var> {
        self.var(name, shape, |rng| {
            // Box-Muller: one standard normal from two uniforms.
            let (u1, u2): (f32, f32) = (rng.gen_range(f32::EPSILON..1.0), rng.gen());
            std * (-2.0 * u1.ln()).sqrt() * (std::f32::consts::TAU * u2).cos()
        })
    }

    fn constant(&mut self, name: &str, shape: &[usize], c: f32) -> Result<Var> {
        self.var(name, shape, |_| c)
    }

    fn linear(&mut self, name: &str, i: usize, o: usize, std: f32, bias: bool) -> Result<Linear> {
        let w = self.normal(&format!("{name}.weight"), &[o, i], std)?;
        let b = if bias {
            Some(
                self.constant(&format!("{name}.bias"), &[o], 0.0)?
                    .as_tensor()
                    .clone(),
            )
        } else {
            None
        };
        Ok(Linear::new(w.as_tensor().clone(), b))
    }

    fn layer_norm(&mut self, name: &str, n: usize, bias: bool) -> Result<LayerNorm> {
        let w = self.constant(&format!("{name}.weight"), &[n], 1.0)?;
        if !bias {
            return Ok(LayerNorm::new_no_bias(w.as_tensor().clone(), 1e-5));
        }
        let b = self.constant(&format!("{name}.bias"), &[n], 0.0)?;
        Ok(LayerNorm::new(
            w.as_tensor().clone(),
            b.as_tensor().clone(),
            1e-5,
        ))
    }
}

impl Gpt {
    /// Builds the model in `varmap` (parameter names as nanoGPT's `state_dict`), initialized
    /// from `seed`.
    pub fn new(cfg: &GptConfig, varmap: &VarMap, device: &Device, seed: u64) -> Result<Gpt> {
        let mut init = Init {
            varmap,
            rng: rand::rngs::StdRng::seed_from_u64(seed),
            device: device.clone(),
        };
        let (c, std) = (cfg.n_embd, 0.02);
        let proj_std = 0.02 / (2.0 * cfg.n_layer as f32).sqrt();
        let wte = init.normal("transformer.wte.weight", &[cfg.vocab_size, c], std)?;
        let wpe = init.normal("transformer.wpe.weight", &[cfg.block_size, c], std)?;
        let mut blocks = Vec::new();
        for l in 0..cfg.n_layer {
            let p = format!("transformer.h.{l}");
            blocks.push(Block {
                ln_1: init.layer_norm(&format!("{p}.ln_1"), c, cfg.bias)?,
                c_attn: init.linear(&format!("{p}.attn.c_attn"), c, 3 * c, std, cfg.bias)?,
                attn_proj: init.linear(&format!("{p}.attn.c_proj"), c, c, proj_std, cfg.bias)?,
                ln_2: init.layer_norm(&format!("{p}.ln_2"), c, cfg.bias)?,
                c_fc: init.linear(&format!("{p}.mlp.c_fc"), c, 4 * c, std, cfg.bias)?,
                mlp_proj: init.linear(&format!("{p}.mlp.c_proj"), 4 * c, c, proj_std, cfg.bias)?,
                n_head: cfg.n_head,
            });
        }
        let ln_f = init.layer_norm("transformer.ln_f", c, cfg.bias)?;
        let lm_head = if cfg.tied {
            None
        } else {
            Some(init.normal("lm_head.weight", &[cfg.vocab_size, c], std)?)
        };
        let t = cfg.block_size;
        let mask: Vec<f32> = (0..t * t)
            .map(|i| {
                if i % t > i / t {
                    f32::NEG_INFINITY
                } else {
                    0.0
                }
            })
            .collect();
        Ok(Gpt {
            wpe: Embedding::new(wpe.as_tensor().clone(), c),
            wte,
            blocks,
            ln_f,
            lm_head,
            mask: Tensor::from_vec(mask, (t, t), device)?,
            cfg: cfg.clone(),
        })
    }

    /// Logits `[b, t, vocab]` of token ids `[b, t]` (`t <= block_size`).
    pub fn forward(&self, idx: &Tensor, drop: &mut Dropout, train: bool) -> Result<Tensor> {
        let (b, t) = idx.dims2()?;
        let c = self.cfg.n_embd;
        let tok = Embedding::new(self.wte.as_tensor().clone(), c).forward(idx)?;
        let pos = self
            .wpe
            .forward(&Tensor::arange(0u32, t as u32, idx.device())?)?;
        let mut x = drop.apply(&tok.broadcast_add(&pos)?, train)?;
        let mask = self.mask.narrow(0, 0, t)?.narrow(1, 0, t)?;
        for blk in &self.blocks {
            let h = blk.ln_1.forward(&x)?;
            let qkv = blk.c_attn.forward(&h)?;
            let hs = c / blk.n_head;
            let heads = |i: usize| -> Result<Tensor> {
                qkv.narrow(D::Minus1, i * c, c)?
                    .reshape((b, t, blk.n_head, hs))?
                    .transpose(1, 2)?
                    .contiguous()
            };
            let (q, k, v) = (heads(0)?, heads(1)?, heads(2)?);
            let att = (q.matmul(&k.t()?)? * (1.0 / (hs as f64).sqrt()))?;
            // `softmax`, not `softmax_last_dim`: the latter (a fused kernel) has no backward in
            // candle 0.11, so the queries and keys would get no gradient.
            let att = candle_nn::ops::softmax(&att.broadcast_add(&mask)?, D::Minus1)?;
            let att = drop.apply(&att, train)?;
            let y = att.matmul(&v)?.transpose(1, 2)?.reshape((b, t, c))?;
            x = (x + drop.apply(&blk.attn_proj.forward(&y)?, train)?)?;
            let h = blk.c_fc.forward(&blk.ln_2.forward(&x)?)?.gelu_erf()?;
            x = (x + drop.apply(&blk.mlp_proj.forward(&h)?, train)?)?;
        }
        let x = self.ln_f.forward(&x)?;
        let head = self.lm_head.as_ref().unwrap_or(&self.wte);
        x.broadcast_matmul(&head.as_tensor().t()?)
    }

    /// Mean cross-entropy of the logits of `x` against `y` (both `[b, t]`).
    pub fn loss(&self, x: &Tensor, y: &Tensor, drop: &mut Dropout, train: bool) -> Result<Tensor> {
        let logits = self.forward(x, drop, train)?;
        let v = logits.dim(D::Minus1)?;
        candle_nn::loss::cross_entropy(&logits.flatten_to(1)?.reshape(((), v))?, &y.flatten_all()?)
    }

    /// Whether the head is the token embedding.
    pub fn tied(&self) -> bool {
        self.lm_head.is_none()
    }

    /// `n` characters sampled after `prompt` (temperature 1, all of the vocabulary), from a
    /// seeded generator.
    pub fn generate(&self, prompt: &[u32], n: usize, seed: u64) -> Result<Vec<u32>> {
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let mut ids = prompt.to_vec();
        let mut drop = Dropout::new(0.0, 0);
        let device = self.wte.device().clone();
        for _ in 0..n {
            let start = ids.len().saturating_sub(self.cfg.block_size);
            let ctx = Tensor::new(&ids[start..], &device)?.unsqueeze(0)?;
            let logits = self.forward(&ctx, &mut drop, false)?;
            let last = logits.squeeze(0)?.get(ids.len() - start - 1)?;
            let probs: Vec<f32> = candle_nn::ops::softmax_last_dim(&last)?.to_vec1()?;
            ids.push(crate::data::sample_index(&probs, rng.gen()) as u32);
        }
        Ok(ids[prompt.len()..].to_vec())
    }
}

/// The parameters AdamW decays: nanoGPT's rule, every parameter of 2 or more dimensions
/// (weights and embeddings), not biases or LayerNorm weights.
pub fn decays(_name: &str, var: &Var) -> bool {
    var.rank() >= 2
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(tied: bool) -> GptConfig {
        GptConfig::tiny(tied)
    }

    fn batch() -> (Tensor, Tensor) {
        let x: Vec<u32> = (0..12).map(|i| (i * 7 % 11) as u32).collect();
        let y: Vec<u32> = (0..12).map(|i| (i * 5 % 11) as u32).collect();
        (
            Tensor::from_vec(x, (2, 6), &Device::Cpu).unwrap(),
            Tensor::from_vec(y, (2, 6), &Device::Cpu).unwrap(),
        )
    }

    /// Causal: the logits at positions before `k` do not depend on the token at `k`, the
    /// logits at `k` do.
    #[test]
    fn attention_is_causal() {
        let model = Gpt::new(&cfg(true), &VarMap::new(), &Device::Cpu, 5).unwrap();
        let mut drop = Dropout::new(0.0, 0);
        let run = |ids: &[u32], drop: &mut Dropout| -> Vec<f32> {
            let x = Tensor::new(ids, &Device::Cpu)
                .unwrap()
                .unsqueeze(0)
                .unwrap();
            model
                .forward(&x, drop, false)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1()
                .unwrap()
        };
        let (a, b) = (
            run(&[1, 2, 3, 4, 5, 6], &mut drop),
            run(&[1, 2, 3, 9, 5, 6], &mut drop),
        );
        let v = 11;
        assert_eq!(a[..3 * v], b[..3 * v], "positions 0..3 saw position 3");
        assert_ne!(
            a[3 * v..4 * v],
            b[3 * v..4 * v],
            "position 3 did not see itself"
        );
    }

    /// Every parameter gets a gradient, the attention's queries and keys included (candle's
    /// fused `softmax_last_dim` has no backward: through it they would get none).
    #[test]
    fn queries_and_keys_get_gradients() {
        let (x, y) = batch();
        let varmap = VarMap::new();
        let model = Gpt::new(&cfg(true), &varmap, &Device::Cpu, 5).unwrap();
        let g = model
            .loss(&x, &y, &mut Dropout::new(0.0, 0), true)
            .unwrap()
            .backward()
            .unwrap();
        let w = varmap.data().lock().unwrap()["transformer.h.0.attn.c_attn.weight"].clone();
        let grad = g.get(&w).expect("c_attn has a gradient");
        for (part, name) in ["queries", "keys", "values"].iter().enumerate() {
            let rows = grad.narrow(0, part * 8, 8).unwrap();
            let norm = rows
                .sqr()
                .unwrap()
                .sum_all()
                .unwrap()
                .to_scalar::<f32>()
                .unwrap();
            assert!(norm > 1e-12, "the {name}' weights get no gradient");
        }
    }

    /// The tied weight's gradient is the sum of its two uses' gradients: the same model
    /// untied, with the head's weight a copy of the embedding's, gives one gradient per use.
    #[test]
    fn tied_gradient_is_the_sum_of_the_embedding_and_head_gradients() {
        let (x, y) = batch();
        let mut drop = Dropout::new(0.0, 0);
        let tied = Gpt::new(&cfg(true), &VarMap::new(), &Device::Cpu, 5).unwrap();
        let g = tied
            .loss(&x, &y, &mut drop, true)
            .unwrap()
            .backward()
            .unwrap();
        let g_tied = g
            .get(&tied.wte)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();

        let untied = Gpt::new(&cfg(false), &VarMap::new(), &Device::Cpu, 5).unwrap();
        let head = untied.lm_head.as_ref().unwrap();
        head.set(untied.wte.as_tensor()).unwrap();
        assert_eq!(
            untied.wte.as_tensor().to_vec2::<f32>().unwrap(),
            tied.wte.as_tensor().to_vec2::<f32>().unwrap()
        );
        let g = untied
            .loss(&x, &y, &mut drop, true)
            .unwrap()
            .backward()
            .unwrap();
        let flat = |v: &Var| {
            g.get(v)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap()
        };
        let (emb, head) = (flat(&untied.wte), flat(head));
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
