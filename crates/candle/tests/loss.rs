//! The candle loss ops: `loss.backward()` gives the kernels' gradients (checked against the f64
//! references), upstream gradients scale them, untracked inputs get none, and the fused-linear
//! op agrees with candle's own matmul + log-softmax composition.

use std::sync::Arc;

use candle_core::{DType, Device, Tensor, Var, D};
use flashgrpo_candle::{loss_from_hidden, loss_from_logits, LossInputs, LossKind};
use flashgrpo_kernels::linear::reference as linear_reference;
use flashgrpo_kernels::synthetic::{normal_matrix, SyntheticSpec};
use flashgrpo_kernels::{
    forward_backward, linear_forward_backward, reference, ChunkBudget, Element, LinearGradients, LinearInputs, Loss,
    LossOptions, LossSpec, PolicyInputs, RolloutCorrection, Rows,
};

const B: usize = 2;
const T: usize = 5;
const V: usize = 37;
const H: usize = 12;

fn inputs(kind_grpo: bool) -> (Arc<LossInputs>, flashgrpo_kernels::synthetic::SyntheticBatch) {
    let data =
        SyntheticSpec { batch: B, seq_len: T, vocab: V, seed: 3, logit_std: 2.0, logp_noise: 0.3, mask_fraction: 0.2 }
            .generate();
    let kind = if kind_grpo {
        LossKind::Grpo {
            advantages: data.advantages.clone(),
            old_logp: Some(data.old_logp.clone()),
            ref_logp: Some(data.ref_logp.clone()),
            is_ratio: None,
            // The sampler's log-probabilities, for a token-level rollout correction.
            sampling_logp: Some(data.old_logp.iter().map(|x| x + 0.05).collect()),
        }
    } else {
        LossKind::CrossEntropy { class_weights: None }
    };
    // GRPO with two of LOSSES.md's additions: a whole-batch one (the entropy quantile) and the
    // rollout correction from `sampling_logp`.
    let options = LossOptions {
        beta: 0.04,
        label_smoothing: 0.1,
        top_entropy_quantile: 0.5,
        vllm_importance_sampling_mode: RolloutCorrection::TokenTruncate,
        ..Default::default()
    };
    let inputs = LossInputs {
        kind,
        batch: B,
        seq_len: T,
        targets: Some(data.targets.clone()),
        mask: Some(data.mask.clone()),
        options,
        budget: ChunkBudget::from_bytes(4 * V * 3),
        batch_shard: None,
    };
    (Arc::new(inputs), data)
}

fn spec<'a>(i: &'a LossInputs, data: &'a flashgrpo_kernels::synthetic::SyntheticBatch) -> LossSpec<'a> {
    let loss = match &i.kind {
        LossKind::Grpo { sampling_logp, .. } => Loss::Grpo(PolicyInputs {
            advantages: &data.advantages,
            old_logp: Some(&data.old_logp),
            ref_logp: Some(&data.ref_logp),
            is_ratio: None,
            sampling_logp: sampling_logp.as_deref(),
        }),
        _ => Loss::CrossEntropy(Default::default()),
    };
    LossSpec {
        loss,
        rows: Rows { batch: B, seq_len: T, vocab: V, targets: Some(&data.targets), mask: Some(&data.mask) },
        options: &i.options,
        batch_shard: None,
    }
}

fn to_vec(t: &Tensor) -> Vec<f64> {
    t.to_dtype(DType::F64).unwrap().flatten_all().unwrap().to_vec1().unwrap()
}

fn rel_norm(got: &[f64], want: &[f64]) -> f64 {
    let d: f64 = got.iter().zip(want).map(|(a, b)| (a - b).powi(2)).sum();
    (d / want.iter().map(|b| b * b).sum::<f64>()).sqrt()
}

#[test]
fn logits_loss_backward_gives_the_reference_gradient() {
    for grpo in [true, false] {
        let (inputs, data) = inputs(grpo);
        let want =
            reference::evaluate(spec(&inputs, &data), &data.logits.iter().map(|&x| x as f64).collect::<Vec<_>>())
                .unwrap();
        let logits =
            Var::from_tensor(&Tensor::from_vec(data.logits.clone(), (B, T, V), &Device::Cpu).unwrap()).unwrap();
        let out = loss_from_logits(logits.as_tensor(), &inputs).unwrap();
        let loss = out.loss.to_scalar::<f32>().unwrap() as f64;
        assert!((loss - want.loss).abs() < 1e-5 * want.loss.abs().max(1.0));
        assert_eq!(out.per_token_loss.dims(), [B, T]);
        let pt = to_vec(&out.per_token_loss);
        assert!(pt.iter().zip(&want.per_token_loss).all(|(a, b)| (a - b).abs() < 1e-5 * b.abs().max(1.0)));
        // An upstream gradient of 3 (loss * 3) scales the gradient.
        let grads = (out.loss * 3.0).unwrap().backward().unwrap();
        let g = to_vec(grads.get(&logits).unwrap());
        let want3: Vec<f64> = want.grad.unwrap().iter().map(|x| 3.0 * x).collect();
        assert!(rel_norm(&g, &want3) < 1e-5);
    }
}

#[test]
fn untracked_logits_cost_no_gradient() {
    let (inputs, data) = inputs(true);
    let logits = Tensor::from_vec(data.logits.clone(), (B, T, V), &Device::Cpu).unwrap();
    let out = loss_from_logits(&logits, &inputs).unwrap();
    assert!(!out.loss.track_op());
    let bf = logits.to_dtype(DType::BF16).unwrap();
    let out16 = loss_from_logits(&bf, &inputs).unwrap();
    assert!((out16.loss.to_scalar::<f32>().unwrap() - out.loss.to_scalar::<f32>().unwrap()).abs() < 0.05);
}

/// An entropy (no gradient) on a tracked input is a constant in a larger graph: the backward of
/// a loss that adds it gives the other loss's gradient alone. A `[1, V]` bias is refused up front.
#[test]
fn entropy_is_a_constant_and_a_bias_must_be_a_vector() {
    let (grpo, data) = inputs(true);
    let entropy = Arc::new(LossInputs { kind: LossKind::Entropy, targets: None, ..(*grpo).clone() });
    let logits = Var::from_tensor(&Tensor::from_vec(data.logits.clone(), (B, T, V), &Device::Cpu).unwrap()).unwrap();
    let policy = loss_from_logits(logits.as_tensor(), &grpo).unwrap();
    let bonus = loss_from_logits(logits.as_tensor(), &entropy).unwrap();
    assert!(!bonus.loss.track_op());
    let both = (policy.loss.clone() - (bonus.loss * 0.01).unwrap()).unwrap();
    let got = to_vec(both.backward().unwrap().get(&logits).unwrap());
    let alone = loss_from_logits(logits.as_tensor(), &grpo).unwrap();
    assert_eq!(got, to_vec(alone.loss.backward().unwrap().get(&logits).unwrap()));

    let hidden = Tensor::from_vec(normal_matrix(B * T, H, 1.0, 21), (B, T, H), &Device::Cpu).unwrap();
    let weight = Tensor::from_vec(normal_matrix(V, H, 0.5, 22), (V, H), &Device::Cpu).unwrap();
    let bias = Tensor::zeros((1, V), DType::F32, &Device::Cpu).unwrap();
    let err = loss_from_hidden(&hidden, &weight, Some(&bias), &grpo).expect_err("an error").to_string();
    assert!(err.contains("bias") && err.contains("[V]"), "{err}");
}

#[test]
fn fused_linear_backward_gives_the_reference_gradients() {
    for grpo in [true, false] {
        let (inputs, data) = inputs(grpo);
        let hidden = normal_matrix(B * T, H, 1.0, 21);
        let weight = normal_matrix(V, H, 0.5, 22);
        let bias = normal_matrix(1, V, 0.3, 23);
        let to64 = |v: &[f32]| -> Vec<f64> { v.iter().map(|&x| x as f64).collect() };
        let want =
            linear_reference::evaluate(spec(&inputs, &data), &to64(&hidden), &to64(&weight), Some(&to64(&bias)), H)
                .unwrap();
        let dev = Device::Cpu;
        let h = Var::from_tensor(&Tensor::from_vec(hidden.clone(), (B, T, H), &dev).unwrap()).unwrap();
        let w = Var::from_tensor(&Tensor::from_vec(weight.clone(), (V, H), &dev).unwrap()).unwrap();
        let b = Var::from_tensor(&Tensor::from_vec(bias.clone(), V, &dev).unwrap()).unwrap();
        let out = loss_from_hidden(h.as_tensor(), w.as_tensor(), Some(b.as_tensor()), &inputs).unwrap();
        let loss = out.loss.to_scalar::<f32>().unwrap() as f64;
        assert!((loss - want.output.loss).abs() < 1e-4 * want.output.loss.abs().max(1.0));
        let grads = out.loss.backward().unwrap();
        assert!(rel_norm(&to_vec(grads.get(&h).unwrap()), want.grad_hidden.as_ref().unwrap()) < 1e-4);
        assert!(rel_norm(&to_vec(grads.get(&w).unwrap()), want.grad_weight.as_ref().unwrap()) < 1e-4);
        assert!(rel_norm(&to_vec(grads.get(&b).unwrap()), want.grad_bias.as_ref().unwrap()) < 1e-4);

        // A frozen lm_head (a plain tensor) gets no gradient and costs no product.
        let frozen = Tensor::from_vec(weight.clone(), (V, H), &dev).unwrap();
        let out = loss_from_hidden(h.as_tensor(), &frozen, None, &inputs).unwrap();
        let grads = out.loss.backward().unwrap();
        assert!(grads.get(&frozen).is_none());
        assert!(grads.get(&h).is_some());
    }
}

#[test]
fn fused_linear_agrees_with_candle_matmul_and_log_softmax() {
    // Cross-entropy without smoothing, composed from candle ops on the materialised logits.
    let (inputs, data) = inputs(false);
    let inputs = Arc::new(LossInputs { options: LossOptions::default(), ..(*inputs).clone() });
    let dev = Device::Cpu;
    let h = Var::from_tensor(&Tensor::from_vec(normal_matrix(B * T, H, 1.0, 31), (B, T, H), &dev).unwrap()).unwrap();
    let w = Var::from_tensor(&Tensor::from_vec(normal_matrix(V, H, 0.5, 32), (V, H), &dev).unwrap()).unwrap();
    let ours = loss_from_hidden(h.as_tensor(), w.as_tensor(), None, &inputs).unwrap();
    let g_ours = ours.loss.backward().unwrap();

    let logits = h.as_tensor().reshape((B * T, H)).unwrap().matmul(&w.as_tensor().t().unwrap()).unwrap();
    let lse = {
        let m = logits.max_keepdim(D::Minus1).unwrap().detach();
        (logits.broadcast_sub(&m).unwrap().exp().unwrap().sum_keepdim(D::Minus1).unwrap().log().unwrap() + m).unwrap()
    };
    let ids: Vec<u32> = data.targets.iter().map(|&y| y as u32).collect();
    let ids = Tensor::from_vec(ids, (B * T, 1), &dev).unwrap();
    let nll = (lse - logits.gather(&ids, 1).unwrap()).unwrap().squeeze(1).unwrap();
    let mask = Tensor::from_vec(data.mask.clone(), B * T, &dev).unwrap();
    let count: f32 = data.mask.iter().sum();
    let slow = ((nll * mask).unwrap().sum_all().unwrap() / count as f64).unwrap();
    let g_slow = slow.backward().unwrap();
    assert!((ours.loss.to_scalar::<f32>().unwrap() - slow.to_scalar::<f32>().unwrap()).abs() < 1e-5);
    for v in [&h, &w] {
        let (a, b) = (to_vec(g_ours.get(v).unwrap()), to_vec(g_slow.get(v).unwrap()));
        assert!(rel_norm(&a, &b) < 1e-5, "{}", rel_norm(&a, &b));
    }
}

/// The 16-bit ops' gradients are the kernels' own, rounded once: the logits-level op's is what
/// the kernel writes into a buffer of the logits' dtype, the fused-linear op's the kernel's f32
/// gradients rounded to nearest even (on every thread: the weight's gradient here is 210,003
/// values, several of the conversion's chunks and a partial one).
#[test]
fn sixteen_bit_ops_return_the_kernels_gradients_rounded_once() {
    fn check<T: Element + candle_core::WithDType>() {
        const B2: usize = 2;
        const T2: usize = 3;
        const V2: usize = 70_001;
        const H2: usize = 3;
        let synthetic = SyntheticSpec {
            batch: B2,
            seq_len: T2,
            vocab: V2,
            seed: 5,
            logit_std: 2.0,
            logp_noise: 0.3,
            mask_fraction: 0.2,
        };
        let data = synthetic.generate();
        // One row a chunk: the weight's gradient accumulates over every row taking part.
        let budget = ChunkBudget::from_bytes(4 * V2 * 2);
        let inputs = Arc::new(data.grpo_inputs(&synthetic, LossOptions::default(), budget));
        // Masked rows too (their gradient rows must come back as zeros).
        assert!(data.mask.contains(&0.0) && data.mask.contains(&1.0));
        let dev = Device::Cpu;
        let dtype = <T as candle_core::WithDType>::DTYPE;
        let values = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<T>().unwrap();
        let same = |got: &[T], want: &[T], what: &str| {
            assert_eq!(got.len(), want.len());
            assert!(want.iter().any(|w| w.to_f32() != 0.0), "{dtype:?} {what}: all zeros");
            let first = got.iter().zip(want).position(|(g, w)| g.to_f32() != w.to_f32());
            assert!(first.is_none(), "{dtype:?} {what}: element {first:?} differs");
        };

        let logits = Var::from_tensor(
            &Tensor::from_vec(data.logits.clone(), (B2, T2, V2), &dev).unwrap().to_dtype(dtype).unwrap(),
        )
        .unwrap();
        let out = loss_from_logits(logits.as_tensor(), &inputs).unwrap();
        let grads = out.loss.backward().unwrap();
        let rounded = values(logits.as_tensor());
        let mut want = vec![T::from_f32(1.0); rounded.len()];
        forward_backward(inputs.spec(V2), &rounded, &mut want).unwrap();
        same(&values(grads.get(&logits).unwrap()), &want, "logits' gradient");

        let h = Var::from_tensor(
            &Tensor::from_vec(normal_matrix(B2 * T2, H2, 1.0, 41), (B2, T2, H2), &dev)
                .unwrap()
                .to_dtype(dtype)
                .unwrap(),
        )
        .unwrap();
        let w = Var::from_tensor(
            &Tensor::from_vec(normal_matrix(V2, H2, 0.5, 42), (V2, H2), &dev).unwrap().to_dtype(dtype).unwrap(),
        )
        .unwrap();
        let out = loss_from_hidden(h.as_tensor(), w.as_tensor(), None, &inputs).unwrap();
        let grads = out.loss.backward().unwrap();
        let (hv, wv) = (values(h.as_tensor()), values(w.as_tensor()));
        let (mut gh, mut gw) = (vec![0.0f32; hv.len()], vec![0.0f32; wv.len()]);
        let target = LinearGradients { hidden: &mut gh, weight: Some(&mut gw), bias: None, accumulate: false };
        let linear = LinearInputs { hidden: &hv, weight: &wv, bias: None, hidden_size: H2 };
        linear_forward_backward(inputs.spec(V2), linear, target, inputs.budget).unwrap();
        let round = |v: &[f32]| v.iter().map(|&x| T::from_f32(x)).collect::<Vec<T>>();
        same(&values(grads.get(&h).unwrap()), &round(&gh), "hidden's gradient");
        same(&values(grads.get(&w).unwrap()), &round(&gw), "weight's gradient");
    }
    check::<half::bf16>();
    check::<half::f16>();
}
