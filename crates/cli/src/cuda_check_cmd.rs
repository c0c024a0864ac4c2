//! `flashgrpo cuda-check`: what the CUDA backend finds on this machine (driver, GPU, NVRTC, the
//! CUDA headers, cuBLAS) and whether NVRTC compiles the kernels to machine code for an
//! architecture. Needs no GPU for the compile, so a build machine can check what a GPU run will
//! do, and a user can see why `--device cuda` fails.

use anyhow::Result;
use flashgrpo_kernels::cuda::{compile_kernels, include_dirs, CudaDevice};

#[derive(Debug, clap::Args)]
pub struct CudaCheckArgs {
    /// The architecture to compile for, `sm_XY` (default: the GPU's, or sm_90 without one).
    #[arg(long)]
    pub arch: Option<String>,
}

pub fn main(args: CudaCheckArgs) -> Result<()> {
    let gpu = match CudaDevice::new(0) {
        Ok(d) => {
            let memory = d.memory()?;
            println!(
                "gpu          {} ({}), {:.1} GiB free of {:.1} GiB",
                d.name,
                d.arch,
                gib(memory.free),
                gib(memory.total)
            );
            Some(d.arch)
        }
        Err(e) => {
            println!("gpu          none: {e}");
            None
        }
    };
    let includes = include_dirs();
    println!("headers      {}", if includes.is_empty() { "not found".to_string() } else { includes.join(":") });
    println!("cublas       {}", if flashgrpo_kernels::cuda::cublas_present() { "loadable" } else { "not found" });
    let arch = args.arch.as_deref().or(gpu).unwrap_or("sm_90");
    let cubin = compile_kernels(arch)?;
    println!("kernels      rows.cu compiled for {arch}: {} bytes of machine code", cubin.len());
    Ok(())
}

fn gib(bytes: usize) -> f64 {
    bytes as f64 / (1u64 << 30) as f64
}
