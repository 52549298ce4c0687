// Kernel benchmarks of bench_cuda_kernels (bench_cuda_kernels.cpp): the DS4 expert GEMVs, the whole
// launch_moe_ffn and the indexer at DS4-Flash shapes, bandwidth vs the device copy rate; the kernels' tests:
// tests/backend/cuda/test_cuda_ds4.cpp.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include <cuda_runtime_api.h>

#include "backend/cpu/iq_tables.h"
#include "backend/cpu/quants.h"
#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/cuda_kernels.h"
#include "backend/cuda/ds4_gemv.h"
#include "backend/cuda/ds4_kernels.h"
#include "backend/cuda/ds4_prefill.h"
#include "backend/cuda/ds4_quant.cuh"
#include "core/error.h"
#include "models/deepseek4_impl.h"

#include "backend/cuda/ds4_fixture.h"

namespace fathom {
namespace {

using namespace cuda_test::ds4_suite;
namespace cd = cuda::ds4;
using cuda_test::randn;
using cuda_test::rel_l2;
using cuda_test::time_graph;

// DS4-Flash expert geometry (D 4096, F 2048, 256 experts, 6 routed + 1 shared) with random weight
// bytes generated on the device. T tokens, each with its own random expert set, are captured into one
// graph (so the 6 experts of consecutive tokens differ and the ~2 GB banks stream from HBM, not L2);
// bytes/token = 6 routed experts (gate + up + down) + the shared expert.
TEST_F(CudaDs4, BenchExpertGemvBandwidth) {
    const int64_t D = 4096, F = 2048;
    const int E = 256, k = 6, T = 64, reps = 9;
    int dev_id = 0;
    cudaGetDevice(&dev_id);
    const double copy_bw = cuda_measure_copy_bandwidth(dev_id);
    std::printf("  device copy bandwidth (D2D 1 GiB, read + write): %.1f GB/s\n", copy_bw / 1e9);
    struct mix_t {
        const char *name;
        dtype gu, dn, sh;
    };
    const mix_t mixes[] = {{"q2 (iq2_xxs gate/up, q2_k down, q8_0 shared)", dtype::iq2_xxs, dtype::q2_k, dtype::q8_0},
                           {"q2k (q2_k experts, q8_0 shared)", dtype::q2_k, dtype::q2_k, dtype::q8_0},
                           {"mxfp4 (mxfp4 experts, q8_0 shared)", dtype::mxfp4, dtype::mxfp4, dtype::q8_0},
                           {"q4k (q4_k gate/up, q6_k down, q4_k shared)", dtype::q4_k, dtype::q6_k, dtype::q4_k},
                           {"q3k (q3_k gate/up, q5_k down, q3_k shared)", dtype::q3_k, dtype::q5_k, dtype::q3_k}};
    std::vector<int32_t> ids(static_cast<size_t>(T * k));
    for (int t = 0; t < T; ++t) {
        std::vector<int32_t> p(E);
        std::iota(p.begin(), p.end(), 0);
        std::shuffle(p.begin(), p.end(), rng_);
        std::copy(p.begin(), p.begin() + k, ids.begin() + t * k);
    }
    int32_t *ids_d = up(ids);
    float *w_d = up(randn(static_cast<size_t>(T * k), rng_, 0.3f));
    float *x_d = up(randn(static_cast<size_t>(D), rng_));
    float *h_d = dev<float>(static_cast<size_t>(T * (k + 1) * F));
    float *y_d = dev<float>(static_cast<size_t>(T * D));
    std::printf("  %-46s %10s %10s %9s %7s | %s\n", "mix", "MB/token", "us/token", "GB/s", "%copy",
                "gate+up routed / down routed (GB/s)");
    for (const mix_t &mx : mixes) {
        const auto g = random_bank(mx.gu, F, D, E, 1), u = random_bank(mx.gu, F, D, E, 2),
                   dn = random_bank(mx.dn, D, F, E, 3);
        const auto gs = random_bank(mx.sh, F, D, 1, 4), us = random_bank(mx.sh, F, D, 1, 5),
                   ds = random_bank(mx.sh, D, F, 1, 6);
        CK(cudaStreamSynchronize(s_));
        // part 0: whole MoE expert work; 1: routed gate/up only; 2: routed down only
        float ms[3];
        for (int part = 0; part < 3; ++part) {
            cudaGraph_t graph;
            cudaGraphExec_t exec;
            CK(cudaStreamBeginCapture(s_, cudaStreamCaptureModeThreadLocal));
            for (int t = 0; t < T; ++t) {
                const int32_t *it = ids_d + t * k;
                float *ht = h_d + static_cast<size_t>(t) * (k + 1) * F, *yt = y_d + static_cast<size_t>(t) * D;
                if (part != 2) cd::launch_moe_gate_up(g, u, it, w_d + t * k, k, 0, x_d, 10.0f, ht, err_, s_);
                if (part == 0) cd::launch_moe_gate_up(gs, us, nullptr, nullptr, 1, k, x_d, 10.0f, ht, err_, s_);
                if (part != 1) cd::launch_moe_down(dn, it, k, 0, ht, false, yt, err_, s_);
                if (part == 0) cd::launch_moe_down(ds, nullptr, 1, k, ht, true, yt, err_, s_);
            }
            CK(cudaStreamEndCapture(s_, &graph));
            CK(cudaGraphInstantiate(&exec, graph, 0));
            ms[part] = time_graph(exec, s_, reps);
            cudaGraphExecDestroy(exec);
            cudaGraphDestroy(graph);
        }
        CK(cudaStreamSynchronize(s_));
        ASSERT_EQ(take_err(), 0u);
        const double gu_bytes = 2.0 * static_cast<double>(g.expert_bytes) * k, dn_bytes = static_cast<double>(dn.expert_bytes) * k;
        const double sh_bytes = static_cast<double>(gs.expert_bytes + us.expert_bytes + ds.expert_bytes);
        const double bytes = gu_bytes + dn_bytes + sh_bytes;
        const double us_tok = ms[0] * 1e3 / T;
        const double bw = bytes / (us_tok * 1e-6);
        const double bw_gu = gu_bytes / (ms[1] * 1e-3 / T), bw_dn = dn_bytes / (ms[2] * 1e-3 / T);
        std::printf("  %-46s %10.2f %10.2f %9.1f %6.1f%% | %.1f / %.1f\n", mx.name, bytes / 1e6, us_tok, bw / 1e9,
                    100.0 * bw / copy_bw, bw_gu / 1e9, bw_dn / 1e9);
        for (const auto *b : {&g, &u, &dn, &gs, &us, &ds}) {
            auto it = std::find(bufs_.begin(), bufs_.end(), b->data);
            cudaFree(*it);
            bufs_.erase(it);
        }
    }
}

// The whole launch_moe_ffn (f16 router GEMV [256, 4096], biased top-6 routing, 6 routed experts +
// the q8_0 shared expert) at the DS4-Flash geometry, per token: T tokens with their own random
// activations (so their routes, and the experts streamed from HBM, differ) captured into one graph.
// Bytes/token = router + 6 routed experts (gate + up + down) + the shared expert.
TEST_F(CudaDs4, BenchMoeFfnPerToken) {
    const int64_t D = 4096, F = 2048;
    const int E = 256, k = 6, T = 64, reps = 9;
    int dev_id = 0;
    cudaGetDevice(&dev_id);
    const double copy_bw = cuda_measure_copy_bandwidth(dev_id);
    const cd::moe_layer l = cuda_test::random_q2_moe_layer(*this, rng_, D, F, E, k, 10);
    const cd::moe_scratch sc = dev_moe_scratch(E, k, F);
    float *x_d = up(randn(static_cast<size_t>(T * D), rng_));
    float *y_d = dev<float>(static_cast<size_t>(T * D));
    int32_t *tok = dev<int32_t>(1);
    CK(cudaStreamSynchronize(s_));
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    CK(cudaStreamBeginCapture(s_, cudaStreamCaptureModeThreadLocal));
    for (int t = 0; t < T; ++t)
        cd::launch_moe_ffn(l, x_d + static_cast<size_t>(t) * D, tok, sc, y_d + static_cast<size_t>(t) * D, err_, s_);
    CK(cudaStreamEndCapture(s_, &graph));
    CK(cudaGraphInstantiate(&exec, graph, 0));
    const float ms = time_graph(exec, s_, reps);
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
    CK(cudaStreamSynchronize(s_));
    ASSERT_EQ(take_err(), 0u);
    const double bytes = static_cast<double>(l.gate_inp_row_bytes) * E +
                         static_cast<double>(l.gate.expert_bytes + l.up.expert_bytes + l.down.expert_bytes) * k +
                         static_cast<double>(l.gate_sh.expert_bytes + l.up_sh.expert_bytes + l.down_sh.expert_bytes);
    const double us_tok = ms * 1e3 / T, bw = bytes / (us_tok * 1e-6);
    std::printf("  launch_moe_ffn DS4-Flash q2 mix (f16 router, 6 x iq2_xxs/q2_k, q8_0 shared): %.2f MB/token, "
                "%.2f us/token, %.1f GB/s, %.1f%% of copy bandwidth (%.1f GB/s)\n",
                bytes / 1e6, us_tok, bw / 1e9, 100.0 * bw / copy_bw, copy_bw / 1e9);
    // The serial front of the chain alone: router GEMV (the fast GEMV launch_moe_ffn uses for f16) +
    // route, per token. In the whole chain the gate/up kernel overlaps the route (PDL).
    CK(cudaStreamBeginCapture(s_, cudaStreamCaptureModeThreadLocal));
    const cd::gemv_weight rw = cd::gemv_prepare(dtype::f16, l.gate_inp, l.gate_inp_row_bytes, E, D, nullptr, s_);
    for (int t = 0; t < T; ++t) {
        cd::launch_gemv_fast(rw, x_d + static_cast<size_t>(t) * D, sc.logits, s_);
        cd::launch_moe_route(sc.logits, E, l.exp_bias, nullptr, 0, tok, k, l.weights_scale, sc.ids, sc.weights, err_, s_);
    }
    CK(cudaStreamEndCapture(s_, &graph));
    CK(cudaGraphInstantiate(&exec, graph, 0));
    const float ms_front = time_graph(exec, s_, reps);
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
    CK(cudaStreamSynchronize(s_));
    ASSERT_EQ(take_err(), 0u);
    std::printf("  of which router GEMV f16 [256, 4096] + route alone: %.2f us/token\n", ms_front * 1e3 / T);
}

TEST_F(CudaDs4, BenchIndexerSelect128K) {
    const int reps = 9;
    // Indexer at 128K context (32768 compressed rows of 128 f16, 64 heads, top-512), 16 per graph.
    const int64_t n = 32768;
    const int H = 64, Dh = 128, reps_i = 16;
    void *rows = raw(static_cast<size_t>(n * Dh * 2));
    std::vector<uint16_t> hr(static_cast<size_t>(n * Dh));
    for (auto &v : hr) v = cpu::f32_to_f16(std::normal_distribution<float>(0.0f, 1.0f)(rng_));
    cudaMemcpy(rows, hr.data(), hr.size() * 2, cudaMemcpyHostToDevice);
    float *qd = up(randn(static_cast<size_t>(H * Dh), rng_)), *wd = up(randn(H, rng_, 0.011f));
    float *sc = dev<float>(static_cast<size_t>(n));
    int32_t *out = dev<int32_t>(512);
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    CK(cudaStreamBeginCapture(s_, cudaStreamCaptureModeThreadLocal));
    for (int i = 0; i < reps_i; ++i) cd::launch_indexer_select(qd, wd, rows, true, Dh * 2, n, H, Dh, 512, sc, out, s_);
    CK(cudaStreamEndCapture(s_, &graph));
    CK(cudaGraphInstantiate(&exec, graph, 0));
    const float ms = time_graph(exec, s_, reps);
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
    std::printf("  indexer n=%lld (128K ctx), 64 heads x 128, top-512: %.1f us per call\n", static_cast<long long>(n),
                ms * 1e3 / reps_i);
}

}  // namespace
}  // namespace fathom
