// DS4 MoE FFN over a prefill chunk (moe_prefill, ds4_prefill.h). Semantics: the CPU reference
// moe_forward_batch (src/models/deepseek4_moe.cpp): each token's routed experts and the shared expert,
// clamped SwiGLU, the routing weight multiplying h before the down projection, y = the slots summed in
// routing order, then the shared expert.
//
// Pipeline of forward() on the runner's stream (P = n_tok * k (token, slot) pairs, pair p = t * k + j):
//   1. router logits [n_tok, E] = xn . gate_inp^T in f32 (gemm_runner, gemm_precision::f32);
//   2. routing: the decode route kernel, one block per token (launch_moe_route_batch): ids, weights
//      [n_tok, k] with the bits of the per-token launch; bad hash ids give ids -1 (+ error bits);
//   3. stable grouping by expert: counts[e] (shared-memory histogram, integer atomics: exact), then
//      one block per expert ranks its pairs in pair order (block scans, no atomics): order[off_e + i]
//      = the i-th pair of expert e, pos[p] = its index in that order (-1: skipped slot);
//   4. counts go to the host (the one synchronisation; the shared expert runs meanwhile);
//   5. xn -> bf16 once; the shared expert: gate|up dequantised as one [2F, D] bf16 matrix, one GEMM
//      gives g|v [n_tok, 2F] f32, SwiGLU -> h bf16, down GEMM -> out_sh [n_tok, D];
//   6. routed experts, ascending id, only experts with pairs: rows gathered in `order` (xg bf16
//      [P, D]); per group of up to `group` experts one dequantisation launch (gate|up of each, then
//      later down) into the weight scratch and one cuBLAS GEMM per expert; SwiGLU * routing weight
//      -> h [P, F] bf16; down -> out [P, D] f32 (rows in `order`);
//   7. y[t] = sum_j out[pos[t k + j]] (j ascending, skipped slots add nothing) + out_sh[t], a fixed
//      order: deterministic, no float atomics anywhere.
// Scratch (DS4-Flash, D 4096, F 2048, k 6, max_tok 4096): xg 201 MB, g|v 403 MB, h 101 MB, out 403
// MB, out_sh + xb 101 MB, expert weights 16 x 33.5 MB = 537 MB: ~1.75 GB.
// Cost (H200, DS4-Flash q2 mix, tests/backend/cuda/test_cuda_ds4_prefill_mm.cpp BenchMoeFlashChunk): 11.2 ms
// per layer at 4096 tokens, 10.0 ms at 256: bound by the bf16 expert weights (every active expert's
// 50 MB is written by the dequantiser, ~4.2 ms per layer, and read back by its GEMMs, ~7 ms), not by
// the tensor cores (~130 TFLOP/s useful). A GEMM that decodes the weights in its main loop would
// remove both. Expert groups of one (L2-sized) measured slower than groups of 16.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <string>
#include <vector>

#include "backend/cuda/cuda_kernels.h"
#include "backend/cuda/ds4_prefill.h"
#include "core/error.h"

namespace fathom::cuda::ds4 {
namespace {

constexpr int kThreads = 256;
constexpr size_t kWeightScratch = size_t{512} << 20;  // bytes of dequantised expert weights per group
constexpr int kRankPer = 8;                           // pairs per thread per round of the ranking kernel

// counts[e] += pairs with id e (counts zeroed before); pos[p] = -1 for ids outside [0, E) (a slot
// the route skipped). Shared-memory histogram (E <= 1024), integer atomics: exact.
__global__ void __launch_bounds__(kThreads)
    count_kernel(const int32_t *__restrict__ ids, int64_t n_pairs, int E, int32_t *counts, int32_t *pos) {
    extern __shared__ int hist[];
    for (int e = threadIdx.x; e < E; e += blockDim.x) hist[e] = 0;
    __syncthreads();
    const int64_t p = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (p < n_pairs) {
        const int32_t e = ids[p];
        if (e >= 0 && e < E) atomicAdd(&hist[e], 1);
        else pos[p] = -1;
    }
    __syncthreads();
    for (int e = threadIdx.x; e < E; e += blockDim.x)
        if (hist[e]) atomicAdd(&counts[e], hist[e]);
}

// Block-wide exclusive prefix sum of v (kThreads threads); *total = the sum. Two barriers; ws is
// shared scratch of kThreads / 32 + 1 ints, free again when this returns.
__device__ __forceinline__ int block_exclusive_scan(int v, int *ws, int *total) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int incl = v;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const int n = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o) incl += n;
    }
    if (lane == 31) ws[warp] = incl;
    __syncthreads();
    int before = 0, sum = 0;
    for (int w = 0; w < kThreads / 32; ++w) {
        const int x = ws[w];
        if (w < warp) before += x;
        sum += x;
    }
    __syncthreads();
    *total = sum;
    return before + incl - v;
}

// Block e: off = sum of counts[0 .. e); the pairs with id e, in ascending pair order, get indices
// off, off + 1, ...: order[index] = p, pos[p] = index. Thread t of a round holds kRankPer
// consecutive pairs, so thread order is pair order and the scan keeps the ranking stable.
__global__ void __launch_bounds__(kThreads)
    rank_kernel(const int32_t *__restrict__ ids, int64_t n_pairs, const int32_t *__restrict__ counts,
                int32_t *__restrict__ order, int32_t *__restrict__ pos) {
    __shared__ int ws[kThreads / 32 + 1];
    const int e = blockIdx.x;
    int part = 0;
    for (int i = threadIdx.x; i < e; i += blockDim.x) part += counts[i];
    int off = 0;
    block_exclusive_scan(part, ws, &off);
    if (counts[e] == 0) return;  // block-uniform
    constexpr int64_t round = static_cast<int64_t>(kThreads) * kRankPer;
    for (int64_t p0 = 0; p0 < n_pairs; p0 += round) {
        const int64_t first = p0 + static_cast<int64_t>(threadIdx.x) * kRankPer;
        unsigned mine = 0;  // bit i: pair first + i has id e
#pragma unroll
        for (int i = 0; i < kRankPer; ++i)
            if (first + i < n_pairs && ids[first + i] == e) mine |= 1u << i;
        int total = 0;
        int idx = off + block_exclusive_scan(__popc(mine), ws, &total);
#pragma unroll
        for (int i = 0; i < kRankPer; ++i)
            if (mine & (1u << i)) {
                order[idx] = static_cast<int32_t>(first + i);
                pos[first + i] = idx;
                ++idx;
            }
        off += total;
    }
}

// xg[i, :] = xb[order[i] / k, :] (bf16 rows of D, D % 8 == 0: 16-byte vectors), i < n_rows.
__global__ void __launch_bounds__(kThreads)
    gather_kernel(const uint4 *__restrict__ xb, const int32_t *__restrict__ order, int k, int64_t n_rows,
                  int64_t vec_per_row, uint4 *__restrict__ xg) {
    const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (idx >= n_rows * vec_per_row) return;
    const int64_t i = idx / vec_per_row, v = idx - i * vec_per_row;
    const int64_t t = order[i] / k;
    xg[idx] = xb[t * vec_per_row + v];
}

// h[i, f] = bf16(silu(min(g, c)) * clamp(v, -c, c) * w_i) with g = gv[i, f], v = gv[i, F + f] (gv
// rows 2F apart), w_i = wts[order[i]] (routed) or 1 (wts null: shared expert). The SwiGLU is
// ds4_moe.cu's (the CPU's swiglu_clamped), then the weight, in the CPU's order. 4 columns per
// thread (F % 4 == 0).
__global__ void __launch_bounds__(kThreads)
    swiglu_kernel(const float *__restrict__ gv, int64_t n_rows, int64_t F, float c, const float *__restrict__ wts,
                  const int32_t *__restrict__ order, __nv_bfloat16 *__restrict__ h) {
    const int64_t q = F / 4;
    const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (idx >= n_rows * q) return;
    const int64_t i = idx / q, f = 4 * (idx - i * q);
    const float4 g = *reinterpret_cast<const float4 *>(gv + i * 2 * F + f);
    const float4 v = *reinterpret_cast<const float4 *>(gv + i * 2 * F + F + f);
    const float w = wts ? wts[order[i]] : 1.0f;
    const float gs[4] = {g.x, g.y, g.z, g.w}, vs[4] = {v.x, v.y, v.z, v.w};
    float o[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        const float gc = fminf(gs[j], c), vc = fminf(fmaxf(vs[j], -c), c);
        float hv = gc / (1.0f + expf(-gc)) * vc;
        if (wts) hv *= w;
        o[j] = hv;
    }
    __nv_bfloat162 b[2] = {__floats2bfloat162_rn(o[0], o[1]), __floats2bfloat162_rn(o[2], o[3])};
    *reinterpret_cast<uint2 *>(h + i * F + f) = *reinterpret_cast<const uint2 *>(b);
}

// y[t, c] = ((0 + out[pos[t k]] ) + out[pos[t k + 1]] ...) + out_sh[t] (skipped slots, pos < 0, add
// nothing; out_sh null: no shared expert): the CPU's slot order.
__global__ void __launch_bounds__(kThreads)
    combine_kernel(const float *__restrict__ out, const int32_t *__restrict__ pos, int k, const float *__restrict__ out_sh,
                   int64_t n_tok, int64_t D, float *__restrict__ y) {
    const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (idx >= n_tok * D) return;
    const int64_t t = idx / D, c = idx - t * D;
    float acc = 0.0f;
    for (int j = 0; j < k; ++j) {
        const int32_t p = pos[t * k + j];
        if (p >= 0) acc += out[static_cast<int64_t>(p) * D + c];
    }
    if (out_sh) acc += out_sh[idx];
    y[idx] = acc;
}

unsigned blocks_for(int64_t threads, const char *what) {
    const int64_t b = (threads + kThreads - 1) / kThreads;
    if (b > 0x7fffffff) throw error(std::string("cuda ds4 moe prefill: ") + what + " launch too large");
    return static_cast<unsigned>(b);
}
void check_launch(const char *what) {
    const cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess)
        throw error(std::string("cuda ds4 moe prefill: ") + what + ": launch failed: " + cudaGetErrorString(e));
}
void ck(cudaError_t e, const char *what) {
    if (e != cudaSuccess) throw error(std::string("cuda ds4 moe prefill: ") + what + ": " + cudaGetErrorString(e));
}

}  // namespace

struct moe_prefill::impl {
    gemm_runner &g;
    int64_t max_tok = 0, D = 0, F = 0;
    int E = 0, k = 0, group = 1;  // group: experts per dequantisation launch
    size_t bytes = 0;
    std::vector<void *> bufs;
    float *logits = nullptr, *wts = nullptr, *gv = nullptr, *out = nullptr, *out_sh = nullptr;
    int32_t *ids = nullptr, *counts = nullptr, *order = nullptr, *pos = nullptr;
    uint16_t *xb = nullptr, *xg = nullptr, *h = nullptr, *wb = nullptr;
    int32_t *counts_host = nullptr;  // pinned [E]
    cudaEvent_t counted = nullptr;

    explicit impl(gemm_runner &r) : g(r) {}
    ~impl() {
        for (void *p : bufs) cudaFree(p);
        if (counts_host) cudaFreeHost(counts_host);
        if (counted) cudaEventDestroy(counted);
    }
    template <class T>
    T *alloc(size_t n, const char *what) {
        void *p = nullptr;
        const size_t b = n * sizeof(T) + 16;
        if (cudaMalloc(&p, b) != cudaSuccess)
            throw error(std::string("cuda ds4 moe prefill: cannot allocate ") + what + " (" + std::to_string(b) + " bytes)");
        bufs.push_back(p);
        bytes += b;
        return static_cast<T *>(p);
    }
    void check_layer(const moe_layer &l) const;
    void shared_expert(const moe_layer &l, int64_t n_tok);
    void routed_experts(const moe_layer &l, int64_t n_valid, const std::vector<int64_t> &off);
};

moe_prefill::moe_prefill(gemm_runner &g, int64_t max_tok, int64_t dim, int64_t ff, int n_expert, int n_used)
    : p_(std::make_unique<impl>(g)) {
    if (max_tok < 1 || dim < 1 || ff < 1 || dim % 32 != 0 || ff % 32 != 0 || n_expert < 1 || n_expert > 1024 ||
        n_used < 1 || n_used > 32 || n_used > n_expert)
        throw error("cuda ds4 moe prefill: bad geometry (max_tok " + std::to_string(max_tok) + ", D " + std::to_string(dim) +
                    ", F " + std::to_string(ff) + ", E " + std::to_string(n_expert) + ", k " + std::to_string(n_used) +
                    "; D, F multiples of 32, E <= 1024, k <= 32)");
    if (max_tok * n_used >= (int64_t{1} << 31)) throw error("cuda ds4 moe prefill: too many (token, slot) pairs");
    impl &m = *p_;
    m.max_tok = max_tok;
    m.D = dim;
    m.F = ff;
    m.E = n_expert;
    m.k = n_used;
    const size_t T = static_cast<size_t>(max_tok), P = T * static_cast<size_t>(n_used);
    const size_t D = static_cast<size_t>(dim), F = static_cast<size_t>(ff);
    const size_t per_expert = 2 * F * D;  // gate|up elements (>= down's D * F)
    m.group = static_cast<int>(std::clamp<size_t>(kWeightScratch / (per_expert * 2), 1, gemm_runner::max_dequant_experts));
    m.logits = m.alloc<float>(T * static_cast<size_t>(n_expert), "logits");
    m.ids = m.alloc<int32_t>(P, "ids");
    m.wts = m.alloc<float>(P, "weights");
    m.counts = m.alloc<int32_t>(static_cast<size_t>(n_expert), "counts");
    m.order = m.alloc<int32_t>(P, "order");
    m.pos = m.alloc<int32_t>(P, "pos");
    m.xb = m.alloc<uint16_t>(T * D, "x bf16");
    m.xg = m.alloc<uint16_t>(P * D, "gathered x");
    m.gv = m.alloc<float>(P * 2 * F, "gate|up");
    m.h = m.alloc<uint16_t>(P * F, "h");
    m.out = m.alloc<float>(P * D, "routed out");
    m.out_sh = m.alloc<float>(T * D, "shared out");
    m.wb = m.alloc<uint16_t>(static_cast<size_t>(m.group) * per_expert, "expert weights");
    ck(cudaMallocHost(&m.counts_host, static_cast<size_t>(n_expert) * 4), "pinned counts");
    ck(cudaEventCreateWithFlags(&m.counted, cudaEventDisableTiming), "event");
}

moe_prefill::~moe_prefill() = default;

size_t moe_prefill::scratch_bytes() const {
    return p_->bytes;
}

void moe_prefill::impl::check_layer(const moe_layer &l) const {
    auto bank_ok = [](const expert_bank &b, int64_t rows, int64_t cols, int64_t n) {
        return b.data && b.rows == rows && b.cols == cols && b.n_expert == n;
    };
    if (l.n_expert != E || l.n_used != k || !bank_ok(l.gate, F, D, E) || !bank_ok(l.up, F, D, E) ||
        !bank_ok(l.down, D, F, E))
        throw error("cuda ds4 moe prefill: layer geometry differs from the one the scratch was sized for (D " +
                    std::to_string(D) + ", F " + std::to_string(F) + ", E " + std::to_string(E) + ", k " +
                    std::to_string(k) + ")");
    if (l.gate_sh.data && (!bank_ok(l.gate_sh, F, D, 1) || !bank_ok(l.up_sh, F, D, 1) || !bank_ok(l.down_sh, D, F, 1)))
        throw error("cuda ds4 moe prefill: shared expert shape differs from [F, D] / [D, F]");
    if (!l.exp_bias && (!l.tid2eid || l.n_vocab < 1))
        throw error("cuda ds4 moe prefill: hash routing needs tid2eid and n_vocab");
}

// out_sh [n_tok, D] = the shared expert of xb (clamp_sh, no routing weight).
void moe_prefill::impl::shared_expert(const moe_layer &l, int64_t n_tok) {
    const cudaStream_t s = g.stream();
    const int32_t zero = 0;
    const expert_bank gu[2] = {l.gate_sh, l.up_sh};
    g.dequant_experts_bf16(gu, 2, &zero, 1, wb);  // [2F, D]: gate rows, then up rows
    g.gemm_bf16(wb, D, 2 * F, D, xb, D, n_tok, gv, 2 * F);
    swiglu_kernel<<<blocks_for(n_tok * (F / 4), "swiglu"), kThreads, 0, s>>>(
        gv, n_tok, F, l.clamp_sh, nullptr, nullptr, reinterpret_cast<__nv_bfloat16 *>(h));
    check_launch("shared swiglu");
    g.dequant_experts_bf16(&l.down_sh, 1, &zero, 1, wb);  // [D, F]
    g.gemm_bf16(wb, F, D, F, h, F, n_tok, out_sh, D);
}

// The routed experts over the n_valid grouped pairs (off[e] .. off[e + 1]: expert e's rows). Per
// group of up to `group` active experts: one dequantisation launch into wb, then one cuBLAS GEMM per
// expert. (cublasGemmGroupedBatchedEx, one call per group, refuses bf16 inputs with f32 outputs in
// cuBLAS 13.1; 16 looped GEMMs at 96 rows each measured 0.26 ms, weight-read bound.)
void moe_prefill::impl::routed_experts(const moe_layer &l, int64_t n_valid, const std::vector<int64_t> &off) {
    const cudaStream_t s = g.stream();
    const int64_t vec = D / 8;
    gather_kernel<<<blocks_for(n_valid * vec, "gather"), kThreads, 0, s>>>(
        reinterpret_cast<const uint4 *>(xb), order, k, n_valid, vec, reinterpret_cast<uint4 *>(xg));
    check_launch("gather");
    std::vector<int32_t> active;
    for (int e = 0; e < E; ++e)
        if (off[e + 1] > off[e]) active.push_back(e);
    const size_t gu_elems = static_cast<size_t>(2 * F * D), dn_elems = static_cast<size_t>(D * F);
    // gate|up: g|v rows of expert e = xg rows off[e] .. (the pairs' inputs) times its [2F, D] matrix
    const expert_bank gu[2] = {l.gate, l.up};
    for (size_t a0 = 0; a0 < active.size(); a0 += static_cast<size_t>(group)) {
        const int n = static_cast<int>(std::min(active.size() - a0, static_cast<size_t>(group)));
        g.dequant_experts_bf16(gu, 2, active.data() + a0, n, wb);
        for (int i = 0; i < n; ++i) {
            const int e = active[a0 + static_cast<size_t>(i)];
            g.gemm_bf16(wb + static_cast<size_t>(i) * gu_elems, D, 2 * F, D, xg + off[e] * D, D, off[e + 1] - off[e],
                        gv + off[e] * 2 * F, 2 * F);
        }
    }
    swiglu_kernel<<<blocks_for(n_valid * (F / 4), "swiglu"), kThreads, 0, s>>>(
        gv, n_valid, F, l.clamp, wts, order, reinterpret_cast<__nv_bfloat16 *>(h));
    check_launch("routed swiglu");
    for (size_t a0 = 0; a0 < active.size(); a0 += static_cast<size_t>(group)) {
        const int n = static_cast<int>(std::min(active.size() - a0, static_cast<size_t>(group)));
        g.dequant_experts_bf16(&l.down, 1, active.data() + a0, n, wb);
        for (int i = 0; i < n; ++i) {
            const int e = active[a0 + static_cast<size_t>(i)];
            g.gemm_bf16(wb + static_cast<size_t>(i) * dn_elems, F, D, F, h + off[e] * F, F, off[e + 1] - off[e],
                        out + off[e] * D, D);
        }
    }
}

void moe_prefill::forward(const moe_layer &l, const float *xn, const int32_t *tokens, int64_t n_tok, float *y,
                          uint32_t *err) {
    impl &m = *p_;
    if (n_tok < 0 || n_tok > m.max_tok)
        throw error("cuda ds4 moe prefill: " + std::to_string(n_tok) + " tokens exceed max_tok " + std::to_string(m.max_tok));
    m.check_layer(l);
    if (n_tok == 0) return;
    if (!xn || !y || !err) throw error("cuda ds4 moe prefill: xn, y and err are required");
    const cudaStream_t s = m.g.stream();
    const int64_t P = n_tok * m.k;
    // 1-2. router logits (f32) and routing
    gemm_weight gi;
    gi.type = l.gate_inp_type;
    gi.p = l.gate_inp;
    gi.row_bytes = l.gate_inp_row_bytes;
    gi.rows = m.E;
    gi.cols = m.D;
    m.g.matmul(gi, xn, m.D, n_tok, m.logits, m.E, gemm_precision::f32);
    launch_moe_route_batch(m.logits, m.E, l.exp_bias, l.tid2eid, l.n_vocab, tokens, n_tok, m.k, l.weights_scale, m.ids,
                           m.wts, err, s);
    // 3-4. stable grouping by expert; counts to the host
    ck(cudaMemsetAsync(m.counts, 0, static_cast<size_t>(m.E) * 4, s), "clear counts");
    count_kernel<<<blocks_for(P, "count"), kThreads, static_cast<size_t>(m.E) * 4, s>>>(m.ids, P, m.E, m.counts, m.pos);
    check_launch("count");
    rank_kernel<<<static_cast<unsigned>(m.E), kThreads, 0, s>>>(m.ids, P, m.counts, m.order, m.pos);
    check_launch("rank");
    ck(cudaMemcpyAsync(m.counts_host, m.counts, static_cast<size_t>(m.E) * 4, cudaMemcpyDeviceToHost, s), "counts");
    ck(cudaEventRecord(m.counted, s), "record");
    // 5. x -> bf16, shared expert (runs while the host waits for the counts)
    launch_f32_to_bf16(xn, m.D, m.D, n_tok, m.xb, s);
    check_launch("convert x");
    const bool shared = l.gate_sh.data != nullptr;
    if (shared) m.shared_expert(l, n_tok);
    ck(cudaEventSynchronize(m.counted), "wait for the counts");
    std::vector<int64_t> off(static_cast<size_t>(m.E) + 1, 0);
    for (int e = 0; e < m.E; ++e) off[e + 1] = off[e] + m.counts_host[e];
    // 6. routed experts
    if (off[m.E] > 0) m.routed_experts(l, off[m.E], off);
    // 7. fixed-order sum
    combine_kernel<<<blocks_for(n_tok * m.D, "combine"), kThreads, 0, s>>>(m.out, m.pos, m.k, shared ? m.out_sh : nullptr,
                                                                          n_tok, m.D, y);
    check_launch("combine");
}

}  // namespace fathom::cuda::ds4
