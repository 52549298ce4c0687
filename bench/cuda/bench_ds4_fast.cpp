// Kernel benchmarks of bench_cuda_kernels (bench_cuda_kernels.cpp): hc_pre at D 4096 and the indexer top-k at
// 2048 / 8192 / 32768 rows by graph replay; the kernels' tests: tests/backend/cuda/test_cuda_ds4_fast.cpp.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "backend/cpu/quants.h"
#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/ds4_attn_kernels.h"
#include "backend/cuda/ds4_kernels.h"
#include "core/error.h"
#include "models/deepseek4_impl.h"
#include "models/deepseek4_ops.h"

#include "backend/cuda/ds4_fast_fixture.h"

namespace fathom {
namespace {

using namespace cuda_test::ds4_fast_suite;
namespace cd = cuda::ds4;
using cuda_test::randn;
using cuda_test::rel_l2;
using cuda_test::time_graph;

// hc_pre at DS4-Flash geometry (D 4096, n_hc 4, f16 fn [24, 16384]): 96 calls per graph, each with its
// own mixer (75 MB in all: past the L2, as the 43 layers' mixers are in the model); bytes = fn + X.
TEST_F(CudaDs4Fast, BenchHcPre) {
    int dev_id = 0;
    cudaGetDevice(&dev_id);
    const double copy_bw = cuda_measure_copy_bandwidth(dev_id);
    const int n = 4, n_mix = (2 + n) * n, calls = 96, reps = 15;
    const int64_t D = 4096, S = n * D;
    const size_t rb = dtype_row_bytes(dtype::f16, S), fn_bytes = rb * n_mix;
    auto *fn = static_cast<uint8_t *>(raw(fn_bytes * calls));
    std::vector<uint16_t> h(static_cast<size_t>(S) * n_mix);
    for (auto &v : h) v = cpu::f32_to_f16(std::normal_distribution<float>(0.0f, 0.01f)(rng_));
    for (int c = 0; c < calls; ++c) cudaMemcpy(fn + fn_bytes * c, h.data(), fn_bytes, cudaMemcpyHostToDevice);
    const float *x = up(randn(static_cast<size_t>(S), rng_)), *base = up(randn(n_mix, rng_, 0.5f)),
                *scale = up(randn(3, rng_));
    float *mix = dev<float>(n_mix + 1), *u = dev<float>(D), *post = dev<float>(n), *comb = dev<float>(n * n);
    const cd::hc_params p{n, D, 20, 1e-6f, 1e-6f};
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    CK(cudaStreamSynchronize(s_));
    CK(cudaStreamBeginCapture(s_, cudaStreamCaptureModeThreadLocal));
    for (int c = 0; c < calls; ++c)
        cd::launch_hc_pre(p, dtype::f16, fn + fn_bytes * c, rb, base, scale, x, mix, u, post, comb, s_);
    CK(cudaStreamEndCapture(s_, &graph));
    CK(cudaGraphInstantiate(&exec, graph, 0));
    const float ms = time_graph(exec, s_, reps);
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
    const double us = ms * 1e3 / calls, bytes = static_cast<double>(fn_bytes) + 4.0 * S;
    const double bw = bytes / (us * 1e-6);
    std::printf("  hc_pre D 4096 n_hc 4 f16: %.2f us per call, %.2f MB, %.1f GB/s (%.1f%% of copy %.1f GB/s)\n", us,
                bytes / 1e6, bw / 1e9, 100.0 * bw / copy_bw, copy_bw / 1e9);
}

// Indexer top-k (64 heads x 128, f16 rows, top-512) at 2048 / 8192 / 32768 visible rows (8K, 32K,
// 128K context), the row count read from the device position; 16 calls per graph, each over its own
// row buffer (the layers' rows are not L2-resident in the model); bytes = rows + scores.
TEST_F(CudaDs4Fast, BenchIndexerTopk) {
    int dev_id = 0;
    cudaGetDevice(&dev_id);
    const double copy_bw = cuda_measure_copy_bandwidth(dev_id);
    const int H = 64, Dh = 128, topk = 512, calls = 16, reps = 15;
    const float w_scale = static_cast<float>(1.0 / std::sqrt(128.0 * 64.0));
    for (int64_t n : {int64_t{2048}, int64_t{8192}, int64_t{32768}}) {
        const size_t row_bytes = static_cast<size_t>(n) * Dh * 2;
        std::vector<uint16_t> hr(static_cast<size_t>(n) * Dh);
        for (auto &v : hr) v = cpu::f32_to_f16(std::normal_distribution<float>(0.0f, 1.0f)(rng_));
        std::vector<void *> rows(calls);
        for (auto &r : rows) {
            r = raw(row_bytes);
            cudaMemcpy(r, hr.data(), row_bytes, cudaMemcpyHostToDevice);
        }
        const float *q = up(randn(static_cast<size_t>(H * Dh), rng_)), *w = up(randn(H, rng_));
        float *score = dev<float>(static_cast<size_t>(n));
        int32_t *sel = dev<int32_t>(topk), *n_sel = dev<int32_t>(1);
        set_pos(n * 4 - 1);
        cudaGraph_t graph;
        cudaGraphExec_t exec;
        CK(cudaStreamSynchronize(s_));
        CK(cudaStreamBeginCapture(s_, cudaStreamCaptureModeThreadLocal));
        for (int c = 0; c < calls; ++c)
            cd::launch_indexer_topk(q, w, w_scale, rows[static_cast<size_t>(c)], true, Dh * 2, 4, n, H, Dh, topk,
                                    pos_, score, sel, n_sel, s_);
        CK(cudaStreamEndCapture(s_, &graph));
        CK(cudaGraphInstantiate(&exec, graph, 0));
        const float ms = time_graph(exec, s_, reps);
        cudaGraphExecDestroy(exec);
        cudaGraphDestroy(graph);
        ASSERT_EQ(down(n_sel, 1)[0], topk);
        const double us = ms * 1e3 / calls, bytes = static_cast<double>(row_bytes) + 8.0 * n;
        const double bw = bytes / (us * 1e-6);
        std::printf("  indexer_topk n %6lld (64 x 128 f16, top-512): %7.2f us per call, %6.1f GB/s (%.1f%% of copy)\n",
                    static_cast<long long>(n), us, bw / 1e9, 100.0 * bw / copy_bw);
        for (void *r : rows) {
            auto it = std::find(bufs_.begin(), bufs_.end(), r);
            cudaFree(*it);
            bufs_.erase(it);
        }
    }
}

}  // namespace
}  // namespace fathom
