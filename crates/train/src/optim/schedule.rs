//! The learning rate: linear warmup, then cosine decay to a floor (Hugging Face's
//! `get_cosine_with_min_lr_schedule_with_warmup`, so that a run's curve matches a TRL run's).

use serde::{Deserialize, Serialize};

/// Linear warmup from 0 to `peak` over `warmup_steps`, then a half cosine from `peak` down to
/// `peak * min_lr_ratio` at `total_steps`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct WarmupCosine {
    pub peak: f64,
    pub warmup_steps: usize,
    pub total_steps: usize,
    pub min_lr_ratio: f64,
}

impl WarmupCosine {
    /// The learning rate of optimiser step `step` (0-based), as Hugging Face computes it: step 0
    /// of a warmup has rate 0.
    pub fn lr(&self, step: usize) -> f64 {
        if step < self.warmup_steps {
            return self.peak * step as f64 / self.warmup_steps.max(1) as f64;
        }
        let decay_steps = self.total_steps.saturating_sub(self.warmup_steps).max(1);
        let progress = ((step - self.warmup_steps) as f64 / decay_steps as f64).min(1.0);
        let cosine = 0.5 * (1.0 + (std::f64::consts::PI * progress).cos());
        self.peak * (self.min_lr_ratio + (1.0 - self.min_lr_ratio) * cosine)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn warmup_then_cosine_to_the_floor() {
        let s = WarmupCosine { peak: 1e-3, warmup_steps: 10, total_steps: 110, min_lr_ratio: 0.1 };
        assert_eq!(s.lr(0), 0.0);
        assert!((s.lr(5) - 5e-4).abs() < 1e-15);
        assert!((s.lr(10) - 1e-3).abs() < 1e-15);
        assert!((s.lr(60) - (1e-4 + 0.9e-3 * 0.5)).abs() < 1e-12);
        assert!((s.lr(110) - 1e-4).abs() < 1e-15);
        assert!((s.lr(500) - 1e-4).abs() < 1e-15);
        let flat = WarmupCosine { peak: 2e-5, warmup_steps: 0, total_steps: 5, min_lr_ratio: 1.0 };
        assert!((0..8).all(|i| (flat.lr(i) - 2e-5).abs() < 1e-18));
    }
}
