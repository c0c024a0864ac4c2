//! `--device cuda` for `flashgrpo loss` and `gradcheck`: the inputs copied to GPU 0, the kernels of
//! flashgrpo-kernels' `cuda` feature (statistics and gradient on the GPU, the token objective on the
//! host; cuBLAS's products for fused-linear), the gradients copied back.

use std::sync::OnceLock;

use anyhow::{bail, Context, Result};
use flashgrpo_kernels::cuda::{CudaDevice, CudaElement, CudaLinearGradients, CudaLinearInputs, CudaSlice};
use flashgrpo_kernels::{ChunkBudget, LossOptions, LossSpec};

use crate::batch::{Batch, LinearData, Scores};
use crate::run::{Grad, Results};
use crate::tensor_io::{FloatData, FloatElement};

/// GPU 0, opened (and its kernels compiled) once per process.
pub fn gpu() -> Result<&'static CudaDevice> {
    static DEVICE: OnceLock<CudaDevice> = OnceLock::new();
    if let Some(d) = DEVICE.get() {
        return Ok(d);
    }
    let device = CudaDevice::new(0)?;
    Ok(DEVICE.get_or_init(|| device))
}

/// Runs the fused kernels on the GPU; `in_place` writes the gradient over the logits' device copy.
pub fn run_cuda(batch: &Batch, options: &LossOptions, in_place: bool, budget: ChunkBudget) -> Result<Results> {
    let device = gpu()?;
    let spec = batch.spec(options);
    match &batch.scores {
        Scores::Logits(logits) => {
            let shape = vec![batch.batch, batch.seq_len, batch.vocab];
            match logits {
                FloatData::F32(v) => on_device(device, spec, v, in_place, shape),
                FloatData::BF16(v) => on_device(device, spec, v, in_place, shape),
                FloatData::F16(v) => on_device(device, spec, v, in_place, shape),
            }
        }
        Scores::Linear(_) if in_place => {
            bail!("`--impl fused-inplace` writes the gradient over the logits; with `hidden` and `weight` use `fused`")
        }
        Scores::Linear(linear) => {
            let run = LinearRun { device, spec, linear, budget, shape: [batch.batch, batch.seq_len, batch.vocab] };
            match &linear.hidden {
                FloatData::F32(h) => run.on_device(h),
                FloatData::BF16(h) => run.on_device(h),
                FloatData::F16(h) => run.on_device(h),
            }
        }
    }
}

fn on_device<T: CudaElement + FloatElement + Default + Clone>(
    device: &CudaDevice,
    spec: LossSpec<'_>,
    host: &[T],
    in_place: bool,
    shape: Vec<usize>,
) -> Result<Results> {
    let mut logits = device.upload(host)?;
    if !spec.loss.has_gradient() {
        return Ok(Results { output: device.forward(spec, &logits)?, grads: Vec::new() });
    }
    let mut grad = if in_place { None } else { Some(device.zeros::<T>(host.len())?) };
    let output = device.forward_backward(spec, &mut logits, grad.as_mut())?;
    let data = device.download(grad.as_ref().unwrap_or(&logits))?;
    Ok(Results { output, grads: vec![Grad { name: "grad_logits", shape, data: T::wrap(data) }] })
}

/// One fused-linear call on the GPU.
struct LinearRun<'a> {
    device: &'a CudaDevice,
    spec: LossSpec<'a>,
    linear: &'a LinearData,
    budget: ChunkBudget,
    shape: [usize; 3],
}

impl LinearRun<'_> {
    fn on_device<T: CudaElement + FloatElement + Default + Clone>(self, hidden: &[T]) -> Result<Results> {
        let (device, lin) = (self.device, self.linear);
        let on_gpu = DeviceLinear::upload(device, lin, hidden)?;
        let inputs = on_gpu.inputs();
        let has_bias = on_gpu.bias.is_some();
        if !self.spec.loss.has_gradient() {
            return Ok(Results { output: device.linear_forward(self.spec, inputs, self.budget)?, grads: Vec::new() });
        }
        let [b, t, v] = self.shape;
        let h = lin.hidden_size;
        let mut gh = device.zeros::<f32>(hidden.len())?;
        let mut gw = device.zeros::<f32>(v * h)?;
        let mut gb = device.zeros::<f32>(v)?;
        let grads = CudaLinearGradients {
            hidden: &mut gh,
            weight: Some(&mut gw),
            bias: if has_bias { Some(&mut gb) } else { None },
        };
        let output = device.linear_forward_backward(self.spec, inputs, grads, self.budget)?;
        let mut named = vec![
            Grad { name: "grad_hidden", shape: vec![b, t, h], data: T::wrap_f32(&device.download(&gh)?) },
            Grad { name: "grad_weight", shape: vec![v, h], data: T::wrap_f32(&device.download(&gw)?) },
        ];
        if has_bias {
            named.push(Grad { name: "grad_bias", shape: vec![v], data: T::wrap_f32(&device.download(&gb)?) });
        }
        Ok(Results { output, grads: named })
    }
}

/// A fused-linear batch's hidden states, lm_head weight and bias on the GPU.
pub struct DeviceLinear<T> {
    pub hidden: CudaSlice<T>,
    pub weight: CudaSlice<T>,
    pub bias: Option<CudaSlice<T>>,
    pub hidden_size: usize,
}

impl<T: CudaElement + FloatElement> DeviceLinear<T> {
    /// Copies `hidden` and `lin`'s weight and bias (one dtype: `Batch::read` and `InputSpec` give
    /// one) to the GPU.
    pub fn upload(device: &CudaDevice, lin: &LinearData, hidden: &[T]) -> Result<Self> {
        let typed = |d: &FloatData| -> Result<CudaSlice<T>> {
            let values = T::slice_of(d).context("the hidden states, weight and bias share one dtype")?;
            Ok(device.upload(values)?)
        };
        Ok(Self {
            hidden: device.upload(hidden)?,
            weight: typed(&lin.weight)?,
            bias: lin.bias.as_ref().map(typed).transpose()?,
            hidden_size: lin.hidden_size,
        })
    }

    pub fn inputs(&self) -> CudaLinearInputs<'_, T> {
        CudaLinearInputs {
            hidden: &self.hidden,
            weight: &self.weight,
            bias: self.bias.as_ref(),
            hidden_size: self.hidden_size,
        }
    }
}
