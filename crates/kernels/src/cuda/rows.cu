// flashgrpo's two streaming passes on CUDA, the same contract as the CPU engine (crates/kernels/src/
// stats.rs and objective/mod.rs):
//
// 1. row statistics: one block per row of `[rows, vocab]` logits (f32 / f16 / bf16), f32
//    accumulation, `u = logits * inv_temperature`:
//      max, sum_exp = sum exp(u - max), sum_exp_shifted = sum exp(u - max) * (u - max),
//      sum_u = sum u, target_u = u[target] (or NaN when the target is out of range),
//    written as five floats per row. Rows with `active[r] == 0` are not read.
// 2. gradient: from the token objective's per-row scalars (lse, a, b, c, d), computed on the host,
//      dlogits_j = a * [j == target] + p_j * (b + c * log p_j) + d,   p_j = exp(u_j - lse),
//    written in the logits' dtype, into a separate buffer or over the logits themselves (each
//    element is read before it is written, by the same thread). A row whose four scalars are
//    all zero is written as zeros without reading its logits.
// 3. fused-linear's helpers around cuBLAS's products: the bias broadcast into the f32 logits of a
//    chunk of rows, the bias gradient (column sums), and the gather / scatter of a chunk's active
//    rows of hidden states and `d hidden` (masked rows skip the products).
//
// Deterministic: every thread walks a fixed strided slice of the row in order, and the block
// combines the threads' partials by a fixed tree in shared memory; there are no atomics. Which
// elements a thread sums depends on where the row's 16-byte-aligned body starts, so a row's
// statistics are the same bits from run to run but, unlike the CPU engine's, may differ in the
// last bits at another position in the batch when V * sizeof(T) is not a multiple of 16.
// The per-element exponentials are `__expf` of shifted values (`u - max`, `log p`, both at most 0):
// its error (2 + 1.17|x| ulp) is largest where a term weighs least, and on an H100 the accurate
// `expf` made the statistics pass compute-bound (472 vs 387 us at B=1, T=4096, V=151936 bf16 under
// Nsight Compute) with the f32 gradchecks unchanged (docs/BENCHMARKS.md). The rescaling of running
// sums keeps `expf`.
//
// Compiled at run time by NVRTC (feature `cuda`); tests/cuda/nvrtc_compile.py compiles this file to
// PTX for sm_80 and sm_90 in CI, where there is no GPU.

#include <cuda_fp16.h>
#include <cuda_bf16.h>

#define FLASHGRPO_THREADS 256

// Tuning switches (`FLASHGRPO_CUDA_DEFINES`, read by device.rs; the defaults are the measured best,
// docs/BENCHMARKS.md): bytes each thread loads per step in the statistics and the gradient pass
// (whole 16-byte vectors), and the exponential of a shifted value (`u - max`, `log p`: at most 0).
#ifndef FLASHGRPO_STATS_BYTES
#define FLASHGRPO_STATS_BYTES 16
#endif
#ifndef FLASHGRPO_GRAD_BYTES
#define FLASHGRPO_GRAD_BYTES 16
#endif
#ifndef FLASHGRPO_FAST_EXP
#define FLASHGRPO_FAST_EXP 1
#endif

// NVRTC has no <cmath>: the constants by their bits.
#define FLASHGRPO_NEG_INF __int_as_float(0xff800000)
#define FLASHGRPO_NAN __int_as_float(0x7fc00000)

struct Partial {
    float max;
    float sum_exp;
    float sum_exp_shifted;
    float sum_u;
};

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
    return __float2bfloat16_rn(x);
}

// exp of a value at most 0, the bulk of both passes' arithmetic. `__expf` (ex2.approx of d*log2 e)
// errs by 2 + 1.17|d| ulp: largest where exp(d) is smallest, and so where a term weighs least in
// the row's sums.
__device__ __forceinline__ float exp_shifted(float d) {
#if FLASHGRPO_FAST_EXP
    return __expf(d);
#else
    return expf(d);
#endif
}

// Raises the running max to `m` when `m` is above it, rescaling the sums kept relative to the old max.
__device__ __forceinline__ void raise_max(Partial &p, float m) {
    if (m > p.max) {
        if (p.sum_exp > 0.0f) {
            float shift = p.max - m;  // < 0
            float k = expf(shift);
            p.sum_exp_shifted = (p.sum_exp_shifted + shift * p.sum_exp) * k;
            p.sum_exp *= k;
        }
        p.max = m;
    }
}

// Adds the value `u` to a running partial (online softmax with the shifted entropy sum). A NaN or
// an infinite `u` turns `sum_exp` / `sum_exp_shifted` into NaN (NaN - max, inf - inf, -inf - -inf).
__device__ __forceinline__ void push(Partial &p, float u) {
    raise_max(p, u);
    float d = u - p.max;
    float e = exp_shifted(d);
    p.sum_exp += e;
    p.sum_exp_shifted += e * d;
    p.sum_u += u;
}

__device__ __forceinline__ bool poisoned(const Partial &p) {
    return p.sum_exp != p.sum_exp || p.sum_exp_shifted != p.sum_exp_shifted;  // NaN
}

// Combines two partials of disjoint parts of a row. A NaN (from a NaN or infinite logit, see
// `push`) is carried to the result, so that the host's finiteness check sees it, as the CPU's does.
__device__ __forceinline__ Partial combine(Partial x, Partial y) {
    float m = fmaxf(x.max, y.max);
    Partial r;
    r.max = m;
    r.sum_exp = 0.0f;
    r.sum_exp_shifted = 0.0f;
    r.sum_u = x.sum_u + y.sum_u;
    if (poisoned(x) || poisoned(y)) {
        r.sum_exp = FLASHGRPO_NAN;
        r.sum_exp_shifted = FLASHGRPO_NAN;
        return r;
    }
    if (m == FLASHGRPO_NEG_INF) return r;
    if (x.sum_exp > 0.0f) {
        float shift = x.max - m;
        float k = expf(shift);
        r.sum_exp += x.sum_exp * k;
        r.sum_exp_shifted += (x.sum_exp_shifted + shift * x.sum_exp) * k;
    }
    if (y.sum_exp > 0.0f) {
        float shift = y.max - m;
        float k = expf(shift);
        r.sum_exp += y.sum_exp * k;
        r.sum_exp_shifted += (y.sum_exp_shifted + shift * y.sum_exp) * k;
    }
    return r;
}

// 16-byte accesses. A row starts wherever `row * vocab` elements put it, so each row is split
// into a scalar head (up to the first 16-byte boundary of the pointer that sets it), a body of
// whole vectors of `W` elements, and a scalar tail. Every thread walks fixed positions in a fixed
// order whatever the split: the results stay deterministic.
struct RowSplit {
    int head;    // elements before the body
    int vectors; // whole vectors of W elements in the body
};

template <typename T>
__device__ __forceinline__ int elements_to_alignment(const T *p) {
    const unsigned long long a = reinterpret_cast<unsigned long long>(p);
    return a % sizeof(T) != 0 ? -1 : (int)(((16 - (a & 15)) & 15) / sizeof(T));
}

// The split of a row of `vocab` elements at `lead`, with `other` (which may equal `lead`) also
// 16-byte aligned at the body's start; otherwise the whole row is head (scalar).
template <int W, typename A, typename B>
__device__ __forceinline__ RowSplit split_row(const A *lead, const B *other, int vocab) {
    int head = elements_to_alignment(lead);
    const bool both = head >= 0 && head <= vocab &&
                      (reinterpret_cast<unsigned long long>(other + head) & 15) == 0;
    if (!both) return RowSplit{vocab, 0};
    return RowSplit{head, (vocab - head) / W};
}

// Walks a row's elements in this thread's fixed positions: `scalar(j)` on each head and tail
// element, `vector(j0)` on each body vector (its first element's index).
template <int W, typename Scalar, typename Vector>
__device__ __forceinline__ void walk_row(RowSplit split, int vocab, Scalar scalar, Vector vector) {
    const int body_end = split.head + split.vectors * W;
    for (int j = threadIdx.x; j < split.head; j += blockDim.x) scalar(j);
    for (int k = threadIdx.x; k < split.vectors; k += blockDim.x) vector(split.head + k * W);
    for (int j = body_end + threadIdx.x; j < vocab; j += blockDim.x) scalar(j);
}

// `W` elements from 16-byte aligned `p`, widened to f32.
template <int W, typename T>
__device__ __forceinline__ void load_vector(const T *p, float (&v)[W]) {
    constexpr int PER = 16 / sizeof(T);
    static_assert(W % PER == 0, "a vector is whole 16-byte loads");
#pragma unroll
    for (int k = 0; k < W / PER; ++k) {
        const uint4 raw = reinterpret_cast<const uint4 *>(p)[k];
        const T *e = reinterpret_cast<const T *>(&raw);
#pragma unroll
        for (int i = 0; i < PER; ++i) v[k * PER + i] = to_float(e[i]);
    }
}

// `W` values rounded to `T`, stored at 16-byte aligned `p`.
template <int W, typename T>
__device__ __forceinline__ void store_vector(T *p, const float (&v)[W]) {
    constexpr int PER = 16 / sizeof(T);
    static_assert(W % PER == 0, "a vector is whole 16-byte stores");
#pragma unroll
    for (int k = 0; k < W / PER; ++k) {
        uint4 raw;
        T *e = reinterpret_cast<T *>(&raw);
#pragma unroll
        for (int i = 0; i < PER; ++i) e[i] = from_float<T>(v[k * PER + i]);
        reinterpret_cast<uint4 *>(p)[k] = raw;
    }
}

// Adds `W` values to a running partial: the vector's max first, so that the running partial is
// rescaled at most once per vector (not per element); then the same per-element sums as `push`
// (a NaN or infinite value poisons the sums the same way).
template <int W>
__device__ __forceinline__ void push_vector(Partial &p, const float (&u)[W]) {
    float m = u[0];
#pragma unroll
    for (int i = 1; i < W; ++i) m = fmaxf(m, u[i]);
    raise_max(p, m);
    float sum_exp = 0.0f, sum_exp_shifted = 0.0f, sum_u = 0.0f;
#pragma unroll
    for (int i = 0; i < W; ++i) {
        float d = u[i] - p.max;
        float e = exp_shifted(d);
        sum_exp += e;
        sum_exp_shifted += e * d;
        sum_u += u[i];
    }
    p.sum_exp += sum_exp;
    p.sum_exp_shifted += sum_exp_shifted;
    p.sum_u += sum_u;
}

// Elements per step: by default one 16-byte load per thread; two or four were slower on an H100
// (fewer resident threads for the same bytes in flight).
template <typename T> struct Widths {
    static constexpr int STATS = FLASHGRPO_STATS_BYTES / sizeof(T);
};

template <typename T>
__device__ void row_stats(const T *__restrict__ logits, int vocab, float inv_temperature,
                          const long long *__restrict__ targets, const float *__restrict__ active,
                          float *__restrict__ out) {
    constexpr int W = Widths<T>::STATS;
    __shared__ Partial partials[FLASHGRPO_THREADS];
    const long long row = blockIdx.x;
    float *o = out + row * 5;
    if (active != nullptr && active[row] == 0.0f) {
        if (threadIdx.x == 0) {
            o[0] = FLASHGRPO_NEG_INF;
            o[1] = 0.0f;
            o[2] = 0.0f;
            o[3] = 0.0f;
            o[4] = FLASHGRPO_NAN;
        }
        return;
    }
    const T *z = logits + row * (long long)vocab;
    Partial p = {FLASHGRPO_NEG_INF, 0.0f, 0.0f, 0.0f};
    walk_row<W>(
        split_row<W>(z, z, vocab), vocab, [&](int j) { push(p, to_float(z[j]) * inv_temperature); },
        [&](int j0) {
            float u[W];
            load_vector<W>(z + j0, u);
#pragma unroll
            for (int i = 0; i < W; ++i) u[i] *= inv_temperature;
            push_vector<W>(p, u);
        });
    partials[threadIdx.x] = p;
    __syncthreads();
    for (int stride = blockDim.x / 2; stride > 0; stride /= 2) {
        if (threadIdx.x < stride) {
            partials[threadIdx.x] = combine(partials[threadIdx.x], partials[threadIdx.x + stride]);
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) {
        Partial r = partials[0];
        o[0] = r.max;
        o[1] = r.sum_exp;
        o[2] = r.sum_exp_shifted;
        o[3] = r.sum_u;
        long long y = targets != nullptr ? targets[row] : -1;
        o[4] = (y >= 0 && y < vocab) ? to_float(z[y]) * inv_temperature : FLASHGRPO_NAN;
    }
}

// One logit's gradient: `a * [j == target] + p * (b + c * log p) + d`.
struct GradientScalars {
    float lse, a, b, c, d, inv_temperature;
    __device__ __forceinline__ float at(float z, bool is_target) const {
        float log_p = z * inv_temperature - lse;
        float p = exp_shifted(log_p);
        float v = p * (b + c * log_p) + d;
        return is_target ? v + a : v;
    }
};

// `scalars`: five floats per row, (lse, a, b, c, d). `grad` may be `logits` (in place, `In` ==
// `Out`; each vector is read before the same thread writes it). Fused-linear reads its f32 logits
// and writes the gradient in the inputs' dtype (`In` = float, `Out` = half / bfloat16) for the
// tensor-core products that follow.
template <typename In, typename Out>
__device__ void row_gradient(const In *logits, Out *grad, int vocab, float inv_temperature,
                             const long long *__restrict__ targets, const float *__restrict__ scalars) {
    constexpr int W = FLASHGRPO_GRAD_BYTES / sizeof(Out);
    const long long row = blockIdx.x;
    const float *s = scalars + row * 5;
    const GradientScalars grad_of = {s[0], s[1], s[2], s[3], s[4], inv_temperature};
    const In *z = logits + row * (long long)vocab;
    Out *g = grad + row * (long long)vocab;
    const RowSplit split = split_row<W>(g, z, vocab);
    if (grad_of.a == 0.0f && grad_of.b == 0.0f && grad_of.c == 0.0f && grad_of.d == 0.0f) {
        float zeros[W];
#pragma unroll
        for (int i = 0; i < W; ++i) zeros[i] = 0.0f;
        walk_row<W>(split, vocab, [&](int j) { g[j] = from_float<Out>(0.0f); },
                    [&](int j0) { store_vector<W>(g + j0, zeros); });
        return;
    }
    const long long y = targets != nullptr ? targets[row] : -1;
    walk_row<W>(
        split, vocab, [&](int j) { g[j] = from_float<Out>(grad_of.at(to_float(z[j]), j == y)); },
        [&](int j0) {
            float v[W];
            load_vector<W>(z + j0, v);
#pragma unroll
            for (int i = 0; i < W; ++i) v[i] = grad_of.at(v[i], j0 + i == y);
            store_vector<W>(g + j0, v);
        });
}

// Fused-linear: every row of the f32 logits `z [rows, vocab]` set to the bias, before the product
// adds `hidden @ weight^T` to it.
template <typename T>
__device__ void bias_rows(float *z, const T *__restrict__ bias, long long rows, int vocab) {
    const long long total = rows * (long long)vocab;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        z[i] = to_float(bias[i % vocab]);
    }
}

// Fused-linear: the bias gradient, column sums of `dz [rows, vocab]` in row order (one thread per
// column: deterministic), written (`accumulate == 0`) or added (`accumulate != 0`) to `db`.
template <typename T>
__device__ void bias_grad(const T *__restrict__ dz, float *db, int rows, int vocab, int accumulate) {
    const int j = blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= vocab) return;
    float sum = accumulate ? db[j] : 0.0f;
    for (int r = 0; r < rows; ++r) sum += to_float(dz[(long long)r * vocab + j]);
    db[j] = sum;
}

// Fused-linear: the rows `index[0..rows]` of `src [*, width]` into `dst [rows, width]` (gather:
// a chunk's active rows when masked rows fall between them), or `src [rows, width]` back to those
// rows of `dst` (scatter: their `d hidden`). One element a thread, a grid-stride loop.
template <typename T>
__device__ void gather_rows(const T *__restrict__ src, T *__restrict__ dst, const long long *__restrict__ index,
                            long long rows, int width) {
    const long long total = rows * (long long)width;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        dst[i] = src[index[i / width] * width + i % width];
    }
}

extern "C" __global__ void __launch_bounds__(FLASHGRPO_THREADS)
    scatter_rows_f32(const float *__restrict__ src, float *__restrict__ dst, const long long *__restrict__ index,
                     long long rows, int width) {
    const long long total = rows * (long long)width;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        dst[index[i / width] * width + i % width] = src[i];
    }
}

#define FLASHGRPO_INSTANTIATE(NAME, T)                                                              \
    extern "C" __global__ void __launch_bounds__(FLASHGRPO_THREADS)                                 \
        row_stats_##NAME(const T *logits, int vocab, float inv_temperature,                          \
                         const long long *targets, const float *active, float *out) {                \
        row_stats<T>(logits, vocab, inv_temperature, targets, active, out);                          \
    }                                                                                                \
    extern "C" __global__ void __launch_bounds__(FLASHGRPO_THREADS)                                 \
        row_gradient_##NAME(const T *logits, T *grad, int vocab, float inv_temperature,              \
                            const long long *targets, const float *scalars) {                        \
        row_gradient<T, T>(logits, grad, vocab, inv_temperature, targets, scalars);                  \
    }                                                                                                \
    extern "C" __global__ void __launch_bounds__(FLASHGRPO_THREADS)                                 \
        row_gradient_f32_to_##NAME(const float *logits, T *grad, int vocab, float inv_temperature,   \
                                   const long long *targets, const float *scalars) {                 \
        row_gradient<float, T>(logits, grad, vocab, inv_temperature, targets, scalars);              \
    }                                                                                                \
    extern "C" __global__ void __launch_bounds__(FLASHGRPO_THREADS)                                 \
        bias_rows_##NAME(float *z, const T *bias, long long rows, int vocab) {                       \
        bias_rows<T>(z, bias, rows, vocab);                                                          \
    }                                                                                                \
    extern "C" __global__ void __launch_bounds__(FLASHGRPO_THREADS)                                 \
        bias_grad_##NAME(const T *dz, float *db, int rows, int vocab, int accumulate) {              \
        bias_grad<T>(dz, db, rows, vocab, accumulate);                                               \
    }                                                                                                \
    extern "C" __global__ void __launch_bounds__(FLASHGRPO_THREADS)                                 \
        gather_rows_##NAME(const T *src, T *dst, const long long *index, long long rows, int width) {   \
        gather_rows<T>(src, dst, index, rows, width);                                                \
    }

FLASHGRPO_INSTANTIATE(f32, float)
FLASHGRPO_INSTANTIATE(f16, __half)
FLASHGRPO_INSTANTIATE(bf16, __nv_bfloat16)
