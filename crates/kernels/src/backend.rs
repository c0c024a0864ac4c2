//! CPU and CUDA as two backends of one API. A front end (the CLI's `loss`, `gradcheck` and
//! `bench`) is written once over [`Backend`]: it puts its inputs into the backend's buffers, calls
//! the same four loss entry points, and reads the results back, whether the buffers are host
//! vectors streamed by the CPU engine or device memory streamed by the CUDA kernels. Both run the
//! same three steps on the same [`LossSpec`]; only where the buffers live differs.

use rayon::prelude::*;

use crate::element::Element;
use crate::error::LossError;
use crate::linear::{ChunkBudget, LinearGradients, LinearInputs};
use crate::{engine, linear, LossOutput, LossSpec};

/// `dst = src` (same lengths), a share on each of the pool's threads.
///
/// # Panics
/// If the lengths differ.
pub fn parallel_copy<T: Copy + Send + Sync>(dst: &mut [T], src: &[T]) {
    assert_eq!(dst.len(), src.len(), "parallel_copy: lengths");
    let chunk = src.len().div_ceil(rayon::current_num_threads()).max(1 << 14);
    dst.par_chunks_mut(chunk).zip(src.par_chunks(chunk)).for_each(|(d, s)| d.copy_from_slice(s));
}

/// `src` rounded to `T` (to nearest even, as [`Element::from_f32`]) into a fresh buffer, a share
/// on each of the pool's threads: the f32 gradients of the fused-linear products handed back in a
/// 16-bit dtype (`V x H` values for the weight: 136 M at Qwen2.5-0.5B's head).
pub fn parallel_round<T: Element>(src: &[f32]) -> Vec<T> {
    // Fixed shares that idle threads can steal; one share a thread (`parallel_copy`'s rule)
    // measured no faster and spread more (docs/BENCHMARKS.md, "The candle ops' own buffers").
    const CHUNK: usize = 1 << 16;
    let mut dst = crate::huge_pages::zeroed::<T>(src.len());
    dst.par_chunks_mut(CHUNK).zip(src.par_chunks(CHUNK)).for_each(|(d, s)| {
        d.iter_mut().zip(s).for_each(|(d, &s)| *d = T::from_f32(s));
    });
    dst
}

/// Where the kernels run: its buffers, copies to and from the host, and the loss calls on them.
pub trait Backend {
    /// A buffer of `T`s the kernels read and write: a `Vec` on the CPU, device memory on a GPU.
    type Buffer<T: Element>;

    /// What runs the kernels, for reports: `cpu`, `cuda: NAME (sm_XY)`.
    fn describe(&self) -> String;

    /// The host values as a buffer of this backend (the CPU keeps the vector; a GPU copies it).
    fn upload<T: Element>(&self, host: Vec<T>) -> Result<Self::Buffer<T>, LossError>;

    /// Overwrites `buffer` with `host` (of its length).
    fn refill<T: Element>(&self, host: &[T], buffer: &mut Self::Buffer<T>) -> Result<(), LossError>;

    /// A buffer of `len` zeros.
    fn zeros<T: Element>(&self, len: usize) -> Result<Self::Buffer<T>, LossError>;

    /// The buffer's values on the host.
    fn download<T: Element>(&self, buffer: Self::Buffer<T>) -> Result<Vec<T>, LossError>;

    /// Waits for the work queued so far (nothing to wait for on the CPU).
    fn synchronize(&self) -> Result<(), LossError>;

    /// The loss and per-token outputs of `logits`, no gradient.
    fn forward<T: Element>(&self, spec: LossSpec<'_>, logits: &Self::Buffer<T>) -> Result<LossOutput, LossError>;

    /// The loss, and its gradient written into `grad`, or over the logits when `grad` is `None`.
    fn forward_backward<T: Element>(
        &self,
        spec: LossSpec<'_>,
        logits: &mut Self::Buffer<T>,
        grad: Option<&mut Self::Buffer<T>>,
    ) -> Result<LossOutput, LossError>;

    /// The loss of `hidden @ weight^T (+ bias)`, no gradient.
    fn linear_forward<T: Element>(
        &self,
        spec: LossSpec<'_>,
        inputs: LinearBuffers<'_, Self, T>,
        budget: ChunkBudget,
    ) -> Result<LossOutput, LossError>;

    /// The loss of `hidden @ weight^T (+ bias)` and its f32 gradients (those asked for).
    fn linear_forward_backward<T: Element>(
        &self,
        spec: LossSpec<'_>,
        inputs: LinearBuffers<'_, Self, T>,
        grads: LinearGradientBuffers<'_, Self>,
        budget: ChunkBudget,
    ) -> Result<LossOutput, LossError>;
}

/// A fused-linear loss's inputs in a backend's buffers.
pub struct LinearBuffers<'a, B: Backend + ?Sized, T: Element> {
    pub hidden: &'a B::Buffer<T>,
    pub weight: &'a B::Buffer<T>,
    pub bias: Option<&'a B::Buffer<T>>,
    pub hidden_size: usize,
}

impl<B: Backend + ?Sized, T: Element> Clone for LinearBuffers<'_, B, T> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<B: Backend + ?Sized, T: Element> Copy for LinearBuffers<'_, B, T> {}

/// A fused-linear loss's f32 gradients in a backend's buffers (`hidden` always; `weight` and
/// `bias` when asked for), overwritten.
pub struct LinearGradientBuffers<'a, B: Backend + ?Sized> {
    pub hidden: &'a mut B::Buffer<f32>,
    pub weight: Option<&'a mut B::Buffer<f32>>,
    pub bias: Option<&'a mut B::Buffer<f32>>,
}

/// The CPU engine: buffers are host vectors, streamed by the machine's threads (rayon).
#[derive(Debug, Clone, Copy, Default)]
pub struct Cpu;

impl Backend for Cpu {
    type Buffer<T: Element> = Vec<T>;

    fn describe(&self) -> String {
        "cpu".into()
    }

    fn upload<T: Element>(&self, host: Vec<T>) -> Result<Vec<T>, LossError> {
        Ok(host)
    }

    fn refill<T: Element>(&self, host: &[T], buffer: &mut Vec<T>) -> Result<(), LossError> {
        check_refill(host.len(), buffer.len())?;
        // On every thread, as a model's threads write its logits. Copied by the calling thread
        // alone, the in-place sequence-level step that followed ran 1.6x slower on cpu-2c (its
        // statistics pass 12.5 -> 20 ms, its gradient pass 24 -> 42 ms; unexplained, not seen
        // when the caller is a pool thread): a figure of the harness, not of the kernels.
        parallel_copy(buffer, host);
        Ok(())
    }

    /// Zeroed pages from the allocator, advised for huge pages (`vec![T::default(); len]` would
    /// write a 16-bit buffer element by element on one thread).
    fn zeros<T: Element>(&self, len: usize) -> Result<Vec<T>, LossError> {
        Ok(crate::huge_pages::zeroed(len))
    }

    fn download<T: Element>(&self, buffer: Vec<T>) -> Result<Vec<T>, LossError> {
        Ok(buffer)
    }

    fn synchronize(&self) -> Result<(), LossError> {
        Ok(())
    }

    fn forward<T: Element>(&self, spec: LossSpec<'_>, logits: &Vec<T>) -> Result<LossOutput, LossError> {
        engine::forward(spec, logits)
    }

    fn forward_backward<T: Element>(
        &self,
        spec: LossSpec<'_>,
        logits: &mut Vec<T>,
        grad: Option<&mut Vec<T>>,
    ) -> Result<LossOutput, LossError> {
        match grad {
            Some(grad) => engine::forward_backward(spec, logits, grad),
            None => engine::forward_backward_in_place(spec, logits),
        }
    }

    fn linear_forward<T: Element>(
        &self,
        spec: LossSpec<'_>,
        inputs: LinearBuffers<'_, Self, T>,
        budget: ChunkBudget,
    ) -> Result<LossOutput, LossError> {
        linear::linear_forward(spec, host_inputs(inputs), budget)
    }

    fn linear_forward_backward<T: Element>(
        &self,
        spec: LossSpec<'_>,
        inputs: LinearBuffers<'_, Self, T>,
        grads: LinearGradientBuffers<'_, Self>,
        budget: ChunkBudget,
    ) -> Result<LossOutput, LossError> {
        let grads = LinearGradients {
            hidden: grads.hidden,
            weight: grads.weight.map(|w| &mut w[..]),
            bias: grads.bias.map(|b| &mut b[..]),
            accumulate: false,
        };
        linear::linear_forward_backward(spec, host_inputs(inputs), grads, budget)
    }
}

/// A refill must cover the whole buffer.
fn check_refill(host: usize, buffer: usize) -> Result<(), LossError> {
    if host == buffer {
        return Ok(());
    }
    Err(LossError::Shape {
        tensor: "buffer",
        got: vec![buffer],
        expected: format!("the {host} elements of the host values it is refilled from"),
    })
}

fn host_inputs<'a, T: Element>(inputs: LinearBuffers<'a, Cpu, T>) -> LinearInputs<'a, T> {
    LinearInputs {
        hidden: inputs.hidden,
        weight: inputs.weight,
        bias: inputs.bias.map(Vec::as_slice),
        hidden_size: inputs.hidden_size,
    }
}

#[cfg(feature = "cuda")]
mod on_gpu {
    use super::{Backend, LinearBuffers, LinearGradientBuffers};
    use crate::cuda::device::cuda_error;
    use crate::cuda::{CudaDevice, CudaLinearGradients, CudaLinearInputs, CudaSlice};
    use crate::element::Element;
    use crate::error::LossError;
    use crate::linear::ChunkBudget;
    use crate::{LossOutput, LossSpec};

    /// One GPU: buffers in device memory, streamed by the CUDA kernels (cuBLAS for fused-linear's
    /// products).
    impl Backend for CudaDevice {
        type Buffer<T: Element> = CudaSlice<T>;

        fn describe(&self) -> String {
            format!("cuda: {} ({})", self.name, self.arch)
        }

        fn upload<T: Element>(&self, host: Vec<T>) -> Result<CudaSlice<T>, LossError> {
            CudaDevice::upload(self, &host)
        }

        fn refill<T: Element>(&self, host: &[T], buffer: &mut CudaSlice<T>) -> Result<(), LossError> {
            super::check_refill(host.len(), buffer.len())?;
            self.stream().memcpy_htod(host, buffer).map_err(cuda_error("copying to the GPU"))
        }

        fn zeros<T: Element>(&self, len: usize) -> Result<CudaSlice<T>, LossError> {
            CudaDevice::zeros(self, len)
        }

        fn download<T: Element>(&self, buffer: CudaSlice<T>) -> Result<Vec<T>, LossError> {
            CudaDevice::download(self, &buffer)
        }

        fn synchronize(&self) -> Result<(), LossError> {
            CudaDevice::synchronize(self)
        }

        fn forward<T: Element>(&self, spec: LossSpec<'_>, logits: &CudaSlice<T>) -> Result<LossOutput, LossError> {
            CudaDevice::forward(self, spec, logits)
        }

        fn forward_backward<T: Element>(
            &self,
            spec: LossSpec<'_>,
            logits: &mut CudaSlice<T>,
            grad: Option<&mut CudaSlice<T>>,
        ) -> Result<LossOutput, LossError> {
            CudaDevice::forward_backward(self, spec, logits, grad)
        }

        fn linear_forward<T: Element>(
            &self,
            spec: LossSpec<'_>,
            inputs: LinearBuffers<'_, Self, T>,
            budget: ChunkBudget,
        ) -> Result<LossOutput, LossError> {
            CudaDevice::linear_forward(self, spec, device_inputs(inputs), budget)
        }

        fn linear_forward_backward<T: Element>(
            &self,
            spec: LossSpec<'_>,
            inputs: LinearBuffers<'_, Self, T>,
            grads: LinearGradientBuffers<'_, Self>,
            budget: ChunkBudget,
        ) -> Result<LossOutput, LossError> {
            let grads = CudaLinearGradients { hidden: grads.hidden, weight: grads.weight, bias: grads.bias };
            CudaDevice::linear_forward_backward(self, spec, device_inputs(inputs), grads, budget)
        }
    }

    fn device_inputs<'a, T: Element>(inputs: LinearBuffers<'a, CudaDevice, T>) -> CudaLinearInputs<'a, T> {
        CudaLinearInputs {
            hidden: inputs.hidden,
            weight: inputs.weight,
            bias: inputs.bias,
            hidden_size: inputs.hidden_size,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Loss, LossOptions, PolicyInputs, Rows};

    /// The CPU backend is the engine: the same bits through either door.
    #[test]
    fn the_cpu_backend_gives_the_engines_bits() {
        let (b, t, v) = (2, 3, 37);
        let logits: Vec<f32> = (0..b * t * v).map(|i| ((i * 7919) % 113) as f32 * 0.05 - 2.0).collect();
        let targets: Vec<i64> = (0..b * t).map(|i| (i * 5 % v) as i64).collect();
        let options = LossOptions { beta: 0.0, ..Default::default() };
        let spec = LossSpec {
            loss: Loss::Grpo(PolicyInputs::new(&[0.5, -1.0])),
            rows: Rows { batch: b, seq_len: t, vocab: v, targets: Some(&targets), mask: None },
            options: &options,
            batch_shard: None,
        };
        let mut want = vec![0.0f32; logits.len()];
        let want_out = engine::forward_backward(spec, &logits, &mut want).unwrap();
        let cpu = Cpu;
        let mut on = cpu.upload(logits.clone()).unwrap();
        let mut grad = cpu.zeros::<f32>(logits.len()).unwrap();
        let out = cpu.forward_backward(spec, &mut on, Some(&mut grad)).unwrap();
        assert_eq!(out.loss.to_bits(), want_out.loss.to_bits());
        assert_eq!(cpu.download(grad).unwrap(), want);
        cpu.forward_backward(spec, &mut on, None).unwrap();
        assert_eq!(cpu.download(on).unwrap(), want);
    }
}
