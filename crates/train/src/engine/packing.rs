//! How a batch of sequences is laid out for the engine: each distinct prompt once, followed by
//! the completions that continue it. A GRPO batch holds `G` completions of every prompt, so
//! the prompt's tokens go through the model once instead of `G` times (the prompt's keys and
//! values are the same for all of them), in the update as in generation; the gradients the
//! completions send back into the shared prompt add up there, which is exactly the sum of the
//! per-sequence gradients.
//!
//! Slots: a prompt's tokens, then for each of its completions every completion token but the last
//! (the last is only a target). The hidden state of a prompt's last slot predicts the first token
//! of each of its completions.

use std::collections::HashMap;
use std::ops::Range;

use super::attention::Query;
use super::forward::Input;
use crate::error::{Result, TrainError};

/// Sequences laid out as slots.
#[derive(Debug, Clone, PartialEq)]
pub struct Packing {
    /// The input token of each slot.
    pub tokens: Vec<u32>,
    /// Each slot's position, counted from its sequence's first token.
    pub positions: Vec<u32>,
    /// The keys each slot's query attends to.
    pub queries: Vec<Query>,
    /// Contiguous ranges of slots closed under the queries' keys: a prompt and its completions.
    pub blocks: Vec<Range<usize>>,
    /// For sequence `s` and completion position `j < C`, at `s * C + j`: the slot whose hidden state
    /// predicts completion token `j` (`None` past the end of the completion).
    pub loss_slots: Vec<Option<usize>>,
    /// `C`, the longest completion (0 when only prompts were laid out).
    pub completion_len: usize,
    /// For each sequence, its prompt's slots.
    pub prompt_slots: Vec<Range<usize>>,
}

impl Packing {
    /// Lays out `prompts[s] + completions[s]` (or only the prompts, when `completions` is empty).
    /// Prompts equal in content share their slots.
    pub fn new(prompts: &[&[u32]], completions: &[&[u32]]) -> Result<Self> {
        if !completions.is_empty() && completions.len() != prompts.len() {
            return Err(TrainError::Other(format!(
                "packing: {} prompts but {} completions",
                prompts.len(),
                completions.len()
            )));
        }
        if let Some(s) = prompts.iter().position(|p| p.is_empty()) {
            return Err(TrainError::Other(format!("packing: prompt {s} is empty")));
        }
        if let Some(s) = completions.iter().position(|c| c.is_empty()) {
            return Err(TrainError::Other(format!("packing: completion {s} is empty")));
        }
        // Distinct prompts in order of first appearance, with the sequences that use each.
        let mut order: Vec<(&[u32], Vec<usize>)> = Vec::new();
        let mut seen: HashMap<&[u32], usize> = HashMap::new();
        for (s, p) in prompts.iter().enumerate() {
            let u = *seen.entry(p).or_insert_with(|| {
                order.push((p, Vec::new()));
                order.len() - 1
            });
            order[u].1.push(s);
        }
        let c = completions.iter().map(|c| c.len()).max().unwrap_or(0);
        let mut p = Packing {
            tokens: Vec::new(),
            positions: Vec::new(),
            queries: Vec::new(),
            blocks: Vec::new(),
            loss_slots: vec![None; prompts.len() * c],
            completion_len: c,
            prompt_slots: vec![0..0; prompts.len()],
        };
        for (prompt, sequences) in order {
            let block_start = p.tokens.len();
            for (j, &token) in prompt.iter().enumerate() {
                p.push(token, j, 0..0, block_start);
            }
            let prompt_range = block_start..p.tokens.len();
            for &s in &sequences {
                p.prompt_slots[s] = prompt_range.clone();
                let Some(completion) = completions.get(s) else { continue };
                let start = p.tokens.len();
                p.loss_slots[s * c] = Some(prompt_range.end - 1);
                for (j, &token) in completion[..completion.len() - 1].iter().enumerate() {
                    p.loss_slots[s * c + j + 1] = Some(p.tokens.len());
                    p.push(token, prompt.len() + j, prompt_range.clone(), start);
                }
            }
            p.blocks.push(block_start..p.tokens.len());
        }
        Ok(p)
    }

    fn push(&mut self, token: u32, position: usize, parent: Range<usize>, own_start: usize) {
        let slot = self.tokens.len();
        self.tokens.push(token);
        self.positions.push(position as u32);
        self.queries.push(Query { parent, own: own_start..slot + 1 });
    }

    /// The slots as a forward's rows.
    pub fn input(&self) -> Input<'_> {
        Input { tokens: &self.tokens, positions: &self.positions, queries: &self.queries }
    }

    pub fn slots(&self) -> usize {
        self.tokens.len()
    }

    /// The loss rows' hidden states `[S * C, H]` gathered from the slots' `hidden [slots, H]`
    /// (zeros on padding).
    pub fn gather(&self, hidden: &[f32], h: usize) -> Vec<f32> {
        gather_rows(&self.loss_slots, hidden, h)
    }

    /// The slots' gradient `[slots, H]` from the loss rows' `d_rows [S * C, H]`.
    pub fn scatter(&self, d_rows: &[f32], h: usize) -> Vec<f32> {
        scatter_rows(&self.loss_slots, d_rows, h, self.slots())
    }

    /// The loss rows that have a target, in order (for losses that are row-local, such as
    /// cross-entropy, which need not see the padding).
    pub fn target_slots(&self) -> Vec<Option<usize>> {
        self.loss_slots.iter().copied().filter(Option::is_some).collect()
    }
}

/// Rows `[rows.len(), H]` gathered from `hidden [slots, H]`: row `i` is slot `rows[i]` (zeros for
/// `None`).
pub fn gather_rows(rows: &[Option<usize>], hidden: &[f32], h: usize) -> Vec<f32> {
    let mut out = vec![0.0f32; rows.len() * h];
    for (row, slot) in out.chunks_exact_mut(h).zip(rows) {
        if let Some(slot) = slot {
            row.copy_from_slice(&hidden[slot * h..(slot + 1) * h]);
        }
    }
    out
}

/// The slots' gradient `[slots, H]` from the gathered rows' `d_rows`: a slot gathered several
/// times (a prompt's last slot, once per completion that continues it) sums its rows in order.
pub fn scatter_rows(rows: &[Option<usize>], d_rows: &[f32], h: usize, slots: usize) -> Vec<f32> {
    let mut out = vec![0.0f32; slots * h];
    for (row, slot) in d_rows.chunks_exact(h).zip(rows) {
        if let Some(slot) = slot {
            out[slot * h..(slot + 1) * h].iter_mut().zip(row).for_each(|(o, &g)| *o += g);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shared_prompts_are_laid_out_once() {
        let (a, b): (&[u32], &[u32]) = (&[5, 6], &[7]);
        let p = Packing::new(&[a, b, a], &[&[1, 2, 3], &[4], &[8, 9]]).unwrap();
        // Prompt [5, 6], completion inputs [1, 2] and [8]; prompt [7] with no completion input.
        assert_eq!(p.tokens, vec![5, 6, 1, 2, 8, 7]);
        assert_eq!(p.positions, vec![0, 1, 2, 3, 2, 0]);
        assert_eq!(p.blocks, vec![0..5, 5..6]);
        assert_eq!(p.queries[3], Query { parent: 0..2, own: 2..4 });
        assert_eq!(p.queries[4], Query { parent: 0..2, own: 4..5 });
        assert_eq!(p.queries[1], Query { parent: 0..0, own: 0..2 });
        assert_eq!(p.completion_len, 3);
        assert_eq!(p.loss_slots, vec![Some(1), Some(2), Some(3), Some(5), None, None, Some(1), Some(4), None]);
        assert_eq!(p.prompt_slots, vec![0..2, 5..6, 0..2]);
        assert!(Packing::new(&[&[]], &[&[1]]).is_err());
        assert!(Packing::new(&[a], &[&[]]).is_err());
    }
}
