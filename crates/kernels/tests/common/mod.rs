//! Shared by the kernel tests: seeded cases, building a `LossSpec` from owned data, running the
//! fused kernels and the f64 reference, and comparing them with LOSSES.md's tolerances.
#![allow(dead_code)]

use flashgrpo_kernels::synthetic::{Rng, SyntheticSpec};
use flashgrpo_kernels::{
    forward, forward_backward, reference, CrossEntropyInputs, Element, IsRatio, Loss, LossOptions, LossOutput,
    LossSpec, PolicyInputs, Rows,
};

/// The kernels' own op names.
pub use flashgrpo_kernels::Op;

#[derive(Debug, Clone, Copy, PartialEq)]
pub enum MaskKind {
    None,
    Random(f64),
    AllZero,
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub enum IsRatioKind {
    None,
    PerToken,
    PerSequence,
}

#[derive(Debug, Clone)]
pub struct Case {
    pub op: Op,
    pub batch: usize,
    pub seq_len: usize,
    pub vocab: usize,
    pub seed: u64,
    pub options: LossOptions,
    pub mask: MaskKind,
    pub with_old: bool,
    pub with_ref: bool,
    pub is_ratio: IsRatioKind,
    /// GRPO: pass the sampler's log-probabilities (`sampling_logp`, near the true ones, a few NaN).
    pub with_sampling: bool,
    /// Cross-entropy: the fraction of targets replaced by `ignore_index`.
    pub ignored: f64,
    /// Cross-entropy: pass class weights (in [0.25, 1.75), every seventh class 0).
    pub class_weights: bool,
    pub logit_std: f64,
}

impl Case {
    pub fn new(op: Op, batch: usize, seq_len: usize, vocab: usize) -> Self {
        Self {
            op,
            batch,
            seq_len,
            vocab,
            seed: (batch * 1_000_003 + seq_len * 1009 + vocab) as u64,
            options: LossOptions::default(),
            mask: MaskKind::Random(0.2),
            with_old: true,
            with_ref: true,
            is_ratio: IsRatioKind::None,
            with_sampling: false,
            ignored: 0.0,
            class_weights: false,
            logit_std: 2.5,
        }
    }

    pub fn with(mut self, f: impl FnOnce(&mut LossOptions)) -> Self {
        f(&mut self.options);
        self
    }

    pub fn data(&self) -> Data {
        let batch = SyntheticSpec {
            batch: self.batch,
            seq_len: self.seq_len,
            vocab: self.vocab,
            seed: self.seed,
            logit_std: self.logit_std,
            logp_noise: 0.3,
            mask_fraction: match self.mask {
                MaskKind::Random(f) => f,
                _ => 0.0,
            },
        }
        .generate();
        let n = self.batch * self.seq_len;
        let mut rng = Rng::new(self.seed ^ 0xABCD);
        let mut targets = batch.targets;
        for y in targets.iter_mut() {
            if rng.uniform() < self.ignored {
                *y = self.options.ignore_index;
            }
        }
        let mask = match self.mask {
            MaskKind::None => None,
            MaskKind::Random(_) => Some(batch.mask),
            MaskKind::AllZero => Some(vec![0.0; n]),
        };
        let is_ratio = match self.is_ratio {
            IsRatioKind::None => None,
            IsRatioKind::PerToken => Some((0..n).map(|_| 0.5 + rng.uniform() as f32).collect()),
            IsRatioKind::PerSequence => Some((0..self.batch).map(|_| 0.5 + rng.uniform() as f32).collect()),
        };
        let sampling_logp = self.with_sampling.then(|| {
            batch
                .old_logp
                .iter()
                .map(|&o| if rng.uniform() < 0.05 { f32::NAN } else { o + 0.2 * (rng.uniform() as f32 - 0.5) })
                .collect()
        });
        let class_weights = self.class_weights.then(|| {
            (0..self.vocab).map(|j| if j % 7 == 3 { 0.0 } else { 0.25 + 1.5 * rng.uniform() as f32 }).collect()
        });
        Data {
            class_weights,
            logits: batch.logits,
            targets,
            mask,
            advantages: batch.advantages,
            old_logp: self.with_old.then_some(batch.old_logp),
            ref_logp: self.with_ref.then_some(batch.ref_logp),
            is_ratio,
            is_ratio_kind: self.is_ratio,
            sampling_logp,
            case: self.clone(),
        }
    }
}

/// Owned inputs of a case; `spec()` borrows them.
pub struct Data {
    pub logits: Vec<f32>,
    pub targets: Vec<i64>,
    pub mask: Option<Vec<f32>>,
    pub advantages: Vec<f32>,
    pub old_logp: Option<Vec<f32>>,
    pub ref_logp: Option<Vec<f32>>,
    pub is_ratio: Option<Vec<f32>>,
    pub is_ratio_kind: IsRatioKind,
    pub sampling_logp: Option<Vec<f32>>,
    /// Cross-entropy's `[V]` class weights.
    pub class_weights: Option<Vec<f32>>,
    pub case: Case,
}

impl Data {
    pub fn rows(&self) -> Rows<'_> {
        Rows {
            batch: self.case.batch,
            seq_len: self.case.seq_len,
            vocab: self.case.vocab,
            targets: Some(&self.targets),
            mask: self.mask.as_deref(),
        }
    }

    pub fn loss(&self) -> Loss<'_> {
        match self.case.op {
            Op::Grpo => Loss::Grpo(PolicyInputs {
                advantages: &self.advantages,
                old_logp: self.old_logp.as_deref(),
                ref_logp: self.ref_logp.as_deref(),
                is_ratio: self.is_ratio.as_deref().map(|v| match self.is_ratio_kind {
                    IsRatioKind::PerSequence => IsRatio::PerSequence(v),
                    _ => IsRatio::PerToken(v),
                }),
                sampling_logp: self.sampling_logp.as_deref(),
            }),
            Op::CrossEntropy => Loss::CrossEntropy(CrossEntropyInputs { class_weights: self.class_weights.as_deref() }),
            Op::Entropy => Loss::Entropy,
            Op::Logprob => Loss::Logprob,
        }
    }

    pub fn spec(&self) -> LossSpec<'_> {
        LossSpec { loss: self.loss(), rows: self.rows(), options: &self.case.options, batch_shard: None }
    }

    pub fn logits_as<T: Element>(&self) -> Vec<T> {
        self.logits.iter().map(|&x| T::from_f32(x)).collect()
    }
}

/// `check` on every `step`-th case whose vocabulary is below 100,000, under each instruction set
/// this CPU has (each test file runs all its cases under the detected one).
pub fn on_every_instruction_set(cases: &[Case], step: usize, check: impl Fn(&Case)) {
    for isa in flashgrpo_kernels::Isa::available() {
        flashgrpo_kernels::with_isa(isa, || {
            for case in cases.iter().filter(|c| c.vocab < 100_000).step_by(step) {
                check(case);
            }
        });
    }
}

/// Runs the fused kernel (with a gradient when the op has one).
pub fn fused<T: Element>(data: &Data, logits: &[T]) -> (LossOutput, Option<Vec<T>>) {
    let spec = data.spec();
    if spec.has_gradient() {
        let mut grad = vec![T::default(); logits.len()];
        let out = forward_backward(spec, logits, &mut grad).unwrap();
        (out, Some(grad))
    } else {
        (forward(spec, logits).unwrap(), None)
    }
}

pub fn relative_norm_error(got: impl Iterator<Item = f64>, want: &[f64]) -> f64 {
    let (mut diff, mut norm) = (0.0, 0.0);
    for (g, &w) in got.zip(want) {
        diff += (g - w) * (g - w);
        norm += w * w;
    }
    if norm == 0.0 {
        diff.sqrt()
    } else {
        (diff / norm).sqrt()
    }
}

/// Asserts LOSSES.md's tolerances: loss and per-token outputs 1e-5 (relative, or absolute
/// below 1), gradient relative norm `grad_tol` (1e-5 for f32, 1e-2 for bf16/f16).
pub fn assert_matches_reference<T: Element>(data: &Data, grad_tol: f64) {
    assert_data_matches_reference::<T>(data, grad_tol)
}

/// As [`assert_matches_reference`], for data a test has modified.
pub fn assert_data_matches_reference<T: Element>(data: &Data, grad_tol: f64) {
    let logits: Vec<T> = data.logits_as();
    let exact: Vec<f64> = logits.iter().map(|x| x.to_f32() as f64).collect();
    let want = reference::evaluate(data.spec(), &exact).unwrap();
    let (got, grad) = fused(data, &logits);
    let name = format!("{:?} {:?}", data.case, T::DTYPE);

    let loss_tol = 1e-5 * want.loss.abs().max(1e-2);
    assert!((got.loss - want.loss).abs() <= loss_tol, "loss {} vs reference {} in {name}", got.loss, want.loss);
    let check = |what: &str, got: &[f32], want: &[f64]| {
        assert_eq!(got.len(), want.len(), "{what} length in {name}");
        for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
            assert!((g as f64 - w).abs() <= 1e-5 * w.abs().max(1.0), "{what}[{i}] = {g} vs reference {w} in {name}");
        }
    };
    check("per_token_loss", &got.per_token_loss, &want.per_token_loss);
    check("entropy", &got.entropy, &want.entropy);
    check("logp", got.logp.as_deref().unwrap(), want.logp.as_deref().unwrap());
    check("lse", &got.lse, &want.lse);
    if let (Some(g), Some(w)) = (&got.kl, &want.kl) {
        check("kl", g, w);
    }
    if let (Some(g), Some(w)) = (&got.is_clipped, &want.is_clipped) {
        check("is_clipped", g, w);
    }
    assert_eq!(got.kl.is_some(), want.kl.is_some());
    let softcap = data.case.options.softcap;
    assert_predicted(&name, got.predicted.as_deref(), want.predicted.as_deref(), &exact, data.case.vocab, softcap);
    match (grad, want.grad) {
        (Some(g), Some(w)) => {
            let err = relative_norm_error(g.iter().map(|x| x.to_f32() as f64), &w);
            assert!(err <= grad_tol, "gradient relative error {err} > {grad_tol} in {name}");
        }
        (None, None) => {}
        (g, w) => panic!("gradient presence differs: fused {} reference {} in {name}", g.is_some(), w.is_some()),
    }
}

/// Each row's predicted token against the reference's: the same column, or, under a soft cap, one
/// whose capped logit equals the reference's largest to f32's rounding (the kernels cap in f32,
/// where two logits the f64 reference tells apart may cap to one value).
pub fn assert_predicted(
    name: &str,
    got: Option<&[i64]>,
    want: Option<&[i64]>,
    logits: &[f64],
    vocab: usize,
    softcap: Option<f64>,
) {
    assert_eq!(got.is_some(), want.is_some(), "predicted tokens computed, kernels vs reference, in {name}");
    let (Some(got), Some(want)) = (got, want) else { return };
    assert_eq!(got.len(), want.len(), "predicted tokens length in {name}");
    let cap = |x: f64| softcap.map_or(x, |c| c * (x / c).tanh());
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        if g == w {
            continue;
        }
        assert!(softcap.is_some() && g >= 0 && w >= 0, "predicted[{i}] = {g} vs reference {w} in {name}");
        let row = &logits[i * vocab..(i + 1) * vocab];
        let (a, b) = (cap(row[g as usize]), cap(row[w as usize]));
        let tol = 4.0 * f32::EPSILON as f64 * b.abs();
        assert!((a - b).abs() <= tol, "predicted[{i}] = {g} (capped {a}) vs reference {w} (capped {b}) in {name}");
    }
}

/// Hidden states and an lm_head for a case: logits of spread about 2.
pub struct Linear {
    pub h: usize,
    pub hidden: Vec<f32>,
    pub weight: Vec<f32>,
    pub bias: Option<Vec<f32>>,
}

pub fn linear_for(case: &Case, h: usize, with_bias: bool) -> Linear {
    let mut rng = Rng::new(case.seed ^ 0x11EA);
    let (n, v) = (case.batch * case.seq_len, case.vocab);
    let hidden = (0..n * h).map(|_| rng.normal() as f32).collect();
    let scale = 2.0 / (h as f64).sqrt();
    let weight = (0..v * h).map(|_| (rng.normal() * scale) as f32).collect();
    let bias = with_bias.then(|| (0..v).map(|_| (rng.normal() * 0.5) as f32).collect());
    Linear { h, hidden, weight, bias }
}
