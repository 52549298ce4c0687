// Kernel benchmarks of bench_cuda_kernels (bench_cuda_kernels.cpp): direct vs staged MoE expert kernels per
// layer-token; the kernels' tests: tests/backend/cuda/test_cuda_ds4_moe_staged.cpp.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include <cuda_runtime_api.h>

#include "backend/cpu/quants.h"
#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/ds4_kernels.h"
#include "backend/cuda/ds4_kernels_testing.h"
#include "core/error.h"

#include "backend/cuda/ds4_moe_staged_fixture.h"

namespace fathom {
namespace {

using namespace cuda_test::ds4_moe_staged_suite;
namespace cd = cuda::ds4;
using cuda_test::randn;
using cuda_test::time_graph;

// Direct (mode 0) vs staged (mode 1) per layer-token at the DS4-Flash shape, in graphs of T tokens
// rotating over L = 8 layers with distinct banks (8 x 44 MB of gate/up weights touched per rotation:
// the 60 MB L2 cannot keep a layer's experts between its tokens). Reported: the whole launch_moe_ffn
// chain (learned routing, f16 router), and the routed-only gate/up (launch_moe_gate_up, ids fixed per
// token, 6 distinct experts) with its HBM rate.
TEST_F(CudaDs4MoeStaged, BenchStagedGateUp) {
    const int64_t D = 4096, F = 2048;
    const int E = 256, k = 6, L = 8, T = 64, reps = 9;
    std::vector<cd::moe_layer> layers;  // banks of random words (timing only: scales may be NaN)
    for (int i = 0; i < L; ++i)
        layers.push_back(cuda_test::random_q2_moe_layer(*this, rng_, D, F, E, k, 100 + 10 * static_cast<uint64_t>(i)));
    const cd::moe_scratch sc = dev_moe_scratch(E, k, F);
    float *x_d = up(randn(static_cast<size_t>(T * D), rng_));
    float *y_d = dev<float>(static_cast<size_t>(T * D));
    int32_t *tok = dev<int32_t>(1);
    std::vector<int32_t> ids(static_cast<size_t>(T * k));
    for (int t = 0; t < T; ++t) {
        std::vector<int32_t> p(static_cast<size_t>(E));
        std::iota(p.begin(), p.end(), 0);
        std::shuffle(p.begin(), p.end(), rng_);
        std::copy(p.begin(), p.begin() + k, ids.begin() + t * k);
    }
    const int32_t *ids_d = up(ids);
    const float *w_d = up(randn(static_cast<size_t>(T * k), rng_, 0.3f));
    CK(cudaStreamSynchronize(s_));
    // us per token of a graph of T captured calls of fn(t) in `mode`
    auto time_us = [&](int mode, auto &&fn) {
        cd::set_moe_staged(mode);
        cudaGraph_t graph;
        cudaGraphExec_t exec;
        float ms = -1.0f;
        if (cudaStreamBeginCapture(s_, cudaStreamCaptureModeThreadLocal) != cudaSuccess) return -1.0;
        for (int t = 0; t < T; ++t) fn(t);
        if (cudaStreamEndCapture(s_, &graph) != cudaSuccess) return -1.0;
        if (cudaGraphInstantiate(&exec, graph, 0) == cudaSuccess) {
            ms = time_graph(exec, s_, reps);
            cudaGraphExecDestroy(exec);
        }
        cudaGraphDestroy(graph);
        cudaStreamSynchronize(s_);
        return static_cast<double>(ms) * 1e3 / T;
    };
    auto ffn = [&](int t) {
        cd::launch_moe_ffn(layers[static_cast<size_t>(t % L)], x_d + static_cast<size_t>(t) * D, tok, sc,
                           y_d + static_cast<size_t>(t) * D, err_, s_);
    };
    auto gate_up = [&](int t) {
        const auto &l = layers[static_cast<size_t>(t % L)];
        cd::launch_moe_gate_up(l.gate, l.up, ids_d + t * k, w_d + t * k, k, 0, x_d + static_cast<size_t>(t) * D,
                               l.clamp, sc.h, err_, s_);
    };
    const double f0 = time_us(0, ffn), f1 = time_us(1, ffn);
    const double g0 = time_us(0, gate_up), g1 = time_us(1, gate_up);
    ASSERT_GT(f0, 0.0);
    ASSERT_GT(f1, 0.0);
    ASSERT_GT(g0, 0.0);
    ASSERT_GT(g1, 0.0);
    ASSERT_EQ(take_err(), 0u);
    const double routed_bytes = 2.0 * static_cast<double>(layers[0].gate.expert_bytes) * k;
    std::printf("  launch_moe_ffn DS4-Flash (%d layers rotated): direct %.2f us/token, staged %.2f us/token\n", L, f0,
                f1);
    std::printf("  routed gate/up only (6 x iq2_xxs gate+up, %.1f MB): direct %.2f us (%.0f GB/s), staged %.2f us "
                "(%.0f GB/s)\n",
                routed_bytes / 1e6, g0, routed_bytes / (g0 * 1e3), g1, routed_bytes / (g1 * 1e3));
}

}  // namespace
}  // namespace fathom
