//! # flashgrpo-train
//!
//! Training language models with flashgrpo's fused losses on candle: a trainable
//! Qwen2-architecture model (Hugging Face directories in and out, KV-cache generation), the
//! optimiser and schedule, and the SFT loop.

pub mod error;
pub mod model;

pub use error::{Result, TrainError};
