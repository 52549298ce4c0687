// DS4 hyper-connections on CUDA for one decoded token (spec ../shared/reference/ds4-architecture.md
// 3.1-3.3): HCPre = the mixer projection m = r * (F v) (double accumulation, as the CPU reference),
// the pre/post/comb split with Sinkhorn normalisation, and u = sum_s pre_s X_s; HCPost = the
// new stream state. Launchers: ds4_kernels.h (one token) and ds4_prefill.h (a chunk of n_tok
// tokens, the same kernels with a token grid dimension). Element-wise sums and products use round-to-nearest
// intrinsics in the CPU's order (no FMA contraction), so they repeat the CPU's f32 arithmetic;
// exp differs from glibc's by at most an ulp or two.
// The decode step uses hc_split_kernel, or without a partial-sum scratch hc_fused_kernel
// (launch_hc_pre_fused / launch_hc_head_fused): the previous sublayer's HCPost, the mixer, Sinkhorn,
// u and the RMSNorm in one launch, the separate kernels' bits (the split kernel: up to the mixer's
// double summation order; see the section banners).
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <string>

#include "backend/cuda/cuda_async.cuh"
#include "backend/cuda/cuda_kernels.h"
#include "backend/cuda/cuda_pdl.cuh"
#include "backend/cuda/cuda_smem.cuh"
#include "backend/cuda/ds4_kernels.h"
#include "backend/cuda/ds4_prefill.h"
#include "core/error.h"

#include "backend/cuda/ktrace.h"

FATHOM_KTRACE_TU(ds4_hc)

namespace fathom::cuda::ds4 {
namespace {

// Tokens: every kernel takes its token from blockIdx.y (decode: one token, gridDim.y = 1), so the
// chunked prefill launchers (ds4_prefill.h) run this same code, bit for bit, over n_tok tokens; the
// one exception is the chunk's mixer, hc_mix_tok_kernel (one block per token, x read once), which
// repeats hc_mix_kernel's arithmetic and reduction tree (same bits; tested against it).
//
// Mixer: one block per fn row (plus one for r), kMixThreads threads, each thread a few 8-element
// units of the row read with 16-byte loads (all issued before the first use), so a row costs about
// one memory round trip instead of 64 dependent ones. Sinkhorn: one warp, the n x n matrix in
// registers (n is a template parameter), in a block of its own beside the u blocks.
constexpr int kMixThreads = 1024, kApplyThreads = 256, kMaxHc = 5;
constexpr int64_t kMaxGridY = 65535;  // tokens per launch (gridDim.y)

__device__ __forceinline__ double block_sum_d(double v, double *red) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (lane == 0) red[warp] = v;
    __syncthreads();
    double t = 0;
    if (warp == 0) {  // the warp sums in a fixed tree order (deterministic)
        t = lane < static_cast<int>(blockDim.x >> 5) ? red[lane] : 0.0;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) t += __shfl_xor_sync(0xffffffffu, t, o);
    }
    return t;  // valid in thread 0
}

// Eight consecutive elements of x / of a row (f16 or f32) as floats; 16-byte loads (VEC) or scalar.
template <bool VEC>
__device__ __forceinline__ void loadx8(const float *x, int64_t e, float *xv) {
    if constexpr (VEC) {
        const float4 x0 = *reinterpret_cast<const float4 *>(x + e), x1 = *reinterpret_cast<const float4 *>(x + e + 4);
        xv[0] = x0.x, xv[1] = x0.y, xv[2] = x0.z, xv[3] = x0.w, xv[4] = x1.x, xv[5] = x1.y, xv[6] = x1.z, xv[7] = x1.w;
    } else {
#pragma unroll
        for (int i = 0; i < 8; ++i) xv[i] = x[e + i];
    }
}
template <bool F16, bool VEC>
__device__ __forceinline__ void loadw8(const uint8_t *row, int64_t e, float *w) {
    if constexpr (VEC) {
        if constexpr (F16) {
            const uint4 h = *reinterpret_cast<const uint4 *>(reinterpret_cast<const __half *>(row) + e);
            const uint32_t hw[4] = {h.x, h.y, h.z, h.w};
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const float2 f = __half22float2(*reinterpret_cast<const __half2 *>(&hw[i]));
                w[2 * i] = f.x, w[2 * i + 1] = f.y;
            }
        } else {
            const float *r = reinterpret_cast<const float *>(row) + e;
            const float4 w0 = *reinterpret_cast<const float4 *>(r), w1 = *reinterpret_cast<const float4 *>(r + 4);
            w[0] = w0.x, w[1] = w0.y, w[2] = w0.z, w[3] = w0.w, w[4] = w1.x, w[5] = w1.y, w[6] = w1.z, w[7] = w1.w;
        }
    } else {
#pragma unroll
        for (int i = 0; i < 8; ++i)
            w[i] = F16 ? __half2float(reinterpret_cast<const __half *>(row)[e + i])
                       : reinterpret_cast<const float *>(row)[e + i];
    }
}
template <bool F16, bool VEC>
__device__ __forceinline__ void load8(const uint8_t *row, const float *x, int64_t e, float *w, float *xv) {
    loadx8<VEC>(x, e, xv);
    loadw8<F16, VEC>(row, e, w);
}

// Blocks b < n_mix: mix[b] = fn row b . v (double sum of exact products, rounded once); block n_mix:
// mix[n_mix] = r = 1 / sqrt(mean(v^2) + eps). v = x [n] of token blockIdx.y (x [n_tok, n], mix
// [n_tok, n_mix + 1]). Thread t takes the 8-element units t,
// t + kMixThreads, ... (2 at a time, loads first); the tail n % 8 goes element-wise to the first threads.
template <bool F16, bool VEC>
__global__ void __launch_bounds__(kMixThreads)
    hc_mix_kernel(const uint8_t *__restrict__ fn, size_t row_bytes, const float *__restrict__ x, int64_t n,
                  int n_mix, float rms_eps, float *mix) {
    __shared__ double red[kMixThreads / 32];
    x += static_cast<size_t>(blockIdx.y) * n;
    mix += static_cast<size_t>(blockIdx.y) * (n_mix + 1);
    const int b = blockIdx.x;
    const bool sq = b == n_mix;  // the r block: v . v
    const uint8_t *row = fn + static_cast<size_t>(sq ? 0 : b) * row_bytes;
    const int64_t units = n / 8;
    double acc = 0;
    constexpr int U = 2;  // units in flight per thread (2 cover n = 16384 at 1024 threads)
    for (int64_t u0 = threadIdx.x; u0 < units; u0 += static_cast<int64_t>(U) * kMixThreads) {
        float w[U][8], xv[U][8];
#pragma unroll
        for (int k = 0; k < U; ++k) {
            const int64_t u = u0 + static_cast<int64_t>(k) * kMixThreads;
            if (u < units) load8<F16, VEC>(row, x, u * 8, w[k], xv[k]);
        }
#pragma unroll
        for (int k = 0; k < U; ++k) {
            if (u0 + static_cast<int64_t>(k) * kMixThreads >= units) break;
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                const double xd = static_cast<double>(xv[k][i]);
                acc = fma(sq ? xd : static_cast<double>(w[k][i]), xd, acc);
            }
        }
    }
    for (int64_t e = units * 8 + threadIdx.x; e < n; e += kMixThreads) {
        const float w = F16 ? __half2float(reinterpret_cast<const __half *>(row)[e]) : reinterpret_cast<const float *>(row)[e];
        const double xd = static_cast<double>(x[e]);
        acc = fma(sq ? xd : static_cast<double>(w), xd, acc);
    }
    const double t = block_sum_d(acc, red);
    if (threadIdx.x == 0)
        mix[b] = !sq ? static_cast<float>(t)
                     : static_cast<float>(1.0 / sqrt(t / static_cast<double>(n) + static_cast<double>(rms_eps)));
}

// Mixer of a chunk (prefill, n <= kMixUnitsMax * 8): one block per token (blockIdx.x), every output b
// <= n_mix. Thread t's x units (t, t + kMixThreads: the single pass of hc_mix_kernel's loop) and tail
// element stay in registers, so x is read once per token instead of once per output. Each output's
// per-thread fma chain and reduction tree (warp butterfly, then warp 0's butterfly over the warp
// totals) are hc_mix_kernel's with block_sum_d, operation for operation: the same bits.
constexpr int kMixU = 2, kMixUnitsMax = kMixU * kMixThreads, kMaxMix = (2 + kMaxHc) * kMaxHc + 1;

template <bool F16, bool VEC>
__global__ void __launch_bounds__(kMixThreads)
    hc_mix_tok_kernel(const uint8_t *__restrict__ fn, size_t row_bytes, const float *__restrict__ x, int64_t n,
                      int n_mix, float rms_eps, float *mix) {
    __shared__ double red[kMaxMix][kMixThreads / 32];
    x += static_cast<size_t>(blockIdx.x) * n;
    mix += static_cast<size_t>(blockIdx.x) * (n_mix + 1);
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int64_t units = n / 8, e_tail = units * 8 + tid;
    float xv[kMixU][8];
#pragma unroll
    for (int k = 0; k < kMixU; ++k) {
        const int64_t u = tid + static_cast<int64_t>(k) * kMixThreads;
        if (u < units) loadx8<VEC>(x, u * 8, xv[k]);
    }
    const float x_tail = e_tail < n ? x[e_tail] : 0.0f;
    for (int b = 0; b <= n_mix; ++b) {
        const bool sq = b == n_mix;
        const uint8_t *row = fn + static_cast<size_t>(sq ? 0 : b) * row_bytes;
        double acc = 0;
        float w[kMixU][8];
#pragma unroll
        for (int k = 0; k < kMixU; ++k) {
            const int64_t u = tid + static_cast<int64_t>(k) * kMixThreads;
            if (u < units) loadw8<F16, VEC>(row, u * 8, w[k]);  // sq: row 0, unused (as hc_mix_kernel)
        }
#pragma unroll
        for (int k = 0; k < kMixU; ++k) {
            if (tid + static_cast<int64_t>(k) * kMixThreads >= units) break;
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                const double xd = static_cast<double>(xv[k][i]);
                acc = fma(sq ? xd : static_cast<double>(w[k][i]), xd, acc);
            }
        }
        if (e_tail < n) {
            const float wt = F16 ? __half2float(reinterpret_cast<const __half *>(row)[e_tail])
                                 : reinterpret_cast<const float *>(row)[e_tail];
            const double xd = static_cast<double>(x_tail);
            acc = fma(sq ? xd : static_cast<double>(wt), xd, acc);
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
        if (lane == 0) red[b][warp] = acc;
    }
    __syncthreads();
    for (int b = warp; b <= n_mix; b += kMixThreads / 32) {  // warp b finishes output b as block_sum_d's warp 0
        double t = red[b][lane];
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) t += __shfl_xor_sync(0xffffffffu, t, o);
        if (lane == 0)
            mix[b] = b != n_mix ? static_cast<float>(t)
                                : static_cast<float>(1.0 / sqrt(t / static_cast<double>(n) + static_cast<double>(rms_eps)));
    }
}

__device__ __forceinline__ uint64_t globaltimer_ns() {
    uint64_t t;
    asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
    return t;
}

__device__ __forceinline__ float sigmoid_f(float x) {
    return __frcp_rn(__fadd_rn(1.0f, expf(-x)));
}

// post and comb from the mix (one warp; N = n_hc): the CPU's hc_split_sinkhorn + sinkhorn, operation
// for operation (sums in index order, IEEE division). Lane l < N*N owns comb[l] (row j = l / N,
// column k = l % N) in a register and reads the other entries of its row or column by shuffles, so a
// normalisation step costs N shuffles, N adds and one division of latency (lanes >= N*N compute
// unused values).
template <int N>
__device__ void hc_sinkhorn_warp(int iters, float eps, const float *__restrict__ mix, const float *__restrict__ base,
                                 const float *__restrict__ scale, float *__restrict__ post, float *__restrict__ comb) {
    const int l = threadIdx.x & 31;
    const bool act = l < N * N;
    const int j = act ? l / N : 0, k = act ? l % N : 0;
    const float r = mix[(2 + N) * N];
    if (l < N)
        post[l] = __fmul_rn(2.0f, sigmoid_f(__fadd_rn(__fmul_rn(__fmul_rn(mix[N + l], r), scale[1]), base[N + l])));
    float v = act ? __fadd_rn(__fmul_rn(__fmul_rn(mix[2 * N + l], r), scale[2]), base[2 * N + l]) : 0.0f;
    // 1. row softmax, + eps
    float mx = __shfl_sync(0xffffffffu, v, j * N);
#pragma unroll
    for (int q = 1; q < N; ++q) mx = fmaxf(mx, __shfl_sync(0xffffffffu, v, j * N + q));
    v = expf(__fsub_rn(v, mx));
    float sum = 0.0f;
#pragma unroll
    for (int q = 0; q < N; ++q) sum = __fadd_rn(sum, __shfl_sync(0xffffffffu, v, j * N + q));
    v = __fadd_rn(__fdiv_rn(v, sum), eps);
    // 2. column normalise; 3. (iters - 1) rounds of row then column normalisation
    for (int it = 0; it < 2 * iters - 1; ++it) {
        const bool col = (it & 1) == 0;
        float s = 0.0f;
#pragma unroll
        for (int q = 0; q < N; ++q) s = __fadd_rn(s, __shfl_sync(0xffffffffu, v, col ? q * N + k : j * N + q));
        v = __fdiv_rn(v, __fadd_rn(s, eps));
    }
    if (act) comb[l] = v;
}

// Blocks 0 .. gridDim.x - 2: u[i] = sum_s pre_s X_s[i] for their slice of kApplyThreads elements
// (pre_s = sigmoid(m_s scale[0] + base[s]) + eps, m_s = mix[s] r); the last block: post and comb
// (warp 0, Sinkhorn), in parallel with the u blocks. Token blockIdx.y: mix [n_tok, (2+N)N + 1],
// x [n_tok, N, D], u [n_tok, D], post [n_tok, N], comb [n_tok, N, N].
template <int N>
__global__ void __launch_bounds__(kApplyThreads)
    hc_pre_apply_kernel(int64_t D, int iters, float eps, const float *__restrict__ mix, const float *__restrict__ base,
                        const float *__restrict__ scale, const float *__restrict__ x, float *__restrict__ u,
                        float *__restrict__ post, float *__restrict__ comb) {
    const size_t tok = blockIdx.y;
    mix += tok * ((2 + N) * N + 1);
    x += tok * N * D;
    u += tok * D;
    post += tok * N;
    comb += tok * N * N;
    if (blockIdx.x == gridDim.x - 1) {
        if (threadIdx.x < 32) hc_sinkhorn_warp<N>(iters, eps, mix, base, scale, post, comb);
        return;
    }
    __shared__ float pre_s[N];
    const int tid = threadIdx.x;
    if (tid < N) {
        const float m = __fmul_rn(mix[tid], mix[(2 + N) * N]);
        pre_s[tid] = __fadd_rn(sigmoid_f(__fadd_rn(__fmul_rn(m, scale[0]), base[tid])), eps);
    }
    __syncthreads();
    const int64_t i = static_cast<int64_t>(blockIdx.x) * kApplyThreads + tid;
    if (i >= D) return;
    float acc = 0;
#pragma unroll
    for (int s = 0; s < N; ++s) acc = __fadd_rn(acc, __fmul_rn(pre_s[s], x[s * D + i]));
    u[i] = acc;
}

// HC head (spec 3.4): pre_s = sigmoid(mix_s * r * scale[0] + base[s]) + eps; z = sum_s pre_s X_s.
__global__ void __launch_bounds__(kApplyThreads)
    hc_head_apply_kernel(int n, int64_t D, float eps, const float *__restrict__ mix, const float *__restrict__ base,
                         const float *__restrict__ scale, const float *__restrict__ x, float *__restrict__ z) {
    __shared__ float pre_s[kMaxHc];
    if (threadIdx.x < n) {
        const float m = __fmul_rn(mix[threadIdx.x], mix[n]);
        pre_s[threadIdx.x] = __fadd_rn(sigmoid_f(__fadd_rn(__fmul_rn(m, scale[0]), base[threadIdx.x])), eps);
    }
    __syncthreads();
    const int64_t i = static_cast<int64_t>(blockIdx.x) * kApplyThreads + threadIdx.x;
    if (i >= D) return;
    float acc = 0;
    for (int s = 0; s < n; ++s) acc = __fadd_rn(acc, __fmul_rn(pre_s[s], x[s * D + i]));
    z[i] = acc;
}

// HCPost of one position and stream k: post[k] y + sum_{j < n} comb[j n + k] x_old[j], the CPU's
// order (the product, then the n terms added in j order; round-to-nearest intrinsics, no FMA). xo:
// x_old[j] at this position (entries j >= n unused). hc_post_kernel and both fused decode kernels
// build their state through this one function, so they agree bit for bit.
__device__ __forceinline__ float hc_post_elem(const float *post, const float *comb, int n, int k, float y,
                                              const float (&xo)[kMaxHc]) {
    float acc = __fmul_rn(post[k], y);
#pragma unroll
    for (int j = 0; j < kMaxHc; ++j)
        if (j < n) acc = __fadd_rn(acc, __fmul_rn(comb[j * n + k], xo[j]));
    return acc;
}

// Thread i of token blockIdx.y: x_new[k D + i] for every stream k, from the n values x_old[j D + i]
// (read once, kept in registers) and y[i]. y [n_tok, D], x_old / x_new [n_tok, n, D], post [n_tok, n],
// comb [n_tok, n, n].
__global__ void hc_post_kernel(int n, int64_t D, const float *__restrict__ y, const float *__restrict__ x_old,
                               const float *__restrict__ post, const float *__restrict__ comb, float *__restrict__ x_new) {
    const size_t tok = blockIdx.y;
    y += tok * D;
    x_old += tok * n * D;
    x_new += tok * n * D;
    post += tok * n;
    comb += tok * n * n;
    const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (i >= D) return;
    float xo[kMaxHc];
#pragma unroll
    for (int j = 0; j < kMaxHc; ++j) xo[j] = j < n ? x_old[j * D + i] : 0.0f;
    const float yi = y[i];
    for (int k = 0; k < n; ++k) x_new[k * D + i] = hc_post_elem(post, comb, n, k, yi, xo);
}

// Thread i of token blockIdx.y: out[tok * out_stride + i] = (x_0[i] + ... + x_(n-1)[i]) / n, summed in
// stream order then divided (the CPU's dspark_capture, bit for bit). x [n_tok, n, D].
__global__ void hc_stream_mean_kernel(int n, int64_t D, const float *__restrict__ x, float *__restrict__ out,
                                      int64_t out_stride) {
    const size_t tok = blockIdx.y;
    const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (i >= D) return;
    x += tok * n * D;
    float acc = 0.0f;
    for (int k = 0; k < n; ++k) acc = __fadd_rn(acc, x[k * D + i]);
    out[tok * out_stride + i] = __fdiv_rn(acc, static_cast<float>(n));
}

// ---- fused decode HC: [HCPost +] HCPre / HC head + RMSNorm in one launch ------------------------
// Grid: one block per mixer output (n_mix + 1, kMixThreads threads), as hc_mix_kernel. Every block
//   1. prefetches its fn row into L2 (weights only: the part allowed before the PDL wait), waits;
//   2. builds the whole state v = x_new (HCPost of y, x_old, post, comb, hc_post_kernel's operations
//      in its order: the same bits) or v = x in shared memory [n_hc * D], and writes its own slice
//      of x_new (block b: elements [b * chunk, (b + 1) * chunk)) for the next sublayer;
//   3. computes its mixer output from the shared v with hc_mix_kernel's units, fma chain and
//      reduction tree (same bits), writes mix[b], fences, and arrives on the counter (atomicInc
//      with wrap: the last of the G blocks reads G - 1 and the counter is back at zero, so graph
//      replays need no reset and no host state);
//   4. the last block to arrive (it has all of v in its own shared memory) does what the apply
//      kernel and launch_rms_norm did: warp 0 the Sinkhorn split (post, comb; not for the head),
//      warps 1..8 as rms_norm_kernel's 256 threads: u[i] = sum_s pre_s v[s D + i] (the apply
//      kernels' order), the squares summed in double per thread over i = t, t + 256, ..., the warp
//      butterfly and the fixed-order sum of the 8 warp totals, then out = (u * s) * w.
// The post/comb read in 2 and rewritten in 4 are safe in place: every block has read them before it
// arrives, and 4 runs after all arrivals.
struct fused_args {
    const uint8_t *fn;
    size_t row_bytes;
    const float *base, *scale;
    const float *y, *x;  // y null: v = x
    float *x_new, *post, *comb, *mix;
    uint32_t *sync;
    const float *norm;
    float *out;
    int64_t D;
    int n_hc, n_mix, iters;
    float hc_eps, rms_eps;
    bool head, vec4;  // vec4: D % 4 == 0 and x, y, x_new 16-byte aligned
    double *part;     // hc_split_kernel only: partial sums [n_mix + 1, gridDim.x]
    int64_t cols;     // hc_split_kernel only: columns per block (a multiple of 4, <= its block size)
};
// Row r's buffers of a multi-row launch (launch_hc_*_fused_rows' layout), for fused_args (the split
// kernel, gridDim.y rows) and hc_fused_io (the row-by-row fallback) alike: the same weights.
template <class IO>
__host__ __device__ __forceinline__ void offset_to_row(IO &a, int64_t r, int n_hc, int64_t D) {
    const int64_t N = n_hc;
    if (a.y) a.y += r * D;
    a.x += r * N * D;
    if (a.x_new) a.x_new += r * N * D;
    if (a.post) a.post += r * N;
    if (a.comb) a.comb += r * N * N;
    a.mix += r * static_cast<int64_t>(hc_rows_mix_floats(n_hc));
    a.sync += r;
    a.out += r * D;
    if (a.part) a.part += r * static_cast<int64_t>(hc_fused_part_count(n_hc));
}
constexpr int kNormThreads = 256;  // rms_norm_kernel's block size (its reduction order)

// Step 2 (sv: shared [n_hc * D]); the x_new slice [lo, hi) goes to global memory.
__device__ __forceinline__ void fused_state(const fused_args &a, float *sv, int64_t lo, int64_t hi) {
    __shared__ float pc[kMaxHc + kMaxHc * kMaxHc];  // post [n], comb [n, n]
    const int N = a.n_hc, tid = threadIdx.x;
    const int64_t D = a.D, n = N * D;
    if (!a.y) {  // v = x
        if (a.vec4)
#pragma unroll 4
            for (int64_t q = tid; q < n / 4; q += blockDim.x)
                reinterpret_cast<float4 *>(sv)[q] = reinterpret_cast<const float4 *>(a.x)[q];
        else
            for (int64_t e = tid; e < n; e += blockDim.x) sv[e] = a.x[e];
        return;
    }
    if (tid < N) pc[tid] = a.post[tid];
    else if (tid < N + N * N) pc[tid] = a.comb[tid - N];
    __syncthreads();
    const float *post = pc, *comb = pc + N;
    if (a.vec4) {  // thread: 4 positions i .. i + 3 of every stream
        for (int64_t i = static_cast<int64_t>(tid) * 4; i < D; i += static_cast<int64_t>(blockDim.x) * 4) {
            const float4 y4 = *reinterpret_cast<const float4 *>(a.y + i);
            float4 xo[kMaxHc];
#pragma unroll
            for (int j = 0; j < kMaxHc; ++j)
                xo[j] = j < N ? *reinterpret_cast<const float4 *>(a.x + j * D + i) : make_float4(0, 0, 0, 0);
            for (int k = 0; k < N; ++k) {
                float r[4];
                const float yq[4] = {y4.x, y4.y, y4.z, y4.w};
#pragma unroll
                for (int q = 0; q < 4; ++q) {
                    float xq[kMaxHc];  // lane q of every stream's float4
#pragma unroll
                    for (int j = 0; j < kMaxHc; ++j)
                        xq[j] = q == 0 ? xo[j].x : q == 1 ? xo[j].y : q == 2 ? xo[j].z : xo[j].w;
                    r[q] = hc_post_elem(post, comb, N, k, yq[q], xq);
                }
                const int64_t e = k * D + i;
                const float4 r4 = make_float4(r[0], r[1], r[2], r[3]);
                *reinterpret_cast<float4 *>(sv + e) = r4;
                if (e >= lo && e + 4 <= hi) *reinterpret_cast<float4 *>(a.x_new + e) = r4;  // lo, hi: multiples of 4
            }
        }
    } else {
        for (int64_t i = tid; i < D; i += blockDim.x) {
            float xo[kMaxHc];
#pragma unroll
            for (int j = 0; j < kMaxHc; ++j) xo[j] = j < N ? a.x[j * D + i] : 0.0f;
            const float yi = a.y[i];
            for (int k = 0; k < N; ++k) {
                const float acc = hc_post_elem(post, comb, N, k, yi, xo);
                const int64_t e = k * D + i;
                sv[e] = acc;
                if (e >= lo && e < hi) a.x_new[e] = acc;
            }
        }
    }
}

// Step 3: this block's mixer output from the shared state (hc_mix_kernel's arithmetic, x from sv).
template <bool F16, bool VEC>
__device__ __forceinline__ double fused_mix_dot(const fused_args &a, const float *sv, const uint8_t *row, bool sq, double *red) {
    const int tid = threadIdx.x;
    const int64_t n = a.n_hc * a.D, units = n / 8;
    double acc = 0;
    constexpr int U = 2;
    for (int64_t u0 = tid; u0 < units; u0 += static_cast<int64_t>(U) * kMixThreads) {
        float w[U][8], xv[U][8];
#pragma unroll
        for (int k = 0; k < U; ++k) {
            const int64_t u = u0 + static_cast<int64_t>(k) * kMixThreads;
            if (u >= units) continue;
            const float4 x0 = *reinterpret_cast<const float4 *>(sv + u * 8), x1 = *reinterpret_cast<const float4 *>(sv + u * 8 + 4);
            xv[k][0] = x0.x, xv[k][1] = x0.y, xv[k][2] = x0.z, xv[k][3] = x0.w;
            xv[k][4] = x1.x, xv[k][5] = x1.y, xv[k][6] = x1.z, xv[k][7] = x1.w;
            if (sq) {
#pragma unroll
                for (int i = 0; i < 8; ++i) w[k][i] = xv[k][i];  // the r block: v . v
            } else {
                loadw8<F16, VEC>(row, u * 8, w[k]);
            }
        }
#pragma unroll
        for (int k = 0; k < U; ++k) {
            if (u0 + static_cast<int64_t>(k) * kMixThreads >= units) break;
#pragma unroll
            for (int i = 0; i < 8; ++i) acc = fma(static_cast<double>(w[k][i]), static_cast<double>(xv[k][i]), acc);
        }
    }
    for (int64_t e = units * 8 + tid; e < n; e += kMixThreads) {
        const float w = sq ? sv[e]
                           : F16 ? __half2float(reinterpret_cast<const __half *>(row)[e])
                                 : reinterpret_cast<const float *>(row)[e];
        acc = fma(static_cast<double>(w), static_cast<double>(sv[e]), acc);
    }
    return block_sum_d(acc, red);
}

// u[i] of the last block (the apply kernels' sum, in their order).
__device__ __forceinline__ float fused_u(const float *sv, const float *pre, int N, int64_t D, int64_t i) {
    float acc = 0;
#pragma unroll
    for (int s = 0; s < kMaxHc; ++s)
        if (s < N) acc = __fadd_rn(acc, __fmul_rn(pre[s], sv[s * D + i]));
    return acc;
}

__device__ __forceinline__ void bar_norm() {  // named barrier 1 over the kNormThreads norm threads
    asm volatile("bar.sync 1, %0;" ::"r"(kNormThreads) : "memory");
}

// The Sinkhorn split of the tail (warp 0; smix: the mix in shared memory).
__device__ __forceinline__ void fused_sinkhorn(const fused_args &a, const float *smix) {
    switch (a.n_hc) {
    case 1: hc_sinkhorn_warp<1>(a.iters, a.hc_eps, smix, a.base, a.scale, a.post, a.comb); break;
    case 2: hc_sinkhorn_warp<2>(a.iters, a.hc_eps, smix, a.base, a.scale, a.post, a.comb); break;
    case 3: hc_sinkhorn_warp<3>(a.iters, a.hc_eps, smix, a.base, a.scale, a.post, a.comb); break;
    case 4: hc_sinkhorn_warp<4>(a.iters, a.hc_eps, smix, a.base, a.scale, a.post, a.comb); break;
    default: hc_sinkhorn_warp<5>(a.iters, a.hc_eps, smix, a.base, a.scale, a.post, a.comb); break;
    }
}

// Step 4 (last block): pre, the Sinkhorn split (warp 0) and out = RMSNorm(u) (warps 1 .. 8).
__device__ __forceinline__ void fused_tail(const fused_args &a, const float *sv) {
    __shared__ float smix[kMaxMix], pre[kMaxHc];
    __shared__ double wsum[kNormThreads / 32];
    const int tid = threadIdx.x, N = a.n_hc;
    if (tid <= a.n_mix) smix[tid] = __ldcg(a.mix + tid);  // other blocks' outputs: from L2
    __syncthreads();
    if (tid < N) {
        const float m = __fmul_rn(smix[tid], smix[a.n_mix]);
        pre[tid] = __fadd_rn(sigmoid_f(__fadd_rn(__fmul_rn(m, a.scale[0]), a.base[tid])), a.hc_eps);
    }
    __syncthreads();
    if (tid < 32) {
        if (!a.head) fused_sinkhorn(a, smix);
        return;
    }
    if (tid >= 32 + kNormThreads) return;
    const int t = tid - 32;  // rms_norm_kernel's threadIdx.x
    const int64_t D = a.D;
    double ss = 0;
    for (int64_t i = t; i < D; i += kNormThreads) {
        const float u = fused_u(sv, pre, N, D, i);
        ss += static_cast<double>(__fmul_rn(u, u));
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
    if ((t & 31) == 0) wsum[t >> 5] = ss;
    bar_norm();
    double tot = 0;
    for (int w = 0; w < kNormThreads / 32; ++w) tot += wsum[w];
    const float sc = 1.0f / sqrtf(static_cast<float>(tot / static_cast<double>(D)) + a.rms_eps);
    for (int64_t i = t; i < D; i += kNormThreads) {
        const float u = fused_u(sv, pre, N, D, i);
        a.out[i] = a.norm ? __fmul_rn(__fmul_rn(u, sc), a.norm[i]) : __fmul_rn(u, sc);
    }
}

template <bool F16, bool VEC>
__global__ void __launch_bounds__(kMixThreads) hc_fused_kernel(fused_args a) {
    extern __shared__ float4 fused_smem[];
    float *sv = reinterpret_cast<float *>(fused_smem);  // [n_hc * D]
    __shared__ double red[kMixThreads / 32];
    __shared__ bool last;
    const int tid = threadIdx.x, b = blockIdx.x;
    const bool sq = b == a.n_mix;
    const int64_t n = a.n_hc * a.D;
    const uint8_t *row = a.fn + static_cast<size_t>(sq ? 0 : b) * a.row_bytes;
    if (!sq) {  // 1. the row into L2 (one prefetch per 128-byte line) while the previous kernel ends
        const size_t bytes = static_cast<size_t>(n) * (F16 ? 2 : 4);
        for (size_t off = static_cast<size_t>(tid) * 128; off < bytes; off += static_cast<size_t>(kMixThreads) * 128)
            asm volatile("prefetch.global.L2 [%0];" ::"l"(row + off));
    }
    pdl_launch_dependents();
    pdl_wait();
    // 2. the state; block b owns x_new [lo, hi) (chunks a multiple of 4: never splits a float4)
    const int64_t chunk = ((n + gridDim.x - 1) / gridDim.x + 3) / 4 * 4, lo = b * chunk,
                  hi = lo + chunk < n ? lo + chunk : n;
    fused_state(a, sv, lo, hi);
    __syncthreads();
    // 3. mixer output b, then arrival
    const double t = fused_mix_dot<F16, VEC>(a, sv, row, sq, red);
    if (tid == 0)
        a.mix[b] = !sq ? static_cast<float>(t)
                       : static_cast<float>(1.0 / sqrt(t / static_cast<double>(n) + static_cast<double>(a.rms_eps)));
    __threadfence();  // this thread's x_new / mix stores are device-visible before the arrival
    __syncthreads();
    if (tid == 0) last = atomicInc(a.sync, gridDim.x - 1) == gridDim.x - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();
    fused_tail(a, sv);  // 4.
}

// ---- column-split fused decode HC: hc_split_kernel (hc_fused_io.part set) ---------------------------
// The same outputs as hc_fused_kernel with the work spread over the D columns instead of the mixer rows.
// Grid: B blocks of kSplitThreads; block j owns columns [j C, j C + C) of every stream (C a multiple of
// 4, the last block may have fewer, cj). Every block
//   1. loads its weight slice ws [n_mix, S] (row r, local element k C + c = fn[r][k D + j C + c],
//      zero past cj; f16 widened) BEFORE the PDL wait (weights only), then waits;
//   2. issues its state loads, stores the weights into shared memory, builds its state slice
//      vs [n_hc, C] (HCPost with hc_post_kernel's operations in its order: the same bits, or v = x)
//      and writes its x_new columns;
//   3. computes the partial double dots of all n_mix rows and of v . v over its slice: warp w, lane l
//      takes rows l (and l + 32) over the 4-element groups w, w + 32, ... (exact f32 products summed
//      in double), the 32 warp sums are added by a lane butterfly; part[r][j] = the block's sum;
//   4. arrives (syncthreads, thread 0 fences and atomicInc's with wrap: the counter is back at zero
//      after the last of the B arrivals, as in hc_fused_kernel). The last block: lane l of warp w sums
//      part[r][l + 32 q] (q = 0..3, in order) and the lane butterfly gives row r = w (+32): a fixed
//      order whatever the arrival order (deterministic). Then warp 0 runs the Sinkhorn split while
//      warps 1..31 copy the whole state (L2, cp.async) into shared memory and do the RMSNorm. The
//      copy is issued before the mix reduction, and the norm never waits on the Sinkhorn warp (named
//      barriers 1 and 2 leave warp 0 out); post / comb are first read by the next sublayer's kernel.
// Bits: the state is the unfused chain's; post and comb are too given the same mix. The mix sums
// (and the norm's sum of squares) run in another order than hc_mix_kernel's (rms_norm_kernel's), so
// a mix value (the norm scale) differs only where the double sums round to different floats (a
// relative 1e-16 perturbation of the sum: practically never); tests allow 1e-6 relative.
constexpr int kSplitThreads = 1024, kSplitWarps = kSplitThreads / 32, kCopyThreads = kSplitThreads - 32;
// Rows from which a multi-row launch takes hc_split_rows_kernel + hc_split_tail_kernel (below 3, rows x B
// blocks of hc_split_kernel are one wave).
constexpr int kSplitRowsFrom = 3;
static_assert(kHcFusedMaxBlocks <= 4 * 32, "the tail reduces at most 4 partials per lane");

__device__ __forceinline__ void bar_named(int id, int threads) {
    asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

// Step 1: ws[r S + k C + c] for r < n_mix, k < n_hc, c < C (zero for c >= cj), element idx =
// r n_hc C + k C + c. Thread t loads the batch idx = b0 + q kSplitThreads (q < kStageK, b0 = t + m
// kStageK kSplitThreads) with coalesced loads into registers; the first batch (all of a DS4 slice:
// 24 x 128 < 4096) is loaded before the PDL wait and stored after the state loads are issued, so
// both memory round trips overlap the previous kernel and each other.
constexpr int kStageK = 4;
template <bool F16>
__device__ __forceinline__ void split_stage_load(const fused_args &a, int b0, int64_t lo, int cj, float (&w)[kStageK]) {
    const int C = static_cast<int>(a.cols), NC = a.n_hc * C, total = a.n_mix * NC;
#pragma unroll
    for (int q = 0; q < kStageK; ++q) {
        const int idx = b0 + q * kSplitThreads, r = idx / NC, le = idx - r * NC, k = le / C, c = le - k * C;
        w[q] = 0.0f;
        if (idx < total && c < cj) {
            const uint8_t *row = a.fn + static_cast<size_t>(r) * a.row_bytes;
            const int64_t e = k * a.D + lo + c;
            w[q] = F16 ? __half2float(__ldg(reinterpret_cast<const __half *>(row) + e))
                       : __ldg(reinterpret_cast<const float *>(row) + e);
        }
    }
}
__device__ __forceinline__ void split_stage_store(const fused_args &a, float *ws, int b0, int S,
                                                  const float (&w)[kStageK]) {
    const int NC = a.n_hc * static_cast<int>(a.cols), total = a.n_mix * NC;
#pragma unroll
    for (int q = 0; q < kStageK; ++q) {
        const int idx = b0 + q * kSplitThreads, r = idx / NC;
        if (idx < total) ws[r * S + (idx - r * NC)] = w[q];
    }
}

// Step 2a: thread c < cj loads column lo + c of x (every stream) and y; the last warp loads post /
// comb into pc (shared [n + n n]) beside them. No shared store waits on them yet.
__device__ __forceinline__ void split_state_load(const fused_args &a, int64_t lo, int cj, float (&xo)[kMaxHc],
                                                 float &yi, float *pc) {
    const int N = a.n_hc, tid = threadIdx.x;
    const int64_t D = a.D, i = lo + tid;
    const bool live = tid < cj;
#pragma unroll
    for (int j = 0; j < kMaxHc; ++j) xo[j] = live && j < N ? a.x[j * D + i] : 0.0f;
    yi = live && a.y ? a.y[i] : 0.0f;
    const int p = tid - (kSplitThreads - 32);
    if (a.y && p >= 0 && p < N + N * N) pc[p] = p < N ? a.post[p] : a.comb[p - N];
}

// Step 2b (after a barrier: pc complete): vs[k C + c] (zero for c >= cj) and x_new[k D + lo + c];
// thread c < C owns column c (C <= kSplitThreads).
__device__ __forceinline__ void split_state_store(const fused_args &a, float *vs, int64_t lo, int cj,
                                                  const float (&xo)[kMaxHc], float yi, const float *pc) {
    const int N = a.n_hc, tid = threadIdx.x, C = static_cast<int>(a.cols);
    const int64_t D = a.D, i = lo + tid;
    const bool live = tid < cj;
    if (tid >= C) return;
    const float *post = pc, *comb = pc + N;
    for (int k = 0; k < N; ++k) {
        float v = xo[0];
#pragma unroll
        for (int j = 1; j < kMaxHc; ++j)
            if (j == k) v = xo[j];
        if (live && a.y) {  // hc_post_kernel's operations in its order
            v = hc_post_elem(post, comb, N, k, yi, xo);
            a.x_new[k * D + i] = v;
        }
        vs[k * C + tid] = live ? v : 0.0f;
    }
}

// Step 3: part[r B + blockIdx.x] for r <= n_mix (red: shared [kSplitWarps][kMaxMix]).
__device__ __forceinline__ void split_dots(const fused_args &a, const float *ws, const float *vs, int S,
                                           double (*red)[kMaxMix]) {
    const int tid = threadIdx.x, w = tid >> 5, l = tid & 31, R = a.n_mix + 1;
    const int G = a.n_hc * static_cast<int>(a.cols) / 4;  // 4-element groups of the slice
    for (int r = l; r < R; r += 32) {
        const float *wr = r == a.n_mix ? vs : ws + r * S;  // the r row: v . v
        double acc = 0;
        for (int g = w; g < G; g += kSplitWarps) {
            const float4 w4 = *reinterpret_cast<const float4 *>(wr + 4 * g);
            const float4 v4 = *reinterpret_cast<const float4 *>(vs + 4 * g);
            acc = fma(static_cast<double>(w4.x), static_cast<double>(v4.x), acc);
            acc = fma(static_cast<double>(w4.y), static_cast<double>(v4.y), acc);
            acc = fma(static_cast<double>(w4.z), static_cast<double>(v4.z), acc);
            acc = fma(static_cast<double>(w4.w), static_cast<double>(v4.w), acc);
        }
        red[w][r] = acc;
    }
    __syncthreads();
    for (int r = w; r < R; r += kSplitWarps) {
        double t = red[l][r];
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) t += __shfl_xor_sync(0xffffffffu, t, o);
        if (l == 0) a.part[static_cast<size_t>(r) * gridDim.x + blockIdx.x] = t;
    }
}

// out = RMSNorm(u) by the kCopyThreads threads t of warps 1..31: u[i] (the apply kernels' sum, in
// their order), u^2 summed in double per thread over i = t, t + kCopyThreads, ..., the lane
// butterfly, then a butterfly over the 31 warp totals that every warp repeats (the same bits in
// every lane). rms_norm_kernel sums in another order (256 threads), so the scale can differ only
// where the double sums round to different floats; out = (u * scale) * w as rms_norm_kernel.
__device__ __forceinline__ void split_norm(const fused_args &a, const float *st, const float *smix, int t) {
    __shared__ double wsum[32];
    const int N = a.n_hc, lane = t & 31;
    const int64_t D = a.D;
    float pre[kMaxHc];
#pragma unroll
    for (int s = 0; s < kMaxHc; ++s) {
        pre[s] = 0.0f;
        if (s < N) {
            const float m = __fmul_rn(smix[s], smix[a.n_mix]);
            pre[s] = __fadd_rn(sigmoid_f(__fadd_rn(__fmul_rn(m, a.scale[0]), a.base[s])), a.hc_eps);
        }
    }
    double ss = 0;
    for (int64_t i = t; i < D; i += kCopyThreads) {
        const float u = fused_u(st, pre, N, D, i);
        ss += static_cast<double>(__fmul_rn(u, u));
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
    if (lane == 0) wsum[t >> 5] = ss;
    bar_named(2, kCopyThreads);
    double tot = lane < kCopyThreads / 32 ? wsum[lane] : 0.0;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) tot += __shfl_xor_sync(0xffffffffu, tot, o);
    const float sc = 1.0f / sqrtf(static_cast<float>(tot / static_cast<double>(D)) + a.rms_eps);
    for (int64_t i = t; i < D; i += kCopyThreads) {
        const float u = fused_u(st, pre, N, D, i);
        a.out[i] = a.norm ? __fmul_rn(__fmul_rn(u, sc), a.norm[i]) : __fmul_rn(u, sc);
    }
}

// Step 4 (the last block; st: shared [n_hc, D], over the no longer needed ws / vs); B: the column blocks
// whose partial sums part holds.
__device__ __forceinline__ void split_tail(const fused_args &a, float *st, int B) {
    __shared__ float smix[kMaxMix];
    const int tid = threadIdx.x, w = tid >> 5, l = tid & 31, R = a.n_mix + 1;
    const int64_t n = a.n_hc * a.D;
    const float *src = a.y ? a.x_new : a.x;  // x_new: the other blocks' writes, read from L2 only
    if (w > 0 && a.vec4)
        for (int64_t q = tid - 32; q < n / 4; q += kCopyThreads) cp_async16(st + 4 * q, src + 4 * q);
    for (int r = w; r < R; r += kSplitWarps) {
        const double *pr = a.part + static_cast<size_t>(r) * B;
        double p[4];
#pragma unroll
        for (int q = 0; q < 4; ++q) p[q] = l + 32 * q < B ? __ldcg(pr + l + 32 * q) : 0.0;
        double t = ((p[0] + p[1]) + p[2]) + p[3];
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) t += __shfl_xor_sync(0xffffffffu, t, o);
        if (l == 0) {
            const float m = r < a.n_mix ? static_cast<float>(t)
                                        : static_cast<float>(1.0 / sqrt(t / static_cast<double>(n) +
                                                                        static_cast<double>(a.rms_eps)));
            smix[r] = m;
            a.mix[r] = m;
        }
    }
    __syncthreads();
    if (w == 0) {
        if (!a.head) fused_sinkhorn(a, smix);
        return;
    }
    if (a.vec4) cp_async_wait_all();
    else
        for (int64_t e = tid - 32; e < n; e += kCopyThreads) st[e] = __ldcg(src + e);
    bar_named(1, kCopyThreads);  // the state of all copying threads is in st
    split_norm(a, st, smix, tid - 32);
}

// Steps 1-3 of column slice blockIdx.x for rows [r0, r1) (a: row 0's buffers): the weight slice staged
// once (its first batch loaded before the PDL wait), then per row its state slice (x_new written) and its
// partial sums part[.][blockIdx.x]. red, pc: the block's shared scratch (split_dots, post / comb).
template <bool F16>
__device__ __forceinline__ void split_parts(const fused_args &a, int r0, int r1, double (*red)[kMaxMix], float *pc) {
    extern __shared__ float4 split_smem[];
    const int C = static_cast<int>(a.cols), NC = a.n_hc * C, S = NC + (36 - NC % 32) % 32;  // S % 32 == 4
    const int64_t lo = static_cast<int64_t>(blockIdx.x) * C;
    const int cj = static_cast<int>(a.D - lo < C ? a.D - lo : C);
    float *ws = reinterpret_cast<float *>(split_smem), *vs = ws + a.n_mix * S;  // [n_mix, S], [n_hc, C]
    float w[kStageK], xo[kMaxHc], yi;
    const int tid = threadIdx.x, total = a.n_mix * NC;
    split_stage_load<F16>(a, tid, lo, cj, w);  // 1. (first batch)
    pdl_launch_dependents();
    pdl_wait();
    fused_args ar = a;
    offset_to_row(ar, r0, a.n_hc, a.D);
    split_state_load(ar, lo, cj, xo, yi, pc);  // 2.
    split_stage_store(a, ws, tid, S, w);
    for (int b0 = tid + kStageK * kSplitThreads; b0 < total; b0 += kStageK * kSplitThreads) {
        split_stage_load<F16>(a, b0, lo, cj, w);
        split_stage_store(a, ws, b0, S, w);
    }
    for (int r = r0;;) {
        __syncthreads();  // ws and this row's pc complete; the previous row's vs / red reads done
        split_state_store(ar, vs, lo, cj, xo, yi, pc);
        __syncthreads();
        split_dots(ar, ws, vs, S, red);  // 3. part[.][blockIdx.x] of row r
        if (++r >= r1) break;
        __syncthreads();  // pc, red free again
        ar = a;
        offset_to_row(ar, r, a.n_hc, a.D);
        split_state_load(ar, lo, cj, xo, yi, pc);
    }
}

template <bool F16>
__global__ void __launch_bounds__(kSplitThreads) hc_split_kernel(fused_args a) {
    FATHOM_KTRACE_SCOPE(k_hc_split);
    extern __shared__ float4 split_smem[];
    __shared__ double red[kSplitWarps][kMaxMix];
    __shared__ float pc[kMaxHc + kMaxHc * kMaxHc];  // post [n], comb [n, n]
    __shared__ bool last;
    split_parts<F16>(a, static_cast<int>(blockIdx.y), static_cast<int>(blockIdx.y) + 1, red, pc);  // 1-3.
    if (blockIdx.y > 0) offset_to_row(a, blockIdx.y, a.n_hc, a.D);
    __syncthreads();  // 4. every thread's x_new / part stores happen before thread 0's fence
    if (threadIdx.x == 0) {
        __threadfence();
        const bool l = atomicInc(a.sync, gridDim.x - 1) == gridDim.x - 1;
        if (l) __threadfence();
        last = l;
    }
    __syncthreads();
    if (last) split_tail(a, reinterpret_cast<float *>(split_smem), static_cast<int>(gridDim.x));
}

// ---- the split kernel for many rows: hc_split_rows_kernel + hc_split_tail_kernel ------------------
// hc_split_kernel over gridDim.y = rows runs rows x B blocks of 1024 threads: 8 waves at 16 rows (86 us a
// call on the H100, against 14 for one row). Here block (j, y) takes column slice j of rows_per_block
// rows y * rows_per_block + q (split_parts: the weight slice staged once for all of them, each row's
// partial sums part[r][j] as hc_split_kernel's, bit for bit); no arrival: one block per row of
// hc_split_tail_kernel (launched after it, PDL) runs step 4 with B = the column blocks. Every row's
// state, mix, post / comb and output are hc_split_kernel's bits (the same operations in the same order).
template <bool F16>
__global__ void __launch_bounds__(kSplitThreads) hc_split_rows_kernel(fused_args a, int rows, int rows_per_block) {
    __shared__ double red[kSplitWarps][kMaxMix];
    __shared__ float pc[kMaxHc + kMaxHc * kMaxHc];
    const int r0 = static_cast<int>(blockIdx.y) * rows_per_block;
    split_parts<F16>(a, r0, min(rows, r0 + rows_per_block), red, pc);
}

// Step 4 of row blockIdx.x (the state from L2 into shared memory: n_hc * D floats), B column blocks.
__global__ void __launch_bounds__(kSplitThreads) hc_split_tail_kernel(fused_args a, int B) {
    extern __shared__ float4 split_smem[];
    pdl_wait();  // every part of hc_split_rows_kernel
    offset_to_row(a, blockIdx.x, a.n_hc, a.D);
    split_tail(a, reinterpret_cast<float *>(split_smem), B);
}

__global__ void sleep_kernel(uint64_t ns) {
    const uint64_t t0 = globaltimer_ns();
    while (globaltimer_ns() - t0 < ns) __nanosleep(1000);
}

void check_launch(const char *what) {
    const cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) throw error(std::string("cuda ds4 ") + what + ": launch failed: " + cudaGetErrorString(e));
}

// mix [n_tok, n_mix + 1] from fn rows [n_mix, n] and x [n_tok, n]: 16-byte loads when the rows, their
// stride, x and (several tokens) n allow them. Either path gives the same bits (same units per thread).
// batch (prefill): one block per token (hc_mix_tok_kernel) when n fits its registers; else (and for
// decode) one block per output and token.
void launch_mix(dtype fn_type, const void *fn, size_t row_bytes, const float *x, int64_t n, int64_t n_tok, int n_mix,
                float rms_eps, float *mix, bool batch, cudaStream_t s) {
    const auto *w = static_cast<const uint8_t *>(fn);
    const bool vec = reinterpret_cast<uintptr_t>(fn) % 16 == 0 && row_bytes % 16 == 0 &&
                     reinterpret_cast<uintptr_t>(x) % 16 == 0 && (n_tok == 1 || n % 4 == 0);
    if (batch && n <= static_cast<int64_t>(kMixUnitsMax) * 8 && n_mix + 1 <= kMaxMix) {
        const unsigned g = static_cast<unsigned>(n_tok);
        if (fn_type == dtype::f16) {
            if (vec)
                hc_mix_tok_kernel<true, true><<<g, kMixThreads, 0, s>>>(w, row_bytes, x, n, n_mix, rms_eps, mix);
            else
                hc_mix_tok_kernel<true, false><<<g, kMixThreads, 0, s>>>(w, row_bytes, x, n, n_mix, rms_eps, mix);
        } else {
            if (vec)
                hc_mix_tok_kernel<false, true><<<g, kMixThreads, 0, s>>>(w, row_bytes, x, n, n_mix, rms_eps, mix);
            else
                hc_mix_tok_kernel<false, false><<<g, kMixThreads, 0, s>>>(w, row_bytes, x, n, n_mix, rms_eps, mix);
        }
        return;
    }
    const dim3 grid(static_cast<unsigned>(n_mix + 1), static_cast<unsigned>(n_tok));
    if (fn_type == dtype::f16) {
        if (vec)
            hc_mix_kernel<true, true><<<grid, kMixThreads, 0, s>>>(w, row_bytes, x, n, n_mix, rms_eps, mix);
        else
            hc_mix_kernel<true, false><<<grid, kMixThreads, 0, s>>>(w, row_bytes, x, n, n_mix, rms_eps, mix);
    } else {
        if (vec)
            hc_mix_kernel<false, true><<<grid, kMixThreads, 0, s>>>(w, row_bytes, x, n, n_mix, rms_eps, mix);
        else
            hc_mix_kernel<false, false><<<grid, kMixThreads, 0, s>>>(w, row_bytes, x, n, n_mix, rms_eps, mix);
    }
}

template <int N>
void launch_pre_apply(dim3 blocks, const hc_params &p, const float *mix, const float *base, const float *scale,
                      const float *x, float *u, float *post, float *comb, cudaStream_t s) {
    hc_pre_apply_kernel<N><<<blocks, kApplyThreads, 0, s>>>(p.dim, p.sinkhorn_iters, p.hc_eps, mix, base, scale, x, u,
                                                            post, comb);
}

// HCPre of n_tok tokens (decode: 1): the checks, the mixer, then the apply/Sinkhorn kernel.
void hc_pre_tokens(const hc_params &p, dtype fn_type, const void *fn, size_t fn_row_bytes, const float *base,
                   const float *scale, const float *x, int64_t n_tok, bool batch, float *mix, float *u, float *post,
                   float *comb, cudaStream_t s) {
    if (p.n_hc < 1 || p.n_hc > kMaxHc || p.dim < 1 || p.sinkhorn_iters < 1)
        throw error("cuda ds4 hc_pre: unsupported n_hc " + std::to_string(p.n_hc) + " (1..5), dim " +
                    std::to_string(p.dim) + ", sinkhorn iterations " + std::to_string(p.sinkhorn_iters));
    if (fn_type != dtype::f32 && fn_type != dtype::f16)
        throw error("cuda ds4 hc_pre: mixer weight type " + std::string(dtype_name(fn_type)) +
                    " unsupported (f32 or f16)");
    if (n_tok < 1 || n_tok > kMaxGridY)
        throw error("cuda ds4 hc_pre: token count " + std::to_string(n_tok) + " outside [1, 65535]");
    const int64_t n = static_cast<int64_t>(p.n_hc) * p.dim;
    if (fn_row_bytes < dtype_row_bytes(fn_type, n) || fn_row_bytes % (fn_type == dtype::f32 ? 4 : 2) != 0)
        throw error("cuda ds4 hc_pre: mixer row stride too small or misaligned");
    const int n_mix = (2 + p.n_hc) * p.n_hc;
    launch_mix(fn_type, fn, fn_row_bytes, x, n, n_tok, n_mix, p.rms_eps, mix, batch, s);
    check_launch("hc mix");
    const dim3 blocks(static_cast<unsigned>((p.dim + kApplyThreads - 1) / kApplyThreads) + 1,
                      static_cast<unsigned>(n_tok));
    switch (p.n_hc) {
    case 1: launch_pre_apply<1>(blocks, p, mix, base, scale, x, u, post, comb, s); break;
    case 2: launch_pre_apply<2>(blocks, p, mix, base, scale, x, u, post, comb, s); break;
    case 3: launch_pre_apply<3>(blocks, p, mix, base, scale, x, u, post, comb, s); break;
    case 4: launch_pre_apply<4>(blocks, p, mix, base, scale, x, u, post, comb, s); break;
    default: launch_pre_apply<5>(blocks, p, mix, base, scale, x, u, post, comb, s); break;
    }
    check_launch("hc pre");
}

void hc_post_tokens(int n_hc, int64_t dim, int64_t n_tok, const float *y, const float *x_old, const float *post,
                    const float *comb, float *x_new, cudaStream_t s) {
    if (n_hc < 1 || n_hc > kMaxHc || dim < 1) throw error("cuda ds4 hc_post: unsupported n_hc " + std::to_string(n_hc));
    if (n_tok < 1 || n_tok > kMaxGridY)
        throw error("cuda ds4 hc_post: token count " + std::to_string(n_tok) + " outside [1, 65535]");
    const dim3 grid(static_cast<unsigned>((dim + 255) / 256), static_cast<unsigned>(n_tok));
    hc_post_kernel<<<grid, 256, 0, s>>>(n_hc, dim, y, x_old, post, comb, x_new);
    check_launch("hc post");
}

// [HCPost +] HCPre / head + RMSNorm: hc_split_kernel when io.part is set (and its shared memory fits),
// else hc_fused_kernel, or the unfused launches when one block's shared memory cannot hold the
// n_hc * D state (the same results: the fused kernels repeat them; the split kernel's mix order aside).
// rows > 1: launch_hc_*_fused_rows (the split kernel over gridDim.y = rows, or this function row by row).
void hc_fused(const hc_params &p, dtype fn_type, const void *fn, size_t fn_row_bytes, const float *base,
              const float *scale, const hc_fused_io &io, bool head, cudaStream_t s, int rows = 1) {
    const std::string what = head ? "cuda ds4 hc head (fused)" : "cuda ds4 hc pre (fused)";
    if (p.n_hc < 1 || p.n_hc > kMaxHc || p.dim < 1 || (!head && p.sinkhorn_iters < 1))
        throw error(what + ": unsupported n_hc " + std::to_string(p.n_hc) + " (1..5), dim " + std::to_string(p.dim) +
                    ", sinkhorn iterations " + std::to_string(p.sinkhorn_iters));
    if (fn_type != dtype::f32 && fn_type != dtype::f16)
        throw error(what + ": mixer weight type " + std::string(dtype_name(fn_type)) + " unsupported (f32 or f16)");
    const int64_t n = static_cast<int64_t>(p.n_hc) * p.dim;
    if (fn_row_bytes < dtype_row_bytes(fn_type, n) || fn_row_bytes % (fn_type == dtype::f32 ? 4 : 2) != 0)
        throw error(what + ": mixer row stride too small or misaligned");
    if (!fn || !base || !scale || !io.x || !io.mix || !io.sync || !io.out || (!head && (!io.post || !io.comb)) ||
        (io.y && (!io.x_new || io.x_new == io.x || !io.post || !io.comb)))
        throw error(what + ": a buffer is missing, or x_new aliases x");
    if (io.part && (reinterpret_cast<uintptr_t>(io.part) % 8 != 0 || io.part_blocks < 0 ||
                    io.part_blocks > kHcFusedMaxBlocks))
        throw error(what + ": part scratch not 8-byte aligned, or part_blocks outside [0, " +
                    std::to_string(kHcFusedMaxBlocks) + "]");
    const float *xin = io.y ? io.x_new : io.x;
    auto al16 = [](const void *q) { return reinterpret_cast<uintptr_t>(q) % 16 == 0; };
    const bool f16 = fn_type == dtype::f16, vec = al16(fn) && fn_row_bytes % 16 == 0;
    fused_args a{};
    a.fn = static_cast<const uint8_t *>(fn);
    a.row_bytes = fn_row_bytes;
    a.base = base, a.scale = scale, a.y = io.y, a.x = io.x, a.x_new = io.x_new, a.post = io.post, a.comb = io.comb;
    a.mix = io.mix, a.sync = io.sync, a.norm = io.norm, a.out = io.out;
    a.D = p.dim, a.n_hc = p.n_hc, a.n_mix = head ? p.n_hc : (2 + p.n_hc) * p.n_hc, a.iters = p.sinkhorn_iters;
    a.hc_eps = p.hc_eps, a.rms_eps = p.rms_eps, a.head = head;
    a.vec4 = p.dim % 4 == 0 && al16(io.x) && (!io.y || (al16(io.y) && al16(io.x_new)));
    if (io.part) {  // the column-split kernel: C columns per block (a multiple of 4), B blocks
        const int64_t want = io.part_blocks > 0 ? io.part_blocks : kHcFusedMaxBlocks;
        const int64_t C = ((p.dim + want - 1) / want + 3) / 4 * 4, B = (p.dim + C - 1) / C;
        const int64_t NC = p.n_hc * C, S = NC + (36 - NC % 32) % 32;  // hc_split_kernel's row stride
        const size_t smem = static_cast<size_t>(std::max(a.n_mix * S + NC, n)) * sizeof(float);
        void (*kernel)(fused_args) = f16 ? hc_split_kernel<true> : hc_split_kernel<false>;
        const size_t limit =
            f16 ? smem_dynamic_limit<hc_split_kernel<true>>() : smem_dynamic_limit<hc_split_kernel<false>>();
        if (C <= kSplitThreads && smem <= limit) {
            a.part = io.part, a.cols = C;
            const size_t smem_rows = static_cast<size_t>(a.n_mix * S + NC) * sizeof(float);
            const size_t smem_tail = static_cast<size_t>(n) * sizeof(float);
            if (rows >= kSplitRowsFrom && smem_tail <= smem_dynamic_limit<hc_split_tail_kernel>() &&
                smem_rows <= (f16 ? smem_dynamic_limit<hc_split_rows_kernel<true>>()
                                  : smem_dynamic_limit<hc_split_rows_kernel<false>>())) {
                // at most 2 blocks of rows (one wave), then one tail block a row
                const int rpb = (rows + 1) / 2, ry = (rows + rpb - 1) / rpb;
                cudaError_t e = launch_pdl(f16 ? hc_split_rows_kernel<true> : hc_split_rows_kernel<false>,
                                           dim3(static_cast<unsigned>(B), static_cast<unsigned>(ry)), dim3(kSplitThreads),
                                           smem_rows, s, true, a, rows, rpb);
                if (e == cudaSuccess)
                    e = launch_pdl(hc_split_tail_kernel, dim3(static_cast<unsigned>(rows)), dim3(kSplitThreads), smem_tail, s,
                                   true, a, static_cast<int>(B));
                if (e != cudaSuccess) throw error(what + ": launch failed: " + cudaGetErrorString(e));
                return;
            }
            const cudaError_t e = launch_pdl(kernel, dim3(static_cast<unsigned>(B), static_cast<unsigned>(rows)),
                                             dim3(kSplitThreads), smem, s, true, a);
            if (e != cudaSuccess) throw error(what + ": launch failed: " + cudaGetErrorString(e));
            return;
        }
    }
    if (rows > 1) {  // no split kernel: each row alone, at its offsets
        for (int64_t r = 0; r < rows; ++r) {
            hc_fused_io o = io;
            offset_to_row(o, r, p.n_hc, p.dim);
            hc_fused(p, fn_type, fn, fn_row_bytes, base, scale, o, head, s);
        }
        return;
    }
    // the kernel instance and the dynamic shared memory it may take (opt-in limit less its static part)
    void (*kernel)(fused_args) = nullptr;
    size_t limit = 0;
    auto pick = [&]<bool F16, bool Vec>() {
        kernel = hc_fused_kernel<F16, Vec>;
        limit = smem_dynamic_limit<hc_fused_kernel<F16, Vec>>();
    };
    if (f16 && vec) pick.template operator()<true, true>();
    else if (f16) pick.template operator()<true, false>();
    else if (vec) pick.template operator()<false, true>();
    else pick.template operator()<false, false>();
    const size_t smem = static_cast<size_t>(n) * sizeof(float);
    if (smem > limit) {  // the n_hc * D state does not fit one block (or the limit could not be raised)
        if (io.y) hc_post_tokens(p.n_hc, p.dim, 1, io.y, io.x, io.post, io.comb, io.x_new, s);
        if (head) launch_hc_head(p, fn_type, fn, fn_row_bytes, base, scale, xin, io.mix, io.out, s);
        else hc_pre_tokens(p, fn_type, fn, fn_row_bytes, base, scale, xin, 1, false, io.mix, io.out, io.post, io.comb, s);
        cuda::launch_rms_norm(io.out, p.dim, io.norm, p.rms_eps, p.dim, 1, io.out, p.dim, s);
        check_launch("hc rms norm");
        return;
    }
    const cudaError_t e =
        launch_pdl(kernel, dim3(static_cast<unsigned>(a.n_mix + 1)), dim3(kMixThreads), smem, s, true, a);
    if (e != cudaSuccess) throw error(what + ": launch failed: " + cudaGetErrorString(e));
}

}  // namespace

void launch_hc_pre(const hc_params &p, dtype fn_type, const void *fn, size_t fn_row_bytes, const float *base,
                   const float *scale, const float *x, float *mix, float *u, float *post, float *comb,
                   cudaStream_t s) {
    hc_pre_tokens(p, fn_type, fn, fn_row_bytes, base, scale, x, 1, false, mix, u, post, comb, s);
}

void launch_hc_pre_batch(const hc_params &p, dtype fn_type, const void *fn, size_t fn_row_bytes, const float *base,
                         const float *scale, const float *x, int64_t n_tok, float *mix, float *u, float *post,
                         float *comb, cudaStream_t s) {
    hc_pre_tokens(p, fn_type, fn, fn_row_bytes, base, scale, x, n_tok, true, mix, u, post, comb, s);
}

void launch_hc_head(const hc_params &p, dtype fn_type, const void *fn, size_t fn_row_bytes, const float *base,
                    const float *scale, const float *x, float *mix, float *z, cudaStream_t s) {
    if (p.n_hc < 1 || p.n_hc > kMaxHc || p.dim < 1)
        throw error("cuda ds4 hc_head: unsupported n_hc " + std::to_string(p.n_hc) + " (1..5) or dim " +
                    std::to_string(p.dim));
    if (fn_type != dtype::f32 && fn_type != dtype::f16)
        throw error("cuda ds4 hc_head: mixer weight type " + std::string(dtype_name(fn_type)) +
                    " unsupported (f32 or f16)");
    const int64_t n = static_cast<int64_t>(p.n_hc) * p.dim;
    if (fn_row_bytes < dtype_row_bytes(fn_type, n) || fn_row_bytes % (fn_type == dtype::f32 ? 4 : 2) != 0)
        throw error("cuda ds4 hc_head: mixer row stride too small or misaligned");
    launch_mix(fn_type, fn, fn_row_bytes, x, n, 1, p.n_hc, p.rms_eps, mix, false, s);
    check_launch("hc head mix");
    const unsigned blocks = static_cast<unsigned>((p.dim + kApplyThreads - 1) / kApplyThreads);
    hc_head_apply_kernel<<<blocks, kApplyThreads, 0, s>>>(p.n_hc, p.dim, p.hc_eps, mix, base, scale, x, z);
    check_launch("hc head");
}

void launch_hc_post(int n_hc, int64_t dim, const float *y, const float *x_old, const float *post,
                    const float *comb, float *x_new, cudaStream_t s) {
    hc_post_tokens(n_hc, dim, 1, y, x_old, post, comb, x_new, s);
}

void launch_hc_post_batch(int n_hc, int64_t dim, int64_t n_tok, const float *y, const float *x_old, const float *post,
                          const float *comb, float *x_new, cudaStream_t s) {
    hc_post_tokens(n_hc, dim, n_tok, y, x_old, post, comb, x_new, s);
}

void launch_hc_pre_fused(const hc_params &p, dtype fn_type, const void *fn, size_t fn_row_bytes, const float *base,
                         const float *scale, const hc_fused_io &io, cudaStream_t s) {
    hc_fused(p, fn_type, fn, fn_row_bytes, base, scale, io, false, s);
}

void launch_hc_head_fused(const hc_params &p, dtype fn_type, const void *fn, size_t fn_row_bytes, const float *base,
                          const float *scale, const hc_fused_io &io, cudaStream_t s) {
    hc_fused(p, fn_type, fn, fn_row_bytes, base, scale, io, true, s);
}

void launch_hc_pre_fused_rows(const hc_params &p, dtype fn_type, const void *fn, size_t fn_row_bytes, const float *base,
                              const float *scale, const hc_fused_io &io, int rows, cudaStream_t s) {
    if (rows < 1 || rows > 65535) throw error("cuda ds4 hc pre (rows): bad row count " + std::to_string(rows));
    hc_fused(p, fn_type, fn, fn_row_bytes, base, scale, io, false, s, rows);
}

void launch_hc_head_fused_rows(const hc_params &p, dtype fn_type, const void *fn, size_t fn_row_bytes,
                               const float *base, const float *scale, const hc_fused_io &io, int rows, cudaStream_t s) {
    if (rows < 1 || rows > 65535) throw error("cuda ds4 hc head (rows): bad row count " + std::to_string(rows));
    hc_fused(p, fn_type, fn, fn_row_bytes, base, scale, io, true, s, rows);
}

void launch_hc_stream_mean(int n_hc, int64_t dim, int64_t n_tok, const float *x, float *out, int64_t out_stride,
                           cudaStream_t s) {
    if (n_hc < 1 || n_hc > kMaxHc || dim < 1 || out_stride < dim)
        throw error("cuda ds4 hc stream mean: unsupported n_hc " + std::to_string(n_hc) + " / output stride");
    if (n_tok < 1 || n_tok > kMaxGridY)
        throw error("cuda ds4 hc stream mean: token count " + std::to_string(n_tok) + " outside [1, 65535]");
    const dim3 grid(static_cast<unsigned>((dim + 255) / 256), static_cast<unsigned>(n_tok));
    hc_stream_mean_kernel<<<grid, 256, 0, s>>>(n_hc, dim, x, out, out_stride);
    check_launch("hc stream mean");
}

void launch_gpu_sleep(uint64_t ns, cudaStream_t s) {
    sleep_kernel<<<1, 1, 0, s>>>(ns);
    check_launch("sleep");
}

}  // namespace fathom::cuda::ds4
