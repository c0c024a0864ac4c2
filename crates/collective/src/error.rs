//! Errors of the collective layer: each names the operation and, where one is at fault, the rank.

use thiserror::Error;

#[derive(Debug, Error)]
pub enum CollectiveError {
    #[error("{op}: buffer of {got} elements where {expected} were expected (rank {rank})")]
    Length { op: &'static str, rank: usize, expected: usize, got: usize },

    #[error("{what} differ across ranks: ranks {ranks:?} disagree with rank 0 (per rank: {values:?})")]
    Diverged { what: String, ranks: Vec<usize>, values: Vec<String> },

    #[error("{0}")]
    Launch(String),

    #[error("MPI: {0}")]
    Mpi(String),

    #[error("NCCL: {0}")]
    Nccl(String),
}

pub type Result<T, E = CollectiveError> = std::result::Result<T, E>;

/// Checks a gather's output length.
pub(crate) fn gathered_len(op: &'static str, rank: usize, local: usize, size: usize, out: usize) -> Result<()> {
    if out != local * size {
        return Err(CollectiveError::Length { op, rank, expected: local * size, got: out });
    }
    Ok(())
}
