//! The streaming kernels against the f64 reference, over ragged shapes, every op and option,
//! masks (none, random, all zero), and f32 / bf16 / f16 logits.

mod common;

use common::{assert_data_matches_reference, assert_matches_reference, Case, IsRatioKind, MaskKind, Op};
use flashgrpo_kernels::{
    Aggregation, EntropyBonus, ImportanceSamplingLevel, KlEstimator, LossType, Reduction, RolloutCorrection,
};
use half::{bf16, f16};

/// Shapes: V = 1 and 2, V not a multiple of the 16 lanes nor of the 2048-element tile,
/// V crossing a tile boundary by one, N = 1, and one large vocabulary.
const SHAPES: &[(usize, usize, usize)] =
    &[(1, 1, 1), (1, 1, 2), (2, 3, 5), (3, 4, 17), (2, 5, 2049), (1, 3, 4097), (4, 6, 100), (1, 2, 151_936)];

fn check_all_dtypes(case: &Case) {
    let data = case.data();
    assert_matches_reference::<f32>(&data, 1e-5);
    assert_matches_reference::<bf16>(&data, 1e-2);
    assert_matches_reference::<f16>(&data, 1e-2);
}

fn grpo_variants() -> Vec<(&'static str, Case)> {
    let base = |b, t, v| Case::new(Op::Grpo, b, t, v).with(|o| o.beta = 0.04);
    let mut cases = vec![
        ("on-policy defaults", {
            let mut c = Case::new(Op::Grpo, 3, 4, 33);
            c.with_old = false;
            c.with_ref = false;
            c
        }),
        (
            "eps_high 0.28 + delta",
            base(3, 5, 41).with(|o| {
                o.epsilon_high = Some(0.28);
                o.delta = Some(1.1);
            }),
        ),
        (
            "delta below 1 + eps_high: the clipped branch carries the gradient",
            base(3, 8, 41).with(|o| {
                o.epsilon_high = Some(0.28);
                o.delta = Some(1.02);
            }),
        ),
        ("bias-corrected kl", base(3, 5, 41).with(|o| o.use_bias_correction_kl = true)),
        (
            "entropy bonus + temperature",
            base(2, 6, 57).with(|o| {
                o.entropy_coef = 0.05;
                o.temperature = 0.7;
            }),
        ),
        ("num_items", base(2, 4, 19).with(|o| o.num_items = Some(3.0))),
        (
            "dr_grpo max_completion_length",
            base(2, 4, 19).with(|o| {
                o.loss_type = LossType::DrGrpo;
                o.max_completion_length = Some(16);
            }),
        ),
        ("is_ratio per token", {
            let mut c = base(2, 5, 23);
            c.is_ratio = IsRatioKind::PerToken;
            c
        }),
        ("is_ratio per sequence", {
            let mut c = base(2, 5, 23);
            c.is_ratio = IsRatioKind::PerSequence;
            c
        }),
        (
            "cispo both branches",
            base(3, 6, 29).with(|o| {
                o.loss_type = LossType::Cispo;
                o.epsilon_high = Some(1.1);
            }),
        ),
        ("on-policy sequence level, bias-corrected", {
            let mut c = base(2, 5, 31).with(|o| {
                o.importance_sampling_level = ImportanceSamplingLevel::Sequence;
                o.use_bias_correction_kl = true;
            });
            c.with_old = false;
            c
        }),
    ];
    for level in [ImportanceSamplingLevel::Token, ImportanceSamplingLevel::Sequence] {
        for lt in [
            LossType::Grpo,
            LossType::Bnpo,
            LossType::DrGrpo,
            LossType::Dapo,
            LossType::Cispo,
            LossType::Sapo,
            LossType::Luspo,
            LossType::Vespo,
            LossType::Gpg,
            LossType::GeoMean,
        ] {
            cases.push((
                "loss type x level",
                base(3, 7, 45).with(|o| {
                    o.loss_type = lt;
                    o.importance_sampling_level = level;
                    o.entropy_coef = 0.01;
                    o.use_bias_correction_kl = lt == LossType::Sapo;
                }),
            ));
        }
    }
    cases.extend(newer_options());
    cases
}

/// The options of TRL 1.16 and verl (docs/LOSSES.md, "Additions").
fn newer_options() -> Vec<(&'static str, Case)> {
    let base = |b, t, v| Case::new(Op::Grpo, b, t, v).with(|o| o.beta = 0.04);
    let sampled = |c: Case, with_old: bool| Case { with_sampling: true, with_old, ..c };
    let mut cases = Vec::new();
    for mode in [
        RolloutCorrection::TokenTruncate,
        RolloutCorrection::TokenMask,
        RolloutCorrection::SequenceTruncate,
        RolloutCorrection::SequenceMask,
    ] {
        for with_old in [true, false] {
            cases.push((
                "rollout correction",
                sampled(
                    base(3, 6, 37).with(|o| {
                        o.vllm_importance_sampling_mode = mode;
                        o.vllm_importance_sampling_clip_min = Some(0.9);
                        o.vllm_importance_sampling_clip_max = Some(1.05);
                    }),
                    with_old,
                ),
            ));
        }
    }
    for (is_ratio, with_sampling) in
        [(IsRatioKind::PerToken, false), (IsRatioKind::PerSequence, false), (IsRatioKind::None, true)]
    {
        let mut c = base(3, 6, 37).with(|o| {
            o.loss_type = LossType::Vespo;
            o.vllm_importance_sampling_mode = RolloutCorrection::TokenMask;
            o.vllm_importance_sampling_clip_min = Some(0.9);
        });
        c.is_ratio = is_ratio;
        c.with_sampling = with_sampling;
        cases.push(("vespo with importance ratios", c));
    }
    for with_sampling in [true, false] {
        cases.push((
            "off-policy mask",
            Case { with_sampling, ..base(4, 6, 37).with(|o| o.off_policy_mask_threshold = Some(0.0)) },
        ));
    }
    for bonus in [EntropyBonus::Token, EntropyBonus::MaskedMean] {
        cases.push((
            "top entropy quantile + entropy bonus",
            base(3, 7, 41).with(|o| {
                o.top_entropy_quantile = 0.3;
                o.entropy_coef = 0.05;
                o.entropy_bonus = bonus;
            }),
        ));
    }
    // TRL's lower end: only the highest-entropy token(s) train the policy term.
    cases.push(("top entropy quantile 0", base(3, 7, 41).with(|o| o.top_entropy_quantile = 0.0)));
    cases.push((
        "masked-mean entropy bonus",
        base(3, 7, 41).with(|o| {
            o.entropy_coef = 0.05;
            o.entropy_bonus = EntropyBonus::MaskedMean;
        }),
    ));
    for mode in [
        Aggregation::TokenMean,
        Aggregation::SeqMeanTokenSum,
        Aggregation::SeqMeanTokenMean,
        Aggregation::SeqMeanTokenSumNorm,
        Aggregation::TokenSum,
        Aggregation::NumItems,
    ] {
        cases.push(("loss_agg_mode", base(3, 6, 29).with(|o| o.loss_agg_mode = Some(mode))));
    }
    cases.push(("dual clip", base(4, 8, 29).with(|o| o.clip_ratio_c = Some(1.1))));
    for level in [ImportanceSamplingLevel::Token, ImportanceSamplingLevel::Sequence] {
        cases.push((
            "kl_cov",
            base(4, 8, 29).with(|o| {
                o.loss_type = LossType::KlCov;
                o.kl_cov_ratio = 0.1;
                o.ppo_kl_coef = 0.5;
                o.importance_sampling_level = level;
            }),
        ));
        cases.push((
            "clip_cov",
            base(4, 8, 29).with(|o| {
                o.loss_type = LossType::ClipCov;
                o.clip_cov_ratio = 0.2;
                o.clip_cov_lb = -1.0;
                o.clip_cov_ub = 1.0;
                o.importance_sampling_level = level;
            }),
        ));
    }
    for kl in [KlEstimator::LowVarKl, KlEstimator::K1, KlEstimator::K2, KlEstimator::Abs] {
        for bias in [false, true] {
            cases.push((
                "kl estimator",
                base(3, 5, 29).with(|o| {
                    o.kl_loss_type = kl;
                    o.use_bias_correction_kl = bias;
                }),
            ));
        }
    }
    cases.push((
        "everything at once, sequence level",
        sampled(
            base(4, 7, 53).with(|o| {
                o.loss_type = LossType::Luspo;
                o.importance_sampling_level = ImportanceSamplingLevel::Sequence;
                o.off_policy_mask_threshold = Some(0.05);
                o.top_entropy_quantile = 0.5;
                o.entropy_coef = 0.02;
                o.entropy_bonus = EntropyBonus::MaskedMean;
                o.vllm_importance_sampling_mode = RolloutCorrection::TokenTruncate;
                o.use_bias_correction_kl = true;
                o.kl_loss_type = KlEstimator::LowVarKl;
            }),
            true,
        ),
    ));
    cases
}

#[test]
fn grpo_every_option_matches_reference() {
    for (name, case) in grpo_variants() {
        println!("{name}: {:?}", case.options);
        check_all_dtypes(&case);
    }
}

#[test]
fn every_op_on_ragged_shapes() {
    for &(b, t, v) in SHAPES {
        for op in [Op::Grpo, Op::CrossEntropy, Op::Entropy, Op::Logprob] {
            for mask in [MaskKind::None, MaskKind::Random(0.3)] {
                let mut case = Case::new(op, b, t, v).with(|o| {
                    o.beta = 0.04;
                    o.epsilon_high = Some(0.28);
                });
                case.mask = mask;
                check_all_dtypes(&case);
            }
        }
    }
}

#[test]
fn all_masked_gives_zero_loss_and_gradient() {
    for op in [Op::Grpo, Op::CrossEntropy, Op::Entropy, Op::Logprob] {
        for lt in [LossType::Grpo, LossType::Dapo, LossType::Sapo] {
            let mut case = Case::new(op, 2, 3, 11).with(|o| {
                o.loss_type = lt;
                o.beta = 0.04;
            });
            case.mask = MaskKind::AllZero;
            let data = case.data();
            let (out, grad) = common::fused::<f32>(&data, &data.logits);
            assert_eq!(out.loss, 0.0, "{case:?}");
            assert!(out.per_token_loss.iter().all(|&x| x == 0.0));
            if let Some(g) = grad {
                assert!(g.iter().all(|&x| x == 0.0));
            }
            assert_matches_reference::<f32>(&data, 1e-5);
        }
    }
}

#[test]
fn cross_entropy_options_match_reference() {
    let variants: Vec<Case> = vec![
        Case::new(Op::CrossEntropy, 2, 5, 37),
        Case::new(Op::CrossEntropy, 2, 5, 37).with(|o| o.label_smoothing = 0.1),
        Case::new(Op::CrossEntropy, 2, 5, 37).with(|o| o.z_loss = 1e-3),
        Case::new(Op::CrossEntropy, 3, 4, 2100).with(|o| {
            o.label_smoothing = 0.2;
            o.z_loss = 1e-4;
            o.temperature = 1.3;
        }),
        Case::new(Op::CrossEntropy, 2, 5, 37).with(|o| o.reduction = Reduction::Sum),
        Case::new(Op::CrossEntropy, 2, 5, 37).with(|o| {
            o.reduction = Reduction::None;
            o.label_smoothing = 0.05;
        }),
        Case::new(Op::CrossEntropy, 2, 5, 37).with(|o| o.ignore_index = 7),
    ];
    for mut case in variants {
        case.ignored = 0.25;
        check_all_dtypes(&case);
        case.mask = MaskKind::None;
        check_all_dtypes(&case);
    }
}

/// Liger's `use_token_scaling`: each row's loss and gradient times its detached `p_y`. f32 and
/// bf16 only: scaled by `p_y` ~ 1/V, the gradient's entries fall below f16's normal range (6e-5)
/// at V = 2100, where f16 keeps few bits whoever rounds.
#[test]
fn cross_entropy_token_scaling_matches_reference() {
    let variants = [
        Case::new(Op::CrossEntropy, 3, 4, 2100).with(|o| {
            o.token_scaling = true;
            o.label_smoothing = 0.1;
            o.z_loss = 1e-3;
        }),
        Case::new(Op::CrossEntropy, 2, 5, 37).with(|o| {
            o.token_scaling = true;
            o.reduction = Reduction::None;
            o.softcap = Some(3.0);
        }),
        Case::new(Op::CrossEntropy, 1, 3, 1).with(|o| o.token_scaling = true),
    ];
    for mut case in variants {
        case.ignored = 0.25;
        let data = case.data();
        assert_matches_reference::<f32>(&data, 1e-5);
        assert_matches_reference::<bf16>(&data, 1e-2);
    }
}

/// The entropy's gradient (`entropy_gradient`): every shape, reduction, temperature and soft
/// cap, masked rows, every dtype, and on every instruction set.
#[test]
fn entropy_gradient_matches_reference() {
    let case = |(b, t, v): (usize, usize, usize), reduction, temperature, softcap| {
        let mut case = Case::new(Op::Entropy, b, t, v).with(|o| {
            o.entropy_gradient = true;
            o.reduction = reduction;
            o.temperature = temperature;
            o.softcap = softcap;
        });
        case.mask = MaskKind::Random(0.3);
        case
    };
    for &shape in SHAPES {
        for reduction in [Reduction::Mean, Reduction::Sum, Reduction::None] {
            check_all_dtypes(&case(shape, reduction, 1.0, None));
        }
        check_all_dtypes(&case(shape, Reduction::Mean, 0.7, Some(3.0)));
    }
    for isa in flashgrpo_kernels::Isa::available() {
        flashgrpo_kernels::with_isa(isa, || {
            for &shape in &SHAPES[..7] {
                check_all_dtypes(&case(shape, Reduction::Sum, 0.9, None));
            }
        });
    }
}

#[test]
fn logprob_and_entropy_with_temperature() {
    for op in [Op::Logprob, Op::Entropy] {
        let case = Case::new(op, 2, 3, 300).with(|o| o.temperature = 0.6);
        check_all_dtypes(&case);
    }
}

#[test]
fn large_logits_stay_accurate() {
    // Logits of spread 30 put the max far from zero: the entropy must not cancel.
    for op in [Op::Grpo, Op::CrossEntropy, Op::Entropy] {
        let mut case = Case::new(op, 2, 3, 5000).with(|o| o.beta = 0.04);
        case.logit_std = 30.0;
        assert_matches_reference::<f32>(&case.data(), 1e-5);
    }
}

/// Rows near one-hot (the target's probability 0.92-0.97) with logits far from 0: a row's
/// gradient is then a difference of nearly equal terms (`a + p_y b`), and the f32 rounding of
/// `lse` (half an ulp: 1.9e-6 at 40) moved every `p` by as much, 2-5e-5 of the gradient's norm,
/// until `GradTerms::finish` folded it into `b` and `c` (found by bench/tools/logits_fuzz.py).
#[test]
fn near_one_hot_rows_far_from_zero() {
    for (op, offset, vocab) in
        [(Op::Grpo, 40.0f32, 2), (Op::Grpo, -40.0, 3), (Op::CrossEntropy, 40.0, 2), (Op::Logprob, -40.0, 2)]
    {
        let mut case = Case::new(op, 3, 4, vocab).with(|o| o.beta = 0.04);
        case.mask = MaskKind::None;
        let mut data = case.data();
        for (i, row) in data.logits.chunks_mut(vocab).enumerate() {
            for (j, x) in row.iter_mut().enumerate() {
                *x = if j == 0 { offset } else { offset - 2.5 - 0.1 * i as f32 - j as f32 };
            }
        }
        data.targets.fill(0);
        assert_data_matches_reference::<f32>(&data, 1e-5);
    }
}

/// A one-token vocabulary: `lse = u`, `log p = 0` and `H = 0` exactly, so that TRL's
/// high-entropy mask, whose entropies all tie at 0, keeps every token as the reference does (the
/// base-2 statistics left ~1e-8 there and the mask kept some), and cross-entropy's z-loss, the
/// one term with a gradient, is not lost among terms that cancel.
#[test]
fn one_token_vocabulary_is_exact() {
    let grpo = Case::new(Op::Grpo, 3, 4, 1).with(|o| {
        o.top_entropy_quantile = 0.5;
        o.entropy_coef = 0.02;
    });
    let ce = Case::new(Op::CrossEntropy, 3, 4, 1).with(|o| {
        o.z_loss = 1e-4;
        o.label_smoothing = 0.3;
    });
    for case in [grpo, ce] {
        check_all_dtypes(&case);
        let data = case.data();
        let (got, _) = common::fused::<f32>(&data, &data.logits);
        assert!(got.entropy.iter().all(|&h| h == 0.0), "entropy {:?}", got.entropy);
        assert!(got.logp.unwrap().iter().all(|&l| l == 0.0), "{:?}", case);
    }
}

#[test]
fn spiky_rows_where_a_later_tile_holds_a_much_larger_logit() {
    // Tiles are 2048 wide: spikes in later tiles exceed the first tile's maximum by more than
    // the kernels' headroom (8), and by less, and a dip lowers one tile far below.
    for op in [Op::Grpo, Op::CrossEntropy, Op::Logprob] {
        let case = Case::new(op, 2, 3, 9000).with(|o| {
            o.beta = 0.04;
            o.entropy_coef = 0.01;
            o.label_smoothing = 0.1;
        });
        let mut data = case.data();
        for row in 0..6 {
            let base = row * 9000;
            data.logits[base + 2500] += 12.0 + row as f32 * 10.0;
            data.logits[base + 4500] += 5.0;
            data.logits[base + 7000] += 40.0 + row as f32;
            data.logits[base + 8999] -= 80.0;
            data.targets[row] = [2500, 7000, 11, 4500, 8999, 7000][row];
            // Old and reference log-probs near the new ones, so the ratios stay moderate.
            let logp =
                flashgrpo_kernels::synthetic::true_logp(&data.logits[base..base + 9000], data.targets[row] as usize);
            data.old_logp.as_mut().unwrap()[row] = (logp + 0.1) as f32;
            data.ref_logp.as_mut().unwrap()[row] = (logp - 0.2) as f32;
        }
        common::assert_data_matches_reference::<f32>(&data, 1e-5);
        common::assert_data_matches_reference::<bf16>(&data, 1e-2);
    }
}

#[test]
fn every_instruction_set_matches_reference() {
    for isa in flashgrpo_kernels::Isa::available() {
        flashgrpo_kernels::with_isa(isa, || {
            for (name, case) in grpo_variants().into_iter().step_by(3) {
                println!("{isa:?} {name}");
                check_all_dtypes(&case);
            }
            for &(b, t, v) in &SHAPES[..7] {
                for op in [Op::CrossEntropy, Op::Entropy, Op::Logprob] {
                    check_all_dtypes(&Case::new(op, b, t, v).with(|o| o.label_smoothing = 0.1));
                }
            }
        });
    }
}
