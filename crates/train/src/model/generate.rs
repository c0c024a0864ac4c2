//! Batched sampling with a KV cache: prompts left-padded, positions counted from each row's first
//! real token (as Hugging Face's `generate` does), temperature, top-k and top-p (nucleus)
//! filtering, and a stop at end-of-sequence per row.

use candle_core::{Device, Result, Tensor};
use flashgrpo_kernels::synthetic::Rng;
use rayon::prelude::*;

use super::qwen2::{KvCache, Qwen2};

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

/// What `generate` produced for each prompt.
#[derive(Debug, Clone, PartialEq)]
pub struct Generated {
    /// The completion's tokens, ending with the end-of-sequence token when one was drawn.
    pub completions: Vec<Vec<u32>>,
    /// Whether each completion ended with end-of-sequence (rather than at `max_new_tokens`).
    pub finished: Vec<bool>,
}

/// Draws one token from `logits` (f32, `[V]`).
pub fn sample(logits: &[f32], s: &Sampling, rng: &mut Rng) -> u32 {
    sample_with(logits, s, uniform_for(s, rng), &mut Vec::new())
}

/// The one uniform number a draw takes from the stream (none when greedy), so that rows can be
/// sampled in parallel from numbers drawn in row order: the same tokens for any thread count.
fn uniform_for(s: &Sampling, rng: &mut Rng) -> f64 {
    if s.temperature > 0.0 {
        rng.uniform()
    } else {
        0.0
    }
}

/// [`sample`] with its uniform number `u` in `[0, 1)` given; `weights` is scratch space, reused
/// across rows so that the unfiltered draw allocates nothing per token.
fn sample_with(logits: &[f32], s: &Sampling, u: f64, weights: &mut Vec<f64>) -> u32 {
    let argmax =
        || logits.iter().enumerate().fold((0, f32::NEG_INFINITY), |b, (i, &x)| if x > b.1 { (i, x) } else { b }).0;
    if s.temperature <= 0.0 {
        return argmax() as u32;
    }
    if s.top_k == 0 && s.top_p >= 1.0 {
        // No filter: draw from the whole softmax in one pass, without sorting the vocabulary.
        let max = logits.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x)) as f64;
        weights.clear();
        weights.extend(logits.iter().map(|&x| ((x as f64 - max) / s.temperature).exp()));
        return draw(weights, u) as u32;
    }
    let (order, weights) = most_likely(logits, s);
    order[draw(&weights, u)] as u32
}

/// The tokens top-k / top-p keep, most likely first (ties: lower id first), and their unnormalised
/// weights. Selects instead of sorting the vocabulary: top-k sorts only its `k`; top-p sorts
/// growing prefixes (64, 256, ...) until one holds `top_p` of the mass, which at a 151,936-token
/// vocabulary and a peaked distribution is a few hundred tokens, not the whole row.
fn most_likely(logits: &[f32], s: &Sampling) -> (Vec<usize>, Vec<f64>) {
    let by_likelihood = |a: &usize, b: &usize| logits[*b].total_cmp(&logits[*a]).then(a.cmp(b));
    let max = logits.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x)) as f64;
    let weight = |i: usize| ((logits[i] as f64 - max) / s.temperature).exp();
    let mut order: Vec<usize> = (0..logits.len()).collect();
    // The `k` most likely, sorted.
    let mut top = |k: usize| -> Vec<usize> {
        let k = k.clamp(1, order.len());
        if k < order.len() {
            order.select_nth_unstable_by(k - 1, by_likelihood);
        }
        let mut prefix = order[..k].to_vec();
        prefix.sort_by(by_likelihood);
        prefix
    };
    // The prefix of `kept` whose share of `total` first reaches top_p (all of it when none does).
    let nucleus = |kept: Vec<usize>, total: f64| -> (Vec<usize>, Vec<f64>, bool) {
        let mut weights: Vec<f64> = kept.iter().map(|&i| weight(i)).collect();
        let mut cumulative = 0.0;
        let reached = (s.top_p < 1.0)
            .then(|| {
                weights.iter().position(|w| {
                    cumulative += w / total;
                    cumulative >= s.top_p
                })
            })
            .flatten();
        match reached {
            Some(n) => {
                weights.truncate(n + 1);
                (kept[..=n].to_vec(), weights, true)
            }
            None => (kept, weights, s.top_p >= 1.0),
        }
    };
    if s.top_k > 0 {
        let kept = top(s.top_k);
        let total = kept.iter().map(|&i| weight(i)).sum();
        let (order, weights, _) = nucleus(kept, total);
        return (order, weights);
    }
    let total = (0..logits.len()).map(weight).sum();
    let mut k = 64;
    loop {
        let kept = top(k);
        let whole = kept.len() == logits.len();
        let (order, weights, reached) = nucleus(kept, total);
        if reached || whole {
            return (order, weights);
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

/// Generates a completion for each prompt (token ids), in one batch.
pub fn generate(
    model: &Qwen2,
    prompts: &[Vec<u32>],
    s: &Sampling,
    eos: &[u32],
    pad: u32,
    rng: &mut Rng,
) -> Result<Generated> {
    let b = prompts.len();
    let longest = prompts.iter().map(Vec::len).max().unwrap_or(0).max(1);
    let mut ids = Vec::with_capacity(b * longest);
    let mut mask = Vec::with_capacity(b * longest);
    let mut positions = Vec::with_capacity(b * longest);
    let mut next_position = vec![0u32; b];
    for (r, p) in prompts.iter().enumerate() {
        let pad_len = longest - p.len();
        ids.extend(std::iter::repeat_n(pad, pad_len).chain(p.iter().copied()));
        mask.extend(std::iter::repeat_n(0u8, pad_len).chain(std::iter::repeat_n(1u8, p.len())));
        positions.extend(std::iter::repeat_n(0u32, pad_len).chain(0..p.len() as u32));
        next_position[r] = p.len() as u32;
    }
    if longest + s.max_new_tokens > model.max_positions() {
        candle_core::bail!(
            "prompt ({longest}) + max_new_tokens ({}) exceed max_position_embeddings ({})",
            s.max_new_tokens,
            model.max_positions()
        );
    }
    let mut cache = KvCache::default();
    let input = Tensor::from_vec(ids, (b, longest), &Device::Cpu)?;
    let mut hidden = model.forward(&input, Some(mask), positions, Some(&mut cache), false)?;
    let mut completions = vec![Vec::new(); b];
    let mut finished = vec![false; b];
    for _ in 0..s.max_new_tokens {
        let t = hidden.dim(1)?;
        let logits: Vec<Vec<f32>> = model.logits(&hidden.narrow(1, t - 1, 1)?)?.squeeze(1)?.to_vec2()?;
        // The rows' uniform numbers in row order, then the rows in parallel (a softmax over the
        // vocabulary each): the same tokens as one row after the other.
        let uniforms: Vec<Option<f64>> = finished.iter().map(|&f| (!f).then(|| uniform_for(s, rng))).collect();
        let tokens: Vec<Option<u32>> = logits
            .par_iter()
            .zip(&uniforms)
            .map_init(Vec::new, |w, (row, u)| u.map(|u| sample_with(row, s, u, w)))
            .collect();
        let mut step = Vec::with_capacity(b);
        let mut step_mask = Vec::with_capacity(b);
        for r in 0..b {
            let Some(token) = tokens[r] else {
                step.push(pad);
                step_mask.push(0u8);
                continue;
            };
            completions[r].push(token);
            finished[r] = eos.contains(&token);
            step.push(token);
            step_mask.push(1u8);
        }
        if finished.iter().all(|&f| f) {
            break;
        }
        let positions: Vec<u32> = next_position.clone();
        for p in next_position.iter_mut() {
            *p += 1;
        }
        let input = Tensor::from_vec(step, (b, 1), &Device::Cpu)?;
        hidden = model.forward(&input, Some(step_mask), positions, Some(&mut cache), false)?;
    }
    Ok(Generated { completions, finished })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The selection gives the tokens and weights of sorting the whole vocabulary.
    #[test]
    fn selection_equals_a_full_sort() {
        let mut rng = Rng::new(7);
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
            let (order, weights) = most_likely(&logits, &s);
            assert_eq!(order, full[..keep].to_vec(), "case {case}");
            assert_eq!(weights, w[..keep].to_vec(), "case {case}");
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
        let all = Sampling::default();
        let draws: Vec<u32> = (0..2000).map(|_| sample(&logits, &all, &mut rng)).collect();
        let share = draws.iter().filter(|&&t| t == 2).count() as f64 / 2000.0;
        let want = 1f64.exp() / [0.0f64, 3.0, 1.0, 2.9, -5.0].iter().map(|x| x.exp()).sum::<f64>();
        assert!((share - want).abs() < 0.02, "{share} vs {want}");
    }
}
