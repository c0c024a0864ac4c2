//! Data-parallel training's model-level pieces: the `parallel:` config section, the initial
//! weights broadcast from rank 0, and the check that the ranks' weights stay identical (each
//! rank applies the same summed gradient, so they should be bit for bit; a hash comparison
//! every few steps turns a silent divergence into an error that names the ranks).

use flashgrpo_collective::{Collective, SingleProcess};
use serde::{Deserialize, Serialize};

use crate::error::{Result, TrainError};
use crate::model::Params;
use crate::optim::grads::with_f32;

/// The `parallel:` section: how the world of processes is used.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ParallelConfig {
    /// Data-parallel ranks; `null`: every process the launcher started.
    pub data: Option<usize>,
    /// Vocabulary-parallel ranks inside each data-parallel group: they share the group's
    /// sequences and split the update's lm_head products and loss by vocabulary rows
    /// (`loss.impl: fused_linear`).
    pub vocab: usize,
    /// Compare a hash of the weights across ranks every this many GRPO / SFT steps (0: never).
    pub check_weights_every: usize,
    /// Sum each layer's gradients over the ranks while the backward computes the layers below
    /// (on a second thread), rather than all of them after it.
    pub overlap_grad_sum: bool,
}

impl Default for ParallelConfig {
    fn default() -> Self {
        Self { data: None, vocab: 1, check_weights_every: 50, overlap_grad_sum: true }
    }
}

impl ParallelConfig {
    /// Checks the section against the world the launcher started.
    pub fn validate(&self, world: usize) -> Result<()> {
        let bad = |why: String| Err(TrainError::Config { origin: "parallel".into(), why });
        if self.vocab == 0 || self.data == Some(0) {
            return bad("parallel.data and parallel.vocab must be positive".into());
        }
        if self.data.is_none() && !world.is_multiple_of(self.vocab) {
            return bad(format!("parallel.vocab ({}) must divide the number of processes ({world})", self.vocab));
        }
        let data = self.data.unwrap_or(world / self.vocab);
        if data * self.vocab != world {
            return bad(format!(
                "parallel.data ({data}) x parallel.vocab ({}) must equal the number of processes ({world})",
                self.vocab
            ));
        }
        Ok(())
    }
}

/// The processes of a job as a `data x vocab` mesh, rank `d * vocab + v`: the `vocab` ranks of
/// a data group hold the same sequences and split the head's vocabulary; the `data` groups
/// split the batch.
pub struct Mesh<'a> {
    /// Every process: weights broadcast and checks, the gradient sum, rank 0's files.
    pub world: &'a dyn Collective,
    /// The ranks with this rank's vocabulary index (one per data group); `None`: the world.
    data: Option<Box<dyn Collective>>,
    /// The ranks of this rank's data group; `None`: this process alone.
    vocab: Option<Box<dyn Collective>>,
    /// Sum the layers' gradients while the backward runs (several processes only).
    pub overlap_grad_sum: bool,
}

static ALONE: SingleProcess = SingleProcess;

impl<'a> Mesh<'a> {
    /// One process.
    pub fn single() -> Mesh<'static> {
        Mesh { world: &ALONE, data: None, vocab: None, overlap_grad_sum: false }
    }

    /// The mesh `config` asks for over `world` (every rank calls it: the splits are collective).
    pub fn new(world: &'a dyn Collective, config: &ParallelConfig) -> Result<Self> {
        config.validate(world.size())?;
        let (v, overlap_grad_sum) = (config.vocab, config.overlap_grad_sum && world.size() > 1);
        if v == 1 {
            return Ok(Self { world, data: None, vocab: None, overlap_grad_sum });
        }
        let (d, r) = (world.rank() / v, world.rank() % v);
        let data = world.split(r, d)?;
        let vocab = world.split(d, r)?;
        Ok(Self { world, data: Some(data), vocab: Some(vocab), overlap_grad_sum })
    }

    /// The data-parallel group: batch shares, normalisers, metrics.
    pub fn data(&self) -> &dyn Collective {
        self.data.as_deref().unwrap_or(self.world)
    }

    /// The vocabulary-parallel group of the head.
    pub fn vocab(&self) -> &dyn Collective {
        self.vocab.as_deref().unwrap_or(&ALONE)
    }
}

/// Makes every rank's weights rank 0's (one broadcast per parameter, as f32: exact for f32,
/// bf16 and f16 weights).
pub fn broadcast_weights(params: &Params, comm: &dyn Collective) -> Result<()> {
    if comm.size() == 1 {
        return Ok(());
    }
    for (_, var) in params.iter() {
        let mut values = with_f32(var.as_tensor(), <[f32]>::to_vec)?;
        comm.broadcast_f32(&mut values, 0)?;
        let t = candle_core::Tensor::from_vec(values, var.shape(), var.device())?.to_dtype(var.dtype())?;
        var.set(&t)?;
    }
    Ok(())
}

/// FNV-1a over every parameter's bits, in the parameters' order.
pub fn weights_hash(params: &Params) -> Result<u64> {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for (_, var) in params.iter() {
        with_f32(var.as_tensor(), |v| {
            for x in v {
                h = (h ^ u64::from(x.to_bits())).wrapping_mul(0x0100_0000_01b3);
            }
        })?;
    }
    Ok(h)
}

/// Errors when the ranks' weights differ after `step`.
pub fn check_weights(params: &Params, comm: &dyn Collective, step: usize) -> Result<()> {
    comm.check_same(&format!("the weights after step {step}"), weights_hash(params)?).map_err(TrainError::from)
}
