//! The loss at the language-model head for the engine, the three ways of `loss.impl`, so that the
//! trainer's A/B compares the head's loss and nothing else:
//! - `fused_linear`: flashgrpo's fused-linear kernel from the hidden states and the lm_head (no
//!   `[N, V]` tensor);
//! - `fused`: the logits materialised by one product, flashgrpo's logits-level kernel writing its
//!   gradient over them, then the two products of the chain rule;
//! - `baseline`: the logits materialised by candle and the loss composed of candle ops, with
//!   candle's autograd (what a Rust user writes without flashgrpo).
//!
//! All three give the loss, `d rows` (the gradient with respect to the rows' hidden states,
//! overwritten) and add the lm_head's gradient to its buffer.

use candle_core::{Device, Tensor, Var};
use flashgrpo_candle::composed::ComposedLoss;
use flashgrpo_candle::LossInputs;
use flashgrpo_kernels::backend::parallel_round;
use flashgrpo_kernels::matmul::{matmul_nn, matmul_nt, matmul_tn, Mat, MatMut};
use flashgrpo_kernels::{
    forward, forward_backward_in_place, linear_forward, linear_forward_backward, ChunkBudget, Element, LinearGradients,
    LinearInputs, LossOutput, LossSpec,
};

use half::bf16;

use super::ops::Weight;
use super::weights::Weights;
use crate::error::{Result, TrainError};
use crate::head_loss::LossImpl;
use crate::optim::GradBuffers;

/// The head's loss over rows `[N, H]` (`N = inputs.batch * inputs.seq_len`).
pub struct Head<'a, 'm> {
    pub weights: &'a Weights<'m>,
    /// The lm_head as candle holds it (the baseline's matmul reads it; its gradient comes back
    /// through candle's autograd).
    pub lm_head: &'a Var,
    pub implementation: LossImpl,
}

/// Where the head's gradients go.
pub struct HeadGradients<'a> {
    /// `[N, H]`, overwritten.
    pub rows: &'a mut [f32],
    /// The lm_head's gradient is added to its buffer.
    pub grads: &'a mut GradBuffers,
}

fn kernel<E: std::fmt::Display>(e: E) -> TrainError {
    TrainError::Other(format!("head loss: {e}"))
}

impl Head<'_, '_> {
    /// The loss and per-token outputs of `rows`; with `gradients`, also its gradients. The
    /// composed baseline gives no per-token outputs (`output` is `None`).
    pub fn loss(
        &self,
        rows: &[f32],
        inputs: &LossInputs,
        gradients: Option<HeadGradients<'_>>,
    ) -> Result<(f64, Option<LossOutput>)> {
        let d = self.weights.dims;
        let (h, v) = (d.hidden, d.vocab);
        let n = inputs.batch * inputs.seq_len;
        if rows.len() != n * h {
            return Err(kernel(format!("{} hidden values for {n} rows of {h}", rows.len())));
        }
        let spec = inputs.spec(v);
        // As f32 only where it is read so: a bf16 head is widened on first use.
        let weight = || -> &[f32] { self.weights.lm_head() };
        let head_index = self.weights.lm_head().index;
        match (self.implementation, gradients) {
            (LossImpl::FusedLinear, gradients) => match self.weights.lm_head().weight() {
                // A bf16 head on the bf16 products: the rows rounded to bf16, as a bf16 model
                // holds its hidden states.
                Weight::Bf16(..) => {
                    let rows = parallel_round::<bf16>(rows);
                    let weight = self.weights.lm_head().bf16().expect("a bf16 head");
                    fused_linear(spec, &rows, weight, h, gradients.map(|g| (g, head_index)), inputs.budget)
                }
                Weight::F32(_) => {
                    fused_linear(spec, rows, weight(), h, gradients.map(|g| (g, head_index)), inputs.budget)
                }
            },
            (LossImpl::Fused, gradients) => {
                let (weight, mut logits) = (weight(), vec![0.0f32; n * v]);
                matmul_nt(&mut MatMut::new(&mut logits, n, v), false, Mat::new(rows, n, h), Mat::new(weight, v, h));
                let Some(g) = gradients else {
                    let out = forward(spec, &logits).map_err(kernel)?;
                    return Ok((out.loss, Some(out)));
                };
                let out = forward_backward_in_place(spec, &mut logits).map_err(kernel)?;
                matmul_nn(&mut MatMut::new(g.rows, n, h), false, Mat::new(&logits, n, v), Mat::new(weight, v, h));
                matmul_tn(
                    &mut MatMut::new(g.grads.get_mut(head_index), v, h),
                    true,
                    Mat::new(&logits, n, v),
                    Mat::new(rows, n, h),
                );
                Ok((out.loss, Some(out)))
            }
            (LossImpl::Baseline, gradients) => self.baseline(rows, inputs, gradients).map(|loss| (loss, None)),
        }
    }

    /// The fused-linear loss with the vocabulary split over `comm`'s ranks, which hold the same
    /// rows: each streams its rows of the lm_head, the rows' statistics are exchanged
    /// ([`crate::vocab_parallel`]), `d rows` is summed over the ranks, and each adds the gradient
    /// of its rows of the lm_head to the buffer.
    pub fn loss_vocab_parallel(
        &self,
        rows: &[f32],
        inputs: &LossInputs,
        g: HeadGradients<'_>,
        comm: &dyn flashgrpo_collective::Collective,
    ) -> Result<(f64, Option<LossOutput>)> {
        use crate::vocab_parallel::{columns, linear_loss, LinearShard, LinearShardGrads};
        if self.implementation != LossImpl::FusedLinear {
            return Err(kernel("a vocabulary-parallel head needs loss.impl = fused_linear"));
        }
        let d = self.weights.dims;
        let (h, v) = (d.hidden, d.vocab);
        let cols = columns(comm, v);
        let weight: &[f32] = self.weights.lm_head();
        let shard =
            LinearShard { hidden: rows, weight: &weight[cols.start * h..cols.end * h], bias: None, hidden_size: h };
        let rows_of_head = &mut g.grads.get_mut(self.weights.lm_head().index)[cols.start * h..cols.end * h];
        let grads = LinearShardGrads { hidden: g.rows, weight: Some(rows_of_head), bias: None, accumulate: true };
        let out = linear_loss(comm, inputs.spec(v), shard, Some(grads), inputs.budget)?;
        Ok((out.loss, Some(out)))
    }

    /// The composed loss on candle's materialised logits, differentiated by candle. candle reads
    /// the lm_head under a second read lock of its storage while `Weights` holds the first: fine,
    /// as nothing writes the parameters during an update (the optimiser runs after `Weights` is
    /// dropped).
    fn baseline(&self, rows: &[f32], inputs: &LossInputs, gradients: Option<HeadGradients<'_>>) -> Result<f64> {
        let d = self.weights.dims;
        let (b, t, h) = (inputs.batch, inputs.seq_len, d.hidden);
        let hidden = Var::from_tensor(&Tensor::from_slice(rows, (b * t, h), &Device::Cpu)?)?;
        let weight =
            if gradients.is_some() { self.lm_head.as_tensor().clone() } else { self.lm_head.as_tensor().detach() };
        let logits = hidden.as_tensor().to_dtype(weight.dtype())?.matmul(&weight.t()?)?.reshape((b, t, d.vocab))?;
        let loss = ComposedLoss::new(inputs, d.vocab)?.loss(&logits)?;
        let value = loss.to_dtype(candle_core::DType::F64)?.to_scalar::<f64>()?;
        if let Some(g) = gradients {
            let store = loss.backward()?;
            let copy = |t: Option<&Tensor>, out: &mut [f32]| -> Result<()> {
                if let Some(t) = t {
                    let values = t.flatten_all()?.to_dtype(candle_core::DType::F32)?.to_vec1::<f32>()?;
                    out.iter_mut().zip(values).for_each(|(o, x)| *o += x);
                }
                Ok(())
            };
            g.rows.fill(0.0);
            copy(store.get(hidden.as_tensor()), g.rows)?;
            copy(store.get(self.lm_head.as_tensor()), g.grads.get_mut(self.weights.lm_head().index))?;
        }
        Ok(value)
    }
}

/// flashgrpo's fused-linear loss of `rows` `[N, H]` through `weight` `[V, H]`; with gradients,
/// `d rows` overwritten and the head's gradient (at `head_index`) added to its buffer.
fn fused_linear<T: Element>(
    spec: LossSpec<'_>,
    rows: &[T],
    weight: &[T],
    h: usize,
    gradients: Option<(HeadGradients<'_>, usize)>,
    budget: ChunkBudget,
) -> Result<(f64, Option<LossOutput>)> {
    let inputs = LinearInputs { hidden: rows, weight, bias: None, hidden_size: h };
    let out = match gradients {
        None => linear_forward(spec, inputs, budget),
        Some((g, head_index)) => {
            let grads = LinearGradients {
                hidden: g.rows,
                weight: Some(g.grads.get_mut(head_index)),
                bias: None,
                accumulate: true,
            };
            linear_forward_backward(spec, inputs, grads, budget)
        }
    }
    .map_err(kernel)?;
    Ok((out.loss, Some(out)))
}
