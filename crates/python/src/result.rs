//! A call's results, kept on the Rust side until the Python side copies the per-token outputs it
//! wants into tensors of its own framework (one small `[B, T]` copy each, no Python lists).

use flashgrpo_kernels::LossOutput;
use pyo3::exceptions::{PyKeyError, PyValueError};
use pyo3::prelude::*;

use crate::buffers::Address;

/// The loss and the per-token outputs `[B, T]` (f32) of one call.
#[pyclass(frozen, module = "flashgrpo._native")]
pub struct LossResult {
    output: LossOutput,
}

impl LossResult {
    pub fn new(output: LossOutput) -> Self {
        Self { output }
    }

    fn per_token(&self, name: &str) -> PyResult<Option<&[f32]>> {
        let o = &self.output;
        Ok(match name {
            "per_token_loss" => Some(&o.per_token_loss),
            "entropy" => Some(&o.entropy),
            "logp" => o.logp.as_deref(),
            "kl" => o.kl.as_deref(),
            "is_clipped" => o.is_clipped.as_deref(),
            "lse" => Some(&o.lse),
            _ => return Err(PyKeyError::new_err(format!("no per-token output `{name}`"))),
        })
    }
}

#[pymethods]
impl LossResult {
    /// The loss (f64, as the kernels reduce it).
    #[getter]
    fn loss(&self) -> f64 {
        self.output.loss
    }

    /// Whether the per-token output `name` was computed (`predicted_tokens`: the i64 one).
    fn has(&self, name: &str) -> PyResult<bool> {
        if name == "predicted_tokens" {
            return Ok(self.output.predicted.is_some());
        }
        Ok(self.per_token(name)?.is_some())
    }

    /// Copies the predicted tokens (`LossOptions::predicted_tokens`; -1 where a row takes no part)
    /// into the i64 buffer of `len` elements at `address`.
    fn copy_tokens_into(&self, address: usize, len: usize) -> PyResult<()> {
        let values = self.output.predicted.as_deref();
        let values = values.ok_or_else(|| PyKeyError::new_err("`predicted_tokens` was not computed"))?;
        if values.len() != len {
            return Err(PyValueError::new_err(format!(
                "`predicted_tokens` has {} values, the buffer {len}",
                values.len()
            )));
        }
        // SAFETY: the module's contract for `address`.
        let out = unsafe { Address::new("out", address, len).slice_mut::<i64>() }.map_err(PyValueError::new_err)?;
        out.ok_or_else(|| PyValueError::new_err("null output buffer"))?.copy_from_slice(values);
        Ok(())
    }

    /// Copies the per-token output `name` into the f32 buffer of `len` elements at `address`.
    fn copy_into(&self, name: &str, address: usize, len: usize) -> PyResult<()> {
        let values = self.per_token(name)?.ok_or_else(|| PyKeyError::new_err(format!("`{name}` was not computed")))?;
        if values.len() != len {
            return Err(PyValueError::new_err(format!("`{name}` has {} values, the buffer {len}", values.len())));
        }
        // SAFETY: the module's contract for `address`.
        let out = unsafe { Address::new("out", address, len).slice_mut::<f32>() }.map_err(PyValueError::new_err)?;
        out.ok_or_else(|| PyValueError::new_err("null output buffer"))?.copy_from_slice(values);
        Ok(())
    }
}
