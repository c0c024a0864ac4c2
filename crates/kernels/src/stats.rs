//! Row statistics: what one streaming pass over a row of logits must produce, and how partial
//! statistics of vocabulary tiles or vocabulary shards combine.
//!
//! With `u = logits / temperature` and `m` the running maximum, a part of a row keeps
//! `s = sum exp(u - m)` and `e = sum exp(u - m) * (u - m)`. Keeping `e` relative to the maximum
//! (rather than `sum exp(u - m) * u` as LOSSES.md writes it) avoids the cancellation in
//! `H = lse - sum p u` when the logits are large: `H = ln s - e / s` exactly.
//! Moving to a larger maximum `M` rescales both: `s' = s * exp(m - M)`,
//! `e' = (e + (m - M) * s) * exp(m - M)`.
//!
//! Every pass scales the logits by the same f32 [`inverse_temperature`]; [`PartialRowStats::finish`]
//! moves `log p` from it to the exact `1 / T`.

/// The f32 factor every statistics and gradient pass (every backend) scales the logits by:
/// `u = x * inverse_temperature(T)`.
pub fn inverse_temperature(temperature: f64) -> f32 {
    (1.0 / temperature) as f32
}

/// Statistics of one part (a tile, a shard) of one row. Accumulated in f32.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PartialRowStats {
    /// Maximum of `u` over the part (`-inf` for an empty or skipped part).
    pub max: f32,
    /// `sum exp(u - max)`.
    pub sum_exp: f32,
    /// `sum exp(u - max) * (u - max)`.
    pub sum_exp_shifted: f32,
    /// `sum u` (for label smoothing's `mean_j u_j`); with class weights `c` (cross-entropy),
    /// `sum c_j u_j` over the part's columns.
    pub sum_u: f32,
    /// `u` at the target, when the target falls in this part, in f64: the exact product of the
    /// logit and the f32 inverse temperature where the sums are of exact products (the base-2
    /// pass, whose one FMA takes a logit to its exponent: `cpu/row/statistics_pass.rs`), else the
    /// f32 `u` the sums were taken of (a row shorter than a vector, the CUDA passes). Either way consistent
    /// with the sums, so a one-token vocabulary gets `log p = 0` exactly; the exact product takes
    /// the target's rounding (half an ulp of `u`: 1e-6 at `u` ~ 30) out of `log p`.
    pub target_u: Option<f64>,
    /// The part's largest logit and its first column, when asked for (`LossOptions::predicted_tokens`).
    pub argmax: Option<Argmax>,
}

/// A row part's largest logit (after the soft cap; before the temperature, which does not change
/// the order but may make two f32 products equal) and the first column holding it, in the
/// vocabulary's numbering: the predicted token, as `torch.argmax` and Liger give it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Argmax {
    /// The largest logit, in f32 (bf16 and f16 widened exactly; `c tanh(x / c)` under a soft cap).
    pub value: f32,
    /// Its first column, in the whole vocabulary's numbering (a shard's first column added).
    pub column: usize,
}

impl Argmax {
    /// The larger of two parts' maxima; of equal ones, the lower column (the first, whatever the
    /// order the parts combine in).
    pub fn max(self, other: Self) -> Self {
        if other.value > self.value || (other.value == self.value && other.column < self.column) {
            other
        } else {
            self
        }
    }

    /// Of two optional maxima, the larger ([`Argmax::max`]); either when the other is missing.
    pub fn either(a: Option<Self>, b: Option<Self>) -> Option<Self> {
        match (a, b) {
            (Some(a), Some(b)) => Some(a.max(b)),
            (a, b) => a.or(b),
        }
    }
}

impl PartialRowStats {
    /// The statistics of nothing: the identity of [`combine`](Self::combine).
    pub const EMPTY: Self =
        Self { max: f32::NEG_INFINITY, sum_exp: 0.0, sum_exp_shifted: 0.0, sum_u: 0.0, target_u: None, argmax: None };

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
            argmax: Argmax::either(self.argmax, other.argmax),
        }
    }

    /// The non-finite check, at no extra pass over the logits: a NaN poisons `sum_exp`, a +Inf
    /// the maximum, a -Inf `sum_exp_shifted` (`exp(-inf) * -inf`); the CPU's base-2 statistics
    /// pass (`cpu/row/statistics_pass.rs`) makes `sum_exp` NaN for any of them. `sum_u` is not
    /// consulted: it may overflow for finite logits near `f32::MIN` (used to mask vocabulary
    /// entries).
    pub fn is_finite(&self) -> bool {
        self.max.is_finite()
            && self.sum_exp.is_finite()
            && self.sum_exp_shifted.is_finite()
            && self.target_u.is_none_or(f64::is_finite)
    }

    /// The per-row quantities the objectives need, in f64, for temperature `T`.
    ///
    /// The passes scaled the logits by the f32 [`inverse_temperature`], not by `1 / T`: off it by
    /// a relative `drift` of at most 2^-24. To first order `lse` then moves by `drift E_p[u]` and
    /// the target's `u` by `drift u_y`, so `log p_y` by `drift (u_y - E_p[u])`, with
    /// `E_p[u] = max + e / s`; `log p` takes it (up to 6e-7 for `u_y - E_p[u]` ~ 10). `lse` and
    /// the entropy stay those of the f32 inverse temperature, which the gradient pass uses
    /// (its `p_j` sum to 1 with that `lse`); the entropy's own drift, `-drift Var_p(u)`, is of
    /// the size of f32's rounding of it.
    pub fn finish(&self, vocab: usize, temperature: f64) -> RowStats {
        let ln_s = (self.sum_exp as f64).ln();
        let lse = self.max as f64 + ln_s;
        let mean_shift = self.sum_exp_shifted as f64 / self.sum_exp as f64;
        let inv_t = inverse_temperature(temperature) as f64;
        let drift = if inv_t.is_normal() { (1.0 / temperature - inv_t) / inv_t } else { 0.0 };
        RowStats {
            lse,
            entropy: ln_s - mean_shift,
            logp: self.target_u.map(|u| u - lse + drift * (u - self.max as f64 - mean_shift)),
            mean_u: self.sum_u as f64 / vocab as f64,
            argmax: self.argmax.map(|a| a.column),
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
    /// `mean_j u_j`; with class weights `c` (cross-entropy), `sum_j c_j u_j / V`.
    pub mean_u: f64,
    /// The predicted token ([`Argmax`]), when asked for.
    pub argmax: Option<usize>,
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
            target_u: target.map(|t| u[t] as f64),
            argmax: None,
        }
    }

    #[test]
    fn combine_of_parts_equals_the_whole() {
        let u: Vec<f32> = (0..37).map(|i| ((i * 7919) % 23) as f32 * 0.7 - 5.0).collect();
        let whole = direct(&u, Some(30)).finish(u.len(), 1.0);
        for split in [1, 5, 20, 36] {
            let (ta, tb) = if 30 < split { (Some(30), None) } else { (None, Some(30 - split)) };
            let a = direct(&u[..split], ta);
            let b = direct(&u[split..], tb);
            for c in [a.combine(b), b.combine(a), PartialRowStats::EMPTY.combine(a).combine(b)] {
                let got = c.finish(u.len(), 1.0);
                assert!((got.lse - whole.lse).abs() < 1e-6);
                assert!((got.entropy - whole.entropy).abs() < 1e-6);
                assert!((got.logp.unwrap() - whole.logp.unwrap()).abs() < 1e-6);
                assert!((got.mean_u - whole.mean_u).abs() < 1e-6);
            }
        }
    }

    /// `log p` at a temperature whose f32 inverse is inexact, from statistics of the exact
    /// products `x * inverse_temperature(T)`: within 2e-7 of f64 at `1 / T`, the f32 rounding of
    /// the sums (the f32 target `u` without the drift correction was off by up to ~1e-6 here).
    #[test]
    fn logp_is_that_of_the_exact_temperature() {
        let x: Vec<f32> = (0..50).map(|i| 18.0 + ((i * 7919) % 31) as f32 * 0.37).collect();
        for temperature in [0.7, 0.9, 0.31, 1.3] {
            let inv_t = inverse_temperature(temperature) as f64;
            let u: Vec<f64> = x.iter().map(|&v| v as f64 * inv_t).collect();
            let m = u.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let stats = PartialRowStats {
                max: m as f32,
                sum_exp: u.iter().map(|&v| (v - m as f32 as f64).exp()).sum::<f64>() as f32,
                sum_exp_shifted: u.iter().map(|&v| (v - m as f32 as f64).exp() * (v - m as f32 as f64)).sum::<f64>()
                    as f32,
                sum_u: 0.0,
                target_u: Some(u[17]),
                argmax: None,
            };
            let exact: Vec<f64> = x.iter().map(|&v| v as f64 / temperature).collect();
            let lse = exact.iter().map(|&v| v.exp()).sum::<f64>().ln();
            let want = exact[17] - lse;
            let got = stats.finish(x.len(), temperature).logp.unwrap();
            assert!((got - want).abs() < 2e-7, "T {temperature}: {got} vs {want}");
        }
    }

    /// Parts' maxima combine to the whole row's first largest column, in any order of combining,
    /// ties included.
    #[test]
    fn argmax_of_parts_is_the_first_of_the_whole() {
        let u = [1.0f32, 3.0, -2.0, 3.0, 0.5, 3.0, 2.0];
        let part = |cols: std::ops::Range<usize>| PartialRowStats {
            argmax: cols.clone().map(|c| Argmax { value: u[c], column: c }).reduce(Argmax::max),
            ..PartialRowStats::EMPTY
        };
        for split in 0..=u.len() {
            let (a, b) = (part(0..split), part(split..u.len()));
            for c in [a.combine(b), b.combine(a)] {
                assert_eq!(c.argmax, Some(Argmax { value: 3.0, column: 1 }), "split at {split}");
                assert_eq!(c.finish(u.len(), 1.0).argmax, Some(1));
            }
        }
        assert_eq!(PartialRowStats::EMPTY.combine(PartialRowStats::EMPTY).argmax, None);
    }
}
