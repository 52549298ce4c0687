// Kernel benchmarks of bench_cuda_kernels (bench_cuda_kernels.cpp): the dense families' tensor-core prefill
// attention at the PFlash drafter's shapes (Qwen3-0.6B: 16 heads, 8 KV heads, hd 128); the kernel's tests:
// tests/backend/cuda/test_cuda_dense_attn.cpp.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "backend/cpu/quants.h"
#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/cuda_kernels.h"

#include "backend/cuda/dense_attn_fixture.h"

namespace fathom {
namespace {

using namespace cuda_test::dense_attn_suite;
using cuda_test::randn;
using cuda_test::rel_l2;

// Kernel time of one attention call at the PFlash drafter's geometry (Qwen3-0.6B: 16 heads, 8 KV heads,
// hd 128): a 4096-token chunk after a 4096-token prefix with window 512 (its windowed prefill), and a
// full-causal 4096-token first chunk. TFLOP/s counts the attended (query, key) pairs only: 4 hd flops
// each (QK^T and PV), not the masked work or the hi / lo doubling.
TEST_F(CudaDenseAttn, BenchDrafterShapes) {
    struct shape {
        const char *name;
        int64_t n_past, n_tok;
        int32_t window;
    };
    for (const shape sh : {shape{"drafter chunk (4096 after 4096, window 512)", 4096, 4096, 512},
                           shape{"full causal 4096", 0, 4096, 0}}) {
        const attn_case c{128, 16, 8, 8192, sh.n_past, sh.n_tok, 0.0f, sh.window};
        auto kc = cache(c), vc = cache(c);
        const int64_t qw = 16 * 128;
        auto q = make_f32(qw, c.n_tok, randn(static_cast<size_t>(qw * c.n_tok), rng_, 2.0f));
        auto o = out_f32(qw, c.n_tok);
        const attn_params p = params(c);
        auto s = static_cast<cudaStream_t>(gpu_->stream());
        for (int i = 0; i < 3; ++i) gpu_->attention(q.d, kc.d, vc.d, p, o.d);  // warm-up
        gpu_->synchronize();
        cudaEvent_t a, b;
        cudaEventCreate(&a);
        cudaEventCreate(&b);
        const int reps = 20;
        cudaEventRecord(a, s);
        for (int i = 0; i < reps; ++i) gpu_->attention(q.d, kc.d, vc.d, p, o.d);
        cudaEventRecord(b, s);
        cudaEventSynchronize(b);
        float ms = 0;
        cudaEventElapsedTime(&ms, a, b);
        cudaEventDestroy(a);
        cudaEventDestroy(b);
        gpu_->synchronize();
        double pairs = 0;
        for (int64_t t = 0; t < c.n_tok; ++t) {
            const int64_t pos = c.n_past + t;
            pairs += static_cast<double>(c.window > 0 ? std::min<int64_t>(pos + 1, c.window) : pos + 1);
        }
        const double us = 1e3 * ms / reps, flops = pairs * 16 * 4 * 128;
        std::printf("[dense attn] %-44s %9.1f us  %6.1f TFLOP/s (attended pairs)\n", sh.name, us, flops / (us * 1e6));
        const std::vector<float> got = down(o.d);
        size_t bad = 0;
        for (float x : got) bad += !std::isfinite(x);
        EXPECT_EQ(bad, 0u);
    }
}

}  // namespace
}  // namespace fathom
