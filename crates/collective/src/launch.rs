//! Which collective a process was launched for: `mpirun` (Open MPI, MPICH), Slurm's `srun` and
//! PMIx all leave the world size in the environment; without one, the process is alone.

use crate::error::Result;
use crate::{Collective, SingleProcess};

/// The variables launchers set to the number of processes, in the order they are read.
const WORLD_SIZE_VARS: [&str; 4] = ["OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE", "SLURM_NTASKS"];

/// The world size a launcher set for this process (`None`: not launched by one). `SLURM_NTASKS`
/// counts only when `srun` started this process (`SLURM_STEP_ID` set), not a batch script.
pub fn launcher_world_size() -> Option<(String, usize)> {
    WORLD_SIZE_VARS.iter().find_map(|&name| {
        if name == "SLURM_NTASKS" && std::env::var_os("SLURM_STEP_ID").is_none() {
            return None;
        }
        let value = std::env::var(name).ok()?;
        value.trim().parse().ok().map(|n| (name.to_string(), n))
    })
}

/// The collective of this process: MPI's world when a launcher started several processes (or
/// `force_mpi`), one process otherwise. A multi-process launch of a binary built without the
/// `mpi` feature is an error rather than K copies of the same single-process run.
pub fn from_environment(force_mpi: bool) -> Result<Box<dyn Collective>> {
    let launched = launcher_world_size();
    let wanted = force_mpi || launched.as_ref().is_some_and(|(_, n)| *n > 1);
    if !wanted {
        return Ok(Box::new(SingleProcess));
    }
    #[cfg(feature = "mpi")]
    {
        Ok(Box::new(crate::Mpi::world()?))
    }
    #[cfg(not(feature = "mpi"))]
    {
        let how =
            launched.map_or("asked for MPI".to_string(), |(var, n)| format!("launched with {n} ranks ({var}={n})"));
        Err(crate::CollectiveError::Launch(format!(
            "{how}, but this flashgrpo was built without MPI: build it with `cargo build --release --features mpi` \
             (after `scripts/setup-mpi.sh`), see docs/DISTRIBUTED.md"
        )))
    }
}
