//! # flashgrpo-train
//!
//! Training language models with flashgrpo's fused losses on candle: a trainable
//! Qwen2-architecture model (Hugging Face directories in and out, KV-cache generation), the
//! optimiser and schedule, the loss at the head three ways, and the SFT loop.

pub mod data;
pub mod error;
pub mod head_loss;
pub mod metrics;
pub mod model;
pub mod optim;
pub mod setup;
pub mod sft;
pub mod sft_job;
pub mod tokenizer;
pub mod train_config;

pub use error::{Result, TrainError};
pub use head_loss::{head_loss, HeadLoss, LossConfig, LossImpl};
pub use train_config::{Algo, TrainConfig};
