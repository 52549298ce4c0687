// DS4 chunked-prefill indexer top-k and sparse sink attention on CUDA (launch_indexer_topk_batch in
// ds4_indexer.cu, launch_sparse_sink_attention_batch in ds4_attn_prefill.cu; contract ds4_prefill.h)
// against the per-token decode launchers (launch_indexer_topk, launch_sparse_sink_attention, which
// test_cuda_ds4_attn.cpp checks against the CPU) called token by token on identical inputs, each with
// its own device position *pos + t.
//   Indexer: selections and counts must be identical (the scores are the same code's bits); outputs
//   are pre-filled with sentinels and compared whole, so a write past n_sel or a missing one fails.
//   Attention: relative L2 <= 1e-5 per token (f32 re-association only). The decode reference sees the
//   ring as the decode steps leave it (chunk rows stored one by one); the batch sees the ring before
//   the chunk plus the chunk rows. Ring slots never written, compressed rows not visible / not chosen
//   and the score scratch are NaN, and outputs are NaN-poisoned, so a wrong row or an unwritten
//   element fails the check. All tests skip without a CUDA device.
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
#include "ds4_prefill_attn_fixture.h"

namespace fathom {
namespace {

using namespace cuda_test::ds4_prefill_attn_suite;

namespace cd = cuda::ds4;

using cuda_test::randn;
using cuda_test::rel_l2;

// ---- indexer top-k ---------------------------------------------------------------------------------------

}  // namespace

namespace cuda_test::ds4_prefill_attn_suite {

void CudaDs4PrefillAttn::run_indexer(const idx_case &c) {
    const int ratio = 4;
    SCOPED_TRACE(std::to_string(c.H) + "x" + std::to_string(c.Dh) + (c.f16 ? " f16" : " f32") + " max_n " +
                 std::to_string(c.max_n) + " p0 " + std::to_string(c.p0) + " n_tok " + std::to_string(c.n_tok) +
                 " group " + std::to_string(c.group));
    auto rows = randn(static_cast<size_t>(c.max_n * c.Dh), rng_);
    for (int64_t r = 1; r < c.max_n; r += 7)  // duplicated rows: exact score ties (the lower row wins)
        std::copy_n(rows.begin() + (r - 1) * c.Dh, c.Dh, rows.begin() + r * c.Dh);
    const size_t stride = static_cast<size_t>(c.Dh) * (c.f16 ? 2 : 4);
    const uint8_t *rd = up(pack_rows(rows, c.Dh, c.f16, stride));
    const float *q = up(randn(static_cast<size_t>(c.n_tok * c.H * c.Dh), rng_));
    const float *w = up(randn(static_cast<size_t>(c.n_tok * c.H), rng_));
    const float w_scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(c.Dh) * c.H));
    const size_t n_out = static_cast<size_t>(c.n_tok * c.topk);

    // Reference: the decode launcher per token, at its own device position.
    const int64_t *ppos = positions(c.p0, c.n_tok);
    float *score_ref = poisoned(static_cast<size_t>(std::max<int64_t>(c.max_n, 1)));
    int32_t *sel_ref = up(std::vector<int32_t>(n_out, -7));
    int32_t *nsel_ref = up(std::vector<int32_t>(static_cast<size_t>(c.n_tok), -1));
    for (int64_t t = 0; t < c.n_tok; ++t)
        cd::launch_indexer_topk(q + t * c.H * c.Dh, w + t * c.H, w_scale, rd, c.f16, stride, ratio, c.max_n, c.H, c.Dh,
                                c.topk, ppos + t, score_ref, sel_ref + t * c.topk, nsel_ref + t, s_);

    const size_t score_floats = static_cast<size_t>((c.group ? c.group : c.n_tok) * c.max_n);
    float *score = poisoned(std::max<size_t>(score_floats, 1));
    int32_t *sel = up(std::vector<int32_t>(n_out, -7));
    int32_t *nsel = up(std::vector<int32_t>(static_cast<size_t>(c.n_tok), -1));
    cd::launch_indexer_topk_batch(q, w, w_scale, rd, c.f16, stride, ratio, c.max_n, c.H, c.Dh, c.topk, c.n_tok,
                                  positions(c.p0, 1), score, score_floats, sel, nsel, s_);

    const auto nr = down(nsel_ref, static_cast<size_t>(c.n_tok)), nb = down(nsel, static_cast<size_t>(c.n_tok));
    const auto sr = down(sel_ref, n_out), sb = down(sel, n_out);
    int64_t above = 0;  // tokens whose selection is a real top-k (more rows than topk)
    for (int64_t t = 0; t < c.n_tok; ++t) {
        const int64_t n = std::min<int64_t>((c.p0 + t + 1) / ratio, c.max_n);
        ASSERT_EQ(nr[static_cast<size_t>(t)], static_cast<int32_t>(std::min<int64_t>(n, c.topk))) << "token " << t;
        ASSERT_EQ(nb[static_cast<size_t>(t)], nr[static_cast<size_t>(t)]) << "token " << t;
        above += n > c.topk;
        for (int i = 0; i < c.topk; ++i) {
            const size_t k = static_cast<size_t>(t * c.topk + i);
            ASSERT_EQ(sb[k], sr[k]) << "token " << t << " sel[" << i << "]";
        }
    }
    std::printf("  indexer batch %dx%d %s p0 %lld n_tok %lld: identical (%lld tokens with n > top-k %d)\n", c.H,
                c.Dh, c.f16 ? "f16" : "f32", static_cast<long long>(c.p0), static_cast<long long>(c.n_tok),
                static_cast<long long>(above), c.topk);
}

}  // namespace cuda_test::ds4_prefill_attn_suite

namespace {

// DS4 geometry (64 x 128, the CPU-order kernel), top-k 512: rows fewer than top-k, crossing exactly
// top-k, more, capped at max_n; the score scratch in groups of 3 tokens (last group partial).
TEST_F(CudaDs4PrefillAttn, IndexerBatchMatchesDecodeDs4) {
    for (bool f16 : {true, false}) {
        run_indexer({64, 128, 512, f16, 3000, 0, 200});     // n = 0 .. 50
        run_indexer({64, 128, 512, f16, 3000, 2040, 20});   // n = 510 .. 515: exactly 512 at p = 2047
        run_indexer({64, 128, 512, f16, 3000, 5001, 37, 3});  // n ~ 1250, groups of 3
        run_indexer({64, 128, 512, f16, 3000, 11995, 9});   // n = 2999, then capped at 3000
    }
}

// Row sets above the cluster threshold (4096): a small batch takes the cluster top-k, a large one the
// single-block top-k; both must give the decode (cluster) selection.
TEST_F(CudaDs4PrefillAttn, IndexerBatchClusterAndBlockTopk) {
    run_indexer({64, 128, 512, true, 6000, 20000, 3});
    run_indexer({64, 128, 512, false, 6000, 20000, 64});
    run_indexer({64, 128, 512, true, 6000, 20000, 64, 10});
}

// Another geometry (the warp-per-row score kernel): 16 heads x 64 dims, top-k 32, n crossing 32.
TEST_F(CudaDs4PrefillAttn, IndexerBatchMatchesDecodeOtherGeometry) {
    for (bool f16 : {true, false}) {
        run_indexer({16, 64, 32, f16, 200, 100, 50, 7});  // n = 25 .. 37
        run_indexer({16, 64, 32, f16, 30, 100, 20});      // max_n 30 <= top-k: no scores needed
    }
}

// The tensor-core scores of prefill (exact = false): against host scores in double, every token's
// selection may differ from the exact one only at near-ties: a row chosen by one path and not the other
// scores within 1e-5 (relative) of the k-th best score. Exact ties (duplicated rows) still go to the
// lower row; tokens with fewer rows than top-k take them all; a group size below n_tok is used.
TEST_F(CudaDs4PrefillAttn, IndexerFastScoresDifferOnlyAtNearTies) {
    const int H = 64, Dh = 128, topk = 512, ratio = 4;
    for (const auto &[max_n, p0, n_tok, group] :
         {std::tuple<int64_t, int64_t, int64_t, int64_t>{6000, 16001, 21, 8}, {3000, 1900, 300, 0}}) {
        SCOPED_TRACE("p0 " + std::to_string(p0) + " n_tok " + std::to_string(n_tok));
        auto rows = randn(static_cast<size_t>(max_n * Dh), rng_);
        for (int64_t r = 1; r < max_n; r += 7) std::copy_n(rows.begin() + (r - 1) * Dh, Dh, rows.begin() + r * Dh);
        const size_t stride = static_cast<size_t>(Dh) * 2;
        const auto packed = pack_rows(rows, Dh, true, stride);
        const uint8_t *rd = up(packed);
        const auto qh = randn(static_cast<size_t>(n_tok * H * Dh), rng_), wh = randn(static_cast<size_t>(n_tok * H), rng_);
        const float *q = up(qh), *w = up(wh);
        const float w_scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(Dh) * H));
        const size_t n_out = static_cast<size_t>(n_tok * topk), score_floats = static_cast<size_t>((group ? group : n_tok) * max_n);
        std::vector<std::vector<int32_t>> got(2);
        std::vector<int32_t> counts;
        for (int fast = 0; fast < 2; ++fast) {
            int32_t *sel = up(std::vector<int32_t>(n_out, -7)), *nsel = up(std::vector<int32_t>(static_cast<size_t>(n_tok), -1));
            cd::launch_indexer_topk_batch(q, w, w_scale, rd, true, stride, ratio, max_n, H, Dh, topk, n_tok,
                                          positions(p0, 1), poisoned(score_floats), score_floats, sel, nsel, s_, fast == 0);
            got[static_cast<size_t>(fast)] = down(sel, n_out);
            counts = down(nsel, static_cast<size_t>(n_tok));
        }
        // host rows as stored (f16) and exact scores in double
        std::vector<float> kf(static_cast<size_t>(max_n * Dh));
        for (size_t i = 0; i < kf.size(); ++i) {
            uint16_t h;
            std::memcpy(&h, &packed[i * 2], 2);
            kf[i] = cpu::f16_to_f32(h);
        }
        int64_t differ = 0, above = 0;
        for (int64_t t = 0; t < n_tok; ++t) {
            const int64_t n = std::min<int64_t>((p0 + t + 1) / ratio, max_n);
            ASSERT_EQ(counts[static_cast<size_t>(t)], static_cast<int32_t>(std::min<int64_t>(n, topk)));
            const auto *a = &got[0][static_cast<size_t>(t * topk)], *b = &got[1][static_cast<size_t>(t * topk)];
            if (n <= topk) {
                for (int64_t i = 0; i < n; ++i) ASSERT_EQ(b[i], static_cast<int32_t>(i));
                continue;
            }
            ++above;
            std::vector<double> sc(static_cast<size_t>(n));
            for (int64_t c = 0; c < n; ++c) {
                double sum = 0;
                for (int h = 0; h < H; ++h) {
                    double dot = 0;
                    for (int j = 0; j < Dh; ++j)
                        dot += static_cast<double>(qh[static_cast<size_t>((t * H + h) * Dh + j)]) * kf[static_cast<size_t>(c * Dh + j)];
                    sum += static_cast<double>(wh[static_cast<size_t>(t * H + h)]) * w_scale * std::max(0.0, dot);
                }
                sc[static_cast<size_t>(c)] = sum;
            }
            std::vector<double> sorted = sc;
            std::nth_element(sorted.begin(), sorted.begin() + (topk - 1), sorted.end(), std::greater<double>());
            const double kth = sorted[static_cast<size_t>(topk - 1)];
            const std::vector<int32_t> sa(a, a + topk), sb(b, b + topk);
            ASSERT_TRUE(std::is_sorted(sb.begin(), sb.end()));
            std::vector<int32_t> only;
            std::set_symmetric_difference(sa.begin(), sa.end(), sb.begin(), sb.end(), std::back_inserter(only));
            differ += static_cast<int64_t>(only.size());
            for (int32_t r : only)
                EXPECT_LE(std::abs(sc[static_cast<size_t>(r)] - kth), 1e-5 * std::abs(kth) + 1e-12)
                    << "token " << t << " row " << r << " (not a near-tie)";
        }
        std::printf("  fast indexer scores: %lld tokens with a real top-k, %lld rows differ from the exact selection\n",
                    static_cast<long long>(above), static_cast<long long>(differ));
    }
}

// ---- sparse sink attention -------------------------------------------------------------------------------

}  // namespace

namespace cuda_test::ds4_prefill_attn_suite {

void CudaDs4PrefillAttn::run_attn(const attn_case &c) {
    const int H = c.H, d = c.d, W = c.W;
    const char *mode = c.mode == cd::comp_mode::none ? "none" : c.mode == cd::comp_mode::all ? "all" : "list";
    SCOPED_TRACE(std::to_string(H) + "x" + std::to_string(d) + " " + mode + " p0 " + std::to_string(c.p0) +
                 " n_tok " + std::to_string(c.n_tok) + (c.ring_f16 ? " ring f16" : " ring f32") +
                 (c.comp_f16 ? " comp f16" : " comp f32"));
    const size_t elem = c.ring_f16 ? 2 : 4;
    const int64_t n_tok = c.n_tok, p_last = c.p0 + n_tok - 1;
    // The ring before the chunk: position r < p0 at slot r mod W; slots never written are NaN.
    auto ring = randn(static_cast<size_t>(W * d), rng_);
    for (int64_t slot = c.p0; slot < W; ++slot) std::fill_n(ring.begin() + slot * d, d, std::nanf(""));
    const auto chunk = randn(static_cast<size_t>(n_tok * d), rng_);

    // Compressed rows; per-token sorted lists (list mode, sel_stride = max_comp + 3, -1 past n_sel).
    std::vector<float> comp;
    const int64_t sel_stride = c.max_comp + 3;
    std::vector<int32_t> sel(static_cast<size_t>(n_tok * sel_stride), -1), n_sel(static_cast<size_t>(n_tok), 0);
    if (c.mode != cd::comp_mode::none) {
        comp = randn(static_cast<size_t>(c.n_comp_rows * d), rng_);
        std::vector<char> used(static_cast<size_t>(c.n_comp_rows), 0);
        if (c.mode == cd::comp_mode::all) {
            const int64_t n = std::min({(p_last + 1) / c.ratio, c.max_comp, c.n_comp_rows});
            std::fill_n(used.begin(), n, 1);
        } else {
            for (int64_t t = 0; t < n_tok; ++t) {
                const int64_t vis = std::min<int64_t>((c.p0 + t + 1) / c.ratio, c.n_comp_rows);
                std::vector<int32_t> all(static_cast<size_t>(vis));
                std::iota(all.begin(), all.end(), 0);
                std::shuffle(all.begin(), all.end(), rng_);
                all.resize(static_cast<size_t>(std::min<int64_t>(vis, c.max_comp)));
                std::sort(all.begin(), all.end());
                std::copy(all.begin(), all.end(), sel.begin() + t * sel_stride);
                n_sel[static_cast<size_t>(t)] = static_cast<int32_t>(all.size());
                for (int32_t r : all) used[static_cast<size_t>(r)] = 1;
            }
        }
        for (int64_t r = 0; r < c.n_comp_rows; ++r)
            if (!used[static_cast<size_t>(r)]) std::fill_n(comp.begin() + r * d, d, std::nanf(""));
    }
    const float *q = up(randn(static_cast<size_t>(n_tok * H * d), rng_));
    auto sinks = randn(static_cast<size_t>(H), rng_);
    sinks[0] = 6.0f;  // a sink that dominates its head

    cd::sparse_attn_args a;
    a.n_head = H;
    a.d = d;
    a.scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(d)));
    a.sinks = up(sinks);
    a.ring_f16 = c.ring_f16;
    a.ring_stride = static_cast<size_t>(d) * elem + 16;
    a.window = W;
    a.mode = c.mode;
    if (c.mode != cd::comp_mode::none) {
        a.comp_f16 = c.comp_f16;
        a.comp_stride = static_cast<size_t>(d) * (c.comp_f16 ? 2 : 4);
        a.comp = up(pack_rows(comp, d, c.comp_f16, a.comp_stride));
        a.ratio = c.ratio;
        a.max_comp = c.max_comp;
    }
    const int32_t *sel_d = up(sel), *nsel_d = up(n_sel);
    a.rope = rope(c.n_rot);
    const size_t hd = static_cast<size_t>(H) * d;

    // Reference: the decode launcher per token over the ring the decode steps leave (chunk row t stored
    // at slot (p0 + t) mod W before token t's step).
    cd::sparse_attn_args ar = a;
    uint8_t *ring_ref = static_cast<uint8_t *>(raw(static_cast<size_t>(W) * a.ring_stride));
    ar.ring = ring_ref;
    const int64_t *ppos = positions(c.p0, n_tok);
    float *part_ref = poisoned(cd::attn_part_floats(ar)), *o_ref = poisoned(static_cast<size_t>(n_tok) * hd);
    auto hr = ring;
    for (int64_t t = 0; t < n_tok; ++t) {
        const int64_t slot = (c.p0 + t) % W;
        std::copy_n(chunk.begin() + t * d, d, hr.begin() + slot * d);
        CK(cudaStreamSynchronize(s_));  // the previous step has read the ring
        put(ring_ref, pack_rows(hr, d, c.ring_f16, a.ring_stride));
        if (c.mode == cd::comp_mode::list) {
            ar.sel = sel_d + t * sel_stride;
            ar.n_sel = nsel_d + t;
        }
        cd::launch_sparse_sink_attention(ar, q + t * static_cast<int64_t>(hd), ppos + t, part_ref,
                                         o_ref + t * static_cast<int64_t>(hd), s_);
    }

    // Batch: the ring before the chunk plus the chunk rows.
    a.ring = up(pack_rows(ring, d, c.ring_f16, a.ring_stride));
    if (c.mode == cd::comp_mode::list) {
        a.sel = sel_d;
        a.n_sel = nsel_d;
    }
    const size_t chunk_stride = static_cast<size_t>(d) * elem + c.chunk_pad;
    const uint8_t *chunk_d = up(pack_rows(chunk, d, c.ring_f16, chunk_stride));
    const size_t part_n = cd::attn_batch_part_floats(a, n_tok);
    float *part = part_n ? poisoned(part_n) : nullptr, *o = poisoned(static_cast<size_t>(n_tok) * hd);
    cd::launch_sparse_sink_attention_batch(a, chunk_d, chunk_stride, n_tok, static_cast<int>(sel_stride), q,
                                           positions(c.p0, 1), part, o, s_);

    const auto ref = down(o_ref, static_cast<size_t>(n_tok) * hd), got = down(o, static_cast<size_t>(n_tok) * hd);
    double worst = 0;
    for (int64_t t = 0; t < n_tok; ++t) {
        const double e = rel_l2(got.data() + t * hd, ref.data() + t * hd, hd);
        ASSERT_LE(e, 1e-5) << "token " << t << " (position " << c.p0 + t << ")";
        worst = std::max(worst, e);
    }
    std::printf("  attention batch %dx%d %s p0 %lld n_tok %lld (%s): worst rel L2 %.3g\n", H, d, mode,
                static_cast<long long>(c.p0), static_cast<long long>(n_tok),
                part_n                                         ? "split"
                : c.ring_f16 && (c.comp_f16 || c.mode == cd::comp_mode::none) ? "tensor cores"
                                                                              : "direct",
                worst);
}

}  // namespace cuda_test::ds4_prefill_attn_suite

namespace {

// DS4 geometry: 64 heads x 512 dims, 64 RoPE dims, window 128. n_tok 1 and 7 take the split path,
// 200 the direct one.
TEST_F(CudaDs4PrefillAttn, AttentionBatchWindowOnly) {
    run_attn({64, 512, 64, 128, cd::comp_mode::none, true, true, 0, 0, 0, 0, 7});     // chunk at 0
    run_attn({64, 512, 64, 128, cd::comp_mode::none, false, true, 0, 0, 0, 0, 200});  // > window, from 0
    run_attn({64, 512, 64, 128, cd::comp_mode::none, true, true, 0, 0, 0, 1000, 200});  // ring rows needed
    run_attn({64, 512, 64, 128, cd::comp_mode::none, false, true, 0, 0, 0, 300, 1});
    run_attn({64, 512, 64, 128, cd::comp_mode::none, true, true, 0, 0, 0, 1000, 7, 2});  // unaligned chunk rows
    run_attn({64, 512, 64, 128, cd::comp_mode::none, false, true, 0, 0, 0, 77, 40, 4});  // p0 < window
}

TEST_F(CudaDs4PrefillAttn, AttentionBatchAllCompressedRows) {
    run_attn({64, 512, 64, 128, cd::comp_mode::all, true, true, 128, 8192, 64, 0, 200});     // first row at p 127
    run_attn({64, 512, 64, 128, cd::comp_mode::all, false, false, 128, 8192, 64, 5000, 200});
    run_attn({64, 512, 64, 128, cd::comp_mode::all, true, false, 128, 8192, 300, 33000, 7});  // f32 tile
    run_attn({64, 512, 64, 128, cd::comp_mode::all, true, true, 4, 512, 1024, 2040, 20});     // capped at 512
}

TEST_F(CudaDs4PrefillAttn, AttentionBatchSelectedRows) {
    run_attn({64, 512, 64, 128, cd::comp_mode::list, true, true, 4, 512, 64, 60, 7});        // p < window
    run_attn({64, 512, 64, 128, cd::comp_mode::list, false, true, 4, 512, 1024, 3001, 200});  // 512 of ~750
    run_attn({64, 512, 64, 128, cd::comp_mode::list, true, true, 4, 512, 64, 0, 200});
    run_attn({64, 512, 64, 128, cd::comp_mode::list, true, false, 4, 512, 2048, 5000, 1});
    run_attn({64, 512, 64, 128, cd::comp_mode::list, true, true, 4, 512, 1024, 3001, 200});  // tensor cores
    run_attn({64, 512, 64, 128, cd::comp_mode::list, true, true, 4, 512, 1024, 4099, 130, 2});  // unaligned
}

// A smaller geometry: 12 heads (a partial head group) x 128 dims, 32 RoPE dims, window 32; n_tok 520
// reaches the direct path with one head group; 4 heads x 64 dims (window 16, 8 selected rows).
TEST_F(CudaDs4PrefillAttn, AttentionBatchOtherGeometry) {
    run_attn({12, 128, 32, 32, cd::comp_mode::none, true, true, 0, 0, 0, 77, 50});
    run_attn({12, 128, 32, 32, cd::comp_mode::list, false, true, 4, 16, 64, 40, 33});
    run_attn({12, 128, 32, 32, cd::comp_mode::all, false, false, 8, 1000, 128, 45, 520});
    run_attn({12, 128, 32, 32, cd::comp_mode::none, true, true, 0, 0, 0, 0, 520});
    run_attn({4, 64, 16, 16, cd::comp_mode::list, true, true, 4, 8, 256, 10, 600});  // d 64, 4 heads
}

TEST_F(CudaDs4PrefillAttn, AttentionBatchRejectsBadArguments) {
    cd::sparse_attn_args a;
    a.n_head = 64;
    a.d = 512;
    a.window = 128;
    a.sinks = dev<float>(64);
    a.ring = raw(128 * 1024);
    a.ring_stride = 1024;
    a.mode = cd::comp_mode::list;
    a.comp = raw(1024 * 16);
    a.comp_stride = 1024;
    a.sel = dev<int32_t>(16);
    a.n_sel = dev<int32_t>(4);
    a.max_comp = 16;
    const void *chunk = raw(4 * 1024);
    const int64_t *p = positions(0, 1);
    float *o = dev<float>(4 * 64 * 512);
    EXPECT_THROW(cd::launch_sparse_sink_attention_batch(a, chunk, 1024, 4, 8, nullptr, p, nullptr, o, s_), error);
    EXPECT_THROW(cd::launch_sparse_sink_attention_batch(a, nullptr, 1024, 4, 16, nullptr, p, nullptr, o, s_), error);
    EXPECT_THROW(cd::launch_sparse_sink_attention_batch(a, chunk, 1000, 4, 16, nullptr, p, nullptr, o, s_), error);
}

}  // namespace
}  // namespace fathom
