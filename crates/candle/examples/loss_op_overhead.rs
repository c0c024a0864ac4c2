//! What the candle loss ops cost beyond the kernels they call: one op call with its backward
//! (`loss_from_logits`, `loss_from_hidden`) against the same kernel writing into a buffer it
//! reuses, GRPO at N=1024 rows (B=8, T=128), V=151936, H=896, f32 and bf16, median of the
//! rounds, and the op's forward alone. The forward's excess is the op's own buffers: a fresh
//! gradient each call (its pages faulted in by the first write) and, for the fused-linear op's
//! 16-bit dtypes, the f32 gradients rounded into tensors of the inputs' dtype; the backward is
//! candle's (it adds each gradient to a new zeros tensor). Gradients are freed outside the timed
//! span. docs/BENCHMARKS.md ("The candle ops' own buffers").
//!
//! ```sh
//! cargo run --release -p flashgrpo-candle --example loss_op_overhead [ROUNDS]
//! ```

use std::sync::Arc;
use std::time::Instant;

use candle_core::{DType, Device, Tensor, Var};
use flashgrpo_candle::{loss_from_hidden, loss_from_logits, LossInputs};
use flashgrpo_kernels::synthetic::{normal_matrix, SyntheticSpec};
use flashgrpo_kernels::{
    forward_backward, linear_forward_backward, ChunkBudget, Element, LinearGradients, LinearInputs, LossOptions,
};
use half::bf16;

const B: usize = 8;
const T: usize = 128;
const V: usize = 151_936;
const H: usize = 896;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn seconds(f: impl FnOnce()) -> f64 {
    let start = Instant::now();
    f();
    start.elapsed().as_secs_f64()
}

fn main() -> candle_core::Result<()> {
    let rounds: usize = std::env::args().nth(1).map_or(5, |a| a.parse().expect("ROUNDS is a number"));
    assert!(rounds >= 1, "ROUNDS must be at least 1");
    let synthetic =
        SyntheticSpec { batch: B, seq_len: T, vocab: V, seed: 1, logit_std: 2.0, logp_noise: 0.3, mask_fraction: 0.1 };
    let data = synthetic.generate();
    let budget = ChunkBudget::from_mb(ChunkBudget::DEFAULT_MB);
    let inputs = Arc::new(data.grpo_inputs(&synthetic, LossOptions::default(), budget));
    let hidden = normal_matrix(B * T, H, 1.0, 2);
    let weight = normal_matrix(V, H, 0.05, 3);
    println!("GRPO, N={} V={V} H={H}, {rounds} rounds, median s (op call + backward / kernel alone)", B * T);
    for dtype in [DType::F32, DType::BF16] {
        let logits =
            Var::from_tensor(&Tensor::from_vec(data.logits.clone(), (B, T, V), &Device::Cpu)?.to_dtype(dtype)?)?;
        let (mut op, mut fwd, mut kernel) = (Vec::new(), Vec::new(), Vec::new());
        for _ in 0..rounds {
            let start = Instant::now();
            let out = loss_from_logits(logits.as_tensor(), &inputs)?;
            fwd.push(start.elapsed().as_secs_f64());
            let grads = out.loss.backward()?;
            op.push(start.elapsed().as_secs_f64());
            // Freed outside the timed span, as the kernel's reused buffers are never freed.
            drop(grads);
            kernel.push(match dtype {
                DType::F32 => kernel_logits::<f32>(&inputs, logits.as_tensor()),
                _ => kernel_logits::<bf16>(&inputs, logits.as_tensor()),
            });
        }
        println!(
            "  loss_from_logits {dtype:?}: {:.4} (forward {:.4}) / {:.4}",
            median(op),
            median(fwd),
            median(kernel)
        );
    }
    for dtype in [DType::F32, DType::BF16] {
        let h = Var::from_tensor(&Tensor::from_vec(hidden.clone(), (B, T, H), &Device::Cpu)?.to_dtype(dtype)?)?;
        let w = Var::from_tensor(&Tensor::from_vec(weight.clone(), (V, H), &Device::Cpu)?.to_dtype(dtype)?)?;
        let (mut op, mut fwd, mut kernel) = (Vec::new(), Vec::new(), Vec::new());
        for _ in 0..rounds {
            let start = Instant::now();
            let out = loss_from_hidden(h.as_tensor(), w.as_tensor(), None, &inputs)?;
            fwd.push(start.elapsed().as_secs_f64());
            let grads = out.loss.backward()?;
            op.push(start.elapsed().as_secs_f64());
            // Freed outside the timed span, as the kernel's reused buffers are never freed.
            drop(grads);
            kernel.push(match dtype {
                DType::F32 => kernel_linear::<f32>(&inputs, h.as_tensor(), w.as_tensor()),
                _ => kernel_linear::<bf16>(&inputs, h.as_tensor(), w.as_tensor()),
            });
        }
        println!(
            "  loss_from_hidden {dtype:?}: {:.4} (forward {:.4}) / {:.4}",
            median(op),
            median(fwd),
            median(kernel)
        );
    }
    Ok(())
}

/// The kernel alone, its gradient buffer written once before the timed call (reused, as the
/// trainer's and the Python pool's are).
fn kernel_logits<T: Element + candle_core::WithDType>(inputs: &LossInputs, logits: &Tensor) -> f64 {
    let values = logits.flatten_all().unwrap().to_vec1::<T>().unwrap();
    let mut grad = vec![T::from_f32(1.0); values.len()];
    seconds(|| {
        forward_backward(inputs.spec(V), &values, &mut grad).unwrap();
    })
}

fn kernel_linear<T: Element + candle_core::WithDType>(inputs: &LossInputs, h: &Tensor, w: &Tensor) -> f64 {
    let (h, w) = (h.flatten_all().unwrap().to_vec1::<T>().unwrap(), w.flatten_all().unwrap().to_vec1::<T>().unwrap());
    let (mut gh, mut gw) = (vec![1.0f32; h.len()], vec![1.0f32; w.len()]);
    seconds(|| {
        let grads = LinearGradients { hidden: &mut gh, weight: Some(&mut gw), bias: None, accumulate: false };
        let inputs_ = LinearInputs { hidden: &h, weight: &w, bias: None, hidden_size: H };
        linear_forward_backward(inputs.spec(V), inputs_, grads, inputs.budget).unwrap();
    })
}
