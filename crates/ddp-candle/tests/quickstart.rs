//! The book's candle program (`docs/candle.md`, "A training loop"; its block is also compiled as
//! a doctest of `ddp-candle`), run on 2 ranks (threads with real TCP process groups), ending with
//! the one-call save `DistributedDataParallel::save_checkpoint`; then the checkpoint it wrote is
//! resumed through `ddp_core::checkpoint::resume_or_start` and compared bit for bit.

use candle_core::{DType, Device, Tensor};
use candle_nn::{Module, VarBuilder, VarMap};
use ddp_candle::prelude::*;
use std::path::{Path, PathBuf};

const N: usize = 48;
const BATCH: usize = 4;
const EPOCHS: u64 = 3;

fn build_model(vb: VarBuilder) -> candle_core::Result<impl Module> {
    let l1 = candle_nn::linear(6, 10, vb.pp("fc1"))?;
    let l2 = candle_nn::linear(10, 3, vb.pp("fc2"))?;
    Ok(candle_nn::func(move |x| {
        l2.forward(&l1.forward(x)?.tanh()?)
    }))
}

/// Row `i` of a fixed synthetic dataset: 6 features and a class in 0..3.
fn rows(idx: &[usize]) -> (Tensor, Tensor) {
    let x: Vec<f32> = idx
        .iter()
        .flat_map(|&i| (0..6).map(move |j| ((i * 7 + j * 13) % 11) as f32 / 11.0 - 0.5))
        .collect();
    let y: Vec<u32> = idx.iter().map(|&i| (i % 3) as u32).collect();
    (
        Tensor::from_vec(x, (idx.len(), 6), &Device::Cpu).unwrap(),
        Tensor::from_vec(y, idx.len(), &Device::Cpu).unwrap(),
    )
}

fn values(ddp: &Ddp) -> Vec<(String, Vec<u32>)> {
    ddp.named_vars()
        .iter()
        .map(|(n, v)| {
            let bits = v
                .as_tensor()
                .flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap();
            (n.clone(), bits.iter().map(|x| x.to_bits()).collect())
        })
        .collect()
}

fn files(dir: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
        .map(|d| d.map(|e| e.unwrap().path()).collect())
        .unwrap_or_default();
    v.retain(|p| !p.ends_with(ddp_core::checkpoint::LOCK_FILE));
    v.sort();
    v
}

/// What the save returned, the wrapper, the optimizer, the samples per rank per epoch.
type Trained = (Option<PathBuf>, Ddp, Sgd, usize);

/// The book's snippet, as written there (model, DDP, PyTorch's SGD, sampler, epochs), then the
/// one-call save into this rank's `dir`. Returns what the save returned, the trained parameters,
/// the optimizer and the wrapper.
fn readme_program(pg: &ProcessGroup, dir: &Path) -> Result<Trained, Box<dyn std::error::Error>> {
    let (epochs, batch_size) = (EPOCHS, BATCH);
    let varmap = candle_nn::VarMap::new();
    let model = build_model(candle_nn::VarBuilder::from_varmap(
        &varmap,
        DType::F32,
        &Device::Cpu,
    ))?;
    let mut ddp = ddp_candle::Ddp::new(&varmap, pg, Default::default())?; // checks + broadcasts
    let params = ddp_candle::optim::ParamsSgd {
        lr: 0.1,
        momentum: 0.9,
        ..Default::default()
    };
    // Named after the parameters (`Sgd::new(varmap.all_vars(), ..)` would call them param0,
    // param1, ... in the VarMap's hash order: momentum buffers would not find their parameters
    // on resume).
    let mut opt = ddp_candle::optim::Sgd::new_named(ddp.named_vars().to_vec(), params)?;
    let mut sampler = ddp_core::DistributedSampler::new(N, pg.size(), pg.rank())?;
    for epoch in 0..epochs {
        sampler.set_epoch(epoch);
        for batch in sampler.indices().chunks(batch_size) {
            let (x, y) = rows(batch);
            let loss = candle_nn::loss::cross_entropy(&model.forward(&x)?, &y)?;
            let grads = ddp.backward(&loss)?;
            opt.step(&grads)?;
        }
    }
    let saved = ddp.save_checkpoint(dir, &opt, epochs)?; // rank 0 writes; Some(file) there
    Ok((saved, ddp, opt, sampler.len()))
}

#[test]
fn one_call_save_writes_one_file_on_rank_0_and_resumes_bit_for_bit() {
    let root = tempfile::tempdir().unwrap();
    let dirs: Vec<PathBuf> = (0..2)
        .map(|r| root.path().join(format!("rank{r}")))
        .collect();
    ddp_comm::testing::run_ranks(2, |pg| {
        let rank = pg.rank();
        let dir = &dirs[rank];
        let (saved, ddp, opt, per_rank) = readme_program(&pg, dir).unwrap();
        let steps_per_epoch = per_rank.div_ceil(BATCH) as u64;
        let steps = EPOCHS * steps_per_epoch;
        assert_eq!(ddp.reducer().step(), steps);
        // Exactly one file, on rank 0; nothing anywhere else.
        if rank == 0 {
            let file = dir.join(ddp_core::checkpoint::CHECKPOINT_FILE);
            assert_eq!(saved.as_deref(), Some(file.as_path()));
            assert_eq!(files(dir), vec![file]);
            let ckpt = ddp_core::checkpoint::load(dir).unwrap().unwrap();
            assert_eq!(ckpt.meta.world_size, 2, "world size of the process group");
            assert_eq!(ckpt.meta.step, steps, "the reducer's step count");
            assert_eq!(ckpt.meta.epoch, EPOCHS);
            assert_eq!(ckpt.optimizer.as_ref().unwrap().kind, "sgd");
            assert_eq!(ckpt.optimizer.as_ref().unwrap().step, steps);
        } else {
            assert_eq!(saved, None);
            assert!(files(dir).is_empty(), "rank {rank} wrote {:?}", files(dir));
        }
        pg.barrier().unwrap();

        // Resume through the existing path into a fresh model (another init, zero momentum).
        let varmap = VarMap::new();
        let _model =
            build_model(VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu)).unwrap();
        let fresh = DdpOptions {
            init_sync: false,
            ..Default::default()
        };
        let ddp2 = Ddp::new(&varmap, &pg, fresh).unwrap();
        assert_ne!(values(&ddp2), values(&ddp), "the fresh model must differ");
        let mut opt2 = Sgd::new_named(ddp2.named_vars().to_vec(), opt.params().clone()).unwrap();
        let plan = RunPlan {
            world_size: pg.size(),
            samples_per_epoch: per_rank,
            batch_size: BATCH,
            epochs: EPOCHS + 2,
            max_steps: None,
            hyper: Default::default(),
            rng_state: 0,
        };
        let r = checkpoint::resume_or_start(&pg, &dirs[rank], true, &plan)
            .unwrap()
            .expect("a checkpoint to resume");
        assert_eq!(
            r.state,
            TrainingState {
                step: steps,
                epoch: EPOCHS,
                consumed: 0
            }
        );
        load_vars(&r.checkpoint, ddp2.named_vars()).unwrap();
        r.checkpoint.load_optimizer(&mut opt2).unwrap();
        assert_eq!(values(&ddp2), values(&ddp), "parameters resume bit for bit");
        assert_eq!(
            opt2.state_dict().unwrap(),
            opt.state_dict().unwrap(),
            "optimizer state (momentum, step) resumes bit for bit"
        );
    });
}

#[test]
fn model_only_save_and_explicit_meta_fill_the_world_size() {
    let root = tempfile::tempdir().unwrap();
    ddp_comm::testing::run_ranks(2, |pg| {
        let rank = pg.rank();
        let varmap = VarMap::new();
        let _m = build_model(VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu)).unwrap();
        let ddp = Ddp::new(&varmap, &pg, Default::default()).unwrap();
        let dir = root.path().join(format!("model{rank}"));
        let saved = ddp.save_model(&dir, 0).unwrap();
        assert_eq!(saved.is_some(), rank == 0);
        let dir2 = root.path().join(format!("meta{rank}"));
        let meta = CheckpointMeta {
            step: 0,
            ..Default::default()
        };
        ddp.save_checkpoint_with::<Sgd>(&dir2, None, meta).unwrap();
        if rank == 0 {
            let ckpt = ddp_core::checkpoint::load(&dir).unwrap().unwrap();
            assert!(ckpt.optimizer.is_none(), "a model-only checkpoint");
            assert!(ckpt.tensors.keys().all(|k| !k.starts_with("optim.")));
            assert_eq!(ckpt.meta.world_size, 2);
            let other = VarMap::new();
            let _m =
                build_model(VarBuilder::from_varmap(&other, DType::F32, &Device::Cpu)).unwrap();
            let mut vars: Vec<(String, candle_core::Var)> = other
                .data()
                .lock()
                .unwrap()
                .iter()
                .map(|(n, v)| (n.clone(), v.clone()))
                .collect();
            vars.sort_by(|a, b| a.0.cmp(&b.0));
            load_vars(&ckpt, &vars).unwrap();
            let loaded: Vec<(String, Vec<u32>)> = vars
                .iter()
                .map(|(n, v)| {
                    let x = v
                        .as_tensor()
                        .flatten_all()
                        .unwrap()
                        .to_vec1::<f32>()
                        .unwrap();
                    (n.clone(), x.iter().map(|x| x.to_bits()).collect())
                })
                .collect();
            assert_eq!(loaded, values(&ddp));
            let meta = ddp_core::checkpoint::load(&dir2).unwrap().unwrap().meta;
            assert_eq!(meta.world_size, 2, "CheckpointMeta::default()'s 1 replaced");
        } else {
            assert!(files(&dir).is_empty() && files(&dir2).is_empty());
        }
    });
}
