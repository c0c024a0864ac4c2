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
//    chunk of rows, and the bias gradient (column sums).
//
// Deterministic: every thread walks a fixed strided slice of the row in order, and the block
// combines the threads' partials by a fixed tree in shared memory; there are no atomics.
// `expf`, not the fast `__expf`: its error (2 + 1.17|x| ulp) would use up a tenth of the f32
// tolerances at V = 151936, and these passes are bound by memory, not by arithmetic.
//
// Compiled at run time by NVRTC (feature `cuda`); tests/cuda/nvrtc_compile.py compiles this file to
// PTX for sm_80 and sm_90 in CI, where there is no GPU.

#include <cuda_fp16.h>
#include <cuda_bf16.h>

#define FLASHGRPO_THREADS 256

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

// Adds the value `u` to a running partial (online softmax with the shifted entropy sum). A NaN or
// an infinite `u` turns `sum_exp` / `sum_exp_shifted` into NaN (NaN - max, inf - inf, -inf - -inf).
__device__ __forceinline__ void push(Partial &p, float u) {
    if (u > p.max) {
        if (p.sum_exp > 0.0f) {
            float shift = p.max - u;  // < 0
            float k = expf(shift);
            p.sum_exp_shifted = (p.sum_exp_shifted + shift * p.sum_exp) * k;
            p.sum_exp *= k;
        }
        p.max = u;
    }
    float d = u - p.max;
    float e = expf(d);
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

template <typename T>
__device__ void row_stats(const T *__restrict__ logits, int vocab, float inv_temperature,
                          const long long *__restrict__ targets, const float *__restrict__ active,
                          float *__restrict__ out) {
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
    for (int j = threadIdx.x; j < vocab; j += blockDim.x) {
        push(p, to_float(z[j]) * inv_temperature);
    }
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

// `scalars`: five floats per row, (lse, a, b, c, d). `grad` may be `logits` (in place, `In` ==
// `Out`). Fused-linear reads its f32 logits and writes the gradient in the inputs' dtype (`In` =
// float, `Out` = half / bfloat16) for the tensor-core products that follow.
template <typename In, typename Out>
__device__ void row_gradient(const In *logits, Out *grad, int vocab, float inv_temperature,
                             const long long *__restrict__ targets, const float *__restrict__ scalars) {
    const long long row = blockIdx.x;
    const float *s = scalars + row * 5;
    const float lse = s[0], a = s[1], b = s[2], c = s[3], d = s[4];
    const In *z = logits + row * (long long)vocab;
    Out *g = grad + row * (long long)vocab;
    if (a == 0.0f && b == 0.0f && c == 0.0f && d == 0.0f) {
        for (int j = threadIdx.x; j < vocab; j += blockDim.x) g[j] = from_float<Out>(0.0f);
        return;
    }
    const long long y = targets != nullptr ? targets[row] : -1;
    for (int j = threadIdx.x; j < vocab; j += blockDim.x) {
        float log_p = to_float(z[j]) * inv_temperature - lse;
        float p = expf(log_p);
        float v = p * (b + c * log_p) + d;
        if (j == y) v += a;
        g[j] = from_float<Out>(v);
    }
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
    }

FLASHGRPO_INSTANTIATE(f32, float)
FLASHGRPO_INSTANTIATE(f16, __half)
FLASHGRPO_INSTANTIATE(bf16, __nv_bfloat16)
