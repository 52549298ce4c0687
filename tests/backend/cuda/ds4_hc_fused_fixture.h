// Shared by tests/backend/cuda/test_cuda_ds4_hc_fused.cpp and bench/cuda/bench_ds4_hc_fused.cpp:
// the suite's fixture and the helpers it needs. Test-only: src/ never includes it.
#pragma once
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include <cuda_runtime_api.h>

#include "backend/cpu/quants.h"
#include "backend/cuda/cuda_kernels.h"
#include "backend/cuda/ds4_kernels.h"
#include "core/error.h"
#include "cuda_test_util.h"

namespace fathom::cuda_test::ds4_hc_fused_suite {

namespace cd = cuda::ds4;
using cuda_test::randn;
using cuda_test::time_graph;

// A test geometry: n_hc streams of D, mixer rows of type ft padded by pad bytes (pad % 16 != 0 takes
// the scalar weight loads), with or without an RMSNorm weight; blocks: the split kernel's
// part_blocks (0: its default).
struct geom {
    int n_hc;
    int64_t D;
    dtype ft;
    size_t pad;
    bool norm;
    int blocks = 0;
};
inline std::string name(const geom &g) {
    return "n_hc " + std::to_string(g.n_hc) + " D " + std::to_string(g.D) + " " + std::string(dtype_name(g.ft)) + " pad " +
           std::to_string(g.pad) + (g.norm ? "" : " no-norm") + " blocks " + std::to_string(g.blocks);
}

// Which fused kernel a test drives: hc_fused_kernel (no partial scratch) or hc_split_kernel.
enum class kern { rows, split };

// One HC's weights on the device: fn [rows, n_hc * D] (rows row_bytes apart), base [rows], scale [3],
// norm [D] (or null).
struct hc_dev {
    const void *fn = nullptr;
    size_t row_bytes = 0;
    const float *base = nullptr, *scale = nullptr, *norm = nullptr;
};

class CudaDs4HcFused : public cuda_test::cuda_fixture {
  public:  // the run_* helpers below drive it
    hc_dev make_hc(const geom &g, int rows) {
        const int64_t S = g.n_hc * g.D;
        const auto f = randn(static_cast<size_t>(rows * S), rng_, 4.0f / std::sqrt(static_cast<float>(S)));
        hc_dev h;
        h.row_bytes = dtype_row_bytes(g.ft, S) + g.pad;
        std::vector<uint8_t> b(h.row_bytes * static_cast<size_t>(rows), 0);
        for (int r = 0; r < rows; ++r) cpu::quantize_row(g.ft, f.data() + r * S, b.data() + r * h.row_bytes, S);
        h.fn = up(b);
        h.base = up(randn(static_cast<size_t>(rows), rng_, 0.5f));
        h.scale = up(randn(3, rng_, 1.0f));
        h.norm = g.norm ? up(randn(static_cast<size_t>(g.D), rng_, 0.3f, 1.0f)) : nullptr;
        return h;
    }
    cd::hc_params params(const geom &g) const { return {g.n_hc, g.D, 20, 1e-6f, 1e-6f}; }
    // Bitwise equality of n floats; reports the count and the first differing index.
    void expect_bits(const float *a, const float *b, size_t n, const char *what) {
        size_t bad = 0, first = n;
        for (size_t i = 0; i < n; ++i)
            if (std::memcmp(a + i, b + i, sizeof(float)) != 0 && bad++ == 0) first = i;
        EXPECT_EQ(bad, 0u) << what << ": " << bad << " of " << n << " differ, first at " << first << " (fused "
                           << (first < n ? a[first] : 0.0f) << ", unfused " << (first < n ? b[first] : 0.0f) << ")";
    }
    void expect_same(const float *fused, const float *unfused, size_t n, const char *what) {
        const auto a = down(fused, n), b = down(unfused, n);
        expect_bits(a.data(), b.data(), n, what);
    }
    void expect_counter_zero(const uint32_t *sync) { EXPECT_EQ(down(sync, 1)[0], 0u) << "arrival counter not reset"; }
    // Split-kernel outputs reached through the mix: relative L2 error <= 1e-6 (per element for the
    // mix, elem true); bit differences are allowed but printed (expected: none).
    void expect_close(const float *got_d, const float *ref_d, size_t n, const char *what, bool elem = false) {
        const auto a = down(got_d, n), b = down(ref_d, n);
        size_t bits = 0, bad = 0, first = n;
        for (size_t i = 0; i < n; ++i) {
            if (std::memcmp(&a[i], &b[i], sizeof(float)) != 0) ++bits;
            const bool ok = std::fabs(static_cast<double>(a[i]) - b[i]) <= 1e-6 * std::fabs(static_cast<double>(b[i]));
            if (elem && !ok && bad++ == 0) first = i;
        }
        if (elem)
            EXPECT_EQ(bad, 0u) << what << ": " << bad << " of " << n << " beyond 1e-6 relative, first at " << first
                               << " (split " << (first < n ? a[first] : 0.0f) << ", unfused "
                               << (first < n ? b[first] : 0.0f) << ")";
        else
            EXPECT_LE(cuda_test::rel_l2(a, b), 1e-6) << what;
        if (bits) std::printf("  note: %s: %zu of %zu floats differ in bits from the unfused chain\n", what, bits, n);
    }
    // out / post / comb / mix of the kernel under test against the unfused chain's.
    void expect_outputs(kern k, const float *got, const float *ref, size_t n, const char *what, bool elem = false) {
        if (k == kern::rows) expect_same(got, ref, n, what);
        else expect_close(got, ref, n, what, elem);
    }
    // The split kernel's partial scratch for n_hc streams (null for the row kernel), NaN-poisoned.
    double *part_for(kern k, int n_hc) {
        if (k == kern::rows) return nullptr;
        const size_t cnt = cd::hc_fused_part_count(n_hc);
        double *p = dev<double>(cnt);
        put(p, std::vector<double>(cnt, std::nan("")));
        return p;
    }
    // After a launch that must have taken the split kernel: its partial of row 0, block 0 was
    // written (then poisoned again for the next launch).
    void expect_split_ran(double *part, int n_hc) {
        if (!part) return;
        const double v = down(part, 1)[0];
        EXPECT_TRUE(std::isfinite(v)) << "the split kernel did not run (partial scratch untouched)";
        put(part, std::vector<double>(cd::hc_fused_part_count(n_hc), std::nan("")));
    }

    std::mt19937 rng_{20261201};
};

}  // namespace fathom::cuda_test::ds4_hc_fused_suite
