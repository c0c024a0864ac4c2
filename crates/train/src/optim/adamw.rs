//! AdamW (decoupled weight decay, PyTorch's update and defaults), with f32 master weights for
//! parameters held in bf16 / f16: the update is computed and kept in f32 and only its rounding is
//! written to the model, so that small steps are not lost to bf16's 8-bit mantissa.

use std::path::Path;

use std::cell::RefCell;

use candle_core::{bail, CpuStorage, DType, Device, InplaceOp1, Layout, Tensor};
use half::{bf16, f16};
use rayon::prelude::*;
use serde::{Deserialize, Serialize};

use super::grads::GradBuffers;
use crate::error::{Result, TrainError};
use crate::model::Params;
use crate::tensor_file::Entry;

/// AdamW's hyper-parameters (PyTorch's defaults, but no weight decay by default as TRL).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AdamWConfig {
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    /// Applied to matrices only: biases and norm weights (rank-1 parameters) are not decayed, as
    /// Hugging Face's Trainer does.
    pub weight_decay: f64,
}

impl Default for AdamWConfig {
    fn default() -> Self {
        Self { beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.0 }
    }
}

impl AdamWConfig {
    pub fn validate(&self, origin: &str) -> Result<()> {
        let bad = |why: String| Err(TrainError::Config { origin: origin.into(), why });
        for (name, b) in [("beta1", self.beta1), ("beta2", self.beta2)] {
            if !(0.0..1.0).contains(&b) {
                return bad(format!("optim.{name} must be in [0, 1), got {b}"));
            }
        }
        if self.eps.is_nan() || self.eps <= 0.0 {
            return bad(format!("optim.eps must be positive, got {}", self.eps));
        }
        if self.weight_decay.is_nan() || self.weight_decay < 0.0 {
            return bad(format!("optim.weight_decay must be >= 0, got {}", self.weight_decay));
        }
        Ok(())
    }
}

struct State {
    exp_avg: Vec<f32>,
    exp_avg_sq: Vec<f32>,
    /// f32 copy of a bf16 / f16 parameter; f32 parameters are their own master.
    master: Option<Vec<f32>>,
    decay: bool,
}

/// The optimiser's state for every parameter, in the parameters' order.
pub struct AdamW {
    pub config: AdamWConfig,
    /// Updates applied so far.
    pub steps: u64,
    states: Vec<State>,
}

#[derive(Clone, Copy)]
struct Coefficients {
    b1: f32,
    b2: f32,
    eps: f32,
    /// `lr / (1 - beta1^t)`.
    step_size: f32,
    /// `sqrt(1 - beta2^t)`.
    bias2_sqrt: f32,
    /// `1 - lr * weight_decay`, for decayed parameters.
    decay: f32,
}

/// AdamW on f32 weights (a parameter's own, or its master).
fn adamw(p: &mut [f32], m: &mut [f32], v: &mut [f32], g: &[f32], c: Coefficients, decay: bool) {
    let decay = if decay { c.decay } else { 1.0 };
    const CHUNK: usize = 1 << 14;
    p.par_chunks_mut(CHUNK)
        .zip(m.par_chunks_mut(CHUNK))
        .zip(v.par_chunks_mut(CHUNK))
        .zip(g.par_chunks(CHUNK))
        .for_each(|(((p, m), v), g)| {
            for j in 0..p.len() {
                let g = g[j];
                m[j] = c.b1 * m[j] + (1.0 - c.b1) * g;
                v[j] = c.b2 * v[j] + (1.0 - c.b2) * g * g;
                let denom = v[j].sqrt() / c.bias2_sqrt + c.eps;
                p[j] = p[j] * decay - c.step_size * m[j] / denom;
            }
        });
}

/// The update of one parameter, run by candle on its storage.
struct Update<'a> {
    state: RefCell<&'a mut State>,
    grad: &'a [f32],
    c: Coefficients,
}

impl InplaceOp1 for Update<'_> {
    fn name(&self) -> &'static str {
        "flashgrpo-adamw"
    }

    fn cpu_fwd(&self, storage: &mut CpuStorage, layout: &Layout) -> candle_core::Result<()> {
        let Some((start, end)) = layout.contiguous_offsets() else { bail!("AdamW: a parameter is not contiguous") };
        let mut state = self.state.borrow_mut();
        let State { exp_avg, exp_avg_sq, master, decay } = &mut **state;
        let (c, decay) = (self.c, *decay);
        /// `out = from(master)` in chunks, the conversion inlined (a bf16 model rounds all its
        /// parameters every step: through a function pointer that cost ~0.1 s a step at 166M).
        fn round<T: Send>(master: &[f32], out: &mut [T], from: impl Fn(f32) -> T + Sync) {
            out.par_chunks_mut(1 << 14).zip(master.par_chunks(1 << 14)).for_each(|(o, m)| {
                for (o, &m) in o.iter_mut().zip(m) {
                    *o = from(m);
                }
            });
        }
        match (storage, master.as_deref_mut()) {
            (CpuStorage::F32(p), None) => adamw(&mut p[start..end], exp_avg, exp_avg_sq, self.grad, c, decay),
            (CpuStorage::BF16(p), Some(m)) => {
                adamw(m, exp_avg, exp_avg_sq, self.grad, c, decay);
                // The kernels' branch-free rounding: `half`'s to the bit (tested there), and it vectorises.
                round(m, &mut p[start..end], <bf16 as flashgrpo_kernels::Element>::from_f32);
            }
            (CpuStorage::F16(p), Some(m)) => {
                adamw(m, exp_avg, exp_avg_sq, self.grad, c, decay);
                round(m, &mut p[start..end], f16::from_f32);
            }
            _ => bail!("AdamW: a parameter's dtype changed since the optimiser was created"),
        }
        Ok(())
    }
}

fn values(t: &Tensor) -> Result<Vec<f32>> {
    Ok(t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?)
}

impl AdamW {
    pub fn new(params: &Params, config: AdamWConfig) -> Result<Self> {
        let states = params
            .iter()
            .map(|(_, var)| {
                let n = var.elem_count();
                let master = (var.dtype() != DType::F32).then(|| values(var.as_tensor())).transpose()?;
                if !matches!(var.dtype(), DType::F32 | DType::BF16 | DType::F16) {
                    return Err(TrainError::Other(format!(
                        "AdamW: parameter dtype {:?} is not supported",
                        var.dtype()
                    )));
                }
                // Faulted in now: the first update reads them before it writes them.
                let zeros = || flashgrpo_kernels::huge_pages::zeroed_resident::<f32>(n);
                Ok(State { exp_avg: zeros(), exp_avg_sq: zeros(), master, decay: var.rank() >= 2 })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self { config, steps: 0, states })
    }

    /// One update with learning rate `lr` from the (already clipped) gradients, written into the
    /// parameters' storage in place (no copy of a `V x H` embedding per step).
    pub fn step(&mut self, params: &Params, grads: &GradBuffers, lr: f64) -> Result<()> {
        self.steps += 1;
        let c = self.config;
        let t = self.steps as i32;
        let coefficients = Coefficients {
            b1: c.beta1 as f32,
            b2: c.beta2 as f32,
            eps: c.eps as f32,
            step_size: (lr / (1.0 - c.beta1.powi(t))) as f32,
            bias2_sqrt: (1.0 - c.beta2.powi(t)).sqrt() as f32,
            decay: (1.0 - lr * c.weight_decay) as f32,
        };
        for (i, ((_, var), state)) in params.iter().zip(&mut self.states).enumerate() {
            let update = Update { state: RefCell::new(state), grad: grads.get(i), c: coefficients };
            var.as_tensor().inplace_op1(&update)?;
        }
        Ok(())
    }

    /// Writes the moments, the master weights and the step count to one safetensors file.
    /// The buffers are written as they are, not copied ([`crate::tensor_file`]).
    pub fn save(&self, params: &Params, path: &Path) -> Result<()> {
        let mut entries = Vec::new();
        for ((name, var), state) in params.iter().zip(&self.states) {
            let shape = var.dims();
            entries.push((format!("exp_avg.{name}"), Entry::f32(&state.exp_avg, shape)));
            entries.push((format!("exp_avg_sq.{name}"), Entry::f32(&state.exp_avg_sq, shape)));
            if let Some(m) = &state.master {
                entries.push((format!("master.{name}"), Entry::f32(m, shape)));
            }
        }
        entries.push(("steps".into(), Entry::f64_owned(&[self.steps as f64], &[1])));
        crate::tensor_file::write(path, &entries)
    }

    /// Restores what [`AdamW::save`] wrote, for the same parameters.
    pub fn load(params: &Params, config: AdamWConfig, path: &Path) -> Result<Self> {
        let file = path.display().to_string();
        let mut tensors = candle_core::safetensors::load(path, &Device::Cpu).map_err(|e| TrainError::Tensor {
            name: "*".into(),
            file: file.clone(),
            why: e.to_string(),
        })?;
        let mut take = |name: String, shape: &candle_core::Shape| -> Result<Vec<f32>> {
            let t = tensors.remove(&name).ok_or_else(|| TrainError::Tensor {
                name: name.clone(),
                file: file.clone(),
                why: "missing from the optimiser state".into(),
            })?;
            if t.shape() != shape {
                return Err(TrainError::Tensor {
                    name,
                    file: file.clone(),
                    why: format!("shape {:?}, the parameter's is {:?}", t.dims(), shape.dims()),
                });
            }
            values(&t)
        };
        let mut states = Vec::with_capacity(params.len());
        for (name, var) in params.iter() {
            let shape = var.shape();
            let exp_avg = take(format!("exp_avg.{name}"), shape)?;
            let exp_avg_sq = take(format!("exp_avg_sq.{name}"), shape)?;
            let master = (var.dtype() != DType::F32).then(|| take(format!("master.{name}"), shape)).transpose()?;
            states.push(State { exp_avg, exp_avg_sq, master, decay: var.rank() >= 2 });
        }
        let steps = values(&tensors.remove("steps").ok_or_else(|| TrainError::Tensor {
            name: "steps".into(),
            file: file.clone(),
            why: "missing from the optimiser state".into(),
        })?)?[0] as u64;
        Ok(Self { config, steps, states })
    }
}
