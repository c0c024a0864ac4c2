//! Batched sampling with candle's forward and a KV cache: prompts left-padded, positions counted
//! from each row's first real token (as Hugging Face's `generate` does), a stop at
//! end-of-sequence per row. The reference for the trainer's generation
//! ([`crate::rollout::Rollout`], the engine's), which must produce the same tokens where the
//! numerics allow (tested greedily in crates/train/tests/engine.rs).

use candle_core::{Device, Result, Tensor};
use flashgrpo_kernels::synthetic::Rng;
use rayon::prelude::*;

use super::qwen2::{KvCache, Qwen2};
use crate::rollout::sampler::{sample_row, RowStreams, Sampling, Seen};

/// What `generate` produced for each prompt.
#[derive(Debug, Clone, PartialEq)]
pub struct Generated {
    /// The completion's tokens, ending with the end-of-sequence token when one was drawn.
    pub completions: Vec<Vec<u32>>,
    /// Whether each completion ended with end-of-sequence (rather than at `max_new_tokens`).
    pub finished: Vec<bool>,
    /// Per completion token, `log p` of the drawn token under the sampling distribution
    /// (`softmax(logits / temperature)` over the whole vocabulary, before the repetition
    /// penalty and top-k / top-p / min-p), by the kernels' `logprob` op; empty when nothing
    /// records it (greedy decoding, this reference).
    pub logp: Vec<Vec<f32>>,
    /// The sampling distribution's entropy at each completion token, recorded with `logp`.
    pub entropy: Vec<Vec<f32>>,
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
    let mut streams = RowStreams::from_rng(rng, b);
    let mut cache = KvCache::default();
    let input = Tensor::from_vec(ids, (b, longest), &Device::Cpu)?;
    let mut hidden = model.forward(&input, Some(mask), positions, Some(&mut cache), false)?;
    let mut completions = vec![Vec::new(); b];
    let mut finished = vec![false; b];
    for _ in 0..s.max_new_tokens {
        let t = hidden.dim(1)?;
        let logits: Vec<Vec<f32>> = model.logits(&hidden.narrow(1, t - 1, 1)?)?.squeeze(1)?.to_vec2()?;
        // Each row's uniform number from its own stream, then the rows in parallel (a softmax
        // over the vocabulary each): the same tokens as one row after the other.
        let uniforms: Vec<Option<f64>> =
            finished.iter().enumerate().map(|(r, &f)| (!f).then(|| streams.uniform(r, s))).collect();
        let tokens: Vec<Option<u32>> = logits
            .par_iter()
            .zip(&uniforms)
            .zip(prompts.par_iter().zip(&completions))
            .map_init(Default::default, |scratch, ((row, u), (prompt, completion))| {
                u.map(|u| sample_row(row, Seen { prompt, completion }, s, u, scratch))
            })
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
    Ok(Generated { completions, finished, logp: Vec::new(), entropy: Vec::new() })
}
