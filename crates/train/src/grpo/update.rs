//! An update on the engine: a batch of sequences cut into micro-batches whose losses sum to the
//! whole batch's (the kernels' [`BatchShard`] normalisers), each micro-batch's forward, head loss
//! and backward into the optimiser's gradient buffers, then the optimiser step. GRPO's policy
//! update runs it `ppo_epochs` times on a rollout batch; SFT once per step on its examples
//! (cross-entropy). [`batch_gradients`] is the same without the optimiser: the loss and every
//! parameter's gradient of one batch, which the trainer-level oracle compares with TRL's
//! (`flashgrpo update-grads`, tests/peers/trl_oracle.py).

use std::ops::Range;

use flashgrpo_candle::{LossInputs, LossKind};
use flashgrpo_collective::{Collective, ReduceOp, SingleProcess};
use flashgrpo_kernels::{BatchShard, LossOptions, LossOutput};

use super::batch::MicroBatch;
use crate::engine::packing::{gather_rows, scatter_rows};
use crate::engine::{backward, forward, BackwardBuffers, Head, HeadGradients, Pass, Weights, Workspace};
use crate::error::Result;
use crate::head_loss::LossConfig;
use crate::model::Qwen2;
use crate::optim::overlap::{overlapped, HandOver};
use crate::optim::{GradBuffers, StepReport, Updater};
use crate::parallel::Mesh;
use crate::rollout::Rollout;

/// The engine's buffers, kept from step to step: generation's, the update's (every layer's
/// activations), the no-gradient passes' (one layer's), the backward's.
#[derive(Default)]
pub struct EngineBuffers {
    pub rollout: Rollout,
    pub workspace: Workspace,
    pub score: Workspace,
    pub backward: BackwardBuffers,
}

/// A rollout batch laid out for the update: micro-batches of consecutive sequences and the whole
/// batch's normalisers.
pub struct UpdateBatch {
    pub batches: Vec<MicroBatch>,
    /// Each micro-batch's sequences.
    pub ranges: Vec<Range<usize>>,
    pub shard: BatchShard,
}

impl UpdateBatch {
    /// `prompts[s] + completions[s]` (every completion at least one token) in micro-batches of
    /// `micro_batch_size` sequences.
    pub fn new(prompts: &[Vec<u32>], completions: &[Vec<u32>], micro_batch_size: usize, pad: u32) -> Result<Self> {
        if micro_batch_size == 0 {
            return Err(crate::error::TrainError::Other("the micro-batch size must be positive".into()));
        }
        let n = completions.len();
        let ranges: Vec<Range<usize>> =
            (0..n).step_by(micro_batch_size).map(|s| s..(s + micro_batch_size).min(n)).collect();
        let batches = ranges
            .iter()
            .map(|r| {
                let p: Vec<&[u32]> = prompts[r.clone()].iter().map(Vec::as_slice).collect();
                let c: Vec<&[u32]> = completions[r.clone()].iter().map(Vec::as_slice).collect();
                MicroBatch::new(&p, &c, pad)
            })
            .collect::<Result<Vec<_>>>()?;
        let mut batch = Self { batches, ranges, shard: BatchShard::counts(n, 0.0) };
        batch.count_rows();
        Ok(batch)
    }

    /// The local counts of unmasked rows and of sequences with at least one.
    fn count_rows(&mut self) {
        self.shard.global_valid_rows = self.batches.iter().map(MicroBatch::valid).sum::<usize>() as f64;
        let with_tokens = |mb: &MicroBatch| {
            mb.mask.chunks(mb.completion_len.max(1)).filter(|seq| seq.iter().any(|&m| m != 0.0)).count()
        };
        self.shard.global_sequences_with_tokens = Some(self.batches.iter().map(with_tokens).sum::<usize>() as f64);
    }

    /// Makes the normalisers those of the batch of every rank (each holding its share of the
    /// sequences): one all-reduce of three numbers, after which the ranks' losses and gradients
    /// sum to the whole batch's.
    pub fn share_normalisers(&mut self, comm: &dyn Collective) -> Result<()> {
        let with_tokens = self.shard.global_sequences_with_tokens.unwrap_or(self.shard.global_batch as f64);
        let mut counts = [self.shard.global_batch as f64, self.shard.global_valid_rows, with_tokens];
        comm.all_reduce_f64(&mut counts, ReduceOp::Sum)?;
        (self.shard.global_batch, self.shard.global_valid_rows) = (counts[0] as usize, counts[1]);
        self.shard.global_sequences_with_tokens = Some(counts[2]);
        Ok(())
    }

    /// TRL's `mask_truncated_completions`: the sequences marked in `drop` (one flag per sequence)
    /// take no part in the loss or its normalisers. Call before [`UpdateBatch::share_normalisers`].
    pub fn mask_sequences(&mut self, drop: &[bool]) {
        for (mb, range) in self.batches.iter_mut().zip(&self.ranges) {
            let c = mb.completion_len;
            for (row, s) in range.clone().enumerate() {
                if drop.get(s).copied().unwrap_or(false) {
                    mb.mask[row * c..(row + 1) * c].fill(0.0);
                }
            }
        }
        self.count_rows();
    }

    /// `top_entropy_quantile < 1`: the entropy threshold over the whole batch of every rank, from
    /// the entropies the sampler recorded (`entropy[s][j]`, the same weights as the update's first
    /// epoch), and the number of tokens at or above it; the micro-batches then all mask by the one
    /// threshold, and their losses still sum to the batch's. TRL takes the quantile per
    /// micro-batch (over every rank) from the training forward's entropies.
    pub fn share_entropy_threshold(
        &mut self,
        entropy: &[Vec<f32>],
        quantile: f64,
        comm: &dyn Collective,
    ) -> Result<()> {
        let mut local = Vec::new();
        for (mb, range) in self.batches.iter().zip(&self.ranges) {
            let c = mb.completion_len;
            for (row, s) in range.clone().enumerate() {
                let on = |j: usize| mb.mask[row * c + j] != 0.0;
                local.extend(entropy[s].iter().take(c).enumerate().filter(|(j, _)| on(*j)).map(|(_, &h)| h as f64));
            }
        }
        // Pad every rank's list to the longest with a value no entropy takes (TRL's sentinel).
        const PAD: f64 = -1e9;
        let mut longest = [local.len() as f64];
        comm.all_reduce_f64(&mut longest, ReduceOp::Max)?;
        local.resize(longest[0] as usize, PAD);
        let mut all = vec![0.0; local.len() * comm.size()];
        comm.all_gather_f64(&local, &mut all)?;
        all.retain(|&h| h != PAD);
        all.sort_by(f64::total_cmp);
        let threshold = if all.is_empty() { f64::INFINITY } else { flashgrpo_kernels::quantile(&all, 1.0 - quantile) };
        self.shard.entropy_threshold = Some(threshold);
        self.shard.global_bonus_rows = Some(all.iter().filter(|&&h| h >= threshold).count() as f64);
        Ok(())
    }

    /// Completion tokens in the batch (every rank's, after [`UpdateBatch::share_normalisers`]).
    pub fn valid_tokens(&self) -> usize {
        self.shard.global_valid_rows as usize
    }

    /// Per-sequence values (`values[s][j]` at completion position `j`) in each micro-batch's
    /// `[S * C]` layout (0 past a completion's end).
    pub fn per_micro_batch(&self, values: &[Vec<f32>]) -> Vec<Vec<f32>> {
        self.batches
            .iter()
            .zip(&self.ranges)
            .map(|(mb, range)| {
                let c = mb.completion_len;
                let mut out = vec![0.0f32; range.len() * c];
                for (row, s) in range.clone().enumerate() {
                    for (j, &v) in values[s].iter().take(c).enumerate() {
                        out[row * c + j] = v * mb.mask[row * c + j];
                    }
                }
                out
            })
            .collect()
    }

    /// The log-probabilities `[S * C]` of each micro-batch's completions under `model`.
    pub fn logprobs(
        &self,
        model: &Qwen2,
        workspace: &mut Workspace,
        options: &LossOptions,
        loss: &LossConfig,
    ) -> Result<Vec<Vec<f32>>> {
        let w = Weights::of(model)?;
        self.batches.iter().map(|b| b.logprobs(&w, model.lm_head(), workspace, options, loss)).collect()
    }
}

/// Per-token outputs summed over the completion tokens of an epoch.
#[derive(Default)]
pub struct TokenSums {
    pub entropy: f64,
    pub kl: f64,
    pub clipped: f64,
    pub tokens: f64,
    pub have_entropy: bool,
    pub have_kl: bool,
    pub have_clip: bool,
    /// The largest `|logp - sampling_logp|` over the completion tokens: the update's
    /// log-probabilities against those the sampler recorded for the same tokens and weights.
    pub rollout_logp_max_abs_diff: Option<f64>,
}

impl TokenSums {
    /// The sums over every rank (with the loss, in one all-reduce).
    fn all_reduce(&mut self, loss: &mut f64, comm: &dyn Collective) -> Result<()> {
        if comm.size() == 1 {
            return Ok(());
        }
        let flag = |b: bool| f64::from(u8::from(b));
        let mut v = [
            *loss,
            self.entropy,
            self.kl,
            self.clipped,
            self.tokens,
            flag(self.have_entropy),
            flag(self.have_kl),
            flag(self.have_clip),
        ];
        comm.all_reduce_f64(&mut v, ReduceOp::Sum)?;
        *loss = v[0];
        (self.entropy, self.kl, self.clipped, self.tokens) = (v[1], v[2], v[3], v[4]);
        (self.have_entropy, self.have_kl, self.have_clip) = (v[5] > 0.0, v[6] > 0.0, v[7] > 0.0);
        // Every rank takes part, also one without sequences (dynamic sampling can leave it none).
        let mut worst = [self.rollout_logp_max_abs_diff.unwrap_or(-1.0)];
        comm.all_reduce_f64(&mut worst, ReduceOp::Max)?;
        self.rollout_logp_max_abs_diff = (worst[0] >= 0.0).then_some(worst[0]);
        Ok(())
    }

    fn add(&mut self, out: Option<&LossOutput>, inputs: &LossInputs, recorded: Option<&[f32]>) {
        let weight = |i: usize| inputs.mask.as_ref().map_or(1.0, |m| m[i] as f64);
        if let (Some(logp), Some(recorded)) = (out.and_then(|o| o.logp.as_ref()), recorded) {
            let worst = logp
                .iter()
                .zip(recorded)
                .enumerate()
                .filter(|&(i, (_, r))| weight(i) != 0.0 && !r.is_nan())
                .map(|(_, (&l, &r))| (l as f64 - r as f64).abs())
                .fold(0.0, f64::max);
            let d = self.rollout_logp_max_abs_diff.get_or_insert(0.0);
            *d = d.max(worst);
        }
        let masked_sum = |v: &[f32]| -> f64 { v.iter().enumerate().map(|(i, x)| *x as f64 * weight(i)).sum() };
        if let Some(o) = out {
            self.entropy += masked_sum(&o.entropy);
            self.have_entropy = true;
            if let Some(kl) = &o.kl {
                self.kl += masked_sum(kl);
                self.have_kl = true;
            }
            if let Some(c) = &o.is_clipped {
                self.clipped += masked_sum(c);
                self.have_clip = true;
            }
        }
        self.tokens += (0..inputs.batch * inputs.seq_len).map(weight).sum::<f64>();
    }
}

/// The loss an update descends.
pub enum Objective<'a> {
    /// GRPO's policy loss.
    Grpo {
        /// Per sequence.
        advantages: &'a [f64],
        /// Per micro-batch, `[S * C]`: the rollout policy's log-probabilities (`ppo_epochs > 1`).
        old_logp: Option<Vec<Vec<f32>>>,
        /// Per micro-batch, `[S * C]`: the reference model's (`beta != 0`).
        ref_logp: Option<Vec<Vec<f32>>>,
        /// Per micro-batch, `[S * C]`: the sampler's, handed to the loss as `sampling_logp`
        /// (`grpo.sampling_logp`: rollout correction, the off-policy mask).
        sampling_logp: Option<Vec<Vec<f32>>>,
    },
    /// Cross-entropy of the completion tokens (SFT).
    CrossEntropy,
}

/// What an update needs besides the model and the optimiser.
pub struct UpdateInputs<'a> {
    pub batch: &'a UpdateBatch,
    pub objective: Objective<'a>,
    pub options: &'a LossOptions,
    pub loss: &'a LossConfig,
    /// Per micro-batch, `[S * C]`: what the sampler recorded, compared with the update's own
    /// log-probabilities (`train/rollout_logp_max_abs_diff`).
    pub recorded_logp: Option<Vec<Vec<f32>>>,
}

impl<'a> UpdateInputs<'a> {
    /// SFT's update: cross-entropy of the completion tokens with the `loss:` section's options.
    pub fn cross_entropy(batch: &'a UpdateBatch, loss: &'a LossConfig) -> Self {
        Self { batch, objective: Objective::CrossEntropy, options: &loss.options, loss, recorded_logp: None }
    }

    /// The head's rows of micro-batch `k` (slots of its packing) and their loss inputs. GRPO's
    /// objectives see the `[S, C]` layout (their normalisers count per sequence); cross-entropy
    /// is row-local, so only the rows with a target reach the head (as one sequence), not the
    /// padding of the shorter completions.
    fn head(&self, k: usize, mb: &MicroBatch) -> (Vec<Option<usize>>, LossInputs) {
        let inputs = mb.inputs(self.kind(k), self.options, self.loss, Some(self.batch.shard));
        if !matches!(self.objective, Objective::CrossEntropy) {
            return (mb.packing.loss_slots.clone(), inputs);
        }
        let rows = mb.packing.target_slots();
        let targets = mb.targets.iter().zip(&mb.mask).filter(|(_, &m)| m != 0.0).map(|(&t, _)| t).collect();
        let compact = LossInputs { batch: 1, seq_len: rows.len(), targets: Some(targets), mask: None, ..inputs };
        (rows, compact)
    }

    /// The loss of micro-batch `k`.
    fn kind(&self, k: usize) -> LossKind {
        match &self.objective {
            Objective::Grpo { advantages, old_logp, ref_logp, sampling_logp } => LossKind::Grpo {
                advantages: advantages[self.batch.ranges[k].clone()].iter().map(|&a| a as f32).collect(),
                old_logp: old_logp.as_ref().map(|o| o[k].clone()),
                ref_logp: ref_logp.as_ref().map(|r| r[k].clone()),
                is_ratio: None,
                sampling_logp: sampling_logp.as_ref().map(|s| s[k].clone()),
            },
            Objective::CrossEntropy => LossKind::CrossEntropy { class_weights: None },
        }
    }
}

/// One pass over the micro-batches: each one's forward, head loss and backward, its gradients
/// added to `grads` (`record` sees each micro-batch's loss). Returns the batch's loss (the sum of
/// the micro-batches') and the per-token sums.
///
/// With a vocabulary group of several ranks (`vocab`), the head's products and loss are split
/// by vocabulary rows among them ([`Head::loss_vocab_parallel`]); they hold the same sequences,
/// so only the group's first rank runs the layers' backward (the others would add the same
/// gradient again to the world's sum): the others contribute their rows of the lm_head's gradient.
/// With `after_layer`, the last micro-batch's backward hands each completed layer over to be
/// summed over the ranks ([`overlapped`]).
fn accumulate(
    model: &Qwen2,
    u: &UpdateInputs<'_>,
    grads: &mut GradBuffers,
    engine: &mut EngineBuffers,
    mut record: impl FnMut(f64),
    vocab: &dyn Collective,
    mut after_layer: Option<&mut HandOver<'_>>,
) -> Result<(f64, TokenSums)> {
    let last = u.batch.batches.len().saturating_sub(1);
    let h = model.config.hidden_size;
    let w = Weights::of(model)?;
    let (mut total, mut sums) = (0.0, TokenSums::default());
    for (k, mb) in u.batch.batches.iter().enumerate() {
        let (slots, inputs) = u.head(k, mb);
        forward(&w, mb.packing.input(), &mut engine.workspace, Pass::Train)?;
        let rows = gather_rows(&slots, &engine.workspace.hidden, h);
        let mut d_rows = vec![0.0f32; rows.len()];
        let head = Head { weights: &w, lm_head: model.lm_head(), implementation: u.loss.implementation };
        let gradients = HeadGradients { rows: &mut d_rows, grads };
        let (value, out) = if vocab.size() > 1 {
            head.loss_vocab_parallel(&rows, &inputs, gradients, vocab)?
        } else {
            head.loss(&rows, &inputs, Some(gradients))?
        };
        record(value);
        total += value;
        sums.add(out.as_ref(), &inputs, u.recorded_logp.as_ref().map(|r| r[k].as_slice()));
        if vocab.rank() == 0 {
            let d_slots = scatter_rows(&slots, &d_rows, h, mb.packing.slots());
            let (ws, bufs) = (&mut engine.workspace, &mut engine.backward);
            match after_layer.as_mut() {
                // The last micro-batch completes each layer's gradient: hand it over to be summed.
                Some(hand_over) if k == last => {
                    let layers = w.dims.layers;
                    backward(&w, &mb.packing, ws, bufs, &d_slots, grads, &mut |l, g| hand_over(layers - 1 - l, g))
                }
                _ => backward(&w, &mb.packing, ws, bufs, &d_slots, grads, &mut |_, _| {}),
            }
        }
    }
    Ok((total, sums))
}

/// The loss of one batch, no gradient (the engine's forward without its activations kept).
pub fn batch_loss(model: &Qwen2, u: &UpdateInputs<'_>, workspace: &mut Workspace) -> Result<f64> {
    crate::engine::on_workers(|| {
        let w = Weights::of(model)?;
        let mut total = 0.0;
        for (k, mb) in u.batch.batches.iter().enumerate() {
            let (slots, inputs) = u.head(k, mb);
            forward(&w, mb.packing.input(), workspace, Pass::Score)?;
            let rows = gather_rows(&slots, &workspace.hidden, w.dims.hidden);
            let head = Head { weights: &w, lm_head: model.lm_head(), implementation: u.loss.implementation };
            total += head.loss(&rows, &inputs, None)?.0;
        }
        Ok(total)
    })
}

/// The loss of one batch and every parameter's gradient (in the parameters' order), no optimiser
/// step.
pub fn batch_gradients(model: &Qwen2, u: &UpdateInputs<'_>) -> Result<(f64, GradBuffers)> {
    let mut grads = GradBuffers::new(&model.params);
    let (loss, _) = crate::engine::on_workers(|| {
        accumulate(model, u, &mut grads, &mut EngineBuffers::default(), |_| {}, &SingleProcess, None)
    })?;
    Ok((loss, grads))
}

/// The update: `epochs` times, every micro-batch into the optimiser's buffers, the gradients
/// summed over every rank of `mesh`, then one optimiser step. Returns each epoch's loss (over
/// every rank), the first epoch's per-token sums, and the last step's report (its `comm_s`:
/// the epochs' time in collectives that the overlap with the backward did not hide).
pub fn update(
    model: &Qwen2,
    u: &UpdateInputs<'_>,
    epochs: usize,
    updater: &mut Updater,
    engine: &mut EngineBuffers,
    mesh: &Mesh<'_>,
) -> Result<(Vec<f64>, TokenSums, StepReport)> {
    let (mut losses, mut first, mut report, mut comm_s) = (Vec::new(), None, None, 0.0);
    let vocab = mesh.vocab();
    // Each layer's parameters, in the order the backward completes them (the last layer first).
    let groups: Vec<Vec<usize>> = if mesh.overlap_grad_sum {
        let w = Weights::of(model)?;
        w.layers.iter().rev().map(|l| l.indices()).collect()
    } else {
        Vec::new()
    };
    for _ in 0..epochs {
        let (grads, record) = updater.grads_and_recorder();
        let ((mut loss, mut sums), done, waited) = if mesh.overlap_grad_sum {
            overlapped(grads, &groups, mesh.world, |grads, hand_over| {
                crate::engine::on_workers(|| accumulate(model, u, grads, engine, record, vocab, Some(hand_over)))
            })?
        } else {
            (crate::engine::on_workers(|| accumulate(model, u, grads, engine, record, vocab, None))?, Vec::new(), 0.0)
        };
        let started = std::time::Instant::now();
        sums.all_reduce(&mut loss, mesh.data())?;
        updater.reduce(mesh.world, &done)?;
        comm_s += waited + started.elapsed().as_secs_f64();
        losses.push(loss);
        first.get_or_insert(sums);
        report = Some(updater.step(&model.params)?);
    }
    let report = StepReport { comm_s, ..report.expect("ppo_epochs >= 1") };
    Ok((losses, first.unwrap_or_default(), report))
}
