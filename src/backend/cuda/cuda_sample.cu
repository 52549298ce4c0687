// Device summary of one step's logits for the host sampler (cuda_sample.h): penalised copy,
// softmax statistics and an exact top-k by radix select.
//
// The statistics and the selection run on ONE block of 1024 threads: a vocabulary of ~130k logits
// is ~0.5 MB (L2-resident after the first pass), so seven passes over it cost tens of microseconds
// against the ~1 ms the host spends on the same vocabulary, and one block keeps the f64 sum's order
// fixed (deterministic) without a second kernel.
#include <cuda_runtime.h>

#include <cfloat>
#include <cmath>
#include <string>

#include "backend/cuda/cuda_sample.h"
#include "core/error.h"

namespace fathom::cuda {
namespace {

constexpr int kThreads = 1024, kWarps = kThreads / 32;
constexpr unsigned kFull = 0xffffffffu;

// Order-preserving unsigned key of a float (NaN excluded by the caller's check).
__device__ __forceinline__ uint32_t key_of(float x) {
    const uint32_t b = __float_as_uint(x);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

__global__ void copy_check_kernel(const float *__restrict__ logits, int64_t n, float *__restrict__ work,
                                  uint32_t *bad) {
    uint32_t nbad = 0;
    for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
         i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
        const float v = logits[i];
        nbad += (isnan(v) || (isinf(v) && v > 0.0f)) ? 1u : 0u;
        work[i] = v;
    }
    for (int o = 16; o > 0; o >>= 1) nbad += __shfl_xor_sync(kFull, nbad, o);
    if ((threadIdx.x & 31) == 0 && nbad) atomicAdd(bad, nbad);
}

// sampler.cpp apply_penalties, operation for operation (no contraction).
__global__ void penalty_kernel(float *work, const int32_t *__restrict__ ids, const int32_t *__restrict__ counts,
                               int n_pen, float repeat, float frequency, float presence) {
    for (int j = threadIdx.x; j < n_pen; j += blockDim.x) {
        float l = work[ids[j]];
        if (isfinite(l)) {
            l = l > 0.0f ? __fdiv_rn(l, repeat) : __fmul_rn(l, repeat);
            l = __fsub_rn(l, __fadd_rn(__fmul_rn(static_cast<float>(counts[j]), frequency), presence));
            l = fminf(fmaxf(l, -FLT_MAX), FLT_MAX);
        }
        work[ids[j]] = l;
    }
}

template <class T, class Op>
__device__ T block_reduce(T v, T *red, Op op) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(kFull, v, o));
    __syncthreads();  // red may still be read by a previous reduction
    if (lane == 0) red[warp] = v;
    __syncthreads();
    T r = red[0];
    for (int w = 1; w < kWarps; ++w) r = op(r, red[w]);  // same order in every thread
    return r;
}

__global__ void __launch_bounds__(kThreads)
    top_kernel(const float *__restrict__ work, int64_t n, int k, int32_t *__restrict__ ids, float *__restrict__ vals,
               float *max_out, double *z_out) {
    __shared__ float redf[kWarps];
    __shared__ double redd[kWarps];
    __shared__ uint32_t hist[256];
    __shared__ uint32_t s_prefix, s_mask, s_remaining, s_eq, s_gt_pos, s_eq_pos;
    __shared__ uint32_t warp_tot[kWarps];
    const int tid = threadIdx.x;

    float m = -INFINITY;
    for (int64_t i = tid; i < n; i += kThreads) m = fmaxf(m, work[i]);
    m = block_reduce(m, redf, [](float a, float b) { return fmaxf(a, b); });
    double z = 0.0;
    for (int64_t i = tid; i < n; i += kThreads) z += static_cast<double>(static_cast<float>(exp(static_cast<double>(__fsub_rn(work[i], m)))));
    z = block_reduce(z, redd, [](double a, double b) { return a + b; });
    if (tid == 0) {
        *max_out = m;
        *z_out = z;
    }
    if (static_cast<int64_t>(k) >= n) {  // every logit is a candidate
        for (int64_t i = tid; i < n; i += kThreads) {
            ids[i] = static_cast<int32_t>(i);
            vals[i] = work[i];
        }
        return;
    }
    // Radix select (8-bit digits, most significant first) of the k-th largest key.
    if (tid == 0) {
        s_prefix = 0;
        s_mask = 0;
        s_remaining = static_cast<uint32_t>(k);
    }
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int i = tid; i < 256; i += kThreads) hist[i] = 0;
        __syncthreads();
        const uint32_t prefix = s_prefix, mask = s_mask;
        for (int64_t i = tid; i < n; i += kThreads) {
            const uint32_t key = key_of(work[i]);
            if ((key & mask) == prefix) atomicAdd(&hist[(key >> shift) & 255u], 1u);
        }
        __syncthreads();
        if (tid == 0) {
            uint32_t above = 0, rem = s_remaining;
            int d = 255;
            for (; d > 0 && above + hist[d] < rem; --d) above += hist[d];
            s_remaining = rem - above;
            s_prefix = prefix | (static_cast<uint32_t>(d) << shift);
            s_mask = mask | (255u << shift);
            if (shift == 0) s_eq = hist[d];
            s_gt_pos = 0;
            s_eq_pos = 0;
        }
        __syncthreads();
    }
    const uint32_t T = s_prefix, take_eq = s_remaining, n_gt = static_cast<uint32_t>(k) - take_eq;
    const bool all_eq = s_eq == take_eq;
    for (int64_t i = tid; i < n; i += kThreads) {
        const uint32_t key = key_of(work[i]);
        if (key > T) {
            const uint32_t p = atomicAdd(&s_gt_pos, 1u);
            ids[p] = static_cast<int32_t>(i);
            vals[p] = work[i];
        } else if (key == T && all_eq) {
            const uint32_t p = n_gt + atomicAdd(&s_eq_pos, 1u);
            ids[p] = static_cast<int32_t>(i);
            vals[p] = work[i];
        }
    }
    if (all_eq) return;
    // More keys equal the k-th than are taken: the lowest ids win (the host's tie order), found by
    // an ordered block scan over chunks of kThreads ids.
    const int lane = tid & 31, warp = tid >> 5;
    uint32_t base = 0;
    for (int64_t c0 = 0; c0 < n && base < take_eq; c0 += kThreads) {
        const int64_t i = c0 + tid;
        const bool eq = i < n && key_of(work[i]) == T;
        const uint32_t ball = __ballot_sync(kFull, eq);
        const uint32_t rank_in_warp = __popc(ball & ((1u << lane) - 1u));
        if (lane == 0) warp_tot[warp] = __popc(ball);
        __syncthreads();
        uint32_t before = 0, total = 0;
        for (int w = 0; w < kWarps; ++w) {
            before += w < warp ? warp_tot[w] : 0u;
            total += warp_tot[w];
        }
        const uint32_t r = base + before + rank_in_warp;
        if (eq && r < take_eq) {
            ids[n_gt + r] = static_cast<int32_t>(i);
            vals[n_gt + r] = work[i];
        }
        base += total;
        __syncthreads();  // warp_tot is rewritten by the next chunk
    }
}

void check(cudaError_t e, const char *what) {
    if (e != cudaSuccess) throw error(std::string("cuda logits top: ") + what + ": " + cudaGetErrorString(e));
}

}  // namespace

void launch_logits_top(const logits_top_args &a, const logits_top_out &o, cudaStream_t s) {
    if (a.n < 1 || a.n > (int64_t{1} << 31) - 1) throw error("cuda logits top: vocabulary size out of range");
    if (a.k < 1 || a.k > logits_top_max_k) throw error("cuda logits top: k must be in [1, 4096]");
    if (a.n_pen < 0 || (a.n_pen > 0 && (!a.pen_ids || !a.pen_counts))) throw error("cuda logits top: bad penalty list");
    check(cudaMemsetAsync(o.bad, 0, sizeof(uint32_t), s), "clearing");
    const int blocks = static_cast<int>(std::min<int64_t>((a.n + 255) / 256, 1024));
    copy_check_kernel<<<blocks, 256, 0, s>>>(a.logits, a.n, o.work, o.bad);
    check(cudaGetLastError(), "copy");
    if (a.n_pen > 0) {
        penalty_kernel<<<1, 256, 0, s>>>(o.work, a.pen_ids, a.pen_counts, a.n_pen, a.repeat, a.frequency, a.presence);
        check(cudaGetLastError(), "penalties");
    }
    top_kernel<<<1, kThreads, 0, s>>>(o.work, a.n, a.k, o.ids, o.vals, o.max, o.z);
    check(cudaGetLastError(), "select");
}

}  // namespace fathom::cuda
