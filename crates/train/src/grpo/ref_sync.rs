//! TRL's `sync_ref_model` (TR-DPO, arXiv 2404.09656): every `ref_model_sync_steps` optimizer
//! steps the reference policy moves towards the trained one,
//! `ref <- alpha * policy + (1 - alpha) * ref` (`ref_model_mixup_alpha`), so that the KL term
//! anchors to a recent policy rather than the start. TRL mixes at the end of each optimizer step
//! whose global count is a multiple of the period; here the check follows each GRPO step, whose
//! `ppo_epochs` optimizer steps are one rollout's (the same weights when `ppo_epochs = 1`, or when
//! the period is a multiple of `ppo_epochs`; otherwise the end of the rollout's last epoch).

use candle_core::DType;

use crate::error::Result;
use crate::model::Qwen2;

/// Whether an optimizer step in `(before, after]` is a multiple of `every`.
pub fn due(before: usize, after: usize, every: usize) -> bool {
    every > 0 && after / every > before / every
}

/// `reference <- alpha * policy + (1 - alpha) * reference`, parameter by parameter, computed in
/// f32 and stored in the reference's dtype.
pub fn mix_into(reference: &Qwen2, policy: &Qwen2, alpha: f64) -> Result<()> {
    for ((name, r), (_, p)) in reference.params.iter().zip(policy.params.iter()) {
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
        assert!(due(0, 1, 1) && due(3, 4, 2) && due(3, 6, 4) && !due(4, 5, 2) && !due(1, 3, 4));
        assert!(!due(0, 10, 0));
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
