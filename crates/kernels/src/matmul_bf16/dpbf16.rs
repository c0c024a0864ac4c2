//! The AVX512-BF16 micro-kernel, for CPUs with `vdpbf16ps` and no AMX (AMD Zen 4 and later,
//! Intel Cooper Lake): the same `C[32, 32] (+)= A[32, K] @ B[K, 32]` as [`super::amx::block`], on
//! the same packed operands ([`super::pack`]), so that every product of [`super`] runs on either;
//! and A read where AMX cannot (in place, or across a packed operand: [`ABlock`]).
//!
//! `vdpbf16ps` multiplies 16 pairs of bf16 by 16 pairs and adds each pair's two products to an
//! f32 lane: one broadcast pair of A's row against one VNNI row of a B panel (16 columns) is one
//! instruction. Register blocking: 8 rows of A against the block's two panels, 16 accumulators,
//! the two panels' rows loaded once per pair row for the 8 rows; the block's 32 rows in 4 such
//! passes. Each C element adds its K products in order, a pair at a time, on one thread: the
//! results do not depend on the thread count (they differ from AMX's in the last bits: the two
//! instructions round inside a pair differently).

use super::amx::CTile;

/// Rows of A per register-blocked pass.
const ROWS: usize = 8;

/// Lines of C a pass of [`block`] covers (`ROWS` rows of 32 f32, two lines each): what it asks
/// for of the next C per pass, one every 8 pair rows, so a pass of 8 k-steps covers them.
const LINES_PER_PASS: usize = 2 * ROWS;

/// The steps a pass needs for [`block`] to ask for every line of the next C.
pub const STEPS_TO_ASK_AHEAD: usize = LINES_PER_PASS / 2;

/// Whether this CPU has AVX512-BF16 (and AVX-512F).
pub fn available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::is_x86_feature_detected!("avx512bf16") && std::is_x86_feature_detected!("avx512f")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Where the 32 rows of an A block lie for [`block`]: row `r` at `ptr + (r / 16) * half_bytes +
/// (r % 16) * row_bytes` bytes, its pairs `pair_bytes` apart. `vdpbf16ps` takes A a broadcast
/// pair at a time, so A need not be packed in rows as AMX's tile loads want it: read in place a
/// transposed operand's rows are adjacent pairs and its pairs whole rows apart (the `d weight`
/// product reads the logits' gradient so and writes `d weight` in its own layout).
#[derive(Clone, Copy)]
pub struct ABlock {
    pub ptr: *const u16,
    pub row_bytes: usize,
    pub half_bytes: usize,
    pub pair_bytes: usize,
}

impl ABlock {
    /// Rows `row_bytes` apart, each row's pairs contiguous (packed or in place, as AMX reads A).
    pub fn rows(ptr: *const u16, row_bytes: usize) -> Self {
        Self { ptr, row_bytes, half_bytes: 16 * row_bytes, pair_bytes: 4 }
    }

    /// Whether the rows are AMX's kind: each one's pairs contiguous, 16 rows evenly apart.
    pub fn contiguous_rows(&self) -> bool {
        self.pair_bytes == 4 && self.half_bytes == 16 * self.row_bytes
    }

    /// Row `r`'s first pair.
    fn row(&self, r: usize) -> *const u32 {
        self.ptr.wrapping_byte_add(r / 16 * self.half_bytes + r % 16 * self.row_bytes).cast()
    }
}

/// As [`super::amx::block`]: `C (+)= A[32, 32 * steps] @ B[32 * steps, 32]`, A's rows where `a`
/// says, `b0` / `b1` at the panels' first rows (rows `b_row_bytes` apart, 16 rows a step).
///
/// With `next_c` (another block of C, its rows `c.row_bytes` apart, that comes from memory; pass
/// it only where `steps >= STEPS_TO_ASK_AHEAD`, else fewer lines are asked for) the kernel asks
/// for its 64 lines meanwhile, one every 8 pair rows: asked all at once before the
/// block they arrived late (`block_rate` with C from memory: 204 GFLOP/s, spread: 230, in the
/// caches: 232; `d weight` on cpu-2c 3-9% faster).
///
/// # Safety
/// AVX512-BF16 must be [`available`]; A's 32 rows readable for `16 * steps` pairs, B and C as
/// [`super::amx::block`] requires.
#[target_feature(enable = "avx512f,avx512bf16")]
pub unsafe fn block(
    a: ABlock,
    b0: *const u16,
    b1: *const u16,
    b_row_bytes: usize,
    steps: usize,
    c: &CTile,
    next_c: Option<*const f32>,
) {
    use std::arch::x86_64::*;
    // SAFETY (whole function): every address is inside the operands and C the caller vouches for;
    // a prefetch never faults, whatever the address.
    unsafe {
        for pass in 0..32 / ROWS {
            let c_row = |r: usize| c.ptr.byte_add((pass * ROWS + r) * c.row_bytes);
            let mut acc: [[__m512; 2]; ROWS] = std::array::from_fn(|r| {
                if c.load {
                    [_mm512_loadu_ps(c_row(r)), _mm512_loadu_ps(c_row(r).add(16))]
                } else {
                    [_mm512_setzero_ps(); 2]
                }
            });
            let a_rows: [*const u32; ROWS] = std::array::from_fn(|r| a.row(pass * ROWS + r));
            for pair_row in 0..16 * steps {
                // Every 8 pair rows, line `pair_row / 8` of the same rows of the next C: its
                // `LINES_PER_PASS` lines over a pass where `steps >= 8` (the callers pass `next_c`
                // only then). (A flat loop: with the pair rows in groups of 8 the kernel ran 3%
                // slower, its own rate included.)
                if let Some(next) = next_c.filter(|_| pair_row % 8 == 0 && pair_row < 8 * LINES_PER_PASS) {
                    let line = pair_row / 8;
                    let p = next.wrapping_byte_add((pass * ROWS + line / 2) * c.row_bytes + line % 2 * 64);
                    _mm_prefetch::<_MM_HINT_T0>(p.cast());
                }
                let (a_at, b_at) = (pair_row * a.pair_bytes, pair_row * b_row_bytes);
                let (p0, p1) =
                    (_mm512_loadu_si512(b0.byte_add(b_at).cast()), _mm512_loadu_si512(b1.byte_add(b_at).cast()));
                let (p0, p1) = (as_bf16_pairs(p0), as_bf16_pairs(p1));
                for (row, acc) in a_rows.iter().zip(acc.iter_mut()) {
                    let pair = as_bf16_pairs(_mm512_set1_epi32(row.byte_add(a_at).read_unaligned() as i32));
                    acc[0] = _mm512_dpbf16_ps(acc[0], pair, p0);
                    acc[1] = _mm512_dpbf16_ps(acc[1], pair, p1);
                }
            }
            for (r, [lo, hi]) in acc.iter().enumerate() {
                _mm512_storeu_ps(c_row(r), *lo);
                _mm512_storeu_ps(c_row(r).add(16), *hi);
            }
        }
    }
}

/// The 32 bf16 numbers in `x`'s bits, as `vdpbf16ps` takes them.
#[inline(always)]
fn as_bf16_pairs(x: std::arch::x86_64::__m512i) -> std::arch::x86_64::__m512bh {
    // SAFETY: both are 64 bytes of plain data; every bit pattern is a valid bf16 vector.
    unsafe { std::mem::transmute::<std::arch::x86_64::__m512i, std::arch::x86_64::__m512bh>(x) }
}
