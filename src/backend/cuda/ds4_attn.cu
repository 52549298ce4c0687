// DS4 attention sublayer on CUDA for one decoded token (spec ../shared/reference/ds4-architecture.md
// sections 4 and 8): per-head query norm + RoPE (+ QAT), the KV row's norm/RoPE/FP8 into the raw
// ring, the KV compressors' frontier and row emission, sparse sink attention (split over rows,
// flash-decoding partials + a combine that applies the sink and the inverse RoPE), the grouped
// output GEMV and the logits argmax. Launchers: ds4_attn_kernels.h (the indexer top-k lives with the
// indexer kernels in ds4_indexer.cu).
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
// likely). Attention accumulates in f32 (scores per row: lanes then a warp tree; softmax online per
// split), so it matches the CPU's double-accumulated attend_with_sink to ~1e-6 relative.
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <string>

#include "backend/cuda/cuda_kernels.h"
#include "backend/cuda/ds4_attn_kernels.h"
#include "core/error.h"

namespace fathom::cuda::ds4 {
namespace {

constexpr unsigned kFull = 0xffffffffu;

void check_launch(const char *what) {
    const cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess)
        throw error(std::string("cuda ds4 attn ") + what + ": launch failed: " + cudaGetErrorString(e));
}

// ---- element-wise building blocks (block-cooperative on a shared-memory vector) ----------------------
// Every helper below is called by all threads of the block (blockDim a multiple of 32) and ends with
// __syncthreads(), so the vector is consistent on return.

__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(kFull, v, o));
    return v;
}
__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(kFull, v, o);
    return v;
}

// Block-wide double sum; every thread gets the same value (warp totals added in warp order).
__device__ double block_sum_d(double v, double *red) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(kFull, v, o);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nw = blockDim.x >> 5;
    __syncthreads();  // red may still be read by a previous call
    if (lane == 0) red[warp] = v;
    __syncthreads();
    double t = 0;
    for (int i = 0; i < nw; ++i) t += red[i];
    return t;
}

// x = x / sqrt(mean(x^2) + eps) * w (w may be null), as ds4::rms_norm.
__device__ void rms_norm_smem(float *x, int n, const float *__restrict__ w, float eps, double *red) {
    double ss = 0;
    for (int i = threadIdx.x; i < n; i += blockDim.x)
        ss += static_cast<double>(x[i]) * static_cast<double>(x[i]);
    ss = block_sum_d(ss, red);
    const float r = static_cast<float>(1.0 / sqrt(ss / static_cast<double>(n) + static_cast<double>(eps)));
    for (int i = threadIdx.x; i < n; i += blockDim.x)
        x[i] = w ? __fmul_rn(w[i], __fmul_rn(x[i], r)) : __fmul_rn(x[i], r);
    __syncthreads();
}

// Interleaved pairs (x[2i], x[2i+1]), i < n_rot / 2, rotated by +-float(pos) * freq[i] (ds4::rope_apply).
__device__ void rope_smem(float *x, const float *__restrict__ freq, int n_rot, int64_t pos, bool inverse) {
    const float fp = static_cast<float>(pos);
    for (int i = threadIdx.x; i < n_rot / 2; i += blockDim.x) {
        const float ang = __fmul_rn(fp, freq[i]);
        const float c = static_cast<float>(cos(static_cast<double>(ang)));
        float s = static_cast<float>(sin(static_cast<double>(ang)));
        if (inverse) s = -s;
        const float a = x[2 * i], b = x[2 * i + 1];
        x[2 * i] = __fsub_rn(__fmul_rn(a, c), __fmul_rn(b, s));
        x[2 * i + 1] = __fadd_rn(__fmul_rn(a, s), __fmul_rn(b, c));
    }
    __syncthreads();
}

// ds4::fp8_e4m3_round / fp4_e2m1_round: |x| on the grid of step 2^(floor(log2|x|) - mbits), exponent
// floored at emin, clamped at maxv, ties to even (rintf). Divisions by the power-of-two step are exact.
__device__ __forceinline__ float round_minifloat(float x, int mbits, int emin, float maxv) {
    float a = fabsf(x);
    if (!(a > 0.0f)) return x;
    a = fminf(a, maxv);
    int e = 0;
    frexpf(a, &e);
    const int ex = max(e - 1, emin);
    const float step = ldexpf(1.0f, ex - mbits);
    const float r = fminf(__fmul_rn(rintf(__fdiv_rn(a, step)), step), maxv);
    return copysignf(r, x);
}

// ds4::pow2_ceil: 2^ceil(log2 v), exact.
__device__ __forceinline__ float pow2_ceil_dev(float v) {
    int e = 0;
    const float m = frexpf(v, &e);
    return m == 0.5f ? ldexpf(1.0f, e - 1) : ldexpf(1.0f, e);
}

// Block round trip of x[0, n) in blocks of `block` (32 or 64), one warp per block (ds4 block_round_trip).
__device__ void block_round_trip_smem(float *x, int n, int block, float fmt_max, float amax_floor, int mbits,
                                      int emin) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nw = blockDim.x >> 5, per = block / 32;
    for (int b = warp; b * block < n; b += nw) {  // warp-uniform loop
        float v[2] = {0.0f, 0.0f}, amax = 0.0f;
        for (int k = 0; k < per; ++k) {
            v[k] = x[b * block + lane + 32 * k];
            amax = fmaxf(amax, fabsf(v[k]));
        }
        amax = fmaxf(warp_max(amax), amax_floor);
        const float s = pow2_ceil_dev(__fdiv_rn(amax, fmt_max));
        for (int k = 0; k < per; ++k) {
            const float c = fminf(fmaxf(__fdiv_rn(v[k], s), -fmt_max), fmt_max);
            x[b * block + lane + 32 * k] = __fmul_rn(s, round_minifloat(c, mbits, emin, fmt_max));
        }
    }
    __syncthreads();
}

// Normalised Walsh-Hadamard transform (Sylvester order) of x[0, n), n a power of two
// (ds4::hadamard_normalised).
__device__ void hadamard_smem(float *x, int n) {
    for (int h = 1; h < n; h *= 2) {
        for (int p = threadIdx.x; p < n / 2; p += blockDim.x) {
            const int i = (p / h) * 2 * h + p % h;
            const float a = x[i], b = x[i + h];
            x[i] = __fadd_rn(a, b);
            x[i + h] = __fsub_rn(a, b);
        }
        __syncthreads();
    }
    const float s = static_cast<float>(1.0 / sqrt(static_cast<double>(n)));
    for (int i = threadIdx.x; i < n; i += blockDim.x) x[i] = __fmul_rn(x[i], s);
    __syncthreads();
}

// The QAT round trip of a row of n dims whose last n_rot are RoPE dims (spec 8).
__device__ void qat_smem(float *x, int n, int n_rot, qat_kind k) {
    if (k == qat_kind::fp8_nope) {
        block_round_trip_smem(x, n - n_rot, 64, 448.0f, 1e-4f, 3, -6);
    } else if (k == qat_kind::hadamard_fp4) {
        hadamard_smem(x, n);
        block_round_trip_smem(x, n, 32, 6.0f, ldexpf(6.0f, -126), 1, 0);
    }
}

// ---- query heads, KV row -----------------------------------------------------------------------------

constexpr int kRowThreads = 128;

// One block per head of x [n_head, hd].
__global__ void __launch_bounds__(kRowThreads)
    head_norm_rope_kernel(float *x, int hd, bool norm, float eps, const float *__restrict__ freq, int n_rot,
                          qat_kind qat, const int64_t *__restrict__ pos) {
    extern __shared__ float sx[];  // [hd]
    __shared__ double red[32];
    float *xh = x + static_cast<size_t>(blockIdx.x) * hd;
    for (int i = threadIdx.x; i < hd; i += blockDim.x) sx[i] = xh[i];
    __syncthreads();
    if (norm) rms_norm_smem(sx, hd, nullptr, eps, red);
    rope_smem(sx + hd - n_rot, freq, n_rot, *pos, false);
    qat_smem(sx, hd, n_rot, qat);
    for (int i = threadIdx.x; i < hd; i += blockDim.x) xh[i] = sx[i];
}

// One block: kv [d] finished in place and stored into ring row *pos mod window.
__global__ void __launch_bounds__(kRowThreads)
    kv_finish_store_kernel(float *kv, int d, const float *__restrict__ norm_w, float eps,
                           const float *__restrict__ freq, int n_rot, qat_kind qat, uint8_t *ring,
                           bool ring_f16, size_t ring_stride, int window, const int64_t *__restrict__ pos) {
    extern __shared__ float sx[];  // [d]
    __shared__ double red[32];
    const int64_t p = *pos;
    for (int i = threadIdx.x; i < d; i += blockDim.x) sx[i] = kv[i];
    __syncthreads();
    rms_norm_smem(sx, d, norm_w, eps, red);
    rope_smem(sx + d - n_rot, freq, n_rot, p, false);
    qat_smem(sx, d, n_rot, qat);
    uint8_t *row = ring + static_cast<size_t>(p % window) * ring_stride;
    for (int i = threadIdx.x; i < d; i += blockDim.x) {
        kv[i] = sx[i];
        if (ring_f16)
            reinterpret_cast<__half *>(row)[i] = __float2half_rn(sx[i]);
        else
            reinterpret_cast<float *>(row)[i] = sx[i];
    }
}

// ---- compressor ----------------------------------------------------------------------------------------

constexpr int kCompThreads = 256;

// One block. Thread t owns channels j = t, t + blockDim, ... of [0, dim): it writes columns j and (overlap)
// dim + j of the frontier, pools channel j (those same columns) and shifts them, so the frontier needs
// no synchronisation between threads; the pooled row is then finished block-wide in shared memory.
__global__ void __launch_bounds__(kCompThreads)
    compressor_step_kernel(compressor_args a, const float *__restrict__ ca, const float *__restrict__ cg,
                           const int64_t *__restrict__ pos, uint32_t *err) {
    extern __shared__ float row[];  // [dim]
    __shared__ double red[32];
    const int R = a.ratio, dp = a.dim;
    const bool overlap = R == 4;
    const int width = (overlap ? 2 : 1) * dp, n_cand = overlap ? 2 * R : R;
    const int64_t p = *pos;
    const int phase = static_cast<int>(p % R);
    const size_t slot = static_cast<size_t>(overlap ? R + phase : phase);
    const float *ape = a.ape + static_cast<size_t>(phase) * width;
    for (int j = threadIdx.x; j < width; j += blockDim.x) {
        a.state_kv[slot * width + j] = ca[j];
        a.state_score[slot * width + j] = __fadd_rn(cg[j], ape[j]);
    }
    if ((p + 1) % R != 0) return;  // block-uniform: no row this token
    __syncthreads();
    for (int j = threadIdx.x; j < dp; j += blockDim.x) {
        // candidate t: slot t, column j (overlap: column dp + j for the current block's slots t >= R)
        auto at = [&](int t) {
            return static_cast<size_t>(t) * width + static_cast<size_t>(overlap && t >= R ? dp + j : j);
        };
        float mx = -INFINITY;
        for (int t = 0; t < n_cand; ++t) mx = fmaxf(mx, a.state_score[at(t)]);
        float sum = 0.0f;
        for (int t = 0; t < n_cand; ++t)
            sum = __fadd_rn(
                sum, static_cast<float>(exp(static_cast<double>(__fsub_rn(a.state_score[at(t)], mx)))));
        float acc = 0.0f;
        for (int t = 0; t < n_cand; ++t) {
            const float e = static_cast<float>(exp(static_cast<double>(__fsub_rn(a.state_score[at(t)], mx))));
            const float wt = __fdiv_rn(e, sum);
            if (wt != 0.0f) acc = __fadd_rn(acc, __fmul_rn(a.state_kv[at(t)], wt));  // skips empty candidates
        }
        row[j] = acc;
        if (overlap)  // the current block (slots R..2R-1) becomes the previous one, columns j and dp + j
            for (int t = 0; t < R; ++t)
                for (int half = 0; half < 2; ++half) {
                    const int col = j + half * dp;
                    const size_t src = static_cast<size_t>(R + t) * width + col,
                                 dst = static_cast<size_t>(t) * width + col;
                    a.state_kv[dst] = a.state_kv[src];
                    a.state_score[dst] = a.state_score[src];
                }
    }
    __syncthreads();
    rms_norm_smem(row, dp, a.norm_w, a.eps, red);
    rope_smem(row + dp - a.rope.n_rot, a.rope.freq, a.rope.n_rot, p + 1 - R, false);
    qat_smem(row, dp, a.rope.n_rot, a.qat);
    const int64_t b = (p + 1) / R - 1;
    if (b >= a.max_rows) {
        if (threadIdx.x == 0 && err) atomicOr(err, err_comp_row);
        return;
    }
    uint8_t *dst = static_cast<uint8_t *>(a.rows) + static_cast<size_t>(b) * a.row_stride;
    for (int j = threadIdx.x; j < dp; j += blockDim.x) {
        if (a.rows_f16)
            reinterpret_cast<__half *>(dst)[j] = __float2half_rn(row[j]);
        else
            reinterpret_cast<float *>(dst)[j] = row[j];
    }
}

// ---- sparse sink attention -----------------------------------------------------------------------------
// Candidate rows t in [0, n_raw + n_comp): raw window rows first (t < n_raw: ring row (first + t) mod
// window), then compressed rows. Split kernel: grid (n_split, ceil(n_head / 16)); block = 8 warps, warp w
// owns heads h0 + 2w, h0 + 2w + 1 (query and output accumulator in registers, lane l holding dims
// l + 32 j). Rows [split * rows_per_split, +rows_per_split) are staged 16 at a time as f32 in shared
// memory and shared by the block's 16 heads (rows_per_split = max(ceil(n / n_split), 16) for this
// token's n rows, n_split fixed by the capacity); scores are lane-partial dot products reduced by warp
// shuffles, softmax is online per head (max m, denominator l, unnormalised output acc). Partials
// part[(split * n_head + h) * (d + 2)] = acc [d], m, l; an empty split writes only m = -inf, l = 0.
// Combine kernel: one block per head merges the splits with the sink logit in the denominator,
// applies the inverse RoPE and writes o.

constexpr int kAttnWarps = 8, kAttnThreads = 32 * kAttnWarps, kHeadsPerWarp = 2;
constexpr int kHeadsPerBlock = kAttnWarps * kHeadsPerWarp, kTileRows = 16, kMaxD = 512, kMaxJ = kMaxD / 32;
constexpr int kMaxSplits = 64, kMinRowsPerSplit = kTileRows, kCombineThreads = 128;

struct attn_geom {
    int n_head, d;
    float scale;
    const uint8_t *ring;
    size_t ring_stride;
    int window;
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

// Row t of the candidate list: its bytes and whether it is f16.
__device__ __forceinline__ const uint8_t *attn_row(const attn_geom &g, const attn_span &sp, int64_t t,
                                                   bool &f16) {
    if (t < sp.n_raw) {
        f16 = g.ring_f16;
        return g.ring + static_cast<size_t>((sp.first + t) % g.window) * g.ring_stride;
    }
    const int64_t c = t - sp.n_raw;
    const int64_t r = g.mode == comp_mode::all ? c : static_cast<int64_t>(g.sel[c]);
    f16 = g.comp_f16;
    return g.comp + static_cast<size_t>(r) * g.comp_stride;
}

__global__ void __launch_bounds__(kAttnThreads)
    attn_split_kernel(attn_geom g, const float *__restrict__ q, const int64_t *__restrict__ pos,
                      float *__restrict__ part) {
    extern __shared__ float tile[];  // [kTileRows, d]
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int d = g.d, nj = d / 32;
    const size_t ps = static_cast<size_t>(d) + 2;
    const int h0 = blockIdx.y * kHeadsPerBlock;
    const attn_span sp = attn_span_at(g, *pos);
    const int64_t n_tot = sp.n_raw + sp.n_comp;
    // rows per split from this token's count (at least one tile), so short contexts still spread
    // over many blocks; n_split * rows_per_split capacity >= window + max_comp >= n_tot (host).
    const int64_t per = (n_tot + g.n_split - 1) / g.n_split;
    const int64_t rps = per > kTileRows ? per : kTileRows;
    const int64_t r0 = static_cast<int64_t>(blockIdx.x) * rps;
    const int64_t r1 = r0 + rps < n_tot ? r0 + rps : n_tot;
    if (r0 >= r1) {  // block-uniform: nothing to attend in this split
        for (int i = threadIdx.x; i < kHeadsPerBlock; i += blockDim.x)
            if (h0 + i < g.n_head) {
                float *pp = part + (static_cast<size_t>(blockIdx.x) * g.n_head + h0 + i) * ps;
                pp[d] = -INFINITY;
                pp[d + 1] = 0.0f;
            }
        return;
    }
    float qr[kHeadsPerWarp][kMaxJ], acc[kHeadsPerWarp][kMaxJ], m[kHeadsPerWarp], l[kHeadsPerWarp];
#pragma unroll
    for (int hh = 0; hh < kHeadsPerWarp; ++hh) {
        const int h = h0 + warp * kHeadsPerWarp + hh;
#pragma unroll
        for (int j = 0; j < kMaxJ; ++j) {
            qr[hh][j] = h < g.n_head && j < nj ? q[static_cast<size_t>(h) * d + lane + 32 * j] : 0.0f;
            acc[hh][j] = 0.0f;
        }
        m[hh] = -INFINITY;
        l[hh] = 0.0f;
    }
    for (int64_t t0 = r0; t0 < r1; t0 += kTileRows) {
        const int nt = static_cast<int>(r1 - t0 < kTileRows ? r1 - t0 : kTileRows);
        __syncthreads();  // the previous tile is consumed
        for (int r = warp; r < nt; r += kAttnWarps) {
            bool f16 = false;
            const uint8_t *src = attn_row(g, sp, t0 + r, f16);
            float *dst = tile + r * d;
            if (f16)
                for (int i = lane; i < d; i += 32)
                    dst[i] = __half2float(reinterpret_cast<const __half *>(src)[i]);
            else
                for (int i = lane; i < d; i += 32) dst[i] = reinterpret_cast<const float *>(src)[i];
        }
        __syncthreads();
        // scores: lane r keeps row r's score (lanes >= nt: -inf)
        float s_mine[kHeadsPerWarp];
#pragma unroll
        for (int hh = 0; hh < kHeadsPerWarp; ++hh) s_mine[hh] = -INFINITY;
        for (int r = 0; r < nt; ++r) {
            const float *kr = tile + r * d;
            float dot[kHeadsPerWarp] = {};
#pragma unroll
            for (int j = 0; j < kMaxJ; ++j)
                if (j < nj) {
                    const float kv = kr[lane + 32 * j];
#pragma unroll
                    for (int hh = 0; hh < kHeadsPerWarp; ++hh) dot[hh] = fmaf(qr[hh][j], kv, dot[hh]);
                }
#pragma unroll
            for (int hh = 0; hh < kHeadsPerWarp; ++hh) {
                const float s = warp_sum(dot[hh]) * g.scale;
                if (lane == r) s_mine[hh] = s;
            }
        }
        float pr[kHeadsPerWarp];
#pragma unroll
        for (int hh = 0; hh < kHeadsPerWarp; ++hh) {
            const float m_new = fmaxf(m[hh], warp_max(s_mine[hh]));  // finite: nt >= 1 rows
            const float corr = expf(m[hh] - m_new);                  // 0 on the first tile (m = -inf)
            pr[hh] = lane < nt ? expf(s_mine[hh] - m_new) : 0.0f;
            l[hh] = l[hh] * corr + warp_sum(pr[hh]);
            m[hh] = m_new;
#pragma unroll
            for (int j = 0; j < kMaxJ; ++j) acc[hh][j] *= corr;
        }
        for (int r = 0; r < nt; ++r) {
            const float *kr = tile + r * d;
            float p_r[kHeadsPerWarp];
#pragma unroll
            for (int hh = 0; hh < kHeadsPerWarp; ++hh) p_r[hh] = __shfl_sync(kFull, pr[hh], r);
#pragma unroll
            for (int j = 0; j < kMaxJ; ++j)
                if (j < nj) {
                    const float kv = kr[lane + 32 * j];
#pragma unroll
                    for (int hh = 0; hh < kHeadsPerWarp; ++hh) acc[hh][j] = fmaf(p_r[hh], kv, acc[hh][j]);
                }
        }
    }
#pragma unroll
    for (int hh = 0; hh < kHeadsPerWarp; ++hh) {
        const int h = h0 + warp * kHeadsPerWarp + hh;
        if (h >= g.n_head) continue;
        float *pp = part + (static_cast<size_t>(blockIdx.x) * g.n_head + h) * ps;
#pragma unroll
        for (int j = 0; j < kMaxJ; ++j)
            if (j < nj) pp[lane + 32 * j] = acc[hh][j];
        if (lane == 0) {
            pp[d] = m[hh];
            pp[d + 1] = l[hh];
        }
    }
}

// One block per head: o_h = sum_s e^(m_s - M) acc_s / (e^(sink - M) + sum_s e^(m_s - M) l_s), M the
// largest of the sink and the m_s; empty splits (m_s = -inf) are skipped without reading acc. Then the
// inverse RoPE of the last n_rot dims at *pos.
__global__ void __launch_bounds__(kCombineThreads)
    attn_combine_kernel(const float *__restrict__ part, int n_split, int n_head, int d,
                        const float *__restrict__ sinks, const float *__restrict__ freq, int n_rot,
                        const int64_t *__restrict__ pos, float *__restrict__ o) {
    extern __shared__ float so[];  // [d]
    __shared__ float ws[kMaxSplits];
    __shared__ float s_denom;
    const int h = blockIdx.x;
    const size_t ps = static_cast<size_t>(d) + 2;
    const float sink = sinks[h];
    if (threadIdx.x == 0) {
        float M = sink;
        for (int s = 0; s < n_split; ++s) M = fmaxf(M, part[(static_cast<size_t>(s) * n_head + h) * ps + d]);
        float den = expf(sink - M);
        for (int s = 0; s < n_split; ++s) {
            const float *pp = part + (static_cast<size_t>(s) * n_head + h) * ps;
            const float ms = pp[d];
            ws[s] = ms == -INFINITY ? 0.0f : expf(ms - M);
            if (ws[s] != 0.0f) den += ws[s] * pp[d + 1];
        }
        s_denom = den;
    }
    __syncthreads();
    const float inv = 1.0f / s_denom;
    for (int i = threadIdx.x; i < d; i += blockDim.x) {
        float a = 0.0f;
        for (int s = 0; s < n_split; ++s)
            if (ws[s] != 0.0f) a += ws[s] * part[(static_cast<size_t>(s) * n_head + h) * ps + i];
        so[i] = a * inv;
    }
    __syncthreads();
    rope_smem(so + d - n_rot, freq, n_rot, *pos, true);
    for (int i = threadIdx.x; i < d; i += blockDim.x) o[static_cast<size_t>(h) * d + i] = so[i];
}

// Rows per split at full capacity (window + max_comp rows): at most kMaxSplits splits, at least
// kMinRowsPerSplit rows each, a multiple of the tile height. Only the split count (a function of the
// arguments alone, so attn_part_floats agrees with the launch) is taken from it.
int64_t attn_rows_per_split(const sparse_attn_args &a) {
    const int64_t max_rows = a.window + (a.mode == comp_mode::none ? 0 : a.max_comp);
    int64_t rps = (max_rows + kMaxSplits - 1) / kMaxSplits;
    rps = std::max<int64_t>(rps, kMinRowsPerSplit);
    return (rps + kTileRows - 1) / kTileRows * kTileRows;
}
int attn_splits(const sparse_attn_args &a) {
    const int64_t max_rows = a.window + (a.mode == comp_mode::none ? 0 : a.max_comp);
    const int64_t rps = attn_rows_per_split(a);
    return static_cast<int>(std::max<int64_t>(1, (max_rows + rps - 1) / rps));
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
    argmax_kernel(const float *__restrict__ x, int64_t n, int32_t *out) {
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

}  // namespace

void launch_head_norm_rope(float *x, int n_head, int hd, bool norm, float eps, const rope_args &rope,
                           qat_kind qat, const int64_t *pos, cudaStream_t s) {
    if (n_head < 1 || hd < 1 || hd > 8192) throw error("cuda ds4 head_norm_rope: bad geometry");
    check_rope(rope, hd, "head_norm_rope");
    check_qat(qat, hd, rope.n_rot, "head_norm_rope");
    head_norm_rope_kernel<<<static_cast<unsigned>(n_head), kRowThreads, sizeof(float) * hd, s>>>(
        x, hd, norm, eps, rope.freq, rope.n_rot, qat, pos);
    check_launch("head_norm_rope");
}

void launch_kv_finish_store(float *kv, int d, const float *norm_w, float eps, const rope_args &rope,
                            qat_kind qat, void *ring, bool ring_f16, size_t ring_stride, int window,
                            const int64_t *pos, cudaStream_t s) {
    if (d < 1 || d > 8192 || window < 1 || !ring || !norm_w)
        throw error("cuda ds4 kv_finish_store: bad arguments");
    if (ring_stride < static_cast<size_t>(d) * (ring_f16 ? 2 : 4) || ring_stride % (ring_f16 ? 2 : 4) != 0)
        throw error("cuda ds4 kv_finish_store: ring stride below the row size or misaligned");
    check_rope(rope, d, "kv_finish_store");
    check_qat(qat, d, rope.n_rot, "kv_finish_store");
    kv_finish_store_kernel<<<1, kRowThreads, sizeof(float) * d, s>>>(
        kv, d, norm_w, eps, rope.freq, rope.n_rot, qat, static_cast<uint8_t *>(ring), ring_f16, ring_stride,
        window, pos);
    check_launch("kv_finish_store");
}

void launch_compressor_step(const compressor_args &a, const float *ca, const float *cg, const int64_t *pos,
                            uint32_t *err, cudaStream_t s) {
    if (a.ratio < 1 || a.dim < 1 || a.dim > 512 || !a.ape || !a.norm_w || !a.state_kv || !a.state_score ||
        !a.rows)
        throw error("cuda ds4 compressor: bad arguments (ratio " + std::to_string(a.ratio) + ", dim " +
                    std::to_string(a.dim) + ", dim <= 512)");
    if (a.row_stride < static_cast<size_t>(a.dim) * (a.rows_f16 ? 2 : 4) ||
        a.row_stride % (a.rows_f16 ? 2 : 4) != 0)
        throw error("cuda ds4 compressor: row stride below the row size or misaligned");
    check_rope(a.rope, a.dim, "compressor");
    check_qat(a.qat, a.dim, a.rope.n_rot, "compressor");
    compressor_step_kernel<<<1, kCompThreads, sizeof(float) * a.dim, s>>>(a, ca, cg, pos, err);
    check_launch("compressor");
}

size_t attn_part_floats(const sparse_attn_args &a) {
    return static_cast<size_t>(attn_splits(a)) * static_cast<size_t>(a.n_head) *
           (static_cast<size_t>(a.d) + 2);
}

void launch_sparse_sink_attention(const sparse_attn_args &a, const float *q, const int64_t *pos, float *part,
                                  float *o, cudaStream_t s) {
    if (a.n_head < 1 || a.d < 32 || a.d > kMaxD || a.d % 32 != 0 || a.window < 1 || !a.ring || !a.sinks)
        throw error("cuda ds4 attention: unsupported geometry (" + std::to_string(a.n_head) + " heads of " +
                    std::to_string(a.d) + ", d a multiple of 32 <= 512, window " + std::to_string(a.window) +
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
    const dim3 grid(static_cast<unsigned>(g.n_split),
                    static_cast<unsigned>((a.n_head + kHeadsPerBlock - 1) / kHeadsPerBlock));
    attn_split_kernel<<<grid, kAttnThreads, sizeof(float) * kTileRows * a.d, s>>>(g, q, pos, part);
    check_launch("attention split");
    attn_combine_kernel<<<static_cast<unsigned>(a.n_head), kCombineThreads, sizeof(float) * a.d, s>>>(
        part, g.n_split, a.n_head, a.d, a.sinks, a.rope.freq, a.rope.n_rot, pos, o);
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
    argmax_kernel<<<1, kArgmaxThreads, 0, s>>>(x, n, out);
    check_launch("argmax");
}

}  // namespace fathom::cuda::ds4
