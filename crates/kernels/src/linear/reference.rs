//! The f64 reference of the fused-linear losses: the full `[N, V]` logits `hidden @ weight^T
//! (+ bias)` in f64, the logits-level reference on them, and the chain rule through the linear
//! layer: `d hidden = G @ W`, `d weight = G^T @ hidden`, `d bias = sum_rows G`. The three
//! products are f64 `gemm` calls (plain matrix products, and fast enough for the original's shape).

use crate::engine::LossSpec;
use crate::error::LossError;
use crate::reference::{self, ReferenceOutput};

/// The reference's results: the logits-level outputs (with `grad` = dL/dlogits) and the
/// gradients of the linear layer's inputs.
#[derive(Debug, Clone, PartialEq)]
pub struct LinearReferenceOutput {
    pub output: ReferenceOutput,
    /// `[N, H]`; `None` for `entropy`.
    pub grad_hidden: Option<Vec<f64>>,
    /// `[V, H]`.
    pub grad_weight: Option<Vec<f64>>,
    /// `[V]`, when there is a bias.
    pub grad_bias: Option<Vec<f64>>,
}

/// Evaluates the loss of `hidden [N, H] @ weight [V, H]^T (+ bias [V])` in f64.
pub fn evaluate(
    spec: LossSpec<'_>,
    hidden: &[f64],
    weight: &[f64],
    bias: Option<&[f64]>,
    hidden_size: usize,
) -> Result<LinearReferenceOutput, LossError> {
    let (n, v, h) = (spec.rows.len(), spec.rows.vocab, hidden_size);
    if hidden.len() != n * h || weight.len() != v * h || bias.is_some_and(|b| b.len() != v) {
        return Err(LossError::Shape {
            tensor: "hidden/weight/bias",
            got: vec![hidden.len(), weight.len(), bias.map_or(0, <[f64]>::len)],
            expected: format!("hidden [N*H] = {}, weight [V*H] = {}, bias [V] = {v}", n * h, v * h),
        });
    }
    let mut logits = vec![0.0; n * v];
    // logits[i, j] = sum_k hidden[i, k] weight[j, k]
    product(&mut logits, n, v, h, hidden, (h, 1), weight, (1, h));
    if let Some(b) = bias {
        for row in logits.chunks_exact_mut(v.max(1)) {
            row.iter_mut().zip(b).for_each(|(z, b)| *z += b);
        }
    }
    let output = reference::evaluate(spec, &logits)?;
    let (grad_hidden, grad_weight, grad_bias) = match &output.grad {
        None => (None, None, None),
        Some(g) => {
            let mut gh = vec![0.0; n * h];
            // gh[i, k] = sum_j g[i, j] weight[j, k]
            product(&mut gh, n, h, v, g, (v, 1), weight, (h, 1));
            let mut gw = vec![0.0; v * h];
            // gw[j, k] = sum_i g[i, j] hidden[i, k]
            product(&mut gw, v, h, n, g, (1, v), hidden, (h, 1));
            let gb = bias.map(|_| (0..v).map(|j| (0..n).map(|i| g[i * v + j]).sum()).collect());
            (Some(gh), Some(gw), gb)
        }
    };
    Ok(LinearReferenceOutput { output, grad_hidden, grad_weight, grad_bias })
}

/// `out[m, n] = sum_p lhs[i, p] rhs[p, j]` with `(row, column)` element strides for `lhs` and
/// `rhs`; `out` row-major.
#[allow(clippy::too_many_arguments)]
fn product(
    out: &mut [f64],
    m: usize,
    n: usize,
    k: usize,
    lhs: &[f64],
    (lrs, lcs): (usize, usize),
    rhs: &[f64],
    (rrs, rcs): (usize, usize),
) {
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        out.fill(0.0);
        return;
    }
    assert!(
        out.len() >= m * n && lhs.len() > (m - 1) * lrs + (k - 1) * lcs && rhs.len() > (k - 1) * rrs + (n - 1) * rcs
    );
    // SAFETY: the assert bounds every element read and written.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            out.as_mut_ptr(),
            1,
            n as isize,
            false,
            lhs.as_ptr(),
            lcs as isize,
            lrs as isize,
            rhs.as_ptr(),
            rcs as isize,
            rrs as isize,
            0.0,
            1.0,
            false,
            false,
            false,
            gemm::Parallelism::Rayon(rayon::current_num_threads()),
        );
    }
}
