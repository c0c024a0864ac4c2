//! Datasets.

pub mod gsm8k;

pub use gsm8k::{load_gsm8k, Gsm8kProblem};
