//! Collectives for multi-process training: the operations data- and vocabulary-parallel code
//! needs (all-reduce sum / max over f32 and f64, broadcast, all-gather, barrier, rank and size)
//! behind one trait, [`Collective`], with three implementations:
//!
//! - [`SingleProcess`]: the default, every operation a no-op (world size 1), so single-process
//!   code calls the same functions at no cost;
//! - `Mpi` (feature `mpi`): Open MPI through the `mpi` crate (rsmpi), for CPU processes
//!   launched by `mpirun` / `srun` on one machine or many;
//! - `nccl::NcclGroup` (feature `nccl`): NCCL over device buffers through cudarc, bootstrapped by
//!   broadcasting its id over a host [`Collective`].
//!
//! [`from_environment`] picks the implementation the process was launched for.

mod error;
mod launch;
#[cfg(feature = "mpi")]
mod mpi_backend;
#[cfg(feature = "nccl")]
pub mod nccl;
mod single;

pub use error::{CollectiveError, Result};
pub use launch::{from_environment, launcher_world_size};
#[cfg(feature = "mpi")]
pub use mpi_backend::{abort_world, finalize, Mpi};
pub use single::SingleProcess;

/// Ends every rank of a multi-process job with `code` when this process is one of them (a rank
/// that stops on an error would leave the others waiting in their next collective); returns
/// when the process is alone.
#[cfg(not(feature = "mpi"))]
pub fn abort_world(_code: i32) {}

/// Finalises MPI when it was initialised: the end of a successful multi-process run.
#[cfg(not(feature = "mpi"))]
pub fn finalize() {}

/// The reductions an all-reduce applies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReduceOp {
    Sum,
    Max,
}

/// A group of processes that compute together. Every rank must make the same calls in the
/// same order with buffers of the same lengths (MPI's rule); the implementations check the
/// lengths they can and name the operation when one fails.
pub trait Collective: Send + Sync {
    /// This process's index in the group, `0..size()`.
    fn rank(&self) -> usize;
    /// The number of processes.
    fn size(&self) -> usize;
    /// Every rank's `buf` replaced by the element-wise reduction over the ranks.
    fn all_reduce_f32(&self, buf: &mut [f32], op: ReduceOp) -> Result<()>;
    fn all_reduce_f64(&self, buf: &mut [f64], op: ReduceOp) -> Result<()>;
    /// Every rank's `buf` replaced by `root`'s.
    fn broadcast_f32(&self, buf: &mut [f32], root: usize) -> Result<()>;
    fn broadcast_bytes(&self, buf: &mut [u8], root: usize) -> Result<()>;
    /// `out` (`size() * local.len()`) receives every rank's `local`, in rank order.
    fn all_gather_f32(&self, local: &[f32], out: &mut [f32]) -> Result<()>;
    fn all_gather_f64(&self, local: &[f64], out: &mut [f64]) -> Result<()>;
    fn all_gather_u64(&self, local: &[u64], out: &mut [u64]) -> Result<()>;
    /// Returns once every rank has called it.
    fn barrier(&self) -> Result<()>;
    /// The sub-group of the ranks that pass the same `color`, ordered by `key` (then by rank):
    /// the data and vocabulary axes of a `data x vocab` mesh.
    fn split(&self, color: usize, key: usize) -> Result<Box<dyn Collective>>;
    /// What runs underneath, for logs ("single process", "MPI (Open MPI 4.1.4)").
    fn describe(&self) -> String;

    /// Whether this is rank 0, the one that writes files and prints.
    fn is_root(&self) -> bool {
        self.rank() == 0
    }

    /// Checks that every rank holds the same `value` (e.g. a hash of the weights); the error
    /// names the ranks that differ from rank 0.
    fn check_same(&self, what: &str, value: u64) -> Result<()> {
        let mut all = vec![0u64; self.size()];
        self.all_gather_u64(&[value], &mut all)?;
        let differ: Vec<usize> = (0..all.len()).filter(|&r| all[r] != all[0]).collect();
        if differ.is_empty() {
            return Ok(());
        }
        Err(CollectiveError::Diverged {
            what: what.into(),
            ranks: differ,
            values: all.iter().map(|v| format!("{v:016x}")).collect(),
        })
    }
}

/// `part`'s contiguous share of `0..len` split into `parts` nearly equal pieces (the first
/// `len % parts` one longer): how ranks cut prompts and vocabularies.
pub fn share(len: usize, parts: usize, part: usize) -> std::ops::Range<usize> {
    let (base, extra) = (len / parts, len % parts);
    let start = part * base + part.min(extra);
    start..start + base + usize::from(part < extra)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shares_cover_the_range_in_order() {
        for len in [0, 1, 7, 10, 151_936, 4_099] {
            for parts in 1..6 {
                let ranges: Vec<_> = (0..parts).map(|p| share(len, parts, p)).collect();
                assert_eq!(ranges[0].start, 0);
                assert_eq!(ranges[parts - 1].end, len);
                for w in ranges.windows(2) {
                    assert_eq!(w[0].end, w[1].start);
                    assert!(w[0].len() >= w[1].len() && w[0].len() - w[1].len() <= 1);
                }
            }
        }
    }

    #[test]
    fn single_process_is_the_identity() {
        let c = SingleProcess;
        let mut x = [1.0f32, -2.0];
        c.all_reduce_f32(&mut x, ReduceOp::Sum).unwrap();
        c.all_reduce_f32(&mut x, ReduceOp::Max).unwrap();
        assert_eq!(x, [1.0, -2.0]);
        let mut out = [0.0f64; 2];
        c.all_gather_f64(&[3.0, 4.0], &mut out).unwrap();
        assert_eq!(out, [3.0, 4.0]);
        c.check_same("weights", 42).unwrap();
        assert_eq!((c.rank(), c.size(), c.is_root()), (0, 1, true));
        assert_eq!(c.split(3, 0).unwrap().size(), 1);
        assert!(matches!(c.all_gather_f32(&[1.0], &mut [0.0; 2]), Err(CollectiveError::Length { .. })));
    }
}
