//! `flashgrpo forward`: the logits and last hidden states of a Hugging Face Qwen2 directory on
//! given token ids, so that anyone can check our loader and model against transformers.

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor};
use flashgrpo_train::model::load_model;

use crate::tensor_io::{expect_shape, write_atomically, Output, TensorFile};

#[derive(Debug, clap::Args)]
pub struct ForwardArgs {
    /// A Hugging Face model directory (config.json, model.safetensors or shards).
    #[arg(long)]
    pub model: PathBuf,
    /// safetensors with `input_ids [B,T]` (i64 / i32) and optional `attention_mask [B,T]` (0/1).
    #[arg(long)]
    pub inputs: PathBuf,
    /// Output safetensors: `logits [B,T,V]` and `hidden_states [B,T,H]` (the last layer's, after the
    /// final norm), f32.
    #[arg(long)]
    pub out: PathBuf,
    /// The dtype to run the model in.
    #[arg(long, default_value = "f32")]
    pub dtype: flashgrpo_kernels::DType,
}

pub fn main(args: ForwardArgs) -> Result<()> {
    let dtype = flashgrpo_train::train_config::parameter_dtype(args.dtype)?;
    let model = load_model(&args.model, Some(dtype))?;
    let file = TensorFile::read(&args.inputs)?;
    let (ids, shape) = file.ids("input_ids", "the token ids [B, T]")?;
    let [b, t] = shape[..] else {
        bail!("`input_ids` has shape {shape:?}; expected [B, T]");
    };
    let vocab = model.config.vocab_size;
    if let Some(i) = ids.iter().position(|&x| x < 0 || x as u64 >= vocab as u64) {
        bail!("input_ids[{}, {}] = {} is outside the vocabulary [0, {vocab})", i / t, i % t, ids[i]);
    }
    if t > model.max_positions() {
        bail!("T = {t} exceeds max_position_embeddings = {}", model.max_positions());
    }
    let mask: Option<Vec<u8>> = match file.mask("attention_mask")? {
        Some((m, s)) => {
            expect_shape("attention_mask", &s, &[b, t], &format!("`input_ids` has shape {shape:?}"))?;
            Some(m.iter().map(|&v| u8::from(v != 0.0)).collect())
        }
        None => None,
    };
    let ids = Tensor::from_vec(ids.iter().map(|&x| x as u32).collect::<Vec<u32>>(), (b, t), &Device::Cpu)?;
    let hidden = model.hidden_states(&ids, mask.as_deref(), false).context("the model's forward")?;
    let logits: Vec<f32> = model.logits(&hidden)?.flatten_all()?.to_vec1()?;
    let hidden: Vec<f32> = hidden.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?;
    let h = model.config.hidden_size;
    write_atomically(
        &args.out,
        &[Output::f32("logits", vec![b, t, vocab], &logits), Output::f32("hidden_states", vec![b, t, h], &hidden)],
    )
}
