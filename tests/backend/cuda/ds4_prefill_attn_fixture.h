// Shared by tests/backend/cuda/test_cuda_ds4_prefill_attn.cpp and bench/cuda/bench_ds4_prefill_attn.cpp:
// the suite's fixture and the helpers it needs. Test-only: src/ never includes it.
#pragma once
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <iterator>
#include <numeric>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "backend/cpu/quants.h"
#include "backend/cuda/ds4_attn_kernels.h"
#include "backend/cuda/ds4_prefill.h"
#include "core/error.h"
#include "cuda_test_util.h"

namespace fathom::cuda_test::ds4_prefill_attn_suite {

namespace cd = cuda::ds4;
using cuda_test::randn;
using cuda_test::rel_l2;

// Rows [n, width] as stored at `f16` precision, `stride` bytes apart (padding bytes 0xFF).
inline std::vector<uint8_t> pack_rows(const std::vector<float> &v, int64_t width, bool f16, size_t stride) {
    const int64_t n = static_cast<int64_t>(v.size()) / width;
    std::vector<uint8_t> b(static_cast<size_t>(n) * stride, 0xFF);
    for (int64_t r = 0; r < n; ++r)
        for (int64_t i = 0; i < width; ++i) {
            uint8_t *p = b.data() + static_cast<size_t>(r) * stride;
            const float x = v[static_cast<size_t>(r * width + i)];
            if (f16) {
                const uint16_t h = cpu::f32_to_f16(x);
                std::memcpy(p + 2 * i, &h, 2);
            } else {
                std::memcpy(p + 4 * i, &x, 4);
            }
        }
    return b;
}

class CudaDs4PrefillAttn : public cuda_test::cuda_fixture {
  protected:
    // Device positions p0, p0 + 1, .., p0 + n - 1 (the decode reference's *pos per token).
    int64_t *positions(int64_t p0, int64_t n) {
        std::vector<int64_t> v(static_cast<size_t>(n));
        std::iota(v.begin(), v.end(), p0);
        return up(v);
    }
    // A RoPE table of n_rot / 2 frequencies (any values: both paths read the same table).
    cd::rope_args rope(int n_rot) {
        std::vector<float> f(static_cast<size_t>(n_rot / 2));
        for (size_t i = 0; i < f.size(); ++i)
            f[i] = static_cast<float>(std::pow(10000.0, -2.0 * static_cast<double>(i) / n_rot));
        cd::rope_args r;
        r.freq = up(f);
        r.n_rot = n_rot;
        return r;
    }

    struct idx_case {
        int H, Dh, topk;
        bool f16;
        int64_t max_n, p0, n_tok;
        int64_t group = 0;  // score rows in the scratch (tokens per group); 0: n_tok
    };
    void run_indexer(const idx_case &c);

    struct attn_case {
        int H, d, n_rot, W;
        cd::comp_mode mode;
        bool ring_f16, comp_f16;
        int ratio;
        int64_t max_comp, n_comp_rows, p0, n_tok;
        size_t chunk_pad = 16;  // bytes past each chunk row (2: f16 rows not aligned to a dim pair)
    };
    void run_attn(const attn_case &c);

    std::mt19937 rng_{20261201};
};

}  // namespace fathom::cuda_test::ds4_prefill_attn_suite
