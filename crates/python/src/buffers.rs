//! Caller-owned buffers, passed as addresses. The Python side guarantees what Rust cannot check:
//! each address is the start of a live, contiguous CPU buffer of the stated element type and
//! length, not freed or resized during the call (the caller holds a reference to its tensor
//! across the call). Rust checks what it can: null and alignment.

use std::mem::{align_of, size_of};

/// What went wrong, in words for the user (turned into a `ValueError`, or an XLA error).
pub type Result<T> = std::result::Result<T, String>;

/// One buffer: where it starts and how many elements it holds; address 0 means absent.
#[derive(Debug, Clone, Copy)]
pub struct Address {
    pub name: &'static str,
    pub address: usize,
    pub len: usize,
}

impl Address {
    pub fn new(name: &'static str, address: usize, len: usize) -> Self {
        Self { name, address, len }
    }

    fn check<T>(&self) -> Result<()> {
        if !self.address.is_multiple_of(align_of::<T>()) {
            return Err(format!(
                "`{}` at address {:#x} is not aligned to {} bytes",
                self.name,
                self.address,
                align_of::<T>()
            ));
        }
        if self.len.checked_mul(size_of::<T>()).is_none_or(|bytes| bytes > isize::MAX as usize) {
            return Err(format!("`{}`: {} elements is too many", self.name, self.len));
        }
        Ok(())
    }

    /// The buffer as a slice, `None` when absent.
    ///
    /// # Safety
    /// The module's contract: a live buffer of `len` `T`s at `address`, not written by anyone
    /// else during `'a`.
    pub unsafe fn slice<'a, T>(&self) -> Result<Option<&'a [T]>> {
        if self.address == 0 {
            return Ok(None);
        }
        self.check::<T>()?;
        Ok(Some(unsafe { std::slice::from_raw_parts(self.address as *const T, self.len) }))
    }

    /// As [`slice`](Self::slice), for a buffer that is written.
    ///
    /// # Safety
    /// As [`slice`](Self::slice), and no one else reads or writes the buffer during `'a`.
    pub unsafe fn slice_mut<'a, T>(&self) -> Result<Option<&'a mut [T]>> {
        if self.address == 0 {
            return Ok(None);
        }
        self.check::<T>()?;
        Ok(Some(unsafe { std::slice::from_raw_parts_mut(self.address as *mut T, self.len) }))
    }

    /// A buffer that must be present.
    ///
    /// # Safety
    /// As [`slice`](Self::slice).
    pub unsafe fn required<'a, T>(&self) -> Result<&'a [T]> {
        unsafe { self.slice()? }.ok_or_else(|| format!("`{}` is required", self.name))
    }
}
