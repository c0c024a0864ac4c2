//! A row's predicted token (`LossOptions::predicted_tokens`): the first column of its largest
//! logit, as `torch.argmax` and Liger's `predicted_tokens` give it.
//!
//! A pass of its own over the row rather than a term in the statistics loop, which is bound by its
//! FP operations (docs/BENCHMARKS.md, "Where the in-place sweep's time goes"): asked for, it reads
//! the row from cache after the statistics pass has brought it there (`Kernels::sweep_wanted`,
//! between the sweep's two passes; step 1's `statistics`, after each row part's); not asked for,
//! it costs nothing. The maximum of each block of 256 values (32 at a time, in the row kernels'
//! widening of [`Simd::load_pair_t`], whose even / odd layout a maximum does not mind), then the
//! first block holding the row's maximum searched for its first column: one vector `max` per 16
//! values (the first form, a maximum over the whole row and then a search from its start, took
//! ~1.5 passes of LLVM-vectorised loops). With a soft cap it runs on the capped values the losses
//! see (`softcap.rs`), where two logits may cap to the same f32.

use super::simd::{Simd, LANES};
use super::Kernels;
use crate::element::Element;
use crate::stats::Argmax;

/// Values per block: whole pairs of 32, few enough that searching one is cheap.
const BLOCK: usize = 256;

/// The largest value of `row` (as f32) and the first column holding it; `None` for an empty row.
/// A row holding a NaN (refused as non-finite by the statistics anyway) gives `None` or any
/// column, never a panic: a NaN makes a vector lane forget its earlier maximum.
#[inline(always)]
pub(super) fn first_max<S: Simd, T: Element>(s: S, row: &[T]) -> Option<(f32, usize)> {
    let mut best = f32::NEG_INFINITY;
    let mut first_block = None;
    for (b, block) in row.chunks(BLOCK).enumerate() {
        let m = block_max(s, block);
        if m > best || (first_block.is_none() && m == best) {
            (best, first_block) = (m, Some(b));
        }
    }
    let start = first_block? * BLOCK;
    let block = &row[start..(start + BLOCK).min(row.len())];
    let column = start + block.iter().position(|x| x.to_f32() == best)?;
    Some((best, column))
}

/// The largest value of a block without NaNs, -inf for an empty one.
#[inline(always)]
fn block_max<S: Simd, T: Element>(s: S, block: &[T]) -> f32 {
    let (pairs, full) = (block.len() / (2 * LANES) * (2 * LANES), block.len() / LANES * LANES);
    let (mut m0, mut m1) = (s.splat(f32::NEG_INFINITY), s.splat(f32::NEG_INFINITY));
    for pair in block[..pairs].chunks_exact(2 * LANES) {
        let (a, b) = s.load_pair_t(pair);
        (m0, m1) = (s.max(m0, a), s.max(m1, b));
    }
    if full > pairs {
        m0 = s.max(m0, s.load_t(&block[pairs..full]));
    }
    let lanes = s.to_array(s.max(m0, m1));
    let rest = block[full..].iter().map(|x| x.to_f32());
    lanes.into_iter().chain(rest).fold(f32::NEG_INFINITY, |m, v| if v > m { v } else { m })
}

impl<T: Element> Kernels<T> {
    /// The predicted token of a row part whose first column is `first_column` of the vocabulary.
    pub(super) fn argmax(&self, row: &[T], first_column: usize) -> Option<Argmax> {
        // SAFETY: `select` only picks kernels whose features `Isa::detected` found on this CPU.
        let found = unsafe { (self.first_max)(row) };
        found.map(|(value, column)| Argmax { value, column: first_column + column })
    }
}

#[cfg(test)]
mod tests {
    use half::{bf16, f16};

    use super::*;

    /// The first index of the largest value, in f64 over the widened values.
    fn reference<T: Element>(row: &[T]) -> Option<usize> {
        let mut best: Option<(f64, usize)> = None;
        for (j, x) in row.iter().enumerate() {
            let v = x.to_f32() as f64;
            if best.is_none_or(|(b, _)| v > b) {
                best = Some((v, j));
            }
        }
        best.map(|(_, j)| j)
    }

    fn check<T: Element>(values: &[f32]) {
        let row: Vec<T> = values.iter().map(|&v| T::from_f32(v)).collect();
        let got = Kernels::<T>::select().argmax(&row, 7);
        assert_eq!(got.map(|a| a.column - 7), reference(&row), "{:?} of {} values", T::DTYPE, row.len());
        if let Some(a) = got {
            assert_eq!(a.value, row[a.column - 7].to_f32());
        }
    }

    /// Every length around the lanes and the 256-value blocks, the largest value anywhere, ties
    /// within a block and across blocks (the first wins), values all equal, masking values, -inf
    /// rows, on every instruction set this CPU has.
    #[test]
    fn first_largest_column_on_every_instruction_set() {
        for isa in crate::cpu::isa::Isa::available() {
            crate::with_isa(isa, || {
                // 276 and 543: a later block ending in a 16-value vector and a scalar tail.
                for len in [1, 2, 15, 16, 17, 31, 33, 100, 255, 256, 257, 276, 300, 543, 1000, 1057] {
                    for at in [0, len / 3, len - 1, (len - len % 32 + 3).min(len - 1)] {
                        let mut v: Vec<f32> = (0..len).map(|j| ((j * 7919) % 97) as f32 * 0.01 - 0.5).collect();
                        v[at] = 3.0;
                        check::<f32>(&v);
                        check::<bf16>(&v);
                        check::<f16>(&v);
                        v[len - 1 - at / 2] = 3.0; // a tie: after `at`, at it, or (`at` last) before it
                        check::<f32>(&v);
                        check::<bf16>(&v);
                        check::<f16>(&v);
                    }
                    check::<f32>(&vec![-1.25; len]);
                    check::<f32>(&vec![f32::MIN; len]);
                    // -inf (a masked vocabulary entry) everywhere, or everywhere but one column.
                    let mut v = vec![f32::NEG_INFINITY; len];
                    check::<f32>(&v);
                    check::<bf16>(&v);
                    v[len * 2 / 3] = -7.0;
                    check::<f32>(&v);
                    check::<bf16>(&v);
                    check::<bf16>(&vec![0.0; len]);
                    // NaNs: refused by the statistics; here only no panic.
                    let k = Kernels::<f32>::select();
                    assert_eq!(k.argmax(&vec![f32::NAN; len], 0), None);
                    let mut v = vec![1.0f32; len];
                    v[len / 2] = f32::NAN;
                    let _ = k.argmax(&v, 0);
                }
            });
        }
        assert_eq!(Kernels::<f32>::select().argmax(&[], 0), None);
    }
}
