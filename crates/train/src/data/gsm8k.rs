//! GSM8K in its standard JSONL: `{"question": ..., "answer": "...reasoning...\n#### 72"}`.

use std::path::Path;

use serde::Deserialize;

use crate::error::{io, Result, TrainError};

/// One grade-school math problem.
#[derive(Debug, Clone, PartialEq)]
pub struct Gsm8kProblem {
    pub question: String,
    /// The worked solution, without its final `#### N` line.
    pub reasoning: String,
    /// The final answer, as written after `####` (e.g. `1,000`).
    pub answer: String,
}

#[derive(Deserialize)]
struct Line {
    question: String,
    answer: String,
}

impl Gsm8kProblem {
    /// Splits a GSM8K `answer` field into reasoning and final answer.
    pub fn parse(question: String, answer: &str) -> Option<Self> {
        let (reasoning, last) = answer.rsplit_once("####")?;
        let answer = last.trim().to_string();
        if answer.is_empty() {
            return None;
        }
        Some(Self { question, reasoning: reasoning.trim_end().to_string(), answer })
    }
}

/// Reads a GSM8K JSONL file (at most `limit` problems). A malformed line is an error naming the
/// file and the line.
pub fn load_gsm8k(path: &Path, limit: Option<usize>) -> Result<Vec<Gsm8kProblem>> {
    let text = std::fs::read_to_string(path).map_err(io(path))?;
    let mut problems = Vec::new();
    for (n, line) in text.lines().enumerate() {
        if limit.is_some_and(|l| problems.len() >= l) {
            break;
        }
        if line.trim().is_empty() {
            continue;
        }
        let bad = |why: String| TrainError::Config { origin: format!("{} line {}", path.display(), n + 1), why };
        let parsed: Line = serde_json::from_str(line)
            .map_err(|e| bad(format!("not a GSM8K record ({{\"question\", \"answer\"}}): {e}")))?;
        let problem = Gsm8kProblem::parse(parsed.question, &parsed.answer)
            .ok_or_else(|| bad("the answer has no final `#### N` line".into()))?;
        problems.push(problem);
    }
    if problems.is_empty() {
        return Err(TrainError::Config { origin: path.display().to_string(), why: "no GSM8K problems".into() });
    }
    Ok(problems)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splits_the_final_answer() {
        let p = Gsm8kProblem::parse("q".into(), "a = <<1+1=2>>2\n#### 1,000").unwrap();
        assert_eq!(p.reasoning, "a = <<1+1=2>>2");
        assert_eq!(p.answer, "1,000");
        assert!(Gsm8kProblem::parse("q".into(), "no answer").is_none());
    }
}
