//! Per-thread scratch buffers that survive rayon's work stealing.
//!
//! A product keeps its packed operands in a thread-local, reused from call to call. When the code
//! holding that scratch runs a parallel loop of its own (a packer, gemm), rayon may run another
//! task on the waiting thread, and that task can come back for the same thread's scratch while it
//! is still borrowed: a second `borrow_mut` would panic inside a rayon worker. [`with_scratch`]
//! gives that re-entered call fresh buffers instead; every user fully overwrites what it uses, so
//! nothing is lost but the reuse.

use std::cell::RefCell;
use std::thread::LocalKey;

/// Runs `f` with this thread's scratch in `key`, or with a fresh `T` when the thread's is in use.
pub(crate) fn with_scratch<T: Default + 'static, R>(
    key: &'static LocalKey<RefCell<T>>,
    f: impl FnOnce(&mut T) -> R,
) -> R {
    key.with(|cell| match cell.try_borrow_mut() {
        Ok(mut kept) => f(&mut kept),
        Err(_) => f(&mut T::default()),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    thread_local! {
        static KEPT: RefCell<Vec<u8>> = const { RefCell::new(Vec::new()) };
    }

    /// A scratch taken again on the same thread (what work stealing does) gets a fresh one.
    #[test]
    fn a_scratch_in_use_is_not_borrowed_twice() {
        let inner = with_scratch(&KEPT, |outer| {
            outer.push(1);
            with_scratch(&KEPT, |inner| {
                inner.push(2);
                inner.clone()
            })
        });
        assert_eq!(inner, [2], "the inner call has its own scratch");
        with_scratch(&KEPT, |kept| assert_eq!(*kept, [1], "the thread's scratch is the outer call's"));
    }
}
