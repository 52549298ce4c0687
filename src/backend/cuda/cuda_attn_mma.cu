// Tensor-core flash attention for the dense families' CUDA prefill (launch_attention_mma, declared in
// cuda_kernels.h): causal (optionally sliding-window, optionally soft-capped) GQA attention of n_tok f32
// queries over the f16 K/V caches of launch_attention. launch_attention takes this path for f16 caches,
// n_tok >= kAttnMmaMinTokens and head_dim 64 / 128 / 256 (attention_mma_usable); decode keeps the
// scalar split kernel of cuda_ops.cu.
//
// Block = (head blockIdx.x, 64 queries, key split blockIdx.z), 4 warps; warp w owns query rows
// 16 w .. 16 w + 15 of the block (one m16 tile), so a row's online softmax lives in one warp's registers
// and K/V tiles staged once in shared memory serve all 64 queries. Query tiles run last-first
// (blockIdx.y reversed): in causal prefill the late tiles have the most keys, so they start first.
// Heads are the fastest grid dimension, so the heads sharing a KV head (GQA) run together and read the
// same K/V rows from L2.
//
// Per 64-key tile (cp.async double buffering: tile j + 1 is in flight while tile j is computed):
//   S [16, 64] = Q K^T with mma.m16n8k16 (f16 in, f32 accumulate). The f32 query is split into
//     q_hi = f16(q) and q_lo = f16(q - q_hi) (two MMAs per product), so the scores carry ~2^-22
//     relative error, as f32 dots against the f16 keys would (which are exact in f16).
//   s = scale * S, softcap (cap * tanh(s / cap)) when set, masked keys (key > query position, or
//     key < position - window + 1) -> -inf; tiles wholly inside every row's span of the warp skip the
//     mask, tiles wholly outside it are skipped by the warp.
//   Online softmax in f32 (expf): m, l per row; O rescaled by e^(m_old - m_new).
//   O += P V with P split into hi + lo f16 halves the same way (p in [0, 1]; absolute error ~2^-25),
//     V from shared memory through ldmatrix.trans. So the result matches the f32 path of the scalar
//     kernel to ~1e-6 relative, not the ~5e-4 of a plain f16 P.
// Output: n_split == 1: O / l into out; n_split > 1: the partial (m, l, O) at
// part[((t * n_head + h) * n_split + split) * (hd + 2)] for cuda_ops.cu's attn_combine_kernel (the
// scalar path's layout). Splits divide the block's key tiles evenly when the kernel runs (the span
// depends on the device position); a split without keys for a row writes m = -inf, l = 0, O = 0.
//
// Positions: query i at *pos_base + n_past + i, read on the device (graphs replay at new positions;
// the grid depends on n_tok and n_split only). Rows whose position is outside [0, n_ctx) set
// err_attn_pos and are not written, as in attn_kernel. Key rows past the block's last query position
// are zero-filled by cp.async (never read), so stale or unwritten cache rows never reach the MMAs.
// Queries must stay inside the f16 range (|q| < 65504), true of normed attention queries.
//
// Shared memory per block: q hi, q lo [64, hd + 8] and two stages of K and V [64, hd + 8] (f16; the
// 16-byte row pad makes the 8 rows of an ldmatrix hit 8 different bank groups): 55 KB (hd 64),
// 102 KB (hd 128, two blocks per SM), 198 KB (hd 256).
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>

#include "backend/cuda/cuda_device.h"
#include "backend/cuda/cuda_kernels.h"
#include "backend/cuda/cuda_mma.cuh"
#include "backend/cuda/cuda_smem.cuh"
#include "core/error.h"

namespace fathom::cuda {
namespace {

constexpr int kWarps = 4, kThreads = 32 * kWarps;
constexpr int kQ = 16 * kWarps;  // queries per block: one m16 row tile per warp
constexpr int kK = 64;           // keys per tile
constexpr int kPad = 8;          // halves of padding per shared-memory row
constexpr int kMaxSplits = 32;
constexpr int64_t kTargetBlocks = 264;  // two blocks on each of the H200's 132 SMs
constexpr int64_t kNoKey = INT64_MAX / 4;  // key bound of a row without output (never attends)

constexpr size_t smem_bytes(int hd) { return static_cast<size_t>(2 * kQ + 4 * kK) * (hd + kPad) * sizeof(__half); }

// ---- PTX helpers (sm_80+; the host launches nothing on older devices) ------------------------------
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
__device__ __forceinline__ unsigned smem_addr(const void *p) {
    return static_cast<unsigned>(__cvta_generic_to_shared(p));
}
#endif
// 16 bytes global -> shared, bypassing L1; src_bytes 0 writes 16 zero bytes and reads nothing.
__device__ __forceinline__ void cp_async16(void *dst, const void *src, int src_bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src), "r"(src_bytes));
#endif
}
__device__ __forceinline__ void cp_async_commit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.commit_group;\n" ::);
#endif
}
// Waits until at most N of this thread's committed groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
#endif
}
__device__ __forceinline__ uint32_t half2_bits(__half2 h) { return *reinterpret_cast<const uint32_t *>(&h); }
// (a, b) -> f16 pairs hi = (f16(a), f16(b)) and lo = the rounding residuals; a in the low half.
__device__ __forceinline__ void split_pair(float a, float b, uint32_t &hi, uint32_t &lo) {
    const __half2 h = __floats2half2_rn(a, b);
    const float2 hf = __half22float2(h);
    hi = half2_bits(h);
    lo = half2_bits(__floats2half2_rn(a - hf.x, b - hf.y));
}

// One 64-key tile for one warp: S = Q K^T, scale / softcap / mask, online softmax, O += P V.
// Thread (g = lane / 4, tq = lane % 4) holds rows g (i = 0) and g + 8 (i = 1) of the warp's 16: S tile
// j's columns 8 j + 2 tq, + 1 in s[j][2 i], s[j][2 i + 1]; O dims 8 jd + 2 tq, + 1 in acc[jd][2 i ..].
// Row i attends keys kt + c for clo[i] <= c <= chi[i] (checked only when `masked`).
template <int HD>
__device__ __forceinline__ void tile_step(const __half *sqh, const __half *sql, const __half *tk, const __half *tv,
                                          int warp, int lane, bool masked, const int (&clo)[2], const int (&chi)[2],
                                          float scale, float softcap, float (&acc)[HD / 8][4], float (&m)[2],
                                          float (&l)[2]) {
    constexpr int LD = HD + kPad;
    const int tq = lane & 3, mi = lane >> 3, ri = lane & 7;  // ldmatrix: matrix mi, row ri
    float s[kK / 8][4];
#pragma unroll
    for (int j = 0; j < kK / 8; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.0f;
    // A (q): matrices (rows 0-7 | 8-15) x (dims 0-7 | 8-15) -> a0..a3. B (keys): matrices
    // (keys 0-7: dims 0-7, 8-15 | keys 8-15: dims 0-7, 8-15) -> b0, b1 of n8 tiles 2 np and 2 np + 1.
    const int qoff = (16 * warp + ri + 8 * (mi & 1)) * LD + 8 * (mi >> 1);
    const __half *kp = tk + (ri + 8 * (mi >> 1)) * LD + 8 * (mi & 1);
#pragma unroll
    for (int kk = 0; kk < HD / 16; ++kk) {
        uint32_t ah[4], al[4];
        ldsm_x4(ah, sqh + qoff + 16 * kk);
        ldsm_x4(al, sql + qoff + 16 * kk);
#pragma unroll
        for (int np = 0; np < kK / 16; ++np) {
            uint32_t b[4];
            ldsm_x4(b, kp + 16 * np * LD + 16 * kk);
            mma_hi_lo_x2(s[2 * np], s[2 * np + 1], ah, al, b);
        }
    }
    float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int j = 0; j < kK / 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int i = e >> 1, c = 8 * j + 2 * tq + (e & 1);
            float x = s[j][e] * scale;
            if (softcap > 0.0f) x = softcap * tanhf(x / softcap);
            if (masked && (c < clo[i] || c > chi[i])) x = -INFINITY;
            s[j][e] = x;
            mx[i] = fmaxf(mx[i], x);
        }
    float corr[2], ms[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {  // the row's 64 columns live in the 4 lanes of a quad
        mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], 1));
        mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], 2));
        const float mn = fmaxf(m[i], mx[i]);
        ms[i] = mn == -INFINITY ? 0.0f : mn;  // no key yet: keep p = 0 and avoid inf - inf
        corr[i] = expf(m[i] - ms[i]);         // 0 while m was -inf (O and l are 0 then)
        m[i] = mn;
    }
    float ps[2] = {0.0f, 0.0f};
#pragma unroll
    for (int j = 0; j < kK / 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const float p = expf(s[j][e] - ms[e >> 1]);  // masked: e^-inf = 0
            s[j][e] = p;
            ps[e >> 1] += p;
        }
    l[0] = l[0] * corr[0] + ps[0];  // this lane's columns; the quad's lanes are summed at the end
    l[1] = l[1] * corr[1] + ps[1];
    mma_scale_rows(acc, corr[0], corr[1]);
    // P as the A operand: k16 step kk = S tiles 2 kk (a0: row g, a1: row g + 8) and 2 kk + 1 (a2, a3).
    // V (rows = keys) through ldmatrix.trans: matrices (keys 0-7 | 8-15) x (dims 0-7 | 8-15) ->
    // b0, b1 of dim tile 2 dp, b0, b1 of dim tile 2 dp + 1.
    const __half *vp = tv + (ri + 8 * (mi & 1)) * LD + 8 * (mi >> 1);
#pragma unroll
    for (int kk = 0; kk < kK / 16; ++kk) {
        uint32_t ph[4], pl[4];
        split_pair(s[2 * kk][0], s[2 * kk][1], ph[0], pl[0]);
        split_pair(s[2 * kk][2], s[2 * kk][3], ph[1], pl[1]);
        split_pair(s[2 * kk + 1][0], s[2 * kk + 1][1], ph[2], pl[2]);
        split_pair(s[2 * kk + 1][2], s[2 * kk + 1][3], ph[3], pl[3]);
#pragma unroll
        for (int dp = 0; dp < HD / 16; ++dp) {
            uint32_t b[4];
            ldsm_x4_trans(b, vp + 16 * kk * LD + 16 * dp);
            mma_hi_lo_x2(acc[2 * dp], acc[2 * dp + 1], ph, pl, b);
        }
    }
}

// Grid (n_head, ceil(n_tok / 64), n_split), kThreads threads, smem_bytes(HD) dynamic shared memory.
template <int HD>
__global__ void __launch_bounds__(kThreads)
    attn_mma_kernel(const float *__restrict__ q, int64_t ldq, int64_t n_tok, const uint8_t *__restrict__ k,
                    const uint8_t *__restrict__ v, size_t kvs, attn_args a, const int64_t *pos_base,
                    float *__restrict__ out, int64_t ldo, float *__restrict__ part, uint32_t *err) {
    constexpr int LD = HD + kPad;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    __half *sqh = reinterpret_cast<__half *>(smem_raw);  // [kQ, LD] q hi
    __half *sql = sqh + kQ * LD;                         // [kQ, LD] q lo
    __half *sk = sql + kQ * LD;                          // [2][kK, LD] key tiles
    __half *sv = sk + 2 * kK * LD;                       // [2][kK, LD] value tiles
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, tq = lane & 3;
    const int h = blockIdx.x, split = blockIdx.z, n_split = gridDim.z;
    const int64_t i0 = static_cast<int64_t>(gridDim.y - 1 - blockIdx.y) * kQ;
    const int nt = static_cast<int>(min(static_cast<int64_t>(kQ), n_tok - i0));
    const int hk = h / (a.n_head / a.n_head_kv);
    const int64_t pos0 = *pos_base + a.n_past + i0;
    // Rows [ra, rb] have positions inside the cache; the others are flagged and not written.
    const int64_t ra = max(static_cast<int64_t>(0), -pos0);
    const int64_t rb = min(static_cast<int64_t>(nt - 1), a.n_ctx - 1 - pos0);
    if ((ra > 0 || rb < nt - 1) && tid == 0 && split == 0) atomicOr(err, err_attn_pos);
    if (ra > rb) return;  // block-uniform, before any barrier
    // Keys [kb, ke) that some row attends, in n_tiles tiles from kb; this split's share of them.
    const int64_t kb = a.window > 0 ? max(static_cast<int64_t>(0), pos0 + ra - a.window + 1) : 0;
    const int64_t ke = pos0 + rb + 1;
    const int64_t n_tiles = (ke - kb + kK - 1) / kK;
    const int64_t per = (n_tiles + n_split - 1) / n_split;
    const int64_t t_first = min(n_tiles, split * per);
    const int n_it = static_cast<int>(min(n_tiles, t_first + per) - t_first);
    const int64_t k_first = kb + t_first * kK;

    // Tile loader: rows kt .. kt + 63 of K and V (rows >= ke: zeros), 16-byte chunks over the block.
    const uint8_t *kh = k + static_cast<size_t>(hk) * static_cast<size_t>(a.n_ctx) * kvs;
    const uint8_t *vh = v + static_cast<size_t>(hk) * static_cast<size_t>(a.n_ctx) * kvs;
    auto load_tile = [&](int stage, int64_t kt) {
        constexpr int kChunks = HD / 8;  // 16-byte chunks per row
        __half *dk = sk + stage * kK * LD, *dv = sv + stage * kK * LD;
        for (int e = tid; e < kK * kChunks; e += kThreads) {
            const int r = e / kChunks, c = e % kChunks;
            const int64_t key = kt + r;
            const bool in = key < ke;
            const size_t off = static_cast<size_t>(in ? key : kb) * kvs + static_cast<size_t>(c) * 16;
            cp_async16(dk + r * LD + 8 * c, kh + off, in ? 16 : 0);
            cp_async16(dv + r * LD + 8 * c, vh + off, in ? 16 : 0);
        }
    };
    if (n_it > 0) load_tile(0, k_first);  // in flight while q is staged
    cp_async_commit();

    // q hi / lo of the block's rows (rows past n_tok: zeros).
    const float *qb = q + i0 * ldq + static_cast<int64_t>(h) * HD;
    for (int e = tid; e < kQ * HD; e += kThreads) {
        const int r = e / HD, c = e % HD;
        const float x = r < nt ? qb[static_cast<int64_t>(r) * ldq + c] : 0.0f;
        const __half hi = __float2half_rn(x);
        sqh[r * LD + c] = hi;
        sql[r * LD + c] = __float2half_rn(x - __half2float(hi));
    }
    // This thread's rows g, g + 8 of the warp: keys [rlo, rhi] (empty for rows without output).
    int64_t rlo[2], rhi[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const int r = 16 * warp + g + 8 * i;
        const int64_t p = pos0 + r;
        const bool ok = r >= ra && r <= rb;
        rhi[i] = ok ? p : -1;
        rlo[i] = !ok ? kNoKey : a.window > 0 ? max(static_cast<int64_t>(0), p - a.window + 1) : 0;
    }
    // The warp's rows with output [wa, wb] and the keys [wk_lo, wk_hi] any of them attends; a tile
    // inside [free_lo, free_hi] is attended whole by all 16 rows (no mask needed).
    const int64_t wa = max(ra, static_cast<int64_t>(16 * warp)), wb = min(rb, static_cast<int64_t>(16 * warp + 15));
    const bool live = wa <= wb;
    const int64_t wk_lo = a.window > 0 ? max(static_cast<int64_t>(0), pos0 + wa - a.window + 1) : 0;
    const int64_t wk_hi = pos0 + wb;
    const bool full = wa == 16 * warp && wb == 16 * warp + 15;
    const int64_t free_lo = a.window > 0 ? max(static_cast<int64_t>(0), pos0 + 16 * warp + 15 - a.window + 1) : 0;
    const int64_t free_hi = pos0 + 16 * warp;

    float acc[HD / 8][4];
#pragma unroll
    for (int jd = 0; jd < HD / 8; ++jd) acc[jd][0] = acc[jd][1] = acc[jd][2] = acc[jd][3] = 0.0f;
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
    for (int it = 0; it < n_it; ++it) {
        const int64_t kt = k_first + static_cast<int64_t>(it) * kK;
        if (it + 1 < n_it) load_tile((it + 1) & 1, kt + kK);
        cp_async_commit();  // possibly empty: the wait below always leaves exactly the newest group
        cp_async_wait<1>();  // tile `it` has landed (this thread's copies) ...
        __syncthreads();     // ... everyone's, and the q stores are visible
        if (live && kt <= wk_hi && kt + kK - 1 >= wk_lo) {  // warp-uniform
            const bool masked = !(full && kt >= free_lo && kt + kK - 1 <= free_hi);
            int clo[2], chi[2];
#pragma unroll
            for (int i = 0; i < 2; ++i) {
                clo[i] = static_cast<int>(min(static_cast<int64_t>(kK), max(static_cast<int64_t>(0), rlo[i] - kt)));
                chi[i] = static_cast<int>(max(static_cast<int64_t>(-1), min(static_cast<int64_t>(kK - 1), rhi[i] - kt)));
            }
            const int st = it & 1;
            tile_step<HD>(sqh, sql, sk + st * kK * LD, sv + st * kK * LD, warp, lane, masked, clo, chi, a.scale,
                          a.softcap, acc, m, l);
        }
        __syncthreads();  // stage `it & 1` is consumed before iteration it + 1 refills it
    }

#pragma unroll
    for (int i = 0; i < 2; ++i) {
        l[i] += __shfl_xor_sync(0xffffffffu, l[i], 1);
        l[i] += __shfl_xor_sync(0xffffffffu, l[i], 2);
    }
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const int r = 16 * warp + g + 8 * i;
        if (r < ra || r > rb) continue;
        const int64_t t = i0 + r;
        if (n_split == 1) {  // a row with output has >= 1 key (its own position): l >= 1
            float *o = out + t * ldo + static_cast<int64_t>(h) * HD;
            const float inv = 1.0f / l[i];
#pragma unroll
            for (int jd = 0; jd < HD / 8; ++jd) {
                o[8 * jd + 2 * tq] = acc[jd][2 * i] * inv;
                o[8 * jd + 2 * tq + 1] = acc[jd][2 * i + 1] * inv;
            }
        } else {
            float *pp = part + ((t * a.n_head + h) * n_split + split) * (HD + 2);
            if (tq == 0) {
                pp[0] = m[i];
                pp[1] = l[i];
            }
#pragma unroll
            for (int jd = 0; jd < HD / 8; ++jd) {
                pp[2 + 8 * jd + 2 * tq] = acc[jd][2 * i];
                pp[2 + 8 * jd + 2 * tq + 1] = acc[jd][2 * i + 1];
            }
        }
    }
}

template <int HD>
void launch_hd(const float *q, int64_t ldq, int64_t n_tok, const void *k, const void *v, size_t kvs,
               const attn_args &a, const int64_t *pos_base, float *out, int64_t ldo, uint32_t *err, float *part,
               int n_split, cudaStream_t s) {
    const size_t smem = smem_bytes(HD);
    // the opt-in once per device (cuda_smem.cuh): a launch inside a graph capture issues no attribute call
    if (!smem_opt_in<attn_mma_kernel<HD>>(smem))
        throw error("cuda attention (tensor cores): " + std::to_string(smem) +
                    " bytes of shared memory exceed the device's limit");
    const dim3 grid(static_cast<unsigned>(a.n_head), static_cast<unsigned>((n_tok + kQ - 1) / kQ),
                    static_cast<unsigned>(n_split));
    attn_mma_kernel<HD><<<grid, kThreads, smem, s>>>(q, ldq, n_tok, static_cast<const uint8_t *>(k),
                                                     static_cast<const uint8_t *>(v), kvs, a, pos_base, out, ldo,
                                                     part, err);
    const cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) throw error(std::string("cuda attention (tensor cores): launch failed: ") + cudaGetErrorString(e));
}

}  // namespace

bool attention_mma_usable(int32_t head_dim, const void *k, const void *v, size_t kv_stride_bytes) {
    if (head_dim != 64 && head_dim != 128 && head_dim != 256) return false;
    const auto al16 = [](const void *p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
    if (!al16(k) || !al16(v) || kv_stride_bytes % 16 != 0 || kv_stride_bytes < static_cast<size_t>(head_dim) * 2)
        return false;
    const device_caps *caps = current_device_caps();
    return caps && caps->cc_major >= 8 && static_cast<size_t>(caps->smem_optin) >= smem_bytes(head_dim);
}

// Enough splits to bring the blocks near kTargetBlocks, each with >= 4 tiles of cache capacity.
int attention_mma_splits(int64_t n_tok, int32_t n_head, int64_t n_ctx) {
    const int64_t blocks = std::max<int64_t>(1, (n_tok + kQ - 1) / kQ * n_head);
    if (blocks >= kTargetBlocks) return 1;
    int64_t sp = kTargetBlocks / blocks;
    sp = std::min<int64_t>(sp, std::max<int64_t>(1, n_ctx / (4 * kK)));
    return static_cast<int>(std::min<int64_t>(sp, kMaxSplits));
}

void launch_attention_mma(const float *q, int64_t ldq, int64_t n_tok, const void *k, const void *v,
                          size_t kv_stride_bytes, const attn_args &a, const int64_t *pos_base, float *out,
                          int64_t ldo, uint32_t *err, float *part, int n_split, cudaStream_t s) {
    if (n_tok <= 0) return;
    if ((n_tok + kQ - 1) / kQ > 65535 || n_split < 1 || n_split > 65535)
        throw error("cuda attention (tensor cores): grid too large for " + std::to_string(n_tok) + " tokens");
    if (n_split > 1 && !part) throw error("cuda attention (tensor cores): split partials scratch missing");
    switch (a.head_dim) {
    case 64: launch_hd<64>(q, ldq, n_tok, k, v, kv_stride_bytes, a, pos_base, out, ldo, err, part, n_split, s); break;
    case 128: launch_hd<128>(q, ldq, n_tok, k, v, kv_stride_bytes, a, pos_base, out, ldo, err, part, n_split, s); break;
    case 256: launch_hd<256>(q, ldq, n_tok, k, v, kv_stride_bytes, a, pos_base, out, ldo, err, part, n_split, s); break;
    default: throw error("cuda attention (tensor cores): head_dim " + std::to_string(a.head_dim) + " not 64/128/256");
    }
}

}  // namespace fathom::cuda
