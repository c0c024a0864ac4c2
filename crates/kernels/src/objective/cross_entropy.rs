//! Cross-entropy with label smoothing and z-loss (PyTorch's `F.cross_entropy`, Liger's
//! `LigerCrossEntropyLoss` with `lse_square_scale`):
//! `l = (1-s)(lse - u_y) + s(lse - mean_j u_j) + z lse^2 = -(1-s) logp + s(lse - mean_u) + z lse^2`.

use super::{ordered_sum, row_outputs, to_f32, GradTerms, LossOutput, RowGradient};
use crate::inputs::{Normalisers, Rows};
use crate::options::{LossOptions, Reduction};
use crate::stats::RowStats;

pub(super) fn evaluate(
    rows: &Rows,
    options: &LossOptions,
    norm: &Normalisers,
    active: &[bool],
    stats: &[RowStats],
) -> (LossOutput, Vec<RowGradient>) {
    let n = rows.len();
    let (s, z) = (options.label_smoothing, options.z_loss);
    let w = match options.reduction {
        Reduction::Mean => 1.0 / norm.valid_rows.max(1.0),
        Reduction::Sum | Reduction::None => 1.0,
    };
    let mut per_token = vec![0.0; n];
    let mut grads = vec![RowGradient::ZERO; n];
    for i in (0..n).filter(|&i| active[i]) {
        let st = &stats[i];
        let logp = st.logp.unwrap_or(0.0);
        per_token[i] = -(1.0 - s) * logp + s * (st.lse - st.mean_u) + z * st.lse * st.lse;
        let mut terms = GradTerms::default();
        terms.logp(-(1.0 - s) * w);
        terms.lse((s + 2.0 * z * st.lse) * w);
        terms.mean_u(-s * w, rows.vocab);
        grads[i] = terms.finish(st, options.temperature);
    }
    let (logp, entropy) = row_outputs(rows, active, stats);
    let output = LossOutput {
        loss: w * ordered_sum(per_token.iter().copied()),
        per_token_loss: to_f32(&per_token),
        logp,
        entropy,
        kl: None,
        is_clipped: None,
    };
    (output, grads)
}
