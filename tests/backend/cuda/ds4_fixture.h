// Shared by tests/backend/cuda/test_cuda_ds4.cpp and bench/cuda/bench_ds4.cpp:
// the suite's fixture and the helpers it needs. Test-only: src/ never includes it.
#pragma once
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
#include "cuda_test_util.h"
#include "models/cuda/ds4_host_util.h"

namespace fathom::cuda_test::ds4_suite {

namespace cd = cuda::ds4;
using cuda_test::randn;
using cuda_test::rel_l2;
using cuda_test::time_graph;

// Device buffers of cuda_fixture (16 spare zero bytes each) plus the kernels' error word err_.
class CudaDs4 : public cuda_test::cuda_fixture {
protected:
    void SetUp() override {
        cuda_fixture::SetUp();
        if (IsSkipped() || HasFatalFailure()) return;
        err_ = dev<uint32_t>(1);
    }
    uint32_t take_err() {
        const uint32_t e = down(err_, 1)[0];
        cudaMemset(err_, 0, 4);
        return e;
    }

    uint32_t *err_ = nullptr;
    std::mt19937 rng_{20261129};
};

}  // namespace fathom::cuda_test::ds4_suite
