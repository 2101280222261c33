//! nanoGPT's model in candle: token and position embeddings, pre-LayerNorm blocks of causal
//! multi-head self-attention and a GELU MLP, a final LayerNorm, and a language-model head whose
//! weight is the token embedding's (tied: one `Var`, `wte.weight`, used twice; its gradient is
//! the sum of both uses, and DDP reduces it once). Parameter names and initialization are
//! nanoGPT's: normal(0, 0.02) weights, zero biases, unit LayerNorm weights, and the residual
//! projections (`attn.c_proj`, `mlp.c_proj`) at 0.02 / sqrt(2 * n_layer).

use crate::config::GptConfig;
use candle_core::{Device, Module, Result, Tensor, Var, D};
use candle_nn::{Embedding, LayerNorm, Linear, VarMap};
use ddprs::candle::Unit;
use rand::{Rng, SeedableRng};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

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

/// A parameter by name and shape: from the `VarMap` of [`Gpt::new`], or from the `VarBuilder`
/// of a ZeRO-3 unit ([`units`]).
type Get<'a> = dyn Fn(&str, &[usize]) -> Result<Tensor> + 'a;

fn linear(get: &Get, name: &str, i: usize, o: usize, bias: bool) -> Result<Linear> {
    let w = get(&format!("{name}.weight"), &[o, i])?;
    let b = bias
        .then(|| get(&format!("{name}.bias"), &[o]))
        .transpose()?;
    Ok(Linear::new(w, b))
}

fn layer_norm(get: &Get, name: &str, n: usize, bias: bool) -> Result<LayerNorm> {
    let w = get(&format!("{name}.weight"), &[n])?;
    Ok(match bias {
        true => LayerNorm::new(w, get(&format!("{name}.bias"), &[n])?, 1e-5),
        false => LayerNorm::new_no_bias(w, 1e-5),
    })
}

impl Block {
    /// Block `l`'s layers from `get`.
    fn load(get: &Get, cfg: &GptConfig, l: usize) -> Result<Block> {
        let (p, c, b) = (format!("transformer.h.{l}"), cfg.n_embd, cfg.bias);
        Ok(Block {
            ln_1: layer_norm(get, &format!("{p}.ln_1"), c, b)?,
            c_attn: linear(get, &format!("{p}.attn.c_attn"), c, 3 * c, b)?,
            attn_proj: linear(get, &format!("{p}.attn.c_proj"), c, c, b)?,
            ln_2: layer_norm(get, &format!("{p}.ln_2"), c, b)?,
            c_fc: linear(get, &format!("{p}.mlp.c_fc"), c, 4 * c, b)?,
            mlp_proj: linear(get, &format!("{p}.mlp.c_proj"), 4 * c, c, b)?,
            n_head: cfg.n_head,
        })
    }

    /// `x + attn(ln_1(x))`, then `x + mlp(ln_2(x))`; `mask` is the causal mask `[t, t]`.
    fn forward(
        &self,
        x: &Tensor,
        mask: &Tensor,
        drop: &mut Dropout,
        train: bool,
    ) -> Result<Tensor> {
        let (b, t, c) = x.dims3()?;
        let h = self.ln_1.forward(x)?;
        let qkv = self.c_attn.forward(&h)?;
        let hs = c / self.n_head;
        let heads = |i: usize| -> Result<Tensor> {
            qkv.narrow(D::Minus1, i * c, c)?
                .reshape((b, t, self.n_head, hs))?
                .transpose(1, 2)?
                .contiguous()
        };
        let (q, k, v) = (heads(0)?, heads(1)?, heads(2)?);
        let att = (q.matmul(&k.t()?)? * (1.0 / (hs as f64).sqrt()))?;
        // `softmax`, not `softmax_last_dim`: the latter (a fused kernel) has no backward in
        // candle 0.11, so the queries and keys would get no gradient.
        let att = candle_nn::ops::softmax(&att.broadcast_add(mask)?, D::Minus1)?;
        let att = drop.apply(&att, train)?;
        let y = att.matmul(&v)?.transpose(1, 2)?.reshape((b, t, c))?;
        let x = (x + drop.apply(&self.attn_proj.forward(&y)?, train)?)?;
        let h = self.c_fc.forward(&self.ln_2.forward(&x)?)?.gelu_erf()?;
        x + drop.apply(&self.mlp_proj.forward(&h)?, train)?
    }
}

/// Token plus position embeddings of ids `[b, t]`, with dropout.
fn embed(
    wte: &Tensor,
    wpe: &Tensor,
    idx: &Tensor,
    drop: &mut Dropout,
    train: bool,
) -> Result<Tensor> {
    let (_, t) = idx.dims2()?;
    let c = wte.dim(1)?;
    let tok = Embedding::new(wte.clone(), c).forward(idx)?;
    let pos =
        Embedding::new(wpe.clone(), c).forward(&Tensor::arange(0u32, t as u32, idx.device())?)?;
    drop.apply(&tok.broadcast_add(&pos)?, train)
}

/// The causal mask of context `t`: 0 on and below the diagonal, -inf above.
fn causal_mask(t: usize, device: &Device) -> Result<Tensor> {
    let mask: Vec<f32> = (0..t * t)
        .map(|i| {
            if i % t > i / t {
                f32::NEG_INFINITY
            } else {
                0.0
            }
        })
        .collect();
    Tensor::from_vec(mask, (t, t), device)
}

/// The model; its parameters live in the `VarMap` it was built in.
pub struct Gpt {
    wte: Var,
    wpe: Tensor,
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

    fn linear(&mut self, name: &str, i: usize, o: usize, std: f32, bias: bool) -> Result<()> {
        self.normal(&format!("{name}.weight"), &[o, i], std)?;
        if bias {
            self.constant(&format!("{name}.bias"), &[o], 0.0)?;
        }
        Ok(())
    }

    fn layer_norm(&mut self, name: &str, n: usize, bias: bool) -> Result<()> {
        self.constant(&format!("{name}.weight"), &[n], 1.0)?;
        if bias {
            self.constant(&format!("{name}.bias"), &[n], 0.0)?;
        }
        Ok(())
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
        let (c, std, b) = (cfg.n_embd, 0.02, cfg.bias);
        let proj_std = 0.02 / (2.0 * cfg.n_layer as f32).sqrt();
        let wte = init.normal("transformer.wte.weight", &[cfg.vocab_size, c], std)?;
        let wpe = init.normal("transformer.wpe.weight", &[cfg.block_size, c], std)?;
        for l in 0..cfg.n_layer {
            let p = format!("transformer.h.{l}");
            init.layer_norm(&format!("{p}.ln_1"), c, b)?;
            init.linear(&format!("{p}.attn.c_attn"), c, 3 * c, std, b)?;
            init.linear(&format!("{p}.attn.c_proj"), c, c, proj_std, b)?;
            init.layer_norm(&format!("{p}.ln_2"), c, b)?;
            init.linear(&format!("{p}.mlp.c_fc"), c, 4 * c, std, b)?;
            init.linear(&format!("{p}.mlp.c_proj"), 4 * c, c, proj_std, b)?;
        }
        init.layer_norm("transformer.ln_f", c, b)?;
        let lm_head = match cfg.tied {
            true => None,
            false => Some(init.normal("lm_head.weight", &[cfg.vocab_size, c], std)?),
        };
        let vars = varmap.data().lock().unwrap().clone();
        let get =
            |name: &str, _: &[usize]| -> Result<Tensor> { Ok(vars[name].as_tensor().clone()) };
        Ok(Gpt {
            wpe: wpe.as_tensor().clone(),
            wte,
            blocks: (0..cfg.n_layer)
                .map(|l| Block::load(&get, cfg, l))
                .collect::<Result<_>>()?,
            ln_f: layer_norm(&get, "transformer.ln_f", c, b)?,
            lm_head,
            mask: causal_mask(cfg.block_size, device)?,
            cfg: cfg.clone(),
        })
    }

    /// Logits `[b, t, vocab]` of token ids `[b, t]` (`t <= block_size`).
    pub fn forward(&self, idx: &Tensor, drop: &mut Dropout, train: bool) -> Result<Tensor> {
        let t = idx.dim(1)?;
        let mut x = embed(self.wte.as_tensor(), &self.wpe, idx, drop, train)?;
        let mask = self.mask.narrow(0, 0, t)?.narrow(1, 0, t)?;
        for blk in &self.blocks {
            x = blk.forward(&x, &mask, drop, train)?;
        }
        let head = self.lm_head.as_ref().unwrap_or(&self.wte);
        self.ln_f
            .forward(&x)?
            .broadcast_matmul(&head.as_tensor().t()?)
    }

    /// Mean cross-entropy of the logits of `x` against `y` (both `[b, t]`).
    pub fn loss(&self, x: &Tensor, y: &Tensor, drop: &mut Dropout, train: bool) -> Result<Tensor> {
        cross_entropy(&self.forward(x, drop, train)?, y)
    }

    /// Whether the head is the token embedding.
    pub fn tied(&self) -> bool {
        self.lm_head.is_none()
    }

    pub fn config(&self) -> &GptConfig {
        &self.cfg
    }
}

/// Mean cross-entropy of logits `[b, t, vocab]` against targets `[b, t]`.
pub fn cross_entropy(logits: &Tensor, y: &Tensor) -> Result<Tensor> {
    let v = logits.dim(D::Minus1)?;
    candle_nn::loss::cross_entropy(&logits.flatten_to(1)?.reshape(((), v))?, &y.flatten_all()?)
}

/// `n` characters sampled after `prompt` (temperature 1, all of the vocabulary) from a seeded
/// generator, `logits` mapping ids `[1, t]` to logits `[1, t, vocab]` (`t <= block_size`).
pub fn generate(
    logits: impl Fn(&Tensor) -> Result<Tensor>,
    block_size: usize,
    prompt: &[u32],
    n: usize,
    seed: u64,
) -> Result<Vec<u32>> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut ids = prompt.to_vec();
    for _ in 0..n {
        let start = ids.len().saturating_sub(block_size);
        let ctx = Tensor::new(&ids[start..], &Device::Cpu)?.unsqueeze(0)?;
        let last = logits(&ctx)?.squeeze(0)?.get(ids.len() - start - 1)?;
        let probs: Vec<f32> = candle_nn::ops::softmax_last_dim(&last)?.to_vec1()?;
        ids.push(crate::data::sample_index(&probs, rng.gen()) as u32);
    }
    Ok(ids[prompt.len()..].to_vec())
}

/// What every ZeRO-3 unit reads at each call: whether it trains (dropout) and the step's
/// dropout seed (a unit runs twice per step, forward and recomputed in the backward: it draws
/// the same mask both times).
#[derive(Default)]
pub struct UnitCtx {
    pub train: AtomicBool,
    pub seed: AtomicU64,
}

/// The model as ZeRO-3 units (`ddprs::candle::Fsdp`): the embeddings, each block, the final
/// LayerNorm with the head. A parameter belongs to one unit, so the head cannot be the token
/// embedding: `cfg.tied` must be false (`train-gpt --zero 3` unties it, and says so).
pub fn units(cfg: &GptConfig, dropout: f32, ctx: Arc<UnitCtx>) -> Result<Vec<Unit>> {
    if cfg.tied {
        candle_core::bail!("ZeRO-3 units need an untied head (a parameter belongs to one unit)");
    }
    let drop = move |ctx: &UnitCtx, unit: u64| {
        let train = ctx.train.load(Ordering::Relaxed);
        let seed = ctx.seed.load(Ordering::Relaxed) ^ unit.wrapping_mul(0x94d0_49bb_1331_11eb);
        (Dropout::new(if train { dropout } else { 0.0 }, seed), train)
    };
    let mut units = Vec::with_capacity(cfg.n_layer + 2);
    let (c0, (v, t, c)) = (ctx.clone(), (cfg.vocab_size, cfg.block_size, cfg.n_embd));
    units.push(Unit::new(
        ["transformer.wte", "transformer.wpe"],
        move |vb, idx| {
            let (mut d, train) = drop(&c0, 0);
            let get = |name: &str, shape: &[usize]| vb.get(shape, name);
            let wte = get("transformer.wte.weight", &[v, c])?;
            let wpe = get("transformer.wpe.weight", &[t, c])?;
            embed(&wte, &wpe, idx, &mut d, train)
        },
    ));
    for l in 0..cfg.n_layer {
        let (cfg, ctx) = (cfg.clone(), ctx.clone());
        units.push(Unit::new([format!("transformer.h.{l}")], move |vb, x| {
            let (mut d, train) = drop(&ctx, 1 + l as u64);
            let t = x.dim(1)?;
            let mask = causal_mask(t, x.device())?;
            let get = |name: &str, shape: &[usize]| vb.get(shape, name);
            Block::load(&get, &cfg, l)?.forward(x, &mask, &mut d, train)
        }));
    }
    let cfg = cfg.clone();
    units.push(Unit::new(["transformer.ln_f", "lm_head"], move |vb, x| {
        let get = |name: &str, shape: &[usize]| vb.get(shape, name);
        let ln_f = layer_norm(&get, "transformer.ln_f", cfg.n_embd, cfg.bias)?;
        let head = get("lm_head.weight", &[cfg.vocab_size, cfg.n_embd])?;
        ln_f.forward(x)?.broadcast_matmul(&head.t()?)
    }));
    Ok(units)
}

/// The parameters AdamW decays: nanoGPT's rule, every parameter of 2 or more dimensions
/// (weights and embeddings), not biases or LayerNorm weights.
pub fn decays(_name: &str, dims: &[usize]) -> bool {
    dims.len() >= 2
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
