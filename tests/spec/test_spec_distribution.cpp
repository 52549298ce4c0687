// Sampled speculative decoding keeps the output distribution (include/fathom/speculative.h).
//
// A toy session over a 6-token vocabulary whose logits are a fixed function of its last two tokens
// (written here; it rolls back for free) generates 3 tokens after a 1-token prompt, many times with
// different sampler seeds, through spec::generate with a random drafter (right about half the time). The
// counts of the 216 possible outputs are compared by a chi-square test with the exact probabilities, which
// this test computes itself from the logits (softmax at temperature T, top-k cut, renormalised, in
// double). A deliberately wrong acceptance rule (accept draft d with probability p(d), otherwise sample
// from p, the classic mistake of not conditioning on "not d") run on the same toy fails the same test.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <map>
#include <random>
#include <vector>

#include "fathom/engine.h"
#include "fathom/sampling.h"
#include "fathom/speculative.h"

using namespace fathom;

namespace {

constexpr int kV = 6;

std::array<float, kV> toy_logits(std::span<const int32_t> h) {
    const int a = h.empty() ? 0 : h.back(), b = h.size() < 2 ? 0 : h[h.size() - 2];
    std::array<float, kV> l{};
    for (int v = 0; v < kV; ++v) l[v] = static_cast<float>(1.5 * std::sin(1.3 * v + 0.7 * a + 0.3 * b + 0.2 * v * a));
    return l;
}

// Holds tokens; every evaluated position's logits are toy_logits of the prefix ending there.
class toy_session final : public session {
  public:
    void sync(std::span<const int32_t> prefix, const std::function<void(int64_t, int64_t)> & = {}) override {
        toks_.assign(prefix.begin(), prefix.end());
        last_ = toy_logits(toks_);
    }
    void eval(std::span<const int32_t> tokens, float *all) override {
        for (size_t i = 0; i < tokens.size(); ++i) {
            toks_.push_back(tokens[i]);
            last_ = toy_logits(toks_);
            if (all) std::copy(last_.begin(), last_.end(), all + i * kV);
        }
    }
    std::span<const float> logits() const override { return last_; }
    int64_t n_past() const override { return static_cast<int64_t>(toks_.size()); }
    const std::vector<int32_t> &tokens() const override { return toks_; }
    void reset() override { toks_.clear(); }
    void truncate(int64_t n) override {
        if (n < n_past()) {
            toks_.resize(static_cast<size_t>(n));
            last_ = toy_logits(toks_);
        }
    }
    bool rolls_back() const override { return true; }

  private:
    std::vector<int32_t> toks_;
    std::array<float, kV> last_{};
};

sampling_params params(float temp, int32_t top_k, uint64_t seed) {
    sampling_params p;
    p.temperature = temp;
    p.top_k = top_k;
    p.top_p = 1.0f;
    p.min_p = 0.0f;
    p.seed = seed;
    return p;
}

// The exact next-token distribution the sampler draws from: softmax(l / T) over the top_k largest.
std::array<double, kV> exact(std::span<const int32_t> h, float temp, int32_t top_k) {
    const std::array<float, kV> l = toy_logits(h);
    std::array<int, kV> idx{};
    for (int v = 0; v < kV; ++v) idx[v] = v;
    std::stable_sort(idx.begin(), idx.end(), [&](int x, int y) { return l[x] > l[y]; });
    const int keep = top_k > 0 ? std::min(top_k, kV) : kV;
    std::array<double, kV> p{};
    double z = 0;
    for (int i = 0; i < keep; ++i) z += std::exp((static_cast<double>(l[idx[i]]) - l[idx[0]]) / temp);
    for (int i = 0; i < keep; ++i) p[idx[i]] = std::exp((static_cast<double>(l[idx[i]]) - l[idx[0]]) / temp) / z;
    return p;
}

constexpr int kGen = 3, kCells = kV * kV * kV;

int cell(const std::vector<int32_t> &out) {
    return (out[0] * kV + out[1]) * kV + out[2];
}

// Pearson's chi-square of the counts against the exact probabilities (cells expecting < 5 pooled),
// and the 0.1 % critical value for its degrees of freedom (Wilson-Hilferty).
std::pair<double, double> chi_square(const std::vector<int> &counts, int n, float temp, int32_t top_k) {
    std::vector<double> expect(kCells, 0.0);
    for (int c = 0; c < kCells; ++c) {
        std::vector<int32_t> h{0};
        double p = 1;
        for (int i = 0; i < kGen; ++i) {
            const int t = (i == 0 ? c / (kV * kV) : i == 1 ? (c / kV) % kV : c % kV);
            p *= exact(h, temp, top_k)[t];
            h.push_back(t);
        }
        expect[c] = p * n;
    }
    double chi = 0, pool_o = 0, pool_e = 0;
    int df = -1;
    for (int c = 0; c < kCells; ++c) {
        if (expect[c] < 5) {
            pool_o += counts[c];
            pool_e += expect[c];
            continue;
        }
        chi += (counts[c] - expect[c]) * (counts[c] - expect[c]) / expect[c];
        ++df;
    }
    if (pool_e > 0) {
        if (pool_e < 1e-12 && pool_o > 0) return {1e30, 0};  // an impossible output was drawn
        if (pool_e >= 1e-12) {
            chi += (pool_o - pool_e) * (pool_o - pool_e) / pool_e;
            ++df;
        }
    }
    const double k = df, z = 3.09;  // one-sided 0.1 %
    const double crit = k * std::pow(1 - 2 / (9 * k) + z * std::sqrt(2 / (9 * k)), 3);
    return {chi, crit};
}

// A drafter right about half the time: the most likely token, or a uniformly random one.
spec::drafter random_drafter(std::mt19937_64 &rng) {
    return [&rng](std::span<const int32_t> h, int32_t max) {
        std::vector<int32_t> d;
        std::vector<int32_t> hist(h.begin(), h.end());
        std::uniform_int_distribution<int> any(0, kV - 1), coin(0, 1);
        for (int32_t i = 0; i < max; ++i) {
            const std::array<float, kV> l = toy_logits(hist);
            const int32_t t = coin(rng) ? static_cast<int32_t>(std::max_element(l.begin(), l.end()) - l.begin()) : any(rng);
            d.push_back(t);
            hist.push_back(t);
        }
        return d;
    };
}

std::vector<int> run_speculative(int n, float temp, int32_t top_k) {
    std::vector<int> counts(kCells, 0);
    std::mt19937_64 rng(77);
    const spec::drafter draft = random_drafter(rng);
    for (int r = 0; r < n; ++r) {
        toy_session s;
        const std::vector<int32_t> prompt{0};
        s.sync(prompt);
        sampler smp(params(temp, top_k, 1000 + static_cast<uint64_t>(r)));
        std::vector<int32_t> out;
        spec::width_options w;
        w.draft_max = 4;
        w.adaptive = false;
        spec::generate(s, smp, 64, w, draft, [&](int32_t t) {
            out.push_back(t);
            return out.size() < kGen ? spec::token_verdict::keep : spec::token_verdict::keep_and_stop;
        });
        EXPECT_EQ(out.size(), static_cast<size_t>(kGen));
        if (out.size() == kGen) ++counts[static_cast<size_t>(cell(out))];
    }
    return counts;
}

// The wrong rule: draft d kept with probability p(d); otherwise a fresh sample from p (which may be d
// again), instead of a sample from p given "not d".
std::vector<int> run_wrong_rule(int n, float temp, int32_t top_k) {
    std::vector<int> counts(kCells, 0);
    std::mt19937_64 rng(78);
    const spec::drafter draft = random_drafter(rng);
    std::uniform_real_distribution<double> u(0, 1);
    for (int r = 0; r < n; ++r) {
        sampler smp(params(temp, top_k, 5000 + static_cast<uint64_t>(r)));
        std::vector<int32_t> h{0}, out;
        while (out.size() < kGen) {
            const std::vector<int32_t> d = draft(h, 1);
            const std::array<double, kV> p = exact(h, temp, top_k);
            int32_t t = d[0];
            if (u(rng) >= p[static_cast<size_t>(t)]) {
                const std::array<float, kV> l = toy_logits(h);
                t = smp.sample(l, h).token;
            }
            out.push_back(t);
            h.push_back(t);
        }
        ++counts[static_cast<size_t>(cell(out))];
    }
    return counts;
}

TEST(SpecDistribution, SampledSpeculationHasThePlainSamplingDistribution) {
    const int n = 30000;
    for (const auto &[temp, top_k] : std::vector<std::pair<float, int32_t>>{{1.0f, 0}, {0.7f, 4}}) {
        const auto [chi, crit] = chi_square(run_speculative(n, temp, top_k), n, temp, top_k);
        EXPECT_LT(chi, crit) << "temperature " << temp << " top_k " << top_k;  // measured: 183.7 < 249.1, 87.0 < 103.5
    }
}

TEST(SpecDistribution, AWrongAcceptanceRuleFailsTheSameTest) {
    const int n = 30000;
    const auto [chi, crit] = chi_square(run_wrong_rule(n, 1.0f, 0), n, 1.0f, 0);
    EXPECT_GT(chi, crit);  // measured: 5738 > 249
}

}  // namespace
