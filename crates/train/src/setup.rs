//! What a training run starts from: the tokenizer (given, the model's, or trained on the text),
//! the model (a Hugging Face directory, or new from the config), and its special token ids.

use std::path::{Path, PathBuf};

use tokenizers::Tokenizer;

use crate::error::{Result, TrainError};
use crate::model::{load_model, load_tokenizer, Qwen2};
use crate::special_tokens::{special_ids, SpecialIds};
use crate::tokenizer::{train_bpe, SideFiles, END_OF_TEXT};
use crate::train_config::TrainConfig;

/// A model with its tokenizer and the ids the trainer needs.
pub struct Setup {
    pub model: Qwen2,
    pub tokenizer: Tokenizer,
    /// Ends a training example (SFT), and a completion.
    pub eos: u32,
    /// Every id that ends a completion: `eos` and the others the source names
    /// ([`crate::special_tokens`]; Qwen2.5-Instruct: `<|im_end|>` and `<|endoftext|>`).
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
    let side_files = SideFiles {
        tokenizer_dir: if trained { None } else { tokenizer_dir(config) },
        model_dir: config.model.path.clone(),
    };
    let SpecialIds { eos, stop, pad } = special_ids(&model, &tokenizer, &side_files)?;
    Ok(Setup { model, tokenizer, eos, stop, pad, trained_tokenizer: trained, side_files })
}
