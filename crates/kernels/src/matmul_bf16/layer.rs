//! An `nn.Linear` with bf16 weights on the packed bf16 kernels (AMX, AVX512-BF16), for a model's layers (the trainer's engine): the
//! three products of a linear layer, `y = x @ w^T`, `dx = dy @ w` and `dw += dy^T @ x`, with the
//! weight's bf16 bits read as the model holds them and f32 activations and gradients.
//!
//! The activations `x` are rounded to bf16 (as a bf16 model holds them), every product
//! accumulates in f32, and the outputs and gradients stay f32. The gradient `dy` is split into two bf16
//! numbers ([`Bf16Products::Amx`], [`Bf16Products::Avx512Bf16`]: f32-grade gradients as the
//! fused-linear loss keeps them) or rounded to bf16 as PyTorch takes it (their `Rounded` forms).
//!
//! Every output element sums its `k` terms in one order (in passes over `k` whose f32 sums are
//! stored and reloaded exactly), on one thread: the results do not
//! depend on how the output is split over threads, and [`forward`]'s do not depend on the other
//! rows of `x` (a decode step's rows get the same bits as the same rows in a whole-sequence pass;
//! `dx` added onto a buffer may differ in the last bit with the number of rows). The f32 products of
//! [`crate::matmul`] are the reference (tests.rs).

use rayon::prelude::*;

use super::pack;
use super::{gradient_products, logits, product, AOperand, BOperand, Bf16Products, Output, PackedHidden, TileScratch};
use crate::matmul::{Mat, MatMut};

/// Output blocks (32 x 32) per parallel task of the gradient products, rows and columns: large
/// enough to amortise a task's set-up (AMX's tile configuration), small enough to balance 2 to 16
/// threads.
const TASK_BLOCKS: (usize, usize) = (4, 8);

/// Output rows of the forward product per task, at most (the weight's rows; measured on the
/// fused-linear loss's logits, whose product this is).
const MAX_TILE: usize = 1024;

/// `x` (`rows x cols`, contiguous) rounded to bf16 bits.
fn rounded_bits(x: Mat<'_>) -> Vec<u16> {
    assert!(x.stride == x.cols, "the activations are contiguous");
    let mut bits = vec![0u16; x.rows * x.cols];
    bits.par_chunks_mut(1 << 14).zip(x.data.par_chunks(1 << 14)).for_each(|(b, x)| {
        for (b, &x) in b.iter_mut().zip(x) {
            *b = <half::bf16 as crate::Element>::from_f32(x).to_bits();
        }
    });
    bits
}

/// Weight rows per forward task: the threads evenly busy, at most [`MAX_TILE`].
fn forward_tile(outputs: usize) -> usize {
    let threads = rayon::current_num_threads().max(1);
    let tasks = outputs.div_ceil(MAX_TILE).div_ceil(threads).max(1) * threads;
    pack::padded(outputs.div_ceil(tasks)).max(32)
}

/// `y (+)= x @ w^T` on the packed kernel of `products`: `x` is `n x k` f32 (rounded to bf16),
/// `w` is `y.cols x k` bf16 bits, row-major (an `nn.Linear` weight).
///
/// # Panics
/// If the shapes disagree, `x` is strided, or `products` is not a packed way of this machine.
pub fn forward(y: &mut MatMut<'_>, accumulate: bool, x: Mat<'_>, w: &[u16], products: Bf16Products) {
    assert!(products.packed() && Bf16Products::available().contains(&products), "{products:?} on this machine");
    assert!(y.rows == x.rows && w.len() == y.cols * x.cols, "linear layer shapes");
    let mut packed = PackedHidden::default();
    packed.pack_for_logits(&rounded_bits(x), x.rows, x.cols, products);
    logits(y, accumulate, &packed, w, forward_tile(y.cols));
}

/// The gradients of [`forward`]: `dx (+)= dy @ w` (added when `accumulate_dx`) and
/// `dw += dy^T @ x`, with `dy` (`n x outputs`, f32) split or rounded as `products` says: the
/// fused-linear loss's gradient products (`gradient_products`) over the whole layer, each
/// product spread over the threads.
///
/// # Panics
/// If the shapes disagree, or `products` is not a packed way of this machine.
pub fn backward(
    dx: &mut MatMut<'_>,
    accumulate_dx: bool,
    dw: &mut [f32],
    dy: Mat<'_>,
    x: Mat<'_>,
    w: &[u16],
    products: Bf16Products,
) {
    assert!(products.packed() && Bf16Products::available().contains(&products), "{products:?} on this machine");
    let (n, outputs, inputs) = (dy.rows, dy.cols, x.cols);
    assert!(x.rows == n && dx.rows == n && dx.cols == inputs, "linear layer shapes");
    assert!(w.len() == outputs * inputs && dw.len() == outputs * inputs, "linear layer weight shapes");
    let mut packed_x = PackedHidden::default();
    packed_x.pack_for_gradients(&rounded_bits(x), n, inputs, products);
    let dx_out = Output::new(dx, false, accumulate_dx);
    let dw_out = Output::new(&mut MatMut::new(dw, outputs, inputs), !super::weight_gradient_in_place(products), true);
    // SAFETY: this call owns `dx` and `dw`; each product's tasks write disjoint parts.
    unsafe {
        gradient_products(&dx_out, Some(&dw_out), dy, w, &packed_x, &mut TileScratch::default(), parallel_product)
    };
}

/// C (+)= A @ B on the packed kernel of `products`, the output's blocks in tasks of
/// [`TASK_BLOCKS`] over the threads.
///
/// # Safety
/// As for [`product`] on the whole output; the output is not written by anyone else meanwhile.
unsafe fn parallel_product(a: AOperand, b: BOperand, out: &Output, products: Bf16Products) {
    let (rows, cols) = (32 * TASK_BLOCKS.0, 32 * TASK_BLOCKS.1);
    let (tasks_m, tasks_n) = (out.rows.div_ceil(rows), out.cols.div_ceil(cols));
    (0..tasks_m * tasks_n).into_par_iter().for_each(|task| {
        let (r0, c0) = (task / tasks_n * rows, task % tasks_n * cols);
        let part = out.part(r0..(r0 + rows).min(out.rows), c0..(c0 + cols).min(out.cols));
        let a = a.starting_at_block(r0 / 32);
        let b = BOperand { ptr: b.panel(c0 / 16), ..b };
        // SAFETY: the caller's promise, for this task's blocks of A's rows and B's panels; the
        // tasks' parts of the output are disjoint.
        unsafe { product(a, b, &part, products) };
    });
}
