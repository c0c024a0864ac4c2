//! Drawing tokens from logits: temperature, top-k and top-p (nucleus) filtering, greedy. One
//! uniform number per draw, taken from the run's stream in row order before the rows are drawn
//! in parallel, so the tokens do not depend on the thread count. Scratch space is owned by the
//! [`Sampler`] and reused: drawing allocates nothing per token.
//!
//! The unfiltered draw (the default) evaluates `exp` once per logit in f32 with a vectorised
//! polynomial (within two ulps) and finds the drawn token by block sums, without sorting the
//! vocabulary; top-k / top-p select the likely tokens instead of sorting all of them.

use flashgrpo_kernels::synthetic::Rng;
use rayon::prelude::*;

use crate::engine::math::{avx2_or_baseline, fast_exp, sum};

/// How tokens are drawn.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sampling {
    /// 0 means greedy.
    pub temperature: f64,
    /// Keep the `top_k` most likely tokens; 0 keeps all.
    pub top_k: usize,
    /// Keep the smallest set of most likely tokens whose probability reaches `top_p`; 1 keeps all.
    pub top_p: f64,
    pub max_new_tokens: usize,
}

impl Default for Sampling {
    fn default() -> Self {
        Self { temperature: 1.0, top_k: 0, top_p: 1.0, max_new_tokens: 64 }
    }
}

impl Sampling {
    pub(crate) fn greedy(&self) -> bool {
        self.temperature <= 0.0
    }

    fn filtered(&self) -> bool {
        self.top_k > 0 || self.top_p < 1.0
    }
}

/// The one uniform number a draw takes from the stream (none when greedy).
pub fn uniform_for(s: &Sampling, rng: &mut Rng) -> f64 {
    if s.greedy() {
        0.0
    } else {
        rng.uniform()
    }
}

/// One random stream per row of a generation, keyed by the generation's seed and the row's
/// global index: a row's draws do not depend on which other rows share its batch, on the thread
/// count, or on which rank of a data-parallel job generates it, so the same global batch gives
/// the same completions on any number of processes.
#[derive(Debug, Clone)]
pub struct RowStreams {
    streams: Vec<Rng>,
}

impl RowStreams {
    /// The streams of global rows `rows` of the generation seeded `seed`.
    pub fn new(seed: u64, rows: std::ops::Range<usize>) -> Self {
        let stream = |r: usize| Rng::new(Rng::new(seed ^ (r as u64).wrapping_mul(0xD1B5_4A32_D192_ED03)).next_u64());
        Self { streams: rows.map(stream).collect() }
    }

    /// Streams for `rows` rows, seeded by one draw from `rng`.
    pub fn from_rng(rng: &mut Rng, rows: usize) -> Self {
        Self::new(rng.next_u64(), 0..rows)
    }

    pub fn len(&self) -> usize {
        self.streams.len()
    }

    pub fn is_empty(&self) -> bool {
        self.streams.is_empty()
    }

    /// The next uniform number of local row `row` (none drawn when greedy).
    pub fn uniform(&mut self, row: usize, s: &Sampling) -> f64 {
        uniform_for(s, &mut self.streams[row])
    }
}

/// Reusable buffers of one thread's draws.
#[derive(Debug, Default)]
pub struct Scratch {
    weights: Vec<f32>,
    blocks: Vec<f32>,
    order: Vec<usize>,
    kept: Vec<usize>,
    kept_weights: Vec<f64>,
}

/// Draws one token from `logits` (f32, `[V]`).
pub fn sample(logits: &[f32], s: &Sampling, rng: &mut Rng) -> u32 {
    sample_row(logits, s, uniform_for(s, rng), &mut Scratch::default())
}

/// [`sample`] with its uniform number `u` in `[0, 1)` given.
pub fn sample_row(logits: &[f32], s: &Sampling, u: f64, scratch: &mut Scratch) -> u32 {
    if s.greedy() {
        return argmax(logits) as u32;
    }
    if !s.filtered() {
        return draw_softmax(logits, (1.0 / s.temperature) as f32, u, &mut scratch.weights, &mut scratch.blocks) as u32;
    }
    most_likely(logits, s, scratch);
    scratch.kept[draw(&scratch.kept_weights, u)] as u32
}

/// The first index of the largest value.
fn argmax(x: &[f32]) -> usize {
    x.iter().enumerate().fold((0, f32::NEG_INFINITY), |b, (i, &v)| if v > b.1 { (i, v) } else { b }).0
}

/// Elements per block of the draw's search.
const BLOCK: usize = 256;

avx2_or_baseline!(
    /// The index `u` picks from `softmax(logits * inv_temperature)`: weights `exp((x - max) / T)`
    /// in `weights` and their sums per block in `blocks` (one pass), then the block and the
    /// element where the cumulative sum passes `u * total` (block sums added in f64).
    fn draw_softmax(logits: &[f32], inv_temperature: f32, u: f64, weights: &mut Vec<f32>, blocks: &mut Vec<f32>) -> usize
        => draw_softmax_body
);

#[inline(always)]
fn draw_softmax_body(
    logits: &[f32],
    inv_temperature: f32,
    u: f64,
    weights: &mut Vec<f32>,
    blocks: &mut Vec<f32>,
) -> usize {
    let max = logits.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x));
    weights.resize(logits.len(), 0.0);
    blocks.clear();
    for (w, x) in weights.chunks_mut(BLOCK).zip(logits.chunks(BLOCK)) {
        for (w, &x) in w.iter_mut().zip(x) {
            *w = fast_exp((x - max) * inv_temperature);
        }
        blocks.push(sum(w));
    }
    let total: f64 = blocks.iter().map(|&b| b as f64).sum();
    let mut left = u * total;
    for (b, &s) in blocks.iter().enumerate() {
        let s = s as f64;
        if left < s {
            let block = &weights[b * BLOCK..((b + 1) * BLOCK).min(weights.len())];
            for (i, &w) in block.iter().enumerate() {
                left -= w as f64;
                if left < 0.0 {
                    return b * BLOCK + i;
                }
            }
            // Rounding left a remainder within this block: its last token that can be drawn.
            return b * BLOCK + block.iter().rposition(|&w| w > 0.0).unwrap_or(0);
        }
        left -= s;
    }
    weights.iter().rposition(|&w| w > 0.0).unwrap_or(0)
}

/// The tokens top-k / top-p keep, most likely first (ties: lower id first), into
/// `scratch.kept`, and their unnormalised weights into `scratch.kept_weights`. Selects instead of
/// sorting the vocabulary: top-k sorts only its `k`; top-p sorts growing prefixes (64, 256, ...)
/// until one holds `top_p` of the mass, which at a 151,936-token vocabulary and a peaked
/// distribution is a few hundred tokens, not the whole row.
fn most_likely(logits: &[f32], s: &Sampling, scratch: &mut Scratch) {
    let by_likelihood = |a: &usize, b: &usize| logits[*b].total_cmp(&logits[*a]).then(a.cmp(b));
    let max = logits.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x)) as f64;
    let weight = |i: usize| ((logits[i] as f64 - max) / s.temperature).exp();
    let Scratch { order, kept, kept_weights, .. } = scratch;
    order.clear();
    order.extend(0..logits.len());
    // The `k` most likely, sorted, into `kept`.
    let top = |k: usize, order: &mut Vec<usize>, kept: &mut Vec<usize>| {
        let k = k.clamp(1, order.len());
        if k < order.len() {
            order.select_nth_unstable_by(k - 1, by_likelihood);
        }
        kept.clear();
        kept.extend_from_slice(&order[..k]);
        kept.sort_by(by_likelihood);
    };
    // Cuts `kept` to its prefix whose share of `total` first reaches top_p; whether one did.
    let nucleus = |kept: &mut Vec<usize>, weights: &mut Vec<f64>, total: f64| -> bool {
        weights.clear();
        weights.extend(kept.iter().map(|&i| weight(i)));
        if s.top_p >= 1.0 {
            return true;
        }
        let mut cumulative = 0.0;
        match weights.iter().position(|w| {
            cumulative += w / total;
            cumulative >= s.top_p
        }) {
            Some(n) => {
                weights.truncate(n + 1);
                kept.truncate(n + 1);
                true
            }
            None => false,
        }
    };
    if s.top_k > 0 {
        top(s.top_k, order, kept);
        let total = kept.iter().map(|&i| weight(i)).sum();
        nucleus(kept, kept_weights, total);
        return;
    }
    let total = (0..logits.len()).map(weight).sum();
    let mut k = 64;
    loop {
        top(k, order, kept);
        let whole = kept.len() == logits.len();
        if nucleus(kept, kept_weights, total) || whole {
            return;
        }
        k *= 4;
    }
}

/// The index that `u` in `[0, 1)` picks with probability proportional to `weights` (non-negative,
/// not all zero).
fn draw(weights: &[f64], u: f64) -> usize {
    let mut u = u * weights.iter().sum::<f64>();
    for (i, w) in weights.iter().enumerate() {
        u -= w;
        if u < 0.0 {
            return i;
        }
    }
    // Rounding left `u` at or just above 0: the last index that can be drawn.
    weights.iter().rposition(|&w| w > 0.0).unwrap_or(0)
}

/// Draws for many rows at once, in parallel, with one [`Scratch`] per thread kept between calls.
#[derive(Debug, Default)]
pub struct Sampler {
    scratch: Vec<Scratch>,
}

impl Sampler {
    /// `tokens[i]` drawn from row `rows[i]` of `logits [.., vocab]` with uniform `uniforms[i]`.
    pub fn draw(
        &mut self,
        s: &Sampling,
        logits: &[f32],
        vocab: usize,
        rows: &[usize],
        uniforms: &[f64],
        tokens: &mut [u32],
    ) {
        let threads = rayon::current_num_threads().max(1);
        let per = rows.len().div_ceil(threads).max(1);
        self.scratch.resize_with(threads, Scratch::default);
        tokens
            .par_chunks_mut(per)
            .zip(rows.par_chunks(per))
            .zip(uniforms.par_chunks(per))
            .zip(self.scratch.par_iter_mut())
            .for_each(|(((tokens, rows), uniforms), scratch)| {
                for ((t, &r), &u) in tokens.iter_mut().zip(rows).zip(uniforms) {
                    *t = sample_row(&logits[r * vocab..(r + 1) * vocab], s, u, scratch);
                }
            });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The selection gives the tokens and weights of sorting the whole vocabulary.
    #[test]
    fn selection_equals_a_full_sort() {
        let mut rng = Rng::new(7);
        let mut scratch = Scratch::default();
        for case in 0..300 {
            let v = [5, 70, 300, 5000][case % 4];
            let logits: Vec<f32> = (0..v).map(|_| (rng.normal() * 3.0) as f32).collect();
            let (top_k, top_p) = [(0, 0.5), (0, 0.95), (0, 0.999), (10, 1.0), (40, 0.9), (v + 3, 0.7)][case % 6];
            let s = Sampling { temperature: 0.8, top_k, top_p, max_new_tokens: 1 };
            let mut full: Vec<usize> = (0..v).collect();
            full.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
            if top_k > 0 {
                full.truncate(top_k);
            }
            let max = logits[full[0]] as f64;
            let w: Vec<f64> = full.iter().map(|&i| ((logits[i] as f64 - max) / 0.8).exp()).collect();
            let total: f64 = w.iter().sum();
            let mut keep = w.len();
            let mut cumulative = 0.0;
            for (n, x) in w.iter().enumerate() {
                cumulative += x / total;
                if top_p < 1.0 && cumulative >= top_p {
                    keep = n + 1;
                    break;
                }
            }
            most_likely(&logits, &s, &mut scratch);
            assert_eq!(scratch.kept, full[..keep].to_vec(), "case {case}");
            assert_eq!(scratch.kept_weights, w[..keep].to_vec(), "case {case}");
        }
    }

    #[test]
    fn sampling_filters() {
        let logits = [0.0f32, 3.0, 1.0, 2.9, -5.0];
        let mut rng = Rng::new(1);
        let greedy = Sampling { temperature: 0.0, ..Default::default() };
        assert_eq!(sample(&logits, &greedy, &mut rng), 1);
        let top2 = Sampling { top_k: 2, ..Default::default() };
        assert!((0..200).all(|_| [1, 3].contains(&sample(&logits, &top2, &mut rng))));
        // Nucleus: tokens 1 and 3 hold ~0.85 of the mass; p = 0.8 keeps exactly them.
        let nucleus = Sampling { top_p: 0.8, ..Default::default() };
        assert!((0..200).all(|_| [1, 3].contains(&sample(&logits, &nucleus, &mut rng))));
    }

    /// Token frequencies of many draws agree with the full softmax on fixed logits (a chi-square
    /// test at a false-alarm rate of about 1e-6), at temperatures 1 and 0.7, over a vocabulary
    /// larger than one search block, and the draws of [`Sampler`] are those of [`sample_row`].
    #[test]
    fn draws_follow_the_softmax() {
        let mut rng = Rng::new(11);
        let v = 600;
        let logits: Vec<f32> = (0..v).map(|i| (rng.normal() * 2.0) as f32 + if i == 300 { 4.0 } else { 0.0 }).collect();
        for temperature in [1.0, 0.7] {
            let s = Sampling { temperature, ..Default::default() };
            let max = logits.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x)) as f64;
            let p: Vec<f64> = logits.iter().map(|&x| ((x as f64 - max) / temperature).exp()).collect();
            let total: f64 = p.iter().sum();
            let draws = 400_000;
            let uniforms: Vec<f64> = (0..draws).map(|_| rng.uniform()).collect();
            let mut scratch = Scratch::default();
            let mut counts = vec![0usize; v];
            for &u in &uniforms {
                counts[sample_row(&logits, &s, u, &mut scratch) as usize] += 1;
            }
            // Tokens expected at least 20 times each as their own cell, the rest pooled.
            let (mut chi2, mut cells, mut pooled_e, mut pooled_o) = (0.0, 0usize, 0.0, 0.0);
            for (c, &pi) in counts.iter().zip(&p) {
                let e = pi / total * draws as f64;
                if e >= 20.0 {
                    chi2 += (*c as f64 - e).powi(2) / e;
                    cells += 1;
                } else {
                    pooled_e += e;
                    pooled_o += *c as f64;
                }
            }
            chi2 += (pooled_o - pooled_e).powi(2) / pooled_e.max(1e-9);
            let dof = cells as f64;
            // Wilson-Hilferty: chi2 / dof beyond 1 + 4.75 sqrt(2 / (9 dof)) has probability ~1e-6.
            let bound = dof * (1.0 - 2.0 / (9.0 * dof) + 4.75 * (2.0 / (9.0 * dof)).sqrt()).powi(3);
            assert!(chi2 < bound, "T={temperature}: chi2 {chi2:.1} over {cells} cells, bound {bound:.1}");
            let rows: Vec<usize> = vec![0; 64];
            let mut tokens = vec![0u32; 64];
            Sampler::default().draw(&s, &logits, v, &rows, &uniforms[..64], &mut tokens);
            for (t, &u) in tokens.iter().zip(&uniforms) {
                assert_eq!(*t, sample_row(&logits, &s, u, &mut scratch));
            }
        }
    }
}
