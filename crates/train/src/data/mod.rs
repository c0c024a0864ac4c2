//! Datasets: GSM8K files, the built-in arithmetic task, and the `task:` section choosing between
//! them.

pub mod arithmetic;
pub mod gsm8k;
pub mod task;

pub use gsm8k::{load_gsm8k, Gsm8kProblem};
pub use task::{TaskName, TaskSection};
