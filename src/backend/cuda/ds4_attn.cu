// DS4 attention sublayer on CUDA for one decoded token (spec ../shared/reference/ds4-architecture.md
// sections 4 and 8): per-head query norm + RoPE (+ QAT), the KV row's norm/RoPE/FP8 into the raw
// ring, the KV compressors' frontier and row emission, sparse sink attention (split over rows,
// flash-decoding partials + a combine that applies the sink and the inverse RoPE, on the tensor-core
// path optionally folded into the split kernel), the grouped output GEMV and the logits argmax.
// Launchers: ds4_attn_kernels.h (the indexer top-k lives with the
// indexer kernels in ds4_indexer.cu). Chunked prefill (ds4_prefill.h): the query-head and KV-row
// kernels take a token index (token t at *pos + t; decode is token 0 of 1), the ring gets a chunk's
// last rows by launch_ring_store_tail, and the compressor over a chunk pools each emitted row in a
// block of its own (compressor_chunk_rows_kernel, the step's pooling and finish code) and then writes
// the frontier n_tok steps leave (compressor_chunk_state_kernel): all bit-identical to the steps.
//
// Position handling: every kernel reads the token's position from device memory and derives its
// counts there (ring row, emitted row, visible rows); grids depend only on host-side capacities, so
// a captured CUDA graph replays at any position.
//
// Numerics: element-wise steps repeat the CPU reference (src/models/deepseek4_ops.cpp, _qat.cpp,
// _attn.cpp) op for op with round-to-nearest intrinsics (no FMA contraction): RMSNorm sums exact
// squares in double, RoPE angles are the f32 product float(pos) * f with cos/sin in double, the FP8 /
// FP4 round trips use power-of-two scales and ties to even, the compressor softmax takes exp in
// double (the correctly rounded expf the CPU's libm gives, barring rare halfway cases). Only the
// block-wide double sums differ in order from the CPU (a float-rounding flip there is ~2^-29
// likely). Attention accumulates in f32 (scores: lane partials, then a reduce-scatter over the warp;
// softmax online per split), so it matches the CPU's double-accumulated attend_with_sink to ~1e-6
// relative; with f16 rows the split runs on tensor cores (q and p as f16 hi + lo pairs, f32
// accumulation: ~1e-6 relative to the f32 kernel; sparse_attn_args::tensor_cores = false forces the f32
// kernel).
//
// Latency: the per-token kernels are short chains, so rows of a power-of-two multiple of 64 dims (the
// DS4-Flash query heads, KV row and compressed rows) are finished by one warp in registers with no block
// barrier (wrow_*), and the compressor computes each pooling exp once, spread over the block; other
// widths take the shared-memory block helpers. Attention stages f16 rows as f16 in shared memory.
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <type_traits>

#include "backend/cuda/cuda_device.h"
#include "backend/cuda/cuda_kernels.h"
#include "backend/cuda/cuda_mma.cuh"
#include "backend/cuda/cuda_pdl.cuh"
#include "backend/cuda/cuda_smem.cuh"
#include "backend/cuda/ds4_attn_common.cuh"
#include "backend/cuda/ds4_attn_kernels.h"
#include "backend/cuda/ds4_prefill.h"
#include "core/error.h"

#include "backend/cuda/ktrace.h"

FATHOM_KTRACE_TU(ds4_attn)

namespace fathom::cuda::ds4 {
namespace {

using namespace attn_detail;


// ---- query heads, KV row -----------------------------------------------------------------------------

constexpr int kRowThreads = 128;

// One block per head of x [n_tok, n_head, hd] (decode: n_tok = 1); head blockIdx.x belongs to token
// blockIdx.x / n_head, at position *pos + that token.
__global__ void __launch_bounds__(kRowThreads)
    head_norm_rope_kernel(float *x, int n_head, int hd, bool norm, float eps, const float *__restrict__ freq,
                          int n_rot, qat_kind qat, const int64_t *__restrict__ pos) {
    extern __shared__ float sx[];  // [hd]
    __shared__ double red[32];
    float *xh = x + static_cast<size_t>(blockIdx.x) * hd;
    const int64_t p = *pos + static_cast<int64_t>(blockIdx.x / n_head);
    for (int i = threadIdx.x; i < hd; i += blockDim.x) sx[i] = xh[i];
    __syncthreads();
    if (norm) rms_norm_smem(sx, hd, nullptr, eps, red);
    rope_smem(sx + hd - n_rot, freq, n_rot, p, false);
    qat_smem(sx, hd, n_rot, qat);
    for (int i = threadIdx.x; i < hd; i += blockDim.x) xh[i] = sx[i];
}

// Where a finished KV row goes: ring row (p mod window) when window > 0 (decode), else row t of the
// chunk's rows (prefill), rows `stride` bytes apart.
__device__ __forceinline__ uint8_t *kv_dst(uint8_t *rows, size_t stride, int window, int64_t p, int64_t t) {
    return rows + static_cast<size_t>(window > 0 ? p % window : t) * stride;
}

// One block per token t = blockIdx.x: kv [n_tok, d] row t finished in place at position *pos + t and
// stored (kv_dst).
__global__ void __launch_bounds__(kRowThreads)
    kv_finish_store_kernel(float *kv, int d, const float *__restrict__ norm_w, float eps,
                           const float *__restrict__ freq, int n_rot, qat_kind qat, uint8_t *ring,
                           bool ring_f16, size_t ring_stride, int window, const int64_t *__restrict__ pos) {
    extern __shared__ float sx[];  // [d]
    __shared__ double red[32];
    const int64_t t = blockIdx.x, p = *pos + t;
    kv += static_cast<size_t>(t) * d;
    for (int i = threadIdx.x; i < d; i += blockDim.x) sx[i] = kv[i];
    __syncthreads();
    rms_norm_smem(sx, d, norm_w, eps, red);
    rope_smem(sx + d - n_rot, freq, n_rot, p, false);
    qat_smem(sx, d, n_rot, qat);
    uint8_t *row = kv_dst(ring, ring_stride, window, p, t);
    for (int i = threadIdx.x; i < d; i += blockDim.x) {
        kv[i] = sx[i];
        if (ring_f16)
            reinterpret_cast<__half *>(row)[i] = __float2half_rn(sx[i]);
        else
            reinterpret_cast<float *>(row)[i] = sx[i];
    }
}


// Warp-per-head variant (hd = 64 * NP, see warp_row_fits): kWarpRowThreads / 32 heads per block, no
// block barrier, the double cos/sin of the RoPE pairs computed by different lanes concurrently. Head h
// of the n_rows = n_tok * n_head heads of x [n_tok, n_head, hd] is at position *pos + h / n_head.
constexpr int kWarpRowThreads = 128;

template <int NP>
__global__ void __launch_bounds__(kWarpRowThreads)
    head_norm_rope_warp_kernel(float *x, int64_t n_rows, int n_head, bool norm, float eps,
                               const float *__restrict__ freq, int n_rot, qat_kind qat,
                               const int64_t *__restrict__ pos) {
    FATHOM_KTRACE_SCOPE(k_head_norm_rope);
    const int64_t h = static_cast<int64_t>(blockIdx.x) * (kWarpRowThreads / 32) + (threadIdx.x >> 5);
    if (h >= n_rows) return;  // warp-uniform
    float *xh = x + static_cast<size_t>(h) * 64 * NP;
    float v[NP][2];
    wrow_load(v, xh);
    wrow_finish(v, norm, nullptr, eps, freq, n_rot, *pos + h / n_head, qat);
    wrow_store(v, xh);
}

// One warp per token t (warp index over the grid; decode: one warp, t = 0): kv [n_tok, 64 * NP] row t
// finished in place at position *pos + t and stored (kv_dst).
template <int NP>
__global__ void __launch_bounds__(kWarpRowThreads)
    kv_finish_store_warp_kernel(float *kv, int64_t n_tok, const float *__restrict__ norm_w, float eps,
                                const float *__restrict__ freq, int n_rot, qat_kind qat, uint8_t *ring,
                                bool ring_f16, size_t ring_stride, int window, const int64_t *__restrict__ pos) {
    const int64_t t = static_cast<int64_t>(blockIdx.x) * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (t >= n_tok) return;  // warp-uniform
    const int64_t p = *pos + t;
    kv += static_cast<size_t>(t) * 64 * NP;
    float v[NP][2];
    wrow_load(v, kv);
    wrow_finish(v, true, norm_w, eps, freq, n_rot, p, qat);
    wrow_store(v, kv);
    wrow_store_row(v, kv_dst(ring, ring_stride, window, p, t), ring_f16);
}

// The decode step's one KV row over NP warps (srow_finish: slice j = warp j; bit-identical to
// kv_finish_store_warp_kernel's single warp): the step's KV branch (this, then the compressor) ran
// longer than the query path, and one warp's serial chain (RMSNorm, double cos/sin, FP8 per slice) was
// most of this kernel's 11 us. kv [64 NP] finished in place at *pos and stored (kv_dst, token 0).
template <int NP>
__global__ void __launch_bounds__(32 * NP)
    kv_finish_store_split_kernel(float *kv, const float *__restrict__ norm_w, float eps,
                                 const float *__restrict__ freq, int n_rot, qat_kind qat, uint8_t *ring,
                                 bool ring_f16, size_t ring_stride, int window, const int64_t *__restrict__ pos) {
    FATHOM_KTRACE_SCOPE(k_kv_finish);
    __shared__ float2 sv[NP][32];
    const int j = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int64_t p = *pos;
    float v[2] = {kv[64 * j + 2 * lane], kv[64 * j + 2 * lane + 1]};
    srow_finish<NP>(v, sv, norm_w, eps, freq, n_rot, p, qat);
    kv[64 * j + 2 * lane] = v[0];
    kv[64 * j + 2 * lane + 1] = v[1];
    srow_store(v, kv_dst(ring, ring_stride, window, p, 0), ring_f16);
}

// Ring rows after a chunk: block k copies chunk row (n_tok - n_tail + k) (position *pos + that row) to
// ring row (position mod window); E is the element type (2 or 4 bytes), d elements per row.
template <class E>
__global__ void ring_store_tail_kernel(const uint8_t *__restrict__ rows, size_t row_stride, int64_t n_tok,
                                       int64_t n_tail, int d, uint8_t *__restrict__ ring, size_t ring_stride,
                                       int window, const int64_t *__restrict__ pos) {
    const int64_t t = n_tok - n_tail + blockIdx.x, p = *pos + t;
    const E *src = reinterpret_cast<const E *>(rows + static_cast<size_t>(t) * row_stride);
    E *dst = reinterpret_cast<E *>(ring + static_cast<size_t>(p % window) * ring_stride);
    for (int i = threadIdx.x; i < d; i += blockDim.x) dst[i] = src[i];
}

// ---- compressor ----------------------------------------------------------------------------------------

constexpr int kCompThreads = 512, kCompChunk = 16;

// Pooling of one emitted row (compressor_push) by a block of kCompThreads threads (dp <= kCompThreads):
// for channel j (thread j) in the CPU's order: max over the candidates, then the exps e_t = exp(s_t -
// max) of kCompChunk candidates at a time computed by the whole block into shared memory (each e_t once
// when all candidates fit one chunk, as for ratio 4; else once for the sum and again for the weights),
// the f32 sum and the weighted sum taken by thread j in candidate order; row[j] = the pooled value.
// score(t, c) / kv(t, c): candidate t of channel c. Called by all threads; every read of score
// happens before the last barrier inside (callers may overwrite the sources after it); kv(t, j) is
// read by thread j only, after it. No barrier at the end: row[j] is visible to thread j only.
template <class Score, class Kv>
__device__ __forceinline__ void comp_pool(int dp, int n_cand, const Score &score, const Kv &kv, float *row,
                                          float *smx, float *ex) {
    const int j = threadIdx.x;
    if (j < dp) {
        float mx = -INFINITY;
        for (int t = 0; t < n_cand; ++t) mx = fmaxf(mx, score(t, j));
        smx[j] = mx;
    }
    __syncthreads();
    auto exps = [&](int c0, int nc) {  // ex[t - c0][c] = exp(s_t - max_c), t in [c0, c0 + nc)
        for (int k = threadIdx.x; k < nc * dp; k += blockDim.x) {
            const int t = k / dp, c = k - t * dp;
            ex[k] = static_cast<float>(exp(static_cast<double>(__fsub_rn(score(c0 + t, c), smx[c]))));
        }
        __syncthreads();
    };
    const bool kept = n_cand <= kCompChunk;  // one chunk: the exps stay in ex for the weights
    float sum = 0.0f, acc = 0.0f;
    for (int c0 = 0; c0 < n_cand; c0 += kCompChunk) {
        const int nc = min(kCompChunk, n_cand - c0);
        exps(c0, nc);
        if (j < dp)
            for (int t = 0; t < nc; ++t) sum = __fadd_rn(sum, ex[t * dp + j]);
        if (!kept) __syncthreads();  // ex is rewritten by the next chunk
    }
    for (int c0 = 0; c0 < n_cand; c0 += kCompChunk) {
        const int nc = min(kCompChunk, n_cand - c0);
        if (!kept) exps(c0, nc);
        if (j < dp)
            for (int t = 0; t < nc; ++t) {
                const float wt = __fdiv_rn(ex[t * dp + j], sum);
                if (wt != 0.0f) acc = __fadd_rn(acc, __fmul_rn(kv(c0 + t, j), wt));  // skips empty
            }
        if (!kept) __syncthreads();
    }
    if (j < dp) row[j] = acc;
}

// The pooled row (shared row [dp], complete: called after a barrier, by all threads) finished as
// compressor_finish: RMSNorm(norm_w), RoPE at block_start, QAT; stored as row b of a.rows, or, when
// b >= max_rows, not stored and err_comp_row set. NP > 0 (dim = 64 NP): warps 0 .. NP - 1 a 64-dim
// slice each (srow_finish; the Hadamard QAT, which mixes the whole row: warp 0 alone), in registers;
// NP = 0 (any dim): the block in shared memory.
template <int NP>
__device__ __forceinline__ void comp_finish_store(const compressor_args &a, float *row, int64_t block_start,
                                                  int64_t b, uint32_t *err, double *red) {
    const int dp = a.dim;
    uint8_t *dst = static_cast<uint8_t *>(a.rows) + static_cast<size_t>(b) * a.row_stride;
    if constexpr (NP > 0) {
        if (b >= a.max_rows) {  // block-uniform
            if (threadIdx.x == 0 && err) atomicOr(err, err_comp_row);
            return;
        }
        if (a.qat != qat_kind::hadamard_fp4) {  // warp j < NP finishes slice j (srow_finish: the same bits)
            __shared__ float2 sv[NP][32];
            const int w = threadIdx.x >> 5, lane = threadIdx.x & 31;
            float v[2] = {0.0f, 0.0f};
            if (w < NP) {
                v[0] = row[64 * w + 2 * lane];
                v[1] = row[64 * w + 2 * lane + 1];
            }
            srow_finish<NP>(v, sv, a.norm_w, a.eps, a.rope.freq, a.rope.n_rot, block_start, a.qat, w < NP);
            if (w < NP) srow_store(v, dst, a.rows_f16);
            return;
        }
        if (threadIdx.x >= 32) return;  // warp 0 finishes the row (the Hadamard transform mixes it whole)
        float v[NP][2];
        wrow_load(v, row);
        wrow_finish(v, true, a.norm_w, a.eps, a.rope.freq, a.rope.n_rot, block_start, a.qat);
        wrow_store_row(v, dst, a.rows_f16);
    } else {
        rms_norm_smem(row, dp, a.norm_w, a.eps, red);
        rope_smem(row + dp - a.rope.n_rot, a.rope.freq, a.rope.n_rot, block_start, false);
        qat_smem(row, dp, a.rope.n_rot, a.qat);
        if (b >= a.max_rows) {
            if (threadIdx.x == 0 && err) atomicOr(err, err_comp_row);
            return;
        }
        for (int i = threadIdx.x; i < dp; i += blockDim.x) {
            if (a.rows_f16)
                reinterpret_cast<__half *>(dst)[i] = __float2half_rn(row[i]);
            else
                reinterpret_cast<float *>(dst)[i] = row[i];
        }
    }
}

// Candidate t of a block whose first candidate is position q0 (ratio 4: 2R candidates from the previous
// block's start, else R): its frontier element for channel c (column dim + c for the current block's
// candidates under the overlap), or -1 for a position < 0 (empty: score -inf, value 0).
__device__ __forceinline__ int64_t comp_slot_elem(const compressor_args &a, int64_t q0, int t, int c) {
    const int64_t q = q0 + t;
    if (q < 0) return -1;
    const bool overlap = a.ratio == 4;
    const int width = (overlap ? 2 : 1) * a.dim;
    return (q % a.slots) * width + (overlap && t >= a.ratio ? a.dim + c : c);
}

// Decode step, one block (dim <= kCompThreads). Every token: its slot's columns written by all threads.
// On an emitting token: comp_pool over the block's candidates (by position), then comp_finish_store.
template <int NP>
__global__ void __launch_bounds__(kCompThreads)
    compressor_step_kernel(compressor_args a, const float *__restrict__ ca, const float *__restrict__ cg,
                           const int64_t *__restrict__ pos, uint32_t *err) {
    FATHOM_KTRACE_SCOPE(k_compressor_step);
    extern __shared__ float sm[];
    float *row = sm, *smx = sm + a.dim, *ex = sm + 2 * a.dim;  // [dim], [dim], [kCompChunk, dim]
    __shared__ double red[32];
    const int R = a.ratio, dp = a.dim;
    const bool overlap = R == 4;
    const int width = (overlap ? 2 : 1) * dp, n_cand = overlap ? 2 * R : R;
    const int64_t p = *pos;
    const int phase = static_cast<int>(p % R);
    const size_t slot = static_cast<size_t>(p % a.slots);
    const float *ape = a.ape + static_cast<size_t>(phase) * width;
    for (int i = threadIdx.x; i < width; i += blockDim.x) {
        a.state_kv[slot * width + i] = ca[i];
        a.state_score[slot * width + i] = __fadd_rn(cg[i], ape[i]);
    }
    if ((p + 1) % R != 0) return;  // block-uniform: no row this token
    __syncthreads();               // the slot's columns are visible to the whole block
    const int64_t q0 = p + 1 - n_cand;
    comp_pool(
        dp, n_cand,
        [&](int t, int c) {
            const int64_t e = comp_slot_elem(a, q0, t, c);
            return e < 0 ? -INFINITY : a.state_score[e];
        },
        [&](int t, int c) {
            const int64_t e = comp_slot_elem(a, q0, t, c);
            return e < 0 ? 0.0f : a.state_kv[e];
        },
        row, smx, ex);
    __syncthreads();  // row complete for every thread
    comp_finish_store<NP>(a, row, p + 1 - R, (p + 1) / R - 1, err, red);
}

// ---- compressor over a chunk -----------------------------------------------------------------------------
// Tokens at positions p0 .. p1 - 1 (p0 = *pos, p1 = p0 + n_tok). The value a step writes for position
// q (kv = ca row, score = cg row + ape[q mod R]) is: chunk row q - p0 for q >= p0 (computed as the step
// does: same bits), else in the frontier slot q mod slots (empty for q < 0). Rows b = p0 / R .. p1 / R - 1
// are emitted (block start B = b R); row b pools the candidates of positions B - R .. B + R - 1 (overlap;
// columns 0..dp of the first R, dp..2dp of the rest) or B .. B + R - 1. One block per row (rows kernel:
// reads only), then the state kernel writes the chunk's positions into the frontier (stream order:
// after every row has read it).

// One block per emitted row (blockIdx.x = b - p0 / R; blocks past the last row exit).
template <int NP>
__global__ void __launch_bounds__(kCompThreads)
    compressor_chunk_rows_kernel(compressor_args a, const float *__restrict__ ca, const float *__restrict__ cg,
                                 int64_t n_tok, const int64_t *__restrict__ pos, uint32_t *err) {
    extern __shared__ float sm[];
    float *row = sm, *smx = sm + a.dim, *ex = sm + 2 * a.dim;  // [dim], [dim], [kCompChunk, dim]
    __shared__ double red[32];
    const int R = a.ratio, dp = a.dim;
    const bool overlap = R == 4;
    const int width = (overlap ? 2 : 1) * dp, n_cand = overlap ? 2 * R : R;
    const int64_t p0 = *pos, b = p0 / R + blockIdx.x;
    if (b >= (p0 + n_tok) / R) return;  // block-uniform
    const int64_t q0 = b * R - (overlap ? R : 0);  // position of candidate 0
    auto col = [&](int t, int c) { return overlap && t >= R ? dp + c : c; };
    auto score = [&](int t, int c) {
        const int64_t q = q0 + t;
        if (q >= p0)
            return __fadd_rn(cg[static_cast<size_t>(q - p0) * width + col(t, c)],
                             a.ape[static_cast<size_t>(t % R) * width + col(t, c)]);
        const int64_t e = comp_slot_elem(a, q0, t, c);
        return e < 0 ? -INFINITY : a.state_score[e];
    };
    auto kv = [&](int t, int c) {
        const int64_t q = q0 + t;
        if (q >= p0) return ca[static_cast<size_t>(q - p0) * width + col(t, c)];
        const int64_t e = comp_slot_elem(a, q0, t, c);
        return e < 0 ? 0.0f : a.state_kv[e];
    };
    comp_pool(dp, n_cand, score, kv, row, smx, ex);
    __syncthreads();
    comp_finish_store<NP>(a, row, b * R, b, err, red);
}

// The frontier after the chunk, one thread per (slot s, column i): the slot takes the last position
// q <= p1 - 1 with q = s (mod slots) when that position is in the chunk (others keep theirs).
__global__ void compressor_chunk_state_kernel(compressor_args a, const float *__restrict__ ca,
                                              const float *__restrict__ cg, int64_t n_tok,
                                              const int64_t *__restrict__ pos) {
    const int R = a.ratio, dp = a.dim;
    const int width = (R == 4 ? 2 : 1) * dp;
    const int64_t k = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (k >= static_cast<int64_t>(a.slots) * width) return;
    const int s = static_cast<int>(k / width), i = static_cast<int>(k % width);
    const int64_t p0 = *pos, last = p0 + n_tok - 1;
    if (last < s) return;
    const int64_t q = last - (last - s) % a.slots;  // the last position of slot s
    if (q < p0) return;
    const size_t e = static_cast<size_t>(q - p0) * width + i, dst = static_cast<size_t>(s) * width + i;
    a.state_kv[dst] = ca[e];
    a.state_score[dst] = __fadd_rn(cg[e], a.ape[static_cast<size_t>(q % R) * width + i]);
}

// ---- sparse sink attention -----------------------------------------------------------------------------
// Candidate rows t in [0, n_raw + n_comp): raw window rows first (t < n_raw: ring row (first + t) mod
// window), then compressed rows. This token's n rows are cut into splits of rps rows (attn_rps: at least
// kMinRowsPerSplit, whole tiles, at most n_split splits, n_split fixed by the capacity on the host); the
// busy splits are the first ceil(n / rps), and both kernels derive them from *pos, so idle blocks exit
// at once and the combine reads only what was written.
//
// Split kernel: grid (n_split, ceil(n_head / 16)); block = 8 warps, warp w owns heads h0 + 2w, h0 + 2w + 1
// (query and output accumulator in registers, lane l holding the dim pairs (64 j + 2 l, +1)). Rows are
// staged 16 at a time in shared memory (as f16 when every source row is f16, else f32: T) and shared by
// the block's 16 heads. Scores: each lane forms 16 partial dot products (one per tile row) over its dims,
// and a reduce-scatter (16 shuffles instead of 16 x 5) leaves row (lane & 15)'s full score in lanes l and
// l + 16. Softmax is online per head (max m, denominator l, unnormalised output acc). Partials: acc at
// part[(split * n_head + h) * d], (m, l) at part[n_split * n_head * d + (split * n_head + h) * 2].
// Combine kernel: one warp per (head, 64 dims) merges the busy splits with the sink logit in the
// denominator, applies the inverse RoPE per dim pair and writes o. Every row f16 (the decode case): the
// tensor-core split kernel below replaces the split kernel (same partition and partials).

constexpr int kAttnWarps = 8, kAttnThreads = 32 * kAttnWarps, kHeadsPerWarp = 2;
constexpr int kHeadsPerBlock = kAttnWarps * kHeadsPerWarp, kTileRows = kAttnTileRows, kMaxD = 512, kMaxP = kMaxD / 64;
constexpr int kMaxSplits = 64, kMinRowsPerSplit = 32, kCombineThreads = 32;
static_assert(kMaxSplits == 64, "combine_split_weights: splits lane and lane + 32 of one warp, ws [64]");

struct attn_geom {
    int n_head, d;
    float scale;
    const uint8_t *ring;
    size_t ring_stride;
    int window;
    int ring_rows;  // ring row of position p: p mod ring_rows
    bool ring_f16;
    comp_mode mode;
    const uint8_t *comp;
    size_t comp_stride;
    bool comp_f16;
    int ratio;
    const int32_t *sel;
    const int32_t *n_sel;
    int64_t max_comp;
    int n_split;
    bool pair_loads;  // every row base and stride aligned to a dim pair (4 bytes f16, 8 bytes f32)
};

struct attn_span {
    int64_t first, n_raw, n_comp;
};

__device__ __forceinline__ attn_span attn_span_at(const attn_geom &g, int64_t p) {
    attn_span s;
    s.first = p - g.window + 1 > 0 ? p - g.window + 1 : 0;
    s.n_raw = p - s.first + 1;
    int64_t nc = 0;
    if (g.mode == comp_mode::all)
        nc = (p + 1) / g.ratio;
    else if (g.mode == comp_mode::list)
        nc = *g.n_sel;
    nc = nc < 0 ? 0 : nc;
    s.n_comp = nc < g.max_comp ? nc : g.max_comp;
    return s;
}

// Rows per split for n rows over at most n_split splits: >= kMinRowsPerSplit, whole tiles; then
// n_split * rps >= n, and the busy splits are ceil(n / rps).
__host__ __device__ __forceinline__ int64_t attn_rps(int64_t n, int n_split) {
    int64_t rps = (n + n_split - 1) / n_split;
    rps = rps > kMinRowsPerSplit ? rps : kMinRowsPerSplit;
    return (rps + kTileRows - 1) / kTileRows * kTileRows;
}

// This block's split (blockIdx.x) of the token's rows sp: rows [r0, r1); r0 >= r1 for an idle split
// (the caller returns: block-uniform, and the combine does not read it).
struct attn_split_rows {
    int64_t r0, r1;
};
__device__ __forceinline__ attn_split_rows attn_split_at(const attn_span &sp, int n_split) {
    const int64_t n_tot = sp.n_raw + sp.n_comp;
    const int64_t rps = attn_rps(n_tot, n_split);
    const int64_t r0 = static_cast<int64_t>(blockIdx.x) * rps;
    return {r0, r0 + rps < n_tot ? r0 + rps : n_tot};
}

// Row t of the candidate list: its bytes and whether it is f16.
__device__ __forceinline__ const uint8_t *attn_row(const attn_geom &g, const attn_span &sp, int64_t t,
                                                   bool &f16) {
    if (t < sp.n_raw) {
        f16 = g.ring_f16;
        return g.ring + static_cast<size_t>((sp.first + t) % g.ring_rows) * g.ring_stride;
    }
    const int64_t c = t - sp.n_raw;
    const int64_t r = g.mode == comp_mode::all ? c : static_cast<int64_t>(g.sel[c]);
    f16 = g.comp_f16;
    return g.comp + static_cast<size_t>(r) * g.comp_stride;
}

template <class T>
__global__ void __launch_bounds__(kAttnThreads, 2)  // two blocks per SM: <= 128 registers
    attn_split_kernel(attn_geom g, const float *__restrict__ q, const int64_t *__restrict__ pos,
                      float *__restrict__ part) {
    FATHOM_KTRACE_SCOPE(k_attn_split);
    using P = typename tile_pair<T>::type;
    extern __shared__ __align__(16) unsigned char tile_raw[];
    P *tile = reinterpret_cast<P *>(tile_raw);  // [kTileRows, d / 2] pairs
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int d = g.d, np = d / 64, hp = d / 2;
    const int h0 = blockIdx.y * kHeadsPerBlock;
    const attn_span sp = attn_span_at(g, *pos);
    const auto [r0, r1] = attn_split_at(sp, g.n_split);
    if (r0 >= r1) return;  // block-uniform: an idle split (the combine does not read it)
    float qr[kHeadsPerWarp][kMaxP][2], acc[kHeadsPerWarp][kMaxP][2], m[kHeadsPerWarp], l[kHeadsPerWarp];
#pragma unroll
    for (int hh = 0; hh < kHeadsPerWarp; ++hh) {
        const int h = h0 + warp * kHeadsPerWarp + hh;
#pragma unroll
        for (int j = 0; j < kMaxP; ++j)
#pragma unroll
            for (int k = 0; k < 2; ++k) {
                qr[hh][j][k] = h < g.n_head && j < np ? q[static_cast<size_t>(h) * d + 64 * j + 2 * lane + k] : 0.0f;
                acc[hh][j][k] = 0.0f;
            }
        m[hh] = -INFINITY;
        l[hh] = 0.0f;
    }
    for (int64_t t0 = r0; t0 < r1; t0 += kTileRows) {
        const int nt = static_cast<int>(r1 - t0 < kTileRows ? r1 - t0 : kTileRows);
        __syncthreads();  // the previous tile is consumed
        if (std::is_same_v<T, __half> && g.pair_loads) {
            // Every row f16 and pair-aligned (the decode case): all of this warp's row loads are issued
            // before any shared store. The loads go through generic pointers, which the compiler must
            // assume may alias the tile, so the row loop below waits for each load in turn: 23 us for a
            // 32-row split (ncu), whatever the row count. Rows past nt: zeros (p = 0 must not meet NaN).
            static_assert(kTileRows % kAttnWarps == 0, "whole rows per warp");
            constexpr int kRowsPerWarp = kTileRows / kAttnWarps, kPairIt = kMaxD / 2 / 32;
            __half2 v[kRowsPerWarp][kPairIt];
#pragma unroll
            for (int k = 0; k < kRowsPerWarp; ++k) {
                const int r = warp + k * kAttnWarps;
                bool f16 = true;
                const __half2 *src =
                    r < nt ? reinterpret_cast<const __half2 *>(attn_row(g, sp, t0 + r, f16)) : nullptr;
#pragma unroll
                for (int j = 0; j < kPairIt; ++j) {
                    const int i = lane + 32 * j;
                    v[k][j] = src && i < hp ? src[i] : __float2half2_rn(0.0f);
                }
            }
#pragma unroll
            for (int k = 0; k < kRowsPerWarp; ++k) {
                P *dst = tile + (warp + k * kAttnWarps) * hp;
#pragma unroll
                for (int j = 0; j < kPairIt; ++j) {
                    const int i = lane + 32 * j;
                    if (i < hp) tile_put(dst, i, __low2half(v[k][j]), __high2half(v[k][j]));
                }
            }
        } else
        for (int r = warp; r < kTileRows; r += kAttnWarps) {  // rows past nt: zeros (p = 0 must not meet NaN)
            P *dst = tile + r * hp;
            if (r >= nt) {
                for (int i = lane; i < hp; i += 32) tile_put(dst, i, 0.0f, 0.0f);
                continue;
            }
            bool f16 = false;
            const uint8_t *src = attn_row(g, sp, t0 + r, f16);
            if (f16 && g.pair_loads) {
                const __half2 *s = reinterpret_cast<const __half2 *>(src);
                for (int i = lane; i < hp; i += 32) {
                    const __half2 v = s[i];
                    tile_put(dst, i, __low2half(v), __high2half(v));
                }
            } else if (f16) {
                const __half *s = reinterpret_cast<const __half *>(src);
                for (int i = lane; i < hp; i += 32) tile_put(dst, i, s[2 * i], s[2 * i + 1]);
            } else if (g.pair_loads) {
                const float2 *s = reinterpret_cast<const float2 *>(src);
                for (int i = lane; i < hp; i += 32) {
                    const float2 v = s[i];
                    tile_put(dst, i, v.x, v.y);
                }
            } else {
                const float *s = reinterpret_cast<const float *>(src);
                for (int i = lane; i < hp; i += 32) tile_put(dst, i, s[2 * i], s[2 * i + 1]);
            }
        }
        __syncthreads();
        float pr[kHeadsPerWarp];
        {
            float dot[kHeadsPerWarp][kTileRows];
#pragma unroll
            for (int hh = 0; hh < kHeadsPerWarp; ++hh)
#pragma unroll
                for (int r = 0; r < kTileRows; ++r) dot[hh][r] = 0.0f;
#pragma unroll
            for (int r = 0; r < kTileRows; ++r)
#pragma unroll
                for (int j = 0; j < kMaxP; ++j)
                    if (j < np) {
                        const float2 kv = tile_get(tile, r * hp + 32 * j + lane);
#pragma unroll
                        for (int hh = 0; hh < kHeadsPerWarp; ++hh)
                            dot[hh][r] = fmaf(qr[hh][j][1], kv.y, fmaf(qr[hh][j][0], kv.x, dot[hh][r]));
                    }
            const bool valid = (lane & 15) < nt;
#pragma unroll
            for (int hh = 0; hh < kHeadsPerWarp; ++hh) {
                const float tot = reduce_scatter16(dot[hh], lane);  // every lane shuffles
                const float s = valid ? tot * g.scale : -INFINITY;
                const float m_new = fmaxf(m[hh], warp_max(s));  // finite: nt >= 1 rows
                const float corr = expf(m[hh] - m_new);          // 0 on the first tile (m = -inf)
                pr[hh] = valid ? expf(s - m_new) : 0.0f;
                float ps = pr[hh];  // the 16 rows' sum (lanes l, l + 16 hold the same row)
                for (int o = 8; o > 0; o >>= 1) ps += __shfl_xor_sync(kFull, ps, o);
                l[hh] = l[hh] * corr + ps;
                m[hh] = m_new;
#pragma unroll
                for (int j = 0; j < kMaxP; ++j) {
                    acc[hh][j][0] *= corr;
                    acc[hh][j][1] *= corr;
                }
            }
        }
#pragma unroll
        for (int r = 0; r < kTileRows; ++r) {
            float p_r[kHeadsPerWarp];
#pragma unroll
            for (int hh = 0; hh < kHeadsPerWarp; ++hh) p_r[hh] = __shfl_sync(kFull, pr[hh], r);
#pragma unroll
            for (int j = 0; j < kMaxP; ++j)
                if (j < np) {
                    const float2 kv = tile_get(tile, r * hp + 32 * j + lane);
#pragma unroll
                    for (int hh = 0; hh < kHeadsPerWarp; ++hh) {
                        acc[hh][j][0] = fmaf(p_r[hh], kv.x, acc[hh][j][0]);
                        acc[hh][j][1] = fmaf(p_r[hh], kv.y, acc[hh][j][1]);
                    }
                }
        }
    }
    const size_t ml0 = static_cast<size_t>(g.n_split) * g.n_head * d;
#pragma unroll
    for (int hh = 0; hh < kHeadsPerWarp; ++hh) {
        const int h = h0 + warp * kHeadsPerWarp + hh;
        if (h >= g.n_head) continue;
        const size_t ph = static_cast<size_t>(blockIdx.x) * g.n_head + h;
        float *pp = part + ph * d;
#pragma unroll
        for (int j = 0; j < kMaxP; ++j)
            if (j < np) {
                pp[64 * j + 2 * lane] = acc[hh][j][0];
                pp[64 * j + 2 * lane + 1] = acc[hh][j][1];
            }
        if (lane == 0) {
            part[ml0 + 2 * ph] = m[hh];
            part[ml0 + 2 * ph + 1] = l[hh];
        }
    }
}

// Busy splits of the token at p: the first ceil(n / rps) (each saw >= 1 row).
__device__ __forceinline__ int attn_busy_splits(const attn_geom &g, int64_t p) {
    const attn_span sp = attn_span_at(g, p);
    const int64_t n_tot = sp.n_raw + sp.n_comp, rps = attn_rps(n_tot, g.n_split);
    return static_cast<int>((n_tot + rps - 1) / rps);
}

// One warp, all 32 lanes: head h, dim pairs 32 y .. 32 y + 31 for the NJ chunks y = y0 .. y0 + NJ - 1
// below cpp = d / 64 (lane l: pairs 32 y + l). o_h = sum_s e^(m_s - M) acc_s / (e^(sink - M) + sum_s
// e^(m_s - M) l_s) over the busy splits s (each saw >= 1 row: m_s finite), M the largest of the sink and
// the m_s (every warp of the head computes the same weights; the warp butterflies leave M, den and so
// inv bit-identical in every lane). Then the inverse RoPE of the last n_rot dims at p, one dim pair per
// lane and chunk. Every pair gets the same operations in the same order whatever NJ and U (U: the split
// loop's unroll, NJ: chunks sharing one weight computation and keeping 2 NJ U loads in flight), so the
// separate combine kernel (NJ = 1) and the fused tail (NJ up to 8) give the same bits. ws: this warp's
// shared [kMaxSplits] (the split weights). part is read through L2 (__ldcg): in the fused kernel other
// blocks wrote it during this launch.
template <int NJ, int U>
__device__ __forceinline__ void attn_combine_warp(const attn_geom &g, const float *part, const float *sinks,
                                                  const float *freq, int n_rot, int64_t p, int busy, int h, int y0,
                                                  float *ws, float *o) {
    const int lane = threadIdx.x & 31, d = g.d, n_head = g.n_head, cpp = d / 64;
    const size_t ml0 = static_cast<size_t>(g.n_split) * n_head * d;
    const float sink = sinks[h];
    float ms[2], ls[2];
#pragma unroll
    for (int k = 0; k < 2; ++k) {  // splits lane and lane + 32 (past busy: split busy - 1 read, unused)
        const int s = lane + 32 * k;
        const size_t ph = static_cast<size_t>(min(s, busy - 1)) * n_head + h;
        const float mv = __ldcg(part + ml0 + 2 * ph), lv = __ldcg(part + ml0 + 2 * ph + 1);
        ms[k] = s < busy ? mv : -INFINITY;
        ls[k] = s < busy ? lv : 0.0f;
    }
    const float inv = combine_split_weights(ms, ls, sink, busy, lane, ws);
    __syncwarp();  // ws visible to the whole warp
    const float fp = static_cast<float>(p);
    const int rp0 = (d - n_rot) / 2;
    float a[NJ], b[NJ];
    const float *pj[NJ];  // chunk j's pairs of split 0; past the head's chunks: its last (read, unused)
#pragma unroll
    for (int j = 0; j < NJ; ++j) {
        a[j] = b[j] = 0.0f;
        pj[j] = part + static_cast<size_t>(h) * d + 2 * lane + 64 * min(y0 + j, cpp - 1);
    }
    const size_t sstride = static_cast<size_t>(n_head) * d;  // floats from one split's acc to the next
    // U splits at a time: the 2 NJ U loads (__ldcg is volatile asm: issued in program order, so all of
    // them first; splits past busy read split busy - 1) before the FMAs, which run in split order.
    for (int s0 = 0; s0 < busy; s0 += U) {
        float x[U][NJ][2];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const size_t off = static_cast<size_t>(min(s0 + u, busy - 1)) * sstride;
#pragma unroll
            for (int j = 0; j < NJ; ++j) {
                x[u][j][0] = __ldcg(pj[j] + off);
                x[u][j][1] = __ldcg(pj[j] + off + 1);
            }
        }
#pragma unroll
        for (int u = 0; u < U; ++u)
            if (s0 + u < busy) {
                const float w = ws[s0 + u];
#pragma unroll
                for (int j = 0; j < NJ; ++j) {
                    a[j] += w * x[u][j][0];
                    b[j] += w * x[u][j][1];
                }
            }
    }
#pragma unroll
    for (int j = 0; j < NJ; ++j) {
        const int pi = 32 * (y0 + j) + lane;  // this lane's dim pair
        if (y0 + j >= cpp) continue;
        float x0 = a[j] * inv, x1 = b[j] * inv;
        if (pi >= rp0) {  // inverse RoPE of the pair, as rope_smem
            const float ang = __fmul_rn(fp, freq[pi - rp0]);
            const float c = static_cast<float>(cos(static_cast<double>(ang)));
            const float sn = -static_cast<float>(sin(static_cast<double>(ang)));
            const float r0 = __fsub_rn(__fmul_rn(x0, c), __fmul_rn(x1, sn));
            const float r1 = __fadd_rn(__fmul_rn(x0, sn), __fmul_rn(x1, c));
            x0 = r0;
            x1 = r1;
        }
        o[static_cast<size_t>(h) * d + 2 * pi] = x0;
        o[static_cast<size_t>(h) * d + 2 * pi + 1] = x1;
    }
    __syncwarp();  // every lane has read ws before the warp's next item rewrites it
}

// Block (head blockIdx.x, dim pairs 32 blockIdx.y .. + 31), one warp: attn_combine_warp. One warp per
// block and d / 64 blocks per head: the partials (up to 64 x 128 KB at 64 heads of 512) are read by 512
// warps with the split loop unrolled, not by 64 blocks walking them in turn.
__global__ void __launch_bounds__(kCombineThreads)
    attn_combine_kernel(attn_geom g, const float *__restrict__ part, const float *__restrict__ sinks,
                        const float *__restrict__ freq, int n_rot, const int64_t *__restrict__ pos,
                        float *__restrict__ o) {
    FATHOM_KTRACE_SCOPE(k_attn_combine);
    static_assert(kCombineThreads == 32, "one warp per (head, 32 dim pairs)");
    __shared__ float ws[kMaxSplits];
    pdl_wait();  // the split kernel's partials (a no-op without PDL)
    pdl_launch_dependents();
    const int64_t p = *pos;
    attn_combine_warp<1, 8>(g, part, sinks, freq, n_rot, p, attn_busy_splits(g, p), blockIdx.x, blockIdx.y, ws, o);
}

// Split count from the capacity (window + max_comp rows): at most kMaxSplits, a function of the
// arguments alone so attn_part_floats agrees with the launch.
int attn_splits(const sparse_attn_args &a) {
    const int64_t max_rows = a.window + (a.mode == comp_mode::none ? 0 : a.max_comp);
    int64_t n = (max_rows + kMinRowsPerSplit - 1) / kMinRowsPerSplit;
    return static_cast<int>(std::min<int64_t>(std::max<int64_t>(n, 1), kMaxSplits));
}

// ---- sparse sink attention on tensor cores (decode, every row f16) -------------------------------------
// The same row partition (attn_rps over attn_splits(a) splits), partial layout and combine as the f32
// split kernel above, so attn_part_floats and attn_combine_kernel serve both paths; only the split
// kernel differs. Why: the f32 kernel is latency-bound (~22 us whatever the row count: CUDA-core dots
// of 16 rows x 2 heads per warp, 4 head-group blocks each reading every row); here a block takes 32
// heads of the token as the MMA M dimension (2 m16 tiles), so each row is read from L2 twice per
// split and the dots run on tensor cores. Why 32 heads: a block's fixed traffic is its q (heads x d f32)
// in and its partial (the same size) out, which one SM moves at its own L2 port's rate; with all 64
// heads per block (128 KB each way) that dominated the few-tile splits of decode, and half of it doubles
// the blocks at half the bytes each (measured on the H200 at 8K context, each in one call with the
// others: 64 heads 128.5, 32 heads 131.3, 16 heads 130.9 tok/s; at 1M context 42.7 / 41.4 / 48.9 us per
// ratio-128 call, where 16 heads read every row four times). With sparse_attn_args::fused_combine the
// kernel is a PDL launch (it waits for the preceding kernel before reading pos, q and the rows) and its
// busy blocks then do the combine themselves (attn_fused_combine below): one launch per call instead
// of two.
//
// Block (split blockIdx.x, heads 32 blockIdx.y .. + 31; heads past n_head get q = 0 and are not
// written), 8 warps, rows in tiles of kMmaRows = 32 staged in shared memory as f16. f16 rows are exact
// in f16, so only the f32 operands are split: q = q_hi + q_lo and p = p_hi + p_lo (f16 each, the pair
// exact to ~2^-22 relative), each product pair accumulated in f32 by mma.m16n8k16, as the prefill
// kernel (ds4_attn_prefill.cu): ~1e-6 relative to the f32 kernel. (Queries must be below the f16
// range, 65504: true of the normed attention queries.) Per tile:
//   stage   : rows t0 .. t0 + 31 -> ks [32, d + 8] f16 (rows past the split's end: zeros, since p = 0
//             must not meet NaN) by cp.async (16-byte aligned rows; the first tile's copies overlap the
//             q staging) or by pair loads issued before their shared stores.
//   scores  : warp w: head tile w % 2 x the 32 rows x dims (w / 2) d / 4 .. + d / 4 (a quarter of
//             k): partial S [16, 32] f32 to sq[w / 2]; the quarters are summed in a fixed order.
//   softmax : thread tid: head tid / 8, rows 4 (tid % 8) .. + 3; online per head: (m, l) live in the
//             registers of the head's 8 threads (butterfly reductions: identical in all 8); p (hi, lo)
//             to ph / pl, the rescale factor exp(m_old - m_new) to corr.
//   output  : warp w: head tile w % 2 x dims (w / 2) d / 4 .. + d / 4 (d / 32 n8 tiles of f32
//             accumulators in registers): acc = acc * corr + P V.
// Fragments come from ldmatrix: A (q, p) row-major; B of S = K rows as [n, k] as they are; B of P V
// = V rows [k, n] through .trans. Shared row strides (d + 8 halves, 40 halves, 40 floats) keep the 8
// rows of an ldmatrix phase and the fragment stores on distinct banks. Shared memory at d = 512:
// 125 KB (q hi + lo 66.5 KB, rows 33 KB, S quarters 20 KB, P 5 KB): one block per SM.
constexpr int kMmaHeads = 32, kMmaTiles = kMmaHeads / 16;  // heads per block, m16 tiles
constexpr int kMmaWarps = 4 * kMmaTiles, kMmaThreads = 32 * kMmaWarps, kMmaRows = 32;
constexpr int kMmaPad = 8, kMmaSld = kMmaRows + 8;           // f16 row pad; S / P row stride
constexpr int kMmaKParts = kMmaWarps / kMmaTiles;            // 4: the d quarters of the score warps
static_assert(kMmaKParts == 4 && kMmaRows == 32 && kMmaThreads / 8 == kMmaHeads,
              "the warp roles below: head tiles x 4 quarters, 8 softmax threads per head");

// Byte offsets of the tensor-core kernel's shared arrays (all 16-byte aligned: d % 64 == 0).
struct mma_smem {
    size_t qh, ql, ks, sq, ph, pl, corr, total;
};
__host__ __device__ __forceinline__ mma_smem mma_smem_layout(int d) {
    const size_t ldk = static_cast<size_t>(d) + kMmaPad;
    mma_smem m;
    m.qh = 0;                                                // [heads, ldk] f16: q hi
    m.ql = m.qh + kMmaHeads * ldk * 2;                       // [heads, ldk] f16: q lo
    m.ks = m.ql + kMmaHeads * ldk * 2;                       // [32, ldk] f16: the row tile
    m.sq = m.ks + kMmaRows * ldk * 2;                        // [4, heads, 40] f32: partial scores
    m.ph = m.sq + static_cast<size_t>(kMmaKParts) * kMmaHeads * kMmaSld * 4;  // [heads, 40] f16: p hi
    m.pl = m.ph + static_cast<size_t>(kMmaHeads) * kMmaSld * 2;               // [heads, 40] f16: p lo
    m.corr = m.pl + static_cast<size_t>(kMmaHeads) * kMmaSld * 2;             // [heads] f32
    m.total = m.corr + kMmaHeads * 4;
    return m;
}

// (a, b) -> f16 hi pair at hi, f16 lo pair (a - hi(a), b - hi(b): exact in f32) at lo.
__device__ __forceinline__ void put_hi_lo(__half *hi, __half *lo, float a, float b) {
    const __half ah = __float2half_rn(a), bh = __float2half_rn(b);
    *reinterpret_cast<__half2 *>(hi) = __halves2half2(ah, bh);
    *reinterpret_cast<__half2 *>(lo) =
        __halves2half2(__float2half_rn(a - __half2float(ah)), __float2half_rn(b - __half2float(bh)));
}

// q of heads h0 .. h0 + kMmaHeads - 1 (past n_head: zeros) in one round trip: the block's kMmaHeads x d
// floats are kQIt float4 loads per thread, all issued before any is used (q [n_head, d] 16-byte aligned:
// host check). Then the hi / lo split into qh / ql [kMmaHeads, ldk] (mma_store_q). The kernel issues the
// loads before it forms the first tile's row addresses (the selected-row list read, the cp.async), so
// both round trips overlap.
constexpr int kQIt = 16;
static_assert(kMmaHeads * kMaxD / 4 <= kMmaThreads * kQIt, "q in one batch of loads");
__device__ __forceinline__ void mma_load_q(const float *__restrict__ q, int n_head, int d, int h0,
                                           float4 (&v)[kQIt]) {
    const int n4 = kMmaHeads * d / 4;  // float4s of the block's heads
    const float4 *q4 = reinterpret_cast<const float4 *>(q + static_cast<size_t>(h0) * d);
#pragma unroll
    for (int k = 0; k < kQIt; ++k) {
        const int e = k * kMmaThreads + static_cast<int>(threadIdx.x);
        v[k] = e < n4 && h0 + 4 * e / d < n_head ? q4[e] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    }
}
__device__ __forceinline__ void mma_store_q(const float4 (&v)[kQIt], int d, __half *qh, __half *ql, int ldk) {
    const int n4 = kMmaHeads * d / 4;
#pragma unroll
    for (int k = 0; k < kQIt; ++k) {
        const int e = k * kMmaThreads + static_cast<int>(threadIdx.x);
        if (e >= n4) continue;
        const int hh = 4 * e / d, c = 4 * e - hh * d;
        put_hi_lo(qh + hh * ldk + c, ql + hh * ldk + c, v[k].x, v[k].y);
        put_hi_lo(qh + hh * ldk + c + 2, ql + hh * ldk + c + 2, v[k].z, v[k].w);
    }
}

// 16 bytes global -> shared by cp.async (L2 only); src_bytes 0 writes 16 zero bytes and reads nothing.
__device__ __forceinline__ void mma_cp_async16(__half *dst, const void *src, int src_bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(
                     static_cast<uint32_t>(__cvta_generic_to_shared(dst))),
                 "l"(src), "r"(src_bytes));
#endif
}
// Waits for all of this thread's cp.async copies (a no-op when none were issued).
__device__ __forceinline__ void mma_cp_async_wait_all() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.wait_all;\n" ::: "memory");
#endif
}

// Rows t0 .. t0 + kMmaRows - 1 of the candidate list into ks [kMmaRows, ldk] (rows >= nt: zeros), in
// units of V. uint4 (8 halves, rows 16-byte aligned): cp.async, complete after mma_cp_async_wait_all
// (so the first tile's copies fly while q is staged). uint32_t (a pair): loads to registers, 4 per
// thread in flight, then shared stores.
template <class V>
__device__ __forceinline__ void mma_stage_rows(const attn_geom &g, const attn_span &sp, int64_t t0, int nt,
                                               __half *ks, int ldk) {
    constexpr int per = static_cast<int>(sizeof(V) / 2), kIt = 4;
    const int cpr = g.d / per, total = kMmaRows * cpr;
    if constexpr (sizeof(V) == 16) {
        for (int e = threadIdx.x; e < total; e += kMmaThreads) {
            const int r = e / cpr, c = e - r * cpr;
            const void *src = g.ring;  // any valid address: nothing is read for rows >= nt
            if (r < nt) {
                bool f16 = true;
                src = reinterpret_cast<const V *>(attn_row(g, sp, t0 + r, f16)) + c;
            }
            mma_cp_async16(ks + r * ldk + per * c, src, r < nt ? 16 : 0);
        }
    } else {
        for (int e0 = 0; e0 < total; e0 += kMmaThreads * kIt) {
            V v[kIt];
#pragma unroll
            for (int k = 0; k < kIt; ++k) {
                const int e = e0 + k * kMmaThreads + static_cast<int>(threadIdx.x), r = e / cpr, c = e - r * cpr;
                v[k] = V{};
                if (e < total && r < nt) {
                    bool f16 = true;
                    v[k] = reinterpret_cast<const V *>(attn_row(g, sp, t0 + r, f16))[c];
                }
            }
#pragma unroll
            for (int k = 0; k < kIt; ++k) {
                const int e = e0 + k * kMmaThreads + static_cast<int>(threadIdx.x), r = e / cpr, c = e - r * cpr;
                if (e < total) *reinterpret_cast<V *>(ks + r * ldk + per * c) = v[k];
            }
        }
    }
}

// ---- fused combine (sparse_attn_args::fused_combine) ------------------------------------------------------
// The tensor-core split kernel may finish the call itself instead of the separate combine launch. The
// combine of the ~128 KB of partials per busy split is spread over the busy blocks of each head group
// (one block alone would read busy x 128 KB through one SM's L2 port: ~1 us per split), so they meet
// at a grid barrier per head group first: every busy block publishes its partials (fence), arrives on
// the group's counter and waits until all `busy` have arrived; then warp w of busy block x takes the
// combine items x * 16 + w, + busy * 16, ... (attn_combine_warp: the separate combine kernel's code and
// per-pair operation order, so the same bits). The wait needs every busy block resident at once: the
// launcher fuses only when the occupancy calculator fits the whole grid on the device, and the kernel
// lets its dependents launch (PDL) only after the barrier, so no waiting block can hold an SM a busy
// block needs. A bounded wait (about a second) turns a broken assumption into wrong outputs, not a hang.
//
// Counters: two words per head group at the head of `part` (kAttnSyncFloats, attn_part_floats counts
// them): arrivals, then departures. The last block to depart (all busy blocks are past the wait) zeroes
// both, so every call leaves them zero and a captured graph replays with no reset; they must be zero
// before the first fused call (ds4_attn_kernels.h).
constexpr int kAttnSyncFloats = 64;  // 256 bytes: keeps the partials' alignment; 32 head groups
constexpr uint32_t kFuseSpinLimit = 1u << 21;  // polls of ~0.5 us: about a second, vs microseconds of real waits

struct attn_fuse {
    const float *sinks, *freq;
    int n_rot;
    float *o;
    uint32_t *sync;  // [2 * head groups] or null: partials only (the separate combine kernel follows)
};

__device__ __forceinline__ uint32_t ld_acquire_gpu(const uint32_t *p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 700
    uint32_t v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
#else
    return *reinterpret_cast<const volatile uint32_t *>(p);
#endif
}

// Called by every thread of a busy block of the tensor-core split kernel after its partial stores;
// heads h0 .. h0 + kMmaHeads - 1 (< n_head) are this head group's. ws: kMmaWarps x kMaxSplits floats of
// shared memory no longer in use.
__device__ __forceinline__ void attn_fused_combine(const attn_geom &g, const float *part, const attn_fuse &f,
                                                   int64_t p, int busy, int h0, int n_heads_blk, float *ws) {
    __shared__ int s_ok;
    const int tid = threadIdx.x, warp = tid >> 5;
    uint32_t *arrive = f.sync + 2 * blockIdx.y, *depart = arrive + 1;
    __threadfence();  // this thread's partial stores are device-visible before the block arrives
    __syncthreads();
    if (tid == 0) {
        const uint32_t need = static_cast<uint32_t>(busy);
        atomicAdd(arrive, 1u);
        uint32_t n = ld_acquire_gpu(arrive);
        for (uint32_t spin = 0; n < need && spin < kFuseSpinLimit; ++spin) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 700
            __nanosleep(32);
#endif
            n = ld_acquire_gpu(arrive);
        }
        s_ok = n >= need;
        // the last to depart resets the pair: every busy block is past its wait by then
        if (n >= need && atomicAdd(depart, 1u) == need - 1) {
            atomicExch(arrive, 0u);
            atomicExch(depart, 0u);
        }
        __threadfence();
    }
    __syncthreads();
    if (!s_ok) return;  // a busy block never arrived: leave the outputs unwritten rather than hang
    pdl_launch_dependents();  // every busy block has read its inputs (q, rows, pos)
    // Items: (head, nj chunks of 32 dim pairs), nj the smallest power of two up to 8 (and to the cpp
    // chunks of a head) that leaves no more items than the busy * 16 warps: few busy splits -> whole
    // heads per warp (one weight computation, 2 nj U loads in flight), many -> one chunk per warp.
    const int cpp = g.d / 64, n_warps = busy * kMmaWarps;
    int nj = 1;
    while (nj < 8 && nj < cpp && n_heads_blk * ((cpp + nj - 1) / nj) > n_warps) nj *= 2;
    const int gph = (cpp + nj - 1) / nj;  // items per head
    const int n_items = n_heads_blk * gph;
    float *wsw = ws + warp * kMaxSplits;
    for (int it = static_cast<int>(blockIdx.x) * kMmaWarps + warp; it < n_items; it += n_warps) {
        const int hl = it / gph, y0 = (it - hl * gph) * nj;
        switch (nj) {  // warp-uniform
            case 1: attn_combine_warp<1, 16>(g, part, f.sinks, f.freq, f.n_rot, p, busy, h0 + hl, y0, wsw, f.o); break;
            case 2: attn_combine_warp<2, 8>(g, part, f.sinks, f.freq, f.n_rot, p, busy, h0 + hl, y0, wsw, f.o); break;
            case 4: attn_combine_warp<4, 4>(g, part, f.sinks, f.freq, f.n_rot, p, busy, h0 + hl, y0, wsw, f.o); break;
            default: attn_combine_warp<8, 2>(g, part, f.sinks, f.freq, f.n_rot, p, busy, h0 + hl, y0, wsw, f.o); break;
        }
    }
}

template <class V>
__global__ void __launch_bounds__(kMmaThreads, 1)
    attn_split_mma_kernel(attn_geom g, const float *__restrict__ q, const int64_t *__restrict__ pos,
                          float *__restrict__ part, attn_fuse f) {
    FATHOM_KTRACE_SCOPE(k_attn_split_mma);
    extern __shared__ __align__(16) unsigned char mma_raw[];
    const int d = g.d, ldk = d + kMmaPad;
    const mma_smem L = mma_smem_layout(d);
    __half *qh = reinterpret_cast<__half *>(mma_raw + L.qh), *ql = reinterpret_cast<__half *>(mma_raw + L.ql);
    __half *ks = reinterpret_cast<__half *>(mma_raw + L.ks);
    float *sq = reinterpret_cast<float *>(mma_raw + L.sq), *corr_s = reinterpret_cast<float *>(mma_raw + L.corr);
    __half *ph = reinterpret_cast<__half *>(mma_raw + L.ph), *pl = reinterpret_cast<__half *>(mma_raw + L.pl);
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, gq = lane >> 2, tq = lane & 3;
    const int lr = lane & 7, li = lane >> 3;  // ldmatrix: row within matrix, matrix index
    const int mt = warp % kMmaTiles, quarter = warp / kMmaTiles, dq = d / kMmaKParts;  // head tile, d quarter
    const int hs = tid >> 3, rq = tid & 7;                               // softmax: head, row quad
    const int h0 = blockIdx.y * kMmaHeads;
    pdl_wait();  // q, the rows and pos come from the preceding kernels (a no-op without PDL)
    // Two launches: the combine may be scheduled now (it waits for this grid in its pdl_wait); the
    // fused form triggers only after its barrier, so no dependent takes the SMs its grid needs.
    if (!f.sync) pdl_launch_dependents();
    const int64_t p = *pos;
    const attn_span sp = attn_span_at(g, p);
    const auto [r0, r1] = attn_split_at(sp, g.n_split);
    if (r0 >= r1) return;  // block-uniform: an idle split (the combine does not read it)
    // q's loads, the first tile's rows (cp.async: in flight until the wait below), then q hi / lo
    {
        float4 qv[kQIt];
        mma_load_q(q, g.n_head, d, h0, qv);
        mma_stage_rows<V>(g, sp, r0, static_cast<int>(r1 - r0 < kMmaRows ? r1 - r0 : kMmaRows), ks, ldk);
        mma_store_q(qv, d, qh, ql, ldk);
    }
    const int nj = d / 32;  // n8 tiles of the warp's d / 4 output dims
    float acc[kMaxD / 32][4];
#pragma unroll
    for (int j = 0; j < kMaxD / 32; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.0f;
    float m_run = -INFINITY, l_run = 0.0f;  // head hs (softmax role)
    for (int64_t t0 = r0; t0 < r1; t0 += kMmaRows) {
        const int nt = static_cast<int>(r1 - t0 < kMmaRows ? r1 - t0 : kMmaRows);
        if (t0 != r0) {
            __syncthreads();  // the previous tile's rows, P and corr are consumed
            mma_stage_rows<V>(g, sp, t0, nt, ks, ldk);
        }
        mma_cp_async_wait_all();
        __syncthreads();  // the tile (and, first time, q) visible to the block
        {  // partial scores: head tile mt x rows 0..31 over the dims of `quarter`
            float sc[4][4];
#pragma unroll
            for (int j = 0; j < 4; ++j) sc[j][0] = sc[j][1] = sc[j][2] = sc[j][3] = 0.0f;
            for (int k0 = quarter * dq; k0 < (quarter + 1) * dq; k0 += 16) {
                uint32_t ah[4], al[4];
                const int ao = (16 * mt + lr + 8 * (li & 1)) * ldk + k0 + 8 * (li >> 1);
                ldsm_x4(ah, qh + ao);
                ldsm_x4(al, ql + ao);
#pragma unroll
                for (int np = 0; np < 2; ++np) {  // n8 tiles 2 np (b[0], b[1]) and 2 np + 1 (b[2], b[3])
                    uint32_t b[4];
                    ldsm_x4(b, ks + (16 * np + lr + 8 * (li >> 1)) * ldk + k0 + 8 * (li & 1));
                    mma_hi_lo_x2(sc[2 * np], sc[2 * np + 1], ah, al, b);
                }
            }
            float *s = sq + static_cast<size_t>(quarter) * kMmaHeads * kMmaSld;
#pragma unroll
            for (int j = 0; j < 4; ++j) {  // C: rows gq, gq + 8 (heads), cols 8 j + 2 tq, + 1 (rows)
                *reinterpret_cast<float2 *>(s + (16 * mt + gq) * kMmaSld + 8 * j + 2 * tq) =
                    make_float2(sc[j][0], sc[j][1]);
                *reinterpret_cast<float2 *>(s + (16 * mt + gq + 8) * kMmaSld + 8 * j + 2 * tq) =
                    make_float2(sc[j][2], sc[j][3]);
            }
        }
        __syncthreads();
        {  // online softmax of head hs over rows 4 rq .. + 3 (rows >= nt: -inf, p = 0)
            float4 t = *reinterpret_cast<const float4 *>(sq + hs * kMmaSld + 4 * rq);
#pragma unroll
            for (int k = 1; k < kMmaKParts; ++k) {
                const float4 u = *reinterpret_cast<const float4 *>(sq + (k * kMmaHeads + hs) * kMmaSld + 4 * rq);
                t.x += u.x;
                t.y += u.y;
                t.z += u.z;
                t.w += u.w;
            }
            float s[4] = {t.x, t.y, t.z, t.w};
            float mx = -INFINITY;
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                s[i] = 4 * rq + i < nt ? s[i] * g.scale : -INFINITY;
                mx = fmaxf(mx, s[i]);
            }
            for (int o = 1; o < 8; o <<= 1) mx = fmaxf(mx, __shfl_xor_sync(kFull, mx, o));
            const float m_new = fmaxf(m_run, mx);  // finite: nt >= 1
            const float corr = expf(m_run - m_new);  // 0 on the first tile (m_run = -inf)
            float p[4], ps = 0.0f;
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                p[i] = s[i] == -INFINITY ? 0.0f : expf(s[i] - m_new);
                ps += p[i];
            }
            for (int o = 1; o < 8; o <<= 1) ps += __shfl_xor_sync(kFull, ps, o);
            l_run = l_run * corr + ps;
            m_run = m_new;
            if (rq == 0) corr_s[hs] = corr;
            put_hi_lo(ph + hs * kMmaSld + 4 * rq, pl + hs * kMmaSld + 4 * rq, p[0], p[1]);
            put_hi_lo(ph + hs * kMmaSld + 4 * rq + 2, pl + hs * kMmaSld + 4 * rq + 2, p[2], p[3]);
        }
        __syncthreads();
        {  // acc [head tile mt, dims of `quarter`] = acc * corr + P V
            mma_scale_rows(acc, corr_s[16 * mt + gq], corr_s[16 * mt + gq + 8]);
            const int kk_end = (nt + 15) / 16;  // k16 steps holding valid rows (the rest have p = 0)
            const int dw0 = quarter * dq;
            for (int kk = 0; kk < kk_end; ++kk) {
                uint32_t ah[4], al[4];
                const int ao = (16 * mt + lr + 8 * (li & 1)) * kMmaSld + 16 * kk + 8 * (li >> 1);
                ldsm_x4(ah, ph + ao);
                ldsm_x4(al, pl + ao);
                const __half *v0 = ks + (16 * kk + lr + 8 * (li & 1)) * ldk + dw0 + 8 * (li >> 1);
#pragma unroll
                for (int jp = 0; jp < kMaxD / 64; ++jp)  // n8 tiles 2 jp (b[0], b[1]), 2 jp + 1 (b[2], b[3])
                    if (2 * jp < nj) {
                        uint32_t b[4];
                        ldsm_x4_trans(b, v0 + 16 * jp);
                        mma_hi_lo_x2(acc[2 * jp], acc[2 * jp + 1], ah, al, b);
                    }
            }
        }
    }
    // partials in the f32 kernel's layout: acc at part[(split * n_head + h) * d], (m, l) after them
    const size_t ml0 = static_cast<size_t>(g.n_split) * g.n_head * d;
#pragma unroll
    for (int hk = 0; hk < 2; ++hk) {
        const int h = h0 + 16 * mt + gq + 8 * hk;
        if (h >= g.n_head) continue;
        float *pp = part + (static_cast<size_t>(blockIdx.x) * g.n_head + h) * d + quarter * dq + 2 * tq;
#pragma unroll
        for (int j = 0; j < kMaxD / 32; ++j)
            if (j < nj) *reinterpret_cast<float2 *>(pp + 8 * j) = make_float2(acc[j][2 * hk], acc[j][2 * hk + 1]);
    }
    if (rq == 0 && h0 + hs < g.n_head) {
        const size_t ph_i = static_cast<size_t>(blockIdx.x) * g.n_head + h0 + hs;
        part[ml0 + 2 * ph_i] = m_run;
        part[ml0 + 2 * ph_i + 1] = l_run;
    }
    if (!f.sync) return;
    // fused combine; sq is free: its last reads (the last tile's softmax) precede a barrier
    const int64_t n_tot = sp.n_raw + sp.n_comp, rps = attn_rps(n_tot, g.n_split);
    attn_fused_combine(g, part, f, p, static_cast<int>((n_tot + rps - 1) / rps), h0,
                       min(kMmaHeads, g.n_head - h0), sq);
}

// ---- argmax --------------------------------------------------------------------------------------------

constexpr int kArgmaxThreads = 1024;

// (value, index) pairs: larger value wins, ties (and -inf) to the lower index; NaN never wins.
__device__ __forceinline__ void argmax_merge(float &v, int64_t &i, float v2, int64_t i2) {
    if (v2 > v || (v2 == v && i2 < i)) {
        v = v2;
        i = i2;
    }
}

__global__ void __launch_bounds__(kArgmaxThreads)
    argmax_kernel(const float *__restrict__ x, int64_t n, int32_t *out, int64_t ld) {
    FATHOM_KTRACE_SCOPE(k_argmax);
    x += static_cast<int64_t>(blockIdx.x) * ld;  // row blockIdx.x (launch_argmax_rows)
    out += blockIdx.x;
    __shared__ float sv[kArgmaxThreads / 32];
    __shared__ int64_t si[kArgmaxThreads / 32];
    float v = -INFINITY;
    int64_t idx = INT64_MAX;
    for (int64_t k = threadIdx.x; k < n; k += blockDim.x) argmax_merge(v, idx, x[k], k);
    for (int o = 16; o > 0; o >>= 1) {
        const float v2 = __shfl_xor_sync(kFull, v, o);
        const int64_t i2 = __shfl_xor_sync(kFull, idx, o);
        argmax_merge(v, idx, v2, i2);
    }
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (lane == 0) {
        sv[warp] = v;
        si[warp] = idx;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int w = 1; w < static_cast<int>(blockDim.x >> 5); ++w) argmax_merge(v, idx, sv[w], si[w]);
        *out = idx == INT64_MAX ? 0 : static_cast<int32_t>(idx);  // all NaN: 0
    }
}

// ---- host checks ---------------------------------------------------------------------------------------

void check_rope(const rope_args &r, int dim, const char *what) {
    if (!r.freq || r.n_rot < 2 || r.n_rot % 2 != 0 || r.n_rot > dim)
        throw error(std::string("cuda ds4 ") + what + ": RoPE of " + std::to_string(r.n_rot) + " dims over " +
                    std::to_string(dim));
}

void check_qat(qat_kind k, int dim, int n_rot, const char *what) {
    if (k == qat_kind::fp8_nope && (dim - n_rot) % 64 != 0)
        throw error(std::string("cuda ds4 ") + what + ": FP8 QAT needs the non-RoPE dims (" +
                    std::to_string(dim - n_rot) + ") in whole blocks of 64");
    if (k == qat_kind::hadamard_fp4 && (dim < 32 || (dim & (dim - 1)) != 0))
        throw error(std::string("cuda ds4 ") + what +
                    ": Hadamard/FP4 QAT needs a power-of-two dim >= 32, got " + std::to_string(dim));
}

// Whether the tensor-core split kernel can run: sm_80+ (mma.m16n8k16, ldmatrix), its shared memory
// within both instances' dynamic limit (opt-in limit less static shared memory; raised once per
// device, cuda_smem.cuh), q 16-byte and part 8-byte aligned (vector loads / stores). The row checks
// (all f16, pair-aligned) are the caller's.
bool attn_mma_fits(int d, const float *q, const float *part) {
    if (reinterpret_cast<uintptr_t>(q) % 16 != 0 || reinterpret_cast<uintptr_t>(part) % 8 != 0) return false;
    const device_caps *caps = current_device_caps();  // null: error cleared, the f32 kernel runs
    if (!caps) return false;
    const size_t smem = mma_smem_layout(d).total;  // else the f32 kernel runs instead
    return caps->cc_major >= 8 && smem_opt_in<attn_split_mma_kernel<uint4>>(smem) &&
           smem_opt_in<attn_split_mma_kernel<uint32_t>>(smem);
}

// Whether a grid of n_blocks blocks of the tensor-core split kernel (smem bytes each) fits the device
// all at once (the occupancy calculator's blocks per SM x SMs): the fused combine's barrier needs every
// busy block resident together.
template <class Kernel>
bool attn_grid_resident(Kernel kernel, unsigned n_blocks, size_t smem) {
    const device_caps *caps = current_device_caps();  // null: error cleared
    int per_sm = 0;
    if (!caps || cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kMmaThreads, smem) != cudaSuccess) {
        (void)cudaGetLastError();
        return false;
    }
    return static_cast<int64_t>(per_sm) * caps->sm_count >= static_cast<int64_t>(n_blocks);
}

}  // namespace

void launch_head_norm_rope_batch(float *x, int64_t n_tok, int n_head, int hd, bool norm, float eps,
                                 const rope_args &rope, qat_kind qat, const int64_t *pos, cudaStream_t s) {
    if (n_tok < 1 || n_head < 1 || hd < 1 || hd > 8192 || n_tok * n_head > 0x7fffffff)
        throw error("cuda ds4 head_norm_rope: bad geometry");
    check_rope(rope, hd, "head_norm_rope");
    check_qat(qat, hd, rope.n_rot, "head_norm_rope");
    const int64_t n_rows = n_tok * n_head;  // heads of all tokens, token-major
    if (warp_row_fits(hd)) {  // one warp per head
        const unsigned grid = static_cast<unsigned>((n_rows + kWarpRowThreads / 32 - 1) / (kWarpRowThreads / 32));
        switch (hd / 64) {
            case 1: head_norm_rope_warp_kernel<1><<<grid, kWarpRowThreads, 0, s>>>(x, n_rows, n_head, norm, eps, rope.freq, rope.n_rot, qat, pos); break;
            case 2: head_norm_rope_warp_kernel<2><<<grid, kWarpRowThreads, 0, s>>>(x, n_rows, n_head, norm, eps, rope.freq, rope.n_rot, qat, pos); break;
            case 4: head_norm_rope_warp_kernel<4><<<grid, kWarpRowThreads, 0, s>>>(x, n_rows, n_head, norm, eps, rope.freq, rope.n_rot, qat, pos); break;
            default: head_norm_rope_warp_kernel<8><<<grid, kWarpRowThreads, 0, s>>>(x, n_rows, n_head, norm, eps, rope.freq, rope.n_rot, qat, pos); break;
        }
    } else {  // any other width: one block per head in shared memory
        head_norm_rope_kernel<<<static_cast<unsigned>(n_rows), kRowThreads, sizeof(float) * hd, s>>>(
            x, n_head, hd, norm, eps, rope.freq, rope.n_rot, qat, pos);
    }
    check_launch("head_norm_rope");
}

void launch_head_norm_rope(float *x, int n_head, int hd, bool norm, float eps, const rope_args &rope,
                           qat_kind qat, const int64_t *pos, cudaStream_t s) {
    launch_head_norm_rope_batch(x, 1, n_head, hd, norm, eps, rope, qat, pos, s);
}

namespace {

// KV rows of n_tok tokens: finished in place and stored to `dst` (window > 0: ring rows p mod window,
// decode; window == 0: chunk row t).
void kv_finish_tokens(float *kv, int64_t n_tok, int d, const float *norm_w, float eps, const rope_args &rope,
                      qat_kind qat, void *dst, bool dst_f16, size_t dst_stride, int window, const int64_t *pos,
                      cudaStream_t s) {
    if (n_tok < 1 || n_tok > 0x7fffffff || d < 1 || d > 8192 || window < 0 || !dst || !norm_w)
        throw error("cuda ds4 kv_finish_store: bad arguments");
    if (dst_stride < static_cast<size_t>(d) * (dst_f16 ? 2 : 4) || dst_stride % (dst_f16 ? 2 : 4) != 0)
        throw error("cuda ds4 kv_finish_store: row stride below the row size or misaligned");
    check_rope(rope, d, "kv_finish_store");
    check_qat(qat, d, rope.n_rot, "kv_finish_store");
    uint8_t *rb = static_cast<uint8_t *>(dst);
    if (n_tok == 1 && warp_row_fits(d) && (qat == qat_kind::none || qat == qat_kind::fp8_nope)) {
        // the decode step's row: one block of d / 64 warps, a 64-dim slice each (same bits)
        switch (d / 64) {
            case 1: kv_finish_store_split_kernel<1><<<1, 32, 0, s>>>(kv, norm_w, eps, rope.freq, rope.n_rot, qat, rb, dst_f16, dst_stride, window, pos); break;
            case 2: kv_finish_store_split_kernel<2><<<1, 64, 0, s>>>(kv, norm_w, eps, rope.freq, rope.n_rot, qat, rb, dst_f16, dst_stride, window, pos); break;
            case 4: kv_finish_store_split_kernel<4><<<1, 128, 0, s>>>(kv, norm_w, eps, rope.freq, rope.n_rot, qat, rb, dst_f16, dst_stride, window, pos); break;
            default: kv_finish_store_split_kernel<8><<<1, 256, 0, s>>>(kv, norm_w, eps, rope.freq, rope.n_rot, qat, rb, dst_f16, dst_stride, window, pos); break;
        }
    } else if (warp_row_fits(d)) {  // one warp per token, no block barrier
        const int per = kWarpRowThreads / 32;  // decode: a single warp
        const unsigned grid = static_cast<unsigned>((n_tok + per - 1) / per);
        const unsigned threads = n_tok == 1 ? 32u : static_cast<unsigned>(kWarpRowThreads);
        switch (d / 64) {
            case 1: kv_finish_store_warp_kernel<1><<<grid, threads, 0, s>>>(kv, n_tok, norm_w, eps, rope.freq, rope.n_rot, qat, rb, dst_f16, dst_stride, window, pos); break;
            case 2: kv_finish_store_warp_kernel<2><<<grid, threads, 0, s>>>(kv, n_tok, norm_w, eps, rope.freq, rope.n_rot, qat, rb, dst_f16, dst_stride, window, pos); break;
            case 4: kv_finish_store_warp_kernel<4><<<grid, threads, 0, s>>>(kv, n_tok, norm_w, eps, rope.freq, rope.n_rot, qat, rb, dst_f16, dst_stride, window, pos); break;
            default: kv_finish_store_warp_kernel<8><<<grid, threads, 0, s>>>(kv, n_tok, norm_w, eps, rope.freq, rope.n_rot, qat, rb, dst_f16, dst_stride, window, pos); break;
        }
    } else {  // one block per token
        kv_finish_store_kernel<<<static_cast<unsigned>(n_tok), kRowThreads, sizeof(float) * d, s>>>(
            kv, d, norm_w, eps, rope.freq, rope.n_rot, qat, rb, dst_f16, dst_stride, window, pos);
    }
    check_launch("kv_finish_store");
}

}  // namespace

void launch_kv_finish_store(float *kv, int d, const float *norm_w, float eps, const rope_args &rope,
                            qat_kind qat, void *ring, bool ring_f16, size_t ring_stride, int window,
                            const int64_t *pos, cudaStream_t s) {
    if (window < 1) throw error("cuda ds4 kv_finish_store: window must be positive");
    kv_finish_tokens(kv, 1, d, norm_w, eps, rope, qat, ring, ring_f16, ring_stride, window, pos, s);
}

void launch_kv_finish_batch(float *kv, int64_t n_tok, int d, const float *norm_w, float eps, const rope_args &rope,
                            qat_kind qat, void *rows, bool rows_f16, size_t row_stride, const int64_t *pos,
                            cudaStream_t s) {
    kv_finish_tokens(kv, n_tok, d, norm_w, eps, rope, qat, rows, rows_f16, row_stride, 0, pos, s);
}

void launch_ring_store_tail(const void *rows, size_t row_stride, int64_t n_tok, int d, int elem, void *ring,
                            size_t ring_stride, int window, const int64_t *pos, cudaStream_t s) {
    if (n_tok < 1 || d < 1 || window < 1 || (elem != 2 && elem != 4) || !rows || !ring)
        throw error("cuda ds4 ring_store_tail: bad arguments");
    const size_t row_bytes = static_cast<size_t>(d) * elem;
    if (row_stride < row_bytes || ring_stride < row_bytes || row_stride % elem != 0 || ring_stride % elem != 0 ||
        reinterpret_cast<uintptr_t>(rows) % elem != 0 || reinterpret_cast<uintptr_t>(ring) % elem != 0)
        throw error("cuda ds4 ring_store_tail: row strides below the row size or misaligned");
    // the last min(n_tok, window) positions: distinct ring rows, the only ones n_tok steps leave changed
    const int64_t n_tail = std::min<int64_t>(n_tok, window);
    const auto *src = static_cast<const uint8_t *>(rows);
    auto *dst = static_cast<uint8_t *>(ring);
    if (elem == 2)
        ring_store_tail_kernel<uint16_t><<<static_cast<unsigned>(n_tail), 128, 0, s>>>(src, row_stride, n_tok, n_tail, d, dst, ring_stride, window, pos);
    else
        ring_store_tail_kernel<uint32_t><<<static_cast<unsigned>(n_tail), 128, 0, s>>>(src, row_stride, n_tok, n_tail, d, dst, ring_stride, window, pos);
    check_launch("ring_store_tail");
}

namespace {

void check_compressor(const compressor_args &a) {
    if (a.ratio < 1 || a.dim < 1 || a.dim > kCompThreads || !a.ape || !a.norm_w || !a.state_kv ||
        !a.state_score || !a.rows)
        throw error("cuda ds4 compressor: bad arguments (ratio " + std::to_string(a.ratio) + ", dim " +
                    std::to_string(a.dim) + ", dim <= 512)");
    if (a.row_stride < static_cast<size_t>(a.dim) * (a.rows_f16 ? 2 : 4) ||
        a.row_stride % (a.rows_f16 ? 2 : 4) != 0)
        throw error("cuda ds4 compressor: row stride below the row size or misaligned");
    if (a.slots < (a.ratio == 4 ? 2 * a.ratio : a.ratio))
        throw error("cuda ds4 compressor: " + std::to_string(a.slots) + " frontier slots for ratio " +
                    std::to_string(a.ratio) + " (needs " + std::to_string(a.ratio == 4 ? 2 * a.ratio : a.ratio) + ")");
    check_rope(a.rope, a.dim, "compressor");
    check_qat(a.qat, a.dim, a.rope.n_rot, "compressor");
}

// Shared memory of a pooling block: row, max, exps.
size_t comp_smem(const compressor_args &a) {
    return sizeof(float) * static_cast<size_t>(a.dim) * (2 + kCompChunk);
}

}  // namespace

void launch_compressor_step(const compressor_args &a, const float *ca, const float *cg, const int64_t *pos,
                            uint32_t *err, cudaStream_t s) {
    check_compressor(a);
    const size_t smem = comp_smem(a);
    if (!warp_row_fits(a.dim)) {
        compressor_step_kernel<0><<<1, kCompThreads, smem, s>>>(a, ca, cg, pos, err);
    } else {
        switch (a.dim / 64) {
            case 1: compressor_step_kernel<1><<<1, kCompThreads, smem, s>>>(a, ca, cg, pos, err); break;
            case 2: compressor_step_kernel<2><<<1, kCompThreads, smem, s>>>(a, ca, cg, pos, err); break;
            case 4: compressor_step_kernel<4><<<1, kCompThreads, smem, s>>>(a, ca, cg, pos, err); break;
            default: compressor_step_kernel<8><<<1, kCompThreads, smem, s>>>(a, ca, cg, pos, err); break;
        }
    }
    check_launch("compressor");
}

void launch_compressor_chunk(const compressor_args &a, const float *ca, const float *cg, int64_t n_tok,
                             const int64_t *pos, uint32_t *err, cudaStream_t s) {
    check_compressor(a);
    if (n_tok < 1 || n_tok > 0x7fffffff) throw error("cuda ds4 compressor chunk: bad token count");
    // rows emitted: floor(p1 / R) - floor(p0 / R) <= ceil(n_tok / R) for any p0
    const unsigned rows = static_cast<unsigned>((n_tok + a.ratio - 1) / a.ratio);
    const size_t smem = comp_smem(a);
    if (!warp_row_fits(a.dim)) {
        compressor_chunk_rows_kernel<0><<<rows, kCompThreads, smem, s>>>(a, ca, cg, n_tok, pos, err);
    } else {
        switch (a.dim / 64) {
            case 1: compressor_chunk_rows_kernel<1><<<rows, kCompThreads, smem, s>>>(a, ca, cg, n_tok, pos, err); break;
            case 2: compressor_chunk_rows_kernel<2><<<rows, kCompThreads, smem, s>>>(a, ca, cg, n_tok, pos, err); break;
            case 4: compressor_chunk_rows_kernel<4><<<rows, kCompThreads, smem, s>>>(a, ca, cg, n_tok, pos, err); break;
            default: compressor_chunk_rows_kernel<8><<<rows, kCompThreads, smem, s>>>(a, ca, cg, n_tok, pos, err); break;
        }
    }
    check_launch("compressor chunk rows");
    const int width = (a.ratio == 4 ? 2 : 1) * a.dim;
    const int64_t n_state = static_cast<int64_t>(a.slots) * width;  // (slot, column) pairs
    compressor_chunk_state_kernel<<<static_cast<unsigned>((n_state + 255) / 256), 256, 0, s>>>(a, ca, cg, n_tok, pos);
    check_launch("compressor chunk state");
}

// [kAttnSyncFloats] fused-combine counters (uint32), then the partials: acc [n_split, n_head, d], (m, l)
// [n_split, n_head, 2]. The counters sit at a fixed offset so every layer kind sharing one buffer uses
// the same words (each call leaves them zero).
size_t attn_part_floats(const sparse_attn_args &a) {
    return kAttnSyncFloats + static_cast<size_t>(attn_splits(a)) * static_cast<size_t>(a.n_head) *
                                 (static_cast<size_t>(a.d) + 2);
}

size_t attn_part_sync_bytes() { return sizeof(float) * kAttnSyncFloats; }

void launch_sparse_sink_attention(const sparse_attn_args &a, const float *q, const int64_t *pos, float *part,
                                  float *o, cudaStream_t s) {
    if (a.n_head < 1 || a.d < 64 || a.d > kMaxD || a.d % 64 != 0 || a.window < 1 || (a.ring_rows != 0 && a.ring_rows < a.window) || !a.ring || !a.sinks)
        throw error("cuda ds4 attention: unsupported geometry (" + std::to_string(a.n_head) + " heads of " +
                    std::to_string(a.d) + ", d a multiple of 64 <= 512, window " + std::to_string(a.window) +
                    ")");
    if (a.ring_stride < static_cast<size_t>(a.d) * (a.ring_f16 ? 2 : 4) ||
        a.ring_stride % (a.ring_f16 ? 2 : 4) != 0)
        throw error("cuda ds4 attention: ring stride below the row size or misaligned");
    if (a.mode != comp_mode::none) {
        if (!a.comp || a.max_comp < 0 || a.comp_stride < static_cast<size_t>(a.d) * (a.comp_f16 ? 2 : 4) ||
            a.comp_stride % (a.comp_f16 ? 2 : 4) != 0)
            throw error("cuda ds4 attention: compressed rows missing, too narrow or misaligned");
        if (a.mode == comp_mode::all && a.ratio < 1)
            throw error("cuda ds4 attention: ratio must be positive");
        if (a.mode == comp_mode::list && (!a.sel || !a.n_sel))
            throw error("cuda ds4 attention: row list missing");
    }
    check_rope(a.rope, a.d, "attention");
    attn_geom g{};
    g.n_head = a.n_head;
    g.d = a.d;
    g.scale = a.scale;
    g.ring = static_cast<const uint8_t *>(a.ring);
    g.ring_stride = a.ring_stride;
    g.window = a.window;
    g.ring_rows = a.ring_rows > 0 ? a.ring_rows : a.window;
    g.ring_f16 = a.ring_f16;
    g.mode = a.mode;
    g.comp = static_cast<const uint8_t *>(a.comp);
    g.comp_stride = a.comp_stride;
    g.comp_f16 = a.comp_f16;
    g.ratio = a.ratio;
    g.sel = a.sel;
    g.n_sel = a.n_sel;
    g.max_comp = a.mode == comp_mode::none ? 0 : a.max_comp;
    g.n_split = attn_splits(a);
    auto pair_aligned = [](const void *base, size_t stride, bool f16) {
        const size_t al = f16 ? 4 : 8;
        return reinterpret_cast<uintptr_t>(base) % al == 0 && stride % al == 0;
    };
    g.pair_loads = pair_aligned(a.ring, a.ring_stride, a.ring_f16) &&
                   (a.mode == comp_mode::none || pair_aligned(a.comp, a.comp_stride, a.comp_f16));
    const bool all_f16 = a.ring_f16 && (a.mode == comp_mode::none || a.comp_f16);
    float *partials = part + kAttnSyncFloats;  // past the fused-combine counters
    if (a.tensor_cores && all_f16 && g.pair_loads && attn_mma_fits(a.d, q, part)) {  // tensor cores
        auto al16 = [](const void *base, size_t stride) {
            return reinterpret_cast<uintptr_t>(base) % 16 == 0 && stride % 16 == 0;
        };
        const bool vec16 =
            al16(a.ring, a.ring_stride) && (a.mode == comp_mode::none || al16(a.comp, a.comp_stride));
        const size_t smem = mma_smem_layout(a.d).total;
        const dim3 grid(static_cast<unsigned>(g.n_split),
                        static_cast<unsigned>((a.n_head + kMmaHeads - 1) / kMmaHeads));
        auto kernel = vec16 ? attn_split_mma_kernel<uint4> : attn_split_mma_kernel<uint32_t>;
        attn_fuse f{a.sinks, a.rope.freq, a.rope.n_rot, o, nullptr};
        if (a.fused_combine && 2 * grid.y <= static_cast<unsigned>(kAttnSyncFloats) &&
            attn_grid_resident(kernel, grid.x * grid.y, smem)) {
            // one launch (PDL: may start while the previous kernel drains), the combine folded in
            f.sync = reinterpret_cast<uint32_t *>(part);
            const cudaError_t e = launch_pdl(kernel, grid, dim3(kMmaThreads), smem, s, true, g, q, pos, partials, f);
            if (e != cudaSuccess)
                throw error(std::string("cuda ds4 attn attention (fused): launch failed: ") + cudaGetErrorString(e));
            check_launch("attention (tensor cores, fused combine)");
            return;
        }
        const cudaError_t e = launch_pdl(kernel, grid, dim3(kMmaThreads), smem, s, true, g, q, pos, partials, f);
        if (e != cudaSuccess)
            throw error(std::string("cuda ds4 attn attention split: launch failed: ") + cudaGetErrorString(e));
        check_launch("attention split (tensor cores)");
    } else {
        const dim3 grid(static_cast<unsigned>(g.n_split),
                        static_cast<unsigned>((a.n_head + kHeadsPerBlock - 1) / kHeadsPerBlock));
        // rows staged as f16 when every row the call can read is f16 (half the shared-memory traffic)
        if (all_f16)
            attn_split_kernel<__half><<<grid, kAttnThreads, sizeof(__half) * kTileRows * a.d, s>>>(g, q, pos, partials);
        else
            attn_split_kernel<float><<<grid, kAttnThreads, sizeof(float) * kTileRows * a.d, s>>>(g, q, pos, partials);
        check_launch("attention split");
    }
    const dim3 cgrid(static_cast<unsigned>(a.n_head),
                     static_cast<unsigned>((a.d / 2 + kCombineThreads - 1) / kCombineThreads));
    // PDL: scheduled while the split kernel runs, waiting for it in pdl_wait (the f32 split kernel
    // never triggers early, so there the launch simply follows it)
    const cudaError_t ce = launch_pdl(attn_combine_kernel, cgrid, dim3(kCombineThreads), 0, s, true, g,
                                      static_cast<const float *>(partials), a.sinks, a.rope.freq, a.rope.n_rot, pos, o);
    if (ce != cudaSuccess) throw error(std::string("cuda ds4 attn combine: launch failed: ") + cudaGetErrorString(ce));
    check_launch("attention combine");
}

void launch_gemv_grouped(dtype t, const void *W, size_t w_stride, int64_t K, int64_t rows_per_group,
                         int groups, const float *x, float *y, cudaStream_t s) {
    if (groups < 1 || rows_per_group < 1 || K < 16 || K % 16 != 0)
        throw error("cuda ds4 grouped gemv: bad geometry (K " + std::to_string(K) + ", " +
                    std::to_string(groups) + " groups of " + std::to_string(rows_per_group) + " rows)");
    // One GEMV per group over its row block (group inputs are K floats apart: 16-byte aligned as K % 16 ==
    // 0).
    for (int g = 0; g < groups; ++g)
        launch_gemv(t, static_cast<const uint8_t *>(W) + static_cast<size_t>(g) * rows_per_group * w_stride,
                    w_stride, K, rows_per_group, x + static_cast<int64_t>(g) * K, K, 1,
                    y + static_cast<int64_t>(g) * rows_per_group, rows_per_group, s);
    check_launch("grouped gemv");
}

void launch_argmax(const float *x, int64_t n, int32_t *out, cudaStream_t s) {
    if (n < 1 || n > 0x7fffffff) throw error("cuda ds4 argmax: n = " + std::to_string(n) + " out of range");
    argmax_kernel<<<1, kArgmaxThreads, 0, s>>>(x, n, out, 0);
    check_launch("argmax");
}

void launch_argmax_rows(const float *x, int64_t n, int rows, int64_t ld, int32_t *out, cudaStream_t s) {
    if (n < 1 || n > 0x7fffffff || rows < 1 || rows > 65535 || ld < n)
        throw error("cuda ds4 argmax: n = " + std::to_string(n) + ", " + std::to_string(rows) + " rows " +
                    std::to_string(ld) + " apart out of range");
    argmax_kernel<<<static_cast<unsigned>(rows), kArgmaxThreads, 0, s>>>(x, n, out, ld);
    check_launch("argmax");
}

}  // namespace fathom::cuda::ds4
