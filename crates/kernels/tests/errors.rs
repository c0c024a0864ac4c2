//! Bad input gets a clear error naming the tensor, row or option, and in-place callers keep
//! their logits untouched.

mod common;

use common::{Case, Op};
use flashgrpo_kernels::{
    forward, forward_backward, forward_backward_in_place, IsRatio, Loss, LossOptions, LossSpec, LossType, PolicyInputs,
    Rows,
};

fn err_of(spec: LossSpec<'_>, logits: &[f32]) -> String {
    forward(spec, logits).unwrap_err().to_string()
}

#[test]
fn target_out_of_range_names_the_row() {
    let mut data = Case::new(Op::CrossEntropy, 2, 3, 10).data();
    data.mask = None;
    data.targets[4] = 10;
    let e = err_of(data.spec(), &data.logits);
    assert!(e.contains("targets[1, 1] (row 4) = 10") && e.contains("[0, 10)"), "{e}");
    data.targets[4] = -5;
    assert!(err_of(data.spec(), &data.logits).contains("= -5"));
    // Masked or ignored rows may hold anything.
    data.targets[4] = -100;
    forward(data.spec(), &data.logits).unwrap();
    let mut mask = vec![1.0; 6];
    mask[4] = 0.0;
    data.mask = Some(mask);
    data.targets[4] = 12345;
    forward(data.spec(), &data.logits).unwrap();
}

#[test]
fn non_finite_logits_name_the_lowest_row() {
    for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
        let mut data = Case::new(Op::Grpo, 2, 3, 5000).data();
        data.mask = None;
        data.logits[4 * 5000 + 4321] = bad;
        data.logits[5 * 5000 + 7] = bad;
        let e = err_of(data.spec(), &data.logits);
        assert!(e.contains("logits row 4 (b = 1, t = 1) contains NaN or Inf"), "{bad}: {e}");
        let mut logits = data.logits.clone();
        let e = forward_backward_in_place(data.spec(), &mut logits).unwrap_err().to_string();
        assert!(e.contains("logits row 4"), "{e}");
        let mut grad = vec![0.0; logits.len()];
        let e = forward_backward(data.spec(), &data.logits, &mut grad).unwrap_err().to_string();
        assert!(e.contains("logits row 4"), "{e}");
    }
}

#[test]
fn invalid_inputs_leave_in_place_buffers_alone() {
    let mut data = Case::new(Op::Grpo, 2, 3, 50).data();
    data.mask = None;
    data.targets[2] = 50;
    let mut logits = data.logits.clone();
    assert!(forward_backward_in_place(data.spec(), &mut logits).is_err());
    assert!(logits.iter().zip(&data.logits).all(|(a, b)| a.to_bits() == b.to_bits()));
}

#[test]
fn huge_negative_logits_are_fine() {
    // torch.finfo(float32).min is a common way to mask vocabulary entries.
    let mut data = Case::new(Op::Grpo, 1, 2, 3000).with(|o| o.beta = 0.0);
    data.with_ref = false;
    let mut data = data.data();
    for j in 100..2500 {
        data.logits[j] = f32::MIN;
    }
    let out = forward(data.spec(), &data.logits).unwrap();
    assert!(out.loss.is_finite() && out.entropy.iter().all(|h| h.is_finite()));
}

#[test]
fn beta_without_reference_logp() {
    let mut case = Case::new(Op::Grpo, 1, 2, 4).with(|o| o.beta = 0.1);
    case.with_ref = false;
    let data = case.data();
    let e = err_of(data.spec(), &data.logits);
    assert!(e.contains("ref_logp") && e.contains("beta = 0.1"), "{e}");
}

#[test]
fn shapes_are_named() {
    let data = Case::new(Op::Grpo, 2, 3, 4).data();
    let mut spec = data.spec();
    let short = &data.logits[..20];
    assert!(err_of(spec, short).contains("`logits`"));
    let adv = [1.0f32; 3];
    if let Loss::Grpo(p) = &mut spec.loss {
        p.advantages = &adv;
    }
    let e = err_of(spec, &data.logits);
    assert!(e.contains("`advantages` has shape [3]") && e.contains("[B] = [2]"), "{e}");
    let mut spec = data.spec();
    let old = [0.0f32; 5];
    if let Loss::Grpo(p) = &mut spec.loss {
        p.old_logp = Some(&old);
    }
    assert!(err_of(spec, &data.logits).contains("`old_logp` has shape [5]"));
    let mut grad = vec![0.0f32; 3];
    let e = forward_backward(data.spec(), &data.logits, &mut grad).unwrap_err().to_string();
    assert!(e.contains("gradient buffer"), "{e}");
}

#[test]
fn missing_targets_mask_values_and_options() {
    let logits = [0.0f32; 8];
    let options = LossOptions::default();
    let rows = Rows { batch: 1, seq_len: 2, vocab: 4, targets: None, mask: None };
    let spec = LossSpec { loss: Loss::CrossEntropy(Default::default()), rows, options: &options, batch_shard: None };
    assert!(err_of(spec, &logits).contains("missing input `targets`"));
    // Entropy needs no targets.
    forward(LossSpec { loss: Loss::Entropy, ..spec }, &logits).unwrap();
    let mask = [1.0f32, 0.5];
    let spec = LossSpec { rows: Rows { mask: Some(&mask), targets: Some(&[0, 1]), ..rows }, ..spec };
    assert!(err_of(spec, &logits).contains("mask[0, 1] (row 1) = 0.5"));
    let bad = LossOptions { temperature: -1.0, ..Default::default() };
    let spec = LossSpec { options: &bad, rows: Rows { targets: Some(&[0, 1]), ..rows }, ..spec };
    assert!(err_of(spec, &logits).contains("invalid option `temperature`"));
    let spec = LossSpec { loss: Loss::Entropy, options: &options, ..spec };
    let mut grad = [0.0f32; 8];
    assert!(forward_backward(spec, &logits, &mut grad).unwrap_err().to_string().contains("no gradient"));
    // The entropy's gradient is the entropy op's option only.
    let with = LossOptions { entropy_gradient: true, ..Default::default() };
    forward_backward(LossSpec { options: &with, ..spec }, &logits, &mut grad).unwrap();
    let spec = LossSpec { loss: Loss::Logprob, options: &with, ..spec };
    let e = err_of(spec, &logits);
    assert!(e.contains("`entropy_gradient`") && e.contains("entropy op only"), "{e}");
}

#[test]
fn non_finite_policy_inputs_are_named() {
    let data = Case::new(Op::Grpo, 1, 3, 4).data();
    let mut old = data.old_logp.clone().unwrap();
    old[0] = f32::NAN;
    let mut spec = data.spec();
    if let Loss::Grpo(p) = &mut spec.loss {
        *p = PolicyInputs { old_logp: Some(&old), ..*p };
    }
    let e = err_of(spec, &data.logits);
    assert!(e.contains("`old_logp` has a non-finite value NaN at row 0"), "{e}");
}

/// `sampling_logp`: its shape, an infinity on a row that takes part, `is_ratio` beside it with
/// the correction on, and a sequence-level correction with vespo are named errors; NaN (a token
/// the sampler could not score) is accepted.
#[test]
fn sampling_logp_errors_are_named() {
    let data = Case::new(Op::Grpo, 2, 3, 5).data();
    let base = data.spec();
    let Loss::Grpo(p) = base.loss else { unreachable!() };
    let with = |sampling: &'static [f32], is_ratio: Option<IsRatio<'static>>, options: &'static LossOptions| {
        let loss = Loss::Grpo(PolicyInputs { sampling_logp: Some(sampling), is_ratio, ..p });
        err_of(LossSpec { loss, options, ..base }, &data.logits)
    };
    let defaults: &'static LossOptions = Box::leak(Box::default());
    assert!(with(&[-1.0; 4], None, defaults).contains("`sampling_logp` has shape [4]"));
    let inf: &'static [f32] = Box::leak(vec![-1.0, f32::NEG_INFINITY, -1.0, -1.0, -1.0, -1.0].into_boxed_slice());
    let e = with(inf, None, defaults);
    assert!(e.contains("`sampling_logp` has a non-finite value -inf at row 1"), "{e}");
    let ratio: &'static [f32] = Box::leak(vec![1.0; 6].into_boxed_slice());
    let e = with(&[-1.0; 6], Some(IsRatio::PerToken(ratio)), defaults);
    assert!(e.contains("`is_ratio` and `sampling_logp` were both given"), "{e}");
    let vespo: &'static LossOptions =
        Box::leak(Box::new(LossOptions { loss_type: LossType::Vespo, ..Default::default() }));
    let e = with(&[-1.0; 6], None, vespo);
    assert!(e.contains("invalid option `vllm_importance_sampling_mode`"), "{e}");
    let nan: &'static [f32] = Box::leak(vec![f32::NAN; 6].into_boxed_slice());
    forward(LossSpec { loss: Loss::Grpo(PolicyInputs { sampling_logp: Some(nan), ..p }), ..base }, &data.logits)
        .unwrap();
}

/// Inputs are checked a chunk of rows at a time (`inputs::first_bad`): over many chunks, the
/// lowest bad row that takes part is still the one named, and a masked row's values are ignored.
#[test]
fn the_lowest_bad_row_is_named_across_many_rows() {
    let fresh = || {
        let mut data = Case::new(Op::Grpo, 2, 700, 8).with(|o| o.beta = 0.04).data();
        let mut mask = vec![1.0; 1400];
        mask[10] = 0.0;
        data.mask = Some(mask);
        data
    };
    let mut data = fresh();
    data.targets[10] = 99; // masked: never read
    data.targets[901] = 8;
    data.targets[300] = -1;
    let e = err_of(data.spec(), &data.logits);
    assert!(e.contains("targets[0, 300] (row 300) = -1"), "{e}");

    let mut data = fresh();
    let mask = data.mask.as_mut().unwrap();
    mask[1300] = 0.5;
    mask[777] = 2.0;
    let e = err_of(data.spec(), &data.logits);
    assert!(e.contains("mask[1, 77] (row 777) = 2"), "{e}");

    for tensor in ["old_logp", "ref_logp"] {
        let mut data = fresh();
        let values = if tensor == "old_logp" { data.old_logp.as_mut() } else { data.ref_logp.as_mut() };
        let values = values.expect("the case passes both");
        values[10] = f32::NAN; // masked
        values[1399] = f32::INFINITY;
        values[513] = f32::NAN;
        let e = err_of(data.spec(), &data.logits);
        assert!(e.contains(&format!("`{tensor}` has a non-finite value NaN at row 513")), "{e}");
    }
}
