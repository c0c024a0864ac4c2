//! The engine against its reference, the candle model (itself checked against Hugging Face
//! transformers and candle-transformers): the completion positions' hidden states, the GRPO loss
//! and every parameter's gradient of an update (three head implementations, shared and distinct
//! prompts, ragged completions, tied and untied heads, bf16 parameters), and generation: greedy
//! tokens equal to candle's generation, sampled tokens equal where the numerics allow and the
//! same for any thread count.

use std::sync::Arc;

use candle_core::{DType, Device, Tensor};
use flashgrpo_candle::LossKind;
use flashgrpo_kernels::synthetic::{normal_matrix, Rng};
use flashgrpo_kernels::{BatchShard, LossOptions};
use flashgrpo_train::engine::{
    backward, forward, BackwardBuffers, Head, HeadGradients, Input, Packing, Pass, Weights, Workspace,
};
use flashgrpo_train::grpo::batch::MicroBatch;
use flashgrpo_train::model::{generate, Qwen2, Qwen2Config, Sampling};
use flashgrpo_train::optim::GradBuffers;
use flashgrpo_train::rollout::Rollout;
use flashgrpo_train::{head_loss, LossConfig, LossImpl};

fn config(tied: bool) -> Qwen2Config {
    let mut c = Qwen2Config::tiny(97, 32, 2, 4, 2);
    c.tie_word_embeddings = tied;
    c.intermediate_size = 48;
    c.max_position_embeddings = 64;
    c
}

/// A random model whose parameters are all non-trivial (norm weights and biases too).
fn model(tied: bool, dtype: DType, seed: u64) -> Qwen2 {
    let m = Qwen2::random(config(tied), dtype, seed).unwrap();
    for (i, (name, var)) in m.params.iter().enumerate() {
        let n = var.elem_count();
        let v: Vec<f32> = if name.ends_with("norm.weight") || name.ends_with(".bias") {
            let base = if name.ends_with("norm.weight") { 1.0 } else { 0.0 };
            normal_matrix(1, n, 0.1, 1000 + i as u64).into_iter().map(|x| x + base).collect()
        } else {
            // Larger than the default initialisation, so that attention is not uniform.
            normal_matrix(1, n, 0.15, 2000 + i as u64)
        };
        var.set(&Tensor::from_vec(v, var.dims(), &Device::Cpu).unwrap().to_dtype(dtype).unwrap()).unwrap();
    }
    m
}

/// Prompts (two shared by several sequences, as in a GRPO group) and ragged completions.
fn batch(seed: u64) -> (Vec<Vec<u32>>, Vec<Vec<u32>>) {
    let mut rng = Rng::new(seed);
    let mut token = || rng.below(97) as u32;
    let a: Vec<u32> = (0..7).map(|_| token()).collect();
    let b: Vec<u32> = (0..3).map(|_| token()).collect();
    let c: Vec<u32> = (0..5).map(|_| token()).collect();
    let prompts = vec![a.clone(), a.clone(), b.clone(), a, c, b];
    let lengths = [4, 1, 6, 2, 5, 3];
    let completions = lengths.iter().map(|&n| (0..n).map(|_| token()).collect()).collect();
    (prompts, completions)
}

fn rel_err(got: &[f32], want: &[f32]) -> f64 {
    let num: f64 = got.iter().zip(want).map(|(a, b)| (*a as f64 - *b as f64).powi(2)).sum();
    let den: f64 = want.iter().map(|b| (*b as f64).powi(2)).sum();
    (num / den.max(1e-30)).sqrt()
}

fn refs(v: &[Vec<u32>]) -> Vec<&[u32]> {
    v.iter().map(Vec::as_slice).collect()
}

/// The engine's final hidden states at the loss rows equal candle's at the completion positions.
#[test]
fn hidden_states_match_the_candle_model() {
    for tied in [true, false] {
        let m = model(tied, DType::F32, 3);
        let (prompts, completions) = batch(5);
        let mb = MicroBatch::new(&refs(&prompts), &refs(&completions), 0).unwrap();
        let want: Vec<f32> = mb.completion_hidden(&m, false).unwrap().flatten_all().unwrap().to_vec1().unwrap();
        let packing = Packing::new(&refs(&prompts), &refs(&completions)).unwrap();
        let w = Weights::of(&m).unwrap();
        let mut ws = Workspace::default();
        for pass in [Pass::Train, Pass::Score] {
            let input = Input { tokens: &packing.tokens, positions: &packing.positions, queries: &packing.queries };
            forward(&w, input, &mut ws, pass).unwrap();
            let got = packing.gather(&ws.hidden, 32);
            let h = 32;
            for (row, slot) in packing.loss_slots.iter().enumerate() {
                let (g, e) = (&got[row * h..(row + 1) * h], &want[row * h..(row + 1) * h]);
                if slot.is_some() {
                    assert!(rel_err(g, e) < 2e-6, "tied={tied} row {row}: {}", rel_err(g, e));
                } else {
                    assert!(g.iter().all(|&x| x == 0.0));
                }
            }
        }
    }
}

struct Update {
    loss: f64,
    grads: GradBuffers,
}

fn grpo_inputs(mb: &MicroBatch, options: &LossOptions, loss: &LossConfig, s: usize) -> flashgrpo_candle::LossInputs {
    let mut rng = Rng::new(9);
    let n = mb.targets.len();
    let advantages: Vec<f32> = (0..s).map(|_| rng.normal() as f32).collect();
    // Old and reference log-probabilities near the model's (about -4.6 for 97 tokens).
    let near = |rng: &mut Rng| -> Vec<f32> { (0..n).map(|_| (-4.6 + 0.3 * rng.normal()) as f32).collect() };
    let kind = LossKind::Grpo {
        advantages,
        old_logp: Some(near(&mut rng)),
        ref_logp: Some(near(&mut rng)),
        is_ratio: None,
        sampling_logp: None,
    };
    let shard = BatchShard::counts(s + 3, mb.valid() as f64 + 11.0);
    mb.inputs(kind, options, loss, Some(shard))
}

/// candle's update: the model's graph, the head's loss, candle's backward.
fn candle_update(
    m: &Qwen2,
    prompts: &[Vec<u32>],
    completions: &[Vec<u32>],
    implementation: LossImpl,
    options: &LossOptions,
) -> Update {
    let loss = LossConfig { implementation, ..LossConfig::default() };
    let mb = MicroBatch::new(&refs(prompts), &refs(completions), 0).unwrap();
    let inputs = Arc::new(grpo_inputs(&mb, options, &loss, prompts.len()));
    let hidden = mb.completion_hidden(m, true).unwrap();
    let out = head_loss(m, &hidden, &inputs, implementation, true).unwrap();
    let mut grads = GradBuffers::new(&m.params);
    grads.add(&m.params, &out.loss.backward().unwrap()).unwrap();
    Update { loss: out.loss.to_dtype(DType::F64).unwrap().to_scalar::<f64>().unwrap(), grads }
}

/// The engine's update: packed forward, the head, backward.
fn engine_update(
    m: &Qwen2,
    prompts: &[Vec<u32>],
    completions: &[Vec<u32>],
    implementation: LossImpl,
    options: &LossOptions,
) -> Update {
    let loss = LossConfig { implementation, ..LossConfig::default() };
    let mb = MicroBatch::new(&refs(prompts), &refs(completions), 0).unwrap();
    let inputs = grpo_inputs(&mb, options, &loss, prompts.len());
    let packing = Packing::new(&refs(prompts), &refs(completions)).unwrap();
    let w = Weights::of(m).unwrap();
    let (mut ws, mut bufs) = (Workspace::default(), BackwardBuffers::default());
    let mut grads = GradBuffers::new(&m.params);
    let input = Input { tokens: &packing.tokens, positions: &packing.positions, queries: &packing.queries };
    forward(&w, input, &mut ws, Pass::Train).unwrap();
    let h = w.dims.hidden;
    let rows = packing.gather(&ws.hidden, h);
    let mut d_rows = vec![0.0f32; rows.len()];
    let head = Head { weights: &w, lm_head: m.lm_head(), implementation };
    let (value, _) = head.loss(&rows, &inputs, Some(HeadGradients { rows: &mut d_rows, grads: &mut grads })).unwrap();
    let d_slots = packing.scatter(&d_rows, h);
    backward(&w, &packing, &mut ws, &mut bufs, &d_slots, &mut grads, &mut |_, _| {});
    Update { loss: value, grads }
}

fn compare(m: &Qwen2, want: &Update, got: &Update, tolerance: f64, what: &str) {
    assert!(
        (want.loss - got.loss).abs() <= tolerance * want.loss.abs().max(1e-3),
        "{what}: loss {} vs {}",
        got.loss,
        want.loss
    );
    for (i, (name, _)) in m.params.iter().enumerate() {
        let (g, e) = (got.grads.get(i), want.grads.get(i));
        assert!(e.iter().any(|&x| x != 0.0), "{what}: {name} has no gradient in the reference");
        let err = rel_err(g, e);
        assert!(err < tolerance, "{what}: {name}: relative error {err:.2e}");
    }
}

/// Every parameter's gradient of a GRPO update equals candle autograd's, for the three head
/// implementations (each against the reference with the same head), tied and untied.
#[test]
fn update_gradients_match_candle_autograd() {
    let (prompts, completions) = batch(7);
    let options = LossOptions { beta: 0.04, epsilon_high: Some(0.28), ..LossOptions::default() };
    for tied in [true, false] {
        let m = model(tied, DType::F32, 4);
        for implementation in [LossImpl::FusedLinear, LossImpl::Fused, LossImpl::Baseline] {
            let want = candle_update(&m, &prompts, &completions, implementation, &options);
            let got = engine_update(&m, &prompts, &completions, implementation, &options);
            compare(&m, &want, &got, 2e-5, &format!("tied={tied} {}", implementation.name()));
        }
    }
    // Sequence-level importance sampling (a two-pass objective) and the entropy bonus.
    let options = LossOptions {
        importance_sampling_level: flashgrpo_kernels::ImportanceSamplingLevel::Sequence,
        loss_type: flashgrpo_kernels::LossType::Grpo,
        entropy_coef: 0.01,
        ..LossOptions::default()
    };
    let m = model(true, DType::F32, 6);
    let want = candle_update(&m, &prompts, &completions, LossImpl::FusedLinear, &options);
    let got = engine_update(&m, &prompts, &completions, LossImpl::FusedLinear, &options);
    compare(&m, &want, &got, 2e-5, "gspo + entropy bonus");
}

/// A zero gradient of the final hidden states (a micro-batch whose advantages are all zero, with
/// no KL or entropy term: GRPO's groups of equal rewards) adds nothing: every gradient buffer
/// keeps its bits, and every layer is still handed over, the last first, as a data-parallel
/// update waits for them.
#[test]
fn a_zero_hidden_gradient_adds_nothing_and_hands_over_every_layer() {
    let m = model(true, DType::F32, 4);
    let (prompts, completions) = batch(7);
    let packing = Packing::new(&refs(&prompts), &refs(&completions)).unwrap();
    let w = Weights::of(&m).unwrap();
    let (mut ws, mut bufs) = (Workspace::default(), BackwardBuffers::default());
    let input = Input { tokens: &packing.tokens, positions: &packing.positions, queries: &packing.queries };
    forward(&w, input, &mut ws, Pass::Train).unwrap();
    let mut grads = GradBuffers::new(&m.params);
    for i in 0..m.params.len() {
        grads.get_mut(i).iter_mut().enumerate().for_each(|(j, g)| *g = (j as f32 * 0.37 + i as f32).sin());
    }
    let before: Vec<Vec<f32>> = (0..m.params.len()).map(|i| grads.get(i).to_vec()).collect();
    // The head's gradient rows of a batch whose advantages are all zero (dapo, no KL): zero.
    let loss = LossConfig::default();
    let mb = MicroBatch::new(&refs(&prompts), &refs(&completions), 0).unwrap();
    let mut inputs = grpo_inputs(&mb, &LossOptions::default(), &loss, prompts.len());
    if let LossKind::Grpo { advantages, .. } = &mut inputs.kind {
        advantages.iter_mut().for_each(|a| *a = 0.0);
    }
    let rows = packing.gather(&ws.hidden, w.dims.hidden);
    let mut d_rows = vec![1.0f32; rows.len()];
    let mut head_grads = GradBuffers::new(&m.params);
    let head = Head { weights: &w, lm_head: m.lm_head(), implementation: LossImpl::FusedLinear };
    head.loss(&rows, &inputs, Some(HeadGradients { rows: &mut d_rows, grads: &mut head_grads })).unwrap();
    assert!(d_rows.iter().all(|&g| g == 0.0), "zero advantages without KL must give a zero gradient");
    let d_slots = packing.scatter(&d_rows, w.dims.hidden);
    let mut handed = Vec::new();
    backward(&w, &packing, &mut ws, &mut bufs, &d_slots, &mut grads, &mut |l, _| handed.push(l));
    assert_eq!(handed, (0..w.dims.layers).rev().collect::<Vec<_>>());
    for (i, (name, _)) in m.params.iter().enumerate() {
        let same = grads.get(i).iter().zip(&before[i]).all(|(a, b)| a.to_bits() == b.to_bits());
        assert!(same, "{name}: a zero d_hidden changed its gradient");
    }
}

/// bf16 parameters, every way this machine has (`Widened`: f32 products of the widened weights;
/// on AMX, the layers' and the head's bf16 products with the activations rounded to bf16, the
/// gradients split or rounded), tied and untied, against candle computing in bf16: they agree to
/// bf16's precision.
#[test]
fn bf16_parameters_train_to_bf16_precision() {
    use flashgrpo_kernels::{with_bf16_products, Bf16Products};
    let (prompts, completions) = batch(8);
    let options = LossOptions::default();
    for tied in [true, false] {
        let m = model(tied, DType::BF16, 5);
        let want = candle_update(&m, &prompts, &completions, LossImpl::FusedLinear, &options);
        for products in Bf16Products::available() {
            let got = with_bf16_products(products, || {
                engine_update(&m, &prompts, &completions, LossImpl::FusedLinear, &options)
            });
            println!("bf16, tied={tied}, {products:?}: loss {} (candle {})", got.loss, want.loss);
            compare(&m, &want, &got, 5e-2, &format!("bf16 tied={tied} {products:?}"));
        }
    }
}

/// Greedy generation gives candle's tokens (ragged prompts, prompts shared by several rows, rows
/// stopping at end-of-sequence at different steps).
#[test]
fn greedy_generation_matches_the_candle_model() {
    let m = model(true, DType::F32, 3);
    let (prompts, _) = batch(9);
    let greedy = Sampling { temperature: 0.0, max_new_tokens: 12, ..Default::default() };
    for eos in [vec![96u32], vec![5, 17, 40]] {
        let want = generate(&m, &prompts, &greedy, &eos, 0, &mut Rng::new(1)).unwrap();
        let got = Rollout::default().generate(&m, &prompts, &greedy, &eos, &mut Rng::new(1)).unwrap();
        assert_eq!(got, want, "eos {eos:?}");
    }
}

/// Sampled generation: the same tokens as candle's where the last-bit differences of the logits
/// do not move a draw (all but rare rows), and the same tokens for one thread as for two.
#[test]
fn sampled_generation_matches_and_does_not_depend_on_threads() {
    let m = model(false, DType::F32, 4);
    let (prompts, _) = batch(10);
    let prompts: Vec<Vec<u32>> = prompts.iter().cycle().take(48).cloned().collect();
    let s = Sampling { temperature: 1.0, max_new_tokens: 10, ..Default::default() };
    let want = generate(&m, &prompts, &s, &[3], 0, &mut Rng::new(2)).unwrap();
    let got = Rollout::default().generate(&m, &prompts, &s, &[3], &mut Rng::new(2)).unwrap();
    let same = want.completions.iter().zip(&got.completions).filter(|(a, b)| a == b).count();
    assert!(same >= 46, "{same} of 48 completions equal");
    let one = rayon::ThreadPoolBuilder::new().num_threads(1).build().unwrap();
    let single = one.install(|| Rollout::default().generate(&m, &prompts, &s, &[3], &mut Rng::new(2)).unwrap());
    assert_eq!(single, got);
}

/// The repetition penalty and min-p: the engine's tokens are candle's (greedy, so that the
/// penalty alone decides, and sampled, where last-bit differences of the logits may move one
/// draw), and the penalty changes the greedy completions (a tiny random model repeats itself).
#[test]
fn repetition_penalty_and_min_p_match_the_candle_model() {
    let m = model(true, DType::F32, 3);
    let (prompts, _) = batch(9);
    let plain = Sampling { temperature: 0.0, max_new_tokens: 12, ..Default::default() };
    let penalised = Sampling { repetition_penalty: 1.8, ..plain };
    let unpenalised = Rollout::default().generate(&m, &prompts, &plain, &[96], &mut Rng::new(1)).unwrap();
    let want = generate(&m, &prompts, &penalised, &[96], 0, &mut Rng::new(1)).unwrap();
    let got = Rollout::default().generate(&m, &prompts, &penalised, &[96], &mut Rng::new(1)).unwrap();
    assert_eq!(got, want);
    assert_ne!(got.completions, unpenalised.completions);
    let sampled = Sampling { temperature: 1.0, min_p: 0.2, repetition_penalty: 1.3, ..plain };
    let want = generate(&m, &prompts, &sampled, &[96], 0, &mut Rng::new(4)).unwrap();
    let got = Rollout::default().generate(&m, &prompts, &sampled, &[96], &mut Rng::new(4)).unwrap();
    let same = want.completions.iter().zip(&got.completions).filter(|(a, b)| a == b).count();
    assert!(same + 1 >= prompts.len(), "{same} of {} completions equal", prompts.len());
}

/// Tokens outside the vocabulary and positions beyond the rotary table are errors, not panics.
#[test]
fn bad_rows_are_errors() {
    let m = model(true, DType::F32, 3);
    let w = Weights::of(&m).unwrap();
    let p = Packing::new(&[&[1, 2, 3][..]], &[&[4, 5][..]]).unwrap();
    let mut ws = Workspace::default();
    let mut tokens = p.tokens.clone();
    tokens[1] = 97;
    let e = forward(&w, Input { tokens: &tokens, ..p.input() }, &mut ws, Pass::Score).unwrap_err().to_string();
    assert!(e.contains("row 1") && e.contains("vocabulary"), "{e}");
    let positions: Vec<u32> = p.positions.iter().map(|&x| x + 62).collect();
    let e = forward(&w, Input { positions: &positions, ..p.input() }, &mut ws, Pass::Score).unwrap_err().to_string();
    assert!(e.contains("position 64") && e.contains("max_position_embeddings"), "{e}");
    let long = Sampling { temperature: 0.0, max_new_tokens: 62, ..Default::default() };
    let e = Rollout::default().generate(&m, &[vec![1, 2, 3]], &long, &[0], &mut Rng::new(1)).unwrap_err().to_string();
    assert!(e.contains("max_position_embeddings"), "{e}");
}

/// The log-probabilities and entropies the sampler records are the kernels' `logprob` op on the
/// decode step's logits: the update's scoring pass of the same tokens with the same weights gives
/// them again up to the rounding of two different forward paths (the KV-cached decode against
/// the packed forward of whole sequences), and `mask_sequences` drops the truncated ones.
#[test]
fn recorded_log_probabilities_match_the_update() {
    use flashgrpo_train::grpo::update::UpdateBatch;
    let m = model(false, DType::F32, 11);
    let prompts: Vec<Vec<u32>> = vec![vec![3, 5, 7], vec![3, 5, 7], vec![11, 2], vec![11, 2], vec![4]];
    let s = Sampling { temperature: 0.9, max_new_tokens: 6, ..Default::default() };
    let generated = Rollout::default().generate(&m, &prompts, &s, &[0], &mut Rng::new(7)).unwrap();
    for (c, (lp, h)) in generated.completions.iter().zip(generated.logp.iter().zip(&generated.entropy)) {
        assert_eq!((lp.len(), h.len()), (c.len(), c.len()));
        assert!(lp.iter().all(|&x| x <= 0.0 && x.is_finite()) && h.iter().all(|&x| x >= 0.0));
    }
    let mut batch = UpdateBatch::new(&prompts, &generated.completions, 2, 0).unwrap();
    let options = LossOptions { temperature: 0.9, ..LossOptions::default() };
    let scored = batch.logprobs(&m, &mut Workspace::default(), &options, &LossConfig::default()).unwrap();
    let recorded = batch.per_micro_batch(&generated.logp);
    let worst =
        scored.iter().flatten().zip(recorded.iter().flatten()).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
    println!("sampler vs update log-probabilities: max |diff| = {worst:e}");
    assert!(worst < 1e-5, "{worst}");
    // Greedy decoding records nothing.
    let greedy = Sampling { temperature: 0.0, ..s };
    let g = Rollout::default().generate(&m, &prompts, &greedy, &[0], &mut Rng::new(7)).unwrap();
    assert!(g.logp.is_empty() && g.entropy.is_empty());
    // TRL's mask_truncated_completions: the dropped sequences leave the loss and the count.
    let before = batch.valid_tokens();
    let drop: Vec<bool> = generated.finished.iter().map(|f| !f).collect();
    batch.mask_sequences(&drop);
    let kept: usize = generated.completions.iter().zip(&drop).filter(|(_, &d)| !d).map(|(c, _)| c.len()).sum();
    assert_eq!(batch.valid_tokens(), kept);
    assert!(kept <= before);
    // The top-entropy threshold of the whole batch, from the recorded entropies of kept tokens.
    batch.share_entropy_threshold(&generated.entropy, 0.5, &flashgrpo_collective::SingleProcess).unwrap();
    let mut h: Vec<f64> = generated
        .entropy
        .iter()
        .zip(&drop)
        .filter(|(_, &d)| !d)
        .flat_map(|(e, _)| e.iter().map(|&x| x as f64))
        .collect();
    h.sort_by(f64::total_cmp);
    if let Some(&top) = h.last() {
        let want = flashgrpo_kernels::quantile(&h, 0.5);
        assert_eq!(batch.shard.entropy_threshold, Some(want));
        assert_eq!(batch.shard.global_bonus_rows, Some(h.iter().filter(|&&x| x >= want).count() as f64));
        assert!(want <= top);
    }
}
