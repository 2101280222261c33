//! The outer loop of the methods whose replicas train apart between synchronizations —
//! DiLoCo (`--hook diloco:H[:OUTER_LR[:MOMENTUM]]`, `streaming-diloco:H:F[:TAU]`,
//! `ddprs::hooks::DiLoCo`) and post-local SGD (`--hook localsgd[:PERIOD[:WARMUP]]`, whose
//! `PeriodicModelAverager` averages the parameters every PERIOD steps after WARMUP) — in the
//! examples' steps, checkpoints and ends of runs ([`Outer`]).
//!
//! Between synchronizations every rank's parameters and optimizer state are its own, so the
//! checkpoint holds every rank's beside the method's state: the library's
//! [`ddprs::hooks::local_state`] ([`Outer::gather`] on every rank, [`Gathered::store`] in rank
//! 0's checkpoint, [`Outer::restore`] on resume). At the world size it was written at the resume
//! is exact; at another (an elastic restart) a rank joining between synchronizations takes a
//! peer's state and, under DiLoCo, the last-synchronized parameters; rank 0 says so.
//!
//! The end of a run: the last synchronization ([`Outer::finish`]) comes after the last step's
//! training and before its evaluation and checkpoint, so that both see the one model every
//! replica holds; a run stopped earlier (`--max-steps`, `--target-accuracy`) writes its
//! checkpoint first, so that a resume continues where the uninterrupted run would, and then
//! synchronizes for its summary. DiLoCo's `finish` does nothing the second time.

use ddprs::adapter::ParamAccess;
use ddprs::checkpoint::Checkpoint;
use ddprs::comm::ProcessGroup;
use ddprs::hooks::local_state;
pub use ddprs::hooks::local_state::{Gathered, Restored};
use ddprs::hooks::{DiLoCo, HookSpec, PeriodicModelAverager};

/// DiLoCo's or post-local SGD's outer loop, after every inner optimizer step.
pub enum Outer {
    /// DiLoCo and streaming DiLoCo.
    DiLoCo(Box<DiLoCo>),
    /// Post-local SGD's model averaging.
    Average(PeriodicModelAverager),
}

impl Outer {
    /// The outer loop `spec` asks for (`None` for a hook that reduces every step), anchored at
    /// `params` (build it after the DDP wrapper, whose construction makes the replicas equal).
    pub fn new<P: ParamAccess + ?Sized>(
        spec: &HookSpec,
        params: &P,
    ) -> Result<Option<Outer>, P::Error> {
        if let Some(cfg) = spec.diloco() {
            return Ok(Some(Outer::DiLoCo(Box::new(DiLoCo::new(cfg, params)?))));
        }
        Ok(spec.averager()?.map(Outer::Average))
    }

    /// After an inner optimizer step: a synchronization when one is due (a collective then;
    /// every rank calls it after every step).
    pub fn step<P: ParamAccess + ?Sized>(
        &mut self,
        pg: &ProcessGroup,
        params: &P,
    ) -> Result<(), P::Error> {
        match self {
            Outer::DiLoCo(d) => d.step(pg, params).map(drop),
            Outer::Average(a) => a.average_parameters(pg, params).map(drop),
        }
    }

    /// The last synchronization, so that every replica holds the same model (a collective).
    pub fn finish<P: ParamAccess + ?Sized>(
        &mut self,
        pg: &ProcessGroup,
        params: &P,
    ) -> Result<(), P::Error> {
        match self {
            Outer::DiLoCo(d) => d.finish(pg, params).map(drop),
            Outer::Average(a) => a.average_now(pg, params),
        }
    }

    /// Payload bytes of synchronizations sent so far (per rank).
    pub fn bytes_sent(&self) -> u64 {
        match self {
            Outer::DiLoCo(d) => d.bytes_sent(),
            Outer::Average(a) => a.bytes_sent(),
        }
    }

    /// The kind of the method's state in checkpoints.
    fn kind(&self) -> &'static str {
        match self {
            Outer::DiLoCo(_) => "diloco",
            Outer::Average(_) => "periodic_model_averager",
        }
    }

    fn name(&self) -> &'static str {
        match self {
            Outer::DiLoCo(_) => "DiLoCo",
            Outer::Average(_) => "post-local SGD",
        }
    }

    /// Collects every rank's `local` checkpoint (its own parameters and optimizer state, as
    /// its framework writes them) and the method's state (DiLoCo's all-reduces in flight
    /// completed). A collective: every rank calls it at the same step.
    pub fn gather(&mut self, pg: &ProcessGroup, local: &Checkpoint) -> ddprs::Result<Gathered> {
        let state = match self {
            Outer::DiLoCo(d) => d.state_dict()?,
            Outer::Average(a) => a.state_dict(),
        };
        local_state::gather(pg, state, local)
    }

    /// Resuming on `rank` of a world of `world` from `ckpt` (`from` names it): loads the
    /// method's state and returns this rank's part; load `local` (parameters and optimizer
    /// state), then call [`joined`](Self::joined). Rank 0 prints (prefixed with `program`) what
    /// a change of world size did.
    pub fn restore(
        &mut self,
        program: &str,
        ckpt: &Checkpoint,
        from: &str,
        rank: usize,
        world: usize,
    ) -> ddprs::Result<Restored> {
        let r = local_state::restore(ckpt, from, self.kind(), rank, world)?;
        let joiners = match self {
            Outer::DiLoCo(d) => {
                d.load_state_dict(&r.state)?;
                d.joiners_start()
            }
            Outer::Average(a) => {
                a.load_state_dict(&r.state)?;
                "a peer's parameters".to_string()
            }
        };
        let note = local_state::world_change_note(ckpt.meta.world_size, world, &joiners);
        if let Some(note) = note.filter(|_| rank == 0) {
            eprintln!("{program}: {} {note}", self.name());
        }
        Ok(r)
    }

    /// After the parameters and optimizer state of [`restore`](Self::restore)'s `local` were
    /// loaded: a rank joining DiLoCo between synchronizations starts from the anchor (the
    /// last-synchronized parameters); otherwise nothing.
    pub fn joined<P: ParamAccess + ?Sized>(
        &self,
        restored: &Restored,
        params: &P,
    ) -> Result<(), P::Error> {
        match self {
            Outer::DiLoCo(d) if !restored.own => d.restore_anchor(params),
            _ => Ok(()),
        }
    }
}
