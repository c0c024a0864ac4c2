//! `--device cuda` for `flashgrpo loss`: the logits copied to GPU 0, the kernels of
//! flashgrpo-kernels' `cuda` feature (statistics and gradient on the GPU, the token objective on the
//! host), the gradient copied back. Fused-linear (hidden states and lm_head) is not on CUDA yet.

use anyhow::{bail, Result};
use flashgrpo_kernels::cuda::{CudaDevice, CudaElement};
use flashgrpo_kernels::{LossOptions, LossSpec};

use crate::batch::{Batch, Scores};
use crate::run::{Grad, Results};
use crate::tensor_io::{FloatData, FloatElement};

/// Runs the fused kernels on the GPU; `in_place` writes the gradient over the logits' device copy.
pub fn run_cuda(batch: &Batch, options: &LossOptions, in_place: bool) -> Result<Results> {
    let Scores::Logits(logits) = &batch.scores else {
        bail!("--device cuda: the fused-linear losses (hidden + weight) are not implemented on CUDA yet; give logits")
    };
    let device = CudaDevice::new(0)?;
    let spec = batch.spec(options);
    let shape = vec![batch.batch, batch.seq_len, batch.vocab];
    match logits {
        FloatData::F32(v) => on_device(&device, spec, v, in_place, shape),
        FloatData::BF16(v) => on_device(&device, spec, v, in_place, shape),
        FloatData::F16(v) => on_device(&device, spec, v, in_place, shape),
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
    let mut grad = if in_place {
        None
    } else {
        Some(device.stream().alloc_zeros::<T>(host.len()).map_err(|e| anyhow::anyhow!("CUDA allocation: {e:?}"))?)
    };
    let output = device.forward_backward(spec, &mut logits, grad.as_mut())?;
    let data = device.download(grad.as_ref().unwrap_or(&logits))?;
    Ok(Results { output, grads: vec![Grad { name: "grad_logits", shape, data: T::wrap(data) }] })
}
