//! `flashgrpo loss`: the interop contract. Named tensors in, named tensors out, every option of
//! LOSSES.md settable with `--set`, so any tool (and our own cross-checks) can call the kernels.

use std::path::PathBuf;

use anyhow::{bail, Context, Result};

use crate::batch::{op_parser, Batch};
use crate::config::{self, NoKeys};
use crate::device::Device;
use crate::run::{run_on, Impl, Results};
use crate::tensor_io::{write_atomically, Output, TensorFile};
use crate::vocab_parallel_run::run_vocab_parallel;
use flashgrpo_kernels::{Bf16Choice, ChunkBudget, Op};
use serde::{Deserialize, Serialize};

#[derive(Debug, clap::Args)]
pub struct LossArgs {
    /// Which loss.
    #[arg(long, value_parser = op_parser())]
    pub op: Op,
    /// safetensors file with `logits [B,T,V]` (or `hidden [B,T,H]`, `weight [V,H]`, optional
    /// `bias [V]`), `targets [B,T]`, optional `mask [B,T]`, and for GRPO `advantages [B]`, optional
    /// `old_logp`, `ref_logp`, `is_ratio`.
    #[arg(long)]
    pub inputs: PathBuf,
    /// Output safetensors file: loss, per_token_loss, logp, entropy, (GRPO) kl, is_clipped,
    /// (with `--set predicted_tokens=true`) predicted_tokens (i64, -1 where a row takes no
    /// part), grad_logits (or grad_hidden, grad_weight, grad_bias).
    #[arg(long)]
    pub out: PathBuf,
    #[arg(long = "impl", value_enum, default_value_t = Impl::Fused)]
    pub implementation: Impl,
    /// Where the fused kernels run: `cpu`, or `cuda` (GPU 0; needs a driver and NVRTC at run
    /// time, and cuBLAS for fused-linear).
    #[arg(long, value_enum, default_value_t = Device::Cpu)]
    pub device: Device,
    /// A loss option of LOSSES.md, e.g. `--set beta=0.04 --set loss_type=grpo`, or
    /// `chunk_memory_mb` or `bf16_products` (fused-linear).
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub sets: Vec<String>,
    /// Split the vocabulary over the processes of `mpirun -np K` (logits columns, or lm_head
    /// rows): each rank computes its slice, rank 0 writes the same file as one process
    /// (docs/DISTRIBUTED.md). CPU, `--impl fused`.
    #[arg(long)]
    pub vocab_parallel: bool,
}

/// `flashgrpo loss`'s own keys, besides the loss options.
#[derive(Debug, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
struct LossKeys {
    /// Fused-linear: the memory the streaming may use beyond inputs and gradients, in MiB.
    chunk_memory_mb: usize,
    /// Fused-linear, bf16: the products' way (`auto`, `rounded`, or a way's name). Unset: as
    /// every front end, `rounded` where the gradients are handed back in bf16 (this command
    /// writes them in the inputs' dtype), else `auto` ([`Bf16Choice::default_for`]).
    bf16_products: Option<Bf16Choice>,
}

impl Default for LossKeys {
    fn default() -> Self {
        Self { chunk_memory_mb: ChunkBudget::DEFAULT_MB, bf16_products: None }
    }
}

pub fn main(args: LossArgs) -> Result<()> {
    let loaded = config::load::<LossKeys, NoKeys>(config::Source::Defaults, &args.sets)?;
    let keys = &loaded.command;
    let options = loaded.options;
    let file = TensorFile::read(&args.inputs)?;
    let batch = Batch::read(&file, args.op).with_context(|| format!("in {}", args.inputs.display()))?;
    drop(file);
    let bf16_gradients = batch.scores.dtype() == safetensors::Dtype::BF16;
    let products = keys.bf16_products.unwrap_or_else(|| Bf16Choice::default_for(bf16_gradients));
    let budget = ChunkBudget::from_mb(keys.chunk_memory_mb).with_bf16_products(products);
    if args.vocab_parallel {
        if args.device != Device::Cpu || args.implementation != Impl::Fused {
            bail!("--vocab-parallel runs the fused kernels on the CPU (--impl fused --device cpu)");
        }
        let comm = flashgrpo_collective::from_environment(false)?;
        if comm.is_root() {
            let widest = flashgrpo_collective::share(batch.vocab, comm.size(), 0).len();
            eprintln!(
                "flashgrpo loss: vocabulary of {} over {} ranks (up to {widest} columns each; {})",
                batch.vocab,
                comm.size(),
                comm.describe()
            );
        }
        let results = run_vocab_parallel(comm.as_ref(), &batch, &options, budget)?;
        if comm.is_root() {
            write_atomically(&args.out, &outputs(&batch, results))?;
        }
        comm.barrier()?;
        return Ok(());
    }
    let results = run_on(args.device, &batch, &options, args.implementation, budget)?;
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
    if let Some(p) = &r.predicted {
        out.push(Output::i64("predicted_tokens", bt.clone(), p));
    }
    for g in &results.grads {
        out.push(Output::float(g.name, g.shape.clone(), &g.data));
    }
    out
}
