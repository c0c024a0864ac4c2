//! The memory floor of a logits-level step on the CPU, measured as a pass with the step's own
//! traffic over the step's own buffers, right before its steps: `fused-inplace` reads every line
//! of the logits and writes it back (the gradient over them), so its floor is a pass that flips a
//! bit of every byte in place (an even number of passes leaves the logits as they were); `fused`
//! reads the logits and writes the gradient buffer with streaming stores (the kernels' stores for
//! a gradient of 64 MiB or more), so its floor is a streamed copy of one into the other (streamed
//! whatever the size: below 64 MiB, where the kernels store plainly and the buffers fit in
//! cache, the ratio says less). `fused` with a fresh gradient buffer each step has no such floor.
//!
//! Why the step's own buffers: on the Zen 5 host of 2026-11-30 the rate of a pass over a fresh
//! buffer was one of two from one process to the next (a copy of 311 MB at ~40 or ~68 GB/s),
//! uncorrelated with the step's time, so a floor over other memory than the step's said 1.2x in
//! one process and 2.2x in the next. And why not the plain copy (`bench/copy_gbps`, the older
//! floor): its stores read the destination's lines first, which neither step does; it ran
//! 10.4-15.0 ms for 311 MB where the in-place pass ran 6.8-9.5 ms (docs/BENCHMARKS.md, "The floor
//! of each logits-level step, measured as its own traffic").

use std::time::Instant;

use flashgrpo_kernels::Element;
use rayon::prelude::*;

/// Passes timed (even, so that the in-place passes restore every bit); the best counts.
const PASSES: usize = 8;
const _: () = assert!(PASSES.is_multiple_of(2), "the in-place passes must leave the logits as they were");

/// The bytes of a buffer of [`Element`]s (f32, bf16, f16: no padding, every bit pattern a value).
fn bytes_of<T: Element>(values: &[T]) -> &[u8] {
    // SAFETY: `Element` is sealed to f32, bf16 and f16, plain values without padding; the bytes
    // live as long as `values`.
    unsafe { std::slice::from_raw_parts(values.as_ptr().cast(), std::mem::size_of_val(values)) }
}

fn bytes_of_mut<T: Element>(values: &mut [T]) -> &mut [u8] {
    // SAFETY: as `bytes_of`; every byte pattern written is a valid f32, bf16 or f16.
    unsafe { std::slice::from_raw_parts_mut(values.as_mut_ptr().cast(), std::mem::size_of_val(values)) }
}

fn chunk_of(len: usize) -> usize {
    len.div_ceil(rayon::current_num_threads()).max(1 << 16)
}

/// The best time (s) of a pass that reads every byte of `logits` and writes it back changed;
/// `logits` end as they began.
pub fn in_place_seconds<T: Element>(logits: &mut [T]) -> f64 {
    let bytes = bytes_of_mut(logits);
    let chunk = chunk_of(bytes.len());
    best_of(|| bytes.par_chunks_mut(chunk).for_each(|c| c.iter_mut().for_each(|b| *b ^= 1)))
}

/// The best time (s) of a streamed copy of `logits` into `grad` (same length).
pub fn streamed_seconds<T: Element>(logits: &[T], grad: &mut [T]) -> f64 {
    assert_eq!(logits.len(), grad.len(), "pass_floor: lengths");
    let (src, dst) = (bytes_of(logits), bytes_of_mut(grad));
    let chunk = chunk_of(src.len());
    best_of(|| dst.par_chunks_mut(chunk).zip(src.par_chunks(chunk)).for_each(|(d, s)| streamed_copy(d, s)))
}

fn best_of(mut pass: impl FnMut()) -> f64 {
    let mut best = f64::INFINITY;
    for _ in 0..PASSES {
        let start = Instant::now();
        pass();
        best = best.min(start.elapsed().as_secs_f64());
    }
    best
}

/// `dst = src` with non-temporal stores where the CPU has them (the lines are not read first).
fn streamed_copy(dst: &mut [u8], src: &[u8]) {
    assert_eq!(dst.len(), src.len(), "streamed_copy: lengths");
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_sfence, _mm_stream_si128};
        const LINE: usize = 16;
        let head = dst.as_ptr().align_offset(LINE).min(dst.len());
        dst[..head].copy_from_slice(&src[..head]);
        let body = (dst.len() - head) / LINE * LINE;
        for k in (head..head + body).step_by(LINE) {
            // SAFETY: SSE2 is part of x86_64; `k + 16 <= len` for both slices, and `dst + k` is
            // 16-byte aligned (`head` aligns it, and `k - head` is a multiple of 16).
            unsafe {
                let value = _mm_loadu_si128(src.as_ptr().add(k).cast::<__m128i>());
                _mm_stream_si128(dst.as_mut_ptr().add(k).cast::<__m128i>(), value);
            }
        }
        dst[head + body..].copy_from_slice(&src[head + body..]);
        // SAFETY: SSE's store fence: the streamed lines are visible before the pass counts as done.
        unsafe { _mm_sfence() };
    }
    #[cfg(not(target_arch = "x86_64"))]
    dst.copy_from_slice(src);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_streamed_copy_copies_every_byte_whatever_the_alignment() {
        let src: Vec<u8> = (0..1037u32).map(|i| (i * 7 % 251) as u8).collect();
        for offset in 0..17 {
            let mut dst = vec![0xAAu8; 1037 + offset];
            streamed_copy(&mut dst[offset..], &src);
            assert_eq!(&dst[offset..], &src[..], "offset {offset}");
            assert!(dst[..offset].iter().all(|&v| v == 0xAA), "offset {offset}: wrote before the slice");
        }
    }

    #[test]
    fn the_in_place_passes_leave_the_logits_as_they_were() {
        let logits: Vec<half::bf16> = (0..100_003).map(|i| half::bf16::from_f32(i as f32 * 0.25 - 7.0)).collect();
        let mut passed = logits.clone();
        assert!(in_place_seconds(&mut passed) > 0.0);
        assert_eq!(passed, logits);
        let mut grad = vec![half::bf16::ZERO; logits.len()];
        assert!(streamed_seconds(&logits, &mut grad) > 0.0);
        assert_eq!(grad, logits);
    }
}
