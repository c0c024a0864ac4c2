//! Drawing tokens from logits: repetition penalty, temperature, top-k, top-p (nucleus) and min-p
//! filtering, greedy, in the order of Hugging Face's `generate` (TRL's generation without vLLM). One
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
    /// Keep the tokens at least `min_p` times as likely as the most likely one (after top-k and
    /// top-p, as Hugging Face's `MinPLogitsWarper`); 0 keeps all.
    pub min_p: f64,
    /// Hugging Face's (and vLLM's) repetition penalty, applied to the raw logits of every token
    /// the row has seen (its prompt and its completion so far) before the temperature: a positive
    /// logit divided by it, a negative one multiplied. 1 is off; above 1 discourages repeats.
    pub repetition_penalty: f64,
    pub max_new_tokens: usize,
}

impl Default for Sampling {
    fn default() -> Self {
        Self { temperature: 1.0, top_k: 0, top_p: 1.0, min_p: 0.0, repetition_penalty: 1.0, max_new_tokens: 64 }
    }
}

impl Sampling {
    pub(crate) fn greedy(&self) -> bool {
        self.temperature <= 0.0
    }

    fn filtered(&self) -> bool {
        self.top_k > 0 || self.top_p < 1.0 || self.min_p > 0.0
    }

    fn penalised(&self) -> bool {
        self.repetition_penalty != 1.0
    }
}

/// The tokens a row has seen, which the repetition penalty applies to: its prompt and its
/// completion so far (each token once, however often it occurs; padding is not a token seen).
#[derive(Debug, Clone, Copy, Default)]
pub struct Seen<'a> {
    pub prompt: &'a [u32],
    pub completion: &'a [u32],
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
    /// The row's logits after the repetition penalty (only when one applies).
    penalised: Vec<f32>,
    /// Top-p's weight mass by histogram bin, and the tokens of its boundary bins.
    mass: Vec<f64>,
    boundary: Vec<usize>,
}

/// Draws one token from `logits` (f32, `[V]`) of a row that has seen `seen`.
pub fn sample(logits: &[f32], seen: Seen<'_>, s: &Sampling, rng: &mut Rng) -> u32 {
    sample_row(logits, seen, s, uniform_for(s, rng), &mut Scratch::default())
}

/// [`sample`] with its uniform number `u` in `[0, 1)` given.
pub fn sample_row(logits: &[f32], seen: Seen<'_>, s: &Sampling, u: f64, scratch: &mut Scratch) -> u32 {
    if !s.penalised() {
        return sample_processed(logits, s, u, scratch);
    }
    let mut penalised = std::mem::take(&mut scratch.penalised);
    penalise(logits, seen, s.repetition_penalty as f32, &mut penalised);
    let token = sample_processed(&penalised, s, u, scratch);
    scratch.penalised = penalised;
    token
}

/// `logits` with the repetition penalty applied once to each token of `seen`, into `out`
/// (Hugging Face's `RepetitionPenaltyLogitsProcessor`: `x / penalty` where `x > 0`, else
/// `x * penalty`, in f32). Tokens beyond the vocabulary are ignored (the engine checks prompts).
fn penalise(logits: &[f32], seen: Seen<'_>, penalty: f32, out: &mut Vec<f32>) {
    out.clear();
    out.extend_from_slice(logits);
    for &t in seen.prompt.iter().chain(seen.completion) {
        // Penalised already (a repeat) when it differs from the raw logit; a logit of 0 stays 0
        // either way, so applying the penalty again changes nothing.
        if let (Some(&x), Some(y)) = (logits.get(t as usize), out.get_mut(t as usize)) {
            if *y == x {
                *y = if x > 0.0 { x / penalty } else { x * penalty };
            }
        }
    }
}

/// [`sample_row`] on logits the repetition penalty has been applied to.
fn sample_processed(logits: &[f32], s: &Sampling, u: f64, scratch: &mut Scratch) -> u32 {
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
    let total = exp_weights_body(logits, max, inv_temperature, weights, blocks);
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

avx2_or_baseline!(
    /// Weights `exp((x - max) / T)` of the row in `weights` (f32, within two ulps), their sums per
    /// block in `blocks`, and the row's mass (the block sums added in f64).
    fn exp_weights(logits: &[f32], max: f32, inv_temperature: f32, weights: &mut Vec<f32>, blocks: &mut Vec<f32>) -> f64
        => exp_weights_body
);

#[inline(always)]
fn exp_weights_body(
    logits: &[f32],
    max: f32,
    inv_temperature: f32,
    weights: &mut Vec<f32>,
    blocks: &mut Vec<f32>,
) -> f64 {
    weights.resize(logits.len(), 0.0);
    blocks.clear();
    for (w, x) in weights.chunks_mut(BLOCK).zip(logits.chunks(BLOCK)) {
        for (w, &x) in w.iter_mut().zip(x) {
            *w = fast_exp((x - max) * inv_temperature);
        }
        blocks.push(sum(w));
    }
    blocks.iter().map(|&b| b as f64).sum()
}

/// Mantissa bits of a weight's histogram bin beside its exponent: 16 bins per octave, so that
/// near-uniform weights still spread over many bins.
const SUB_BITS: u32 = 4;

/// The histogram bin of a weight in `[0, 1]`: its exponent and first mantissa bits (monotone in
/// the weight).
fn bin(w: f32) -> usize {
    (w.to_bits() >> (23 - SUB_BITS)) as usize
}

/// The smallest weight of bin `b`.
fn bin_floor(b: usize) -> f32 {
    f32::from_bits((b as u32) << (23 - SUB_BITS))
}

/// The bin of the nucleus's least likely token (the most likely tokens whose mass first reaches
/// `top_p` of `total`): the weights' mass by bin, walked from the largest bin. `None` where
/// rounding keeps the walk short of it.
fn nucleus_bin(weights: &[f32], total: f64, top_p: f64, mass: &mut Vec<f64>) -> Option<usize> {
    mass.clear();
    mass.resize(bin(1.0) + 1, 0.0);
    // Weights below `tiny` hold less than half of `1 - top_p` of the mass all together: the
    // nucleus is complete before any of them, so they are not binned.
    let tiny = ((1.0 - top_p) * total / weights.len() as f64 / 2.0) as f32;
    for &w in weights.iter().filter(|&&w| w >= tiny) {
        mass[bin(w).min(bin(1.0))] += w as f64;
    }
    let mut cumulative = 0.0;
    (0..mass.len()).rev().find(|&b| {
        cumulative += mass[b];
        cumulative >= top_p * total
    })
}

/// The tokens top-k / top-p / min-p keep into `scratch.kept`, and their unnormalised weights
/// `exp((x - max) / T)` (f64) into `scratch.kept_weights`, in an order fixed by the row (the draw
/// walks it; any fixed order draws from the same distribution). Selects instead of sorting the
/// vocabulary: top-k sorts only its `k` (most likely first, ties: lower id first). Top-p and
/// min-p take one vectorised pass over the row (f32 weights and the row's mass); top-p then bins
/// the weights' mass (16 bins an octave) to find the bin of the nucleus's last token: the tokens
/// of the bins above are kept in id order, only those of that bin and the one below are sorted.
/// Min-p alone keeps the tokens at or above its weight, in id order; where min-p's floor is the
/// higher, the tokens above it are sorted and cut. Should the f32 weights' rounding leave a cut
/// outside the tokens gathered, the exact search over growing prefixes
/// ([`Ranking::exact_search`]) decides.
fn most_likely(logits: &[f32], s: &Sampling, scratch: &mut Scratch) {
    let r = Ranking::new(logits, s);
    if s.top_k > 0 {
        r.top_k(scratch);
        return;
    }
    let Scratch { weights: row, blocks, kept, kept_weights, mass, boundary, .. } = scratch;
    let total = exp_weights(logits, r.max, (1.0 / s.temperature) as f32, row, blocks);
    // min-p's floor, with a margin for the f32 weights (its exact cut is made in f64), at most 1:
    // the most likely token (weight 1) is always a candidate.
    let min_p_floor = ((s.min_p * (1.0 - 1e-4)) as f32).min(1.0);
    let nucleus = if s.top_p < 1.0 { nucleus_bin(row, total, s.top_p, mass) } else { None };
    // The nucleus's floor: one bin below its last token's, for the f32 weights' rounding.
    let nucleus_floor = nucleus.map_or(0.0, |b| bin_floor(b.saturating_sub(1)));
    // Top-p's nucleus, then min-p within it (both keep the most likely tokens: the smaller set).
    if let Some(b) = nucleus {
        if r.nucleus_by_bins(row, b, total, kept, kept_weights, boundary) {
            r.min_p_within(kept, kept_weights);
            return;
        }
    }
    let floor = min_p_floor.max(nucleus_floor);
    kept.clear();
    kept.extend(row.iter().enumerate().filter(|(_, &w)| w >= floor).map(|(i, _)| i));
    if s.top_p >= 1.0 {
        kept_weights.clear();
        kept_weights.extend(kept.iter().map(|&i| r.weight(i)));
        r.min_p_within(kept, kept_weights);
        return;
    }
    kept.sort_unstable_by(|a, b| r.by_likelihood(a, b));
    // Every token outside `kept` is below min-p's floor when that set the floor: a cut at its end.
    let min_p_ends = s.min_p > 0.0 && floor == min_p_floor;
    if r.cut(kept, kept_weights, total) || kept.len() == logits.len() || min_p_ends {
        return;
    }
    r.exact_search(scratch);
}

/// A row's tokens ranked by likelihood under a sampling's filters (the reference of
/// [`most_likely`]'s shortcuts, and its top-k).
struct Ranking<'a> {
    logits: &'a [f32],
    s: &'a Sampling,
    max: f32,
}

impl<'a> Ranking<'a> {
    fn new(logits: &'a [f32], s: &'a Sampling) -> Self {
        Self { logits, s, max: logits.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x)) }
    }

    /// `exp((x - max) / T)` in f64: 1 for the most likely token.
    fn weight(&self, i: usize) -> f64 {
        ((self.logits[i] as f64 - self.max as f64) / self.s.temperature).exp()
    }

    /// Most likely first, ties: lower id first.
    fn by_likelihood(&self, a: &usize, b: &usize) -> std::cmp::Ordering {
        self.logits[*b].total_cmp(&self.logits[*a]).then(a.cmp(b))
    }

    /// The `k` most likely of `order`, sorted, into `kept`.
    fn top(&self, k: usize, order: &mut [usize], kept: &mut Vec<usize>) {
        let k = k.clamp(1, order.len());
        if k < order.len() {
            order.select_nth_unstable_by(k - 1, |a, b| self.by_likelihood(a, b));
        }
        kept.clear();
        kept.extend_from_slice(&order[..k]);
        kept.sort_by(|a, b| self.by_likelihood(a, b));
    }

    /// Cuts `kept` (sorted) to the prefix top-p and min-p keep, its weights into `weights`: top-p
    /// the prefix whose share of `total` first reaches `top_p`, min-p the weights at least `min_p`.
    /// Whether a cut fell inside `kept` (both keep prefixes: the shorter holds).
    fn cut(&self, kept: &mut Vec<usize>, weights: &mut Vec<f64>, total: f64) -> bool {
        let s = self.s;
        weights.clear();
        weights.extend(kept.iter().map(|&i| self.weight(i)));
        let nucleus = if s.top_p < 1.0 {
            let mut cumulative = 0.0;
            weights.iter().position(|w| {
                cumulative += w / total;
                cumulative >= s.top_p
            })
        } else {
            None
        };
        let nucleus = nucleus.map(|n| n + 1);
        let likely = if s.min_p > 0.0 { weights.iter().position(|&w| w < s.min_p) } else { None };
        // At least one token, as Hugging Face keeps (a `min_p` above 1 would keep none).
        let keep = nucleus.into_iter().chain(likely).min().map(|n| n.max(1));
        if let Some(n) = keep {
            weights.truncate(n);
            kept.truncate(n);
        }
        keep.is_some()
    }

    /// Top-k, then top-p / min-p over the `k` (top-p's mass: theirs).
    fn top_k(&self, scratch: &mut Scratch) {
        let Scratch { order, kept, kept_weights, .. } = scratch;
        order.clear();
        order.extend(0..self.logits.len());
        self.top(self.s.top_k, order, kept);
        let total = kept.iter().map(|&i| self.weight(i)).sum();
        self.cut(kept, kept_weights, total);
    }

    /// The nucleus without sorting most of it: the tokens of bins above `cut_bin` (the bin the
    /// mass walk stopped in) are all in it, in id order; those of `cut_bin` and the bin below it
    /// are sorted and taken until the mass reaches `top_p` of `total`. False (nothing decided)
    /// where rounding puts the cut outside them: the sorted path then decides.
    fn nucleus_by_bins(
        &self,
        row: &[f32],
        cut_bin: usize,
        total: f64,
        kept: &mut Vec<usize>,
        kept_weights: &mut Vec<f64>,
        boundary: &mut Vec<usize>,
    ) -> bool {
        let floor = bin_floor(cut_bin.saturating_sub(1));
        kept.clear();
        boundary.clear();
        for (i, &w) in row.iter().enumerate().filter(|(_, &w)| w >= floor) {
            if bin(w) > cut_bin {
                kept.push(i)
            } else {
                boundary.push(i)
            }
        }
        kept_weights.clear();
        kept_weights.extend(kept.iter().map(|&i| self.weight(i)));
        let mut share: f64 = kept_weights.iter().map(|w| w / total).sum();
        if share >= self.s.top_p {
            return false;
        }
        boundary.sort_unstable_by(|a, b| self.by_likelihood(a, b));
        for &i in boundary.iter() {
            let w = self.weight(i);
            kept.push(i);
            kept_weights.push(w);
            share += w / total;
            if share >= self.s.top_p {
                return true;
            }
        }
        false
    }

    /// Min-p over `kept` in any order, `kept_weights` theirs: those at least `min_p` as likely
    /// as the most likely token (which always stays), in f64; nothing to do without min-p.
    fn min_p_within(&self, kept: &mut Vec<usize>, kept_weights: &mut Vec<f64>) {
        if self.s.min_p <= 0.0 {
            return;
        }
        let mut k = 0;
        for j in 0..kept.len() {
            if kept_weights[j] >= self.s.min_p || self.logits[kept[j]] == self.max {
                (kept[k], kept_weights[k]) = (kept[j], kept_weights[j]);
                k += 1;
            }
        }
        kept.truncate(k);
        kept_weights.truncate(k);
    }

    /// Top-p (and min-p) by sorting growing prefixes (64, 256, ...) of the most likely tokens
    /// until a cut falls inside one, the row's mass in f64.
    fn exact_search(&self, scratch: &mut Scratch) {
        let Scratch { order, kept, kept_weights, .. } = scratch;
        let total = (0..self.logits.len()).map(|i| self.weight(i)).sum();
        order.clear();
        order.extend(0..self.logits.len());
        let mut k = 64;
        loop {
            self.top(k, order, kept);
            let whole = kept.len() == self.logits.len();
            if self.cut(kept, kept_weights, total) || whole {
                return;
            }
            k *= 4;
        }
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
    /// `tokens[i]` drawn from row `rows[i]` of `logits [.., vocab]` with uniform `uniforms[i]`,
    /// for a sequence that has seen `seen(i)`.
    #[allow(clippy::too_many_arguments)]
    pub fn draw<'a>(
        &mut self,
        s: &Sampling,
        logits: &[f32],
        vocab: usize,
        rows: &[usize],
        seen: impl Fn(usize) -> Seen<'a> + Sync,
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
            .enumerate()
            .for_each(|(chunk, (((tokens, rows), uniforms), scratch))| {
                for (k, ((t, &r), &u)) in tokens.iter_mut().zip(rows).zip(uniforms).enumerate() {
                    *t = sample_row(&logits[r * vocab..(r + 1) * vocab], seen(chunk * per + k), s, u, scratch);
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
        let mut exact = Scratch::default();
        for case in 0..340 {
            // Vocabularies from 5 to 40,000 tokens; logits near-uniform (the nucleus is most of
            // the row) to peaked.
            let v = [5, 70, 300, 5000, 40_000][case % 5];
            let scale = [3.0, 0.05, 8.0][case % 3];
            let logits: Vec<f32> = (0..v).map(|_| (rng.normal() * scale) as f32).collect();
            let (top_k, top_p) =
                [(0, 0.5), (0, 0.95), (0, 0.999), (10, 1.0), (40, 0.9), (v + 3, 0.7), (0, 1.0)][case % 7];
            // min-p: off, looser than top-p / top-k, tighter, alone (with top_k 0, top_p 1, every
            // min-p but 0 comes with the last pair of the list above in some case).
            let min_p = [0.0, 1e-4, 0.05, 0.3][case % 11 % 4];
            if (top_k, top_p, min_p) == (0, 1.0, 0.0) {
                continue;
            }
            let s = Sampling { temperature: 0.8, top_k, top_p, min_p, max_new_tokens: 1, ..Default::default() };
            let (want, want_weights) = full_sort(&logits, &s);
            most_likely(&logits, &s, &mut scratch);
            if top_k == 0 {
                // Top-p and min-p keep their tokens in an order of their own.
                let mut pairs: Vec<(usize, f64)> =
                    scratch.kept.iter().copied().zip(scratch.kept_weights.iter().copied()).collect();
                pairs.sort_by(|a, b| logits[b.0].total_cmp(&logits[a.0]).then(a.0.cmp(&b.0)));
                (scratch.kept, scratch.kept_weights) = pairs.into_iter().unzip();
            }
            assert_eq!(scratch.kept, want, "case {case}");
            assert_eq!(scratch.kept_weights, want_weights, "case {case}");
            // The exact search the shortcut falls back on, on its own.
            if top_k == 0 && top_p < 1.0 {
                Ranking::new(&logits, &s).exact_search(&mut exact);
                assert_eq!((&exact.kept, &exact.kept_weights), (&want, &want_weights), "case {case}, exact");
            }
        }
    }

    /// What top-k, top-p and min-p keep, by sorting the whole row: Hugging Face's warpers in their
    /// order (min-p after top-p: probabilities renormalised over the kept tokens, those below
    /// min_p times the largest removed), weights `exp((x - max) / T)` in f64.
    fn full_sort(logits: &[f32], s: &Sampling) -> (Vec<usize>, Vec<f64>) {
        let mut full: Vec<usize> = (0..logits.len()).collect();
        full.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
        if s.top_k > 0 {
            full.truncate(s.top_k);
        }
        let max = logits[full[0]] as f64;
        let w: Vec<f64> = full.iter().map(|&i| ((logits[i] as f64 - max) / s.temperature).exp()).collect();
        let total: f64 = w.iter().sum();
        let mut keep = w.len();
        let mut cumulative = 0.0;
        for (n, x) in w.iter().enumerate() {
            cumulative += x / total;
            if s.top_p < 1.0 && cumulative >= s.top_p {
                keep = n + 1;
                break;
            }
        }
        let kept_total: f64 = w[..keep].iter().sum();
        let top = w[0] / kept_total;
        keep = w[..keep].iter().take_while(|&&x| x / kept_total >= s.min_p * top).count();
        (full[..keep].to_vec(), w[..keep].to_vec())
    }

    #[test]
    fn sampling_filters() {
        let logits = [0.0f32, 3.0, 1.0, 2.9, -5.0];
        let mut rng = Rng::new(1);
        let none = Seen::default();
        let greedy = Sampling { temperature: 0.0, ..Default::default() };
        assert_eq!(sample(&logits, none, &greedy, &mut rng), 1);
        let top2 = Sampling { top_k: 2, ..Default::default() };
        assert!((0..200).all(|_| [1, 3].contains(&sample(&logits, none, &top2, &mut rng))));
        // Nucleus: tokens 1 and 3 hold ~0.85 of the mass; p = 0.8 keeps exactly them.
        let nucleus = Sampling { top_p: 0.8, ..Default::default() };
        assert!((0..200).all(|_| [1, 3].contains(&sample(&logits, none, &nucleus, &mut rng))));
        // min-p 0.5: token 3 (e^-0.1 of token 1) stays, token 2 (e^-2) goes.
        let min_p = Sampling { min_p: 0.5, ..Default::default() };
        assert!((0..200).all(|_| [1, 3].contains(&sample(&logits, none, &min_p, &mut rng))));
        // min-p above 1 (a library caller's; configs refuse it) keeps the most likely token.
        let above = Sampling { min_p: 2.0, ..Default::default() };
        assert_eq!(sample(&logits, none, &above, &mut rng), 1);
        // A repetition penalty of 2 on token 1 (3.0 -> 1.5): greedy picks token 3, and token 1
        // seen twice is penalised once.
        let penalised = Sampling { repetition_penalty: 2.0, ..greedy };
        let seen = Seen { prompt: &[1, 4], completion: &[1] };
        assert_eq!(sample(&logits, seen, &penalised, &mut rng), 3);
        // Token 3 penalised as well (2.9 -> 1.45): token 2 (1.0) loses to token 1 (1.5).
        let seen = Seen { prompt: &[1, 3], completion: &[3, 1] };
        assert_eq!(sample(&logits, seen, &penalised, &mut rng), 1);
    }

    /// The repetition penalty as Hugging Face's `RepetitionPenaltyLogitsProcessor` computes it (a
    /// negative logit multiplied, a positive one divided, each token seen once), then the draw:
    /// the same token as drawing from logits penalised by hand, for every filter.
    #[test]
    fn repetition_penalty_is_hugging_faces() {
        let mut rng = Rng::new(5);
        let mut scratch = Scratch::default();
        for case in 0..200 {
            let v = [7, 300, 1000][case % 3];
            let logits: Vec<f32> = (0..v).map(|_| (rng.normal() * 2.0) as f32).collect();
            let prompt: Vec<u32> = (0..case % 9).map(|_| rng.below(v) as u32).collect();
            let completion: Vec<u32> = (0..case % 5).map(|_| rng.below(v.min(20)) as u32).collect();
            let penalty = [1.3, 0.7, 4.0][case % 3];
            let mut by_hand = logits.clone();
            let mut seen: Vec<u32> = prompt.iter().chain(&completion).copied().collect();
            seen.sort_unstable();
            seen.dedup();
            for &t in &seen {
                let x = &mut by_hand[t as usize];
                *x = if *x < 0.0 { *x * penalty } else { *x / penalty };
            }
            let (top_k, top_p, min_p) = [(0, 1.0, 0.0), (5, 1.0, 0.0), (0, 0.9, 0.0), (0, 1.0, 0.1)][case % 4];
            let temperature = [1.0, 0.0, 0.6][case / 3 % 3];
            let s =
                Sampling { temperature, top_k, top_p, min_p, repetition_penalty: penalty as f64, max_new_tokens: 1 };
            let plain = Sampling { repetition_penalty: 1.0, ..s };
            let row = Seen { prompt: &prompt, completion: &completion };
            for _ in 0..5 {
                let u = rng.uniform();
                let want = sample_row(&by_hand, Seen::default(), &plain, u, &mut scratch);
                assert_eq!(sample_row(&logits, row, &s, u, &mut scratch), want, "case {case}");
            }
        }
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
                counts[sample_row(&logits, Seen::default(), &s, u, &mut scratch) as usize] += 1;
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
            let seen: Vec<Vec<u32>> = (0..64).map(|i| vec![300, i as u32]).collect();
            let s = Sampling { repetition_penalty: 1.5, ..s };
            let row = |i: usize| Seen { prompt: &seen[i], completion: &[] };
            Sampler::default().draw(&s, &logits, v, &rows, row, &uniforms[..64], &mut tokens);
            for (i, (t, &u)) in tokens.iter().zip(&uniforms).enumerate() {
                assert_eq!(*t, sample_row(&logits, row(i), &s, u, &mut scratch));
            }
        }
    }
}
