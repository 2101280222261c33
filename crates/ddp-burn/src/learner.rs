//! [`DdpLearningStrategy`]: ddp-rs as a training strategy of Burn's own `Learner`
//! (`burn-train`'s `SupervisedTraining`), so that a Burn user keeps Burn's loop, metrics, loggers,
//! checkpointing, LR schedulers and early stopping, and only launches with `ddprun` (or
//! `mpirun`, or `ddprun::spawn`).
//!
//! ```text
//!  SupervisedTraining::new(dir, train_loader (a ShardedDataset), valid_loader)
//!      .with_training_strategy(DdpLearningStrategy::new(&pg, device)
//!          .on_epoch(move |e| shard.set_epoch(e as u64 - 1)).into())   // Burn's epochs from 1
//!      .launch(Learner::new(model, optim, lr))          ── on every rank
//!
//!  fit (this module), per optimizer step, on every rank:
//!    Join::begin_step_or_stop(has a batch, interrupted)  ── one all-reduce ──► Stopped: every
//!                                      rank stops at the same step; Done: every rank out of data
//!    learner.train_step(item)  (forward + backward: Burn's TrainStep)
//!    Ddp::sync_gradients_join  (bucketed all-reduce; no_sync for accumulated micro-batches)
//!    learner.lr_step(); learner.optimizer_step(averaged grads)   ── identical on every rank
//!  per epoch: validation on this rank's valid loader; early stopping decided by any rank for all
//!  (all_reduce(max)); Burn's checkpointer written by rank 0 only.
//! ```
//!
//! Guarantees, as for [`crate::Ddp`]: rank 0's parameters are copied to every rank before the
//! first step (and after a checkpoint was loaded), every rank applies bit-identical averaged
//! gradients, and at the end of `fit` the replicas are checked bit for bit
//! ([`DdpLearningStrategy::last_fit`]). Uneven loaders (a rank with fewer batches) do not hang:
//! the rank that ran out shadows the others' all-reduces ([`ddp_core::Join`]) and still steps its
//! optimizer. A communication failure (a dead peer, a timeout) stops the training on this rank
//! through Burn's `Interrupter` with the error as its reason; [`DdpLearningStrategy::take_error`]
//! returns it after `launch`.
//!
//! Checkpoints: Burn's `FileCheckpointer` writes bare burnpack files (no checksum: a flipped bit
//! loads as another model). [`ChecksummedCheckpointer`] stores each record in a checksummed,
//! atomically written `ddp_core::Checkpoint` instead; give it to
//! `SupervisedTraining::with_custom_checkpointers`, and check the epoch to resume with
//! [`ChecksummedCheckpointer::verify`] before `.checkpoint(epoch)` (Burn panics on a record it
//! cannot restore).
//!
//! What stays per rank: training metrics are this rank's batches', validation metrics this
//! rank's valid loader's (give every rank the whole valid set, or shard it with
//! [`crate::ShardedDataset`]); Burn's renderer and metric loggers run on every rank:
//! [`DdpLearningStrategy::supervised`] gives each rank its own directory (`base/rank<r>` off
//! rank 0) and a quiet renderer off rank 0, and [`DdpLearningStrategy::launch`] returns the
//! strategy's error (or Burn's) as an `Err` instead of leaving it to `take_error`.

use crate::data_parallel::{DdpOptions, DistributedDataParallel};
use crate::{Error, Result};
use burn::data::dataloader::Progress;
use burn::optim::GradientsParams;
use burn::tensor::Bytes;
use burn::tensor::Device;
use burn_train::checkpoint::{Checkpoint as BurnCheckpoint, Checkpointer, CheckpointerError};
use burn_train::logger::{EvaluationProgressLogger, TrainingProgressLogger};
use burn_train::metric::store::EventStoreClient;
use burn_train::metric::MetricDefinition;
use burn_train::renderer::{
    EvaluationName, MetricState, MetricsRenderer, MetricsRendererEvaluation,
    MetricsRendererTraining,
};
use burn_train::{
    CloneEarlyStoppingStrategy, EventProcessorTraining, InferenceStep, Interrupter, Learner,
    LearnerEvent, LearnerModel, LearnerSummary, LearningCheckpointer, LearningResult,
    SupervisedLearningStrategy, SupervisedTraining, SupervisedTrainingEventProcessor, TrainLoader,
    TrainStep, TrainingComponents, TrainingItem, TrainingStrategy, ValidLoader,
};
use ddp_comm::{ProcessGroup, ReduceOp};
use ddp_core::join::{Join, JoinStart, JoinStep};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

/// Called with the epoch number before each training epoch on every rank. Burn numbers epochs
/// from 1 (`burn-train` starts at `checkpoint.unwrap_or(0) + 1`, and a checkpoint of epoch `n`
/// resumes at `n + 1`), while a sampler's epochs, as PyTorch's `set_epoch`, start at 0: for a
/// [`crate::ShardedDataset`] pass `move |e| shard.set_epoch(e as u64 - 1)`, so that Burn's
/// epoch `e` is shuffled as epoch `e - 1` of a plain loop (the same batches, bit for bit).
pub type EpochHook = Arc<dyn Fn(usize) + Send + Sync>;

/// What the last `fit` did (see [`DdpLearningStrategy::last_fit`]).
#[derive(Debug, Clone, PartialEq)]
pub struct FitSummary {
    /// Optimizer steps taken (the same on every rank, shadowed ones included).
    pub steps: u64,
    /// Steps in which this rank had a batch of its own.
    pub own_steps: u64,
    /// Epochs whose training split ran to the end.
    pub epochs: usize,
    /// Whether the replicas ended bit-identical (checked across ranks).
    pub replicas_identical: bool,
    /// Largest absolute difference of any parameter between two ranks at the end.
    pub replica_max_diff: f64,
    /// Bytes this rank sent for the gradients' all-reduces during the fit.
    pub bytes_sent: u64,
}

/// ddp-rs data parallelism as a Burn `TrainingStrategy::Custom`: one process (or thread) per
/// rank, each with a full replica, gradients averaged by the bucketed reducer of
/// [`crate::Ddp`]. See the module documentation.
pub struct DdpLearningStrategy {
    pg: ProcessGroup,
    device: Device,
    opts: DdpOptions,
    on_epoch: Option<EpochHook>,
    error: Mutex<Option<Error>>,
    summary: Mutex<Option<FitSummary>>,
}

impl DdpLearningStrategy {
    /// A strategy over `pg` training on `device` (made an autodiff device if it is not one).
    pub fn new(pg: &ProcessGroup, device: Device) -> Self {
        let device = if device.is_autodiff() {
            device
        } else {
            device.autodiff()
        };
        DdpLearningStrategy {
            pg: pg.clone(),
            device,
            opts: DdpOptions::default(),
            on_epoch: None,
            error: Mutex::new(None),
            summary: Mutex::new(None),
        }
    }

    /// Reducer options (bucket sizes, `init_sync`, `check_finite`), as for [`crate::Ddp::new`].
    pub fn with_options(mut self, opts: DdpOptions) -> Self {
        self.opts = opts;
        self
    }

    /// Runs `f(epoch)` before each training epoch, with Burn's epoch number (from 1; see
    /// [`EpochHook`]): e.g. `move |e| shard.set_epoch(e as u64 - 1)`.
    pub fn on_epoch(mut self, f: impl Fn(usize) + Send + Sync + 'static) -> Self {
        self.on_epoch = Some(Arc::new(f));
        self
    }

    /// The error that stopped the last `fit` on this rank, if one did (taken).
    pub fn take_error(&self) -> Option<Error> {
        self.error.lock().unwrap_or_else(|p| p.into_inner()).take()
    }

    /// What the last `fit` did, if it got as far as building the replica.
    pub fn last_fit(&self) -> Option<FitSummary> {
        self.summary
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// `TrainingStrategy::Custom` over this strategy, for
    /// `SupervisedTraining::with_training_strategy`.
    pub fn into_training_strategy<M: LearnerModel>(self: &Arc<Self>) -> TrainingStrategy<M> {
        TrainingStrategy::Custom(self.clone())
    }

    fn record_error(&self, e: Error) {
        let mut slot = self.error.lock().unwrap_or_else(|p| p.into_inner());
        slot.get_or_insert(e);
    }
}

/// What the strategy arranges for a Burn program itself: the per-rank directory, the quiet
/// renderer off rank 0, and errors after `launch`.
///
/// Why these are helpers around `SupervisedTraining` and not done inside the strategy: Burn 0.22
/// gives a `TrainingStrategy` only `fit(components, learner, loaders, epoch)`. By then
/// `SupervisedTraining::launch` has already registered its `FileMetricLogger` on the directory
/// given to `SupervisedTraining::new` (a private field, with no setter) and built the event
/// processor around its renderer, and `launch` returns Burn's `LearningResult`, whose `error`
/// holds only Burn's own `TrainingError` kinds (events, datasets, workers, checkpoints). So the
/// directory and the renderer must be chosen before `SupervisedTraining::new` returns
/// ([`DdpLearningStrategy::supervised`]), and our error must be read after `launch`
/// ([`DdpLearningStrategy::launch`]).
impl DdpLearningStrategy {
    /// This rank's learner directory under `base`: `base` on rank 0, `base/rank<r>` on rank `r`
    /// (Burn writes metric logs there on every rank; rank 0 also its checkpoints). Created and
    /// probed on every rank; a collective: any rank's failure (a read-only file system, a path
    /// through a file) fails every rank, naming it.
    pub fn rank_dir(&self, base: impl AsRef<Path>) -> Result<PathBuf> {
        let base = base.as_ref();
        let rank = self.pg.rank();
        let dir = match rank {
            0 => base.to_path_buf(),
            r => base.join(format!("rank{r}")),
        };
        let mine = (|| -> ddp_core::Result<()> {
            let why = |what: &str, p: &Path, e| {
                ddp_core::Error::io(format!("Burn's learner directory: cannot {what}"), p, e)
            };
            std::fs::create_dir_all(&dir).map_err(|e| why("create", &dir, e))?;
            let probe = dir.join(format!(".write-probe.{}.{rank}", std::process::id()));
            std::fs::write(&probe, b"probe\n").map_err(|e| why("write a file in", &dir, e))?;
            std::fs::remove_file(&probe).map_err(|e| why("remove a file in", &dir, e))?;
            Ok(())
        })();
        ddp_core::sharding::agree(&self.pg, "preparing the learner directories", mine)?;
        Ok(dir)
    }

    /// Burn's `SupervisedTraining` set up for this rank: over [`rank_dir(base)`](Self::rank_dir),
    /// with this strategy as its training strategy and, on ranks other than 0, the
    /// [`QuietRenderer`] (Burn's default renderer would print every rank's progress). Configure
    /// the rest as usual (`.num_epochs(..)`, metrics, checkpointers), then
    /// [`launch`](Self::launch). A collective (the directory check).
    pub fn supervised<M: LearnerModel>(
        self: &Arc<Self>,
        base: impl AsRef<Path>,
        train: TrainLoader<M>,
        valid: ValidLoader<M>,
    ) -> Result<SupervisedTraining<M>> {
        let dir = self.rank_dir(base)?;
        let training = SupervisedTraining::new(dir, train, valid)
            .with_training_strategy(self.into_training_strategy());
        Ok(match self.pg.rank() {
            0 => training,
            _ => training.renderer(Box::new(QuietRenderer)),
        })
    }

    /// `training.launch(learner)` with the errors surfaced: this strategy's error (a dead peer,
    /// a timeout, a model that differs between ranks: [`take_error`](Self::take_error)), else
    /// the error Burn's loop recorded (`LearningResult::error`, as [`Error::Training`]). A stop
    /// without an error (early stopping, an interrupter) is `Ok`, with
    /// `LearningResult::interrupted` set. `training` must use this strategy (as
    /// [`supervised`](Self::supervised) sets it up).
    pub fn launch<M: LearnerModel>(
        &self,
        training: SupervisedTraining<M>,
        learner: Learner<M>,
    ) -> Result<LearningResult<M>> {
        let result = training.launch(learner);
        if let Some(e) = self.take_error() {
            return Err(e);
        }
        if let Some(e) = &result.error {
            return Err(Error::Training(e.to_string()));
        }
        Ok(result)
    }
}

/// Whether any rank says yes (a collective: every rank calls it at the same point).
fn any_rank(pg: &ProcessGroup, yes: bool) -> Result<bool> {
    let mut flag = [u8::from(yes)];
    pg.all_reduce(&mut flag, ReduceOp::Max)?;
    Ok(flag[0] != 0)
}

type TrainInput<M> = <M as TrainStep>::Input;
type TrainItem<M> = <M as TrainStep>::Output;

struct Fit<'a, M: LearnerModel> {
    strategy: &'a DdpLearningStrategy,
    ddp: DistributedDataParallel<M>,
    learner: Learner<M>,
    events: SupervisedTrainingEventProcessor<M>,
    interrupter: Interrupter,
    accumulation: usize,
    steps: u64,
    own_steps: u64,
    iteration: usize,
}

impl<M: LearnerModel> Fit<'_, M> {
    /// Hands the learner's current model (after an optimizer step) to the reducer's view.
    fn refresh(&mut self) -> Result<()> {
        let model = self.learner.model();
        self.ddp.map_module(|_| model)
    }

    /// One training epoch; returns whether training should stop (on every rank alike).
    fn train_epoch(&mut self, loader: &TrainLoader<M>) -> Result<bool> {
        let interrupter = &self.interrupter.clone();
        let accumulation = self.accumulation;
        let pg = self.strategy.pg.clone();
        let mut join = Join::new(&pg);
        let mut iter = loader.iter();
        let mut exhausted = false;
        loop {
            let mut inputs = Vec::with_capacity(accumulation);
            while !exhausted && inputs.len() < accumulation && !interrupter.should_stop() {
                match iter.next() {
                    Some(Ok(item)) => inputs.push((item, iter.progress())),
                    Some(Err(e)) => interrupter.fail(e),
                    None => exhausted = true,
                }
            }
            // A stop (Burn's interrupter, a data error) on any rank stops every rank here, at
            // the same step: a rank leaving alone would leave the others in their all-reduce.
            // It travels in Join's own all-reduce: one collective per step.
            let step =
                match join.begin_step_or_stop(!inputs.is_empty(), interrupter.should_stop())? {
                    JoinStart::Step(step) => step,
                    JoinStart::Done => return Ok(false),
                    JoinStart::Stopped { .. } => {
                        if !interrupter.should_stop() {
                            interrupter.stop(Some("ddp-rs: another rank stopped the training"));
                        }
                        return Ok(true);
                    }
                };
            self.refresh()?;
            let (grads, outputs) = if inputs.is_empty() {
                let grads = self.ddp.sync_gradients_join(None, &join, &step)?;
                (grads, Vec::new())
            } else {
                self.own_steps += 1;
                self.micro_batches(inputs, &join, &step)?
            };
            self.learner.lr_step();
            self.learner.optimizer_step(grads);
            self.steps += 1;
            for (item, progress) in outputs {
                self.iteration += 1;
                let lr = Some(self.learner.lr_current());
                let item = TrainingItem::new(item, progress, Some(self.iteration), lr);
                interrupter
                    .fail_on_error(self.events.process_train(LearnerEvent::ProcessedItem(item)));
            }
        }
    }

    /// Forward and backward of each micro-batch of one optimizer step: all but the last
    /// accumulate locally (`no_sync`), the last one's backward reduces the sum over the
    /// micro-batches and ranks. Returns the averaged gradients and the step outputs.
    #[allow(clippy::type_complexity)]
    fn micro_batches(
        &mut self,
        inputs: Vec<(TrainInput<M>, Progress)>,
        join: &Join,
        step: &JoinStep,
    ) -> Result<(GradientsParams, Vec<(TrainItem<M>, Progress)>)> {
        let n = inputs.len();
        let mut outputs = Vec::with_capacity(n);
        let mut reduced = GradientsParams::new();
        for (i, (input, progress)) in inputs.into_iter().enumerate() {
            let out = self.learner.train_step(input);
            if i + 1 < n {
                // Accumulated in the reducer's buckets; the local gradients are not needed.
                drop(self.ddp.no_sync().sync_gradients(out.grads)?);
            } else {
                reduced = self.ddp.sync_gradients_join(Some(out.grads), join, step)?;
            }
            outputs.push((out.item, progress));
        }
        Ok((reduced, outputs))
    }

    /// Validation on this rank's valid loader (no collective), as Burn's single-device loop.
    fn valid_epoch(&mut self, loader: &ValidLoader<M>) {
        let interrupter = &self.interrupter.clone();
        let model = self.learner.model().valid();
        let mut iter = loader.iter();
        let mut iteration = 0;
        while let Some(item) = iter.next() {
            let item = match item {
                Ok(item) => item,
                Err(e) => {
                    interrupter.fail(e);
                    break;
                }
            };
            let progress = iter.progress();
            iteration += 1;
            let item = InferenceStep::step(&model, item);
            let item = TrainingItem::new(item, progress, Some(iteration), None);
            interrupter.fail_on_error(self.events.process_valid(LearnerEvent::ProcessedItem(item)));
            if interrupter.should_stop() {
                break;
            }
        }
    }
}

/// What `fit` keeps of Burn's `TrainingComponents` besides the event processor.
struct Rest<M: LearnerModel> {
    checkpointer: Option<LearningCheckpointer<M>>,
    early_stopping: Option<Box<dyn CloneEarlyStoppingStrategy>>,
    event_store: Arc<EventStoreClient>,
    num_epochs: usize,
}

impl DdpLearningStrategy {
    /// The loop of `fit`; an `Err` is a ddp-rs failure (communication, a mismatched model).
    fn run<M: LearnerModel>(
        &self,
        fit: &mut Fit<'_, M>,
        rest: Rest<M>,
        train: TrainLoader<M>,
        valid: ValidLoader<M>,
        starting_epoch: usize,
    ) -> Result<usize> {
        let Rest {
            mut checkpointer,
            mut early_stopping,
            event_store,
            num_epochs,
        } = rest;
        let rank = self.pg.rank();
        let interrupter = fit.interrupter.clone();
        let mut epochs = 0;
        for epoch in starting_epoch..=num_epochs {
            if let Some(f) = &self.on_epoch {
                f(epoch);
            }
            let start = LearnerEvent::StartSplit {
                epoch_number: epoch,
                total_items: train.num_items(),
            };
            interrupter.fail_on_error(fit.events.process_train(start));
            let stopped = fit.train_epoch(&train)?;
            interrupter.fail_on_error(fit.events.process_train(LearnerEvent::EndSplit(epoch)));
            if stopped {
                if let Some(i) = interrupter.interruption() {
                    let reason = i.reason.as_deref().unwrap_or("reason unknown");
                    tracing::info!("training interrupted: {reason}");
                }
                break;
            }
            epochs += 1;

            let start = LearnerEvent::StartSplit {
                epoch_number: epoch,
                total_items: valid.num_items(),
            };
            interrupter.fail_on_error(fit.events.process_valid(start));
            fit.valid_epoch(&valid);
            interrupter.fail_on_error(fit.events.process_valid(LearnerEvent::EndSplit(epoch)));
            interrupter.fail_on_error(fit.events.process_train(LearnerEvent::EndEpoch(epoch)));
            if checkpointer.is_some() || early_stopping.is_some() {
                interrupter.fail_on_error(fit.events.flush());
            }
            // Burn's checkpointer writes from rank 0 only (the replicas are identical); the
            // stop decisions are every rank's at once.
            let mut stop = interrupter.should_stop();
            if rank == 0 {
                if let (Some(c), false) = (&mut checkpointer, stop) {
                    c.checkpoint(&fit.learner, epoch, &event_store);
                }
            }
            if let Some(e) = &mut early_stopping {
                stop |= e.should_stop(epoch, &event_store);
            }
            if any_rank(&self.pg, stop)? {
                break;
            }
        }
        Ok(epochs)
    }
}

impl<M: LearnerModel> SupervisedLearningStrategy<M> for DdpLearningStrategy {
    fn fit(
        &self,
        components: TrainingComponents<M>,
        mut learner: Learner<M>,
        train: TrainLoader<M>,
        valid: ValidLoader<M>,
        starting_epoch: usize,
    ) -> (M, SupervisedTrainingEventProcessor<M>) {
        let train = train.to_device(&self.device);
        let valid = valid.to_device(&self.device.clone().inner());
        learner.fork(&self.device);
        let TrainingComponents {
            checkpointer,
            grad_accumulation,
            interrupter,
            early_stopping,
            event_processor,
            event_store,
            num_epochs,
            ..
        } = components;
        let rest = Rest {
            checkpointer,
            early_stopping,
            event_store,
            num_epochs,
        };
        // Rank 0's parameters on every rank (after any checkpoint Burn loaded), names, shapes
        // and dtypes checked across ranks first.
        let ddp = DistributedDataParallel::new(learner.model(), &self.pg, self.opts);
        let ddp = match ddp {
            Ok(ddp) => ddp,
            Err(e) => {
                interrupter.stop(Some(&format!("ddp-rs: {e}")));
                self.record_error(e);
                return (learner.model(), event_processor);
            }
        };
        learner.load_model(ddp.module().clone().into_record());
        let mut fit = Fit {
            strategy: self,
            ddp,
            learner,
            events: event_processor,
            interrupter: interrupter.clone(),
            accumulation: grad_accumulation.unwrap_or(1).max(1),
            steps: 0,
            own_steps: 0,
            iteration: 0,
        };
        let outcome = self
            .run(&mut fit, rest, train, valid, starting_epoch)
            .and_then(|epochs| {
                fit.refresh()?;
                let report = fit.ddp.verify_replicas()?;
                Ok(FitSummary {
                    steps: fit.steps,
                    own_steps: fit.own_steps,
                    epochs,
                    replicas_identical: report.identical,
                    replica_max_diff: report.max_abs_diff,
                    bytes_sent: fit.ddp.reducer().bytes_sent(),
                })
            });
        match outcome {
            Ok(summary) => {
                if !summary.replicas_identical {
                    let e = Error::Unsupported(format!(
                        "replicas differ after training on rank {} (max |difference| {:e})",
                        self.pg.rank(),
                        summary.replica_max_diff
                    ));
                    interrupter.stop(Some(&format!("ddp-rs: {e}")));
                    self.record_error(e);
                }
                *self.summary.lock().unwrap_or_else(|p| p.into_inner()) = Some(summary);
            }
            Err(e) => {
                interrupter.stop(Some(&format!("ddp-rs: {e}")));
                self.record_error(e);
            }
        }
        (fit.learner.model(), fit.events)
    }
}

/// Blob name of a Burn record in a [`ChecksummedCheckpointer`] file.
pub const RECORD_BLOB: &str = "burn.record";

/// A Burn checkpointer (for `SupervisedTraining::with_custom_checkpointers`) with the integrity
/// of every ddp-rs checkpoint. Burn's `FileCheckpointer` writes bare burnpack files in place: a
/// torn write or one flipped bit loads silently as another model. This one stores each record
/// (Burn's burnpack bytes, as Burn's `Checkpoint::checkpoint_into_bytes` makes them) as blob
/// [`RECORD_BLOB`] of a `ddp_core::Checkpoint`, one per epoch:
///
/// ```text
///   <directory>/<name>-<epoch>/checkpoint.safetensors   (ddp_core::checkpoint::save_atomic: temp
///       └── "burn.record"  U8  Burn's record   crc32     file, fsync, rename, fsync of the
///       └── metadata (epoch, name)             crc32     directory)
/// ```
///
/// and verifies both checksums before Burn decodes anything: a damaged file is an error naming
/// its path and the blob. Burn's own loop panics on a checkpoint it cannot restore, so check
/// first with [`ChecksummedCheckpointer::verify`] (then a restore error names the file too).
/// The metadata can carry the run's position ([`ChecksummedCheckpointer::with_meta`]), e.g. the
/// optimizer steps taken, which Burn's records do not hold.
#[derive(Clone)]
pub struct ChecksummedCheckpointer {
    directory: PathBuf,
    name: String,
    meta: Option<MetaFn>,
}

/// What [`ChecksummedCheckpointer::with_meta`] records with the checkpoint of an epoch.
type MetaFn = Arc<dyn Fn(usize) -> ddp_core::checkpoint::CheckpointMeta + Send + Sync>;

impl std::fmt::Debug for ChecksummedCheckpointer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChecksummedCheckpointer")
            .field("directory", &self.directory)
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

impl ChecksummedCheckpointer {
    /// Checkpoints `<directory>/<name>-<epoch>/` (the directory is created at the first save).
    pub fn new(directory: impl AsRef<Path>, name: &str) -> Self {
        ChecksummedCheckpointer {
            directory: directory.as_ref().to_path_buf(),
            name: name.to_string(),
            meta: None,
        }
    }

    /// Records `meta(epoch)` (its `epoch` set to Burn's) as the metadata of each checkpoint, for
    /// [`ChecksummedCheckpointer::read_meta`]: e.g. the optimizer steps taken and the world size.
    pub fn with_meta(
        mut self,
        meta: impl Fn(usize) -> ddp_core::checkpoint::CheckpointMeta + Send + Sync + 'static,
    ) -> Self {
        self.meta = Some(Arc::new(meta));
        self
    }

    /// The metadata of the checkpoint of `epoch`, checksums verified.
    pub fn read_meta(&self, epoch: usize) -> Result<ddp_core::checkpoint::CheckpointMeta> {
        Ok(self.load(epoch)?.meta)
    }

    /// The directory of the checkpoint of `epoch`.
    pub fn dir_for_epoch(&self, epoch: usize) -> PathBuf {
        self.directory.join(format!("{}-{epoch}", self.name))
    }

    /// The file of the checkpoint of `epoch`.
    pub fn path_for_epoch(&self, epoch: usize) -> PathBuf {
        ddp_core::checkpoint::checkpoint_path(&self.dir_for_epoch(epoch))
    }

    /// The epochs that have a checkpoint of this name (complete: the file exists), ascending.
    pub fn epochs(&self) -> Vec<usize> {
        let prefix = format!("{}-", self.name);
        let mut epochs: Vec<usize> = std::fs::read_dir(&self.directory)
            .into_iter()
            .flatten()
            .filter_map(|e| {
                let name = e.ok()?.file_name().into_string().ok()?;
                name.strip_prefix(&prefix)?.parse().ok()
            })
            .filter(|&e| self.path_for_epoch(e).is_file())
            .collect();
        epochs.sort_unstable();
        epochs
    }

    /// The record bytes of `epoch`, checksums verified; an error naming the file when it is
    /// missing or damaged.
    pub fn read(&self, epoch: usize) -> Result<Vec<u8>> {
        let ckpt = self.load(epoch)?;
        let blob = ckpt.require_blob(RECORD_BLOB).map_err(|e| {
            Error::Ddp(ddp_core::Error::Checkpoint(format!(
                "{}: {e}",
                self.path_for_epoch(epoch).display()
            )))
        })?;
        Ok(blob.to_vec())
    }

    fn load(&self, epoch: usize) -> Result<ddp_core::Checkpoint> {
        let dir = self.dir_for_epoch(epoch);
        ddp_core::checkpoint::load(&dir)?.ok_or_else(|| {
            Error::Ddp(ddp_core::Error::Checkpoint(format!(
                "Burn checkpoint {} is missing",
                self.path_for_epoch(epoch).display()
            )))
        })
    }

    /// Checks the checkpoint of `epoch` (present, checksums right) without decoding it.
    pub fn verify(&self, epoch: usize) -> Result<()> {
        self.read(epoch).map(drop)
    }
}

impl<R: BurnCheckpoint> Checkpointer<R> for ChecksummedCheckpointer {
    fn save(&self, epoch: usize, record: R) -> std::result::Result<(), CheckpointerError> {
        let bytes = record
            .checkpoint_into_bytes()
            .map_err(CheckpointerError::Record)?;
        let meta = match &self.meta {
            Some(f) => f(epoch),
            None => ddp_core::checkpoint::CheckpointMeta {
                extra: serde_json::json!({ "burn_checkpoint": self.name }),
                ..Default::default()
            },
        };
        let mut ckpt = ddp_core::Checkpoint::new(ddp_core::checkpoint::CheckpointMeta {
            epoch: epoch as u64,
            ..meta
        });
        ckpt.insert_blob(RECORD_BLOB, bytes.to_vec());
        ddp_core::checkpoint::save_atomic(&self.dir_for_epoch(epoch), &ckpt)
            .map_err(|e| CheckpointerError::Unknown(e.to_string()))?;
        Ok(())
    }

    fn restore(&self, epoch: usize) -> std::result::Result<R, CheckpointerError> {
        let bytes = self
            .read(epoch)
            .map_err(|e| CheckpointerError::Unknown(e.to_string()))?;
        R::checkpoint_from_bytes(Bytes::from_bytes_vec(bytes)).map_err(CheckpointerError::Record)
    }

    fn delete(&self, epoch: usize) -> std::result::Result<(), CheckpointerError> {
        let dir = self.dir_for_epoch(epoch);
        match std::fs::remove_dir_all(&dir) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                Err(CheckpointerError::IOError(e))
            }
            _ => Ok(()),
        }
    }
}

/// A Burn metrics renderer that shows nothing: Burn's default renderer prints progress on every
/// rank, so give this one to the ranks other than 0
/// (`SupervisedTraining::renderer(Box::new(QuietRenderer))`). Metrics still reach Burn's
/// metric loggers and event store (early stopping, checkpoint selection).
#[derive(Debug, Default, Clone, Copy)]
pub struct QuietRenderer;

impl MetricsRendererTraining for QuietRenderer {
    fn update_train(&mut self, _state: MetricState) {}
    fn update_valid(&mut self, _state: MetricState) {}
    fn on_train_end(
        &mut self,
        _summary: Option<LearnerSummary>,
    ) -> std::result::Result<(), Box<dyn std::error::Error>> {
        Ok(())
    }
}

impl MetricsRendererEvaluation for QuietRenderer {
    fn update_test(&mut self, _name: EvaluationName, _state: MetricState) {}
    fn on_test_end(
        &mut self,
        _summary: Option<LearnerSummary>,
    ) -> std::result::Result<(), Box<dyn std::error::Error>> {
        Ok(())
    }
}

impl TrainingProgressLogger for QuietRenderer {
    fn start(&mut self, _epochs: usize, _first: usize, _items: Option<usize>, _: Option<&str>) {}
    fn update_epoch(&mut self, _epoch: usize) {}
    fn start_split(&mut self, _split: &str, _total_items: usize) {}
    fn update_split(&mut self, _items_processed: usize) {}
    fn end_split(&mut self) {}
    fn end(&mut self) {}
    fn log_event_training(&mut self, _event: String) {}
}

impl EvaluationProgressLogger for QuietRenderer {
    fn start_global_progress(&mut self, _total_tests: usize) {}
    fn start_test(&mut self, _name: &str, _total_items: usize) {}
    fn update_test_progress(&mut self, _items_processed: usize) {}
    fn end_test(&mut self) {}
    fn end_global_progress(&mut self) {}
    fn log_event_evaluation(&mut self, _event: String) {}
}

impl MetricsRenderer for QuietRenderer {
    fn manual_close(&mut self) {}
    fn register_metric(&mut self, _definition: MetricDefinition) {}
}
