//! A bf16 micro-kernel's own rate on one thread: `amx::block` or `dpbf16::block` over operands
//! that stay in the caches, the ceiling the blocked products are measured against (issue 17).
//!
//! `cargo run --release -p flashgrpo-kernels --example block_rate -- [KERNEL] [STEPS] [A_BLOCKS] [C_BLOCKS]`:
//! `KERNEL` is `amx` or `dpbf16` (default: the first this CPU has); each call multiplies one of
//! `A_BLOCKS` A blocks (32 rows x 32 * STEPS, 64-byte aligned) by one B block pair (STEPS
//! k-steps, 16 KiB at 8) into one of `C_BLOCKS` output blocks (loaded and stored where more than
//! one; on `dpbf16` the next block asked for meanwhile, as the products do for blocks of C they
//! accumulate in place: AMX and `dpbf16` are then not measured alike).

use flashgrpo_kernels::matmul_bf16::{amx, dpbf16};
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
    let mut args = std::env::args().skip(1).peekable();
    let kernel = match args.peek().map(String::as_str) {
        Some("amx" | "dpbf16") => args.next().expect("peeked"),
        _ if amx::available() => "amx".to_string(),
        _ => "dpbf16".to_string(),
    };
    let numbers: Vec<usize> = args.map(|s| s.parse().expect("a number")).collect();
    let arg = |i: usize, default: usize| numbers.get(i).copied().unwrap_or(default);
    let (steps, a_blocks, c_blocks) = (arg(0, 8), arg(1, 8), arg(2, 1));
    let usable = if kernel == "amx" { amx::available() } else { dpbf16::available() };
    if !usable {
        println!("no {kernel} on this machine");
        return;
    }
    let a = aligned(a_blocks * 32 * 32 * steps);
    let b = aligned(2 * 16 * steps * 32);
    let c = aligned(c_blocks * 2048).as_mut_ptr().cast::<f32>();
    let flops_per_call = steps * 4 * 16384;
    let calls = ((if kernel == "amx" { 200_000_000 } else { 20_000_000 }) / (steps * a_blocks)).max(1) * a_blocks;
    // SAFETY: the kernel is available; every block read is inside `a`, `b` and `c`.
    let seconds = unsafe {
        if kernel == "amx" {
            amx::configure();
        }
        let start = Instant::now();
        for call in 0..calls {
            let tile = amx::CTile { ptr: c.add(call % c_blocks * 1024), row_bytes: 128, load: c_blocks > 1 };
            let a_block = a.as_ptr().add(call % a_blocks * 32 * 32 * steps);
            let b1 = b.as_ptr().add(16 * steps * 32);
            if kernel == "amx" {
                amx::block(a_block, 64 * steps, b.as_ptr(), b1, 64, steps, &tile);
            } else {
                // The next C block from memory asked for meanwhile, as the products do.
                let ask = c_blocks > 1 && steps >= dpbf16::STEPS_TO_ASK_AHEAD;
                let next_c = ask.then(|| c.add((call + 1) % c_blocks * 1024).cast_const());
                dpbf16::block(dpbf16::ABlock::rows(a_block, 64 * steps), b.as_ptr(), b1, 64, steps, &tile, next_c);
            }
        }
        let seconds = start.elapsed().as_secs_f64();
        if kernel == "amx" {
            amx::release();
        }
        seconds
    };
    println!(
        "{kernel}: steps {steps}, A blocks {a_blocks} ({} KiB), C blocks {c_blocks}: {:.1} GFLOP/s on one thread",
        a_blocks * steps * 2,
        (calls * flops_per_call) as f64 / seconds / 1e9
    );
}
