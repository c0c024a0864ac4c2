//! Fresh output buffers backed by 2 MiB pages. A gradient buffer the framework has just
//! allocated (XLA's result buffers, a new PyTorch tensor) is untouched memory: the kernels' first
//! write faults in every 4 KiB page of it, which at N=1024, V=151936 costs about as much as the
//! kernels' whole sweep. Where transparent huge pages are on `madvise` (the Linux default), asking
//! for them turns 512 faults into one.

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
