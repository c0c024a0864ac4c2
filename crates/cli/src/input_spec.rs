//! The inputs of `gradcheck` and `bench`: seeded synthetic batches (logits with a realistic
//! spread, old/ref log-probs near the true ones, normal advantages, a masked fraction), or logits
//! and other inputs from a safetensors file.

use std::path::PathBuf;

use anyhow::{bail, Result};
use flashgrpo_kernels::synthetic::{normal_matrix, Rng, SyntheticRows, SyntheticSpec};
use flashgrpo_kernels::{
    linear_forward, Bf16Choice, ChunkBudget, DType, LinearInputs, Loss, LossOptions, LossSpec, Op, Rows,
};
use half::{bf16, f16};
use serde::{Deserialize, Serialize};

use crate::batch::{Batch, LinearData, Scores};
use crate::tensor_io::{expect_shape, FloatData, TensorFile};

/// Which op, which shape, and how its inputs are made.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct InputSpec {
    pub op: Op,
    pub batch: usize,
    pub seq_len: usize,
    pub vocab: usize,
    pub dtype: DType,
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
    /// GRPO: pass `sampling_logp` (the rollout engine's log-probabilities).
    pub with_sampling_logp: bool,
    /// Cross-entropy: pass class weights `[V]` (in [0.5, 1.5)).
    pub with_class_weights: bool,
    /// GRPO: pass `ref_logp` (required when beta != 0).
    pub with_ref_logp: bool,
    /// Read `logits [B,T,V]` (and any other inputs present) from this safetensors file instead;
    /// the shape comes from the file, missing inputs are generated from the seed.
    pub logits_file: Option<PathBuf>,
    /// Fused-linear mode: generate hidden states `[B,T,H]` and an lm_head `[V,H]` instead of logits.
    pub hidden_size: Option<usize>,
    /// Fused-linear mode: with a bias `[V]`.
    pub with_bias: bool,
    /// Fused-linear: the memory the streaming may use beyond inputs and gradients, in MiB.
    pub chunk_memory_mb: usize,
    /// Fused-linear, bf16: the products' way (`auto`, `rounded`, or a way's name; README).
    pub bf16_products: Bf16Choice,
}

impl Default for InputSpec {
    fn default() -> Self {
        Self {
            op: Op::Grpo,
            batch: 1,
            seq_len: 129,
            vocab: 151_936,
            dtype: DType::F32,
            seed: 0,
            logit_std: 2.5,
            logp_noise: 0.3,
            mask_fraction: 0.1,
            ignore_fraction: 0.0,
            with_old_logp: true,
            with_sampling_logp: false,
            with_class_weights: false,
            with_ref_logp: true,
            logits_file: None,
            hidden_size: None,
            with_bias: false,
            chunk_memory_mb: ChunkBudget::DEFAULT_MB,
            bf16_products: Bf16Choice::Auto,
        }
    }
}

fn cast(values: Vec<f32>, dtype: DType) -> FloatData {
    match dtype {
        DType::F32 => FloatData::F32(values),
        DType::BF16 => FloatData::BF16(values.iter().map(|&x| bf16::from_f32(x)).collect()),
        DType::F16 => FloatData::F16(values.iter().map(|&x| f16::from_f32(x)).collect()),
    }
}

impl InputSpec {
    /// How fused-linear calls run: the memory budget and the bf16 products' way.
    pub fn budget(&self) -> ChunkBudget {
        ChunkBudget::from_mb(self.chunk_memory_mb).with_bf16_products(self.bf16_products)
    }

    fn synthetic(&self) -> SyntheticSpec {
        SyntheticSpec {
            batch: self.batch,
            seq_len: self.seq_len,
            vocab: self.vocab,
            seed: self.seed,
            logit_std: self.logit_std,
            logp_noise: self.logp_noise,
            mask_fraction: self.mask_fraction,
        }
    }

    /// The batch: generated (logits, or hidden states and an lm_head when `hidden_size` is set),
    /// or logits (and whatever else is there) from a file.
    pub fn build(&self, options: &LossOptions) -> Result<Batch> {
        if self.with_class_weights && self.op != Op::CrossEntropy {
            bail!("`with_class_weights` weighs cross-entropy's classes; the `{}` op takes none", self.op.name());
        }
        let mut spec = self.synthetic();
        let mut rng = Rng::new(self.seed ^ 0x5EED);
        let (scores, rows, old_ref, file) = match (&self.logits_file, self.hidden_size) {
            (Some(_), Some(_)) => bail!("`logits_file` and `hidden_size` exclude each other"),
            (None, Some(h)) => {
                let (linear, rows, old_ref) = self.linear(h, &mut rng)?;
                (Scores::Linear(linear), rows, old_ref, None)
            }
            (None, None) => {
                let g = spec.generate();
                let rows = SyntheticRows { targets: g.targets, mask: g.mask, advantages: g.advantages };
                (Scores::Logits(cast(g.logits, self.dtype)), rows, (g.old_logp, g.ref_logp), None)
            }
            (Some(path), None) => {
                let file = TensorFile::read(path)?;
                let (logits, shape) = file.float_tensor("logits")?;
                let [b, t, v] = shape[..] else {
                    bail!("`logits` in {} has shape {shape:?}; expected [B, T, V]", path.display())
                };
                (spec.batch, spec.seq_len, spec.vocab) = (b, t, v);
                let g = spec.complete(logits.to_f64().into_iter().map(|x| x as f32).collect(), &mut rng);
                let rows = SyntheticRows { targets: g.targets, mask: g.mask, advantages: g.advantages };
                (Scores::Logits(logits), rows, (g.old_logp, g.ref_logp), Some(file))
            }
        };
        let mut targets = rows.targets;
        if self.op == Op::CrossEntropy {
            for y in targets.iter_mut() {
                if rng.uniform() < self.ignore_fraction {
                    *y = options.ignore_index;
                }
            }
        }
        let grpo = self.op == Op::Grpo;
        // The sampler's log-probabilities: the old ones with a small deterministic mismatch.
        let sampling_logp = (grpo && self.with_sampling_logp)
            .then(|| old_ref.0.iter().enumerate().map(|(i, &x)| x + 0.05 * (i as f32 * 0.37).sin()).collect());
        let mut batch = Batch {
            op: self.op,
            scores,
            batch: spec.batch,
            seq_len: spec.seq_len,
            vocab: spec.vocab,
            targets: Some(targets),
            mask: Some(rows.mask),
            advantages: if grpo { rows.advantages } else { Vec::new() },
            old_logp: (grpo && self.with_old_logp).then_some(old_ref.0),
            ref_logp: (grpo && self.with_ref_logp).then_some(old_ref.1),
            is_ratio: None,
            sampling_logp,
            class_weights: self
                .with_class_weights
                .then(|| (0..spec.vocab).map(|_| 0.5 + rng.uniform() as f32).collect()),
        };
        if let Some(file) = file {
            overlay_file_inputs(&mut batch, &file)?;
        }
        Ok(batch)
    }

    /// Hidden states `N(0, 1)` and an lm_head `N(0, logit_std^2 / H)` (logits of spread about
    /// `logit_std`), optional bias `N(0, 0.5^2)`; old/ref log-probs near the true ones, which the
    /// fused-linear logprob op computes.
    #[allow(clippy::type_complexity)]
    fn linear(&self, h: usize, rng: &mut Rng) -> Result<(LinearData, SyntheticRows, (Vec<f32>, Vec<f32>))> {
        let spec = self.synthetic();
        let (n, v) = (self.batch * self.seq_len, self.vocab);
        let cast_rounded =
            |x: Vec<f32>| -> Vec<f32> { cast(x, self.dtype).to_f64().into_iter().map(|v| v as f32).collect() };
        let hidden = cast_rounded(normal_matrix(n, h, 1.0, self.seed));
        let weight = cast_rounded(normal_matrix(v, h, self.logit_std / (h as f64).sqrt(), self.seed ^ 0x00E1));
        let bias = self.with_bias.then(|| cast_rounded(normal_matrix(1, v, 0.5, self.seed ^ 0xB1A5)));
        let rows = spec.rows(rng);
        let logp_spec = LossSpec {
            loss: Loss::Logprob,
            rows: Rows { batch: self.batch, seq_len: self.seq_len, vocab: v, targets: Some(&rows.targets), mask: None },
            options: &LossOptions::default(),
            batch_shard: None,
        };
        let inputs = LinearInputs { hidden: &hidden, weight: &weight, bias: bias.as_deref(), hidden_size: h };
        let logp = linear_forward(logp_spec, inputs, self.budget())?.logp.unwrap_or_default();
        let logp: Vec<f64> = logp.iter().map(|&l| l as f64).collect();
        let old_ref = spec.near(&logp, rng);
        let linear = LinearData {
            hidden: cast(hidden, self.dtype),
            weight: cast(weight, self.dtype),
            bias: bias.map(|b| cast(b, self.dtype)),
            hidden_size: h,
        };
        Ok((linear, rows, old_ref))
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
    if let Some(c) = crate::batch::read_class_weights(file, batch.op, batch.vocab, &because)? {
        batch.class_weights = Some(c);
    }
    if batch.op == Op::Grpo {
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
