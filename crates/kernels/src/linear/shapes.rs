//! The shape checks of a fused-linear call, by buffer lengths, so that the CPU and CUDA paths
//! (host slices, device buffers) name the same tensor with the same message.

use crate::error::LossError;
use crate::inputs::Rows;

fn expect(tensor: &'static str, got: usize, want: usize, what: impl FnOnce() -> String) -> Result<(), LossError> {
    if got == want {
        Ok(())
    } else {
        Err(LossError::Shape { tensor, got: vec![got], expected: what() })
    }
}

/// `hidden [N, H]`, `weight [columns, H]`, `bias [columns]`, given by their lengths.
pub(crate) fn check_inputs(
    rows: &Rows,
    hidden_size: usize,
    columns: usize,
    hidden: usize,
    weight: usize,
    bias: Option<usize>,
) -> Result<(), LossError> {
    let h = hidden_size;
    if h == 0 {
        return Err(LossError::Shape {
            tensor: "hidden",
            got: vec![hidden],
            expected: "the hidden size must be at least 1".into(),
        });
    }
    let holds = |what: String| format!("it must hold {what} elements");
    expect("hidden", hidden, rows.len() * h, || holds(format!("B*T*H = {}*{}*{h}", rows.batch, rows.seq_len)))?;
    expect("weight", weight, columns * h, || holds(format!("V*H = {columns}*{h}")))?;
    if let Some(b) = bias {
        expect("bias", b, columns, || holds(format!("V = {columns}")))?;
    }
    Ok(())
}

/// The gradient buffers `grad_hidden [N, H]`, `grad_weight [columns, H]`, `grad_bias [columns]`
/// (those given), by their lengths.
pub(crate) fn check_gradients(
    rows: &Rows,
    hidden_size: usize,
    columns: usize,
    hidden: usize,
    weight: Option<usize>,
    bias: Option<usize>,
) -> Result<(), LossError> {
    let holds = |want: usize| move || format!("the gradient buffer must hold {want} elements");
    expect("grad_hidden", hidden, rows.len() * hidden_size, holds(rows.len() * hidden_size))?;
    if let Some(w) = weight {
        expect("grad_weight", w, columns * hidden_size, holds(columns * hidden_size))?;
    }
    if let Some(b) = bias {
        expect("grad_bias", b, columns, holds(columns))?;
    }
    Ok(())
}
