// Tests for the sampler (include/fathom/sampling.h): greedy choice, each truncation stage against
// hand-computed distributions (checked empirically with a chi-square bound over 100k draws),
// stage order, penalties against hand-worked logits, logprobs, seeding, validation, and the
// no-allocation-after-first-call property.
#include <gtest/gtest.h>

#include <atomic>
#include <cmath>
#include <cstdlib>
#include <map>
#include <string>
#include <vector>

#include "fathom/error.h"
#include "fathom/sampling.h"

// Defined in test_alloc_hook.cpp, which replaces global operator new for this binary.
extern std::atomic<long> g_allocations;

namespace {

using fathom::sampler;
using fathom::sampling_params;

// A parameter set with every stage off; tests switch on the stage they examine.
sampling_params plain(float temperature = 1.0f) {
    sampling_params p;
    p.temperature = temperature;
    p.top_k = 0;
    p.top_p = 1.0f;
    p.min_p = 0.0f;
    p.repeat_penalty = 1.0f;
    p.frequency_penalty = 0.0f;
    p.presence_penalty = 0.0f;
    p.seed = 1234;
    return p;
}

// Logits whose softmax is {0.1, 0.2, 0.3, 0.4}.
std::vector<float> logits_1234() {
    return {std::log(1.0f), std::log(2.0f), std::log(3.0f), std::log(4.0f)};
}

// Draws n tokens and checks the frequencies against `expected` (token -> probability; tokens not
// listed must never appear) with Pearson's chi-square statistic. The bound 40 is far above the
// 1e-6 tail of chi-square with <= 5 degrees of freedom (about 35.9 for df = 5), and the seed is
// fixed, so the test is deterministic while still catching any wrong distribution (a shift of a
// single percentage point on 100k draws already gives chi-square > 40).
void expect_distribution(const sampling_params &p, const std::vector<float> &logits,
                         const std::map<int32_t, double> &expected, int n = 100000) {
    sampler s(p);
    std::vector<long> counts(logits.size(), 0);
    for (int i = 0; i < n; ++i) {
        const auto r = s.sample(logits, {});
        ASSERT_GE(r.token, 0);
        ASSERT_LT(r.token, static_cast<int32_t>(logits.size()));
        counts[r.token]++;
    }
    double chi2 = 0.0;
    for (size_t t = 0; t < logits.size(); ++t) {
        const auto it = expected.find(static_cast<int32_t>(t));
        if (it == expected.end()) {
            EXPECT_EQ(counts[t], 0) << "token " << t << " should have been truncated";
            continue;
        }
        const double e = it->second * n;
        chi2 += (counts[t] - e) * (counts[t] - e) / e;
    }
    EXPECT_LT(chi2, 40.0) << "empirical frequencies do not match the expected distribution";
}

}  // namespace

// ------------------------------------------------------------------------------------ greedy

TEST(Sampler, GreedyPicksArgmaxLowestIdOnTies) {
    sampler s(plain(0.0f));
    const std::vector<float> logits = {1.0f, 3.0f, 2.0f, 3.0f, -5.0f};
    for (int i = 0; i < 10; ++i) EXPECT_EQ(s.sample(logits, {}).token, 1);
    const std::vector<float> masked = {-INFINITY, -INFINITY, -2.0f};
    EXPECT_EQ(s.sample(masked, {}).token, 2);
}

TEST(Sampler, GreedyIgnoresTruncationSettings) {
    auto p = plain(0.0f);
    p.top_k = 1;
    p.top_p = 0.1f;
    p.min_p = 0.9f;
    sampler s(p);
    EXPECT_EQ(s.sample(logits_1234(), {}).token, 3);
}

TEST(Sampler, TopKOneIsGreedyAtAnyTemperature) {
    auto p = plain(5.0f);
    p.top_k = 1;
    sampler s(p);
    for (int i = 0; i < 200; ++i) EXPECT_EQ(s.sample(logits_1234(), {}).token, 3);
}

// ------------------------------------------------------------------------ distributions

TEST(Sampler, FullDistributionAtTemperatureOne) {
    expect_distribution(plain(1.0f), logits_1234(), {{0, 0.1}, {1, 0.2}, {2, 0.3}, {3, 0.4}});
}

TEST(Sampler, TemperatureTwoTakesSquareRoots) {
    // p_i ∝ exp(ln(i+1) / 2) = sqrt(i+1)
    const double z = 1.0 + std::sqrt(2.0) + std::sqrt(3.0) + 2.0;
    expect_distribution(plain(2.0f), logits_1234(),
                        {{0, 1.0 / z}, {1, std::sqrt(2.0) / z}, {2, std::sqrt(3.0) / z}, {3, 2.0 / z}});
}

TEST(Sampler, TopK) {
    auto p = plain(1.0f);
    p.top_k = 2;  // keeps 0.4 and 0.3, renormalised to 4/7 and 3/7
    expect_distribution(p, logits_1234(), {{3, 4.0 / 7}, {2, 3.0 / 7}});
}

TEST(Sampler, TopP) {
    auto p = plain(1.0f);
    p.top_p = 0.6f;  // cumulative 0.4, 0.7: the crossing token is kept
    expect_distribution(p, logits_1234(), {{3, 4.0 / 7}, {2, 3.0 / 7}});
    p.top_p = 0.75f;  // cumulative 0.4, 0.7, 0.9
    expect_distribution(p, logits_1234(), {{3, 4.0 / 9}, {2, 3.0 / 9}, {1, 2.0 / 9}});
}

TEST(Sampler, TopPOverALargeUnsortedVocabulary) {
    // 3000 tokens: 0..299 have odds 2, 300..2999 odds 1, so z = 3300. top_p = 0.305 needs mass
    // 1006.5/3300: all 300 heavy tokens (600) plus 407 light ones (ties go to the lowest ids), so
    // tokens 0..706 survive with probabilities 2/1007 and 1/1007. No top-k: the sampler must widen
    // its sorted window past its initial size to find the cut.
    auto p = plain(1.0f);
    p.top_p = 0.305f;
    std::vector<float> logits(3000, 0.0f);
    for (int i = 0; i < 300; ++i) logits[i] = std::log(2.0f);
    sampler s(p);
    const int n = 5000;  // each call costs O(n_vocab): keep the suite fast
    int heavy = 0, max_tok = -1;
    for (int i = 0; i < n; ++i) {
        const int32_t t = s.sample(logits, {}).token;
        ASSERT_LE(t, 706) << "token outside the nucleus";
        heavy += t < 300;
        max_tok = std::max(max_tok, static_cast<int>(t));
    }
    EXPECT_GE(max_tok, 690);  // P(none of 690..706 drawn) = (1 - 17/1007)^5000 ~ e^-84
    EXPECT_NEAR(static_cast<double>(heavy) / n, 600.0 / 1007.0, 0.03);  // sd 0.007
}

TEST(Sampler, MinP) {
    auto p = plain(1.0f);
    p.min_p = 0.6f;  // threshold 0.6 * 0.4 = 0.24
    expect_distribution(p, logits_1234(), {{3, 4.0 / 7}, {2, 3.0 / 7}});
    p.min_p = 0.45f;  // threshold 0.18
    expect_distribution(p, logits_1234(), {{3, 4.0 / 9}, {2, 3.0 / 9}, {1, 2.0 / 9}});
}

TEST(Sampler, TopPAndMinPKeepTheShorterCut) {
    // top_p = 0.75 alone keeps {0.4, 0.3, 0.2}; min_p = 0.6 alone keeps {0.4, 0.3}.
    auto p = plain(1.0f);
    p.top_p = 0.75f;
    p.min_p = 0.6f;
    expect_distribution(p, logits_1234(), {{3, 4.0 / 7}, {2, 3.0 / 7}});
    // top_p = 0.6 alone keeps {0.4, 0.3}; min_p = 0.45 alone keeps {0.4, 0.3, 0.2}.
    p.top_p = 0.6f;
    p.min_p = 0.45f;
    expect_distribution(p, logits_1234(), {{3, 4.0 / 7}, {2, 3.0 / 7}});
    // Probabilities {0.05, 0.1, 0.15, 0.3, 0.4}: min_p = 0.2 (threshold 0.08) drops only 0.05;
    // top_p = 0.72 over the full distribution (cumulative 0.4, 0.7, 0.85) keeps three tokens.
    // (Normalising over min-p's survivors instead, mass 0.95, would stop at two: 0.42, 0.74.)
    p.top_p = 0.72f;
    p.min_p = 0.2f;
    const std::vector<float> five = {std::log(0.05f), std::log(0.1f), std::log(0.15f), std::log(0.3f),
                                     std::log(0.4f)};
    expect_distribution(p, five, {{4, 0.4 / 0.85}, {3, 0.3 / 0.85}, {2, 0.15 / 0.85}});
}

TEST(Sampler, TopPSeesTheTopKRenormalisedDistribution) {
    // Alone, top_p = 0.75 keeps three tokens (see TopP). After top_k = 3 the survivors have
    // probabilities 4/9, 3/9, 2/9 (cumulative 0.444, 0.778), so top_p keeps only two.
    auto p = plain(1.0f);
    p.top_k = 3;
    p.top_p = 0.75f;
    expect_distribution(p, logits_1234(), {{3, 4.0 / 7}, {2, 3.0 / 7}});
}

TEST(Sampler, MinPSeesLogitsBeforeTemperature) {
    // min_p = 0.6 on the untempered distribution keeps {0.4, 0.3}. Temperature 0.5 then squares
    // the odds: 16/25 and 9/25. (Had temperature come first, 9/16 < 0.6 would leave one token.)
    auto p = plain(0.5f);
    p.min_p = 0.6f;
    expect_distribution(p, logits_1234(), {{3, 16.0 / 25}, {2, 9.0 / 25}});
}

TEST(Sampler, MaskedTokensAreNeverDrawn) {
    auto p = plain(1.0f);
    const std::vector<float> logits = {0.0f, -INFINITY, 0.0f, -INFINITY};
    expect_distribution(p, logits, {{0, 0.5}, {2, 0.5}}, 20000);
}

// ----------------------------------------------------------------------------- penalties

// Hand-worked: logits {2, -1, 0.5, 1}, history {0, 1, 0, 3} -> counts {2, 1, 0, 1}.
// repeat 2, frequency 0.1, presence 0.2:
//   t0: 2/2 - 2*0.1 - 0.2 = 0.6     t1: -1*2 - 0.1 - 0.2 = -2.3
//   t2: untouched 0.5               t3: 1/2 - 0.1 - 0.2 = 0.2
TEST(Sampler, PenaltiesHandWorked) {
    auto p = plain(0.0f);
    p.repeat_penalty = 2.0f;
    p.frequency_penalty = 0.1f;
    p.presence_penalty = 0.2f;
    p.repeat_last_n = -1;
    p.n_logprobs = 4;
    sampler s(p);
    const std::vector<float> logits = {2.0f, -1.0f, 0.5f, 1.0f};
    const std::vector<int32_t> history = {0, 1, 0, 3};
    const auto r = s.sample(logits, history);
    const double expect[4] = {0.6, -2.3, 0.5, 0.2};
    const double lse = std::log(std::exp(0.6) + std::exp(-2.3) + std::exp(0.5) + std::exp(0.2));
    EXPECT_EQ(r.token, 0);
    EXPECT_NEAR(r.logprob, expect[0] - lse, 1e-5);
    ASSERT_EQ(r.top.size(), 4u);
    const int32_t order[4] = {0, 2, 3, 1};
    for (int i = 0; i < 4; ++i) {
        EXPECT_EQ(r.top[i].token, order[i]);
        EXPECT_NEAR(r.top[i].logprob, expect[order[i]] - lse, 1e-5);
    }
}

TEST(Sampler, PenaltyWindowIsTheLastNTokens) {
    // repeat_last_n = 2 sees only {0, 3}: t0: 1 - 0.1 - 0.2 = 0.7, t1 stays -1, t3: 0.2.
    auto p = plain(0.0f);
    p.repeat_penalty = 2.0f;
    p.frequency_penalty = 0.1f;
    p.presence_penalty = 0.2f;
    p.repeat_last_n = 2;
    p.n_logprobs = 4;
    sampler s(p);
    const std::vector<float> logits = {2.0f, -1.0f, 0.5f, 1.0f};
    const auto r = s.sample(logits, std::vector<int32_t>{0, 1, 0, 3});
    const double lse = std::log(std::exp(0.7) + std::exp(-1.0) + std::exp(0.5) + std::exp(0.2));
    ASSERT_EQ(r.top.size(), 4u);
    EXPECT_EQ(r.top[3].token, 1);
    EXPECT_NEAR(r.top[3].logprob, -1.0 - lse, 1e-5);
    EXPECT_NEAR(r.logprob, 0.7 - lse, 1e-5);
    // repeat_last_n = 0 turns penalties off.
    p.repeat_last_n = 0;
    sampler off(p);
    const auto r0 = off.sample(logits, std::vector<int32_t>{0, 1, 0, 3});
    const double lse0 = std::log(std::exp(2.0) + std::exp(-1.0) + std::exp(0.5) + std::exp(1.0));
    EXPECT_NEAR(r0.logprob, 2.0 - lse0, 1e-5);
}

TEST(Sampler, RepeatPenaltyFlipsGreedyChoice) {
    auto p = plain(0.0f);
    p.repeat_penalty = 1.1f;  // 2.0 / 1.1 = 1.818 < 1.9
    sampler s(p);
    const std::vector<float> logits = {2.0f, 1.9f};
    EXPECT_EQ(s.sample(logits, {}).token, 0);
    EXPECT_EQ(s.sample(logits, std::vector<int32_t>{0}).token, 1);
    // Called again with an empty history, no penalty may linger from the previous call.
    EXPECT_EQ(s.sample(logits, {}).token, 0);
}

// ------------------------------------------------------------------------------ logprobs

TEST(Sampler, LogprobsAreLogSoftmaxOfTheFullDistribution) {
    auto p = plain(1.0f);
    p.top_k = 1;  // truncation must not change the reported log-probabilities
    p.n_logprobs = 2;
    sampler s(p);
    const auto r = s.sample(logits_1234(), {});
    EXPECT_EQ(r.token, 3);
    EXPECT_NEAR(r.logprob, std::log(0.4), 1e-6);
    ASSERT_EQ(r.top.size(), 2u);
    EXPECT_EQ(r.top[0].token, 3);
    EXPECT_NEAR(r.top[0].logprob, std::log(0.4), 1e-6);
    EXPECT_EQ(r.top[1].token, 2);
    EXPECT_NEAR(r.top[1].logprob, std::log(0.3), 1e-6);
    // More alternatives than the vocabulary: clamped.
    p.n_logprobs = 10;
    sampler s2(p);
    EXPECT_EQ(s2.sample(logits_1234(), {}).top.size(), 4u);
}

// ---------------------------------------------------------------------------------- seeds

std::vector<int32_t> draw_sequence(sampler &s, int n) {
    std::vector<float> logits(1000);
    for (size_t i = 0; i < logits.size(); ++i) logits[i] = static_cast<float>(std::sin(i * 0.37) * 3.0);
    std::vector<int32_t> out;
    for (int i = 0; i < n; ++i) out.push_back(s.sample(logits, out).token);
    return out;
}

TEST(Sampler, SeedReproducibility) {
    sampling_params p;  // defaults: temperature 0.8, top_k 40, top_p 0.95, min_p 0.05
    p.seed = 42;
    p.repeat_penalty = 1.1f;
    sampler a(p), b(p);
    const auto sa = draw_sequence(a, 200);
    EXPECT_EQ(sa, draw_sequence(b, 200));
    a.reset();
    EXPECT_EQ(sa, draw_sequence(a, 200));
    p.seed = 43;
    sampler c(p);
    EXPECT_NE(sa, draw_sequence(c, 200));
}

// ----------------------------------------------------------------------------- validation

namespace {
void expect_invalid(const sampling_params &p, const std::string &name) {
    try {
        p.validate();
        FAIL() << "validate() accepted bad " << name;
    } catch (const fathom::error &e) {
        EXPECT_NE(std::string(e.what()).find(name), std::string::npos) << e.what();
        EXPECT_EQ(std::string(e.what()).find('\n'), std::string::npos) << "multi-line message";
    }
    EXPECT_THROW(sampler{p}, fathom::error);
}
}  // namespace

TEST(Sampler, ValidationRejectsBadParameters) {
    EXPECT_NO_THROW(sampling_params{}.validate());
    EXPECT_NO_THROW(plain(0.0f).validate());
    auto p = plain();
    p.temperature = NAN; expect_invalid(p, "temperature");
    p.temperature = INFINITY; expect_invalid(p, "temperature");
    p.temperature = -0.1f; expect_invalid(p, "temperature");
    p = plain(); p.top_k = -1; expect_invalid(p, "top_k");
    p = plain(); p.top_p = 0.0f; expect_invalid(p, "top_p");
    p = plain(); p.top_p = 1.01f; expect_invalid(p, "top_p");
    p = plain(); p.top_p = NAN; expect_invalid(p, "top_p");
    p = plain(); p.min_p = -0.01f; expect_invalid(p, "min_p");
    p = plain(); p.min_p = 1.5f; expect_invalid(p, "min_p");
    p = plain(); p.min_p = NAN; expect_invalid(p, "min_p");
    p = plain(); p.repeat_penalty = 0.0f; expect_invalid(p, "repeat_penalty");
    p = plain(); p.repeat_penalty = NAN; expect_invalid(p, "repeat_penalty");
    p = plain(); p.repeat_last_n = -2; expect_invalid(p, "repeat_last_n");
    p = plain(); p.frequency_penalty = INFINITY; expect_invalid(p, "frequency_penalty");
    p = plain(); p.presence_penalty = NAN; expect_invalid(p, "presence_penalty");
    p = plain(); p.n_logprobs = -1; expect_invalid(p, "n_logprobs");
}

TEST(Sampler, RejectsUnusableInputs) {
    sampler s(plain(1.0f));
    EXPECT_THROW(s.sample(std::vector<float>{}, {}), fathom::error);
    EXPECT_THROW(s.sample(std::vector<float>{0.0f, NAN}, {}), fathom::error);
    EXPECT_THROW(s.sample(std::vector<float>{0.0f, INFINITY}, {}), fathom::error);
    EXPECT_THROW(s.sample(std::vector<float>{-INFINITY, -INFINITY}, {}), fathom::error);
    auto p = plain(1.0f);
    p.repeat_penalty = 1.2f;
    sampler pen(p);
    EXPECT_THROW(pen.sample(logits_1234(), std::vector<int32_t>{0, 4}), fathom::error);
    EXPECT_THROW(pen.sample(logits_1234(), std::vector<int32_t>{-1}), fathom::error);
    // Penalties large enough to overflow float stay well defined.
    auto q = plain(1.0f);
    q.frequency_penalty = -3e38f;
    q.presence_penalty = 3e38f;
    q.repeat_penalty = 1e30f;
    sampler extreme(q);
    const auto r = extreme.sample(logits_1234(), std::vector<int32_t>{0, 0, 1});
    EXPECT_GE(r.token, 0);
    EXPECT_TRUE(std::isfinite(r.logprob) || r.logprob == -INFINITY);
    // Still usable afterwards, and the failed call left no penalty counts behind.
    EXPECT_EQ(pen.sample(logits_1234(), {}).token >= 0, true);
}

// ------------------------------------------------------------------------------ allocation

TEST(Sampler, NoHeapAllocationAfterFirstCall) {
    sampling_params p;
    p.top_k = 0;  // exercise the full sort of top-p
    p.repeat_penalty = 1.3f;
    p.frequency_penalty = 0.2f;
    sampler s(p);
    std::vector<float> logits(50000);
    for (size_t i = 0; i < logits.size(); ++i) logits[i] = static_cast<float>(std::cos(i * 0.11) * 4.0);
    std::vector<int32_t> history = {1, 2, 3, 2, 49999};
    history.reserve(64);
    s.sample(logits, history);  // first call sizes the buffers
    const long before = g_allocations.load();
    for (int i = 0; i < 20; ++i) {
        const auto r = s.sample(logits, history);
        history[static_cast<size_t>(i) % history.size()] = r.token;
    }
    EXPECT_EQ(g_allocations.load() - before, 0);
}
