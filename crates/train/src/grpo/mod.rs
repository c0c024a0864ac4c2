//! GRPO: configuration, the update's micro-batch layout, checkpoints, and the training loop.

pub mod adaptive_entropy;
pub mod batch;
pub mod checkpoint;
pub mod completions_log;
pub mod config;
pub mod ref_sync;
pub mod rollouts;
pub mod trainer;
pub mod update;

pub use checkpoint::{checkpoint_dir, Checkpoint, Resume, TrainerState};
pub use config::GrpoConfig;
pub use trainer::{train_grpo, Evaluation, GrpoRun, GrpoSummary, Prompt, StepHook};
