//! Running one loss call with a chosen implementation, on logits or on hidden states and an
//! lm_head, on the CPU or a GPU (the same code over [`Backend`]), and what comes out of it.

use anyhow::{bail, Context, Result};
use clap::ValueEnum;
use flashgrpo_kernels::linear::reference as linear_reference;
use flashgrpo_kernels::{
    reference, Backend, ChunkBudget, LinearBuffers, LinearGradientBuffers, LossOptions, LossOutput, LossSpec,
};
use serde::{Deserialize, Serialize};

use crate::batch::{Batch, LinearData, Scores};
use crate::device::Device;
use crate::device::{DeviceVisitor, Runner};
use crate::tensor_io::{FloatData, FloatElement, FloatVisitor};

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize, Deserialize, Default)]
#[serde(rename_all = "kebab-case")]
pub enum Impl {
    /// The f64 reference (materialises everything; slow, obviously right).
    Reference,
    /// The streaming kernels (logits: gradient into a new buffer; hidden states: fused-linear).
    #[default]
    Fused,
    /// The streaming kernels, gradient written over (a copy of) the logits.
    FusedInplace,
}

/// One gradient output, in its input's dtype.
pub struct Grad {
    pub name: &'static str,
    pub shape: Vec<usize>,
    pub data: FloatData,
}

/// What a loss call produces: the outputs and the gradients.
pub struct Results {
    pub output: LossOutput,
    pub grads: Vec<Grad>,
}

/// The reference's f64 results, for comparisons: the outputs and each gradient by name.
pub struct ReferenceResults {
    pub output: reference::ReferenceOutput,
    pub grads: Vec<(&'static str, Vec<f64>)>,
}

/// The streaming kernels on a backend: a copy of the inputs in its buffers, the gradients read
/// back.
struct KernelRun<'a> {
    batch: &'a Batch,
    options: &'a LossOptions,
    in_place: bool,
    budget: ChunkBudget,
}

impl DeviceVisitor for KernelRun<'_> {
    type Out = Results;

    fn visit<R: Runner>(self, backend: &R) -> Result<Results> {
        let (batch, spec) = (self.batch, self.batch.spec(self.options));
        let shape = [batch.batch, batch.seq_len, batch.vocab];
        match &batch.scores {
            Scores::Logits(logits) => logits.visit(OnLogits { backend, spec, in_place: self.in_place, shape }),
            // `run_on` refuses `in_place` here.
            Scores::Linear(linear) => {
                linear.hidden.visit(OnLinear { backend, spec, linear, budget: self.budget, shape })
            }
        }
    }
}

/// Logits of any dtype on a backend.
struct OnLogits<'a, B> {
    backend: &'a B,
    spec: LossSpec<'a>,
    in_place: bool,
    shape: [usize; 3],
}

impl<B: Backend> FloatVisitor for OnLogits<'_, B> {
    type Out = Result<Results>;

    fn visit<T: FloatElement>(self, host: &[T]) -> Result<Results> {
        let (backend, spec) = (self.backend, self.spec);
        let mut logits = backend.upload(host.to_vec())?;
        if !spec.has_gradient() {
            return Ok(Results { output: backend.forward(spec, &logits)?, grads: Vec::new() });
        }
        let (output, grad) = if self.in_place {
            (backend.forward_backward(spec, &mut logits, None)?, logits)
        } else {
            let mut grad = backend.zeros::<T>(host.len())?;
            (backend.forward_backward(spec, &mut logits, Some(&mut grad))?, grad)
        };
        let data = T::wrap(backend.download(grad)?);
        Ok(Results { output, grads: vec![Grad { name: "grad_logits", shape: self.shape.to_vec(), data }] })
    }
}

/// Hidden states of any dtype (the weight and bias of the same) on a backend.
struct OnLinear<'a, B> {
    backend: &'a B,
    spec: LossSpec<'a>,
    linear: &'a LinearData,
    budget: ChunkBudget,
    shape: [usize; 3],
}

impl<B: Backend> FloatVisitor for OnLinear<'_, B> {
    type Out = Result<Results>;

    fn visit<T: FloatElement>(self, hidden: &[T]) -> Result<Results> {
        let (backend, spec, lin) = (self.backend, self.spec, self.linear);
        let buffers = LinearOnBackend::upload(backend, lin, hidden)?;
        let inputs = buffers.inputs();
        if !spec.has_gradient() {
            return Ok(Results { output: backend.linear_forward(spec, inputs, self.budget)?, grads: Vec::new() });
        }
        let [b, t, v] = self.shape;
        let h = lin.hidden_size;
        let (mut gh, mut gw) = (backend.zeros::<f32>(hidden.len())?, backend.zeros::<f32>(v * h)?);
        let mut gb = match lin.bias {
            Some(_) => Some(backend.zeros::<f32>(v)?),
            None => None,
        };
        let grads = LinearGradientBuffers { hidden: &mut gh, weight: Some(&mut gw), bias: gb.as_mut() };
        let output = backend.linear_forward_backward(spec, inputs, grads, self.budget)?;
        let mut named = vec![
            Grad { name: "grad_hidden", shape: vec![b, t, h], data: T::wrap_f32(&backend.download(gh)?) },
            Grad { name: "grad_weight", shape: vec![v, h], data: T::wrap_f32(&backend.download(gw)?) },
        ];
        if let Some(gb) = gb {
            named.push(Grad { name: "grad_bias", shape: vec![v], data: T::wrap_f32(&backend.download(gb)?) });
        }
        Ok(Results { output, grads: named })
    }
}

/// A fused-linear batch's hidden states, lm_head weight and bias in a backend's buffers.
pub struct LinearOnBackend<B: Backend, T: FloatElement> {
    pub hidden: B::Buffer<T>,
    pub weight: B::Buffer<T>,
    pub bias: Option<B::Buffer<T>>,
    pub hidden_size: usize,
}

impl<B: Backend, T: FloatElement> LinearOnBackend<B, T> {
    /// Copies `hidden` and `lin`'s weight and bias (one dtype: `Batch::read` and `InputSpec` give
    /// one) into `backend`'s buffers.
    pub fn upload(backend: &B, lin: &LinearData, hidden: &[T]) -> Result<Self> {
        let typed = |d: &FloatData| -> Result<B::Buffer<T>> {
            let values = T::slice_of(d).context("the hidden states, weight and bias share one dtype")?;
            Ok(backend.upload(values.to_vec())?)
        };
        Ok(Self {
            hidden: backend.upload(hidden.to_vec())?,
            weight: typed(&lin.weight)?,
            bias: lin.bias.as_ref().map(typed).transpose()?,
            hidden_size: lin.hidden_size,
        })
    }

    pub fn inputs(&self) -> LinearBuffers<'_, B, T> {
        LinearBuffers {
            hidden: &self.hidden,
            weight: &self.weight,
            bias: self.bias.as_ref(),
            hidden_size: self.hidden_size,
        }
    }
}

/// Rounds an f64 tensor to the dtype of the visited one.
struct RoundLike<'a>(&'a [f64]);

impl FloatVisitor for RoundLike<'_> {
    type Out = FloatData;
    fn visit<T: FloatElement>(self, _like: &[T]) -> FloatData {
        T::wrap(self.0.iter().map(|&x| T::from_f32(x as f32)).collect())
    }
}

fn to_f32(v: &[f64]) -> Vec<f32> {
    v.iter().map(|&x| x as f32).collect()
}

/// A gradient of the reference: name, shape, values.
type NamedGrad = (&'static str, Vec<usize>, Vec<f64>);

/// Runs the reference: its f64 results, and the same rounded to the contract's dtypes.
pub fn reference_results(batch: &Batch, options: &LossOptions) -> Result<(Results, ReferenceResults)> {
    let spec = batch.spec(options);
    let (b, t, v) = (batch.batch, batch.seq_len, batch.vocab);
    let (r, grads, like): (_, Vec<NamedGrad>, &FloatData) = match &batch.scores {
        Scores::Logits(logits) => {
            let r = reference::evaluate(spec, &logits.to_f64())?;
            let grads = r.grad.clone().map(|g| ("grad_logits", vec![b, t, v], g)).into_iter().collect();
            (r, grads, logits)
        }
        Scores::Linear(lin) => {
            let h = lin.hidden_size;
            let bias = lin.bias.as_ref().map(FloatData::to_f64);
            let r = linear_reference::evaluate(spec, &lin.hidden.to_f64(), &lin.weight.to_f64(), bias.as_deref(), h)?;
            let mut grads = Vec::new();
            if let (Some(gh), Some(gw)) = (r.grad_hidden, r.grad_weight) {
                grads.push(("grad_hidden", vec![b, t, h], gh));
                grads.push(("grad_weight", vec![v, h], gw));
            }
            if let Some(gb) = r.grad_bias {
                grads.push(("grad_bias", vec![v], gb));
            }
            (r.output, grads, &lin.hidden)
        }
    };
    let output = LossOutput {
        loss: r.loss,
        per_token_loss: to_f32(&r.per_token_loss),
        logp: r.logp.as_deref().map(to_f32),
        entropy: to_f32(&r.entropy),
        kl: r.kl.as_deref().map(to_f32),
        is_clipped: r.is_clipped.as_deref().map(to_f32),
        lse: to_f32(&r.lse),
        predicted: r.predicted.clone(),
    };
    let rounded = grads
        .iter()
        .map(|(name, shape, g)| Grad { name, shape: shape.clone(), data: like.visit(RoundLike(g)) })
        .collect();
    let exact = grads.into_iter().map(|(name, _, g)| (name, g)).collect();
    Ok((Results { output, grads: rounded }, ReferenceResults { output: r, grads: exact }))
}

/// Runs `imp` on the batch on `device` (the reference runs on the CPU).
pub fn run_on(device: Device, batch: &Batch, options: &LossOptions, imp: Impl, budget: ChunkBudget) -> Result<Results> {
    let in_place = match imp {
        Impl::Reference if device == Device::Cpu => return Ok(reference_results(batch, options)?.0),
        Impl::Reference => bail!("--device cuda runs the fused kernels; the reference is `--device cpu`"),
        Impl::Fused => false,
        Impl::FusedInplace => true,
    };
    if in_place && matches!(batch.scores, Scores::Linear(_)) {
        bail!("`--impl fused-inplace` writes the gradient over the logits; with `hidden` and `weight` use `fused`");
    }
    device.run(KernelRun { batch, options, in_place, budget })
}
