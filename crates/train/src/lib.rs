//! # flashgrpo-train
//!
//! Training language models with flashgrpo's fused losses on candle: a trainable
//! Qwen2-architecture model (Hugging Face directories in and out, KV-cache generation), the
//! optimiser and schedule, the loss at the head three ways, the SFT loop, and the GRPO trainer
//! (rollouts, rewards, group advantages, checkpoints) with its built-in arithmetic task.

pub mod data;
pub mod engine;
pub mod error;
pub mod grpo;
pub mod grpo_job;
pub mod head_loss;
pub mod metrics;
pub mod model;
pub mod optim;
pub mod parallel;
pub mod plot;
pub mod progress;
pub mod prompt;
pub mod rewards;
pub mod rollout;
pub mod setup;
pub mod sft;
pub mod sft_job;
pub mod special_tokens;
pub mod tensor_file;
pub mod tokenizer;
pub mod train_config;
pub mod vocab_parallel;

pub use error::{Result, TrainError};
pub use head_loss::{head_loss, HeadLoss, LossConfig, LossImpl};
pub use train_config::{Algo, TrainConfig};
