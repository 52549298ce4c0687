// CUDA kernels that read GGUF weight formats: the decode GEMV (M <= 8 activation rows, weights read
// straight from their blocks), dequantisation to bf16 for the cuBLAS prefill GEMM, the activation
// f32 -> bf16 conversion, and get_rows. Block decoding lives in cuda_quant.cuh.
#include <cuda_bf16.h>

#include "backend/cuda/cuda_kernels.h"
#include "backend/cuda/cuda_quant.cuh"
#include "core/error.h"

namespace fathom::cuda {
namespace {

constexpr int kGemvWarps = 4;  // 128-thread blocks

// x is 16-byte aligned (the backend checks x rows, and s0/s1 are multiples of 8).
__device__ __forceinline__ float dot8(const float *w, const float *x) {
    const float4 x0 = __ldg(reinterpret_cast<const float4 *>(x));
    const float4 x1 = __ldg(reinterpret_cast<const float4 *>(x) + 1);
    float a = w[0] * x0.x + w[1] * x0.y + w[2] * x0.z + w[3] * x0.w;
    a += w[4] * x1.x + w[5] * x1.y + w[6] * x1.z + w[7] * x1.w;
    return a;
}

// LPR lanes per output row (8 or 32): a warp covers 32/LPR rows. Small K with many rows uses 8
// lanes per row so lanes stay busy and each warp keeps 4 rows' loads in flight; otherwise the
// whole warp takes a row. Lanes stride over the row's 16-weight units, keep M partial sums, and reduce within
// their group (xor shuffles below LPR stay inside the group). x rows are read through the
// read-only cache (every warp reuses them).
template <dtype T, int M, int LPR>
__global__ void __launch_bounds__(32 * kGemvWarps) gemv_kernel(const uint8_t *__restrict__ W, size_t w_stride,
                                                               int64_t units, int64_t N, const float *__restrict__ x,
                                                               int64_t ldx, float *__restrict__ y, int64_t ldy) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int sub = lane % LPR;
    const int64_t r = (static_cast<int64_t>(blockIdx.x) * kGemvWarps + warp) * (32 / LPR) + lane / LPR;
    float acc[M];
#pragma unroll
    for (int m = 0; m < M; ++m) acc[m] = 0.0f;
    if (r < N) {  // no early return: every lane takes part in the shuffles below
        const uint8_t *row = W + static_cast<size_t>(r) * w_stride;
#pragma unroll 4
        for (int64_t u = sub; u < units; u += LPR) {
            float w[16];
            int64_t s0, s1;
            decode_unit<T>(row, u, w, s0, s1);
#pragma unroll
            for (int m = 0; m < M; ++m) {
                const float *xm = x + m * ldx;
                acc[m] += dot8(w, xm + s0) + dot8(w + 8, xm + s1);
            }
        }
    }
#pragma unroll
    for (int m = 0; m < M; ++m) {
        float a = acc[m];
#pragma unroll
        for (int o = LPR / 2; o > 0; o >>= 1) a += __shfl_xor_sync(0xffffffffu, a, o);
        if (sub == 0 && r < N) y[m * ldy + r] = a;
    }
}

template <dtype T>
__global__ void dequant_bf16_kernel(const uint8_t *__restrict__ W, size_t w_stride, int64_t K, int64_t units,
                                    int64_t total, __nv_bfloat16 *__restrict__ dst) {
    const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (idx >= total) return;
    const int64_t r = idx / units, u = idx % units;
    float w[16];
    int64_t s0, s1;
    decode_unit<T>(W + static_cast<size_t>(r) * w_stride, u, w, s0, s1);
    __nv_bfloat16 *o = dst + r * K;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        o[s0 + i] = __float2bfloat16_rn(w[i]);
        o[s1 + i] = __float2bfloat16_rn(w[8 + i]);
    }
}

template <dtype T>
__global__ void get_rows_kernel(const uint8_t *__restrict__ table, size_t t_stride, int64_t units, int64_t n_rows,
                                const int32_t *__restrict__ ids, int64_t total, float *__restrict__ out,
                                int64_t ldo, uint32_t *err) {
    const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (idx >= total) return;
    const int64_t i = idx / units, u = idx % units;
    const int32_t id = ids[i];
    if (id < 0 || id >= n_rows) {
        if (u == 0) atomicOr(err, err_get_rows_id);
        return;
    }
    float w[16];
    int64_t s0, s1;
    decode_unit<T>(table + static_cast<size_t>(id) * t_stride, u, w, s0, s1);
    float *o = out + i * ldo;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        o[s0 + j] = w[j];
        o[s1 + j] = w[8 + j];
    }
}

__global__ void f32_to_bf16_kernel(const float *__restrict__ x, int64_t ldx, int64_t K, int64_t total,
                                   __nv_bfloat16 *__restrict__ dst) {
    const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (idx >= total) return;
    const int64_t m = idx / K, k = idx % K;
    dst[idx] = __float2bfloat16_rn(x[m * ldx + k]);
}

unsigned grid_for(int64_t total, int threads) {
    const int64_t g = (total + threads - 1) / threads;
    if (g > 0x7fffffff) throw error("cuda: launch of " + std::to_string(total) + " threads is too large");
    return static_cast<unsigned>(g);
}

template <dtype T, int M>
void gemv_m(const void *W, size_t w_stride, int64_t K, int64_t N, const float *x, int64_t ldx, float *y, int64_t ldy,
            cudaStream_t s) {
    const auto *w8 = static_cast<const uint8_t *>(W);
    const int64_t units = K / 16;
    // 8 lanes per row only when there are rows enough to fill the GPU with 16-row blocks (e.g. an
    // output head); otherwise a warp per row keeps the grid wide (small N is latency-bound).
    if (units <= 128 && N >= 16 * 264) {
        gemv_kernel<T, M, 8><<<grid_for(N, kGemvWarps * 4), 32 * kGemvWarps, 0, s>>>(w8, w_stride, units, N, x, ldx,
                                                                                    y, ldy);
    } else {
        gemv_kernel<T, M, 32><<<grid_for(N, kGemvWarps), 32 * kGemvWarps, 0, s>>>(w8, w_stride, units, N, x, ldx, y,
                                                                                 ldy);
    }
}

struct supported_fn {
    template <dtype T> void operator()() const {}
};

}  // namespace

bool mm_supported(dtype t) {
    return dispatch_qtype(t, supported_fn{});
}

int mm_alignment(dtype t) {
    int a = 0;
    dispatch_qtype(t, [&]<dtype T>() { a = qtraits<T>::align; });
    return a;
}

void launch_gemv(dtype t, const void *W, size_t w_stride, int64_t K, int64_t N, const float *x, int64_t ldx,
                 int64_t M, float *y, int64_t ldy, cudaStream_t s) {
    if (reinterpret_cast<uintptr_t>(x) % 16 != 0 || ldx % 4 != 0)
        throw error("cuda gemv: activation rows must be 16-byte aligned");
    // M is covered by chunks of 4, 2 and 1 rows (fewer template instances than one per M).
    const bool ok = dispatch_qtype(t, [&]<dtype T>() {
        int64_t m = 0;
        for (; m + 4 <= M; m += 4) gemv_m<T, 4>(W, w_stride, K, N, x + m * ldx, ldx, y + m * ldy, ldy, s);
        if (m + 2 <= M) {
            gemv_m<T, 2>(W, w_stride, K, N, x + m * ldx, ldx, y + m * ldy, ldy, s);
            m += 2;
        }
        if (m < M) gemv_m<T, 1>(W, w_stride, K, N, x + m * ldx, ldx, y + m * ldy, ldy, s);
    });
    if (!ok) throw error("cuda gemv: unsupported weight type " + std::string(dtype_name(t)));
}

void launch_dequant_bf16(dtype t, const void *W, size_t w_stride, int64_t K, int64_t N, uint16_t *dst,
                         cudaStream_t s) {
    const int64_t units = K / 16, total = units * N;
    const bool ok = dispatch_qtype(t, [&]<dtype T>() {
        dequant_bf16_kernel<T><<<grid_for(total, 256), 256, 0, s>>>(static_cast<const uint8_t *>(W), w_stride, K,
                                                                     units, total,
                                                                     reinterpret_cast<__nv_bfloat16 *>(dst));
    });
    if (!ok) throw error("cuda dequantise: unsupported weight type " + std::string(dtype_name(t)));
}

void launch_f32_to_bf16(const float *x, int64_t ldx, int64_t K, int64_t M, uint16_t *dst, cudaStream_t s) {
    const int64_t total = K * M;
    f32_to_bf16_kernel<<<grid_for(total, 256), 256, 0, s>>>(x, ldx, K, total, reinterpret_cast<__nv_bfloat16 *>(dst));
}

void launch_get_rows(dtype t, const void *table, size_t t_stride, int64_t K, int64_t n_rows, const int32_t *ids,
                     int64_t n, float *out, int64_t ldo, uint32_t *err, cudaStream_t s) {
    const int64_t units = K / 16, total = units * n;
    const bool ok = dispatch_qtype(t, [&]<dtype T>() {
        get_rows_kernel<T><<<grid_for(total, 256), 256, 0, s>>>(static_cast<const uint8_t *>(table), t_stride, units,
                                                                 n_rows, ids, total, out, ldo, err);
    });
    if (!ok) throw error("cuda get_rows: unsupported table type " + std::string(dtype_name(t)));
}

}  // namespace fathom::cuda
