// DS4 hyper-connections on CUDA for one decoded token (spec ../shared/reference/ds4-architecture.md
// 3.1-3.3): HCPre = the mixer projection m = r * (F v) (double accumulation, as the CPU reference),
// the pre/post/comb split with Sinkhorn normalisation, and u = sum_s pre_s X_s; HCPost = the
// new stream state. Launchers: ds4_kernels.h. Element-wise sums and products use round-to-nearest
// intrinsics in the CPU's order (no FMA contraction), so they repeat the CPU's f32 arithmetic;
// exp differs from glibc's by at most an ulp or two.
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <string>

#include "backend/cuda/ds4_kernels.h"
#include "core/error.h"

namespace fathom::cuda::ds4 {
namespace {

constexpr int kMixThreads = 256, kApplyThreads = 256, kMaxHc = 5;

__device__ __forceinline__ double block_sum_d(double v, double *red) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (lane == 0) red[warp] = v;
    __syncthreads();
    double t = 0;
    if (threadIdx.x == 0)
        for (int w = 0; w < static_cast<int>(blockDim.x >> 5); ++w) t += red[w];
    return t;  // valid in thread 0
}

// Blocks b < n_mix: mix[b] = fn row b . v (double sum, rounded once); block n_mix: mix[n_mix] = r =
// 1 / sqrt(mean(v^2) + eps).
template <bool F16>
__global__ void __launch_bounds__(kMixThreads)
    hc_mix_kernel(const uint8_t *__restrict__ fn, size_t row_bytes, const float *__restrict__ x, int64_t n,
                  int n_mix, float rms_eps, float *mix) {
    __shared__ double red[kMixThreads / 32];
    const int b = blockIdx.x;
    double acc = 0;
    if (b < n_mix) {
        const uint8_t *row = fn + static_cast<size_t>(b) * row_bytes;
        for (int64_t i = threadIdx.x; i < n; i += kMixThreads) {
            float w;
            if constexpr (F16)
                w = __half2float(reinterpret_cast<const __half *>(row)[i]);
            else
                w = reinterpret_cast<const float *>(row)[i];
            acc += static_cast<double>(w) * static_cast<double>(x[i]);
        }
    } else {
        for (int64_t i = threadIdx.x; i < n; i += kMixThreads) acc += static_cast<double>(x[i]) * x[i];
    }
    const double t = block_sum_d(acc, red);
    if (threadIdx.x == 0)
        mix[b] = b < n_mix ? static_cast<float>(t)
                           : static_cast<float>(1.0 / sqrt(t / static_cast<double>(n) + static_cast<double>(rms_eps)));
}

__device__ __forceinline__ uint64_t globaltimer_ns() {
    uint64_t t;
    asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
    return t;
}

__device__ __forceinline__ float sigmoid_f(float x) {
    return __frcp_rn(__fadd_rn(1.0f, expf(-x)));
}

// Every block: warp 0 splits the mix and runs Sinkhorn into shared memory (lane l < n*n owns
// comb[l]; sums are read back in the CPU's index order), then the block writes its slice of u.
// Block 0 also writes post and comb.
__global__ void __launch_bounds__(kApplyThreads)
    hc_pre_apply_kernel(int n_hc, int64_t D, int iters, float eps, const float *__restrict__ mix,
                        const float *__restrict__ base, const float *__restrict__ scale, const float *__restrict__ x,
                        float *__restrict__ u, float *__restrict__ post, float *__restrict__ comb) {
    __shared__ float pre_s[kMaxHc], c[kMaxHc * kMaxHc];
    const int n = n_hc, nn = n * n, tid = threadIdx.x;
    if (tid < 32) {
        const float r = mix[(2 + n) * n];
        const int l = tid, j = l / n, k = l % n;
        if (l < n) {
            const float m = __fmul_rn(mix[l], r);
            pre_s[l] = __fadd_rn(sigmoid_f(__fadd_rn(__fmul_rn(m, scale[0]), base[l])), eps);
            if (blockIdx.x == 0) {
                const float mp = __fmul_rn(mix[n + l], r);
                post[l] = __fmul_rn(2.0f, sigmoid_f(__fadd_rn(__fmul_rn(mp, scale[1]), base[n + l])));
            }
        }
        float v = 0;
        if (l < nn) v = __fadd_rn(__fmul_rn(__fmul_rn(mix[2 * n + l], r), scale[2]), base[2 * n + l]);
        if (l < nn) c[l] = v;
        __syncwarp();
        // 1. row softmax, + eps
        if (l < nn) {
            float mx = c[j * n];
            for (int q = 1; q < n; ++q) mx = fmaxf(mx, c[j * n + q]);
            v = expf(__fsub_rn(v, mx));
        }
        __syncwarp();
        if (l < nn) c[l] = v;
        __syncwarp();
        auto row_sum = [&] {
            float s = 0;
            for (int q = 0; q < n; ++q) s = __fadd_rn(s, c[j * n + q]);
            return s;
        };
        auto col_sum = [&] {
            float s = 0;
            for (int q = 0; q < n; ++q) s = __fadd_rn(s, c[q * n + k]);
            return s;
        };
        if (l < nn) v = __fadd_rn(__fdiv_rn(v, row_sum()), eps);
        __syncwarp();
        if (l < nn) c[l] = v;
        __syncwarp();
        // 2. column normalise; 3. (iters - 1) rounds of row then column normalisation
        for (int it = 0; it < 2 * iters - 1; ++it) {
            const bool col = (it % 2) == 0;
            if (l < nn) v = __fdiv_rn(v, __fadd_rn(col ? col_sum() : row_sum(), eps));
            __syncwarp();
            if (l < nn) c[l] = v;
            __syncwarp();
        }
        if (blockIdx.x == 0 && l < nn) comb[l] = v;
    }
    __syncthreads();
    const int64_t i = static_cast<int64_t>(blockIdx.x) * kApplyThreads + tid;
    if (i >= D) return;
    float acc = 0;
    for (int s = 0; s < n; ++s) acc = __fadd_rn(acc, __fmul_rn(pre_s[s], x[s * D + i]));
    u[i] = acc;
}

// HC head (spec 3.4): pre_s = sigmoid(mix_s * r * scale[0] + base[s]) + eps; z = sum_s pre_s X_s.
__global__ void __launch_bounds__(kApplyThreads)
    hc_head_apply_kernel(int n, int64_t D, float eps, const float *__restrict__ mix, const float *__restrict__ base,
                         const float *__restrict__ scale, const float *__restrict__ x, float *__restrict__ z) {
    __shared__ float pre_s[kMaxHc];
    if (threadIdx.x < n) {
        const float m = __fmul_rn(mix[threadIdx.x], mix[n]);
        pre_s[threadIdx.x] = __fadd_rn(sigmoid_f(__fadd_rn(__fmul_rn(m, scale[0]), base[threadIdx.x])), eps);
    }
    __syncthreads();
    const int64_t i = static_cast<int64_t>(blockIdx.x) * kApplyThreads + threadIdx.x;
    if (i >= D) return;
    float acc = 0;
    for (int s = 0; s < n; ++s) acc = __fadd_rn(acc, __fmul_rn(pre_s[s], x[s * D + i]));
    z[i] = acc;
}

__global__ void hc_post_kernel(int n, int64_t D, const float *__restrict__ y, const float *__restrict__ x_old,
                               const float *__restrict__ post, const float *__restrict__ comb, float *__restrict__ x_new) {
    const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (idx >= n * D) return;
    const int k = static_cast<int>(idx / D);
    const int64_t i = idx % D;
    float acc = __fmul_rn(post[k], y[i]);
    for (int j = 0; j < n; ++j) acc = __fadd_rn(acc, __fmul_rn(comb[j * n + k], x_old[j * D + i]));
    x_new[idx] = acc;
}

__global__ void sleep_kernel(uint64_t ns) {
    const uint64_t t0 = globaltimer_ns();
    while (globaltimer_ns() - t0 < ns) __nanosleep(1000);
}

void check_launch(const char *what) {
    const cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) throw error(std::string("cuda ds4 ") + what + ": launch failed: " + cudaGetErrorString(e));
}

}  // namespace

void launch_hc_pre(const hc_params &p, dtype fn_type, const void *fn, size_t fn_row_bytes, const float *base,
                   const float *scale, const float *x, float *mix, float *u, float *post, float *comb,
                   cudaStream_t s) {
    if (p.n_hc < 1 || p.n_hc > kMaxHc || p.dim < 1 || p.sinkhorn_iters < 1)
        throw error("cuda ds4 hc_pre: unsupported n_hc " + std::to_string(p.n_hc) + " (1..5), dim " +
                    std::to_string(p.dim) + ", sinkhorn iterations " + std::to_string(p.sinkhorn_iters));
    if (fn_type != dtype::f32 && fn_type != dtype::f16)
        throw error("cuda ds4 hc_pre: mixer weight type " + std::string(dtype_name(fn_type)) +
                    " unsupported (f32 or f16)");
    const int64_t n = static_cast<int64_t>(p.n_hc) * p.dim;
    if (fn_row_bytes < dtype_row_bytes(fn_type, n) || fn_row_bytes % (fn_type == dtype::f32 ? 4 : 2) != 0)
        throw error("cuda ds4 hc_pre: mixer row stride too small or misaligned");
    const int n_mix = (2 + p.n_hc) * p.n_hc;
    const auto *w = static_cast<const uint8_t *>(fn);
    if (fn_type == dtype::f16)
        hc_mix_kernel<true><<<n_mix + 1, kMixThreads, 0, s>>>(w, fn_row_bytes, x, n, n_mix, p.rms_eps, mix);
    else
        hc_mix_kernel<false><<<n_mix + 1, kMixThreads, 0, s>>>(w, fn_row_bytes, x, n, n_mix, p.rms_eps, mix);
    check_launch("hc mix");
    const unsigned blocks = static_cast<unsigned>((p.dim + kApplyThreads - 1) / kApplyThreads);
    hc_pre_apply_kernel<<<blocks, kApplyThreads, 0, s>>>(p.n_hc, p.dim, p.sinkhorn_iters, p.hc_eps, mix, base, scale,
                                                         x, u, post, comb);
    check_launch("hc pre");
}

void launch_hc_head(const hc_params &p, dtype fn_type, const void *fn, size_t fn_row_bytes, const float *base,
                    const float *scale, const float *x, float *mix, float *z, cudaStream_t s) {
    if (p.n_hc < 1 || p.n_hc > kMaxHc || p.dim < 1)
        throw error("cuda ds4 hc_head: unsupported n_hc " + std::to_string(p.n_hc) + " (1..5) or dim " +
                    std::to_string(p.dim));
    if (fn_type != dtype::f32 && fn_type != dtype::f16)
        throw error("cuda ds4 hc_head: mixer weight type " + std::string(dtype_name(fn_type)) +
                    " unsupported (f32 or f16)");
    const int64_t n = static_cast<int64_t>(p.n_hc) * p.dim;
    if (fn_row_bytes < dtype_row_bytes(fn_type, n) || fn_row_bytes % (fn_type == dtype::f32 ? 4 : 2) != 0)
        throw error("cuda ds4 hc_head: mixer row stride too small or misaligned");
    const auto *w = static_cast<const uint8_t *>(fn);
    if (fn_type == dtype::f16)
        hc_mix_kernel<true><<<p.n_hc + 1, kMixThreads, 0, s>>>(w, fn_row_bytes, x, n, p.n_hc, p.rms_eps, mix);
    else
        hc_mix_kernel<false><<<p.n_hc + 1, kMixThreads, 0, s>>>(w, fn_row_bytes, x, n, p.n_hc, p.rms_eps, mix);
    check_launch("hc head mix");
    const unsigned blocks = static_cast<unsigned>((p.dim + kApplyThreads - 1) / kApplyThreads);
    hc_head_apply_kernel<<<blocks, kApplyThreads, 0, s>>>(p.n_hc, p.dim, p.hc_eps, mix, base, scale, x, z);
    check_launch("hc head");
}

void launch_hc_post(int n_hc, int64_t dim, const float *y, const float *x_old, const float *post,
                    const float *comb, float *x_new, cudaStream_t s) {
    if (n_hc < 1 || n_hc > kMaxHc || dim < 1) throw error("cuda ds4 hc_post: unsupported n_hc " + std::to_string(n_hc));
    const int64_t total = n_hc * dim;
    hc_post_kernel<<<static_cast<unsigned>((total + 255) / 256), 256, 0, s>>>(n_hc, dim, y, x_old, post, comb, x_new);
    check_launch("hc post");
}

void launch_gpu_sleep(uint64_t ns, cudaStream_t s) {
    sleep_kernel<<<1, 1, 0, s>>>(ns);
    check_launch("sleep");
}

}  // namespace fathom::cuda::ds4
