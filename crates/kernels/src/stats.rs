//! Row statistics: what one streaming pass over a row of logits must produce, and how partial
//! statistics of vocabulary tiles or vocabulary shards combine.
//!
//! With `u = logits / temperature` and `m` the running maximum, a part of a row keeps
//! `s = sum exp(u - m)` and `e = sum exp(u - m) * (u - m)`. Keeping `e` relative to the maximum
//! (rather than `sum exp(u - m) * u` as LOSSES.md writes it) avoids the cancellation in
//! `H = lse - sum p u` when the logits are large: `H = ln s - e / s` exactly.
//! Moving to a larger maximum `M` rescales both: `s' = s * exp(m - M)`,
//! `e' = (e + (m - M) * s) * exp(m - M)`.

/// Statistics of one part (a tile, a shard) of one row. Accumulated in f32.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PartialRowStats {
    /// Maximum of `u` over the part (`-inf` for an empty or skipped part).
    pub max: f32,
    /// `sum exp(u - max)`.
    pub sum_exp: f32,
    /// `sum exp(u - max) * (u - max)`.
    pub sum_exp_shifted: f32,
    /// `sum u` (for label smoothing's `mean_j u_j`).
    pub sum_u: f32,
    /// `u` at the target, when the target falls in this part.
    pub target_u: Option<f32>,
}

impl PartialRowStats {
    /// The statistics of nothing: the identity of [`combine`](Self::combine).
    pub const EMPTY: Self =
        Self { max: f32::NEG_INFINITY, sum_exp: 0.0, sum_exp_shifted: 0.0, sum_u: 0.0, target_u: None };

    /// Combines the statistics of two disjoint parts of a row (what an all-reduce of max then sum
    /// carries between devices). Computed in f64, rounded once.
    pub fn combine(self, other: Self) -> Self {
        let m = self.max.max(other.max);
        let (s, e) = if m == f32::NEG_INFINITY {
            (0.0, 0.0)
        } else {
            let rescale = |p: &Self| -> (f64, f64) {
                if p.sum_exp == 0.0 {
                    return (0.0, 0.0);
                }
                let shift = p.max as f64 - m as f64;
                let k = shift.exp();
                (p.sum_exp as f64 * k, (p.sum_exp_shifted as f64 + shift * p.sum_exp as f64) * k)
            };
            let (s1, e1) = rescale(&self);
            let (s2, e2) = rescale(&other);
            (s1 + s2, e1 + e2)
        };
        Self {
            max: m,
            sum_exp: s as f32,
            sum_exp_shifted: e as f32,
            sum_u: (self.sum_u as f64 + other.sum_u as f64) as f32,
            target_u: self.target_u.or(other.target_u),
        }
    }

    /// The non-finite check, at no extra pass over the logits: a NaN poisons `sum_exp`, a +Inf
    /// the maximum, a -Inf `sum_exp_shifted` (`exp(-inf) * -inf`); the CPU's base-2 statistics
    /// pass (`cpu/row.rs`) makes `sum_exp` NaN for any of them. `sum_u` is not consulted: it
    /// may overflow for finite logits near `f32::MIN` (used to mask vocabulary entries).
    pub fn is_finite(&self) -> bool {
        self.max.is_finite()
            && self.sum_exp.is_finite()
            && self.sum_exp_shifted.is_finite()
            && self.target_u.is_none_or(f32::is_finite)
    }

    /// The per-row quantities the objectives need, in f64.
    pub fn finish(&self, vocab: usize) -> RowStats {
        let ln_s = (self.sum_exp as f64).ln();
        let lse = self.max as f64 + ln_s;
        RowStats {
            lse,
            entropy: ln_s - self.sum_exp_shifted as f64 / self.sum_exp as f64,
            logp: self.target_u.map(|u| u as f64 - lse),
            mean_u: self.sum_u as f64 / vocab as f64,
        }
    }
}

/// Per-row quantities every loss is a function of.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct RowStats {
    /// `log sum_j exp(u_j)`.
    pub lse: f64,
    /// `H = -sum_j p_j log p_j`.
    pub entropy: f64,
    /// `log p_y`, when the row has a target.
    pub logp: Option<f64>,
    /// `mean_j u_j`.
    pub mean_u: f64,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn direct(u: &[f32], target: Option<usize>) -> PartialRowStats {
        let m = u.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        PartialRowStats {
            max: m,
            sum_exp: u.iter().map(|&x| ((x - m) as f64).exp()).sum::<f64>() as f32,
            sum_exp_shifted: u.iter().map(|&x| ((x - m) as f64).exp() * (x - m) as f64).sum::<f64>() as f32,
            sum_u: u.iter().map(|&x| x as f64).sum::<f64>() as f32,
            target_u: target.map(|t| u[t]),
        }
    }

    #[test]
    fn combine_of_parts_equals_the_whole() {
        let u: Vec<f32> = (0..37).map(|i| ((i * 7919) % 23) as f32 * 0.7 - 5.0).collect();
        let whole = direct(&u, Some(30)).finish(u.len());
        for split in [1, 5, 20, 36] {
            let (ta, tb) = if 30 < split { (Some(30), None) } else { (None, Some(30 - split)) };
            let a = direct(&u[..split], ta);
            let b = direct(&u[split..], tb);
            for c in [a.combine(b), b.combine(a), PartialRowStats::EMPTY.combine(a).combine(b)] {
                let got = c.finish(u.len());
                assert!((got.lse - whole.lse).abs() < 1e-6);
                assert!((got.entropy - whole.entropy).abs() < 1e-6);
                assert!((got.logp.unwrap() - whole.logp.unwrap()).abs() < 1e-6);
                assert!((got.mean_u - whole.mean_u).abs() < 1e-6);
            }
        }
    }
}
