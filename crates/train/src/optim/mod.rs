//! Updating the parameters: gradients accumulated on the host over micro-batches, global-norm
//! clipping, AdamW with f32 master weights, and the learning-rate schedule.

pub mod adamw;
pub mod grads;
pub mod overlap;
pub mod schedule;
pub mod updater;

pub use adamw::{AdamW, AdamWConfig};
pub use grads::GradBuffers;
pub use schedule::WarmupCosine;
pub use updater::{OptimConfig, StepReport, Updater};
