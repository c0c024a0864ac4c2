//! The CPU streaming engine: steps 1 and 3 over all rows, rows spread over rayon's threads.
//! Each row is computed by one thread in a fixed order, so the results do not depend on the
//! number of threads (threads may share the cache line where one row ends and the next begins,
//! when a row's bytes are not a multiple of 64: correct, at most a line's traffic per row).
//!
//! Where the objective is row-local (everything but sequence-level GRPO), [`sweep`] runs all
//! three steps on a row before moving on: the row is read from memory once, and the gradient pass
//! rereads it from cache (a 151936-wide f32 row is 594 KiB and fits in L2).

mod argmax;
mod class_weights;
pub mod isa;
mod math;
mod row;
mod simd;
mod softcap;

use std::ops::Range;

use rayon::prelude::*;

use crate::element::Element;
use crate::error::LossError;
use crate::inputs::Rows;
use crate::objective::{Objective, RowGradient, RowOutcome};
use crate::options::LossOptions;
use crate::stats::{inverse_temperature, Argmax, PartialRowStats, RowStats};
use isa::Isa;

/// Where step 3 writes (for a whole batch, or for one row).
pub enum GradientTarget<'a, T> {
    /// Read the logits, write the gradient into `out` (same shape).
    Into { logits: &'a [T], out: &'a mut [T] },
    /// Overwrite the logits with their gradient.
    InPlace(&'a mut [T]),
}

impl<'a, T> GradientTarget<'a, T> {
    /// The logits read (in place, the buffer that is also written).
    pub(crate) fn logits(&self) -> &[T] {
        match self {
            GradientTarget::Into { logits, .. } => logits,
            GradientTarget::InPlace(logits) => logits,
        }
    }

    /// The size of the buffer written.
    fn written_bytes(&self) -> usize {
        match self {
            GradientTarget::Into { out, .. } => std::mem::size_of_val(*out),
            GradientTarget::InPlace(logits) => std::mem::size_of_val(*logits),
        }
    }

    /// What is read (`None`: the row itself) and what is written.
    pub(crate) fn into_parts(self) -> (Option<&'a [T]>, &'a mut [T]) {
        match self {
            GradientTarget::Into { logits, out } => (Some(logits), out),
            GradientTarget::InPlace(row) => (None, row),
        }
    }

    /// The target of [`into_parts`](Self::into_parts)'s parts.
    pub(crate) fn of_parts(logits: Option<&'a [T]>, out: &'a mut [T]) -> Self {
        match logits {
            Some(logits) => GradientTarget::Into { logits, out },
            None => GradientTarget::InPlace(out),
        }
    }
}

type StatsFn<T> = unsafe fn(&[T], f32, Option<usize>, bool, RowMax) -> PartialRowStats;
type GradFn<T> = for<'a> unsafe fn(GradientTarget<'a, T>, &RowGradient, f32, Option<usize>, bool);
/// What [`sweep`] does with a row's statistics (the row kernel's own sweep takes it as
/// [`RowFinish`]). They may be relative to a reference below the row's maximum (the base-2 pass
/// does not track it, `row::statistics_pass::statistics_base2`): use them through
/// [`PartialRowStats::finish`] and [`PartialRowStats::is_finite`], not their `max`.
type Finish<'f> = &'f mut dyn FnMut(PartialRowStats) -> Option<RowGradient>;
/// [`Finish`] as the row kernel's sweep calls it: with the row's logits (or capped values), still
/// in cache after the statistics pass and not yet overwritten, for what [`Wanted`] adds to them.
type RowFinish<'f, T> = &'f mut dyn FnMut(PartialRowStats, &[T]) -> Option<RowGradient>;
type SweepFn<T> =
    for<'a, 'f> unsafe fn(GradientTarget<'a, T>, f32, Option<usize>, bool, bool, RowFinish<'f, T>) -> bool;
type ZeroFn<T> = unsafe fn(&mut [T], bool);
type CapFn<T> = unsafe fn(&[T], f32, &mut [f32]);
type ChainFn<T> = unsafe fn(&[f32], Option<&[T]>, &mut [T], f32);
type FirstMaxFn<T> = unsafe fn(&[T]) -> Option<(f32, usize)>;
type WeightedSumFn<T> = unsafe fn(&[T], &[f32]) -> f32;
type GradWeightedFn<T> = for<'a> unsafe fn(GradientTarget<'a, T>, &RowGradient, f32, Option<usize>, &[f32]);

/// The row kernels compiled for one instruction set.
#[derive(Clone, Copy)]
struct Kernels<T> {
    statistics: StatsFn<T>,
    gradient: GradFn<T>,
    sweep: SweepFn<T>,
    zero_row: ZeroFn<T>,
    cap: CapFn<T>,
    chain: ChainFn<T>,
    first_max: FirstMaxFn<T>,
    weighted_sum: WeightedSumFn<T>,
    gradient_weighted: GradWeightedFn<T>,
}

/// Compiles the row kernels for one instruction set: `$simd` is the [`simd::Simd`] token.
macro_rules! isa_kernels {
    ($module:ident, [$(#[$attr:meta])*], $simd:expr) => {
        mod $module {
            use super::*;

            /// # Safety
            /// The CPU must support the features this module is compiled for.
            $(#[$attr])*
            pub unsafe fn statistics<T: Element>(row: &[T], inv_t: f32, target: Option<usize>, sum_u: bool, max: RowMax) -> PartialRowStats {
                row::statistics($simd, row, inv_t, target, sum_u, max)
            }

            /// # Safety
            /// As for `statistics`.
            $(#[$attr])*
            pub unsafe fn gradient<T: Element>(dst: GradientTarget<'_, T>, g: &RowGradient, inv_t: f32, target: Option<usize>, large: bool) {
                row::gradient($simd, dst, g, inv_t, target, large)
            }

            /// # Safety
            /// As for `statistics`.
            $(#[$attr])*
            pub unsafe fn sweep<T: Element>(dst: GradientTarget<'_, T>, inv_t: f32, target: Option<usize>, sum_u: bool, large: bool, finish: RowFinish<'_, T>) -> bool {
                row::sweep($simd, dst, inv_t, target, sum_u, large, finish)
            }

            /// # Safety
            /// As for `statistics`.
            $(#[$attr])*
            pub unsafe fn zero_row<T: Element>(out: &mut [T], stream: bool) {
                row::zero_row($simd, out, stream)
            }

            /// # Safety
            /// As for `statistics`.
            $(#[$attr])*
            pub unsafe fn cap<T: Element>(row: &[T], cap: f32, out: &mut [f32]) {
                softcap::cap_row($simd, row, cap, out)
            }

            /// # Safety
            /// As for `statistics`.
            $(#[$attr])*
            pub unsafe fn chain<T: Element>(grad: &[f32], logits: Option<&[T]>, out: &mut [T], cap: f32) {
                softcap::chain_row($simd, grad, logits, out, cap)
            }

            /// # Safety
            /// As for `statistics`.
            $(#[$attr])*
            pub unsafe fn first_max<T: Element>(row: &[T]) -> Option<(f32, usize)> {
                argmax::first_max($simd, row)
            }

            /// # Safety
            /// As for `statistics`.
            $(#[$attr])*
            pub unsafe fn weighted_sum<T: Element>(row: &[T], weights: &[f32]) -> f32 {
                class_weights::weighted_sum(row, weights)
            }

            /// # Safety
            /// As for `statistics`.
            $(#[$attr])*
            pub unsafe fn gradient_weighted<T: Element>(dst: GradientTarget<'_, T>, g: &RowGradient, inv_t: f32, target: Option<usize>, weights: &[f32]) {
                row::gradient_weighted($simd, dst, g, inv_t, target, weights)
            }

            pub fn kernels<T: Element>() -> Kernels<T> {
                Kernels {
                    statistics: statistics::<T>,
                    gradient: gradient::<T>,
                    sweep: sweep::<T>,
                    zero_row: zero_row::<T>,
                    cap: cap::<T>,
                    chain: chain::<T>,
                    first_max: first_max::<T>,
                    weighted_sum: weighted_sum::<T>,
                    gradient_weighted: gradient_weighted::<T>,
                }
            }
        }
    };
}

#[cfg(target_arch = "x86_64")]
isa_kernels!(
    avx512bf16,
    [#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512bf16,avx2,fma,bmi1,bmi2")]],
    // SAFETY: the module's functions are compiled with these features and called only after
    // `isa::current` found them (`Kernels::select`).
    unsafe { simd::Avx512::<true>::new() }
);
#[cfg(target_arch = "x86_64")]
isa_kernels!(
    avx512,
    [#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,bmi1,bmi2")]],
    // SAFETY: as for `avx512bf16`.
    unsafe { simd::Avx512::<false>::new() }
);
#[cfg(target_arch = "x86_64")]
isa_kernels!(
    avx2,
    [#[target_feature(enable = "avx2,fma,f16c,bmi1,bmi2")]],
    // SAFETY: as for `avx512bf16`.
    unsafe { simd::Avx2::new() }
);
isa_kernels!(generic, [], simd::Portable::<false>);

impl<T: Element> Kernels<T> {
    /// The kernels of the calling thread's instruction set ([`isa::current`]).
    fn select() -> Self {
        match isa::current() {
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512Bf16 => avx512bf16::kernels(),
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => avx512::kernels(),
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => avx2::kernels(),
            _ => generic::kernels(),
        }
    }

    fn statistics(&self, row: &[T], inv_t: f32, target: Option<usize>, sum_u: bool, max: RowMax) -> PartialRowStats {
        // SAFETY: `select` only picks kernels whose features `Isa::detected` found on this CPU.
        unsafe { (self.statistics)(row, inv_t, target, sum_u, max) }
    }

    fn gradient(&self, dst: GradientTarget<'_, T>, g: &RowGradient, inv_t: f32, target: Option<usize>, large: bool) {
        // SAFETY: as in `statistics`.
        unsafe { (self.gradient)(dst, g, inv_t, target, large) }
    }

    #[allow(clippy::too_many_arguments)] // the row kernel's own arguments, passed through
    fn sweep(
        &self,
        dst: GradientTarget<'_, T>,
        inv_t: f32,
        target: Option<usize>,
        sum_u: bool,
        large: bool,
        finish: RowFinish<'_, T>,
    ) -> bool {
        // SAFETY: as in `statistics`.
        unsafe { (self.sweep)(dst, inv_t, target, sum_u, large, finish) }
    }

    fn zero_row(&self, out: &mut [T], stream: bool) {
        // SAFETY: as in `statistics`.
        unsafe { (self.zero_row)(out, stream) }
    }

    /// `c tanh(x / c)` of a row into `out` ([`softcap`]).
    fn cap(&self, row: &[T], cap: f32, out: &mut [f32]) {
        // SAFETY: as in `statistics`.
        unsafe { (self.cap)(row, cap, out) }
    }

    /// `out = grad * sech^2(x / c)` ([`softcap`]).
    fn chain(&self, grad: &[f32], logits: Option<&[T]>, out: &mut [T], cap: f32) {
        // SAFETY: as in `statistics`.
        unsafe { (self.chain)(grad, logits, out, cap) }
    }
}

/// A gradient written into a new buffer of at least this many bytes goes there by non-temporal
/// stores where the row kernels have them (16-bit dtypes on AVX-512 and AVX2, f32 too on AMD
/// CPUs, `isa::streams_f32`; [`row::sweep`], and [`gradient`]'s recomputing pass; in place only
/// the zeros of a row without a gradient, [`row::zero_row`], whose logits are not read): larger
/// than the last-level cache of the machines we measure on, so its lines would not be in cache
/// when read anyway, and a plain store would first read each line it writes. On AMD Zen 4 the
/// bf16 `fused` step took 19-25% less time, the f32 one 12-21% (docs/BENCHMARKS.md); a smaller
/// gradient stays in cache for its reader.
const STREAM_MIN_BYTES: usize = 64 << 20;

/// Rows per rayon task: enough elements that scheduling costs nothing next to the work.
fn rows_per_task(width: usize) -> usize {
    (1 << 15) / width.max(1) + 1
}

/// The target's index within the columns `columns`, if it falls there.
fn local_target(rows: &Rows, row: usize, columns: &Range<usize>) -> Option<usize> {
    let y = *rows.targets?.get(row)?;
    (y >= columns.start as i64 && y < columns.end as i64).then(|| y as usize - columns.start)
}

pub(crate) fn non_finite(rows: &Rows, row: usize) -> LossError {
    let (b, t) = rows.position(row);
    LossError::NonFiniteLogits { row, b, t }
}

/// Which part of the `[N, V]` logits a buffer holds: `len` rows of the batch described by `rows`
/// (all of them, or the rows `listed`, in that order, as a fused-linear chunk of active rows holds
/// them) over the vocabulary columns `columns`.
#[derive(Clone)]
pub(crate) struct Block<'a> {
    pub rows: &'a Rows<'a>,
    pub active: &'a [bool],
    pub listed: Option<&'a [usize]>,
    pub len: usize,
    pub columns: Range<usize>,
}

impl<'a> Block<'a> {
    /// The whole batch, over `columns`.
    pub fn all_rows(rows: &'a Rows<'a>, active: &'a [bool], columns: Range<usize>) -> Self {
        Self { rows, active, listed: None, len: rows.len(), columns }
    }

    /// The listed rows of the batch, in that order, over `columns`.
    pub fn listed(rows: &'a Rows<'a>, active: &'a [bool], listed: &'a [usize], columns: Range<usize>) -> Self {
        Self { rows, active, listed: Some(listed), len: listed.len(), columns }
    }

    /// The batch row held at `local`, the buffer's row.
    fn row(&self, local: usize) -> usize {
        self.listed.map_or(local, |rows| rows[local])
    }

    fn target(&self, row: usize) -> Option<usize> {
        local_target(self.rows, row, &self.columns)
    }
}

/// Whether step 1 reports each row part's maximum, as [`PartialRowStats`] defines its sums (a
/// vocabulary shard's statistics, for [`PartialRowStats::combine`]), or may leave the sums
/// relative to a reference below it (a whole row's, which only reach [`PartialRowStats::finish`]):
/// the base-2 pass then skips one vector operation of ~12 per 16 logits
/// (`row::statistics_pass::statistics_base2`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RowMax {
    Reported,
    Unneeded,
}

/// How a row's logits become the `u` the losses see: `x / T`, or with a soft cap `c`,
/// `c tanh(x / c) / T` ([`softcap`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct LogitMap {
    pub temperature: f64,
    /// The cap in f32, as the row kernels apply it.
    pub softcap: Option<f32>,
}

impl LogitMap {
    pub fn of(options: &LossOptions) -> Self {
        Self { temperature: options.temperature, softcap: options.softcap.map(|c| c as f32) }
    }
}

/// Which `sum u` a row's statistics carry ([`PartialRowStats::sum_u`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum SumU<'a> {
    /// None: no objective reads it.
    Skip,
    /// `sum_j u_j` (label smoothing), which the row kernels sum as they go.
    Plain,
    /// `sum_j c_j u_j`, with the class weights `c` of the whole vocabulary (label smoothing with
    /// class weights): a pass of its own ([`class_weights`]); the gradient's `d` term is then
    /// `d c_j` too.
    Weighted(&'a [f32]),
}

impl<'a> SumU<'a> {
    /// The class weights of the gradient's `d` term, when it has them.
    pub fn weights(self) -> Option<&'a [f32]> {
        match self {
            SumU::Weighted(c) => Some(c),
            _ => None,
        }
    }
}

/// What step 1 adds to the row kernels' own statistics of a row part.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Wanted<'a> {
    pub sum_u: SumU<'a>,
    /// The part's argmax (`LossOptions::predicted_tokens`).
    pub argmax: bool,
}

impl Wanted<'_> {
    /// Whether the row kernels sum `u` themselves.
    fn kernel_sum_u(&self) -> bool {
        self.sum_u == SumU::Plain
    }
}

/// What passes of their own add to the row kernels' statistics of a row part ([`Wanted`]).
#[derive(Debug, Clone, Copy, Default)]
struct Extras {
    weighted_sum_u: Option<f32>,
    argmax: Option<Argmax>,
}

impl Extras {
    fn apply(self, p: PartialRowStats) -> PartialRowStats {
        PartialRowStats { sum_u: self.weighted_sum_u.unwrap_or(p.sum_u), argmax: self.argmax, ..p }
    }
}

impl<T: Element> Kernels<T> {
    /// What `wanted` adds to the statistics of a row part (its logits or capped values `row`,
    /// from column `first` of the vocabulary).
    fn extras(&self, row: &[T], first: usize, wanted: Wanted<'_>, inv_t: f32) -> Extras {
        Extras {
            weighted_sum_u: wanted
                .sum_u
                .weights()
                .map(|c| self.weighted_sum(row, &c[first..first + row.len()]) * inv_t),
            argmax: if wanted.argmax { self.argmax(row, first) } else { None },
        }
    }

    /// [`Kernels::sweep`] over a whole row with the argmax `wanted` adds to its statistics, read
    /// from the row between the statistics pass and the gradient's, while the row is in cache and
    /// before the gradient overwrites it (read first, as a pass of its own, it took the row from
    /// memory with no arithmetic to hide behind: docs/BENCHMARKS.md). Class weights take
    /// [`Kernels::weighted_sweep`].
    fn sweep_wanted(
        &self,
        dst: GradientTarget<'_, T>,
        inv_t: f32,
        target: Option<usize>,
        wanted: Wanted<'_>,
        large: bool,
        finish: Finish<'_>,
    ) -> bool {
        debug_assert!(wanted.sum_u.weights().is_none(), "class weights take weighted_sweep");
        let with_extras: RowFinish<'_, T> = &mut |p, row| finish(self.extras(row, 0, wanted, inv_t).apply(p));
        self.sweep(dst, inv_t, target, wanted.kernel_sum_u(), large, with_extras)
    }
}

/// Step 1: partial statistics of every active row of the block (`logits` holds
/// `[block.len, columns.len()]`), with what `wanted` adds.
/// Inactive rows are not read. A NaN or Inf makes the lowest such row an error.
pub(crate) fn statistics<T: Element>(
    logits: &[T],
    block: &Block<'_>,
    map: LogitMap,
    wanted: Wanted<'_>,
    max: RowMax,
) -> Result<Vec<PartialRowStats>, LossError> {
    let width = block.columns.len();
    let inv_t = inverse_temperature(map.temperature);
    if width == 0 {
        return Ok(vec![PartialRowStats::EMPTY; block.len]);
    }
    let k = Kernels::<T>::select();
    let k32 = Kernels::<f32>::select();
    let first = block.columns.start;
    let stats: Vec<PartialRowStats> = logits
        .par_chunks(width)
        .with_min_len(rows_per_task(width))
        .enumerate()
        .map(|(local, r)| {
            let i = block.row(local);
            if !block.active[i] {
                return PartialRowStats::EMPTY;
            }
            match map.softcap {
                None => {
                    let p = k.statistics(r, inv_t, block.target(i), wanted.kernel_sum_u(), max);
                    k.extras(r, first, wanted, inv_t).apply(p)
                }
                Some(cap) => k.capped_statistics(&k32, r, cap, inv_t, block.target(i), first, wanted, max),
            }
        })
        .collect();
    match (0..stats.len()).find(|&l| block.active[block.row(l)] && !stats[l].is_finite()) {
        Some(local) => Err(non_finite(block.rows, block.row(local))),
        None => Ok(stats),
    }
}

/// Step 3: the gradient of every row of the block; `grads` is indexed by global row. With
/// `class_weights` (of the whole vocabulary), each row's `d` term is `d c_j`.
pub(crate) fn gradient<T: Element>(
    target: GradientTarget<'_, T>,
    block: &Block<'_>,
    grads: &[RowGradient],
    map: LogitMap,
    class_weights: Option<&[f32]>,
) {
    let width = block.columns.len();
    if width == 0 {
        return;
    }
    let inv_t = inverse_temperature(map.temperature);
    let min_len = rows_per_task(width);
    let k = Kernels::<T>::select();
    let k32 = Kernels::<f32>::select();
    let weights = class_weights.map(|c| &c[block.columns.clone()]);
    // Class-weighted rows go out by plain stores (`row::gradient_weighted`).
    let large = target.written_bytes() >= STREAM_MIN_BYTES && weights.is_none();
    let one_row = |l: usize, write: GradientTarget<'_, T>| {
        let i = block.row(l);
        let g = &grads[i];
        match (map.softcap, weights) {
            // A zero gradient is written without reading the logits.
            (Some(cap), _) if !g.is_zero() => k.capped_gradient(&k32, write, g, inv_t, block.target(i), cap, weights),
            (_, Some(c)) => k.weighted_gradient(write, g, inv_t, block.target(i), c),
            _ => k.gradient(write, g, inv_t, block.target(i), large),
        }
    };
    match target {
        GradientTarget::Into { logits, out } => out
            .par_chunks_mut(width)
            .zip(logits.par_chunks(width))
            .with_min_len(min_len)
            .enumerate()
            .for_each(|(l, (out, logits))| one_row(l, GradientTarget::Into { logits, out })),
        GradientTarget::InPlace(logits) => logits
            .par_chunks_mut(width)
            .with_min_len(min_len)
            .enumerate()
            .for_each(|(l, r)| one_row(l, GradientTarget::InPlace(r))),
    }
}

/// Steps 1 to 3 row by row, for a row-local objective, over a block of whole rows (columns
/// `0..V`), with what `wanted` adds to the statistics (taken before the gradient overwrites a
/// row; class-weighted `sum u`: the gradient's `d` term is `d c_j`). Returns each row's
/// statistics and outcome in order, or the lowest row with a NaN or Inf (whose gradient is not
/// written; other rows' may be).
pub(crate) fn sweep<T: Element>(
    target: GradientTarget<'_, T>,
    block: &Block<'_>,
    objective: &Objective<'_>,
    map: LogitMap,
    wanted: Wanted<'_>,
) -> Result<Vec<(RowStats, RowOutcome)>, LossError> {
    debug_assert!(objective.is_row_local());
    debug_assert_eq!(block.columns, 0..block.rows.vocab);
    let width = block.rows.vocab;
    let inv_t = inverse_temperature(map.temperature);
    let k = Kernels::<T>::select();
    let k32 = Kernels::<f32>::select();
    let weights = wanted.sum_u.weights();
    // Masked rows' zeros stream in place too (their logits are not read); the sweep streams
    // computed rows only into a new buffer (in place, it has just read the row's lines), and not
    // class-weighted ones (`weighted_sweep`).
    let large = target.written_bytes() >= STREAM_MIN_BYTES;
    let one_row = |i: usize, write: GradientTarget<'_, T>| -> Option<(RowStats, RowOutcome)> {
        let y = block.target(i);
        if !block.active[i] {
            k.zero_row(write.into_parts().1, large);
            return Some((RowStats::default(), RowOutcome::ZERO));
        }
        let mut result = None;
        let mut finish = |partial: PartialRowStats| {
            if !partial.is_finite() {
                return None;
            }
            let stats = partial.finish(width, map.temperature);
            let outcome = objective.row(i, &stats);
            result = Some((stats, outcome));
            Some(outcome.grad)
        };
        match map.softcap {
            Some(cap) => k.capped_sweep(&k32, write, inv_t, y, wanted, cap, &mut finish),
            None => match weights {
                Some(c) => k.weighted_sweep(write, inv_t, y, wanted, c, &mut finish),
                None => k.sweep_wanted(write, inv_t, y, wanted, large, &mut finish),
            },
        };
        result
    };
    let min_len = rows_per_task(width);
    let results: Vec<Option<(RowStats, RowOutcome)>> = match target {
        GradientTarget::Into { logits, out } => out
            .par_chunks_mut(width)
            .zip(logits.par_chunks(width))
            .with_min_len(min_len)
            .enumerate()
            .map(|(l, (out, logits))| one_row(block.row(l), GradientTarget::Into { logits, out }))
            .collect(),
        GradientTarget::InPlace(logits) => logits
            .par_chunks_mut(width)
            .with_min_len(min_len)
            .enumerate()
            .map(|(l, r)| one_row(block.row(l), GradientTarget::InPlace(r)))
            .collect(),
    };
    match results.iter().position(Option::is_none) {
        Some(local) => Err(non_finite(block.rows, block.row(local))),
        None => Ok(results.into_iter().flatten().collect()),
    }
}
