//! `flashgrpo mpi-check`: what the multi-process layer finds (ranks, the MPI library), every
//! collective checked on known values, and the all-reduce's time and bandwidth on this launch,
//! the figure that docs/DISTRIBUTED.md projects step times from.

use std::time::Instant;

use anyhow::{ensure, Result};
use clap::Args;
use flashgrpo_collective::{from_environment, Collective, ReduceOp};

#[derive(Debug, Args)]
pub struct MpiCheckArgs {
    /// Size of the timed all-reduce, in MiB of f32.
    #[arg(long, default_value_t = 64)]
    pub mib: usize,
    /// Timed repetitions (the median is printed).
    #[arg(long, default_value_t = 5)]
    pub repeats: usize,
}

pub fn main(args: MpiCheckArgs) -> Result<()> {
    let comm = from_environment(false)?;
    check_collectives(comm.as_ref())?;
    let timing = time_all_reduce(comm.as_ref(), args.mib, args.repeats.max(1))?;
    if comm.is_root() {
        println!("{}: rank 0 of {}", comm.describe(), comm.size());
        println!("collectives: all_reduce sum/max (f32, f64), broadcast, all_gather, barrier, split: ok");
        println!("{timing}");
    }
    Ok(())
}

/// Every collective on values whose result is known.
fn check_collectives(comm: &dyn Collective) -> Result<()> {
    let (rank, k) = (comm.rank(), comm.size());
    let mut sum = vec![rank as f32 + 1.0; 1000];
    comm.all_reduce_f32(&mut sum, ReduceOp::Sum)?;
    ensure!(sum.iter().all(|&x| x == (k * (k + 1) / 2) as f32), "all_reduce sum (f32) on rank {rank}: {}", sum[0]);
    let mut max = [rank as f64, -(rank as f64)];
    comm.all_reduce_f64(&mut max, ReduceOp::Max)?;
    ensure!(max == [(k - 1) as f64, 0.0], "all_reduce max (f64) on rank {rank}: {max:?}");
    let mut b = [rank as f32; 3];
    comm.broadcast_f32(&mut b, k - 1)?;
    ensure!(b == [(k - 1) as f32; 3], "broadcast from rank {} on rank {rank}: {b:?}", k - 1);
    let mut bytes = [rank as u8; 5];
    comm.broadcast_bytes(&mut bytes, 0)?;
    ensure!(bytes == [0; 5], "broadcast of bytes on rank {rank}: {bytes:?}");
    let mut all = vec![0.0f64; 2 * k];
    comm.all_gather_f64(&[rank as f64, 10.0 * rank as f64], &mut all)?;
    let want: Vec<f64> = (0..k).flat_map(|r| [r as f64, 10.0 * r as f64]).collect();
    ensure!(all == want, "all_gather on rank {rank}: {all:?}");
    let parity = comm.split(rank % 2, rank)?;
    ensure!(parity.size() == k / 2 + (k % 2) * usize::from(rank % 2 == 0), "split on rank {rank}: {}", parity.size());
    comm.check_same("a constant", 7)?;
    comm.barrier()?;
    Ok(())
}

/// The median time of an all-reduce (sum) of `mib` MiB of f32, and its bus bandwidth
/// (`2 (K-1) / K` times the buffer per rank, NCCL's convention).
fn time_all_reduce(comm: &dyn Collective, mib: usize, repeats: usize) -> Result<String> {
    let n = mib * (1 << 20) / 4;
    let mut buf = vec![1.0f32; n];
    let mut times = Vec::with_capacity(repeats);
    for _ in 0..repeats + 1 {
        comm.barrier()?;
        let started = Instant::now();
        comm.all_reduce_f32(&mut buf, ReduceOp::Sum)?;
        times.push(started.elapsed().as_secs_f64());
    }
    times.remove(0);
    times.sort_by(f64::total_cmp);
    let median = times[times.len() / 2];
    let k = comm.size() as f64;
    let bus = if k > 1.0 { 2.0 * (k - 1.0) / k * (n * 4) as f64 / median / 1e9 } else { f64::NAN };
    Ok(format!("all_reduce of {mib} MiB f32: median {:.4} s over {repeats}, bus bandwidth {bus:.2} GB/s", median))
}
