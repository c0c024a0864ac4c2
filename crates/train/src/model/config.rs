//! The Qwen2 configuration, as Hugging Face's `config.json` writes it (Qwen2 and Qwen2.5).

use serde::{Deserialize, Serialize};

use crate::error::TrainError;

/// A Qwen2 / Qwen2.5 `config.json`. Unknown keys are kept through a round trip in `extra`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Qwen2Config {
    #[serde(default)]
    pub architectures: Vec<String>,
    #[serde(default = "default_model_type")]
    pub model_type: String,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    /// Absent: as many as the attention heads (transformers' default); [`Qwen2Config::resolve`]
    /// fills it in.
    #[serde(default)]
    pub num_key_value_heads: usize,
    /// Newer configs give it; Qwen2's is `hidden_size / num_attention_heads`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub head_dim: Option<usize>,
    pub max_position_embeddings: usize,
    #[serde(default = "default_rope_theta")]
    pub rope_theta: f64,
    #[serde(default = "default_rms_norm_eps")]
    pub rms_norm_eps: f64,
    #[serde(default)]
    pub tie_word_embeddings: bool,
    #[serde(default = "default_act")]
    pub hidden_act: String,
    #[serde(default = "default_initializer_range")]
    pub initializer_range: f64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bos_token_id: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub eos_token_id: Option<serde_json::Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub torch_dtype: Option<String>,
    #[serde(default)]
    pub use_sliding_window: bool,
    /// Unused (no sliding window), kept for other tools that require them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sliding_window: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_window_layers: Option<usize>,
    #[serde(flatten)]
    pub extra: serde_json::Map<String, serde_json::Value>,
}

/// Qwen2 / Qwen2.5 (`Qwen2ForCausalLM`), from a `config.json`'s two fields: checked before the
/// rest is read, so that another model's config is named as such rather than by the first of its
/// fields this one lacks or does not run.
pub fn check_architecture(model_type: &str, architectures: &[String], source: &str) -> Result<(), TrainError> {
    let arch_ok = architectures.is_empty() || architectures.iter().any(|a| a == "Qwen2ForCausalLM");
    if model_type != "qwen2" || !arch_ok {
        return Err(TrainError::Config {
            origin: source.to_string(),
            why: format!(
                "unsupported architecture (model_type `{model_type}`, architectures {architectures:?}); flashgrpo runs \
                 Qwen2 / Qwen2.5 (`Qwen2ForCausalLM`)"
            ),
        });
    }
    Ok(())
}

fn default_model_type() -> String {
    "qwen2".into()
}
fn default_rope_theta() -> f64 {
    10_000.0
}
fn default_rms_norm_eps() -> f64 {
    1e-6
}
fn default_act() -> String {
    "silu".into()
}
fn default_initializer_range() -> f64 {
    0.02
}

impl Qwen2Config {
    /// A small configuration for tests and for models trained from scratch.
    pub fn tiny(vocab_size: usize, hidden_size: usize, layers: usize, heads: usize, kv_heads: usize) -> Self {
        Self {
            architectures: vec!["Qwen2ForCausalLM".into()],
            model_type: "qwen2".into(),
            vocab_size,
            hidden_size,
            intermediate_size: hidden_size * 3,
            num_hidden_layers: layers,
            num_attention_heads: heads,
            num_key_value_heads: kv_heads,
            head_dim: None,
            max_position_embeddings: 2048,
            rope_theta: 10_000.0,
            rms_norm_eps: 1e-6,
            tie_word_embeddings: true,
            hidden_act: "silu".into(),
            initializer_range: 0.02,
            bos_token_id: None,
            eos_token_id: None,
            torch_dtype: Some("float32".into()),
            use_sliding_window: false,
            sliding_window: Some(2048),
            max_window_layers: Some(layers),
            extra: serde_json::Map::new(),
        }
    }

    pub fn head_dim(&self) -> usize {
        self.head_dim.unwrap_or(self.hidden_size / self.num_attention_heads.max(1))
    }

    /// The end-of-sequence token ids the config names (one id or a list).
    pub fn eos_token_ids(&self) -> Vec<u32> {
        match &self.eos_token_id {
            Some(serde_json::Value::Number(n)) => n.as_u64().map(|v| vec![v as u32]).unwrap_or_default(),
            Some(serde_json::Value::Array(a)) => a.iter().filter_map(|v| v.as_u64().map(|v| v as u32)).collect(),
            _ => Vec::new(),
        }
    }

    /// A `config.json` as this implementation runs it: the architecture checked first, a
    /// quantized checkpoint refused, `num_key_value_heads` filled in where absent, what newer
    /// files nest read (transformers 5 writes `rope_parameters: {rope_theta, rope_type}` instead
    /// of a top-level `rope_theta`), RoPE scaling refused; then [`Qwen2Config::validate`].
    pub fn resolve(&mut self, source: &str) -> Result<(), TrainError> {
        let bad = |why: String| Err(TrainError::Config { origin: source.to_string(), why });
        check_architecture(&self.model_type, &self.architectures, source)?;
        if self.extra.get("quantization_config").is_some_and(|q| !q.is_null()) {
            return bad(
                "quantized checkpoints (`quantization_config`) are not supported: use the unquantized model".into()
            );
        }
        if self.num_key_value_heads == 0 {
            self.num_key_value_heads = self.num_attention_heads;
        }
        if let Some(rope) = self.extra.get("rope_parameters").and_then(|r| r.as_object()) {
            if let Some(theta) = rope.get("rope_theta").and_then(|t| t.as_f64()) {
                self.rope_theta = theta;
            }
            if let Some(kind) = rope.get("rope_type").and_then(|t| t.as_str()).filter(|k| *k != "default") {
                return bad(format!("rope_type `{kind}` is not supported (only the default rotary embedding)"));
            }
        }
        if let Some(scaling) = self.extra.get("rope_scaling").filter(|s| !s.is_null()) {
            let kind = scaling.get("rope_type").or_else(|| scaling.get("type")).and_then(|t| t.as_str()).unwrap_or("?");
            if kind != "default" {
                return bad(format!("rope_scaling `{kind}` is not supported (only the default rotary embedding)"));
            }
        }
        self.validate(source)
    }

    /// Rejects what this implementation does not run: other architectures, other activations,
    /// sliding-window attention, inconsistent head counts.
    pub fn validate(&self, source: &str) -> Result<(), TrainError> {
        let bad = |why: String| Err(TrainError::Config { origin: source.to_string(), why });
        check_architecture(&self.model_type, &self.architectures, source)?;
        if self.hidden_act != "silu" {
            return bad(format!("hidden_act `{}` is not supported (Qwen2 uses `silu`)", self.hidden_act));
        }
        if self.use_sliding_window {
            return bad("use_sliding_window = true is not supported".into());
        }
        if self.num_attention_heads == 0
            || self.num_key_value_heads == 0
            || !self.num_attention_heads.is_multiple_of(self.num_key_value_heads)
        {
            return bad(format!(
                "num_attention_heads = {} must be a positive multiple of num_key_value_heads = {}",
                self.num_attention_heads, self.num_key_value_heads
            ));
        }
        if !self.head_dim().is_multiple_of(2) || self.head_dim() == 0 {
            return bad(format!("the head dimension {} must be even", self.head_dim()));
        }
        Ok(())
    }
}
