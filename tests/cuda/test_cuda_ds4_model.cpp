// Whole-model DS4 on CUDA (src/backend/cuda/ds4_model.*) against independent truth:
//  - ../shared/golden/ds4-tiny cases (logits of the official f32 implementation), every case in its
//    tier, decoded token by token through the captured graph with an f32 KV cache;
//  - the CPU reference forward (src/models/deepseek4_forward.cpp, itself checked against the
//    goldens) on a synthetic quantised model (IQ2_XXS / Q2_K experts, Q8_0 projections, F16 mixers)
//    over 300 positions: raw-ring wrap, ratio-4 and ratio-128 compressed rows, indexer top-k with
//    more rows than k, in every QAT mode and both KV precisions: within the error of the CPU's own
//    quantised path (the MoE runs q8 activations with integer dots);
//  - graph replay against eager launches (bitwise), device argmax against the host argmax.
// Skips without a CUDA device.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <numeric>

#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/ds4_model.h"
#include "ds4/golden_util.h"
#include "models/deepseek4.h"
#include "models/deepseek4_synth.h"
#include "cuda_test_util.h"

namespace fathom {
namespace {

using CudaDs4Model = cuda_test::cuda_device_test;
using cuda_test::rel_l2;

const ds4::model &tiny_model() {
    static std::unique_ptr<ds4::model> m = ds4::load_model(ds4_test::golden_dir() + "/ds4-tiny-a.gguf");
    return *m;
}

std::shared_ptr<const ds4::cuda_weights> upload(const ds4::model &m, ds4::qat_mode q, kv_precision kv) {
    ds4::cuda_run_options o;
    o.qat = q;
    o.kv = kv;
    return ds4::cuda_upload(m, o);
}

TEST_F(CudaDs4Model, GoldenTinyDecodeThroughGraph) {
    const auto cases = ds4_test::load_cases("cases.jsonl");
    ASSERT_EQ(cases.size(), 12u);
    const ds4::model &m = tiny_model();
    const size_t V = static_cast<size_t>(m.hp.n_vocab);
    for (const auto &c : cases) {
        auto w = upload(m, c.qat, kv_precision::f32);
        ds4::cuda_sequence seq(w, static_cast<int64_t>(c.tokens.size()) + 1);
        std::vector<float> logits(c.tokens.size() * V, std::nanf(""));
        seq.eval(c.tokens, logits);
        EXPECT_EQ(seq.graph_replays(), c.tokens.size());
        const auto v = ds4_test::compare(c, logits, m.hp.n_vocab);
        EXPECT_TRUE(v.ok) << c.name << ": " << v.why;
        std::printf("  %-20s max e_p %.3g  median e_p %.3g\n", c.name.c_str(), v.max_e, v.median_e);
    }
}

// A quantised synthetic model with the ds4-tiny layout but 256-wide rows (IQ2_XXS / Q2_K blocks).
const std::string &quant_model_path() {
    static const std::string path = [] {
        ds4::hparams hp = ds4::synth_preset("tiny");
        hp.n_embd = 256;
        hp.n_ff_exp = 256;
        hp.n_layer = 5;  // ratios 0, 0, 4, 128, 4
        ds4::synth_fix_layers(hp, 1.5f);
        ds4::synth_options o;
        o.mix = "q2";
        o.seed = 7;
        const std::string p = (std::filesystem::temp_directory_path() / "fathom_cuda_ds4_q2.gguf").string();
        ds4::synth_write(p, hp, o);
        return p;
    }();
    return path;
}

// CPU logits of every token: the reference products (dequantised rows, double sums), or the CPU's
// quantised path (activations quantised to each weight's vec_dot type, cpu::gemm).
std::vector<float> cpu_logits(const ds4::model &m, ds4::qat_mode q, kv_precision kv, const std::vector<int32_t> &toks,
                              bool quantised = false) {
    ds4::state st = ds4::new_state(m, q, kv);
    st.exec.quantised = quantised;
    const size_t V = static_cast<size_t>(m.hp.n_vocab);
    std::vector<float> out(toks.size() * V);
    std::vector<int64_t> pos(toks.size());
    std::iota(pos.begin(), pos.end(), 0);
    ds4::forward(m, st, toks, pos, {out, {}});
    return out;
}

// Per-position rel L2 of a against b: (median, worst, position of worst, argmax agreements).
struct err_stats {
    double median = 0, worst = 0;
    size_t worst_at = 0, argmax_same = 0;
};
err_stats compare_logits(const std::vector<float> &a, const std::vector<float> &b, size_t n, size_t V) {
    err_stats r;
    std::vector<double> errs;
    for (size_t i = 0; i < n; ++i) {
        const double e = rel_l2(&a[i * V], &b[i * V], V);
        errs.push_back(e);
        if (e > r.worst) r.worst = e, r.worst_at = i;
        r.argmax_same += std::max_element(&a[i * V], &a[(i + 1) * V]) - &a[i * V] ==
                         std::max_element(&b[i * V], &b[(i + 1) * V]) - &b[i * V];
    }
    std::sort(errs.begin(), errs.end());
    r.median = errs[n / 2];
    return r;
}

std::vector<int32_t> random_tokens(size_t n, int vocab, uint32_t seed) {
    std::vector<int32_t> t(n);
    uint64_t s = seed;
    for (auto &x : t) {
        s = s * 6364136223846793005ull + 1442695040888963407ull;
        x = static_cast<int32_t>((s >> 33) % static_cast<uint64_t>(vocab));
    }
    return t;
}

TEST_F(CudaDs4Model, QuantisedMatchesCpuReferenceEveryQatAndKv) {
    auto m = ds4::load_model(quant_model_path());
    const size_t n = 300, V = static_cast<size_t>(m->hp.n_vocab);
    const auto toks = random_tokens(n, m->hp.n_vocab, 11);
    struct mode_t {
        ds4::qat_mode q;
        kv_precision kv;
        const char *name;
    };
    for (const mode_t md : {mode_t{ds4::qat_mode::full, kv_precision::f16, "qat full, f16 KV"},
                            mode_t{ds4::qat_mode::fp4only, kv_precision::f32, "qat fp4only, f32 KV"},
                            mode_t{ds4::qat_mode::off, kv_precision::f32, "qat off, f32 KV"}}) {
        const auto ref = cpu_logits(*m, md.q, md.kv, toks);
        const auto cpuq = cpu_logits(*m, md.q, md.kv, toks, true);
        auto w = upload(*m, md.q, md.kv);
        ds4::cuda_sequence seq(w, static_cast<int64_t>(n));
        std::vector<float> got(n * V, std::nanf(""));
        seq.eval(toks, got);
        const err_stats g = compare_logits(got, ref, n, V), c = compare_logits(cpuq, ref, n, V);
        std::printf("  %-20s vs CPU reference: CUDA median %.3g worst %.3g (pos %zu) argmax %zu/%zu | CPU quantised "
                    "path median %.3g worst %.3g argmax %zu/%zu\n",
                    md.name, g.median, g.worst, g.worst_at, g.argmax_same, n, c.median, c.worst, c.argmax_same, n);
        // The criterion: quantised kernels within the CPU quantised path's own error. The
        // MoE quantises its activations to q8 (dp4a); the CPU's quantised path quantises them to its
        // vec_dot types. With QAT-1 an ulp of difference before the FP8 round trip moves a KV value by
        // a whole e4m3 step and can change the indexer's top-k later on, so tails are compared
        // through the median there (the official golden's tier is statistical for the same reason).
        EXPECT_LE(g.median, 2.0 * c.median + 1e-4) << md.name;
        if (md.q != ds4::qat_mode::full) {
            EXPECT_LE(g.worst, 2.0 * c.worst + 1e-4) << md.name;
        }
        EXPECT_GE(g.argmax_same + 3, c.argmax_same) << md.name;
    }
}

TEST_F(CudaDs4Model, GraphReplayEqualsEagerAndDeviceArgmax) {
    auto m = ds4::load_model(quant_model_path());
    const size_t n = 280, V = static_cast<size_t>(m->hp.n_vocab);
    const auto toks = random_tokens(n, m->hp.n_vocab, 5);
    auto w = upload(*m, ds4::qat_mode::full, kv_precision::f16);
    ds4::cuda_sequence graph(w, static_cast<int64_t>(n)), eager(w, static_cast<int64_t>(n), false);
    std::vector<float> a(V), b(V);
    for (size_t i = 0; i < n; ++i) {
        graph.eval(std::span(&toks[i], 1), a);
        eager.eval(std::span(&toks[i], 1), b);
        ASSERT_EQ(0, std::memcmp(a.data(), b.data(), V * sizeof(float))) << "position " << i;
    }
    EXPECT_EQ(graph.graph_replays(), n);
    EXPECT_EQ(eager.graph_replays(), 0u);
    // reset + greedy: the device argmax equals the host argmax of the same step's logits
    graph.reset();
    eager.reset();
    int32_t t = toks[0];
    for (int i = 0; i < 40; ++i) {
        const int32_t g = graph.step_greedy(t);
        eager.eval(std::span(&t, 1), b);
        const int32_t h = static_cast<int32_t>(std::max_element(b.begin(), b.end()) - b.begin());
        ASSERT_EQ(g, h) << "step " << i;
        t = g;
    }
}

TEST_F(CudaDs4Model, BadInputIsRejectedAndSequenceSurvives) {
    auto w = upload(tiny_model(), ds4::qat_mode::full, kv_precision::f16);
    ds4::cuda_sequence seq(w, 8);
    std::vector<float> l(static_cast<size_t>(tiny_model().hp.n_vocab));
    const int32_t bad[] = {3, 512};
    EXPECT_THROW(seq.eval(bad, l), error);  // token outside the vocabulary: nothing evaluated
    EXPECT_EQ(seq.n_past(), 0);
    const std::vector<int32_t> nine(9, 5);
    EXPECT_THROW(seq.eval(nine, l), error);  // past n_ctx
    EXPECT_EQ(seq.n_past(), 0);
    const int32_t ok[] = {3, 4};
    seq.eval(ok, l);
    EXPECT_EQ(seq.n_past(), 2);
    EXPECT_TRUE(std::all_of(l.begin(), l.end(), [](float v) { return std::isfinite(v); }));
    EXPECT_THROW(ds4::cuda_sequence(w, int64_t{1} << 40), error);  // more memory than the device has
}

}  // namespace
}  // namespace fathom
