//! `flashgrpo loss --vocab-parallel`: every rank reads the whole inputs, keeps its slice of the
//! vocabulary (logits columns, or lm_head rows), runs [`flashgrpo_train::vocab_parallel`], and
//! the gradient slices are gathered so that rank 0 writes the file one process would write.

use anyhow::Result;
use flashgrpo_collective::{share, Collective};
use flashgrpo_kernels::{ChunkBudget, LossOptions};
use flashgrpo_train::vocab_parallel::{columns, linear_loss, logits_loss, LinearShard, LinearShardGrads};

use crate::batch::{Batch, LinearData, Scores};
use crate::run::{Grad, Results};
use crate::tensor_io::{FloatData, FloatElement, FloatVisitor};

/// The loss of `batch` over the ranks of `comm`, each holding its vocabulary slice; every rank
/// returns the whole results.
pub fn run_vocab_parallel(
    comm: &dyn Collective,
    batch: &Batch,
    options: &LossOptions,
    budget: ChunkBudget,
) -> Result<Results> {
    match &batch.scores {
        Scores::Logits(logits) => logits.visit(LogitsSlice { comm, batch, options }),
        Scores::Linear(lin) => lin.hidden.visit(LinearSlice { comm, batch, options, lin, budget }),
    }
}

/// Rows `0..rows` of a `[rows, width]` row-major matrix, columns `cols`.
fn column_slice<T: Copy>(values: &[T], width: usize, cols: &std::ops::Range<usize>) -> Vec<T> {
    values.chunks(width.max(1)).flat_map(|row| row[cols.clone()].iter().copied()).collect()
}

/// Each rank's `[rows, its columns]` block of a `[rows, vocab]` matrix, put together (one
/// all-gather, every rank's block padded to the widest).
fn gather_columns(comm: &dyn Collective, local: &[f32], rows: usize, vocab: usize) -> Result<Vec<f32>> {
    let k = comm.size();
    let widest = share(vocab, k, 0).len();
    let mine = columns(comm, vocab).len();
    let mut padded = vec![0.0f32; rows * widest];
    for i in 0..rows {
        padded[i * widest..i * widest + mine].copy_from_slice(&local[i * mine..(i + 1) * mine]);
    }
    let mut all = vec![0.0f32; padded.len() * k];
    comm.all_gather_f32(&padded, &mut all)?;
    let mut full = vec![0.0f32; rows * vocab];
    for r in 0..k {
        let cols = share(vocab, k, r);
        let block = &all[r * rows * widest..(r + 1) * rows * widest];
        for i in 0..rows {
            full[i * vocab + cols.start..i * vocab + cols.end]
                .copy_from_slice(&block[i * widest..i * widest + cols.len()]);
        }
    }
    Ok(full)
}

/// Each rank's rows `[its rows of vocab, width]` of a `[vocab, width]` matrix (the lm_head's
/// gradient, or the bias's with width 1), put together (one all-gather, padded to the most rows).
fn gather_rows(comm: &dyn Collective, local: &[f32], vocab: usize, width: usize) -> Result<Vec<f32>> {
    let k = comm.size();
    let most = share(vocab, k, 0).len() * width;
    let mut padded = local.to_vec();
    padded.resize(most, 0.0);
    let mut all = vec![0.0f32; most * k];
    comm.all_gather_f32(&padded, &mut all)?;
    Ok((0..k).flat_map(|r| all[r * most..r * most + share(vocab, k, r).len() * width].iter().copied()).collect())
}

struct LogitsSlice<'a> {
    comm: &'a dyn Collective,
    batch: &'a Batch,
    options: &'a LossOptions,
}

impl FloatVisitor for LogitsSlice<'_> {
    type Out = Result<Results>;
    fn visit<T: FloatElement>(self, logits: &[T]) -> Self::Out {
        let (b, t, v) = (self.batch.batch, self.batch.seq_len, self.batch.vocab);
        let spec = self.batch.spec(self.options);
        let local = column_slice(logits, v, &columns(self.comm, v));
        if !spec.has_gradient() {
            return Ok(Results { output: logits_loss(self.comm, spec, &local, None)?, grads: Vec::new() });
        }
        let mut grad = flashgrpo_kernels::huge_pages::zeroed::<T>(local.len());
        let output = logits_loss(self.comm, spec, &local, Some(&mut grad))?;
        let grad: Vec<f32> = grad.iter().map(|x| x.to_f32()).collect();
        let full = gather_columns(self.comm, &grad, b * t, v)?;
        Ok(Results {
            output,
            grads: vec![Grad { name: "grad_logits", shape: vec![b, t, v], data: T::wrap_f32(&full) }],
        })
    }
}

struct LinearSlice<'a> {
    comm: &'a dyn Collective,
    batch: &'a Batch,
    options: &'a LossOptions,
    lin: &'a LinearData,
    budget: ChunkBudget,
}

impl FloatVisitor for LinearSlice<'_> {
    type Out = Result<Results>;
    fn visit<T: FloatElement>(self, hidden: &[T]) -> Self::Out {
        let (b, t, v, h) = (self.batch.batch, self.batch.seq_len, self.batch.vocab, self.lin.hidden_size);
        let spec = self.batch.spec(self.options);
        let cols = columns(self.comm, v);
        let weight = &typed::<T>(&self.lin.weight)[cols.start * h..cols.end * h];
        let bias = self.lin.bias.as_ref().map(|b| &typed::<T>(b)[cols.clone()]);
        let shard = LinearShard { hidden, weight, bias, hidden_size: h };
        if !spec.has_gradient() {
            return Ok(Results { output: linear_loss(self.comm, spec, shard, None, self.budget)?, grads: Vec::new() });
        }
        let mut gh = vec![0.0f32; hidden.len()];
        let mut gw = vec![0.0f32; cols.len() * h];
        let mut gb = vec![0.0f32; if bias.is_some() { cols.len() } else { 0 }];
        let grads = LinearShardGrads {
            hidden: &mut gh,
            weight: Some(&mut gw),
            bias: bias.is_some().then_some(&mut gb[..]),
            accumulate: false,
        };
        let output = linear_loss(self.comm, spec, shard, Some(grads), self.budget)?;
        let full_w = gather_rows(self.comm, &gw, v, h)?;
        let mut named = vec![
            Grad { name: "grad_hidden", shape: vec![b, t, h], data: T::wrap_f32(&gh) },
            Grad { name: "grad_weight", shape: vec![v, h], data: T::wrap_f32(&full_w) },
        ];
        if bias.is_some() {
            let full_b = gather_rows(self.comm, &gb, v, 1)?;
            named.push(Grad { name: "grad_bias", shape: vec![v], data: T::wrap_f32(&full_b) });
        }
        Ok(Results { output, grads: named })
    }
}

/// The weight or bias in the hidden states' dtype (`Batch::read` gives them one dtype).
fn typed<T: FloatElement>(data: &FloatData) -> &[T] {
    T::slice_of(data).expect("the hidden states, weight and bias share one dtype")
}
