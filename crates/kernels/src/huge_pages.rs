//! Fresh large buffers backed by 2 MiB pages. A buffer just allocated (the fused-linear chunk's
//! logits, XLA's result buffers, a new PyTorch tensor) is untouched memory: the first write
//! faults in every 4 KiB page of it, which for an `[N, V]` gradient at N=1024, V=151936 costs
//! 2-4x the kernels' whole sweep on the machine measured, and a sweep over 4 KiB pages misses the
//! TLB every 4 KiB. Where transparent huge pages are on `madvise` (Debian's and Ubuntu's default),
//! asking for them turns 512 faults into one (docs/BENCHMARKS.md, "Again on cpu-2c (2026-11-27)":
//! the in-place sweeps 6-12% faster with every buffer on huge pages; the fused-linear chunk's
//! logits alone advised, the bf16 step at N=1024 3% faster).

/// Advises the kernel to back `[address, address + bytes)` with huge pages (the whole 2 MiB pages
/// inside it). A hint: errors are ignored, and memory already faulted in is not changed.
pub fn advise(address: usize, bytes: usize) {
    const HUGE: usize = 2 << 20;
    if bytes < 2 * HUGE {
        return;
    }
    let start = address.next_multiple_of(HUGE);
    let end = (address + bytes) / HUGE * HUGE;
    if end > start {
        #[cfg(target_os = "linux")]
        // SAFETY: madvise on pages of a live buffer of the caller's; MADV_HUGEPAGE changes no data.
        unsafe {
            libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_HUGEPAGE);
        }
    }
}

/// `len` zeros on fresh pages, advised as above before anything touches them (`vec![0.0; len]`
/// takes zeroed pages from the allocator without writing them).
pub fn zeroed_f32(len: usize) -> Vec<f32> {
    let values = vec![0.0f32; len];
    advise(values.as_ptr() as usize, 4 * len);
    values
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zeroed_buffers_are_zeros_of_the_length_asked_and_writable() {
        // Below, at and above the 4 MiB where the advice starts (a hint whatever the system's
        // setting, never an error).
        for len in [0, 1, 1 << 20, (1 << 20) + 3, 3 << 20] {
            let mut v = zeroed_f32(len);
            assert_eq!(v.len(), len);
            assert!(v.iter().all(|&x| x == 0.0));
            v.iter_mut().enumerate().for_each(|(i, x)| *x = i as f32);
            assert!(v.iter().enumerate().all(|(i, &x)| x == i as f32));
        }
    }
}
