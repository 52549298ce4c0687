// CUDA kernels for the non-matmul ops: rms_norm, rope table + rotation, KV-cache store, attention
// (flash-decoding style: online softmax per warp, optional split over keys with a combine pass; prefill
// over f16 caches goes to the tensor-core kernel of cuda_attn_mma.cu),
// row-wise elementwise ops and softmax. Positions for rope_table / kv_store / attention are read on
// the device as *pos_base + offset so a captured CUDA graph replays at a new position.
// The decode step's per-layer chain (QKV GEMV, qk_rope_store, attention, combine, output GEMV) is launched
// with PDL (cuda_pdl.cuh): qk_rope_store, attn_kernel and attn_combine_kernel wait for their predecessor
// before touching memory and let their successor launch at once, so the next kernel's launch (and the
// next GEMV's weight loads, issued before its own wait) overlap the running one instead of following it.
// Only the dense backend launches these (after a kernel of the same stream, never after a cross-stream
// wait); pdl_wait is a no-op in a launch without the attribute.
#include <cuda_fp16.h>

#include <cmath>

#include "backend/cuda/cuda_kernels.h"
#include "backend/cuda/cuda_pdl.cuh"
#include "core/error.h"

namespace fathom::cuda {
namespace {

unsigned grid_for(int64_t total, int threads) {
    const int64_t g = (total + threads - 1) / threads;
    if (g > 0x7fffffff) throw error("cuda: launch of " + std::to_string(total) + " threads is too large");
    return static_cast<unsigned>(g);
}

__device__ __forceinline__ float warp_sum(float a) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) a += __shfl_xor_sync(0xffffffffu, a, o);
    return a;
}
__device__ __forceinline__ double warp_sum_d(double a) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) a += __shfl_xor_sync(0xffffffffu, a, o);
    return a;
}
__device__ __forceinline__ float warp_max(float a) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) a = fmaxf(a, __shfl_xor_sync(0xffffffffu, a, o));
    return a;
}

// Block-wide reductions for 256-thread blocks (result broadcast to every thread).
__device__ double block_sum_d(double a, double *sh) {
    a = warp_sum_d(a);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    __syncthreads();
    if (lane == 0) sh[warp] = a;
    __syncthreads();
    double t = 0;
    for (int i = 0; i < static_cast<int>(blockDim.x >> 5); ++i) t += sh[i];
    return t;
}
__device__ float block_max(float a, float *sh) {
    a = warp_max(a);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    __syncthreads();
    if (lane == 0) sh[warp] = a;
    __syncthreads();
    float t = -INFINITY;
    for (int i = 0; i < static_cast<int>(blockDim.x >> 5); ++i) t = fmaxf(t, sh[i]);
    return t;
}

// ---- rms_norm: one 256-thread block per row; squares summed in double as the CPU does ----------
// The row's scale 1 / sqrt(mean(x^2) + eps) (every thread of the block gets it).
__device__ float rms_scale(const float *__restrict__ xr, int64_t n, float eps, double *sh) {
    double ss = 0;
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) ss += static_cast<double>(xr[i] * xr[i]);
    ss = block_sum_d(ss, sh);
    return 1.0f / sqrtf(static_cast<float>(ss / static_cast<double>(n)) + eps);
}

__global__ void rms_norm_kernel(const float *__restrict__ x, int64_t ldx, const float *__restrict__ w, float eps,
                                int64_t n, float *__restrict__ y, int64_t ldy) {
    __shared__ double sh[8];
    const float *xr = x + blockIdx.x * ldx;
    float *yr = y + blockIdx.x * ldy;
    const float s = rms_scale(xr, n, eps, sh);
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) yr[i] = w ? (xr[i] * s) * w[i] : xr[i] * s;
}

// ---- rope ------------------------------------------------------------------------------------
// Same arithmetic as the CPU reference: theta in double, YaRN ramp in float, cos/sin in double.
__global__ void rope_table_kernel(const int64_t *pos_base, int64_t p0, int64_t n, rope_table_args a, float *out,
                                  int64_t ldo) {
    const int half = a.n_rot / 2;
    const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (idx >= n * half) return;
    const int64_t t = idx / half;
    const int i = static_cast<int>(idx % half);
    // Negative positions are computed as the CPU reference does (no error).
    const double pos = static_cast<double>(*pos_base + p0 + t);
    double theta_extrap = pos * pow(static_cast<double>(a.freq_base), -2.0 * i / a.n_rot);
    if (a.freq_factors) theta_extrap /= a.freq_factors[i];
    double theta = a.freq_scale * theta_extrap;
    if (a.ext_factor != 0.0f) {
        const float y = (static_cast<float>(i) - a.corr0) / fmaxf(0.001f, a.corr1 - a.corr0);
        const float ramp = (1.0f - fminf(1.0f, fmaxf(0.0f, y))) * a.ext_factor;
        theta = theta * (1.0 - ramp) + theta_extrap * ramp;
    }
    float *row = out + t * ldo;
    row[2 * i] = static_cast<float>(cos(theta)) * a.mscale;
    row[2 * i + 1] = static_cast<float>(sin(theta)) * a.mscale;
}

__global__ void rope_kernel(float *x, int64_t ldx, int64_t rows, int64_t n_head, int32_t hd,
                            const float *__restrict__ table, int64_t ldt, int32_t n_rot, bool neox) {
    const int half = n_rot / 2;
    const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (idx >= rows * n_head * half) return;
    const int i = static_cast<int>(idx % half);
    const int64_t h = (idx / half) % n_head, t = idx / (half * n_head);
    float *xh = x + t * ldx + h * hd;
    float *pa = neox ? xh + i : xh + 2 * i;
    float *pb = neox ? pa + half : pa + 1;
    const float c = table[t * ldt + 2 * i], s = table[t * ldt + 2 * i + 1];
    const float x0 = *pa, x1 = *pb;
    *pa = x0 * c - x1 * s;
    *pb = x0 * s + x1 * c;
}

// ---- kv_store: thread per (token, kv head, dim) -------------------------------------------------
__global__ void kv_store_kernel(const float *__restrict__ src, int64_t lds, int64_t n_tok, int32_t n_head_kv,
                                int32_t hd, uint8_t *cache, bool f16, size_t cstride, int64_t n_ctx,
                                const int64_t *pos_base, int64_t p0, uint32_t *err) {
    const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (idx >= n_tok * n_head_kv * hd) return;
    const int64_t d = idx % hd, h = (idx / hd) % n_head_kv, t = idx / (static_cast<int64_t>(hd) * n_head_kv);
    const int64_t pos = *pos_base + p0 + t;
    if (pos < 0 || pos >= n_ctx) {
        if (d == 0) atomicOr(err, err_kv_pos);
        return;
    }
    const float v = src[t * lds + h * hd + d];
    uint8_t *row = cache + static_cast<size_t>(h * n_ctx + pos) * cstride;
    if (f16) reinterpret_cast<__half *>(row)[d] = __float2half_rn(v);
    else reinterpret_cast<float *>(row)[d] = v;
}

// ---- fused decode ops (backend::qk_rope_store, backend::rms_norm_add) ----------------------------
// qk_rope_store: one block per (head slot, token); slots [0, H) are q heads, [H, H + Hkv) k heads,
// [H + Hkv, H + 2 Hkv) v heads. A q / k head is staged in shared memory, normed (squares summed in
// double, then rms_norm_kernel's arithmetic), rotated (rope_kernel's arithmetic), q scaled, written
// back; k and v heads are stored in the cache at *pos_base + p0 + t (outside the cache: err_kv_pos,
// nothing stored). One launch instead of q norm, k norm, two ropes, (scale), two kv_stores.
constexpr int kQkThreads = 128;
constexpr int kQkMaxHd = 512;
__global__ void __launch_bounds__(kQkThreads) qk_rope_store_kernel(float *q, int64_t ldq, float *k, int64_t ldk,
                                                                   const float *__restrict__ v, int64_t ldv,
                                                                   const float *__restrict__ table, int64_t ldt,
                                                                   qk_rope_store_args a, const int64_t *pos_base,
                                                                   uint32_t *err) {
    __shared__ float xs[kQkMaxHd];
    __shared__ double sh[8];
    pdl_wait();               // q, k, v are the preceding GEMV's output; the caches may be read by it
    pdl_launch_dependents();  // the attention may be scheduled (it waits for this grid itself)
    const int slot = static_cast<int>(blockIdx.x);
    const int64_t t = blockIdx.y;
    const int hd = a.hd;
    const int64_t pos = *pos_base + a.p0 + t;
    const bool in_cache = pos >= 0 && pos < a.n_ctx;
    if (!in_cache && threadIdx.x == 0 && slot >= a.n_head) atomicOr(err, err_kv_pos);
    const auto store = [&](void *cache, int h, int d, float val) {
        uint8_t *row = static_cast<uint8_t *>(cache) + static_cast<size_t>(h * a.n_ctx + pos) * a.cache_stride;
        if (a.f16) reinterpret_cast<__half *>(row)[d] = __float2half_rn(val);
        else reinterpret_cast<float *>(row)[d] = val;
    };
    if (slot >= a.n_head + a.n_head_kv) {  // v: stored as it is
        const int h = slot - a.n_head - a.n_head_kv;
        if (!in_cache) return;
        const float *src = v + t * ldv + static_cast<int64_t>(h) * hd;
        for (int d = threadIdx.x; d < hd; d += blockDim.x) store(a.v_cache, h, d, src[d]);
        return;
    }
    const bool is_q = slot < a.n_head;
    const int h = is_q ? slot : slot - a.n_head;
    float *row = is_q ? q + t * ldq + static_cast<int64_t>(h) * hd : k + t * ldk + static_cast<int64_t>(h) * hd;
    const float *nw = is_q ? a.q_norm : a.k_norm;
    for (int d = threadIdx.x; d < hd; d += blockDim.x) xs[d] = row[d];
    __syncthreads();
    if (nw) {
        const float sc = rms_scale(xs, hd, a.eps, sh);
        __syncthreads();
        for (int d = threadIdx.x; d < hd; d += blockDim.x) xs[d] = (xs[d] * sc) * nw[d];
        __syncthreads();
    }
    const int half = a.n_rot / 2;
    const float *tr = table + t * ldt;
    for (int i = threadIdx.x; i < half; i += blockDim.x) {
        const int ia = a.neox ? i : 2 * i, ib = a.neox ? i + half : 2 * i + 1;
        const float c = tr[2 * i], sn = tr[2 * i + 1];
        const float x0 = xs[ia], x1 = xs[ib];
        xs[ia] = x0 * c - x1 * sn;
        xs[ib] = x0 * sn + x1 * c;
    }
    __syncthreads();
    for (int d = threadIdx.x; d < hd; d += blockDim.x) {
        float val = xs[d];
        if (is_q && a.q_scale != 1.0f) val = val * a.q_scale;
        row[d] = val;
        if (!is_q && in_cache) store(a.k_cache, h, d, val);
    }
}

// rms_norm_add: acc[r] += rms_norm(x[r]) * w, rms_norm_kernel's arithmetic then elementwise add's.
__global__ void rms_norm_add_kernel(const float *__restrict__ x, int64_t ldx, const float *__restrict__ w, float eps,
                                    int64_t n, float *acc, int64_t lda) {
    __shared__ double sh[8];
    const float *xr = x + blockIdx.x * ldx;
    float *ar = acc + blockIdx.x * lda;
    const float s = rms_scale(xr, n, eps, sh);
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) ar[i] = ar[i] + (xr[i] * s) * w[i];
}

// ---- attention --------------------------------------------------------------------------------
constexpr int kAttnWarps = 4;
constexpr int kMaxHd = 256;  // head_dim limit: 8 dims per lane

template <bool F16>
__device__ __forceinline__ float kv_at(const uint8_t *row, int d) {
    if constexpr (F16) return __half2float(reinterpret_cast<const __half *>(row)[d]);
    else return reinterpret_cast<const float *>(row)[d];
}

// Block (item = token*n_head + head, split). Each warp walks keys j0+warp, j0+warp+4, ... of the
// split's key range with an online softmax; lanes own dims lane + 32*i. The 4 warps are merged in
// shared memory; with one split the block writes the normalised output, otherwise the unnormalised
// partial (max, sum, acc[hd]) for attn_combine_kernel.
template <bool F16>
__global__ void __launch_bounds__(32 * kAttnWarps) attn_kernel(const float *__restrict__ q, int64_t ldq,
                                                               const uint8_t *__restrict__ k,
                                                               const uint8_t *__restrict__ v, size_t kvs,
                                                               attn_args a, const int64_t *pos_base,
                                                               float *out, int64_t ldo, float *part,
                                                               uint32_t *err) {
    __shared__ float sm_m[kAttnWarps], sm_l[kAttnWarps];
    __shared__ float sm_acc[kAttnWarps][kMaxHd];
    pdl_wait();  // q and the cache rows are written by the preceding kernel
    pdl_launch_dependents();
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int64_t item = blockIdx.x;
    const int split = blockIdx.y, n_split = gridDim.y;
    const int64_t t = item / a.n_head;
    const int h = static_cast<int>(item % a.n_head), hk = h / (a.n_head / a.n_head_kv);
    const int hd = a.head_dim;
    const int64_t pos = *pos_base + a.n_past + t;
    if (pos < 0 || pos >= a.n_ctx) {
        if (threadIdx.x == 0 && split == 0) atomicOr(err, err_attn_pos);
        return;
    }
    const int64_t lo = a.window > 0 ? max(static_cast<int64_t>(0), pos - a.window + 1) : 0;
    // The valid keys [lo, pos] are divided evenly among the splits when the kernel runs: the grid
    // cannot depend on pos (it may exist only on the device, in a replayed graph), but the work
    // can, so a decode step at position 600 of an 8192-slot cache gives every split ~600/n_split
    // keys instead of leaving all of them to the first few splits. Splits past the span get none.
    const int64_t per = (pos + 1 - lo + n_split - 1) / n_split;
    const int64_t j0 = lo + split * per, j1 = min(pos + 1, j0 + per);

    float qr[8], acc[8];
    const float *qh = q + t * ldq + static_cast<int64_t>(h) * hd;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        const int d = lane + 32 * i;
        qr[i] = d < hd ? qh[d] : 0.0f;
        acc[i] = 0.0f;
    }
    float m = -INFINITY, l = 0.0f;
    const size_t base = static_cast<size_t>(hk) * a.n_ctx;
    for (int64_t j = j0 + warp; j < j1; j += kAttnWarps) {
        const uint8_t *kr = k + (base + j) * kvs, *vr = v + (base + j) * kvs;
        float s = 0.0f;
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            const int d = lane + 32 * i;
            if (d < hd) s += qr[i] * kv_at<F16>(kr, d);
        }
        s = warp_sum(s) * a.scale;
        if (a.softcap > 0.0f) s = a.softcap * tanhf(s / a.softcap);
        const float mn = fmaxf(m, s);
        const float c = expf(m - mn), p = expf(s - mn);
        l = l * c + p;
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            const int d = lane + 32 * i;
            acc[i] = acc[i] * c + (d < hd ? p * kv_at<F16>(vr, d) : 0.0f);
        }
        m = mn;
    }
    if (lane == 0) {
        sm_m[warp] = m;
        sm_l[warp] = l;
    }
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        const int d = lane + 32 * i;
        if (d < hd) sm_acc[warp][d] = acc[i];
    }
    __syncthreads();
    float M = -INFINITY;
    for (int w = 0; w < kAttnWarps; ++w) M = fmaxf(M, sm_m[w]);
    float L = 0.0f, f[kAttnWarps];
    for (int w = 0; w < kAttnWarps; ++w) {
        f[w] = sm_m[w] == -INFINITY ? 0.0f : expf(sm_m[w] - M);
        L += sm_l[w] * f[w];
    }
    if (n_split == 1) {
        float *o = out + t * ldo + static_cast<int64_t>(h) * hd;
        const float inv = 1.0f / L;
        for (int d = threadIdx.x; d < hd; d += blockDim.x) {
            float s = 0.0f;
            for (int w = 0; w < kAttnWarps; ++w) s += sm_acc[w][d] * f[w];
            o[d] = s * inv;
        }
    } else {
        float *pp = part + (item * n_split + split) * (hd + 2);
        if (threadIdx.x == 0) {
            pp[0] = M;
            pp[1] = L;
        }
        for (int d = threadIdx.x; d < hd; d += blockDim.x) {
            float s = 0.0f;
            for (int w = 0; w < kAttnWarps; ++w) s += sm_acc[w][d] * f[w];
            pp[2 + d] = s;
        }
    }
}

__global__ void attn_combine_kernel(const float *__restrict__ part, int n_split, attn_args a,
                                    const int64_t *pos_base, float *out, int64_t ldo) {
    pdl_wait();  // the partials of attn_kernel
    pdl_launch_dependents();  // the output GEMV may start its weight loads
    const int64_t item = blockIdx.x;
    const int64_t t = item / a.n_head;
    const int h = static_cast<int>(item % a.n_head), hd = a.head_dim;
    const int64_t pos = *pos_base + a.n_past + t;
    if (pos < 0 || pos >= a.n_ctx) return;  // flagged by attn_kernel
    const float *pp = part + item * n_split * (hd + 2);
    float M = -INFINITY;
    for (int s = 0; s < n_split; ++s) M = fmaxf(M, pp[s * (hd + 2)]);
    float L = 0.0f;
    for (int s = 0; s < n_split; ++s) {
        const float ms = pp[s * (hd + 2)];
        if (ms != -INFINITY) L += pp[s * (hd + 2) + 1] * expf(ms - M);
    }
    float *o = out + t * ldo + static_cast<int64_t>(h) * hd;
    for (int d = threadIdx.x; d < hd; d += blockDim.x) {
        float acc = 0.0f;
        for (int s = 0; s < n_split; ++s) {
            const float ms = pp[s * (hd + 2)];
            if (ms != -INFINITY) acc += pp[s * (hd + 2) + 2 + d] * expf(ms - M);
        }
        o[d] = acc / L;
    }
}

// ---- elementwise --------------------------------------------------------------------------------
__global__ void elementwise_kernel(ew_op op, const float *__restrict__ a, int64_t lda, const float *__restrict__ b,
                                   int64_t ldb, void *out, int64_t ldo, int64_t n, int64_t total, float param) {
    const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (idx >= total) return;
    const int64_t r = idx / n, i = idx % n;
    const float x = a[r * lda + i];
    float y;
    switch (op) {
    case ew_op::add: y = x + b[r * ldb + i]; break;
    case ew_op::add_bcast: y = x + b[i]; break;
    case ew_op::scale: y = x * param; break;
    case ew_op::softcap: y = param * tanhf(x / param); break;
    case ew_op::swiglu: y = x / (1.0f + expf(-x)) * b[r * ldb + i]; break;
    case ew_op::geglu: {
        constexpr float kSqrt2OverPi = 0.79788456080286535587989211986876f, kCoef = 0.044715f;
        y = 0.5f * x * (1.0f + tanhf(kSqrt2OverPi * x * (1.0f + kCoef * x * x))) * b[r * ldb + i];
        break;
    }
    case ew_op::copy_f16:
        static_cast<__half *>(out)[r * ldo + i] = __float2half_rn(x);
        return;
    default: y = x; break;
    }
    static_cast<float *>(out)[r * ldo + i] = y;
}

__global__ void softmax_kernel(float *x, int64_t ldx, int64_t n) {
    __shared__ float shf[8];
    __shared__ double shd[8];
    float *xr = x + blockIdx.x * ldx;
    float mx = -INFINITY;
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) mx = fmaxf(mx, xr[i]);
    mx = block_max(mx, shf);
    double sum = 0;
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
        const float e = expf(xr[i] - mx);
        xr[i] = e;
        sum += e;
    }
    sum = block_sum_d(sum, shd);
    const float inv = static_cast<float>(1.0 / sum);
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) xr[i] *= inv;
}

__global__ void set_i64_kernel(int64_t *dst, int64_t v) { *dst = v; }

}  // namespace

void launch_rms_norm(const float *x, int64_t ldx, const float *w, float eps, int64_t n, int64_t rows, float *y,
                     int64_t ldy, cudaStream_t s) {
    if (rows == 0) return;
    rms_norm_kernel<<<grid_for(rows, 1), 256, 0, s>>>(x, ldx, w, eps, n, y, ldy);
}

void launch_qk_rope_store(float *q, int64_t ldq, float *k, int64_t ldk, const float *v, int64_t ldv, int64_t n_tok,
                          const float *table, int64_t ldt, const qk_rope_store_args &a, const int64_t *pos_base,
                          uint32_t *err, cudaStream_t s) {
    if (n_tok == 0) return;
    if (a.hd > kQkMaxHd || a.n_rot > a.hd || n_tok > 65535)
        throw error("cuda qk_rope_store: head_dim " + std::to_string(a.hd) + " / n_rot / tokens out of range");
    const dim3 grid(static_cast<unsigned>(a.n_head + 2 * a.n_head_kv), static_cast<unsigned>(n_tok));
    const cudaError_t e = launch_pdl(qk_rope_store_kernel, grid, dim3(kQkThreads), 0, s, true, q, ldq, k, ldk, v, ldv,
                                     table, ldt, a, pos_base, err);
    if (e != cudaSuccess) throw error(std::string("cuda qk_rope_store: launch failed: ") + cudaGetErrorString(e));
}

void launch_rms_norm_add(const float *x, int64_t ldx, const float *w, float eps, int64_t n, int64_t rows, float *acc,
                         int64_t lda, cudaStream_t s) {
    if (rows == 0) return;
    rms_norm_add_kernel<<<grid_for(rows, 1), 256, 0, s>>>(x, ldx, w, eps, n, acc, lda);
}

void launch_rope_table(const int64_t *pos_base, int64_t p0, int64_t n, const rope_table_args &a, float *out,
                       int64_t ldo, cudaStream_t s) {
    const int64_t total = n * (a.n_rot / 2);
    if (total == 0) return;
    rope_table_kernel<<<grid_for(total, 128), 128, 0, s>>>(pos_base, p0, n, a, out, ldo);
}

void launch_rope(float *x, int64_t ldx, int64_t rows, int64_t n_head, int32_t head_dim, const float *table,
                 int64_t ldt, int32_t n_rot, bool neox, cudaStream_t s) {
    const int64_t total = rows * n_head * (n_rot / 2);
    if (total == 0) return;
    rope_kernel<<<grid_for(total, 256), 256, 0, s>>>(x, ldx, rows, n_head, head_dim, table, ldt, n_rot, neox);
}

void launch_kv_store(const float *src, int64_t lds, int64_t n_tok, int32_t n_head_kv, int32_t hd, void *cache,
                     bool f16, size_t cache_stride_bytes, int64_t n_ctx, const int64_t *pos_base, int64_t p0,
                     uint32_t *err, cudaStream_t s) {
    const int64_t total = n_tok * n_head_kv * hd;
    if (total == 0) return;
    kv_store_kernel<<<grid_for(total, 256), 256, 0, s>>>(src, lds, n_tok, n_head_kv, hd, static_cast<uint8_t *>(cache),
                                                         f16, cache_stride_bytes, n_ctx, pos_base, p0, err);
}

// Splits over keys only pay when there are few (token, head) items, i.e. decode; the split count
// depends on n_tok, n_head and the cache capacity only, never on the position, so graphs stay valid.
int attention_splits(int64_t n_tok, int32_t n_head, int64_t n_ctx) {
    // Prefill-sized calls: the tensor-core kernel's blocks (64 queries x one head) set the count. The
    // scalar kernel, which still serves those calls for f32 caches, takes any count.
    if (n_tok >= kAttnMmaMinTokens) return attention_mma_splits(n_tok, n_head, n_ctx);
    const int64_t items = n_tok * n_head;
    int64_t splits = std::max<int64_t>(1, 264 / std::max<int64_t>(1, items));
    splits = std::min<int64_t>(splits, std::max<int64_t>(1, (n_ctx + 127) / 128));
    return static_cast<int>(std::min<int64_t>(splits, 64));
}

void launch_attention(const float *q, int64_t ldq, int64_t n_tok, const void *k, const void *v, bool f16,
                      size_t kv_stride_bytes, const attn_args &a, const int64_t *pos_base, float *out, int64_t ldo,
                      uint32_t *err, float *part, int n_split, cudaStream_t s) {
    if (n_tok == 0) return;
    if (a.head_dim > kMaxHd) throw error("cuda attention: head_dim " + std::to_string(a.head_dim) + " > 256");
    const int64_t items = n_tok * a.n_head;
    const dim3 grid(grid_for(items, 1), static_cast<unsigned>(n_split));
    const auto *k8 = static_cast<const uint8_t *>(k), *v8 = static_cast<const uint8_t *>(v);
    // Several queries over f16 caches: tensor cores (cuda_attn_mma.cu); single-token decode keeps the
    // scalar split kernel (kAttnMmaMinTokens).
    if (f16 && n_tok >= kAttnMmaMinTokens && attention_mma_usable(a.head_dim, k, v, kv_stride_bytes))
        launch_attention_mma(q, ldq, n_tok, k, v, kv_stride_bytes, a, pos_base, out, ldo, err, part, n_split, s);
    else {
        const cudaError_t e = launch_pdl(f16 ? attn_kernel<true> : attn_kernel<false>, grid, dim3(32 * kAttnWarps), 0, s,
                                         true, q, ldq, k8, v8, kv_stride_bytes, a, pos_base, out, ldo, part, err);
        if (e != cudaSuccess) throw error(std::string("cuda attention: launch failed: ") + cudaGetErrorString(e));
    }
    if (n_split > 1) {
        const cudaError_t e = launch_pdl(attn_combine_kernel, dim3(grid_for(items, 1)), dim3(128), 0, s, true,
                                         static_cast<const float *>(part), n_split, a, pos_base, out, ldo);
        if (e != cudaSuccess) throw error(std::string("cuda attention combine: launch failed: ") + cudaGetErrorString(e));
    }
}

void launch_elementwise(ew_op op, const float *a, int64_t lda, const float *b, int64_t ldb, void *out, int64_t ldo,
                        int64_t n, int64_t rows, float param, cudaStream_t s) {
    const int64_t total = n * rows;
    if (total == 0) return;
    elementwise_kernel<<<grid_for(total, 256), 256, 0, s>>>(op, a, lda, b, ldb, out, ldo, n, total, param);
}

void launch_softmax(float *x, int64_t ldx, int64_t n, int64_t rows, cudaStream_t s) {
    if (rows == 0) return;
    softmax_kernel<<<grid_for(rows, 1), 256, 0, s>>>(x, ldx, n);
}

void launch_set_i64(int64_t *dst, int64_t v, cudaStream_t s) { set_i64_kernel<<<1, 1, 0, s>>>(dst, v); }

namespace {

// PFlash scoring (backend::attention_prob_max): one block per (query, head); three passes over the
// query's keys (max, f64 sum of exp, then p into agg with an integer atomicMax: p >= 0, so the f32 bit
// patterns order like the values and the result does not depend on the blocks' order).
constexpr int kProbThreads = 256;

__device__ __forceinline__ float prob_score(const float *qs, const uint16_t *krow, int hd, float scale, float cap) {
    float acc = 0.0f;
    for (int i = 0; i < hd; i += 8) {
        const uint4 raw = *reinterpret_cast<const uint4 *>(krow + i);
        const __half2 *h2 = reinterpret_cast<const __half2 *>(&raw);
#pragma unroll
        for (int u = 0; u < 4; ++u) {
            const float2 f = __half22float2(h2[u]);
            acc = fmaf(qs[i + 2 * u], f.x, acc);
            acc = fmaf(qs[i + 2 * u + 1], f.y, acc);
        }
    }
    float sc = acc * scale;
    if (cap > 0.0f) sc = cap * tanhf(sc / cap);
    return sc;
}

template <class T, class Op>
__device__ T prob_block_reduce(T v, T *red, Op op) {
    for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
    __syncthreads();
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
    __syncthreads();
    T r = red[0];
    for (int w = 1; w < kProbThreads / 32; ++w) r = op(r, red[w]);
    return r;
}

__global__ void __launch_bounds__(kProbThreads)
    attn_prob_max_kernel(const float *__restrict__ q, int64_t ldq, const uint16_t *__restrict__ k, int n_head, int group,
                         int64_t n_ctx, int hd, float scale, float cap, int64_t first_pos, float *agg, int64_t ld_agg) {
    __shared__ float qs[512];
    __shared__ float redf[kProbThreads / 32];
    __shared__ double redd[kProbThreads / 32];
    const int64_t t = blockIdx.x / n_head;
    const int h = static_cast<int>(blockIdx.x % n_head);
    const int64_t pos = first_pos + t;
    for (int i = threadIdx.x; i < hd; i += kProbThreads) qs[i] = q[t * ldq + static_cast<int64_t>(h) * hd + i];
    __syncthreads();
    const uint16_t *kb = k + static_cast<int64_t>(h / group) * n_ctx * hd;
    float mx = -INFINITY;
    for (int64_t j = threadIdx.x; j <= pos; j += kProbThreads) mx = fmaxf(mx, prob_score(qs, kb + j * hd, hd, scale, cap));
    mx = prob_block_reduce(mx, redf, [](float a, float b) { return fmaxf(a, b); });
    double sum = 0.0;
    for (int64_t j = threadIdx.x; j <= pos; j += kProbThreads) sum += expf(prob_score(qs, kb + j * hd, hd, scale, cap) - mx);
    sum = prob_block_reduce(sum, redd, [](double a, double b) { return a + b; });
    const float inv = static_cast<float>(1.0 / sum);
    float *a = agg + t * ld_agg;
    for (int64_t j = threadIdx.x; j <= pos; j += kProbThreads) {
        const float p = expf(prob_score(qs, kb + j * hd, hd, scale, cap) - mx) * inv;
        atomicMax(reinterpret_cast<int *>(a + j), __float_as_int(p));
    }
}

}  // namespace

void launch_attn_prob_max(const float *q, int64_t ldq, const uint16_t *k, int n_head, int group, int64_t n_ctx, int hd,
                          float scale, float softcap, int64_t first_pos, int64_t n_q, float *agg, int64_t ld_agg,
                          cudaStream_t s) {
    if (n_q <= 0) return;
    if (hd > 512 || hd % 8 != 0) throw error("cuda attention_prob_max: head_dim must be a multiple of 8 up to 512");
    attn_prob_max_kernel<<<static_cast<unsigned>(n_q * n_head), kProbThreads, 0, s>>>(q, ldq, k, n_head, group, n_ctx, hd,
                                                                                      scale, softcap, first_pos, agg, ld_agg);
}

}  // namespace fathom::cuda
