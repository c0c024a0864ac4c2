//! The baseline of `flashgrpo bench`: the same losses written the way a Rust user writes them
//! today, with candle tensor ops and candle autograd on materialised logits (our stand-in for the
//! original system's pure-JAX baseline). It materialises the `[N, V]` log-softmax and several
//! temporaries of that size, which is the cost the fused kernels remove.

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor, Var, D};
use flashgrpo_kernels::{ImportanceSamplingLevel, IsRatio, Loss, LossOptions, LossSpec, LossType, Reduction};

use crate::tensor_io::FloatElement;

/// Where the logits come from: given, or `hidden @ weight^T (+ bias)` (candle matmul).
pub enum Source {
    Logits(Var),
    Linear { hidden: Var, weight: Var, bias: Option<Var> },
}

impl Source {
    pub fn logits<T: FloatElement>(logits: &[T]) -> Result<Self> {
        let n = logits.len();
        Ok(Source::Logits(Var::from_tensor(&T::candle_tensor(logits, (1, n))?)?))
    }

    pub fn linear<T: FloatElement>(hidden: &[T], weight: &[T], bias: Option<&[T]>, hidden_size: usize) -> Result<Self> {
        let h = hidden_size;
        let var = |v: &[T], rows: usize| -> Result<Var> { Ok(Var::from_tensor(&T::candle_tensor(v, (rows, h))?)?) };
        let bias =
            bias.map(|b| -> Result<Var> { Ok(Var::from_tensor(&T::candle_tensor(b, (1, b.len()))?)?) }).transpose()?;
        Ok(Source::Linear { hidden: var(hidden, hidden.len() / h)?, weight: var(weight, weight.len() / h)?, bias })
    }

    /// The `[N, V]` f32 logits (materialised: this is the baseline).
    fn logits_tensor(&self, n: usize, v: usize) -> Result<Tensor> {
        Ok(match self {
            Source::Logits(l) => l.as_tensor().reshape((n, v))?.to_dtype(DType::F32)?,
            Source::Linear { hidden, weight, bias } => {
                let z = hidden.as_tensor().matmul(&weight.as_tensor().t()?)?.to_dtype(DType::F32)?;
                match bias {
                    Some(b) => z.broadcast_add(&b.as_tensor().to_dtype(DType::F32)?)?,
                    None => z,
                }
            }
        })
    }

    /// The variables, in the order of `value_and_grad`'s gradients.
    fn variables(&self) -> Vec<&Var> {
        match self {
            Source::Logits(l) => vec![l],
            Source::Linear { hidden, weight, bias } => {
                [Some(hidden), Some(weight), bias.as_ref()].into_iter().flatten().collect()
            }
        }
    }
}

/// Inputs as candle tensors, built once; each step builds the graph and runs backward.
pub struct Inputs {
    source: Source,
    /// `[N, 1]` u32 (masked rows clamped into range; the mask zeroes them).
    targets: Tensor,
    /// `[N]` f32 0/1.
    mask: Tensor,
    valid_rows: f64,
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
    Ok(Tensor::from_slice(v, v.len(), &Device::Cpu)?)
}

impl Inputs {
    pub fn new(spec: LossSpec<'_>, source: Source) -> Result<Self> {
        let o = spec.options;
        let rows = spec.rows;
        let n = rows.len();
        let unsupported = |what: &str| -> Result<Self> { bail!("the candle baseline does not implement {what}") };
        let mut mask: Vec<f32> = rows.mask.map_or_else(|| vec![1.0; n], <[f32]>::to_vec);
        let targets: Vec<u32> = rows
            .targets
            .unwrap_or_default()
            .iter()
            .map(|&y| if (0..rows.vocab as i64).contains(&y) { y as u32 } else { 0 })
            .collect();
        let kind = match spec.loss {
            Loss::Grpo(p) => {
                if !o.loss_type.is_ppo_family() || o.importance_sampling_level == ImportanceSamplingLevel::Sequence {
                    return unsupported("cispo, sapo or sequence-level importance sampling");
                }
                if o.entropy_coef != 0.0 {
                    return unsupported("the entropy bonus");
                }
                let per_row_adv: Vec<f32> = (0..n).map(|i| p.advantages[i / rows.seq_len]).collect();
                let is_ratio = p.is_ratio.map(|r| match r {
                    IsRatio::PerToken(v) => v.to_vec(),
                    IsRatio::PerSequence(v) => (0..n).map(|i| v[i / rows.seq_len]).collect(),
                });
                Kind::Grpo {
                    advantages: rows_tensor(&per_row_adv)?,
                    old: p.old_logp.map(rows_tensor).transpose()?,
                    reference: p.ref_logp.map(rows_tensor).transpose()?,
                    is_ratio: is_ratio.as_deref().map(rows_tensor).transpose()?,
                }
            }
            Loss::CrossEntropy => {
                for (m, &y) in mask.iter_mut().zip(rows.targets.unwrap_or_default()) {
                    if y == o.ignore_index {
                        *m = 0.0;
                    }
                }
                Kind::CrossEntropy
            }
            Loss::Logprob => Kind::Logprob,
            Loss::Entropy => return unsupported("the entropy op (it has no gradient to time)"),
        };
        let valid_rows = mask.iter().map(|&m| m as f64).sum();
        Ok(Self {
            source,
            targets: Tensor::from_slice(&targets, (n, 1), &Device::Cpu)?,
            mask: rows_tensor(&mask)?,
            valid_rows,
            batch: rows.batch,
            seq_len: rows.seq_len,
            vocab: rows.vocab,
            options: o.clone(),
            kind,
        })
    }

    /// The loss as a scalar tensor, built from the logits variable.
    fn loss(&self) -> Result<Tensor> {
        let o = &self.options;
        let n = self.targets.dims()[0];
        let x = self.source.logits_tensor(n, self.vocab)?.affine(1.0 / o.temperature, 0.0)?;
        let z = x.broadcast_sub(&x.max_keepdim(D::Minus1)?.detach())?;
        let lse_shifted = z.exp()?.sum_keepdim(D::Minus1)?.log()?;
        let log_softmax = z.broadcast_sub(&lse_shifted)?;
        let logp = log_softmax.gather(&self.targets, D::Minus1)?.squeeze(D::Minus1)?;
        let masked_sum = |per: &Tensor| -> Result<Tensor> { Ok((per * &self.mask)?.sum_all()?) };
        let scalar = |t: Tensor, k: f64| -> Result<Tensor> { Ok(t.affine(k, 0.0)?) };
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
                        scalar((per_seq / count)?.sum_all()?, 1.0 / self.batch as f64)
                    }
                    LossType::Bnpo => scalar(masked_sum(&per)?, 1.0 / self.valid_rows.max(1.0)),
                    LossType::DrGrpo => {
                        let mcl = o.max_completion_length.unwrap_or(self.seq_len) as f64;
                        scalar(masked_sum(&per)?, 1.0 / (self.batch as f64 * mcl))
                    }
                    _ => scalar(masked_sum(&per)?, 1.0 / o.num_items.unwrap_or(self.valid_rows).max(1.0)),
                }
            }
        }
    }

    /// One step: the loss and its gradients with respect to the source's variables (the logits,
    /// or hidden, weight and bias).
    pub fn value_and_grad(&self) -> Result<(f64, Vec<Tensor>)> {
        let loss = self.loss()?;
        let grads = loss.backward()?;
        let grads = self
            .source
            .variables()
            .into_iter()
            .map(|v| grads.get(v.as_tensor()).cloned().context("candle returned no gradient for an input"))
            .collect::<Result<Vec<_>>>()?;
        Ok((loss.to_vec0::<f32>()? as f64, grads))
    }
}

#[cfg(test)]
mod tests {
    use flashgrpo_kernels::synthetic::SyntheticSpec;
    use flashgrpo_kernels::{reference, Loss, LossOptions, LossSpec, LossType, PolicyInputs, Rows};

    use super::{Inputs, Source};

    /// The baseline is an implementation too: its value and gradient must be the reference's.
    #[test]
    fn baseline_matches_the_reference() {
        let data = SyntheticSpec {
            batch: 3,
            seq_len: 4,
            vocab: 37,
            seed: 5,
            logit_std: 2.0,
            logp_noise: 0.3,
            mask_fraction: 0.2,
        }
        .generate();
        let logits64: Vec<f64> = data.logits.iter().map(|&x| x as f64).collect();
        let grpo = |()| {
            Loss::Grpo(PolicyInputs {
                advantages: &data.advantages,
                old_logp: Some(&data.old_logp),
                ref_logp: Some(&data.ref_logp),
                is_ratio: None,
            })
        };
        let cases: Vec<(Loss, LossOptions)> = vec![
            (grpo(()), LossOptions { beta: 0.04, epsilon_high: Some(0.28), ..Default::default() }),
            (grpo(()), LossOptions { beta: 0.04, loss_type: LossType::Grpo, temperature: 0.7, ..Default::default() }),
            (
                grpo(()),
                LossOptions {
                    loss_type: LossType::DrGrpo,
                    delta: Some(1.1),
                    use_bias_correction_kl: true,
                    beta: 0.1,
                    ..Default::default()
                },
            ),
            (Loss::CrossEntropy, LossOptions { label_smoothing: 0.1, z_loss: 1e-3, ..Default::default() }),
            (Loss::Logprob, LossOptions::default()),
        ];
        for (loss, options) in cases {
            let spec = LossSpec {
                loss,
                rows: Rows { batch: 3, seq_len: 4, vocab: 37, targets: Some(&data.targets), mask: Some(&data.mask) },
                options: &options,
                batch_shard: None,
            };
            let want = reference::evaluate(spec, &logits64).unwrap();
            let (loss, grads) =
                Inputs::new(spec, Source::logits(&data.logits).unwrap()).unwrap().value_and_grad().unwrap();
            assert!((loss - want.loss).abs() < 1e-5 * want.loss.abs().max(1.0), "{options:?}: {loss} vs {}", want.loss);
            let grad: Vec<f32> = grads[0].flatten_all().unwrap().to_vec1().unwrap();
            let want = want.grad.unwrap();
            let err: f64 = grad.iter().zip(&want).map(|(a, b)| (*a as f64 - b).powi(2)).sum::<f64>().sqrt()
                / want.iter().map(|b| b * b).sum::<f64>().sqrt();
            assert!(err < 1e-5, "{options:?}: gradient error {err}");
        }
    }
}
