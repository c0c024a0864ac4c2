//! NCCL over device buffers (cudarc): the collective of GPU ranks, one process per GPU. The
//! 128-byte NCCL id is made on rank 0 and broadcast over a host [`Collective`] (MPI), as
//! PyTorch's `ProcessGroupNCCL` broadcasts it over its store. The buffers stay on the GPU; each
//! call is enqueued on the group's stream, like the kernels that produce the gradients.

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream};
use cudarc::nccl::safe::{Comm, Id, ReduceOp as NcclOp};

use crate::error::{CollectiveError, Result};
use crate::{Collective, ReduceOp};

/// A group of GPU ranks that reduce device buffers.
pub struct NcclGroup {
    comm: Comm,
}

fn nccl_error(op: &'static str) -> impl Fn(cudarc::nccl::result::NcclError) -> CollectiveError {
    move |e| CollectiveError::Nccl(format!("{op}: {e:?}"))
}

fn op_of(op: ReduceOp) -> NcclOp {
    match op {
        ReduceOp::Sum => NcclOp::Sum,
        ReduceOp::Max => NcclOp::Max,
    }
}

impl NcclGroup {
    /// The NCCL group of the same ranks as `host`, each on `stream`'s GPU.
    pub fn new(host: &dyn Collective, stream: Arc<CudaStream>) -> Result<Self> {
        // SAFETY: only probes whether the shared library can be loaded.
        if !unsafe { cudarc::nccl::sys::is_culib_present() } {
            return Err(CollectiveError::Nccl(
                "libnccl.so could not be loaded (install the nvidia-nccl-cu13 wheel or NCCL, see docs/DISTRIBUTED.md)"
                    .into(),
            ));
        }
        let mut bytes = [0u8; 128];
        if host.is_root() {
            let id = Id::new().map_err(nccl_error("creating the NCCL id"))?;
            for (b, c) in bytes.iter_mut().zip(id.internal()) {
                *b = *c as u8;
            }
        }
        host.broadcast_bytes(&mut bytes, 0)?;
        let id = Id::uninit(bytes.map(|b| b as core::ffi::c_char));
        let comm = Comm::from_rank(stream, host.rank(), host.size(), id).map_err(nccl_error("joining the group"))?;
        Ok(Self { comm })
    }

    pub fn rank(&self) -> usize {
        self.comm.rank()
    }

    pub fn size(&self) -> usize {
        self.comm.world_size()
    }

    /// Every rank's `buf` replaced by the element-wise reduction (in place, on the stream).
    pub fn all_reduce_f32(&self, buf: &mut CudaSlice<f32>, op: ReduceOp) -> Result<()> {
        self.comm.all_reduce_in_place(buf, &op_of(op)).map_err(nccl_error("all_reduce"))?;
        Ok(())
    }

    pub fn all_reduce_f64(&self, buf: &mut CudaSlice<f64>, op: ReduceOp) -> Result<()> {
        self.comm.all_reduce_in_place(buf, &op_of(op)).map_err(nccl_error("all_reduce"))?;
        Ok(())
    }

    /// Every rank's `buf` replaced by `root`'s.
    pub fn broadcast_f32(&self, buf: &mut CudaSlice<f32>, root: usize) -> Result<()> {
        self.comm.broadcast_in_place(buf, root as i32).map_err(nccl_error("broadcast"))?;
        Ok(())
    }

    /// `out` (`size() * local.len()` elements) receives every rank's `local` in rank order.
    pub fn all_gather_f32(&self, local: &CudaSlice<f32>, out: &mut CudaSlice<f32>) -> Result<()> {
        crate::error::gathered_len("all_gather", self.rank(), local.len(), self.size(), out.len())?;
        self.comm.all_gather(local, out).map_err(nccl_error("all_gather"))?;
        Ok(())
    }
}
