// Whole-model DS4 on CUDA (src/models/cuda/deepseek4_cuda.*) against independent truth:
//  - ../shared/golden/ds4-tiny cases (logits of the official f32 implementation), every case in its
//    tier, decoded token by token through the captured graph with an f32 KV cache;
//  - the CPU reference forward (src/models/deepseek4_forward.cpp, itself checked against the
//    goldens) on a synthetic quantised model (IQ2_XXS / Q2_K experts, Q8_0 projections, F16 mixers)
//    over 300 positions: raw-ring wrap, ratio-4 and ratio-128 compressed rows, indexer top-k with
//    more rows than k, in every QAT mode and both KV precisions: within the error of the CPU's own
//    quantised path (the MoE runs q8 activations with integer dots); the same for the K-quant
//    synthetic mixes (q4k: Q4_K / Q6_K experts, Q4_K projections; q3k: Q3_K / Q5_K experts, Q3_K
//    projections), which with f32 activations must also equal the reference to f32 rounding;
//  - graph replay against eager launches (bitwise), device argmax against the host argmax;
//  - chunked (layer-major) prefill: the goldens and the CPU reference through chunks of several
//    sizes, and decoding after a chunked prefill against decoding after a token-serial one.
// Skips without a CUDA device.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <tuple>

#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/ds4_gemv.h"
#include "backend/cuda/ds4_gemv_testing.h"
#include "backend/cuda/ds4_kernels.h"
#include "backend/cuda/ds4_kernels_testing.h"
#include "models/cuda/deepseek4_cuda.h"
#include "models/cuda/deepseek4_cuda_testing.h"
#include "core/error.h"
#include "models/ds4/golden_util.h"
#include "models/deepseek4.h"
#include "backend/cuda/cuda_test_util.h"
#include "ds4_host_util.h"

namespace fathom {
namespace {

using CudaDs4Model = cuda_test::cuda_device_test;
using cuda_test::rel_l2;

const ds4::model &tiny_model() {
    static std::unique_ptr<ds4::model> m = ds4::load_model(ds4_test::golden_dir() + "/ds4-tiny-a.gguf");
    return *m;
}

std::shared_ptr<const ds4::cuda_weights> upload(const ds4::model &m, ds4::qat_mode q, kv_precision kv,
                                                bool exact_indexer = false) {
    ds4::cuda_run_options o;
    o.qat = q;
    o.kv = kv;
    o.exact_indexer = exact_indexer;
    return ds4::cuda_upload(m, o);
}

TEST_F(CudaDs4Model, GoldenTinyDecodeThroughGraph) {
    const auto cases = ds4_test::load_cases("cases.jsonl");
    ASSERT_EQ(cases.size(), 12u);
    const ds4::model &m = tiny_model();
    const size_t V = static_cast<size_t>(m.hp.n_vocab);
    for (const auto &c : cases) {
        auto w = upload(m, c.qat, kv_precision::f32);
        ds4::cuda_sequence seq(w, static_cast<int64_t>(c.tokens.size()) + 1, true, 0);  // token-serial
        std::vector<float> logits(c.tokens.size() * V, std::nanf(""));
        seq.eval(c.tokens, logits);
        EXPECT_EQ(ds4::cuda_testing::graph_replays(seq), c.tokens.size());
        const auto v = ds4_test::compare(c, logits, m.hp.n_vocab);
        EXPECT_TRUE(v.ok) << c.name << ": " << v.why;
        std::printf("  %-20s max e_p %.3g  median e_p %.3g\n", c.name.c_str(), v.max_e, v.median_e);
    }
}

// The same cases through chunked prefill (every token's logits from its chunk): chunks of 5 tokens
// (ratio-4 boundaries inside chunks, compressor rows emitted mid-chunk, several chunks per case)
// and one chunk for the whole prompt.
TEST_F(CudaDs4Model, GoldenTinyChunkedPrefill) {
    const auto cases = ds4_test::load_cases("cases.jsonl");
    const ds4::model &m = tiny_model();
    const size_t V = static_cast<size_t>(m.hp.n_vocab);
    for (const int64_t chunk : {int64_t{5}, ds4::default_prefill_chunk}) {
        for (const auto &c : cases) {
            auto w = upload(m, c.qat, kv_precision::f32);
            ds4::cuda_sequence seq(w, static_cast<int64_t>(c.tokens.size()) + 1, true, chunk);
            std::vector<float> logits(c.tokens.size() * V, std::nanf(""));
            seq.eval(c.tokens, logits);
            EXPECT_EQ(ds4::cuda_testing::graph_replays(seq), c.tokens.size() > 1 ? 0u : 1u);
            const auto v = ds4_test::compare(c, logits, m.hp.n_vocab);
            EXPECT_TRUE(v.ok) << c.name << " (chunk " << chunk << "): " << v.why;
            std::printf("  chunk %-5lld %-20s max e_p %.3g  median e_p %.3g\n", static_cast<long long>(chunk),
                        c.name.c_str(), v.max_e, v.median_e);
        }
    }
}

// A quantised synthetic model with the ds4-tiny layout but 256-wide rows (IQ2_XXS / Q2_K blocks).
const std::string &quant_model_path() {
    static const std::string path = cuda_test::write_quant_tiny_model("fathom_cuda_ds4_q2.gguf");
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
        bool exact_indexer = false;
    };
    for (const mode_t md : {mode_t{ds4::qat_mode::full, kv_precision::f16, "qat full, f16 KV"},
                            mode_t{ds4::qat_mode::full, kv_precision::f16, "(exact indexer)", true},
                            mode_t{ds4::qat_mode::fp4only, kv_precision::f32, "qat fp4only, f32 KV"},
                            mode_t{ds4::qat_mode::off, kv_precision::f32, "qat off, f32 KV"}}) {
        const auto ref = cpu_logits(*m, md.q, md.kv, toks);
        const auto cpuq = cpu_logits(*m, md.q, md.kv, toks, true);
        auto w = upload(*m, md.q, md.kv, md.exact_indexer);
        // Token-serial (decode steps) and chunked prefill (chunks of 64: ring wraps, compressor rows
        // and indexer selections inside chunks).
        for (const int64_t chunk : {int64_t{0}, int64_t{64}}) {
        ds4::cuda_sequence seq(w, static_cast<int64_t>(n), true, chunk);
        std::vector<float> got(n * V, std::nanf(""));
        seq.eval(toks, got);
        const err_stats g = compare_logits(got, ref, n, V), c = compare_logits(cpuq, ref, n, V);
        std::printf("  %-20s chunk %2lld vs CPU reference: CUDA median %.3g worst %.3g (pos %zu) argmax %zu/%zu | CPU "
                    "quantised path median %.3g worst %.3g argmax %zu/%zu\n",
                    md.name, static_cast<long long>(chunk), g.median, g.worst, g.worst_at, g.argmax_same, n, c.median,
                    c.worst, c.argmax_same, n);
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
}

// Synthetic models of the K-quant mixes (src/models/deepseek4_synth.cpp): q4k (Q4_K_M-like: Q4_K
// routed gate/up, Q6_K routed down and output head, Q4_K attention projections, shared expert and
// embedding; Q8_0 where a row is not whole 256-blocks) and q3k (Q3_K gate/up, projections, shared
// expert and embedding, Q5_K down, Q6_K head). Before K-quant experts had kernels, cuda_upload refused
// these files (and Q3_K dense weights had no GEMV). Checked against the CPU reference forward over 200
// positions:
//  - with every decode product on f32 activations (set_moe_q8_activations(false) and
//    set_gemv_q8_activations(false): the MoE and the dense q8_0 GEMVs switched to their
//    f32-activation kernels), qat off, f32 KV and the exact indexer, token-serial
//    decode equals the reference to f32 rounding: median rel L2 <= 1e-5, worst <= 1e-3 (room for a
//    near-tie indexer selection decided the other way by an f32 difference; f32 activations gave a
//    worst of 7.3e-07 on the q2 mix). A wrong K-quant element, scale or row shows as O(1e-2) or more.
//  - in the default configuration (q8 activations with integer dots in the MoE and the q8_0
//    GEMVs, qat full, f16 KV), token-serial and in
//    chunks of 64 (the prefill MoE dequantises the K-quant experts for bf16 GEMMs): within twice the
//    CPU quantised path's own error, as QuantisedMatchesCpuReferenceEveryQatAndKv judges the q2 mix.
TEST_F(CudaDs4Model, KquantMixesMatchCpuReference) {
    struct mix_t {
        const char *name;
        dtype gu, dn, dense;  // routed gate/up, routed down; shared expert, 256-wide projections, embedding
    };
    for (const mix_t mx : {mix_t{"q4k", dtype::q4_k, dtype::q6_k, dtype::q4_k},
                           mix_t{"q3k", dtype::q3_k, dtype::q5_k, dtype::q3_k}}) {
        SCOPED_TRACE(mx.name);
        auto m = ds4::load_model(
            cuda_test::write_quant_tiny_model(std::string("fathom_cuda_ds4_") + mx.name + ".gguf", mx.name));
        // the file really has the K-quant types this test is about
        for (const auto &l : m->layers) {
            ASSERT_EQ(l.gate_exps.first.type, mx.gu);
            ASSERT_EQ(l.up_exps.first.type, mx.gu);
            ASSERT_EQ(l.down_exps.first.type, mx.dn);
            ASSERT_EQ(l.gate_sh.type, mx.dense);
            ASSERT_EQ(l.down_sh.type, mx.dense);
            ASSERT_EQ(l.q_a.type, mx.dense);
            ASSERT_EQ(l.kv.type, mx.dense);
        }
        ASSERT_EQ(m->output.type, dtype::q6_k);
        ASSERT_EQ(m->tok_embd.type, mx.dense);
        const size_t n = 200, V = static_cast<size_t>(m->hp.n_vocab);
        const auto toks = random_tokens(n, m->hp.n_vocab, 31);
        {  // f32 activations throughout: the reference to f32 rounding
            const auto ref = cpu_logits(*m, ds4::qat_mode::off, kv_precision::f32, toks);
            auto w = upload(*m, ds4::qat_mode::off, kv_precision::f32, true);
            struct f32_scope {  // the process-wide switches are restored even when eval throws
                f32_scope() {
                    cuda::ds4::set_gemv_q8_activations(false);
                    cuda::ds4::set_moe_q8_activations(false);
                }
                ~f32_scope() {
                    cuda::ds4::set_gemv_q8_activations(true);
                    cuda::ds4::set_moe_q8_activations(true);
                }
            } f32_products;
            ds4::cuda_sequence seq(w, static_cast<int64_t>(n), true, 0);
            std::vector<float> got(n * V, std::nanf(""));
            seq.eval(toks, got);
            const err_stats g = compare_logits(got, ref, n, V);
            std::printf("  %s, f32 activations, qat off, f32 KV: median %.3g worst %.3g (pos %zu) argmax %zu/%zu\n",
                        mx.name, g.median, g.worst, g.worst_at, g.argmax_same, n);
            EXPECT_LE(g.median, 1e-5);
            EXPECT_LE(g.worst, 1e-3);
            EXPECT_GE(g.argmax_same + 1, n);
        }
        // the default configuration, token-serial and chunked
        const auto ref = cpu_logits(*m, ds4::qat_mode::full, kv_precision::f16, toks);
        const auto cpuq = cpu_logits(*m, ds4::qat_mode::full, kv_precision::f16, toks, true);
        auto w = upload(*m, ds4::qat_mode::full, kv_precision::f16);
        for (const int64_t chunk : {int64_t{0}, int64_t{64}}) {
            ds4::cuda_sequence seq(w, static_cast<int64_t>(n), true, chunk);
            std::vector<float> got(n * V, std::nanf(""));
            seq.eval(toks, got);
            const err_stats g = compare_logits(got, ref, n, V), c = compare_logits(cpuq, ref, n, V);
            std::printf("  %s, qat full, f16 KV, chunk %2lld vs CPU reference: CUDA median %.3g worst %.3g argmax %zu/%zu | "
                        "CPU quantised path median %.3g worst %.3g argmax %zu/%zu\n",
                        mx.name, static_cast<long long>(chunk), g.median, g.worst, g.argmax_same, n, c.median, c.worst,
                        c.argmax_same, n);
            EXPECT_LE(g.median, 2.0 * c.median + 1e-4) << "chunk " << chunk;
            EXPECT_GE(g.argmax_same + 3, c.argmax_same) << "chunk " << chunk;
        }
    }
}

// A weight type without a CUDA kernel fails cuda_upload before anything is uploaded, with one line
// naming the tensor and its type (a copy of the q4k model with one tensor's type changed; the bytes
// are never read).
TEST_F(CudaDs4Model, UnsupportedWeightTypeFailsAtLoadNamingTheTensor) {
    const auto m = ds4::load_model(cuda_test::write_quant_tiny_model("fathom_cuda_ds4_q4k_types.gguf", "q4k"));
    auto expect_refused = [&](const ds4::model &bad, const std::string &what) {
        try {
            upload(bad, ds4::qat_mode::full, kv_precision::f16);
            ADD_FAILURE() << "no error for " << what;
        } catch (const error &e) {
            EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
        }
    };
    ds4::model bad = *m;
    bad.layers[2].q_b.type = dtype::iq4_xs;
    expect_refused(bad, "blk.2.attn_q_b is iq4_xs");
    bad = *m;
    bad.layers[1].down_exps.first.type = dtype::iq3_xxs;
    expect_refused(bad, "blk.1.ffn_down_exps is iq3_xxs");
    bad = *m;
    bad.layers[3].up_sh.type = dtype::iq2_xs;
    expect_refused(bad, "blk.3.ffn_up_shexp is iq2_xs");
    bad = *m;
    bad.layers[0].hc_ffn.fn.type = dtype::q8_0;
    expect_refused(bad, "blk.0.hc_ffn_fn is q8_0");
    // the unchanged model loads
    EXPECT_NO_THROW(upload(*m, ds4::qat_mode::full, kv_precision::f16));
}

// Decoding continues from the state a chunked prefill leaves (ring, compressor frontiers, compressed
// and indexer rows): 230 prompt tokens as chunks of 37 over two calls (the second starting at position
// 101: mid-block, mid-window), then 60 decode steps, every logit against the CPU reference forward of
// the same 290 tokens, judged as QuantisedMatchesCpuReference judges the token-serial path (within
// twice the CPU quantised path's own error). A wrong ring row, frontier slot or compressed row left by
// the chunks would show as O(1) errors in the decode steps that read it.
TEST_F(CudaDs4Model, ChunkedPrefillThenDecodeMatchesCpuReference) {
    auto m = ds4::load_model(quant_model_path());
    const size_t n = 230, n_dec = 60, N = n + n_dec, V = static_cast<size_t>(m->hp.n_vocab);
    const auto toks = random_tokens(N, m->hp.n_vocab, 23);
    for (const auto &md : {std::pair{ds4::qat_mode::full, kv_precision::f16}, std::pair{ds4::qat_mode::off, kv_precision::f32}}) {
        const auto ref = cpu_logits(*m, md.first, md.second, toks);
        const auto cpuq = cpu_logits(*m, md.first, md.second, toks, true);
        auto w = upload(*m, md.first, md.second);
        ds4::cuda_sequence seq(w, static_cast<int64_t>(N), true, 37);
        std::vector<float> got(N * V, std::nanf(""));
        seq.eval(std::span(toks).first(101), std::span(got).first(101 * V));
        seq.eval(std::span(toks).subspan(101, n - 101), std::span(got).subspan(101 * V, (n - 101) * V));
        EXPECT_EQ(seq.n_past(), static_cast<int64_t>(n));
        for (size_t i = n; i < N; ++i) seq.eval(std::span(&toks[i], 1), std::span(got).subspan(i * V, V));
        // prompt and decode parts separately, each against the CPU quantised path's error on the same part
        auto part = [&](const std::vector<float> &v, size_t a, size_t b) {
            return std::vector<float>(v.begin() + static_cast<std::ptrdiff_t>(a * V), v.begin() + static_cast<std::ptrdiff_t>(b * V));
        };
        for (const auto &[a, b, what] : {std::tuple{size_t{0}, n, "prompt"}, std::tuple{n, N, "decode"}}) {
            const err_stats g = compare_logits(part(got, a, b), part(ref, a, b), b - a, V),
                            c = compare_logits(part(cpuq, a, b), part(ref, a, b), b - a, V);
            std::printf("  qat %d kv %s %-6s: CUDA median %.3g worst %.3g (pos %zu) argmax %zu/%zu | CPU quantised median "
                        "%.3g worst %.3g argmax %zu/%zu\n",
                        static_cast<int>(md.first), md.second == kv_precision::f16 ? "f16" : "f32", what, g.median,
                        g.worst, a + g.worst_at, g.argmax_same, b - a, c.median, c.worst, c.argmax_same, b - a);
            EXPECT_LE(g.median, 2.0 * c.median + 1e-4) << what;
            if (md.first != ds4::qat_mode::full) {
                EXPECT_LE(g.worst, 2.0 * c.worst + 1e-4) << what;
            }
            EXPECT_GE(g.argmax_same + 3, c.argmax_same) << what;
        }
    }
}

// Logits left on the device: last_logits() equals the logits eval() downloads (decode step and
// chunked prefill), logits_top() selects the host's best ids with the host's max, and both refuse
// before anything is evaluated.
TEST_F(CudaDs4Model, LogitsStayOnTheDeviceForSampling) {
    auto m = ds4::load_model(quant_model_path());
    const size_t V = static_cast<size_t>(m->hp.n_vocab);
    const auto toks = random_tokens(40, m->hp.n_vocab, 31);
    auto w = upload(*m, ds4::qat_mode::full, kv_precision::f16);
    ds4::cuda_sequence a(w, 64, true, 16), b(w, 64, true, 16);
    std::vector<float> la(V), lb(V, std::nanf(""));
    EXPECT_THROW(b.last_logits(lb), error);
    EXPECT_THROW(b.logits_top(4, {}, 1.0f, 0.0f, 0.0f), error);
    for (size_t n : {size_t{37}, size_t{1}, size_t{1}}) {  // a chunked prefill, then two decode steps
        const size_t at = static_cast<size_t>(a.n_past());
        a.eval(std::span(toks).subspan(at, n), la);
        b.eval(std::span(toks).subspan(at, n), {});
        b.last_logits(lb);
        ASSERT_EQ(0, std::memcmp(la.data(), lb.data(), V * sizeof(float))) << "after " << a.n_past() << " tokens";
        const auto t = b.logits_top(5, {}, 1.0f, 0.0f, 0.0f);
        std::vector<int32_t> order(V);
        std::iota(order.begin(), order.end(), 0);
        std::stable_sort(order.begin(), order.end(), [&](int32_t x, int32_t y) { return la[x] > la[y]; });
        std::vector<int32_t> got = t.ids;
        std::sort(got.begin(), got.end());
        std::vector<int32_t> want(order.begin(), order.begin() + 5);
        std::sort(want.begin(), want.end());
        EXPECT_EQ(got, want);
        EXPECT_EQ(t.max_logit, la[static_cast<size_t>(order[0])]);
        EXPECT_EQ(t.bad, 0u);
    }
}

// Sequences sharing a prefill pool (cuda_prefill_pool: one chunk scratch taken for each multi-token
// evaluation and given back) give bit for bit the logits of sequences that own their scratch (checked
// against the CPU reference above), with their evaluations interleaved, a pooled sequence destroyed
// mid-way and a new one created afterwards (the scratch it hands back is reused), and at another
// context size (a scratch of another geometry is not taken).
TEST_F(CudaDs4Model, SequencesSharingAPrefillPoolMatchOwnScratch) {
    auto m = ds4::load_model(quant_model_path());
    const size_t V = static_cast<size_t>(m->hp.n_vocab);
    const auto toks = random_tokens(400, m->hp.n_vocab, 41);
    auto w = upload(*m, ds4::qat_mode::full, kv_precision::f16);
    auto pool = ds4::cuda_make_prefill_pool();
    struct pair {
        std::unique_ptr<ds4::cuda_sequence> own, pooled;
    };
    auto make = [&](int64_t n_ctx) {
        return pair{std::make_unique<ds4::cuda_sequence>(w, n_ctx, true, 37),
                    std::make_unique<ds4::cuda_sequence>(w, n_ctx, true, 37, pool)};
    };
    std::vector<pair> seqs;
    seqs.push_back(make(320));
    seqs.push_back(make(320));
    seqs.push_back(make(200));
    // (sequence, tokens): prompts of several chunks, decodes, more prompt after decodes.
    const std::vector<std::pair<size_t, size_t>> plan = {{0, 101}, {1, 80}, {0, 1}, {0, 1}, {2, 120}, {1, 1},
                                                          {0, 50},  {2, 1}, {1, 74}, {2, 2}, {0, 1}};
    std::vector<float> a, b;
    int step = 0;
    auto run = [&](size_t i, size_t n) {
        ds4::cuda_sequence &x = *seqs[i].own, &y = *seqs[i].pooled;
        const size_t at = static_cast<size_t>(x.n_past());
        a.assign(n * V, 0.0f);
        b.assign(n * V, 1.0f);
        x.eval(std::span(toks).subspan(at, n), a);
        y.eval(std::span(toks).subspan(at, n), b);
        ASSERT_EQ(x.n_past(), y.n_past());
        ASSERT_EQ(0, std::memcmp(a.data(), b.data(), a.size() * sizeof(float))) << "step " << step << " sequence " << i;
        ++step;
    };
    for (const auto &[i, n] : plan) run(i, n);
    seqs[1] = make(320);  // destroyed after handing its scratch back; a fresh one reuses it
    for (const auto &[i, n] : std::vector<std::pair<size_t, size_t>>{{1, 90}, {0, 1}, {1, 1}, {2, 40}}) run(i, n);
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
    const int32_t bad_chunk[] = {3, 4, -1};  // chunked path: rejected before anything runs
    EXPECT_THROW(seq.eval(bad_chunk, l), error);
    EXPECT_EQ(seq.n_past(), 2);
    EXPECT_THROW(ds4::cuda_sequence(w, 8, true, -1), error);
    EXPECT_TRUE(std::all_of(l.begin(), l.end(), [](float v) { return std::isfinite(v); }));
    EXPECT_THROW(ds4::cuda_sequence(w, int64_t{1} << 40), error);  // more memory than the device has
}

}  // namespace
}  // namespace fathom
