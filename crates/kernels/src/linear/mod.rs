//! Fused-linear losses: the loss of `logits = hidden @ weight^T (+ bias)` computed from `hidden
//! [N, H]` and the lm_head `weight [V, H]`, streaming chunks of rows so that the `[N, V]` logits
//! never exist whole. The same engine as the logits-level losses: each chunk's logits go through
//! the row statistics, the token objective and the gradient pass, then two products turn the
//! chunk's `dlogits` into `d hidden` and `d weight`.
//!
//! - Row-local objectives (all but sequence-level GRPO) on the whole vocabulary take three
//!   products per chunk, one pass: `z = hc @ W^T`, the row sweep (statistics, objective, gradient
//!   in place, while `z` is in cache), `dh = dz @ W`, `dW += dz^T @ hc` — the minimum, where
//!   Liger-Kernel's chunked loss recomputes the logits (four products).
//! - Sequence-level GRPO and vocabulary shards (tensor-parallel lm_head: [`PreparedLinearLoss`])
//!   need every row's statistics before any gradient: a statistics pass, the objective, then a
//!   gradient pass that recomputes the logits (four products).
//!
//! Only active rows go through the products: a masked row's (or an ignored target's) logits are
//! never read and its gradient rows are zero, so the chunks hold the active rows alone (gathered
//! where a masked row falls between them) and the skipped rows' `d hidden` is written as zero.
//!
//! Memory is bounded by [`ChunkBudget`]: a chunk of rows is sized so that its f32 logits (and,
//! for bf16/f16 inputs, an f32 copy of a weight tile) fit, never O(N V). Gradients are f32 and
//! overwritten; products run through `gemm` ([`matmul`]), whose reductions have a fixed order, so
//! the results are the same bits for any thread count.

pub mod reference;
pub(crate) mod shapes;

use std::ops::Range;

use rayon::prelude::*;

use crate::cpu::{self, Block, GradientTarget, LogitMap, RowMax};
use crate::element::Element;
use crate::engine::{LossSpec, PreparedLoss};
use crate::error::LossError;
use crate::matmul::{self, Mat, MatMut};
use crate::matmul_bf16::{self, Bf16Choice, Bf16Products};
use crate::objective::{LossOutput, Objective, RowGradient, RowOutcome};
use crate::stats::{PartialRowStats, RowStats};

/// The inputs of a fused-linear loss.
#[derive(Debug, Clone, Copy)]
pub struct LinearInputs<'a, T> {
    /// `[N, H]`, row-major.
    pub hidden: &'a [T],
    /// `[V, H]` (an `nn.Linear` / lm_head layout), or a vocabulary shard's rows of it.
    pub weight: &'a [T],
    /// `[V]` (or the shard's entries).
    pub bias: Option<&'a [T]>,
    pub hidden_size: usize,
}

/// Where the gradients go: f32. `hidden` is overwritten; `weight` and `bias` are overwritten, or
/// added to with `accumulate` (a trainer summing micro-batches, or a tied embedding that also
/// receives the lookup's gradient, needs no scratch `[V, H]` buffer). `weight` and `bias` may be
/// left out (a frozen lm_head), which skips their product.
#[derive(Debug)]
pub struct LinearGradients<'a> {
    /// `[N, H]`.
    pub hidden: &'a mut [f32],
    /// `[V, H]`.
    pub weight: Option<&'a mut [f32]>,
    /// `[V]`.
    pub bias: Option<&'a mut [f32]>,
    /// Add the weight and bias gradients to the buffers' contents instead of overwriting them.
    pub accumulate: bool,
}

/// How a fused-linear call runs, shared by every front end: the memory the streaming may use
/// beyond the inputs and the gradients, and, for bf16 inputs, the products' way.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChunkBudget {
    pub bytes: usize,
    pub bf16_products: Bf16Choice,
}

impl ChunkBudget {
    pub const DEFAULT_MB: usize = 192;

    pub fn from_mb(mb: usize) -> Self {
        Self::from_bytes(mb << 20)
    }

    pub fn from_bytes(bytes: usize) -> Self {
        Self { bytes, bf16_products: Bf16Choice::Auto }
    }

    pub fn with_bf16_products(self, bf16_products: Bf16Choice) -> Self {
        Self { bf16_products, ..self }
    }
}

impl Default for ChunkBudget {
    fn default() -> Self {
        Self::from_mb(Self::DEFAULT_MB)
    }
}

/// Chunk sizes: `rows` rows of logits at a time, the weights taken `tile` rows at a time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Plan {
    rows: usize,
    tile: usize,
}

/// Vocabulary rows per tile of the AMX products: a task of the threads, and the rows whose
/// weight and `dz` one thread packs at a time (`4 * tile * H` bytes of doubled weights, 3.5 MiB
/// at H = 896). Since the products are blocked for the caches (`matmul_bf16::MACRO`) the tile
/// matters little; measured on the AMX machine (N = 1024, H = 896, V = 151936, bf16 step,
/// default / `amx-rounded`, 2026-11-25): 512: 1.12-1.14 / 0.94-0.95 s, 1024: 1.18 / 0.92-0.95,
/// 2048: 1.12-1.16 / 0.94 (before that blocking: 64: 2.2 s, 256: 2.0, 1024: 1.68, 2048: 1.73-1.98).
const AMX_TILE: usize = 1024;

impl Plan {
    /// f32 weights: one tile, the whole vocabulary. bf16 weights on AMX: tiles of [`AMX_TILE`]
    /// rows, each thread packing one (its weight rows twice, `4 AMX_TILE H` bytes, and its `dz`
    /// split, `4 AMX_TILE` bytes a row; two threads' worth counted, 4.5 MiB a thread at
    /// H = 896), the chunk's hidden states packed twice (`6 H` bytes a row) and the groups' sums
    /// of `d hidden` (`4 H` bytes a row each).
    /// Other weights widened to f32: a quarter of the budget for an f32 copy of a weight tile.
    /// The rest holds the f32 logits of a chunk of rows (and its f32 hidden states), and, on
    /// every path, a chunk's hidden states gathered and its `d hidden` before it is scattered
    /// (`(size_of T + 4) H` bytes a row: [`Streamer`]'s gathered buffers).
    fn new<T: Element>(n: usize, h: usize, columns: usize, budget: ChunkBudget, packed: bool) -> Self {
        let gathered = (std::mem::size_of::<T>() + 4) * h;
        let (tile, tile_bytes, per_row) = if packed {
            // Two threads' packing counted whatever the thread count: the chunking, and so the
            // gradients' bits, must not depend on it.
            let per_row = 4 * columns + 6 * h + 2 * 4 * AMX_TILE + matmul_bf16::GROUPS * 4 * h;
            (AMX_TILE, 2 * 4 * AMX_TILE * h, per_row)
        } else if T::as_f32_slice(&[]).is_none() {
            let tile = (budget.bytes / 4 / (4 * h.max(1))).clamp(16, columns.max(16));
            (tile, tile * h * 4, 4 * (columns + h))
        } else {
            (columns, 0, 4 * (columns + h))
        };
        let most = budget.bytes.saturating_sub(tile_bytes) / (per_row + gathered).max(1);
        let rows = even_chunk_rows(n, most);
        let rows = if packed { whole_blocks(rows, most, n) } else { rows };
        Self { rows, tile: tile.min(columns).max(1) }
    }
}

/// Rows per chunk for `n` rows and at most `most` per chunk: as few chunks as that allows, of equal
/// size (a small last chunk would make thin, slow products, and the weight gradient is read and
/// written once per chunk).
pub(crate) fn even_chunk_rows(n: usize, most: usize) -> usize {
    let n = n.max(1);
    n.div_ceil(n.div_ceil(most.clamp(1, n)))
}

/// Chunk rows rounded up to whole blocks of the packed products (32 rows: the logits product's
/// columns, `d hidden`'s rows, `d weight`'s k-steps) where `most` allows: 922 active rows in
/// chunks of at most 285 make 256, 256, 256 and 154 (29 blocks), not four of 231 (32 blocks,
/// each chunk's last one 7/32 full).
fn whole_blocks(rows: usize, most: usize, n: usize) -> usize {
    let up = rows.next_multiple_of(matmul_bf16::BLOCK);
    if up <= most {
        up.min(n.max(1))
    } else {
        rows
    }
}

/// `0..n` in consecutive ranges of `step` (the last shorter): the chunks of rows, or the tiles of
/// columns, of the CPU and CUDA streamers.
pub(crate) fn ranges(n: usize, step: usize) -> Vec<Range<usize>> {
    let step = step.max(1);
    (0..n).step_by(step).map(|r| r..(r + step).min(n)).collect()
}

/// The rows of `prepared`'s batch that go through the products, ascending: the active ones (a
/// masked row's, or an ignored target's, logits are never read and its gradient is zero). The CPU
/// and CUDA streamers both chunk these.
pub(crate) fn computed_rows(prepared: &PreparedLoss<'_>) -> Vec<usize> {
    (0..prepared.spec().rows.len()).filter(|&i| prepared.active_rows()[i]).collect()
}

/// The first of `rows` when they are consecutive and in order, as a chunk with no skipped row
/// inside is: its hidden states and `d hidden` are then read and written in place.
pub(crate) fn consecutive(rows: &[usize]) -> Option<usize> {
    let first = *rows.first()?;
    rows.iter().enumerate().all(|(k, &r)| r == first + k).then_some(first)
}

/// The `h`-wide rows `rows` of `values`: a slice of it when they are consecutive, else gathered
/// into `buf`.
fn rows_of<'b, T: Copy>(values: &'b [T], rows: &[usize], h: usize, buf: &'b mut Vec<T>) -> &'b [T] {
    if let Some(first) = consecutive(rows) {
        return &values[first * h..(first + rows.len()) * h];
    }
    buf.clear();
    for &r in rows {
        buf.extend_from_slice(&values[r * h..(r + 1) * h]);
    }
    buf
}

/// Writes zero over the `h`-wide rows `rows` of `values` (the `d hidden` of rows left out of the
/// products).
fn zero_rows(values: &mut [f32], h: usize, rows: impl Iterator<Item = usize>) {
    for row in rows {
        values[row * h..(row + 1) * h].fill(0.0);
    }
}

/// bf16 values' bits, as the packed products take them (only bf16 inputs reach them).
fn bf16_bits<T: Element>(values: &[T]) -> &[u16] {
    T::as_bf16_bits(values).expect("bf16 operands")
}

/// The values as f32: the slice itself, or a widened copy in `buf`.
fn as_f32<'b, T: Element>(values: &'b [T], buf: &'b mut Vec<f32>) -> &'b [f32] {
    if let Some(v) = T::as_f32_slice(values) {
        return v;
    }
    buf.clear();
    buf.resize(values.len(), 0.0);
    buf.par_chunks_mut(1 << 14).zip(values.par_chunks(1 << 14)).for_each(|(d, s)| {
        for (d, s) in d.iter_mut().zip(s) {
            *d = s.to_f32();
        }
    });
    buf
}

/// A fused-linear loss with validated inputs, streaming a range of vocabulary columns.
struct Streamer<'p, 'a, T> {
    prepared: &'p PreparedLoss<'a>,
    inputs: LinearInputs<'a, T>,
    columns: Range<usize>,
    /// What the chunks may hold ([`Self::plan`] sizes them from it and the rows to compute).
    budget: ChunkBudget,
    /// f32 logits of one chunk, `[plan.rows, columns.len()]`.
    z: Vec<f32>,
    /// The products' operands for the chunk in hand.
    operands: Operands,
    /// The rows that go through the products, ascending: the active ones. Chunks are ranges of it.
    computed: Vec<usize>,
    /// A chunk's hidden states when its rows are not consecutive.
    gathered_hidden: Vec<T>,
    /// A chunk's `d hidden` when its rows are not consecutive, before it goes to them.
    gathered_grad: Vec<f32>,
}

/// The chunk's hidden states and the weight tiles as the products take them.
enum Operands {
    /// f32 products: the chunk's hidden states and a weight tile, widened when not f32.
    F32 { hidden: Vec<f32>, weight: Vec<f32> },
    /// Packed bf16 products, AMX or AVX512-BF16 (of the way `products`): the chunk's hidden
    /// states packed, and the sums
    /// of `d hidden`.
    Packed { hidden: Box<matmul_bf16::PackedHidden>, partials: Vec<f32>, products: Bf16Products },
}

impl<'p, 'a, T: Element> Streamer<'p, 'a, T> {
    fn new(
        prepared: &'p PreparedLoss<'a>,
        inputs: LinearInputs<'a, T>,
        columns: Range<usize>,
        budget: ChunkBudget,
    ) -> Result<Self, LossError> {
        let rows = &prepared.spec().rows;
        let (h, v) = (inputs.hidden_size, columns.len());
        if columns.end > rows.vocab || columns.start > columns.end {
            return Err(LossError::Shard(format!(
                "columns {columns:?} are not inside the vocabulary [0, {})",
                rows.vocab
            )));
        }
        shapes::check_inputs(rows, h, v, inputs.hidden.len(), inputs.weight.len(), inputs.bias.map(<[T]>::len))?;
        let products = budget.bf16_products.resolve();
        let bf16 = T::as_bf16_bits(&[]).is_some();
        if bf16 && !Bf16Products::available().contains(&products) {
            return Err(LossError::InvalidOption {
                name: "bf16_products",
                message: format!("this machine cannot run `{}`", products.setting()),
            });
        }
        let packed = bf16 && products.packed();
        let operands = if packed {
            Operands::Packed { hidden: Box::default(), partials: Vec::new(), products }
        } else {
            Operands::F32 { hidden: Vec::new(), weight: Vec::new() }
        };
        let computed = computed_rows(prepared);
        Ok(Self {
            prepared,
            inputs,
            columns,
            budget,
            z: Vec::new(),
            operands,
            computed,
            gathered_hidden: Vec::new(),
            gathered_grad: Vec::new(),
        })
    }

    fn width(&self) -> usize {
        self.columns.len()
    }

    /// The chunking of the rows left to compute.
    fn plan(&self) -> Plan {
        let packed = matches!(self.operands, Operands::Packed { .. });
        Plan::new::<T>(self.computed.len(), self.inputs.hidden_size, self.width(), self.budget, packed)
    }

    /// Ranges of [`Self::computed`].
    fn chunks(&self) -> Vec<Range<usize>> {
        ranges(self.computed.len(), self.plan().rows)
    }

    /// Before the chunks: `d hidden` of every row outside [`Self::computed`] is zero.
    fn zero_skipped(&self, grads: &mut LinearGradients<'_>) {
        let mut computed = vec![false; self.prepared.spec().rows.len()];
        self.computed.iter().for_each(|&i| computed[i] = true);
        let skipped = computed.iter().enumerate().filter(|(_, &c)| !c).map(|(row, _)| row);
        zero_rows(grads.hidden, self.inputs.hidden_size, skipped);
    }

    /// After the chunks: where no row reached the gradient products (`written` false), the
    /// weight and bias gradients (overwritten unless accumulated) are zero.
    fn finish(grads: &mut LinearGradients<'_>, written: bool) {
        if !written && !grads.accumulate {
            for g in [grads.weight.as_deref_mut(), grads.bias.as_deref_mut()].into_iter().flatten() {
                g.fill(0.0);
            }
        }
    }

    /// Takes the chunk's rows whose gradient is zero (`live` false: a token whose objective has
    /// no gradient, e.g. a zero advantage or a clipped ratio without a KL term) out of the
    /// gradient products: each such row's `dz` slot (and f32 hidden state) is refilled with the
    /// chunk's last live row (at most one row of logits moved per row dropped, where dropping it
    /// saves two products' share of a row), the dropped rows' `d hidden` written as zero. Returns
    /// the live rows (global indices) in their new order, as [`Self::backward`] takes them.
    fn drop_zero_rows(&mut self, chunk: &Range<usize>, live: &[bool], grads: &mut LinearGradients<'_>) -> Vec<usize> {
        let rows = &self.computed[chunk.clone()];
        if live.iter().all(|&l| l) {
            return rows.to_vec();
        }
        let (h, v) = (self.inputs.hidden_size, self.width());
        let mut slots: Vec<usize> = (0..rows.len()).collect();
        let (mut i, mut j) = (0, rows.len());
        loop {
            while i < j && live[i] {
                i += 1;
            }
            while j > i && !live[j - 1] {
                j -= 1;
            }
            if i >= j {
                break;
            }
            self.z.copy_within((j - 1) * v..j * v, i * v);
            if let Operands::F32 { hidden, .. } = &mut self.operands {
                hidden.copy_within((j - 1) * h..j * h, i * h);
            }
            slots[i] = j - 1;
            (i, j) = (i + 1, j - 1);
        }
        // Slots before `i` hold live rows, the rest dropped ones.
        let kept: Vec<usize> = slots[..i].iter().map(|&l| rows[l]).collect();
        zero_rows(grads.hidden, h, rows.iter().zip(live).filter(|(_, &l)| !l).map(|(&row, _)| row));
        kept
    }

    fn tiles(&self) -> Vec<Range<usize>> {
        ranges(self.width(), self.plan().tile)
    }

    /// Computes the f32 logits of `chunk` into `self.z`: the chunk's hidden states gathered (and
    /// widened, kept in `self.operands` for [`Self::backward`], on the f32 path) or packed for
    /// the logits product (the gradient products' packing waits for the rows that reach them).
    fn logits(&mut self, chunk: &Range<usize>) {
        let (h, v) = (self.inputs.hidden_size, self.width());
        let n = chunk.len();
        let plan = self.plan();
        if self.z.len() < plan.rows * v {
            self.z = crate::huge_pages::zeroed(plan.rows * v);
        }
        let tiles = self.tiles();
        let z = &mut self.z[..n * v];
        if let Some(bias) = self.inputs.bias {
            let bias: Vec<f32> = bias.iter().map(|b| b.to_f32()).collect();
            z.par_chunks_mut(v).for_each(|row| row.copy_from_slice(&bias));
        }
        let (weight, accumulate) = (self.inputs.weight, self.inputs.bias.is_some());
        let rows = &self.computed[chunk.clone()];
        match &mut self.operands {
            Operands::F32 { hidden, weight: buf } => {
                hidden.clear();
                for &r in rows {
                    hidden.extend(self.inputs.hidden[r * h..(r + 1) * h].iter().map(|x| x.to_f32()));
                }
                let hc = Mat::new(hidden, n, h);
                for t in tiles {
                    let wt = Mat::new(as_f32(&weight[t.start * h..t.end * h], buf), t.len(), h);
                    let mut out = MatMut { data: &mut z[t.start..], rows: n, cols: t.len(), stride: v };
                    matmul::matmul_nt(&mut out, accumulate, hc, wt);
                }
            }
            Operands::Packed { hidden, products, .. } => {
                let hc = rows_of(self.inputs.hidden, rows, h, &mut self.gathered_hidden);
                hidden.pack_for_logits(bf16_bits(hc), n, h, *products);
                let mut out = MatMut { data: z, rows: n, cols: v, stride: v };
                matmul_bf16::logits(&mut out, accumulate, hidden, bf16_bits(weight), plan.tile);
            }
        }
    }

    /// Turns `dz` (in `self.z`, one row per entry of `rows`) into the gradients of `rows`: `dh`
    /// (overwritten), `dW` and `db` (overwritten the first time, `written` false, unless
    /// `grads.accumulate`; accumulated after). Returns whether it wrote them (`rows` not empty).
    fn backward(&mut self, rows: &[usize], grads: &mut LinearGradients<'_>, written: bool) -> bool {
        if rows.is_empty() {
            return false;
        }
        let first_chunk = !written && !grads.accumulate;
        let (h, v, n) = (self.inputs.hidden_size, self.width(), rows.len());
        let (tiles, tile) = (self.tiles(), self.plan().tile);
        if let Operands::Packed { hidden, products, .. } = &mut self.operands {
            let hc = rows_of(self.inputs.hidden, rows, h, &mut self.gathered_hidden);
            hidden.pack_for_gradients(bf16_bits(hc), n, h, *products);
        }
        let weight = self.inputs.weight;
        if let Some(db) = grads.bias.as_deref_mut() {
            bias_gradient(db, &self.z[..n * v], v, first_chunk);
        }
        let in_place = consecutive(rows);
        let dh = match in_place {
            Some(first) => &mut grads.hidden[first * h..(first + n) * h],
            None => {
                self.gathered_grad.resize(n * h, 0.0);
                &mut self.gathered_grad[..n * h]
            }
        };
        match &mut self.operands {
            Operands::F32 { hidden, weight: buf } => {
                let dz = &self.z[..n * v];
                let dz_tile = |t: &Range<usize>| Mat { data: &dz[t.start..], rows: n, cols: t.len(), stride: v };
                for (i, t) in tiles.iter().enumerate() {
                    let wt = Mat::new(as_f32(&weight[t.start * h..t.end * h], buf), t.len(), h);
                    matmul::matmul_nn(&mut MatMut::new(dh, n, h), i > 0, dz_tile(t), wt);
                }
                if let Some(dw) = grads.weight.as_deref_mut() {
                    for t in &tiles {
                        let mut out = MatMut::new(&mut dw[t.start * h..t.end * h], t.len(), h);
                        matmul::matmul_tn(&mut out, !first_chunk, dz_tile(t), Mat::new(hidden, n, h));
                    }
                }
            }
            Operands::Packed { hidden, partials, .. } => {
                let dz = Mat::new(&self.z[..n * v], n, v);
                let weight = bf16_bits(weight);
                let dw = grads.weight.as_deref_mut();
                let dh = &mut MatMut::new(dh, n, h);
                matmul_bf16::gradients(dh, dw, !first_chunk, dz, weight, hidden, tile, partials);
            }
        }
        if in_place.is_none() {
            for (&row, g) in rows.iter().zip(self.gathered_grad.chunks_exact(h)) {
                grads.hidden[row * h..(row + 1) * h].copy_from_slice(g);
            }
        }
        true
    }

    /// Pass 1: every row's partial statistics over the columns (`max`: for shards, [`RowMax`]).
    fn statistics(&mut self, max: RowMax) -> Result<Vec<PartialRowStats>, LossError> {
        let mut stats = vec![PartialRowStats::EMPTY; self.prepared.spec().rows.len()];
        let map = LogitMap::of(self.prepared.spec().options);
        for chunk in self.chunks() {
            self.logits(&chunk);
            let n = chunk.len() * self.width();
            let rows = &self.computed[chunk];
            let block = chunk_block(self.prepared, &self.columns, rows);
            let got = cpu::statistics(&self.z[..n], &block, map, self.prepared.wanted(), max)?;
            for (&row, s) in rows.iter().zip(got) {
                stats[row] = s;
            }
        }
        Ok(stats)
    }

    /// Pass 2: the gradients from every row's gradient scalars, recomputing the logits.
    /// Rows whose gradient is zero are left out of all three products.
    fn gradient(&mut self, row_grads: &[RowGradient], grads: &mut LinearGradients<'_>) {
        self.computed.retain(|&i| !row_grads[i].is_zero());
        self.zero_skipped(grads);
        let map = LogitMap::of(self.prepared.spec().options);
        let mut written = false;
        for chunk in self.chunks() {
            self.logits(&chunk);
            let n = chunk.len() * self.width();
            let block = chunk_block(self.prepared, &self.columns, &self.computed[chunk.clone()]);
            let weights = self.prepared.sum_u().weights();
            cpu::gradient(GradientTarget::InPlace(&mut self.z[..n]), &block, row_grads, map, weights);
            let rows = self.computed[chunk].to_vec();
            written |= self.backward(&rows, grads, written);
        }
        Self::finish(grads, written);
    }

    /// The one-pass path: per chunk, logits, the row sweep, then the gradient products over the
    /// rows whose gradient is not zero.
    fn sweep(
        &mut self,
        objective: &Objective<'_>,
        grads: &mut LinearGradients<'_>,
    ) -> Result<Vec<(RowStats, RowOutcome)>, LossError> {
        self.zero_skipped(grads);
        let map = LogitMap::of(self.prepared.spec().options);
        // A skipped row's, as the row passes give an inactive row.
        let mut results = vec![(RowStats::default(), RowOutcome::ZERO); self.prepared.spec().rows.len()];
        let mut written = false;
        for chunk in self.chunks() {
            self.logits(&chunk);
            let n = chunk.len() * self.width();
            let rows = &self.computed[chunk.clone()];
            let block = chunk_block(self.prepared, &self.columns, rows);
            let got =
                cpu::sweep(GradientTarget::InPlace(&mut self.z[..n]), &block, objective, map, self.prepared.wanted())?;
            let live: Vec<bool> = got.iter().map(|(_, outcome)| !outcome.grad.is_zero()).collect();
            for (&row, r) in rows.iter().zip(got) {
                results[row] = r;
            }
            let live_rows = self.drop_zero_rows(&chunk, &live, grads);
            written |= self.backward(&live_rows, grads, written);
        }
        Self::finish(grads, written);
        Ok(results)
    }
}

/// `db (+)= ` the column sums of `dz` (`v` columns), in row order, columns split over threads:
/// deterministic.
fn bias_gradient(db: &mut [f32], dz: &[f32], v: usize, overwrite: bool) {
    db.par_chunks_mut(1024).enumerate().for_each(|(c, out)| {
        let c0 = c * 1024;
        if overwrite {
            out.fill(0.0);
        }
        let width = out.len();
        for row in dz.chunks_exact(v) {
            for (o, &g) in out.iter_mut().zip(&row[c0..c0 + width]) {
                *o += g;
            }
        }
    });
}

/// A chunk's `rows` over `columns`, as the CPU row passes take them. A free function (not a
/// method) so that it borrows only these fields while the chunk's logits are borrowed mutably.
fn chunk_block<'b>(prepared: &'b PreparedLoss<'_>, columns: &Range<usize>, rows: &'b [usize]) -> Block<'b> {
    Block::listed(&prepared.spec().rows, prepared.active_rows(), rows, columns.clone())
}

fn check_gradients(
    spec: &LossSpec<'_>,
    hidden_size: usize,
    columns: usize,
    grads: &LinearGradients<'_>,
) -> Result<(), LossError> {
    let (weight, bias) = (grads.weight.as_deref().map(<[f32]>::len), grads.bias.as_deref().map(<[f32]>::len));
    shapes::check_gradients(&spec.rows, hidden_size, columns, grads.hidden.len(), weight, bias)
}

/// The loss and per-token outputs of `hidden @ weight^T (+ bias)`, no gradient.
pub fn linear_forward<T: Element>(
    spec: LossSpec<'_>,
    inputs: LinearInputs<'_, T>,
    budget: ChunkBudget,
) -> Result<LossOutput, LossError> {
    let prepared = PreparedLoss::new(spec)?;
    let mut streamer = Streamer::new(&prepared, inputs, 0..spec.rows.vocab, budget)?;
    let stats = streamer.statistics(RowMax::Unneeded)?;
    Ok(prepared.objective(&stats)?.0)
}

/// The loss, per-token outputs, and the gradients of the loss with respect to `hidden`,
/// `weight` and `bias` (those asked for), in f32.
pub fn linear_forward_backward<T: Element>(
    spec: LossSpec<'_>,
    inputs: LinearInputs<'_, T>,
    mut grads: LinearGradients<'_>,
    budget: ChunkBudget,
) -> Result<LossOutput, LossError> {
    let prepared = PreparedLoss::new(spec)?;
    if !spec.has_gradient() {
        return Err(LossError::NoGradient { op: spec.loss.name() });
    }
    check_gradients(&spec, inputs.hidden_size, spec.rows.vocab, &grads)?;
    let mut streamer = Streamer::new(&prepared, inputs, 0..spec.rows.vocab, budget)?;
    if let Some(objective) = prepared.row_local_objective() {
        let rows = streamer.sweep(&objective, &mut grads)?;
        let (stats, outcomes): (Vec<RowStats>, Vec<_>) = rows.into_iter().unzip();
        return Ok(objective.output(
            &spec.rows,
            prepared.active_rows(),
            &stats,
            &outcomes,
            spec.options.predicted_tokens,
        ));
    }
    let stats = streamer.statistics(RowMax::Unneeded)?;
    let (output, row_grads) = prepared.objective(&stats)?;
    streamer.gradient(&row_grads, &mut grads);
    Ok(output)
}

/// A fused-linear loss over a vocabulary-sharded lm_head (tensor parallel): each shard holds the
/// weight rows (and bias entries) of its columns. Step 1 per shard, [`crate::combine_shards`],
/// step 2, then step 3 per shard: each shard's `grad_hidden` is a partial sum (all-reduce them),
/// its `grad_weight` and `grad_bias` are its own rows.
pub struct PreparedLinearLoss<'a> {
    prepared: PreparedLoss<'a>,
    budget: ChunkBudget,
}

impl<'a> PreparedLinearLoss<'a> {
    pub fn new(spec: LossSpec<'a>, budget: ChunkBudget) -> Result<Self, LossError> {
        Ok(Self { prepared: PreparedLoss::new(spec)?, budget })
    }

    /// Step 1 over the shard's columns.
    pub fn statistics<T: Element>(
        &self,
        shard: LinearInputs<'_, T>,
        columns: Range<usize>,
    ) -> Result<Vec<PartialRowStats>, LossError> {
        Streamer::new(&self.prepared, shard, columns, self.budget)?.statistics(RowMax::Reported)
    }

    /// Step 2 from the combined statistics of the whole vocabulary.
    pub fn objective(&self, stats: &[PartialRowStats]) -> Result<(LossOutput, Vec<RowGradient>), LossError> {
        self.prepared.objective(stats)
    }

    /// Step 3 over the shard's columns.
    pub fn gradient<T: Element>(
        &self,
        shard: LinearInputs<'_, T>,
        columns: Range<usize>,
        row_grads: &[RowGradient],
        mut grads: LinearGradients<'_>,
    ) -> Result<(), LossError> {
        let spec = self.prepared.spec();
        if !spec.has_gradient() {
            return Err(LossError::NoGradient { op: spec.loss.name() });
        }
        check_gradients(spec, shard.hidden_size, columns.len(), &grads)?;
        if row_grads.len() != spec.rows.len() {
            return Err(LossError::Shard(format!("{} row gradients for {} rows", row_grads.len(), spec.rows.len())));
        }
        Streamer::new(&self.prepared, shard, columns, self.budget)?.gradient(row_grads, &mut grads);
        Ok(())
    }
}

/// The rate of this machine's f32 matrix product on the fused-linear forward shape
/// (`[rows, h] @ [h, vocab]`), in GFLOP/s, best of three: what the products could reach.
pub fn matmul_gflops(rows: usize, hidden_size: usize, vocab: usize) -> f64 {
    let (n, h, v) = (rows.max(1), hidden_size.max(1), vocab.max(1));
    let hc: Vec<f32> = crate::synthetic::normal_matrix(n, h, 1.0, 1);
    let wt: Vec<f32> = crate::synthetic::normal_matrix(v, h, 0.05, 2);
    let mut z = vec![0.0f32; n * v];
    let mut best = f64::INFINITY;
    for _ in 0..3 {
        let start = std::time::Instant::now();
        matmul::matmul_nt(
            &mut MatMut { data: &mut z, rows: n, cols: v, stride: v },
            false,
            Mat { data: &hc, rows: n, cols: h, stride: h },
            Mat { data: &wt, rows: v, cols: h, stride: h },
        );
        best = best.min(start.elapsed().as_secs_f64());
    }
    std::hint::black_box(&z);
    2.0 * (n * h * v) as f64 / best / 1e9
}

/// The bf16 logits product's rate on this machine (GFLOP/s, best of 3, the products of
/// [`matmul_bf16`] as the fused-linear loss runs them), or `None` where bf16 is widened to f32
/// (then [`matmul_gflops`] is its rate).
pub fn matmul_bf16_gflops(rows: usize, hidden_size: usize, vocab: usize) -> Option<f64> {
    let products = matmul_bf16::current();
    if !products.packed() {
        return None;
    }
    let (n, h, v) = (rows.max(1), hidden_size.max(1), vocab.max(1));
    let bits = |x: Vec<f32>| -> Vec<u16> { x.into_iter().map(|x| half::bf16::from_f32(x).to_bits()).collect() };
    let hc = bits(crate::synthetic::normal_matrix(n, h, 1.0, 1));
    let wt = bits(crate::synthetic::normal_matrix(v, h, 0.05, 2));
    let mut z = vec![0.0f32; n * v];
    let mut packed = matmul_bf16::PackedHidden::default();
    let mut best = f64::INFINITY;
    for _ in 0..3 {
        let start = std::time::Instant::now();
        packed.pack(&hc, n, h, products);
        matmul_bf16::logits(&mut MatMut::new(&mut z, n, v), false, &packed, &wt, AMX_TILE);
        best = best.min(start.elapsed().as_secs_f64());
    }
    std::hint::black_box(&z);
    Some(2.0 * (n * h * v) as f64 / best / 1e9)
}
