//! `train-digits-burn --learner`: the same training through Burn's own loop, `burn-train`'s
//! `SupervisedTraining` + `Learner`, with `ddp_burn::DdpLearningStrategy` as its training
//! strategy, as a Burn user who keeps Burn's loop writes it. Burn's checkpointer (rank 0) goes
//! to `--checkpoint-dir`, and `--resume` continues from its last epoch. Same data, shard,
//! optimizer, LR and summary as the plain loop (module `train`), and the same result bit for
//! bit: the strategy runs the same reducer on the same gradients.

use crate::model::Mlp;
use crate::train::{optimizer, report, setup, BoxResult, RunCounts, Setup};
use crate::Args;
use burn::data::dataloader::DataLoaderBuilder;
use burn::data::dataset::InMemDataset;
use burn::module::Module;
use burn::nn::loss::CrossEntropyLossConfig;
use burn::tensor::{Int, Tensor};
use burn_train::checkpoint::{FileCheckpointer, KeepLastNCheckpoints};
use burn_train::{
    ClassificationOutput, InferenceStep, Learner, SupervisedTraining, TrainOutput, TrainStep,
};
use ddp_burn::{Ddp, DdpLearningStrategy, DdpOptions, QuietRenderer};
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

/// The last epoch Burn's checkpointer wrote in `dir` (`model-<epoch>.bpk`).
fn last_checkpoint(dir: &Path) -> Option<usize> {
    std::fs::read_dir(dir.join("checkpoint"))
        .ok()?
        .filter_map(|e| {
            let name = e.ok()?.file_name().into_string().ok()?;
            name.strip_prefix("model-")?
                .strip_suffix(".bpk")?
                .parse()
                .ok()
        })
        .max()
}

pub fn run(args: &Args) -> BoxResult<()> {
    if args.hook != ddp::hooks::HookSpec::None
        || args.max_steps.is_some()
        || args.target_accuracy.is_some()
        || args.zero != 0
    {
        return Err(
            "--learner runs Burn's epoch loop with plain DDP: --hook, --max-steps, \
             --target-accuracy and --zero are the plain loop's"
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
        check_finite: !args.no_check_finite,
        ..Default::default()
    };
    // Burn numbers epochs from 1; the sampler's epochs are the plain loop's (from 0).
    let s = shard.clone();
    let strategy = Arc::new(
        DdpLearningStrategy::new(&pg, device.clone())
            .with_options(opts)
            .on_epoch(move |e| s.set_epoch(e as u64 - 1)),
    );
    // Burn's learner directory: metric logs, and its checkpoints with --checkpoint-dir.
    let dir = match &args.checkpoint_dir {
        Some(d) => d.clone(),
        None => std::env::temp_dir().join(format!("train-digits-burn-{}", std::process::id())),
    };
    let dir = if rank == 0 {
        dir
    } else {
        dir.join(format!("rank{rank}"))
    };
    let valid = DataLoaderBuilder::new(crate::train::Rows(Arc::new(test.clone())))
        .batch_size(256)
        .build(InMemDataset::new((0..test.len()).collect::<Vec<_>>()));
    let mut training = SupervisedTraining::new(&dir, loader, valid)
        .num_epochs(args.epochs as usize)
        .with_application_logger(None)
        .with_training_strategy(strategy.into_training_strategy());
    if rank != 0 || args.log_every == 0 {
        training = training.renderer(Box::new(QuietRenderer));
    }
    let mut first_epoch = 0;
    if let Some(d) = &args.checkpoint_dir {
        // Burn's checkpointers in DIR/checkpoint on every rank: the strategy saves from rank 0
        // only, and on --resume every rank reads rank 0's files (one host or a shared file
        // system; the strategy broadcasts rank 0's parameters anyway).
        let ckpt = d.join("checkpoint");
        training = training
            .with_custom_checkpointers(
                FileCheckpointer::new(&ckpt, "model"),
                FileCheckpointer::new(&ckpt, "optim"),
                FileCheckpointer::new(&ckpt, "scheduler"),
            )
            .with_checkpointing_strategy(KeepLastNCheckpoints::new(2));
        match (args.resume, last_checkpoint(d)) {
            (true, Some(epoch)) => {
                training = training.checkpoint(epoch);
                first_epoch = epoch;
                if rank == 0 {
                    println!(
                        "resuming from Burn's checkpoint of epoch {epoch} in {}",
                        d.display()
                    );
                }
            }
            (true, None) if rank == 0 => {
                println!("no checkpoint in {}: starting fresh", d.display())
            }
            _ => {}
        }
    }
    if rank == 0 {
        println!(
            "train-digits-burn (Burn's Learner): world_size {}, batch {} per rank, {} epochs",
            pg.size(),
            args.batch_size,
            args.epochs
        );
    }
    let start = Instant::now();
    let learner = Learner::new(
        Mlp::new(args.hidden, args.seed, &device),
        optimizer(args),
        args.lr(),
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
    if args.checkpoint_dir.is_none() {
        let _ = std::fs::remove_dir_all(&dir);
    }
    let steps_per_epoch = samples_per_epoch.div_ceil(args.batch_size) as u64;
    let no_sync = DdpOptions {
        init_sync: false,
        ..opts
    };
    // Burn returns the model for inference (`valid()`, no trainable parameters): its values
    // back into a trainable one, for the replica check and the summary.
    let model = Mlp::new(args.hidden, args.seed, &device).load_record(result.model.into_record());
    let ddp = Ddp::new(model, &pg, no_sync)?;
    let run = RunCounts {
        steps: first_epoch as u64 * steps_per_epoch + fit.steps,
        steps_run: fit.steps,
        local_samples: (fit.epochs * samples_per_epoch) as u64,
        train_time,
        time_to_target: None,
        bytes_sent: ddp.reducer().bytes_sent(),
    };
    report(args, &pg, &ddp, &train, &test, &device, run)
}
