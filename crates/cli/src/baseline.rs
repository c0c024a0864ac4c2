//! The baseline of `flashgrpo bench`: the same losses written the way a Rust user writes them
//! today, with candle tensor ops and candle autograd on materialised logits (our stand-in for the
//! original system's pure-JAX baseline). It materialises the `[N, V]` log-softmax and several
//! temporaries of that size, which is the cost the fused kernels remove.

use anyhow::{Context, Result};
use candle_core::{DType, Tensor, Var};
use flashgrpo_candle::composed::ComposedLoss;
use flashgrpo_candle::LossInputs;
use flashgrpo_kernels::{ChunkBudget, LossSpec};

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

/// The baseline's inputs: where the logits come from, and the composed loss.
pub struct Inputs {
    source: Source,
    composed: ComposedLoss,
    rows: usize,
    vocab: usize,
}

impl Inputs {
    pub fn new(spec: LossSpec<'_>, source: Source) -> Result<Self> {
        let inputs = LossInputs::from_spec(&spec, ChunkBudget::default());
        let (rows, vocab) = (spec.rows.len(), spec.rows.vocab);
        Ok(Self { source, composed: ComposedLoss::new(&inputs, vocab)?, rows, vocab })
    }

    fn loss(&self) -> Result<Tensor> {
        Ok(self.composed.loss(&self.source.logits_tensor(self.rows, self.vocab)?)?)
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
                sampling_logp: None,
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
            (
                Loss::CrossEntropy(Default::default()),
                LossOptions { label_smoothing: 0.1, z_loss: 1e-3, ..Default::default() },
            ),
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
