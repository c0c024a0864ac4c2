//! Fresh large buffers backed by 2 MiB pages. A buffer just allocated (the fused-linear chunk's
//! logits, XLA's result buffers, a new PyTorch tensor) is untouched memory: the first write
//! faults in every 4 KiB page of it, which for an `[N, V]` gradient at N=1024, V=151936 costs
//! 2-4x the kernels' whole sweep on the machine measured, and a sweep over 4 KiB pages misses the
//! TLB every 4 KiB. Where transparent huge pages are on `madvise` (Debian's and Ubuntu's default),
//! asking for them turns 512 faults into one (docs/BENCHMARKS.md, "Again on cpu-2c (2026-11-27)":
//! the in-place sweeps 6-12% faster with every buffer on huge pages; the fused-linear chunk's
//! logits alone advised, the bf16 step at N=1024 3% faster).

use std::alloc::{alloc_zeroed, handle_alloc_error, Layout};

use crate::element::Element;

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

/// `len` zeros of any [`Element`] on fresh pages, advised as above before anything touches them.
/// `vec![0.0f32; len]` takes zeroed pages from the allocator without writing them, but
/// `vec![bf16::ZERO; len]` would write every element on one thread (the standard library asks
/// the allocator for zeroed memory only for its own primitive types), faulting in the pages as it
/// goes: for an `[N, V]` bf16 gradient at N=1024, V=151936 that is 311 MB written before the
/// kernels start. Buffers that large come from their own `mmap` (glibc maps anything above its
/// threshold, at most 32 MiB), so their zeros are fresh pages nobody has written; a smaller one
/// may be recycled heap memory, which the allocator clears itself.
pub fn zeroed<T: Element>(len: usize) -> Vec<T> {
    if len == 0 {
        return Vec::new();
    }
    let layout = Layout::array::<T>(len).expect("a buffer that fits the address space");
    // SAFETY: the layout has a non-zero size; `T` is f32, bf16 or f16 (`Element` is sealed), for
    // each of which all-zero bits are the value +0, so `len` zeroed elements are initialised; the
    // pointer comes from the global allocator with `T`'s layout, as `Vec` requires.
    let values = unsafe {
        let ptr = alloc_zeroed(layout).cast::<T>();
        if ptr.is_null() {
            handle_alloc_error(layout);
        }
        Vec::from_raw_parts(ptr, len, len)
    };
    advise(values.as_ptr() as usize, layout.size());
    values
}

/// `len` zeros as [`zeroed`] gives them, with every page faulted in now by a write: for buffers
/// that live through a whole run and are first *added to* (a trainer's gradients, AdamW's
/// moments). Such a buffer's first `+=` reads a page before writing it, so each 4 KiB page faults
/// twice: the read maps the shared zero page, the write copies it and flushes that mapping from
/// every core's TLB (an inter-processor interrupt, slow in a VM). On cpu-2c-zen5 the first SFT
/// step at Qwen2.5-0.5B's width spent 47 s of its 48 on those faults (1.16 million of them, two
/// threads contending for the same page tables), against 1.7 s for every later step
/// (docs/BENCHMARKS.md, "The first step's page faults"). A write to a page nobody has mapped
/// faults once and flushes nothing; on huge pages (advised, as [`zeroed`] does) once per 2 MiB.
/// The writes are volatile so that the compiler, which knows the memory is zeroed, keeps them.
pub fn zeroed_resident<T: Element>(len: usize) -> Vec<T> {
    let mut values = zeroed::<T>(len);
    let stride = (4096 / std::mem::size_of::<T>()).max(1);
    let zero = T::from_f32(0.0);
    // Every `stride`-th element, and the last: the buffer need not start on a page (glibc's mapped
    // blocks start 16 bytes in), so its last page may hold no element of the stride.
    let last = values.len().checked_sub(1);
    for i in (0..values.len()).step_by(stride).chain(last) {
        // SAFETY: `i < values.len()`; the element is initialised (zero) and overwritten by zero.
        unsafe { std::ptr::write_volatile(values.as_mut_ptr().add(i), zero) };
    }
    values
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zeroed_16_bit_buffers_are_zeros_of_the_length_asked_and_writable() {
        for len in [0, 1, 2 << 20, (2 << 20) + 3] {
            let mut b = zeroed::<half::bf16>(len);
            let mut h = zeroed::<half::f16>(len);
            assert_eq!((b.len(), h.len()), (len, len));
            assert!(b.iter().all(|x| x.to_bits() == 0) && h.iter().all(|x| x.to_bits() == 0));
            b.iter_mut().enumerate().for_each(|(i, x)| *x = half::bf16::from_f32((i % 256) as f32));
            h.iter_mut().enumerate().for_each(|(i, x)| *x = half::f16::from_f32((i % 256) as f32));
            assert!(b.iter().enumerate().all(|(i, x)| x.to_f32() == (i % 256) as f32));
            assert!(h.iter().enumerate().all(|(i, x)| x.to_f32() == (i % 256) as f32));
            b.push(half::bf16::ONE);
            assert_eq!(b.len(), len + 1);
        }
    }

    #[test]
    fn resident_zeros_are_zeros_of_the_length_asked() {
        for len in [0, 1, 1023, 1024, 1025, (4 << 20) + 5] {
            let f = zeroed_resident::<f32>(len);
            let b = zeroed_resident::<half::bf16>(len);
            assert_eq!((f.len(), b.len()), (len, len));
            assert!(f.iter().all(|x| x.to_bits() == 0) && b.iter().all(|x| x.to_bits() == 0));
        }
    }

    /// Every page of a resident buffer is in memory before anything reads or writes it.
    #[cfg(target_os = "linux")]
    #[test]
    fn resident_zeros_are_in_memory_when_returned() {
        // Lengths of whole pages too: a buffer that does not start on a page ends inside one.
        for len in [(16 << 20) + 7, 1 << 20, 1024 * 896] {
            let values = zeroed_resident::<f32>(len);
            let page = 4096;
            let start = values.as_ptr() as usize / page * page;
            let end = (values.as_ptr() as usize + 4 * len).next_multiple_of(page);
            let mut resident = vec![0u8; (end - start) / page];
            // SAFETY: `[start, end)` covers the live buffer's pages; `resident` has one byte a page.
            let rc = unsafe { libc::mincore(start as *mut libc::c_void, end - start, resident.as_mut_ptr()) };
            assert_eq!(rc, 0);
            let missing = resident.iter().filter(|&&r| r & 1 == 0).count();
            assert_eq!(missing, 0, "{missing} of {} pages not in memory (len {len})", resident.len());
        }
    }

    #[test]
    fn zeroed_buffers_are_zeros_of_the_length_asked_and_writable() {
        // Below, at and above the 4 MiB where the advice starts (a hint whatever the system's
        // setting, never an error).
        for len in [0, 1, 1 << 20, (1 << 20) + 3, 3 << 20] {
            let mut v = zeroed::<f32>(len);
            assert_eq!(v.len(), len);
            assert!(v.iter().all(|&x| x == 0.0));
            v.iter_mut().enumerate().for_each(|(i, x)| *x = i as f32);
            assert!(v.iter().enumerate().all(|(i, &x)| x == i as f32));
        }
    }
}
