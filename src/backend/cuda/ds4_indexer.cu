// DS4 indexer on CUDA for one decoded token (spec ../shared/reference/ds4-architecture.md 4.5):
// scores of every visible compressed indexer row, score_c = sum_h w_h * max(0, q_h . K_c), and the
// exact top-k of them (larger score first, ties to the lower row, as the CPU's partial_sort),
// returned in ascending row order. Launchers: ds4_kernels.h (launch_indexer_select, host row count)
// and ds4_attn_kernels.h (launch_indexer_topk, row count derived on the device from the position,
// so it can be captured in a CUDA graph): both run the same two kernels.
//
// Scores: each head's dot product is accumulated in double from exact products and rounded once
// (the CPU's dot_f32 also sums exact products in double), then w_h * relu(dot) is added over heads
// in head order with round-to-nearest f32 operations: the CPU's score bits, barring a double sum
// that lands within 1e-16 of a float rounding boundary. Top-k: 4-pass radix select (8 bits per
// pass) of the k-th largest order-preserving key in one block, then an ordered compaction.
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <string>

#include "backend/cuda/ds4_attn_kernels.h"
#include "backend/cuda/ds4_kernels.h"
#include "core/error.h"

namespace fathom::cuda::ds4 {
namespace {

constexpr int kScoreWarps = 8, kMaxIdxHeads = 128, kMaxIdxDim = 256;
constexpr int kSelectThreads = 1024;

// Number of visible rows: fixed (pos == null) or (*pos + 1) / ratio capped at max_n (decode).
struct row_count {
    int64_t n_fixed = 0;
    const int64_t *pos = nullptr;
    int ratio = 1;
    int64_t max_n = 0;
    __device__ __forceinline__ int64_t get() const {
        if (!pos) return n_fixed;
        const int64_t n = (*pos + 1) / ratio;
        return n < 0 ? 0 : (n < max_n ? n : max_n);
    }
};

// One warp per row c (grid-stride); lane l owns heads l, l + 32, ... q is staged in shared memory
// with rows padded to idx_dim + 1 floats (lanes read different heads at one dim: conflict-free), the
// row K_c once per warp (broadcast reads).
template <bool F16>
__global__ void __launch_bounds__(32 * kScoreWarps)
    indexer_score_kernel(const float *__restrict__ q, const float *__restrict__ w, float w_scale,
                         const void *__restrict__ rows, size_t row_stride, row_count rc, int topk, int n_head, int dim,
                         float *__restrict__ score) {
    const int64_t n = rc.get();
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

// Order-preserving key: larger float -> larger key (-0 mapped with +0: equal scores tie).
__device__ __forceinline__ uint32_t key_of(float f) {
    if (f == 0.0f) f = 0.0f;
    const uint32_t u = __float_as_uint(f);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// Exclusive prefix of a 0/1 flag over the block (in thread order) and the block total.
__device__ __forceinline__ int block_scan01(bool flag, int *warp_tot, int &total) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const unsigned b = __ballot_sync(0xffffffffu, flag);
    const int in_warp = __popc(b & ((1u << lane) - 1u));
    __syncthreads();  // warp_tot free to reuse
    if (lane == 0) warp_tot[warp] = __popc(b);
    __syncthreads();
    int before = 0;
    total = 0;
    for (int i = 0; i < static_cast<int>(blockDim.x >> 5); ++i) {
        if (i < warp) before += warp_tot[i];
        total += warp_tot[i];
    }
    return before + in_warp;
}

__global__ void __launch_bounds__(kSelectThreads)
    topk_select_kernel(const float *__restrict__ score, row_count rc, int k, int32_t *__restrict__ out,
                       int32_t *__restrict__ n_out) {
    const int64_t n = rc.get();
    if (threadIdx.x == 0 && n_out) *n_out = static_cast<int32_t>(n < k ? n : k);
    if (n <= k) {  // every row, ascending (block-uniform branch)
        for (int64_t c = threadIdx.x; c < n; c += blockDim.x) out[c] = static_cast<int32_t>(c);
        return;
    }
    __shared__ int hist[256];
    __shared__ int warp_tot[kSelectThreads / 32];
    __shared__ uint32_t s_prefix;
    __shared__ int s_need;
    const int tid = threadIdx.x;
    uint32_t prefix = 0, mask = 0;
    int need = k;  // how many of the remaining candidates (key & mask == prefix) to take
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int i = tid; i < 256; i += blockDim.x) hist[i] = 0;
        __syncthreads();
        for (int64_t c = tid; c < n; c += blockDim.x) {
            const uint32_t key = key_of(score[c]);
            if ((key & mask) == prefix) atomicAdd(&hist[(key >> shift) & 255u], 1);
        }
        __syncthreads();
        if (tid == 0) {
            int cum = 0, b = 255;
            for (; b > 0; --b) {
                if (cum + hist[b] >= need) break;
                cum += hist[b];
            }
            s_prefix = prefix | (static_cast<uint32_t>(b) << shift);
            s_need = need - cum;
        }
        __syncthreads();
        prefix = s_prefix;
        need = s_need;
        mask |= 255u << shift;
    }
    // prefix = key of the k-th largest score; take every key above it and the first `need` rows
    // (lowest indices) whose key equals it, writing the rows in ascending order.
    int eq_seen = 0, written = 0;
    for (int64_t c0 = 0; c0 < n; c0 += blockDim.x) {
        const int64_t c = c0 + tid;
        const uint32_t key = c < n ? key_of(score[c]) : 0u;
        const bool eq = c < n && key == prefix;
        int eq_total;
        const int eq_before = eq_seen + block_scan01(eq, warp_tot, eq_total);
        const bool take = c < n && (key > prefix || (eq && eq_before < need));
        int take_total;
        const int pos = written + block_scan01(take, warp_tot, take_total);
        if (take) out[pos] = static_cast<int32_t>(c);
        eq_seen += eq_total;
        written += take_total;
    }
}

void check_launch(const char *what) {
    const cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) throw error(std::string("cuda ds4 ") + what + ": launch failed: " + cudaGetErrorString(e));
}

// Scores then top-k for the rows counted by rc (at most max_n); grids sized from max_n.
void indexer_run(const float *q, const float *w, float w_scale, const void *rows, bool rows_f16, size_t row_stride,
                 const row_count &rc, int64_t max_n, int n_head, int dim, int topk, float *score, int32_t *out,
                 int32_t *n_out, cudaStream_t s) {
    if (n_head < 1 || n_head > kMaxIdxHeads || dim < 1 || dim > kMaxIdxDim || topk < 1)
        throw error("cuda ds4 indexer: unsupported geometry: " + std::to_string(n_head) + " heads of " +
                    std::to_string(dim) + " (<= 128 heads, dim <= 256), top-k " + std::to_string(topk));
    if (max_n < 0 || max_n > 0x7fffffff)
        throw error("cuda ds4 indexer: row count " + std::to_string(max_n) + " out of range");
    if (max_n > topk) {  // otherwise no call can need scores
        const size_t smem = sizeof(float) * (static_cast<size_t>(n_head) * (dim + 1) + kScoreWarps * dim +
                                             static_cast<size_t>(kScoreWarps) * n_head);
        if (smem > 48 * 1024)
            throw error("cuda ds4 indexer: query of " + std::to_string(smem) + " bytes exceeds 48 KB");
        int dev = 0, sms = 0;
        cudaGetDevice(&dev);
        cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
        const int64_t want = (max_n + kScoreWarps - 1) / kScoreWarps;
        const unsigned grid =
            static_cast<unsigned>(std::min<int64_t>(want, 4 * static_cast<int64_t>(std::max(sms, 1))));
        if (rows_f16)
            indexer_score_kernel<true><<<grid, 32 * kScoreWarps, smem, s>>>(q, w, w_scale, rows, row_stride, rc, topk,
                                                                            n_head, dim, score);
        else
            indexer_score_kernel<false><<<grid, 32 * kScoreWarps, smem, s>>>(q, w, w_scale, rows, row_stride, rc,
                                                                             topk, n_head, dim, score);
        check_launch("indexer score");
    }
    topk_select_kernel<<<1, kSelectThreads, 0, s>>>(score, rc, topk, out, n_out);
    check_launch("indexer top-k");
}

}  // namespace

void launch_indexer_select(const float *q, const float *w, const void *rows, bool rows_f16, size_t row_stride,
                           int64_t n, int n_head, int dim, int topk, float *score, int32_t *out, cudaStream_t s) {
    if (n < 0 || n > 0x7fffffff) throw error("cuda ds4 indexer: row count " + std::to_string(n) + " out of range");
    if (n == 0) return;
    row_count rc;
    rc.n_fixed = n;
    indexer_run(q, w, 1.0f, rows, rows_f16, row_stride, rc, n, n_head, dim, topk, score, out, nullptr, s);
}

void launch_indexer_topk(const float *q, const float *w, float w_scale, const void *rows, bool rows_f16,
                         size_t row_stride, int ratio, int64_t max_n, int n_head, int dim, int topk,
                         const int64_t *pos, float *score, int32_t *sel, int32_t *n_sel, cudaStream_t s) {
    if (ratio < 1) throw error("cuda ds4 indexer: ratio " + std::to_string(ratio) + " must be positive");
    row_count rc;
    rc.pos = pos;
    rc.ratio = ratio;
    rc.max_n = max_n;
    indexer_run(q, w, w_scale, rows, rows_f16, row_stride, rc, max_n, n_head, dim, topk, score, sel, n_sel, s);
}

}  // namespace fathom::cuda::ds4
