//! Where the `fused` bf16 step loses to the in-place one on an AVX-512 CPU (issue 17, item 3;
//! docs/BENCHMARKS.md, "The f32 gradient streamed on AMD, and what the `fused` gap is"). A
//! standalone replica of the row sweep at memory scale, outside the workspace so that CI never
//! builds it:
//!
//! ```sh
//! rustc --edition 2021 -O -C target-cpu=native bench/tools/zen4_fused_stream.rs -o /tmp/zen4_fused_stream
//! /tmp/zen4_fused_stream inplace nt staged nt-moved
//! ```
//!
//! N=1024 rows of V=151936 bf16 logits (311 MB, on huge pages), two threads with half the rows
//! each; per row the statistics loop (even / odd widening, `exp2` as `cpu::simd`, the two sums,
//! the kept values stored) then the gradient loop (the kept values scaled, rounded 32 at a time,
//! put in order). Ways of writing the gradient, named on the command line, alternated round by
//! round with the copy that gives the floor:
//! - `inplace`: over the logits (plain stores; the lines are in L2);
//! - `nt`: into a second buffer by non-temporal stores (the kernel's `fused`);
//! - `plain`: into a second buffer by plain stores (each line read first; without the kernel's
//!   prefetch of the lines ahead, so not the kernel's plain-store time);
//! - `staged`: into an L2-resident row by plain stores, streamed out by the *next* row's
//!   statistics loop (one 64-byte line per 32 logits), so that the write overlaps compute;
//! - `nt-moved` / `inplace-moved`: the entropy's multiply-add moved from the statistics loop into
//!   the gradient loop (which reads the logits again from L2 for it);
//! - `next-quarter`: in place, the gradient loop also asking for the first quarter of the next
//!   row's logits;
//! - `clwb-half`: in place, every other gradient line written back (`clwb`) eight lines after
//!   it is written.
//!
//! The streaming ways end each row with an `sfence`, as the kernel does.
//!
//! (`clzero` before each plain store, to spare the read of a line, took a whole second a step
//! on cpu-2c: not listed.)

use std::arch::x86_64::*;
use std::hint::black_box;
use std::time::Instant;

const V: usize = 151_936;
const ROWS: usize = 1024;
const POLY: [f32; 6] = [1.867_132_4e-3, 9.017_025e-3, 5.579_991_6e-2, 2.401_644_4e-1, 6.931_513e-1, 1.0];

#[derive(Clone, Copy, PartialEq)]
enum Way {
    InPlace,
    Nt,
    Plain,
    Staged,
    NtMoved,
    InPlaceMoved,
    NextQuarter,
    ClwbHalf,
}

impl Way {
    fn parse(name: &str) -> Way {
        match name {
            "inplace" => Way::InPlace,
            "nt" => Way::Nt,
            "plain" => Way::Plain,
            "staged" => Way::Staged,
            "nt-moved" => Way::NtMoved,
            "inplace-moved" => Way::InPlaceMoved,
            "next-quarter" => Way::NextQuarter,
            "clwb-half" => Way::ClwbHalf,
            _ => panic!("unknown way {name}"),
        }
    }
    fn moved(self) -> bool {
        matches!(self, Way::NtMoved | Way::InPlaceMoved)
    }
    fn in_place(self) -> bool {
        matches!(self, Way::InPlace | Way::InPlaceMoved | Way::NextQuarter | Way::ClwbHalf)
    }
}

#[inline(always)]
unsafe fn exp2(t: __m512) -> __m512 {
    let f = _mm512_reduce_ps::<{ _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC }>(t);
    let mut p = _mm512_set1_ps(POLY[0]);
    for &c in &POLY[1..] {
        p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(c));
    }
    _mm512_scalef_ps(p, t)
}

/// `(x as f32 even positions, odd positions)` of 32 bf16 logits at `p`, and their `t`.
#[inline(always)]
unsafe fn split_t(p: *const u16) -> [__m512; 2] {
    let x = _mm512_loadu_si512(p.cast());
    let (a, r) = (_mm512_set1_ps(0.144_269_5), _mm512_set1_ps(3.0));
    let even = _mm512_castsi512_ps(_mm512_slli_epi32::<16>(x));
    let odd = _mm512_castsi512_ps(_mm512_and_si512(x, _mm512_set1_epi32(0xFFFF_0000u32 as i32)));
    [_mm512_fmsub_ps(even, a, r), _mm512_fmsub_ps(odd, a, r)]
}

/// The statistics loop over one row; with `pending`, one line of the previous row's staged
/// gradient streamed to its place per 32 logits.
#[inline(always)]
unsafe fn statistics(row: *const u16, kept: *mut f32, entropy: bool, pending: Option<(*const u16, *mut u16)>) -> f32 {
    let (mut sv, mut dv) = ([_mm512_setzero_ps(); 2], [_mm512_setzero_ps(); 2]);
    for j in (0..V).step_by(32) {
        _mm_prefetch::<_MM_HINT_T0>(row.add(j + 2048).cast());
        if let Some((staged, out)) = pending {
            _mm512_stream_si512(out.add(j).cast(), _mm512_load_si512(staged.add(j).cast()));
        }
        for (h, t) in split_t(row.add(j)).into_iter().enumerate() {
            let e = exp2(t);
            _mm512_store_ps(kept.add(j + 16 * h), e);
            sv[h] = _mm512_add_ps(sv[h], e);
            if entropy {
                dv[h] = _mm512_fmadd_ps(e, t, dv[h]);
            }
        }
    }
    _mm512_reduce_add_ps(_mm512_add_ps(sv[0], sv[1])) + _mm512_reduce_add_ps(_mm512_add_ps(dv[0], dv[1]))
}

/// The gradient loop: the kept values times a scale so small that in-place logits stay finite,
/// rounded 32 at a time and put in order, written as `way` says; returns the moved entropy sum.
#[inline(always)]
unsafe fn gradient(kept: *const f32, row: *const u16, out: *mut u16, way: Way) -> f32 {
    let scale = _mm512_set1_ps(1e-30);
    let order = _mm512_set_epi16(
        31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1,
        16, 0,
    );
    let mut dv = [_mm512_setzero_ps(); 2];
    for j in (0..V).step_by(32) {
        let k = [_mm512_load_ps(kept.add(j)), _mm512_load_ps(kept.add(j + 16))];
        if way.moved() {
            for (h, t) in split_t(row.add(j)).into_iter().enumerate() {
                dv[h] = _mm512_fmadd_ps(k[h], t, dv[h]);
            }
        }
        let pair = _mm512_cvtne2ps_pbh(_mm512_mul_ps(k[1], scale), _mm512_mul_ps(k[0], scale));
        let g = _mm512_permutexvar_epi16(order, std::mem::transmute::<__m512bh, __m512i>(pair));
        let line = j / 32;
        match way {
            Way::Nt | Way::NtMoved => _mm512_stream_si512(out.add(j).cast(), g),
            Way::NextQuarter => {
                if line % 4 == 0 {
                    _mm_prefetch::<_MM_HINT_T0>(out.wrapping_add(V + line / 4 * 32).cast());
                }
                _mm512_store_si512(out.add(j).cast(), g)
            }
            Way::ClwbHalf => {
                _mm512_store_si512(out.add(j).cast(), g);
                if line % 2 == 0 && line >= 8 {
                    std::arch::asm!("clwb [{0}]", in(reg) out.add(j - 256), options(nostack));
                }
            }
            _ => _mm512_store_si512(out.add(j).cast(), g),
        }
    }
    _mm512_reduce_add_ps(_mm512_add_ps(dv[0], dv[1]))
}

/// One thread's rows, in turn, with its kept row and staging row.
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512bf16")]
unsafe fn rows(
    logits: *mut u16,
    grad: *mut u16,
    range: std::ops::Range<usize>,
    way: Way,
    kept: *mut f32,
    staged: *mut u16,
) -> f32 {
    let mut total = 0.0;
    let mut previous: Option<usize> = None;
    for i in range {
        let row = logits.add(i * V);
        let pending = match (way, previous) {
            (Way::Staged, Some(p)) => Some((staged as *const u16, grad.add(p * V))),
            _ => None,
        };
        total += statistics(row, kept, !way.moved(), pending);
        let out = match way {
            Way::Staged => staged,
            w if w.in_place() => row,
            _ => grad.add(i * V),
        };
        total += gradient(kept, row, out, way);
        if matches!(way, Way::Nt | Way::NtMoved | Way::Staged) {
            _mm_sfence();
        }
        previous = Some(i);
    }
    if let (Way::Staged, Some(p)) = (way, previous) {
        for j in (0..V).step_by(32) {
            _mm512_stream_si512(grad.add(p * V + j).cast(), _mm512_load_si512(staged.add(j).cast()));
        }
        _mm_sfence();
    }
    total
}

extern "C" {
    fn madvise(address: *mut u8, length: usize, advice: i32) -> i32;
}

/// A buffer of `T`s on huge pages (as the kernels' own), 64-byte aligned.
struct Buffer<T>(Vec<T>);

impl<T: Copy + Default> Buffer<T> {
    fn new(len: usize) -> Self {
        let mut v: Vec<T> = Vec::with_capacity(len + 64);
        let start = (v.as_mut_ptr() as usize).next_multiple_of(2 << 20);
        let end = (v.as_mut_ptr() as usize + len * std::mem::size_of::<T>()) / (2 << 20) * (2 << 20);
        if end > start {
            // SAFETY: advice on pages of this buffer (MADV_HUGEPAGE = 14), before any is touched.
            unsafe { madvise(start as *mut u8, end - start, 14) };
        }
        v.resize(len + 64, T::default());
        Buffer(v)
    }
    fn ptr(&mut self) -> *mut T {
        let p = self.0.as_mut_ptr();
        p.wrapping_add(p.align_offset(64))
    }
}

struct Shared<T>(*mut T);
unsafe impl<T> Send for Shared<T> {}
unsafe impl<T> Sync for Shared<T> {}

/// The buffers of a step: the logits, the new gradient, and each thread's kept and staging rows
/// (allocated once, outside the timed steps).
struct Buffers {
    logits: Buffer<u16>,
    grad: Buffer<u16>,
    kept: [Buffer<f32>; 2],
    staged: [Buffer<u16>; 2],
}

fn step(b: &mut Buffers, way: Way) -> f64 {
    let (l, g) = (Shared(b.logits.ptr()), Shared(b.grad.ptr()));
    let kept = [Shared(b.kept[0].ptr()), Shared(b.kept[1].ptr())];
    let staged = [Shared(b.staged[0].ptr()), Shared(b.staged[1].ptr())];
    let start = Instant::now();
    std::thread::scope(|scope| {
        for t in 0..2 {
            let (l, g, k, st) = (&l, &g, &kept[t], &staged[t]);
            let range = t * ROWS / 2..(t + 1) * ROWS / 2;
            // SAFETY: the features are checked in `main`; each thread writes its own rows and
            // its own kept and staging rows.
            scope.spawn(move || black_box(unsafe { rows(l.0, g.0, range, way, k.0, st.0) }));
        }
    });
    start.elapsed().as_secs_f64()
}

/// Bytes read + written per second by a two-thread copy of 512 MiB (best of four).
fn copy_rate() -> f64 {
    let n = 128 << 20;
    let (mut src, mut dst) = (Buffer::<f32>::new(n), Buffer::<f32>::new(n));
    src.0.iter_mut().for_each(|x| *x = 1.0);
    let (src, dst) = (&src.0[..n], &mut dst.0[..n]);
    let mut best = f64::INFINITY;
    for _ in 0..4 {
        let start = Instant::now();
        std::thread::scope(|scope| {
            for (d, s) in dst.chunks_mut(n / 2).zip(src.chunks(n / 2)) {
                scope.spawn(move || d.copy_from_slice(s));
            }
        });
        best = best.min(start.elapsed().as_secs_f64());
    }
    2.0 * (n * 4) as f64 / best
}

fn main() {
    assert!(
        is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512bf16"),
        "needs AVX-512 and AVX512-BF16"
    );
    let names: Vec<String> = std::env::args().skip(1).collect();
    let ways: Vec<Way> = names.iter().map(|n| Way::parse(n)).collect();
    // CPUID leaf 7, EBX bit 24: CLWB.
    #[allow(unused_unsafe)]
    let clwb = unsafe { __cpuid_count(7, 0) }.ebx & (1 << 24) != 0;
    assert!(clwb || !ways.contains(&Way::ClwbHalf), "clwb-half needs CLWB");
    let mut logits = Buffer::<u16>::new(ROWS * V);
    for (i, x) in logits.0.iter_mut().enumerate() {
        *x = ((((i * 7919) % 1000) as f32 / 100.0 - 5.0).to_bits() >> 16) as u16;
    }
    let mut grad = Buffer::<u16>::new(ROWS * V);
    grad.0.iter_mut().for_each(|x| *x = 1);
    let kept = [Buffer::<f32>::new(V), Buffer::<f32>::new(V)];
    let staged = [Buffer::<u16>::new(V), Buffer::<u16>::new(V)];
    let mut buffers = Buffers { logits, grad, kept, staged };
    println!("seconds a step (N={ROWS}, V={V}, bf16, two threads), x the floor of the round's copy");
    for round in 1..=6 {
        let copy = copy_rate();
        let floor = 2.0 * (ROWS * V * 2) as f64 / copy;
        print!("{round}: copy {:.1} GB/s, floor {floor:.4} |", copy / 1e9);
        for (name, &way) in names.iter().zip(&ways) {
            let s = step(&mut buffers, way);
            print!(" {name} {s:.4} ({:.2}x)", s / floor);
        }
        println!();
    }
}
