//! Cross-entropy's class weights (LOSSES.md, "Class weights": PyTorch's and Liger's `weight`)
//! against the f64 reference: ragged vocabularies, label smoothing (where the weights reach every
//! column), z-loss, the three reductions, ignored targets and masks, soft caps, a temperature,
//! token scaling, f32 / bf16 / f16, every instruction set, in place and into a new buffer,
//! vocabulary shards, bad weights named, and any thread count.

mod common;

use common::{assert_data_matches_reference, Case, Data, MaskKind, Op};
use flashgrpo_kernels::{
    combine_shards, forward, forward_backward, forward_backward_in_place, BatchShard, CrossEntropyInputs, Element,
    Loss, LossOutput, LossSpec, PreparedLoss, Reduction, Rows,
};
use half::{bf16, f16};

/// V = 1 and 2, ragged against the 16 lanes, the 1024-column blocks and the 2048-element tile,
/// and a real vocabulary.
const SHAPES: &[(usize, usize, usize)] = &[(1, 1, 1), (1, 2, 2), (2, 3, 17), (2, 5, 2049), (1, 2, 151_936)];

fn weighted((b, t, v): (usize, usize, usize), f: impl FnOnce(&mut flashgrpo_kernels::LossOptions)) -> Case {
    let mut case = Case::new(Op::CrossEntropy, b, t, v).with(f);
    case.class_weights = true;
    case.ignored = 0.2;
    case
}

/// Each shape with and without label smoothing (the per-column term), z-loss, each reduction,
/// uncapped and capped, at a temperature, with token scaling.
fn cases() -> Vec<Case> {
    let mut cases = Vec::new();
    for &shape in SHAPES {
        for softcap in [None, Some(4.0)] {
            cases.push(weighted(shape, |o| o.softcap = softcap));
            cases.push(weighted(shape, |o| {
                o.softcap = softcap;
                o.label_smoothing = 0.1;
                o.z_loss = 1e-3;
            }));
            cases.push(weighted(shape, |o| {
                o.softcap = softcap;
                o.label_smoothing = 0.3;
                o.reduction = Reduction::Sum;
                o.temperature = 0.7;
            }));
            cases.push(weighted(shape, |o| {
                o.softcap = softcap;
                o.label_smoothing = 1.0;
                o.reduction = Reduction::None;
            }));
            cases.push(weighted(shape, |o| {
                o.softcap = softcap;
                o.label_smoothing = 0.2;
                o.token_scaling = true;
            }));
        }
    }
    cases
}

fn check_all_dtypes(case: &Case) {
    let data = case.data();
    assert_data_matches_reference::<f32>(&data, 1e-5);
    assert_data_matches_reference::<bf16>(&data, 1e-2);
    // f16's range: token scaling's `p_y` (~1/V) times `p_j` puts most of a gradient below its
    // smallest subnormal (6e-8), and a 151936-wide row's gradient of ~1/V (label smoothing's
    // terms cancel to less) lies among its subnormals: the reference's own f16 rounding is off by
    // over 1e-2 there (bf16, with f32's exponents, is checked on every case).
    if !case.options.token_scaling && case.vocab < 100_000 {
        assert_data_matches_reference::<f16>(&data, 1e-2);
    }
    in_place_is_into::<f32>(&data);
    in_place_is_into::<bf16>(&data);
}

/// In place and into a new buffer: the same bits, and the forward-only loss.
fn in_place_is_into<T: Element>(data: &Data) {
    let logits: Vec<T> = data.logits_as();
    let mut grad = vec![T::default(); logits.len()];
    let into = forward_backward(data.spec(), &logits, &mut grad).unwrap();
    let mut over = logits.clone();
    let in_place = forward_backward_in_place(data.spec(), &mut over).unwrap();
    let name = format!("{:?} {:?}", data.case, T::DTYPE);
    assert_eq!(into, in_place, "{name}");
    assert!(grad.iter().zip(&over).all(|(a, b)| a.to_f32().to_bits() == b.to_f32().to_bits()), "{name}");
    assert_eq!(forward(data.spec(), &logits).unwrap().loss, into.loss, "{name}");
}

#[test]
fn every_case_matches_the_reference() {
    for case in cases() {
        check_all_dtypes(&case);
    }
}

#[test]
fn every_instruction_set_matches_the_reference() {
    common::on_every_instruction_set(&cases(), 3, check_all_dtypes);
}

#[test]
fn masks_and_ignored_targets() {
    for mask in [MaskKind::None, MaskKind::Random(0.5), MaskKind::AllZero] {
        for ignored in [0.0, 0.6, 1.0] {
            let mut case = weighted((3, 4, 301), |o| o.label_smoothing = 0.1);
            (case.mask, case.ignored) = (mask, ignored);
            check_all_dtypes(&case);
        }
    }
}

/// Weights of 1 are no weights (to f32's rounding of the weighted sums).
#[test]
fn unit_weights_are_no_weights() {
    for smoothing in [0.0, 0.1] {
        let case = Case::new(Op::CrossEntropy, 2, 5, 2049).with(|o| {
            o.label_smoothing = smoothing;
            o.z_loss = 1e-3;
        });
        let data = case.data();
        let ones = vec![1.0f32; 2049];
        let spec =
            LossSpec { loss: Loss::CrossEntropy(CrossEntropyInputs { class_weights: Some(&ones) }), ..data.spec() };
        let (mut g1, mut g2) = (vec![0.0; data.logits.len()], vec![0.0; data.logits.len()]);
        let plain = forward_backward(data.spec(), &data.logits, &mut g1).unwrap();
        let weighted = forward_backward(spec, &data.logits, &mut g2).unwrap();
        assert!((plain.loss - weighted.loss).abs() <= 1e-6 * plain.loss.abs(), "{} vs {}", plain.loss, weighted.loss);
        let err = common::relative_norm_error(
            g2.iter().map(|&x| x as f64),
            &g1.iter().map(|&x| x as f64).collect::<Vec<_>>(),
        );
        assert!(err < 1e-6, "{err}");
    }
}

/// Counted targets whose weights sum to 0: `mean` gives 0 and a finite gradient (the z-loss's
/// alone), where PyTorch and Liger divide by 0.
#[test]
fn targets_of_zero_weight_give_zero_not_nan() {
    let mut case = weighted((1, 3, 50), |o| {
        o.label_smoothing = 0.1;
        o.z_loss = 1e-3;
    });
    case.mask = MaskKind::None;
    let mut data = case.data();
    data.targets = vec![3, 10, 17]; // every seventh class from 3 weighs 0
    let mut grad = vec![0.0; data.logits.len()];
    let out = forward_backward(data.spec(), &data.logits, &mut grad).unwrap();
    assert!(out.loss.is_finite() && grad.iter().all(|g| g.is_finite()), "{}", out.loss);
    assert_data_matches_reference::<f32>(&data, 1e-5);
}

/// Near-uniform rows with label smoothing and weights near their mean: the smoothing term's
/// `p_j b` and `d c_j` nearly cancel, so a 16-bit gradient must be rounded once, after the term is
/// added (rounded before, bf16 was off by 0.16 here, relative norm).
#[test]
fn near_uniform_rows_round_once() {
    for weights in [vec![1.0f32; 3001], (0..3001).map(|j| 1.0 + 0.01 * (j % 3) as f32).collect()] {
        let mut case = weighted((2, 6, 3001), |o| o.label_smoothing = 1.0);
        case.logit_std = 0.01;
        let mut data = case.data();
        data.class_weights = Some(weights);
        // The terms cancel to ~1% of their size (logits of spread 0.01), so f32's own rounding of
        // them (~1e-7 relative) reaches ~3e-5 of the result: ill-conditioned in f32 itself, as
        // PyTorch's `softmax - target` is. f16: these gradients (~4e-7) are f16 subnormals, whose
        // spacing (6e-8) alone misses 1e-2.
        assert_data_matches_reference::<f32>(&data, 1e-4);
        assert_data_matches_reference::<bf16>(&data, 1e-2);
        in_place_is_into::<bf16>(&data);
    }
}

/// Batch shards (data parallelism) with the whole batch's summed target weight: their losses and
/// gradients sum to the whole batch's; without it, a class-weighted `mean` is refused.
#[test]
fn batch_shards_sum_to_the_whole_batch() {
    let mut case = weighted((4, 5, 300), |o| {
        o.label_smoothing = 0.1;
        o.z_loss = 1e-3;
    });
    case.mask = MaskKind::None;
    let data = case.data();
    let c = data.class_weights.as_deref().unwrap();
    let (n, v) = (20, 300);
    let mut whole_grad = vec![0.0; n * v];
    let whole = forward_backward(data.spec(), &data.logits, &mut whole_grad).unwrap();
    let kept: Vec<usize> = (0..n).filter(|&i| data.targets[i] != -100).collect();
    let target_weight: f64 = kept.iter().map(|&i| c[data.targets[i] as usize] as f64).sum();
    let shard = BatchShard { global_target_weight: Some(target_weight), ..BatchShard::counts(4, kept.len() as f64) };
    let mut total = 0.0;
    for half in [0..10, 10..20] {
        let rows = Rows { batch: 2, seq_len: 5, vocab: v, targets: Some(&data.targets[half.clone()]), mask: None };
        let spec = LossSpec { rows, batch_shard: Some(shard), ..data.spec() };
        let logits = &data.logits[half.start * v..half.end * v];
        let mut grad = vec![0.0; logits.len()];
        total += forward_backward(spec, logits, &mut grad).unwrap().loss;
        for (a, b) in grad.iter().zip(&whole_grad[half.start * v..half.end * v]) {
            assert!((a - b).abs() <= 1e-6 * b.abs().max(1e-4), "{a} vs {b}");
        }
        let without = LossSpec { batch_shard: Some(BatchShard::counts(4, kept.len() as f64)), ..spec };
        let e = forward(without, logits).unwrap_err().to_string();
        assert!(e.contains("global_target_weight"), "{e}");
    }
    assert!((total - whole.loss).abs() <= 1e-6 * whole.loss.abs(), "{total} vs {}", whole.loss);
}

/// One class: `lse = u_0`, so cross-entropy and its smoothing term are 0 exactly, weighted or not,
/// as PyTorch's and Liger's are (the f32 sums of `c_0 u_0` and `lse` would differ by ~1e-8).
#[test]
fn one_class_is_exact() {
    for cap in [None, Some(2.0)] {
        let mut case = weighted((2, 9, 1), |o| {
            o.softcap = cap;
            o.label_smoothing = 0.3;
            o.reduction = Reduction::Sum;
        });
        case.logit_std = 6.0;
        let data = case.data();
        let mut grad = vec![1.0f32; data.logits.len()];
        let out = forward_backward(data.spec(), &data.logits, &mut grad).unwrap();
        assert_eq!(out.loss, 0.0, "{case:?}");
        assert!(out.per_token_loss.iter().chain(&grad).all(|&x| x == 0.0), "{case:?}");
    }
}

/// Statistics per vocabulary shard, combined, and each shard's gradient: the unsharded results
/// (the class-weighted `sum u` sums over shards; each shard's gradient takes its columns' weights).
#[test]
fn vocabulary_shards_equal_unsharded() {
    for softcap in [None, Some(5.0)] {
        let case = weighted((2, 5, 3000), |o| {
            o.softcap = softcap;
            o.label_smoothing = 0.1;
        });
        let data = case.data();
        let (n, v) = (10, 3000);
        let mut whole_grad = vec![0.0; n * v];
        let whole = forward_backward(data.spec(), &data.logits, &mut whole_grad).unwrap();
        let prepared = PreparedLoss::new(data.spec()).unwrap();
        let cut = |c: &std::ops::Range<usize>| -> Vec<f32> {
            (0..n).flat_map(|i| data.logits[i * v + c.start..i * v + c.end].to_vec()).collect()
        };
        let ranges: Vec<_> = [0, 1000, 2047, 3000].windows(2).map(|w| w[0]..w[1]).collect();
        let parts: Vec<_> =
            ranges.iter().map(|c| (c.clone(), prepared.statistics(&cut(c), c.clone()).unwrap())).collect();
        let (out, row_grads) = prepared.objective(&combine_shards(v, &parts).unwrap()).unwrap();
        assert!((out.loss - whole.loss).abs() <= 1e-6 * whole.loss.abs(), "{} vs {}", out.loss, whole.loss);
        for c in &ranges {
            let logits = cut(c);
            let mut grad = vec![0.0; logits.len()];
            prepared
                .gradient(
                    flashgrpo_kernels::GradientTarget::Into { logits: &logits, out: &mut grad },
                    c.clone(),
                    &row_grads,
                )
                .unwrap();
            for i in 0..n {
                for (k, j) in c.clone().enumerate() {
                    let (a, b) = (grad[i * c.len() + k], whole_grad[i * v + j]);
                    assert!((a - b).abs() <= 1e-6 * b.abs().max(1e-3), "row {i} column {j}: {a} vs {b}");
                }
            }
        }
    }
}

#[test]
fn bad_class_weights_are_named() {
    let data = Case::new(Op::CrossEntropy, 1, 2, 10).data();
    let short = vec![1.0f32; 9];
    let spec = LossSpec { loss: Loss::CrossEntropy(CrossEntropyInputs { class_weights: Some(&short) }), ..data.spec() };
    let e = forward(spec, &data.logits).unwrap_err().to_string();
    assert!(e.contains("class_weights") && e.contains("[V] = [10]"), "{e}");
    let mut bad = vec![1.0f32; 10];
    bad[4] = f32::NAN;
    let spec = LossSpec { loss: Loss::CrossEntropy(CrossEntropyInputs { class_weights: Some(&bad) }), ..data.spec() };
    let e = forward(spec, &data.logits).unwrap_err().to_string();
    assert!(e.contains("class_weights") && e.contains("class 4"), "{e}");
}

#[test]
fn the_same_for_any_thread_count() {
    let data = weighted((4, 16, 3001), |o| o.label_smoothing = 0.1).data();
    let at = |threads: usize| -> (LossOutput, Vec<f32>) {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
        let mut grad = vec![0.0; data.logits.len()];
        let out = pool.install(|| forward_backward(data.spec(), &data.logits, &mut grad).unwrap());
        (out, grad)
    };
    let one = at(1);
    assert_eq!(one, at(2));
    assert_eq!(one, at(5));
}
