// DS4 sparse sink attention over a CHUNK of n_tok tokens on CUDA (launch_sparse_sink_attention_batch,
// ds4_prefill.h): for each token what the decode launcher launch_sparse_sink_attention (ds4_attn.cu)
// computes, with the raw window rows of positions inside the chunk read from the chunk's own KV rows.
//
// Two kernels, chosen on the host (both grid (n_tok, ceil(n_head / 16)): a block serves one token and
// 16 heads; all heads of a token see the same rows, one shared KV head, so a row is read from L2 once
// per block and staged in shared memory for the block's heads):
//   attn_batch_mma_kernel (every row f16, n_split == 1, sm_80+): tensor cores, f16 rows exact, q and
//     p split into f16 hi + lo, f32 accumulation (see its section). ~3e-6 relative to the decode path.
//   attn_batch_kernel (f32 rows, or small batches): the decode kernel's f32 structure (8 warps x 2
//     heads, 16-row tiles); small batches (n_tok * head groups < kTargetBlocks) split each token's
//     rows over n_split blocks (grid z) and merge them in attn_batch_combine_kernel, as decode does.
//     With n_split == 1 the block finishes its heads itself and `part` is unused.
//
// Candidate rows of token t at p = *pos + t, in the decode order: raw rows first .. p
// (first = max(0, p - window + 1); position r >= *pos: chunk row r - *pos, else ring row r mod window),
// then the compressed rows of the mode (all: 0 .. (p + 1) / ratio - 1; list: sel[t * sel_stride + i],
// i < n_sel[t]; capped at max_comp). Softmax online per head in f32 with the sink in the denominator,
// then the inverse RoPE of each head's last n_rot dims at p.
//
// Measured on an H200 (bench_cuda_kernels CudaDs4PrefillAttn.BenchDs4Chunk, f16 rows, 4096 tokens):
// list mode (128 + 512 rows) 10.1 ms, all mode (128 + ~240 rows) 6.4 ms per chunk and layer (f32
// kernel: 26 ms / 15 ms). A 32K prefill: ~21 ratio-4 layers x 8 chunks x 10 ms + ~20 ratio-128 layers x
// 8 x ~5 ms ~ 2.5 s. Next steps if needed: cp.async double-buffered K/V tiles (the block idles while
// staging), 32-64 heads per block (fewer L2 reads and barriers), ldmatrix.trans for the V fragments.
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>

#include "backend/cuda/ds4_attn_common.cuh"
#include "backend/cuda/cuda_device.h"
#include "backend/cuda/cuda_mma.cuh"
#include "backend/cuda/cuda_smem.cuh"
#include "backend/cuda/ds4_attn_kernels.h"
#include "backend/cuda/ds4_prefill.h"
#include "core/error.h"

namespace fathom::cuda::ds4 {
namespace {

using namespace attn_detail;

void batch_check_launch(const char *what) {
    const cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess)
        throw error(std::string("cuda ds4 attention batch ") + what + ": launch failed: " + cudaGetErrorString(e));
}

constexpr int kWarps = 8, kThreads = 32 * kWarps, kHeadsPerWarp = 2, kHeadsPerBlock = kWarps * kHeadsPerWarp;
constexpr int kTileRows = kAttnTileRows, kMaxD = 512, kMaxP = kMaxD / 64;
constexpr int kMaxSplits = 64, kMinRowsPerSplit = 32, kCombineThreads = 128;
static_assert(kMaxSplits == 64, "combine_split_weights: splits lane and lane + 32 of one warp, ws [64]");
constexpr int64_t kTargetBlocks = 512;  // fewer (token, head group) blocks than this: split the rows

struct batch_geom {
    int n_head, d;
    float scale;
    const uint8_t *ring;  // positions < *pos: ring row (position mod window)
    size_t ring_stride;
    int window;
    int ring_rows;  // ring row of position p: p mod ring_rows
    bool ring_f16;  // also the chunk rows' precision
    const uint8_t *chunk;  // positions >= *pos: chunk row (position - *pos)
    size_t chunk_stride;
    comp_mode mode;
    const uint8_t *comp;
    size_t comp_stride;
    bool comp_f16;
    int ratio;
    const int32_t *sel;  // [n_tok, sel_stride] (list)
    int64_t sel_stride;
    const int32_t *n_sel;  // [n_tok] (list)
    int64_t max_comp;      // 0 for comp_mode none
    int n_split;
    int64_t n_tok;
    bool pair_loads;  // every row base and stride aligned to a dim pair (4 bytes f16, 8 bytes f32)
};

// Token t's candidate rows: n_raw window rows from `first`, then n_comp compressed rows.
struct batch_span {
    int64_t p0, first, n_raw, n_comp;
    const int32_t *sel;  // token t's list (list mode)
};

__device__ __forceinline__ batch_span span_of(const batch_geom &g, int64_t p0, int64_t t) {
    batch_span s;
    const int64_t p = p0 + t;
    s.p0 = p0;
    s.first = p - g.window + 1 > 0 ? p - g.window + 1 : 0;
    s.n_raw = p - s.first + 1;
    int64_t nc = 0;
    s.sel = nullptr;
    if (g.mode == comp_mode::all) {
        nc = (p + 1) / g.ratio;
    } else if (g.mode == comp_mode::list) {
        nc = g.n_sel[t];
        s.sel = g.sel + t * g.sel_stride;
    }
    nc = nc < 0 ? 0 : nc;
    s.n_comp = nc < g.max_comp ? nc : g.max_comp;
    return s;
}

// Rows per split (the decode rule): >= kMinRowsPerSplit, whole tiles, n_split * rps >= n.
__device__ __forceinline__ int64_t rows_per_split(int64_t n, int n_split) {
    int64_t rps = (n + n_split - 1) / n_split;
    rps = rps > kMinRowsPerSplit ? rps : kMinRowsPerSplit;
    return (rps + kTileRows - 1) / kTileRows * kTileRows;
}

// Candidate row i of the token: its bytes and whether it is f16.
__device__ __forceinline__ const uint8_t *row_at(const batch_geom &g, const batch_span &sp, int64_t i, bool &f16) {
    if (i < sp.n_raw) {
        f16 = g.ring_f16;
        const int64_t r = sp.first + i;
        if (r >= sp.p0) return g.chunk + static_cast<size_t>(r - sp.p0) * g.chunk_stride;
        return g.ring + static_cast<size_t>(r % g.ring_rows) * g.ring_stride;
    }
    const int64_t c = i - sp.n_raw;
    const int64_t r = g.mode == comp_mode::all ? c : static_cast<int64_t>(sp.sel[c]);
    f16 = g.comp_f16;
    return g.comp + static_cast<size_t>(r) * g.comp_stride;
}

// Stages candidate rows t0 .. t0 + nt - 1 into tile [kTileRows, d / 2] pairs (rows past nt: zeros, so
// p = 0 never meets a NaN). Warp w loads rows w, w + 8.
template <class P>
__device__ __forceinline__ void stage_tile(const batch_geom &g, const batch_span &sp, int64_t t0, int nt, P *tile) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, hp = g.d / 2;
    for (int r = warp; r < kTileRows; r += kWarps) {
        P *dst = tile + r * hp;
        if (r >= nt) {
            for (int i = lane; i < hp; i += 32) tile_put(dst, i, 0.0f, 0.0f);
            continue;
        }
        bool f16 = false;
        const uint8_t *src = row_at(g, sp, t0 + r, f16);
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
}

// Output of a head (n_split == 1: straight from the block's state; else the combine's merged values):
// pair (a, b) = dims (2 pi, 2 pi + 1), inverse RoPE when pi is a RoPE pair (pi >= rp0), as rope_smem.
__device__ __forceinline__ void store_pair(float *oh, int pi, float a, float b, int rp0, float fp,
                                           const float *__restrict__ freq) {
    if (pi >= rp0) {
        const float ang = __fmul_rn(fp, freq[pi - rp0]);
        const float c = static_cast<float>(cos(static_cast<double>(ang)));
        const float sn = -static_cast<float>(sin(static_cast<double>(ang)));
        const float x0 = a, x1 = b;
        a = __fsub_rn(__fmul_rn(x0, c), __fmul_rn(x1, sn));
        b = __fadd_rn(__fmul_rn(x0, sn), __fmul_rn(x1, c));
    }
    oh[2 * pi] = a;
    oh[2 * pi + 1] = b;
}

// The block (token blockIdx.x, heads 16 blockIdx.y .., split blockIdx.z) over its rows: online softmax
// per head; then (n_split == 1) the finished output, or (n_split > 1) the partials acc at
// part[ph * d], (m, l) at part[ml0 + 2 ph], ph = (t * n_split + split) * n_head + h,
// ml0 = n_tok * n_split * n_head * d.
template <class T>
__global__ void __launch_bounds__(kThreads, 2)  // two blocks per SM: <= 128 registers
    attn_batch_kernel(batch_geom g, const float *__restrict__ q, const int64_t *__restrict__ pos,
                      const float *__restrict__ sinks, rope_args rope, float *__restrict__ part,
                      float *__restrict__ o) {
    using P = typename tile_pair<T>::type;
    extern __shared__ __align__(16) unsigned char tile_raw[];
    P *tile = reinterpret_cast<P *>(tile_raw);  // [kTileRows, d / 2] pairs
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int d = g.d, np = d / 64, hp = d / 2;
    const int64_t t = blockIdx.x;
    const int h0 = blockIdx.y * kHeadsPerBlock, split = blockIdx.z;
    const int64_t p0 = *pos;
    const batch_span sp = span_of(g, p0, t);
    const int64_t n_tot = sp.n_raw + sp.n_comp;
    const int64_t rps = rows_per_split(n_tot, g.n_split);
    const int64_t r0 = static_cast<int64_t>(split) * rps;
    if (r0 >= n_tot) return;  // block-uniform: an idle split (the combine does not read it)
    const int64_t r1 = r0 + rps < n_tot ? r0 + rps : n_tot;
    const float *qt = q + static_cast<size_t>(t) * g.n_head * d;
    float qr[kHeadsPerWarp][kMaxP][2], acc[kHeadsPerWarp][kMaxP][2], m[kHeadsPerWarp], l[kHeadsPerWarp];
#pragma unroll
    for (int hh = 0; hh < kHeadsPerWarp; ++hh) {
        const int h = h0 + warp * kHeadsPerWarp + hh;
#pragma unroll
        for (int j = 0; j < kMaxP; ++j)
#pragma unroll
            for (int k = 0; k < 2; ++k) {
                qr[hh][j][k] = h < g.n_head && j < np ? qt[static_cast<size_t>(h) * d + 64 * j + 2 * lane + k] : 0.0f;
                acc[hh][j][k] = 0.0f;
            }
        m[hh] = -INFINITY;
        l[hh] = 0.0f;
    }
    for (int64_t t0 = r0; t0 < r1; t0 += kTileRows) {
        const int nt = static_cast<int>(r1 - t0 < kTileRows ? r1 - t0 : kTileRows);
        __syncthreads();  // the previous tile is consumed
        stage_tile(g, sp, t0, nt, tile);
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
                for (int off = 8; off > 0; off >>= 1) ps += __shfl_xor_sync(kFull, ps, off);
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
    const int rp0 = (d - rope.n_rot) / 2;
    const float fp = static_cast<float>(p0 + t);
    const size_t ml0 = static_cast<size_t>(g.n_tok) * g.n_split * g.n_head * d;
#pragma unroll
    for (int hh = 0; hh < kHeadsPerWarp; ++hh) {
        const int h = h0 + warp * kHeadsPerWarp + hh;
        if (h >= g.n_head) continue;  // warp-uniform
        if (g.n_split == 1) {  // the combine of one busy split, op for op
            const float sink = sinks[h];
            const float M = fmaxf(sink, m[hh]);
            const float w = expf(m[hh] - M);
            const float inv = 1.0f / __fadd_rn(expf(sink - M), __fmul_rn(w, l[hh]));
            float *oh = o + (static_cast<size_t>(t) * g.n_head + h) * d;
#pragma unroll
            for (int j = 0; j < kMaxP; ++j)
                if (j < np)
                    store_pair(oh, 32 * j + lane, (w * acc[hh][j][0]) * inv, (w * acc[hh][j][1]) * inv, rp0, fp,
                               rope.freq);
            continue;
        }
        const size_t ph = (static_cast<size_t>(t) * g.n_split + split) * g.n_head + h;
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

// One block per (token blockIdx.x, head blockIdx.y) when n_split > 1: o = sum_s e^(m_s - M) acc_s /
// (e^(sink - M) + sum_s e^(m_s - M) l_s) over the token's busy splits, then the inverse RoPE.
__global__ void __launch_bounds__(kCombineThreads)
    attn_batch_combine_kernel(batch_geom g, const float *__restrict__ part, const float *__restrict__ sinks,
                              rope_args rope, const int64_t *__restrict__ pos, float *__restrict__ o) {
    __shared__ float ws[kMaxSplits];
    __shared__ float s_inv;
    const int64_t t = blockIdx.x;
    const int h = blockIdx.y, d = g.d, n_head = g.n_head, ns = g.n_split;
    const int64_t p0 = *pos;
    const batch_span sp = span_of(g, p0, t);
    const int64_t n_tot = sp.n_raw + sp.n_comp, rps = rows_per_split(n_tot, ns);
    const int busy = static_cast<int>((n_tot + rps - 1) / rps);
    const size_t ml0 = static_cast<size_t>(g.n_tok) * ns * n_head * d;
    const size_t ph0 = static_cast<size_t>(t) * ns * n_head + h;  // split s: ph0 + s * n_head
    if (threadIdx.x < 32) {  // warp 0: splits lane and lane + 32
        const int lane = threadIdx.x;
        const float sink = sinks[h];
        float ms[2], ls[2];
#pragma unroll
        for (int k = 0; k < 2; ++k) {
            const int s = lane + 32 * k;
            const size_t ph = ph0 + static_cast<size_t>(s) * n_head;
            ms[k] = s < busy ? part[ml0 + 2 * ph] : -INFINITY;
            ls[k] = s < busy ? part[ml0 + 2 * ph + 1] : 0.0f;
        }
        const float inv = combine_split_weights(ms, ls, sink, busy, lane, ws);
        if (lane == 0) s_inv = inv;
    }
    __syncthreads();
    const float inv = s_inv, fp = static_cast<float>(p0 + t);
    const int rp0 = (d - rope.n_rot) / 2;
    float *oh = o + (static_cast<size_t>(t) * n_head + h) * d;
    for (int pi = threadIdx.x; pi < d / 2; pi += blockDim.x) {
        float a = 0.0f, b = 0.0f;
        for (int s = 0; s < busy; ++s) {
            const float *pp = part + (ph0 + static_cast<size_t>(s) * n_head) * d + 2 * pi;
            a += ws[s] * pp[0];
            b += ws[s] * pp[1];
        }
        store_pair(oh, pi, a * inv, b * inv, rp0, fp, rope.freq);
    }
}

// ---- tensor-core path (every row f16, n_split == 1, sm_80+) ---------------------------------------------
// Block: token blockIdx.x, heads 16 blockIdx.y .. + 15 (one m16 tile), 4 warps; rows in tiles of 64.
// f16 rows are exact in f16, so only the f32 operands are split: q = q_hi + q_lo and p = p_hi + p_lo
// (two f16 each, the pair exact to ~2^-22 relative), each product pair accumulated in f32 by
// mma.m16n8k16: scores and outputs match the f32 kernel to ~1e-6 relative. (Queries must be below
// the f16 range, 65504: true of the normed attention queries.)
//   Scores: warp w computes S [16 heads, rows 16 w .. + 15] over all d dims. Softmax per head online
//   over tiles (the tile's max and sum merged across the 4 warps through shared memory); P (hi, lo) to
//   shared memory. Outputs: warp w owns dims w d / 4 .. + d / 4 (d / 32 n8 tiles of accumulators,
//   rescaled by the tile's correction), O += P V over the tile's 64 rows.
// Fragment layouts (PTX mma.m16n8k16, g = lane / 4, t = lane % 4): A regs {row g | g + 8} x {k 2t, 2t +
// 8} (pairs), B regs k {2t, 2t + 8} (pairs) at column g, C {c0, c1} = row g cols 2t, 2t + 1, {c2, c3}
// = row g + 8.
constexpr int kMmaWarps = 4, kMmaThreads = 32 * kMmaWarps, kMmaRows = 64, kMmaHeads = 16, kPad = 8;

size_t mma_smem_bytes(int d) {
    const size_t ks = static_cast<size_t>(kMmaRows) * (d + kPad) * 2;        // K/V tile, f16
    const size_t qs = 2 * static_cast<size_t>(kMmaHeads) * (d + kPad) * 2;   // q hi, lo
    const size_t ps = 2 * static_cast<size_t>(kMmaHeads) * (kMmaRows + kPad) * 2;  // p hi, lo
    return ks + qs + ps + sizeof(const uint8_t *) * kMmaRows + 2 * sizeof(float) * kMmaWarps * kMmaHeads;
}


// A fragment of rows 0..15 (g, g + 8), columns k0 .. k0 + 15 of a [16, ld] f16 matrix.
__device__ __forceinline__ void load_a(uint32_t (&a)[4], const __half *m, int ld, int k0, int g, int t) {
    a[0] = *reinterpret_cast<const uint32_t *>(m + g * ld + k0 + 2 * t);
    a[1] = *reinterpret_cast<const uint32_t *>(m + (g + 8) * ld + k0 + 2 * t);
    a[2] = *reinterpret_cast<const uint32_t *>(m + g * ld + k0 + 8 + 2 * t);
    a[3] = *reinterpret_cast<const uint32_t *>(m + (g + 8) * ld + k0 + 8 + 2 * t);
}

__device__ __forceinline__ uint32_t pack_halves(__half lo, __half hi) {
    return static_cast<uint32_t>(__half_as_ushort(lo)) | (static_cast<uint32_t>(__half_as_ushort(hi)) << 16);
}

// Stages rows t0 .. t0 + nt - 1 of the token into ks [64, d + kPad] (rows past nt: zeros).
__device__ __forceinline__ void stage_mma_tile(const batch_geom &g, const batch_span &sp, int64_t t0, int nt,
                                               __half *ks, const uint8_t **rp, bool vec16) {
    const int d = g.d, ld = d + kPad, tid = threadIdx.x;
    if (tid < kMmaRows) {
        bool f16 = true;
        rp[tid] = tid < nt ? row_at(g, sp, t0 + tid, f16) : nullptr;
    }
    __syncthreads();
    if (vec16) {
        const int cpr = d / 8;  // 16-byte chunks per row
        for (int e = tid; e < kMmaRows * cpr; e += kMmaThreads) {
            const int r = e / cpr, c = e % cpr;
            const uint8_t *src = rp[r];
            const uint4 v = src ? reinterpret_cast<const uint4 *>(src)[c] : make_uint4(0, 0, 0, 0);
            *reinterpret_cast<uint4 *>(ks + r * ld + 8 * c) = v;
        }
    } else {
        for (int e = tid; e < kMmaRows * d; e += kMmaThreads) {
            const int r = e / d, c = e % d;
            const uint8_t *src = rp[r];
            ks[r * ld + c] = src ? reinterpret_cast<const __half *>(src)[c] : __float2half_rn(0.0f);
        }
    }
}

__global__ void __launch_bounds__(kMmaThreads)
    attn_batch_mma_kernel(batch_geom g, const float *__restrict__ q, const int64_t *__restrict__ pos,
                          const float *__restrict__ sinks, rope_args rope, float *__restrict__ o, bool vec16) {
    // (compiled for every target; before sm_80 mma16816 is empty and the host never launches this)
    extern __shared__ __align__(16) unsigned char smem_raw[];
    const int d = g.d, ld = d + kPad, pld = kMmaRows + kPad;
    __half *ks = reinterpret_cast<__half *>(smem_raw);  // [64, ld]
    __half *qh = ks + kMmaRows * ld, *ql = qh + kMmaHeads * ld;  // [16, ld] each
    __half *ph = ql + kMmaHeads * ld, *pl = ph + kMmaHeads * pld;  // [16, pld] each
    const uint8_t **rp = reinterpret_cast<const uint8_t **>(pl + kMmaHeads * pld);  // [64]
    float *red_m = reinterpret_cast<float *>(rp + kMmaRows), *red_l = red_m + kMmaWarps * kMmaHeads;  // [4, 16]
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, gq = lane >> 2, tq = lane & 3;
    const int64_t t = blockIdx.x;
    const int h0 = blockIdx.y * kMmaHeads;
    const int64_t p0 = *pos;
    const batch_span sp = span_of(g, p0, t);
    const int64_t n_tot = sp.n_raw + sp.n_comp;
    // q hi / lo of the block's heads (heads past n_head: zeros)
    for (int e = tid; e < kMmaHeads * d; e += kMmaThreads) {
        const int hh = e / d, c = e % d, h = h0 + hh;
        const float x = h < g.n_head ? q[(static_cast<size_t>(t) * g.n_head + h) * d + c] : 0.0f;
        const __half hi = __float2half_rn(x);
        qh[hh * ld + c] = hi;
        ql[hh * ld + c] = __float2half_rn(x - __half2float(hi));
    }
    const int nj = d / 32;  // n8 tiles of output dims per warp
    const int dw0 = warp * (d / 4);
    float acc[kMaxD / 32][4];
#pragma unroll
    for (int j = 0; j < kMaxD / 32; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.0f;
    float m_g = -INFINITY, m_g8 = -INFINITY, l_g = 0.0f, l_g8 = 0.0f;  // heads gq, gq + 8
    for (int64_t t0 = 0; t0 < n_tot; t0 += kMmaRows) {
        const int nt = static_cast<int>(n_tot - t0 < kMmaRows ? n_tot - t0 : kMmaRows);
        __syncthreads();  // the previous tile's K/V, P and row pointers are consumed
        stage_mma_tile(g, sp, t0, nt, ks, rp, vec16);
        __syncthreads();
        // S [16 heads, rows 16 warp + 8 j + (2 tq, 2 tq + 1)] in sc[j]
        float sc[2][4] = {{0.0f, 0.0f, 0.0f, 0.0f}, {0.0f, 0.0f, 0.0f, 0.0f}};
        for (int k0 = 0; k0 < d; k0 += 16) {
            uint32_t ah[4], al[4];
            load_a(ah, qh, ld, k0, gq, tq);
            load_a(al, ql, ld, k0, gq, tq);
#pragma unroll
            for (int j = 0; j < 2; ++j) {
                const __half *kr = ks + (16 * warp + 8 * j + gq) * ld + k0 + 2 * tq;
                const uint32_t b0 = *reinterpret_cast<const uint32_t *>(kr);
                const uint32_t b1 = *reinterpret_cast<const uint32_t *>(kr + 8);
                mma_hi_lo(sc[j], ah, al, b0, b1);
            }
        }
        // tile max per head (rows past nt: -inf), merged over the warps
        float mx_g = -INFINITY, mx_g8 = -INFINITY;
#pragma unroll
        for (int j = 0; j < 2; ++j)
#pragma unroll
            for (int k = 0; k < 2; ++k) {
                const int r = 16 * warp + 8 * j + 2 * tq + k;
                sc[j][k] = r < nt ? sc[j][k] * g.scale : -INFINITY;
                sc[j][2 + k] = r < nt ? sc[j][2 + k] * g.scale : -INFINITY;
                mx_g = fmaxf(mx_g, sc[j][k]);
                mx_g8 = fmaxf(mx_g8, sc[j][2 + k]);
            }
        for (int off = 1; off < 4; off <<= 1) {
            mx_g = fmaxf(mx_g, __shfl_xor_sync(kFull, mx_g, off));
            mx_g8 = fmaxf(mx_g8, __shfl_xor_sync(kFull, mx_g8, off));
        }
        if (tq == 0) {
            red_m[warp * kMmaHeads + gq] = mx_g;
            red_m[warp * kMmaHeads + gq + 8] = mx_g8;
        }
        __syncthreads();
        float tm_g = -INFINITY, tm_g8 = -INFINITY;
#pragma unroll
        for (int w = 0; w < kMmaWarps; ++w) {
            tm_g = fmaxf(tm_g, red_m[w * kMmaHeads + gq]);
            tm_g8 = fmaxf(tm_g8, red_m[w * kMmaHeads + gq + 8]);
        }
        const float mn_g = fmaxf(m_g, tm_g), mn_g8 = fmaxf(m_g8, tm_g8);  // finite: nt >= 1
        const float corr_g = expf(m_g - mn_g), corr_g8 = expf(m_g8 - mn_g8);  // 0 on the first tile
        float sum_g = 0.0f, sum_g8 = 0.0f;
#pragma unroll
        for (int j = 0; j < 2; ++j) {
            float pv[4];
#pragma unroll
            for (int k = 0; k < 2; ++k) {
                pv[k] = sc[j][k] == -INFINITY ? 0.0f : expf(sc[j][k] - mn_g);
                pv[2 + k] = sc[j][2 + k] == -INFINITY ? 0.0f : expf(sc[j][2 + k] - mn_g8);
            }
            sum_g += pv[0] + pv[1];
            sum_g8 += pv[2] + pv[3];
            const int col = 16 * warp + 8 * j + 2 * tq;
#pragma unroll
            for (int hk = 0; hk < 2; ++hk) {  // head gq (pv[0..1]) and gq + 8 (pv[2..3])
                const int row = gq + 8 * hk;
                const __half a_hi = __float2half_rn(pv[2 * hk]), b_hi = __float2half_rn(pv[2 * hk + 1]);
                const __half a_lo = __float2half_rn(pv[2 * hk] - __half2float(a_hi));
                const __half b_lo = __float2half_rn(pv[2 * hk + 1] - __half2float(b_hi));
                *reinterpret_cast<uint32_t *>(ph + row * pld + col) = pack_halves(a_hi, b_hi);
                *reinterpret_cast<uint32_t *>(pl + row * pld + col) = pack_halves(a_lo, b_lo);
            }
        }
        for (int off = 1; off < 4; off <<= 1) {
            sum_g += __shfl_xor_sync(kFull, sum_g, off);
            sum_g8 += __shfl_xor_sync(kFull, sum_g8, off);
        }
        if (tq == 0) {
            red_l[warp * kMmaHeads + gq] = sum_g;
            red_l[warp * kMmaHeads + gq + 8] = sum_g8;
        }
        __syncthreads();
        float ts_g = 0.0f, ts_g8 = 0.0f;
#pragma unroll
        for (int w = 0; w < kMmaWarps; ++w) {
            ts_g += red_l[w * kMmaHeads + gq];
            ts_g8 += red_l[w * kMmaHeads + gq + 8];
        }
        l_g = l_g * corr_g + ts_g;
        l_g8 = l_g8 * corr_g8 + ts_g8;
        m_g = mn_g;
        m_g8 = mn_g8;
        // O [16 heads, the warp's dims] = O * corr + P V over the tile's rows
        mma_scale_rows(acc, corr_g, corr_g8);
        const int kk_end = (nt + 15) / 16;  // k16 steps holding valid rows (the rest have p = 0)
        for (int kk = 0; kk < kk_end; ++kk) {
            uint32_t ah[4], al[4];
            load_a(ah, ph, pld, 16 * kk, gq, tq);
            load_a(al, pl, pld, 16 * kk, gq, tq);
            const __half *v0 = ks + (16 * kk + 2 * tq) * ld + dw0 + gq;  // rows 2tq, 2tq + 1, + 8, + 9
#pragma unroll
            for (int j = 0; j < kMaxD / 32; ++j)
                if (j < nj) {
                    const __half *v = v0 + 8 * j;
                    const uint32_t b0 = pack_halves(v[0], v[ld]);
                    const uint32_t b1 = pack_halves(v[8 * ld], v[9 * ld]);
                    mma_hi_lo(acc[j], ah, al, b0, b1);
                }
        }
    }
    // finish: sink, normalisation, inverse RoPE (the decode combine of one split)
    const int rp0 = (d - rope.n_rot) / 2;
    const float fp = static_cast<float>(p0 + t);
#pragma unroll
    for (int hk = 0; hk < 2; ++hk) {
        const int h = h0 + gq + 8 * hk;
        if (h >= g.n_head) continue;
        const float m = hk ? m_g8 : m_g, l = hk ? l_g8 : l_g;
        const float sink = sinks[h];
        const float M = fmaxf(sink, m);
        const float w = expf(m - M);
        const float inv = 1.0f / __fadd_rn(expf(sink - M), __fmul_rn(w, l));
        float *oh = o + (static_cast<size_t>(t) * g.n_head + h) * d;
#pragma unroll
        for (int j = 0; j < kMaxD / 32; ++j)
            if (j < nj) {
                const int dim = dw0 + 8 * j + 2 * tq;
                store_pair(oh, dim / 2, (w * acc[j][2 * hk]) * inv, (w * acc[j][2 * hk + 1]) * inv, rp0, fp,
                           rope.freq);
            }
    }
}

int head_groups(const sparse_attn_args &a) { return (a.n_head + kHeadsPerBlock - 1) / kHeadsPerBlock; }

// Splits per token: 1 once the batch alone gives kTargetBlocks blocks; else enough to approach that,
// at most one per kMinRowsPerSplit rows of capacity and kMaxSplits. A function of the arguments only,
// so attn_batch_part_floats agrees with the launch.
int batch_splits(const sparse_attn_args &a, int64_t n_tok) {
    const int64_t blocks = std::max<int64_t>(n_tok, 1) * head_groups(a);
    if (blocks >= kTargetBlocks) return 1;
    const int64_t max_rows = a.window + (a.mode == comp_mode::none ? 0 : std::max<int64_t>(a.max_comp, 0));
    const int64_t cap = std::min<int64_t>(std::max<int64_t>((max_rows + kMinRowsPerSplit - 1) / kMinRowsPerSplit, 1),
                                          kMaxSplits);
    return static_cast<int>(std::min<int64_t>(cap, std::max<int64_t>(kTargetBlocks / blocks, 1)));
}

// Tensor-core path available: compute capability >= 8.0 (mma.m16n8k16 with f16 inputs).
bool mma_supported() {
    const device_caps *caps = current_device_caps();
    return caps && caps->cc_major >= 8;
}

bool pair_aligned(const void *base, size_t stride, bool f16) {
    const size_t al = f16 ? 4 : 8;
    return reinterpret_cast<uintptr_t>(base) % al == 0 && stride % al == 0;
}

void check_args(const sparse_attn_args &a, const void *chunk, size_t chunk_stride, int64_t n_tok, int sel_stride) {
    const size_t elem = a.ring_f16 ? 2 : 4, row = static_cast<size_t>(a.d) * elem;
    if (a.n_head < 1 || a.d < 64 || a.d > kMaxD || a.d % 64 != 0 || a.window < 1 || (a.ring_rows != 0 && a.ring_rows < a.window) || !a.ring || !a.sinks)
        throw error("cuda ds4 attention batch: unsupported geometry (" + std::to_string(a.n_head) + " heads of " +
                    std::to_string(a.d) + ", d a multiple of 64 <= 512, window " + std::to_string(a.window) + ")");
    if (n_tok < 0 || n_tok > 0x7fffffff) throw error("cuda ds4 attention batch: token count out of range");
    if (a.n_head > 65535 * kHeadsPerBlock) throw error("cuda ds4 attention batch: too many heads");
    if (a.ring_stride < row || a.ring_stride % elem != 0)
        throw error("cuda ds4 attention batch: ring stride below the row size or misaligned");
    if (!chunk || chunk_stride < row || chunk_stride % elem != 0 || reinterpret_cast<uintptr_t>(chunk) % elem != 0)
        throw error("cuda ds4 attention batch: chunk rows missing, too narrow or misaligned");
    if (a.mode != comp_mode::none) {
        if (!a.comp || a.max_comp < 0 || a.comp_stride < static_cast<size_t>(a.d) * (a.comp_f16 ? 2 : 4) ||
            a.comp_stride % (a.comp_f16 ? 2 : 4) != 0)
            throw error("cuda ds4 attention batch: compressed rows missing, too narrow or misaligned");
        if (a.mode == comp_mode::all && a.ratio < 1) throw error("cuda ds4 attention batch: ratio must be positive");
        if (a.mode == comp_mode::list && (!a.sel || !a.n_sel))
            throw error("cuda ds4 attention batch: row list missing");
        if (a.mode == comp_mode::list && n_tok > 1 && sel_stride < a.max_comp)
            throw error("cuda ds4 attention batch: sel stride " + std::to_string(sel_stride) +
                        " below max_comp " + std::to_string(a.max_comp));
    }
    if (a.rope.n_rot < 0 || a.rope.n_rot % 2 != 0 || a.rope.n_rot > a.d || (a.rope.n_rot > 0 && !a.rope.freq))
        throw error("cuda ds4 attention batch: bad RoPE dims " + std::to_string(a.rope.n_rot));
}

}  // namespace

size_t attn_batch_part_floats(const sparse_attn_args &a, int64_t n_tok) {
    const int ns = batch_splits(a, n_tok);
    if (ns == 1) return 0;  // the blocks finish their heads themselves
    return static_cast<size_t>(ns) * static_cast<size_t>(std::max<int64_t>(n_tok, 1)) *
           static_cast<size_t>(a.n_head) * (static_cast<size_t>(a.d) + 2);
}

void launch_sparse_sink_attention_batch(const sparse_attn_args &a, const void *chunk, size_t chunk_stride,
                                        int64_t n_tok, int sel_stride, const float *q, const int64_t *pos,
                                        float *part, float *o, cudaStream_t s) {
    check_args(a, chunk, chunk_stride, n_tok, sel_stride);
    if (n_tok == 0) return;
    batch_geom g{};
    g.n_head = a.n_head;
    g.d = a.d;
    g.scale = a.scale;
    g.ring = static_cast<const uint8_t *>(a.ring);
    g.ring_stride = a.ring_stride;
    g.window = a.window;
    g.ring_rows = a.ring_rows > 0 ? a.ring_rows : a.window;
    g.ring_f16 = a.ring_f16;
    g.chunk = static_cast<const uint8_t *>(chunk);
    g.chunk_stride = chunk_stride;
    g.mode = a.mode;
    g.comp = static_cast<const uint8_t *>(a.comp);
    g.comp_stride = a.comp_stride;
    g.comp_f16 = a.comp_f16;
    g.ratio = a.ratio;
    g.sel = a.sel;
    g.sel_stride = sel_stride;
    g.n_sel = a.n_sel;
    g.max_comp = a.mode == comp_mode::none ? 0 : a.max_comp;
    g.n_split = batch_splits(a, n_tok);
    g.n_tok = n_tok;
    g.pair_loads = pair_aligned(a.ring, a.ring_stride, a.ring_f16) && pair_aligned(chunk, chunk_stride, a.ring_f16) &&
                   (a.mode == comp_mode::none || pair_aligned(a.comp, a.comp_stride, a.comp_f16));
    if (g.n_split > 1 && !part) throw error("cuda ds4 attention batch: partials scratch missing");
    const dim3 grid(static_cast<unsigned>(n_tok), static_cast<unsigned>(head_groups(a)),
                    static_cast<unsigned>(g.n_split));
    const bool all_f16 = a.ring_f16 && (a.mode == comp_mode::none || a.comp_f16);
    if (g.n_split == 1 && all_f16 && mma_supported()) {  // tensor cores (see the path's banner)
        const size_t smem = mma_smem_bytes(a.d);
        static_assert(kMmaHeads == kHeadsPerBlock, "the two paths share the head-group grid");
        if (!smem_opt_in<attn_batch_mma_kernel>(smem))
            throw error("cuda ds4 attention batch: " + std::to_string(smem) +
                        " bytes of shared memory exceed the device's limit");
        auto al16 = [](const void *p, size_t stride) {
            return reinterpret_cast<uintptr_t>(p) % 16 == 0 && stride % 16 == 0;
        };
        const bool vec16 = al16(a.ring, a.ring_stride) && al16(chunk, chunk_stride) &&
                           (a.mode == comp_mode::none || al16(a.comp, a.comp_stride));
        attn_batch_mma_kernel<<<dim3(static_cast<unsigned>(n_tok), static_cast<unsigned>(head_groups(a))),
                                kMmaThreads, smem, s>>>(g, q, pos, a.sinks, a.rope, o, vec16);
        batch_check_launch("attention batch (tensor cores)");
        return;
    }
    // rows staged as f16 when every row the call can read is f16 (half the shared-memory traffic)
    if (a.ring_f16 && (a.mode == comp_mode::none || a.comp_f16))
        attn_batch_kernel<__half><<<grid, kThreads, sizeof(__half) * kTileRows * a.d, s>>>(g, q, pos, a.sinks, a.rope,
                                                                                           part, o);
    else
        attn_batch_kernel<float><<<grid, kThreads, sizeof(float) * kTileRows * a.d, s>>>(g, q, pos, a.sinks, a.rope,
                                                                                         part, o);
    batch_check_launch("attention batch");
    if (g.n_split > 1) {
        attn_batch_combine_kernel<<<dim3(static_cast<unsigned>(n_tok), static_cast<unsigned>(a.n_head)),
                                    kCombineThreads, 0, s>>>(g, part, a.sinks, a.rope, pos, o);
        batch_check_launch("attention batch combine");
    }
}

}  // namespace fathom::cuda::ds4
