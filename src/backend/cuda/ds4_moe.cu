// DS4 MoE on CUDA for one decoded token: expert GEMVs that read only the selected experts' rows
// (gate/up fused with the clamped SwiGLU and the routing weight; down summed over slots in the CPU's
// order), the router (sqrt-softplus scores, hash or biased top-k, weight normalisation) and the
// whole-FFN chain. Launchers: ds4_kernels.h; block decoding: ds4_quant.cuh.
//
// GEMV layout: one warp per output row, lanes stride over the row's 32-weight units (a warp reads a
// contiguous stretch of the row); the activation vector is staged in padded shared memory once per
// block (see pidx). Expert ids come from device memory.
#include <cuda_runtime.h>

#include <algorithm>
#include <string>

#include "backend/cuda/cuda_kernels.h"
#include "backend/cuda/ds4_kernels.h"
#include "backend/cuda/ds4_quant.cuh"
#include "core/error.h"

namespace fathom::cuda::ds4 {
namespace {

// The IQ2_XXS grid (format constant, = cpu::iq2xxs_grid): 8 magnitudes per entry, byte j = element j.
__device__ const uint64_t k_iq2xxs_grid[256] = {
    0x0808080808080808ull, 0x080808080808082bull, 0x0808080808081919ull, 0x0808080808082b08ull,
    0x0808080808082b2bull, 0x0808080808190819ull, 0x0808080808191908ull, 0x08080808082b0808ull,
    0x08080808082b082bull, 0x08080808082b2b08ull, 0x08080808082b2b2bull, 0x0808080819080819ull,
    0x0808080819081908ull, 0x0808080819190808ull, 0x0808080819192b08ull, 0x08080808192b0819ull,
    0x08080808192b1908ull, 0x080808082b080808ull, 0x080808082b08082bull, 0x080808082b082b2bull,
    0x080808082b2b082bull, 0x0808081908080819ull, 0x0808081908081908ull, 0x0808081908190808ull,
    0x0808081908191919ull, 0x0808081919080808ull, 0x080808192b081908ull, 0x080808192b192b08ull,
    0x0808082b08080808ull, 0x0808082b0808082bull, 0x0808082b082b082bull, 0x0808082b2b08082bull,
    0x0808190808080819ull, 0x0808190808081908ull, 0x0808190808190808ull, 0x08081908082b0819ull,
    0x08081908082b1908ull, 0x0808190819080808ull, 0x080819081908082bull, 0x0808190819082b08ull,
    0x08081908192b0808ull, 0x080819082b080819ull, 0x080819082b081908ull, 0x080819082b190808ull,
    0x080819082b2b1908ull, 0x0808191908080808ull, 0x080819190808082bull, 0x0808191908082b08ull,
    0x08081919082b0808ull, 0x080819191908192bull, 0x08081919192b2b19ull, 0x080819192b080808ull,
    0x080819192b190819ull, 0x0808192b08082b19ull, 0x0808192b08190808ull, 0x0808192b19080808ull,
    0x0808192b2b081908ull, 0x0808192b2b2b1908ull, 0x08082b0808080808ull, 0x08082b0808081919ull,
    0x08082b0808082b08ull, 0x08082b0808191908ull, 0x08082b08082b2b08ull, 0x08082b0819080819ull,
    0x08082b0819081908ull, 0x08082b0819190808ull, 0x08082b081919082bull, 0x08082b082b082b08ull,
    0x08082b1908081908ull, 0x08082b1919080808ull, 0x08082b2b0808082bull, 0x08082b2b08191908ull,
    0x0819080808080819ull, 0x0819080808081908ull, 0x0819080808190808ull, 0x08190808082b0819ull,
    0x0819080819080808ull, 0x08190808192b0808ull, 0x081908082b081908ull, 0x081908082b190808ull,
    0x081908082b191919ull, 0x0819081908080808ull, 0x0819081908082b08ull, 0x08190819082b0808ull,
    0x0819081919190808ull, 0x0819081919192b2bull, 0x081908192b080808ull, 0x0819082b082b1908ull,
    0x0819082b19081919ull, 0x0819190808080808ull, 0x0819190808082b08ull, 0x08191908082b0808ull,
    0x08191908082b1919ull, 0x0819190819082b19ull, 0x081919082b080808ull, 0x0819191908192b08ull,
    0x08191919192b082bull, 0x0819192b08080808ull, 0x0819192b0819192bull, 0x08192b0808080819ull,
    0x08192b0808081908ull, 0x08192b0808190808ull, 0x08192b0819080808ull, 0x08192b082b080819ull,
    0x08192b1908080808ull, 0x08192b1908081919ull, 0x08192b192b2b0808ull, 0x08192b2b19190819ull,
    0x082b080808080808ull, 0x082b08080808082bull, 0x082b080808082b2bull, 0x082b080819081908ull,
    0x082b0808192b0819ull, 0x082b08082b080808ull, 0x082b08082b08082bull, 0x082b0819082b2b19ull,
    0x082b081919082b08ull, 0x082b082b08080808ull, 0x082b082b0808082bull, 0x082b190808080819ull,
    0x082b190808081908ull, 0x082b190808190808ull, 0x082b190819080808ull, 0x082b19081919192bull,
    0x082b191908080808ull, 0x082b191919080819ull, 0x082b1919192b1908ull, 0x082b192b2b190808ull,
    0x082b2b0808082b08ull, 0x082b2b08082b0808ull, 0x082b2b082b191908ull, 0x082b2b2b19081908ull,
    0x1908080808080819ull, 0x1908080808081908ull, 0x1908080808190808ull, 0x1908080808192b08ull,
    0x19080808082b0819ull, 0x19080808082b1908ull, 0x1908080819080808ull, 0x1908080819082b08ull,
    0x190808081919192bull, 0x19080808192b0808ull, 0x190808082b080819ull, 0x190808082b081908ull,
    0x190808082b190808ull, 0x1908081908080808ull, 0x19080819082b0808ull, 0x19080819192b0819ull,
    0x190808192b080808ull, 0x190808192b081919ull, 0x1908082b08080819ull, 0x1908082b08190808ull,
    0x1908082b19082b08ull, 0x1908082b1919192bull, 0x1908082b192b2b08ull, 0x1908190808080808ull,
    0x1908190808082b08ull, 0x19081908082b0808ull, 0x190819082b080808ull, 0x190819082b192b19ull,
    0x190819190819082bull, 0x19081919082b1908ull, 0x1908192b08080808ull, 0x19082b0808080819ull,
    0x19082b0808081908ull, 0x19082b0808190808ull, 0x19082b0819080808ull, 0x19082b0819081919ull,
    0x19082b1908080808ull, 0x19082b1919192b08ull, 0x19082b19192b0819ull, 0x19082b192b08082bull,
    0x19082b2b19081919ull, 0x19082b2b2b190808ull, 0x1919080808080808ull, 0x1919080808082b08ull,
    0x1919080808190819ull, 0x1919080808192b19ull, 0x19190808082b0808ull, 0x191908082b080808ull,
    0x191908082b082b08ull, 0x1919081908081908ull, 0x191908191908082bull, 0x191908192b2b1908ull,
    0x1919082b2b190819ull, 0x191919082b190808ull, 0x191919082b19082bull, 0x1919191908082b2bull,
    0x1919192b08080819ull, 0x1919192b19191908ull, 0x19192b0808080808ull, 0x19192b0808190819ull,
    0x19192b0808192b19ull, 0x19192b08192b1908ull, 0x19192b1919080808ull, 0x19192b2b08082b08ull,
    0x192b080808081908ull, 0x192b080808190808ull, 0x192b080819080808ull, 0x192b0808192b2b08ull,
    0x192b081908080808ull, 0x192b081919191919ull, 0x192b082b08192b08ull, 0x192b082b192b0808ull,
    0x192b190808080808ull, 0x192b190808081919ull, 0x192b191908190808ull, 0x192b19190819082bull,
    0x192b19192b081908ull, 0x192b2b081908082bull, 0x2b08080808080808ull, 0x2b0808080808082bull,
    0x2b08080808082b2bull, 0x2b08080819080819ull, 0x2b0808082b08082bull, 0x2b08081908081908ull,
    0x2b08081908192b08ull, 0x2b08081919080808ull, 0x2b08082b08190819ull, 0x2b08190808080819ull,
    0x2b08190808081908ull, 0x2b08190808190808ull, 0x2b08190808191919ull, 0x2b08190819080808ull,
    0x2b081908192b0808ull, 0x2b08191908080808ull, 0x2b0819191908192bull, 0x2b0819192b191908ull,
    0x2b08192b08082b19ull, 0x2b08192b19080808ull, 0x2b08192b192b0808ull, 0x2b082b080808082bull,
    0x2b082b1908081908ull, 0x2b082b2b08190819ull, 0x2b19080808081908ull, 0x2b19080808190808ull,
    0x2b190808082b1908ull, 0x2b19080819080808ull, 0x2b1908082b2b0819ull, 0x2b1908190819192bull,
    0x2b1908192b080808ull, 0x2b19082b19081919ull, 0x2b19190808080808ull, 0x2b191908082b082bull,
    0x2b19190819081908ull, 0x2b19191919190819ull, 0x2b192b082b080819ull, 0x2b192b19082b0808ull,
    0x2b2b08080808082bull, 0x2b2b080819190808ull, 0x2b2b08082b081919ull, 0x2b2b081908082b19ull,
    0x2b2b082b08080808ull, 0x2b2b190808192b08ull, 0x2b2b2b0819190808ull, 0x2b2b2b1908081908ull,
};

constexpr int kWarps = 8;       // 256-thread blocks, one output row per warp at a time
constexpr int kDownRows = 2;    // down: rows per warp (blocks of kWarps * kDownRows rows)
constexpr int kMaxCols = 8192;  // x / h staged in shared memory: 4.5 bytes per column (36 KB)

// Stage the IQ2_XXS grid in shared memory (random 8-byte lookups). No barrier here: the caller's
// staging barrier covers it.
template <dtype T>
__device__ __forceinline__ const uint64_t *stage_grid(uint64_t *sgrid) {
    if constexpr (T == dtype::iq2_xxs)
        for (int i = threadIdx.x; i < 256; i += blockDim.x) sgrid[i] = k_iq2xxs_grid[i];
    return sgrid;
}

// The activation vector lives in shared memory with 4 floats of padding after every 32: lane l
// of a warp decodes unit l (+ 32 k), 32 consecutive columns, so unpadded its float4 reads would all
// hit one bank (through L1: 32 distinct lines per load, the first version's bottleneck, 12-17% of
// the copy rate). Padded, 8 consecutive units' float4 reads cover all 32 banks.
__device__ __forceinline__ int64_t pidx(int64_t e) {
    return e + 4 * (e >> 5);
}
// xs[pidx(i)] = x[i] for i < K, 0 for K <= i < K_pad (K % 4 == 0, K_pad = 32 * units, x 16-byte
// aligned): a float row's last partial unit meets zeros. Caller syncs.
__device__ __forceinline__ void stage_vec(const float *__restrict__ x, int64_t K, int64_t K_pad, float *xs) {
    for (int64_t i = 4 * static_cast<int64_t>(threadIdx.x); i < K_pad; i += 4 * static_cast<int64_t>(blockDim.x))
        *reinterpret_cast<float4 *>(xs + pidx(i)) =
            i < K ? *reinterpret_cast<const float4 *>(x + i) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
}

// Dot of a decoded unit with the staged vector: w[8r + i] pairs with x[base + r * stride + i]
// (base % 8 == 0, so each run of 8 stays inside one padded group of 32).
__device__ __forceinline__ float dot32(const float w[32], const float *xs, int64_t base, int stride) {
    float a = 0.0f;
#pragma unroll
    for (int r = 0; r < 4; ++r) {
        const float4 *xp = reinterpret_cast<const float4 *>(xs + pidx(base + r * stride));
        const float4 x0 = xp[0], x1 = xp[1];
        const float *wr = w + 8 * r;
        a += wr[0] * x0.x + wr[1] * x0.y + wr[2] * x0.z + wr[3] * x0.w;
        a += wr[4] * x1.x + wr[5] * x1.y + wr[6] * x1.z + wr[7] * x1.w;
    }
    return a;
}

// Gate and up units of one row position share each x read.
__device__ __forceinline__ void dot32x2(const float wg[32], const float wu[32], const float *xs, int64_t base,
                                        int stride, float &ag, float &au) {
#pragma unroll
    for (int r = 0; r < 4; ++r) {
        const float4 *xp = reinterpret_cast<const float4 *>(xs + pidx(base + r * stride));
        const float4 x0 = xp[0], x1 = xp[1];
        const float *g = wg + 8 * r, *u = wu + 8 * r;
        ag += g[0] * x0.x + g[1] * x0.y + g[2] * x0.z + g[3] * x0.w + g[4] * x1.x + g[5] * x1.y + g[6] * x1.z +
              g[7] * x1.w;
        au += u[0] * x0.x + u[1] * x0.y + u[2] * x0.z + u[3] * x0.w + u[4] * x1.x + u[5] * x1.y + u[6] * x1.z +
              u[7] * x1.w;
    }
}

__device__ __forceinline__ float warp_sum(float a) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) a += __shfl_xor_sync(0xffffffffu, a, o);
    return a;
}

struct bank_dev {
    const uint8_t *data;
    size_t row_bytes, expert_bytes;
    int64_t n_expert, rows, cols, units;  // units = ceil(cols / 32) (cols % 32 != 0 only for float rows)
};

// Tasks t = (slot, row), slot-major, spread over a grid of about two blocks per SM (x is staged
// once per block); consecutive warps take consecutive rows of one expert.
template <dtype T>
__global__ void __launch_bounds__(32 * kWarps)
    moe_gate_up_kernel(bank_dev g, bank_dev up, const int32_t *__restrict__ ids, const float *__restrict__ wts,
                       int n_slot, int s0, const float *__restrict__ x, float clamp, float *__restrict__ h,
                       uint32_t *err) {
    extern __shared__ float4 dyn_smem[];
    float *xs = reinterpret_cast<float *>(dyn_smem);
    __shared__ uint64_t sgrid[T == dtype::iq2_xxs ? 256 : 1];
    const uint64_t *grid = stage_grid<T>(sgrid);
    stage_vec(x, g.cols, g.units * 32, xs);
    __syncthreads();
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int64_t total = static_cast<int64_t>(n_slot) * g.rows;
    for (int64_t t = static_cast<int64_t>(blockIdx.x) * kWarps + warp; t < total;
         t += static_cast<int64_t>(gridDim.x) * kWarps) {
        const int slot = static_cast<int>(t / g.rows);
        const int64_t r = t % g.rows;
        const int e = ids ? ids[slot] : 0;
        if (e < 0 || e >= g.n_expert) {
            if (r == 0 && lane == 0) atomicOr(err, err_expert_id);
            continue;
        }
        const uint8_t *rg = g.data + static_cast<size_t>(e) * g.expert_bytes + static_cast<size_t>(r) * g.row_bytes;
        const uint8_t *ru = up.data + static_cast<size_t>(e) * up.expert_bytes + static_cast<size_t>(r) * up.row_bytes;
        float ag = 0.0f, au = 0.0f;
#pragma unroll 2
        for (int64_t u = lane; u < g.units; u += 32) {
            float wg[32], wu[32];
            int64_t base;
            int stride;
            ds4q::decode32<T>(rg, u, wg, base, stride, grid);
            ds4q::decode32<T>(ru, u, wu, base, stride, grid);  // same type: same base / stride
            dot32x2(wg, wu, xs, base, stride, ag, au);
        }
        ag = warp_sum(ag);
        au = warp_sum(au);
        if (lane == 0) {
            // CPU: silu(min(g, c)) * clamp(v, -c, c), then * w (deepseek4_moe.cpp swiglu_clamped).
            const float gc = fminf(ag, clamp), vc = fminf(fmaxf(au, -clamp), clamp);
            float hv = gc / (1.0f + expf(-gc)) * vc;
            if (wts) hv *= wts[slot];
            h[static_cast<int64_t>(s0 + slot) * g.rows + r] = hv;
        }
    }
}

// A block owns kWarps * kDownRows rows (warp w: rows w, w + kWarps, ...) and walks the slots in
// order, staging each slot's h row in shared memory.
template <dtype T>
__global__ void __launch_bounds__(32 * kWarps)
    moe_down_kernel(bank_dev d, const int32_t *__restrict__ ids, int n_slot, int s0, const float *__restrict__ h,
                    bool accumulate, float *__restrict__ y, uint32_t *err) {
    extern __shared__ float4 dyn_smem[];
    float *xs = reinterpret_cast<float *>(dyn_smem);
    __shared__ uint64_t sgrid[T == dtype::iq2_xxs ? 256 : 1];
    const uint64_t *grid = stage_grid<T>(sgrid);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int64_t F = d.cols, row0 = static_cast<int64_t>(blockIdx.x) * kWarps * kDownRows + warp;
    float total[kDownRows];
#pragma unroll
    for (int q = 0; q < kDownRows; ++q) {
        const int64_t r = row0 + q * kWarps;
        total[q] = (accumulate && r < d.rows) ? y[r] : 0.0f;
    }
    for (int s = 0; s < n_slot; ++s) {
        __syncthreads();  // the previous slot's readers are done with xs
        stage_vec(h + static_cast<int64_t>(s0 + s) * F, F, d.units * 32, xs);
        __syncthreads();
        const int e = ids ? ids[s] : 0;
        if (e < 0 || e >= d.n_expert) {
            if (blockIdx.x == 0 && threadIdx.x == 0) atomicOr(err, err_expert_id);
            continue;  // uniform over the block
        }
        const uint8_t *ex = d.data + static_cast<size_t>(e) * d.expert_bytes;
#pragma unroll
        for (int q = 0; q < kDownRows; ++q) {
            const int64_t r = row0 + q * kWarps;
            if (r >= d.rows) continue;
            const uint8_t *row = ex + static_cast<size_t>(r) * d.row_bytes;
            float a = 0.0f;
#pragma unroll 2
            for (int64_t u = lane; u < d.units; u += 32) {
                float w[32];
                int64_t base;
                int stride;
                ds4q::decode32<T>(row, u, w, base, stride, grid);
                a += dot32(w, xs, base, stride);
            }
            total[q] += warp_sum(a);  // per-expert sum first, then slot order (as the CPU)
        }
    }
#pragma unroll
    for (int q = 0; q < kDownRows; ++q) {
        const int64_t r = row0 + q * kWarps;
        if (lane == 0 && r < d.rows) y[r] = total[q];
    }
}

// softplus as the CPU computes it in float (log1pf(expf(x)), torch threshold 20), each step
// evaluated in double and rounded once: the correctly rounded float result of each step.
__device__ __forceinline__ float softplus_ref(float x) {
    if (x > 20.0f) return x;
    const float e = static_cast<float>(exp(static_cast<double>(x)));
    return static_cast<float>(log1p(static_cast<double>(e)));
}

constexpr int kRouteThreads = 256, kMaxExperts = 1024, kMaxUsed = 32;

// One block. Top-k by k rounds of a block-wide argmax (larger value, then lower id) over the
// experts not yet taken: the order of the CPU's partial_sort.
__global__ void __launch_bounds__(kRouteThreads)
    moe_route_kernel(const float *__restrict__ logits, int E, const float *__restrict__ bias,
                     const int32_t *__restrict__ tid2eid, int64_t n_vocab, const int32_t *__restrict__ token, int k,
                     float scale, int32_t *ids, float *weights, uint32_t *err) {
    __shared__ float score[kMaxExperts], biased[kMaxExperts];
    __shared__ unsigned char taken[kMaxExperts];
    __shared__ float red_v[kRouteThreads / 32];
    __shared__ int red_i[kRouteThreads / 32];
    __shared__ int chosen[kMaxUsed];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    for (int e = tid; e < E; e += kRouteThreads) {
        score[e] = sqrtf(softplus_ref(logits[e]));
        if (bias) biased[e] = score[e] + bias[e];
        taken[e] = 0;
    }
    __syncthreads();
    if (!bias) {
        if (tid == 0) {
            const int32_t t = *token;
            bool ok = t >= 0 && t < n_vocab;
            for (int j = 0; ok && j < k; ++j) {
                const int32_t e = tid2eid[static_cast<int64_t>(t) * k + j];
                if (e < 0 || e >= E) ok = false;
                chosen[j] = e;
            }
            if (!ok) {
                atomicOr(err, (t >= 0 && t < n_vocab) ? err_expert_id : err_token_id);
                for (int j = 0; j < k; ++j) chosen[j] = -1;
            }
        }
    } else {
        for (int j = 0; j < k; ++j) {
            float bv = 0.0f;
            int bi = -1;
            for (int e = tid; e < E; e += kRouteThreads) {
                if (taken[e]) continue;
                const float v = biased[e];
                if (bi < 0 || v > bv) {  // ascending e per thread: ties keep the lower id
                    bv = v;
                    bi = e;
                }
            }
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) {
                const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
                const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
                if (oi >= 0 && (bi < 0 || ov > bv || (ov == bv && oi < bi))) {
                    bv = ov;
                    bi = oi;
                }
            }
            if (lane == 0) {
                red_v[warp] = bv;
                red_i[warp] = bi;
            }
            __syncthreads();
            if (tid == 0) {
                float v = red_v[0];
                int i = red_i[0];
                for (int w = 1; w < kRouteThreads / 32; ++w)
                    if (red_i[w] >= 0 && (i < 0 || red_v[w] > v || (red_v[w] == v && red_i[w] < i))) {
                        v = red_v[w];
                        i = red_i[w];
                    }
                chosen[j] = i;
                taken[i] = 1;
            }
            __syncthreads();
        }
    }
    if (tid == 0) {
        if (chosen[0] < 0) {
            for (int j = 0; j < k; ++j) {
                ids[j] = -1;
                weights[j] = 0.0f;
            }
            return;
        }
        float sum = 0.0f;
        for (int j = 0; j < k; ++j) sum += score[chosen[j]];
        for (int j = 0; j < k; ++j) {
            ids[j] = chosen[j];
            weights[j] = score[chosen[j]] / sum * scale;
        }
    }
}

__global__ void fill_random_kernel(uint64_t *dst, size_t n_words, uint64_t seed) {
    const size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (i >= n_words) return;
    uint64_t z = seed + (i + 1) * 0x9E3779B97F4A7C15ull;  // splitmix64
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    dst[i] = z ^ (z >> 31);
}

void check_bank(const expert_bank &b, const char *what) {
    const std::string w = std::string("cuda ds4 ") + what;
    if (!expert_type_supported(b.type))
        throw error(w + ": unsupported expert weight type " + std::string(dtype_name(b.type)));
    if (!b.data || b.rows <= 0 || b.cols <= 0 || b.n_expert <= 0) throw error(w + ": empty expert bank");
    int block = 0;
    ds4q::dispatch_expert_type(b.type, [&]<dtype T>() { block = ds4q::unit_traits<T>::block; });
    if (b.cols % block != 0)
        throw error(w + ": " + std::to_string(b.cols) + " columns is not a multiple of the " +
                    std::string(dtype_name(b.type)) + " block of " + std::to_string(block));
    if (b.row_bytes != dtype_row_bytes(b.type, b.cols) || b.expert_bytes < b.row_bytes * static_cast<size_t>(b.rows))
        throw error(w + ": row/expert strides do not match the " + std::string(dtype_name(b.type)) + " layout");
    const size_t al = static_cast<size_t>(expert_alignment(b.type));
    if (reinterpret_cast<uintptr_t>(b.data) % 4 != 0 || b.row_bytes % al != 0 || b.expert_bytes % al != 0)
        throw error(w + ": weights must start 4-byte aligned with strides aligned to " + std::to_string(al));
}

bank_dev to_dev(const expert_bank &b) {
    return {static_cast<const uint8_t *>(b.data), b.row_bytes, b.expert_bytes, b.n_expert, b.rows, b.cols,
            (b.cols + 31) / 32};
}

size_t staged_bytes(int64_t cols) {
    if (cols > kMaxCols)
        throw error("cuda ds4 moe: " + std::to_string(cols) + " columns exceed the staged-activation limit of " +
                    std::to_string(kMaxCols));
    const int64_t padded = (cols + 31) / 32 * 32;
    return static_cast<size_t>(padded + padded / 8) * sizeof(float);  // 36 floats per 32 columns
}

unsigned sm_count() {
    int dev = 0, n = 0;
    if (cudaGetDevice(&dev) != cudaSuccess || cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess || n < 1)
        throw error("cuda ds4 moe: cannot query the multiprocessor count");
    return static_cast<unsigned>(n);
}

void check_launch(const char *what) {
    const cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) throw error(std::string("cuda ds4 ") + what + ": launch failed: " + cudaGetErrorString(e));
}

struct nothing_fn {
    template <dtype T> void operator()() const {}
};

}  // namespace

bool expert_type_supported(dtype t) {
    return ds4q::dispatch_expert_type(t, nothing_fn{});
}

int expert_alignment(dtype t) {
    int a = 0;
    ds4q::dispatch_expert_type(t, [&]<dtype T>() { a = ds4q::unit_traits<T>::align; });
    return a;
}

void launch_moe_gate_up(const expert_bank &gate, const expert_bank &up, const int32_t *ids, const float *w,
                        int n_slot, int s0, const float *x, float clamp, float *h, uint32_t *err, cudaStream_t s) {
    check_bank(gate, "moe gate");
    check_bank(up, "moe up");
    if (gate.type != up.type || gate.rows != up.rows || gate.cols != up.cols || gate.n_expert != up.n_expert)
        throw error("cuda ds4 moe: gate and up banks differ in type or shape");
    if (n_slot < 1 || n_slot > 65535 || s0 < 0) throw error("cuda ds4 moe: bad slot count " + std::to_string(n_slot));
    if (reinterpret_cast<uintptr_t>(x) % 16 != 0) throw error("cuda ds4 moe: x must be 16-byte aligned");
    const size_t smem = staged_bytes(gate.cols);
    const int64_t tasks = static_cast<int64_t>(n_slot) * gate.rows;
    const unsigned grid = static_cast<unsigned>(std::min<int64_t>((tasks + kWarps - 1) / kWarps, 2 * sm_count()));
    ds4q::dispatch_expert_type(gate.type, [&]<dtype T>() {
        moe_gate_up_kernel<T><<<grid, 32 * kWarps, smem, s>>>(to_dev(gate), to_dev(up), ids, w, n_slot, s0, x, clamp,
                                                              h, err);
    });
    check_launch("moe gate/up");
}

void launch_moe_down(const expert_bank &down, const int32_t *ids, int n_slot, int s0, const float *h,
                     bool accumulate, float *y, uint32_t *err, cudaStream_t s) {
    check_bank(down, "moe down");
    if (n_slot < 1 || s0 < 0) throw error("cuda ds4 moe: bad slot count " + std::to_string(n_slot));
    if (reinterpret_cast<uintptr_t>(h) % 16 != 0) throw error("cuda ds4 moe: h must be 16-byte aligned");
    ds4q::dispatch_expert_type(down.type, [&]<dtype T>() {
        const int64_t per_block = kWarps * kDownRows;
        const unsigned grid = static_cast<unsigned>((down.rows + per_block - 1) / per_block);
        moe_down_kernel<T><<<grid, 32 * kWarps, staged_bytes(down.cols), s>>>(to_dev(down), ids, n_slot, s0, h,
                                                                               accumulate, y, err);
    });
    check_launch("moe down");
}

void launch_moe_route(const float *logits, int E, const float *bias, const int32_t *tid2eid, int64_t n_vocab,
                      const int32_t *token, int k, float scale, int32_t *ids, float *weights, uint32_t *err,
                      cudaStream_t s) {
    if (E < 1 || E > kMaxExperts || k < 1 || k > kMaxUsed || k > E)
        throw error("cuda ds4 route: unsupported expert count " + std::to_string(E) + " / used " + std::to_string(k) +
                    " (E <= 1024, used <= 32)");
    if (!bias && (!tid2eid || !token || n_vocab < 1))
        throw error("cuda ds4 route: hash routing needs tid2eid, n_vocab and the token id");
    moe_route_kernel<<<1, kRouteThreads, 0, s>>>(logits, E, bias, tid2eid, n_vocab, token, k, scale, ids, weights,
                                                  err);
    check_launch("route");
}

void launch_moe_ffn(const moe_layer &l, const float *xn, const int32_t *token, const moe_scratch &sc, float *y,
                    uint32_t *err, cudaStream_t s) {
    const int64_t D = l.gate.cols, F = l.gate.rows;
    if (l.down.rows != D || l.down.cols != F || l.gate.n_expert != l.n_expert || l.down.n_expert != l.n_expert)
        throw error("cuda ds4 moe: routed banks do not form [F, D] / [D, F] stacks of n_expert");
    const bool shared = l.gate_sh.data != nullptr;
    if (shared && (l.gate_sh.cols != D || l.gate_sh.rows != F || l.down_sh.rows != D || l.down_sh.cols != F))
        throw error("cuda ds4 moe: shared expert shape differs from the routed experts");
    launch_gemv(l.gate_inp_type, l.gate_inp, l.gate_inp_row_bytes, D, l.n_expert, xn, D, 1, sc.logits, l.n_expert, s);
    launch_moe_route(sc.logits, l.n_expert, l.exp_bias, l.tid2eid, l.n_vocab, token, l.n_used, l.weights_scale,
                     sc.ids, sc.weights, err, s);
    launch_moe_gate_up(l.gate, l.up, sc.ids, sc.weights, l.n_used, 0, xn, l.clamp, sc.h, err, s);
    if (shared) launch_moe_gate_up(l.gate_sh, l.up_sh, nullptr, nullptr, 1, l.n_used, xn, l.clamp_sh, sc.h, err, s);
    launch_moe_down(l.down, sc.ids, l.n_used, 0, sc.h, false, y, err, s);
    if (shared) launch_moe_down(l.down_sh, nullptr, 1, l.n_used, sc.h, true, y, err, s);
}

void launch_fill_random(void *dst, size_t n, uint64_t seed, cudaStream_t s) {
    if (n % 8 != 0 || reinterpret_cast<uintptr_t>(dst) % 8 != 0)
        throw error("cuda ds4 fill: size and address must be multiples of 8 bytes");
    const size_t words = n / 8;
    if (!words) return;
    fill_random_kernel<<<static_cast<unsigned>((words + 255) / 256), 256, 0, s>>>(static_cast<uint64_t *>(dst), words,
                                                                                  seed);
    check_launch("fill");
}

}  // namespace fathom::cuda::ds4
