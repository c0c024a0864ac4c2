//! The `flashgrpo` wheel's native module, `flashgrpo._native`: the kernels' losses on buffers
//! owned by the caller's framework (PyTorch, NumPy, JAX), read and written in place.
//!
//! The Python package (`crates/python/python/flashgrpo`) checks every tensor (device, dtype,
//! contiguity, shape) and passes its address; this module turns the addresses back into slices
//! for the length of one call, with the GIL released, and calls the same
//! [`flashgrpo_kernels`] entry points as the CLI and the candle ops. No math lives here.

mod buffers;
mod call;
mod deferred;
mod jax_handlers;
mod pool;
mod result;
mod xla_ffi;

use pyo3::prelude::*;

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(call::loss, m)?)?;
    m.add_function(wrap_pyfunction!(call::linear_loss, m)?)?;
    m.add_function(wrap_pyfunction!(call::loss_deferred, m)?)?;
    m.add_function(wrap_pyfunction!(call::linear_loss_deferred, m)?)?;
    m.add_function(wrap_pyfunction!(call::default_bf16_products, m)?)?;
    m.add_function(wrap_pyfunction!(call::has_gradient, m)?)?;
    m.add_class::<deferred::DeferredGradient>()?;
    m.add_class::<result::LossResult>()?;
    m.add_class::<pool::GradientBuffer>()?;
    m.add_function(wrap_pyfunction!(pool::gradient_buffer, m)?)?;
    m.add_function(wrap_pyfunction!(pool::release_cached_buffers, m)?)?;
    m.add_function(wrap_pyfunction!(jax_handlers::ffi_handlers, m)?)?;
    m.add("OPTION_NAMES", flashgrpo_kernels::LossOptions::NAMES.to_vec())?;
    m.add("DEFAULT_CHUNK_MEMORY_MB", flashgrpo_kernels::ChunkBudget::DEFAULT_MB)?;
    m.add("ROW_VALUES", deferred::ROW_VALUES)?;
    Ok(())
}
