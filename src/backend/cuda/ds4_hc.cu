// DS4 hyper-connections on CUDA for one decoded token (spec ../shared/reference/ds4-architecture.md
// 3.1-3.3): HCPre = the mixer projection m = r * (F v) (double accumulation, as the CPU reference),
// the pre/post/comb split with Sinkhorn normalisation, and u = sum_s pre_s X_s; HCPost = the
// new stream state. Launchers: ds4_kernels.h (one token) and ds4_prefill.h (a chunk of n_tok
// tokens, the same kernels with a token grid dimension). Element-wise sums and products use round-to-nearest
// intrinsics in the CPU's order (no FMA contraction), so they repeat the CPU's f32 arithmetic;
// exp differs from glibc's by at most an ulp or two.
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <string>

#include "backend/cuda/ds4_kernels.h"
#include "backend/cuda/ds4_prefill.h"
#include "core/error.h"

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
    for (int k = 0; k < n; ++k) {
        float acc = __fmul_rn(post[k], yi);
#pragma unroll
        for (int j = 0; j < kMaxHc; ++j)
            if (j < n) acc = __fadd_rn(acc, __fmul_rn(comb[j * n + k], xo[j]));
        x_new[k * D + i] = acc;
    }
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

void launch_gpu_sleep(uint64_t ns, cudaStream_t s) {
    sleep_kernel<<<1, 1, 0, s>>>(ns);
    check_launch("sleep");
}

}  // namespace fathom::cuda::ds4
