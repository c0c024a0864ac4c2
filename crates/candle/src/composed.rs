//! The losses composed from candle ops on materialised logits: what a user writes without
//! flashgrpo (log-softmax, gather, exp, clamp, min, ...), with candle's own autograd. The baseline
//! of the benches and of the training A/B; it materialises several `[N, V]` tensors.

use candle_core::{bail, DType, Device, Result, Tensor, D};
use flashgrpo_kernels::{ImportanceSamplingLevel, KlEstimator, LossOptions, LossType, Reduction};

use crate::loss::{LossInputs, LossKind};

/// A loss's inputs as candle tensors, built once.
pub struct ComposedLoss {
    /// `[N, 1]` u32 (masked rows clamped into range; the mask zeroes them).
    targets: Tensor,
    /// `[N]` f32 0/1.
    mask: Tensor,
    /// The normalisers: this call's, or the whole batch's when it is a micro-batch of one.
    valid_rows: f64,
    norm_batch: f64,
    batch: usize,
    seq_len: usize,
    vocab: usize,
    options: LossOptions,
    kind: Kind,
}

enum Kind {
    Grpo { advantages: Tensor, old: Option<Tensor>, reference: Option<Tensor>, is_ratio: Option<Tensor> },
    CrossEntropy,
    Logprob,
}

fn rows_tensor(v: &[f32]) -> Result<Tensor> {
    Tensor::from_slice(v, v.len(), &Device::Cpu)
}

impl ComposedLoss {
    pub fn new(inputs: &LossInputs, vocab: usize) -> Result<Self> {
        let o = &inputs.options;
        let n = inputs.batch * inputs.seq_len;
        let seq_len = inputs.seq_len.max(1);
        let mut mask: Vec<f32> = inputs.mask.clone().unwrap_or_else(|| vec![1.0; n]);
        let targets_i64 = inputs.targets.clone().unwrap_or_default();
        let targets: Vec<u32> =
            targets_i64.iter().map(|&y| if (0..vocab as i64).contains(&y) { y as u32 } else { 0 }).collect();
        if o.softcap.is_some() {
            bail!("the composed baseline does not apply a soft cap (`softcap`)");
        }
        if o.predicted_tokens {
            bail!("the composed baseline reports no predicted tokens (`predicted_tokens`)");
        }
        if o.entropy_gradient {
            bail!("`entropy_gradient` applies to the entropy op only, which the composed baseline lacks");
        }
        let kind = match &inputs.kind {
            LossKind::Grpo { advantages, old_logp, ref_logp, is_ratio, sampling_logp } => {
                let composed =
                    matches!(o.loss_type, LossType::Grpo | LossType::Bnpo | LossType::DrGrpo | LossType::Dapo);
                if !composed || o.importance_sampling_level == ImportanceSamplingLevel::Sequence {
                    bail!("the composed baseline implements grpo, bnpo, dr_grpo and dapo at token level only");
                }
                let additions = o.loss_agg_mode.is_some()
                    || o.off_policy_mask_threshold.is_some()
                    || o.top_entropy_quantile < 1.0
                    || o.clip_ratio_c.is_some()
                    || o.kl_loss_type != KlEstimator::K3
                    || sampling_logp.is_some();
                if additions {
                    bail!("the composed baseline implements none of LOSSES.md's additions (TRL 1.16, verl)");
                }
                if o.entropy_coef != 0.0 {
                    bail!("the composed baseline does not implement the entropy bonus");
                }
                let per_row_adv: Vec<f32> = (0..n).map(|i| advantages[i / seq_len]).collect();
                let is_ratio = is_ratio.as_ref().map(|(v, per_sequence)| {
                    if *per_sequence {
                        (0..n).map(|i| v[i / seq_len]).collect()
                    } else {
                        v.clone()
                    }
                });
                Kind::Grpo {
                    advantages: rows_tensor(&per_row_adv)?,
                    old: old_logp.as_deref().map(rows_tensor).transpose()?,
                    reference: ref_logp.as_deref().map(rows_tensor).transpose()?,
                    is_ratio: is_ratio.as_deref().map(rows_tensor).transpose()?,
                }
            }
            LossKind::CrossEntropy { class_weights: Some(_) } => {
                bail!("the composed baseline has no class weights; use `loss_from_logits` or `loss_from_hidden`")
            }
            LossKind::CrossEntropy { class_weights: None } => {
                for (m, &y) in mask.iter_mut().zip(&targets_i64) {
                    if y == o.ignore_index {
                        *m = 0.0;
                    }
                }
                Kind::CrossEntropy
            }
            LossKind::Logprob => Kind::Logprob,
            LossKind::Entropy => bail!("the composed baseline has no entropy op"),
        };
        let (norm_batch, valid_rows) = match inputs.batch_shard {
            Some(s) => (s.global_batch as f64, s.global_valid_rows),
            None => (inputs.batch as f64, mask.iter().map(|&m| m as f64).sum()),
        };
        Ok(Self {
            targets: Tensor::from_slice(&targets, (n, 1), &Device::Cpu)?,
            mask: rows_tensor(&mask)?,
            valid_rows,
            norm_batch,
            batch: inputs.batch,
            seq_len: inputs.seq_len,
            vocab,
            options: o.clone(),
            kind,
        })
    }

    /// The loss of `logits` (`[B, T, V]` or `[B*T, V]`, any float dtype; a graph tensor), as a
    /// scalar f32 tensor whose backward is candle's.
    pub fn loss(&self, logits: &Tensor) -> Result<Tensor> {
        let o = &self.options;
        let n = self.targets.dims()[0];
        let x = logits.reshape((n, self.vocab))?.to_dtype(DType::F32)?.affine(1.0 / o.temperature, 0.0)?;
        let z = x.broadcast_sub(&x.max_keepdim(D::Minus1)?.detach())?;
        let lse_shifted = z.exp()?.sum_keepdim(D::Minus1)?.log()?;
        let log_softmax = z.broadcast_sub(&lse_shifted)?;
        let logp = log_softmax.gather(&self.targets, D::Minus1)?.squeeze(D::Minus1)?;
        let masked_sum = |per: &Tensor| -> Result<Tensor> { (per * &self.mask)?.sum_all() };
        let scalar = |t: Tensor, k: f64| -> Result<Tensor> { t.affine(k, 0.0) };
        match &self.kind {
            Kind::Logprob => masked_sum(&logp),
            Kind::CrossEntropy => {
                let s = o.label_smoothing;
                let mut per = logp.neg()?.affine(1.0 - s, 0.0)?;
                if s != 0.0 {
                    let smooth = log_softmax.mean_keepdim(D::Minus1)?.squeeze(D::Minus1)?.neg()?;
                    per = (per + smooth.affine(s, 0.0)?)?;
                }
                if o.z_loss != 0.0 {
                    let lse = (x.max_keepdim(D::Minus1)?.detach() + lse_shifted)?.squeeze(D::Minus1)?;
                    per = (per + lse.sqr()?.affine(o.z_loss, 0.0)?)?;
                }
                let total = masked_sum(&per)?;
                match o.reduction {
                    Reduction::Mean => scalar(total, 1.0 / self.valid_rows.max(1.0)),
                    Reduction::Sum | Reduction::None => Ok(total),
                }
            }
            Kind::Grpo { advantages, old, reference, is_ratio } => {
                let old = old.clone().unwrap_or_else(|| logp.detach());
                let ratio = (&logp - &old)?.exp()?;
                let clipped = ratio.clamp(1.0 - o.epsilon_low, 1.0 + o.epsilon_high())?;
                let unclipped = match o.delta {
                    Some(d) => ratio.clamp(f64::MIN, d)?,
                    None => ratio.clone(),
                };
                let mut per = (&unclipped * advantages)?.minimum(&(&clipped * advantages)?)?.neg()?;
                if let Some(k) = is_ratio {
                    per = (per * k)?;
                }
                if let (Some(r), true) = (reference, o.beta != 0.0) {
                    let d = (r - &logp)?;
                    let mut kl = ((d.exp()? - &d)? - 1.0)?;
                    if o.use_bias_correction_kl {
                        kl = (kl * &ratio)?;
                    }
                    per = (per + kl.affine(o.beta, 0.0)?)?;
                }
                match o.loss_type {
                    LossType::Grpo => {
                        let shape = (self.batch, self.seq_len);
                        let per_seq = (per * &self.mask)?.reshape(shape)?.sum(D::Minus1)?;
                        let count = self.mask.reshape(shape)?.sum(D::Minus1)?.clamp(1.0, f64::MAX)?;
                        scalar((per_seq / count)?.sum_all()?, 1.0 / self.norm_batch)
                    }
                    LossType::Bnpo => scalar(masked_sum(&per)?, 1.0 / self.valid_rows.max(1.0)),
                    LossType::DrGrpo => {
                        let mcl = o.max_completion_length.unwrap_or(self.seq_len) as f64;
                        scalar(masked_sum(&per)?, 1.0 / (self.norm_batch * mcl))
                    }
                    _ => scalar(masked_sum(&per)?, 1.0 / o.num_items.unwrap_or(self.valid_rows).max(1.0)),
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use flashgrpo_kernels::ChunkBudget;

    use super::*;

    /// The baseline refuses what it does not compose rather than computing another loss:
    /// `clip_cov` (verl's covariance-selected cut) and `luspo` are PPO-family types it lacks.
    #[test]
    fn loss_types_it_does_not_compose_are_refused() {
        for loss_type in [LossType::ClipCov, LossType::Luspo, LossType::Cispo] {
            let inputs = LossInputs {
                kind: LossKind::Grpo {
                    advantages: vec![1.0],
                    old_logp: None,
                    ref_logp: None,
                    is_ratio: None,
                    sampling_logp: None,
                },
                batch: 1,
                seq_len: 2,
                targets: Some(vec![0, 1]),
                mask: None,
                options: LossOptions { loss_type, ..Default::default() },
                budget: ChunkBudget::default(),
                batch_shard: None,
            };
            let err = ComposedLoss::new(&inputs, 3).err().expect("refused").to_string();
            assert!(err.contains("composed baseline"), "{err}");
        }
    }

    /// A soft cap, which the composed ops do not apply, is refused for every loss.
    #[test]
    fn a_soft_cap_is_refused() {
        let inputs = LossInputs {
            kind: LossKind::CrossEntropy { class_weights: None },
            batch: 1,
            seq_len: 2,
            targets: Some(vec![0, 1]),
            mask: None,
            options: LossOptions { softcap: Some(30.0), ..Default::default() },
            budget: ChunkBudget::default(),
            batch_shard: None,
        };
        let err = ComposedLoss::new(&inputs, 3).err().expect("refused").to_string();
        assert!(err.contains("soft cap"), "{err}");
    }
}
