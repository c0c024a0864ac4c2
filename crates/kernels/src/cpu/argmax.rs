//! A row's predicted token (`LossOptions::predicted_tokens`): the first column of its largest
//! logit, as `torch.argmax` and Liger's `predicted_tokens` give it.
//!
//! A pass of its own over the row rather than a term in the statistics loop, which is bound by its
//! FP operations (docs/BENCHMARKS.md, "Where the in-place sweep's time goes"): asked for, it costs
//! a read of the row (from memory before the sweep, which then finds the row in cache); not asked
//! for, nothing. Two loops LLVM vectorises: the maximum over 16 lanes, then the first block of
//! 16 values holding it, compared 16 at a time, and the column within it. With a soft cap it runs on the capped values the losses see
//! (`softcap.rs`), where two logits may cap to the same f32.

use super::Kernels;
use crate::element::Element;
use crate::stats::Argmax;

/// Values compared at once: one AVX-512 vector of f32.
const LANES: usize = 16;

/// The largest value of `row` (as f32) and the first column holding it; `None` for an empty row,
/// or one with no value above -inf and none equal to it (NaNs only: refused as non-finite anyway).
#[inline(always)]
pub(super) fn first_max<T: Element>(row: &[T]) -> Option<(f32, usize)> {
    let mut lanes = [f32::NEG_INFINITY; LANES];
    let mut chunks = row.chunks_exact(LANES);
    for chunk in &mut chunks {
        for (m, x) in lanes.iter_mut().zip(chunk) {
            let v = x.to_f32();
            *m = if v > *m { v } else { *m };
        }
    }
    let rest = chunks.remainder().iter().map(|x| x.to_f32());
    let best = lanes.into_iter().chain(rest).fold(f32::NEG_INFINITY, |m, v| if v > m { v } else { m });
    let holds = |chunk: &[T]| chunk.iter().fold(false, |found, x| found | (x.to_f32() == best));
    let start = row.chunks(LANES).position(holds)? * LANES;
    let column = start + row[start..].iter().position(|x| x.to_f32() == best)?;
    Some((best, column))
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

    /// Every length around the lanes, the largest value anywhere, ties (the first wins), values
    /// all equal, masking values, on every instruction set this CPU has.
    #[test]
    fn first_largest_column_on_every_instruction_set() {
        for isa in crate::cpu::isa::Isa::available() {
            crate::with_isa(isa, || {
                for len in [1, 2, 15, 16, 17, 31, 33, 100, 257] {
                    for at in [0, len / 3, len - 1] {
                        let mut v: Vec<f32> = (0..len).map(|j| ((j * 7919) % 97) as f32 * 0.01 - 0.5).collect();
                        v[at] = 3.0;
                        check::<f32>(&v);
                        check::<bf16>(&v);
                        check::<f16>(&v);
                        v[len - 1 - at / 2] = 3.0; // a tie, after or at `at`
                        check::<f32>(&v);
                        check::<bf16>(&v);
                    }
                    check::<f32>(&vec![-1.25; len]);
                    check::<f32>(&vec![f32::MIN; len]);
                    check::<bf16>(&vec![0.0; len]);
                }
            });
        }
        assert_eq!(Kernels::<f32>::select().argmax(&[], 0), None);
    }
}
