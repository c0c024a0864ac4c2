//! A micro-batch of the update. The loss sees `S` sequences of `C` completion positions (the longest
//! completion): hidden states `[S, C, H]`, targets the completion tokens (end of sequence
//! included), the mask 0 on padding, as TRL lays them out. The engine computes those hidden
//! states from a [`Packing`] (each distinct prompt once, positions counted from each sequence's
//! first token, as in generation, so the update scores exactly the tokens the rollout sampled).
//! The candle reference layout (prompts left-padded to `P`, completions right-padded) is kept
//! for the tests that check the engine against candle.

use candle_core::{Device, Tensor};
use flashgrpo_candle::{LossInputs, LossKind};
use flashgrpo_kernels::{BatchShard, LossOptions};

use crate::engine::{forward, Head, Packing, Pass, Weights, Workspace};
use crate::error::{Result, TrainError};
use crate::head_loss::{LossConfig, LossImpl};
use crate::model::Qwen2;

/// Sequences ready for the model and the loss.
pub struct MicroBatch {
    /// `[S, P + C - 1]` (the last completion token is a target, never an input).
    pub ids: Tensor,
    pub attention: Vec<u8>,
    pub positions: Vec<u32>,
    pub prompt_len: usize,
    pub completion_len: usize,
    /// `[S * C]`.
    pub targets: Vec<i64>,
    /// `[S * C]`, 1 on completion tokens.
    pub mask: Vec<f32>,
    /// The sequences as the engine runs them.
    pub packing: Packing,
}

impl MicroBatch {
    /// Lays out `prompts[i] + completions[i]`; every completion has at least one token.
    pub fn new(prompts: &[&[u32]], completions: &[&[u32]], pad: u32) -> Result<Self> {
        let s = prompts.len();
        let p = prompts.iter().map(|x| x.len()).max().unwrap_or(1).max(1);
        let c = completions.iter().map(|x| x.len()).max().unwrap_or(1).max(1);
        let width = p + c - 1;
        let (mut ids, mut attention, mut positions) =
            (vec![pad; s * width], vec![0u8; s * width], vec![0u32; s * width]);
        let (mut targets, mut mask) = (vec![0i64; s * c], vec![0f32; s * c]);
        for (r, (prompt, completion)) in prompts.iter().zip(completions).enumerate() {
            let row = r * width;
            let start = p - prompt.len();
            let tokens = prompt.iter().chain(completion.iter()).take(width - start);
            for (k, &token) in tokens.enumerate() {
                ids[row + start + k] = token;
                attention[row + start + k] = 1;
                positions[row + start + k] = k as u32;
            }
            for (j, &token) in completion.iter().enumerate() {
                targets[r * c + j] = token as i64;
                mask[r * c + j] = 1.0;
            }
        }
        Ok(Self {
            ids: Tensor::from_vec(ids, (s, width), &Device::Cpu)?,
            attention,
            positions,
            prompt_len: p,
            completion_len: c,
            targets,
            mask,
            packing: Packing::new(prompts, completions)?,
        })
    }

    pub fn sequences(&self) -> usize {
        self.mask.len() / self.completion_len
    }

    /// Completion tokens.
    pub fn valid(&self) -> usize {
        self.mask.iter().filter(|&&m| m != 0.0).count()
    }

    /// The hidden states at the completion positions, `[S, C, H]`, by candle's forward (the
    /// reference of the engine's).
    pub fn completion_hidden(&self, model: &Qwen2, track: bool) -> Result<Tensor> {
        let hidden = model.forward(&self.ids, Some(self.attention.clone()), self.positions.clone(), None, track)?;
        Ok(hidden.narrow(1, self.prompt_len - 1, self.completion_len)?.contiguous()?)
    }

    /// The loss inputs of this micro-batch for `kind`.
    pub fn inputs(
        &self,
        kind: LossKind,
        options: &LossOptions,
        loss: &LossConfig,
        shard: Option<BatchShard>,
    ) -> LossInputs {
        LossInputs {
            kind,
            batch: self.sequences(),
            seq_len: self.completion_len,
            targets: Some(self.targets.clone()),
            mask: Some(self.mask.clone()),
            options: options.clone(),
            budget: loss.budget(),
            batch_shard: shard,
        }
    }

    /// Per-token log-probabilities `[S * C]` of the completion under the model `w` (no gradient:
    /// the engine's forward, then the fused-linear logprob op, no logits materialised). 0 on
    /// padding.
    pub fn logprobs(
        &self,
        w: &Weights<'_>,
        lm_head: &candle_core::Var,
        ws: &mut Workspace,
        options: &LossOptions,
        loss: &LossConfig,
    ) -> Result<Vec<f32>> {
        forward(w, self.packing.input(), ws, Pass::Score)?;
        let rows = self.packing.gather(&ws.hidden, w.dims.hidden);
        let inputs = self.inputs(LossKind::Logprob, options, loss, None);
        let head = Head { weights: w, lm_head, implementation: LossImpl::FusedLinear };
        let (_, out) = head.loss(&rows, &inputs, None)?;
        out.and_then(|o| o.logp).ok_or_else(|| TrainError::Other("the logprob op returns log-probabilities".into()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout() {
        let mb = MicroBatch::new(&[&[5, 6], &[7]], &[&[1, 2, 0], &[3]], 9).unwrap();
        assert_eq!((mb.prompt_len, mb.completion_len), (2, 3));
        let ids: Vec<Vec<u32>> = mb.ids.to_vec2().unwrap();
        assert_eq!(ids, vec![vec![5, 6, 1, 2], vec![9, 7, 3, 9]]);
        assert_eq!(mb.attention, vec![1, 1, 1, 1, 0, 1, 1, 0]);
        assert_eq!(mb.positions, vec![0, 1, 2, 3, 0, 0, 1, 0]);
        assert_eq!(mb.targets, vec![1, 2, 0, 3, 0, 0]);
        assert_eq!(mb.mask, vec![1.0, 1.0, 1.0, 1.0, 0.0, 0.0]);
        assert_eq!(mb.valid(), 4);
    }
}
