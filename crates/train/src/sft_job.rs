//! `flashgrpo train --algo sft`: GSM8K question / worked answer pairs, a model and tokenizer from
//! the config, SFT, and the trained model saved in Hugging Face's layout.

use std::path::Path;

use crate::data::{load_gsm8k, Gsm8kProblem};
use crate::error::{io, Result};
use crate::metrics::MetricsLog;
use crate::model::save_model;
use crate::setup::setup;
use crate::sft::{encode_examples, train_sft, Example, SftRun, SftSummary};
use crate::tokenizer::save_tokenizer;
use crate::train_config::TrainConfig;

/// GSM8K as a plain-text completion task: `Question: ...\nAnswer: ` then the worked solution
/// ending in `#### N`.
pub fn gsm8k_example(p: &Gsm8kProblem) -> Example {
    Example {
        prompt: format!("Question: {}\nAnswer: ", p.question),
        completion: format!("{}\n#### {}", p.reasoning, p.answer),
    }
}

/// Runs SFT as the config says, writing `metrics.jsonl`, `config.json` and `model/` to `out`.
pub fn run_sft_job(config: &TrainConfig, out: &Path) -> Result<SftSummary> {
    let train = load_gsm8k(&config.data.path, config.data.limit)?;
    let eval = match &config.data.eval_path {
        Some(p) => load_gsm8k(p, Some(config.data.eval_limit))?,
        None => Vec::new(),
    };
    let corpus = train.iter().map(|p| format!("Question: {}\nAnswer: {}\n#### {}", p.question, p.reasoning, p.answer));
    let s = setup(config, corpus)?;
    std::fs::create_dir_all(out).map_err(io(out))?;
    let config_path = out.join("config.json");
    std::fs::write(&config_path, serde_json::to_string_pretty(config).expect("json")).map_err(io(&config_path))?;
    let examples = |problems: &[Gsm8kProblem]| problems.iter().map(gsm8k_example).collect::<Vec<_>>();
    let (train, _) = encode_examples(&s.tokenizer, &examples(&train), s.eos, config.sft.max_len)?;
    let (eval, _) = encode_examples(&s.tokenizer, &examples(&eval), s.eos, config.sft.max_len)?;
    let mut log = MetricsLog::open(out, false)?;
    let summary = train_sft(
        &s.model,
        SftRun {
            config: &config.sft,
            loss: &config.loss,
            train: &train,
            eval: &eval,
            pad: s.pad,
            seed: config.seed,
            log: Some(&mut log),
            progress: config.progress,
        },
    )?;
    let model_dir = out.join("model");
    save_model(&s.model, &model_dir, None)?;
    save_tokenizer(&s.tokenizer, &model_dir)?;
    Ok(summary)
}
