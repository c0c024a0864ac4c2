//! The AMX kernel's own rate on one thread: `amx::block` over operands that stay in the caches,
//! the ceiling the blocked products are measured against (issue 17).
//!
//! `cargo run --release -p flashgrpo-kernels --example amx_block_rate -- [STEPS] [A_BLOCKS] [C_BLOCKS]`:
//! each call multiplies one of `A_BLOCKS` A blocks (32 rows x 32 * STEPS, 64-byte aligned) by one
//! B block pair (STEPS k-steps, 16 KiB at 8) into one of `C_BLOCKS` output blocks (loaded and
//! stored where more than one, as the products' kept blocks are).

use flashgrpo_kernels::matmul_bf16::amx;
use std::alloc::{alloc_zeroed, Layout};
use std::time::Instant;

/// `len` u16 on a 64-byte boundary, filled with bf16 1.0.
fn aligned(len: usize) -> &'static mut [u16] {
    let layout = Layout::from_size_align((2 * len).max(64), 64).expect("layout");
    // SAFETY: a non-zero size; the memory is leaked for the process's life, zeroed, then filled.
    let data = unsafe { std::slice::from_raw_parts_mut(alloc_zeroed(layout).cast::<u16>(), len) };
    data.fill(0x3f80);
    data
}

fn main() {
    if !amx::available() {
        println!("no AMX on this machine");
        return;
    }
    let arg = |i: usize, default: usize| std::env::args().nth(i).map_or(default, |s| s.parse().expect("a number"));
    let (steps, a_blocks, c_blocks) = (arg(1, 8), arg(2, 8), arg(3, 1));
    let a = aligned(a_blocks * 32 * 32 * steps);
    let b = aligned(2 * 16 * steps * 32);
    let c = aligned(c_blocks * 2048).as_mut_ptr().cast::<f32>();
    let calls = (200_000_000 / (steps * a_blocks)).max(1) * a_blocks;
    // SAFETY: AMX is available; every block read is inside `a`, `b` and `c`.
    let seconds = unsafe {
        amx::configure();
        let start = Instant::now();
        for call in 0..calls {
            let tile = amx::CTile { ptr: c.add(call % c_blocks * 1024), row_bytes: 128, load: c_blocks > 1 };
            let a_block = a.as_ptr().add(call % a_blocks * 32 * 32 * steps);
            amx::block(a_block, 64 * steps, b.as_ptr(), b.as_ptr().add(16 * steps * 32), 64, steps, &tile);
        }
        let seconds = start.elapsed().as_secs_f64();
        amx::release();
        seconds
    };
    let flops = (calls * steps * 4 * 16384) as f64;
    println!(
        "steps {steps}, A blocks {a_blocks} ({} KiB), C blocks {c_blocks}: {:.0} GFLOP/s on one thread",
        a_blocks * steps * 2,
        flops / seconds / 1e9
    );
}
