//! MPI through rsmpi (the `mpi` crate): processes launched by `mpirun` / `srun`, on one machine
//! or many. MPI is initialised with `MPI_THREAD_SERIALIZED` and every call holds one
//! process-wide lock, so the trainer may call from any thread (rayon's workers included) and
//! from any group (the world or a split of it) but never two at once.
//!
//! Failures end the whole job, never hang it: a killed rank is caught by Open MPI (`mpirun` names
//! the rank and its signal and stops the others); a rank that returns an error or panics calls
//! [`abort_world`] (`MPI_Abort`), since the others would otherwise wait in their next collective
//! forever.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, MutexGuard};

use mpi::collective::SystemOperation;
use mpi::environment::Universe;
use mpi::topology::{Color, SimpleCommunicator};
use mpi::traits::*;

use crate::error::{gathered_len, CollectiveError, Result};
use crate::{Collective, ReduceOp};

/// Every MPI call of the process holds it (`MPI_THREAD_SERIALIZED`).
static MPI_LOCK: Mutex<()> = Mutex::new(());

/// Set once MPI is initialised with more than one process: errors and panics then abort the job.
static MULTI_PROCESS: AtomicBool = AtomicBool::new(false);

fn lock() -> MutexGuard<'static, ()> {
    MPI_LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

/// Ends every rank of the job with `code` (`MPI_Abort` on the world) when this process is one of
/// several MPI ranks; returns otherwise. Takes no lock: it must work while another thread of the
/// process waits in a collective.
pub fn abort_world(code: i32) {
    if MULTI_PROCESS.load(Ordering::SeqCst) {
        // SAFETY: MPI is initialised (MULTI_PROCESS is set after initialisation) and not
        // finalised ([`finalize`] clears the flag first); MPI_Abort does not return.
        unsafe {
            mpi::ffi::MPI_Abort(mpi::ffi::RSMPI_COMM_WORLD, code);
        }
    }
}

/// The MPI environment, finalised by [`finalize`] (not by a drop: a rank that stops on an error
/// must abort the job before anything finalises, or `MPI_Finalize` would wait for the others).
struct Environment(#[allow(dead_code)] /* held for its drop: MPI_Finalize */ Universe);

// SAFETY: the universe is only touched under `MPI_LOCK` (MPI_THREAD_SERIALIZED).
unsafe impl Send for Environment {}

static ENVIRONMENT: Mutex<Option<Environment>> = Mutex::new(None);

/// Finalises MPI if it was initialised (call once the groups are dropped, at the end of a
/// successful run; after it, no collective may be called).
pub fn finalize() {
    let _guard = lock();
    MULTI_PROCESS.store(false, Ordering::SeqCst);
    let environment = ENVIRONMENT.lock().unwrap_or_else(|e| e.into_inner()).take();
    drop(environment);
}

/// A group of MPI processes (the world, or a [`Collective::split`] of it).
pub struct Mpi {
    comm: SimpleCommunicator,
    rank: usize,
    size: usize,
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
        if size > 1 {
            MULTI_PROCESS.store(true, Ordering::SeqCst);
            let previous = std::panic::take_hook();
            std::panic::set_hook(Box::new(move |info| {
                previous(info);
                eprintln!("flashgrpo: rank {rank} panicked; aborting the job");
                abort_world(101);
            }));
        }
        *ENVIRONMENT.lock().unwrap_or_else(|e| e.into_inner()) = Some(Environment(universe));
        Ok(Self { comm, rank, size })
    }

    fn with<R>(&self, f: impl FnOnce(&SimpleCommunicator) -> R) -> R {
        let _guard = lock();
        f(&self.comm)
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
        Ok(Box::new(Mpi { comm, rank, size }))
    }
    fn describe(&self) -> String {
        let library = {
            let _guard = lock();
            mpi::environment::library_version().unwrap_or_else(|_| "MPI".into())
        };
        let first_line = library.lines().next().unwrap_or("MPI").trim().to_string();
        format!("MPI, {} ranks ({first_line})", self.size)
    }
}
