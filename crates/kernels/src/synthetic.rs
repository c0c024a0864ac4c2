//! Seeded synthetic batches for gradchecks, tests and benchmarks: logits with a realistic
//! spread, targets, a mask with a chosen masked fraction, normal advantages, and old/ref
//! log-probs near the true ones. The generator is ours (SplitMix64 + Box-Muller), so a seed
//! gives the same batch on every machine and every version of every dependency.

use rayon::prelude::*;

use crate::linear::ChunkBudget;
use crate::options::LossOptions;
use crate::owned::{LossInputs, LossKind};

/// SplitMix64: tiny, fast, and good enough for test data.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Self(seed ^ 0x9E37_79B9_7F4A_7C15)
    }

    /// The generator's whole state, for checkpoints: `Rng::from_state(r.state())` continues
    /// exactly where `r` is.
    pub fn state(&self) -> u64 {
        self.0
    }

    pub fn from_state(state: u64) -> Self {
        Self(state)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    pub fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Uniform in `0..n`.
    pub fn below(&mut self, n: usize) -> usize {
        (self.uniform() * n as f64) as usize % n.max(1)
    }

    /// Standard normal (Box-Muller).
    pub fn normal(&mut self) -> f64 {
        self.normal_pair().0
    }

    /// Two independent standard normals (both halves of Box-Muller).
    pub fn normal_pair(&mut self) -> (f64, f64) {
        let u1 = 1.0 - self.uniform();
        let u2 = self.uniform();
        let r = (-2.0 * u1.ln()).sqrt();
        let (s, c) = (2.0 * std::f64::consts::PI * u2).sin_cos();
        (r * c, r * s)
    }
}

/// What to generate.
#[derive(Debug, Clone, PartialEq)]
pub struct SyntheticSpec {
    pub batch: usize,
    pub seq_len: usize,
    pub vocab: usize,
    pub seed: u64,
    /// Logits are `N(0, logit_std^2)`.
    pub logit_std: f64,
    /// Old and reference log-probs are the true log-probs plus `N(0, logp_noise^2)`.
    pub logp_noise: f64,
    /// Each row is masked with this probability (the first row of each sequence never is).
    pub mask_fraction: f64,
}

/// A generated batch, row-major `[B*T]` per-row tensors, logits `[B*T*V]` in f32.
#[derive(Debug, Clone)]
pub struct SyntheticBatch {
    pub logits: Vec<f32>,
    pub targets: Vec<i64>,
    pub mask: Vec<f32>,
    pub advantages: Vec<f32>,
    pub old_logp: Vec<f32>,
    pub ref_logp: Vec<f32>,
}

/// A `rows x cols` matrix of `N(0, std^2)` values, one generator per row (seeded from `seed` and
/// the row), so that rows fill in parallel and the result is the same for any thread count.
pub fn normal_matrix(rows: usize, cols: usize, std: f64, seed: u64) -> Vec<f32> {
    let mut values = vec![0.0f32; rows * cols];
    values.par_chunks_mut(cols.max(1)).enumerate().for_each(|(row, out)| {
        let mut rng = Rng::new(seed ^ (row as u64 + 1).wrapping_mul(0xD1B5_4A32_D192_ED03));
        for pair in out.chunks_mut(2) {
            let (a, b) = rng.normal_pair();
            pair[0] = (a * std) as f32;
            if let Some(x) = pair.get_mut(1) {
                *x = (b * std) as f32;
            }
        }
    });
    values
}

/// The per-row inputs that do not depend on the logits.
#[derive(Debug, Clone)]
pub struct SyntheticRows {
    pub targets: Vec<i64>,
    pub mask: Vec<f32>,
    pub advantages: Vec<f32>,
}

impl SyntheticSpec {
    /// Logits `N(0, logit_std^2)` and everything else to go with them.
    pub fn generate(&self) -> SyntheticBatch {
        let logits = normal_matrix(self.batch * self.seq_len, self.vocab, self.logit_std, self.seed);
        self.complete(logits, &mut Rng::new(self.seed))
    }

    /// Targets, mask (the first row of each sequence is never masked) and advantages.
    pub fn rows(&self, rng: &mut Rng) -> SyntheticRows {
        let (n, v) = (self.batch * self.seq_len, self.vocab);
        let targets: Vec<i64> = (0..n).map(|_| rng.below(v) as i64).collect();
        let mask: Vec<f32> = (0..n)
            .map(|i| {
                let keep = i % self.seq_len.max(1) == 0 || rng.uniform() >= self.mask_fraction;
                if keep {
                    1.0
                } else {
                    0.0
                }
            })
            .collect();
        let advantages = (0..self.batch).map(|_| rng.normal() as f32).collect();
        SyntheticRows { targets, mask, advantages }
    }

    /// Old and reference log-probs: `logp` plus `N(0, logp_noise^2)` each. A non-finite `logp`
    /// gets a finite stand-in, so that the kernels, not these inputs, report the bad logits.
    pub fn near(&self, logp: &[f64], rng: &mut Rng) -> (Vec<f32>, Vec<f32>) {
        let mut near = || -> Vec<f32> {
            logp.iter()
                .map(|&l| ((if l.is_finite() { l } else { 0.0 }) + self.logp_noise * rng.normal()) as f32)
                .collect()
        };
        let old = near();
        (old, near())
    }

    /// Targets, mask, advantages and old/ref log-probs for the given logits `[B*T*V]`.
    pub fn complete(&self, logits: Vec<f32>, rng: &mut Rng) -> SyntheticBatch {
        let (n, v) = (self.batch * self.seq_len, self.vocab);
        assert_eq!(logits.len(), n * v, "logits must be [B*T*V]");
        let SyntheticRows { targets, mask, advantages } = self.rows(rng);
        let logp: Vec<f64> =
            (0..n).into_par_iter().map(|i| true_logp(&logits[i * v..(i + 1) * v], targets[i] as usize)).collect();
        let (old_logp, ref_logp) = self.near(&logp, rng);
        SyntheticBatch { logits, targets, mask, advantages, old_logp, ref_logp }
    }
}

impl SyntheticBatch {
    /// GRPO over this batch as a front end holds it: the generated advantages, targets, mask and
    /// old log-probabilities (no reference model, no sampler's log-probabilities), `options`,
    /// and the fused-linear `budget`. `spec` is the one that generated the batch.
    pub fn grpo_inputs(&self, spec: &SyntheticSpec, options: LossOptions, budget: ChunkBudget) -> LossInputs {
        LossInputs {
            kind: LossKind::Grpo {
                advantages: self.advantages.clone(),
                old_logp: Some(self.old_logp.clone()),
                ref_logp: None,
                is_ratio: None,
                sampling_logp: None,
            },
            batch: spec.batch,
            seq_len: spec.seq_len,
            targets: Some(self.targets.clone()),
            mask: Some(self.mask.clone()),
            options,
            budget,
            batch_shard: None,
        }
    }
}

/// `log softmax(row)[target]` in f64 at temperature 1.
pub fn true_logp(row: &[f32], target: usize) -> f64 {
    let m = row.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b)) as f64;
    let lse = m + row.iter().map(|&x| (x as f64 - m).exp()).sum::<f64>().ln();
    row[target] as f64 - lse
}
