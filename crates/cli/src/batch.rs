//! The inputs of one loss call, owned, read from named tensors (the interop contract of
//! `flashgrpo loss`) or generated, with every shape checked against the logits'.

use anyhow::{bail, Result};
use clap::ValueEnum;
use flashgrpo_kernels::{IsRatio, Loss, LossOptions, LossSpec, PolicyInputs, Rows};
use serde::{Deserialize, Serialize};

use crate::tensor_io::{expect_shape, LogitsData, TensorFile};

/// The ops of LOSSES.md.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum OpName {
    #[default]
    Grpo,
    #[value(name = "cross_entropy", alias = "cross-entropy")]
    CrossEntropy,
    Entropy,
    Logprob,
}

/// Every tensor name `flashgrpo loss` reads; others are reported and ignored.
pub const INPUT_NAMES: &[&str] = &["logits", "targets", "mask", "advantages", "old_logp", "ref_logp", "is_ratio"];

/// Owned inputs; [`Batch::spec`] borrows them for the kernels.
pub struct Batch {
    pub op: OpName,
    pub logits: LogitsData,
    pub batch: usize,
    pub seq_len: usize,
    pub vocab: usize,
    pub targets: Option<Vec<i64>>,
    pub mask: Option<Vec<f32>>,
    pub advantages: Vec<f32>,
    pub old_logp: Option<Vec<f32>>,
    pub ref_logp: Option<Vec<f32>>,
    pub is_ratio: Option<(Vec<f32>, bool)>,
}

impl Batch {
    /// Reads the inputs of `op` from `file`, checking each shape against the logits'.
    pub fn read(file: &TensorFile, op: OpName) -> Result<Self> {
        for name in file.names() {
            if !INPUT_NAMES.contains(&name.as_str()) {
                eprintln!(
                    "warning: ignoring tensor `{name}`: not an input of `flashgrpo loss` (inputs: {})",
                    INPUT_NAMES.join(", ")
                );
            }
        }
        let (logits, shape) = file.logits("logits")?;
        let [batch, seq_len, vocab] = shape[..] else {
            bail!("`logits` has shape {shape:?}; expected three dimensions [B, T, V]");
        };
        let bt = [batch, seq_len];
        let per_row = format!("`logits` has shape {shape:?}");
        let mut b = Batch {
            op,
            logits,
            batch,
            seq_len,
            vocab,
            targets: None,
            mask: None,
            advantages: Vec::new(),
            old_logp: None,
            ref_logp: None,
            is_ratio: None,
        };
        if op != OpName::Entropy || file.shape("targets").is_some() {
            let (targets, s) = file.ids("targets", "the chosen token of each row, [B, T]")?;
            expect_shape("targets", &s, &bt, &per_row)?;
            b.targets = Some(targets);
        }
        if let Some((mask, s)) = file.mask("mask")? {
            expect_shape("mask", &s, &bt, &per_row)?;
            b.mask = Some(mask);
        }
        if op == OpName::Grpo {
            let Some((adv, s)) = file.floats("advantages")? else {
                bail!("missing tensor `advantages` (GRPO needs one advantage per sequence, [B] = [{batch}]); it holds: {}", file.names().join(", "));
            };
            if s != [batch] && s != [batch, 1] {
                expect_shape("advantages", &s, &[batch], &format!("{per_row} (one advantage per sequence)"))?;
            }
            b.advantages = adv;
            for (name, slot) in [("old_logp", &mut b.old_logp), ("ref_logp", &mut b.ref_logp)] {
                if let Some((v, s)) = file.floats(name)? {
                    expect_shape(name, &s, &bt, &per_row)?;
                    *slot = Some(v);
                }
            }
            if let Some((v, s)) = file.floats("is_ratio")? {
                let per_sequence = s == [batch] || s == [batch, 1];
                if !per_sequence {
                    expect_shape("is_ratio", &s, &bt, &format!("{per_row} (or [B] = [{batch}] per sequence)"))?;
                }
                b.is_ratio = Some((v, per_sequence));
            }
        }
        Ok(b)
    }

    pub fn spec<'a>(&'a self, options: &'a LossOptions) -> LossSpec<'a> {
        let loss = match self.op {
            OpName::Grpo => Loss::Grpo(PolicyInputs {
                advantages: &self.advantages,
                old_logp: self.old_logp.as_deref(),
                ref_logp: self.ref_logp.as_deref(),
                is_ratio: self.is_ratio.as_ref().map(|(v, per_sequence)| {
                    if *per_sequence {
                        IsRatio::PerSequence(v)
                    } else {
                        IsRatio::PerToken(v)
                    }
                }),
            }),
            OpName::CrossEntropy => Loss::CrossEntropy,
            OpName::Entropy => Loss::Entropy,
            OpName::Logprob => Loss::Logprob,
        };
        LossSpec {
            loss,
            rows: Rows {
                batch: self.batch,
                seq_len: self.seq_len,
                vocab: self.vocab,
                targets: self.targets.as_deref(),
                mask: self.mask.as_deref(),
            },
            options,
            batch_shard: None,
        }
    }
}
