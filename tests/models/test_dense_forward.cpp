// The dense family's one forward (src/models/dense_forward.cpp) through its internal API:
//   - batches: sequences at different positions, contiguous and paged K/V, one-token and multi-token
//     rows, logits of one or several last rows or none, evaluated in ONE forward: every logit must be
//     bit-identical to the same sequence evaluated alone (a batch of one), and close to the float64
//     reference (tests/models/scripts/dense_reference.py) for the tiny qwen3; the same for the real
//     models (quantised weights, batch-invariant numerics) when installed;
//   - the trace callback, passed per call: the llama.cpp tensor names in graph order, values checked
//     against a float64 evaluation in the test (embedding rows, final norm x output head = logits),
//     rows of a batch equal to the single-sequence trace, nothing traced by a call without it;
//   - the attention hook (PFlash's drafter): pre-RoPE q/k of layer 0 against a float64 evaluation at
//     positions where RoPE would change them, one call per layer, stop_layer ending the forward
//     (no logits), its q/k unchanged by stopping, and the window (1 = attend to oneself only).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "backend/backend.h"
#include "backend/cpu/quants.h"
#include "core/error.h"
#include "gguf/gguf.h"
#include "kv/kv_cache.h"
#include "kv/kv_pool.h"
#include "models/dense.h"

using namespace fathom;

namespace {

const std::string kTiny = std::string(FATHOM_SOURCE_DIR) + "/tests/models/data/tiny_qwen3.gguf";
const std::string kSmol = std::string(FATHOM_SOURCE_DIR) + "/models/SmolLM2-135M-Instruct.Q4_1.gguf";
const std::string kGemma = std::string(FATHOM_SOURCE_DIR) + "/models/gemma-3-270m-q4_k_m.gguf";

nlohmann::json tiny_reference() {
    std::ifstream in(std::string(FATHOM_SOURCE_DIR) + "/tests/models/data/tiny_qwen3_reference.json");
    return nlohmann::json::parse(in);
}

struct loaded {
    std::shared_ptr<const gguf::file> f;
    std::unique_ptr<backend> be;
    std::unique_ptr<dense_model> m;
};

loaded load(const std::string &path, bool exact) {
    loaded l;
    l.f = gguf::file::open(path);
    cpu_options co;
    co.n_threads = 2;
    co.exact = exact;
    l.be = make_cpu_backend(co);
    l.m = dense_load(*l.f, *l.be);
    return l;
}

std::vector<float> host(backend &be, const tensor &t) {
    std::vector<float> out(static_cast<size_t>(t.ne[0] * t.ne[1]));
    be.download(t, out.data());
    return out;
}

// Row r of a weight / embedding tensor, dequantised, as doubles.
std::vector<double> weight_row(const tensor &w, int64_t r) {
    std::vector<float> f(static_cast<size_t>(w.ne[0]));
    cpu::dequantize_row(w.type, static_cast<const uint8_t *>(w.data) + r * w.nb1, f.data(), w.ne[0]);
    return std::vector<double>(f.begin(), f.end());
}

// x / rms(x) * w, in double.
std::vector<double> rms_norm(const std::vector<double> &x, const std::vector<double> &w, double eps) {
    double ss = 0;
    for (double v : x) ss += v * v;
    const double inv = 1.0 / std::sqrt(ss / double(x.size()) + eps);
    std::vector<double> y(x.size());
    for (size_t i = 0; i < x.size(); ++i) y[i] = x[i] * inv * w[i];
    return y;
}

// W . x for W [N, K] (dequantised) and x [K].
std::vector<double> matvec(const tensor &w, const std::vector<double> &x) {
    std::vector<double> y(static_cast<size_t>(w.ne[1]));
    for (int64_t r = 0; r < w.ne[1]; ++r) {
        const std::vector<double> row = weight_row(w, r);
        double acc = 0;
        for (size_t i = 0; i < x.size(); ++i) acc += row[i] * x[i];
        y[static_cast<size_t>(r)] = acc;
    }
    return y;
}

size_t count_diff(const float *a, const float *b, size_t n) {
    size_t d = 0;
    for (size_t i = 0; i < n; ++i) d += std::memcmp(&a[i], &b[i], sizeof(float)) != 0;
    return d;
}

// One sequence's K/V for the batch tests: a contiguous cache or a sequence of a shared pool.
struct seq_kv {
    std::unique_ptr<kv_cache> cache;
    int pool_seq = -1;
    dense_kv kv(kv_pool &pool) const {
        dense_kv k;
        if (cache) {
            k.cache = cache.get();
        } else {
            k.pool = &pool;
            k.seq = pool_seq;
        }
        return k;
    }
};

// A batch case: sequence i holds tokens[0, held) of the stream and evaluates tokens[held, held + n)
// with the logits of its last n_out rows (n_out 0: none).
struct case_seq {
    int64_t held, n, n_out;
    bool paged;
};

// Runs `cases` over the token stream `toks` twice: every sequence alone (each a batch of one), then all
// in one forward; expects bit-identical logits. Returns the batched logits (per sequence, [n_out, V]).
// K/V in `kv_type` (caches and pool).
std::vector<std::vector<float>> check_batch_equals_single(loaded &l, const std::vector<int32_t> &toks,
                                                          const std::vector<case_seq> &cases, dtype kv_type) {
    const dense_model &m = *l.m;
    const int64_t V = m.hp.n_vocab, n_ctx = 64;
    const size_t B = cases.size();
    std::vector<std::vector<float>> out[2];
    for (int batched = 0; batched < 2; ++batched) {
        kv_pool pool(*l.be, m.hp.n_layer, m.hp.n_head_kv, m.hp.head_dim, kv_type, 16, 4, 0);
        std::vector<seq_kv> kvs(B);
        auto s = dense_scratch_create(m.hp, *l.be, 64);
        // Prefixes, each alone in chunks of 3 (crossing chunk boundaries like a session's prefill).
        for (size_t i = 0; i < B; ++i) {
            const case_seq &c = cases[i];
            if (c.paged) {
                kvs[i].pool_seq = pool.seq_open();
                EXPECT_TRUE(pool.reserve(kvs[i].pool_seq, c.held + c.n));
            } else {
                kvs[i].cache = std::make_unique<kv_cache>(*l.be, m.hp.n_layer, m.hp.n_head_kv, m.hp.head_dim, n_ctx,
                                                          kv_type);
            }
            for (int64_t p = 0; p < c.held; p += 3)
                dense_forward(m, *l.be, kvs[i].kv(pool), *s, &toks[size_t(p)], std::min<int64_t>(3, c.held - p), p, 0,
                              nullptr);
        }
        out[batched].assign(B, {});
        std::vector<dense_seq> seqs(B);
        for (size_t i = 0; i < B; ++i) {
            const case_seq &c = cases[i];
            out[batched][i].assign(size_t(c.n_out * V), std::numeric_limits<float>::quiet_NaN());
            seqs[i] = {kvs[i].kv(pool), c.held, std::span<const int32_t>(&toks[size_t(c.held)], size_t(c.n)),
                       c.n_out ? out[batched][i].data() : nullptr, c.n_out};
        }
        if (batched) {
            dense_forward(m, *l.be, *s, seqs);
        } else {
            for (size_t i = 0; i < B; ++i) dense_forward(m, *l.be, *s, std::span<const dense_seq>(&seqs[i], 1));
        }
        for (size_t i = 0; i < B; ++i) {
            if (kvs[i].cache) {
                EXPECT_EQ(kvs[i].cache->n_used, cases[i].held + cases[i].n);
            }
        }
    }
    for (size_t i = 0; i < B; ++i) {
        EXPECT_EQ(count_diff(out[0][i].data(), out[1][i].data(), out[0][i].size()), 0u)
            << "sequence " << i << " (held " << cases[i].held << ", " << cases[i].n << " tokens, "
            << (cases[i].paged ? "paged" : "contiguous") << "): batched logits differ from the single-sequence ones";
    }
    return out[1];
}

// Mixed batches over the tiny model's reference tokens (10): one-token and multi-token sequences,
// several-row logits, no logits, contiguous and paged.
std::vector<case_seq> tiny_cases(bool all_paged) {
    return {
        {4, 1, 1, all_paged},  // a decode at position 4
        {0, 6, 6, all_paged},  // a whole prompt, every row's logits
        {2, 1, 1, true},       // a paged decode
        {7, 3, 2, true},       // a verification: the last two rows
        {8, 1, 0, all_paged},  // evaluated, no logits
        {5, 1, 1, true},       // another paged decode
    };
}

}  // namespace

TEST(DenseForward, TinyQwen3BatchBitIdenticalToSingleAndMatchesFloat64) {
    const auto j = tiny_reference();
    const auto toks = j["tokens"].get<std::vector<int32_t>>();
    for (bool exact : {true, false})
        for (bool all_paged : {false, true}) {
            SCOPED_TRACE(std::string(exact ? "exact" : "fast") + (all_paged ? ", all paged" : ", mixed"));
            loaded l = load(kTiny, exact);
            const auto cases = tiny_cases(all_paged);
            // Exact numerics with an f32 KV against float64; the fast ones with f16 K/V (batched rows).
            const auto got = check_batch_equals_single(l, toks, cases, exact ? dtype::f32 : dtype::f16);
            // Truth: the float64 reference's top logits at each evaluated position.
            const int64_t V = l.m->hp.n_vocab;
            const double tol = exact ? 1e-4 : 2e-2;
            for (size_t i = 0; i < cases.size(); ++i)
                for (int64_t r = 0; r < cases[i].n_out; ++r) {
                    const int64_t p = cases[i].held + cases[i].n - cases[i].n_out + r;
                    const auto &pos = j["positions"][size_t(p)];
                    const double rms = pos["norm"].get<double>() / std::sqrt(double(V));
                    for (size_t k = 0; k < pos["ids"].size(); ++k) {
                        const float v = got[i][size_t(r * V + pos["ids"][k].get<int64_t>())];
                        EXPECT_LT(std::abs(v - pos["logits"][k].get<double>()) / rms, tol)
                            << "sequence " << i << " position " << p;
                    }
                }
        }
}

TEST(DenseForward, RealModelsBatchBitIdenticalToSingle) {
    // Quantised weights on the batch-invariant numerics; gemma3 adds sliding-window layers, q/k norms,
    // post-norms and the embedding scale.
    int n_run = 0;
    for (const std::string &path : {kSmol, kGemma}) {
        if (!std::filesystem::exists(path)) continue;
        SCOPED_TRACE(path);
        loaded l = load(path, false);
        std::vector<int32_t> toks;
        for (int i = 0; i < 40; ++i) toks.push_back(300 + (i * 53) % 4000);
        check_batch_equals_single(l, toks,
                                  {{30, 1, 1, true}, {0, 20, 3, false}, {11, 1, 1, false}, {25, 7, 7, true},
                                   {3, 1, 1, true}, {33, 1, 1, true}},
                                  dtype::f16);
        ++n_run;
    }
    if (n_run == 0) GTEST_SKIP() << "no real dense model installed";
}

// The forward's fused ops (backend.h: mul_mat_normed, mul_mat_add, glu_mul_mat_add, rms_norm_add,
// qk_rope_store; taken without a trace callback) are on the CPU exactly the separate ops the traced
// forward runs: logits and KV caches bit for bit, prefill and decode, on the tiny qwen3 (q/k norms) and the
// real models when installed (SmolLM2: llama; Gemma3: post-norms, q scale, sliding window).
TEST(DenseForward, FusedOpsEqualSeparateOpsBitForBit) {
    const dense_trace nop{[](void *, const char *, int32_t, const tensor &) {}, nullptr};
    for (const std::string &path : {kTiny, kSmol, kGemma}) {
        if (!std::filesystem::exists(path)) continue;
        for (bool exact : {true, false}) {
            SCOPED_TRACE(path + (exact ? " exact" : " fast"));
            loaded l = load(path, exact);
            const dense_model &m = *l.m;
            const size_t V = static_cast<size_t>(m.hp.n_vocab);
            std::vector<int32_t> toks;
            for (int i = 0; i < 12; ++i) toks.push_back(3 + (i * 53) % (m.hp.n_vocab - 3));
            std::vector<float> lg[2];
            std::vector<std::vector<float>> caches[2];
            for (int traced = 0; traced < 2; ++traced) {
                kv_cache kv(*l.be, m.hp.n_layer, m.hp.n_head_kv, m.hp.head_dim, 16, dtype::f16);
                auto s = dense_scratch_create(m.hp, *l.be, 16);
                const dense_trace &tr = traced ? nop : dense_trace{};
                lg[traced].assign(3 * V, 0.0f);
                dense_forward(m, *l.be, kv, *s, toks.data(), 10, 0, 1, lg[traced].data(), tr);  // prefill
                dense_forward(m, *l.be, kv, *s, &toks[10], 1, 10, 1, lg[traced].data() + V, tr);  // decode
                dense_forward(m, *l.be, kv, *s, &toks[11], 1, 11, 1, lg[traced].data() + 2 * V, tr);
                for (int32_t il = 0; il < m.hp.n_layer; ++il)
                    for (const tensor *c : {&kv.k[size_t(il)], &kv.v[size_t(il)]}) {
                        const auto *h = static_cast<const uint16_t *>(c->data);
                        std::vector<float> f(c->nbytes() / 2);
                        for (size_t i = 0; i < f.size(); ++i) f[i] = static_cast<float>(h[i]);
                        caches[traced].push_back(std::move(f));
                    }
            }
            EXPECT_EQ(std::memcmp(lg[0].data(), lg[1].data(), lg[0].size() * sizeof(float)), 0) << "logits differ";
            EXPECT_TRUE(caches[0] == caches[1]) << "KV caches differ";
        }
    }
}

TEST(DenseForward, Validation) {
    loaded l = load(kTiny, true);
    const dense_model &m = *l.m;
    kv_cache a(*l.be, m.hp.n_layer, m.hp.n_head_kv, m.hp.head_dim, 8, dtype::f32);
    kv_cache other(*l.be, m.hp.n_layer, m.hp.n_head_kv, m.hp.head_dim + 1, 8, dtype::f32);
    auto s = dense_scratch_create(m.hp, *l.be, 4);
    const int32_t toks[] = {1, 2, 3, 4, 5}, bad[] = {1, int32_t(m.hp.n_vocab)};
    dense_kv ka, ko;
    ka.cache = &a;
    ko.cache = &other;
    auto run = [&](std::vector<dense_seq> seqs) { dense_forward(m, *l.be, *s, seqs); };
    EXPECT_THROW(run({}), error);                                                       // no sequences
    EXPECT_THROW(run({{ka, 0, std::span<const int32_t>(toks, 5)}}), error);              // rows > n_batch
    EXPECT_THROW(run({{ka, 6, std::span<const int32_t>(toks, 3)}}), error);              // beyond the context
    EXPECT_THROW(run({{ka, 0, std::span<const int32_t>(bad, 2)}}), error);               // token id
    EXPECT_THROW(run({{ko, 0, std::span<const int32_t>(toks, 1)}}), error);              // cache geometry
    EXPECT_THROW(run({{ka, 0, std::span<const int32_t>(toks, 1)}, {ka, 1, std::span<const int32_t>(toks, 1)}}),
                 error);                                                                 // one cache twice
    EXPECT_THROW(run({{dense_kv{}, 0, std::span<const int32_t>(toks, 1)}}), error);      // no cache
    float lg[64];
    EXPECT_THROW(run({{ka, 0, std::span<const int32_t>(toks, 2), lg, 3}}), error);       // n_out > n
    EXPECT_EQ(a.n_used, 0);  // nothing ran
}

// ---- trace ----

namespace {

struct trace_rec {
    backend *be = nullptr;
    std::vector<std::string> names;
    std::vector<int32_t> layers;
    std::vector<std::vector<float>> values;  // host copies, same order
};

void record(void *user, const char *name, int32_t layer, const tensor &t) {
    auto &r = *static_cast<trace_rec *>(user);
    r.names.push_back(name);
    r.layers.push_back(layer);
    r.values.push_back(host(*r.be, t));
}

}  // namespace

TEST(DenseForward, TraceCallbackNamesValuesAndBatchRows) {
    const auto toks = tiny_reference()["tokens"].get<std::vector<int32_t>>();
    loaded l = load(kTiny, true);
    const dense_model &m = *l.m;
    const int64_t V = m.hp.n_vocab, E = m.hp.n_embd, n = 4;
    kv_cache kv(*l.be, m.hp.n_layer, m.hp.n_head_kv, m.hp.head_dim, 16, dtype::f32);
    auto s = dense_scratch_create(m.hp, *l.be, 8);
    trace_rec rec;
    rec.be = l.be.get();
    const dense_trace tr{record, &rec};
    std::vector<float> lg(size_t(2 * V));
    dense_forward(m, *l.be, kv, *s, toks.data(), n, 0, 2, lg.data(), tr);

    // llama.cpp's names, in graph order.
    std::vector<std::string> want = {"inp_scaled"};
    std::vector<int32_t> want_layer = {-1};
    for (int32_t il = 0; il < m.hp.n_layer; ++il)
        for (const char *nm : {"attn_norm", "Qcur", "Kcur", "Vcur", "kqv_out", "attn_out", "attn_post_norm", "ffn_inp",
                               "ffn_norm", "ffn_gate", "ffn_up", "ffn_glu", "ffn_down", "ffn_out", "l_out"}) {
            want.push_back(nm);
            want_layer.push_back(il);
        }
    want.push_back("result_norm");
    want_layer.push_back(-1);
    ASSERT_EQ(rec.names, want);
    EXPECT_EQ(rec.layers, want_layer);

    // inp_scaled: the tokens' embedding rows (f32/f16 -> f32 is exact).
    ASSERT_EQ(rec.values[0].size(), size_t(n * E));
    for (int64_t t = 0; t < n; ++t) {
        const auto row = weight_row(m.tok_embd, toks[size_t(t)]);
        for (int64_t i = 0; i < E; ++i) EXPECT_EQ(rec.values[0][size_t(t * E + i)], float(row[size_t(i)]));
    }
    // result_norm: rms_norm(l_out of the last layer) * output_norm for the two output rows, and the
    // logits are result_norm . output^T (float64 here).
    const auto &l_out = rec.values[rec.values.size() - 2], &res = rec.values.back();
    ASSERT_EQ(res.size(), size_t(2 * E));
    const auto onorm = weight_row(m.output_norm, 0);
    for (int64_t r = 0; r < 2; ++r) {
        std::vector<double> x(l_out.begin() + (n - 2 + r) * E, l_out.begin() + (n - 1 + r) * E);
        const auto y = rms_norm(x, onorm, m.hp.rms_eps);
        std::vector<double> xr(res.begin() + r * E, res.begin() + (r + 1) * E);
        for (int64_t i = 0; i < E; ++i) EXPECT_NEAR(xr[size_t(i)], y[size_t(i)], 1e-5);
        const auto logit = matvec(m.output, xr);
        for (int64_t v = 0; v < V; ++v) EXPECT_NEAR(lg[size_t(r * V + v)], logit[size_t(v)], 1e-4);
    }

    // Per call: a forward without the callback traces nothing.
    const size_t n_calls = rec.names.size();
    dense_forward(m, *l.be, kv, *s, &toks[size_t(n)], 1, n, 1, lg.data());
    EXPECT_EQ(rec.names.size(), n_calls);

    // In a batch, a sequence's rows of every traced tensor are those of its own traced forward: here
    // sequence 1 (2 tokens at positions 4, 5 over its 4-token prefix) sits after a one-token sequence.
    trace_rec single, batch;
    single.be = batch.be = l.be.get();
    kv_cache k1(*l.be, m.hp.n_layer, m.hp.n_head_kv, m.hp.head_dim, 16, dtype::f32),
        k2(*l.be, m.hp.n_layer, m.hp.n_head_kv, m.hp.head_dim, 16, dtype::f32),
        k3(*l.be, m.hp.n_layer, m.hp.n_head_kv, m.hp.head_dim, 16, dtype::f32);
    dense_forward(m, *l.be, k1, *s, toks.data(), 4, 0, 0, nullptr);
    dense_forward(m, *l.be, k2, *s, toks.data(), 4, 0, 0, nullptr);
    dense_forward(m, *l.be, k3, *s, toks.data(), 2, 0, 0, nullptr);
    dense_forward(m, *l.be, k1, *s, &toks[4], 2, 4, 0, nullptr, dense_trace{record, &single});
    dense_kv d2, d3;
    d2.cache = &k2;
    d3.cache = &k3;
    const std::vector<dense_seq> seqs = {{d2, 4, std::span<const int32_t>(&toks[4], 2)},
                                         {d3, 2, std::span<const int32_t>(&toks[2], 1)}};
    dense_forward(m, *l.be, *s, seqs, dense_trace{record, &batch});
    ASSERT_EQ(s->row0, (std::vector<int64_t>{1, 0}));  // the one-token sequence's row first
    ASSERT_EQ(batch.names, single.names);
    for (size_t i = 0; i < single.values.size(); ++i) {
        const size_t w = single.values[i].size() / 2;  // row width (two rows alone, three batched)
        ASSERT_EQ(batch.values[i].size(), 3 * w) << single.names[i];
        EXPECT_EQ(count_diff(&batch.values[i][w], single.values[i].data(), 2 * w), 0u)
            << single.names[i] << " layer " << single.layers[i];
    }
}

// ---- attention hook ----

namespace {

struct hook_rec {
    backend *be = nullptr;
    std::vector<int32_t> layers;
    std::vector<std::vector<float>> q, k;
};

void capture(void *user, int32_t layer, const tensor &q, const tensor &k) {
    auto &r = *static_cast<hook_rec *>(user);
    r.layers.push_back(layer);
    r.q.push_back(host(*r.be, q));
    r.k.push_back(host(*r.be, k));
}

}  // namespace

TEST(DenseForward, AttnHookPreRopeQKStopAndWindow) {
    const auto toks = tiny_reference()["tokens"].get<std::vector<int32_t>>();
    loaded l = load(kTiny, true);
    const dense_model &m = *l.m;
    const dense_hparams &hp = m.hp;
    const int64_t V = hp.n_vocab, hd = hp.head_dim, QW = int64_t{hp.n_head} * hd, KW = int64_t{hp.n_head_kv} * hd;
    const int64_t p0 = 3, n = 5;  // positions 3..7: RoPE would change q and k there
    auto s = dense_scratch_create(hp, *l.be, 8);

    // A full forward with the hook: one call per layer, in order.
    kv_cache kv(*l.be, hp.n_layer, hp.n_head_kv, hd, 16, dtype::f32);
    dense_forward(m, *l.be, kv, *s, toks.data(), p0, 0, 0, nullptr);
    hook_rec full;
    full.be = l.be.get();
    dense_attn_hook hook;
    hook.fn = capture;
    hook.user = &full;
    std::vector<float> lg(size_t(V), std::numeric_limits<float>::quiet_NaN());
    dense_seq sq;
    sq.kv.cache = &kv;
    sq.pos = p0;
    sq.tokens = std::span<const int32_t>(&toks[size_t(p0)], size_t(n));
    sq.logits = lg.data();
    sq.n_out = 1;
    dense_forward(m, *l.be, *s, std::span<const dense_seq>(&sq, 1), dense_trace{}, hook);
    ASSERT_EQ(full.layers.size(), size_t(hp.n_layer));
    for (int32_t il = 0; il < hp.n_layer; ++il) EXPECT_EQ(full.layers[size_t(il)], il);
    EXPECT_FALSE(std::isnan(lg[0]));

    // Layer 0's q and k, pre-RoPE, against float64: per-head RMS norms of Wq / Wk . rms_norm(embedding).
    ASSERT_EQ(full.q[0].size(), size_t(n * QW));
    ASSERT_EQ(full.k[0].size(), size_t(n * KW));
    const dense_layer &ly = m.layers[0];
    const auto an = weight_row(ly.attn_norm, 0), qn = weight_row(ly.attn_q_norm, 0), kn = weight_row(ly.attn_k_norm, 0);
    for (int64_t t = 0; t < n; ++t) {
        const auto xn = rms_norm(weight_row(m.tok_embd, toks[size_t(p0 + t)]), an, hp.rms_eps);
        for (const bool is_q : {true, false}) {
            const auto proj = matvec(is_q ? ly.wq : ly.wk, xn);
            const int64_t nh = is_q ? hp.n_head : hp.n_head_kv, W = nh * hd;
            for (int64_t h = 0; h < nh; ++h) {
                const std::vector<double> head(proj.begin() + h * hd, proj.begin() + (h + 1) * hd);
                const auto want = rms_norm(head, is_q ? qn : kn, hp.rms_eps);
                const float *got = (is_q ? full.q[0] : full.k[0]).data() + t * W + h * hd;
                for (int64_t i = 0; i < hd; ++i)
                    EXPECT_NEAR(got[i], want[size_t(i)], 1e-4) << (is_q ? "q" : "k") << " row " << t << " head " << h;
            }
        }
    }

    // stop_layer: the hook's calls end there, its q/k are the full forward's, no logits are written,
    // and the cache still records the positions.
    kv_cache kv2(*l.be, hp.n_layer, hp.n_head_kv, hd, 16, dtype::f32);
    dense_forward(m, *l.be, kv2, *s, toks.data(), p0, 0, 0, nullptr);
    hook_rec part;
    part.be = l.be.get();
    hook.user = &part;
    hook.stop_layer = 1;
    std::vector<float> lg2(size_t(V), std::numeric_limits<float>::quiet_NaN());
    sq.kv.cache = &kv2;
    sq.logits = lg2.data();
    dense_forward(m, *l.be, *s, std::span<const dense_seq>(&sq, 1), dense_trace{}, hook);
    EXPECT_EQ(part.layers, (std::vector<int32_t>{0, 1}));
    for (size_t il = 0; il < part.layers.size(); ++il) {
        EXPECT_EQ(count_diff(part.q[il].data(), full.q[il].data(), full.q[il].size()), 0u) << "layer " << il;
        EXPECT_EQ(count_diff(part.k[il].data(), full.k[il].data(), full.k[il].size()), 0u) << "layer " << il;
    }
    for (float v : lg2) ASSERT_TRUE(std::isnan(v)) << "a stopped forward wrote logits";
    EXPECT_EQ(kv2.n_used, p0 + n);

    // window 1: every row attends to its own position only, so kqv_out is its own V row (softmax of
    // one score is exactly 1 in exact mode) for every head of a KV group; window n + p0 changes nothing.
    trace_rec tr;
    tr.be = l.be.get();
    dense_attn_hook w1;
    w1.window = 1;
    kv_cache kv3(*l.be, hp.n_layer, hp.n_head_kv, hd, 16, dtype::f32);
    dense_forward(m, *l.be, kv3, *s, toks.data(), p0, 0, 0, nullptr);
    sq.kv.cache = &kv3;
    sq.logits = nullptr;
    dense_forward(m, *l.be, *s, std::span<const dense_seq>(&sq, 1), dense_trace{record, &tr}, w1);
    size_t n_checked = 0;
    for (size_t i = 0; i + 1 < tr.names.size(); ++i) {
        if (tr.names[i] != "Vcur") continue;
        ASSERT_EQ(tr.names[i + 1], "kqv_out");
        const auto &v = tr.values[i], &o = tr.values[i + 1];
        const int64_t group = hp.n_head / hp.n_head_kv;
        for (int64_t t = 0; t < n; ++t)
            for (int64_t h = 0; h < hp.n_head; ++h)
                for (int64_t d = 0; d < hd; ++d)
                    EXPECT_EQ(o[size_t(t * QW + h * hd + d)], v[size_t(t * KW + (h / group) * hd + d)]);
        ++n_checked;
    }
    EXPECT_EQ(n_checked, size_t(hp.n_layer));
    std::vector<float> lg_wide(static_cast<size_t>(V));
    dense_attn_hook wide;
    wide.window = int32_t(p0 + n);
    kv_cache kv4(*l.be, hp.n_layer, hp.n_head_kv, hd, 16, dtype::f32);
    dense_forward(m, *l.be, kv4, *s, toks.data(), p0, 0, 0, nullptr);
    sq.kv.cache = &kv4;
    sq.logits = lg_wide.data();
    dense_forward(m, *l.be, *s, std::span<const dense_seq>(&sq, 1), dense_trace{}, wide);
    EXPECT_EQ(count_diff(lg_wide.data(), lg.data(), lg.size()), 0u);
}
