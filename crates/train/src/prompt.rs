//! Prompts as the model expects them: through the tokenizer's chat template (the Jinja template
//! of `tokenizer_config.json`, rendered by `minijinja` as transformers' `apply_chat_template`
//! does, with the generation prompt added) when the model has one, plain text otherwise.

use std::path::Path;

use minijinja::{context, Environment};
use serde_json::Value;

use crate::error::{io, Result, TrainError};

/// The system prompt of the original GSM8K GRPO run.
pub const THINK_ANSWER_SYSTEM_PROMPT: &str =
    "A conversation between User and Assistant. The user asks a math question, \
and the Assistant solves it. The Assistant first thinks about the reasoning process and then gives the answer, in the \
following format:\n<think>\n...\n</think>\n<answer>\n...\n</answer>";

/// How prompts are written.
#[derive(Debug, Clone, Default)]
pub struct PromptFormat {
    /// A Jinja chat template; `None`: plain text.
    pub chat_template: Option<String>,
    /// `bos_token` / `eos_token` as the template may use them.
    pub bos_token: Option<String>,
    pub eos_token: Option<String>,
    pub system_prompt: Option<String>,
}

impl PromptFormat {
    /// The chat template and special tokens of the tokenizer files in `dir`, if any: the
    /// template of `chat_template.jinja` where there is one (transformers >= 4.5x saves it apart,
    /// and gives it priority on loading, as here), else `tokenizer_config.json`'s.
    pub fn from_tokenizer_dir(dir: &Path, system_prompt: Option<String>) -> Result<Self> {
        let mut format = Self::from_tokenizer_config(dir, system_prompt)?;
        let jinja = dir.join("chat_template.jinja");
        if jinja.is_file() {
            format.chat_template = Some(std::fs::read_to_string(&jinja).map_err(io(&jinja))?);
        }
        Ok(format)
    }

    /// `tokenizer_config.json`'s chat template and special tokens.
    fn from_tokenizer_config(dir: &Path, system_prompt: Option<String>) -> Result<Self> {
        let path = dir.join("tokenizer_config.json");
        let mut format = Self { system_prompt, ..Default::default() };
        if !path.exists() {
            return Ok(format);
        }
        let text = std::fs::read_to_string(&path).map_err(io(&path))?;
        let config: Value = serde_json::from_str(&text)
            .map_err(|e| TrainError::Config { origin: path.display().to_string(), why: e.to_string() })?;
        let token = |key: &str| match &config[key] {
            Value::String(s) => Some(s.clone()),
            Value::Object(o) => o.get("content").and_then(Value::as_str).map(str::to_string),
            _ => None,
        };
        format.bos_token = token("bos_token");
        format.eos_token = token("eos_token");
        format.chat_template = match &config["chat_template"] {
            Value::String(s) => Some(s.clone()),
            // A list of named templates: the "default" one.
            Value::Array(list) => {
                list.iter().find(|t| t["name"] == "default").and_then(|t| t["template"].as_str()).map(str::to_string)
            }
            _ => None,
        };
        Ok(format)
    }

    /// The prompt text of a question (the completion follows it directly).
    pub fn render(&self, question: &str) -> Result<String> {
        let Some(template) = &self.chat_template else {
            return Ok(match &self.system_prompt {
                Some(system) => format!("{system}\n\n{question}\n"),
                None => format!("{question}\n"),
            });
        };
        let mut messages = Vec::new();
        if let Some(system) = &self.system_prompt {
            messages.push(context! { role => "system", content => system });
        }
        messages.push(context! { role => "user", content => question });
        let mut env = Environment::new();
        env.add_function("raise_exception", |msg: String| -> std::result::Result<String, minijinja::Error> {
            Err(minijinja::Error::new(minijinja::ErrorKind::InvalidOperation, msg))
        });
        let error = |e: minijinja::Error| TrainError::Tokenizer(format!("chat template: {e:#}"));
        env.add_template("chat", template).map_err(error)?;
        env.get_template("chat")
            .map_err(error)?
            .render(context! {
                messages => messages,
                add_generation_prompt => true,
                bos_token => self.bos_token.clone().unwrap_or_default(),
                eos_token => self.eos_token.clone().unwrap_or_default(),
            })
            .map_err(error)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tokenizer::CHATML_TEMPLATE;

    #[test]
    fn chatml_and_plain() {
        let f = PromptFormat {
            chat_template: Some(CHATML_TEMPLATE.into()),
            system_prompt: Some("Be brief.".into()),
            ..Default::default()
        };
        assert_eq!(
            f.render("1+1?").unwrap(),
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n1+1?<|im_end|>\n<|im_start|>assistant\n"
        );
        assert_eq!(PromptFormat::default().render("1+1?").unwrap(), "1+1?\n");
    }

    /// transformers >= 4.5x saves the template as `chat_template.jinja`, which wins over
    /// `tokenizer_config.json`'s on loading; the special tokens still come from the config.
    #[test]
    fn a_chat_template_file_wins() {
        let dir = std::env::temp_dir().join(format!("flashgrpo-chat-template-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let config = serde_json::json!({"chat_template": "old {{ messages[0]['content'] }}", "eos_token": "<e>"});
        std::fs::write(dir.join("tokenizer_config.json"), config.to_string()).unwrap();
        let f = PromptFormat::from_tokenizer_dir(&dir, None).unwrap();
        assert_eq!(f.render("q").unwrap(), "old q");
        std::fs::write(dir.join("chat_template.jinja"), "new {{ messages[-1]['content'] }}{{ eos_token }}").unwrap();
        let f = PromptFormat::from_tokenizer_dir(&dir, None).unwrap();
        assert_eq!(f.render("q").unwrap(), "new q<e>");
        std::fs::remove_file(dir.join("tokenizer_config.json")).unwrap();
        assert_eq!(PromptFormat::from_tokenizer_dir(&dir, None).unwrap().render("q").unwrap(), "new q");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
