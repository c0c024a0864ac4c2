//! One optimiser step from an accumulation window: backward each micro-batch's loss into the host
//! buffers, then clip, check, update, and zero. A window whose loss or gradient is not finite is
//! skipped (counted, the weights untouched), never applied.

use candle_core::Tensor;
use serde::{Deserialize, Serialize};

use super::{AdamW, AdamWConfig, GradBuffers, WarmupCosine};
use crate::error::{Result, TrainError};
use crate::model::Params;

/// The optimiser settings of a training stage (`sft.optim`, `grpo.optim`).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct OptimConfig {
    /// Peak learning rate.
    pub lr: f64,
    pub warmup_steps: usize,
    /// The cosine decays to `lr * min_lr_ratio` at the last step (1: constant after warmup).
    pub min_lr_ratio: f64,
    /// Global-norm clipping; `null` (or 0) disables it.
    pub max_grad_norm: Option<f64>,
    pub weight_decay: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
}

impl Default for OptimConfig {
    fn default() -> Self {
        let a = AdamWConfig::default();
        Self {
            lr: 1e-5,
            warmup_steps: 0,
            min_lr_ratio: 0.0,
            max_grad_norm: Some(1.0),
            weight_decay: a.weight_decay,
            beta1: a.beta1,
            beta2: a.beta2,
            eps: a.eps,
        }
    }
}

impl OptimConfig {
    pub fn adamw(&self) -> AdamWConfig {
        AdamWConfig { beta1: self.beta1, beta2: self.beta2, eps: self.eps, weight_decay: self.weight_decay }
    }

    pub fn schedule(&self, total_steps: usize) -> WarmupCosine {
        WarmupCosine { peak: self.lr, warmup_steps: self.warmup_steps, total_steps, min_lr_ratio: self.min_lr_ratio }
    }

    pub fn validate(&self, section: &str) -> Result<()> {
        let bad = |why: String| Err(TrainError::Config { origin: section.into(), why });
        if !(self.lr > 0.0 && self.lr.is_finite()) {
            return bad(format!("{section}.lr must be positive, got {}", self.lr));
        }
        if !(0.0..=1.0).contains(&self.min_lr_ratio) {
            return bad(format!("{section}.min_lr_ratio must be in [0, 1], got {}", self.min_lr_ratio));
        }
        if let Some(n) = self.max_grad_norm {
            if n.is_nan() || n < 0.0 {
                return bad(format!("{section}.max_grad_norm must be >= 0 or null, got {n}"));
            }
        }
        self.adamw().validate(section)
    }
}

/// What one step did.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepReport {
    pub lr: f64,
    /// Before clipping.
    pub grad_norm: f64,
    /// The window was skipped (non-finite loss or gradient).
    pub skipped: bool,
    /// Seconds spent in collectives (summing the gradients over data-parallel ranks).
    pub comm_s: f64,
}

/// Gradient accumulation, clipping, AdamW and the schedule for one training stage.
pub struct Updater {
    pub optimizer: AdamW,
    grads: GradBuffers,
    config: OptimConfig,
    schedule: WarmupCosine,
    /// Optimiser steps taken or skipped.
    pub steps: usize,
    /// Windows skipped for a non-finite loss or gradient.
    pub skipped: usize,
    finite: bool,
}

impl Updater {
    pub fn new(params: &Params, config: OptimConfig, total_steps: usize) -> Result<Self> {
        Ok(Self {
            optimizer: AdamW::new(params, config.adamw())?,
            grads: GradBuffers::new(params),
            schedule: config.schedule(total_steps),
            config,
            steps: 0,
            skipped: 0,
            finite: true,
        })
    }

    /// An updater continuing from a checkpoint: the optimiser state saved by
    /// [`AdamW::save`](super::AdamW::save) and the step counters.
    pub fn restore(
        params: &Params,
        config: OptimConfig,
        total_steps: usize,
        optimizer: &std::path::Path,
        steps: usize,
        skipped: usize,
    ) -> Result<Self> {
        let mut updater = Self::new(params, config, total_steps)?;
        updater.optimizer = AdamW::load(params, config.adamw(), optimizer)?;
        updater.steps = steps;
        updater.skipped = skipped;
        Ok(updater)
    }

    /// Backpropagates one micro-batch's share of the window's loss (already scaled so that the
    /// window's shares sum to its loss) into the buffers.
    pub fn accumulate(&mut self, params: &Params, loss: &Tensor) -> Result<()> {
        let value = loss.to_dtype(candle_core::DType::F64)?.to_scalar::<f64>()?;
        if !value.is_finite() {
            self.finite = false;
            return Ok(());
        }
        let store = loss.backward()?;
        self.grads.add(params, &store)?;
        Ok(())
    }

    /// The window's gradient buffers, for code that computes gradients itself (the engine), and
    /// the function to report each micro-batch's loss with: a non-finite one skips the window.
    pub fn grads_and_recorder(&mut self) -> (&mut GradBuffers, impl FnMut(f64) + Send + '_) {
        let finite = &mut self.finite;
        (&mut self.grads, move |value: f64| *finite &= value.is_finite())
    }

    /// Sums the window's gradients over the data-parallel ranks (and whether every rank's loss
    /// was finite), so that each rank's step below is the same step.
    /// Buffers listed in `done` were summed already (while the backward ran).
    pub fn reduce(&mut self, comm: &dyn flashgrpo_collective::Collective, done: &[usize]) -> Result<()> {
        if comm.size() == 1 {
            return Ok(());
        }
        let mut not_finite = [f64::from(u8::from(!self.finite))];
        comm.all_reduce_f64(&mut not_finite, flashgrpo_collective::ReduceOp::Max)?;
        self.finite = not_finite[0] == 0.0;
        self.grads.all_reduce_except(comm, done)
    }

    /// Ends the window: clip, update (unless something was not finite), zero.
    pub fn step(&mut self, params: &Params) -> Result<StepReport> {
        let lr = self.schedule.lr(self.steps);
        self.steps += 1;
        let grad_norm = match self.config.max_grad_norm {
            Some(max) if max > 0.0 => self.grads.clip(max),
            _ => self.grads.global_norm(),
        };
        let skipped = !self.finite || !grad_norm.is_finite();
        if skipped {
            self.skipped += 1;
        } else {
            self.optimizer.step(params, &self.grads, lr)?;
        }
        self.grads.zero();
        self.finite = true;
        Ok(StepReport { lr, grad_norm, skipped, comm_s: 0.0 })
    }
}
