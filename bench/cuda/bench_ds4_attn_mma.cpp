// Kernel benchmarks of bench_cuda_kernels (bench_cuda_kernels.cpp): decode sparse attention, f32 kernel vs
// tensor cores (two launches, fused); the kernels' tests: tests/backend/cuda/test_cuda_ds4_attn_mma.cpp.
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
#include <vector>

#include "backend/cpu/quants.h"
#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/ds4_attn_kernels.h"
#include "models/deepseek4_impl.h"
#include "models/deepseek4_ops.h"

#include "backend/cuda/ds4_attn_mma_fixture.h"
#include "attn_bench.h"

namespace fathom {
namespace {

using namespace cuda_test::ds4_attn_mma_suite;
namespace cd = cuda::ds4;
using cuda_test::randn;
using cuda_test::rel_l2;

// f32 kernel vs tensor cores (split + separate combine: the old two launches; fused: one PDL launch) at
// the shapes of cuda_test::kAttnBenchCases (as CudaDs4AttnBench.SparseSinkAttention): 16 launches
// captured in one graph (buffer sets cycled at 1M so rows come from HBM), microseconds per call.
TEST_F(CudaDs4AttnMma, BenchOldVsNew) {
    const int calls = 16;
    const cuda_test::attn_bench_inputs in = cuda_test::attn_bench_make_inputs(*this, rng_);
    for (const cuda_test::attn_bench_case &c : cuda_test::kAttnBenchCases) {
        const cuda_test::attn_bench_sets sets = cuda_test::attn_bench_make_sets(*this, rng_, c, in, rope_);
        set_pos(c.pos);
        float us[3] = {0, 0, 0};
        for (int k = 0; k < 3; ++k) {  // path::f32, path::tc, path::fused
            float ms = 0;
            cuda_test::attn_bench_time(s_, calls, [&](int i) {
                cd::sparse_attn_args a = sets.args[static_cast<size_t>(i % c.sets)];
                set_path(a, static_cast<path>(k));
                cd::launch_sparse_sink_attention(a, in.q, pos_, sets.parts[static_cast<size_t>(i % c.sets)], in.o, s_);
            }, ms);
            if (HasFatalFailure()) return;
            us[k] = ms * 1e3f / calls;
        }
        std::printf("  attention %-34s f32 kernel %7.2f us/call, tensor cores: split + combine (old) %7.2f, "
                    "fused (new) %7.2f us/call\n",
                    c.what, us[0], us[1], us[2]);
        for (float *part : sets.parts) EXPECT_TRUE(sync_zero(part));
    }
}

}  // namespace
}  // namespace fathom
