//! Vocabulary shards (tensor parallel) and batch shards (data parallel) equal the unsharded result.

mod common;

use common::{relative_norm_error, Case, Data, Op};
use flashgrpo_kernels::{
    combine_shards, forward_backward, quantile, Aggregation, BatchShard, EntropyBonus, GradientTarget,
    ImportanceSamplingLevel, LossSpec, LossType, OutputUpstreams, PreparedLoss, Reduction, RolloutCorrection, Rows,
};

/// Runs the three steps over `bounds.len() - 1` vocabulary shards, as separate devices would;
/// with `upstreams`, the row gradients are theirs ([`PreparedLoss::output_gradients`]).
fn vocab_sharded(
    data: &Data,
    bounds: &[usize],
    upstreams: Option<&OutputUpstreams>,
) -> (flashgrpo_kernels::LossOutput, Vec<f32>) {
    let (n, v) = (data.case.batch * data.case.seq_len, data.case.vocab);
    let prepared = PreparedLoss::new(data.spec()).unwrap();
    let shards: Vec<(std::ops::Range<usize>, Vec<f32>)> = bounds
        .windows(2)
        .map(|w| {
            let cols = w[0]..w[1];
            let local: Vec<f32> =
                (0..n).flat_map(|i| data.logits[i * v + cols.start..i * v + cols.end].to_vec()).collect();
            (cols, local)
        })
        .collect();
    let partials: Vec<_> =
        shards.iter().map(|(c, l)| (c.clone(), prepared.statistics(l, c.clone()).unwrap())).collect();
    let combined = combine_shards(v, &partials).unwrap();
    let (out, mut grads) = prepared.objective(&combined).unwrap();
    if let Some(up) = upstreams {
        grads = prepared.output_gradients(&combined, up).unwrap();
    }
    let mut grad = vec![0.0f32; n * v];
    for (cols, local) in &shards {
        let mut g = vec![0.0f32; local.len()];
        prepared.gradient(GradientTarget::Into { logits: local, out: &mut g }, cols.clone(), &grads).unwrap();
        for i in 0..n {
            grad[i * v + cols.start..i * v + cols.end].copy_from_slice(&g[i * cols.len()..(i + 1) * cols.len()]);
        }
    }
    (out, grad)
}

#[test]
fn vocabulary_shards_equal_unsharded() {
    let cases = [
        Case::new(Op::Grpo, 2, 5, 37).with(|o| {
            o.beta = 0.04;
            o.entropy_coef = 0.02;
        }),
        Case::new(Op::Grpo, 2, 4, 5000).with(|o| {
            o.loss_type = LossType::Grpo;
            o.importance_sampling_level = ImportanceSamplingLevel::Sequence;
        }),
        Case::new(Op::CrossEntropy, 3, 3, 4099).with(|o| {
            o.label_smoothing = 0.1;
            o.z_loss = 1e-3;
        }),
        Case::new(Op::Logprob, 2, 3, 100),
        Case::new(Op::Entropy, 2, 3, 301).with(|o| {
            o.entropy_gradient = true;
            o.temperature = 0.8;
        }),
    ];
    for case in cases {
        let data = case.data();
        let v = case.vocab;
        let mut full_grad = vec![0.0f32; data.logits.len()];
        let full = forward_backward(data.spec(), &data.logits, &mut full_grad).unwrap();
        for bounds in [vec![0, v], vec![0, v / 2, v], vec![0, 1, v / 3, v - 1, v], vec![0, 3, 3, 10, v]] {
            let (out, grad) = vocab_sharded(&data, &bounds, None);
            assert!((out.loss - full.loss).abs() <= 1e-6 * full.loss.abs().max(1e-2), "{bounds:?} {case:?}");
            for (a, b) in out.per_token_loss.iter().zip(&full.per_token_loss) {
                assert!((a - b).abs() <= 1e-6 * b.abs().max(1.0));
            }
            for (a, b) in out.entropy.iter().zip(&full.entropy) {
                assert!((a - b).abs() <= 1e-6 * b.abs().max(1.0));
            }
            let full64: Vec<f64> = full_grad.iter().map(|&x| x as f64).collect();
            let err = relative_norm_error(grad.iter().map(|&x| x as f64), &full64);
            assert!(err < 1e-6, "gradient error {err} with shards {bounds:?} in {case:?}");
        }
    }
}

/// The gradients of the per-token entropy and `lse` outputs beside the loss's, from statistics
/// combined over shards, equal those from the whole vocabulary.
#[test]
fn output_upstreams_over_shards_equal_unsharded() {
    let data = Case::new(Op::Logprob, 2, 4, 997).with(|o| o.temperature = 0.7).data();
    let (n, v) = (8, 997);
    let wave = |k: f32| (0..n).map(|i| (i as f32 * k).sin()).collect::<Vec<f32>>();
    let (loss, entropy, lse) = (wave(0.7), wave(1.3), wave(2.1));
    let up = OutputUpstreams { loss: Some(&loss), entropy: Some(&entropy), lse: Some(&lse) };
    let prepared = PreparedLoss::new(data.spec()).unwrap();
    let stats = prepared.statistics(&data.logits, 0..v).unwrap();
    let rows = prepared.output_gradients(&stats, &up).unwrap();
    let mut whole = vec![0.0f32; n * v];
    prepared.gradient(GradientTarget::Into { logits: &data.logits, out: &mut whole }, 0..v, &rows).unwrap();
    let whole64: Vec<f64> = whole.iter().map(|&x| x as f64).collect();
    for bounds in [vec![0, v / 2, v], vec![0, 1, v / 3, v - 1, v]] {
        let (_, grad) = vocab_sharded(&data, &bounds, Some(&up));
        let err = relative_norm_error(grad.iter().map(|&x| x as f64), &whole64);
        assert!(err < 1e-6, "gradient error {err} with shards {bounds:?}");
    }
}

#[test]
fn shards_must_tile_the_vocabulary() {
    let data = Case::new(Op::Logprob, 1, 2, 10).data();
    let prepared = PreparedLoss::new(data.spec()).unwrap();
    let part = |cols: std::ops::Range<usize>| {
        let local: Vec<f32> =
            (0..2).flat_map(|i| data.logits[i * 10 + cols.start..i * 10 + cols.end].to_vec()).collect();
        (cols.clone(), prepared.statistics(&local, cols).unwrap())
    };
    let err = combine_shards(10, &[part(0..4), part(5..10)]).unwrap_err().to_string();
    assert!(err.contains("gap or overlap at column 4"), "{err}");
    let err = combine_shards(10, &[part(0..4), part(4..9)]).unwrap_err().to_string();
    assert!(err.contains("end at column 9"), "{err}");
}

#[test]
fn batch_shards_sum_to_unsharded() {
    let mut cases: Vec<Case> =
        [LossType::Grpo, LossType::Bnpo, LossType::DrGrpo, LossType::Dapo, LossType::Cispo, LossType::Sapo]
            .into_iter()
            .map(|lt| {
                Case::new(Op::Grpo, 6, 5, 23).with(|o| {
                    o.loss_type = lt;
                    o.beta = 0.04;
                    o.entropy_coef = 0.01;
                    o.importance_sampling_level = ImportanceSamplingLevel::Sequence;
                })
            })
            .collect();
    for lt in [LossType::Luspo, LossType::Vespo, LossType::Gpg, LossType::GeoMean] {
        cases.push(Case::new(Op::Grpo, 6, 5, 23).with(|o| {
            o.loss_type = lt;
            o.beta = 0.04;
        }));
    }
    for mode in [
        Aggregation::TokenMean,
        Aggregation::SeqMeanTokenSum,
        Aggregation::SeqMeanTokenMean,
        Aggregation::SeqMeanTokenSumNorm,
        Aggregation::TokenSum,
    ] {
        cases.push(Case::new(Op::Grpo, 6, 5, 23).with(|o| o.loss_agg_mode = Some(mode)));
    }
    // Whole-batch quantities: the entropy threshold and the bonus's row count come with the shard.
    cases.push(Case {
        with_sampling: true,
        ..Case::new(Op::Grpo, 6, 5, 23).with(|o| {
            o.top_entropy_quantile = 0.4;
            o.entropy_coef = 0.05;
            o.entropy_bonus = EntropyBonus::MaskedMean;
            o.off_policy_mask_threshold = Some(0.0);
            o.vllm_importance_sampling_mode = RolloutCorrection::SequenceTruncate;
        })
    });
    cases.push(Case::new(Op::CrossEntropy, 6, 5, 23).with(|o| o.label_smoothing = 0.1));
    cases.push(Case::new(Op::CrossEntropy, 6, 5, 23).with(|o| o.reduction = Reduction::Sum));
    for case in cases {
        let data = case.data();
        let (t, v) = (case.seq_len, case.vocab);
        let mut full_grad = vec![0.0f32; data.logits.len()];
        let full = forward_backward(data.spec(), &data.logits, &mut full_grad).unwrap();
        let prepared = PreparedLoss::new(data.spec()).unwrap();
        let active = prepared.active_rows();
        let mut global = BatchShard::counts(case.batch, active.iter().filter(|&&a| a).count() as f64);
        global.global_sequences_with_tokens =
            Some(active.chunks(t).filter(|seq| seq.iter().any(|&a| a)).count() as f64);
        if case.options.top_entropy_quantile < 1.0 {
            let mut h: Vec<f64> = full.entropy.iter().zip(active).filter(|(_, &a)| a).map(|(&h, _)| h as f64).collect();
            h.sort_by(f64::total_cmp);
            let threshold = quantile(&h, 1.0 - case.options.top_entropy_quantile);
            global.entropy_threshold = Some(threshold);
            global.global_bonus_rows = Some(h.iter().filter(|&&x| x >= threshold).count() as f64);
        }
        for split in [vec![0, 6], vec![0, 1, 6], vec![0, 2, 4, 6], vec![0, 1, 2, 3, 4, 5, 6]] {
            let mut loss = 0.0;
            let mut grad = Vec::new();
            for w in split.windows(2) {
                let rows = w[0] * t..w[1] * t;
                let spec = LossSpec {
                    loss: slice_loss(&data, w[0]..w[1], rows.clone()),
                    rows: Rows {
                        batch: w[1] - w[0],
                        seq_len: t,
                        vocab: v,
                        targets: Some(&data.targets[rows.clone()]),
                        mask: data.mask.as_deref().map(|m| &m[rows.clone()]),
                    },
                    options: &case.options,
                    batch_shard: Some(global),
                };
                let logits = &data.logits[rows.start * v..rows.end * v];
                let mut g = vec![0.0f32; logits.len()];
                loss += forward_backward(spec, logits, &mut g).unwrap().loss;
                grad.extend(g);
            }
            assert!(
                (loss - full.loss).abs() <= 1e-9 * full.loss.abs().max(1.0),
                "{loss} vs {} split {split:?} {case:?}",
                full.loss
            );
            assert_eq!(grad, full_grad, "split {split:?} {case:?}");
        }
    }
}

fn slice_loss<'a>(
    data: &'a Data,
    seqs: std::ops::Range<usize>,
    rows: std::ops::Range<usize>,
) -> flashgrpo_kernels::Loss<'a> {
    match data.loss() {
        flashgrpo_kernels::Loss::Grpo(p) => flashgrpo_kernels::Loss::Grpo(flashgrpo_kernels::PolicyInputs {
            advantages: &p.advantages[seqs],
            old_logp: p.old_logp.map(|x| &x[rows.clone()]),
            ref_logp: p.ref_logp.map(|x| &x[rows.clone()]),
            is_ratio: None,
            sampling_logp: p.sampling_logp.map(|x| &x[rows.clone()]),
        }),
        other => other,
    }
}
