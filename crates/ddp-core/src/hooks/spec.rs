//! The command-line form of a hook: `none|fp16|bf16|powersgd[:RANK[:START_ITER]]|
//! localsgd[:PERIOD[:WARMUP]]` ([`HookSpec`]).

use super::{
    CompressHook, DiLoCoConfig, PeriodicModelAverager, PostLocalSgdHook, PowerSgdHook,
    PowerSgdState,
};
use crate::error::Result;
use crate::reducer::{BucketWork, CommHook, GradBucket, HookState};
use ddp_comm::ProcessGroup;
use std::fmt;
use std::str::FromStr;

/// A built-in hook chosen by name (`--hook`), with PyTorch's defaults for what is left out:
/// PowerSGD rank 1 from iteration 1000, local SGD period 4 after 100 warm-up steps (the
/// values of PyTorch's post-local SGD example).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub enum HookSpec {
    /// The default all-reduce.
    #[default]
    None,
    /// `fp16_compress_hook`.
    Fp16,
    /// `bf16_compress_hook`.
    Bf16,
    /// `powerSGD_hook` with `matrix_approximation_rank` and `start_powerSGD_iter`.
    PowerSgd { rank: usize, start_iter: u64 },
    /// `post_localSGD_hook` (global averaging for `warmup` steps) and a
    /// `PeriodicModelAverager(period, warmup)`.
    LocalSgd { period: u64, warmup: u64 },
    /// DiLoCo: local inner steps (gradients not reduced) and an outer Nesterov SGD step on the
    /// averaged pseudo-gradient every `h` steps ([`super::DiLoCo`]; outer lr 0.7, momentum 0.9
    /// by default).
    DiLoCo {
        h: u64,
        outer_lr: f64,
        momentum: f64,
    },
    /// Streaming DiLoCo: `fragments` fragments synchronized in turn, each all-reduce overlapping
    /// `overlap` inner steps, pseudo-gradients in bf16.
    StreamingDiLoCo {
        h: u64,
        fragments: usize,
        overlap: u64,
    },
}

const FORMS: &str = "none|fp16|bf16|powersgd[:RANK[:START_ITER]]|localsgd[:PERIOD[:WARMUP]]|\
                     diloco:H[:OUTER_LR[:MOMENTUM]]|streaming-diloco:H:F[:TAU]";

impl FromStr for HookSpec {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<HookSpec, String> {
        let mut parts = s.split(':');
        let name = parts.next().unwrap_or_default();
        let args: Vec<&str> = parts.collect();
        let num =
            |i: usize, what: &str, default: u64, min: u64| -> std::result::Result<u64, String> {
                match args.get(i) {
                    None => Ok(default),
                    Some(a) => match a.parse::<u64>() {
                        Ok(v) if v >= min => Ok(v),
                        _ => Err(format!(
                        "hook {s:?}: {what} must be an integer >= {min}, got {a:?} (forms: {FORMS})"
                    )),
                    },
                }
            };
        let float = |i: usize, what: &str, default: f64| -> std::result::Result<f64, String> {
            match args.get(i) {
                None => Ok(default),
                Some(a) => a
                    .parse::<f64>()
                    .ok()
                    .filter(|v| v.is_finite())
                    .ok_or_else(|| {
                        format!("hook {s:?}: {what} must be a number, got {a:?} (forms: {FORMS})")
                    }),
            }
        };
        let (min_args, max_args) = match name {
            "none" | "fp16" | "bf16" => (0, 0),
            "powersgd" | "localsgd" => (0, 2),
            "diloco" => (1, 3),
            "streaming-diloco" => (2, 3),
            _ => return Err(format!("unknown hook {s:?} (forms: {FORMS})")),
        };
        if args.len() > max_args {
            return Err(format!("hook {s:?}: too many ':' fields (forms: {FORMS})"));
        }
        if args.len() < min_args {
            return Err(format!("hook {s:?}: missing ':' fields (forms: {FORMS})"));
        }
        let spec = match name {
            "none" => HookSpec::None,
            "fp16" => HookSpec::Fp16,
            "bf16" => HookSpec::Bf16,
            "powersgd" => HookSpec::PowerSgd {
                rank: num(0, "RANK", 1, 1)? as usize,
                start_iter: num(1, "START_ITER", 1000, 0)?,
            },
            "localsgd" => HookSpec::LocalSgd {
                period: num(0, "PERIOD", 4, 1)?,
                warmup: num(1, "WARMUP", 100, 0)?,
            },
            "diloco" => HookSpec::DiLoCo {
                h: num(0, "H", 0, 1)?,
                outer_lr: float(1, "OUTER_LR", 0.7)?,
                momentum: float(2, "MOMENTUM", 0.9)?,
            },
            _ => HookSpec::StreamingDiLoCo {
                h: num(0, "H", 0, 1)?,
                fragments: num(1, "F", 0, 1)? as usize,
                overlap: num(2, "TAU", 0, 0)?,
            },
        };
        // DiLoCo's settings checked together (F <= H, TAU < H/F, the outer optimizer's) when
        // the command line is read, not in the workers.
        if let Some(cfg) = spec.diloco() {
            cfg.check()
                .map_err(|e| format!("hook {s:?}: {e} (forms: {FORMS})"))?;
        }
        Ok(spec)
    }
}

impl fmt::Display for HookSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            HookSpec::None => write!(f, "none"),
            HookSpec::Fp16 => write!(f, "fp16"),
            HookSpec::Bf16 => write!(f, "bf16"),
            HookSpec::PowerSgd { rank, start_iter } => write!(f, "powersgd:{rank}:{start_iter}"),
            HookSpec::LocalSgd { period, warmup } => write!(f, "localsgd:{period}:{warmup}"),
            HookSpec::DiLoCo {
                h,
                outer_lr,
                momentum,
            } => write!(f, "diloco:{h}:{outer_lr}:{momentum}"),
            HookSpec::StreamingDiLoCo {
                h,
                fragments,
                overlap,
            } => write!(f, "streaming-diloco:{h}:{fragments}:{overlap}"),
        }
    }
}

impl HookSpec {
    /// The comm hook to register (`None` for the default all-reduce).
    pub fn hook(&self) -> Result<Option<BuiltinHook>> {
        Ok(match *self {
            HookSpec::None => None,
            HookSpec::Fp16 => Some(BuiltinHook::Compress(CompressHook::fp16())),
            HookSpec::Bf16 => Some(BuiltinHook::Compress(CompressHook::bf16())),
            HookSpec::PowerSgd { rank, start_iter } => {
                Some(BuiltinHook::PowerSgd(PowerSgdHook::new(PowerSgdState {
                    matrix_approximation_rank: rank,
                    start_powersgd_iter: start_iter,
                    ..Default::default()
                })?))
            }
            HookSpec::LocalSgd { warmup, .. } => {
                Some(BuiltinHook::LocalSgd(PostLocalSgdHook::new(warmup)))
            }
            // The inner steps are local: the gradients are not reduced.
            HookSpec::DiLoCo { .. } | HookSpec::StreamingDiLoCo { .. } => {
                Some(BuiltinHook::LocalSgd(PostLocalSgdHook::new(0)))
            }
        })
    }

    /// The DiLoCo outer loop that goes with the hook (DiLoCo and streaming DiLoCo only): build
    /// a [`super::DiLoCo`] with it after the DDP wrapper, and call its `step` after every inner
    /// optimizer step.
    pub fn diloco(&self) -> Option<DiLoCoConfig> {
        match *self {
            HookSpec::DiLoCo {
                h,
                outer_lr,
                momentum,
            } => Some(DiLoCoConfig {
                outer_lr,
                momentum,
                ..DiLoCoConfig::new(h)
            }),
            HookSpec::StreamingDiLoCo {
                h,
                fragments,
                overlap,
            } => Some(DiLoCoConfig::streaming(h, fragments, overlap)),
            _ => None,
        }
    }

    /// The model averager that goes with the hook (local SGD only).
    pub fn averager(&self) -> Result<Option<PeriodicModelAverager>> {
        match *self {
            HookSpec::LocalSgd { period, warmup } => {
                Ok(Some(PeriodicModelAverager::new(period, warmup)?))
            }
            _ => Ok(None),
        }
    }
}

/// One of the built-in hooks (what [`HookSpec::hook`] builds).
pub enum BuiltinHook {
    Compress(CompressHook),
    PowerSgd(PowerSgdHook),
    LocalSgd(PostLocalSgdHook),
}

impl BuiltinHook {
    fn get(&mut self) -> &mut dyn CommHook {
        match self {
            BuiltinHook::Compress(h) => h,
            BuiltinHook::PowerSgd(h) => h,
            BuiltinHook::LocalSgd(h) => h,
        }
    }

    fn get_ref(&self) -> &dyn CommHook {
        match self {
            BuiltinHook::Compress(h) => h,
            BuiltinHook::PowerSgd(h) => h,
            BuiltinHook::LocalSgd(h) => h,
        }
    }
}

impl CommHook for BuiltinHook {
    fn run(&mut self, pg: &ProcessGroup, bucket: GradBucket) -> BucketWork {
        self.get().run(pg, bucket)
    }

    fn take_sent_bytes(&mut self) -> Option<u64> {
        self.get().take_sent_bytes()
    }

    fn state_dict(&self) -> HookState {
        self.get_ref().state_dict()
    }

    fn load_state_dict(&mut self, state: &HookState) -> Result<()> {
        self.get().load_state_dict(state)
    }
}
