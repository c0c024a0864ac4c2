//! What a loss is computed on, besides the logits: shapes, targets, mask and the GRPO inputs,
//! and the checks every implementation runs before touching the logits.

use crate::error::LossError;
use crate::options::{LossOptions, LossType};

/// Shapes and per-row inputs shared by every op. Row `i = b * seq_len + t` is one token.
#[derive(Debug, Clone, Copy)]
pub struct Rows<'a> {
    pub batch: usize,
    pub seq_len: usize,
    /// The full vocabulary, also when the logits at hand are one vocabulary shard.
    pub vocab: usize,
    /// `[B*T]` chosen / label token of each row. Required by every op but `entropy`.
    pub targets: Option<&'a [i64]>,
    /// `[B*T]` 0/1; `None` means all ones.
    pub mask: Option<&'a [f32]>,
}

impl Rows<'_> {
    pub fn len(&self) -> usize {
        self.batch * self.seq_len
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// `(b, t)` of row `i`.
    pub fn position(&self, row: usize) -> (usize, usize) {
        (row / self.seq_len.max(1), row % self.seq_len.max(1))
    }
}

/// Rollout-engine importance weights (TRL's `vllm_is_ratio`), per token or per sequence.
#[derive(Debug, Clone, Copy)]
pub enum IsRatio<'a> {
    PerToken(&'a [f32]),
    PerSequence(&'a [f32]),
}

impl IsRatio<'_> {
    pub fn at(&self, row: usize, seq_len: usize) -> f32 {
        match self {
            IsRatio::PerToken(v) => v[row],
            IsRatio::PerSequence(v) => v[row / seq_len],
        }
    }
}

/// The GRPO-only inputs.
#[derive(Debug, Clone, Copy)]
pub struct PolicyInputs<'a> {
    /// `[B]`, one per sequence.
    pub advantages: &'a [f32],
    /// `[B*T]`; `None` means on-policy (`old = stop_grad(logp)`).
    pub old_logp: Option<&'a [f32]>,
    /// `[B*T]`; required when `beta != 0`.
    pub ref_logp: Option<&'a [f32]>,
    pub is_ratio: Option<IsRatio<'a>>,
    /// `[B*T]`: the sampler's own log-probabilities of the chosen tokens (TRL's
    /// `sampling_per_token_logps`), for rollout correction and the off-policy mask. NaN marks a
    /// token the sampler could not score (its log-ratio counts as 0, as in TRL).
    pub sampling_logp: Option<&'a [f32]>,
}

impl<'a> PolicyInputs<'a> {
    /// Advantages only: on-policy, no reference, no correction.
    pub fn new(advantages: &'a [f32]) -> Self {
        Self { advantages, old_logp: None, ref_logp: None, is_ratio: None, sampling_logp: None }
    }
}

/// The cross-entropy-only inputs.
#[derive(Debug, Clone, Copy, Default)]
pub struct CrossEntropyInputs<'a> {
    /// `[V]`: a weight per class (PyTorch's and Liger's `weight`, Liger's `ce_weight`). A row
    /// weighs `c[y]`, and label smoothing's uniform target becomes `c_j / V`; `mean` divides by
    /// the rows' summed `c[y]` (LOSSES.md, "Class weights").
    pub class_weights: Option<&'a [f32]>,
}

/// The ops of LOSSES.md, by name: what every front end (CLI, candle, Python) parses an op into
/// before it gathers the op's inputs into a [`Loss`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Op {
    #[default]
    Grpo,
    #[serde(alias = "cross-entropy")]
    CrossEntropy,
    Entropy,
    Logprob,
}

impl Op {
    pub const ALL: [Op; 4] = [Op::Grpo, Op::CrossEntropy, Op::Entropy, Op::Logprob];

    pub fn name(self) -> &'static str {
        match self {
            Op::Grpo => "grpo",
            Op::CrossEntropy => "cross_entropy",
            Op::Entropy => "entropy",
            Op::Logprob => "logprob",
        }
    }

    /// Whether the op has a gradient output: every op but entropy, and entropy with
    /// `options.entropy_gradient`. The one rule of every front end.
    pub fn has_gradient(self, options: &LossOptions) -> bool {
        self != Op::Entropy || options.entropy_gradient
    }

    /// The [`Loss`] of this op; `policy` is read by `grpo` only, which requires it.
    pub fn loss<'a>(self, policy: Option<PolicyInputs<'a>>) -> Result<Loss<'a>, crate::LossError> {
        Ok(match self {
            Op::Grpo => Loss::Grpo(policy.ok_or_else(|| crate::LossError::MissingInput {
                tensor: "advantages",
                why: "the grpo op needs one advantage per sequence".into(),
            })?),
            Op::CrossEntropy => Loss::CrossEntropy(CrossEntropyInputs::default()),
            Op::Entropy => Loss::Entropy,
            Op::Logprob => Loss::Logprob,
        })
    }
}

impl std::str::FromStr for Op {
    type Err = crate::LossError;

    /// The names of [`Op::name`]; `cross-entropy` is accepted too.
    fn from_str(name: &str) -> Result<Self, Self::Err> {
        let wanted = name.replace('-', "_");
        Op::ALL.into_iter().find(|op| op.name() == wanted).ok_or(crate::LossError::UnknownOp { name: name.into() })
    }
}

/// Which loss, with the inputs only it needs.
#[derive(Debug, Clone, Copy)]
pub enum Loss<'a> {
    Grpo(PolicyInputs<'a>),
    CrossEntropy(CrossEntropyInputs<'a>),
    /// `loss` is the mean entropy over unmasked rows; no gradient unless `entropy_gradient`.
    Entropy,
    /// `loss = sum(mask * logp)`, whose gradient this op returns.
    Logprob,
}

impl Loss<'_> {
    pub fn name(&self) -> &'static str {
        self.op().name()
    }

    pub fn op(&self) -> Op {
        match self {
            Loss::Grpo(_) => Op::Grpo,
            Loss::CrossEntropy(_) => Op::CrossEntropy,
            Loss::Entropy => Op::Entropy,
            Loss::Logprob => Op::Logprob,
        }
    }

    /// Whether the op has a gradient output ([`Op::has_gradient`]).
    pub fn has_gradient(&self, options: &LossOptions) -> bool {
        self.op().has_gradient(options)
    }

    /// Cross-entropy's class weights, when given.
    pub fn class_weights(&self) -> Option<&[f32]> {
        match self {
            Loss::CrossEntropy(inputs) => inputs.class_weights,
            _ => None,
        }
    }
}

/// Normalisers for data parallelism: when the batch is split over devices, each shard reduces
/// its rows with the global counts, so that the shard losses and gradients sum to the
/// unsharded ones (LOSSES.md, Sharding).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BatchShard {
    /// Sequences in the whole batch (the `B` of `grpo`, `sapo` and `dr_grpo`).
    pub global_batch: usize,
    /// Unmasked rows in the whole batch (`bnpo`, cross-entropy `mean`, and `dapo`/`cispo` unless
    /// `num_items` is set, in which case `num_items` is taken as the global count).
    pub global_valid_rows: f64,
    /// With `top_entropy_quantile < 1`: the entropy threshold computed over the whole batch
    /// (every shard's unmasked rows); `None` computes it from this shard's rows.
    pub entropy_threshold: Option<f64>,
    /// With `entropy_bonus: masked_mean`: the number of rows the bonus averages over in the whole
    /// batch (unmasked rows at or above the entropy threshold); `None` counts this shard's rows.
    pub global_bonus_rows: Option<f64>,
    /// Sequences with at least one unmasked row in the whole batch (verl's `seq-mean-*`
    /// reductions average over them); `None` takes `global_batch`, right when no sequence is
    /// empty.
    pub global_sequences_with_tokens: Option<f64>,
    /// Cross-entropy with class weights `c`: the summed `c[y]` of the whole batch's counted rows,
    /// which `mean` divides by (required there: [`crate::PreparedLoss::new`] refuses a shard
    /// without it); ignored without class weights.
    pub global_target_weight: Option<f64>,
}

impl BatchShard {
    /// A shard with the batch's sequence and row counts and nothing else global.
    pub fn counts(global_batch: usize, global_valid_rows: f64) -> Self {
        Self {
            global_batch,
            global_valid_rows,
            entropy_threshold: None,
            global_bonus_rows: None,
            global_sequences_with_tokens: None,
            global_target_weight: None,
        }
    }
}

/// The normalisers a reduction divides by, resolved from the shard (if any) or the local rows.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Normalisers {
    pub batch: f64,
    pub valid_rows: f64,
    /// Sequences with at least one unmasked row.
    pub sequences_with_tokens: f64,
    pub num_items: f64,
    pub max_completion_length: f64,
    /// The summed class weight of the counted rows' targets (`valid_rows` without class weights).
    pub target_weight: f64,
}

impl Normalisers {
    pub fn resolve(
        loss: &Loss,
        rows: &Rows,
        active: &[bool],
        options: &LossOptions,
        shard: Option<BatchShard>,
    ) -> Self {
        let t = rows.seq_len.max(1);
        let (batch, valid_rows, sequences_with_tokens) = match shard {
            Some(s) => (
                s.global_batch as f64,
                s.global_valid_rows,
                s.global_sequences_with_tokens.unwrap_or(s.global_batch as f64),
            ),
            None => (
                rows.batch as f64,
                active.iter().filter(|&&a| a).count() as f64,
                active.chunks(t).filter(|seq| seq.iter().any(|&a| a)).count() as f64,
            ),
        };
        let target_weight = match (shard.and_then(|s| s.global_target_weight), loss.class_weights(), rows.targets) {
            (Some(global), Some(_), _) => global,
            (None, Some(c), Some(y)) => {
                let weights = y.iter().zip(active).filter(|(_, &a)| a).map(|(&y, _)| c[y as usize] as f64);
                weights.fold(0.0, |acc, w| acc + w)
            }
            _ => valid_rows,
        };
        Self {
            batch,
            valid_rows,
            sequences_with_tokens,
            num_items: options.num_items.unwrap_or(valid_rows),
            max_completion_length: options.max_completion_length.unwrap_or(rows.seq_len) as f64,
            target_weight,
        }
    }
}

/// Checks lengths, mask values, targets and GRPO inputs, and returns which rows take part
/// (mask is 1 and, for cross-entropy, the target is not `ignore_index`).
/// Runs in O(N); the logits themselves (length, NaN, Inf) are checked by the statistics pass.
pub fn validate(loss: &Loss, rows: &Rows, options: &LossOptions) -> Result<Vec<bool>, LossError> {
    options.validate()?;
    let n = rows.len();
    let bt = || format!("[B*T] = [{}] elements (B = {}, T = {})", n, rows.batch, rows.seq_len);
    let expect_len = |tensor: &'static str, got: usize, want: usize, expected: String| {
        if got == want {
            Ok(())
        } else {
            Err(LossError::Shape { tensor, got: vec![got], expected })
        }
    };
    if rows.vocab == 0 {
        return Err(LossError::Shape {
            tensor: "logits",
            got: vec![rows.batch, rows.seq_len, 0],
            expected: "the vocabulary must have at least one entry".into(),
        });
    }
    if let Some(m) = rows.mask {
        expect_len("mask", m.len(), n, format!("it must hold {}", bt()))?;
        if let Some(row) = first_bad(m, m, |v, _| v != 0.0 && v != 1.0) {
            let (b, t) = rows.position(row);
            return Err(LossError::MaskValue { row, b, t, value: m[row] });
        }
    }
    if options.entropy_gradient && !matches!(loss, Loss::Entropy) {
        return Err(LossError::InvalidOption {
            name: "entropy_gradient",
            message: format!("applies to the entropy op only; the `{}` op has its own gradient", loss.name()),
        });
    }
    let needs_targets = !matches!(loss, Loss::Entropy);
    match rows.targets {
        Some(t) => expect_len("targets", t.len(), n, format!("it must hold {}", bt()))?,
        None if needs_targets => {
            return Err(LossError::MissingInput {
                tensor: "targets",
                why: format!("the `{}` op needs the chosen token of every row", loss.name()),
            })
        }
        None => {}
    }

    let mut active: Vec<bool> = match rows.mask {
        Some(m) => m.iter().map(|&v| v != 0.0).collect(),
        None => vec![true; n],
    };
    if let Some(c) = loss.class_weights() {
        validate_class_weights(c, rows.vocab)?;
    }
    if let (Loss::CrossEntropy(_), Some(targets)) = (loss, rows.targets) {
        for (a, &y) in active.iter_mut().zip(targets) {
            *a &= y != options.ignore_index;
        }
    }
    if needs_targets {
        let targets = rows.targets.unwrap_or_default();
        let vocab = rows.vocab as u64;
        if let Some(row) = first_bad(targets, &active, |y, a| a & (y as u64 >= vocab)) {
            let (b, t) = rows.position(row);
            return Err(LossError::TargetOutOfRange { row, b, t, value: targets[row], vocab: rows.vocab });
        }
    }

    if let Loss::Grpo(p) = loss {
        validate_policy_inputs(p, rows, options, &active)?;
    }
    Ok(active)
}

/// `[V]` finite weights: the reduction and the smoothing term sum them.
fn validate_class_weights(c: &[f32], vocab: usize) -> Result<(), LossError> {
    if c.len() != vocab {
        return Err(LossError::Shape {
            tensor: "class_weights",
            got: vec![c.len()],
            expected: format!("one weight per class of the vocabulary, [V] = [{vocab}]"),
        });
    }
    match c.iter().position(|w| !w.is_finite()) {
        Some(j) => Err(LossError::InvalidOption {
            name: "class_weights",
            message: format!("the weight of class {j} is {}; every class weight must be finite", c[j]),
        }),
        None => Ok(()),
    }
}

/// The policy's per-sequence and per-token inputs: shapes against `rows`, finite where a row is
/// active, and the combinations the options refuse. Checked in this order: advantages,
/// `old_logp`, `sampling_logp`, `ref_logp`, `is_ratio`.
fn validate_policy_inputs(
    p: &PolicyInputs,
    rows: &Rows,
    options: &LossOptions,
    active: &[bool],
) -> Result<(), LossError> {
    validate_advantages(p.advantages, rows, active)?;
    if let Some(old) = p.old_logp {
        validate_per_token("old_logp", old, rows, active)?;
    }
    if let Some(sampling) = p.sampling_logp {
        validate_sampling_logp(sampling, p.is_ratio.is_some(), rows, options, active)?;
    }
    match p.ref_logp {
        Some(r) => validate_per_token("ref_logp", r, rows, active)?,
        None if options.beta != 0.0 => {
            return Err(LossError::MissingInput {
                tensor: "ref_logp",
                why: format!(
                    "beta = {} weights a KL penalty against the reference policy; pass `ref_logp` or set beta = 0",
                    options.beta
                ),
            })
        }
        None => {}
    }
    match p.is_ratio {
        Some(IsRatio::PerToken(v)) => validate_per_token("is_ratio", v, rows, active),
        Some(IsRatio::PerSequence(v)) => validate_sequence_is_ratio(v, rows, active),
        None => Ok(()),
    }
}

/// A `[B, T]` input like `targets`, finite on every active row.
fn validate_per_token(tensor: &'static str, v: &[f32], rows: &Rows, active: &[bool]) -> Result<(), LossError> {
    if v.len() != rows.len() {
        return Err(LossError::Shape {
            tensor,
            got: vec![v.len()],
            expected: format!("it must be [B, T] = [{}, {}] like `targets`", rows.batch, rows.seq_len),
        });
    }
    check_finite(tensor, v, rows, active)
}

/// `[B]` advantages, finite for every sequence with an active row.
fn validate_advantages(advantages: &[f32], rows: &Rows, active: &[bool]) -> Result<(), LossError> {
    if advantages.len() != rows.batch {
        return Err(LossError::Shape {
            tensor: "advantages",
            got: vec![advantages.len()],
            expected: format!("it must be [B] = [{}], one per sequence of `logits`", rows.batch),
        });
    }
    for (b, &a) in advantages.iter().enumerate() {
        if !a.is_finite() && (0..rows.seq_len).any(|t| active[b * rows.seq_len + t]) {
            return Err(LossError::NonFiniteInput { tensor: "advantages", row: b * rows.seq_len, b, t: 0, value: a });
        }
    }
    Ok(())
}

/// The sampler's `[B, T]` log-probabilities: NaN allowed (a token it could not score, as TRL
/// has it), an infinity not; and what the rollout correction refuses beside them.
fn validate_sampling_logp(
    sampling: &[f32],
    has_is_ratio: bool,
    rows: &Rows,
    options: &LossOptions,
    active: &[bool],
) -> Result<(), LossError> {
    if sampling.len() != rows.len() {
        return Err(LossError::Shape {
            tensor: "sampling_logp",
            got: vec![sampling.len()],
            expected: format!("it must be [B, T] = [{}, {}] like `targets`", rows.batch, rows.seq_len),
        });
    }
    // NaN marks a token the sampler could not score (TRL); an infinity is a bug upstream.
    if let Some(row) = sampling.iter().zip(active).position(|(x, &a)| a && x.is_infinite()) {
        let (b, t) = rows.position(row);
        return Err(LossError::NonFiniteInput { tensor: "sampling_logp", row, b, t, value: sampling[row] });
    }
    let corrects = options.vllm_importance_sampling_correction;
    if corrects && has_is_ratio {
        return Err(LossError::ConflictingInputs {
            tensor: "is_ratio",
            other: "sampling_logp",
            why: "with vllm_importance_sampling_correction = true the correction computes is_ratio from \
                  sampling_logp; pass one of them, or set the correction to false"
                .into(),
        });
    }
    if corrects && options.loss_type == LossType::Vespo && options.vllm_importance_sampling_mode.per_sequence() {
        return Err(LossError::InvalidOption {
            name: "vllm_importance_sampling_mode",
            message: "vespo needs a token-level correction (token_truncate or token_mask), as in TRL".into(),
        });
    }
    Ok(())
}

/// A `[B]` importance-sampling ratio, one per sequence, finite for every active row.
fn validate_sequence_is_ratio(v: &[f32], rows: &Rows, active: &[bool]) -> Result<(), LossError> {
    if v.len() != rows.batch {
        return Err(LossError::Shape {
            tensor: "is_ratio",
            got: vec![v.len()],
            expected: format!("it must be [B] = [{}] or [B, T] = [{}, {}]", rows.batch, rows.batch, rows.seq_len),
        });
    }
    let expanded: Vec<f32> = (0..rows.len()).map(|i| v[i / rows.seq_len]).collect();
    check_finite("is_ratio", &expanded, rows, active)
}

/// The first index `i` where `bad(xs[i], flags[i])`. The valid case, which every call pays for,
/// runs as a branch-free pass over chunks (it vectorises: ~4x faster than stopping at each element
/// at 32768 rows, time the host spends before a GPU's first pass); the exact index is looked for
/// only inside the first chunk that has one.
fn first_bad<X: Copy, F: Copy>(xs: &[X], flags: &[F], bad: impl Fn(X, F) -> bool) -> Option<usize> {
    const CHUNK: usize = 256;
    xs.chunks(CHUNK).zip(flags.chunks(CHUNK)).enumerate().find_map(|(c, (x, f))| {
        let any = x.iter().zip(f).fold(false, |acc, (&x, &f)| acc | bad(x, f));
        any.then(|| c * CHUNK + x.iter().zip(f).position(|(&x, &f)| bad(x, f)).expect("a bad element"))
    })
}

fn check_finite(tensor: &'static str, v: &[f32], rows: &Rows, active: &[bool]) -> Result<(), LossError> {
    match first_bad(v, active, |x, a| a & !x.is_finite()) {
        Some(row) => {
            let (b, t) = rows.position(row);
            Err(LossError::NonFiniteInput { tensor, row, b, t, value: v[row] })
        }
        None => Ok(()),
    }
}
