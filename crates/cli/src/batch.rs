//! The inputs of one loss call, owned, read from named tensors (the interop contract of
//! `flashgrpo loss`) or generated, with every shape checked against the logits'.

use anyhow::{bail, Result};
use clap::builder::{PossibleValue, PossibleValuesParser, TypedValueParser};
use flashgrpo_kernels::{CrossEntropyInputs, IsRatio, Loss, LossOptions, LossSpec, Op, PolicyInputs, Rows};

use crate::tensor_io::{expect_shape, FloatData, TensorFile};

/// `--op NAME`: the kernels' [`Op`] by name (`cross-entropy` accepted for `cross_entropy`), with
/// the names listed in `--help`.
pub fn op_parser() -> impl TypedValueParser<Value = Op> {
    let mut names: Vec<PossibleValue> = Op::ALL.iter().map(|op| PossibleValue::new(op.name())).collect();
    names.push(PossibleValue::new("cross-entropy").hide(true));
    PossibleValuesParser::new(names).map(|name| name.parse::<Op>().expect("one of the possible values"))
}

/// Every tensor name `flashgrpo loss` reads; others are reported and ignored.
pub const INPUT_NAMES: &[&str] = &[
    "logits",
    "hidden",
    "weight",
    "bias",
    "targets",
    "mask",
    "advantages",
    "old_logp",
    "ref_logp",
    "is_ratio",
    "sampling_logp",
    "class_weights",
];

/// What the loss is computed on: the logits, or the hidden states and lm_head they come from.
pub enum Scores {
    /// `[B, T, V]`.
    Logits(FloatData),
    Linear(LinearData),
}

/// `logits = hidden @ weight^T (+ bias)`, all of one dtype.
pub struct LinearData {
    /// `[B, T, H]`.
    pub hidden: FloatData,
    /// `[V, H]`.
    pub weight: FloatData,
    /// `[V]`.
    pub bias: Option<FloatData>,
    pub hidden_size: usize,
}

impl Scores {
    /// The dtype of the logits, or of the hidden states.
    pub fn dtype(&self) -> safetensors::Dtype {
        match self {
            Scores::Logits(l) => l.dtype(),
            Scores::Linear(l) => l.hidden.dtype(),
        }
    }

    /// The kernels' name for that dtype.
    pub fn element_dtype(&self) -> flashgrpo_kernels::DType {
        match self {
            Scores::Logits(l) => l.element_dtype(),
            Scores::Linear(l) => l.hidden.element_dtype(),
        }
    }

    /// Bytes of the inputs the loss reads.
    pub fn size_in_bytes(&self) -> usize {
        match self {
            Scores::Logits(l) => l.size_in_bytes(),
            Scores::Linear(l) => {
                l.hidden.size_in_bytes()
                    + l.weight.size_in_bytes()
                    + l.bias.as_ref().map_or(0, FloatData::size_in_bytes)
            }
        }
    }
}

/// Owned inputs; [`Batch::spec`] borrows them for the kernels.
pub struct Batch {
    pub op: Op,
    pub scores: Scores,
    pub batch: usize,
    pub seq_len: usize,
    pub vocab: usize,
    pub targets: Option<Vec<i64>>,
    pub mask: Option<Vec<f32>>,
    pub advantages: Vec<f32>,
    pub old_logp: Option<Vec<f32>>,
    pub ref_logp: Option<Vec<f32>>,
    pub is_ratio: Option<(Vec<f32>, bool)>,
    /// The sampler's per-token log-probabilities (TRL's `sampling_per_token_logps`).
    pub sampling_logp: Option<Vec<f32>>,
    /// Cross-entropy: `[V]` class weights.
    pub class_weights: Option<Vec<f32>>,
}

impl Batch {
    /// Reads the inputs of `op` from `file`, checking each shape against the logits'.
    pub fn read(file: &TensorFile, op: Op) -> Result<Self> {
        for name in file.names() {
            if !INPUT_NAMES.contains(&name.as_str()) {
                eprintln!(
                    "warning: ignoring tensor `{name}`: not an input of `flashgrpo loss` (inputs: {})",
                    INPUT_NAMES.join(", ")
                );
            }
        }
        let (scores, [batch, seq_len, vocab], per_row) = read_scores(file)?;
        let bt = [batch, seq_len];
        let mut b = Batch {
            op,
            scores,
            batch,
            seq_len,
            vocab,
            targets: None,
            mask: None,
            advantages: Vec::new(),
            old_logp: None,
            ref_logp: None,
            is_ratio: None,
            sampling_logp: None,
            class_weights: None,
        };
        if op != Op::Entropy || file.shape("targets").is_some() {
            let (targets, s) = file.ids("targets", "the chosen token of each row, [B, T]")?;
            expect_shape("targets", &s, &bt, &per_row)?;
            b.targets = Some(targets);
        }
        if let Some((mask, s)) = file.mask("mask")? {
            expect_shape("mask", &s, &bt, &per_row)?;
            b.mask = Some(mask);
        }
        b.class_weights = read_class_weights(file, op, vocab, &per_row)?;
        if op == Op::Grpo {
            let Some((adv, s)) = file.floats("advantages")? else {
                bail!("missing tensor `advantages` (GRPO needs one advantage per sequence, [B] = [{batch}]); it holds: {}", file.names().join(", "));
            };
            if s != [batch] && s != [batch, 1] {
                expect_shape("advantages", &s, &[batch], &format!("{per_row} (one advantage per sequence)"))?;
            }
            b.advantages = adv;
            for (name, slot) in
                [("old_logp", &mut b.old_logp), ("ref_logp", &mut b.ref_logp), ("sampling_logp", &mut b.sampling_logp)]
            {
                if let Some((v, s)) = file.floats(name)? {
                    expect_shape(name, &s, &bt, &per_row)?;
                    *slot = Some(v);
                }
            }
            if let Some((v, s)) = file.floats("is_ratio")? {
                let per_sequence = s == [batch] || s == [batch, 1];
                if !per_sequence {
                    expect_shape("is_ratio", &s, &bt, &format!("{per_row} (or [B] = [{batch}] per sequence)"))?;
                }
                b.is_ratio = Some((v, per_sequence));
            }
        }
        Ok(b)
    }

    pub fn spec<'a>(&'a self, options: &'a LossOptions) -> LossSpec<'a> {
        let policy = (self.op == Op::Grpo).then(|| PolicyInputs {
            advantages: &self.advantages,
            old_logp: self.old_logp.as_deref(),
            ref_logp: self.ref_logp.as_deref(),
            is_ratio: self.is_ratio.as_ref().map(|(v, per_sequence)| {
                if *per_sequence {
                    IsRatio::PerSequence(v)
                } else {
                    IsRatio::PerToken(v)
                }
            }),
            sampling_logp: self.sampling_logp.as_deref(),
        });
        let loss = match self.op.loss(policy).expect("a grpo batch has its advantages") {
            Loss::CrossEntropy(_) => {
                Loss::CrossEntropy(CrossEntropyInputs { class_weights: self.class_weights.as_deref() })
            }
            loss => loss,
        };
        LossSpec {
            loss,
            rows: Rows {
                batch: self.batch,
                seq_len: self.seq_len,
                vocab: self.vocab,
                targets: self.targets.as_deref(),
                mask: self.mask.as_deref(),
            },
            options,
            batch_shard: None,
        }
    }
}

/// `class_weights [V]`, cross-entropy's only.
pub fn read_class_weights(file: &TensorFile, op: Op, vocab: usize, per_row: &str) -> Result<Option<Vec<f32>>> {
    let Some((c, s)) = file.floats("class_weights")? else { return Ok(None) };
    if op != Op::CrossEntropy {
        bail!("`class_weights` weighs cross-entropy's classes; the `{}` op takes none", op.name());
    }
    expect_shape("class_weights", &s, &[vocab], &format!("{per_row} (one weight per class)"))?;
    Ok(Some(c))
}

/// Reads `logits [B,T,V]`, or `hidden [B,T,H]` + `weight [V,H]` (+ `bias [V]`): the scores, the
/// shape `[B, T, V]`, and how to name it in shape errors.
fn read_scores(file: &TensorFile) -> Result<(Scores, [usize; 3], String)> {
    let has = |name: &str| file.shape(name).is_some();
    if has("logits") {
        if has("hidden") || has("weight") {
            bail!("give either `logits` or `hidden` and `weight`, not both");
        }
        let (logits, shape) = file.float_tensor("logits")?;
        let [b, t, v] = shape[..] else {
            bail!("`logits` has shape {shape:?}; expected three dimensions [B, T, V]");
        };
        return Ok((Scores::Logits(logits), [b, t, v], format!("`logits` has shape {shape:?}")));
    }
    if !has("hidden") {
        bail!("missing tensor `logits` (or `hidden` and `weight`); it holds: {}", file.names().join(", "));
    }
    let (hidden, hs) = file.float_tensor("hidden")?;
    let [b, t, h] = hs[..] else {
        bail!("`hidden` has shape {hs:?}; expected three dimensions [B, T, H]");
    };
    let (weight, ws) = file.float_tensor("weight")?;
    let [v, wh] = ws[..] else {
        bail!("`weight` has shape {ws:?}; expected two dimensions [V, H] (the lm_head layout)");
    };
    if wh != h {
        bail!(
            "shape mismatch: `weight` has shape {ws:?} but `hidden` has shape {hs:?}: both must end in the hidden size"
        );
    }
    if weight.dtype() != hidden.dtype() {
        bail!("`weight` is {:?} but `hidden` is {:?}: give them one dtype", weight.dtype(), hidden.dtype());
    }
    let bias = match file.shape("bias") {
        None => None,
        Some(bs) => {
            expect_shape("bias", &bs, &[v], &format!("`weight` has shape {ws:?}"))?;
            let (bias, _) = file.float_tensor("bias")?;
            if bias.dtype() != hidden.dtype() {
                bail!("`bias` is {:?} but `hidden` is {:?}: give them one dtype", bias.dtype(), hidden.dtype());
            }
            Some(bias)
        }
    };
    let scores = Scores::Linear(LinearData { hidden, weight, bias, hidden_size: h });
    Ok((scores, [b, t, v], format!("`hidden` has shape {hs:?}")))
}
