// Shared by tests/backend/cuda/test_cuda_dense_attn.cpp and bench/cuda/bench_dense_attn.cpp:
// the suite's fixture and the helpers it needs. Test-only: src/ never includes it.
#pragma once
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
#include "cuda_test_util.h"

namespace fathom::cuda_test::dense_attn_suite {

using cuda_test::randn;
using cuda_test::rel_l2;

struct attn_case {
    int32_t hd, n_head, n_head_kv;
    int64_t n_ctx, n_past, n_tok;
    float softcap;
    int32_t window;
    bool f16 = true;
};
using pair_t = cuda_test::tensor_pair;

class CudaDenseAttn : public cuda_test::cuda_backend_pair_test {
  protected:
    // A K or V cache [hd, n_head_kv * n_ctx] of random values; positions no query of c may read
    // (>= n_past + n_tok; < n_past - window + 1 with a window) hold NaN.
    pair_t cache(const attn_case &c) {
        const int64_t rows = static_cast<int64_t>(c.n_head_kv) * c.n_ctx;
        const auto vals = randn(static_cast<size_t>(rows * c.hd), rng_);
        const int64_t lo = c.window > 0 ? c.n_past - c.window + 1 : 0, hi = c.n_past + c.n_tok;
        auto unread = [&](int64_t r) {
            const int64_t p = r % c.n_ctx;
            return p >= hi || p < lo;
        };
        if (!c.f16) {
            std::vector<float> f(vals);
            for (int64_t r = 0; r < rows; ++r)
                if (unread(r))
                    for (int32_t d = 0; d < c.hd; ++d) f[static_cast<size_t>(r * c.hd + d)] = std::nanf("");
            return make(dtype::f32, c.hd, rows, f.data());
        }
        std::vector<uint16_t> b(vals.size());
        for (int64_t r = 0; r < rows; ++r)
            for (int32_t d = 0; d < c.hd; ++d) {
                const size_t i = static_cast<size_t>(r * c.hd + d);
                b[i] = unread(r) ? uint16_t{0x7e00} : cpu::f32_to_f16(vals[i]);
            }
        return make(dtype::f16, c.hd, rows, b.data());
    }
    static attn_params params(const attn_case &c) { return cuda_test::attn_params_of(c); }
    // Largest per-(token, head) relative L2 error of got against ref, rows [0, n_tok) of n_head heads.
    static double worst_row(const std::vector<float> &got, const std::vector<float> &ref, int64_t n_tok, int32_t n_head,
                            int32_t hd) {
        double worst = 0;
        for (int64_t r = 0; r < n_tok * n_head; ++r) {
            const double e = rel_l2(got.data() + r * hd, ref.data() + r * hd, static_cast<size_t>(hd));
            if (std::isnan(e)) return e;  // an unwritten or NaN output
            worst = std::max(worst, e);
        }
        return worst;
    }
    // Runs case c on both backends; returns the worst row error (NaN if any output is NaN).
    double run(const attn_case &c, float q_sd = 2.0f) {
        auto kc = cache(c), vc = cache(c);
        const int64_t qw = static_cast<int64_t>(c.n_head) * c.hd;
        auto q = make_f32(qw, c.n_tok, randn(static_cast<size_t>(qw * c.n_tok), rng_, q_sd));
        auto o = out_f32(qw, c.n_tok);
        const attn_params p = params(c);
        exact_->attention(q.h, kc.h, vc.h, p, o.h);
        gpu_->attention(q.d, kc.d, vc.d, p, o.d);
        gpu_->synchronize();
        return worst_row(down(o.d), hostv(o), c.n_tok, c.n_head, c.hd);
    }

    std::mt19937 rng_{4321};
};

}  // namespace fathom::cuda_test::dense_attn_suite
