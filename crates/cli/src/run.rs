//! Running one loss call with a chosen implementation, on logits or on hidden states and an
//! lm_head, and what comes out of it.

use anyhow::{bail, Result};
use clap::ValueEnum;
use flashgrpo_kernels::linear::reference as linear_reference;
use flashgrpo_kernels::{
    forward, forward_backward, forward_backward_in_place, linear_forward, linear_forward_backward, reference,
    ChunkBudget, LinearGradients, LinearInputs, LossOptions, LossOutput, LossSpec,
};
use serde::{Deserialize, Serialize};

use crate::batch::{Batch, LinearData, Scores};
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

/// The streaming kernels on logits of any dtype.
pub struct Fused<'a> {
    pub spec: LossSpec<'a>,
    pub in_place: bool,
}

impl FloatVisitor for Fused<'_> {
    type Out = Result<(LossOutput, Option<FloatData>)>;

    fn visit<T: FloatElement>(self, logits: &[T]) -> Self::Out {
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

/// The fused-linear kernels on hidden states of any dtype (the weight and bias of the same).
pub struct FusedLinear<'a> {
    pub spec: LossSpec<'a>,
    pub linear: &'a LinearData,
    pub budget: ChunkBudget,
    pub shape: [usize; 3],
}

impl FloatVisitor for FusedLinear<'_> {
    type Out = Result<(LossOutput, Vec<Grad>)>;

    fn visit<T: FloatElement>(self, hidden: &[T]) -> Self::Out {
        let lin = self.linear;
        let inputs = LinearInputs {
            hidden,
            weight: typed::<T>(&lin.weight),
            bias: lin.bias.as_ref().map(typed::<T>),
            hidden_size: lin.hidden_size,
        };
        if !self.spec.loss.has_gradient() {
            return Ok((linear_forward(self.spec, inputs, self.budget)?, Vec::new()));
        }
        let [b, t, v] = self.shape;
        let h = lin.hidden_size;
        let mut gh = vec![0.0f32; hidden.len()];
        let mut gw = vec![0.0f32; v * h];
        let mut gb = vec![0.0f32; if lin.bias.is_some() { v } else { 0 }];
        let grads = LinearGradients {
            hidden: &mut gh,
            weight: Some(&mut gw),
            bias: lin.bias.is_some().then_some(&mut gb[..]),
            accumulate: false,
        };
        let out = linear_forward_backward(self.spec, inputs, grads, self.budget)?;
        let mut named = vec![
            Grad { name: "grad_hidden", shape: vec![b, t, h], data: T::wrap_f32(&gh) },
            Grad { name: "grad_weight", shape: vec![v, h], data: T::wrap_f32(&gw) },
        ];
        if lin.bias.is_some() {
            named.push(Grad { name: "grad_bias", shape: vec![v], data: T::wrap_f32(&gb) });
        }
        Ok((out, named))
    }
}

/// The weight or bias in the hidden states' dtype (`Batch::read` and `InputSpec` give one dtype).
fn typed<T: FloatElement>(data: &FloatData) -> &[T] {
    T::slice_of(data).expect("the hidden states, weight and bias share one dtype")
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
    };
    let rounded = grads
        .iter()
        .map(|(name, shape, g)| Grad { name, shape: shape.clone(), data: like.visit(RoundLike(g)) })
        .collect();
    let exact = grads.into_iter().map(|(name, _, g)| (name, g)).collect();
    Ok((Results { output, grads: rounded }, ReferenceResults { output: r, grads: exact }))
}

/// Where the fused kernels run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Device {
    #[default]
    Cpu,
    /// GPU 0 (feature `cuda`; needs a driver, NVRTC and, for fused-linear, cuBLAS at run time).
    Cuda,
}

/// Runs `imp` on the batch on `device`.
pub fn run_on(device: Device, batch: &Batch, options: &LossOptions, imp: Impl, budget: ChunkBudget) -> Result<Results> {
    match device {
        Device::Cpu => run(batch, options, imp, budget),
        Device::Cuda => run_on_gpu(batch, options, imp, budget),
    }
}

impl Device {
    /// What the device is, for reports: `cpu`, or `cuda: NAME (sm_XY)` (opening the GPU).
    pub fn describe(self) -> Result<String> {
        match self {
            Device::Cpu => Ok("cpu".into()),
            #[cfg(feature = "cuda")]
            Device::Cuda => {
                let gpu = crate::cuda_run::gpu()?;
                Ok(format!("cuda: {} ({})", gpu.name, gpu.arch))
            }
            #[cfg(not(feature = "cuda"))]
            Device::Cuda => bail!("this flashgrpo was built without the `cuda` feature"),
        }
    }
}

#[cfg(feature = "cuda")]
fn run_on_gpu(batch: &Batch, options: &LossOptions, imp: Impl, budget: ChunkBudget) -> Result<Results> {
    match imp {
        Impl::Reference => bail!("--device cuda runs the fused kernels; the reference is `--device cpu`"),
        Impl::Fused => crate::cuda_run::run_cuda(batch, options, false, budget),
        Impl::FusedInplace => crate::cuda_run::run_cuda(batch, options, true, budget),
    }
}

#[cfg(not(feature = "cuda"))]
fn run_on_gpu(_: &Batch, _: &LossOptions, _: Impl, _: ChunkBudget) -> Result<Results> {
    bail!("this flashgrpo was built without the `cuda` feature")
}

/// Runs `imp` on the batch.
pub fn run(batch: &Batch, options: &LossOptions, imp: Impl, budget: ChunkBudget) -> Result<Results> {
    let spec = batch.spec(options);
    let in_place = match imp {
        Impl::Reference => return Ok(reference_results(batch, options)?.0),
        Impl::Fused => false,
        Impl::FusedInplace => true,
    };
    match &batch.scores {
        Scores::Logits(logits) => {
            let (output, grad) = logits.visit(Fused { spec, in_place })?;
            let grads = grad.map(|data| Grad {
                name: "grad_logits",
                shape: vec![batch.batch, batch.seq_len, batch.vocab],
                data,
            });
            Ok(Results { output, grads: grads.into_iter().collect() })
        }
        Scores::Linear(_) if in_place => {
            bail!("`--impl fused-inplace` writes the gradient over the logits; with `hidden` and `weight` use `fused`")
        }
        Scores::Linear(linear) => {
            let shape = [batch.batch, batch.seq_len, batch.vocab];
            let (output, grads) = linear.hidden.visit(FusedLinear { spec, linear, budget, shape })?;
            Ok(Results { output, grads })
        }
    }
}
