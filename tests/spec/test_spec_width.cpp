// Adaptive draft width (include/fathom/speculative.h: verify_cost, draft_budget).
//
// verify_cost against lines it is fed (hand-chosen slopes: the CPU's ~0.85 of a step per extra row, a
// GPU's few percent); draft_budget in a simulated speculation loop whose drafts are kept with a known
// probability a (each draft only if its predecessors were) and whose forwards cost a known line, against
// the throughput the formulas give by hand: an always-wrong drafter costs under 3 % of plain decoding on
// either machine, a mediocre drafter on the CPU too (the doubling rule that preceded this one ran at
// 0.55x there), and a good drafter on the GPU gets at least 90 % of the best fixed width's throughput.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <random>

#include "fathom/speculative.h"

using namespace fathom;

namespace {

TEST(SpecWidth, VerifyCostLearnsTheLineItIsFed) {
    spec::verify_cost c;
    EXPECT_DOUBLE_EQ(c.ratio(1), 1.0);  // the prior before any measurement: 1 + 0.25 (r - 1)
    EXPECT_DOUBLE_EQ(c.ratio(5), 2.0);
    for (int i = 0; i < 400; ++i) {
        const int rows = 1 + i % 5;
        c.observe(rows, 0.010 * (1 + 0.85 * (rows - 1)));  // the CPU: each extra row ~0.85 of a step
    }
    EXPECT_NEAR(c.ratio(2), 1.85, 0.02);
    EXPECT_NEAR(c.ratio(5), 4.40, 0.05);
    spec::verify_cost g;
    for (int i = 0; i < 400; ++i) {
        const int rows = 1 + i % 3;
        g.observe(rows, 0.007 * (1 + 0.05 * (rows - 1)));  // a GPU: rows nearly free
    }
    EXPECT_NEAR(g.ratio(5), 1.20, 0.01);  // extrapolated past the widths it saw
    // Nonsense is ignored; a cost that falls with rows is flattened, never below 1.
    g.observe(0, 1.0);
    g.observe(3, -1.0);
    g.observe(3, std::nan(""));
    EXPECT_NEAR(g.ratio(5), 1.20, 0.01);
    spec::verify_cost f;
    for (int i = 0; i < 100; ++i) f.observe(1 + i % 4, 0.01 * (1.0 - 0.05 * (i % 4)));
    EXPECT_GE(f.ratio(4), 1.0);
}

struct sim_result {
    double tokens = 0, cost = 0;
    double throughput() const { return tokens / cost; }  // tokens per plain step's time
};

// n_steps speculative steps: the budget asks for k drafts, each kept with probability a while its
// predecessors were; the forward of 1 + k rows costs 1 + rho k (fed to the cost model, as generate()
// times its forwards); the step yields the kept drafts + 1 sampled token.
sim_result simulate(double a, double rho, int32_t max, int n_steps, uint64_t seed) {
    spec::draft_budget b(max, true);
    spec::verify_cost c;
    std::mt19937_64 rng(seed);
    std::uniform_real_distribution<double> u(0.0, 1.0);
    sim_result r;
    for (int i = 0; i < n_steps; ++i) {
        const int32_t k = b.next(&c);
        int32_t kept = 0;
        while (kept < k && u(rng) < a) ++kept;
        const double t = 1 + rho * k;
        c.observe(1 + k, t * 1e-3);
        b.update(static_cast<size_t>(k), static_cast<size_t>(kept));
        r.tokens += 1 + kept;
        r.cost += t;
    }
    return r;
}

// Expected tokens per unit time of always drafting k: (1 + a + ... + a^k) / (1 + rho k), best over k.
double best_fixed(double a, double rho, int32_t max) {
    double best = 1.0, e = 1.0, p = 1.0;
    for (int32_t k = 1; k <= max; ++k) {
        p *= a;
        e += p;
        best = std::max(best, e / (1 + rho * k));
    }
    return best;
}

TEST(SpecWidth, AnAlwaysWrongDrafterCostsUnderThreePercent) {
    for (double rho : {0.85, 0.05}) {
        const sim_result r = simulate(0.0, rho, 8, 4000, 1);  // a = 0: the draws do not matter
        EXPECT_GE(r.throughput(), 0.97) << "rho " << rho;
        EXPECT_LE(r.throughput(), 1.0);
    }
}

TEST(SpecWidth, OnTheCpuAMediocreDrafterIsNotPaidFor) {
    // a = 0.6, rows at 0.85 of a step: every width loses (E(1) / c(2) = 1.6 / 1.85), so drafting must
    // nearly stop: within 3 % of plain decoding.
    EXPECT_LT(best_fixed(0.6, 0.85, 8), 1.0 + 1e-12);
    for (uint64_t seed = 1; seed <= 8; ++seed) EXPECT_GE(simulate(0.6, 0.85, 8, 4000, seed).throughput(), 0.97);
    // a = 0.95 on the same machine: width 2 pays a little (2.8525 / 2.7 = 1.056); no worse than plain.
    EXPECT_NEAR(best_fixed(0.95, 0.85, 8), 2.8525 / 2.7, 1e-9);
    for (uint64_t seed = 1; seed <= 8; ++seed) EXPECT_GE(simulate(0.95, 0.85, 8, 4000, seed).throughput(), 1.0);
}

TEST(SpecWidth, OnTheGpuAGoodDrafterGetsNearTheBestWidth) {
    // rows at 5 % of a step: a = 0.6 -> best width 4 (2.3056 / 1.2 = 1.921, worked by hand);
    // a = 0.8 and 0.9 -> wider. The adaptive budget reaches >= 90 % of the best fixed width's rate.
    EXPECT_NEAR(best_fixed(0.6, 0.05, 8), 2.3056 / 1.2, 1e-9);
    for (double a : {0.6, 0.8, 0.9}) {
        for (uint64_t seed = 1; seed <= 8; ++seed)
            EXPECT_GE(simulate(a, 0.05, 8, 4000, seed).throughput(), 0.9 * best_fixed(a, 0.05, 8)) << "a " << a;
    }
}

TEST(SpecWidth, APausedDrafterThatImprovesIsNoticed) {
    // 600 steps of an always-wrong drafter, then one that is always right: within the longest pause
    // (63 steps) a probe succeeds and the width grows back to the maximum.
    spec::draft_budget b(4, true);
    spec::verify_cost c;
    for (int i = 0; i < 600; ++i) {
        const int32_t k = b.next(&c);
        c.observe(1 + k, 1 + 0.05 * k);
        b.update(static_cast<size_t>(k), 0);
    }
    int first_full = -1;
    for (int i = 0; i < 200 && first_full < 0; ++i) {
        const int32_t k = b.next(&c);
        c.observe(1 + k, 1 + 0.05 * k);
        b.update(static_cast<size_t>(k), static_cast<size_t>(k));
        if (k == 4) first_full = i;
    }
    EXPECT_GE(first_full, 0);
    EXPECT_LE(first_full, 64 + 10);
}

TEST(SpecWidth, NotAdaptiveIsAlwaysTheMaximum) {
    spec::draft_budget b(5, false);
    spec::verify_cost c;
    for (int i = 0; i < 50; ++i) c.observe(1 + i % 6, 1 + 0.85 * (i % 6));
    for (int i = 0; i < 10; ++i) {
        EXPECT_EQ(b.next(&c), 5);
        b.update(5, 0);
    }
}

}  // namespace

namespace {

// cut(): the prefix of a proposal worth verifying from the drafter's own per-token odds (hand-worked).
TEST(SpecWidth, ConfidenceCutsTheDraftWhereItStopsPaying) {
    const spec::verify_cost gpu(0.05), cpu(0.85);
    const std::vector<float> c = {0.9f, 0.9f, 0.1f};
    // GPU: E/c = 1.9/1.05 = 1.810, 2.71/1.10 = 2.464, 2.791/1.15 = 2.427 -> 2 drafts.
    EXPECT_EQ(spec::draft_budget::cut(c, &gpu), 2u);
    // CPU: 1.9/1.85 = 1.027, 2.71/2.70 = 1.004 -> 1 draft.
    EXPECT_EQ(spec::draft_budget::cut(c, &cpu), 1u);
    // Unlikely drafts on the CPU: 1.3/1.85 < 1 -> none.
    EXPECT_EQ(spec::draft_budget::cut(std::vector<float>{0.3f, 0.9f}, &cpu), 0u);
    // Free rows (no cost): every draft with a chance.
    EXPECT_EQ(spec::draft_budget::cut(std::vector<float>{0.5f, 0.5f}), 2u);
    // Nonsense confidences count as 0; beside 15 other rows the CPU's marginal price is lower:
    // c(17 + k) / c(17) = 1 + 0.85 k / 14.6 -> 0.3 pays there (1.3 / 1.058 > 1).
    EXPECT_EQ(spec::draft_budget::cut(std::vector<float>{std::nanf(""), 0.9f}, &gpu), 0u);
    EXPECT_EQ(spec::draft_budget::cut(std::vector<float>{1.5f}, &gpu), 0u);
    EXPECT_EQ(spec::draft_budget::cut(std::vector<float>{0.3f}, &cpu, 15), 1u);
    EXPECT_EQ(spec::draft_budget::cut({}, &cpu), 0u);
}

}  // namespace
