//! What a training run starts from: the tokenizer (given, the model's, or trained on the text),
//! the model (a Hugging Face directory, or new from the config), and its special token ids.

use std::path::{Path, PathBuf};

use tokenizers::Tokenizer;

use crate::error::{io, Result, TrainError};
use crate::model::{load_model, load_tokenizer, Qwen2};
use crate::tokenizer::{train_bpe, SideFiles, END_OF_TEXT, IM_END};
use crate::train_config::TrainConfig;

/// A model with its tokenizer and the ids the trainer needs.
pub struct Setup {
    pub model: Qwen2,
    pub tokenizer: Tokenizer,
    /// Ends a training example (SFT), and a completion.
    pub eos: u32,
    /// Every id that ends a completion: `eos` and the others `config.json` and the model's
    /// `generation_config.json` name (Qwen2.5-Instruct: `<|im_end|>` and `<|endoftext|>`), as
    /// transformers' `generate` stops on any of them.
    pub stop: Vec<u32>,
    /// Pads batches (never attended to, never a target).
    pub pad: u32,
    /// Whether the tokenizer was trained by this run.
    pub trained_tokenizer: bool,
    /// The source's files that go with every model the run saves.
    pub side_files: SideFiles,
}

/// The directory of a run's tokenizer: `tokenizer.path` (a directory, or a `tokenizer.json`'s),
/// else `model.path`; `None` for a tokenizer the run trains.
pub fn tokenizer_dir(config: &TrainConfig) -> Option<PathBuf> {
    match (&config.tokenizer.path, &config.model.path) {
        (Some(p), _) if p.is_dir() => Some(p.clone()),
        (Some(p), _) => p.parent().map(Path::to_path_buf),
        (None, Some(m)) => Some(m.clone()),
        (None, None) => None,
    }
}

/// The ids `generation_config.json` in `dir` names as `eos_token_id` (one or a list); none without
/// the file.
fn generation_eos(dir: &Path) -> Result<Vec<u32>> {
    let path = dir.join("generation_config.json");
    if !path.is_file() {
        return Ok(Vec::new());
    }
    let text = std::fs::read_to_string(&path).map_err(io(&path))?;
    let json: serde_json::Value = serde_json::from_str(&text)
        .map_err(|e| TrainError::Config { origin: path.display().to_string(), why: e.to_string() })?;
    let ids = match json.get("eos_token_id") {
        Some(serde_json::Value::Array(a)) => a.iter().filter_map(|v| v.as_u64()).collect(),
        Some(v) => v.as_u64().into_iter().collect(),
        None => Vec::new(),
    };
    Ok(ids.into_iter().map(|v| v as u32).collect())
}

/// The id of `tokenizer_config.json`'s `eos_token` in `dir` (a string or `{"content": ...}`).
fn tokenizer_eos(dir: &Path, tokenizer: &Tokenizer) -> Result<Option<u32>> {
    let path = dir.join("tokenizer_config.json");
    if !path.is_file() {
        return Ok(None);
    }
    let text = std::fs::read_to_string(&path).map_err(io(&path))?;
    let json: serde_json::Value = serde_json::from_str(&text)
        .map_err(|e| TrainError::Config { origin: path.display().to_string(), why: e.to_string() })?;
    let token = json.get("eos_token").and_then(|t| t.as_str().or_else(|| t.get("content").and_then(|c| c.as_str())));
    Ok(token.and_then(|t| tokenizer.token_to_id(t)))
}

/// `eos` first, then every other end-of-sequence id of the model's `config.json`, of
/// `generation_config.json` in the source model's directory and of the source tokenizer's
/// `eos_token` (TRL stops on the last two), each once.
pub fn stop_tokens(model: &Qwen2, tokenizer: &Tokenizer, eos: u32, side: &SideFiles) -> Result<Vec<u32>> {
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

fn load_tokenizer_path(path: &Path) -> Result<Tokenizer> {
    if path.is_dir() {
        return load_tokenizer(path);
    }
    if !path.exists() {
        return Err(TrainError::Tokenizer(format!("{} does not exist", path.display())));
    }
    Tokenizer::from_file(path).map_err(|e| TrainError::Tokenizer(format!("{}: {e}", path.display())))
}

/// Builds the tokenizer and model of `config`; `corpus` is the text a new tokenizer learns from.
pub fn setup<S: AsRef<str> + Send>(config: &TrainConfig, corpus: impl Iterator<Item = S> + Send) -> Result<Setup> {
    let dtype = crate::train_config::parameter_dtype(config.model.dtype)?;
    if let Some(dir) = config.model.path.as_deref().filter(|d| !d.is_dir()) {
        return Err(TrainError::Config {
            origin: "model.path".into(),
            why: format!(
                "{} is not a directory; put a Hugging Face checkpoint there (config.json, model.safetensors, \
                 tokenizer.json) or set model.path, or leave it null for a new model",
                dir.display()
            ),
        });
    }
    let (tokenizer, trained) = match (&config.tokenizer.path, &config.model.path) {
        (Some(path), _) => (load_tokenizer_path(path)?, false),
        (None, Some(dir)) => (load_tokenizer(dir)?, false),
        (None, None) => (train_bpe(corpus, config.tokenizer.vocab_size)?, true),
    };
    let vocab = tokenizer.get_vocab_size(true);
    let model = match &config.model.path {
        Some(dir) => load_model(dir, Some(dtype))?,
        None => {
            let mut c = config.model.new_config(vocab)?;
            if let Some(eos) = tokenizer.token_to_id(END_OF_TEXT) {
                c.eos_token_id = Some(serde_json::json!(eos));
            }
            Qwen2::random(c, dtype, config.seed)?
        }
    };
    if vocab > model.config.vocab_size {
        return Err(TrainError::Other(format!(
            "the tokenizer has {vocab} tokens, more than the model's vocab_size {}",
            model.config.vocab_size
        )));
    }
    let eos = match model.config.eos_token_ids().first() {
        Some(&id) => id,
        None => tokenizer.token_to_id(END_OF_TEXT).or_else(|| tokenizer.token_to_id(IM_END)).ok_or_else(|| {
            TrainError::Tokenizer(format!(
                "no end-of-sequence token: config.json has no eos_token_id and the tokenizer has neither {END_OF_TEXT} nor {IM_END}"
            ))
        })?,
    };
    let pad = tokenizer.token_to_id(END_OF_TEXT).unwrap_or(eos);
    let side_files = SideFiles {
        tokenizer_dir: if trained { None } else { tokenizer_dir(config) },
        model_dir: config.model.path.clone(),
    };
    let stop = stop_tokens(&model, &tokenizer, eos, &side_files)?;
    Ok(Setup { model, tokenizer, eos, stop, pad, trained_tokenizer: trained, side_files })
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
