//! Fused-linear losses against the f64 reference (full logits in f64): ragged shapes, every op and
//! the main options, masks, bias, bf16, chunk budgets small enough to force many chunks and
//! weight tiles, vocabulary shards, and bitwise determinism across thread counts.

mod common;

use common::{linear_for, Case, Data, Linear, Op};
use flashgrpo_kernels::linear::reference;
use flashgrpo_kernels::matmul_bf16::{with_bf16_products, Bf16Choice, Bf16Products};
use flashgrpo_kernels::{
    combine_shards, linear_forward, linear_forward_backward, Aggregation, ChunkBudget, Element, EntropyBonus,
    ImportanceSamplingLevel, KlEstimator, LinearGradients, LinearInputs, LossOutput, LossType, PreparedLinearLoss,
    Reduction, RolloutCorrection,
};
use half::bf16;

struct Got {
    out: LossOutput,
    grad_hidden: Vec<f32>,
    grad_weight: Vec<f32>,
    grad_bias: Vec<f32>,
}

fn run<T: Element>(data: &Data, lin: &Linear, budget: ChunkBudget) -> Got {
    let hidden: Vec<T> = lin.hidden.iter().map(|&x| T::from_f32(x)).collect();
    let weight: Vec<T> = lin.weight.iter().map(|&x| T::from_f32(x)).collect();
    let bias: Option<Vec<T>> = lin.bias.as_ref().map(|b| b.iter().map(|&x| T::from_f32(x)).collect());
    let inputs = LinearInputs { hidden: &hidden, weight: &weight, bias: bias.as_deref(), hidden_size: lin.h };
    let spec = data.spec();
    // NaN-filled: the gradients must be overwritten, not accumulated into.
    let mut gh = vec![f32::NAN; hidden.len()];
    let mut gw = vec![f32::NAN; weight.len()];
    let mut gb = vec![f32::NAN; bias.as_ref().map_or(0, Vec::len)];
    let out = if spec.has_gradient() {
        let grads = LinearGradients {
            hidden: &mut gh,
            weight: Some(&mut gw),
            bias: bias.is_some().then_some(&mut gb[..]),
            accumulate: false,
        };
        linear_forward_backward(spec, inputs, grads, budget).unwrap()
    } else {
        linear_forward(spec, inputs, budget).unwrap()
    };
    Got { out, grad_hidden: gh, grad_weight: gw, grad_bias: gb }
}

fn rel_norm(got: &[f32], want: &[f64]) -> f64 {
    let diff: f64 = got.iter().zip(want).map(|(&g, &w)| (g as f64 - w).powi(2)).sum();
    let norm: f64 = want.iter().map(|w| w * w).sum();
    (diff / norm.max(1e-300)).sqrt()
}

/// [`check`] in bf16 with every way this machine has of running the bf16 products (AMX tiles and
/// AVX512-BF16 where the CPU has them, the widened f32 products everywhere). The opt-in ways that
/// round the logits' gradient to bf16 are held to LOSSES.md's bf16 gradient tolerance (1e-2
/// relative norm) for the two gradients that go through the products.
fn check_bf16_every_way(data: &Data, lin: &Linear, budget: ChunkBudget) {
    for products in Bf16Products::available() {
        let product_tolerance = if products.rounded() { 1e-2 } else { 1e-4 };
        with_bf16_products(products, || check_within::<bf16>(data, lin, budget, product_tolerance));
    }
}

/// LOSSES.md's fused-linear tolerances: loss 1e-4 relative, gradients 1e-4 relative norm; the
/// per-token outputs as the logits-level ones.
fn check<T: Element>(data: &Data, lin: &Linear, budget: ChunkBudget) {
    check_within::<T>(data, lin, budget, 1e-4)
}

/// [`check`] with `grad_hidden` and `grad_weight` to `product_tolerance`.
fn check_within<T: Element>(data: &Data, lin: &Linear, budget: ChunkBudget, product_tolerance: f64) {
    let round = |v: &[f32]| -> Vec<f64> { v.iter().map(|&x| T::from_f32(x).to_f32() as f64).collect() };
    let want = reference::evaluate(
        data.spec(),
        &round(&lin.hidden),
        &round(&lin.weight),
        lin.bias.as_deref().map(round).as_deref(),
        lin.h,
    )
    .unwrap();
    let got = run::<T>(data, lin, budget);
    let products = flashgrpo_kernels::matmul_bf16::current();
    let name =
        format!("{:?} {:?} {products:?} H={} bias={} {budget:?}", data.case, T::DTYPE, lin.h, lin.bias.is_some());
    let w = &want.output;
    assert!(
        (got.out.loss - w.loss).abs() <= 1e-4 * w.loss.abs().max(1e-2),
        "loss {} vs {} in {name}",
        got.out.loss,
        w.loss
    );
    for (what, g, r) in
        [("per_token_loss", &got.out.per_token_loss, &w.per_token_loss), ("entropy", &got.out.entropy, &w.entropy)]
    {
        for (a, b) in g.iter().zip(r) {
            assert!((*a as f64 - b).abs() <= 2e-5 * b.abs().max(1.0), "{what}: {a} vs {b} in {name}");
        }
    }
    if let Some(gh) = &want.grad_hidden {
        let (e_h, gw) = (rel_norm(&got.grad_hidden, gh), want.grad_weight.as_ref().unwrap());
        assert!(e_h < product_tolerance, "grad_hidden {e_h} in {name}");
        let e_w = rel_norm(&got.grad_weight, gw);
        assert!(e_w < product_tolerance, "grad_weight {e_w} in {name}");
        if let Some(gb) = &want.grad_bias {
            assert!(rel_norm(&got.grad_bias, gb) < 1e-4, "grad_bias {} in {name}", rel_norm(&got.grad_bias, gb));
        }
    }
}

/// Budgets: the default (one chunk), and ones small enough for 1-3 rows per chunk and (bf16)
/// weight tiles of 16 rows.
fn budgets(v: usize) -> [ChunkBudget; 3] {
    [ChunkBudget::default(), ChunkBudget::from_bytes(4 * (v + 64) * 2), ChunkBudget::from_bytes(4 * v * 3 + 5000)]
}

#[test]
fn every_op_and_option_matches_the_reference() {
    let grpo = |lt, level| {
        Case::new(Op::Grpo, 3, 5, 67).with(|o| {
            o.loss_type = lt;
            o.importance_sampling_level = level;
            o.beta = 0.04;
            o.epsilon_high = Some(0.28);
            o.entropy_coef = 0.01;
            o.temperature = 0.9;
        })
    };
    let mut cases = vec![
        grpo(LossType::Dapo, ImportanceSamplingLevel::Token),
        grpo(LossType::Grpo, ImportanceSamplingLevel::Sequence),
        grpo(LossType::Sapo, ImportanceSamplingLevel::Token),
        grpo(LossType::Cispo, ImportanceSamplingLevel::Token).with(|o| o.epsilon_high = Some(1.2)),
        grpo(LossType::DrGrpo, ImportanceSamplingLevel::Sequence).with(|o| o.use_bias_correction_kl = true),
        Case::new(Op::CrossEntropy, 2, 6, 67).with(|o| {
            o.label_smoothing = 0.1;
            o.z_loss = 1e-3;
        }),
        Case::new(Op::CrossEntropy, 2, 6, 67).with(|o| o.reduction = Reduction::Sum),
        Case::new(Op::Logprob, 2, 4, 40),
        Case::new(Op::Entropy, 2, 4, 40),
        // The entropy with its gradient (`entropy_gradient`), of its mean and of its sum.
        Case::new(Op::Entropy, 2, 4, 40).with(|o| {
            o.entropy_gradient = true;
            o.temperature = 0.8;
        }),
        Case::new(Op::Entropy, 3, 5, 67).with(|o| {
            o.entropy_gradient = true;
            o.reduction = Reduction::None;
        }),
    ];
    cases[5].ignored = 0.2;
    // LOSSES.md's additions: one row-local (luspo with a token-level correction) and the
    // whole-batch ones (vespo, geo_mean, kl_cov, the entropy quantile, the off-policy mask).
    let sampled = |c: Case| Case { with_sampling: true, ..c };
    cases.extend([
        sampled(grpo(LossType::Luspo, ImportanceSamplingLevel::Token).with(|o| {
            o.vllm_importance_sampling_mode = RolloutCorrection::TokenMask;
            o.vllm_importance_sampling_clip_max = Some(1.05);
        })),
        sampled(grpo(LossType::Vespo, ImportanceSamplingLevel::Token).with(|o| {
            o.vllm_importance_sampling_mode = RolloutCorrection::TokenTruncate;
            o.top_entropy_quantile = 0.4;
            o.entropy_bonus = EntropyBonus::MaskedMean;
        })),
        sampled(
            grpo(LossType::GeoMean, ImportanceSamplingLevel::Token).with(|o| o.off_policy_mask_threshold = Some(0.0)),
        ),
        grpo(LossType::KlCov, ImportanceSamplingLevel::Token).with(|o| {
            o.kl_cov_ratio = 0.2;
            o.loss_agg_mode = Some(Aggregation::SeqMeanTokenMean);
            o.kl_loss_type = KlEstimator::LowVarKl;
        }),
    ]);
    // Soft-capped logits (logits of spread ~2 against caps that bend them hard and a little).
    cases.extend([
        grpo(LossType::Grpo, ImportanceSamplingLevel::Sequence).with(|o| o.softcap = Some(1.5)),
        Case::new(Op::CrossEntropy, 2, 6, 67).with(|o| {
            o.softcap = Some(4.0);
            o.label_smoothing = 0.1;
            o.z_loss = 1e-3;
        }),
    ]);
    // Class weights: a row weight `c_y`, and with label smoothing a term per column.
    let weighted = |c: Case| Case { class_weights: true, ignored: 0.2, ..c };
    cases.extend([
        weighted(Case::new(Op::CrossEntropy, 2, 6, 67)),
        weighted(Case::new(Op::CrossEntropy, 2, 6, 67).with(|o| {
            o.label_smoothing = 0.1;
            o.z_loss = 1e-3;
        })),
        weighted(Case::new(Op::CrossEntropy, 2, 6, 67).with(|o| {
            o.label_smoothing = 0.2;
            o.softcap = Some(4.0);
            o.reduction = Reduction::Sum;
        })),
    ]);
    for case in cases {
        let data = case.data();
        for (h, bias) in [(8, false), (13, true), (1, true)] {
            let lin = linear_for(&case, h, bias);
            for budget in budgets(case.vocab) {
                check::<f32>(&data, &lin, budget);
                check_bf16_every_way(&data, &lin, budget);
            }
        }
    }
}

#[test]
fn ragged_shapes_and_masks() {
    for &(b, t, v, h) in &[(1, 1, 1, 3), (1, 1, 2, 5), (2, 3, 17, 33), (1, 7, 300, 16), (3, 2, 1025, 24)] {
        for mask in [common::MaskKind::None, common::MaskKind::Random(0.4), common::MaskKind::AllZero] {
            let mut case = Case::new(Op::Grpo, b, t, v).with(|o| o.beta = 0.04);
            case.mask = mask;
            let data = case.data();
            let lin = linear_for(&case, h, true);
            for budget in budgets(v) {
                check::<f32>(&data, &lin, budget);
                check_bf16_every_way(&data, &lin, budget);
            }
        }
    }
}

/// Masked rows skip the products (the chunks hold the active rows alone, gathered where a masked
/// row falls between them): runs of masked rows at the start, across chunks and at the end,
/// against the reference at every budget (one to a few rows per chunk, whole 32-row blocks, one
/// chunk) and every bf16 way. With `accumulate`, an all-masked batch leaves the weight and bias
/// gradients as they were and writes a zero `d hidden`.
#[test]
fn masked_rows_are_skipped_by_the_products() {
    let case = Case::new(Op::Grpo, 3, 23, 301).with(|o| o.beta = 0.04);
    let mut data = case.data();
    let n = 69;
    let masked = |i: usize| i < 5 || (20..31).contains(&i) || i % 7 == 3 || i >= 64;
    data.mask = Some((0..n).map(|i| if masked(i) { 0.0 } else { 1.0 }).collect());
    let lin = linear_for(&case, 40, true);
    let more = [ChunkBudget::from_bytes(4 * 301 * 9), ChunkBudget::from_bytes(900_000)];
    for budget in budgets(case.vocab).into_iter().chain(more) {
        check::<f32>(&data, &lin, budget);
        check_bf16_every_way(&data, &lin, budget);
    }

    data.mask = Some(vec![0.0; n]);
    let as_bf16 = |v: &[f32]| -> Vec<bf16> { v.iter().map(|&x| bf16::from_f32(x)).collect() };
    let (hidden, weight, bias) = (as_bf16(&lin.hidden), as_bf16(&lin.weight), as_bf16(lin.bias.as_ref().unwrap()));
    let inputs = LinearInputs { hidden: &hidden, weight: &weight, bias: Some(&bias), hidden_size: 40 };
    let (mut gh, mut gw, mut gb) = (vec![f32::NAN; hidden.len()], vec![1.5; weight.len()], vec![2.5; bias.len()]);
    let grads = LinearGradients { hidden: &mut gh, weight: Some(&mut gw), bias: Some(&mut gb), accumulate: true };
    let out = linear_forward_backward(data.spec(), inputs, grads, ChunkBudget::default()).unwrap();
    assert_eq!(out.loss, 0.0);
    assert!(gh.iter().all(|&x| x == 0.0), "d hidden of masked rows");
    assert!(gw.iter().all(|&x| x == 1.5) && gb.iter().all(|&x| x == 2.5), "accumulated gradients changed");
}

/// Rows whose gradient is zero (no KL term: a sequence with a zero advantage) skip the gradient
/// products (row-local objectives: the chunk's `dz` slots refilled from its end; sequence level:
/// all three products), mixed with masked rows, against the reference at every budget and bf16
/// way; every row of a batch without any gradient leaves `d hidden`, `d weight` and `d bias`
/// zero.
#[test]
fn rows_without_a_gradient_skip_the_gradient_products() {
    for level in [ImportanceSamplingLevel::Token, ImportanceSamplingLevel::Sequence] {
        let case = Case::new(Op::Grpo, 6, 9, 211).with(|o| {
            o.beta = 0.0;
            o.importance_sampling_level = level;
            o.epsilon_high = Some(0.28);
        });
        let mut data = case.data();
        for b in [0, 2, 5] {
            data.advantages[b] = 0.0;
        }
        let lin = linear_for(&case, 24, true);
        for budget in budgets(case.vocab).into_iter().chain([ChunkBudget::from_bytes(900_000)]) {
            check::<f32>(&data, &lin, budget);
            check_bf16_every_way(&data, &lin, budget);
        }
        data.advantages.fill(0.0);
        for budget in budgets(case.vocab) {
            let got = run::<f32>(&data, &lin, budget);
            let zero = |v: &[f32]| v.iter().all(|&x| x == 0.0);
            assert!(zero(&got.grad_hidden) && zero(&got.grad_weight) && zero(&got.grad_bias), "{level:?} {budget:?}");
        }
    }
}

#[test]
fn bitwise_identical_for_any_thread_count_and_the_same_for_any_chunking() {
    let case = Case::new(Op::Grpo, 4, 128, 3001).with(|o| o.beta = 0.04);
    let data = case.data();
    let lin = linear_for(&case, 256, true);
    let at = |threads: usize, budget| {
        rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap()
            .install(|| run::<f32>(&data, &lin, budget))
    };
    let budget = ChunkBudget::from_bytes(4 * 3001 * 200);
    let one = at(1, budget);
    for threads in [2, 7] {
        let other = at(threads, budget);
        assert_eq!(one.out, other.out, "{threads} threads");
        assert_eq!(one.grad_hidden, other.grad_hidden, "{threads} threads");
        assert_eq!(one.grad_weight, other.grad_weight, "{threads} threads");
        assert_eq!(one.grad_bias, other.grad_bias, "{threads} threads");
    }
    // Another chunking changes only the order of the weight-gradient sums over chunks.
    let whole = at(2, ChunkBudget::default());
    assert_eq!(one.out.per_token_loss, whole.out.per_token_loss);
    assert_eq!(one.grad_hidden, whole.grad_hidden);
    let w64: Vec<f64> = whole.grad_weight.iter().map(|&x| x as f64).collect();
    assert!(rel_norm(&one.grad_weight, &w64) < 1e-6);
}

/// The bf16 products, every way this machine has, are the same bits for any thread count, too.
#[test]
fn bf16_is_bitwise_identical_for_any_thread_count() {
    let case = Case::new(Op::Grpo, 2, 70, 1001).with(|o| o.beta = 0.04);
    let data = case.data();
    let lin = linear_for(&case, 96, true);
    for products in Bf16Products::available() {
        let at = |threads: usize| {
            let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
            let budget = ChunkBudget::from_bytes(4 * 1001 * 50);
            pool.install(|| with_bf16_products(products, || run::<bf16>(&data, &lin, budget)))
        };
        let one = at(1);
        for threads in [2, 3] {
            let other = at(threads);
            let what = format!("{products:?}, {threads} threads");
            assert_eq!(one.out, other.out, "{what}");
            assert_eq!(one.grad_hidden, other.grad_hidden, "{what}");
            assert_eq!(one.grad_weight, other.grad_weight, "{what}");
            assert_eq!(one.grad_bias, other.grad_bias, "{what}");
        }
    }
}

#[test]
fn vocabulary_shards_equal_unsharded() {
    for case in [
        Case::new(Op::Grpo, 2, 5, 90).with(|o| o.beta = 0.04),
        Case::new(Op::Grpo, 2, 5, 90).with(|o| o.importance_sampling_level = ImportanceSamplingLevel::Sequence),
        Case::new(Op::CrossEntropy, 2, 5, 90).with(|o| o.label_smoothing = 0.1),
    ] {
        let data = case.data();
        let lin = linear_for(&case, 12, true);
        let (h, v, n) = (12, 90, 10);
        let whole = run::<f32>(&data, &lin, ChunkBudget::default());
        let prepared = PreparedLinearLoss::new(data.spec(), ChunkBudget::from_bytes(4 * 40 * 3)).unwrap();
        let bounds = [0, 7, 40, 41, 90];
        let bias = lin.bias.as_ref().unwrap();
        let shard = |c: &std::ops::Range<usize>| LinearInputs {
            hidden: &lin.hidden,
            weight: &lin.weight[c.start * h..c.end * h],
            bias: Some(&bias[c.clone()]),
            hidden_size: h,
        };
        let ranges: Vec<_> = bounds.windows(2).map(|w| w[0]..w[1]).collect();
        let parts: Vec<_> =
            ranges.iter().map(|c| (c.clone(), prepared.statistics(shard(c), c.clone()).unwrap())).collect();
        let (out, row_grads) = prepared.objective(&combine_shards(v, &parts).unwrap()).unwrap();
        assert!((out.loss - whole.out.loss).abs() < 1e-6 * whole.out.loss.abs().max(1.0));
        let mut gh = vec![0.0f32; n * h];
        let mut gw = vec![0.0f32; v * h];
        let mut gb = vec![0.0f32; v];
        for c in &ranges {
            // NaN-filled: each shard's `d hidden` is written whole, masked rows included.
            let mut part = vec![f32::NAN; n * h];
            let grads = LinearGradients {
                hidden: &mut part,
                weight: Some(&mut gw[c.start * h..c.end * h]),
                bias: Some(&mut gb[c.clone()]),
                accumulate: false,
            };
            prepared.gradient(shard(c), c.clone(), &row_grads, grads).unwrap();
            gh.iter_mut().zip(&part).for_each(|(a, b)| *a += b); // the all-reduce
        }
        let as64 = |v: &[f32]| -> Vec<f64> { v.iter().map(|&x| x as f64).collect() };
        assert!(rel_norm(&gh, &as64(&whole.grad_hidden)) < 1e-6);
        assert!(rel_norm(&gw, &as64(&whole.grad_weight)) < 1e-6);
        assert!(rel_norm(&gb, &as64(&whole.grad_bias)) < 1e-6);
    }
}

#[test]
fn bad_shapes_are_named() {
    let case = Case::new(Op::Logprob, 1, 2, 10);
    let data = case.data();
    let lin = linear_for(&case, 4, false);
    let inputs = LinearInputs { hidden: &lin.hidden[..7], weight: &lin.weight, bias: None, hidden_size: 4 };
    let e = linear_forward(data.spec(), inputs, ChunkBudget::default()).unwrap_err().to_string();
    assert!(e.contains("`hidden`") && e.contains("B*T*H = 1*2*4"), "{e}");
    let inputs = LinearInputs { hidden: &lin.hidden, weight: &lin.weight[..39], bias: None, hidden_size: 4 };
    let e = linear_forward(data.spec(), inputs, ChunkBudget::default()).unwrap_err().to_string();
    assert!(e.contains("`weight`") && e.contains("V*H = 10*4"), "{e}");
    let b = [0.0f32; 3];
    let inputs = LinearInputs { hidden: &lin.hidden, weight: &lin.weight, bias: Some(&b), hidden_size: 4 };
    assert!(linear_forward(data.spec(), inputs, ChunkBudget::default()).unwrap_err().to_string().contains("`bias`"));
    let inputs = LinearInputs { hidden: &lin.hidden, weight: &lin.weight, bias: None, hidden_size: 4 };
    let mut gh = vec![0.0; 3];
    let grads = LinearGradients { hidden: &mut gh, weight: None, bias: None, accumulate: false };
    let e = linear_forward_backward(data.spec(), inputs, grads, ChunkBudget::default()).unwrap_err().to_string();
    assert!(e.contains("grad_hidden"), "{e}");
}

/// A budget's `bf16_products` runs the way it names, the same bits as the thread's override, and
/// a config reads it from its setting (`auto`, `rounded`, or a way's name), refusing a way this
/// machine lacks with the list of those it has.
#[test]
fn the_budgets_bf16_products_choose_the_way() {
    let case = Case::new(Op::Grpo, 2, 9, 301).with(|o| o.beta = 0.04);
    let data = case.data();
    let lin = linear_for(&case, 40, false);
    let budget = ChunkBudget::from_bytes(4 * 301 * 5);
    for products in Bf16Products::available() {
        let chosen = run::<bf16>(&data, &lin, budget.with_bf16_products(Bf16Choice::Way(products)));
        let overridden = with_bf16_products(products, || run::<bf16>(&data, &lin, budget));
        assert!(chosen.out == overridden.out, "{products:?}");
        assert_eq!(chosen.grad_hidden, overridden.grad_hidden, "{products:?}");
        assert_eq!(chosen.grad_weight, overridden.grad_weight, "{products:?}");
        assert_eq!(Bf16Choice::parse(products.setting()).unwrap(), Bf16Choice::Way(products));
        let read: Bf16Choice = serde_saphyr::from_str(products.setting()).unwrap();
        assert_eq!(read, Bf16Choice::Way(products));
    }
    assert_eq!(Bf16Choice::parse("auto").unwrap(), Bf16Choice::Auto);
    match Bf16Products::available().into_iter().find(|p| p.rounded()) {
        Some(fastest) => {
            assert_eq!(Bf16Choice::parse("rounded").unwrap(), Bf16Choice::Rounded);
            assert_eq!(Bf16Choice::Rounded.resolve(), fastest);
            let read: Bf16Choice = serde_saphyr::from_str("rounded").unwrap();
            assert_eq!(String::from(read), "rounded", "kept by name, not as this CPU's way");
        }
        None => assert!(Bf16Choice::parse("rounded").is_err()),
    }
    let e = Bf16Choice::parse("tpu").unwrap_err().to_string();
    assert!(e.contains("bf16_products") && e.contains("`tpu`") && e.contains("widened"), "{e}");
    // A way built by hand that this machine lacks is an error, not a panic.
    let all = [Bf16Products::Amx, Bf16Products::AmxRounded, Bf16Products::Avx512Bf16, Bf16Products::Avx512Bf16Rounded];
    if let Some(&missing) = all.iter().find(|p| !Bf16Products::available().contains(p)) {
        let hidden: Vec<bf16> = lin.hidden.iter().map(|&x| bf16::from_f32(x)).collect();
        let weight: Vec<bf16> = lin.weight.iter().map(|&x| bf16::from_f32(x)).collect();
        let inputs = LinearInputs { hidden: &hidden, weight: &weight, bias: None, hidden_size: lin.h };
        let e = linear_forward(data.spec(), inputs, budget.with_bf16_products(Bf16Choice::Way(missing)));
        assert!(e.unwrap_err().to_string().contains("cannot run"), "{missing:?}");
    }
}
