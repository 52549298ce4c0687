// Kernel benchmarks of bench_cuda_kernels (bench_cuda_kernels.cpp): the DS4 attention-sublayer decode kernels
// at DS4-Flash shapes by graph replay; the kernels' tests: tests/backend/cuda/test_cuda_ds4_attn.cpp.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "backend/cpu/quants.h"
#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/cuda_device.h"
#include "backend/cuda/ds4_attn_kernels.h"
#include "core/error.h"
#include "models/deepseek4_impl.h"
#include "models/deepseek4_qat.h"

#include "backend/cuda/ds4_attn_fixture.h"
#include "attn_bench.h"

namespace fathom {
namespace {

using namespace cuda_test::ds4_attn_suite;
namespace cd = cuda::ds4;
using cuda_test::randn;
using cuda_test::rel_l2;

// The per-call cost of each attention-path kernel at DS4-Flash shapes: `calls` launches captured into one
// graph (as the 43 layers are in the model's step graph, so the per-node cost is included), the position
// read from device memory as in the model; microseconds per call and the bytes a call must move, as GB/s
// and % of the device copy rate (most of these are latency-bound: the microseconds are the measure).
class CudaDs4AttnBench : public CudaDs4Attn {
  protected:
    void SetUp() override {
        CudaDs4Attn::SetUp();
        if (IsSkipped() || HasFatalFailure()) return;
        int dev_id = 0;
        cudaGetDevice(&dev_id);
        copy_bw_ = cuda_measure_copy_bandwidth(dev_id);
    }
    // Captures `calls` enqueue(c) into a graph, replays it at position pos; prints one line.
    template <class F>
    void time_calls(const char *what, int calls, int64_t pos, double bytes, double target_us, F enqueue) {
        set_pos(pos);
        float ms = 0;
        cuda_test::attn_bench_time(s_, calls, enqueue, ms);
        if (HasFatalFailure()) return;
        const double us = ms * 1e3 / calls, bw = bytes / (us * 1e-6);
        std::printf("  %-58s %7.2f us/call (target <= %4.1f)  %7.3f MB  %7.1f GB/s (%4.1f%% of copy %.0f GB/s)\n",
                    what, us, target_us, bytes / 1e6, bw / 1e9, 100.0 * bw / copy_bw_, copy_bw_ / 1e9);
    }
    double copy_bw_ = 0;
};

TEST_F(CudaDs4AttnBench, HeadNormRopeKvFinishStore) {
    const int calls = 43, nr = 64;
    const cd::rope_args rope = dev_rope(yarn_table(nr), nr);
    float *q = up(randn(static_cast<size_t>(64 * 512), rng_, 3.0f)), *iq = up(randn(64 * 128, rng_));
    time_calls("head_norm_rope attention q 64x512 (norm, rope)", calls, 8191, 2.0 * 64 * 512 * 4, 4.0,
               [&](int) { cd::launch_head_norm_rope(q, 64, 512, true, kEps, rope, cd::qat_kind::none, pos_, s_); });
    time_calls("head_norm_rope indexer q 64x128 (rope, hadamard, fp4)", calls, 8191, 2.0 * 64 * 128 * 4, 4.0,
               [&](int) {
                   cd::launch_head_norm_rope(iq, 64, 128, false, kEps, rope, cd::qat_kind::hadamard_fp4, pos_, s_);
               });
    const int d = 512, W = 128;
    float *kv = up(randn(d, rng_)), *norm_w = up(randn(d, rng_, 0.2f, 1.0f));
    void *ring = raw(static_cast<size_t>(W) * d * 2);
    time_calls("kv_finish_store d 512 (norm, rope, fp8, f16 ring)", calls, 8191, 2.0 * d * 4 + d * 4 + d * 2, 4.0,
               [&](int) {
                   cd::launch_kv_finish_store(kv, d, norm_w, kEps, rope, cd::qat_kind::fp8_nope, ring, true,
                                              static_cast<size_t>(d) * 2, W, pos_, s_);
               });
}

TEST_F(CudaDs4AttnBench, CompressorStep) {
    const int calls = 41, nr = 64;
    struct cfg {
        const char *what;
        int ratio, dim;
        cd::qat_kind qat;
        int64_t pos;
    };
    const cfg cfgs[] = {{"compressor R 4 dim 512 fp8, no row", 4, 512, cd::qat_kind::fp8_nope, 8190},
                        {"compressor R 4 dim 512 fp8, row emitted", 4, 512, cd::qat_kind::fp8_nope, 8191},
                        {"compressor R 128 dim 512 fp8, no row", 128, 512, cd::qat_kind::fp8_nope, 8190},
                        {"compressor R 128 dim 512 fp8, row emitted (1 in 128)", 128, 512, cd::qat_kind::fp8_nope,
                         8191},
                        {"indexer compressor R 4 dim 128 hadamard+fp4, no row", 4, 128, cd::qat_kind::hadamard_fp4,
                         8190},
                        {"indexer compressor R 4 dim 128 hadamard+fp4, row emitted", 4, 128,
                         cd::qat_kind::hadamard_fp4, 8191}};
    for (const cfg &c : cfgs) {
        const int R = c.ratio, dp = c.dim, width = (R == 4 ? 2 : 1) * dp, slots = R == 4 ? 2 * R : R;
        const int64_t max_rows = (c.pos + 1) / R;
        cd::compressor_args a;
        a.ratio = R;
        a.dim = dp;
        a.ape = up(randn(static_cast<size_t>(R) * width, rng_, 0.5f));
        a.norm_w = up(randn(dp, rng_, 0.2f, 1.0f));
        a.eps = kEps;
        a.rope = dev_rope(yarn_table(nr), nr);
        a.qat = c.qat;
        a.slots = slots;
        a.state_kv = up(randn(static_cast<size_t>(slots) * width, rng_));  // a full frontier: every candidate live
        a.state_score = up(randn(static_cast<size_t>(slots) * width, rng_));
        a.rows = raw(static_cast<size_t>(max_rows) * dp * 2);
        a.rows_f16 = true;
        a.row_stride = static_cast<size_t>(dp) * 2;
        a.max_rows = max_rows;
        const float *ca = up(randn(width, rng_)), *cg = up(randn(width, rng_));
        const bool emit = (c.pos + 1) % R == 0;
        const double bytes = 5.0 * width * 4 + (emit ? 2.0 * slots * width * 4 + dp * 2 : 0.0);
        time_calls(c.what, calls, c.pos, bytes, 4.0,
                   [&](int) { cd::launch_compressor_step(a, ca, cg, pos_, err_, s_); });
    }
    EXPECT_EQ(take_err(), 0u);
}

// The shapes of cuda_test::kAttnBenchCases (attn_bench.h). Bytes: the rows read, q, o.
TEST_F(CudaDs4AttnBench, SparseSinkAttention) {
    const int H = cuda_test::kAttnBenchHeads, d = cuda_test::kAttnBenchDim, W = cuda_test::kAttnBenchWindow;
    const int nr = 64, calls = 16;
    const cuda_test::attn_bench_inputs in = cuda_test::attn_bench_make_inputs(*this, rng_);
    const cd::rope_args rope = dev_rope(yarn_table(nr), nr);
    for (const cuda_test::attn_bench_case &c : cuda_test::kAttnBenchCases) {
        const cuda_test::attn_bench_sets sets = cuda_test::attn_bench_make_sets(*this, rng_, c, in, rope);
        const double bytes = static_cast<double>(W + cuda_test::attn_bench_comp_rows(c)) * d * 2 + 2.0 * H * d * 4;
        const std::string what = std::string("attention ") + c.what;
        time_calls(what.c_str(), calls, c.pos, bytes, c.target_us, [&](int k) {
            const size_t i = static_cast<size_t>(k % c.sets);
            cd::launch_sparse_sink_attention(sets.args[i], in.q, pos_, sets.parts[i], in.o, s_);
        });
        const auto out = down(in.o, static_cast<size_t>(H * d));
        for (float v : out) ASSERT_TRUE(std::isfinite(v)) << c.what;
    }
}

}  // namespace
}  // namespace fathom
