//! `train-digits-burn --learner`: the same training through Burn's own loop, `burn-train`'s
//! `SupervisedTraining` + `Learner`, with `ddprs::burn::DdpLearningStrategy` as its training
//! strategy, as a Burn user who keeps Burn's loop writes it. Burn's checkpointer (rank 0) goes
//! to `--checkpoint-dir`, each record checksummed and written atomically
//! (`ddprs::burn::learner::ChecksummedCheckpointer`, with the step count in its metadata), and
//! `--resume` continues from its last epoch after every rank verified the files. Same data, shard,
//! optimizer, LR and summary as the plain loop (module `train`), and the same result bit for
//! bit: the strategy runs the same reducer on the same gradients.

use crate::model::Mlp;
use crate::setup::{optimizer, report, setup, BoxResult, Rows, RunCounts, Setup};
use crate::Args;
use burn::data::dataloader::DataLoaderBuilder;
use burn::data::dataset::InMemDataset;
use burn::module::Module;
use burn::nn::loss::CrossEntropyLossConfig;
use burn::tensor::{Int, Tensor};
use burn_train::checkpoint::KeepLastNCheckpoints;
use burn_train::{
    ClassificationOutput, InferenceStep, Learner, SupervisedTraining, TrainOutput, TrainStep,
};
use ddprs::burn::learner::ChecksummedCheckpointer;
use ddprs::burn::{Ddp, DdpLearningStrategy, DdpOptions, QuietRenderer};
use ddprs::checkpoint::CheckpointMeta;
use ddprs::comm::ProcessGroup;
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

type Batch = (Tensor<2>, Tensor<1, Int>);

impl InferenceStep for Mlp {
    type Input = Batch;
    type Output = ClassificationOutput;
    fn step(&self, (x, y): Batch) -> ClassificationOutput {
        let output = self.forward(x);
        let loss = CrossEntropyLossConfig::new()
            .init(&output.device())
            .forward(output.clone(), y.clone());
        ClassificationOutput {
            loss,
            output,
            targets: y,
        }
    }
}

impl TrainStep for Mlp {
    type Input = Batch;
    type Output = ClassificationOutput;
    fn step(&self, batch: Batch) -> TrainOutput<ClassificationOutput> {
        let out = InferenceStep::step(self, batch);
        TrainOutput::new(self, out.loss.backward(), out)
    }
}

/// Burn's checkpointers of `--checkpoint-dir` (`DIR/checkpoint/{model,optim,scheduler}-<epoch>/`),
/// each record stored with ddp-rs's checksums and atomic write.
fn checkpointers(dir: &Path) -> [ChecksummedCheckpointer; 3] {
    let ckpt = dir.join("checkpoint");
    ["model", "optim", "scheduler"].map(|name| ChecksummedCheckpointer::new(&ckpt, name))
}

/// The last epoch whose three checkpoints Burn's checkpointers wrote in `dir`.
fn last_checkpoint(dir: &Path) -> Option<usize> {
    let [model, optim, scheduler] = checkpointers(dir);
    let (optim, scheduler) = (optim.epochs(), scheduler.epochs());
    model
        .epochs()
        .into_iter()
        .rev()
        .find(|e| optim.contains(e) && scheduler.contains(e))
}

/// What else `dir` holds that `--learner --resume` cannot load: the plain loop's checkpoint or
/// save set, or Burn checkpoints without checksums (`model-<epoch>.bpk`, an older
/// train-digits-burn's).
fn other_checkpoints(dir: &Path) -> BoxResult<Option<String>> {
    if ddprs::checkpoint::checkpoint_path(dir).exists() || ddprs::sharding::set_meta(dir)?.is_some()
    {
        return Ok(Some(
            "a checkpoint of the plain loop (resume it without --learner)".into(),
        ));
    }
    let bare = std::fs::read_dir(dir.join("checkpoint"))
        .into_iter()
        .flatten()
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .find(|n| n.starts_with("model-") && n.ends_with(".bpk"));
    Ok(bare.map(|n| {
        format!(
            "Burn checkpoints without checksums (checkpoint/{n}, an older train-digits-burn's), \
             which cannot be verified"
        )
    }))
}

/// Whether `dir` holds checkpoints of Burn's Learner (for the plain loop's `--resume`).
pub fn has_learner_checkpoints(dir: &Path) -> bool {
    last_checkpoint(dir).is_some()
}

/// Makes sure every rank can write its learner directory `dir` (Burn writes its metric logs
/// there, and rank 0 its checkpoints): created and probed on every rank, `--checkpoint-dir`
/// locked by rank 0 (one job per directory). A collective: any rank's failure, with the real
/// reason (a read-only file system, a path through a file), fails every rank before training.
fn prepare_dirs(pg: &ProcessGroup, dir: &Path, checkpoint_dir: Option<&Path>) -> BoxResult<()> {
    let mine = (|| -> ddprs::Result<()> {
        if let (Some(d), 0) = (checkpoint_dir, pg.rank()) {
            ddprs::checkpoint::ensure_writable(d)?;
        }
        let why = |what: &str, p: &Path, e| {
            ddprs::Error::io(format!("Burn's learner directory: cannot {what}"), p, e)
        };
        std::fs::create_dir_all(dir).map_err(|e| why("create", dir, e))?;
        let probe = dir.join(format!(".write-probe.{}", std::process::id()));
        std::fs::write(&probe, b"probe\n").map_err(|e| why("write a file in", dir, e))?;
        std::fs::remove_file(&probe).map_err(|e| why("remove a file in", dir, e))?;
        if let Some(d) = checkpoint_dir {
            let c = d.join("checkpoint");
            std::fs::create_dir_all(&c).map_err(|e| why("create", &c, e))?;
        }
        Ok(())
    })();
    ddprs::sharding::agree(pg, "preparing the learner directories", mine)?;
    Ok(())
}

/// Checks Burn's three checkpoints of `epoch` in `dir` on every rank (Burn panics on one it
/// cannot restore): a missing or damaged file fails every rank, naming it.
fn verify_checkpoint(pg: &ProcessGroup, dir: &Path, epoch: usize) -> BoxResult<()> {
    let mine = checkpointers(dir)
        .iter()
        .try_for_each(|c| c.verify(epoch))
        .map_err(|e| match e {
            ddprs::burn::Error::Ddp(e) => e,
            other => ddprs::Error::Checkpoint(other.to_string()),
        });
    ddprs::sharding::agree(pg, "checking Burn's checkpoint", mine)?;
    Ok(())
}

pub fn run(args: &Args) -> BoxResult<()> {
    if args.common.hook != ddprs::hooks::HookSpec::None
        || args.common.max_steps.is_some()
        || args.common.target_accuracy.is_some()
        || args.zero != 0
    {
        return Err(
            "--learner runs Burn's epoch loop with plain DDP: --hook (comm hooks, local SGD, \
             DiLoCo), --max-steps, --target-accuracy and --zero are the plain loop's: run \
             without --learner"
                .into(),
        );
    }
    let Setup {
        pg,
        train,
        test,
        device,
        shard,
        loader,
        samples_per_epoch,
    } = setup(args)?;
    let rank = pg.rank();
    let opts = DdpOptions {
        check_finite: !args.common.no_check_finite,
        ..Default::default()
    };
    // Burn numbers epochs from 1 (its loop starts at `checkpoint + 1`); the sampler's epochs
    // are the plain loop's and PyTorch's (from 0), so Burn's epoch `e` is the sampler's `e - 1`.
    let s = shard.clone();
    let strategy = Arc::new(
        DdpLearningStrategy::new(&pg, device.clone())
            .with_options(opts)
            .on_epoch(move |e| s.set_epoch(e as u64 - 1)),
    );
    // Burn's learner directory: metric logs, and its checkpoints with --checkpoint-dir.
    let dir = match &args.common.checkpoint_dir {
        Some(d) => d.clone(),
        None => std::env::temp_dir().join(format!("train-digits-burn-{}", std::process::id())),
    };
    let dir = if rank == 0 {
        dir
    } else {
        dir.join(format!("rank{rank}"))
    };
    prepare_dirs(&pg, &dir, args.common.checkpoint_dir.as_deref())?;
    let valid = DataLoaderBuilder::new(Rows(Arc::new(test.clone())))
        .batch_size(256)
        .build(InMemDataset::new((0..test.len()).collect::<Vec<_>>()));
    let mut training = SupervisedTraining::new(&dir, loader, valid)
        .num_epochs(args.common.epochs as usize)
        .with_application_logger(None)
        .with_training_strategy(strategy.into_training_strategy());
    if rank != 0 || args.common.log_every == 0 {
        training = training.renderer(Box::new(QuietRenderer));
    }
    // Optimizer steps before this run's first epoch (recorded with each checkpoint: earlier
    // epochs may have run at another world size, with another number of steps per epoch).
    let mut steps_before = 0u64;
    let steps_per_epoch = samples_per_epoch.div_ceil(args.common.batch_size) as u64;
    if let Some(d) = &args.common.checkpoint_dir {
        let mut first_epoch = 0;
        match (args.resume, last_checkpoint(d)) {
            (true, Some(epoch)) => {
                verify_checkpoint(&pg, d, epoch)?;
                let [model, ..] = checkpointers(d);
                steps_before = model.read_meta(epoch)?.step;
                training = training.checkpoint(epoch);
                first_epoch = epoch;
                if rank == 0 {
                    println!(
                        "resuming from Burn's checkpoint of epoch {epoch} in {} (step \
                         {steps_before})",
                        d.display()
                    );
                }
            }
            (true, None) => {
                // Never a fresh start over a checkpoint this mode cannot load.
                if let Some(other) = other_checkpoints(d)? {
                    return Err(format!(
                        "--resume: {} holds {other}, not checkpoints of Burn's Learner \
                         (--learner); nothing was loaded",
                        d.display()
                    )
                    .into());
                }
                if rank == 0 {
                    println!("no checkpoint in {}: starting fresh", d.display())
                }
            }
            _ => {}
        }
        // Burn's checkpointers in DIR/checkpoint on every rank: the strategy saves from rank 0
        // only, and on --resume every rank reads rank 0's files (one host or a shared file
        // system; the strategy broadcasts rank 0's parameters anyway). Each file carries
        // ddp-rs's checksums, verified on every rank before Burn loads it, and the steps taken
        // at the end of its epoch.
        let world_size = pg.size();
        let [model, optim, scheduler] = checkpointers(d).map(|c| {
            c.with_meta(move |epoch| CheckpointMeta {
                step: steps_before + epoch.saturating_sub(first_epoch) as u64 * steps_per_epoch,
                world_size,
                ..Default::default()
            })
        });
        training = training
            .with_custom_checkpointers(model, optim, scheduler)
            .with_checkpointing_strategy(KeepLastNCheckpoints::new(2));
    }
    if rank == 0 {
        println!(
            "train-digits-burn (Burn's Learner): world_size {}, batch {} per rank, {} epochs",
            pg.size(),
            args.common.batch_size,
            args.common.epochs
        );
    }
    let start = Instant::now();
    let learner = Learner::new(
        Mlp::new(args.common.hidden, args.common.seed, &device),
        optimizer(args),
        args.common.lr(),
    );
    let result = training.launch(learner);
    let train_time = start.elapsed();
    if let Some(e) = strategy.take_error() {
        return Err(e.into());
    }
    if let Some(e) = result.error {
        return Err(format!("Burn's training loop failed: {e}").into());
    }
    let fit = strategy.last_fit().ok_or("the strategy did not run")?;
    if args.common.checkpoint_dir.is_none() {
        let _ = std::fs::remove_dir_all(&dir);
    }
    let no_sync = DdpOptions {
        init_sync: false,
        ..opts
    };
    // Burn returns the model for inference (`valid()`, no trainable parameters): its values
    // back into a trainable one, for the replica check and the summary.
    let model = Mlp::new(args.common.hidden, args.common.seed, &device)
        .load_record(result.model.into_record());
    let ddp = Ddp::new(model, &pg, no_sync)?;
    let run = RunCounts {
        steps: steps_before + fit.steps,
        steps_run: fit.steps,
        local_samples: (fit.epochs * samples_per_epoch) as u64,
        train_time,
        time_to_target: None,
        bytes_sent: fit.bytes_sent,
    };
    report(args, &pg, &ddp, &train, &test, &device, run)
}
