// Shared by tests/backend/cuda/test_cuda_ds4_fast.cpp and bench/cuda/bench_ds4_fast.cpp:
// the suite's fixture and the helpers it needs. Test-only: src/ never includes it.
#pragma once
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
#include "cuda_test_util.h"

namespace fathom::cuda_test::ds4_fast_suite {

namespace cd = cuda::ds4;
using cuda_test::randn;
using cuda_test::rel_l2;
using cuda_test::time_graph;

// cuda_fixture's stream and buffers plus the device position pos_.
class CudaDs4Fast : public cuda_test::cuda_fixture {
  public:  // run_topk_case drives the fixture's buffers
    void SetUp() override {
        cuda_fixture::SetUp();
        if (IsSkipped() || HasFatalFailure()) return;
        pos_ = dev<int64_t>(1);
    }
    void set_pos(int64_t p) { cudaMemcpy(pos_, &p, sizeof(p), cudaMemcpyHostToDevice); }

    int64_t *pos_ = nullptr;
    std::mt19937 rng_{20261130};
};

}  // namespace fathom::cuda_test::ds4_fast_suite
