//! The Qwen2 model: configuration, parameters, forward, loading and saving, generation.

pub mod config;
pub mod generate;
pub mod loader;
pub mod params;
pub mod qwen2;

pub use crate::rollout::sampler::Sampling;
pub use config::Qwen2Config;
pub use generate::{generate, Generated};
pub use loader::{load_config, load_model, load_tokenizer, save_model};
pub use params::Params;
pub use qwen2::{parameter_shapes, KvCache, Qwen2};
