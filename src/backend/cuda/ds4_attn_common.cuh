// Device building blocks shared by the DS4 attention kernels (ds4_attn.cu: decode; the batched
// prefill kernels): block-cooperative shared-memory helpers (RMSNorm, RoPE, FP8/FP4 round trips,
// Hadamard) and their warp-per-row register forms (wrow_*). Numerics: see ds4_attn.cu's banner (the
// CPU reference's op order with round-to-nearest intrinsics). Include only from .cu files.
// Every function here is inline (or a template): several .cu files include this header, and a
// non-inline __device__ function would get a host stub defined in each of them (duplicate symbols).
#pragma once
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <string>

#include "backend/cuda/ds4_attn_kernels.h"
#include "core/error.h"

namespace fathom::cuda::ds4::attn_detail {

constexpr unsigned kFull = 0xffffffffu;

inline void check_launch(const char *what) {
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
inline __device__ double block_sum_d(double v, double *red) {
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
inline __device__ void rms_norm_smem(float *x, int n, const float *__restrict__ w, float eps, double *red) {
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
inline __device__ void rope_smem(float *x, const float *__restrict__ freq, int n_rot, int64_t pos, bool inverse) {
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
inline __device__ void block_round_trip_smem(float *x, int n, int block, float fmt_max, float amax_floor, int mbits,
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
inline __device__ void hadamard_smem(float *x, int n) {
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
inline __device__ void qat_smem(float *x, int n, int n_rot, qat_kind k) {
    if (k == qat_kind::fp8_nope) {
        block_round_trip_smem(x, n - n_rot, 64, 448.0f, 1e-4f, 3, -6);
    } else if (k == qat_kind::hadamard_fp4) {
        hadamard_smem(x, n);
        block_round_trip_smem(x, n, 32, 6.0f, ldexpf(6.0f, -126), 1, 0);
    }
}

// ---- warp-per-row building blocks (a row of 64 * NP dims in one warp's registers) --------------------
// Lane l owns the pairs (64 j + 2 l, 64 j + 2 l + 1), j < NP, as v[j][0..1]. So a RoPE pair is inside one
// lane, a 64-dim FP8 block is one j over the whole warp, a 32-dim FP4 block one j over 16 lanes, and a
// Hadamard stage of span h is an in-lane step (h = 1, or h >= 64 across j) or one shuffle (h = 2 .. 32,
// lane bit log2(h) - 1). The arithmetic is that of the shared-memory helpers above, op for op; only the
// RMSNorm double sum is a warp tree. No __syncthreads: single-warp work items have no block barrier.

constexpr int kWarpRowMaxPairs = 8;  // rows of up to 512 dims

__device__ __forceinline__ double warp_sum_d(double v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(kFull, v, o);
    return v;
}

template <int NP>
__device__ __forceinline__ void wrow_load(float (&v)[NP][2], const float *__restrict__ x) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int j = 0; j < NP; ++j) {
        v[j][0] = x[64 * j + 2 * lane];
        v[j][1] = x[64 * j + 2 * lane + 1];
    }
}

template <int NP>
__device__ __forceinline__ void wrow_store(const float (&v)[NP][2], float *__restrict__ x) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int j = 0; j < NP; ++j) {
        x[64 * j + 2 * lane] = v[j][0];
        x[64 * j + 2 * lane + 1] = v[j][1];
    }
}

// A row store as f16 (round to nearest) or f32.
template <int NP>
__device__ __forceinline__ void wrow_store_row(const float (&v)[NP][2], uint8_t *dst, bool f16) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int j = 0; j < NP; ++j)
#pragma unroll
        for (int k = 0; k < 2; ++k) {
            const int i = 64 * j + 2 * lane + k;
            if (f16)
                reinterpret_cast<__half *>(dst)[i] = __float2half_rn(v[j][k]);
            else
                reinterpret_cast<float *>(dst)[i] = v[j][k];
        }
}

// x = x / sqrt(mean(x^2) + eps) * w (w may be null), as rms_norm_smem.
template <int NP>
__device__ __forceinline__ void wrow_rms_norm(float (&v)[NP][2], const float *__restrict__ w, float eps) {
    const int lane = threadIdx.x & 31;
    double ss = 0;
#pragma unroll
    for (int j = 0; j < NP; ++j)
#pragma unroll
        for (int k = 0; k < 2; ++k) ss += static_cast<double>(v[j][k]) * static_cast<double>(v[j][k]);
    ss = warp_sum_d(ss);
    const float r =
        static_cast<float>(1.0 / sqrt(ss / static_cast<double>(64 * NP) + static_cast<double>(eps)));
#pragma unroll
    for (int j = 0; j < NP; ++j)
#pragma unroll
        for (int k = 0; k < 2; ++k)
            v[j][k] = w ? __fmul_rn(w[64 * j + 2 * lane + k], __fmul_rn(v[j][k], r)) : __fmul_rn(v[j][k], r);
}

// RoPE of the last n_rot dims (pairs of pair index >= (dim - n_rot) / 2), as rope_smem: one pair per
// lane and j, so the double cos/sin of all pairs are computed concurrently. v holds the 64-dim slices
// j0 .. j0 + NP - 1 of a row of `dim` dims (default: the whole row).
template <int NP>
__device__ __forceinline__ void wrow_rope(float (&v)[NP][2], const float *__restrict__ freq, int n_rot, int64_t pos,
                                          bool inverse, int dim = 64 * NP, int j0 = 0) {
    const int lane = threadIdx.x & 31, p0 = (dim - n_rot) / 2;
    const float fp = static_cast<float>(pos);
#pragma unroll
    for (int j = 0; j < NP; ++j) {
        const int i = 32 * (j0 + j) + lane - p0;  // pair index within the RoPE dims
        if (i < 0) continue;
        const float ang = __fmul_rn(fp, freq[i]);
        const float c = static_cast<float>(cos(static_cast<double>(ang)));
        float s = static_cast<float>(sin(static_cast<double>(ang)));
        if (inverse) s = -s;
        const float a = v[j][0], b = v[j][1];
        v[j][0] = __fsub_rn(__fmul_rn(a, c), __fmul_rn(b, s));
        v[j][1] = __fadd_rn(__fmul_rn(a, s), __fmul_rn(b, c));
    }
}

// Block round trip (block_round_trip_smem) of dims [0, n): FP8 blocks of 64 (one j each) or FP4
// blocks of 32 (16 lanes of one j); n a multiple of the block. v: slices j0 .. of the row (wrow_rope).
template <int NP>
__device__ __forceinline__ void wrow_round_trip(float (&v)[NP][2], int n, int block, float fmt_max, float amax_floor,
                                                int mbits, int emin, int j0 = 0) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int j = 0; j < NP; ++j) {
        // shuffles stay unconditional; a 32-block's lanes (xor < 16) never mix with the other block's
        const bool in = 64 * (j0 + j) + (block == 64 ? 64 : 2 * (lane & 16) + 32) <= n;
        float amax = fmaxf(fabsf(v[j][0]), fabsf(v[j][1]));
        for (int o = block == 64 ? 16 : 8; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(kFull, amax, o));
        if (!in) continue;
        amax = fmaxf(amax, amax_floor);
        const float s = pow2_ceil_dev(__fdiv_rn(amax, fmt_max));
#pragma unroll
        for (int k = 0; k < 2; ++k) {
            const float c = fminf(fmaxf(__fdiv_rn(v[j][k], s), -fmt_max), fmt_max);
            v[j][k] = __fmul_rn(s, round_minifloat(c, mbits, emin, fmt_max));
        }
    }
}

// Normalised Walsh-Hadamard transform of the whole row (hadamard_smem).
template <int NP>
__device__ __forceinline__ void wrow_hadamard(float (&v)[NP][2]) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int j = 0; j < NP; ++j) {  // h = 1
        const float a = v[j][0], b = v[j][1];
        v[j][0] = __fadd_rn(a, b);
        v[j][1] = __fsub_rn(a, b);
    }
#pragma unroll
    for (int m = 0; m < 5; ++m) {  // h = 2 << m: partner lane l ^ (1 << m); the lower lane holds x[i]
        const bool upper = (lane >> m) & 1;
#pragma unroll
        for (int j = 0; j < NP; ++j)
#pragma unroll
            for (int k = 0; k < 2; ++k) {
                const float o = __shfl_xor_sync(kFull, v[j][k], 1 << m);
                v[j][k] = upper ? __fsub_rn(o, v[j][k]) : __fadd_rn(v[j][k], o);
            }
    }
#pragma unroll
    for (int hj = 1; hj < NP; hj *= 2)  // h = 64 hj: across j
#pragma unroll
        for (int j = 0; j < NP; ++j)
            if (!(j & hj))
#pragma unroll
                for (int k = 0; k < 2; ++k) {
                    const float a = v[j][k], b = v[j + hj][k];
                    v[j][k] = __fadd_rn(a, b);
                    v[j + hj][k] = __fsub_rn(a, b);
                }
    const float s = static_cast<float>(1.0 / sqrt(static_cast<double>(64 * NP)));
#pragma unroll
    for (int j = 0; j < NP; ++j)
#pragma unroll
        for (int k = 0; k < 2; ++k) v[j][k] = __fmul_rn(v[j][k], s);
}

template <int NP>
__device__ __forceinline__ void wrow_qat(float (&v)[NP][2], int n_rot, qat_kind k) {
    if (k == qat_kind::fp8_nope) {
        wrow_round_trip(v, 64 * NP - n_rot, 64, 448.0f, 1e-4f, 3, -6);
    } else if (k == qat_kind::hadamard_fp4) {
        wrow_hadamard(v);
        wrow_round_trip(v, 64 * NP, 32, 6.0f, ldexpf(6.0f, -126), 1, 0);
    }
}

// Norm (optional), RoPE at pos, QAT: the finish every row kernel applies.
template <int NP>
__device__ __forceinline__ void wrow_finish(float (&v)[NP][2], bool norm, const float *__restrict__ norm_w, float eps,
                                            const float *__restrict__ freq, int n_rot, int64_t pos, qat_kind qat) {
    if (norm) wrow_rms_norm(v, norm_w, eps);
    wrow_rope(v, freq, n_rot, pos, false);
    wrow_qat(v, n_rot, qat);
}

// ---- split rows: a row of 64 NP dims over NP warps of one block, warp j holding slice j ----------------
// The same values as wrow_finish on one warp, bit for bit: the RMSNorm sum of squares is formed from the
// row in shared memory in wrow_rms_norm's order (lane l: its 2 NP values in (j, k) order, then the warp
// tree) by every warp, and the RoPE and the FP8 round trip work per 64-dim slice anyway. Used where one
// row is all the work (the decode step's KV row, a compressor's emitted row), so its serial chain is 1/NP
// as long. QAT none or
// fp8_nope only (the Hadamard transform mixes the whole row).
// Called by every thread of the block (it holds a barrier); with live = false (warps >= NP of a larger
// block) a thread only takes part in the barrier.
template <int NP>
__device__ __forceinline__ void srow_finish(float (&v)[2], float2 (*sv)[32], const float *__restrict__ norm_w,
                                            float eps, const float *__restrict__ freq, int n_rot, int64_t pos,
                                            qat_kind qat, bool live = true) {
    const int j = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (live) sv[j][lane] = make_float2(v[0], v[1]);
    __syncthreads();
    if (!live) return;
    double ss = 0;
#pragma unroll
    for (int jj = 0; jj < NP; ++jj) {
        const float2 e = sv[jj][lane];
        ss += static_cast<double>(e.x) * static_cast<double>(e.x);
        ss += static_cast<double>(e.y) * static_cast<double>(e.y);
    }
    ss = warp_sum_d(ss);
    const float r = static_cast<float>(1.0 / sqrt(ss / static_cast<double>(64 * NP) + static_cast<double>(eps)));
    float w[1][2];
#pragma unroll
    for (int k = 0; k < 2; ++k)
        w[0][k] = norm_w ? __fmul_rn(norm_w[64 * j + 2 * lane + k], __fmul_rn(v[k], r)) : __fmul_rn(v[k], r);
    wrow_rope(w, freq, n_rot, pos, false, 64 * NP, j);
    if (qat == qat_kind::fp8_nope) wrow_round_trip(w, 64 * NP - n_rot, 64, 448.0f, 1e-4f, 3, -6, j);
    v[0] = w[0][0];
    v[1] = w[0][1];
}

// Slice j = warp j of a split row (srow_finish's v) stored as f16 (round to nearest) or f32 at dst.
__device__ __forceinline__ void srow_store(const float (&v)[2], uint8_t *dst, bool f16) {
    const int j = threadIdx.x >> 5, lane = threadIdx.x & 31;
#pragma unroll
    for (int k = 0; k < 2; ++k) {
        const int i = 64 * j + 2 * lane + k;
        if (f16)
            reinterpret_cast<__half *>(dst)[i] = __float2half_rn(v[k]);
        else
            reinterpret_cast<float *>(dst)[i] = v[k];
    }
}

// Whether a row of `dim` dims fits the warp-row layout.
inline bool warp_row_fits(int dim) {
    return dim % 64 == 0 && dim / 64 >= 1 && dim / 64 <= kWarpRowMaxPairs && ((dim / 64) & (dim / 64 - 1)) == 0;
}

// ---- split combine (decode ds4_attn.cu and chunk ds4_attn_prefill.cu combines) ----------------------
// Split weights of one head's combine, one whole warp (lane: this thread's lane, 0..31): ms / ls hold
// (m, l) of splits lane and lane + 32 (m = -inf, l = 0 past the busy ones; each busy split saw >= 1
// row: m finite). M is the largest of the sink and the m_s; ws[s] = e^(m_s - M) (0 past busy; ws: [64] floats, this warp's), and the
// return value is inv = 1 / (e^(sink - M) + sum_s ws[s] l_s). The warp butterflies leave M, the sum
// and so inv bit-identical in every lane. The caller syncs before reading ws across lanes.
__device__ __forceinline__ float combine_split_weights(const float (&ms)[2], const float (&ls)[2], float sink,
                                                       int busy, int lane, float *ws) {
    const float M = fmaxf(sink, warp_max(fmaxf(ms[0], ms[1])));
    float den = 0.0f;
#pragma unroll
    for (int k = 0; k < 2; ++k) {
        const int s = lane + 32 * k;
        const float w = s < busy ? expf(ms[k] - M) : 0.0f;
        ws[s] = w;
        den += w * ls[k];
    }
    den = warp_sum(den);
    return 1.0f / (expf(sink - M) + den);
}

// ---- attention row tiles (decode ds4_attn.cu and chunk ds4_attn_prefill.cu kernels) ----
// Rows per tile of the f32 attention kernels.
constexpr int kAttnTileRows = 16;

// Tile element pairs: f16 (every source f16) or f32.
__device__ __forceinline__ void tile_put(__half2 *t, int i, float a, float b) { t[i] = __floats2half2_rn(a, b); }
__device__ __forceinline__ void tile_put(float2 *t, int i, float a, float b) { t[i] = make_float2(a, b); }
__device__ __forceinline__ void tile_put(__half2 *t, int i, __half a, __half b) { t[i] = __halves2half2(a, b); }
__device__ __forceinline__ void tile_put(float2 *t, int i, __half a, __half b) {
    t[i] = make_float2(__half2float(a), __half2float(b));
}
__device__ __forceinline__ float2 tile_get(const __half2 *t, int i) { return __half22float2(t[i]); }
__device__ __forceinline__ float2 tile_get(const float2 *t, int i) { return t[i]; }
template <class T>
struct tile_pair;
template <>
struct tile_pair<__half> {
    using type = __half2;
};
template <>
struct tile_pair<float> {
    using type = float2;
};

// One stage of reduce_scatter16: lanes with bit O set keep rows [O, 2 O) of the 2 O live ones (moved to
// v[0, O)), the others rows [0, O); each adds its partner's (lane ^ O) copy of the rows it keeps.
template <int O>
__device__ __forceinline__ void reduce_scatter_stage(float (&v)[kAttnTileRows], int lane) {
    const bool up = lane & O;
#pragma unroll
    for (int i = 0; i < O; ++i) {
        const float lo = v[i], hi = v[i + O];
        const float send = up ? lo : hi, keep = up ? hi : lo;
        v[i] = keep + __shfl_xor_sync(kFull, send, O);
    }
}

// Sum of v[r] over the 32 lanes for r < 16, scattered: returns row (lane & 15)'s total (lanes l and
// l + 16 agree bit for bit), 16 shuffles in all.
__device__ __forceinline__ float reduce_scatter16(float (&v)[kAttnTileRows], int lane) {
    reduce_scatter_stage<8>(v, lane);
    reduce_scatter_stage<4>(v, lane);
    reduce_scatter_stage<2>(v, lane);
    reduce_scatter_stage<1>(v, lane);
    return v[0] + __shfl_xor_sync(kFull, v[0], 16);
}

}  // namespace fathom::cuda::ds4::attn_detail
