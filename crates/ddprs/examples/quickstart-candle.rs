//! Quick start with candle: `quickstart-candle-no-ddp.rs` made data-parallel (`cargo add ddprs
//! --features candle`; the lines that differ end in `// DDP`). Every process trains a replica
//! on its shard of the data; run it with `ddprun --nproc-per-node 2 ./quickstart-candle`.

use candle_core::{DType, Device, Tensor};
use candle_nn::{linear, Activation, Module, Optimizer, ParamsAdamW, VarBuilder, VarMap};
use ddprs::candle::prelude::*; // DDP
use std::path::Path;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let pg = init_process_group(Default::default())?; // DDP: rank and world from ddprun's env
    let device = Device::Cpu;
    let (x, y) = dataset(&device)?;
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &device);
    let model = candle_nn::seq()
        .add(linear(16, 64, vb.pp("fc1"))?)
        .add(Activation::Relu)
        .add(linear(64, 4, vb.pp("fc2"))?);
    let mut ddp = Ddp::new(&varmap, &pg, Default::default())?; // DDP: rank 0's values everywhere
    let params = ParamsAdamW {
        lr: 1e-2,
        ..Default::default()
    };
    let mut opt = AdamW::new_named(ddp.named_vars().to_vec(), params)?; // DDP
    let mut sampler = DistributedSampler::new(x.dim(0)?, pg.size(), pg.rank())?; // DDP: this rank's shard
    let epochs = 5;
    for epoch in 0..epochs {
        sampler.set_epoch(epoch); // DDP
        let order = sampler.indices(); // DDP
        let mut loss_sum = 0.0;
        for batch in order.chunks(64) {
            let idx = Tensor::from_iter(batch.iter().map(|&i| i as u32), &device)?;
            let logits = model.forward(&x.index_select(&idx, 0)?)?;
            let loss = candle_nn::loss::cross_entropy(&logits, &y.index_select(&idx, 0)?)?;
            opt.step(&ddp.backward(&loss)?)?; // DDP: gradients averaged over the ranks
            loss_sum += loss.to_scalar::<f32>()? / order.chunks(64).len() as f32;
        }
        println!("epoch {epoch}: mean loss {loss_sum:.4}");
    }
    let predicted = model.forward(&x)?.argmax(1)?;
    let accuracy = predicted
        .eq(&y)?
        .to_dtype(DType::F32)?
        .mean_all()?
        .to_scalar::<f32>()?;
    println!("accuracy {accuracy:.3}");
    std::fs::create_dir_all("checkpoints")?;
    ddp.save_checkpoint(Path::new("checkpoints"), &opt, epochs)?; // DDP: rank 0 writes, atomically
    assert!(ddp.verify_replicas()?.identical, "replicas differ"); // DDP
    Ok(())
}

/// A synthetic task: 4096 points in 16 dimensions, in 4 classes by the signs of the sums of
/// their two halves.
fn dataset(device: &Device) -> candle_core::Result<(Tensor, Tensor)> {
    let mut rng = 0x2545_f491_4f6c_dd1d_u64;
    let x: Vec<f32> = (0..4096 * 16)
        .map(|_| uniform(&mut rng) * 2.0 - 1.0)
        .collect();
    let y: Vec<u32> = x
        .chunks(16)
        .map(|r| {
            u32::from(r[..8].iter().sum::<f32>() > 0.0) * 2
                + u32::from(r[8..].iter().sum::<f32>() > 0.0)
        })
        .collect();
    Ok((
        Tensor::from_vec(x, (4096, 16), device)?,
        Tensor::from_vec(y, 4096, device)?,
    ))
}

/// xorshift64: a uniform number in [0, 1).
fn uniform(state: &mut u64) -> f32 {
    *state ^= *state << 13;
    *state ^= *state >> 7;
    *state ^= *state << 17;
    (*state >> 40) as f32 / (1u64 << 24) as f32
}
