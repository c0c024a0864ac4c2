//! The reference's gradient against central finite differences of the reference's own loss,
//! in f64, for every op and option: this is what makes the reference a reference.

mod common;

use common::{Case, IsRatioKind, Op};
use flashgrpo_kernels::{reference, ImportanceSamplingLevel, LossType, Reduction};

/// Finite differences cannot see `stop_grad`: where the loss detaches something (on-policy
/// `old = stop_grad(logp)`, cispo's coefficient), the differences are taken on the loss with
/// that quantity frozen at its current value, which is what the detached gradient means.
fn check(case: &Case) {
    let data = case.data();
    let x: Vec<f64> = data.logits.iter().map(|&v| v as f64).collect();
    let base = reference::evaluate(data.spec(), &x).unwrap();
    let analytic = base.grad.expect("op has a gradient");
    let mut data = data;
    if case.op == Op::Grpo && data.old_logp.is_none() {
        let logp = base.logp.unwrap();
        data.old_logp = Some(logp.iter().map(|&l| l as f32).collect());
    }
    let h = 1e-6;
    let mut worst = 0.0f64;
    let scale = analytic.iter().fold(0.0f64, |m, g| m.max(g.abs())).max(1e-3);
    for k in 0..x.len() {
        let mut plus = x.clone();
        let mut minus = x.clone();
        plus[k] += h;
        minus[k] -= h;
        let fp = reference::evaluate(data.spec(), &plus).unwrap().loss;
        let fm = reference::evaluate(data.spec(), &minus).unwrap().loss;
        let numeric = (fp - fm) / (2.0 * h);
        worst = worst.max((numeric - analytic[k]).abs() / scale);
    }
    assert!(worst < 1e-6, "finite differences disagree by {worst} (relative to max |g|) in {case:?}");
}

#[test]
fn grpo_gradient_matches_finite_differences() {
    let base = |lt: LossType, level: ImportanceSamplingLevel| {
        Case::new(Op::Grpo, 2, 4, 7).with(|o| {
            o.loss_type = lt;
            o.importance_sampling_level = level;
            o.beta = 0.04;
            o.entropy_coef = 0.03;
            o.temperature = 0.9;
            o.epsilon_high = Some(0.28);
        })
    };
    for level in [ImportanceSamplingLevel::Token, ImportanceSamplingLevel::Sequence] {
        // cispo's coefficient min(r, eps_high) is detached: with eps_high = 0.2 it is the
        // constant 0.2 on every row, which finite differences can check; the r < eps_high branch
        // is checked against the fused objective in reference_vs_fused.
        let cispo = base(LossType::Cispo, level).with(|o| o.epsilon_high = Some(0.2));
        check(&cispo);
        for lt in [LossType::Grpo, LossType::Bnpo, LossType::DrGrpo, LossType::Dapo, LossType::Sapo] {
            check(&base(lt, level));
            check(&base(lt, level).with(|o| {
                o.use_bias_correction_kl = true;
                o.delta = Some(1.02);
            }));
            let mut on_policy = base(lt, level);
            on_policy.with_old = false;
            on_policy.is_ratio = IsRatioKind::PerToken;
            check(&on_policy);
        }
    }
}

#[test]
fn cross_entropy_logprob_gradient_matches_finite_differences() {
    for reduction in [Reduction::Mean, Reduction::Sum, Reduction::None] {
        let mut case = Case::new(Op::CrossEntropy, 2, 3, 6).with(|o| {
            o.label_smoothing = 0.1;
            o.z_loss = 0.01;
            o.temperature = 1.2;
            o.reduction = reduction;
        });
        case.ignored = 0.2;
        check(&case);
    }
    check(&Case::new(Op::Logprob, 2, 3, 6).with(|o| o.temperature = 0.8));
    // The entropy's gradient (`entropy_gradient`), of its mean and of its sum.
    for reduction in [Reduction::Mean, Reduction::Sum] {
        check(&Case::new(Op::Entropy, 2, 3, 6).with(|o| {
            o.entropy_gradient = true;
            o.temperature = 0.8;
            o.reduction = reduction;
        }));
    }
}

#[test]
fn soft_capped_logits_gradient_matches_finite_differences() {
    let capped = |op, cap: f64| {
        let mut case = Case::new(op, 2, 3, 6).with(|o| {
            o.softcap = Some(cap);
            o.temperature = 0.9;
            o.beta = 0.04;
            o.entropy_coef = 0.03;
            o.label_smoothing = 0.1;
            o.z_loss = 0.01;
        });
        case.logit_std = 4.0;
        case
    };
    for cap in [1.5, 30.0] {
        check(&capped(Op::Grpo, cap));
        check(&capped(Op::Grpo, cap).with(|o| o.importance_sampling_level = ImportanceSamplingLevel::Sequence));
        check(&capped(Op::CrossEntropy, cap));
        check(&capped(Op::Logprob, cap));
        check(&capped(Op::Entropy, cap).with(|o| {
            o.entropy_gradient = true;
            o.label_smoothing = 0.0;
            o.z_loss = 0.0;
        }));
    }
}
