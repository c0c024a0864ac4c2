//! The rollout engine: batched generation on the engine's forward.
//!
//! - Each distinct prompt is prefilled once, however many completions continue it (GRPO's `G`
//!   per prompt); its keys and values are shared by those rows.
//! - The KV cache ([`KvCache`]) is allocated once per rollout for every slot the rollout can
//!   fill (the prompts', and `max_new_tokens` per row) and written in place: no cache is copied
//!   or concatenated per token, and grouped-query heads read their key/value head directly.
//! - Every row still generating is decoded in one batch; rows that drew end-of-sequence leave
//!   the batch (they cost nothing afterwards).
//! - Sampling draws one uniform number per row from the row's own stream ([`RowStreams`], keyed
//!   by the generation's seed and the row's global index), then draws the rows in parallel with
//!   per-thread scratch ([`sampler::Sampler`]): the same tokens for any thread count, batch
//!   split or number of ranks, no allocation per token.
//!
//! [`crate::model::generate`](mod@crate::model::generate) (candle's forward) is the reference it
//! is tested against.

pub mod sampler;

use flashgrpo_kernels::synthetic::Rng;
use flashgrpo_kernels::{Loss, LossOptions, LossSpec, Rows};

use crate::engine::{forward, on_workers, Input, KvCache, Packing, Pass, Query, Weights, Workspace};
use crate::error::{Result, TrainError};
use crate::model::{Generated, Qwen2};
pub use sampler::RowStreams;
use sampler::{Sampler, Sampling, Seen};

/// Generation's buffers, kept from one rollout to the next (a trainer allocates them once).
#[derive(Debug, Default)]
pub struct Rollout {
    workspace: Workspace,
    cache: KvCache,
    sampler: Sampler,
    logits: Vec<f32>,
    /// The first step's logits rows, one per completion (equal prompts share a prefill row).
    gathered: Vec<f32>,
    /// The decode step's rows: tokens, positions, cache slots, keys.
    tokens: Vec<u32>,
    positions: Vec<u32>,
    slots: Vec<usize>,
    queries: Vec<Query>,
}

/// `logits[n, V] = hidden[n, H] @ lm_head^T` (on the bf16 products for a bf16 head, as the
/// update's single-rank fused-linear loss computes them: the same bits; the other heads and the
/// vocabulary-parallel one widen a bf16 head to f32).
fn logits(w: &Weights<'_>, hidden: &[f32], out: &mut Vec<f32>) {
    let (h, v) = (w.dims.hidden, w.dims.vocab);
    let n = hidden.len() / h;
    out.resize(n * v, 0.0);
    crate::engine::ops::linear(out, hidden, w.lm_head().weight(), None, h);
}

/// Rejects prompts the model cannot continue for `max_new_tokens`: too long for its positions,
/// or holding a token beyond its vocabulary (named by prompt and token).
fn check_prompts(model: &Qwen2, prompts: &[Vec<u32>], max_new_tokens: usize) -> Result<()> {
    let longest = prompts.iter().map(Vec::len).max().unwrap_or(0);
    if longest + max_new_tokens > model.max_positions() {
        return Err(TrainError::Other(format!(
            "prompt ({longest}) + max_new_tokens ({max_new_tokens}) exceed max_position_embeddings ({})",
            model.max_positions()
        )));
    }
    if let Some((r, &t)) = prompts
        .iter()
        .enumerate()
        .find_map(|(r, p)| p.iter().find(|&&t| t as usize >= model.config.vocab_size).map(|t| (r, t)))
    {
        return Err(TrainError::Other(format!(
            "prompt {r} holds token {t}, beyond the model's vocabulary of {}",
            model.config.vocab_size
        )));
    }
    Ok(())
}

impl Rollout {
    /// A completion for each prompt (token ids; equal prompts share their prefill), drawn as `s`
    /// says, ending at a token of `eos` or after `s.max_new_tokens`; the rows' streams are
    /// seeded by one draw from `rng`.
    pub fn generate(
        &mut self,
        model: &Qwen2,
        prompts: &[Vec<u32>],
        s: &Sampling,
        eos: &[u32],
        rng: &mut Rng,
    ) -> Result<Generated> {
        let mut streams = RowStreams::from_rng(rng, prompts.len());
        self.generate_rows(model, prompts, s, eos, &mut streams)
    }

    /// [`Rollout::generate`] with the rows' streams given (`streams.len() == prompts.len()`).
    pub fn generate_rows(
        &mut self,
        model: &Qwen2,
        prompts: &[Vec<u32>],
        s: &Sampling,
        eos: &[u32],
        streams: &mut RowStreams,
    ) -> Result<Generated> {
        if streams.len() != prompts.len() {
            return Err(TrainError::Other(format!(
                "{} random streams for {} rows of a generation",
                streams.len(),
                prompts.len()
            )));
        }
        on_workers(|| self.generate_here(model, prompts, s, eos, streams))
    }

    fn generate_here(
        &mut self,
        model: &Qwen2,
        prompts: &[Vec<u32>],
        s: &Sampling,
        eos: &[u32],
        streams: &mut RowStreams,
    ) -> Result<Generated> {
        let rows = prompts.len();
        let records = !s.greedy();
        let per_row = || if records { vec![Vec::new(); rows] } else { Vec::new() };
        let mut out = Generated {
            completions: vec![Vec::new(); rows],
            finished: vec![false; rows],
            logp: per_row(),
            entropy: per_row(),
        };
        if rows == 0 || s.max_new_tokens == 0 {
            return Ok(out);
        }
        check_prompts(model, prompts, s.max_new_tokens)?;
        let w = Weights::of(model)?;
        let vocab = w.dims.vocab;
        let refs: Vec<&[u32]> = prompts.iter().map(Vec::as_slice).collect();
        let packing = Packing::new(&refs, &[])?;
        let mut logit_rows = self.prefill(&w, &packing, rows, s.max_new_tokens)?;
        let mut active: Vec<usize> = (0..rows).collect();
        let (mut uniforms, mut drawn) = (Vec::with_capacity(rows), vec![0u32; rows]);
        for step in 0..s.max_new_tokens {
            uniforms.clear();
            uniforms.extend(active.iter().map(|&r| streams.uniform(r, s)));
            let seen = |k: usize| Seen { prompt: &prompts[active[k]], completion: &out.completions[active[k]] };
            self.sampler.draw(s, &self.logits, vocab, &logit_rows, seen, &uniforms, &mut drawn[..active.len()]);
            if records {
                let (lp, h) = self.scores(s, vocab, &logit_rows, &drawn[..active.len()])?;
                for (k, &r) in active.iter().enumerate() {
                    out.logp[r].push(lp[k]);
                    out.entropy[r].push(h[k]);
                }
            }
            for (&r, &token) in active.iter().zip(&drawn) {
                out.completions[r].push(token);
                out.finished[r] = eos.contains(&token);
            }
            active.retain(|&r| !out.finished[r]);
            if active.is_empty() || step + 1 == s.max_new_tokens {
                break;
            }
            self.decode(&w, &packing, prompts, &out.completions, &active, s.max_new_tokens)?;
            logit_rows.clear();
            logit_rows.extend(0..active.len());
        }
        Ok(out)
    }

    /// Reserves the cache for the prompts and every row's `max_new_tokens`, prefills every
    /// distinct prompt once and computes the logits of each one's last position; returns each
    /// row's logits row (the rows of one prompt share it).
    fn prefill(
        &mut self,
        w: &Weights<'_>,
        packing: &Packing,
        rows: usize,
        max_new_tokens: usize,
    ) -> Result<Vec<usize>> {
        let d = w.dims;
        let prompt_slots = packing.slots();
        self.cache.reserve(&d, prompt_slots + rows * max_new_tokens);
        let prefill: Vec<usize> = (0..prompt_slots).collect();
        forward(w, packing.input(), &mut self.workspace, Pass::Cached { cache: &mut self.cache, slots: &prefill })?;
        // Without completions, each block is one distinct prompt.
        let last_hidden: Vec<f32> = packing
            .blocks
            .iter()
            .flat_map(|b| self.workspace.hidden[(b.end - 1) * d.hidden..b.end * d.hidden].iter().copied())
            .collect();
        logits(w, &last_hidden, &mut self.logits);
        let block_of: std::collections::HashMap<usize, usize> =
            packing.blocks.iter().enumerate().map(|(i, b)| (b.start, i)).collect();
        Ok(packing.prompt_slots.iter().map(|p| block_of[&p.start]).collect())
    }

    /// Decodes the rows still generating (`active`): each one's last token at its next position,
    /// into its own cache slot (after the prompts', `max_new_tokens` per row), reading its
    /// prompt's keys and its own; the logits of those rows, in `active`'s order.
    fn decode(
        &mut self,
        w: &Weights<'_>,
        packing: &Packing,
        prompts: &[Vec<u32>],
        completions: &[Vec<u32>],
        active: &[usize],
        max_new_tokens: usize,
    ) -> Result<()> {
        let row_base = |r: usize| packing.slots() + r * max_new_tokens;
        self.tokens.clear();
        self.positions.clear();
        self.slots.clear();
        self.queries.clear();
        for &r in active {
            // A row still generating has drawn one token at every step so far.
            let step = completions[r].len() - 1;
            let slot = row_base(r) + step;
            self.tokens.push(*completions[r].last().expect("a token was drawn"));
            self.positions.push((prompts[r].len() + step) as u32);
            self.slots.push(slot);
            self.queries.push(Query { parent: packing.prompt_slots[r].clone(), own: row_base(r)..slot + 1 });
        }
        let input = Input { tokens: &self.tokens, positions: &self.positions, queries: &self.queries };
        forward(w, input, &mut self.workspace, Pass::Cached { cache: &mut self.cache, slots: &self.slots })?;
        logits(w, &self.workspace.hidden, &mut self.logits);
        Ok(())
    }

    /// `log p` of each drawn token and the entropy of its row under `softmax(logits / T)`, by the
    /// same kernel (the `logprob` op) the update's loss uses, so the two differ only where the
    /// logits do.
    fn scores(
        &mut self,
        s: &Sampling,
        vocab: usize,
        logit_rows: &[usize],
        drawn: &[u32],
    ) -> Result<(Vec<f32>, Vec<f32>)> {
        let n = drawn.len();
        let contiguous = logit_rows.iter().enumerate().all(|(k, &r)| k == r);
        if !contiguous {
            self.gathered.clear();
            for &r in logit_rows {
                self.gathered.extend_from_slice(&self.logits[r * vocab..(r + 1) * vocab]);
            }
        }
        let logits = if contiguous { &self.logits[..n * vocab] } else { &self.gathered[..] };
        let targets: Vec<i64> = drawn.iter().map(|&t| t as i64).collect();
        let options = LossOptions { temperature: s.temperature, ..LossOptions::default() };
        let spec = LossSpec {
            loss: Loss::Logprob,
            rows: Rows { batch: 1, seq_len: n, vocab, targets: Some(&targets), mask: None },
            options: &options,
            batch_shard: None,
        };
        let out = flashgrpo_kernels::forward(spec, logits)?;
        Ok((out.logp.unwrap_or_default(), out.entropy))
    }
}

/// [`Rollout::generate`] with buffers of its own.
pub fn generate(model: &Qwen2, prompts: &[Vec<u32>], s: &Sampling, eos: &[u32], rng: &mut Rng) -> Result<Generated> {
    Rollout::default().generate(model, prompts, s, eos, rng)
}
