// The DSpark drafter on the device (ds4::cuda_upload_dspark, ds4::cuda_dspark) and the target's feature
// capture (cuda_sequence::set_feature_layers) against independent truth:
//  - ../shared/golden/ds4-tiny-dspark/dspark_cases.jsonl, the official f32 semantics: all 6 cases fed with
//    the golden `main_hidden` features (teacher-forced and greedy Markov chain), compared by the README's
//    strict tier; a wrong seed must fail the same comparison;
//  - end to end (the strict cases): the target on the device capturing its layer 3/4/5 stream means in a
//    prefill chunk, token by token and in multi-row steps; the features against the CPU's
//    ds4::dspark_capture (f32 rounding apart) and the golden main_hidden, the block against the golden;
//  - rollback: a drafter that saw verified rows past S and drafted there, then truncated to S, drafts at S
//    bit for bit what a drafter that only ever saw S positions drafts;
//  - bad input: features that are not whole rows, a seed or Markov input outside the vocabulary, capture
//    layers outside the model, feature buffers the sequence was not set up for.
// Skips without a CUDA device.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <memory>
#include <numeric>
#include <string>
#include <vector>

#include "backend/cuda/cuda_test_util.h"
#include "core/error.h"
#include "models/cuda/deepseek4_cuda.h"
#include "models/cuda/deepseek4_cuda_dspark.h"
#include "models/deepseek4.h"
#include "models/deepseek4_dspark.h"
#include "models/ds4/dspark_golden.h"
#include "models/ds4/golden_util.h"

namespace fathom {
namespace {

using CudaDs4Dspark = cuda_test::cuda_device_test;
using ds4_test::dspark_case;

struct tiny {
    std::unique_ptr<ds4::model> target;
    std::unique_ptr<ds4::dspark_weights> drafter;
    std::vector<dspark_case> cases;
};
const tiny &data() {
    static tiny t = [] {
        tiny d;
        d.target = ds4::load_model(ds4_test::golden_dir() + "/ds4-tiny-a.gguf");
        d.drafter = ds4::load_dspark(*d.target, ds4_test::dspark_dir() + "/ds4-tiny-a-dspark.gguf");
        d.cases = ds4_test::load_dspark_cases();
        return d;
    }();
    return t;
}

struct device_pair {
    std::shared_ptr<const ds4::cuda_weights> target, drafter;
};
device_pair upload(ds4::qat_mode q) {
    ds4::cuda_run_options o;
    o.qat = q;
    o.kv = kv_precision::f32;
    device_pair d;
    d.target = ds4::cuda_upload(*data().target, o);
    d.drafter = ds4::cuda_upload_dspark(*data().target, *data().drafter, d.target);
    return d;
}

constexpr int64_t F = 384;  // 3 capture layers x 128

TEST_F(CudaDs4Dspark, GoldenFeatureFed) {
    const int V = data().target->hp.n_vocab;
    ASSERT_EQ(data().cases.size(), 6u);
    for (const dspark_case &c : data().cases) {
        const device_pair w = upload(c.qat);
        ds4::cuda_dspark d(w.drafter, c.qat);
        EXPECT_EQ(d.feature_dim(), F);
        d.observe(c.ctx_positions.front(), c.main_hidden);
        const int64_t S = static_cast<int64_t>(c.tokens.size());
        const ds4::dspark_block forced = d.draft(S, c.seed, c.markov_prev, true);
        EXPECT_EQ(forced.input_ids, c.block_input_ids) << c.name;
        EXPECT_EQ(forced.ctx_positions, c.ctx_positions) << c.name;
        const ds4_test::dspark_verdict v = ds4_test::compare(c, forced, V);
        EXPECT_TRUE(v.ok) << c.name << " (teacher-forced): " << v.why;
        const ds4_test::dspark_verdict g = ds4_test::compare(c, d.draft(S, c.seed, {}, true), V);
        EXPECT_TRUE(g.ok) << c.name << " (greedy chain): " << g.why;
        // the same drafter and features, the last prompt token as the seed: must fail
        EXPECT_FALSE(ds4_test::compare(c, d.draft(S, c.tokens.back(), {}, true), V).ok) << c.name << " (wrong seed)";
        // without logits: the same tokens and confidences
        const ds4::dspark_block lean = d.draft(S, c.seed);
        EXPECT_EQ(lean.draft_tokens, c.draft_tokens) << c.name;
        EXPECT_TRUE(lean.base_logits.empty());
        std::printf("  %-22s feature-fed  max top-8 err %.3g  max conf-logit err %.3g\n", c.name.c_str(), v.max_top8,
                    v.max_conf);
    }
}

// The features of a case's tokens captured on the device three ways (one prefill chunk of all tokens,
// token by token, multi-row steps of 5), the last `tail` rows each.
std::vector<std::vector<float>> device_features(const device_pair &w, const dspark_case &c, size_t tail) {
    const std::vector<int> layers = data().drafter->cfg.target_layers;
    const size_t n = c.tokens.size();
    std::vector<std::vector<float>> out;
    for (int how = 0; how < 3; ++how) {
        ds4::cuda_sequence seq(w.target, static_cast<int64_t>(n) + 8, true, how == 1 ? 0 : 4096);
        seq.set_feature_layers(layers, static_cast<int64_t>(tail));
        std::vector<float> f(tail * F, std::nanf(""));
        if (how < 2) {
            seq.eval(c.tokens, {}, {}, f);
        } else {
            std::vector<float> rows(n * F);
            for (size_t i = 0; i < n; i += 5) {
                const size_t m = std::min<size_t>(5, n - i);
                seq.eval_rows(std::span(c.tokens).subspan(i, m), {}, {}, std::span(rows).subspan(i * F, m * F));
            }
            std::copy(rows.end() - static_cast<std::ptrdiff_t>(tail * F), rows.end(), f.begin());
        }
        out.push_back(std::move(f));
    }
    return out;
}

TEST_F(CudaDs4Dspark, GoldenEndToEnd) {
    const tiny &t = data();
    const int V = t.target->hp.n_vocab;
    int strict = 0;
    for (const dspark_case &c : t.cases) {
        if (!c.end_to_end) continue;
        ++strict;
        const size_t n = c.tokens.size(), W = c.ctx_positions.size();
        ASSERT_EQ(W, std::min<size_t>(n, 32));
        const device_pair w = upload(c.qat);
        // the CPU's capture of the same tokens: the reference for the device's
        ds4::state st = ds4::new_state(*t.target, c.qat, kv_precision::f32);
        std::vector<int64_t> pos(n);
        std::iota(pos.begin(), pos.end(), 0);
        std::vector<float> cpu(n * F);
        ds4::dspark_capture(*t.target, *t.drafter, st, c.tokens, pos, cpu);
        const auto ways = device_features(w, c, W);
        const char *names[] = {"prefill", "token by token", "rows of 5"};
        for (size_t k = 0; k < ways.size(); ++k) {
            const std::vector<float> &f = ways[k];
            double err_cpu = 0, err_gold = 0, scale = 0;
            for (size_t i = 0; i < W * F; ++i) {
                const double cv = cpu[(n - W) * F + i];
                err_cpu = std::max(err_cpu, std::fabs(f[i] - cv));
                err_gold = std::max(err_gold, std::fabs(static_cast<double>(f[i]) - c.main_hidden[i]));
                scale = std::max(scale, std::fabs(cv));
            }
            EXPECT_LT(err_cpu, 1e-4 * std::max(scale, 1.0)) << c.name << " " << names[k];
            ds4::cuda_dspark d(w.drafter, c.qat);
            d.observe(static_cast<int64_t>(n - W), f);
            const ds4::dspark_block b = d.draft(static_cast<int64_t>(n), c.seed, {}, true);
            const ds4_test::dspark_verdict v = ds4_test::compare(c, b, V);
            EXPECT_TRUE(v.ok) << c.name << " " << names[k] << ": " << v.why;
            std::printf("  %-22s %-15s feature err vs CPU %.3g vs golden %.3g  top-8 err %.3g  conf %.3g\n", c.name.c_str(),
                        names[k], err_cpu, err_gold, v.max_top8, v.max_conf);
        }
    }
    EXPECT_EQ(strict, 4);
}

// Rows verified past S (observed), a block drafted there, then the target rolls back to S: the rings
// keep every row the block at S reads, so it equals a fresh drafter's at S bit for bit.
TEST_F(CudaDs4Dspark, RollbackDraftsAsIfTheRowsNeverCame) {
    const dspark_case *cp = nullptr;  // a 300-token case
    for (const dspark_case &k : data().cases)
        if (!cp && k.tokens.size() >= 200) cp = &k;
    ASSERT_NE(cp, nullptr);
    const dspark_case &c = *cp;
    const device_pair w = upload(c.qat);
    const size_t n = c.tokens.size();
    ds4::state st = ds4::new_state(*data().target, c.qat, kv_precision::f32);
    std::vector<int64_t> pos(n);
    std::iota(pos.begin(), pos.end(), 0);
    std::vector<float> feat(n * F);
    ds4::dspark_capture(*data().target, *data().drafter, st, c.tokens, pos, feat);
    const int64_t S = 150;
    ds4::cuda_dspark fresh(w.drafter, c.qat), rolled(w.drafter, c.qat);
    fresh.observe(0, std::span(feat).first(static_cast<size_t>(S) * F));
    const ds4::dspark_block want = fresh.draft(S, c.tokens[S], {}, true);
    rolled.observe(0, std::span(feat).first(static_cast<size_t>(S - 40) * F));
    for (int64_t p = S - 40; p < S + 10; p += 5) {  // verified rows of 5, each followed by a draft after them
        rolled.observe(p, std::span(feat).subspan(static_cast<size_t>(p) * F, 5 * F));
        rolled.draft(p + 5, c.tokens[static_cast<size_t>(p + 5)]);
    }
    rolled.truncate(S);
    const ds4::dspark_block got = rolled.draft(S, c.tokens[S], {}, true);
    EXPECT_EQ(got.ctx_positions, want.ctx_positions);
    EXPECT_EQ(0, std::memcmp(got.corrected_logits.data(), want.corrected_logits.data(), want.corrected_logits.size() * sizeof(float)));
    EXPECT_EQ(got.draft_tokens, want.draft_tokens);
    EXPECT_EQ(got.confidence_logit, want.confidence_logit);
    // a context with a hole (position S - 3 dropped and not observed again): the run before S stops there
    rolled.truncate(S - 3);
    rolled.observe(S - 2, std::span(feat).subspan(static_cast<size_t>(S - 2) * F, 2 * F));
    const ds4::dspark_block holed = rolled.draft(S, c.tokens[S]);
    EXPECT_EQ(holed.ctx_positions, (std::vector<int64_t>{S - 2, S - 1}));
}

TEST_F(CudaDs4Dspark, BadInput) {
    const dspark_case &c = data().cases[0];
    const device_pair w = upload(c.qat);
    ds4::cuda_dspark d(w.drafter, c.qat);
    EXPECT_THROW(d.observe(0, std::vector<float>(F + 1)), error);
    EXPECT_THROW(d.observe(-1, std::vector<float>(F)), error);
    EXPECT_THROW(d.draft(3, data().target->hp.n_vocab), error);
    EXPECT_THROW(d.draft(3, 1, std::vector<int32_t>{1, 2}), error);
    EXPECT_THROW(d.draft(3, 1, std::vector<int32_t>{1, 2, 3, 4, -1}), error);
    ds4::cuda_sequence seq(w.target, 64, true, 0);
    EXPECT_THROW(seq.set_feature_layers(std::vector<int>{3, 6}, 8), error);
    std::vector<float> f(F);
    EXPECT_THROW(seq.eval(std::vector<int32_t>{1}, {}, {}, f), error);  // no capture set up
    seq.set_feature_layers(data().drafter->cfg.target_layers, 8);
    std::vector<float> too_many(17 * F);
    EXPECT_THROW(seq.eval(std::vector<int32_t>(17, 1), {}, {}, too_many), error);  // 17 rows > max(8, 16)
    EXPECT_EQ(seq.n_past(), 0);
    seq.eval(std::vector<int32_t>{1}, {}, {}, f);
    EXPECT_EQ(seq.n_past(), 1);
    EXPECT_THROW(ds4::cuda_upload_dspark(*data().target, *data().drafter, w.drafter), error);  // not a target
}

}  // namespace
}  // namespace fathom
