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
#include <vector>

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
// A drafter's own time in plain steps: d0 + d1 (k - 1) for k >= 1 drafts (0: a free drafter; DSpark's
// block ~d0 alone, the MTP head ~d1 = d0 per token).
struct draft_price {
    double d0 = 0, d1 = 0;
    double at(int32_t k) const { return k > 0 ? d0 + d1 * (k - 1) : 0.0; }
};

// A verification's cost in plain steps: 1 + rho k (a line), or a measured curve c[r - 1].
struct row_price {
    double rho = 0;
    std::vector<double> curve;
    row_price(double r) : rho(r) {}  // NOLINT: a plain slope converts
    row_price(std::vector<double> c) : curve(std::move(c)) {}  // NOLINT
    double at(int32_t k) const { return curve.empty() ? 1 + rho * k : curve.at(static_cast<size_t>(k)); }
};

sim_result simulate(double a, row_price rp, int32_t max, int n_steps, uint64_t seed, draft_price dp = {}) {
    spec::draft_budget b(max, true);
    spec::verify_cost c;
    std::mt19937_64 rng(seed);
    std::uniform_real_distribution<double> u(0.0, 1.0);
    sim_result r;
    for (int i = 0; i < n_steps; ++i) {
        const int32_t k = b.next(&c);
        int32_t kept = 0;
        while (kept < k && u(rng) < a) ++kept;
        const double t = rp.at(k);
        if (k > 0) c.observe_draft(k, dp.at(k) * 1e-3);  // generate() times the drafter, then the forward
        c.observe(1 + k, t * 1e-3);
        b.update(static_cast<size_t>(k), static_cast<size_t>(kept));
        r.tokens += 1 + kept;
        r.cost += t + dp.at(k);
    }
    return r;
}

// Expected tokens per unit time of always drafting k: (1 + a + ... + a^k) / (1 + rho k + d(k)), best over k.
double best_fixed(double a, row_price rp, int32_t max, draft_price dp = {}) {
    double best = 1.0, e = 1.0, p = 1.0;
    for (int32_t k = 1; k <= max; ++k) {
        p *= a;
        e += p;
        best = std::max(best, e / (rp.at(k) + dp.at(k)));
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

TEST(SpecWidth, VerifyCostLearnsTheDraftersLine) {
    spec::verify_cost c;
    EXPECT_EQ(c.draft_ratio(3), 0.0);  // nothing timed: free
    for (int i = 0; i < 200; ++i) c.observe(1 + i % 5, 0.010 * (1 + 0.45 * (i % 5)));
    EXPECT_EQ(c.draft_ratio(3), 0.0);  // still no draft timed
    spec::verify_cost block = c, chain = c;
    for (int i = 0; i < 200; ++i) {
        block.observe_draft(1 + i % 4, 0.0135);              // a DSpark block: 1.35 steps whatever k
        chain.observe_draft(1 + i % 4, 0.0025 * (1 + i % 4));  // an MTP chain: 0.25 of a step per token
    }
    for (int32_t k = 1; k <= 4; ++k) {
        EXPECT_NEAR(block.draft_ratio(k), 1.35, 0.01) << k;
        EXPECT_NEAR(chain.draft_ratio(k), 0.25 * k, 0.01) << k;
    }
    EXPECT_EQ(block.draft_ratio(0), 0.0);
    // One width only (a drafter always asked for 4): the mean, for every k.
    spec::verify_cost one = c;
    for (int i = 0; i < 50; ++i) one.observe_draft(4, 0.002);
    EXPECT_NEAR(one.draft_ratio(1), 0.2, 0.005);
    EXPECT_NEAR(one.draft_ratio(4), 0.2, 0.005);
    // Nonsense is ignored; a fixed row cost ignores drafts (deterministic widths).
    one.observe_draft(0, 1.0);
    one.observe_draft(2, std::nan(""));
    one.observe_draft(2, -1.0);
    EXPECT_NEAR(one.draft_ratio(2), 0.2, 0.005);
    spec::verify_cost fixed(0.05);
    fixed.observe_draft(2, 1.0);
    EXPECT_EQ(fixed.draft_ratio(2), 0.0);
}

TEST(SpecWidth, ADrafterDearerThanItsTokensIsNotAsked) {
    // The 8-layer H100 file of docs/PERF.md (2026-12-07 07:05): rows at 0.45 of a step, a DSpark block at
    // 1.35 steps. Even a = 0.9 loses at every width (best k = 3: 3.439 / 3.7 = 0.93, by hand), so the
    // loop must stay within 3 % of plain decoding whatever the acceptance: before the drafter's time was
    // counted it drafted at a = 0.9 (E(4) / c(5) = 4.0951 / 2.8 = 1.46 on the rows alone).
    const draft_price dspark{1.35, 0.0};
    EXPECT_NEAR(best_fixed(0.9, 0.45, 4, dspark), 1.0, 1e-12);
    for (double a : {0.0, 0.6, 0.9})
        for (uint64_t seed = 1; seed <= 4; ++seed)
            EXPECT_GE(simulate(a, 0.45, 4, 4000, seed, dspark).throughput(), 0.97) << "a " << a;
    // A cheap drafter on the same rows (the MTP head of the 43-layer model: ~0.06 of a step a token) still
    // pays at a = 0.9 and gets >= 90 % of the best fixed width's rate, drafter included.
    const draft_price mtp{0.06, 0.06};
    EXPECT_GT(best_fixed(0.9, 0.45, 4, mtp), 1.3);
    for (uint64_t seed = 1; seed <= 4; ++seed)
        EXPECT_GE(simulate(0.9, 0.45, 4, 4000, seed, mtp).throughput(), 0.9 * best_fixed(0.9, 0.45, 4, mtp));
}

TEST(SpecWidth, AStepOfRowsThatJumpsAtTwoRowsIsNotExtrapolatedFromIt) {
    // The 8-layer H100 file (docs/PERF.md, 2026-12-07 08:01): 1, 1.84, 2.14, 2.39, 2.78 steps for 1..5 rows:
    // the multi-row path's jump, then ~0.3 a row. Fed one- and two-row forwards only (the probes of an
    // unprofitable drafter), the cost of 5 rows must not be the line through those two (4.36): the prior's
    // slope (0.25) beyond two rows until wider forwards are seen, then the measured line.
    const std::vector<double> gpu = {1.0, 1.84, 2.14, 2.39, 2.78};
    spec::verify_cost c;
    for (int i = 0; i < 60; ++i) c.observe(1 + i % 2, 0.002 * gpu[static_cast<size_t>(i % 2)]);
    EXPECT_NEAR(c.ratio(2), 1.84, 0.02);
    EXPECT_LT(c.ratio(5), 3.2);
    for (int i = 0; i < 300; ++i) c.observe(1 + i % 5, 0.002 * gpu[static_cast<size_t>(i % 5)]);
    EXPECT_NEAR(c.ratio(2), 1.84, 0.06);
    EXPECT_NEAR(c.ratio(5), 2.78, 0.06);
    // The 30-layer file's curve and DSpark at 0.41 of a step: a = 0.9 pays at width 4 (4.0951 / (3.04 +
    // 0.41) = 1.187, by hand) and the adaptive width gets >= 90 % of that; an always-wrong one costs < 3 %.
    const std::vector<double> l30 = {1.0, 1.93, 2.28, 2.58, 3.04};
    const draft_price dspark{0.41, 0.0};
    EXPECT_NEAR(best_fixed(0.9, l30, 4, dspark), 4.0951 / (3.04 + 0.41), 1e-9);
    for (uint64_t seed = 1; seed <= 4; ++seed) {
        EXPECT_GE(simulate(0.9, l30, 4, 4000, seed, dspark).throughput(), 0.9 * best_fixed(0.9, l30, 4, dspark)) << seed;
        EXPECT_GE(simulate(0.0, l30, 4, 4000, seed, dspark).throughput(), 0.97) << seed;
    }
}

TEST(SpecWidth, AShortGenerationPaysLittleForAWrongDrafter) {
    // 256 tokens of an always-wrong drafter on the 8-layer H100 file's curve, free and DSpark-priced (1.35
    // steps): the first wide draft on the prior, then probes at least 40 probe costs apart (the doubling
    // from 1 step spent 6-12 % here before).
    const std::vector<double> gpu = {1.0, 1.84, 2.14, 2.39, 2.78};
    for (const draft_price dp : {draft_price{}, draft_price{1.35, 0.0}})
        for (uint64_t seed = 1; seed <= 2; ++seed)
            EXPECT_GE(simulate(0.0, gpu, 4, 256, seed, dp).throughput(), 0.95) << "draft price " << dp.d0;
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
    // A cut comes after the drafting: the drafter's time (here 3 steps) is spent and does not count.
    spec::verify_cost dear;
    for (int i = 0; i < 50; ++i) dear.observe(1 + i % 2, 0.001 * (1 + 0.05 * (i % 2)));
    for (int i = 0; i < 20; ++i) dear.observe_draft(2, 0.003);
    EXPECT_NEAR(dear.draft_ratio(2), 3.0, 0.01);
    EXPECT_EQ(spec::draft_budget::cut(c, &dear), 2u);
}

}  // namespace
