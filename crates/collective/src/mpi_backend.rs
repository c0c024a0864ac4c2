//! MPI through rsmpi (the `mpi` crate): processes launched by `mpirun` / `srun`, on one machine
//! or many. MPI is initialised with `MPI_THREAD_SERIALIZED` and every call holds this group's
//! lock, so the trainer may call from any thread (rayon's workers included) but never from two
//! at once. Open MPI's default error handler aborts the whole job when a rank fails, so a
//! killed rank ends the job (`mpirun` names the rank and its signal) instead of hanging it.

use std::sync::{Arc, Mutex};

use mpi::collective::SystemOperation;
use mpi::environment::Universe;
use mpi::topology::{Color, SimpleCommunicator};
use mpi::traits::*;

use crate::error::{gathered_len, CollectiveError, Result};
use crate::{Collective, ReduceOp};

/// A group of MPI processes (the world, or a [`Collective::split`] of it).
pub struct Mpi {
    comm: Mutex<SimpleCommunicator>,
    rank: usize,
    size: usize,
    /// Finalises MPI when the last group is dropped (after every communicator is freed).
    universe: Arc<Universe>,
}

// SAFETY: MPI handles are plain integers or pointers owned by the MPI library, which was
// initialised for serialised use from any thread; every call below holds `comm`'s lock.
unsafe impl Send for Mpi {}
unsafe impl Sync for Mpi {}

impl Mpi {
    /// Initialises MPI (once per process) and returns the world group.
    pub fn world() -> Result<Self> {
        let (universe, threading) = mpi::initialize_with_threading(mpi::Threading::Serialized)
            .ok_or_else(|| CollectiveError::Mpi("MPI is already initialised in this process".into()))?;
        if threading < mpi::Threading::Serialized {
            return Err(CollectiveError::Mpi(format!(
                "the MPI library offers thread level {threading:?}; flashgrpo needs Serialized"
            )));
        }
        let comm = universe.world();
        let (rank, size) = (comm.rank() as usize, comm.size() as usize);
        Ok(Self { comm: Mutex::new(comm), rank, size, universe: Arc::new(universe) })
    }

    fn with<R>(&self, f: impl FnOnce(&SimpleCommunicator) -> R) -> R {
        let comm = self.comm.lock().unwrap_or_else(|e| e.into_inner());
        f(&comm)
    }

    fn all_reduce<T: Equivalence + Copy>(&self, buf: &mut [T], op: ReduceOp) -> Result<()> {
        if self.size == 1 || buf.is_empty() {
            return Ok(());
        }
        let send = buf.to_vec();
        let op = match op {
            ReduceOp::Sum => SystemOperation::sum(),
            ReduceOp::Max => SystemOperation::max(),
        };
        self.with(|c| c.all_reduce_into(&send[..], buf, op));
        Ok(())
    }

    fn broadcast<T: Equivalence>(&self, buf: &mut [T], root: usize) -> Result<()> {
        self.check_root(root)?;
        if self.size > 1 && !buf.is_empty() {
            self.with(|c| c.process_at_rank(root as i32).broadcast_into(buf));
        }
        Ok(())
    }

    fn all_gather<T: Equivalence>(&self, local: &[T], out: &mut [T]) -> Result<()> {
        gathered_len("all_gather", self.rank, local.len(), self.size, out.len())?;
        self.with(|c| c.all_gather_into(local, out));
        Ok(())
    }

    fn check_root(&self, root: usize) -> Result<()> {
        if root >= self.size {
            return Err(CollectiveError::Mpi(format!("broadcast from rank {root} in a group of {}", self.size)));
        }
        Ok(())
    }
}

impl Collective for Mpi {
    fn rank(&self) -> usize {
        self.rank
    }
    fn size(&self) -> usize {
        self.size
    }
    fn all_reduce_f32(&self, buf: &mut [f32], op: ReduceOp) -> Result<()> {
        self.all_reduce(buf, op)
    }
    fn all_reduce_f64(&self, buf: &mut [f64], op: ReduceOp) -> Result<()> {
        self.all_reduce(buf, op)
    }
    fn broadcast_f32(&self, buf: &mut [f32], root: usize) -> Result<()> {
        self.broadcast(buf, root)
    }
    fn broadcast_bytes(&self, buf: &mut [u8], root: usize) -> Result<()> {
        self.broadcast(buf, root)
    }
    fn all_gather_f32(&self, local: &[f32], out: &mut [f32]) -> Result<()> {
        self.all_gather(local, out)
    }
    fn all_gather_f64(&self, local: &[f64], out: &mut [f64]) -> Result<()> {
        self.all_gather(local, out)
    }
    fn all_gather_u64(&self, local: &[u64], out: &mut [u64]) -> Result<()> {
        self.all_gather(local, out)
    }
    fn barrier(&self) -> Result<()> {
        self.with(|c| c.barrier());
        Ok(())
    }
    fn split(&self, color: usize, key: usize) -> Result<Box<dyn Collective>> {
        let comm = self
            .with(|c| c.split_by_color_with_key(Color::with_value(color as i32), key as i32))
            .ok_or_else(|| CollectiveError::Mpi(format!("split by color {color} gave no group")))?;
        let (rank, size) = (comm.rank() as usize, comm.size() as usize);
        Ok(Box::new(Mpi { comm: Mutex::new(comm), rank, size, universe: Arc::clone(&self.universe) }))
    }
    fn describe(&self) -> String {
        let library = mpi::environment::library_version().unwrap_or_else(|_| "MPI".into());
        let first_line = library.lines().next().unwrap_or("MPI").trim().to_string();
        format!("MPI, {} ranks ({first_line})", self.size)
    }
}
