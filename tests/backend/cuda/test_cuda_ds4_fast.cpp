// The DS4 decode kernels tuned for latency (src/backend/cuda/ds4_hc.cu: row-per-block mixer with
// 16-byte loads, register Sinkhorn in its own block; ds4_indexer.cu: CPU-ordered 64 x 128 scoring,
// cluster radix top-k) against the CPU reference functions of src/models, on shapes the older suites
// (test_cuda_ds4.cpp, test_cuda_ds4_attn.cpp) do not reach: every n_hc, odd widths and unaligned
// mixer rows, HC head, repeated calls (determinism), indexer row sets large enough for the cluster
// top-k, heavy score ties across cluster blocks, and the other scoring geometry.
//   CudaDs4Fast.*      correctness (skipped without a device); device outputs NaN-poisoned first
// Benchmarks (hc_pre at D 4096, indexer top-k at 2048 / 8192 / 32768 rows by graph replay):
// bench/cuda/bench_ds4_fast.cpp (bench_cuda_kernels).
// The indexer's 64 x 128 scores repeat dot_f32's summation order: they are compared bit for bit with
// the CPU's. The HC outputs use the CPU's f32 operations but a different double summation order for
// the mixer: relative L2 <= 1e-5 (and the bit-exact share is printed).
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
#include "ds4_fast_fixture.h"

namespace fathom {
namespace {

using namespace cuda_test::ds4_fast_suite;

namespace cd = cuda::ds4;

using cuda_test::randn;
using cuda_test::rel_l2;
using cuda_test::time_graph;

size_t bit_exact(const std::vector<float> &a, const std::vector<float> &b) {
    size_t k = 0;
    for (size_t i = 0; i < std::min(a.size(), b.size()); ++i) k += std::memcmp(&a[i], &b[i], 4) == 0;
    return k;
}

// Mixer rows [n_mix, S] of type ft, `pad` bytes of 0xFF after each row (pad 2 with f16 rows makes
// every other row start off a 16-byte boundary: the element-wise load path).
struct mixer {
    std::vector<uint8_t> bytes;
    size_t stride = 0;
    ds4::hc_weights w;
};
mixer make_mixer(dtype ft, int n_mix, int64_t S, size_t pad, int n_scale, std::mt19937 &rng) {
    mixer m;
    const size_t rb = dtype_row_bytes(ft, S);
    m.stride = rb + pad;
    m.bytes.assign(m.stride * static_cast<size_t>(n_mix), 0xFF);
    const auto f = randn(static_cast<size_t>(n_mix * S), rng, 4.0f / std::sqrt(static_cast<float>(S)));
    for (int r = 0; r < n_mix; ++r) cpu::quantize_row(ft, f.data() + r * S, m.bytes.data() + r * m.stride, S);
    m.w.fn = {ft, m.bytes.data(), n_mix, S, m.stride};
    m.w.base = randn(static_cast<size_t>(n_mix), rng, 0.5f);
    m.w.scale = randn(static_cast<size_t>(n_scale), rng, 1.0f);
    return m;
}

// HC pre for every n_hc (1..5, each its own Sinkhorn specialisation), widths with a tail (D * n_hc
// not a multiple of 8), aligned and unaligned mixer rows, f32 and f16; the same call twice must give
// the same bits.
TEST_F(CudaDs4Fast, HcPreEveryWidthMatchesCpu) {
    struct hc_case {
        int n_hc;
        int64_t D;
        dtype ft;
        size_t pad;
    };
    const hc_case cases[] = {{1, 64, dtype::f32, 0},   {2, 333, dtype::f16, 2},  {3, 1000, dtype::f16, 0},
                             {4, 4096, dtype::f16, 2}, {4, 4096, dtype::f32, 4}, {5, 777, dtype::f32, 0},
                             {4, 257, dtype::f16, 0},  {4, 971, dtype::f32, 0}};
    for (const hc_case &c : cases) {
        SCOPED_TRACE("n_hc " + std::to_string(c.n_hc) + " D " + std::to_string(c.D) + " " +
                     std::string(dtype_name(c.ft)) + " pad " + std::to_string(c.pad));
        ds4::hparams hp;
        hp.n_hc = c.n_hc;
        hp.n_embd = static_cast<int>(c.D);
        hp.sinkhorn_iters = 20;
        hp.hc_eps = 1e-6f;
        hp.rms_eps = 1e-6f;
        const int n = c.n_hc, n_mix = (2 + n) * n;
        const int64_t S = n * c.D;
        const mixer m = make_mixer(c.ft, n_mix, S, c.pad, 3, rng_);
        const auto x = randn(static_cast<size_t>(S), rng_, 2.0f);
        std::vector<float> u(static_cast<size_t>(c.D)), post(static_cast<size_t>(n)), comb(static_cast<size_t>(n * n));
        ds4::hc_pre(hp, m.w, x.data(), u.data(), post.data(), comb.data());

        const uint8_t *fn = up(m.bytes);
        const float *xd = up(x), *bd = up(m.w.base), *sd = up(m.w.scale);
        float *mix = poisoned(static_cast<size_t>(n_mix + 1)), *ud = poisoned(static_cast<size_t>(c.D)),
              *pd = poisoned(static_cast<size_t>(n)), *cdv = poisoned(static_cast<size_t>(n * n));
        const cd::hc_params p{n, c.D, hp.sinkhorn_iters, hp.hc_eps, hp.rms_eps};
        std::vector<float> first[3];
        for (int rep = 0; rep < 2; ++rep) {
            if (rep == 1) {
                poison(ud, static_cast<size_t>(c.D));
                poison(pd, static_cast<size_t>(n));
                poison(cdv, static_cast<size_t>(n * n));
            }
            cd::launch_hc_pre(p, c.ft, fn, m.stride, bd, sd, xd, mix, ud, pd, cdv, s_);
            const auto gu = down(ud, static_cast<size_t>(c.D)), gp = down(pd, static_cast<size_t>(n)),
                       gc = down(cdv, static_cast<size_t>(n * n));
            if (rep == 0) {
                EXPECT_LE(rel_l2(gu, u), 1e-5);
                EXPECT_LE(rel_l2(gp, post), 1e-5);
                EXPECT_LE(rel_l2(gc, comb), 1e-5);
                std::printf("  hc_pre n_hc %d D %4lld %s pad %zu: u %zu/%zu post %zu/%zu comb %zu/%zu bit-exact\n", n,
                            static_cast<long long>(c.D), std::string(dtype_name(c.ft)).c_str(), c.pad,
                            bit_exact(gu, u), u.size(), bit_exact(gp, post), post.size(), bit_exact(gc, comb),
                            comb.size());
                first[0] = gu, first[1] = gp, first[2] = gc;
            } else {
                EXPECT_EQ(bit_exact(gu, first[0]), gu.size()) << "u differs between two identical calls";
                EXPECT_EQ(bit_exact(gp, first[1]), gp.size());
                EXPECT_EQ(bit_exact(gc, first[2]), gc.size());
            }
        }
    }
}

// HC head (spec 3.4) vs ds4::hc_head at the Flash width and an odd one.
TEST_F(CudaDs4Fast, HcHeadMatchesCpu) {
    for (int64_t D : {int64_t{4096}, int64_t{301}}) {
        for (dtype ft : {dtype::f16, dtype::f32}) {
            SCOPED_TRACE("D " + std::to_string(D) + " " + std::string(dtype_name(ft)));
            ds4::hparams hp;
            hp.n_hc = 4;
            hp.n_embd = static_cast<int>(D);
            hp.hc_eps = 1e-6f;
            hp.rms_eps = 1e-6f;
            const int n = hp.n_hc;
            const int64_t S = n * D;
            const mixer m = make_mixer(ft, n, S, 0, 1, rng_);
            const auto x = randn(static_cast<size_t>(S), rng_, 2.0f);
            std::vector<float> z(static_cast<size_t>(D));
            ds4::hc_head(hp, m.w, x.data(), z.data());
            float *mix = poisoned(static_cast<size_t>(n + 1)), *zd = poisoned(static_cast<size_t>(D));
            const cd::hc_params p{n, D, 0, hp.hc_eps, hp.rms_eps};
            cd::launch_hc_head(p, ft, up(m.bytes), m.stride, up(m.w.base), up(m.w.scale), up(x), mix, zd, s_);
            const auto gz = down(zd, static_cast<size_t>(D));
            EXPECT_LE(rel_l2(gz, z), 1e-5);
            std::printf("  hc_head D %lld %s: %zu/%zu bit-exact\n", static_cast<long long>(D),
                        std::string(dtype_name(ft)).c_str(), bit_exact(gz, z), z.size());
        }
    }
}

// The CPU's indexer scores (indexer_select's loop): score_c = sum_h ws_h * max(0, dot_f32(q_h, K_c)).
std::vector<float> cpu_scores(const std::vector<float> &q, const std::vector<float> &ws, const ds4::row_store &rs,
                              int64_t n, int H, int Dh) {
    std::vector<float> sc(static_cast<size_t>(n)), k(static_cast<size_t>(Dh));
    for (int64_t c = 0; c < n; ++c) {
        rs.get(c, k.data());
        float s = 0;
        for (int h = 0; h < H; ++h)
            s += ws[static_cast<size_t>(h)] * std::max(0.0f, ds4::dot_f32(q.data() + static_cast<int64_t>(h) * Dh,
                                                                            k.data(), Dh));
        sc[static_cast<size_t>(c)] = s;
    }
    return sc;
}

struct idx_rows {
    std::vector<float> rows;  // [n, Dh] as stored (f16-rounded when f16)
    ds4::row_store rs;
    const void *dev = nullptr;
    size_t stride = 0;
};

// Device-counted top-k (n = (pos + 1) / 4) with max_n large enough for the cluster top-k: n from 0
// through top-k to max_n, f16 and f32 rows; `distinct` > 0 draws the rows from that many distinct
// rows (heavy exact ties spanning the cluster's row ranges). For 64 x 128 the score scratch must hold
// the CPU's score bits (checked up to 25000 rows).
void run_topk_case(CudaDs4Fast &t, std::mt19937 &rng, int H, int Dh, int64_t max_n, int distinct, bool f16,
                   const std::vector<int64_t> &positions, bool zero_rows = false) {
    const int topk = 512, ratio = 4;
    const float w_scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(Dh) * H));
    idx_rows ir;
    auto base = randn(static_cast<size_t>(std::max(distinct, 1)) * Dh, rng);
    ir.rows = zero_rows ? std::vector<float>(static_cast<size_t>(max_n * Dh), 0.0f) : randn(static_cast<size_t>(max_n * Dh), rng);
    if (distinct > 0 && !zero_rows) {
        std::uniform_int_distribution<int> pick(0, distinct - 1);
        for (int64_t c = 0; c < max_n; ++c) std::copy_n(base.begin() + pick(rng) * Dh, Dh, ir.rows.begin() + c * Dh);
    }
    if (f16)
        for (float &x : ir.rows) x = cpu::f16_to_f32(cpu::f32_to_f16(x));
    ir.rs = ds4::row_store(Dh, f16 ? kv_precision::f16 : kv_precision::f32);
    ir.rs.resize(max_n);
    for (int64_t c = 0; c < max_n; ++c) ir.rs.set(c, ir.rows.data() + c * Dh);
    ir.stride = static_cast<size_t>(Dh) * (f16 ? 2 : 4);
    if (f16) {
        std::vector<uint16_t> h(ir.rows.size());
        for (size_t i = 0; i < h.size(); ++i) h[i] = cpu::f32_to_f16(ir.rows[i]);
        ir.dev = t.up(h);
    } else {
        ir.dev = t.up(ir.rows);
    }
    float *score = t.poisoned(static_cast<size_t>(max_n));
    int32_t *sel = t.dev<int32_t>(topk), *n_sel = t.dev<int32_t>(1);
    for (int64_t pos : positions) {
        const int64_t n = (pos + 1) / ratio;
        SCOPED_TRACE(std::string(f16 ? "f16" : "f32") + " " + std::to_string(H) + "x" + std::to_string(Dh) +
                     " distinct " + std::to_string(distinct) + " n " + std::to_string(n));
        const auto q = randn(static_cast<size_t>(H * Dh), rng);
        auto w = randn(static_cast<size_t>(H), rng);
        if (zero_rows) w.assign(w.size(), 1.0f);
        std::vector<float> ws(w.size());
        for (size_t h = 0; h < w.size(); ++h) ws[h] = w[h] * w_scale;
        const auto ref = ds4::indexer_select(q.data(), ws.data(), ir.rs, n, H, Dh, topk);
        t.put(sel, std::vector<int32_t>(topk, -7));
        t.put(n_sel, std::vector<int32_t>{-1});
        t.poison(score, static_cast<size_t>(max_n));
        t.set_pos(pos);
        cd::launch_indexer_topk(t.up(q), t.up(w), w_scale, ir.dev, f16, ir.stride, ratio, max_n, H, Dh, topk, t.pos_,
                                score, sel, n_sel, t.s_);
        const int32_t m = t.down(n_sel, 1)[0];
        ASSERT_EQ(m, static_cast<int32_t>(std::min<int64_t>(n, topk)));
        const auto got = t.down(sel, topk);
        EXPECT_EQ(std::vector<int64_t>(got.begin(), got.begin() + m), ref);
        for (int i = m; i < topk; ++i) ASSERT_EQ(got[static_cast<size_t>(i)], -7) << "sel[" << i << "] written";
        if (H == 64 && Dh == 128 && n > topk && n <= 25000) {  // (the CPU's scores cost ~1 s per 25000 rows)
            const auto want = cpu_scores(q, ws, ir.rs, n, H, Dh);
            const auto have = t.down(score, static_cast<size_t>(n));
            EXPECT_EQ(bit_exact(have, want), want.size()) << "64 x 128 scores are not the CPU's bits";
        }
    }
}

TEST_F(CudaDs4Fast, IndexerClusterTopkMatchesCpu) {
    const std::vector<int64_t> positions = {2, 2047, 2051, 2055, 16383, 16387, 65535, 99999, 159999};
    for (bool f16 : {true, false}) run_topk_case(*this, rng_, 64, 128, 40000, 0, f16, positions);
    std::printf("  indexer cluster top-k: n = 0 .. 40000, f16 and f32 rows: selections and scores identical\n");
}

// Few distinct rows: thousands of exactly equal scores, the threshold key shared across blocks.
TEST_F(CudaDs4Fast, IndexerHeavyTiesMatchCpu) {
    run_topk_case(*this, rng_, 64, 128, 40000, 300, true, {159999, 70001});
    run_topk_case(*this, rng_, 64, 128, 3000, 40, false, {11999, 4000});
    run_topk_case(*this, rng_, 64, 128, 20000, 0, true, {79999}, true);  // all scores 0: rows 0 .. 511
    std::printf("  indexer ties: 300 / 40 distinct rows and all-zero scores: selections identical\n");
}

// Geometries other than 64 x 128 (the warp-per-row scoring kernel) with both top-k launch shapes.
TEST_F(CudaDs4Fast, IndexerOtherGeometryMatchesCpu) {
    run_topk_case(*this, rng_, 12, 96, 30000, 0, true, {7, 4000, 119999});
    run_topk_case(*this, rng_, 128, 64, 2500, 0, false, {9999, 2100});
    std::printf("  indexer 12 x 96 and 128 x 64: selections identical\n");
}

}  // namespace
}  // namespace fathom
