//! The `task:` section: which problems a run trains and evaluates on (the built-in arithmetic
//! task, or GSM8K files), and the system prompt.

use serde::{Deserialize, Serialize};

use super::arithmetic::{arithmetic_problems, ArithmeticLevel};
use super::{load_gsm8k, Gsm8kProblem};
use crate::error::Result;
use crate::prompt::THINK_ANSWER_SYSTEM_PROMPT;
use crate::train_config::DataSection;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TaskName {
    /// Generated word problems (`data.limit` training problems, default `task.train_problems`;
    /// `data.eval_limit` held out, from a disjoint seed).
    #[default]
    Arithmetic,
    /// `data.path` and `data.eval_path`, GSM8K JSONL.
    Gsm8k,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TaskSection {
    pub name: TaskName,
    /// `null`: the task's own (GSM8K: the original's think/answer instructions; arithmetic:
    /// none); `""`: none.
    pub system_prompt: Option<String>,
    /// Arithmetic: training problems generated when `data.limit` is not set.
    pub train_problems: usize,
    /// Arithmetic: largest addend.
    pub max_sum_operand: u32,
    /// Arithmetic: largest factor, divisor and quotient.
    pub max_factor: u32,
    /// The share of the GRPO warm start's worked solutions whose final answer the teacher writes
    /// with its digits reversed (`data::sloppy_teacher`; the rewards check the true answer).
    /// `null`: the task's own (arithmetic: 0.75; GSM8K: 0).
    pub sloppy_teacher: Option<f64>,
}

impl Default for TaskSection {
    fn default() -> Self {
        let level = ArithmeticLevel::default();
        Self {
            name: TaskName::Arithmetic,
            system_prompt: None,
            train_problems: 20_000,
            max_sum_operand: level.max_sum_operand,
            max_factor: level.max_factor,
            sloppy_teacher: None,
        }
    }
}

impl TaskSection {
    pub fn system_prompt(&self) -> Option<String> {
        match (&self.system_prompt, self.name) {
            (Some(s), _) if s.is_empty() => None,
            (Some(s), _) => Some(s.clone()),
            (None, TaskName::Gsm8k) => Some(THINK_ANSWER_SYSTEM_PROMPT.into()),
            (None, TaskName::Arithmetic) => None,
        }
    }

    /// The share of reversed answers in the GRPO warm start's data.
    pub fn sloppy_teacher_share(&self) -> f64 {
        self.sloppy_teacher.unwrap_or(match self.name {
            TaskName::Arithmetic => 0.75,
            TaskName::Gsm8k => 0.0,
        })
    }

    /// Training and held-out problems.
    pub fn load(&self, data: &DataSection, seed: u64) -> Result<(Vec<Gsm8kProblem>, Vec<Gsm8kProblem>)> {
        match self.name {
            TaskName::Arithmetic => {
                let level = ArithmeticLevel { max_sum_operand: self.max_sum_operand, max_factor: self.max_factor };
                let train = arithmetic_problems(seed ^ 0xA817, data.limit.unwrap_or(self.train_problems), level);
                let eval = arithmetic_problems(seed ^ 0xE7A1_0000_0000, data.eval_limit, level);
                Ok((train, eval))
            }
            TaskName::Gsm8k => {
                let train = load_gsm8k(&data.path, data.limit)?;
                let eval = match &data.eval_path {
                    Some(p) => load_gsm8k(p, Some(data.eval_limit))?,
                    None => Vec::new(),
                };
                Ok((train, eval))
            }
        }
    }
}
