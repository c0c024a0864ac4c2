//! Datasets: GSM8K files, the built-in arithmetic task, the sloppy teacher of its warm start, and
//! the `task:` section choosing between them.

pub mod arithmetic;
pub mod gsm8k;
pub mod sloppy_teacher;
pub mod task;

pub use gsm8k::{load_gsm8k, Gsm8kProblem};
pub use task::{TaskName, TaskSection};
