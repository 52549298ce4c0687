// Shared by tests/backend/cuda/test_cuda_ds4_attn_mma.cpp and bench/cuda/bench_ds4_attn_mma.cpp:
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
#include <vector>

#include "backend/cpu/quants.h"
#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/ds4_attn_kernels.h"
#include "models/deepseek4_impl.h"
#include "models/deepseek4_ops.h"
#include "cuda_test_util.h"

namespace fathom::cuda_test::ds4_attn_mma_suite {

namespace cd = cuda::ds4;
using cuda_test::randn;
using cuda_test::rel_l2;

// Rows [n, width] as f16 bits, stride bytes apart (padding bytes 0xFF).
inline std::vector<uint8_t> pack_f16(const std::vector<float> &v, int64_t width, size_t stride) {
    const int64_t n = static_cast<int64_t>(v.size()) / width;
    std::vector<uint8_t> b(static_cast<size_t>(n) * stride + 16, 0xFF);
    for (int64_t r = 0; r < n; ++r)
        for (int64_t i = 0; i < width; ++i) {
            const uint16_t h = cpu::f32_to_f16(v[static_cast<size_t>(r * width + i)]);
            std::memcpy(b.data() + static_cast<size_t>(r) * stride + 2 * i, &h, 2);
        }
    return b;
}

inline std::vector<float> f16_rounded(std::vector<float> v) {
    for (float &x : v) x = cpu::f16_to_f32(cpu::f32_to_f16(x));
    return v;
}

struct mma_case {
    const char *what;
    cd::comp_mode mode = cd::comp_mode::none;
    int64_t pos = 0;
    int ratio = 0;
    int64_t n_comp_rows = 0, max_comp = 0;
    int64_t n_sel = -1;  // list: rows chosen (-1: min(visible, max_comp))
    bool dup = false;    // list: unsorted, with repeats
    int n_head = 64, d = 512;
    size_t pad = 0;  // bytes past each ring and compressed row (0 / 16: 16-byte aligned; 4: pairs; 2: f32 path)
    float q_sd = 1.0f;
};

// One call's device arguments and the CPU reference output [n_head, d].
struct mma_setup {
    cd::sparse_attn_args a;
    float *q = nullptr;
    int32_t *sel = nullptr, *n_sel = nullptr;
    std::vector<float> ref;
    int64_t n_rows = 0;
};

class CudaDs4AttnMma : public cuda_test::cuda_fixture {
  protected:
    static constexpr int kWindow = 128, kRot = 64;
    void SetUp() override {
        cuda_fixture::SetUp();
        if (IsSkipped() || HasFatalFailure()) return;
        pos_ = dev<int64_t>(1);
        tab_ = ds4::rope_yarn(160000.0f, kRot, 16.0f, 65536, 32.0f, 1.0f);
        rope_.freq = up(tab_.freq);
        rope_.n_rot = kRot;
    }
    void set_pos(int64_t p) { cudaMemcpy(pos_, &p, sizeof(p), cudaMemcpyHostToDevice); }

    // A list of `count` compressed rows out of `vis` visible: sorted distinct (as the indexer gives), or
    // unsorted with repeats.
    std::vector<int32_t> make_sel(int64_t vis, int64_t count, bool dup) {
        std::vector<int32_t> sel;
        if (vis <= 0 || count <= 0) return sel;
        if (dup) {
            std::uniform_int_distribution<int32_t> u(0, static_cast<int32_t>(vis - 1));
            for (int64_t i = 0; i < count; ++i) sel.push_back(u(rng_));
            if (count >= 2) sel[1] = sel[0];  // at least one repeat
            return sel;
        }
        std::vector<int32_t> all(static_cast<size_t>(vis));
        std::iota(all.begin(), all.end(), 0);
        std::shuffle(all.begin(), all.end(), rng_);
        all.resize(static_cast<size_t>(std::min(vis, count)));
        std::sort(all.begin(), all.end());
        return all;
    }

    // Random f16 rows (those the token must not see: NaN), the CPU reference, device arguments.
    mma_setup build(const mma_case &c) {
        const int H = c.n_head, d = c.d, W = kWindow;
        mma_setup u;
        const int64_t first = std::max<int64_t>(0, c.pos - W + 1);
        auto ring = f16_rounded(randn(static_cast<size_t>(W) * d, rng_));
        for (int64_t slot = c.pos + 1; slot < W; ++slot) std::fill_n(ring.begin() + slot * d, d, std::nanf(""));
        std::vector<float> rows;  // the candidate list in the CPU's order
        for (int64_t p = first; p <= c.pos; ++p)
            rows.insert(rows.end(), ring.begin() + (p % W) * d, ring.begin() + (p % W + 1) * d);
        std::vector<float> comp;
        std::vector<int32_t> sel;
        if (c.mode != cd::comp_mode::none) {
            comp = f16_rounded(randn(static_cast<size_t>(c.n_comp_rows) * d, rng_));
            std::vector<char> used(static_cast<size_t>(c.n_comp_rows), 0);
            const int64_t vis = (c.pos + 1) / c.ratio;
            if (c.mode == cd::comp_mode::all) {
                for (int64_t r = 0; r < std::min(vis, c.max_comp); ++r) sel.push_back(static_cast<int32_t>(r));
            } else {
                sel = make_sel(vis, c.n_sel < 0 ? std::min(vis, c.max_comp) : c.n_sel, c.dup);
            }
            for (int32_t r : sel) used[static_cast<size_t>(r)] = 1;
            for (int64_t r = 0; r < c.n_comp_rows; ++r)
                if (!used[static_cast<size_t>(r)]) std::fill_n(comp.begin() + r * d, d, std::nanf(""));
            for (int32_t r : sel) rows.insert(rows.end(), comp.begin() + r * d, comp.begin() + (r + 1) * d);
        }
        u.n_rows = static_cast<int64_t>(rows.size()) / d;
        const auto q = randn(static_cast<size_t>(H) * d, rng_, c.q_sd);
        auto sinks = randn(static_cast<size_t>(H), rng_);
        sinks[0] = 6.0f;  // a sink that dominates its head
        const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(d)));
        u.ref.assign(static_cast<size_t>(H) * d, 0.0f);
        ds4::attend_with_sink(q.data(), rows.data(), u.n_rows, sinks.data(), H, d, scale, u.ref.data());
        for (int h = 0; h < H; ++h) ds4::rope_apply(u.ref.data() + static_cast<size_t>(h) * d + d - kRot, tab_, c.pos, true);

        cd::sparse_attn_args &a = u.a;
        a.n_head = H;
        a.d = d;
        a.scale = scale;
        a.sinks = up(sinks);
        a.ring_stride = static_cast<size_t>(d) * 2 + c.pad;
        a.ring = up(pack_f16(ring, d, a.ring_stride));
        a.window = W;
        a.mode = c.mode;
        if (c.mode != cd::comp_mode::none) {
            a.comp_stride = static_cast<size_t>(d) * 2 + c.pad;
            a.comp = up(pack_f16(comp, d, a.comp_stride));
            a.ratio = c.ratio;
            a.max_comp = c.max_comp;
        }
        if (c.mode == cd::comp_mode::list) {
            std::vector<int32_t> buf(static_cast<size_t>(std::max<int64_t>(c.max_comp, 1)), -1);  // -1: never read
            std::copy(sel.begin(), sel.end(), buf.begin());
            u.sel = up(buf);
            u.n_sel = up(std::vector<int32_t>{static_cast<int32_t>(sel.size())});
            a.sel = u.sel;
            a.n_sel = u.n_sel;
        }
        a.rope = rope_;
        u.q = up(q);
        return u;
    }

    // Which launch: the f32 split kernel + combine, the tensor-core split kernel + the separate combine
    // kernel (two launches), or the tensor-core kernel with the combine folded in (one PDL launch).
    enum class path { f32, tc, fused };
    static void set_path(cd::sparse_attn_args &a, path k) {
        a.tensor_cores = k != path::f32;
        a.fused_combine = k == path::fused;
    }

    // n_floats of partials: NaN-poisoned, the fused combine's counters (the first attn_part_sync_bytes) zero.
    float *fresh_part(size_t n_floats) {
        float *part = poisoned(n_floats);
        EXPECT_EQ(cudaMemset(part, 0, cd::attn_part_sync_bytes()), cudaSuccess);
        return part;
    }
    // Whether the counters are back at zero after the calls on part (every call must leave them so).
    bool sync_zero(const float *part) {
        const auto w = down(reinterpret_cast<const uint32_t *>(part), cd::attn_part_sync_bytes() / 4);
        return std::all_of(w.begin(), w.end(), [](uint32_t x) { return x == 0; });
    }

    // One launch at pos on `k` into a fresh poisoned output (partials poisoned too); returns o [n_head, d].
    std::vector<float> launch(const mma_setup &u, int64_t pos, path k) {
        cd::sparse_attn_args a = u.a;
        set_path(a, k);
        const size_t n = static_cast<size_t>(a.n_head) * a.d;
        float *part = fresh_part(cd::attn_part_floats(a)), *o = poisoned(n);
        set_pos(pos);
        cd::launch_sparse_sink_attention(a, u.q, pos_, part, o, s_);
        auto out = down(o, n);
        EXPECT_TRUE(sync_zero(part)) << "the fused combine's counters are not back at zero";
        return out;
    }

    // Busy splits of a call with n candidate rows (ds4_attn.cu attn_splits / attn_rps), for the log.
    static int64_t busy_splits(const cd::sparse_attn_args &a, int64_t n) {
        const int64_t cap = a.window + (a.mode == cd::comp_mode::none ? 0 : a.max_comp);
        const int64_t n_split = std::min<int64_t>(std::max<int64_t>((cap + 31) / 32, 1), 64);
        int64_t rps = std::max<int64_t>((n + n_split - 1) / n_split, 32);
        rps = (rps + 15) / 16 * 16;
        return (n + rps - 1) / rps;
    }

    // Largest per-head relative L2 of got against ref (NaN: +inf).
    static double worst_head(const std::vector<float> &got, const std::vector<float> &ref, int H, int d) {
        double w = 0;
        for (int h = 0; h < H; ++h) {
            const double e = rel_l2(got.data() + static_cast<size_t>(h) * d, ref.data() + static_cast<size_t>(h) * d,
                                    static_cast<size_t>(d));
            w = std::max(w, std::isnan(e) ? INFINITY : e);
        }
        return w;
    }

    void run(const mma_case &c) {
        SCOPED_TRACE(std::string(c.what) + " pos " + std::to_string(c.pos));
        const mma_setup u = build(c);
        const auto o_new = launch(u, c.pos, path::tc), o_old = launch(u, c.pos, path::f32);
        const auto o_again = launch(u, c.pos, path::tc);
        const auto o_fused = launch(u, c.pos, path::fused), o_fused2 = launch(u, c.pos, path::fused);
        for (float v : o_new) ASSERT_TRUE(std::isfinite(v)) << "non-finite output";
        const double vs_old = worst_head(o_new, o_old, c.n_head, c.d);
        const double vs_cpu = rel_l2(o_new.data(), u.ref.data(), o_new.size());
        const double old_cpu = rel_l2(o_old.data(), u.ref.data(), o_old.size());
        EXPECT_LE(vs_old, 1e-5);
        EXPECT_LE(vs_cpu, 1e-5);
        EXPECT_EQ(std::memcmp(o_new.data(), o_again.data(), o_new.size() * 4), 0) << "not deterministic";
        // the folded combine runs the combine kernel's code on the same partials: the same bits (NaN
        // included: a missed item stays poisoned and differs)
        EXPECT_EQ(std::memcmp(o_fused.data(), o_new.data(), o_new.size() * 4), 0) << "fused combine differs";
        EXPECT_EQ(std::memcmp(o_fused2.data(), o_new.data(), o_new.size() * 4), 0) << "fused combine, 2nd call";
        worst_ = std::max(worst_, vs_old);
        std::printf("  %-34s pos %8lld: %5lld rows (%2lld busy splits), per-head vs f32 kernel %.3g, vs CPU %.3g "
                    "(f32 kernel %.3g)\n",
                    c.what, static_cast<long long>(c.pos), static_cast<long long>(u.n_rows),
                    static_cast<long long>(busy_splits(u.a, u.n_rows)), vs_old, vs_cpu, old_cpu);
    }

    int64_t *pos_ = nullptr;
    ds4::rope_table tab_;
    cd::rope_args rope_;
    std::mt19937 rng_{20261201};
    double worst_ = 0;
};

}  // namespace fathom::cuda_test::ds4_attn_mma_suite
