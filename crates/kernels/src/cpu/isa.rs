//! Which instruction set the row kernels run with, chosen at run time.
//!
//! The row kernels are written once, generically, and compiled four times: for AVX-512 with and
//! without AVX512-BF16 (intrinsics, `vscalefps` exp), for AVX2 + FMA + F16C (intrinsics), and for
//! the baseline target (no FMA). The best one the CPU supports is used unless [`with_isa`] asks for another on a
//! thread (tests use it to check every path) or `FLASHGRPO_ISA` (`generic`, `avx2`, `avx512`,
//! `avx512bf16`) for the process (to time a fallback on a CPU that has better).
//! Results are identical for any thread count on one path; paths differ by FMA rounding.

use std::cell::Cell;
use std::sync::OnceLock;

/// An instruction-set level of the row kernels.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Isa {
    /// Plain Rust, autovectorised for the compilation target (SSE2 on x86-64), no FMA.
    Generic,
    /// AVX2, FMA, F16C and BMI1/2 (every AVX2 CPU has them), with intrinsics.
    Avx2,
    /// AVX-512 (F, BW, DQ, VL) and FMA, with intrinsics.
    Avx512,
    /// As `Avx512`, with AVX512-BF16's conversion for bf16 gradients.
    Avx512Bf16,
}

impl Isa {
    /// The best level this CPU supports.
    pub fn detected() -> Isa {
        static DETECTED: OnceLock<Isa> = OnceLock::new();
        *DETECTED.get_or_init(|| {
            #[cfg(target_arch = "x86_64")]
            {
                let avx2 = is_x86_feature_detected!("avx2")
                    && is_x86_feature_detected!("fma")
                    && is_x86_feature_detected!("f16c")
                    && is_x86_feature_detected!("bmi1")
                    && is_x86_feature_detected!("bmi2");
                let avx512 = avx2
                    && is_x86_feature_detected!("avx512f")
                    && is_x86_feature_detected!("avx512bw")
                    && is_x86_feature_detected!("avx512dq")
                    && is_x86_feature_detected!("avx512vl");
                if avx512 && is_x86_feature_detected!("avx512bf16") {
                    return Isa::Avx512Bf16;
                }
                if avx512 {
                    return Isa::Avx512;
                }
                if avx2 {
                    return Isa::Avx2;
                }
            }
            Isa::Generic
        })
    }

    /// The level of this process: [`Isa::detected`], or a lower one named by `FLASHGRPO_ISA`
    /// (read once; a name this CPU cannot run is reported on stderr and ignored).
    pub fn of_process() -> Isa {
        static CHOSEN: OnceLock<Isa> = OnceLock::new();
        *CHOSEN.get_or_init(|| {
            let wanted = std::env::var("FLASHGRPO_ISA").unwrap_or_default();
            let available = Isa::available();
            match available.iter().find(|i| i.name() == wanted) {
                Some(&isa) => isa,
                None => {
                    if !wanted.is_empty() {
                        let names: Vec<&str> = available.iter().map(|i| i.name()).collect();
                        eprintln!(
                            "flashgrpo: FLASHGRPO_ISA={wanted} is not a level this CPU can run (it can: {}); using {}",
                            names.join(", "),
                            Isa::detected().name()
                        );
                    }
                    Isa::detected()
                }
            }
        })
    }

    /// Every level this CPU can run, lowest first.
    pub fn available() -> Vec<Isa> {
        [Isa::Generic, Isa::Avx2, Isa::Avx512, Isa::Avx512Bf16].into_iter().filter(|&i| i <= Isa::detected()).collect()
    }

    pub fn name(self) -> &'static str {
        match self {
            Isa::Generic => "generic",
            Isa::Avx2 => "avx2",
            Isa::Avx512 => "avx512",
            Isa::Avx512Bf16 => "avx512bf16",
        }
    }
}

/// Whether a large new f32 gradient buffer is written by non-temporal stores on AVX-512 and
/// AVX2 (`Simd::streams`): on AMD CPUs. A plain store first reads each line it writes; on AMD Zen 4
/// streaming took 12-21% off the f32 `fused` step, where on the Intel server CPU of
/// docs/BENCHMARKS.md it had measured 6% slower, so f32 keeps plain stores there (16-bit outputs
/// stream on both). Read once, from the CPU's vendor string.
#[cfg(target_arch = "x86_64")]
pub(crate) fn streams_f32() -> bool {
    #[cfg(test)]
    if let Some(streams) = F32_STREAMS.with(Cell::get) {
        return streams;
    }
    static AMD: OnceLock<bool> = OnceLock::new();
    *AMD.get_or_init(|| {
        // `__cpuid` is a safe function in recent Rust, an unsafe one in older (rust-version 1.89).
        #[allow(unused_unsafe)]
        // SAFETY: CPUID leaf 0 exists on every x86-64 CPU.
        let id = unsafe { std::arch::x86_64::__cpuid(0) };
        [id.ebx, id.edx, id.ecx].map(u32::to_le_bytes).concat() == b"AuthenticAMD"
    })
}

thread_local! {
    static OVERRIDE: Cell<Option<Isa>> = const { Cell::new(None) };
}

#[cfg(test)]
thread_local! {
    static F32_STREAMS: Cell<Option<bool>> = const { Cell::new(None) };
}

/// Runs `f` with [`streams_f32`] answering `streams` on this thread (tests: the f32 streaming path
/// on any CPU, and the plain one on an AMD CPU).
#[cfg(test)]
pub(crate) fn with_f32_streams<R>(streams: bool, f: impl FnOnce() -> R) -> R {
    let previous = F32_STREAMS.with(|o| o.replace(Some(streams)));
    let result = f();
    F32_STREAMS.with(|o| o.set(previous));
    result
}

/// Runs `f` with the row kernels of `isa` for calls made from this thread (the kernels are
/// chosen on the calling thread, before rows are spread over rayon's workers).
///
/// # Panics
/// If the CPU does not support `isa`.
pub fn with_isa<R>(isa: Isa, f: impl FnOnce() -> R) -> R {
    assert!(isa <= Isa::detected(), "this CPU does not support {isa:?}");
    let previous = OVERRIDE.with(|o| o.replace(Some(isa)));
    let result = f();
    OVERRIDE.with(|o| o.set(previous));
    result
}

/// The level calls from this thread use now.
pub fn current() -> Isa {
    OVERRIDE.with(Cell::get).unwrap_or_else(Isa::of_process)
}
