// DS4 MoE on CUDA for one decoded token: expert GEMVs that read only the selected experts' rows
// (gate/up fused with the clamped SwiGLU and the routing weight; down summed over slots in the CPU's
// order), the router (sqrt-softplus scores, hash or biased top-k, weight normalisation) and the
// whole-FFN chain. Launchers: ds4_kernels.h; block decoding: ds4_quant.cuh.
//
// GEMV layout: lanes stride over a row's 32-weight units (lane l: units l + 32 k, so a warp reads a
// contiguous stretch of the row); the activation vector (x, or the h rows) is staged in shared memory
// once per block. Each lane first issues the loads of several units, then computes their dots.
// Two activation paths, chosen per launch from the weight types:
//   q8 (iq2_xxs, q2_k, q8_0: the DS4 q2 mix; the K-quants q3_k .. q6_k of the q4 / Q4_K_M files): the
//      activation is quantised while staged, per block of
//      32 as ggml's q8_1 (d = amax / 127, int8), and the dots are integer (__dp4a of the weight
//      codes with the int8 activations, llama.cpp mmvq style; ds4q::dot_q8x), scaled per run or unit
//      in f32. Results carry the activations' q8 rounding, as the CPU's quantised matmuls
//      (vec_dot_type activations) do.
//      gate/up (moe_gate_up_q8_kernel): a warp task is 2 rows of a routed expert's gate and up (each
//      x unit read from shared memory once for the 4 weight rows) or 1 row of the shared expert;
//      IQ2_XXS signs are computed from their 7-bit codes. Reasoning from the previous version (85 us
//      per layer): its limiter was the shared-memory pipe (one wavefront per cycle per SM), not
//      HBM: every IQ2_XXS unit did 4 random grid and 4 random sign-table lookups (~3.3
//      bank-conflicted wavefronts each) and read its x words once per matrix, ~61 wavefronts per
//      warp-unit, ~23 us for the routed gate/up at the DS4 shape; now ~28.
//      down (moe_down_q8_kernel): a warp computes 2 rows together in 64-column steps (ds4q::step_q8;
//      q2_k runs of 16 scaled once), each step's activation words read once for both rows; a lane
//      issues the loads of 3 routed experts x 2 rows before any arithmetic.
//   staged q8 (default, set_moe_staged): moe_gate_up_staged_kernel / moe_down_staged_kernel copy the
//      weight rows into shared memory with cp.async first (many KB in flight per SM), then run the
//      kernels above's per-row arithmetic on them: bit-identical results (see their comments). The
//      routed iq2_xxs rows read their slab with 32-bit shared addresses at lane-constant offsets
//      (gate_up_iq2_staged: 13 % fewer instructions than the generic loads, gate/up 29.4 -> 26.4 us).
//   f32 (f32, f16, mxfp4, or any mix with them): padded f32 staging (pidx) and FMA dots
//      (ds4q::unit_dot::dot: each 32-weight unit decoded to f32 bit-identically to the CPU's
//      dequantisation, then dotted); gate/up one row per warp task (moe_gate_up_f32_kernel), down
//      (moe_down_f32_kernel) one unit of up to six experts + the shared one per lane round. Results
//      equal the CPU reference (dequantised rows x f32 activations) to f32 rounding.
// Every block quantises the same inputs with the same exact operations, so all get the same bits;
// sums run in a fixed order (deterministic). launch_moe_ffn is 4 launches: router GEMV, route (scores
// by a block, top-k by one warp), gate/up of the routed + shared experts, down of the routed + shared
// experts, each launched with PDL (each waits for its predecessor before reading its outputs).
// Expert ids come from device memory. The router's top-k kernel lives in ds4_moe_route.cu (it also
// serves prefill chunks: launch_moe_route_batch, ds4_prefill.h).
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <string>
#include <type_traits>

#include "backend/cuda/cuda_async.cuh"
#include "backend/cuda/cuda_device.h"
#include "backend/cuda/cuda_pdl.cuh"
#include "backend/cuda/cuda_smem.cuh"
#include "backend/cuda/cuda_kernels.h"
#include "backend/cuda/ds4_gemv.h"
#include "backend/cuda/ds4_kernels.h"
#include "backend/cuda/ds4_moe_route.h"
#include "backend/cuda/ds4_prefill.h"
#include "backend/cuda/ds4_quant.cuh"
#include "core/error.h"

#include "backend/cuda/ktrace.h"

FATHOM_KTRACE_TU(ds4_moe)

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
constexpr int kDownSlots = 6;   // down: routed slots whose loads a lane issues together (DS4: 6 used)
constexpr int kMaxCols = 8192;  // x / h rows staged in shared memory (f32 path: 4.5 bytes per column)

// Units (of 32 weights) per lane per matrix whose loads are issued before any arithmetic, by type
// (bounded by registers: 2 blocks of 256 threads per SM need <= 128 registers per thread).
template <dtype T> constexpr int units_in_flight() {
    return (T == dtype::iq2_xxs || T == dtype::q2_k) ? 4 : 2;
}

// Kernels whose routed and shared types both have integer dots (iq2_xxs, q2_k, q8_0: the DS4 q2
// mix; the K-quants) stage the activation quantised to q8 blocks (ds4q::q8_blk) and dot with __dp4a;
// the others (f32, f16, mxfp4, or a mix with one of them) stage it in f32 and dot with FMAs, as every
// pair does while set_moe_q8_activations(false) (q8_flag).
template <dtype TR, dtype TS> constexpr bool use_q8() {
    return ds4q::has_q8_dot<TR>() && ds4q::has_q8_dot<TS>();
}
std::atomic<bool> &q8_flag() {
    static std::atomic<bool> f{true};
    return f;
}
bool use_q8_rt(dtype tr, dtype ts) {
    bool q8 = false;
    ds4q::dispatch_expert_type(tr, [&]<dtype TR>() {
        ds4q::dispatch_expert_type(ts, [&]<dtype TS>() { q8 = use_q8<TR, TS>(); });
    });
    return q8 && q8_flag().load();
}

// The IQ2_XXS grid in shared memory (random 8-byte lookups) when either type needs it. No barrier
// here: the caller's staging barrier covers it.
template <bool Grid>
__device__ __forceinline__ const uint64_t *stage_grid(uint64_t *sgrid) {
    if constexpr (Grid)
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
// Floats one staged row of K_pad = 32 * units columns occupies (36 per 32).
__host__ __device__ __forceinline__ int64_t staged_floats(int64_t units) {
    return 36 * units;
}
// 4 activation floats (16-byte aligned) by a plain coherent load, not the read-only path: h is
// written by the previous kernel, which may still be running when a PDL-launched down kernel starts
// (it reads h only after pdl_wait; the read-only path is defined only for data constant over the
// kernel's lifetime). Volatile keeps the loads after the wait.
__device__ __forceinline__ float4 ld_act4(const float *p) {
    float4 v;
    asm volatile("ld.global.v4.f32 {%0, %1, %2, %3}, [%4];" : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "l"(p));
    return v;
}
// xs[pidx(i)] = x[i] for i < K, 0 for K <= i < K_pad (K % 4 == 0, K_pad = 32 * units, x 16-byte
// aligned): a float row's last partial unit meets zeros. Caller syncs.
__device__ __forceinline__ void stage_vec(const float *x, int64_t K, int64_t K_pad, float *xs) {
    for (int64_t i = 4 * static_cast<int64_t>(threadIdx.x); i < K_pad; i += 4 * static_cast<int64_t>(blockDim.x))
        *reinterpret_cast<float4 *>(xs + pidx(i)) = i < K ? ld_act4(x + i) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
}

// x[e .. e+4) of a staged row (e % 4 == 0: the four stay inside one padded group of 32).
struct staged_x {
    const float *xs;
    __device__ __forceinline__ float4 operator()(int64_t e) const {
        return *reinterpret_cast<const float4 *>(xs + pidx(e));
    }
};
// A staged q8 row: blocks of 32 (element e in block e >> 5).
struct staged_q8 {
    const ds4q::q8_blk *xb;
};

// Quantise n_rows rows of nblk * 32 floats (row j starts at src + row_off(j), 16-byte aligned) into
// dst[j * nblk + b] (ds4q::quantize_q8_block, bit for bit). 8 lanes per block of 32, a float4 each;
// the amax is an xor-shuffle max over the 8 lanes (exact, so every block staging the same rows gets
// the same bits). Each pass first issues the loads of kStageBatch blocks per 8 lanes (one L2 round
// trip per pass: the down kernel stages 7 x 2048 floats, 2 passes), then quantises them. The loop
// bound is warp-uniform (the shuffles need the whole warp). 32-bit index math (n_rows * nblk is at
// most 8 * 256). Caller syncs.
constexpr int kStageBatch = 8;
template <class RowOff>
__device__ __forceinline__ void stage_q8(const float *src, RowOff row_off, int n_rows, int nblk,
                                         ds4q::q8_blk *dst) {
    const int lane = threadIdx.x & 31, sub = lane & 7;
    const int total = n_rows * nblk, step = static_cast<int>(blockDim.x >> 3);
    for (int gw = (threadIdx.x >> 5) * 4; gw < total; gw += kStageBatch * step) {
        float4 v[kStageBatch];
#pragma unroll
        for (int i = 0; i < kStageBatch; ++i) {
            const int g = gw + (lane >> 3) + i * step;
            v[i] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            if (g < total) {
                const int j = g / nblk, b = g - j * nblk;
                v[i] = ld_act4(src + row_off(j) + 32 * static_cast<int64_t>(b) + 4 * sub);
            }
        }
#pragma unroll
        for (int i = 0; i < kStageBatch; ++i) {
            const int g = gw + (lane >> 3) + i * step;
            float amax = fmaxf(fmaxf(fabsf(v[i].x), fabsf(v[i].y)), fmaxf(fabsf(v[i].z), fabsf(v[i].w)));
            amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
            amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
            amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 4));
            const float d = ds4q::q8_scale(amax), id = ds4q::q8_inv(d);
            const uint32_t q = ds4q::q8_round(v[i].x, id) | ds4q::q8_round(v[i].y, id) << 8 |
                               ds4q::q8_round(v[i].z, id) << 16 | ds4q::q8_round(v[i].w, id) << 24;
            if (g < total) {
                ds4q::q8_blk &o = dst[g];
                o.qs[sub] = static_cast<int32_t>(q);
                if (sub == 0) {
                    o.d = d;
                    o.pad = 0.0f;
                }
            }
        }
    }
}

// The activation type a kernel stages: q8 blocks or padded f32.
template <bool Q8> using act_t = std::conditional_t<Q8, staged_q8, staged_x>;
// Bytes of shared memory one staged row of `units` 32-column units takes.
__host__ __device__ __forceinline__ size_t staged_row_bytes(int64_t units, bool q8) {
    return q8 ? static_cast<size_t>(units) * sizeof(ds4q::q8_blk) : static_cast<size_t>(staged_floats(units)) * 4;
}
// Row j of n rows staged side by side from smem.
template <bool Q8>
__device__ __forceinline__ act_t<Q8> staged_row(void *smem, int64_t units, int j) {
    if constexpr (Q8) return staged_q8{static_cast<const ds4q::q8_blk *>(smem) + j * units};
    else return staged_x{static_cast<const float *>(smem) + j * staged_floats(units)};
}

// sum w x of loaded unit u against either staged form.
template <dtype T>
__device__ __forceinline__ float unit_dot_act(const ds4q::unit_dot<T> &w, int64_t, staged_x x, const uint64_t *grid) {
    return w.dot(x, grid);
}
template <dtype T>
__device__ __forceinline__ float unit_dot_act(const ds4q::unit_dot<T> &w, int64_t u, staged_q8 x,
                                              const uint64_t *grid) {
    return ds4q::dot_q8<T>(w, u, x.xb, grid);
}

// Hint: fetch the 128-byte line holding p into L2 (no register result, no fault on the address).
__device__ __forceinline__ void prefetch_l2(const void *p) {
    asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
}
// The lines of [p, p + bytes) (bytes > 0) prefetched into L2 by the 32 lanes of a warp.
__device__ __forceinline__ void prefetch_range_l2(const uint8_t *p, size_t bytes, int lane) {
    for (size_t off = static_cast<size_t>(lane) * 128; off < bytes + 127; off += 32 * 128)
        prefetch_l2(p + std::min(off, bytes - 1));
}

__device__ __forceinline__ float warp_sum(float a) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) a += __shfl_xor_sync(0xffffffffu, a, o);
    return a;
}


struct bank_dev {
    const uint8_t *data;  // null: no such bank (no shared expert)
    size_t row_bytes, expert_bytes;
    int64_t n_expert, rows, cols, units;  // units = ceil(cols / 32) (cols % 32 != 0 only for float rows)
};
__device__ __forceinline__ const uint8_t *row_ptr(const bank_dev &b, int e, int64_t r) {
    return b.data + static_cast<size_t>(e) * b.expert_bytes + static_cast<size_t>(r) * b.row_bytes;
}

struct gate_up_args {
    bank_dev g, up;    // routed [F, D] stacks
    bank_dev gs, us;   // shared expert [F, D] (data null: none)
    const int32_t *ids;
    const float *wts;
    int n_slot, s0;    // routed slot s -> h row s0 + s; shared -> h row s0 + n_slot
    const float *x;    // [D]
    float clamp, clamp_sh;
    float *h;
    uint32_t *err;
};

// CPU: silu(min(g, c)) * clamp(v, -c, c) (deepseek4_moe.cpp swiglu_clamped); the caller applies the
// routing weight.
__device__ __forceinline__ float swiglu_clamped(float g, float v, float c) {
    const float gc = fminf(g, c), vc = fminf(fmaxf(v, -c), c);
    return gc / (1.0f + expf(-gc)) * vc;
}

// ---- gate/up, f32 activations (f32, f16, mxfp4 weights) ----------------------------------------------

// Per-lane partial dots of one gate row and one up row with the staged x: lane owns units
// lane + 32 k; each round issues the loads of units_in_flight units of both rows, then decodes.
template <dtype T>
__device__ __forceinline__ void gate_up_row_f32(const uint8_t *rg, const uint8_t *ru, int64_t units, int lane,
                                                staged_x x, const uint64_t *grid, float &ag, float &au) {
    constexpr int N = units_in_flight<T>();
    for (int64_t u0 = lane; u0 < units; u0 += 32 * N) {
        ds4q::unit_dot<T> g[N], v[N];
#pragma unroll
        for (int c = 0; c < N; ++c) {
            const int64_t u = u0 + 32 * c;
            if (u < units) {
                g[c].load(rg, u);
                v[c].load(ru, u);
            }
        }
#pragma unroll
        for (int c = 0; c < N; ++c) {
            const int64_t u = u0 + 32 * c;
            if (u < units) {
                ag += unit_dot_act(g[c], u, x, grid);
                au += unit_dot_act(v[c], u, x, grid);
            }
        }
    }
}

// Tasks t = (slot, row), slot-major over the routed slots then the shared expert's rows, spread over
// a grid of as many resident blocks as fit (x is staged once per block); consecutive warps take
// consecutive rows of one expert.
template <dtype TR, dtype TS>
__global__ void __launch_bounds__(32 * kWarps, 2) moe_gate_up_f32_kernel(gate_up_args a) {
    constexpr bool need_grid = TR == dtype::iq2_xxs || TS == dtype::iq2_xxs;
    extern __shared__ float4 dyn_smem[];
    __shared__ uint64_t sgrid[need_grid ? 256 : 1];
    const uint64_t *grid = stage_grid<need_grid>(sgrid);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int64_t F = a.g.rows;
    const int64_t total = static_cast<int64_t>(a.n_slot + (a.gs.data ? 1 : 0)) * F;
    // The warp's first gate and up rows start streaming into L2 while x is staged.
    if (const int64_t t0 = static_cast<int64_t>(blockIdx.x) * kWarps + warp; t0 < total) {
        const int slot = static_cast<int>(t0 / F);
        const int64_t r = t0 % F;
        const int e = slot < a.n_slot ? (a.ids ? a.ids[slot] : 0) : 0;
        const bank_dev &g = slot < a.n_slot ? a.g : a.gs, &u = slot < a.n_slot ? a.up : a.us;
        if (e >= 0 && e < g.n_expert) {
            prefetch_range_l2(row_ptr(g, e, r), g.row_bytes, lane);
            prefetch_range_l2(row_ptr(u, e, r), u.row_bytes, lane);
        }
    }
    stage_vec(a.x, a.g.cols, a.g.units * 32, reinterpret_cast<float *>(dyn_smem));
    __syncthreads();
    const staged_x x{reinterpret_cast<const float *>(dyn_smem)};
    for (int64_t t = static_cast<int64_t>(blockIdx.x) * kWarps + warp; t < total;
         t += static_cast<int64_t>(gridDim.x) * kWarps) {
        const int slot = static_cast<int>(t / F);
        const int64_t r = t % F;
        float ag = 0.0f, au = 0.0f, c = a.clamp_sh, wmul = 1.0f;
        if (slot < a.n_slot) {
            const int e = a.ids ? a.ids[slot] : 0;
            if (e < 0 || e >= a.g.n_expert) {
                if (r == 0 && lane == 0) atomicOr(a.err, err_expert_id);
                continue;
            }
            gate_up_row_f32<TR>(row_ptr(a.g, e, r), row_ptr(a.up, e, r), a.g.units, lane, x, grid, ag, au);
            c = a.clamp;
            if (a.wts) wmul = a.wts[slot];
        } else {
            gate_up_row_f32<TS>(row_ptr(a.gs, 0, r), row_ptr(a.us, 0, r), a.gs.units, lane, x, grid, ag, au);
        }
        ag = warp_sum(ag);
        au = warp_sum(au);
        if (lane == 0) {
            float hv = swiglu_clamped(ag, au, c);
            if (slot < a.n_slot && a.wts) hv *= wmul;
            a.h[static_cast<int64_t>(a.s0 + slot) * F + r] = hv;
        }
    }
}

// ---- gate/up, q8 activations (iq2_xxs, q2_k, q8_0, K-quant weights) ----------------------------------
// x is quantised once per block into shared memory (5 KB at D = 4096). A routed task is kRoutedRows
// consecutive rows of one expert's gate and up (4 weight rows): each x unit is read from shared
// memory once and dotted with all four. A shared-expert task is one row (gate + up): q8_0 rows are
// ~4x the bytes of iq2_xxs rows, so both kinds cost about the same, and the host sizes the grid so
// every warp gets the same number of tasks (at the DS4 shape, F = 2048 warps: one shared row and
// three routed pairs each). A warp prefetches its next task's rows into L2 before computing the
// current one, so the loads of the next task meet L2 rather than HBM latency.

constexpr int kRoutedRows = 2;

// Units per row whose loads a lane issues before any arithmetic, for tasks of R rows of type T: the
// largest power of two (1, 2 or 4) whose raw loaded words fit in ~48 registers (iq2_xxs 4 per
// unit: f16 d + the 3 words ld8_a2 reads; q2_k 8 with its unpacked fields; q8_0 10; the K-quants
// their unit_dot fields: q3_k 7, q6_k 9, q4_k 10, q5_k 12). With 64 the kernel needed more than the
// 128 registers two blocks per SM allow and spilled. The rest of a row's units are in L2 by then (the
// task's rows were prefetched).
template <dtype T> constexpr int unit_regs() {
    switch (T) {
        case dtype::iq2_xxs: return 4;
        case dtype::q3_k: return 7;
        case dtype::q2_k: return 8;
        case dtype::q6_k: return 9;
        case dtype::q5_k: return 12;
        default: return 10;  // q8_0, q4_k
    }
}
template <dtype T, int R> constexpr int q8_units_in_flight() {
    constexpr int n = 48 / (unit_regs<T>() * 2 * R);
    return n >= 4 ? 4 : (n >= 2 ? 2 : 1);
}

// Lane-partial dots of R gate rows and R up rows (rg[r] null: row absent, skipped) with the staged q8
// x: lane owns units lane + 32 k; a round issues the loads of N units of every row, then reads each
// unit's x words once and dots them with all 2R rows.
template <dtype T, int R>
__device__ __forceinline__ void gate_up_rows_q8(const uint8_t *const (&rg)[R], const uint8_t *const (&ru)[R],
                                                int units, int lane, const ds4q::q8_blk *xs, const uint64_t *grid,
                                                float (&ag)[R], float (&au)[R]) {
    constexpr int N = q8_units_in_flight<T, R>();
    for (int u0 = lane; u0 < units; u0 += 32 * N) {
        ds4q::unit_dot<T> g[R][N], v[R][N];
#pragma unroll
        for (int c = 0; c < N; ++c) {
            const int u = u0 + 32 * c;
#pragma unroll
            for (int r = 0; r < R; ++r)
                if (u < units && rg[r]) {
                    g[r][c].load(rg[r], u);
                    v[r][c].load(ru[r], u);
                }
        }
#pragma unroll
        for (int c = 0; c < N; ++c) {
            const int u = u0 + 32 * c;
            if (u < units) {
                ds4q::x_q8<T> x;
                x.load(xs, u);
#pragma unroll
                for (int r = 0; r < R; ++r)
                    if (rg[r]) {
                        ag[r] += ds4q::dot_q8x<T>(g[r][c], x, grid);
                        au[r] += ds4q::dot_q8x<T>(v[r][c], x, grid);
                    }
            }
        }
    }
}

// Task t of the q8 kernel: t < n_sh: row t of the shared expert (slot = n_slot, n = 1); otherwise
// routed task t - n_sh = (slot, pair p): rows kRoutedRows p .. of expert ids[slot], n of them (fewer
// at the end of an odd F; 0 when the expert id is out of range). Row pointers past n are null.
struct gu_task {
    int slot, r0, n;
    const uint8_t *g[kRoutedRows], *u[kRoutedRows];
};
__device__ __forceinline__ gu_task gu_task_at(const gate_up_args &a, int t, int n_sh, int pairs) {
    gu_task k;
#pragma unroll
    for (int i = 0; i < kRoutedRows; ++i) k.g[i] = k.u[i] = nullptr;
    if (t < n_sh) {
        k.slot = a.n_slot;
        k.r0 = t;
        k.n = 1;
        k.g[0] = row_ptr(a.gs, 0, t);
        k.u[0] = row_ptr(a.us, 0, t);
        return k;
    }
    const int tr = t - n_sh;
    k.slot = tr / pairs;
    k.r0 = kRoutedRows * (tr - k.slot * pairs);
    const int e = a.ids ? a.ids[k.slot] : 0;
    k.n = (e < 0 || e >= a.g.n_expert) ? 0 : min(kRoutedRows, static_cast<int>(a.g.rows) - k.r0);
#pragma unroll
    for (int i = 0; i < kRoutedRows; ++i)
        if (i < k.n) {
            k.g[i] = row_ptr(a.g, e, k.r0 + i);
            k.u[i] = row_ptr(a.up, e, k.r0 + i);
        }
    return k;
}
__device__ __forceinline__ void prefetch_task(const gu_task &k, const gate_up_args &a, int lane) {
    const size_t rb = k.slot < a.n_slot ? a.g.row_bytes : a.gs.row_bytes;
#pragma unroll
    for (int i = 0; i < kRoutedRows; ++i)
        if (i < k.n) {
            prefetch_range_l2(k.g[i], rb, lane);
            prefetch_range_l2(k.u[i], rb, lane);
        }
}

// Tasks of the q8 kernel: n_sh shared rows, then the routed pairs.
__host__ __device__ __forceinline__ int gu_q8_pairs(int64_t F) {
    return static_cast<int>((F + kRoutedRows - 1) / kRoutedRows);
}

template <dtype TR, dtype TS>
__global__ void __launch_bounds__(32 * kWarps, 2) moe_gate_up_q8_kernel(gate_up_args a) {
    constexpr bool need_grid = TR == dtype::iq2_xxs || TS == dtype::iq2_xxs;
    extern __shared__ float4 dyn_smem[];
    __shared__ uint64_t sgrid[need_grid ? 256 : 1];
    const uint64_t *grid = stage_grid<need_grid>(sgrid);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int F = static_cast<int>(a.g.rows), units = static_cast<int>(a.g.units);
    const int n_sh = a.gs.data ? F : 0, pairs = gu_q8_pairs(F);
    const int total = n_sh + a.n_slot * pairs, stride = static_cast<int>(gridDim.x) * kWarps;
    int t = static_cast<int>(blockIdx.x) * kWarps + warp;
    // the first task's rows start streaming into L2 while x is staged (before pdl_wait a routed
    // task's expert id may be stale: a prefetch is only a hint, the task itself reads it again)
    if (t < total) prefetch_task(gu_task_at(a, t, n_sh, pairs), a, lane);
    ds4q::q8_blk *xs = reinterpret_cast<ds4q::q8_blk *>(dyn_smem);
    stage_q8(a.x, [](int) { return int64_t{0}; }, 1, units, xs);
    __syncthreads();
    // PDL (launch_moe_ffn): the preceding kernel is the route kernel, which writes only ids and wts;
    // everything before it has completed (it lets this kernel launch only after its own pdl_wait),
    // so x and the shared expert's
    // rows are read, and shared tasks run, while routing is still in flight. pdl_wait comes before
    // the first routed task (warp-uniform), and at the end for warps that had none.
    bool waited = false;
    for (; t < total; t += stride) {
        if (!waited && t >= n_sh) {
            pdl_wait();
            pdl_launch_dependents();  // the down kernel may start prefetching its rows
            waited = true;
        }
        const gu_task k = gu_task_at(a, t, n_sh, pairs);
        if (t + stride < total) prefetch_task(gu_task_at(a, t + stride, n_sh, pairs), a, lane);
        const bool routed = k.slot < a.n_slot;
        if (routed && k.n == 0) {
            if (k.r0 == 0 && lane == 0) atomicOr(a.err, err_expert_id);
            continue;
        }
        float ag[kRoutedRows], au[kRoutedRows];
#pragma unroll
        for (int i = 0; i < kRoutedRows; ++i) ag[i] = au[i] = 0.0f;
        if (routed) {
            gate_up_rows_q8<TR, kRoutedRows>(k.g, k.u, units, lane, xs, grid, ag, au);
        } else {
            const uint8_t *const g1[1] = {k.g[0]}, *const u1[1] = {k.u[0]};
            float ag1[1] = {0.0f}, au1[1] = {0.0f};
            gate_up_rows_q8<TS, 1>(g1, u1, units, lane, xs, grid, ag1, au1);
            ag[0] = ag1[0];
            au[0] = au1[0];
        }
        const float c = routed ? a.clamp : a.clamp_sh;
        const float wmul = routed && a.wts ? a.wts[k.slot] : 1.0f;
        float *hrow = a.h + static_cast<int64_t>(a.s0 + k.slot) * F + k.r0;
#pragma unroll
        for (int i = 0; i < kRoutedRows; ++i) {
            if (i >= k.n) break;  // warp-uniform
            const float g = warp_sum(ag[i]), v = warp_sum(au[i]);
            if (lane == i) {
                float hv = swiglu_clamped(g, v, c);
                if (routed && a.wts) hv *= wmul;
                hrow[i] = hv;
            }
        }
    }
    if (!waited) pdl_wait();  // this kernel completes only after the route kernel
}

// ---- gate/up, q8, weights staged through shared memory (cp.async) ------------------------------------
// Why: moe_gate_up_q8_kernel reads its weight rows straight from global memory, a lane holding N units
// per round: a few KB in flight per SM, ~24 % of HBM bandwidth at the DS4 shape (40 us per
// layer-token for 44 MB). Here a block walks "slabs": up to kGuRoutedRows consecutive rows of one
// routed expert's gate AND the same rows of its up (or a few rows of the shared expert's gate and
// up), whose bytes are contiguous in global memory (rows of one expert are). All 256 threads copy a
// slab into a shared-memory stage with 16-byte cp.async.cg, c.stages (2 or 3) stages deep, so while
// one slab is computed the next one or two (~34 KB each, ~70-140 KB per SM) are in flight. The warps
// then run EXACTLY the per-row arithmetic of the direct kernel on row pointers into the stage (the unit
// decoders use generic loads, which reach shared memory): every h value is bit-identical to
// moe_gate_up_q8_kernel's (same units per lane in the same order, same warp_sum, swiglu and weight).
//   routed slab: rows r0 .. r0 + n (n <= c.rows_r) of expert ids[slot]; warp w: rows 2w, 2w + 1
//     (gate_up_rows_q8<TR, 2>, as a direct-kernel task).
//   shared slab: rows r0 .. r0 + n (n <= c.rows_s <= kWarps / 2) of the shared expert; warp w: matrix
//     w & 1 (gate, up) of row w >> 1 (row_dot_q8: the direct kernel's per-row loop for one matrix),
//     the two warp sums meet in shared memory for the swiglu.
// Stage layout (c.stage_bytes, 16-byte multiple): gate rows at 0, up rows at c.half, 16 spare bytes at
// the end (the unit loads may read up to 4 bytes past a row; those bytes never reach a result).
// Slab order: the shared expert's slabs first (they need no expert ids: copied and computed before
// pdl_wait while routing is in flight), then slot-major routed slabs. Block b takes slabs b + k * grid.
// Sizes at the DS4 shape: routed slab 16 rows x 1056 B (iq2_xxs, D = 4096) per matrix, shared slab 4
// rows x 4352 B (q8_0): ~34 KB per stage; 3 stages + x = 107 KB per block, 2 blocks per SM (228 KB).
constexpr int kGuRoutedRows = 2 * kWarps;   // routed rows per slab at most (2 per warp)
constexpr int kGuSharedRows = kWarps / 2;   // shared rows per slab at most (gate + up over 2 warps)
constexpr size_t kGuHalfBytes = 17920;      // target bytes of one matrix's rows in a stage (17.5 KB)

struct gu_stage_cfg {
    int rows_r, rows_s;      // rows per routed / shared slab
    int sh_slabs, per_slot;  // shared slabs (0: no shared expert), routed slabs per slot
    int total, stages;       // slabs; pipeline depth (2 or 3)
    int half, stage_bytes;   // up rows' offset in a stage; bytes per stage
    int xs_bytes;            // staged q8 x (16-byte multiple), before the stages
};
struct gu_staged_args {
    gate_up_args a;
    gu_stage_cfg c;
};

// The dot of one weight row (in place or staged) with the staged q8 x: gate_up_rows_q8's loop for
// one matrix (lane owns units lane + 32 k, ascending; the same loads and dot_q8x), so the lane
// partials equal that function's ag / au for the same row bit for bit.
template <dtype T>
__device__ __forceinline__ float row_dot_q8(const uint8_t *row, int units, int lane, const ds4q::q8_blk *xs,
                                            const uint64_t *grid) {
    constexpr int N = q8_units_in_flight<T, 1>();
    float acc = 0.0f;
    for (int u0 = lane; u0 < units; u0 += 32 * N) {
        ds4q::unit_dot<T> w[N];
#pragma unroll
        for (int c = 0; c < N; ++c)
            if (u0 + 32 * c < units) w[c].load(row, u0 + 32 * c);
#pragma unroll
        for (int c = 0; c < N; ++c) {
            const int u = u0 + 32 * c;
            if (u < units) {
                ds4q::x_q8<T> x;
                x.load(xs, u);
                acc += ds4q::dot_q8x<T>(w[c], x, grid);
            }
        }
    }
    return acc;
}

// Slab i: shared (slot == n_slot, e = 0) or routed; n rows from r0 (0 for a routed id out of range).
// Routed slabs read ids: only after pdl_wait.
struct gu_slab {
    int slot, r0, n, e;
};
__device__ __forceinline__ gu_slab gu_slab_at(const gate_up_args &a, const gu_stage_cfg &c, int i) {
    const int F = static_cast<int>(a.g.rows);
    gu_slab k;
    if (i < c.sh_slabs) {
        k.slot = a.n_slot;
        k.r0 = i * c.rows_s;
        k.n = min(c.rows_s, F - k.r0);
        k.e = 0;
        return k;
    }
    const int j = i - c.sh_slabs;
    k.slot = j / c.per_slot;
    k.r0 = (j - k.slot * c.per_slot) * c.rows_r;
    k.e = a.ids ? a.ids[k.slot] : 0;
    k.n = (k.e < 0 || k.e >= a.g.n_expert) ? 0 : min(c.rows_r, F - k.r0);
    return k;
}

// All threads: cp.async of slab k's gate rows to stage[0, n * rb) and up rows to stage[half, ..).
// Sources and row_bytes are 16-byte multiples (checked at launch). One loop over the chunks of both
// matrices (the same offset in each), so the index math is paid once per two copies.
__device__ __forceinline__ void gu_issue(const gate_up_args &a, const gu_stage_cfg &c, const gu_slab &k,
                                         uint8_t *stage) {
    if (k.n <= 0) return;
    const bool routed = k.slot < a.n_slot;
    const bank_dev &g = routed ? a.g : a.gs, &u = routed ? a.up : a.us;
    const uint8_t *sg = row_ptr(g, k.e, k.r0), *su = row_ptr(u, k.e, k.r0);
    const int chunks = k.n * static_cast<int>(g.row_bytes / 16);  // per matrix
    for (int q = static_cast<int>(threadIdx.x); q < chunks; q += static_cast<int>(blockDim.x)) {
        cp_async16(stage + 16 * q, sg + 16 * q);
        cp_async16(stage + c.half + 16 * q, su + 16 * q);
    }
}

// 32-bit shared-memory loads (address from smem_addr): the staged kernels' fast paths read their
// slabs this way, so the per-unit index math stays 32-bit and the loads are LDS, not generic 64-bit
// loads. Volatile with a memory clobber: they stay after the cp.async wait and barrier that make the
// slab visible.
__device__ __forceinline__ uint32_t smem_addr(const void *p) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ uint32_t lds_u32(uint32_t a) {
    uint32_t v;
    asm volatile("ld.shared.u32 %0, [%1];" : "=r"(v) : "r"(a) : "memory");
    return v;
}
__device__ __forceinline__ float lds_f16(uint32_t a) {
    unsigned short v;
    asm volatile("ld.shared.u16 %0, [%1];" : "=h"(v) : "r"(a) : "memory");
    return __half2float(__ushort_as_half(v));
}

// gu_compute's routed iq2_xxs fast path (the warp has both its rows, whole rounds of 32 units): rows
// 2w and 2w + 1 of the slab, gate at g0 and g0 + rb, up at + half (shared addresses). Lane l's units
// l + 32 k lie in block (l >> 3) + 4 k, group l & 7 of a row: bytes 66 (l >> 3) + 2 + 8 (l & 7) + 264 k,
// so the offsets and the 2- or 4-byte alignment (the funnel shift of ld8_a2) are the lane's, fixed for
// the loop. Same units per lane in the same order, same x_q8 loads and dot_q8x as gate_up_rows_q8<
// iq2_xxs, 2>: bit-identical. Reads up to 4 bytes past a row (the stage's spare bytes cover the last).
__device__ __forceinline__ void gate_up_iq2_staged(uint32_t g0, uint32_t rb, uint32_t half, int units, int lane,
                                                   const ds4q::q8_blk *xs, const uint64_t *grid,
                                                   float (&ag)[kRoutedRows], float (&au)[kRoutedRows]) {
    static_assert(kRoutedRows == 2, "rows 2w, 2w + 1");
    const uint32_t boff = 66u * static_cast<uint32_t>(lane >> 3);
    const uint32_t goff = boff + 2u + 8u * static_cast<uint32_t>(lane & 7);
    const uint32_t aoff = goff & ~3u, sh = (goff & 2u) * 8u;  // sh: 0 or 16
    const uint32_t row[4] = {g0, g0 + half, g0 + rb, g0 + rb + half};  // gate 0, up 0, gate 1, up 1
#pragma unroll 2
    for (int u = lane; u < units; u += 32) {
        const uint32_t o = 264u * static_cast<uint32_t>(u >> 5);
        ds4q::unit_dot<dtype::iq2_xxs> w[4];
#pragma unroll
        for (int r = 0; r < 4; ++r) {
            const uint32_t p = row[r] + aoff + o;
            const uint32_t w0 = lds_u32(p), w1 = lds_u32(p + 4), w2 = lds_u32(p + 8);
            w[r].d = lds_f16(row[r] + boff + o);
            w[r].a0 = __funnelshift_r(w0, w1, sh);
            w[r].a1 = __funnelshift_r(w1, w2, sh);
            w[r].base = 32 * u;
        }
        ds4q::x_q8<dtype::iq2_xxs> x;
        x.load(xs, u);
        ag[0] += ds4q::dot_q8x<dtype::iq2_xxs>(w[0], x, grid);
        au[0] += ds4q::dot_q8x<dtype::iq2_xxs>(w[1], x, grid);
        ag[1] += ds4q::dot_q8x<dtype::iq2_xxs>(w[2], x, grid);
        au[1] += ds4q::dot_q8x<dtype::iq2_xxs>(w[3], x, grid);
    }
}

// One staged slab computed by the block (block-uniform control flow: it may __syncthreads).
template <dtype TR, dtype TS>
__device__ __forceinline__ void gu_compute(const gate_up_args &a, const gu_stage_cfg &c, const gu_slab &k,
                                           const uint8_t *stage, const ds4q::q8_blk *xs, const uint64_t *grid,
                                           float *red) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int F = static_cast<int>(a.g.rows), units = static_cast<int>(a.g.units);
    if (k.slot < a.n_slot) {
        if (k.n == 0) {  // expert id out of range: flag once per slot, leave its h rows
            if (k.r0 == 0 && threadIdx.x == 0) atomicOr(a.err, err_expert_id);
            return;
        }
        const int nw = min(kRoutedRows, k.n - kRoutedRows * warp);  // this warp's rows (warp-uniform)
        if (nw <= 0) return;
        const size_t rb = a.g.row_bytes;
        const uint8_t *rg[kRoutedRows], *ru[kRoutedRows];
#pragma unroll
        for (int i = 0; i < kRoutedRows; ++i) {
            const uint8_t *p = stage + static_cast<size_t>(kRoutedRows * warp + i) * rb;
            rg[i] = i < nw ? p : nullptr;
            ru[i] = i < nw ? p + c.half : nullptr;
        }
        float ag[kRoutedRows], au[kRoutedRows];
#pragma unroll
        for (int i = 0; i < kRoutedRows; ++i) ag[i] = au[i] = 0.0f;
        bool fast = false;
        if constexpr (TR == dtype::iq2_xxs)
            if (nw == kRoutedRows && units % 32 == 0) {  // warp-uniform
                gate_up_iq2_staged(smem_addr(rg[0]), static_cast<uint32_t>(rb), static_cast<uint32_t>(c.half), units,
                                   lane, xs, grid, ag, au);
                fast = true;
            }
        if (!fast) gate_up_rows_q8<TR, kRoutedRows>(rg, ru, units, lane, xs, grid, ag, au);
        const float wmul = a.wts ? a.wts[k.slot] : 1.0f;
        float *hrow = a.h + static_cast<int64_t>(a.s0 + k.slot) * F + k.r0 + kRoutedRows * warp;
#pragma unroll
        for (int i = 0; i < kRoutedRows; ++i) {
            if (i >= nw) break;  // warp-uniform
            const float g = warp_sum(ag[i]), v = warp_sum(au[i]);
            if (lane == i) {
                float hv = swiglu_clamped(g, v, a.clamp);
                if (a.wts) hv *= wmul;
                hrow[i] = hv;
            }
        }
        return;
    }
    const int j = warp >> 1, m = warp & 1;  // row j, matrix m (0 gate, 1 up)
    if (j < k.n) {
        const float s = warp_sum(row_dot_q8<TS>(stage + m * c.half + static_cast<size_t>(j) * a.gs.row_bytes, units,
                                                lane, xs, grid));
        if (lane == 0) red[warp] = s;
    }
    __syncthreads();  // red complete (the next writes to red follow the next slab's barrier)
    if (static_cast<int>(threadIdx.x) < k.n)
        a.h[static_cast<int64_t>(a.s0 + a.n_slot) * F + k.r0 + threadIdx.x] =
            swiglu_clamped(red[2 * threadIdx.x], red[2 * threadIdx.x + 1], a.clamp_sh);
}

// Pipeline: the prologue issues the block's first stages - 1 slabs, x is quantised meanwhile; each
// iteration then waits for its slab (cp.async.wait_group + one barrier, which also frees the stage
// computed in the previous iteration), issues the slab stages - 1 ahead into that freed stage,
// computes. One commit group per slab position (empty ones too), so wait_group counts stay aligned.
// PDL as the direct kernel: shared slabs before pdl_wait; pdl_wait (+ launch_dependents) right
// before the first routed slab is issued - after computing the current slab, so shared compute
// overlaps routing; at the end for blocks that had no routed slab.
template <dtype TR, dtype TS>
__global__ void __launch_bounds__(32 * kWarps, 2) moe_gate_up_staged_kernel(gu_staged_args p) {
    FATHOM_KTRACE_SCOPE(k_moe_gate_up);
    constexpr bool need_grid = TR == dtype::iq2_xxs || TS == dtype::iq2_xxs;
    extern __shared__ float4 dyn_smem[];
    __shared__ uint64_t sgrid[need_grid ? 256 : 1];
    __shared__ float red[kWarps];
    const gate_up_args &a = p.a;
    const gu_stage_cfg &c = p.c;
    const uint64_t *grid = stage_grid<need_grid>(sgrid);
    ds4q::q8_blk *xs = reinterpret_cast<ds4q::q8_blk *>(dyn_smem);
    uint8_t *stages = reinterpret_cast<uint8_t *>(dyn_smem) + c.xs_bytes;
    const int G = static_cast<int>(gridDim.x), b = static_cast<int>(blockIdx.x);
    bool waited = false;
    // slab index -> issue into stage `st` (after pdl_wait when routed)
    auto issue = [&](int i, int st) {
        if (i >= c.total) return;
        if (i >= c.sh_slabs && !waited) {
            pdl_wait();
            pdl_launch_dependents();  // the down kernel may start prefetching its rows
            waited = true;
        }
        gu_issue(a, c, gu_slab_at(a, c, i), stages + static_cast<size_t>(st) * c.stage_bytes);
    };
    for (int q = 0; q < c.stages - 1; ++q) {
        issue(b + q * G, q);
        cp_async_commit();
    }
    stage_q8(a.x, [](int) { return int64_t{0}; }, 1, static_cast<int>(a.g.units), xs);
    for (int it = 0;; ++it) {
        const int i = b + it * G;
        if (i >= c.total) break;
        if (c.stages == 3) cp_async_wait<1>();
        else cp_async_wait<0>();
        __syncthreads();  // slab i (all threads' copies), x and the grid visible; stage (it - 1) free
        const int nxt = i + (c.stages - 1) * G, st = (it + c.stages - 1) % c.stages;
        const bool defer = nxt < c.total && nxt >= c.sh_slabs && !waited;
        if (!defer) issue(nxt, st);
        gu_compute<TR, TS>(a, c, gu_slab_at(a, c, i), stages + static_cast<size_t>(it % c.stages) * c.stage_bytes, xs,
                           grid, red);
        if (defer) issue(nxt, st);
        cp_async_commit();
    }
    cp_async_wait<0>();
    if (!waited) pdl_wait();  // this kernel completes only after the route kernel
}

// ---- down --------------------------------------------------------------------------------------------

struct down_args {
    bank_dev d;    // routed [D, F] stack
    bank_dev ds;   // shared expert [D, F] (data null: none)
    const int32_t *ids;
    int n_slot, s0, s_sh;  // routed slot s reads h row s0 + s, the shared expert h row s_sh
    const float *h;
    bool accumulate;
    float *y;
    uint32_t *err;
};

// Start block `blk`'s weight rows streaming from HBM into L2 before staging h (staging reads only h,
// from L2; without this the first weight loads are issued after it): rows [r0, r0 + kWarps *
// kDownRows) of every selected expert and of the shared expert, contiguous per matrix, one matrix per
// warp. Before pdl_wait the ids may be stale: prefetches are only hints.
__device__ __forceinline__ void down_prefetch(const down_args &a, int n_rows, int warp, int lane) {
    const int64_t r0 = static_cast<int64_t>(blockIdx.x) * kWarps * kDownRows;
    const int64_t nr = std::min<int64_t>(kWarps * kDownRows, a.d.rows - r0);
    for (int j = warp; j < n_rows; j += kWarps) {
        const int e = j < a.n_slot ? (a.ids ? a.ids[j] : 0) : 0;
        if (j < a.n_slot && (e < 0 || e >= a.d.n_expert)) continue;
        const uint8_t *p = j < a.n_slot ? row_ptr(a.d, e, r0) : row_ptr(a.ds, 0, r0);
        prefetch_range_l2(p, static_cast<size_t>(nr) * (j < a.n_slot ? a.d.row_bytes : a.ds.row_bytes), lane);
    }
}
// Block 0 flags routed ids out of range (their slots are skipped).
__device__ __forceinline__ void down_check_ids(const down_args &a) {
    if (blockIdx.x == 0 && static_cast<int>(threadIdx.x) < a.n_slot) {
        const int e = a.ids ? a.ids[threadIdx.x] : 0;
        if (e < 0 || e >= a.d.n_expert) atomicOr(a.err, err_expert_id);
    }
}

// f32 activations (f32, f16, mxfp4 weights or a mix with them). A block owns kWarps * kDownRows
// rows (warp w: rows w, w + kWarps, ...). Every h row it needs (all routed slots, then the shared
// expert's) is staged once, side by side, in padded f32; a lane then issues the loads of one unit of
// up to kDownSlots experts (+ the shared expert) before decoding any. Per-lane sums run over units,
// then slots in order, then the shared expert; one warp tree at the end (deterministic: no atomics).
template <dtype TR, dtype TS>
__global__ void __launch_bounds__(32 * kWarps, 2) moe_down_f32_kernel(down_args a) {
    constexpr bool need_grid = TR == dtype::iq2_xxs || TS == dtype::iq2_xxs;
    extern __shared__ float4 dyn_smem[];
    __shared__ uint64_t sgrid[need_grid ? 256 : 1];
    const uint64_t *grid = stage_grid<need_grid>(sgrid);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int64_t F = a.d.cols, units = a.d.units;
    const bool shared = a.ds.data != nullptr;
    const int n_rows = a.n_slot + (shared ? 1 : 0);
    down_prefetch(a, n_rows, warp, lane);
    // PDL: h, y and the ids used below come after the preceding kernel has completed.
    pdl_wait();
    {
        float *xs = reinterpret_cast<float *>(dyn_smem);
        const int64_t stride = staged_floats(units);
        for (int j = 0; j < n_rows; ++j)
            stage_vec(a.h + static_cast<int64_t>(j < a.n_slot ? a.s0 + j : a.s_sh) * F, F, 32 * units, xs + j * stride);
    }
    down_check_ids(a);
    __syncthreads();
    const int64_t row0 = static_cast<int64_t>(blockIdx.x) * kWarps * kDownRows + warp;
    for (int q = 0; q < kDownRows; ++q) {
        const int64_t r = row0 + q * kWarps;
        if (r >= a.d.rows) break;
        float acc = 0.0f;
        for (int sg = 0; sg < a.n_slot || (sg == 0 && shared); sg += kDownSlots) {
            const uint8_t *rows[kDownSlots];  // null: slot absent or its id out of range (skipped)
#pragma unroll
            for (int j = 0; j < kDownSlots; ++j) {
                const int s = sg + j;
                const int e = s < a.n_slot ? (a.ids ? a.ids[s] : 0) : -1;
                rows[j] = (e >= 0 && e < a.d.n_expert) ? row_ptr(a.d, e, r) : nullptr;
            }
            const bool with_sh = shared && sg == 0;
            const uint8_t *rsh = with_sh ? row_ptr(a.ds, 0, r) : nullptr;
            for (int64_t u = lane; u < units; u += 32) {
                ds4q::unit_dot<TR> w[kDownSlots];
                ds4q::unit_dot<TS> wsh;
#pragma unroll
                for (int j = 0; j < kDownSlots; ++j)
                    if (rows[j]) w[j].load(rows[j], u);
                if (with_sh) wsh.load(rsh, u);
#pragma unroll
                for (int j = 0; j < kDownSlots; ++j)
                    if (rows[j]) acc += unit_dot_act(w[j], u, staged_row<false>(dyn_smem, units, sg + j), grid);
                if (with_sh) acc += unit_dot_act(wsh, u, staged_row<false>(dyn_smem, units, a.n_slot), grid);
            }
        }
        const float total = warp_sum(acc);
        if (lane == 0) a.y[r] = (a.accumulate ? a.y[r] : 0.0f) + total;
    }
}

// q8 activations (iq2_xxs, q2_k, q8_0 weights: the DS4 q2 mix). Why it is shaped this way (round 3
// measured 837 GB/s for the routed q2_k down, ~20 % of copy): the kernel was issue-bound, not
// HBM-bound (each block's rows are prefetched into L2 before h is staged): ~100 instructions per
// q2_k 32-weight unit (4 runs of 8, each scaled in f32) plus 8 shared-memory loads of its activation
// words per row, and every warp did its 2 rows one after the other (4 dependent load rounds).
// Now a lane's unit is a 64-column step (ds4q::step_q8: q2_k runs of 16 share one scaling, ~2/3 of
// the instructions per weight), a warp owns kDownRows consecutive rows and computes them together
// (each step's activation words are read from shared memory once, ds4q::xs_q8, and dotted with
// every row), and a lane issues the loads of down_group routed slots x kDownRows rows (42 words for
// q2_k) before any arithmetic: 3 load rounds per step for the DS4 shape (2 routed groups + the
// shared expert) instead of 4 per row pair. 32-bit index math (rows, steps < 2^31). At the DS4 shape
// (F = 2048: 32 steps) every lane does exactly one step per row pair. Per-lane sums run over steps,
// then routed slots in order, then the shared expert; one warp tree per row (deterministic).
// Routed slots per load round (x kDownRows rows), by type: q2_k 3 (42 loaded words; the DS4 mix with
// the q8_0 shared expert fits 128 registers without spills), iq2_xxs 2, q8_0 and the K-quants 1 (two
// units of 7-12 words per row).
template <dtype T> constexpr int down_group() {
    return T == dtype::q2_k ? 3 : (T == dtype::iq2_xxs ? 2 : 1);
}

// Lane-partial dots of n <= kDownRows rows (rows[i], consecutive rows of one matrix; n warp-uniform)
// of one expert with its staged q8 activation row xb, at step U.
template <dtype T, int N>
__device__ __forceinline__ void down_step_rows(const uint8_t *const (&rows)[N][kDownRows], const bool (&ok)[N],
                                               const ds4q::q8_blk *const (&xb)[N], int n, int U, int units,
                                               const uint64_t *grid, float (&acc)[kDownRows]) {
    ds4q::step_q8<T> w[N][kDownRows];
#pragma unroll
    for (int j = 0; j < N; ++j)
#pragma unroll
        for (int i = 0; i < kDownRows; ++i)
            if (ok[j] && i < n) w[j][i].load(rows[j][i], U, units);
#pragma unroll
    for (int j = 0; j < N; ++j) {
        if (!ok[j]) continue;
        ds4q::xs_q8<T> x;
        x.load(xb[j], U, units);
#pragma unroll
        for (int i = 0; i < kDownRows; ++i)
            if (i < n) acc[i] += ds4q::dot_step_q8<T>(w[j][i], x, grid);
    }
}

// The q8 down kernels' part after staging (moe_down_q8_kernel, moe_down_staged_kernel): the warp's
// rows rb .. rb + n - 1 (n <= kDownRows, warp-uniform; none: return) dotted with every routed slot's
// staged q8 h row (xs + slot * units) and the shared expert's (xs + n_slot * units; its rows in
// global memory); y[rb + i] = (accumulate ? y : 0) + warp_sum. routed_row(s, e, i): row rb + i of
// slot s's expert e (id in range). Per-lane sums run over steps, then routed slot groups in order,
// then the shared expert, so both kernels produce the same bits.
template <dtype TR, dtype TS, class RoutedRow>
__device__ __forceinline__ void down_rows_q8(const down_args &a, const ds4q::q8_blk *xs, int rb, int lane,
                                             const uint64_t *grid, RoutedRow routed_row) {
    const int units = static_cast<int>(a.d.units), steps = (units + 1) >> 1;
    const bool shared = a.ds.data != nullptr;
    const int n_slot = a.n_slot;
    const int n = min(kDownRows, static_cast<int>(a.d.rows) - rb);  // rows of this warp (warp-uniform)
    if (n <= 0) return;
    float acc[kDownRows];
#pragma unroll
    for (int i = 0; i < kDownRows; ++i) acc[i] = 0.0f;
    for (int U = lane; U < steps; U += 32) {
        constexpr int G = down_group<TR>();
        for (int g0 = 0; g0 < n_slot; g0 += G) {
            const uint8_t *rows[G][kDownRows];
            const ds4q::q8_blk *xb[G];
            bool ok[G];  // slot present and its id in range (warp-uniform)
#pragma unroll
            for (int j = 0; j < G; ++j) {
                const int s = g0 + j;
                const int e = s < n_slot ? (a.ids ? a.ids[s] : 0) : -1;
                ok[j] = e >= 0 && e < a.d.n_expert;
                xb[j] = xs + s * units;
#pragma unroll
                for (int i = 0; i < kDownRows; ++i) rows[j][i] = ok[j] ? routed_row(s, e, i) : nullptr;
            }
            down_step_rows<TR, G>(rows, ok, xb, n, U, units, grid, acc);
        }
        if (shared) {
            const uint8_t *rows[1][kDownRows];
#pragma unroll
            for (int i = 0; i < kDownRows; ++i) rows[0][i] = row_ptr(a.ds, 0, rb + i);
            const bool ok[1] = {true};
            const ds4q::q8_blk *xb[1] = {xs + n_slot * units};
            down_step_rows<TS, 1>(rows, ok, xb, n, U, units, grid, acc);
        }
    }
#pragma unroll
    for (int i = 0; i < kDownRows; ++i) {
        if (i >= n) break;  // warp-uniform
        const float total = warp_sum(acc[i]);
        if (lane == 0) a.y[rb + i] = (a.accumulate ? a.y[rb + i] : 0.0f) + total;
    }
}

// The q8 down kernels' h staging: rows s0 .. s0 + n_slot - 1 and, with a shared expert, s_sh of h
// quantised into xs (n_rows x units q8 blocks), then the ids checked. The caller syncs.
__device__ __forceinline__ void down_stage_h(const down_args &a, ds4q::q8_blk *xs) {
    const int F = static_cast<int>(a.d.cols), units = static_cast<int>(a.d.units);
    const int n_slot = a.n_slot, n_rows = n_slot + (a.ds.data != nullptr ? 1 : 0);
    const int s0 = a.s0, s_sh = a.s_sh;
    stage_q8(a.h, [=](int j) { return static_cast<int64_t>(j < n_slot ? s0 + j : s_sh) * F; }, n_rows, units, xs);
    down_check_ids(a);
}

template <dtype TR, dtype TS>
__global__ void __launch_bounds__(32 * kWarps, 2) moe_down_q8_kernel(down_args a) {
    constexpr bool need_grid = TR == dtype::iq2_xxs || TS == dtype::iq2_xxs;
    extern __shared__ float4 dyn_smem[];
    __shared__ uint64_t sgrid[need_grid ? 256 : 1];
    const uint64_t *grid = stage_grid<need_grid>(sgrid);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    down_prefetch(a, a.n_slot + (a.ds.data != nullptr ? 1 : 0), warp, lane);
    // PDL: h, y and the ids used below come after the preceding kernel has completed.
    pdl_wait();
    ds4q::q8_blk *xs = reinterpret_cast<ds4q::q8_blk *>(dyn_smem);
    down_stage_h(a, xs);
    __syncthreads();
    const int rb = static_cast<int>(blockIdx.x) * (kWarps * kDownRows) + kDownRows * warp;
    down_rows_q8<TR, TS>(a, xs, rb, lane, grid, [&](int, int e, int i) { return row_ptr(a.d, e, rb + i); });
}

// ---- down, q8, routed rows staged through shared memory (cp.async) -----------------------------------
// moe_down_q8_kernel prefetches its block's rows into L2 (hints: before pdl_wait the ids may be
// stale), then each lane loads a few words per round. Here, after pdl_wait (ids final), all threads
// copy the block's kWarps * kDownRows consecutive rows of every routed slot (contiguous per expert)
// into shared memory with 16-byte cp.async.cg, all in flight at once (~64 KB per block at the DS4
// shape) while h is quantised, then compute exactly as moe_down_q8_kernel with the routed row pointers
// into shared memory: y is bit-identical (same steps per lane, slot order, warp_sum). The shared
// expert's rows (q8_0: 34 KB per block) stay in global memory (prefetched into L2): staging them too
// would leave room for one block per SM. Layout after the staged h rows (xs_bytes, 16-byte multiple):
// slot s's rows at s * kWarps * kDownRows * row_bytes, then 16 spare bytes (loads read up to 4 bytes
// past a row). Slots with an id out of range are neither copied nor computed (as the direct kernel).
struct down_staged_args {
    down_args a;
    int xs_bytes;
};
template <dtype TR, dtype TS>
__global__ void __launch_bounds__(32 * kWarps, 2) moe_down_staged_kernel(down_staged_args p) {
    FATHOM_KTRACE_SCOPE(k_moe_down);
    constexpr bool need_grid = TR == dtype::iq2_xxs || TS == dtype::iq2_xxs;
    constexpr int kBlockRows = kWarps * kDownRows;
    extern __shared__ float4 dyn_smem[];
    __shared__ uint64_t sgrid[need_grid ? 256 : 1];
    const down_args &a = p.a;
    const uint64_t *grid = stage_grid<need_grid>(sgrid);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int n_slot = a.n_slot;
    down_prefetch(a, n_slot + (a.ds.data != nullptr ? 1 : 0), warp, lane);
    // PDL: h, y and the ids used below come after the preceding kernel has completed.
    pdl_wait();
    const int r0 = static_cast<int>(blockIdx.x) * kBlockRows;
    const int rbytes = static_cast<int>(a.d.row_bytes);
    uint8_t *wst = reinterpret_cast<uint8_t *>(dyn_smem) + p.xs_bytes;
    {
        const int chunks = min(kBlockRows, static_cast<int>(a.d.rows) - r0) * (rbytes / 16);  // per slot
        for (int s = 0; s < n_slot; ++s) {
            const int e = a.ids ? a.ids[s] : 0;
            if (e < 0 || e >= a.d.n_expert) continue;  // block-uniform
            const uint8_t *src = row_ptr(a.d, e, r0);
            uint8_t *dst = wst + static_cast<size_t>(s) * kBlockRows * rbytes;
            for (int q = static_cast<int>(threadIdx.x); q < chunks; q += static_cast<int>(blockDim.x))
                cp_async16(dst + 16 * q, src + 16 * q);
        }
        cp_async_commit();
    }
    ds4q::q8_blk *xs = reinterpret_cast<ds4q::q8_blk *>(dyn_smem);
    down_stage_h(a, xs);
    cp_async_wait<0>();
    __syncthreads();  // staged rows (every thread's copies) and h visible
    const int wr = kDownRows * warp, rb = r0 + wr;
    down_rows_q8<TR, TS>(a, xs, rb, lane, grid, [=](int s, int, int i) {
        const uint8_t *base = wst + static_cast<size_t>(s * kBlockRows + wr) * rbytes;
        return base + i * rbytes;
    });
}

// ---- multi-row MoE (launch_moe_ffn_rows) -----------------------------------------------------------
// n rows (the tokens of a multi-row decode step) through one chain of launches, row r's h and y
// bit-identical to launch_moe_ffn on row r alone: every row's activations are quantised exactly as the
// decode kernels stage them (stage_q8, one row per block, into global memory), and every dot runs the
// direct q8 kernels' per-row arithmetic (gate_up_rows_q8 / down_rows_q8: same units per lane in the
// same order, same warp_sum), which the staged decode kernels equal bit for bit. What the rows share:
// the shared expert's gate/up rows are loaded once per task for up to kTokChunk rows (registers), and
// the tasks and blocks that read the same weights for different rows run side by side, so repeated
// rows (the shared expert's down, experts chosen by several rows) come from L2, not HBM.
// Layouts: xq [n, units_D] q8 blocks; h [n, k + 1, F] (row r's routed slots, then its shared expert);
// hq [n, k + 1, units_F] q8 blocks; ids / wts [n, k].
constexpr int kTokChunk = 4;  // rows per shared-expert gate/up task

struct rows_args {
    bank_dev g, up, gs, us, d, ds;  // routed gate/up/down, shared (data null: none)
    const int32_t *ids;
    const float *wts;
    int n, k;
    const ds4q::q8_blk *xq;
    float *h;
    const ds4q::q8_blk *hq;
    float *y;
    int64_t y_stride;
    float clamp, clamp_sh;
    uint32_t *err;
};

// Rows of `units` * 32 floats (row j at src + j * stride, 16-byte aligned) -> dst [rows, units] q8
// blocks, one row per block: stage_q8's arithmetic, so the same bits as every decode kernel's staging.
// Rows j with j % group >= used are skipped (h rows of a shared expert the layer does not have).
__global__ void __launch_bounds__(256) quantize_rows_q8_kernel(const float *src, int64_t stride, int units, int group,
                                                               int used, ds4q::q8_blk *dst) {
    const int64_t j = blockIdx.x;
    if (j % group >= used) return;
    stage_q8(src + j * stride, [](int) { return int64_t{0}; }, 1, units, dst + j * units);
}

// gate_up_rows_q8 for R weight rows and np <= P activation rows at once: a round's unit loads serve
// every activation row. Per (activation row, weight row) the lane sums run over the same units in the
// same order as gate_up_rows_q8's, so each equals that function's result for that x bit for bit.
template <dtype T, int R, int P>
__device__ __forceinline__ void gate_up_rows_q8_tok(const uint8_t *const (&rg)[R], const uint8_t *const (&ru)[R],
                                                    int units, int lane, const ds4q::q8_blk *const (&xs)[P], int np,
                                                    const uint64_t *grid, float (&ag)[P][R], float (&au)[P][R]) {
    constexpr int N = q8_units_in_flight<T, R>();
    for (int u0 = lane; u0 < units; u0 += 32 * N) {
        ds4q::unit_dot<T> g[R][N], v[R][N];
#pragma unroll
        for (int c = 0; c < N; ++c) {
            const int u = u0 + 32 * c;
#pragma unroll
            for (int r = 0; r < R; ++r)
                if (u < units && rg[r]) {
                    g[r][c].load(rg[r], u);
                    v[r][c].load(ru[r], u);
                }
        }
#pragma unroll
        for (int c = 0; c < N; ++c) {
            const int u = u0 + 32 * c;
            if (u >= units) continue;
#pragma unroll
            for (int p = 0; p < P; ++p) {
                if (p >= np) break;  // warp-uniform
                ds4q::x_q8<T> x;
                x.load(xs[p], u);
#pragma unroll
                for (int r = 0; r < R; ++r)
                    if (rg[r]) {
                        ag[p][r] += ds4q::dot_q8x<T>(g[r][c], x, grid);
                        au[p][r] += ds4q::dot_q8x<T>(v[r][c], x, grid);
                    }
            }
        }
    }
}

// Warp tasks: first the shared expert's (row f, chunk of kTokChunk activation rows; the chunks of one
// weight row are consecutive tasks), then the routed ones, row-major: (row r, slot s, pair p) as the
// decode kernel's (slot, pair) for row r. Grid-stride over the tasks.
template <dtype TR, dtype TS>
__global__ void __launch_bounds__(32 * kWarps, 2) moe_gate_up_rows_kernel(rows_args a) {
    constexpr bool need_grid = TR == dtype::iq2_xxs || TS == dtype::iq2_xxs;
    __shared__ uint64_t sgrid[need_grid ? 256 : 1];
    const uint64_t *grid = stage_grid<need_grid>(sgrid);
    __syncthreads();
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int F = static_cast<int>(a.g.rows), units = static_cast<int>(a.g.units), k = a.k;
    const int nc = (a.n + kTokChunk - 1) / kTokChunk, n_sh = a.gs.data ? F * nc : 0, pairs = gu_q8_pairs(F);
    const int total = n_sh + a.n * k * pairs, stride = static_cast<int>(gridDim.x) * kWarps;
    for (int t = static_cast<int>(blockIdx.x) * kWarps + warp; t < total; t += stride) {
        if (t < n_sh) {
            const int f = t / nc, c0 = (t - f * nc) * kTokChunk, np = min(kTokChunk, a.n - c0);
            const uint8_t *const g1[1] = {row_ptr(a.gs, 0, f)}, *const u1[1] = {row_ptr(a.us, 0, f)};
            const ds4q::q8_blk *xs[kTokChunk];
#pragma unroll
            for (int p = 0; p < kTokChunk; ++p) xs[p] = a.xq + static_cast<int64_t>(min(c0 + p, a.n - 1)) * units;
            float ag[kTokChunk][1], au[kTokChunk][1];
#pragma unroll
            for (int p = 0; p < kTokChunk; ++p) ag[p][0] = au[p][0] = 0.0f;
            gate_up_rows_q8_tok<TS, 1, kTokChunk>(g1, u1, units, lane, xs, np, grid, ag, au);
#pragma unroll
            for (int p = 0; p < kTokChunk; ++p) {
                if (p >= np) break;  // warp-uniform
                const float g = warp_sum(ag[p][0]), v = warp_sum(au[p][0]);
                if (lane == 0) a.h[(static_cast<int64_t>(c0 + p) * (k + 1) + k) * F + f] = swiglu_clamped(g, v, a.clamp_sh);
            }
            continue;
        }
        const int tr = t - n_sh, r = tr / (k * pairs), rem = tr - r * k * pairs, s = rem / pairs;
        const int r0 = kRoutedRows * (rem - s * pairs);
        const int e = a.ids[r * k + s];
        const int n = (e < 0 || e >= a.g.n_expert) ? 0 : min(kRoutedRows, F - r0);
        if (n == 0) {
            if (r0 == 0 && lane == 0) atomicOr(a.err, err_expert_id);
            continue;
        }
        const uint8_t *rg[kRoutedRows], *ru[kRoutedRows];
#pragma unroll
        for (int i = 0; i < kRoutedRows; ++i) {
            rg[i] = i < n ? row_ptr(a.g, e, r0 + i) : nullptr;
            ru[i] = i < n ? row_ptr(a.up, e, r0 + i) : nullptr;
        }
        float ag[kRoutedRows], au[kRoutedRows];
#pragma unroll
        for (int i = 0; i < kRoutedRows; ++i) ag[i] = au[i] = 0.0f;
        gate_up_rows_q8<TR, kRoutedRows>(rg, ru, units, lane, a.xq + static_cast<int64_t>(r) * units, grid, ag, au);
        const float wmul = a.wts[r * k + s];
        float *hrow = a.h + (static_cast<int64_t>(r) * (k + 1) + s) * F + r0;
#pragma unroll
        for (int i = 0; i < kRoutedRows; ++i) {
            if (i >= n) break;  // warp-uniform
            const float g = warp_sum(ag[i]), v = warp_sum(au[i]);
            if (lane == i) hrow[i] = swiglu_clamped(g, v, a.clamp) * wmul;
        }
    }
}

// Block b: output rows (b / n) * kWarps * kDownRows .. of activation row b % n (the rows of one output
// block are neighbours in launch order, so their shared-expert and common routed rows meet in L2), the
// decode kernels' per-warp arithmetic (down_rows_q8) on row r's q8 h rows.
template <dtype TR, dtype TS>
__global__ void __launch_bounds__(32 * kWarps, 2) moe_down_rows_kernel(rows_args a) {
    constexpr bool need_grid = TR == dtype::iq2_xxs || TS == dtype::iq2_xxs;
    __shared__ uint64_t sgrid[need_grid ? 256 : 1];
    const uint64_t *grid = stage_grid<need_grid>(sgrid);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int r = static_cast<int>(blockIdx.x % static_cast<unsigned>(a.n));
    const int blk = static_cast<int>(blockIdx.x / static_cast<unsigned>(a.n));
    down_args d{a.d, a.ds, a.ids + r * a.k, a.k, 0, a.k, nullptr, false, a.y + r * a.y_stride, a.err};
    if (blk == 0 && static_cast<int>(threadIdx.x) < a.k) {  // as the decode kernel's block 0
        const int e = d.ids[threadIdx.x];
        if (e < 0 || e >= a.d.n_expert) atomicOr(a.err, err_expert_id);
    }
    __syncthreads();  // the grid table
    const int rb = blk * (kWarps * kDownRows) + kDownRows * warp;
    const ds4q::q8_blk *xs = a.hq + static_cast<int64_t>(r) * (a.k + 1) * a.d.units;
    down_rows_q8<TR, TS>(d, xs, rb, lane, grid, [&](int, int e, int i) { return row_ptr(d.d, e, rb + i); });
}

// Staged forms of the two rows kernels (set_moe_staged != 0 and the weights 16-byte aligned), the decode
// chain's staged kernels with rows: gate/up walks the slabs of moe_gate_up_staged_kernel - the shared
// expert's slabs, each computed for every row from the one staged copy, then row-major (row, slot) routed
// slabs - with each row's q8 x read from global memory; down stages a block's rows of its row's experts
// as moe_down_staged_kernel does. Same per-row arithmetic (gu_compute, down_rows_q8), so the same bits.
struct gu_rows_staged_args {
    gate_up_args a;  // row 0's ids / wts / h, n_slot = k, s0 = 0
    gu_stage_cfg c;  // total = sh_slabs + n * k * per_slot
    int n;
    const ds4q::q8_blk *xq;
};
// Slab i and its row (-1: a shared slab, for every row). Routed slabs read ids.
__device__ __forceinline__ gu_slab gu_rows_slab_at(const gu_rows_staged_args &p, int i, int &tok) {
    const gate_up_args &a = p.a;
    const gu_stage_cfg &c = p.c;
    if (i < c.sh_slabs) {
        tok = -1;
        return gu_slab_at(a, c, i);
    }
    const int j = i - c.sh_slabs, per_tok = a.n_slot * c.per_slot;
    tok = j / per_tok;
    gate_up_args at = a;
    at.ids = a.ids + tok * a.n_slot;
    return gu_slab_at(at, c, c.sh_slabs + (j - tok * per_tok));
}

template <dtype TR, dtype TS>
__global__ void __launch_bounds__(32 * kWarps, 2) moe_gate_up_rows_staged_kernel(gu_rows_staged_args p) {
    constexpr bool need_grid = TR == dtype::iq2_xxs || TS == dtype::iq2_xxs;
    extern __shared__ float4 dyn_smem[];
    __shared__ uint64_t sgrid[need_grid ? 256 : 1];
    __shared__ float red[kWarps];
    const gate_up_args &a = p.a;
    const gu_stage_cfg &c = p.c;
    const uint64_t *grid = stage_grid<need_grid>(sgrid);
    uint8_t *stages = reinterpret_cast<uint8_t *>(dyn_smem);
    const int G = static_cast<int>(gridDim.x), b = static_cast<int>(blockIdx.x);
    const int units = static_cast<int>(a.g.units), k = a.n_slot;
    const int64_t F = a.g.rows;
    auto issue = [&](int i, int st) {
        if (i >= c.total) return;
        int tok;
        gu_issue(a, c, gu_rows_slab_at(p, i, tok), stages + static_cast<size_t>(st) * c.stage_bytes);
    };
    for (int q = 0; q < c.stages - 1; ++q) {
        issue(b + q * G, q);
        cp_async_commit();
    }
    for (int it = 0;; ++it) {
        const int i = b + it * G;
        if (i >= c.total) break;
        if (c.stages == 3) cp_async_wait<1>();
        else cp_async_wait<0>();
        __syncthreads();  // slab i visible (and the grid table); the stage computed last iteration is free
        issue(i + (c.stages - 1) * G, (it + c.stages - 1) % c.stages);
        int tok;
        const gu_slab sl = gu_rows_slab_at(p, i, tok);
        const uint8_t *stage = stages + static_cast<size_t>(it % c.stages) * c.stage_bytes;
        gate_up_args at = a;
        if (tok >= 0) {
            at.ids = a.ids + tok * k;
            at.wts = a.wts + tok * k;
            at.h = a.h + tok * (k + 1) * F;
            gu_compute<TR, TS>(at, c, sl, stage, p.xq + static_cast<int64_t>(tok) * units, grid, red);
        } else {
            for (int r = 0; r < p.n; ++r) {  // block-uniform: gu_compute's shared branch syncs
                at.h = a.h + r * (k + 1) * F;
                gu_compute<TR, TS>(at, c, sl, stage, p.xq + static_cast<int64_t>(r) * units, grid, red);
                __syncthreads();  // every thread's reads of red done before the next row writes it
            }
        }
        cp_async_commit();
    }
    cp_async_wait<0>();
}

template <dtype TR, dtype TS>
__global__ void __launch_bounds__(32 * kWarps, 2) moe_down_rows_staged_kernel(rows_args a) {
    constexpr bool need_grid = TR == dtype::iq2_xxs || TS == dtype::iq2_xxs;
    constexpr int kBlockRows = kWarps * kDownRows;
    extern __shared__ float4 dyn_smem[];
    __shared__ uint64_t sgrid[need_grid ? 256 : 1];
    const uint64_t *grid = stage_grid<need_grid>(sgrid);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int r = static_cast<int>(blockIdx.x % static_cast<unsigned>(a.n));
    const int blk = static_cast<int>(blockIdx.x / static_cast<unsigned>(a.n));
    down_args d{a.d, a.ds, a.ids + r * a.k, a.k, 0, a.k, nullptr, false, a.y + r * a.y_stride, a.err};
    const int r0 = blk * kBlockRows, rbytes = static_cast<int>(a.d.row_bytes);
    uint8_t *wst = reinterpret_cast<uint8_t *>(dyn_smem);
    {
        const int chunks = min(kBlockRows, static_cast<int>(a.d.rows) - r0) * (rbytes / 16);  // per slot
        for (int s = 0; s < a.k; ++s) {
            const int e = d.ids[s];
            if (e < 0 || e >= a.d.n_expert) continue;  // block-uniform
            const uint8_t *src = row_ptr(a.d, e, r0);
            uint8_t *dst = wst + static_cast<size_t>(s) * kBlockRows * rbytes;
            for (int q = static_cast<int>(threadIdx.x); q < chunks; q += static_cast<int>(blockDim.x))
                cp_async16(dst + 16 * q, src + 16 * q);
        }
        cp_async_commit();
    }
    if (blk == 0 && static_cast<int>(threadIdx.x) < a.k) {  // as the decode kernel's block 0
        const int e = d.ids[threadIdx.x];
        if (e < 0 || e >= a.d.n_expert) atomicOr(a.err, err_expert_id);
    }
    cp_async_wait<0>();
    __syncthreads();  // staged rows and the grid table visible
    const int wr = kDownRows * warp, rb = r0 + wr;
    const ds4q::q8_blk *xs = a.hq + static_cast<int64_t>(r) * (a.k + 1) * a.d.units;
    down_rows_q8<TR, TS>(d, xs, rb, lane, grid, [=](int s, int, int i) {
        return wst + static_cast<size_t>(s * kBlockRows + wr) * rbytes + static_cast<size_t>(i) * rbytes;
    });
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

// Shared memory for one staged activation row of `cols` columns (q8: 40 bytes per 32 columns, f32:
// 36 floats per 32).
size_t staged_bytes(int64_t cols, bool q8) {
    if (cols > kMaxCols)
        throw error("cuda ds4 moe: " + std::to_string(cols) + " columns exceed the staged-activation limit of " +
                    std::to_string(kMaxCols));
    return staged_row_bytes((cols + 31) / 32, q8);
}

struct device_info {
    int id = 0, sms = 0;
    size_t smem_optin = 0;  // dynamic shared memory one block may opt in to
};
device_info current_device() {
    const device_caps *caps = current_device_caps();  // queried once per device
    if (!caps || caps->sm_count < 1) throw error("cuda ds4 moe: cannot query the device");
    return {caps->ordinal, caps->sm_count, static_cast<size_t>(caps->smem_optin)};
}

void check_launch(const char *what) {
    const cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) throw error(std::string("cuda ds4 ") + what + ": launch failed: " + cudaGetErrorString(e));
}

// kernel<<<grid, 32 * kWarps, smem, s>>>(args), with programmatic stream serialisation when pdl (the
// kernel may start while the previous kernel of the stream is finishing; it waits in pdl_wait()).
template <class Args>
void launch_kernel(void (*kernel)(Args), unsigned grid, size_t smem, bool pdl, cudaStream_t s, const Args &args,
                   const char *what) {
    const cudaError_t e = launch_pdl(kernel, dim3(grid), dim3(32 * kWarps), smem, s, pdl, args);
    if (e != cudaSuccess) throw error(std::string("cuda ds4 ") + what + ": launch failed: " + cudaGetErrorString(e));
}

struct nothing_fn {
    template <dtype T> void operator()() const {}
};

// f.template operator()<TR, TS>() for a routed type TR and a shared-expert type TS that one kernel
// handles (TS == TR, or TS == q8_0 as in the q2 mix); false otherwise (the caller launches twice).
template <class Fn>
bool dispatch_pair(dtype tr, dtype ts, Fn &&f) {
    bool ok = false;
    ds4q::dispatch_expert_type(tr, [&]<dtype TR>() {
        if (ts == TR) {
            f.template operator()<TR, TR>();
            ok = true;
        } else if (ts == dtype::q8_0) {
            f.template operator()<TR, dtype::q8_0>();
            ok = true;
        }
    });
    return ok;
}

// Process-wide mode of the q8 gate/up (set_moe_staged): 0 direct kernel, 1 staged (depth chosen
// here, the default), 2 / 3 staged with that depth (tests and benchmarks switch it).
// Staged launches made (moe_staged_launches: tests check the staged path really ran).
std::atomic<uint64_t> g_staged_launches{0};

std::atomic<int> &staged_flag() {
    static std::atomic<int> f{1};
    return f;
}

// The staged q8 gate/up launch (moe_gate_up_staged_kernel) when it applies: weight bases, row and
// expert strides 16-byte multiples (cp.async 16) and at least one block of >= 2 stages resident.
// Depth: 3 stages when 2 blocks per SM still fit, else 2. Grid sized as run_gate_up's (equal rounds
// of slabs per block). false: the caller launches the direct kernel.
template <dtype TR, dtype TS>
bool try_gate_up_staged(const gate_up_args &a, bool pdl, cudaStream_t s) {
    const bool sh = a.gs.data != nullptr;
    auto al16 = [](const bank_dev &b, bool stack) {
        return reinterpret_cast<uintptr_t>(b.data) % 16 == 0 && b.row_bytes % 16 == 0 &&
               (!stack || b.expert_bytes % 16 == 0);
    };
    if (!al16(a.g, true) || !al16(a.up, true) || (sh && (!al16(a.gs, false) || !al16(a.us, false)))) return false;
    const int64_t F = a.g.rows;
    const size_t rb_r = a.g.row_bytes, rb_s = sh ? a.gs.row_bytes : 16;
    gu_stage_cfg c{};
    c.rows_r = static_cast<int>(std::clamp<size_t>(kGuHalfBytes / rb_r & ~size_t{1}, 2, kGuRoutedRows));
    c.rows_s = static_cast<int>(std::clamp<size_t>(kGuHalfBytes / rb_s, 1, kGuSharedRows));
    const int64_t per_slot = (F + c.rows_r - 1) / c.rows_r, sh_slabs = sh ? (F + c.rows_s - 1) / c.rows_s : 0;
    const int64_t total = sh_slabs + per_slot * a.n_slot;
    const size_t half = std::max(c.rows_r * rb_r, sh ? c.rows_s * rb_s : 0);
    const size_t stage_bytes = 2 * half + 16, xs_bytes = (staged_row_bytes(a.g.units, true) + 15) / 16 * 16;
    if (total >= (int64_t{1} << 31) || stage_bytes >= (size_t{1} << 30)) return false;
    c.per_slot = static_cast<int>(per_slot);
    c.sh_slabs = static_cast<int>(sh_slabs);
    c.total = static_cast<int>(total);
    c.half = static_cast<int>(half);
    c.stage_bytes = static_cast<int>(stage_bytes);
    c.xs_bytes = static_cast<int>(xs_bytes);
    void (*kernel)(gu_staged_args) = moe_gate_up_staged_kernel<TR, TS>;
    const device_info di = current_device();
    // dynamic shared memory the kernel may take: the opt-in limit less its static grid table (2 KB)
    const size_t limit = smem_dynamic_limit<moe_gate_up_staged_kernel<TR, TS>>();
    if (limit == 0) return false;
    int best_stages = 0, best_per_sm = 0;
    const int forced = staged_flag().load();  // 2 / 3: that depth only
    for (int st : {3, 2}) {
        if (forced >= 2 && st != forced) continue;
        const size_t smem = xs_bytes + static_cast<size_t>(st) * stage_bytes;
        int per_sm = 0;
        if (smem > limit ||
            cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, 32 * kWarps, smem) != cudaSuccess) {
            (void)cudaGetLastError();
            continue;
        }
        if (per_sm > best_per_sm) {  // 3 stages unless 2 stages fit more blocks
            best_per_sm = per_sm;
            best_stages = st;
        }
    }
    if (best_per_sm < 1) return false;
    c.stages = best_stages;
    const size_t smem = xs_bytes + static_cast<size_t>(c.stages) * stage_bytes;
    const int64_t resident = static_cast<int64_t>(best_per_sm) * di.sms;
    const int64_t rounds = (total + resident - 1) / resident;
    const unsigned grid = static_cast<unsigned>((total + rounds - 1) / rounds);
    launch_kernel(kernel, grid, smem, pdl, s, gu_staged_args{a, c}, "moe gate/up (staged)");
    g_staged_launches.fetch_add(1);
    return true;
}


// Grid of the gate/up kernels: at most the resident blocks, and sized so every warp gets the same
// number of grid-stride tasks (rounds = ceil(tasks / resident warps); the last round is not left
// half empty).
// pdl: only for the q8 kernel right after the route kernel (launch_moe_ffn; see the kernel).
// q8: use_q8_rt of the pair, read once by the caller, which sized smem with it.
template <dtype TR, dtype TS>
void run_gate_up(const gate_up_args &a, bool q8, size_t smem, bool pdl, cudaStream_t s) {
    if constexpr (use_q8<TR, TS>())
        if (q8 && staged_flag().load() != 0 && try_gate_up_staged<TR, TS>(a, pdl, s)) return;
    void (*kernel)(gate_up_args) = moe_gate_up_f32_kernel<TR, TS>;
    int64_t tasks = static_cast<int64_t>(a.n_slot + (a.gs.data ? 1 : 0)) * a.g.rows;
    if constexpr (use_q8<TR, TS>())
        if (q8) {
            kernel = moe_gate_up_q8_kernel<TR, TS>;
            tasks = (a.gs.data ? a.g.rows : 0) + static_cast<int64_t>(a.n_slot) * gu_q8_pairs(a.g.rows);
        }
    if (tasks >= (int64_t{1} << 31)) throw error("cuda ds4 moe: too many gate/up rows for one launch");
    const device_info di = current_device();
    int per_sm = 0;
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, 32 * kWarps, smem) != cudaSuccess ||
        per_sm < 1)
        per_sm = 1;
    const int64_t resident_warps = static_cast<int64_t>(per_sm) * di.sms * kWarps;
    const int64_t rounds = (tasks + resident_warps - 1) / resident_warps;
    const unsigned grid = static_cast<unsigned>((tasks + kWarps * rounds - 1) / (kWarps * rounds));
    launch_kernel(kernel, grid, smem, q8 && pdl, s, a, "moe gate/up");
}

// gate/up of n_slot routed experts (h rows s0 ..) and, with gs/us, the shared expert (h row
// s0 + n_slot, clamp_sh, no routing weight). pdl: the previous launch in the stream is the route
// kernel (launch_moe_ffn), whose only outputs are ids and w.
void gate_up_launch(const expert_bank &gate, const expert_bank &up, const expert_bank *gs, const expert_bank *us,
                    const int32_t *ids, const float *w, int n_slot, int s0, const float *x, float clamp,
                    float clamp_sh, float *h, uint32_t *err, bool pdl, cudaStream_t s) {
    check_bank(gate, "moe gate");
    check_bank(up, "moe up");
    if (gate.type != up.type || gate.rows != up.rows || gate.cols != up.cols || gate.n_expert != up.n_expert)
        throw error("cuda ds4 moe: gate and up banks differ in type or shape");
    if (n_slot < 1 || n_slot > 65535 || s0 < 0) throw error("cuda ds4 moe: bad slot count " + std::to_string(n_slot));
    if (reinterpret_cast<uintptr_t>(x) % 16 != 0) throw error("cuda ds4 moe: x must be 16-byte aligned");
    if (gs) {
        check_bank(*gs, "moe shared gate");
        check_bank(*us, "moe shared up");
        if (gs->type != us->type || gs->rows != gate.rows || gs->cols != gate.cols || us->rows != gate.rows ||
            us->cols != gate.cols)
            throw error("cuda ds4 moe: shared gate/up differ from the routed shape or from each other");
    }
    const bool q8 = use_q8_rt(gate.type, gs ? gs->type : gate.type);
    const size_t smem = staged_bytes(gate.cols, q8);
    gate_up_args a{to_dev(gate), to_dev(up), gs ? to_dev(*gs) : bank_dev{}, gs ? to_dev(*us) : bank_dev{}, ids, w,
                   n_slot, s0, x, clamp, clamp_sh, h, err};
    const bool fused = dispatch_pair(gate.type, gs ? gs->type : gate.type,
                                     [&]<dtype TR, dtype TS>() { run_gate_up<TR, TS>(a, q8, smem, pdl, s); });
    if (!fused) {  // shared expert of another type: two launches
        gate_up_launch(gate, up, nullptr, nullptr, ids, w, n_slot, s0, x, clamp, clamp, h, err, false, s);
        gate_up_launch(*gs, *us, nullptr, nullptr, nullptr, nullptr, 1, s0 + n_slot, x, clamp_sh, clamp_sh, h, err,
                       false, s);
    }
}

// The staged q8 down launch (moe_down_staged_kernel) when it applies: routed weight base and strides
// 16-byte multiples and the block's routed rows fitting next to the staged h rows (smem_h bytes).
// false: the caller launches the direct kernel.
template <dtype TR, dtype TS>
bool try_down_staged(const down_args &a, size_t smem_h, bool pdl, cudaStream_t s) {
    if (reinterpret_cast<uintptr_t>(a.d.data) % 16 != 0 || a.d.row_bytes % 16 != 0 || a.d.expert_bytes % 16 != 0 ||
        a.d.rows >= (int64_t{1} << 30) || a.d.cols >= (int64_t{1} << 30))
        return false;
    const size_t xs_bytes = (smem_h + 15) / 16 * 16;
    const size_t smem = xs_bytes + static_cast<size_t>(a.n_slot) * kWarps * kDownRows * a.d.row_bytes + 16;
    constexpr void (*kernel)(down_staged_args) = moe_down_staged_kernel<TR, TS>;
    if (!smem_opt_in<kernel>(smem)) return false;  // the opt-in limit less the static grid table
    const int64_t per_block = kWarps * kDownRows;
    const unsigned grid = static_cast<unsigned>((a.d.rows + per_block - 1) / per_block);
    launch_kernel(kernel, grid, smem, pdl, s, down_staged_args{a, static_cast<int>(xs_bytes)}, "moe down (staged)");
    g_staged_launches.fetch_add(1);
    return true;
}

// The direct down kernel for the type pair: q8 activations or f32.
template <dtype TR, dtype TS>
constexpr void (*down_kernel())(down_args) {
    if constexpr (use_q8<TR, TS>()) return moe_down_q8_kernel<TR, TS>;
    else return moe_down_f32_kernel<TR, TS>;
}

// q8: use_q8_rt of the pair, read once by the caller, which sized smem with it.
template <dtype TR, dtype TS>
void run_down(const down_args &a, bool q8, size_t smem, bool pdl, cudaStream_t s) {
    if constexpr (use_q8<TR, TS>())
        if (q8 && staged_flag().load() != 0 && try_down_staged<TR, TS>(a, smem, pdl, s)) return;
    constexpr void (*kq8)(down_args) = down_kernel<TR, TS>();
    constexpr void (*kf32)(down_args) = moe_down_f32_kernel<TR, TS>;
    void (*kernel)(down_args) = q8 ? kq8 : kf32;
    if (!(q8 ? smem_opt_in<kq8>(smem) : smem_opt_in<kf32>(smem)))
        throw error("cuda ds4 moe: the down kernel's " + std::to_string(smem) +
                    " bytes of shared memory exceed the device's limit");
    const int64_t per_block = kWarps * kDownRows;
    if (a.d.rows >= (int64_t{1} << 30) || a.d.cols >= (int64_t{1} << 30))
        throw error("cuda ds4 moe: down matrix too large for 32-bit row indices");
    const unsigned grid = static_cast<unsigned>((a.d.rows + per_block - 1) / per_block);
    launch_kernel(kernel, grid, smem, pdl, s, a, "moe down");
}

// y = (accumulate ? y : 0) + sum of the n_slot routed experts' down rows (h rows s0 ..) and, with
// dsh, the shared expert's (h row s_sh). Slots whose staged h rows do not fit in shared memory
// together go to further launches that accumulate. pdl: launched with programmatic serialisation
// (the kernel only prefetches before pdl_wait, so any predecessor is safe).
void down_launch(const expert_bank &down, const expert_bank *dsh, const int32_t *ids, int n_slot, int s0, int s_sh,
                 const float *h, bool accumulate, float *y, uint32_t *err, bool pdl, cudaStream_t s) {
    check_bank(down, "moe down");
    if (n_slot < 1 || s0 < 0 || s_sh < 0) throw error("cuda ds4 moe: bad slot count " + std::to_string(n_slot));
    if (reinterpret_cast<uintptr_t>(h) % 16 != 0) throw error("cuda ds4 moe: h must be 16-byte aligned");
    if (dsh) {
        check_bank(*dsh, "moe shared down");
        if (dsh->rows != down.rows || dsh->cols != down.cols)
            throw error("cuda ds4 moe: shared down differs from the routed shape");
    }
    const device_info di = current_device();
    // staged bytes per h row of a launch pairing the routed type with `ts` (q8: the activation form)
    const bool q8_sh = dsh && use_q8_rt(down.type, dsh->type), q8_alone = use_q8_rt(down.type, down.type);
    auto per_row = [&](bool q8) { return staged_bytes(down.cols, q8); };
    bool with_sh = dsh != nullptr && dispatch_pair(down.type, dsh->type, [&]<dtype, dtype>() {}) &&
                   di.smem_optin / per_row(q8_sh) >= 2;
    if (dsh && !with_sh) {
        // shared expert alone first (as routed expert 0 of a one-expert bank), then accumulate
        down_launch(*dsh, nullptr, nullptr, 1, s_sh, 0, h, accumulate, y, err, pdl, s);
        accumulate = true;
    }
    for (int first = 0; first < n_slot;) {
        const dtype ts = with_sh ? dsh->type : down.type;
        const bool q8 = with_sh ? q8_sh : q8_alone;
        const size_t row_bytes = per_row(q8);
        const int max_rows = static_cast<int>(std::max<size_t>(1, di.smem_optin / row_bytes));
        const int n = std::min(n_slot - first, max_rows - (with_sh ? 1 : 0));
        down_args a{to_dev(down), with_sh ? to_dev(*dsh) : bank_dev{}, ids ? ids + first : nullptr, n, s0 + first,
                    s_sh, h, accumulate, y, err};
        const size_t smem = row_bytes * static_cast<size_t>(n + (with_sh ? 1 : 0));
        dispatch_pair(down.type, ts, [&]<dtype TR, dtype TS>() { run_down<TR, TS>(a, q8, smem, pdl, s); });
        accumulate = true;
        with_sh = false;
        first += n;
    }
}

// The staged rows gate/up launch (moe_gate_up_rows_staged_kernel) when the staged mode is on and the
// weights allow it (as try_gate_up_staged: 16-byte aligned bases and strides, >= 2 stages resident); the
// same slab sizes and depth choice. false: the caller launches the direct rows kernel.
template <dtype TR, dtype TS>
bool try_gate_up_rows_staged(const gate_up_args &a, int n, const ds4q::q8_blk *xq, cudaStream_t s) {
    if (staged_flag().load() == 0) return false;
    const bool sh = a.gs.data != nullptr;
    auto al16 = [](const bank_dev &b, bool stack) {
        return reinterpret_cast<uintptr_t>(b.data) % 16 == 0 && b.row_bytes % 16 == 0 &&
               (!stack || b.expert_bytes % 16 == 0);
    };
    if (!al16(a.g, true) || !al16(a.up, true) || (sh && (!al16(a.gs, false) || !al16(a.us, false)))) return false;
    const int64_t F = a.g.rows;
    const size_t rb_r = a.g.row_bytes, rb_s = sh ? a.gs.row_bytes : 16;
    gu_stage_cfg c{};
    c.rows_r = static_cast<int>(std::clamp<size_t>(kGuHalfBytes / rb_r & ~size_t{1}, 2, kGuRoutedRows));
    c.rows_s = static_cast<int>(std::clamp<size_t>(kGuHalfBytes / rb_s, 1, kGuSharedRows));
    const int64_t per_slot = (F + c.rows_r - 1) / c.rows_r, sh_slabs = sh ? (F + c.rows_s - 1) / c.rows_s : 0;
    const int64_t total = sh_slabs + per_slot * a.n_slot * n;
    const size_t half = std::max(c.rows_r * rb_r, sh ? c.rows_s * rb_s : 0);
    const size_t stage_bytes = 2 * half + 16;
    if (total >= (int64_t{1} << 31) || stage_bytes >= (size_t{1} << 30)) return false;
    c.per_slot = static_cast<int>(per_slot);
    c.sh_slabs = static_cast<int>(sh_slabs);
    c.total = static_cast<int>(total);
    c.half = static_cast<int>(half);
    c.stage_bytes = static_cast<int>(stage_bytes);
    c.xs_bytes = 0;
    void (*kernel)(gu_rows_staged_args) = moe_gate_up_rows_staged_kernel<TR, TS>;
    const size_t limit = smem_dynamic_limit<moe_gate_up_rows_staged_kernel<TR, TS>>();
    if (limit == 0) return false;
    int best_stages = 0, best_per_sm = 0;
    for (int st : {3, 2}) {
        const size_t smem = static_cast<size_t>(st) * stage_bytes;
        int per_sm = 0;
        if (smem > limit ||
            cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, 32 * kWarps, smem) != cudaSuccess) {
            (void)cudaGetLastError();
            continue;
        }
        if (per_sm > best_per_sm) {
            best_per_sm = per_sm;
            best_stages = st;
        }
    }
    if (best_per_sm < 1) return false;
    c.stages = best_stages;
    const size_t smem = static_cast<size_t>(c.stages) * stage_bytes;
    const int64_t resident = static_cast<int64_t>(best_per_sm) * current_device().sms;
    const int64_t rounds = (total + resident - 1) / resident;
    const unsigned grid = static_cast<unsigned>((total + rounds - 1) / rounds);
    kernel<<<grid, 32 * kWarps, smem, s>>>(gu_rows_staged_args{a, c, n, xq});
    check_launch("moe rows gate/up (staged)");
    g_staged_launches.fetch_add(1);
    return true;
}

// The staged rows down launch (moe_down_rows_staged_kernel) when the staged mode is on and the routed
// weights allow it (as try_down_staged). false: the caller launches the direct rows kernel.
template <dtype TR, dtype TS>
bool try_down_rows_staged(const rows_args &a, cudaStream_t s) {
    if (staged_flag().load() == 0) return false;
    if (reinterpret_cast<uintptr_t>(a.d.data) % 16 != 0 || a.d.row_bytes % 16 != 0 || a.d.expert_bytes % 16 != 0 ||
        a.d.rows >= (int64_t{1} << 30))
        return false;
    const size_t smem = static_cast<size_t>(a.k) * kWarps * kDownRows * a.d.row_bytes + 16;
    constexpr void (*kernel)(rows_args) = moe_down_rows_staged_kernel<TR, TS>;
    if (!smem_opt_in<kernel>(smem)) return false;
    const int64_t blocks = (a.d.rows + kWarps * kDownRows - 1) / (kWarps * kDownRows) * a.n;
    kernel<<<static_cast<unsigned>(blocks), 32 * kWarps, smem, s>>>(a);
    check_launch("moe rows down (staged)");
    g_staged_launches.fetch_add(1);
    return true;
}

}  // namespace

bool expert_type_supported(dtype t) {
    return ds4q::dispatch_expert_type(t, nothing_fn{});
}

void set_moe_q8_activations(bool on) {
    q8_flag().store(on);
}

void set_moe_staged(int mode) {
    if (mode < 0 || mode > 3) throw error("cuda ds4 moe: staged mode must be 0..3, not " + std::to_string(mode));
    staged_flag().store(mode);
}
int moe_staged() {
    return staged_flag().load();
}
uint64_t moe_staged_launches() {
    return g_staged_launches.load();
}

int expert_alignment(dtype t) {
    int a = 0;
    ds4q::dispatch_expert_type(t, [&]<dtype T>() { a = ds4q::unit_traits<T>::align; });
    return a;
}

void launch_moe_gate_up(const expert_bank &gate, const expert_bank &up, const int32_t *ids, const float *w,
                        int n_slot, int s0, const float *x, float clamp, float *h, uint32_t *err, cudaStream_t s) {
    gate_up_launch(gate, up, nullptr, nullptr, ids, w, n_slot, s0, x, clamp, clamp, h, err, false, s);
}

void launch_moe_down(const expert_bank &down, const int32_t *ids, int n_slot, int s0, const float *h,
                     bool accumulate, float *y, uint32_t *err, cudaStream_t s) {
    down_launch(down, nullptr, ids, n_slot, s0, 0, h, accumulate, y, err, false, s);
}

const uint64_t *iq2xxs_grid_device() {
    void *p = nullptr;
    if (cudaGetSymbolAddress(&p, k_iq2xxs_grid) != cudaSuccess || !p)
        throw error("cuda ds4: cannot find the device IQ2_XXS grid");
    return static_cast<const uint64_t *>(p);
}

void launch_moe_ffn(const moe_layer &l, const float *xn, const int32_t *token, const moe_scratch &sc, float *y,
                    uint32_t *err, cudaStream_t s) {
    const int64_t D = l.gate.cols, F = l.gate.rows;
    if (l.down.rows != D || l.down.cols != F || l.gate.n_expert != l.n_expert || l.down.n_expert != l.n_expert)
        throw error("cuda ds4 moe: routed banks do not form [F, D] / [D, F] stacks of n_expert");
    const bool shared = l.gate_sh.data != nullptr;
    if (shared && (l.gate_sh.cols != D || l.gate_sh.rows != F || l.down_sh.rows != D || l.down_sh.cols != F))
        throw error("cuda ds4 moe: shared expert shape differs from the routed experts");
    // Router logits: the fast GEMV (PDL: its weights stream while the previous kernel finishes) when
    // it takes the type, else the generic one.
    if (gemv_fast_supported(l.gate_inp_type, D) && l.gate_inp_row_bytes % 16 == 0 &&
        reinterpret_cast<uintptr_t>(l.gate_inp) % 16 == 0 && reinterpret_cast<uintptr_t>(xn) % 16 == 0 &&
        (l.gate_inp_type == dtype::f16 || l.gate_inp_type == dtype::f32)) {
        // f16 / f32 rows are used in place: gemv_prepare only describes them (no launch)
        launch_gemv_fast(gemv_prepare(l.gate_inp_type, l.gate_inp, l.gate_inp_row_bytes, l.n_expert, D, nullptr, s), xn,
                         sc.logits, s);
    } else {
        launch_gemv(l.gate_inp_type, l.gate_inp, l.gate_inp_row_bytes, D, l.n_expert, xn, D, 1, sc.logits, l.n_expert,
                    s);
    }
    // The route kernel is launched with PDL (its launch overlaps the router GEMV's tail; it reads the
    // logits after pdl_wait, when the GEMV, and so all earlier work, has completed) and lets the
    // gate/up kernel launch right after that wait (PDL): the shared expert's gate/up runs while
    // routing is in flight. Then the down kernel (PDL) prefetches its rows while gate/up finishes.
    moe_route_launch(sc.logits, l.n_expert, l.exp_bias, l.tid2eid, l.n_vocab, token, l.n_used, l.weights_scale, sc.ids,
                 sc.weights, err, true, s);
    // routed + shared gate/up in one launch, routed + shared down in one launch
    gate_up_launch(l.gate, l.up, shared ? &l.gate_sh : nullptr, shared ? &l.up_sh : nullptr, sc.ids, sc.weights,
                   l.n_used, 0, xn, l.clamp, l.clamp_sh, sc.h, err, true, s);
    down_launch(l.down, shared ? &l.down_sh : nullptr, sc.ids, l.n_used, 0, l.n_used, sc.h, false, y, err, true, s);
}

size_t moe_rows_q8_bytes(int64_t rows, int64_t cols) {
    return static_cast<size_t>(rows) * static_cast<size_t>((cols + 31) / 32) * sizeof(ds4q::q8_blk);
}

bool moe_rows_supported(const moe_layer &l) {
    const bool shared = l.gate_sh.data != nullptr;
    if (l.n_used < 1 || l.n_used > kMaxUsed || l.gate.type != l.up.type || (shared && l.gate_sh.type != l.up_sh.type))
        return false;
    const dtype ts = shared ? l.gate_sh.type : l.gate.type, tds = shared ? l.down_sh.type : l.down.type;
    if (!expert_type_supported(l.gate.type) || !expert_type_supported(ts) || !expert_type_supported(l.down.type) ||
        !expert_type_supported(tds) || !use_q8_rt(l.gate.type, ts) || !use_q8_rt(l.down.type, tds))
        return false;
    // one fused launch each in the decode chain (gate_up_launch / down_launch), so one sum order
    if (!dispatch_pair(l.gate.type, ts, [&]<dtype, dtype>() {}) || !dispatch_pair(l.down.type, tds, [&]<dtype, dtype>() {}))
        return false;
    if (l.gate.cols > kMaxCols || l.down.cols > kMaxCols) return false;
    return current_device().smem_optin / staged_bytes(l.down.cols, true) >= static_cast<size_t>(l.n_used + 1);
}

void launch_moe_ffn_rows(const moe_layer &l, int n, const float *xn, int64_t x_stride, const int32_t *tokens,
                         const moe_rows_scratch &sc, float *y, int64_t y_stride, uint32_t *err, cudaStream_t s) {
    const int64_t D = l.gate.cols, F = l.gate.rows;
    const int E = l.n_expert, k = l.n_used;
    if (n < 1 || n > gemv_max_rows) throw error("cuda ds4 moe rows: " + std::to_string(n) + " rows (1.." +
                                                std::to_string(gemv_max_rows) + ")");
    if (!moe_rows_supported(l)) throw error("cuda ds4 moe rows: the layer's expert types need the per-row chain");
    check_bank(l.gate, "moe gate");
    check_bank(l.up, "moe up");
    check_bank(l.down, "moe down");
    const bool shared = l.gate_sh.data != nullptr;
    if (l.down.rows != D || l.down.cols != F || l.up.rows != F || l.up.cols != D || l.gate.n_expert != E ||
        l.up.n_expert != E || l.down.n_expert != E)
        throw error("cuda ds4 moe rows: routed banks do not form [F, D] / [D, F] stacks of n_expert");
    if (shared) {
        check_bank(l.gate_sh, "moe shared gate");
        check_bank(l.up_sh, "moe shared up");
        check_bank(l.down_sh, "moe shared down");
        if (l.gate_sh.cols != D || l.gate_sh.rows != F || l.up_sh.cols != D || l.up_sh.rows != F || l.down_sh.rows != D ||
            l.down_sh.cols != F)
            throw error("cuda ds4 moe rows: shared expert shape differs from the routed experts");
    }
    if (reinterpret_cast<uintptr_t>(xn) % 16 != 0 || x_stride % 4 != 0 || x_stride < D || y_stride < D || F % 4 != 0)
        throw error("cuda ds4 moe rows: x rows must be 16-byte aligned, strides at least one row");
    if (!sc.logits || !sc.ids || !sc.weights || !sc.h || !sc.xq || !sc.hq) throw error("cuda ds4 moe rows: missing scratch");
    // router logits [n, E]: the decode chain's GEMV, row by row or in its columns form (same bits)
    if (gemv_fast_supported(l.gate_inp_type, D) && l.gate_inp_row_bytes % 16 == 0 &&
        reinterpret_cast<uintptr_t>(l.gate_inp) % 16 == 0 &&
        (l.gate_inp_type == dtype::f16 || l.gate_inp_type == dtype::f32)) {
        launch_gemv_rows(gemv_prepare(l.gate_inp_type, l.gate_inp, l.gate_inp_row_bytes, E, D, nullptr, s), n, xn, x_stride,
                         sc.logits, s);
    } else {
        for (int r = 0; r < n; ++r)
            launch_gemv(l.gate_inp_type, l.gate_inp, l.gate_inp_row_bytes, D, E, xn + r * x_stride, D, 1, sc.logits + r * E,
                        E, s);
    }
    moe_route_launch(sc.logits, E, l.exp_bias, l.tid2eid, l.n_vocab, tokens, k, l.weights_scale, sc.ids, sc.weights, err,
                 false, s, n);
    const int units_d = static_cast<int>((D + 31) / 32), units_f = static_cast<int>((F + 31) / 32);
    auto *xq = static_cast<ds4q::q8_blk *>(sc.xq);
    auto *hq = static_cast<ds4q::q8_blk *>(sc.hq);
    quantize_rows_q8_kernel<<<static_cast<unsigned>(n), 256, 0, s>>>(xn, x_stride, units_d, 1, 1, xq);
    check_launch("moe rows quantise");
    rows_args a{to_dev(l.gate), to_dev(l.up), shared ? to_dev(l.gate_sh) : bank_dev{}, shared ? to_dev(l.up_sh) : bank_dev{},
                to_dev(l.down), shared ? to_dev(l.down_sh) : bank_dev{}, sc.ids, sc.weights, n, k, xq, sc.h, hq, y, y_stride,
                l.clamp, l.clamp_sh, err};
    const int nc = (n + kTokChunk - 1) / kTokChunk;
    const int64_t tasks = (shared ? F * nc : 0) + static_cast<int64_t>(n) * k * gu_q8_pairs(F);
    if (tasks >= (int64_t{1} << 31) || D >= (int64_t{1} << 30)) throw error("cuda ds4 moe rows: too many tasks");
    const device_info di = current_device();
    const dtype ts = shared ? l.gate_sh.type : l.gate.type, tds = shared ? l.down_sh.type : l.down.type;
    const gate_up_args ga{a.g, a.up, a.gs, a.us, sc.ids, sc.weights, k, 0, nullptr, l.clamp, l.clamp_sh, sc.h, err};
    dispatch_pair(l.gate.type, ts, [&]<dtype TR, dtype TS>() {
        if constexpr (use_q8<TR, TS>()) {
            if (try_gate_up_rows_staged<TR, TS>(ga, n, xq, s)) return;
            void (*kernel)(rows_args) = moe_gate_up_rows_kernel<TR, TS>;
            int per_sm = 0;
            if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, 32 * kWarps, 0) != cudaSuccess || per_sm < 1)
                per_sm = 1;
            const int64_t resident = static_cast<int64_t>(per_sm) * di.sms * kWarps;
            const int64_t rounds = (tasks + resident - 1) / resident;
            const unsigned grid = static_cast<unsigned>((tasks + kWarps * rounds - 1) / (kWarps * rounds));
            kernel<<<grid, 32 * kWarps, 0, s>>>(a);
            check_launch("moe rows gate/up");
        }
    });
    quantize_rows_q8_kernel<<<static_cast<unsigned>(n * (k + 1)), 256, 0, s>>>(sc.h, F, units_f, k + 1, shared ? k + 1 : k, hq);
    check_launch("moe rows quantise h");
    dispatch_pair(l.down.type, tds, [&]<dtype TR, dtype TS>() {
        if constexpr (use_q8<TR, TS>()) {
            if (try_down_rows_staged<TR, TS>(a, s)) return;
            const int64_t blocks = (D + kWarps * kDownRows - 1) / (kWarps * kDownRows) * n;
            moe_down_rows_kernel<TR, TS><<<static_cast<unsigned>(blocks), 32 * kWarps, 0, s>>>(a);
            check_launch("moe rows down");
        }
    });
}

}  // namespace fathom::cuda::ds4
