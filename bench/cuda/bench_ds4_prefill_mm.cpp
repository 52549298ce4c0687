// Kernel benchmarks of bench_cuda_kernels (bench_cuda_kernels.cpp): the DS4 prefill MoE on one chunk; the
// kernels' tests: tests/backend/cuda/test_cuda_ds4_prefill_mm.cpp.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "backend/cpu/quants.h"
#include "backend/cuda/ds4_gemv.h"
#include "backend/cuda/ds4_kernels.h"
#include "backend/cuda/ds4_prefill.h"
#include "core/error.h"
#include "models/deepseek4_impl.h"

#include "backend/cuda/ds4_prefill_mm_fixture.h"

namespace fathom {
namespace {

using namespace cuda_test::ds4_prefill_mm_suite;
namespace cd = cuda::ds4;
using cuda_test::randn;
using cuda_test::rel_l2;

// moe_prefill at the DS4-Flash shape (D 4096, F 2048, 256 experts, 6 used, iq2_xxs gate/up, q2_k down,
// q8_0 shared expert, f32 router, biased routing) and a dense q8_0 (repacked) [8192, 4096] product, per
// chunk size: wall time of one call (the MoE includes its host synchronisation). Weights are random
// bytes (timing only: their values may be NaN).
TEST_F(CudaDs4PrefillMm, BenchMoeFlashChunk) {
    const int64_t D = 4096, F = 2048;
    const int E = 256, k = 6;
    uint64_t seed = 1;
    auto bank = [&](dtype t, int64_t rows, int64_t cols, int64_t n) { return random_bank(t, rows, cols, n, seed++); };
    cd::moe_layer l;
    const auto router = randn(static_cast<size_t>(E * D), rng_, 2.0f / std::sqrt(static_cast<float>(D)));
    l.gate_inp_type = dtype::f32;
    l.gate_inp = up(router);
    l.gate_inp_row_bytes = static_cast<size_t>(D) * 4;
    l.exp_bias = up(std::vector<float>(static_cast<size_t>(E), 0.0f));
    l.n_expert = E;
    l.n_used = k;
    l.weights_scale = 1.5f;
    l.clamp = 10.0f;
    l.clamp_sh = 10.0f;
    l.gate = bank(dtype::iq2_xxs, F, D, E);
    l.up = bank(dtype::iq2_xxs, F, D, E);
    l.down = bank(dtype::q2_k, D, F, E);
    l.gate_sh = bank(dtype::q8_0, F, D, 1);
    l.up_sh = bank(dtype::q8_0, F, D, 1);
    l.down_sh = bank(dtype::q8_0, D, F, 1);
    const int64_t max_tok = 4096;
    cd::gemm_runner g(s_, static_cast<size_t>(max_tok * D));
    cd::moe_prefill moe(g, max_tok, D, F, E, k);
    const auto x = randn(static_cast<size_t>(max_tok * D), rng_);
    float *xd = up(x), *yd = dev<float>(static_cast<size_t>(max_tok * D));
    int32_t *td = dev<int32_t>(static_cast<size_t>(max_tok));
    std::printf("  moe_prefill scratch %.2f GB\n", static_cast<double>(moe.scratch_bytes()) / 1e9);
    // dense: q8_0 [8192, 4096] repacked (as the decode GEMV keeps it)
    const int64_t rows = 8192;
    const cd::expert_bank dq = bank(dtype::q8_0, rows, D, 1);
    void *rp = raw(cd::gemv_prepared_bytes(dtype::q8_0, rows, D));
    cd::gemv_weight fast = cd::gemv_prepare(dtype::q8_0, dq.data, dq.row_bytes, rows, D, rp, s_);
    cd::gemm_weight w;
    w.type = dtype::q8_0;
    w.fast = &fast;
    w.rows = rows;
    w.cols = D;
    float *yw = dev<float>(static_cast<size_t>(max_tok * rows));
    ASSERT_EQ(cudaStreamSynchronize(s_), cudaSuccess);
    for (int64_t n_tok : {256, 1024, 4096}) {
        auto time_ms = [&](auto &&fn) {
            fn();
            cudaStreamSynchronize(s_);
            const auto t0 = std::chrono::steady_clock::now();
            const int reps = 5;
            for (int i = 0; i < reps; ++i) fn();
            cudaStreamSynchronize(s_);
            return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count() / reps;
        };
        const double ms = time_ms([&] { moe.forward(l, xd, td, n_tok, yd, err_); });
        const double mw = time_ms([&] { g.matmul(w, xd, D, n_tok, yw, rows); });
        const double flop = 2.0 * static_cast<double>(n_tok) * (k + 1) * 3 * static_cast<double>(D * F);
        std::printf("  n_tok %4lld: moe_prefill %.2f ms (%.0f tok/s per layer, %.0f TFLOP/s useful); dense q8_0 "
                    "[8192, 4096] %.3f ms (%.0f TFLOP/s)\n",
                    static_cast<long long>(n_tok), ms, n_tok / ms * 1e3, flop / ms / 1e9,
                    mw, 2.0 * n_tok * rows * D / mw / 1e9);
    }
    // the MoE's parts: dequantising 16 experts (gate|up iq2_xxs, down q2_k) and one expert's GEMMs
    // at the mean load of a 4096-token chunk (96 rows)
    {
        auto time_ms = [&](auto &&fn) {
            fn();
            cudaStreamSynchronize(s_);
            const auto t0 = std::chrono::steady_clock::now();
            for (int i = 0; i < 5; ++i) fn();
            cudaStreamSynchronize(s_);
            return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count() / 5;
        };
        std::vector<int32_t> ids(16);
        std::iota(ids.begin(), ids.end(), 0);
        auto *wb = dev<uint16_t>(static_cast<size_t>(16 * 2 * F * D));
        auto *xb = dev<uint16_t>(static_cast<size_t>(96 * D));
        float *gv = dev<float>(static_cast<size_t>(96 * 2 * F));
        const cd::expert_bank gu[2] = {l.gate, l.up};
        const double t_gu = time_ms([&] { g.dequant_experts_bf16(gu, 2, ids.data(), 16, wb); });
        const double t_dn = time_ms([&] { g.dequant_experts_bf16(&l.down, 1, ids.data(), 16, wb); });
        const double t_g1 = time_ms([&] { g.gemm_bf16(wb, D, 2 * F, D, xb, D, 96, gv, 2 * F); });
        const double t_g2 = time_ms([&] { g.gemm_bf16(wb, F, D, F, xb, F, 96, gv, D); });
        std::printf("  16 experts: dequantise gate|up %.3f ms (%.0f GB/s written), down %.3f ms; one expert at 96 "
                    "rows: gate|up GEMM %.3f ms, down GEMM %.3f ms\n",
                    t_gu, 16.0 * 2 * F * D * 2 / t_gu / 1e6, t_dn, t_g1, t_g2);
    }
    EXPECT_EQ(cudaGetLastError(), cudaSuccess);
}

}  // namespace
}  // namespace fathom
