//! The AMX micro-kernel: `C[32, 32] = A[32, K] @ B[K, 32]` in bf16 with f32 accumulation, on the
//! tile registers of Intel's Advanced Matrix Extensions (`tdpbf16ps`: a 16x16 f32 tile += a 16x32
//! bf16 tile times a 32x16 bf16 tile, 16,384 flops per instruction; 1.4-2.0 TFLOP/s per core
//! here with the operands in L1 and L2, `examples/block_rate.rs`, ~15x the f32 `gemm` rate).
//!
//! Register use (one tile configuration, eight 16-row x 64-byte tiles): `tmm0..tmm3` hold the four
//! 16x16 quarters of C, `tmm4`/`tmm5` the two 16-row halves of A's 32-column step, `tmm6`/`tmm7`
//! the two 16-column panels of B's step. Per step of 32 along K: four loads, four products.
//!
//! The operands are packed ([`super::pack`]): A row-major `[rows, k]` (k a multiple of 32), B as
//! panels of 16 columns in the "VNNI" layout AMX reads: panel row `k'` holds, for each of the 16
//! columns `j`, the pair `(B[2k', j], B[2k'+1, j])`. Each C element sums its K products in one
//! fixed order, the same on any thread, so the results are deterministic.
//!
//! Linux hands out the tile registers' 8 KiB of state only to processes that ask
//! (`arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`); [`available`] asks once.

use std::arch::asm;
use std::sync::OnceLock;

/// The tile configuration `ldtilecfg` loads: palette 1, eight tiles of 16 rows x 64 bytes.
#[repr(C, align(64))]
struct TileConfig {
    palette: u8,
    start_row: u8,
    reserved: [u8; 14],
    bytes_per_row: [u16; 16],
    rows: [u8; 16],
}

const CONFIG: TileConfig = {
    let mut bytes_per_row = [0u16; 16];
    let mut rows = [0u8; 16];
    let mut t = 0;
    while t < 8 {
        bytes_per_row[t] = 64;
        rows[t] = 16;
        t += 1;
    }
    TileConfig { palette: 1, start_row: 0, reserved: [0; 14], bytes_per_row, rows }
};

/// Whether this CPU has AMX-BF16 and the kernel lets this process use it (asked once).
pub fn available() -> bool {
    static AVAILABLE: OnceLock<bool> = OnceLock::new();
    *AVAILABLE.get_or_init(|| {
        #[cfg(all(target_arch = "x86_64", target_os = "linux"))]
        {
            // CPUID leaf 7: EDX bit 22 AMX-BF16, bit 24 AMX-TILE (std's detection of them is
            // not stable yet).
            let edx = std::arch::x86_64::__cpuid_count(7, 0).edx;
            edx & (1 << 22) != 0 && edx & (1 << 24) != 0 && request_tile_permission()
        }
        #[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
        {
            false
        }
    })
}

/// `arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`: 0 on success, for the whole process.
#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
fn request_tile_permission() -> bool {
    const SYS_ARCH_PRCTL: i64 = 158;
    const ARCH_REQ_XCOMP_PERM: i64 = 0x1023;
    const XFEATURE_XTILEDATA: i64 = 18;
    let result: i64;
    // SAFETY: a plain system call; it reads no memory of ours and clobbers rcx and r11 only.
    unsafe {
        asm!(
            "syscall",
            inlateout("rax") SYS_ARCH_PRCTL => result,
            in("rdi") ARCH_REQ_XCOMP_PERM,
            in("rsi") XFEATURE_XTILEDATA,
            lateout("rcx") _,
            lateout("r11") _,
            options(nostack),
        );
    }
    result == 0
}

/// Loads the tile configuration on this thread, for the [`block`] calls that follow.
///
/// # Safety
/// [`available`] must be true.
pub unsafe fn configure() {
    // SAFETY: AMX is available (the caller's promise); `CONFIG` is a valid palette-1 configuration.
    unsafe { asm!("ldtilecfg [{}]", in(reg) &CONFIG, options(nostack, readonly)) };
}

/// Gives the tile state back (the thread's context switches stop saving 8 KiB of tiles).
///
/// # Safety
/// [`available`] must be true.
pub unsafe fn release() {
    // SAFETY: AMX is available (the caller's promise).
    unsafe { asm!("tilerelease", options(nostack, nomem)) };
}

/// One 32x32 block of C, f32, row-major with rows of 32.
pub type Block = [f32; 32 * 32];

/// Where [`block`] reads and writes C: 32 rows of 32 f32 at `ptr`, rows `row_bytes` apart; with
/// `load`, C's contents are added to.
pub struct CTile {
    pub ptr: *mut f32,
    pub row_bytes: usize,
    pub load: bool,
}

/// `C (+)= A[32, 32 * steps] @ B[32 * steps, 32]`: `a` points at A's first row (rows
/// `a_row_bytes` apart, each step 64 bytes further along), `b0` / `b1` at the two B panels'
/// first rows (rows `b_row_bytes` apart, 16 rows a step).
///
/// # Safety
/// [`configure`] must have run on this thread (and no [`release`] since); `a` must be readable
/// for 32 rows of `64 * steps` bytes, `b0` and `b1` for `16 * steps` rows of 64 bytes, and C
/// readable (with `load`) and writable for 32 rows of 128 bytes.
pub unsafe fn block(
    a: *const u16,
    a_row_bytes: usize,
    b0: *const u16,
    b1: *const u16,
    b_row_bytes: usize,
    steps: usize,
    c: &CTile,
) {
    // SAFETY (whole function): the caller vouches for the operands; the tiles are registers of
    // their own that the compiler never uses, configured on this thread before any use.
    unsafe {
        let (c0, sc) = (c.ptr, c.row_bytes);
        let (c1, c2, c3) = (c0.add(16), c0.byte_add(16 * sc), c0.byte_add(16 * sc).add(16));
        if c.load {
            asm!(
                "tileloadd tmm0, [{c0} + {sc} * 1]",
                "tileloadd tmm1, [{c1} + {sc} * 1]",
                "tileloadd tmm2, [{c2} + {sc} * 1]",
                "tileloadd tmm3, [{c3} + {sc} * 1]",
                c0 = in(reg) c0, c1 = in(reg) c1, c2 = in(reg) c2, c3 = in(reg) c3, sc = in(reg) sc,
                options(nostack, readonly),
            );
        } else {
            asm!("tilezero tmm0", "tilezero tmm1", "tilezero tmm2", "tilezero tmm3", options(nostack, nomem));
        }
        let a1 = a.byte_add(16 * a_row_bytes);
        for s in 0..steps {
            asm!(
                "tileloadd tmm4, [{a0} + {sa} * 1]",
                "tileloadd tmm5, [{a1} + {sa} * 1]",
                "tileloadd tmm6, [{b0} + {sb} * 1]",
                "tileloadd tmm7, [{b1} + {sb} * 1]",
                "tdpbf16ps tmm0, tmm4, tmm6",
                "tdpbf16ps tmm1, tmm4, tmm7",
                "tdpbf16ps tmm2, tmm5, tmm6",
                "tdpbf16ps tmm3, tmm5, tmm7",
                a0 = in(reg) a.add(32 * s),
                a1 = in(reg) a1.add(32 * s),
                b0 = in(reg) b0.byte_add(16 * s * b_row_bytes),
                b1 = in(reg) b1.byte_add(16 * s * b_row_bytes),
                sa = in(reg) a_row_bytes,
                sb = in(reg) b_row_bytes,
                options(nostack, readonly),
            );
        }
        asm!(
            "tilestored [{c0} + {sc} * 1], tmm0",
            "tilestored [{c1} + {sc} * 1], tmm1",
            "tilestored [{c2} + {sc} * 1], tmm2",
            "tilestored [{c3} + {sc} * 1], tmm3",
            c0 = in(reg) c0, c1 = in(reg) c1, c2 = in(reg) c2, c3 = in(reg) c3, sc = in(reg) sc,
            options(nostack),
        );
    }
}
