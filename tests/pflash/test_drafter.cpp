// PFlash's drafter (src/pflash/drafter.cpp) against the scoring rule of drafter.h computed here in
// float64: score(j) = mean over the last Q tokens t of max over layers l and heads h of
// softmax_j(scale * q_pre[l,h,t] . k_pre[l,h,j]), j <= t. The pre-RoPE q/k come from the model's own
// forward through an attention hook of this test (prefix with the drafter's sliding window, the Q
// query tokens with full attention), so the check covers what the drafter's hook keeps (layers, rows,
// pre-RoPE, positions), its window and its query/prefill split, and the reuse of a held prefix.
// Real models (SmolLM2-135M, and Gemma3-270M for sliding-window layers, q/k norms and the q scale);
// skipped when none is installed.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "backend/cpu/quants.h"
#include "gguf/gguf.h"
#include "kv/kv_cache.h"
#include "models/dense.h"
#include "pflash/drafter.h"

using namespace fathom;

namespace {

const std::string kSmol = std::string(FATHOM_SOURCE_DIR) + "/models/SmolLM2-135M-Instruct.Q4_1.gguf";
const std::string kGemma = std::string(FATHOM_SOURCE_DIR) + "/models/gemma-3-270m-q4_k_m.gguf";

struct qk_rec {
    backend *be = nullptr;
    std::vector<std::vector<float>> q, k;  // [n_layer] host rows of the last forward
};

void keep_qk(void *user, int32_t layer, const tensor &q, const tensor &k) {
    auto &r = *static_cast<qk_rec *>(user);
    r.q[size_t(layer)].resize(size_t(q.ne[0] * q.ne[1]));
    r.k[size_t(layer)].resize(size_t(k.ne[0] * k.ne[1]));
    r.be->download(q, r.q[size_t(layer)].data());
    r.be->download(k, r.k[size_t(layer)].data());
}

// The scores of drafter.h's rule for ids with Q queries and prefill window `window`, in float64.
std::vector<double> reference_scores(const std::string &path, const std::vector<int32_t> &ids, int64_t n_q,
                                     int32_t window) {
    auto f = gguf::file::open(path);
    cpu_options co;
    co.n_threads = 2;
    auto be = make_cpu_backend(co);
    auto m = dense_load(*f, *be);
    const dense_hparams &hp = m->hp;
    const int64_t n = int64_t(ids.size()), n_pre = n - n_q, hd = hp.head_dim;
    kv_cache kv(*be, hp.n_layer, hp.n_head_kv, hp.head_dim, n, dtype::f16);
    auto s = dense_scratch_create(hp, *be, n);
    // Pre-RoPE k of every token, q of the queries: [n_layer][rows x width].
    std::vector<std::vector<float>> k_all(size_t(hp.n_layer)), q_all;
    qk_rec rec;
    rec.be = be.get();
    rec.q.resize(size_t(hp.n_layer));
    rec.k.resize(size_t(hp.n_layer));
    dense_attn_hook hook;
    hook.fn = keep_qk;
    hook.user = &rec;
    const int64_t part[2][2] = {{0, n_pre}, {n_pre, n}};
    for (int i = 0; i < 2; ++i) {
        hook.window = i == 0 ? window : 0;
        dense_seq sq;
        sq.kv.cache = &kv;
        sq.pos = part[i][0];
        sq.tokens = std::span<const int32_t>(&ids[size_t(part[i][0])], size_t(part[i][1] - part[i][0]));
        dense_forward(*m, *be, *s, std::span<const dense_seq>(&sq, 1), dense_trace{}, hook);
        for (int32_t l = 0; l < hp.n_layer; ++l)  // kept in f16, as the drafter keeps them
            for (float v : rec.k[size_t(l)]) k_all[size_t(l)].push_back(cpu::f16_to_f32(cpu::f32_to_f16(v)));
    }
    q_all = rec.q;
    std::vector<double> score(size_t(n), 0.0);
    const int64_t group = hp.n_head / hp.n_head_kv, QW = hp.n_head * hd, KW = hp.n_head_kv * hd;
    for (int64_t t = 0; t < n_q; ++t) {
        const int64_t pos = n_pre + t;
        std::vector<double> agg(size_t(pos + 1), 0.0);
        for (int32_t l = 0; l < hp.n_layer; ++l)
            for (int64_t h = 0; h < hp.n_head; ++h) {
                const float *q = &q_all[size_t(l)][size_t(t * QW + h * hd)];
                std::vector<double> sc(size_t(pos + 1));
                double mx = -INFINITY;
                for (int64_t j = 0; j <= pos; ++j) {
                    const float *k = &k_all[size_t(l)][size_t(j * KW + (h / group) * hd)];
                    double d = 0;
                    for (int64_t i = 0; i < hd; ++i) d += double(q[i]) * double(k[i]);
                    d *= hp.attn_scale;
                    if (hp.attn_softcap > 0) d = hp.attn_softcap * std::tanh(d / hp.attn_softcap);
                    sc[size_t(j)] = d;
                    mx = std::max(mx, d);
                }
                double sum = 0;
                for (double &v : sc) sum += (v = std::exp(v - mx));
                for (int64_t j = 0; j <= pos; ++j) agg[size_t(j)] = std::max(agg[size_t(j)], sc[size_t(j)] / sum);
            }
        for (int64_t j = 0; j <= pos; ++j) score[size_t(j)] += agg[size_t(j)] / double(n_q);
    }
    return score;
}

void expect_scores_near(const std::vector<float> &got, const std::vector<double> &want, const std::string &what) {
    ASSERT_EQ(got.size(), want.size()) << what;
    double worst = 0;
    size_t at = 0;
    for (size_t j = 0; j < want.size(); ++j)
        if (std::abs(got[j] - want[j]) > worst) {
            worst = std::abs(got[j] - want[j]);
            at = j;
        }
    // f32 sums and exp in the drafter, double here.
    EXPECT_LT(worst, 1e-4) << what << ": token " << at << " scores " << got[at] << " vs " << want[at];
}

}  // namespace

TEST(pflash_drafter, scores_match_float64_rule_on_the_models_forward) {
    int n_run = 0;
    for (const std::string &path : {kSmol, kGemma}) {
        if (!std::filesystem::exists(path)) continue;
        SCOPED_TRACE(path);
        auto d = pflash::drafter::load(path, 2, 32);
        std::vector<int32_t> ids;
        for (int i = 0; i < 90; ++i) ids.push_back(300 + (i * 53) % 4000);
        pflash::drafter_score_params p;
        p.query_tokens = 4;
        p.window = 16;  // < the prefix: the prefill's attention really is windowed
        pflash::drafter_stats st;
        expect_scores_near(d->score(ids, p, st), reference_scores(path, ids, 4, 16), "window 16");
        EXPECT_EQ(st.n_evaluated, 90);
        // A longer prompt over the same prefix: the held windowed prefix is reused, the scores are
        // still the rule's.
        std::vector<int32_t> more = ids;
        for (int i = 0; i < 20; ++i) more.push_back(700 + i);
        expect_scores_near(d->score(more, p, st), reference_scores(path, more, 4, 16), "reused prefix");
        EXPECT_LT(st.n_evaluated, 40);
        p.window = 0;  // full attention everywhere
        d->reset_state();
        expect_scores_near(d->score(ids, p, st), reference_scores(path, ids, 4, 0), "window 0");
        ++n_run;
    }
    if (n_run == 0) GTEST_SKIP() << "no dense drafter model installed";
}
