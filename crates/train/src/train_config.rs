//! The configuration of `flashgrpo train`: one YAML file with a section per concern, every key
//! with a default, unknown keys rejected (a typo is an error that names it, never a silent
//! default).

use std::path::PathBuf;

use candle_core::DType;
use flashgrpo_kernels::{Bf16Choice, DType as ElementType};
use serde::{Deserialize, Serialize};

use crate::data::TaskSection;
use crate::error::{Result, TrainError};
use crate::grpo::GrpoConfig;
use crate::head_loss::LossConfig;
use crate::model::Qwen2Config;
use crate::parallel::ParallelConfig;
use crate::sft::SftConfig;

/// Which training algorithm.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Algo {
    Sft,
    #[default]
    Grpo,
}

/// The candle dtype of a model's parameters (`model.dtype`): the kernels' [`ElementType`] by
/// the same names; f32 or bf16 (the model layers have no f16 path).
pub fn parameter_dtype(dtype: ElementType) -> Result<DType> {
    match dtype {
        ElementType::F32 => Ok(DType::F32),
        ElementType::BF16 => Ok(DType::BF16),
        ElementType::F16 => Err(TrainError::Config {
            origin: "model.dtype".into(),
            why: "f16 parameters are not supported; use f32 or bf16".into(),
        }),
    }
}

/// `model:` a Hugging Face directory, or (no `path`) a new randomly initialised Qwen2 of the
/// given size, its vocabulary that of the tokenizer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ModelSection {
    pub path: Option<PathBuf>,
    /// Parameters are converted to this dtype (bf16: f32 master weights in the optimiser).
    pub dtype: ElementType,
    /// With `dtype: bf16`, how the layers' and the head's products run (`auto`, `rounded`, or a
    /// way's name: [`Bf16Choice`]), as `FLASHGRPO_BF16_PRODUCTS` for the whole process.
    pub bf16_products: Bf16Choice,
    pub hidden_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    /// `null`: 3 x hidden_size.
    pub intermediate_size: Option<usize>,
    pub max_positions: usize,
    pub rope_theta: f64,
    pub tie_embeddings: bool,
    /// Rows of a new model's embedding and lm_head: the tokenizer's tokens, padded past them to
    /// this many (as Qwen2.5 has 151936 rows for 151665 tokens); `null`: exactly the tokenizer's.
    /// Default 4096: the built-in task's tokenizer has about 410 tokens, and with a head that small
    /// the loss is a few percent of a training step, which no real language model resembles; at
    /// 4096 rows the head is about a third of the model's flops per token, as in Qwen2.5-0.5B
    /// (a quarter), so the built-in run and its A/B exercise the loss as real training does.
    pub vocab_size: Option<usize>,
}

impl Default for ModelSection {
    fn default() -> Self {
        Self {
            path: None,
            dtype: ElementType::F32,
            bf16_products: Bf16Choice::Auto,
            hidden_size: 128,
            num_layers: 2,
            num_heads: 4,
            num_kv_heads: 2,
            intermediate_size: None,
            max_positions: 1024,
            rope_theta: 10_000.0,
            tie_embeddings: true,
            vocab_size: Some(4096),
        }
    }
}

impl ModelSection {
    /// The config of a new model with `vocab_size` tokens.
    pub fn new_config(&self, tokenizer_vocab: usize) -> Result<Qwen2Config> {
        let vocab_size = self.vocab_size.unwrap_or(tokenizer_vocab);
        if vocab_size < tokenizer_vocab {
            return Err(TrainError::Config {
                origin: "model.vocab_size".into(),
                why: format!("{vocab_size} is smaller than the tokenizer's {tokenizer_vocab} tokens"),
            });
        }
        let mut c = Qwen2Config::tiny(vocab_size, self.hidden_size, self.num_layers, self.num_heads, self.num_kv_heads);
        c.intermediate_size = self.intermediate_size.unwrap_or(3 * self.hidden_size);
        c.max_position_embeddings = self.max_positions;
        c.rope_theta = self.rope_theta;
        c.tie_word_embeddings = self.tie_embeddings;
        c.validate("model")?;
        Ok(c)
    }
}

/// `tokenizer:` a `tokenizer.json` (or a directory holding one); without it, the model
/// directory's, or for a new model a byte-level BPE trained on the training text.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TokenizerSection {
    pub path: Option<PathBuf>,
    /// Size of a trained tokenizer (special tokens included).
    pub vocab_size: usize,
}

impl Default for TokenizerSection {
    fn default() -> Self {
        Self { path: None, vocab_size: 1024 }
    }
}

/// `data:` GSM8K-format JSONL files.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DataSection {
    pub path: PathBuf,
    /// Use at most this many training problems.
    pub limit: Option<usize>,
    /// Held-out problems (`null`: no evaluation).
    pub eval_path: Option<PathBuf>,
    pub eval_limit: usize,
}

impl Default for DataSection {
    fn default() -> Self {
        Self {
            path: PathBuf::from("../shared/data/gsm8k/train.jsonl"),
            limit: None,
            eval_path: Some(PathBuf::from("../shared/data/gsm8k/test.jsonl")),
            eval_limit: 500,
        }
    }
}

/// Everything `flashgrpo train` reads.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TrainConfig {
    pub algo: Algo,
    pub seed: u64,
    /// Output directory: metrics, the resolved config, the trained model.
    pub out: PathBuf,
    /// Show progress on stderr: a bar on a terminal, elsewhere a plain line after the first
    /// step, every 30 s and at the end (`crate::progress`).
    pub progress: bool,
    pub task: TaskSection,
    pub model: ModelSection,
    pub tokenizer: TokenizerSection,
    pub data: DataSection,
    /// SFT (`algo: sft`), or the warm start before GRPO (`sft.steps: 0` skips it).
    pub sft: SftConfig,
    pub grpo: GrpoConfig,
    pub loss: LossConfig,
    /// Multi-process training (`mpirun -np K flashgrpo train`): docs/DISTRIBUTED.md.
    pub parallel: ParallelConfig,
}

impl Default for TrainConfig {
    fn default() -> Self {
        Self {
            algo: Algo::default(),
            seed: 0,
            out: PathBuf::from("runs/train"),
            progress: true,
            task: TaskSection::default(),
            model: ModelSection::default(),
            tokenizer: TokenizerSection::default(),
            data: DataSection::default(),
            sft: SftConfig::default(),
            grpo: GrpoConfig::default(),
            loss: LossConfig::default(),
            parallel: ParallelConfig::default(),
        }
    }
}

impl TrainConfig {
    /// Parses a config from a JSON value (what the YAML and `--set`s resolve to).
    pub fn from_value(value: serde_json::Value, origin: &str) -> Result<Self> {
        let config: Self = serde_json::from_value(value)
            .map_err(|e| TrainError::Config { origin: origin.into(), why: e.to_string() })?;
        config.validate()?;
        Ok(config)
    }

    pub fn validate(&self) -> Result<()> {
        let share = self.task.sloppy_teacher_share();
        if !(0.0..=1.0).contains(&share) {
            return Err(TrainError::Config {
                origin: "task.sloppy_teacher".into(),
                why: format!("a share of the warm start's solutions, in [0, 1]; got {share}"),
            });
        }
        parameter_dtype(self.model.dtype)?;
        if self.loss.options.softcap.is_some() {
            // The sampler draws from x / T: a capped loss would score another distribution.
            return Err(TrainError::Config {
                origin: "loss.softcap".into(),
                why: "the trainer's models (Qwen2) have no final logit soft cap, and its sampler applies none; \
                      leave it unset"
                    .into(),
            });
        }
        if self.loss.options.predicted_tokens {
            return Err(TrainError::Config {
                origin: "loss.predicted_tokens".into(),
                why: "an output of the loss ops (`flashgrpo loss`, the Python bindings), which the trainer would \
                      compute and drop; leave it unset"
                    .into(),
            });
        }
        if self.model.path.is_none() {
            // The architecture's checks; the vocabulary is checked against the tokenizer later.
            self.model.new_config(1)?;
        }
        match self.algo {
            Algo::Sft => self.sft.validate(&self.loss)?,
            Algo::Grpo => {
                if self.sft.steps > 0 {
                    let mut warm_start_loss = self.loss.clone();
                    warm_start_loss.options.reduction = flashgrpo_kernels::Reduction::Mean;
                    self.sft.validate(&warm_start_loss)?;
                }
                self.grpo.validate()?;
                if self.grpo.sync_ref_model && self.loss.options.beta == 0.0 {
                    return Err(TrainError::Config {
                        origin: "grpo.sync_ref_model".into(),
                        why: "synchronises the reference model, which only a KL term uses: set loss.beta != 0".into(),
                    });
                }
            }
        }
        Ok(())
    }

    /// What a run may do that its user likely did not mean, printed at its start.
    pub fn warnings(&self) -> Vec<String> {
        let (sampled, scored) = (self.grpo.temperature, self.loss.options.temperature);
        let mut out = Vec::new();
        if self.algo == Algo::Grpo && sampled > 0.0 && sampled != scored {
            out.push(format!(
                "grpo.temperature = {sampled} samples the completions, loss.temperature = {scored} scores them: TRL \
                 uses one temperature for both (set loss.temperature too)"
            ));
        }
        let g = &self.grpo;
        let processed = g.top_k > 0 || g.top_p < 1.0 || g.min_p > 0.0 || g.repetition_penalty != 1.0;
        if self.algo == Algo::Grpo && g.sampling_logp && processed {
            out.push(
                "grpo.sampling_logp hands the loss log-probabilities of softmax(logits / T) before top_k / top_p / \
                 min_p / repetition_penalty, not of the filtered distribution the tokens were drawn from (TRL with \
                 vLLM's processed_logprobs)"
                    .into(),
            );
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sampling_temperature_the_loss_does_not_share_is_warned_of() {
        let mut c = TrainConfig::default();
        assert!(c.warnings().is_empty());
        c.grpo.temperature = 0.7;
        assert!(c.warnings()[0].contains("loss.temperature"));
        c.loss.options.temperature = 0.7;
        assert!(c.warnings().is_empty());
        c.grpo.sampling_logp = true;
        assert!(c.warnings().is_empty());
        c.grpo.min_p = 0.1;
        assert!(c.warnings()[0].contains("processed"), "{:?}", c.warnings());
        assert_eq!(c.grpo.eval_temperature(), 0.7);
    }

    #[test]
    fn a_soft_cap_is_refused() {
        let e = TrainConfig::from_value(serde_json::json!({"loss": {"softcap": 30.0}}), "t.yaml").unwrap_err();
        assert!(e.to_string().contains("loss.softcap"), "{e}");
    }

    #[test]
    fn predicted_tokens_are_refused() {
        let value = serde_json::json!({"loss": {"predicted_tokens": true}});
        let e = TrainConfig::from_value(value, "t.yaml").unwrap_err();
        assert!(e.to_string().contains("loss.predicted_tokens"), "{e}");
    }

    #[test]
    fn unknown_keys_are_named() {
        let e = TrainConfig::from_value(serde_json::json!({"sft": {"stepz": 3}}), "t.yaml").unwrap_err();
        assert!(e.to_string().contains("stepz"), "{e}");
        let e = TrainConfig::from_value(serde_json::json!({"loss": {"betta": 3}}), "t.yaml").unwrap_err();
        assert!(e.to_string().contains("loss.betta"), "{e}");
        let e = TrainConfig::from_value(serde_json::json!({"loss": {"beta": -1}}), "t.yaml").unwrap_err();
        assert!(e.to_string().contains("beta"), "{e}");
    }

    /// TRL's spellings of its sampling and scaling settings: `scale_rewards` as a boolean,
    /// `min_p: null`; out-of-range values named.
    #[test]
    fn trl_sampling_settings() {
        use crate::rewards::ScaleRewards;
        let grpo = |g: serde_json::Value| TrainConfig::from_value(serde_json::json!({ "grpo": g }), "t.yaml");
        assert_eq!(grpo(serde_json::json!({"scale_rewards": true})).unwrap().grpo.scale_rewards, ScaleRewards::Group);
        assert_eq!(grpo(serde_json::json!({"scale_rewards": false})).unwrap().grpo.scale_rewards, ScaleRewards::None);
        assert_eq!(
            grpo(serde_json::json!({"scale_rewards": "batch"})).unwrap().grpo.scale_rewards,
            ScaleRewards::Batch
        );
        let e = grpo(serde_json::json!({"scale_rewards": "sequence"})).unwrap_err().to_string();
        assert!(e.contains("sequence") && e.contains("`group`, `batch`, `none`"), "{e}");
        let c = grpo(serde_json::json!({"min_p": null, "repetition_penalty": 1.1})).unwrap();
        assert_eq!((c.grpo.sampling().min_p, c.grpo.eval_sampling().repetition_penalty), (0.0, 1.1));
        assert_eq!(grpo(serde_json::json!({"min_p": 0.05})).unwrap().grpo.sampling().min_p, 0.05);
        let e = grpo(serde_json::json!({"min_p": 1.5})).unwrap_err().to_string();
        assert!(e.contains("grpo.min_p"), "{e}");
        let e = grpo(serde_json::json!({"repetition_penalty": 0})).unwrap_err().to_string();
        assert!(e.contains("grpo.repetition_penalty"), "{e}");
        let e = grpo(serde_json::json!({"sync_ref_model": true})).unwrap_err().to_string();
        assert!(e.contains("loss.beta"), "{e}");
        let e = grpo(serde_json::json!({"ref_model_mixup_alpha": 1.5})).unwrap_err().to_string();
        assert!(e.contains("ref_model_mixup_alpha"), "{e}");
        // TRL's names for two settings, and both spellings at once refused.
        let c = grpo(serde_json::json!({"num_iterations": 2, "max_completion_length": 40, "num_generations_eval": 3}))
            .unwrap();
        assert_eq!((c.grpo.ppo_epochs, c.grpo.max_new_tokens, c.grpo.eval_samples), (2, 40, 3));
        let e = grpo(serde_json::json!({"num_iterations": 2, "ppo_epochs": 3})).unwrap_err().to_string();
        assert!(e.contains("duplicate field"), "{e}");
    }

    #[test]
    fn round_trips_through_json() {
        let mut c = TrainConfig::default();
        c.loss.options.beta = 0.04;
        c.loss.options.delta = Some(2.0);
        let v = serde_json::to_value(&c).unwrap();
        assert_eq!(v["loss"]["impl"], "fused_linear");
        assert_eq!(TrainConfig::from_value(v, "json").unwrap(), c);
    }
}
