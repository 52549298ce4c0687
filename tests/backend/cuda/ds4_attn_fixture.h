// Shared by tests/backend/cuda/test_cuda_ds4_attn.cpp and bench/cuda/bench_ds4_attn.cpp:
// the suite's fixture and the helpers it needs. Test-only: src/ never includes it.
#pragma once
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
#include "cuda_test_util.h"

namespace fathom::cuda_test::ds4_attn_suite {

namespace cd = cuda::ds4;
using cuda_test::randn;
using cuda_test::rel_l2;

constexpr float kEps = 1e-6f;
// The model's two RoPE tables at full DS4-Flash parameters (spec 1, 4.2).
inline ds4::rope_table yarn_table(int n_rot) {
    return ds4::rope_yarn(160000.0f, n_rot, 16.0f, 65536, 32.0f, 1.0f);
}
// cuda_fixture's stream and buffers plus the kernels' error word err_ and the device position pos_.
class CudaDs4Attn : public cuda_test::cuda_fixture {
  protected:
    void SetUp() override {
        cuda_fixture::SetUp();
        if (IsSkipped() || HasFatalFailure()) return;
        err_ = dev<uint32_t>(1);
        pos_ = dev<int64_t>(1);
    }
    void set_pos(int64_t p) { cudaMemcpy(pos_, &p, sizeof(p), cudaMemcpyHostToDevice); }
    uint32_t take_err() {
        const uint32_t e = down(err_, 1)[0];
        cudaMemset(err_, 0, 4);
        return e;
    }
    cd::rope_args dev_rope(const ds4::rope_table &t, int n_rot) {
        cd::rope_args r;
        r.freq = up(t.freq);
        r.n_rot = n_rot;
        return r;
    }

    uint32_t *err_ = nullptr;
    int64_t *pos_ = nullptr;
    std::mt19937 rng_{20261129};
};

}  // namespace fathom::cuda_test::ds4_attn_suite
