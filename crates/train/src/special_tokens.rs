//! The token ids a run ends and pads its sequences with: the end of a training example, every id
//! that ends a completion (the source checkpoint's end-of-sequence ids, wherever Hugging Face's
//! files name them: `config.json`, `generation_config.json`, the tokenizer config's `eos_token`,
//! as transformers' `generate` and TRL stop on any of them), and the padding.

use std::path::Path;

use tokenizers::Tokenizer;

use crate::error::{io, Result, TrainError};
use crate::model::Qwen2;
use crate::tokenizer::{SideFiles, END_OF_TEXT, IM_END};

/// What [`special_ids`] finds.
#[derive(Debug, Clone, PartialEq)]
pub struct SpecialIds {
    /// Ends a training example (SFT), and a completion: `config.json`'s first `eos_token_id`,
    /// else the tokenizer's end-of-text or ChatML's end of turn.
    pub eos: u32,
    /// Every id that ends a completion, `eos` first (`stop_tokens`).
    pub stop: Vec<u32>,
    /// Pads batches (never attended to, never a target): end-of-text, else `eos`.
    pub pad: u32,
}

/// The special ids of `model` and `tokenizer`, whose source's files `side` names.
pub fn special_ids(model: &Qwen2, tokenizer: &Tokenizer, side: &SideFiles) -> Result<SpecialIds> {
    let eos = match model.config.eos_token_ids().first() {
        Some(&id) => id,
        None => tokenizer.token_to_id(END_OF_TEXT).or_else(|| tokenizer.token_to_id(IM_END)).ok_or_else(|| {
            TrainError::Tokenizer(format!(
                "no end-of-sequence token: config.json has no eos_token_id and the tokenizer has neither {END_OF_TEXT} nor {IM_END}"
            ))
        })?,
    };
    let stop = stop_tokens(model, tokenizer, eos, side)?;
    let pad = tokenizer.token_to_id(END_OF_TEXT).unwrap_or(eos);
    Ok(SpecialIds { eos, stop, pad })
}

/// A JSON file's contents, or `None` without the file.
fn read_json(path: &Path) -> Result<Option<serde_json::Value>> {
    if !path.is_file() {
        return Ok(None);
    }
    let text = std::fs::read_to_string(path).map_err(io(path))?;
    let json = serde_json::from_str(&text)
        .map_err(|e| TrainError::Config { origin: path.display().to_string(), why: e.to_string() })?;
    Ok(Some(json))
}

/// The ids `generation_config.json` in `dir` names as `eos_token_id` (one or a list); none without
/// the file.
fn generation_eos(dir: &Path) -> Result<Vec<u32>> {
    let Some(json) = read_json(&dir.join("generation_config.json"))? else {
        return Ok(Vec::new());
    };
    let ids = match json.get("eos_token_id") {
        Some(serde_json::Value::Array(a)) => a.iter().filter_map(|v| v.as_u64()).collect(),
        Some(v) => v.as_u64().into_iter().collect(),
        None => Vec::new(),
    };
    Ok(ids.into_iter().map(|v| v as u32).collect())
}

/// The id of `tokenizer_config.json`'s `eos_token` in `dir` (a string or `{"content": ...}`).
fn tokenizer_eos(dir: &Path, tokenizer: &Tokenizer) -> Result<Option<u32>> {
    let Some(json) = read_json(&dir.join("tokenizer_config.json"))? else {
        return Ok(None);
    };
    let token = json.get("eos_token").and_then(|t| t.as_str().or_else(|| t.get("content").and_then(|c| c.as_str())));
    Ok(token.and_then(|t| tokenizer.token_to_id(t)))
}

/// `eos` first, then every other end-of-sequence id of the model's `config.json`, of
/// `generation_config.json` in the source model's directory and of the source tokenizer's
/// `eos_token` (TRL stops on the last two), each once.
fn stop_tokens(model: &Qwen2, tokenizer: &Tokenizer, eos: u32, side: &SideFiles) -> Result<Vec<u32>> {
    let mut stop = vec![eos];
    let mut from_files = match &side.model_dir {
        Some(d) => generation_eos(d)?,
        None => Vec::new(),
    };
    if let Some(d) = &side.tokenizer_dir {
        from_files.extend(tokenizer_eos(d, tokenizer)?);
    }
    for id in model.config.eos_token_ids().into_iter().chain(from_files) {
        if !stop.contains(&id) {
            stop.push(id);
        }
    }
    Ok(stop)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Qwen2Config;

    /// Qwen2.5-Instruct's ids: `config.json` names `<|im_end|>` (151645), its
    /// `generation_config.json` `[151645, 151643]`; the run stops on both, `eos` first, each once;
    /// and on the tokenizer config's `eos_token`.
    #[test]
    fn completions_stop_on_every_eos_the_source_names() {
        let mut c = Qwen2Config::tiny(151_700, 8, 1, 2, 1);
        c.eos_token_id = Some(serde_json::json!(151_645));
        let model = Qwen2::random(c, candle_core::DType::F32, 1).unwrap();
        let texts = ["Natalia sold 48 clips in April and 24 clips in May."].repeat(20);
        let tokenizer = crate::tokenizer::train_bpe(texts.iter(), 300).unwrap();
        let dir = std::env::temp_dir().join(format!("flashgrpo-stop-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let side = SideFiles { tokenizer_dir: Some(dir.clone()), model_dir: Some(dir.clone()) };
        assert_eq!(stop_tokens(&model, &tokenizer, 151_645, &side).unwrap(), [151_645]);
        std::fs::write(dir.join("generation_config.json"), r#"{"eos_token_id": [151645, 151643]}"#).unwrap();
        assert_eq!(stop_tokens(&model, &tokenizer, 151_645, &side).unwrap(), [151_645, 151_643]);
        // The trained tokenizer's ids: <|endoftext|> 0, <|im_start|> 1, <|im_end|> 2.
        std::fs::write(dir.join("tokenizer_config.json"), r#"{"eos_token": {"content": "<|im_end|>"}}"#).unwrap();
        assert_eq!(stop_tokens(&model, &tokenizer, 151_645, &side).unwrap(), [151_645, 151_643, 2]);
        assert_eq!(stop_tokens(&model, &tokenizer, 7, &SideFiles::default()).unwrap(), [7, 151_645]);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
