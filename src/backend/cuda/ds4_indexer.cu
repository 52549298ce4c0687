// DS4 indexer on CUDA for one decoded token (spec ../shared/reference/ds4-architecture.md 4.5):
// scores of every visible compressed indexer row, score_c = sum_h w_h * max(0, q_h . K_c), and the
// exact top-k of them (larger score first, ties to the lower row, as the CPU's partial_sort),
// returned in ascending row order. Launchers: ds4_kernels.h (launch_indexer_select, host row count)
// and ds4_attn_kernels.h (launch_indexer_topk, row count derived on the device from the position,
// so it can be captured in a CUDA graph): both run the same two kernels.
//
// Scores: each head's dot product is a double sum of exact f32 x f32 products rounded once to f32,
// then w_h * relu(dot) is added over heads in head order with round-to-nearest f32 operations.
//   DS4 geometry (64 heads x 128 dims): indexer_score64_kernel repeats the CPU's dot_f32 order
//   exactly (16 double lanes, lane l summing dims l, l + 16, ... in order, then the pairwise tree
//   8/4/2/1), so the scores are the CPU's bits. 8 threads are the CPU's 16 lanes for 4 heads (q in
//   registers as doubles), the tree's last three steps a reduce-scatter over their shuffles.
//   Other geometries: indexer_score_kernel, one warp per row, sequential double sum per head (the
//   CPU's bits barring a double sum within 1e-16 of an f32 rounding boundary).
// Top-k: up to 4096 rows (16K context at ratio 4) one block holds the order-preserving keys in
// registers and finds the k-th largest by a 2-bit-per-step threshold search (topk_small); more rows:
// radix select of that key in 3 passes of 11/11/10 bits. Then an ordered compaction. Large row sets run
// the radix passes on a cluster of kClusterBlocks blocks (sm_90: histograms merged through distributed
// shared memory, in rank order); the others (and pre-sm_90 devices) on one block of the same kernel.
//
// Batches (launch_indexer_topk_batch, ds4_prefill.h): the same kernels with a token dimension (grid y):
// token t of the chunk sees (*pos + t + 1) / ratio rows, takes its query and weights at offset t and
// writes sel + t * topk, n_sel + t; block y of a launch uses score slot y (score + y * max_n). Every
// score is computed by the same code in the same order, so each token's selection is the decode
// launcher's, bit for bit; only the grid (blocks per token, cluster or single-block top-k) differs.
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <string>

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#include <cooperative_groups.h>
#endif

#include "backend/cuda/cuda_device.h"
#include "backend/cuda/cuda_mma.cuh"
#include "backend/cuda/ds4_attn_kernels.h"
#include "backend/cuda/ds4_kernels.h"
#include "backend/cuda/ds4_prefill.h"
#include "core/error.h"

#include "backend/cuda/ktrace.h"

FATHOM_KTRACE_TU(ds4_indexer)

namespace fathom::cuda::ds4 {
namespace {

constexpr int kScoreWarps = 8, kMaxIdxHeads = 128, kMaxIdxDim = 256;
constexpr int kSelectThreads = 1024;
constexpr int kClusterBlocks = 8;        // portable cluster size (sm_90)
constexpr int64_t kClusterMinRows = 4096;  // fewer rows: one block
constexpr int kKeyCache = 4096;           // keys per block kept in shared memory between passes
constexpr int kBins = 2048;               // 11-bit digits
constexpr int kFastHeads = 64, kFastDim = 128, kFastRows = 32;  // indexer_score64_kernel geometry

// Number of visible rows: fixed (pos == null) or (*pos + 1) / ratio capped at max_n (decode).
struct row_count {
    int64_t n_fixed = 0;
    const int64_t *pos = nullptr;
    int ratio = 1;
    int64_t max_n = 0;
    // Rows seen by token t of a batch (t = 0: the decode token at *pos).
    __device__ __forceinline__ int64_t get(int64_t t = 0) const {
        if (!pos) return n_fixed;
        const int64_t n = (*pos + t + 1) / ratio;
        return n < 0 ? 0 : (n < max_n ? n : max_n);
    }
};

// The token a block works for: token t0 + blockIdx.y of the batch (decode: t0 = 0, one grid row).
// Query / weights / output offsets are per token, the score slot per grid row (score_stride floats).
struct tok_off {
    int64_t t0 = 0;
    size_t score_stride = 0;
    __device__ __forceinline__ int64_t tok() const { return t0 + static_cast<int64_t>(blockIdx.y); }
    __device__ __forceinline__ size_t slot() const { return static_cast<size_t>(blockIdx.y) * score_stride; }
};

// One warp per row c (grid-stride); lane l owns heads l, l + 32, ... q is staged in shared memory
// with rows padded to idx_dim + 1 floats (lanes read different heads at one dim: conflict-free), the
// row K_c once per warp (broadcast reads).
template <bool F16>
__global__ void __launch_bounds__(32 * kScoreWarps)
    indexer_score_kernel(const float *__restrict__ q, const float *__restrict__ w, float w_scale,
                         const void *__restrict__ rows, size_t row_stride, row_count rc, int topk, int n_head, int dim,
                         float *__restrict__ score, tok_off to) {
    FATHOM_KTRACE_SCOPE(k_indexer_score);
    const int64_t tok = to.tok();
    const int64_t n = rc.get(tok);
    q += static_cast<size_t>(tok) * n_head * dim;
    w += static_cast<size_t>(tok) * n_head;
    score += to.slot();
    if (n <= topk) return;  // every row is taken: no scores needed (block-uniform exit)
    extern __shared__ float smem[];
    const int qs_stride = dim + 1;
    float *qs = smem;                                   // [n_head, dim + 1]
    float *ks = qs + n_head * qs_stride;                // [kScoreWarps, dim]
    float *ps = ks + kScoreWarps * dim;                 // [kScoreWarps, n_head]
    for (int i = threadIdx.x; i < n_head * dim; i += blockDim.x) qs[(i / dim) * qs_stride + i % dim] = q[i];
    __syncthreads();
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    float *kw = ks + warp * dim, *pw = ps + warp * n_head;
    for (int64_t c = static_cast<int64_t>(blockIdx.x) * kScoreWarps + warp; c < n;
         c += static_cast<int64_t>(gridDim.x) * kScoreWarps) {
        const uint8_t *rp = static_cast<const uint8_t *>(rows) + static_cast<size_t>(c) * row_stride;
        for (int j = lane; j < dim; j += 32)
            kw[j] = F16 ? __half2float(reinterpret_cast<const __half *>(rp)[j]) : reinterpret_cast<const float *>(rp)[j];
        __syncwarp();
        for (int h = lane; h < n_head; h += 32) {
            const float *qh = qs + h * qs_stride;
            double acc = 0;
            for (int j = 0; j < dim; ++j) acc = fma(static_cast<double>(qh[j]), static_cast<double>(kw[j]), acc);
            // (w_h * w_scale) is the CPU's scaled head weight; w_scale = 1 leaves w_h's bits.
            pw[h] = __fmul_rn(__fmul_rn(w[h], w_scale), fmaxf(0.0f, static_cast<float>(acc)));
        }
        __syncwarp();
        if (lane == 0) {
            float s = 0.0f;
            for (int h = 0; h < n_head; ++h) s = __fadd_rn(s, pw[h]);
            score[c] = s;
        }
        __syncwarp();
    }
}

// Scores for 64 heads x 128 dims, in dot_f32's order. Block: 256 threads = 32 groups of 8 lanes;
// warp w covers heads 16 (w % 4) .. + 16 (4 per group) of the rows of parity w / 4 in each tile of
// kFastRows rows (the 4 groups of a warp share the row: broadcast shared-memory reads). Lane m of a
// group stands for the CPU's double lanes m and m + 8: it holds q_h[m + 16 i + 8 p] (i < 8, p < 2) for
// its 4 heads in registers, sums each lane's 8 products in order, and adds the two (the tree's w = 8
// step). The steps w = 4, 2, 1 run as a reduce-scatter over the group's shuffles: a lane keeps half of
// its heads, adds the partner's value for them (the pair the CPU adds; addition commutes) and hands
// over the other half. Persistent blocks loop over row tiles; the next tile's rows are loaded into
// registers while the current one is scored, and the head sums of a tile (64 dependent adds per row,
// in head order) run during the next tile's scoring, spread over the warps.
__device__ __forceinline__ int ks_index(int j) {  // dim j -> slot: lane m's pair (m + 16 i, + 8) adjacent
    const int i = j / 16, rem = j % 16;
    return ((i * 8 + rem % 8) * 2) + rem / 8;
}

template <bool F16>
__device__ __forceinline__ void fetch_tile(const void *rows, size_t row_stride, int64_t c0, int64_t n, float *v) {
    constexpr int kPer = kFastRows * kFastDim / 256;
#pragma unroll
    for (int k = 0; k < kPer; ++k) {
        const int e = threadIdx.x + 256 * k, r = e / kFastDim, j = e % kFastDim;
        const int64_t c = c0 + r;
        const uint8_t *rp = static_cast<const uint8_t *>(rows) + static_cast<size_t>(c) * row_stride;
        v[k] = c >= n ? 0.0f
               : F16  ? __half2float(reinterpret_cast<const __half *>(rp)[j])
                      : reinterpret_cast<const float *>(rp)[j];
    }
}

// score[c0 + r] for the tile's rows r = 4 warp + lane (lane < 4): the CPU's head-order f32 sum.
__device__ __forceinline__ void sum_tile(const float (*part)[kFastHeads], int64_t c0, int64_t n, float *score) {
    const int lane = threadIdx.x & 31, r = 4 * (threadIdx.x >> 5) + lane;
    if (lane < 4 && c0 + r < n) {
        float sc = 0.0f;
#pragma unroll 16
        for (int h = 0; h < kFastHeads; ++h) sc = __fadd_rn(sc, part[r][h]);
        score[c0 + r] = sc;
    }
}

template <bool F16>
__global__ void __launch_bounds__(256, 1)
    indexer_score64_kernel(const float *__restrict__ q, const float *__restrict__ w, float w_scale,
                           const void *__restrict__ rows, size_t row_stride, row_count rc, int topk,
                           float *__restrict__ score, tok_off to) {
    FATHOM_KTRACE_SCOPE(k_indexer_score);
    static_assert(kFastRows == 32, "sum_tile maps 8 warps x 4 lanes to the tile's rows");
    const int64_t tok = to.tok();
    const int64_t n = rc.get(tok);
    q += static_cast<size_t>(tok) * kFastHeads * kFastDim;
    w += static_cast<size_t>(tok) * kFastHeads;
    score += to.slot();
    const int64_t first = static_cast<int64_t>(blockIdx.x) * kFastRows, step = static_cast<int64_t>(gridDim.x) * kFastRows;
    if (n <= topk || first >= n) return;  // no scores needed / no tile for this block (block-uniform exits)
    __shared__ __align__(16) double ks[kFastRows][kFastDim];  // the tile's rows as doubles, ks_index order
    __shared__ float part[2][kFastRows][kFastHeads];  // w_h * relu(dot) per row and head, two tiles (48 KB in all)
    const int tid = threadIdx.x, lane = tid & 31, m = lane & 7, warp = tid >> 5;
    const int h0 = 16 * (warp & 3) + 4 * (lane >> 3), rpar = warp >> 2;  // the group's heads h0 .. h0 + 3
    double qr[4][8][2];  // [head][i][p]: q_{h0 + hh}[m + 16 i + 8 p]
#pragma unroll
    for (int hh = 0; hh < 4; ++hh)
#pragma unroll
        for (int i = 0; i < 8; ++i)
#pragma unroll
            for (int p = 0; p < 2; ++p)
                qr[hh][i][p] = static_cast<double>(q[(h0 + hh) * kFastDim + m + 16 * i + 8 * p]);
    const bool up4 = (m & 4) != 0, up2 = (m & 2) != 0;
    const int my_head = h0 + (up4 ? 2 : 0) + (up2 ? 1 : 0);  // the head a lane ends with (m even)
    const float w_my = __fmul_rn(w[my_head], w_scale);     // the CPU's scaled weight of that head
    constexpr int kPer = kFastRows * kFastDim / 256;
    float v[kPer];
    fetch_tile<F16>(rows, row_stride, first, n, v);
    int64_t prev = -1;  // the tile whose head sums are pending (in part[pb ^ 1])
    int pb = 0;
    for (int64_t c0 = first; c0 < n; c0 += step) {
        __syncthreads();  // ks consumed by the previous tile's scoring
#pragma unroll
        for (int k = 0; k < kPer; ++k) {
            const int e = tid + 256 * k;
            ks[e / kFastDim][ks_index(e % kFastDim)] = static_cast<double>(v[k]);
        }
        __syncthreads();
        if (c0 + step < n) fetch_tile<F16>(rows, row_stride, c0 + step, n, v);  // in flight while scoring
        if (prev >= 0) sum_tile(part[pb ^ 1], prev, n, score);
        for (int r = rpar; r < kFastRows; r += 2) {
            if (c0 + r >= n) break;  // warp-uniform: the warp's groups share r
            double acc[4][2];
#pragma unroll
            for (int hh = 0; hh < 4; ++hh) acc[hh][0] = acc[hh][1] = 0.0;
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                const double2 kk = *reinterpret_cast<const double2 *>(&ks[r][(i * 8 + m) * 2]);
#pragma unroll
                for (int hh = 0; hh < 4; ++hh) {
                    acc[hh][0] = fma(qr[hh][i][0], kk.x, acc[hh][0]);
                    acc[hh][1] = fma(qr[hh][i][1], kk.y, acc[hh][1]);
                }
            }
            double b[4], c2[2], d;
#pragma unroll
            for (int hh = 0; hh < 4; ++hh) b[hh] = acc[hh][0] + acc[hh][1];  // w = 8, in the lane
#pragma unroll
            for (int j = 0; j < 2; ++j) {  // w = 4: lanes with m & 4 keep heads 2-3, the others 0-1
                const double give = up4 ? b[j] : b[2 + j], keep = up4 ? b[2 + j] : b[j];
                c2[j] = keep + __shfl_xor_sync(0xffffffffu, give, 4);
            }
            {  // w = 2
                const double give = up2 ? c2[0] : c2[1], keep = up2 ? c2[1] : c2[0];
                d = keep + __shfl_xor_sync(0xffffffffu, give, 2);
            }
            const double e = d + __shfl_xor_sync(0xffffffffu, d, 1);  // w = 1
            if ((m & 1) == 0) part[pb][r][my_head] = __fmul_rn(w_my, fmaxf(0.0f, __double2float_rn(e)));
        }
        prev = c0;
        pb ^= 1;
    }
    __syncthreads();
    if (prev >= 0) sum_tile(part[pb ^ 1], prev, n, score);
}

// ---- fast scores for prefill chunks (tensor cores) ------------------------------------------------
// score_c = sum_h (w_h * w_scale) * relu(q_h . K_c) for the DS4 geometry (64 heads x 128 dims, f16
// rows) with mma.m16n8k16: rows are exact in f16, each query is split into f16 hi + lo (x = hi + lo to
// ~2^-22 relative), products accumulate in f32 in the tensor cores' order, and the head sum is a
// shuffle / shared-memory tree. Not the CPU's bits (the exact kernel above is): relative error ~1e-6,
// so a near-tie between two rows can select the other one. Used for prefill chunks only
// (launch_indexer_topk_batch with exact = false), where the exact double kernel is ~15x slower.
// Block: 8 warps, 2 tokens (warps 0-3 token 2 y, warps 4-7 token 2 y + 1), warp w owning heads
// 16 (w % 4) .. + 15 of its token; each 64-row tile of K is staged once in shared memory for both tokens.
constexpr int kMmaTok = 2, kMmaTile = 64, kMmaLd = kFastDim + 8;


// f16 hi / lo halves of the pair (x0, x1) packed as mma operands (element 0 in the low half).
__device__ __forceinline__ void split_pair(float x0, float x1, uint32_t &hi, uint32_t &lo) {
    const __half h0 = __float2half_rn(x0), h1 = __float2half_rn(x1);
    const __half l0 = __float2half_rn(x0 - __half2float(h0)), l1 = __float2half_rn(x1 - __half2float(h1));
    hi = static_cast<uint32_t>(__half_as_ushort(h0)) | (static_cast<uint32_t>(__half_as_ushort(h1)) << 16);
    lo = static_cast<uint32_t>(__half_as_ushort(l0)) | (static_cast<uint32_t>(__half_as_ushort(l1)) << 16);
}

__global__ void __launch_bounds__(256)
    indexer_score_mma_kernel(const float *__restrict__ q, const float *__restrict__ w, float w_scale,
                             const __half *__restrict__ rows, size_t row_stride_h, row_count rc, int topk,
                             float *__restrict__ score, int64_t t0, int64_t g, size_t score_stride) {
    FATHOM_KTRACE_SCOPE(k_indexer_score);
    __shared__ __align__(16) __half ks[kMmaTile * kMmaLd];
    __shared__ float part[kMmaTok][4][kMmaTile];
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, gq = lane >> 2, tq = lane & 3;
    const int tw = warp >> 2, h0 = 16 * (warp & 3);  // token of the warp within the block, first head
    const int64_t ti = static_cast<int64_t>(blockIdx.y) * kMmaTok + tw;  // token index within the group
    const bool live = ti < g;
    const int64_t n_w = live ? rc.get(t0 + ti) : 0;  // rows the warp's token sees
    int64_t n_blk = 0;  // the most rows either token sees (block-uniform)
    for (int j = 0; j < kMmaTok; ++j) {
        const int64_t tj = static_cast<int64_t>(blockIdx.y) * kMmaTok + j;
        if (tj < g) n_blk = max(n_blk, rc.get(t0 + tj));
    }
    if (n_blk <= topk) return;  // no token of the block needs scores (block-uniform)
    // A fragments of the warp's 16 heads x 128 dims, hi and lo: rows gq / gq + 8, k pairs 2 tq (+8).
    uint32_t ah[8][4], al[8][4];
    const float *qt = q + static_cast<size_t>(live ? t0 + ti : t0) * kFastHeads * kFastDim;
#pragma unroll
    for (int kk = 0; kk < 8; ++kk) {
#pragma unroll
        for (int r = 0; r < 4; ++r) {
            const int head = h0 + gq + ((r & 1) ? 8 : 0), k = 16 * kk + 2 * tq + ((r & 2) ? 8 : 0);
            const float2 x = live ? *reinterpret_cast<const float2 *>(qt + head * kFastDim + k) : make_float2(0.0f, 0.0f);
            split_pair(x.x, x.y, ah[kk][r], al[kk][r]);
        }
    }
    const float *wt = w + static_cast<size_t>(live ? t0 + ti : t0) * kFastHeads;
    const float wg = live ? __fmul_rn(wt[h0 + gq], w_scale) : 0.0f, wg8 = live ? __fmul_rn(wt[h0 + gq + 8], w_scale) : 0.0f;
    for (int64_t c0 = static_cast<int64_t>(blockIdx.x) * kMmaTile; c0 < n_blk;
         c0 += static_cast<int64_t>(gridDim.x) * kMmaTile) {
        __syncthreads();  // the previous tile's ks and part are consumed
        // Stage rows c0 .. c0 + 63 (rows past n_blk: zeros): 64 x 16 chunks of 16 bytes.
        for (int e = tid; e < kMmaTile * (kFastDim / 8); e += 256) {
            const int r = e >> 4, c = e & 15;
            const int64_t row = c0 + r;
            uint4 v = make_uint4(0, 0, 0, 0);
            if (row < n_blk) v = *reinterpret_cast<const uint4 *>(rows + static_cast<size_t>(row) * row_stride_h + 8 * c);
            *reinterpret_cast<uint4 *>(ks + r * kMmaLd + 8 * c) = v;
        }
        __syncthreads();
        if (c0 < n_w) {  // warp-uniform: the warp's token needs this tile
#pragma unroll 2
            for (int j = 0; j < kMmaTile / 8; ++j) {
                float c[4] = {0.0f, 0.0f, 0.0f, 0.0f};
                const __half *kr = ks + (8 * j + gq) * kMmaLd + 2 * tq;
#pragma unroll
                for (int kk = 0; kk < 8; ++kk) {
                    const uint32_t b0 = *reinterpret_cast<const uint32_t *>(kr + 16 * kk);
                    const uint32_t b1 = *reinterpret_cast<const uint32_t *>(kr + 16 * kk + 8);
                    mma_hi_lo(c, ah[kk], al[kk], b0, b1);
                }
                // heads gq (c0, c1) and gq + 8 (c2, c3); columns 8 j + 2 tq, + 1
                float v0 = __fmul_rn(wg, fmaxf(0.0f, c[0])) + __fmul_rn(wg8, fmaxf(0.0f, c[2]));
                float v1 = __fmul_rn(wg, fmaxf(0.0f, c[1])) + __fmul_rn(wg8, fmaxf(0.0f, c[3]));
#pragma unroll
                for (int o = 4; o < 32; o <<= 1) {  // over gq: the warp's 16 heads
                    v0 += __shfl_xor_sync(0xffffffffu, v0, o);
                    v1 += __shfl_xor_sync(0xffffffffu, v1, o);
                }
                if (gq == 0) {
                    part[tw][warp & 3][8 * j + 2 * tq] = v0;
                    part[tw][warp & 3][8 * j + 2 * tq + 1] = v1;
                }
            }
        }
        __syncthreads();
        // 256 threads: token tid / 128 (of the block), column tid % 64 ... two passes of 128 outputs
        for (int e = tid; e < kMmaTok * kMmaTile; e += 256) {
            const int tk = e / kMmaTile, col = e % kMmaTile;
            const int64_t tj = static_cast<int64_t>(blockIdx.y) * kMmaTok + tk;
            if (tj >= g) continue;
            const int64_t row = c0 + col;
            if (row < rc.get(t0 + tj))
                score[static_cast<size_t>(tj) * score_stride + row] =
                    (part[tk][0][col] + part[tk][1][col]) + (part[tk][2][col] + part[tk][3][col]);
        }
    }
}

// Order-preserving key: larger float -> larger key (-0 mapped with +0: equal scores tie).
__device__ __forceinline__ uint32_t key_of(float f) {
    if (f == 0.0f) f = 0.0f;
    const uint32_t u = __float_as_uint(f);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// Of the block's 32 warp totals warp_tot[0 .. 32) (blockDim.x == kSelectThreads): the sum over the
// warps before this thread's, and `total` of all. Each lane loads one total and the warp scans them
// with shuffles (integer sums: exact in any order), instead of every thread adding 32 loads: the
// select kernel runs on one SM, bound by its instruction count.
__device__ __forceinline__ int warps_before(const int *warp_tot, int &total) {
    static_assert(kSelectThreads / 32 == 32, "one warp total per lane");
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int v = warp_tot[lane];
    int incl = v;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const int y = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o) incl += y;
    }
    total = __shfl_sync(0xffffffffu, incl, 31);
    return __shfl_sync(0xffffffffu, incl - v, warp);
}

// Exclusive prefix of a 0/1 flag over the block of kSelectThreads (in thread order) and the block total.
__device__ __forceinline__ int block_scan01(bool flag, int *warp_tot, int &total) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const unsigned b = __ballot_sync(0xffffffffu, flag);
    const int in_warp = __popc(b & ((1u << lane) - 1u));
    __syncthreads();  // warp_tot free to reuse
    if (lane == 0) warp_tot[warp] = __popc(b);
    __syncthreads();
    return warps_before(warp_tot, total) + in_warp;
}

// ---- top-k of at most kRegKeys * kSelectThreads rows: keys in registers, rank 0 alone ---------------
// The decode step's usual case (2048 rows at 8K context, up to 4096 at 16K), where the radix passes
// (histograms of 2048 bins, on a cluster merged through distributed shared memory) cost more than the
// rows: thread t holds the keys of rows t + 1024 j (j < kRegKeys; absent rows: key 0, never counted since
// every threshold tried is >= 1). The k-th largest key T = the largest v with count(key >= v) >= k, found
// 2 bits per step from the top: a step counts the keys >= T | c << b for c = 1, 2, 3 at once (three
// 10-bit fields of one word: a thread adds <= 4 per field, a warp <= 128, so the warp sum cannot carry),
// with one barrier (the warp sums double-buffered by step parity), then every warp sums the 32 warp words
// field by field. Then the ordered compaction: rows with key > T and the first need = k - count(key > T)
// rows with key == T in row order (the radix path's rule: the same selections in the same order); row
// order = chunk j major, thread minor, so a row's place is the count in earlier chunks + in earlier
// warps of its chunk + in earlier lanes of its warp (16-bit per-chunk fields, two per word).
// Measured on the H200 (decode at 8K, one call alternating the builds): 130.9-131.5 -> 131.7-132.3 tok/s.
constexpr int kRegKeys = 4;

__device__ __forceinline__ uint32_t warp_sum_u32(uint32_t v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    return __reduce_add_sync(0xffffffffu, v);
#else
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
#endif
}

// Per-chunk counts of a flag: 16-bit fields (chunk 2 h + f in field f of word h; <= 1024 per field).
struct chunk_counts {
    uint32_t w[kRegKeys / 2];
    __device__ __forceinline__ int at(int j) const {
        return static_cast<int>((w[j >> 1] >> (16 * (j & 1))) & 0xFFFFu);
    }
};
// Exclusive prefix over the block's warps of the packed per-warp counts wt[h][warp] (stored, after a
// barrier), and the block totals: warps_before per word (the packed fields add without carries: a word
// stays below 2^27, so its int sums are the unsigned ones).
__device__ __forceinline__ void warp_prefix(const uint32_t (*wt)[32], chunk_counts &before, chunk_counts &total) {
#pragma unroll
    for (int h = 0; h < kRegKeys / 2; ++h) {
        int tot = 0;
        before.w[h] = static_cast<uint32_t>(warps_before(reinterpret_cast<const int *>(wt[h]), tot));
        total.w[h] = static_cast<uint32_t>(tot);
    }
}

// Top-k of score[0 .. n) (k < n <= kRegKeys * kSelectThreads) into out, ascending rows. Every thread of
// the block calls it.
__device__ void topk_small(const float *__restrict__ score, int64_t n, int k, int32_t *__restrict__ out) {
    static_assert(kSelectThreads == 1024 && kRegKeys % 2 == 0 && kRegKeys <= 8,
                  "32 warps; 10-bit warp fields");
    __shared__ uint32_t wsum[2][32];
    __shared__ uint32_t wt[2][kRegKeys / 2][32];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    uint32_t key[kRegKeys];
#pragma unroll
    for (int j = 0; j < kRegKeys; ++j) {
        const int64_t i = tid + static_cast<int64_t>(kSelectThreads) * j;
        key[j] = i < n ? key_of(score[i]) : 0u;
    }
    uint32_t T = 0;
#pragma unroll 1
    for (int step = 0; step < 16; ++step) {
        const int b = 30 - 2 * step;
        const uint32_t t1 = T | (1u << b), t2 = T | (2u << b), t3 = T | (3u << b);
        uint32_t packed = 0;
#pragma unroll
        for (int j = 0; j < kRegKeys; ++j)
            packed += (key[j] >= t1 ? 1u : 0u) + (key[j] >= t2 ? (1u << 10) : 0u) +
                      (key[j] >= t3 ? (1u << 20) : 0u);
        packed = warp_sum_u32(packed);
        if (lane == 0) wsum[step & 1][warp] = packed;
        __syncthreads();
        const uint32_t v = wsum[step & 1][lane];
        const int c1 = static_cast<int>(warp_sum_u32(v & 1023u));
        const int c2 = static_cast<int>(warp_sum_u32((v >> 10) & 1023u));
        const int c3 = static_cast<int>(warp_sum_u32((v >> 20) & 1023u));
        T |= (c3 >= k ? 3u : c2 >= k ? 2u : c1 >= k ? 1u : 0u) << b;
    }
    // T is the k-th largest key. Compaction: per-chunk counts of "> T" and "== T", then of "taken".
    const unsigned below = (1u << lane) - 1u;
    bool gt[kRegKeys], eq[kRegKeys];
    unsigned beq[kRegKeys];
    uint32_t pg[kRegKeys / 2] = {}, pe[kRegKeys / 2] = {};
#pragma unroll
    for (int j = 0; j < kRegKeys; ++j) {
        const bool ok = tid + static_cast<int64_t>(kSelectThreads) * j < n;
        gt[j] = ok && key[j] > T;
        eq[j] = ok && key[j] == T;
        beq[j] = __ballot_sync(0xffffffffu, eq[j]);
        pg[j >> 1] |= static_cast<uint32_t>(__popc(__ballot_sync(0xffffffffu, gt[j]))) << (16 * (j & 1));
        pe[j >> 1] |= static_cast<uint32_t>(__popc(beq[j])) << (16 * (j & 1));
    }
    if (lane == 0)
#pragma unroll
        for (int h = 0; h < kRegKeys / 2; ++h) {
            wt[0][h][warp] = pe[h];
            wt[1][h][warp] = pg[h];
        }
    __syncthreads();
    chunk_counts eb, et, gb, gtot;
    warp_prefix(wt[0], eb, et);
    warp_prefix(wt[1], gb, gtot);
    int n_gt = 0;
#pragma unroll
    for (int j = 0; j < kRegKeys; ++j) n_gt += gtot.at(j);
    const int need = k - n_gt;  // rows equal to T to take: the first in row order
    bool take[kRegKeys];
    unsigned bt[kRegKeys];
    uint32_t pt[kRegKeys / 2] = {};
    int eq_chunks = 0;  // rows equal to T in the chunks before j
#pragma unroll
    for (int j = 0; j < kRegKeys; ++j) {
        const int eq_before = eq_chunks + eb.at(j) + __popc(beq[j] & below);
        take[j] = gt[j] || (eq[j] && eq_before < need);
        bt[j] = __ballot_sync(0xffffffffu, take[j]);
        pt[j >> 1] |= static_cast<uint32_t>(__popc(bt[j])) << (16 * (j & 1));
        eq_chunks += et.at(j);
    }
    __syncthreads();  // every warp has read wt[0] above before it is overwritten
    if (lane == 0)
#pragma unroll
        for (int h = 0; h < kRegKeys / 2; ++h) wt[0][h][warp] = pt[h];
    __syncthreads();
    chunk_counts tb, tt;
    warp_prefix(wt[0], tb, tt);
    int base = 0;  // rows taken in the chunks before j
#pragma unroll
    for (int j = 0; j < kRegKeys; ++j) {
        if (take[j]) out[base + tb.at(j) + __popc(bt[j] & below)] = tid + kSelectThreads * j;
        base += tt.at(j);
    }
}

// The cluster the block belongs to (nb blocks; nb == 1: the block alone, no cluster instructions).
struct cluster_ctx {
    int nb = 1, rank = 0;
    __device__ void sync() const {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
        if (nb > 1) {
            cooperative_groups::this_cluster().sync();
            return;
        }
#endif
        __syncthreads();
    }
    // Block r's copy of the shared variable p.
    template <class T>
    __device__ T *at(T *p, int r) const {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
        if (nb > 1) return cooperative_groups::this_cluster().map_shared_rank(p, r);
#endif
        return p;
    }
};

// Exact top-k of score[0 .. n) by a cluster of nb blocks (grid = the cluster): block r owns the rows
// [r * chunk, (r + 1) * chunk). Three radix passes (bits 31-21, 20-10, 9-0 of the key) narrow the key
// of the k-th largest score: per pass each block histograms its candidates (keys matching the prefix
// so far) with warp-aggregated shared atomics, the blocks sum all histograms in rank order, and every
// block finds the same digit with a suffix scan. Then each block takes its keys above the threshold and
// the first `need` equal ones in row order (counts before it from lower ranks), written at its offset.
__global__ void __launch_bounds__(kSelectThreads)
    topk_select_kernel(const float *__restrict__ score, row_count rc, int k, int nb, int32_t *__restrict__ out,
                       int32_t *__restrict__ n_out, tok_off to) {
    FATHOM_KTRACE_SCOPE(k_topk_select);
    cluster_ctx cl;
    cl.nb = nb;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    if (nb > 1) cl.rank = static_cast<int>(cooperative_groups::this_cluster().block_rank());
#endif
    const int64_t tok = to.tok();
    const int64_t n = rc.get(tok);
    score += to.slot();
    out += static_cast<size_t>(tok) * k;
    if (n_out) n_out += tok;
    const int tid = threadIdx.x, lane = tid & 31;
    if (tid == 0 && cl.rank == 0 && n_out) *n_out = static_cast<int32_t>(n < k ? n : k);
    if (n <= k) {  // every row, ascending (uniform over the cluster: no block waits on another)
        for (int64_t c = static_cast<int64_t>(cl.rank) * blockDim.x + tid; c < n;
             c += static_cast<int64_t>(nb) * blockDim.x)
            out[c] = static_cast<int32_t>(c);
        return;
    }
    if (n <= static_cast<int64_t>(kRegKeys) * kSelectThreads) {  // uniform over a cluster: rank 0 alone
        if (cl.rank == 0) topk_small(score, n, k, out);
        return;
    }
    __shared__ int hist[2][kBins];  // double-buffered: pass p zeroes hist[p & 1] while others may read hist[1 - (p & 1)]
    __shared__ int tot[kBins];
    __shared__ uint32_t keys[kKeyCache];
    __shared__ int warp_tot[kSelectThreads / 32];
    __shared__ int s_bin, s_cum;
    __shared__ int s_counts[2];  // this block's keys above the threshold, equal to it
    const int64_t chunk = (n + nb - 1) / nb, lo = std::min<int64_t>(n, cl.rank * chunk),
                  len = std::min<int64_t>(n, lo + chunk) - lo;
    auto key_at = [&](int64_t i) -> uint32_t { return i < kKeyCache ? keys[i] : key_of(score[lo + i]); };

    uint32_t prefix = 0, mask = 0;
    int need = k;  // how many of the remaining candidates (key & mask == prefix) to take
    for (int pass = 0; pass < 3; ++pass) {
        const int shift = pass == 0 ? 21 : pass == 1 ? 10 : 0;
        int *h = hist[pass & 1];
        for (int i = tid; i < kBins; i += blockDim.x) h[i] = 0;
        __syncthreads();
        for (int64_t i0 = 0; i0 < len; i0 += blockDim.x) {  // warp-uniform trip count
            const int64_t i = i0 + tid;
            uint32_t bin = 0xffffffffu;  // not a candidate
            if (i < len) {
                uint32_t key;
                if (pass == 0) {
                    key = key_of(score[lo + i]);
                    if (i < kKeyCache) keys[i] = key;
                } else {
                    key = key_at(i);
                }
                if ((key & mask) == prefix) bin = (key >> shift) & (kBins - 1);
            }
            const unsigned peers = __match_any_sync(0xffffffffu, bin);
            if (bin != 0xffffffffu && lane == __ffs(peers) - 1) atomicAdd(&h[bin], __popc(peers));
        }
        cl.sync();  // every block's histogram complete (and, nb == 1, this block's)
#pragma unroll
        for (int i0 = 0; i0 < kBins; i0 += kSelectThreads) {  // all remote loads issued, then summed in rank order
            const int i = i0 + tid;
            int hv[kClusterBlocks];
#pragma unroll
            for (int r = 0; r < kClusterBlocks; ++r) hv[r] = r < nb ? cl.at(h, r)[i] : 0;
            int t = 0;
#pragma unroll
            for (int r = 0; r < kClusterBlocks; ++r) t += hv[r];
            tot[i] = t;
        }
        __syncthreads();
        // Thread u covers bins 2t + 1, 2t with t = kSelectThreads - 1 - u (u ascending = bins
        // descending); an inclusive scan over u gives the count of candidates in higher bins.
        {
            const int t = kSelectThreads - 1 - tid;
            const int hi = tot[2 * t + 1], lo_c = tot[2 * t], v = hi + lo_c;
            int incl = v;
#pragma unroll
            for (int o = 1; o < 32; o <<= 1) {
                const int y = __shfl_up_sync(0xffffffffu, incl, o);
                if (lane >= o) incl += y;
            }
            if (lane == 31) warp_tot[tid >> 5] = incl;
            __syncthreads();
            int all = 0;
            incl += warps_before(warp_tot, all);
            const int excl = incl - v;
            if (excl < need && need <= excl + hi) {
                s_bin = 2 * t + 1;
                s_cum = excl;
            } else if (excl + hi < need && need <= incl) {
                s_bin = 2 * t;
                s_cum = excl + hi;
            }
        }
        __syncthreads();
        prefix |= static_cast<uint32_t>(s_bin) << shift;
        mask |= static_cast<uint32_t>(kBins - 1) << shift;
        need -= s_cum;
        __syncthreads();  // s_bin / s_cum / warp_tot reused by the next pass
    }
    // prefix = key of the k-th largest score. This block's counts above it and equal to it.
    int gt = 0, eq = 0;
    for (int64_t i = tid; i < len; i += blockDim.x) {
        const uint32_t key = key_at(i);
        gt += key > prefix;
        eq += key == prefix;
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        gt += __shfl_xor_sync(0xffffffffu, gt, o);
        eq += __shfl_xor_sync(0xffffffffu, eq, o);
    }
    if (tid == 0) s_counts[0] = s_counts[1] = 0;
    __syncthreads();
    if (lane == 0) {  // integer sums: any order gives the same counts
        atomicAdd(&s_counts[0], gt);
        atomicAdd(&s_counts[1], eq);
    }
    cl.sync();  // every block's counts complete
    int eq_base = 0, out_base = 0;
    for (int r = 0; r < cl.rank; ++r) {
        const int *cr = cl.at(s_counts, r);
        const int r_gt = cr[0], r_eq = cr[1];
        out_base += r_gt + std::min(std::max(need - eq_base, 0), r_eq);
        eq_base += r_eq;
    }
    // Ordered compaction of this block's rows.
    int eq_seen = eq_base, written = out_base;
    for (int64_t i0 = 0; i0 < len; i0 += blockDim.x) {
        const int64_t i = i0 + tid;
        const uint32_t key = i < len ? key_at(i) : 0u;
        const bool is_eq = i < len && key == prefix;
        int eq_total;
        const int eq_before = eq_seen + block_scan01(is_eq, warp_tot, eq_total);
        const bool take = i < len && (key > prefix || (is_eq && eq_before < need));
        int take_total;
        const int pos = written + block_scan01(take, warp_tot, take_total);
        if (take) out[pos] = static_cast<int32_t>(lo + i);
        eq_seen += eq_total;
        written += take_total;
    }
    cl.sync();  // no block leaves while another may still read its shared counts
}

void check_launch(const char *what) {
    const cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) throw error(std::string("cuda ds4 ") + what + ": launch failed: " + cudaGetErrorString(e));
}

// One group of g tokens (t0 .. t0 + g - 1 of the batch; decode: t0 = 0, g = 1): scores into the
// group's score slots (score_stride floats apart), then the top-k of each token. Grids sized from max_n.
struct idx_group {
    int64_t t0 = 0, g = 1;
    size_t score_stride = 0;
};

void indexer_group(const float *q, const float *w, float w_scale, const void *rows, bool rows_f16, size_t row_stride,
                   const row_count &rc, int64_t max_n, int n_head, int dim, int topk, float *score, int32_t *out,
                   int32_t *n_out, const idx_group &grp, int sms, int cc_major, bool exact, cudaStream_t s) {
    tok_off to;
    to.t0 = grp.t0;
    to.score_stride = grp.score_stride;
    const unsigned gy = static_cast<unsigned>(grp.g);
    // Blocks per token: the decode grid for one token; for a batch enough to give ~4 blocks per SM in
    // all (each block loops over its token's row tiles; per-score arithmetic does not depend on it).
    auto per_tok = [&](int64_t tiles, int64_t one) {
        const int64_t want = grp.g == 1 ? one : std::max<int64_t>(1, (4 * static_cast<int64_t>(sms) + grp.g - 1) / grp.g);
        return static_cast<unsigned>(std::max<int64_t>(1, std::min(tiles, want)));
    };
    if (!exact && max_n > topk && n_head == kFastHeads && dim == kFastDim && rows_f16 && cc_major >= 8 &&
        row_stride % 16 == 0 && reinterpret_cast<uintptr_t>(rows) % 16 == 0) {  // prefill: tensor cores
        const unsigned gyy = static_cast<unsigned>((grp.g + kMmaTok - 1) / kMmaTok);
        const int64_t tiles = (max_n + kMmaTile - 1) / kMmaTile;
        const unsigned gx = static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>(tiles, (4 * static_cast<int64_t>(sms) + gyy - 1) / gyy)));
        indexer_score_mma_kernel<<<dim3(gx, gyy), 256, 0, s>>>(q, w, w_scale, static_cast<const __half *>(rows),
                                                               row_stride / 2, rc, topk, score, grp.t0, grp.g,
                                                               grp.score_stride);
        check_launch("indexer score (tensor cores)");
    } else if (max_n > topk && n_head == kFastHeads && dim == kFastDim) {  // the DS4 geometry, CPU-exact order
        const dim3 grid(per_tok((max_n + kFastRows - 1) / kFastRows, sms), gy);
        if (rows_f16)
            indexer_score64_kernel<true><<<grid, 256, 0, s>>>(q, w, w_scale, rows, row_stride, rc, topk, score, to);
        else
            indexer_score64_kernel<false><<<grid, 256, 0, s>>>(q, w, w_scale, rows, row_stride, rc, topk, score, to);
        check_launch("indexer score");
    } else if (max_n > topk) {  // otherwise no call can need scores
        const size_t smem = sizeof(float) * (static_cast<size_t>(n_head) * (dim + 1) + kScoreWarps * dim +
                                             static_cast<size_t>(kScoreWarps) * n_head);
        if (smem > 48 * 1024)
            throw error("cuda ds4 indexer: query of " + std::to_string(smem) + " bytes exceeds 48 KB");
        const dim3 grid(per_tok((max_n + kScoreWarps - 1) / kScoreWarps, 4 * static_cast<int64_t>(sms)), gy);
        if (rows_f16)
            indexer_score_kernel<true><<<grid, 32 * kScoreWarps, smem, s>>>(q, w, w_scale, rows, row_stride, rc, topk,
                                                                            n_head, dim, score, to);
        else
            indexer_score_kernel<false><<<grid, 32 * kScoreWarps, smem, s>>>(q, w, w_scale, rows, row_stride, rc,
                                                                             topk, n_head, dim, score, to);
        check_launch("indexer score");
    }
    // Top-k: a cluster of kClusterBlocks per token when the row set can be large, the device has
    // clusters and the group is small enough for the clusters to run side by side (a large batch keeps
    // every SM busy with one block per token instead).
    const bool cluster = cc_major >= 9 && max_n > kClusterMinRows &&
                         grp.g * kClusterBlocks <= 2 * static_cast<int64_t>(sms);
    const int nb = cluster ? kClusterBlocks : 1;
    if (nb == 1) {
        topk_select_kernel<<<dim3(1, gy), kSelectThreads, 0, s>>>(score, rc, topk, 1, out, n_out, to);
    } else {
        cudaLaunchConfig_t cfg = {};
        cfg.gridDim = dim3(static_cast<unsigned>(nb), gy);  // grid row y is token t0 + y's cluster
        cfg.blockDim = dim3(kSelectThreads);
        cfg.stream = s;
        cudaLaunchAttribute attr[1];
        attr[0].id = cudaLaunchAttributeClusterDimension;
        attr[0].val.clusterDim.x = static_cast<unsigned>(nb);
        attr[0].val.clusterDim.y = 1;
        attr[0].val.clusterDim.z = 1;
        cfg.attrs = attr;
        cfg.numAttrs = 1;
        const cudaError_t e = cudaLaunchKernelEx(&cfg, topk_select_kernel, score, rc, topk, nb, out, n_out, to);
        if (e != cudaSuccess)
            throw error(std::string("cuda ds4 indexer top-k: cluster launch failed: ") + cudaGetErrorString(e));
    }
    check_launch("indexer top-k");
}

// Scores then top-k for n_tok tokens (rows counted by rc, at most max_n each), in groups of as many
// tokens as score_floats holds score rows (max_n floats each).
void indexer_run(const float *q, const float *w, float w_scale, const void *rows, bool rows_f16, size_t row_stride,
                 const row_count &rc, int64_t max_n, int n_head, int dim, int topk, int64_t n_tok, float *score,
                 size_t score_floats, int32_t *out, int32_t *n_out, cudaStream_t s, bool exact = true) {
    if (n_head < 1 || n_head > kMaxIdxHeads || dim < 1 || dim > kMaxIdxDim || topk < 1)
        throw error("cuda ds4 indexer: unsupported geometry: " + std::to_string(n_head) + " heads of " +
                    std::to_string(dim) + " (<= 128 heads, dim <= 256), top-k " + std::to_string(topk));
    if (max_n < 0 || max_n > 0x7fffffff)
        throw error("cuda ds4 indexer: row count " + std::to_string(max_n) + " out of range");
    if (n_tok < 1) return;
    int64_t per_group = n_tok;  // tokens per group (score rows the scratch holds)
    if (max_n > topk) {
        if (score_floats < static_cast<size_t>(max_n))
            throw error("cuda ds4 indexer: score scratch of " + std::to_string(score_floats) + " floats below " +
                        std::to_string(max_n) + " rows");
        per_group = std::min<int64_t>(n_tok, static_cast<int64_t>(score_floats / static_cast<size_t>(max_n)));
    }
    per_group = std::min<int64_t>(per_group, 65535);  // grid y
    const device_caps *caps = current_device_caps();  // null (query failed): 1 SM, no tensor cores
    const int sms = std::max(caps ? caps->sm_count : 0, 1), cc_major = caps ? caps->cc_major : 0;
    for (int64_t t0 = 0; t0 < n_tok; t0 += per_group) {
        idx_group grp;
        grp.t0 = t0;
        grp.g = std::min(per_group, n_tok - t0);
        grp.score_stride = static_cast<size_t>(max_n);
        indexer_group(q, w, w_scale, rows, rows_f16, row_stride, rc, max_n, n_head, dim, topk, score, out, n_out, grp,
                      sms, cc_major, exact, s);
    }
}

}  // namespace

void launch_indexer_select(const float *q, const float *w, const void *rows, bool rows_f16, size_t row_stride,
                           int64_t n, int n_head, int dim, int topk, float *score, int32_t *out, cudaStream_t s) {
    if (n < 0 || n > 0x7fffffff) throw error("cuda ds4 indexer: row count " + std::to_string(n) + " out of range");
    if (n == 0) return;
    row_count rc;
    rc.n_fixed = n;
    indexer_run(q, w, 1.0f, rows, rows_f16, row_stride, rc, n, n_head, dim, topk, 1, score, static_cast<size_t>(n),
                out, nullptr, s);
}

void launch_indexer_topk(const float *q, const float *w, float w_scale, const void *rows, bool rows_f16,
                         size_t row_stride, int ratio, int64_t max_n, int n_head, int dim, int topk,
                         const int64_t *pos, float *score, int32_t *sel, int32_t *n_sel, cudaStream_t s, bool exact) {
    if (ratio < 1) throw error("cuda ds4 indexer: ratio " + std::to_string(ratio) + " must be positive");
    row_count rc;
    rc.pos = pos;
    rc.ratio = ratio;
    rc.max_n = max_n;
    indexer_run(q, w, w_scale, rows, rows_f16, row_stride, rc, max_n, n_head, dim, topk, 1, score,
                static_cast<size_t>(std::max<int64_t>(max_n, 0)), sel, n_sel, s, exact);
}

void launch_indexer_topk_batch(const float *q, const float *w, float w_scale, const void *rows, bool rows_f16,
                               size_t row_stride, int ratio, int64_t max_n, int n_head, int dim, int topk,
                               int64_t n_tok, const int64_t *pos, float *score, size_t score_floats, int32_t *sel,
                               int32_t *n_sel, cudaStream_t s, bool exact) {
    if (ratio < 1) throw error("cuda ds4 indexer: ratio " + std::to_string(ratio) + " must be positive");
    if (n_tok < 0) throw error("cuda ds4 indexer: negative token count");
    row_count rc;
    rc.pos = pos;
    rc.ratio = ratio;
    rc.max_n = max_n;
    indexer_run(q, w, w_scale, rows, rows_f16, row_stride, rc, max_n, n_head, dim, topk, n_tok, score, score_floats,
                sel, n_sel, s, exact);
}

}  // namespace fathom::cuda::ds4
