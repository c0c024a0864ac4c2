//! Gradient buffers that come back. A gradient of `[N, V]` logits is hundreds of MiB; allocated
//! fresh each step (as PyTorch's CPU allocator does), the first write of each page faults it in,
//! which costs more than the kernels' own sweep (measured: a GRPO step at N=1024, V=151936 takes
//! 0.27 s with a fresh gradient tensor, 0.09 s with a reused one). So the Python side takes its
//! large gradient tensors from here: the memory is handed to PyTorch / NumPy through the buffer
//! protocol, and when the framework frees the tensor the buffer returns to a small free list,
//! its pages still mapped, for the next step's gradient of the same size (a caching allocator,
//! as PyTorch's own on CUDA). `release_cached_buffers()` frees the list.

use std::os::raw::c_int;
use std::sync::Mutex;

use pyo3::prelude::*;
use pyo3::{ffi, PyErr};

/// Buffers whose owners have died, most recent last.
static FREE: Mutex<Vec<Vec<u64>>> = Mutex::new(Vec::new());

/// How many free buffers are kept (a training step frees its gradients before the next one
/// asks: logits-level one; fused-linear the f32 gradients of hidden and weight and, with bf16
/// inputs, their casts, four; a bias's is pooled only from V = 262144). Each one kept is memory
/// held between steps, and a batch of another size leaves its buffers stale, so no more.
const KEPT: usize = 4;

/// Writable memory of `len` bytes (8-byte aligned), lent to Python.
#[pyclass(frozen, module = "flashgrpo._native")]
pub struct GradientBuffer {
    /// Never resized while lent: its address is what Python holds.
    words: Mutex<Vec<u64>>,
    len: usize,
}

/// A buffer of `len` bytes: a free one of that size if there is one (its pages already faulted
/// in), else a new one.
#[pyfunction]
pub fn gradient_buffer(len: usize) -> GradientBuffer {
    let words = len.div_ceil(8);
    let mut free = FREE.lock().unwrap_or_else(|e| e.into_inner());
    let reused = free.iter().rposition(|w| w.len() == words).map(|i| free.swap_remove(i));
    drop(free);
    let words = reused.unwrap_or_else(|| {
        let fresh = vec![0; words];
        flashgrpo_kernels::huge_pages::advise(fresh.as_ptr() as usize, 8 * fresh.len());
        fresh
    });
    GradientBuffer { words: Mutex::new(words), len }
}

/// Frees the buffers kept for reuse.
#[pyfunction]
pub fn release_cached_buffers() {
    FREE.lock().unwrap_or_else(|e| e.into_inner()).clear();
}

impl Drop for GradientBuffer {
    fn drop(&mut self) {
        let words = std::mem::take(self.words.get_mut().unwrap_or_else(|e| e.into_inner()));
        let mut free = FREE.lock().unwrap_or_else(|e| e.into_inner());
        free.push(words);
        if free.len() > KEPT {
            free.remove(0);
        }
    }
}

#[pymethods]
impl GradientBuffer {
    /// The writable buffer protocol over the whole buffer, one byte per item.
    unsafe fn __getbuffer__(slf: Bound<'_, Self>, view: *mut ffi::Py_buffer, flags: c_int) -> PyResult<()> {
        let this = slf.get();
        let address = this.words.lock().unwrap_or_else(|e| e.into_inner()).as_mut_ptr();
        let len = this.len as ffi::Py_ssize_t;
        // SAFETY: `view` is CPython's; the buffer outlives every export, since each holds a
        // reference to `slf`, and its memory never moves (it is not resized while lent).
        let status = unsafe { ffi::PyBuffer_FillInfo(view, slf.as_ptr(), address.cast(), len, 0, flags) };
        if status == -1 {
            return Err(PyErr::fetch(slf.py()));
        }
        Ok(())
    }

    unsafe fn __releasebuffer__(&self, _view: *mut ffi::Py_buffer) {}

    fn __len__(&self) -> usize {
        self.len
    }
}
