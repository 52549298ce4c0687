// Shared by tests/backend/cuda/test_cuda_ds4_moe_staged.cpp and bench/cuda/bench_ds4_moe_staged.cpp:
// the suite's fixture and the helpers it needs. Test-only: src/ never includes it.
#pragma once
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
#include "cuda_test_util.h"

namespace fathom::cuda_test::ds4_moe_staged_suite {

namespace cd = cuda::ds4;
using cuda_test::randn;
using cuda_test::time_graph;

class CudaDs4MoeStaged : public cuda_test::cuda_fixture {
  protected:
    void SetUp() override {
        cuda_fixture::SetUp();
        if (IsSkipped() || HasFatalFailure()) return;
        err_ = dev<uint32_t>(1);
        mode0_ = cd::moe_staged();
    }
    void TearDown() override {
        if (!IsSkipped()) cd::set_moe_staged(mode0_);
        cuda_fixture::TearDown();
    }
    uint32_t take_err() {
        const uint32_t e = down(err_, 1)[0];
        cudaMemset(err_, 0, 4);
        return e;
    }

    uint32_t *err_ = nullptr;
    int mode0_ = 1;
    std::mt19937 rng_{20261201};
};

}  // namespace fathom::cuda_test::ds4_moe_staged_suite
