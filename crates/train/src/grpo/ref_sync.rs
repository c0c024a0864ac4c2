//! TRL's `sync_ref_model` (TR-DPO, arXiv 2404.09656): every `ref_model_sync_steps` optimizer
//! steps the reference policy moves towards the trained one,
//! `ref <- alpha * policy + (1 - alpha) * ref` (`ref_model_mixup_alpha`), so that the KL term
//! anchors to a recent policy rather than the start. TRL mixes at the end of each optimizer step
//! whose global count is a multiple of the period; here the mixes a GRPO step's `ppo_epochs`
//! optimizer steps are due are made after it, as many as TRL makes (the same weights when
//! `ppo_epochs = 1` or the period is a multiple of it; otherwise the rollout's last epoch's).

use candle_core::DType;

use crate::error::Result;
use crate::model::Qwen2;

/// How many optimizer steps in `(before, after]` are multiples of `every` (0 for `every = 0`).
pub fn due(before: usize, after: usize, every: usize) -> usize {
    match (after.checked_div(every), before.checked_div(every)) {
        (Some(a), Some(b)) => a - b,
        _ => 0,
    }
}

/// `reference <- alpha * policy + (1 - alpha) * reference`, parameter by parameter, computed in
/// f32 and stored in the reference's dtype.
pub fn mix_into(reference: &Qwen2, policy: &Qwen2, alpha: f64) -> Result<()> {
    for ((name, r), (policy_name, p)) in reference.params.iter().zip(policy.params.iter()) {
        if name != policy_name || r.shape() != p.shape() {
            return Err(crate::TrainError::Other(format!(
                "the reference's {name} {:?} does not match the policy's {policy_name} {:?}",
                r.shape(),
                p.shape()
            )));
        }
        let (r32, p32) = (r.as_tensor().to_dtype(DType::F32)?, p.as_tensor().to_dtype(DType::F32)?);
        let mixed = ((r32 * (1.0 - alpha))? + (p32 * alpha)?)?;
        r.set(&mixed.to_dtype(r.dtype())?).map_err(|e| crate::TrainError::Other(format!("{name}: {e}")))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Qwen2Config;

    #[test]
    fn due_at_multiples_of_the_period() {
        assert_eq!([due(0, 1, 1), due(3, 4, 2), due(3, 6, 4), due(4, 5, 2), due(1, 3, 4)], [1, 1, 1, 0, 0]);
        // Two epochs a rollout, a period of one: two mixes, as TRL makes after each.
        assert_eq!(due(4, 6, 1), 2);
        assert_eq!(due(0, 10, 0), 0);
    }

    /// Every parameter becomes `alpha * policy + (1 - alpha) * reference`.
    #[test]
    fn mixes_every_parameter() {
        let config = Qwen2Config::tiny(11, 8, 1, 2, 1);
        let reference = Qwen2::random(config.clone(), DType::F32, 1).unwrap();
        let policy = Qwen2::random(config, DType::F32, 2).unwrap();
        let before: Vec<Vec<f32>> =
            reference.params.iter().map(|(_, v)| v.as_tensor().flatten_all().unwrap().to_vec1().unwrap()).collect();
        mix_into(&reference, &policy, 0.25).unwrap();
        for (((_, r), (_, p)), old) in reference.params.iter().zip(policy.params.iter()).zip(&before) {
            let (r, p): (Vec<f32>, Vec<f32>) = (
                r.as_tensor().flatten_all().unwrap().to_vec1().unwrap(),
                p.as_tensor().flatten_all().unwrap().to_vec1().unwrap(),
            );
            for ((r, p), o) in r.iter().zip(&p).zip(old) {
                assert!((r - (0.25 * p + 0.75 * o)).abs() <= 1e-6 * (1.0 + o.abs()), "{r} {p} {o}");
            }
        }
    }
}
