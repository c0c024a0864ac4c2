//! One process: every collective is the identity (world size 1), so code written for many
//! ranks runs unchanged, and at no cost, in one.

use crate::error::{gathered_len, Result};
use crate::{Collective, ReduceOp};

/// The group of one process.
#[derive(Debug, Clone, Copy, Default)]
pub struct SingleProcess;

impl Collective for SingleProcess {
    fn rank(&self) -> usize {
        0
    }
    fn size(&self) -> usize {
        1
    }
    fn all_reduce_f32(&self, _: &mut [f32], _: ReduceOp) -> Result<()> {
        Ok(())
    }
    fn all_reduce_f64(&self, _: &mut [f64], _: ReduceOp) -> Result<()> {
        Ok(())
    }
    fn broadcast_f32(&self, _: &mut [f32], _: usize) -> Result<()> {
        Ok(())
    }
    fn broadcast_bytes(&self, _: &mut [u8], _: usize) -> Result<()> {
        Ok(())
    }
    fn all_gather_f32(&self, local: &[f32], out: &mut [f32]) -> Result<()> {
        gathered_len("all_gather", 0, local.len(), 1, out.len())?;
        out.copy_from_slice(local);
        Ok(())
    }
    fn all_gather_f64(&self, local: &[f64], out: &mut [f64]) -> Result<()> {
        gathered_len("all_gather", 0, local.len(), 1, out.len())?;
        out.copy_from_slice(local);
        Ok(())
    }
    fn all_gather_u64(&self, local: &[u64], out: &mut [u64]) -> Result<()> {
        gathered_len("all_gather", 0, local.len(), 1, out.len())?;
        out.copy_from_slice(local);
        Ok(())
    }
    fn barrier(&self) -> Result<()> {
        Ok(())
    }
    fn split(&self, _: usize, _: usize) -> Result<Box<dyn Collective>> {
        Ok(Box::new(SingleProcess))
    }
    fn describe(&self) -> String {
        "single process".into()
    }
}
