//! `flashgrpo`: fused loss kernels for RL fine-tuning of language models, from the command line.

mod ab_cmd;
mod baseline;
mod batch;
mod bench;
mod bench_rollout_cmd;
mod bench_trainer_cmd;
mod config;
#[cfg(feature = "cuda")]
mod cuda_check_cmd;
mod device;
mod forward_cmd;
mod generate_cmd;
mod gradcheck;
mod input_spec;
mod loss_cmd;
mod memory;
mod mpi_check_cmd;
mod pass_floor;
mod peers;
mod plot_cmd;
mod run;
mod tensor_io;
mod train_cmd;
mod update_grads_cmd;
mod vocab_parallel_run;

use std::process::ExitCode;

use anyhow::Result;
use clap::{Parser, Subcommand};

/// Counts heap bytes for `flashgrpo bench`'s `mem/peak_bytes`.
#[global_allocator]
static ALLOCATOR: memory::CountingAllocator = memory::CountingAllocator;

#[derive(Debug, Parser)]
#[command(
    name = "flashgrpo",
    version,
    about = "Fused, memory-efficient GRPO / cross-entropy / entropy / log-prob kernels"
)]
struct Cli {
    /// Worker threads (default: one per core).
    #[arg(long, global = true)]
    threads: Option<usize>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Compute a loss, its per-token outputs and its gradient from named tensors.
    Loss(loss_cmd::LossArgs),
    /// Compare the fused kernels with the f64 reference on seeded inputs, with tolerance gates.
    Gradcheck(config::ConfigArgs),
    /// Time forward + backward and measure peak memory (fused, fused-inplace, or the candle baseline).
    Bench(config::ConfigArgs),
    /// Logits and last hidden states of a Hugging Face Qwen2 directory on given token ids.
    Forward(forward_cmd::ForwardArgs),
    /// Train a Qwen2 model with GRPO (default: the built-in arithmetic task, end to end) or SFT.
    Train(train_cmd::TrainArgs),
    /// Completions of a saved model (a run's `model/`, or any Hugging Face Qwen2 directory) by
    /// the trainer's sampler: temperature, top-k, top-p, min-p, repetition penalty.
    Generate(generate_cmd::GenerateArgs),
    /// Draw the plots of a run directory from its metrics.jsonl.
    Plot(plot_cmd::PlotArgs),
    /// The same GRPO run with loss.impl = baseline and fused_linear, side by side.
    Ab(ab_cmd::AbArgs),
    /// The rollout engine's generation beside transformers' generate: tokens/s on one model.
    BenchRollout(bench_rollout_cmd::BenchRolloutArgs),
    /// flashgrpo's GRPO trainer beside TRL's GRPOTrainer: same warm start, task and settings.
    BenchTrainer(bench_trainer_cmd::BenchTrainerArgs),
    /// The loss and every parameter's gradient of one GRPO update on a given rollout batch.
    UpdateGrads(update_grads_cmd::UpdateGradsArgs),
    /// What the multi-process layer finds (run under `mpirun -np K`): every collective checked,
    /// the all-reduce timed.
    MpiCheck(mpi_check_cmd::MpiCheckArgs),
    /// What the CUDA backend finds here (GPU, NVRTC, headers, cuBLAS); compiles the kernels.
    #[cfg(feature = "cuda")]
    CudaCheck(cuda_check_cmd::CudaCheckArgs),
}

fn main() -> ExitCode {
    match run(Cli::parse()) {
        Ok(()) => {
            flashgrpo_collective::finalize();
            ExitCode::SUCCESS
        }
        Err(e) => {
            // The whole chain on one line, without anyhow's backtrace.
            eprintln!("error: {e:#}");
            // One rank of several: the others would wait for it in their next collective.
            flashgrpo_collective::abort_world(1);
            ExitCode::FAILURE
        }
    }
}

fn run(cli: Cli) -> Result<()> {
    if let Some(n) = cli.threads {
        rayon::ThreadPoolBuilder::new().num_threads(n).build_global()?;
    }
    match cli.command {
        Command::Loss(args) => loss_cmd::main(args),
        Command::Gradcheck(args) => gradcheck::main(args),
        Command::Bench(args) => bench::main(args),
        Command::Forward(args) => forward_cmd::main(args),
        Command::Train(args) => train_cmd::main(args),
        Command::Generate(args) => generate_cmd::main(args),
        Command::Plot(args) => plot_cmd::main(args),
        Command::Ab(args) => ab_cmd::main(args),
        Command::BenchRollout(args) => bench_rollout_cmd::main(args),
        Command::BenchTrainer(args) => bench_trainer_cmd::main(args),
        Command::UpdateGrads(args) => update_grads_cmd::main(args),
        Command::MpiCheck(args) => mpi_check_cmd::main(args),
        #[cfg(feature = "cuda")]
        Command::CudaCheck(args) => cuda_check_cmd::main(args),
    }
}
