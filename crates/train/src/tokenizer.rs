//! Tokenizers: training a byte-level BPE on a corpus (for models trained from scratch), the
//! special tokens, encoding, and saving next to a model in Hugging Face's layout.

use std::path::Path;

use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::{BpeTrainerBuilder, BPE};
use tokenizers::models::{ModelWrapper, TrainerWrapper};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::{AddedToken, Tokenizer};

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

/// Writes `tokenizer.json` and a `tokenizer_config.json` (end-of-text as eos and padding, ChatML
/// as chat template) into `dir`, so that transformers' `AutoTokenizer` loads it.
pub fn save_tokenizer(tokenizer: &Tokenizer, dir: &Path) -> Result<()> {
    std::fs::create_dir_all(dir).map_err(io(dir))?;
    let path = dir.join("tokenizer.json");
    tokenizer.save(&path, false).map_err(|e| TrainError::Tokenizer(format!("{}: {e}", path.display())))?;
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
