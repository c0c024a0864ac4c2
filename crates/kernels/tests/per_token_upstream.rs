//! A per-token loss back-propagated with a per-token upstream gradient
//! (`PreparedLoss::upstream_gradients`, what Liger's `triton_grpo_loss(reduce=False)` and
//! `loss.backward(dy)` need), against the f64 reference differentiating the loss whose reduction
//! weighs each row's term by its upstream (`reference::evaluate_with_upstream`). At sequence level
//! (GSPO) a sequence's rows share the gradient of its weight, so a row's gradient is not its own
//! times its upstream: the case this exists for.

mod common;

use common::{relative_norm_error, Case, Data, IsRatioKind, Op};
use flashgrpo_kernels::synthetic::Rng;
use flashgrpo_kernels::{
    reference, Aggregation, Element, EntropyBonus, GradientTarget, ImportanceSamplingLevel, LossError, LossType,
    OutputUpstreams, PreparedLoss, Reduction, RolloutCorrection,
};
use half::bf16;

/// Upstream gradients of both signs, some zero; `inf` on masked rows, which must write nothing.
fn upstream(data: &Data, seed: u64) -> Vec<f32> {
    let mut rng = Rng::new(seed);
    let n = data.case.batch * data.case.seq_len;
    (0..n)
        .map(|i| {
            let masked = data.mask.as_ref().is_some_and(|m| m[i] == 0.0);
            let x = rng.uniform();
            if masked {
                f32::INFINITY
            } else if x < 0.1 {
                0.0
            } else {
                (3.0 * x - 1.0) as f32
            }
        })
        .collect()
}

/// The fused gradient with `upstream`: statistics, the objective's upstream-weighted row
/// gradients, the gradient pass.
fn fused_gradient<T: Element>(data: &Data, logits: &[T], upstream: &[f32]) -> Vec<T> {
    let prepared = PreparedLoss::new(data.spec()).unwrap();
    let vocab = data.case.vocab;
    let stats = prepared.statistics(logits, 0..vocab).unwrap();
    let rows = prepared.upstream_gradients(&stats, upstream).unwrap();
    let mut out = vec![T::default(); logits.len()];
    prepared.gradient(GradientTarget::Into { logits, out: &mut out }, 0..vocab, &rows).unwrap();
    out
}

fn check<T: Element>(case: &Case, grad_tol: f64) {
    let data = case.data();
    let u = upstream(&data, case.seed ^ 0x5EED);
    let logits: Vec<T> = data.logits_as();
    let exact: Vec<f64> = logits.iter().map(|x| x.to_f32() as f64).collect();
    let want = reference::evaluate_with_upstream(data.spec(), &exact, &u).unwrap().grad.unwrap();
    let got = fused_gradient(&data, &logits, &u);
    assert!(got.iter().all(|x| x.to_f32().is_finite()), "non-finite gradient in {case:?} {:?}", T::DTYPE);
    let err = relative_norm_error(got.iter().map(|x| x.to_f32() as f64), &want);
    assert!(err <= grad_tol, "gradient relative error {err} > {grad_tol} in {case:?} {:?}", T::DTYPE);
}

fn cases() -> Vec<Case> {
    let sum = |b, t, v| {
        Case::new(Op::Grpo, b, t, v).with(|o| {
            o.beta = 0.04;
            o.loss_agg_mode = Some(Aggregation::TokenSum);
        })
    };
    let sequence =
        |o: &mut flashgrpo_kernels::LossOptions| o.importance_sampling_level = ImportanceSamplingLevel::Sequence;
    let mut cases = Vec::new();
    for lt in [LossType::Grpo, LossType::Bnpo, LossType::DrGrpo, LossType::Dapo, LossType::Luspo] {
        cases.push(sum(3, 6, 37).with(|o| {
            o.loss_type = lt;
            sequence(o);
        }));
    }
    for lt in [LossType::Dapo, LossType::Cispo, LossType::Sapo, LossType::Vespo, LossType::Gpg] {
        cases.push(sum(3, 6, 37).with(|o| o.loss_type = lt));
    }
    cases.push(sum(2, 7, 2049).with(|o| {
        sequence(o);
        o.use_bias_correction_kl = true;
        o.temperature = 0.7;
    }));
    cases.push(sum(3, 5, 41).with(|o| {
        sequence(o);
        o.delta = Some(1.05);
        o.epsilon_high = Some(0.28);
    }));
    for kind in [IsRatioKind::PerToken, IsRatioKind::PerSequence] {
        let mut c = sum(3, 5, 23).with(sequence);
        c.is_ratio = kind;
        cases.push(c);
    }
    let mut on_policy = sum(2, 5, 31).with(|o| {
        sequence(o);
        o.use_bias_correction_kl = true;
    });
    on_policy.with_old = false;
    cases.push(on_policy);
    for bonus in [EntropyBonus::Token, EntropyBonus::MaskedMean] {
        cases.push(sum(3, 7, 41).with(|o| {
            sequence(o);
            o.entropy_coef = 0.05;
            o.entropy_bonus = bonus;
            o.top_entropy_quantile = 0.5;
        }));
    }
    let mut corrected = sum(3, 6, 37).with(|o| {
        sequence(o);
        o.vllm_importance_sampling_mode = RolloutCorrection::SequenceTruncate;
        o.off_policy_mask_threshold = Some(0.0);
    });
    corrected.with_sampling = true;
    cases.push(corrected);
    // A reduction other than the token sum: each row's weight times its upstream.
    cases.push(Case::new(Op::Grpo, 3, 6, 37).with(|o| {
        o.beta = 0.04;
        sequence(o);
    }));
    cases.push(Case::new(Op::CrossEntropy, 3, 5, 97).with(|o| {
        o.label_smoothing = 0.1;
        o.z_loss = 1e-3;
    }));
    cases.push(Case::new(Op::Logprob, 2, 4, 33).with(|o| o.temperature = 0.8));
    // The entropy's gradient, per token (`reduction` none: each row's weight 1) and of the mean.
    for reduction in [Reduction::None, Reduction::Mean] {
        cases.push(Case::new(Op::Entropy, 2, 4, 33).with(|o| {
            o.entropy_gradient = true;
            o.reduction = reduction;
            o.temperature = 0.8;
        }));
    }
    cases
}

#[test]
fn upstream_weighted_gradients_match_the_reference() {
    for case in cases() {
        check::<f32>(&case, 1e-5);
        check::<bf16>(&case, 1e-2);
    }
}

/// With one upstream per sequence (what `(loss * mask).sum() / mask.sum()` gives), the gradient
/// is the loss's own times it: the same bits as the forward's row gradients scaled.
#[test]
fn a_uniform_upstream_scales_the_loss_gradient() {
    let case = Case::new(Op::Grpo, 3, 6, 37).with(|o| {
        o.beta = 0.04;
        o.loss_agg_mode = Some(Aggregation::TokenSum);
        o.importance_sampling_level = ImportanceSamplingLevel::Sequence;
    });
    let data = case.data();
    let prepared = PreparedLoss::new(data.spec()).unwrap();
    let logits: Vec<f32> = data.logits_as();
    let stats = prepared.statistics(&logits, 0..case.vocab).unwrap();
    let (_, rows) = prepared.objective(&stats).unwrap();
    let ones = prepared.upstream_gradients(&stats, &vec![1.0; rows.len()]).unwrap();
    assert_eq!(ones, rows);
    let halves = prepared.upstream_gradients(&stats, &vec![0.5; rows.len()]).unwrap();
    for (h, r) in halves.iter().zip(&rows) {
        assert_eq!((h.a, h.b, h.c, h.d, h.lse), (r.a * 0.5, r.b * 0.5, r.c * 0.5, r.d * 0.5, r.lse));
    }
}

#[test]
fn upstream_errors_name_the_problem() {
    let data = Case::new(Op::Grpo, 2, 3, 11)
        .with(|o| {
            o.loss_type = LossType::GeoMean;
            o.beta = 0.0;
        })
        .data();
    let prepared = PreparedLoss::new(data.spec()).unwrap();
    let logits: Vec<f32> = data.logits_as();
    let stats = prepared.statistics(&logits, 0..11).unwrap();
    let err = prepared.upstream_gradients(&stats, &[1.0; 6]).unwrap_err();
    assert!(matches!(err, LossError::InvalidOption { name: "loss_type", .. }), "{err}");

    let data = Case::new(Op::Grpo, 2, 3, 11).data();
    let prepared = PreparedLoss::new(data.spec()).unwrap();
    let logits: Vec<f32> = data.logits_as();
    let stats = prepared.statistics(&logits, 0..11).unwrap();
    let err = prepared.upstream_gradients(&stats, &[1.0; 5]).unwrap_err();
    assert!(matches!(err, LossError::Shape { tensor: "upstream", .. }), "{err}");
}

/// The gradient of the loss's terms and of the per-token `entropy` and `lse` outputs at once
/// (`PreparedLoss::output_gradients`, what verl's `FusedLinearForPPO` and Liger's fused-linear
/// scaled cross-entropy need), against the reference adding the upstreams to each row's
/// derivatives, with each upstream present or absent.
#[test]
fn output_upstreams_match_the_reference() {
    let cases = [
        Case::new(Op::Logprob, 2, 5, 37).with(|o| o.temperature = 0.7),
        Case::new(Op::Logprob, 2, 4, 2049).with(|o| o.softcap = Some(3.0)),
        Case::new(Op::CrossEntropy, 3, 4, 97).with(|o| o.label_smoothing = 0.1),
        Case::new(Op::Grpo, 3, 6, 37).with(|o| {
            o.beta = 0.04;
            o.loss_agg_mode = Some(Aggregation::TokenSum);
            o.importance_sampling_level = ImportanceSamplingLevel::Sequence;
        }),
        Case::new(Op::Entropy, 2, 4, 33).with(|o| {
            o.entropy_gradient = true;
            o.reduction = Reduction::None;
        }),
    ];
    for case in &cases {
        let data = case.data();
        let [loss, entropy, lse] = [1u64, 2, 3].map(|k| upstream(&data, case.seed ^ k));
        let (loss, entropy, lse) = (Some(loss.as_slice()), Some(entropy.as_slice()), Some(lse.as_slice()));
        let choices = [
            OutputUpstreams { loss, entropy, lse },
            OutputUpstreams { entropy, ..Default::default() },
            OutputUpstreams { lse, ..Default::default() },
            OutputUpstreams { loss, lse, ..Default::default() },
        ];
        for up in &choices {
            check_outputs::<f32>(&data, up, 1e-5);
            check_outputs::<bf16>(&data, up, 1e-2);
        }
    }
}

fn check_outputs<T: Element>(data: &Data, upstreams: &OutputUpstreams, grad_tol: f64) {
    let logits: Vec<T> = data.logits_as();
    let exact: Vec<f64> = logits.iter().map(|x| x.to_f32() as f64).collect();
    let want = reference::evaluate_with_outputs(data.spec(), &exact, upstreams).unwrap().grad.unwrap();
    let prepared = PreparedLoss::new(data.spec()).unwrap();
    let vocab = data.case.vocab;
    let stats = prepared.statistics(&logits, 0..vocab).unwrap();
    let rows = prepared.output_gradients(&stats, upstreams).unwrap();
    let mut got = vec![T::default(); logits.len()];
    prepared.gradient(GradientTarget::Into { logits: &logits, out: &mut got }, 0..vocab, &rows).unwrap();
    let case = &data.case;
    assert!(got.iter().all(|x| x.to_f32().is_finite()), "non-finite gradient in {case:?} {:?}", T::DTYPE);
    let err = relative_norm_error(got.iter().map(|x| x.to_f32() as f64), &want);
    assert!(err <= grad_tol, "gradient relative error {err} > {grad_tol} in {case:?} {:?} {upstreams:?}", T::DTYPE);
}

#[test]
fn output_upstream_errors_name_the_tensor() {
    let data = Case::new(Op::Logprob, 2, 3, 11).data();
    let prepared = PreparedLoss::new(data.spec()).unwrap();
    let logits: Vec<f32> = data.logits_as();
    let stats = prepared.statistics(&logits, 0..11).unwrap();
    let short = [1.0; 5];
    let up = OutputUpstreams { lse: Some(&short), ..Default::default() };
    let err = prepared.output_gradients(&stats, &up).unwrap_err();
    assert!(matches!(err, LossError::Shape { tensor: "upstream_lse", .. }), "{err}");
    let up = OutputUpstreams { entropy: Some(&short), ..Default::default() };
    let err = prepared.output_gradients(&stats, &up).unwrap_err();
    assert!(matches!(err, LossError::Shape { tensor: "upstream_entropy", .. }), "{err}");

    // The entropy op has a gradient only with `entropy_gradient`.
    let data = Case::new(Op::Entropy, 2, 3, 11).data();
    let prepared = PreparedLoss::new(data.spec()).unwrap();
    let stats = prepared.statistics(&logits, 0..11).unwrap();
    let ones = [1.0; 6];
    let up = OutputUpstreams { entropy: Some(&ones), ..Default::default() };
    let err = prepared.output_gradients(&stats, &up).unwrap_err();
    assert!(matches!(err, LossError::NoGradient { op: "entropy" }), "{err}");
}
