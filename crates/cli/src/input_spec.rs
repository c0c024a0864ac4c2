//! The inputs of `gradcheck` and `bench`: seeded synthetic batches (logits with a realistic
//! spread, old/ref log-probs near the true ones, normal advantages, a masked fraction), or logits
//! and other inputs from a safetensors file.

use std::path::PathBuf;

use anyhow::{bail, Result};
use flashgrpo_kernels::synthetic::{Rng, SyntheticSpec};
use flashgrpo_kernels::LossOptions;
use half::{bf16, f16};
use serde::{Deserialize, Serialize};

use crate::batch::{Batch, OpName};
use crate::tensor_io::{expect_shape, LogitsData, TensorFile};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum DTypeName {
    #[default]
    F32,
    Bf16,
    F16,
}

/// Which op, which shape, and how its inputs are made.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct InputSpec {
    pub op: OpName,
    pub batch: usize,
    pub seq_len: usize,
    pub vocab: usize,
    pub dtype: DTypeName,
    pub seed: u64,
    /// Logits are `N(0, logit_std^2)`.
    pub logit_std: f64,
    /// Old / reference log-probs: the true ones plus `N(0, logp_noise^2)`.
    pub logp_noise: f64,
    /// Probability that a row is masked (the first row of each sequence never is).
    pub mask_fraction: f64,
    /// Cross-entropy: probability that a target is replaced by `ignore_index`.
    pub ignore_fraction: f64,
    /// GRPO: pass `old_logp` (off-policy) rather than none (on-policy).
    pub with_old_logp: bool,
    /// GRPO: pass `ref_logp` (required when beta != 0).
    pub with_ref_logp: bool,
    /// Read `logits [B,T,V]` (and any other inputs present) from this safetensors file instead;
    /// the shape comes from the file, missing inputs are generated from the seed.
    pub logits_file: Option<PathBuf>,
}

impl Default for InputSpec {
    fn default() -> Self {
        Self {
            op: OpName::Grpo,
            batch: 1,
            seq_len: 129,
            vocab: 151_936,
            dtype: DTypeName::F32,
            seed: 0,
            logit_std: 2.5,
            logp_noise: 0.3,
            mask_fraction: 0.1,
            ignore_fraction: 0.0,
            with_old_logp: true,
            with_ref_logp: true,
            logits_file: None,
        }
    }
}

impl InputSpec {
    /// The batch: generated, or logits (and whatever else is there) from a file.
    pub fn build(&self, options: &LossOptions) -> Result<Batch> {
        let cfg = self;
        let mut spec = SyntheticSpec {
            batch: cfg.batch,
            seq_len: cfg.seq_len,
            vocab: cfg.vocab,
            seed: cfg.seed,
            logit_std: cfg.logit_std,
            logp_noise: cfg.logp_noise,
            mask_fraction: cfg.mask_fraction,
        };
        let mut rng = Rng::new(cfg.seed ^ 0x5EED);
        let (generated, file) = match &cfg.logits_file {
            None => (spec.generate(), None),
            Some(path) => {
                let file = TensorFile::read(path)?;
                let (logits, shape) = file.logits("logits")?;
                let [b, t, v] = shape[..] else {
                    bail!("`logits` in {} has shape {shape:?}; expected [B, T, V]", path.display())
                };
                (spec.batch, spec.seq_len, spec.vocab) = (b, t, v);
                let f32_logits = logits.to_f64().into_iter().map(|x| x as f32).collect();
                (spec.complete(f32_logits, &mut rng), Some((file, logits)))
            }
        };
        let mut targets = generated.targets;
        if cfg.op == OpName::CrossEntropy {
            for y in targets.iter_mut() {
                if rng.uniform() < cfg.ignore_fraction {
                    *y = options.ignore_index;
                }
            }
        }
        let grpo = cfg.op == OpName::Grpo;
        let mut batch = Batch {
            op: cfg.op,
            logits: match cfg.dtype {
                DTypeName::F32 => LogitsData::F32(generated.logits),
                DTypeName::Bf16 => LogitsData::BF16(generated.logits.iter().map(|&x| bf16::from_f32(x)).collect()),
                DTypeName::F16 => LogitsData::F16(generated.logits.iter().map(|&x| f16::from_f32(x)).collect()),
            },
            batch: spec.batch,
            seq_len: spec.seq_len,
            vocab: spec.vocab,
            targets: Some(targets),
            mask: Some(generated.mask),
            advantages: if grpo { generated.advantages } else { Vec::new() },
            old_logp: (grpo && cfg.with_old_logp).then_some(generated.old_logp),
            ref_logp: (grpo && cfg.with_ref_logp).then_some(generated.ref_logp),
            is_ratio: None,
        };
        if let Some((file, logits)) = file {
            batch.logits = logits;
            overlay_file_inputs(&mut batch, &file)?;
        }
        Ok(batch)
    }
}

/// Replaces generated inputs by those the file holds, each checked against the logits' shape.
fn overlay_file_inputs(batch: &mut Batch, file: &TensorFile) -> Result<()> {
    let bt = [batch.batch, batch.seq_len];
    let because = format!("`logits` has shape [{}, {}, {}]", batch.batch, batch.seq_len, batch.vocab);
    if file.shape("targets").is_some() {
        let (t, s) = file.ids("targets", "")?;
        expect_shape("targets", &s, &bt, &because)?;
        batch.targets = Some(t);
    }
    if let Some((m, s)) = file.mask("mask")? {
        expect_shape("mask", &s, &bt, &because)?;
        batch.mask = Some(m);
    }
    if batch.op == OpName::Grpo {
        if let Some((a, s)) = file.floats("advantages")? {
            expect_shape("advantages", &s, &[batch.batch], &because)?;
            batch.advantages = a;
        }
        for (name, slot) in [("old_logp", &mut batch.old_logp), ("ref_logp", &mut batch.ref_logp)] {
            if let Some((v, s)) = file.floats(name)? {
                expect_shape(name, &s, &bt, &because)?;
                *slot = Some(v);
            }
        }
    }
    Ok(())
}
