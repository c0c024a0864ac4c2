//! `flashgrpo loss`: the interop contract. Named tensors in, named tensors out, every option of
//! LOSSES.md settable with `--set`, so any tool (and our own cross-checks) can call the kernels.

use std::path::PathBuf;

use anyhow::{Context, Result};

use crate::batch::{Batch, OpName};
use crate::config::{self, NoKeys};
use crate::run::{run, Impl, Results};
use crate::tensor_io::{write_atomically, Output, TensorFile};

#[derive(Debug, clap::Args)]
pub struct LossArgs {
    /// Which loss.
    #[arg(long, value_enum)]
    pub op: OpName,
    /// safetensors file with `logits [B,T,V]`, `targets [B,T]`, optional `mask [B,T]`, and for
    /// GRPO `advantages [B]`, optional `old_logp`, `ref_logp`, `is_ratio`.
    #[arg(long)]
    pub inputs: PathBuf,
    /// Output safetensors file: loss, per_token_loss, logp, entropy, (GRPO) kl, is_clipped, grad_logits.
    #[arg(long)]
    pub out: PathBuf,
    #[arg(long = "impl", value_enum, default_value_t = Impl::Fused)]
    pub implementation: Impl,
    /// A loss option of LOSSES.md, e.g. `--set beta=0.04 --set loss_type=grpo`.
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub sets: Vec<String>,
}

pub fn main(args: LossArgs) -> Result<()> {
    let options = config::load::<NoKeys, NoKeys>(config::Source::Defaults, &args.sets)?.options;
    let file = TensorFile::read(&args.inputs)?;
    let batch = Batch::read(&file, args.op).with_context(|| format!("in {}", args.inputs.display()))?;
    drop(file);
    let results = run(&batch, &options, args.implementation)?;
    write_atomically(&args.out, &outputs(&batch, results))?;
    Ok(())
}

fn outputs(batch: &Batch, results: Results) -> Vec<Output> {
    let bt = vec![batch.batch, batch.seq_len];
    let r = &results.output;
    let mut out = vec![
        Output::f32("loss", vec![], &[r.loss as f32]),
        Output::f32("per_token_loss", bt.clone(), &r.per_token_loss),
        Output::f32("entropy", bt.clone(), &r.entropy),
    ];
    for (name, values) in [("logp", &r.logp), ("kl", &r.kl), ("is_clipped", &r.is_clipped)] {
        if let Some(v) = values {
            out.push(Output::f32(name, bt.clone(), v));
        }
    }
    if let Some(g) = &results.grad {
        out.push(Output::logits_like("grad_logits", vec![batch.batch, batch.seq_len, batch.vocab], g));
    }
    out
}
