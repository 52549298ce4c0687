// sampler::sample_top (a device's summary of the logits: best candidates + softmax statistics)
// against sampler::sample over every logit, the reference: same tokens, logprobs and alternatives
// bit for bit over long seeded runs, for every stage combination; nullopt exactly when the summary
// cannot determine the draw; penalty_counts' window and order.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <vector>

#include "fathom/error.h"
#include "fathom/sampling.h"

namespace {

using fathom::logits_top;
using fathom::sampler;
using fathom::sampling_params;

// The summary a device would send for `logits` (no penalties): the n best (descending, ties to lower
// ids; handed over shuffled, as the device's selection is unordered) and the full softmax statistics
// summed in id order as the host sampler does, so z has the host's bits here.
logits_top summarise(const std::vector<float> &logits, size_t n, std::mt19937 &rng) {
    std::vector<int32_t> order(logits.size());
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return logits[a] > logits[b]; });
    order.resize(std::min(n, order.size()));
    std::shuffle(order.begin(), order.end(), rng);
    logits_top t;
    t.n_vocab = static_cast<int64_t>(logits.size());
    for (int32_t id : order) {
        t.ids.push_back(id);
        t.logits.push_back(logits[static_cast<size_t>(id)]);
    }
    t.max_logit = *std::max_element(logits.begin(), logits.end());
    for (float l : logits) t.z += std::exp(l - t.max_logit);
    return t;
}

// A vocabulary of V logits with heavy ties (values on a coarse grid) and a few masked tokens.
std::vector<float> random_logits(size_t V, std::mt19937 &rng, float spread) {
    std::normal_distribution<float> nd(0.0f, spread);
    std::vector<float> l(V);
    for (auto &x : l) x = std::round(nd(rng) * 8.0f) / 8.0f;
    for (int i = 0; i < 5; ++i) l[rng() % V] = -INFINITY;
    return l;
}

struct combo {
    const char *name;
    float temperature;
    int top_k;
    float top_p, min_p;
    int n_logprobs;
};

// Every stage combination, run 300 steps against the reference with the same seed. `summary_n` 0:
// the sampler's own top_candidates(). Returns how many steps sample_top declined.
int run_combo(const combo &c, size_t V, size_t summary_n, float spread, uint32_t seed) {
    sampling_params p;
    p.temperature = c.temperature;
    p.top_k = c.top_k;
    p.top_p = c.top_p;
    p.min_p = c.min_p;
    p.n_logprobs = c.n_logprobs;
    p.seed = seed;
    sampler ref(p), top(p);
    std::mt19937 rng(seed);
    int declined = 0;
    for (int step = 0; step < 300; ++step) {
        const auto logits = random_logits(V, rng, spread);
        const logits_top t = summarise(logits, summary_n ? summary_n : top.top_candidates(), rng);
        const fathom::sample_result want = ref.sample(logits, {});
        const auto got = top.sample_top(t);
        if (!got) {  // the reference drew without it: re-synchronise the streams the same way
            ++declined;
            const fathom::sample_result again = top.sample(logits, {});
            EXPECT_EQ(again.token, want.token);
            continue;
        }
        EXPECT_EQ(got->token, want.token) << c.name << " step " << step;
        EXPECT_EQ(got->logprob, want.logprob) << c.name << " step " << step;
        EXPECT_EQ(got->top.size(), want.top.size()) << c.name;
        for (size_t i = 0; i < std::min(got->top.size(), want.top.size()); ++i) {
            EXPECT_EQ(got->top[i].token, want.top[i].token) << c.name << " step " << step << " alt " << i;
            EXPECT_EQ(got->top[i].logprob, want.top[i].logprob) << c.name << " step " << step << " alt " << i;
        }
        if (::testing::Test::HasFailure()) return declined;
    }
    return declined;
}

TEST(SamplerTop, MatchesFullSamplingForEveryStageCombination) {
    const combo combos[] = {
        {"greedy", 0.0f, 40, 0.95f, 0.05f, 0},
        {"greedy + logprobs", 0.0f, 0, 1.0f, 0.0f, 5},
        {"defaults (top-k 40, top-p 0.95, min-p 0.05)", 0.8f, 40, 0.95f, 0.05f, 0},
        {"top-k only", 1.0f, 20, 1.0f, 0.0f, 3},
        {"top-k + top-p", 1.3f, 100, 0.8f, 0.0f, 0},
        {"top-p only", 0.7f, 0, 0.5f, 0.0f, 0},
        {"min-p only (vocabulary-order draw)", 1.0f, 0, 1.0f, 0.3f, 2},
        {"top-p + min-p", 1.0f, 0, 0.9f, 0.1f, 0},
    };
    for (const combo &c : combos) {
        // A peaked vocabulary (the usual case): the default summary decides every step.
        EXPECT_EQ(run_combo(c, 5000, 0, 3.0f, 11), 0) << c.name;
        // The whole vocabulary as the summary always decides.
        EXPECT_EQ(run_combo(c, 700, 700, 0.5f, 12), 0) << c.name;
        if (HasFailure()) return;
    }
}

TEST(SamplerTop, DeclinesWhenTheSummaryCannotDecide) {
    // Pure temperature sampling needs every token: declined, and the RNG untouched (run_combo checks
    // that the next full draw still matches the reference stream).
    EXPECT_EQ(run_combo({"temperature only", 1.0f, 0, 1.0f, 0.0f, 0}, 3000, 0, 0.5f, 5), 300);
    // A flat vocabulary where top-p 0.99 needs far more than 256 candidates: declined (and correct).
    EXPECT_GT(run_combo({"flat top-p", 1.0f, 0, 0.99f, 0.0f, 0}, 3000, 0, 0.05f, 6), 250);
    // top-k larger than the summary: declined.
    EXPECT_EQ(run_combo({"top-k 50 from 10", 1.0f, 50, 1.0f, 0.0f, 0}, 1000, 10, 1.0f, 7), 300);
    // More logprobs than the summary holds: declined.
    EXPECT_EQ(run_combo({"logprobs 20 from 10", 0.0f, 0, 1.0f, 0.0f, 20}, 1000, 10, 1.0f, 8), 300);
}

TEST(SamplerTop, RejectsMalformedSummaries) {
    sampler s(sampling_params{});
    logits_top t;
    EXPECT_THROW(s.sample_top(t), fathom::error);  // empty
    t.ids = {1, 2};
    t.logits = {0.5f};
    t.n_vocab = 10;
    t.z = 1.5;
    EXPECT_THROW(s.sample_top(t), fathom::error);  // sizes differ
    t.logits = {0.5f, 0.25f};
    t.ids = {1, 12};
    EXPECT_THROW(s.sample_top(t), fathom::error);  // id outside the vocabulary
    t.ids = {1, 2};
    t.max_logit = -INFINITY;
    EXPECT_THROW(s.sample_top(t), fathom::error);  // every logit -inf
}

TEST(SamplerTop, PenaltyCountsFollowTheWindow) {
    sampling_params p;
    p.repeat_penalty = 1.3f;
    p.repeat_last_n = 4;
    sampler s(p);
    const std::vector<int32_t> h = {9, 1, 5, 1, 7, 5, 5};
    const auto c = s.penalty_counts(h, 10);  // window: 1, 7, 5, 5
    ASSERT_EQ(c.size(), 3u);
    EXPECT_EQ(c[0], std::make_pair(1, 1));
    EXPECT_EQ(c[1], std::make_pair(7, 1));
    EXPECT_EQ(c[2], std::make_pair(5, 2));
    EXPECT_THROW(s.penalty_counts(std::vector<int32_t>{3, 10}, 10), fathom::error);
    sampling_params off;  // no penalty configured: nothing to apply
    off.repeat_penalty = 1.0f;
    EXPECT_TRUE(sampler(off).penalty_counts(h, 10).empty());
    p.repeat_last_n = -1;  // whole history
    EXPECT_EQ(sampler(p).penalty_counts(h, 10).size(), 4u);
}

}  // namespace
