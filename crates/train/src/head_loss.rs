//! The loss at the language-model head, three ways (`loss.impl`): `fused_linear` (from the hidden
//! states and the lm_head, no `[N, V]` tensor), `fused` (candle's matmul materialises the logits,
//! then our kernel), and `baseline` (materialised logits and the loss composed from candle ops with
//! candle's autograd: what a Rust user writes without flashgrpo). All three compute the same
//! numbers; the trainer's A/B compares their time and memory.

use std::sync::Arc;

use candle_core::{Result, Tensor};
use flashgrpo_candle::composed::ComposedLoss;
use flashgrpo_candle::{loss_from_hidden, loss_from_logits, LossInputs, LossTensors};
use flashgrpo_kernels::{ChunkBudget, LossOptions};
use serde::de::Error as _;
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use serde_json::{Map, Value};

use crate::model::Qwen2;

/// How the head's loss is computed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LossImpl {
    Baseline,
    Fused,
    #[default]
    FusedLinear,
}

impl LossImpl {
    pub fn name(self) -> &'static str {
        match self {
            Self::Baseline => "baseline",
            Self::Fused => "fused",
            Self::FusedLinear => "fused_linear",
        }
    }
}

/// The `loss:` section of a training config: the implementation, the fused-linear memory budget,
/// and every option of LOSSES.md under its own name (`loss.beta`, `loss.loss_type`, ...).
#[derive(Debug, Clone, PartialEq)]
pub struct LossConfig {
    pub implementation: LossImpl,
    pub chunk_memory_mb: usize,
    pub options: LossOptions,
}

impl Default for LossConfig {
    fn default() -> Self {
        Self {
            implementation: LossImpl::default(),
            chunk_memory_mb: ChunkBudget::DEFAULT_MB,
            options: LossOptions::default(),
        }
    }
}

impl LossConfig {
    pub fn budget(&self) -> ChunkBudget {
        ChunkBudget::from_mb(self.chunk_memory_mb)
    }
}

impl Serialize for LossConfig {
    fn serialize<S: Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        let mut map = Map::new();
        map.insert("impl".into(), Value::from(self.implementation.name()));
        map.insert("chunk_memory_mb".into(), Value::from(self.chunk_memory_mb));
        if let Value::Object(options) = serde_json::to_value(&self.options).map_err(serde::ser::Error::custom)? {
            map.extend(options);
        }
        map.serialize(s)
    }
}

impl<'de> Deserialize<'de> for LossConfig {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        let map = Map::<String, Value>::deserialize(d)?;
        let mut config = LossConfig::default();
        let mut options = Map::new();
        for (key, value) in map {
            match key.as_str() {
                "impl" => config.implementation = serde_json::from_value(value).map_err(D::Error::custom)?,
                "chunk_memory_mb" => {
                    config.chunk_memory_mb = serde_json::from_value(value).map_err(D::Error::custom)?
                }
                k if LossOptions::NAMES.contains(&k) => {
                    // `delta: none` reads as unset, as in Python; `reduction: none` is a value.
                    let unset = k != "reduction" && value.as_str().is_some_and(|s| s.eq_ignore_ascii_case("none"));
                    options.insert(key, if unset { Value::Null } else { value });
                }
                _ => {
                    return Err(D::Error::custom(format!(
                        "unknown key `loss.{key}`; valid keys are impl, chunk_memory_mb and the loss options {}",
                        LossOptions::NAMES.join(", ")
                    )))
                }
            }
        }
        config.options = serde_json::from_value(Value::Object(options)).map_err(D::Error::custom)?;
        config.options.validate().map_err(D::Error::custom)?;
        if config.chunk_memory_mb == 0 {
            return Err(D::Error::custom("loss.chunk_memory_mb must be positive"));
        }
        Ok(config)
    }
}

/// The head's loss: the differentiable scalar, and the per-token outputs where the
/// implementation gives them (the composed baseline gives only the loss).
pub struct HeadLoss {
    pub loss: Tensor,
    pub outputs: Option<LossTensors>,
}

/// The loss of `hidden [B, T, H]` under `model`'s lm_head. Gradients flow to whatever of hidden
/// and the lm_head tracks its graph.
pub fn head_loss(
    model: &Qwen2,
    hidden: &Tensor,
    inputs: &Arc<LossInputs>,
    implementation: LossImpl,
    track_head: bool,
) -> Result<HeadLoss> {
    let weight = model.lm_head().as_tensor();
    let weight = if track_head { weight.clone() } else { weight.detach() };
    let logits = || -> Result<Tensor> {
        let (b, t, h) = hidden.dims3()?;
        hidden.reshape((b * t, h))?.matmul(&weight.t()?)?.reshape((b, t, weight.dim(0)?))
    };
    Ok(match implementation {
        LossImpl::FusedLinear => {
            let out = loss_from_hidden(hidden, &weight, None, inputs)?;
            HeadLoss { loss: out.loss.clone(), outputs: Some(out) }
        }
        LossImpl::Fused => {
            let out = loss_from_logits(&logits()?, inputs)?;
            HeadLoss { loss: out.loss.clone(), outputs: Some(out) }
        }
        LossImpl::Baseline => {
            let composed = ComposedLoss::new(inputs, weight.dim(0)?)?;
            HeadLoss { loss: composed.loss(&logits()?)?, outputs: None }
        }
    })
}
