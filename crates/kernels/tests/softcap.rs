//! Soft-capped logits (`LossOptions::softcap`: `u = c tanh(x / c) / T`, Gemma 2's final logit
//! soft-capping, Liger's `softcap`) against the f64 reference, which caps the plain way and
//! chains `1 - tanh^2` by hand: every op, ragged vocabularies, masks, f32 / bf16 / f16, every
//! instruction set, in place, vocabulary shards, caps that saturate and caps that barely bend.

mod common;

use common::{assert_data_matches_reference, relative_norm_error, Case, Data, MaskKind, Op};
use flashgrpo_kernels::synthetic::Rng;
use flashgrpo_kernels::{
    combine_shards, forward_backward, forward_backward_in_place, reference, GradientTarget, ImportanceSamplingLevel,
    LossError, LossType, PreparedLoss, Reduction,
};
use half::{bf16, f16};

/// V = 1 and 2, ragged against the 16 lanes and the 2048-element tile, and a real vocabulary.
const SHAPES: &[(usize, usize, usize)] = &[(1, 1, 1), (1, 1, 2), (2, 3, 17), (2, 5, 2049), (1, 2, 151_936)];

/// Logits of spread 12 against caps of 2 (most saturate), 10, and 50 (little bends). Two-token
/// rows are drawn narrower: with a gap of ~5 or more between their two `u` they are near one-hot,
/// where `1 - p_y` carries f32's absolute rounding (`p_y`'s half ulp, 3e-8) as in every f32
/// implementation, and the gradient's relative error is that over `1 - p_y`, cap or no cap.
fn capped(op: Op, (b, t, v): (usize, usize, usize), cap: f64) -> Case {
    let mut case = Case::new(op, b, t, v).with(|o| {
        o.softcap = Some(cap);
        o.beta = 0.04;
        o.entropy_coef = 0.01;
        o.epsilon_high = Some(0.28);
    });
    case.logit_std = if v > 2 { 12.0 } else { 1.5 };
    case
}

/// The case's data with `old_logp` and `ref_logp` near the capped logits' own `log p` (the
/// synthetic ones are near the uncapped logits', and ratios `exp(logp - old_logp)` of 1e10 would
/// test only overflow).
fn data(case: &Case) -> Data {
    let mut data = case.data();
    if case.op != Op::Grpo {
        return data;
    }
    let exact: Vec<f64> = data.logits.iter().map(|&x| x as f64).collect();
    let mut logprob = case.clone();
    logprob.op = Op::Logprob;
    let logp = reference::evaluate(logprob.data().spec(), &exact).unwrap().logp.unwrap();
    let mut rng = Rng::new(case.seed ^ 0x0CA9);
    let mut near = || -> Vec<f32> { logp.iter().map(|&l| (l + 0.3 * (rng.uniform() - 0.5)) as f32).collect() };
    data.old_logp = data.old_logp.is_some().then(&mut near);
    data.ref_logp = data.ref_logp.is_some().then(&mut near);
    data
}

fn check_all_dtypes(case: &Case) {
    let data = data(case);
    assert_data_matches_reference::<f32>(&data, 1e-5);
    assert_data_matches_reference::<bf16>(&data, 1e-2);
    assert_data_matches_reference::<f16>(&data, 1e-2);
}

fn cases() -> Vec<Case> {
    let mut cases = Vec::new();
    for &shape in SHAPES {
        for cap in [2.0, 10.0, 50.0] {
            cases.push(capped(Op::Grpo, shape, cap).with(|o| o.temperature = 0.9));
            cases.push(capped(Op::Grpo, shape, cap).with(|o| {
                o.loss_type = LossType::Grpo;
                o.importance_sampling_level = ImportanceSamplingLevel::Sequence;
            }));
            let mut ce = capped(Op::CrossEntropy, shape, cap).with(|o| {
                o.label_smoothing = 0.1;
                o.z_loss = 1e-3;
            });
            ce.ignored = 0.3;
            cases.push(ce);
            cases.push(capped(Op::CrossEntropy, shape, cap).with(|o| o.reduction = Reduction::None));
            cases.push(capped(Op::Logprob, shape, cap).with(|o| o.temperature = 0.7));
            cases.push(capped(Op::Entropy, shape, cap));
        }
    }
    cases
}

#[test]
fn every_op_matches_the_reference() {
    for case in cases() {
        check_all_dtypes(&case);
    }
}

#[test]
fn every_instruction_set_matches_the_reference() {
    common::on_every_instruction_set(&cases(), 5, check_all_dtypes);
}

#[test]
fn masks_none_random_and_all_zero() {
    for mask in [MaskKind::None, MaskKind::Random(0.5), MaskKind::AllZero] {
        for op in [Op::Grpo, Op::CrossEntropy, Op::Logprob] {
            let mut case = capped(op, (3, 4, 301), 5.0);
            case.mask = mask;
            check_all_dtypes(&case);
        }
    }
}

#[test]
fn in_place_equals_out_of_place_bitwise() {
    for case in [capped(Op::Grpo, (2, 6, 2049), 5.0), capped(Op::CrossEntropy, (2, 3, 4099), 30.0)] {
        let data = data(&case);
        let logits: Vec<bf16> = data.logits_as();
        let mut grad = vec![bf16::ZERO; logits.len()];
        let out = forward_backward(data.spec(), &logits, &mut grad).unwrap();
        let mut in_place = logits.clone();
        let out_in_place = forward_backward_in_place(data.spec(), &mut in_place).unwrap();
        assert_eq!(out.loss, out_in_place.loss, "{case:?}");
        assert!(grad.iter().zip(&in_place).all(|(a, b)| a.to_bits() == b.to_bits()), "{case:?}");
    }
}

#[test]
fn vocabulary_shards_equal_unsharded() {
    let case = capped(Op::Grpo, (2, 5, 5000), 5.0).with(|o| {
        o.loss_type = LossType::Grpo;
        o.importance_sampling_level = ImportanceSamplingLevel::Sequence;
    });
    let data = data(&case);
    let (n, v) = (case.batch * case.seq_len, case.vocab);
    let mut full_grad = vec![0.0f32; n * v];
    let full = forward_backward(data.spec(), &data.logits, &mut full_grad).unwrap();
    let prepared = PreparedLoss::new(data.spec()).unwrap();
    let bounds = [0, 1000, 3001, 5000];
    let shard = |cols: &std::ops::Range<usize>| -> Vec<f32> {
        (0..n).flat_map(|i| data.logits[i * v + cols.start..i * v + cols.end].to_vec()).collect()
    };
    let partials: Vec<_> = bounds
        .windows(2)
        .map(|w| (w[0]..w[1], prepared.statistics(&shard(&(w[0]..w[1])), w[0]..w[1]).unwrap()))
        .collect();
    let (out, grads) = prepared.objective(&combine_shards(v, &partials).unwrap()).unwrap();
    assert!((out.loss - full.loss).abs() <= 1e-6 * full.loss.abs().max(1.0), "{} vs {}", out.loss, full.loss);
    let mut sharded = vec![0.0f32; n * v];
    for w in bounds.windows(2) {
        let cols = w[0]..w[1];
        let local = shard(&cols);
        let mut g = vec![0.0f32; local.len()];
        prepared.gradient(GradientTarget::Into { logits: &local, out: &mut g }, cols.clone(), &grads).unwrap();
        for i in 0..n {
            sharded[i * v + cols.start..i * v + cols.end].copy_from_slice(&g[i * cols.len()..(i + 1) * cols.len()]);
        }
    }
    let err = relative_norm_error(
        sharded.iter().map(|&x| x as f64),
        &full_grad.iter().map(|&x| x as f64).collect::<Vec<_>>(),
    );
    assert!(err <= 1e-6, "sharded gradient differs by {err}");
}

#[test]
fn bad_caps_and_infinite_logits_are_refused() {
    for cap in [0.0, -1.0, f64::NAN, f64::INFINITY] {
        let data = Case::new(Op::CrossEntropy, 1, 2, 10).with(|o| o.softcap = Some(cap)).data();
        match forward_backward(data.spec(), &data.logits, &mut [0.0; 20]) {
            Err(LossError::InvalidOption { name: "softcap", .. }) => {}
            other => panic!("softcap = {cap}: {other:?}"),
        }
    }
    // A cap would map an infinity to a finite value: it is still an error naming the row.
    let mut data = capped(Op::CrossEntropy, (1, 3, 40), 5.0).data();
    data.logits[2 * 40 + 7] = f32::INFINITY;
    match forward_backward(data.spec(), &data.logits, &mut [0.0; 120]) {
        Err(LossError::NonFiniteLogits { row: 2, .. }) => {}
        other => panic!("{other:?}"),
    }
}
