//! The losses of flashgrpo-kernels as candle ops with autograd: from logits, or from hidden states
//! and the lm_head (fused-linear: no `[N, V]` tensor is ever created, forward or backward).
//!
//! The kernels compute the loss and its gradient in one sweep, so when an input requires a
//! gradient the forward keeps it, and the backward only scales it by the upstream gradient (with
//! a kernel of ours through `apply_op*_no_bwd`): a second sweep (or, fused-linear, a fourth
//! matrix product) is never spent on the backward. Inputs that need no gradient cost nothing
//! extra: the forward then only computes the loss.

use std::sync::{Arc, Mutex};

use candle_core::{
    bail, CpuStorage, CustomOp1, CustomOp2, CustomOp3, DType, Device, InplaceOp1, Layout, Result, Shape, Tensor,
};
use flashgrpo_kernels::backend::parallel_round;
use flashgrpo_kernels::huge_pages::zeroed;
use flashgrpo_kernels::{
    forward, forward_backward, linear_forward, linear_forward_backward, Element, LinearGradients, LinearInputs,
    LossOutput,
};
pub use flashgrpo_kernels::{LossInputs, LossKind};
use half::{bf16, f16};

use crate::storage::{floats, Floats};

/// A loss call's results: the differentiable scalar `loss`, and the per-token outputs `[B, T]`
/// (f32, no gradient).
#[derive(Debug, Clone)]
pub struct LossTensors {
    pub loss: Tensor,
    pub per_token_loss: Tensor,
    pub logp: Option<Tensor>,
    pub entropy: Tensor,
    pub kl: Option<Tensor>,
    pub is_clipped: Option<Tensor>,
}

fn kernel_err(e: flashgrpo_kernels::LossError) -> candle_core::Error {
    candle_core::Error::Msg(e.to_string())
}

/// Gradients computed by a forward, waiting for the backward.
#[derive(Default)]
struct Kept {
    output: Option<LossOutput>,
    grads: Vec<Option<Tensor>>,
}

type State = Arc<Mutex<Kept>>;

fn tensors(output: LossOutput, inputs: &LossInputs, loss: Tensor, device: &Device) -> Result<LossTensors> {
    let bt = (inputs.batch, inputs.seq_len);
    let t = |v: Vec<f32>| Tensor::from_vec(v, bt, device);
    Ok(LossTensors {
        loss,
        per_token_loss: t(output.per_token_loss)?,
        logp: output.logp.map(t).transpose()?,
        entropy: t(output.entropy)?,
        kl: output.kl.map(t).transpose()?,
        is_clipped: output.is_clipped.map(t).transpose()?,
    })
}

fn scalar(loss: f64) -> (CpuStorage, Shape) {
    (CpuStorage::F32(vec![loss as f32]), Shape::from(()))
}

/// Scales a kept gradient by the upstream scalar gradient, in place: the backward owns the kept
/// tensor (it is taken from the op's state), so no second `[N, V]` or `[V, H]` buffer is made.
fn scaled(grad: Option<Tensor>, upstream: &Tensor) -> Result<Option<Tensor>> {
    let Some(grad) = grad else { return Ok(None) };
    let k = upstream.to_dtype(DType::F64)?.to_scalar::<f64>()?;
    if k != 1.0 {
        grad.inplace_op1(&ScaleInPlace(k))?;
    }
    Ok(Some(grad))
}

/// `x *= k` in x's dtype.
struct ScaleInPlace(f64);

impl InplaceOp1 for ScaleInPlace {
    fn name(&self) -> &'static str {
        "flashgrpo-scale"
    }

    fn cpu_fwd(&self, storage: &mut CpuStorage, layout: &Layout) -> Result<()> {
        use rayon::prelude::*;
        let Some((start, end)) = layout.contiguous_offsets() else { bail!("flashgrpo-scale: not contiguous") };
        let k = self.0;
        match storage {
            CpuStorage::F32(v) => v[start..end].par_iter_mut().for_each(|g| *g = (*g as f64 * k) as f32),
            CpuStorage::F64(v) => v[start..end].par_iter_mut().for_each(|g| *g *= k),
            CpuStorage::BF16(v) => {
                v[start..end].par_iter_mut().for_each(|g| *g = bf16::from_f64(g.to_f64() * k));
            }
            CpuStorage::F16(v) => v[start..end].par_iter_mut().for_each(|g| *g = f16::from_f64(g.to_f64() * k)),
            _ => bail!("flashgrpo-scale: not a float gradient"),
        }
        Ok(())
    }
}

/// The loss of `logits [B, T, V]` (f32 / bf16 / f16), differentiable in `logits`.
pub fn loss_from_logits(logits: &Tensor, inputs: &Arc<LossInputs>) -> Result<LossTensors> {
    let (b, t, _) = logits.dims3()?;
    if (b, t) != (inputs.batch, inputs.seq_len) {
        bail!(
            "logits {:?} do not match the loss inputs' [B, T] = [{}, {}]",
            logits.dims(),
            inputs.batch,
            inputs.seq_len
        );
    }
    let state = State::default();
    let op = LogitsLoss {
        inputs: inputs.clone(),
        want_grad: logits.track_op() && inputs.has_gradient(),
        state: state.clone(),
    };
    // A loss without a gradient (entropy) is a constant to candle's backward, as the values it is.
    let logits = logits.contiguous()?;
    let loss = if inputs.has_gradient() { logits.apply_op1(op)? } else { logits.apply_op1_no_bwd(&op)? };
    let output = state.lock().expect("not poisoned").output.take().expect("the forward ran");
    tensors(output, inputs, loss, logits.device())
}

struct LogitsLoss {
    inputs: Arc<LossInputs>,
    want_grad: bool,
    state: State,
}

impl LogitsLoss {
    fn run<T: Element + candle_core::WithDType>(&self, logits: &[T], shape: &Shape) -> Result<f64> {
        let vocab = *shape.dims().last().unwrap_or(&0);
        let spec = self.inputs.spec(vocab);
        let (output, grad) = if self.want_grad {
            // A fresh buffer each call (candle's backward takes it), on fresh huge pages: the
            // kernels write every element, so its zeros are never written by us.
            let mut grad = zeroed::<T>(logits.len());
            let output = forward_backward(spec, logits, &mut grad).map_err(kernel_err)?;
            (output, Some(Tensor::from_vec(grad, shape, &Device::Cpu)?))
        } else {
            (forward(spec, logits).map_err(kernel_err)?, None)
        };
        let loss = output.loss;
        let mut kept = self.state.lock().expect("not poisoned");
        kept.output = Some(output);
        kept.grads = vec![grad];
        Ok(loss)
    }
}

impl CustomOp1 for LogitsLoss {
    fn name(&self) -> &'static str {
        "flashgrpo-loss"
    }

    fn cpu_fwd(&self, storage: &CpuStorage, layout: &Layout) -> Result<(CpuStorage, Shape)> {
        let shape = layout.shape();
        let loss = match floats(storage, layout, "logits")? {
            Floats::F32(l) => self.run(l, shape)?,
            Floats::BF16(l) => self.run(l, shape)?,
            Floats::F16(l) => self.run(l, shape)?,
            Floats::F64(_) => bail!("f64 logits are not supported by the kernels; convert to f32"),
        };
        Ok(scalar(loss))
    }

    fn bwd(&self, _logits: &Tensor, _loss: &Tensor, upstream: &Tensor) -> Result<Option<Tensor>> {
        let grad = self.state.lock().expect("not poisoned").grads.first_mut().and_then(Option::take);
        if grad.is_none() {
            bail!(
                "flashgrpo-loss: the forward ran without gradient tracking on the logits, or the backward already ran"
            );
        }
        scaled(grad, upstream)
    }
}

/// The loss of `hidden [B, T, H] @ weight [V, H]^T (+ bias [V])` (one dtype: f32 / bf16 / f16),
/// differentiable in each, without materialising the logits.
pub fn loss_from_hidden(
    hidden: &Tensor,
    weight: &Tensor,
    bias: Option<&Tensor>,
    inputs: &Arc<LossInputs>,
) -> Result<LossTensors> {
    let (b, t, h) = hidden.dims3()?;
    let (_, wh) = weight.dims2()?;
    if (b, t) != (inputs.batch, inputs.seq_len) || wh != h {
        bail!(
            "hidden {:?} and weight {:?} do not match the loss inputs' [B, T] = [{}, {}]",
            hidden.dims(),
            weight.dims(),
            inputs.batch,
            inputs.seq_len
        );
    }
    if weight.dtype() != hidden.dtype() || bias.is_some_and(|b| b.dtype() != hidden.dtype()) {
        bail!("hidden, weight and bias must share one dtype");
    }
    if let Some(bias) = bias.filter(|b| b.rank() != 1) {
        bail!("bias {:?} must be [V]", bias.dims());
    }
    let has = inputs.has_gradient();
    let want = [hidden.track_op() && has, weight.track_op() && has, bias.is_some_and(|b| b.track_op()) && has];
    let state = State::default();
    let op = LinearLoss { inputs: inputs.clone(), want, state: state.clone() };
    let (hidden, weight) = (hidden.contiguous()?, weight.contiguous()?);
    let loss = match (bias, has) {
        (Some(bias), true) => hidden.apply_op3(&weight, &bias.contiguous()?, op)?,
        (None, true) => hidden.apply_op2(&weight, op)?,
        (Some(bias), false) => hidden.apply_op3_no_bwd(&weight, &bias.contiguous()?, &op)?,
        (None, false) => hidden.apply_op2_no_bwd(&weight, &op)?,
    };
    let output = state.lock().expect("not poisoned").output.take().expect("the forward ran");
    tensors(output, inputs, loss, hidden.device())
}

struct LinearLoss {
    inputs: Arc<LossInputs>,
    /// Gradients wanted for hidden, weight, bias.
    want: [bool; 3],
    state: State,
}

/// f32 values as a tensor of `T`: as they are for f32, else rounded on every thread.
fn tensor_of<T: Element + candle_core::WithDType>(values: Vec<f32>, shape: &Shape) -> Result<Tensor> {
    if <T as Element>::DTYPE == flashgrpo_kernels::DType::F32 {
        return Tensor::from_vec(values, shape, &Device::Cpu);
    }
    Tensor::from_vec(parallel_round::<T>(&values), shape, &Device::Cpu)
}

impl LinearLoss {
    fn run<T: Element + candle_core::WithDType>(
        &self,
        h: &[T],
        hs: &Shape,
        w: &[T],
        ws: &Shape,
        bias: Option<&[T]>,
    ) -> Result<f64> {
        let (vocab, hidden_size) = ws.dims2()?;
        let spec = self.inputs.spec(vocab);
        let inputs = LinearInputs { hidden: h, weight: w, bias, hidden_size };
        let budget = self.inputs.budget;
        let mut kept = self.state.lock().expect("not poisoned");
        if !self.want.iter().any(|&w| w) {
            let output = linear_forward(spec, inputs, budget).map_err(kernel_err)?;
            let loss = output.loss;
            kept.output = Some(output);
            return Ok(loss);
        }
        let mut gh = zeroed::<f32>(h.len());
        let mut gw = if self.want[1] { zeroed::<f32>(w.len()) } else { Vec::new() };
        let mut gb = if self.want[2] { zeroed::<f32>(vocab) } else { Vec::new() };
        let grads = LinearGradients {
            hidden: &mut gh,
            weight: self.want[1].then_some(&mut gw[..]),
            bias: self.want[2].then_some(&mut gb[..]),
            accumulate: false,
        };
        let output = linear_forward_backward(spec, inputs, grads, budget).map_err(kernel_err)?;
        let loss = output.loss;
        kept.output = Some(output);
        kept.grads = vec![
            self.want[0].then(|| tensor_of::<T>(gh, hs)).transpose()?,
            self.want[1].then(|| tensor_of::<T>(gw, ws)).transpose()?,
            self.want[2].then(|| tensor_of::<T>(gb, &Shape::from(vocab))).transpose()?,
        ];
        Ok(loss)
    }

    fn dispatch(&self, h: Floats<'_>, hs: &Shape, w: Floats<'_>, ws: &Shape, b: Option<Floats<'_>>) -> Result<f64> {
        match (h, w, b) {
            (Floats::F32(h), Floats::F32(w), None) => self.run::<f32>(h, hs, w, ws, None),
            (Floats::F32(h), Floats::F32(w), Some(Floats::F32(b))) => self.run::<f32>(h, hs, w, ws, Some(b)),
            (Floats::BF16(h), Floats::BF16(w), None) => self.run::<bf16>(h, hs, w, ws, None),
            (Floats::BF16(h), Floats::BF16(w), Some(Floats::BF16(b))) => self.run::<bf16>(h, hs, w, ws, Some(b)),
            (Floats::F16(h), Floats::F16(w), None) => self.run::<f16>(h, hs, w, ws, None),
            (Floats::F16(h), Floats::F16(w), Some(Floats::F16(b))) => self.run::<f16>(h, hs, w, ws, Some(b)),
            _ => bail!("fused-linear loss: hidden, weight and bias must all be f32, bf16 or f16 (one dtype)"),
        }
    }

    fn backward(&self, upstream: &Tensor, count: usize) -> Result<Vec<Option<Tensor>>> {
        let grads = std::mem::take(&mut self.state.lock().expect("not poisoned").grads);
        if grads.is_empty() {
            bail!("flashgrpo-linear-loss: the forward ran without gradient tracking, or the backward already ran");
        }
        grads.into_iter().take(count).map(|g| scaled(g, upstream)).collect()
    }
}

impl CustomOp2 for LinearLoss {
    fn name(&self) -> &'static str {
        "flashgrpo-linear-loss"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> Result<(CpuStorage, Shape)> {
        let loss = self.dispatch(floats(s1, l1, "hidden")?, l1.shape(), floats(s2, l2, "weight")?, l2.shape(), None)?;
        Ok(scalar(loss))
    }

    fn bwd(
        &self,
        _h: &Tensor,
        _w: &Tensor,
        _loss: &Tensor,
        upstream: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let mut g = self.backward(upstream, 2)?.into_iter();
        Ok((g.next().flatten(), g.next().flatten()))
    }
}

impl CustomOp3 for LinearLoss {
    fn name(&self) -> &'static str {
        "flashgrpo-linear-loss"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let b = floats(s3, l3, "bias")?;
        let loss =
            self.dispatch(floats(s1, l1, "hidden")?, l1.shape(), floats(s2, l2, "weight")?, l2.shape(), Some(b))?;
        Ok(scalar(loss))
    }

    fn bwd(
        &self,
        _h: &Tensor,
        _w: &Tensor,
        _b: &Tensor,
        _loss: &Tensor,
        upstream: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let mut g = self.backward(upstream, 3)?.into_iter();
        Ok((g.next().flatten(), g.next().flatten(), g.next().flatten()))
    }
}
