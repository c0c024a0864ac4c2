//! Tokenizers: training a byte-level BPE on a corpus (for models trained from scratch), the
//! special tokens, encoding, and saving next to a model in Hugging Face's layout.

use std::path::{Path, PathBuf};

use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::{BpeTrainerBuilder, BPE};
use tokenizers::models::{ModelWrapper, TrainerWrapper};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::AddedToken;
/// The tokenizer type every front end shares (Hugging Face's `tokenizers`).
pub use tokenizers::Tokenizer;

use crate::error::{io, Result, TrainError};

/// End of text (also the padding token), and ChatML's turn markers, as Qwen2's tokenizer names
/// them. A trained tokenizer gives them ids 0, 1, 2.
pub const END_OF_TEXT: &str = "<|endoftext|>";
pub const IM_START: &str = "<|im_start|>";
pub const IM_END: &str = "<|im_end|>";

/// ChatML, Qwen2's chat format without its tool-calling parts.
pub const CHATML_TEMPLATE: &str = "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

fn tokenizer_error(e: impl std::fmt::Display) -> TrainError {
    TrainError::Tokenizer(e.to_string())
}

/// Trains a byte-level BPE of `vocab_size` tokens (special tokens included) on `texts`. Digits are
/// split one per token, as Qwen2's pre-tokenizer does, so that numbers are spelled digit by digit.
pub fn train_bpe<S: AsRef<str> + Send>(texts: impl Iterator<Item = S> + Send, vocab_size: usize) -> Result<Tokenizer> {
    let specials = [END_OF_TEXT, IM_START, IM_END];
    if vocab_size < 256 + specials.len() {
        return Err(TrainError::Tokenizer(format!(
            "a byte-level BPE needs a vocabulary of at least {} tokens (256 bytes and the special tokens), got {vocab_size}",
            256 + specials.len()
        )));
    }
    let trainer = BpeTrainerBuilder::new()
        .show_progress(false)
        .vocab_size(vocab_size)
        .min_frequency(2)
        .initial_alphabet(ByteLevel::alphabet().into_iter().collect())
        .special_tokens(specials.iter().map(|s| AddedToken::from(*s, true)).collect())
        .build();
    let mut tokenizer = Tokenizer::new(ModelWrapper::BPE(BPE::default()));
    tokenizer.with_pre_tokenizer(Some(PreTokenizerWrapper::Sequence(Sequence::new(vec![
        PreTokenizerWrapper::Digits(Digits::new(true)),
        PreTokenizerWrapper::ByteLevel(ByteLevel::new(false, true, true)),
    ]))));
    tokenizer.with_decoder(Some(ByteLevelDecoder::default()));
    tokenizer.train(&mut TrainerWrapper::BpeTrainer(trainer), texts).map_err(tokenizer_error)?;
    Ok(tokenizer)
}

/// Token ids of `text`, without special tokens added.
pub fn encode(tokenizer: &Tokenizer, text: &str) -> Result<Vec<u32>> {
    Ok(tokenizer.encode(text, false).map_err(tokenizer_error)?.get_ids().to_vec())
}

/// The text of `ids`, special tokens dropped.
pub fn decode(tokenizer: &Tokenizer, ids: &[u32]) -> Result<String> {
    tokenizer.decode(ids, true).map_err(tokenizer_error)
}

/// The id of a token that must exist.
pub fn token_id(tokenizer: &Tokenizer, token: &str) -> Result<u32> {
    tokenizer.token_to_id(token).ok_or_else(|| TrainError::Tokenizer(format!("the tokenizer has no token `{token}`")))
}

/// Where the Hugging Face files that travel with a saved model besides its weights and
/// `tokenizer.json` come from, so that a model saved by a run loads and generates as its source
/// did (the source's chat template, eos token and sampling defaults, not ours).
#[derive(Debug, Clone, Default)]
pub struct SideFiles {
    /// The tokenizer's directory ([`TOKENIZER_SIDE_FILES`]); `None` for a tokenizer trained by
    /// the run, which gets a `tokenizer_config.json` of its own (ChatML, end-of-text).
    pub tokenizer_dir: Option<PathBuf>,
    /// The model's directory, for its `generation_config.json` (eos ids, sampling defaults).
    pub model_dir: Option<PathBuf>,
}

/// The tokenizer's files besides `tokenizer.json`, copied as they are where present.
pub const TOKENIZER_SIDE_FILES: [&str; 7] = [
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
];

/// Copies the contents of `from/name` to `to/name` if it exists (and is not that same file); the
/// copy gets default permissions, not the source's (a read-only download would make the next save
/// into the same directory fail).
fn copy_if_present(from: &Path, to: &Path, name: &str) -> Result<()> {
    let (src, dst) = (from.join(name), to.join(name));
    if !src.is_file() {
        return Ok(());
    }
    let same = matches!((src.canonicalize(), dst.canonicalize()), (Ok(a), Ok(b)) if a == b);
    if !same {
        let bytes = std::fs::read(&src).map_err(io(&src))?;
        std::fs::write(&dst, bytes).map_err(io(&dst))?;
    }
    Ok(())
}

/// Writes `tokenizer.json` into `dir` with the side files of `side`: the source tokenizer's
/// (`tokenizer_config.json` and the rest, as they are) when it has a `tokenizer_config.json`, else
/// one written here (end-of-text as eos and padding, ChatML as chat template), so that
/// transformers' `AutoTokenizer` loads it; and the source model's `generation_config.json`.
pub fn save_tokenizer(tokenizer: &Tokenizer, dir: &Path, side: &SideFiles) -> Result<()> {
    std::fs::create_dir_all(dir).map_err(io(dir))?;
    let path = dir.join("tokenizer.json");
    tokenizer.save(&path, false).map_err(|e| TrainError::Tokenizer(format!("{}: {e}", path.display())))?;
    if let Some(src) = &side.model_dir {
        copy_if_present(src, dir, "generation_config.json")?;
    }
    if let Some(src) = side.tokenizer_dir.as_deref().filter(|d| d.join("tokenizer_config.json").is_file()) {
        for name in TOKENIZER_SIDE_FILES {
            copy_if_present(src, dir, name)?;
        }
        return Ok(());
    }
    let config = serde_json::json!({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": END_OF_TEXT,
        "pad_token": END_OF_TEXT,
        "bos_token": null,
        "unk_token": null,
        "model_max_length": 32768,
        "chat_template": CHATML_TEMPLATE,
    });
    let path = dir.join("tokenizer_config.json");
    std::fs::write(&path, serde_json::to_string_pretty(&config).expect("json")).map_err(io(&path))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A model saved from a Hugging Face directory keeps that directory's tokenizer config (its
    /// chat template and eos) and generation config; a trained tokenizer gets ours; saving into
    /// the source directory itself leaves its files intact.
    #[test]
    fn saved_tokenizers_keep_their_sources_side_files() {
        let root = std::env::temp_dir().join(format!("flashgrpo-side-files-{}", std::process::id()));
        let (src, out, trained) = (root.join("src"), root.join("out"), root.join("trained"));
        std::fs::create_dir_all(&src).unwrap();
        let texts = ["Natalia sold 48 clips in April and 24 clips in May."].repeat(20);
        let t = train_bpe(texts.iter(), 300).unwrap();
        let theirs = r#"{"eos_token": "<|im_end|>", "chat_template": "theirs"}"#;
        std::fs::write(src.join("tokenizer_config.json"), theirs).unwrap();
        std::fs::write(src.join("special_tokens_map.json"), "{}").unwrap();
        std::fs::write(src.join("generation_config.json"), r#"{"eos_token_id": [2, 0], "top_p": 0.8}"#).unwrap();
        let side = SideFiles { tokenizer_dir: Some(src.clone()), model_dir: Some(src.clone()) };
        save_tokenizer(&t, &out, &side).unwrap();
        let read = |p: PathBuf| std::fs::read_to_string(p).unwrap();
        assert_eq!(read(out.join("tokenizer_config.json")), theirs);
        assert_eq!(read(out.join("special_tokens_map.json")), "{}");
        assert!(read(out.join("generation_config.json")).contains("top_p"));
        assert!(Tokenizer::from_file(out.join("tokenizer.json")).is_ok());
        save_tokenizer(&t, &src, &side).unwrap();
        assert_eq!(read(src.join("tokenizer_config.json")), theirs);
        save_tokenizer(&t, &trained, &SideFiles::default()).unwrap();
        assert!(read(trained.join("tokenizer_config.json")).contains(END_OF_TEXT));
        assert!(!trained.join("generation_config.json").exists());
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn trained_bpe_round_trips_and_splits_digits() {
        let texts = ["Natalia sold 48 clips in April and 24 clips in May.", "Weng earns $12 an hour."].repeat(20);
        let t = train_bpe(texts.iter(), 300).unwrap();
        assert_eq!(token_id(&t, END_OF_TEXT).unwrap(), 0);
        assert_eq!(token_id(&t, IM_END).unwrap(), 2);
        let ids = encode(&t, "Natalia sold 1234 clips.").unwrap();
        assert_eq!(decode(&t, &ids).unwrap(), "Natalia sold 1234 clips.");
        let tokens = t.encode("1234", false).unwrap().get_tokens().to_vec();
        assert_eq!(tokens, ["1", "2", "3", "4"]);
        assert!(train_bpe(texts.iter(), 100).is_err());
    }
}
