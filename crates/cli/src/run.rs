//! Running one loss call with a chosen implementation, and what comes out of it.

use anyhow::Result;
use clap::ValueEnum;
use flashgrpo_kernels::{
    forward, forward_backward, forward_backward_in_place, reference, LossOptions, LossOutput, LossSpec,
};
use serde::{Deserialize, Serialize};

use crate::batch::Batch;
use crate::tensor_io::{LogitElement, LogitsData, LogitsVisitor};

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize, Deserialize, Default)]
#[serde(rename_all = "kebab-case")]
pub enum Impl {
    /// The f64 reference (materialises everything; slow, obviously right).
    Reference,
    /// The streaming kernels, gradient into a new buffer.
    #[default]
    Fused,
    /// The streaming kernels, gradient written over (a copy of) the logits.
    FusedInplace,
}

/// What a loss call produces: the outputs, and the gradient in the logits' dtype.
pub struct Results {
    pub output: LossOutput,
    pub grad: Option<LogitsData>,
}

/// The streaming kernels on logits of any dtype.
pub struct Fused<'a> {
    pub spec: LossSpec<'a>,
    pub in_place: bool,
}

impl LogitsVisitor for Fused<'_> {
    type Out = Result<(LossOutput, Option<LogitsData>)>;

    fn visit<T: LogitElement>(self, logits: &[T]) -> Self::Out {
        let spec = self.spec;
        if !spec.loss.has_gradient() {
            return Ok((forward(spec, logits)?, None));
        }
        let (out, grad) = if self.in_place {
            let mut buffer = logits.to_vec();
            let out = forward_backward_in_place(spec, &mut buffer)?;
            (out, buffer)
        } else {
            let mut grad = vec![T::default(); logits.len()];
            let out = forward_backward(spec, logits, &mut grad)?;
            (out, grad)
        };
        Ok((out, Some(T::wrap(grad))))
    }
}

/// Rounds an f64 gradient to the logits' dtype.
struct RoundLike<'a>(&'a [f64]);

impl LogitsVisitor for RoundLike<'_> {
    type Out = LogitsData;
    fn visit<T: LogitElement>(self, _like: &[T]) -> LogitsData {
        T::wrap(self.0.iter().map(|&x| T::from_f32(x as f32)).collect())
    }
}

fn to_f32(v: &[f64]) -> Vec<f32> {
    v.iter().map(|&x| x as f32).collect()
}

/// Runs the reference; returns its f64 output and the same rounded to the contract's dtypes.
pub fn reference_results(batch: &Batch, options: &LossOptions) -> Result<(Results, reference::ReferenceOutput)> {
    let r = reference::evaluate(batch.spec(options), &batch.logits.to_f64())?;
    let output = LossOutput {
        loss: r.loss,
        per_token_loss: to_f32(&r.per_token_loss),
        logp: r.logp.as_deref().map(to_f32),
        entropy: to_f32(&r.entropy),
        kl: r.kl.as_deref().map(to_f32),
        is_clipped: r.is_clipped.as_deref().map(to_f32),
    };
    let results = Results { output, grad: r.grad.as_deref().map(|g| batch.logits.visit(RoundLike(g))) };
    Ok((results, r))
}

/// Runs `imp` on the batch.
pub fn run(batch: &Batch, options: &LossOptions, imp: Impl) -> Result<Results> {
    let spec = batch.spec(options);
    let in_place = match imp {
        Impl::Reference => return Ok(reference_results(batch, options)?.0),
        Impl::Fused => false,
        Impl::FusedInplace => true,
    };
    let (output, grad) = batch.logits.visit(Fused { spec, in_place })?;
    Ok(Results { output, grad })
}
