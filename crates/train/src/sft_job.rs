//! `flashgrpo train --algo sft`: the task's question / worked answer pairs, a model and tokenizer from
//! the config, SFT, and the trained model saved in Hugging Face's layout.

use std::path::Path;

use crate::data::{Gsm8kProblem, TaskName};
use crate::error::{io, Result};
use crate::grpo_job::{prompt_format, warm_start_examples};
use crate::metrics::MetricsLog;
use flashgrpo_collective::Collective;

use crate::model::save_model;
use crate::parallel::{broadcast_weights, Mesh};
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
/// GSM8K trains on `Question: ...\nAnswer: ` + the worked solution; the arithmetic task on its
/// prompts and the think/answer format the GRPO rewards ask for. The bf16 products are those
/// `model.bf16_products` names.
pub fn run_sft_job(config: &TrainConfig, out: &Path, comm: &dyn Collective) -> Result<SftSummary> {
    config.model.bf16_products.run(|| sft_job(config, out, comm))
}

fn sft_job(config: &TrainConfig, out: &Path, comm: &dyn Collective) -> Result<SftSummary> {
    let mesh = Mesh::new(comm, &config.parallel)?;
    let root = comm.is_root();
    let (train, eval) = config.task.load(&config.data, config.seed)?;
    let gsm8k = config.task.name == TaskName::Gsm8k;
    let s = if gsm8k {
        let corpus =
            train.iter().map(|p| format!("Question: {}\nAnswer: {}\n#### {}", p.question, p.reasoning, p.answer));
        setup(config, corpus)?
    } else {
        let format = prompt_format(config, true)?;
        let corpus = warm_start_examples(&format, &train)?;
        setup(config, corpus.iter().map(|e| format!("{}{}", e.prompt, e.completion)))?
    };
    broadcast_weights(&s.model.params, comm)?;
    if root {
        std::fs::create_dir_all(out).map_err(io(out))?;
        let config_path = out.join("config.json");
        std::fs::write(&config_path, serde_json::to_string_pretty(config).expect("json")).map_err(io(&config_path))?;
    }
    let format = prompt_format(config, s.trained_tokenizer)?;
    let examples = |problems: &[Gsm8kProblem]| -> Result<Vec<Example>> {
        if gsm8k {
            Ok(problems.iter().map(gsm8k_example).collect())
        } else {
            warm_start_examples(&format, problems)
        }
    };
    let (train, _) = encode_examples(&s.tokenizer, &examples(&train)?, s.eos, config.sft.max_len)?;
    let (eval, _) = encode_examples(&s.tokenizer, &examples(&eval)?, s.eos, config.sft.max_len)?;
    let mut log = if root {
        MetricsLog::open(out, false)?.with_tensorboard(&out.join("tensorboard/sft"))?
    } else {
        MetricsLog::discard()
    };
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
            mesh: &mesh,
            check_weights_every: config.parallel.check_weights_every,
        },
    )?;
    if root {
        let model_dir = out.join("model");
        save_model(&s.model, &model_dir, None)?;
        save_tokenizer(&s.tokenizer, &model_dir, &s.side_files)?;
    }
    comm.barrier()?;
    Ok(summary)
}
