//! TRL's `log_completions`: what the policy wrote each step, beside its rewards and advantage, in
//! `completions.jsonl` of the run directory (one line per completion: `step`, `prompt` as the
//! model saw it, special tokens included, `completion`, the three rewards, the weighted
//! `reward`, `advantage`). The completions are those the step trained on, of rank 0 in a
//! data-parallel run; `num_completions_to_print` keeps the first ones of each step.

use std::path::Path;

use serde_json::json;
use tokenizers::Tokenizer;

use super::rollouts::Groups;
use crate::error::{Result, TrainError};
use crate::metrics::{record, MetricsLog};
use crate::rewards::{weighted, REWARD_NAMES};
use crate::tokenizer::decode;

/// The log's file name in the run directory.
pub const COMPLETIONS_FILE: &str = "completions.jsonl";

/// Opens `out/completions.jsonl`: new for a fresh run, continued after `resumed_at` (the lines of
/// later steps dropped, as the metrics' are) for a resumed one.
pub fn open(out: &Path, resumed_at: Option<usize>) -> Result<MetricsLog> {
    let path = out.join(COMPLETIONS_FILE);
    match resumed_at {
        Some(step) => MetricsLog::resume_file(&path, step),
        None => MetricsLog::open_file(&path, false),
    }
}

/// Writes step `step`'s first `limit` (all: `None`) trained-on completions.
pub fn write(
    log: &mut MetricsLog,
    step: usize,
    groups: &Groups,
    weights: &[f64],
    tokenizer: &Tokenizer,
    limit: Option<usize>,
) -> Result<()> {
    let rows = groups.completions.len().min(limit.unwrap_or(usize::MAX));
    for r in 0..rows {
        let prompt = tokenizer
            .decode(&groups.prompts[r], false)
            .map_err(|e| TrainError::Tokenizer(format!("decoding a prompt: {e}")))?;
        let scores = &groups.kept_scores[r];
        let rewards: serde_json::Map<String, serde_json::Value> =
            REWARD_NAMES.iter().zip(scores).map(|(name, s)| (name.to_string(), json!(s))).collect();
        let reward = weighted(scores, weights);
        log.write(&record(json!({
            "step": step,
            "prompt": prompt,
            "completion": decode(tokenizer, &groups.completions[r])?,
            "rewards": rewards,
            "reward": reward,
            "advantage": groups.advantages[r],
        })))?;
    }
    Ok(())
}
