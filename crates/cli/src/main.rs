//! `flashgrpo`: fused loss kernels for RL fine-tuning of language models, from the command line.

mod batch;
mod config;
mod gradcheck;
mod loss_cmd;
mod run;
mod tensor_io;

use std::process::ExitCode;

use anyhow::Result;
use clap::{Parser, Subcommand};

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
    Gradcheck(gradcheck::GradcheckArgs),
}

fn main() -> ExitCode {
    match run(Cli::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            // The whole chain on one line, without anyhow's backtrace.
            eprintln!("error: {e:#}");
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
    }
}
