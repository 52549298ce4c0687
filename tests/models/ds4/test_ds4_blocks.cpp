// DS4 building blocks against hand-worked spec cases (ds4-architecture.md): Sinkhorn, HC post,
// compressor pooling (overlap, first block, APE), indexer top-k, sink attention, YaRN frequencies,
// interleaved RoPE, MoE routing and SwiGLU clamps, FP8/FP4 rounding, Hadamard, f16 KV rows.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <numeric>
#include <random>

#include "backend/cpu/quants.h"
#include "backend/cpu/thread_pool.h"
#include "models/deepseek4_impl.h"
#include "models/deepseek4_ops.h"
#include "models/deepseek4_qat.h"

namespace {

using namespace fathom::ds4;

// ---- Sinkhorn / HC ----------------------------------------------------------------------------------

// K = A (x) B with A = [[3,1],[2,2]], B = [[4,1],[1,1]]. The Sinkhorn limit of a Kronecker product is
// the product of the limits; a 2x2 limit is [[x,1-x],[1-x,x]] with x/(1-x) = sqrt(cross ratio):
// A: ratio 3 -> x = sqrt3/(1+sqrt3); B: ratio 4 -> y = 2/3. The row softmax of C0 = ln K is a row
// scaling of K, which leaves the limit unchanged.
TEST(ds4_hc, sinkhorn_kronecker_4x4) {
    const double A[2][2] = {{3, 1}, {2, 2}}, B[2][2] = {{4, 1}, {1, 1}};
    float c[16];
    for (int j = 0; j < 4; ++j)
        for (int k = 0; k < 4; ++k)
            c[j * 4 + k] = static_cast<float>(std::log(A[j / 2][k / 2] * B[j % 2][k % 2]));
    sinkhorn(c, 4, 20, 1e-6f);
    const double x = std::sqrt(3.0) / (1 + std::sqrt(3.0)), y = 2.0 / 3.0;
    const double LA[2][2] = {{x, 1 - x}, {1 - x, x}}, LB[2][2] = {{y, 1 - y}, {1 - y, y}};
    for (int j = 0; j < 4; ++j)
        for (int k = 0; k < 4; ++k)
            EXPECT_NEAR(c[j * 4 + k], LA[j / 2][k / 2] * LB[j % 2][k % 2], 1e-5) << j << "," << k;
}

// Identical rows of C0: after the row softmax every row is p; the column step then makes every
// entry p_k / (4 p_k) = 1/4 (a column step applied along rows would leave p unchanged).
TEST(ds4_hc, sinkhorn_identical_rows_become_uniform) {
    float c[16];
    for (int j = 0; j < 4; ++j)
        for (int k = 0; k < 4; ++k) c[j * 4 + k] = static_cast<float>(k);
    sinkhorn(c, 4, 1, 0.0f);
    for (float v : c) EXPECT_NEAR(v, 0.25f, 1e-7);
}

TEST(ds4_hc, split_pre_post) {
    // n_hc = 2: mix = [pre0, pre1, post0, post1, comb(4)], scale = [2, 3, 1]
    const float mix[8] = {1, -1, 0.5f, 0, 0, 0, 0, 0}, scale[3] = {2, 3, 1};
    const float base[8] = {0, 0.5f, -1.5f, 1, 0, 0, 0, 0};
    float pre[2], post[2], comb[4];
    hc_split_sinkhorn(mix, scale, base, 2, 20, 1e-6f, pre, post, comb);
    EXPECT_NEAR(pre[0], 1 / (1 + std::exp(-2.0)) + 1e-6, 1e-7);
    EXPECT_NEAR(pre[1], 1 / (1 + std::exp(1.5)) + 1e-6, 1e-7);
    EXPECT_NEAR(post[0], 1.0, 1e-7);                       // 2*sigmoid(0.5*3 - 1.5)
    EXPECT_NEAR(post[1], 2 / (1 + std::exp(-1.0)), 1e-6);  // 2*sigmoid(0*3 + 1)
    for (float v : comb) EXPECT_NEAR(v, 0.5, 1e-6);        // all-zero logits -> uniform
}

TEST(ds4_hc, post_row_is_source_column_is_destination) {
    const float y[1] = {1}, x_old[2] = {2, 3}, post[2] = {0.5f, 2}, comb[4] = {0.9f, 0.1f, 0.2f, 0.8f};
    float x_new[2];
    hc_post(2, 1, y, x_old, post, comb, x_new);
    EXPECT_NEAR(x_new[0], 0.5 + 0.9 * 2 + 0.2 * 3, 1e-6);
    EXPECT_NEAR(x_new[1], 2 + 0.1 * 2 + 0.8 * 3, 1e-6);
}

// ---- compressor ------------------------------------------------------------------------------------

compressor_state fresh(int ratio, int dim) {
    const int slots = ratio == 4 ? 8 : ratio, width = (ratio == 4 ? 2 : 1) * dim;
    compressor_state s;
    s.ratio = ratio;
    s.dim = dim;
    s.kv.assign(static_cast<size_t>(slots * width), 0.0f);
    s.score.assign(static_cast<size_t>(slots * width), -INFINITY);
    return s;
}

// Ratio 4, d' = 1 (width 2: lane A = col 0 for the next block, lane B = col 1 for this block).
TEST(ds4_compressor, ratio4_first_block_and_overlap) {
    compressor_weights w;
    w.ratio = 4;
    w.dim = 1;
    w.ape.assign(8, 0.0f);
    compressor_state s = fresh(4, 1);
    const float ln2 = std::log(2.0f), ln3 = std::log(3.0f), ln4 = std::log(4.0f);
    // block 0: lane B scores ln[1,2,3,4] -> weights [1,2,3,4]/10 over values [10,20,30,40] -> 30.
    // lane A of block 0 (value 1, score 0) feeds block 1.
    const float a0[4][2] = {{1, 10}, {1, 20}, {1, 30}, {1, 40}},
                g0[4][2] = {{0, 0}, {0, ln2}, {0, ln3}, {0, ln4}};
    float out = -1;
    for (int t = 0; t < 4; ++t) {
        const bool emitted = compressor_push(s, w, a0[t], g0[t], t, &out);
        EXPECT_EQ(emitted, t == 3);
    }
    EXPECT_NEAR(out, 30.0f, 1e-5);
    // block 1: previous lane A (4 x value 1, weight e^0) + current lane B (4 x value 3, weight e^ln3):
    // (4*1*1 + 4*3*3) / (4*1 + 4*3) = 2.5. Lane A values of block 1 (99) must not enter.
    const float a1[2] = {99, 3}, g1[2] = {0, ln3};
    for (int t = 4; t < 8; ++t) EXPECT_EQ(compressor_push(s, w, a1, g1, t, &out), t == 7);
    EXPECT_NEAR(out, 2.5f, 1e-5);
    // block 2: previous lane A = 4 x 99 (score 0), current lane B = 4 x 0 (score 0) -> 49.5.
    const float a2[2] = {0, 0}, g2[2] = {0, 0};
    for (int t = 8; t < 12; ++t) compressor_push(s, w, a2, g2, t, &out);
    EXPECT_NEAR(out, 49.5f, 1e-4);
}

// Non-overlapping ratio (3 here): APE indexed by pos mod R adds to the scores.
TEST(ds4_compressor, plain_ratio_with_ape) {
    compressor_weights w;
    w.ratio = 3;
    w.dim = 1;
    w.ape = {0, std::log(2.0f), 0};
    compressor_state s = fresh(3, 1);
    float out = -1;
    const float g[1] = {0};
    for (int t = 0; t < 6; ++t) {
        const float a[1] = {static_cast<float>(t % 3 + 1 + (t >= 3 ? 10 : 0))};
        EXPECT_EQ(compressor_push(s, w, a, g, t, &out), t % 3 == 2);
        if (t == 2) {
            EXPECT_NEAR(out, (1 + 2 * 2 + 3) / 4.0f, 1e-6);  // weights 1:2:1
        }
        if (t == 5) {
            EXPECT_NEAR(out, (11 + 2 * 12 + 13) / 4.0f, 1e-5);
        }
    }
}

// ---- indexer, attention ------------------------------------------------------------------------------

TEST(ds4_indexer, top_k_by_relu_weighted_score) {
    fathom::ds4::row_store rows(2, fathom::kv_precision::f32);
    // 2 heads x dim 2: q0 = [1, 0], q1 = [0, 1], w = [1, 2]. score = relu(k0) + 2 relu(k1).
    const float k[5][2] = {{1, 0}, {0, 1}, {3, -5}, {-1, -1}, {0.5f, 0.5f}};  // scores 1, 2, 3, 0, 1.5
    for (const auto &r : k) rows.push(r);
    const float q[4] = {1, 0, 0, 1}, w[2] = {1, 2};
    EXPECT_EQ(indexer_select(q, w, rows, 5, 2, 2, 2), (std::vector<int64_t>{1, 2}));
    EXPECT_EQ(indexer_select(q, w, rows, 5, 2, 2, 3), (std::vector<int64_t>{1, 2, 4}));
    // visibility: only the first n rows are candidates; n <= top-k keeps them all
    EXPECT_EQ(indexer_select(q, w, rows, 2, 2, 2, 2), (std::vector<int64_t>{0, 1}));
    EXPECT_EQ(indexer_select(q, w, rows, 4, 2, 2, 1), (std::vector<int64_t>{2}));
}

TEST(ds4_attention, sink_adds_mass_without_value) {
    // one head, d = 1, scale 1: scores q*k = [0, ln2]; sink 0 -> P = [1, 2] / (1 + 1 + 2)
    const float q[1] = {1}, kv[2] = {0, std::log(2.0f)}, sink[1] = {0};
    float o[1];
    attend_with_sink(q, kv, 2, sink, 1, 1, 1.0f, o);
    EXPECT_NEAR(o[0], 2 * std::log(2.0) / 4, 1e-6);
    const float big_sink[1] = {50};
    attend_with_sink(q, kv, 2, big_sink, 1, 1, 1.0f, o);
    EXPECT_NEAR(o[0], 0.0, 1e-12);
}

// dot_f32's documented order spelled out: 16 double lanes in element order, then the pairwise sum.
float dot_spec(const float *a, const float *b, int64_t n) {
    double acc[16] = {};
    for (int64_t i = 0; i < n; ++i) acc[i % 16] += static_cast<double>(a[i]) * static_cast<double>(b[i]);
    for (int w = 8; w > 0; w /= 2)
        for (int l = 0; l < w; ++l) acc[l] += acc[l + w];
    return static_cast<float>(acc[0]);
}

// dot_f32_rows (several rows per pass, FMA on AVX-512 and AVX2) == dot_f32 row by row, bit for bit, and both
// == a scalar spelling of the documented order (16 double lanes in element order, pairwise sum), for
// row counts around the 4-row blocks, lengths with and without a 16-element tail, and values over a
// wide dynamic range (so any reassociation would show).
TEST(ds4_attention, dot_rows_bitwise) {
    std::mt19937 rng(7);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    std::uniform_int_distribution<int> ex(-20, 20);
    for (int64_t n : {16, 128, 512, 100, 7})
        for (int64_t rows : {1, 3, 4, 5, 9}) {
            std::vector<float> a(static_cast<size_t>(n)), b(static_cast<size_t>(rows * n)),
                out(static_cast<size_t>(rows));
            for (float &v : a) v = std::ldexp(nd(rng), ex(rng));
            for (float &v : b) v = std::ldexp(nd(rng), ex(rng));
            dot_f32_rows(a.data(), b.data(), rows, n, out.data());
            for (int64_t r = 0; r < rows; ++r) {
                const float one = dot_f32(a.data(), b.data() + r * n, n),
                            want = dot_spec(a.data(), b.data() + r * n, n);
                const float got = out[static_cast<size_t>(r)];
                EXPECT_EQ(std::memcmp(&got, &one, 4), 0) << "n=" << n << " rows=" << rows << " r=" << r;
                EXPECT_EQ(std::memcmp(&got, &want, 4), 0) << "n=" << n << " rows=" << rows << " r=" << r;
            }
        }
}

// attend_with_sink == a scalar spelling of its definition, bit for bit: scores in dot_f32's order (16
// double lanes, pairwise sum), scaled, softmax with the sink in the denominator (row order), outputs
// accumulated row after row as o = o + p*v in float. Head counts with and without a 4-head remainder and
// head sizes 128 / 512 (the grouped path on AVX-512 and AVX2), 64 (grouped on AVX2, the one-head loop on
// AVX-512), 80 (the one-head loop with dot_f32_rows' row blocks) and 40 (the scalar dots), on one thread
// and the pool.
TEST(ds4_attention, sink_attention_bitwise) {
    std::mt19937 rng(11);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    fathom::cpu::thread_pool pool(2);
    for (const bool threaded : {false, true})
        for (int64_t d : {128, 512, 64, 80, 40})
            for (int H : {4, 6, 9})
                for (int64_t n : {1, 5, 37}) {
                    std::vector<float> q(static_cast<size_t>(H * d)), kv(static_cast<size_t>(n * d)),
                        sinks(static_cast<size_t>(H)), o(static_cast<size_t>(H * d), -1.0f);
                    for (float &v : q) v = nd(rng);
                    for (float &v : kv) v = nd(rng);
                    for (float &v : sinks) v = nd(rng);
                    const float scale = 1.0f / std::sqrt(static_cast<float>(d));
                    exec_options ex;
                    ex.pool = threaded ? &pool : nullptr;
                    {
                        const exec_scope scope(ex);
                        attend_with_sink(q.data(), kv.data(), n, sinks.data(), H, d, scale, o.data());
                    }
                    for (int h = 0; h < H; ++h) {
                        std::vector<float> sc(static_cast<size_t>(n)), want(static_cast<size_t>(d), 0.0f);
                        float mx = sinks[h];
                        for (int64_t r = 0; r < n; ++r) {
                            sc[r] = dot_spec(&q[h * d], &kv[r * d], d) * scale;
                            mx = std::max(mx, sc[r]);
                        }
                        float denom = std::exp(sinks[h] - mx);
                        for (int64_t r = 0; r < n; ++r) denom += (sc[r] = std::exp(sc[r] - mx));
                        for (int64_t r = 0; r < n; ++r) {
                            const float p = sc[r] / denom;
                            for (int64_t i = 0; i < d; ++i) {
                                const float t = p * kv[r * d + i];
                                want[i] = want[i] + t;
                            }
                        }
                        ASSERT_EQ(std::memcmp(want.data(), &o[h * d], static_cast<size_t>(d) * 4), 0)
                            << "d=" << d << " H=" << H << " n=" << n << " head " << h << " threaded " << threaded;
                    }
                }
}

// The documented order, probed by cancellation: random inputs cannot tell two association orders apart
// (the sums are in double, the result a float), so these vectors are built so that only dot_f32's order
// gives its value. Against a vector of ones: +B at element i, -B at element j and 1 at element k (B =
// 2^60, so B + 1 rounds to B) sum to 1 where the order meets i and j before k joins them, else 0. All
// (i, j, k) over the first two 16-element chunks, so every lane pairing of the pairwise reduction and the in-lane
// element order are probed. dot_f32_rows (row blocks), dot_f32 and the grouped attention scores must
// each equal the spelled-out order on every probe.
TEST(ds4_attention, accumulation_order_probes) {
    constexpr int64_t m = 32, n = 128;  // probes over the first 32 elements of 128 (AVX-512's grouped width)
    const float B = std::ldexp(1.0f, 60);
    std::vector<float> probes;  // rows of n
    for (int i = 0; i < m; ++i)
        for (int j = 0; j < m; ++j)
            for (int k = 0; k < m; ++k) {
                if (i == j || j == k || i == k) continue;
                std::vector<float> v(static_cast<size_t>(n), 0.0f);
                v[static_cast<size_t>(i)] = B;
                v[static_cast<size_t>(j)] = -B;
                v[static_cast<size_t>(k)] = 1.0f;
                probes.insert(probes.end(), v.begin(), v.end());
            }
    const int64_t rows = static_cast<int64_t>(probes.size()) / n;
    const std::vector<float> ones(static_cast<size_t>(n), 1.0f);
    std::vector<float> out(static_cast<size_t>(rows));
    dot_f32_rows(ones.data(), probes.data(), rows, n, out.data());
    int64_t ones_seen = 0;
    for (int64_t r = 0; r < rows; ++r) {
        const float want = dot_spec(ones.data(), &probes[static_cast<size_t>(r * n)], n);
        ones_seen += want == 1.0f;
        ASSERT_EQ(out[static_cast<size_t>(r)], want) << "dot_f32_rows, probe " << r;
        ASSERT_EQ(dot_f32(ones.data(), &probes[static_cast<size_t>(r * n)], n), want) << "dot_f32, probe " << r;
    }
    // both outcomes occur, so an order that differs anywhere shows
    EXPECT_GT(ones_seen, 0);
    EXPECT_LT(ones_seen, rows);
    if (!attention_heads_grouped(n)) GTEST_SKIP() << "no grouped attention kernels on this CPU";
    // The grouped scores: 4 probe heads against one row of ones (and the ones against 4 probe rows).
    std::vector<float> sc(4);
    for (int64_t r = 0; r + 4 <= rows; r += 4) {
        attention_scores_heads4(&probes[static_cast<size_t>(r * n)], ones.data(), 1, n, sc.data());
        for (int h = 0; h < 4; ++h)
            ASSERT_EQ(sc[static_cast<size_t>(h)], dot_spec(&probes[static_cast<size_t>((r + h) * n)], ones.data(), n))
                << "scores, probe " << r + h;
    }
}

// ---- RoPE ----------------------------------------------------------------------------------------------

// ds4-tiny: base 160000, 64 dims, factor 16, original context 1024, beta 32/1.
// c(r) = 64 ln(1024 / (2 pi r)) / (2 ln 160000): c(32) = 4.35 -> lo 4, c(1) = 13.6 -> hi 14.
TEST(ds4_rope, yarn_tiny_ramp) {
    const rope_table t = rope_yarn(160000, 64, 16, 1024, 32, 1);
    ASSERT_EQ(t.freq.size(), 32u);
    for (int i = 0; i < 32; ++i) {
        const double b = std::pow(160000.0, -2.0 * i / 64);
        const double ramp = std::clamp((i - 4) / 10.0, 0.0, 1.0);
        EXPECT_NEAR(t.freq[static_cast<size_t>(i)] / (b * (1 - ramp) + b / 16 * ramp), 1.0, 2e-6) << i;
    }
}

// Flash: original context 65536 -> lo 15, hi 25 (spec 4.2).
TEST(ds4_rope, yarn_flash_range) {
    const rope_table t = rope_yarn(160000, 64, 16, 65536, 32, 1);
    const rope_table p = rope_plain(160000, 64);
    for (int i = 0; i <= 15; ++i)
        EXPECT_EQ(t.freq[static_cast<size_t>(i)], p.freq[static_cast<size_t>(i)]) << i;
    for (int i = 25; i < 32; ++i)
        EXPECT_NEAR(t.freq[static_cast<size_t>(i)] * 16 / p.freq[static_cast<size_t>(i)], 1.0, 1e-6);
    EXPECT_NEAR(t.freq[20] / p.freq[20], 0.5 + 0.5 / 16, 1e-6);
}

TEST(ds4_rope, interleaved_pairs_and_inverse) {
    const rope_table t = rope_plain(10000, 4);  // f = [1, 0.01]
    float x[4] = {1, 0, 0, 1};
    rope_apply(x, t, 1, false);
    EXPECT_NEAR(x[0], std::cos(1.0), 1e-6);
    EXPECT_NEAR(x[1], std::sin(1.0), 1e-6);
    EXPECT_NEAR(x[2], -std::sin(0.01), 1e-6);
    EXPECT_NEAR(x[3], std::cos(0.01), 1e-6);
    rope_apply(x, t, 1, true);
    EXPECT_NEAR(x[0], 1, 1e-6);
    EXPECT_NEAR(x[1], 0, 1e-6);
    EXPECT_NEAR(x[2], 0, 1e-6);
    EXPECT_NEAR(x[3], 1, 1e-6);
}

// ---- MoE ---------------------------------------------------------------------------------------------

// logits chosen so sqrt(softplus(l)) = s exactly: l = ln(e^{s^2} - 1)
float logit_for(double s) {
    return static_cast<float>(std::log(std::exp(s * s) - 1));
}

TEST(ds4_moe, biased_topk_selects_unbiased_weights) {
    hparams hp;
    hp.n_expert = 4;
    hp.n_expert_used = 2;
    hp.expert_weights_scale = 1.5f;
    layer_weights l;
    l.exp_bias = {0, -1.0f, 1.2f, 0};
    const float logits[4] = {logit_for(1), logit_for(2), logit_for(0.5), logit_for(1.5)};
    // biased scores [1, 1, 1.7, 1.5] -> experts 2, 3; weights 1.5 * [0.5, 1.5] / 2
    const route r = moe_route(hp, l, logits, 0);
    ASSERT_EQ(r.experts, (std::vector<int>{2, 3}));
    EXPECT_NEAR(r.weights[0], 0.375, 1e-5);
    EXPECT_NEAR(r.weights[1], 1.125, 1e-5);
}

TEST(ds4_moe, hash_routing_by_token_id) {
    hparams hp;
    hp.n_expert = 4;
    hp.n_expert_used = 2;
    hp.expert_weights_scale = 1.5f;
    layer_weights l;
    l.hash = true;
    l.tid2eid = {0, 1, 3, 1};  // token 0 -> {0,1}, token 1 -> {3,1}
    const float logits[4] = {logit_for(1), logit_for(2), logit_for(0.5), logit_for(1.5)};
    const route r = moe_route(hp, l, logits, 1);
    ASSERT_EQ(r.experts, (std::vector<int>{3, 1}));
    EXPECT_NEAR(r.weights[0], 1.5 * 1.5 / 3.5, 1e-5);
    EXPECT_NEAR(r.weights[1], 1.5 * 2.0 / 3.5, 1e-5);
}

TEST(ds4_moe, swiglu_clamps_gate_above_and_up_both_sides) {
    float g[4] = {2, -3, 0.5f, 1};
    const float v[4] = {2, -2, 1, -0.5f};
    swiglu_clamped(g, v, 4, 1.5f);
    auto silu_d = [](double x) { return x / (1 + std::exp(-x)); };
    EXPECT_NEAR(g[0], silu_d(1.5) * 1.5, 1e-6);  // gate clamped to 1.5, up to 1.5
    EXPECT_NEAR(g[1], silu_d(-3) * -1.5, 1e-6);  // gate not clamped below, up to -1.5
    EXPECT_NEAR(g[2], silu_d(0.5) * 1, 1e-6);
    EXPECT_NEAR(g[3], silu_d(1) * -0.5, 1e-6);
}

// ---- QAT rounding ------------------------------------------------------------------------------------

TEST(ds4_qat, e4m3_hand_values) {
    EXPECT_EQ(fp8_e4m3_round(1.0f), 1.0f);
    EXPECT_EQ(fp8_e4m3_round(1.0625f), 1.0f);   // tie between codes 0 and 1 -> even
    EXPECT_EQ(fp8_e4m3_round(1.1875f), 1.25f);  // tie between codes 1 and 2 -> even
    EXPECT_EQ(fp8_e4m3_round(0.3f), 0.3125f);   // step 2^-5 in [0.25, 0.5)
    EXPECT_EQ(fp8_e4m3_round(-0.3f), -0.3125f);
    EXPECT_EQ(fp8_e4m3_round(448.0f), 448.0f);
    EXPECT_EQ(fp8_e4m3_round(500.0f), 448.0f);    // clamp
    EXPECT_EQ(fp8_e4m3_round(0x1p-9f), 0x1p-9f);  // smallest subnormal
    EXPECT_EQ(fp8_e4m3_round(0x1p-10f), 0.0f);    // tie to 0 (even)
    EXPECT_EQ(fp8_e4m3_round(0x1.8p-10f), 0x1p-9f);
    EXPECT_EQ(fp8_e4m3_round(0x1.9p-7f), 0x1.8p-7f);  // subnormal step 2^-9: 6.25 steps -> 6
    EXPECT_EQ(fp8_e4m3_round(300.0f), 288.0f);        // step 32 in [256, 448]: 9.375 -> 9
}

TEST(ds4_qat, e2m1_hand_values) {
    const float in[] = {0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5.0f, 5.5f, 7.0f, -1.25f, -0.2f};
    const float want[] = {0.0f, 1.0f, 1.0f, 2.0f, 2.0f, 4.0f, 4.0f, 6.0f, 6.0f, -1.0f, -0.0f};
    for (size_t i = 0; i < std::size(in); ++i) EXPECT_EQ(fp4_e2m1_round(in[i]), want[i]) << in[i];
}

TEST(ds4_qat, pow2_scale) {
    EXPECT_EQ(pow2_ceil(1.0f), 1.0f);
    EXPECT_EQ(pow2_ceil(1.0f / 448), 0x1p-8f);
    EXPECT_EQ(pow2_ceil(0.5f), 0.5f);
    EXPECT_EQ(pow2_ceil(0.50001f), 1.0f);
    EXPECT_EQ(pow2_ceil(3.0f), 4.0f);
}

TEST(ds4_qat, fp8_block_round_trip) {
    // amax 1 -> s = 2^-8: 0.3*256 = 76.8 -> 80 -> 0.3125; 0.001*256 = 0.256 -> 0.25 -> 2^-10
    std::vector<float> x(64, 0.0f);
    x[0] = 1.0f;
    x[1] = 0.3f;
    x[2] = 0.001f;
    x[3] = -0.5f;
    fp8_round_trip(x.data(), 64);
    EXPECT_EQ(x[0], 1.0f);
    EXPECT_EQ(x[1], 0.3125f);
    EXPECT_EQ(x[2], 0x1p-10f);
    EXPECT_EQ(x[3], -0.5f);
    EXPECT_EQ(x[4], 0.0f);
    // amax floor 1e-4: s = 2^-22; 1e-6 / 2^-22 = 4.19 -> 4 -> 2^-20
    std::vector<float> y(64, 0.0f);
    y[5] = 1e-6f;
    fp8_round_trip(y.data(), 64);
    EXPECT_EQ(y[5], 0x1p-20f);
}

TEST(ds4_qat, fp4_block_round_trip_and_hadamard) {
    // amax 3 -> s = 0.5: [3, 1, 0.3, -0.7] / 0.5 = [6, 2, 0.6, -1.4] -> [6, 2, 0.5, -1.5]
    std::vector<float> x(32, 0.0f);
    x[0] = 3;
    x[1] = 1;
    x[2] = 0.3f;
    x[3] = -0.7f;
    fp4_round_trip(x.data(), 32);
    EXPECT_EQ(x[0], 3.0f);
    EXPECT_EQ(x[1], 1.0f);
    EXPECT_EQ(x[2], 0.25f);
    EXPECT_EQ(x[3], -0.75f);
    float h[4] = {1, 2, 3, 4};  // Sylvester H4 rows: ++++, +-+-, ++--, +--+ ; / 2
    hadamard_normalised(h, 4);
    EXPECT_FLOAT_EQ(h[0], 5);
    EXPECT_FLOAT_EQ(h[1], -1);
    EXPECT_FLOAT_EQ(h[2], -2);
    EXPECT_FLOAT_EQ(h[3], 0);
}

TEST(ds4_state, f16_rows_round) {
    fathom::ds4::row_store r(3, fathom::kv_precision::f16);
    const float in[3] = {1.0009765625f, 1.0001f, 65504.0f};  // exact, rounds to 1, f16 max
    r.push(in);
    float out[3];
    r.get(0, out);
    EXPECT_EQ(out[0], 1.0009765625f);
    EXPECT_EQ(out[1], 1.0f);
    EXPECT_EQ(out[2], 65504.0f);
}

// A wide f16 row (the F16C path, 8 at a time, and its scalar tail) reads back every value as the
// scalar f16 -> f32 conversion of its stored bits: normals, subnormals, zeros of both signs, infinities.
TEST(ds4_state, f16_rows_wide_exact) {
    const int64_t w = 523;  // 65 vectors of 8 + a tail of 3
    fathom::ds4::row_store r(w, fathom::kv_precision::f16);
    std::mt19937 rng(3);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    std::uniform_int_distribution<int> ex(-26, 17);
    std::vector<float> in(static_cast<size_t>(w)), out(static_cast<size_t>(w));
    for (float &v : in) v = std::ldexp(nd(rng), ex(rng));
    in[0] = 0.0f, in[1] = -0.0f, in[2] = INFINITY, in[3] = -INFINITY, in[4] = 6e-8f, in[w - 1] = -1e5f;
    r.push(in.data());
    r.get(0, out.data());
    for (int64_t i = 0; i < w; ++i) {
        const float want = fathom::cpu::f16_to_f32(fathom::cpu::f32_to_f16(in[static_cast<size_t>(i)]));
        EXPECT_EQ(std::memcmp(&out[static_cast<size_t>(i)], &want, 4), 0)
            << i << ": " << out[static_cast<size_t>(i)] << " vs " << want;
    }
}

}  // namespace
