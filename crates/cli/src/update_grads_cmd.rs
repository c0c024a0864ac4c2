//! `flashgrpo update-grads`: the loss and every parameter's gradient of one GRPO update of a
//! Hugging Face Qwen2 directory on a given rollout batch, laid out as TRL lays it out, through the
//! trainer's own update (micro-batches, whole-batch normalisers, the engine, the head's loss) but
//! without the optimiser step. The trainer-level oracle (tests/peers/trl_oracle.py) compares it with
//! TRL's `GRPOTrainer.compute_loss` on the same weights and batch.

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use flashgrpo_train::grpo::update::{batch_gradients, Objective, UpdateBatch, UpdateInputs};
use flashgrpo_train::model::load_model;
use flashgrpo_train::LossConfig;
use serde_json::Value;

use crate::config::{load_tree, Source};
use crate::tensor_io::{expect_shape, write_atomically, Output, TensorFile};

#[derive(Debug, clap::Args)]
pub struct UpdateGradsArgs {
    /// A Hugging Face Qwen2 directory.
    #[arg(long)]
    pub model: PathBuf,
    /// safetensors: `prompt_ids [B,P]` and `prompt_mask [B,P]` (left-padded), `completion_ids [B,C]`
    /// and `completion_mask [B,C]` (right-padded: each row's ones come first), `advantages [B]`,
    /// and, optional, `old_per_token_logps [B,C]` and `ref_per_token_logps [B,C]` (f32).
    #[arg(long)]
    pub batch: PathBuf,
    /// Output safetensors: `loss` and one f32 gradient per parameter, under Hugging Face's names.
    #[arg(long)]
    pub out: PathBuf,
    /// Sequences per micro-batch (default: the whole batch).
    #[arg(long)]
    pub micro_batch_size: Option<usize>,
    /// Loss options and `impl` as in a training config's `loss:` section: `--set loss_type=bnpo
    /// --set beta=0.04 --set max_completion_length=16`.
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub sets: Vec<String>,
}

/// The rows of a `[B, W]` id tensor where `mask` is 1, checking that the ones form one run
/// (`left`: at the end of the row, else at its start).
fn rows(name: &str, ids: &[i64], mask: &[f32], width: usize, left: bool, vocab: usize) -> Result<Vec<Vec<u32>>> {
    ids.chunks(width)
        .zip(mask.chunks(width))
        .enumerate()
        .map(|(r, (ids, mask))| {
            let ones = mask.iter().filter(|&&m| m != 0.0).count();
            let run = if left { width - ones..width } else { 0..ones };
            if ones == 0 || mask.iter().enumerate().any(|(j, &m)| (m != 0.0) != run.contains(&j)) {
                bail!(
                    "{name} row {r}: the mask must hold at least one 1, all {} (a {}-padded row)",
                    if left { "at the end" } else { "at the start" },
                    if left { "left" } else { "right" }
                );
            }
            ids[run]
                .iter()
                .map(|&t| {
                    u32::try_from(t)
                        .ok()
                        .filter(|&t| (t as usize) < vocab)
                        .with_context(|| format!("{name} row {r} holds token {t}, outside the vocabulary [0, {vocab})"))
                })
                .collect()
        })
        .collect()
}

pub fn main(args: UpdateGradsArgs) -> Result<()> {
    let model = load_model(&args.model, None)?;
    let vocab = model.config.vocab_size;
    let file = TensorFile::read(&args.batch)?;
    let (prompt_ids, ps) = file.ids("prompt_ids", "the prompts [B, P], left-padded")?;
    let (completion_ids, cs) = file.ids("completion_ids", "the completions [B, C], right-padded")?;
    let [b, p] = ps[..] else { bail!("`prompt_ids` has shape {ps:?}; expected [B, P]") };
    let [_, c] = cs[..] else { bail!("`completion_ids` has shape {cs:?}; expected [B, C]") };
    expect_shape("completion_ids", &cs, &[b, c], "`prompt_ids` has B rows")?;
    if b == 0 || p == 0 || c == 0 {
        bail!("the batch is empty: prompt_ids {ps:?}, completion_ids {cs:?} (every dimension must be positive)");
    }
    let mask = |name: &str, shape: &[usize]| -> Result<Vec<f32>> {
        let (m, s) = file.mask(name)?.with_context(|| format!("the batch has no `{name}`"))?;
        expect_shape(name, &s, shape, "it masks the ids beside it")?;
        Ok(m)
    };
    let prompts = rows("prompt_ids", &prompt_ids, &mask("prompt_mask", &[b, p])?, p, true, vocab)?;
    let completions = rows("completion_ids", &completion_ids, &mask("completion_mask", &[b, c])?, c, false, vocab)?;
    let (advantages, s) = file.floats("advantages")?.context("the batch has no `advantages [B]`")?;
    expect_shape("advantages", &s, &[b], "one per sequence")?;
    let per_sequence = |name: &str| -> Result<Option<Vec<Vec<f32>>>> {
        let Some((v, s)) = file.floats(name)? else { return Ok(None) };
        expect_shape(name, &s, &[b, c], "one per completion position")?;
        Ok(Some(v.chunks(c).map(<[f32]>::to_vec).collect()))
    };
    let (old, reference) = (per_sequence("old_per_token_logps")?, per_sequence("ref_per_token_logps")?);

    let (map, origin) = load_tree(Source::Defaults, &args.sets)?;
    let loss: LossConfig =
        serde_json::from_value(Value::Object(map)).with_context(|| format!("bad loss setting in {origin}"))?;
    let mut options = loss.options.clone();
    options.max_completion_length.get_or_insert(c);
    if options.beta != 0.0 && reference.is_none() {
        bail!("beta = {} needs `ref_per_token_logps [B, C]` in the batch", options.beta);
    }
    let batch = UpdateBatch::new(&prompts, &completions, args.micro_batch_size.unwrap_or(b), 0)?;
    let advantages: Vec<f64> = advantages.iter().map(|&a| a as f64).collect();
    let objective = Objective::Grpo {
        advantages: &advantages,
        old_logp: old.map(|o| batch.per_micro_batch(&o)),
        ref_logp: reference.map(|r| batch.per_micro_batch(&r)),
        sampling_logp: None,
    };
    let inputs = UpdateInputs { batch: &batch, objective, options: &options, loss: &loss, recorded_logp: None };
    let (value, grads) = batch_gradients(&model, &inputs)?;
    let mut outputs = vec![Output::f32("loss", vec![1], &[value as f32])];
    for (i, (name, var)) in model.params.iter().enumerate() {
        outputs.push(Output::f32(name, var.dims().to_vec(), grads.get(i)));
    }
    write_atomically(&args.out, &outputs)?;
    println!("loss {value:.9e}; {} gradients in {}", model.params.len(), args.out.display());
    Ok(())
}
