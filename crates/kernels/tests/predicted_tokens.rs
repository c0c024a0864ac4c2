//! Predicted tokens (`LossOptions::predicted_tokens`: each row's first argmax, Liger's
//! `return_predicted_tokens` / `return_token_accuracy`) against the f64 reference: every op,
//! ragged vocabularies, masks and ignored targets (-1), f32 / bf16 / f16, soft caps, every
//! instruction set, in place and forward-only, ties (the first column wins, across vectors, tiles
//! and shards), vocabulary shards, fused-linear (both passes, any chunking), any thread count.

mod common;

use common::{assert_data_matches_reference, linear_for, Case, Data, Linear, MaskKind, Op};
use flashgrpo_kernels::{
    combine_shards, forward, forward_backward, forward_backward_in_place, linear_forward, linear_forward_backward,
    reference, ChunkBudget, Element, ImportanceSamplingLevel, LinearGradients, LinearInputs, LossOutput, LossType,
    PreparedLinearLoss, PreparedLoss, Reduction,
};
use half::{bf16, f16};

/// V = 1 and 2, ragged against the 16 lanes and the 2048-element tile, and a real vocabulary.
const SHAPES: &[(usize, usize, usize)] = &[(1, 1, 1), (1, 1, 2), (2, 3, 17), (2, 5, 2049), (1, 2, 151_936)];

fn predicting(op: Op, (b, t, v): (usize, usize, usize)) -> Case {
    Case::new(op, b, t, v).with(|o| {
        o.predicted_tokens = true;
        o.beta = 0.04;
    })
}

/// Token- and sequence-level GRPO (the one-pass sweep, and the statistics pass before the
/// objective), cross-entropy with ignored targets, log-probabilities at a temperature, entropy
/// (forward only): uncapped, and capped at 10 (little saturates) and 2 (most does).
fn cases() -> Vec<Case> {
    let mut cases = Vec::new();
    for &shape in SHAPES {
        for softcap in [None, Some(10.0), Some(2.0)] {
            let cap = move |c: Case| c.with(|o| o.softcap = softcap);
            cases.push(cap(predicting(Op::Grpo, shape)));
            cases.push(cap(predicting(Op::Grpo, shape).with(|o| {
                o.loss_type = LossType::Grpo;
                o.importance_sampling_level = ImportanceSamplingLevel::Sequence;
            })));
            let mut ce = cap(predicting(Op::CrossEntropy, shape).with(|o| o.label_smoothing = 0.1));
            ce.ignored = 0.3;
            cases.push(ce);
            cases.push(cap(predicting(Op::CrossEntropy, shape).with(|o| o.reduction = Reduction::None)));
            cases.push(cap(predicting(Op::Logprob, shape).with(|o| o.temperature = 0.7)));
            cases.push(cap(predicting(Op::Entropy, shape)));
        }
    }
    cases
}

/// Against the reference (through `forward_backward`, or `forward` for entropy), and in place
/// and forward-only the same tokens as into a new buffer.
fn check_all_dtypes(case: &Case) {
    let data = case.data();
    assert_data_matches_reference::<f32>(&data, 1e-5);
    assert_data_matches_reference::<bf16>(&data, 1e-2);
    assert_data_matches_reference::<f16>(&data, 1e-2);
    same_every_way::<f32>(&data);
    same_every_way::<bf16>(&data);
}

fn same_every_way<T: Element>(data: &Data) {
    let logits: Vec<T> = data.logits_as();
    let forward_only = forward(data.spec(), &logits).unwrap().predicted;
    assert!(forward_only.is_some(), "{:?}", data.case);
    if data.spec().has_gradient() {
        let mut grad = vec![T::default(); logits.len()];
        let into = forward_backward(data.spec(), &logits, &mut grad).unwrap().predicted;
        let mut in_place = logits.clone();
        let over = forward_backward_in_place(data.spec(), &mut in_place).unwrap().predicted;
        assert_eq!(into, forward_only, "{:?} {:?}", data.case, T::DTYPE);
        assert_eq!(over, forward_only, "{:?} {:?}", data.case, T::DTYPE);
    }
}

#[test]
fn every_op_matches_the_reference() {
    for case in cases() {
        check_all_dtypes(&case);
    }
}

#[test]
fn every_instruction_set_matches_the_reference() {
    common::on_every_instruction_set(&cases(), 4, check_all_dtypes);
}

#[test]
fn rows_that_take_no_part_predict_minus_one() {
    for mask in [MaskKind::None, MaskKind::Random(0.5), MaskKind::AllZero] {
        for op in [Op::Grpo, Op::CrossEntropy, Op::Logprob, Op::Entropy] {
            let mut case = predicting(op, (3, 4, 301));
            case.mask = mask;
            let data = case.data();
            let out = forward(data.spec(), &data.logits).unwrap();
            let predicted = out.predicted.unwrap();
            for (i, &p) in predicted.iter().enumerate() {
                let takes_part = data.mask.as_ref().is_none_or(|m| m[i] != 0.0);
                assert_eq!(p < 0, !takes_part, "row {i} of {case:?}: {p}");
                assert!(p < 301, "row {i} of {case:?}: {p}");
            }
            check_all_dtypes(&case);
        }
    }
    let mut ce = predicting(Op::CrossEntropy, (2, 8, 50));
    ce.ignored = 0.5;
    let data = ce.data();
    let predicted = forward(data.spec(), &data.logits).unwrap().predicted.unwrap();
    for (p, &y) in predicted.iter().zip(&data.targets) {
        assert_eq!(*p < 0, y == ce.options.ignore_index);
    }
}

#[test]
fn not_asked_for_none_is_computed() {
    let data = Case::new(Op::CrossEntropy, 2, 3, 40).data();
    assert_eq!(forward(data.spec(), &data.logits).unwrap().predicted, None);
    let data = Case::new(Op::Grpo, 2, 3, 40).data();
    let mut logits = data.logits.clone();
    assert_eq!(forward_backward_in_place(data.spec(), &mut logits).unwrap().predicted, None);
}

/// Rows whose largest logit is held by several columns: the first wins, whichever vector, tile or
/// instruction set the others fall in, in every dtype (bf16 and f16 make ties of near values).
#[test]
fn ties_go_to_the_first_column() {
    let v = 5000;
    let places: &[&[usize]] = &[&[3, 4], &[15, 16], &[0, 4999], &[2047, 2048], &[100, 2100, 4100], &[4998, 4999]];
    for isa in flashgrpo_kernels::Isa::available() {
        flashgrpo_kernels::with_isa(isa, || {
            for op in [Op::Grpo, Op::CrossEntropy, Op::Entropy] {
                let mut case = predicting(op, (1, places.len(), v));
                case.mask = MaskKind::None;
                let mut data = case.data();
                for (i, cols) in places.iter().enumerate() {
                    for &c in *cols {
                        data.logits[i * v + c] = 40.0;
                    }
                }
                let want: Vec<i64> = places.iter().map(|c| c[0] as i64).collect();
                assert_eq!(forward(data.spec(), &data.logits).unwrap().predicted.unwrap(), want, "{isa:?} {op:?}");
                let half: Vec<bf16> = data.logits_as();
                assert_eq!(forward(data.spec(), &half).unwrap().predicted.unwrap(), want, "{isa:?} {op:?} bf16");
                if data.spec().has_gradient() {
                    let mut logits: Vec<f16> = data.logits_as();
                    let got = forward_backward_in_place(data.spec(), &mut logits).unwrap().predicted;
                    assert_eq!(got.unwrap(), want, "{isa:?} {op:?} f16 in place");
                }
                assert_data_matches_reference::<f32>(&data, 1e-5);
            }
        });
    }
}

/// Statistics per vocabulary shard, combined, predict what the whole row does, a tie across two
/// shards included (the lower column, in whichever order the shards are given).
#[test]
fn vocabulary_shards_equal_unsharded() {
    for softcap in [None, Some(5.0)] {
        let mut case = predicting(Op::CrossEntropy, (2, 5, 5000)).with(|o| o.softcap = softcap);
        (case.ignored, case.mask) = (0.2, MaskKind::None);
        let mut data = case.data();
        data.targets[3] = 0;
        data.logits[3 * 5000 + 1200] = 60.0;
        data.logits[3 * 5000 + 3500] = 60.0;
        let (n, v) = (10, 5000);
        let whole = forward(data.spec(), &data.logits).unwrap().predicted.unwrap();
        assert_eq!(whole[3], 1200);
        let prepared = PreparedLoss::new(data.spec()).unwrap();
        let shard = |cols: &std::ops::Range<usize>| -> Vec<f32> {
            (0..n).flat_map(|i| data.logits[i * v + cols.start..i * v + cols.end].to_vec()).collect()
        };
        let mut partials: Vec<_> = [0, 1000, 3001, 5000]
            .windows(2)
            .map(|w| (w[0]..w[1], prepared.statistics(&shard(&(w[0]..w[1])), w[0]..w[1]).unwrap()))
            .collect();
        for _ in 0..2 {
            let (out, _) = prepared.objective(&combine_shards(v, &partials).unwrap()).unwrap();
            assert_eq!(out.predicted.as_ref(), Some(&whole), "softcap {softcap:?}");
            partials.reverse();
        }
    }
}

/// Statistics that carry no argmax (a caller's own exchange of shards' statistics that drops
/// it) are an error naming the row, not a panic.
#[test]
fn statistics_without_an_argmax_are_an_error() {
    let mut case = predicting(Op::CrossEntropy, (1, 4, 30));
    case.mask = MaskKind::None;
    let data = case.data();
    let prepared = PreparedLoss::new(data.spec()).unwrap();
    let mut stats = prepared.statistics(&data.logits, 0..30).unwrap();
    stats[2].argmax = None;
    let e = prepared.objective(&stats).unwrap_err().to_string();
    assert!(e.contains("row 2") && e.contains("predicted_tokens"), "{e}");
}

#[test]
fn the_same_for_any_thread_count() {
    let data = predicting(Op::Grpo, (4, 16, 3001)).data();
    let at = |threads: usize| -> LossOutput {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
        pool.install(|| forward_backward(data.spec(), &data.logits, &mut vec![0.0; data.logits.len()]).unwrap())
    };
    let one = at(1);
    assert_eq!(one, at(2));
    assert_eq!(one, at(5));
}

/// Fused-linear: the argmax of the chunk's logits, by the sweep (token level) and by the
/// statistics pass (sequence level, forward only), whatever the chunking; against the f64
/// logits, where a product's f32 rounding may turn a near tie (checked: within 1e-5).
#[test]
fn fused_linear_matches_the_reference() {
    let gspo = |c: Case| {
        c.with(|o| {
            o.loss_type = LossType::Grpo;
            o.importance_sampling_level = ImportanceSamplingLevel::Sequence;
        })
    };
    for (b, t, v) in [(1, 1, 1), (2, 3, 17), (2, 7, 1001)] {
        for softcap in [None, Some(3.0)] {
            let cap = |c: Case| c.with(|o| o.softcap = softcap);
            let mut ce = cap(predicting(Op::CrossEntropy, (b, t, v)));
            ce.ignored = 0.3;
            let cases = [
                cap(predicting(Op::Grpo, (b, t, v))),
                cap(gspo(predicting(Op::Grpo, (b, t, v)))),
                ce,
                cap(predicting(Op::Entropy, (b, t, v))),
            ];
            for case in cases {
                let data = case.data();
                let lin = linear_for(&case, 24, true);
                for budget in [ChunkBudget::default(), ChunkBudget::from_bytes(4 * (v + 64) * 2)] {
                    check_linear::<f32>(&data, &lin, budget);
                    check_linear::<bf16>(&data, &lin, budget);
                }
            }
        }
    }
}

fn check_linear<T: Element>(data: &Data, lin: &Linear, budget: ChunkBudget) {
    let cast = |v: &[f32]| -> Vec<T> { v.iter().map(|&x| T::from_f32(x)).collect() };
    let (hidden, weight) = (cast(&lin.hidden), cast(&lin.weight));
    let bias = lin.bias.as_deref().map(cast);
    let inputs = LinearInputs { hidden: &hidden, weight: &weight, bias: bias.as_deref(), hidden_size: lin.h };
    let spec = data.spec();
    let forward_only = linear_forward(spec, inputs, budget).unwrap().predicted;
    let got = if spec.has_gradient() {
        let (mut gh, mut gw) = (vec![0.0; hidden.len()], vec![0.0; weight.len()]);
        let grads = LinearGradients { hidden: &mut gh, weight: Some(&mut gw), bias: None, accumulate: false };
        let out = linear_forward_backward(spec, inputs, grads, budget).unwrap();
        assert_eq!(out.predicted, forward_only, "{:?} {:?}", data.case, T::DTYPE);
        out.predicted
    } else {
        forward_only
    };
    // The f64 logits of the rounded inputs, and the reference's argmax of them.
    let (n, v, h) = (data.case.batch * data.case.seq_len, data.case.vocab, lin.h);
    let wide = |x: &[T]| -> Vec<f64> { x.iter().map(|x| x.to_f32() as f64).collect() };
    let (hd, wd, bd) = (wide(&hidden), wide(&weight), bias.as_deref().map(wide));
    let logits: Vec<f64> = (0..n * v)
        .map(|k| {
            let (i, j) = (k / v, k % v);
            let dot: f64 = (0..h).map(|c| hd[i * h + c] * wd[j * h + c]).sum();
            dot + bd.as_ref().map_or(0.0, |b| b[j])
        })
        .collect();
    let want = reference::evaluate(spec, &logits).unwrap().predicted;
    let name = format!("{:?} {:?} {budget:?}", data.case, T::DTYPE);
    let (got, want) = (got.unwrap(), want.unwrap());
    let cap = |x: f64| data.case.options.softcap.map_or(x, |c| c * (x / c).tanh());
    for (i, (&g, &w)) in got.iter().zip(&want).enumerate() {
        if g == w {
            continue;
        }
        assert!(g >= 0 && w >= 0, "predicted[{i}] = {g} vs reference {w} in {name}");
        let (a, b) = (cap(logits[i * v + g as usize]), cap(logits[i * v + w as usize]));
        assert!((a - b).abs() <= 1e-5 * b.abs().max(1.0), "predicted[{i}] = {g} ({a}) vs {w} ({b}) in {name}");
    }
}

/// The fused-linear shards' statistics carry their argmax to the combined rows.
#[test]
fn fused_linear_shards_equal_unsharded() {
    let case = predicting(Op::CrossEntropy, (2, 5, 90));
    let data = case.data();
    let lin = linear_for(&case, 12, true);
    let h = 12;
    let bias = lin.bias.as_ref().unwrap();
    let whole_inputs = LinearInputs { hidden: &lin.hidden, weight: &lin.weight, bias: Some(bias), hidden_size: h };
    let whole = linear_forward(data.spec(), whole_inputs, ChunkBudget::default()).unwrap().predicted.unwrap();
    let prepared = PreparedLinearLoss::new(data.spec(), ChunkBudget::from_bytes(4 * 40 * 3)).unwrap();
    let shard = |c: &std::ops::Range<usize>| LinearInputs {
        hidden: &lin.hidden,
        weight: &lin.weight[c.start * h..c.end * h],
        bias: Some(&bias[c.clone()]),
        hidden_size: h,
    };
    let parts: Vec<_> = [0, 7, 40, 41, 90]
        .windows(2)
        .map(|w| (w[0]..w[1], prepared.statistics(shard(&(w[0]..w[1])), w[0]..w[1]).unwrap()))
        .collect();
    let (out, _) = prepared.objective(&combine_shards(90, &parts).unwrap()).unwrap();
    assert_eq!(out.predicted.unwrap(), whole);
}
