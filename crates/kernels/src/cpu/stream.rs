//! Non-temporal (streaming) stores for gradients written into a new buffer: the destination
//! lines are written without first being read (no read-for-ownership), so writing the gradient
//! costs one pass over memory instead of two.

/// Copies `len` bytes from `src` to `dst`, streaming the 64-byte-aligned middle of `dst`.
///
/// # Safety
/// AVX-512F must be available; `src` and `dst` must be valid for `len` bytes and not overlap.
/// Call [`fence`] before another thread reads `dst`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
pub unsafe fn copy_nontemporal(dst: *mut u8, src: *const u8, len: usize) {
    use std::arch::x86_64::{__m512i, _mm512_loadu_si512, _mm512_stream_si512};
    let head = ((dst as usize).wrapping_neg() & 63).min(len);
    // SAFETY: the caller guarantees both ranges; each access below stays within `len`, and the
    // streamed addresses are 64-byte aligned.
    unsafe {
        std::ptr::copy_nonoverlapping(src, dst, head);
        let mut i = head;
        while i + 64 <= len {
            let v = _mm512_loadu_si512(src.add(i) as *const __m512i);
            _mm512_stream_si512(dst.add(i) as *mut __m512i, v);
            i += 64;
        }
        std::ptr::copy_nonoverlapping(src.add(i), dst.add(i), len - i);
    }
}

/// Orders earlier streaming stores before later stores (they are weakly ordered).
#[cfg(target_arch = "x86_64")]
pub fn fence() {
    // SAFETY: sfence has no preconditions (SSE is part of x86-64).
    unsafe { std::arch::x86_64::_mm_sfence() }
}
