// The device logits summary (src/backend/cuda/cuda_sample.h) against the host sampler over the full
// logits (fathom::sampler::sample, the reference): the selected set is the host's top-k with its
// tie order, the statistics are the host's, and sampler::sample_top on the device summary draws the
// same tokens with the same logprobs as sampler::sample on every logit, penalties included.
// Also the DS4 whole-model path (cuda_sequence::logits_top / last_logits). Skips without a device.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <set>
#include <vector>

#include "backend/cuda/cuda_sample.h"
#include "cuda_test_util.h"
#include "fathom/sampling.h"

namespace fathom {
namespace {

class CudaSample : public cuda_test::cuda_fixture {
  public:
    // Runs the summary of host logits `l` with penalties (token, count) and returns it as the host
    // sampler's logits_top (bad count in *bad).
    logits_top summarise(const std::vector<float> &l, const std::vector<std::pair<int32_t, int32_t>> &pen,
                         const sampling_params &p, int k, uint32_t *bad) {
        const size_t V = l.size();
        float *dl = up(l);
        std::vector<int32_t> pi, pc;
        for (auto [t, c] : pen) pi.push_back(t), pc.push_back(c);
        cuda::logits_top_args a;
        a.logits = dl;
        a.n = static_cast<int64_t>(V);
        a.pen_ids = pen.empty() ? nullptr : up(pi);
        a.pen_counts = pen.empty() ? nullptr : up(pc);
        a.n_pen = static_cast<int>(pen.size());
        a.repeat = p.repeat_penalty;
        a.frequency = p.frequency_penalty;
        a.presence = p.presence_penalty;
        a.k = k;
        cuda::logits_top_out o;
        const size_t kk = std::min<size_t>(static_cast<size_t>(k), V);
        o.ids = up(std::vector<int32_t>(kk, -7));
        o.vals = poisoned(kk);
        o.max = poisoned(1);
        o.z = dev<double>(1);
        o.bad = dev<uint32_t>(1);
        o.work = dev<float>(V);
        cuda::launch_logits_top(a, o, s_);
        logits_top t;
        t.ids = down(o.ids, kk);
        t.logits = down(o.vals, kk);
        t.max_logit = down(o.max, 1)[0];
        t.z = down(o.z, 1)[0];
        t.n_vocab = static_cast<int64_t>(V);
        *bad = down(o.bad, 1)[0];
        return t;
    }
};

std::vector<float> vocab(size_t V, std::mt19937 &rng) {
    auto l = cuda_test::randn(V, rng, 3.0f);
    for (auto &x : l) x = std::round(x * 4.0f) / 4.0f;  // many exact ties, also at the top-k cut
    for (int i = 0; i < 9; ++i) l[rng() % V] = -INFINITY;
    return l;
}

TEST_F(CudaSample, TopSetAndStatisticsAreTheHosts) {
    std::mt19937 rng(3);
    sampling_params none;
    none.repeat_penalty = 1.0f;
    for (size_t V : {size_t{129280}, size_t{1000}, size_t{7}}) {
        for (int k : {1, 40, 256, 4096}) {
            const auto l = vocab(V, rng);
            uint32_t bad = 1;
            const logits_top t = summarise(l, {}, none, k, &bad);
            EXPECT_EQ(bad, 0u);
            // host: stable order by (logit desc, id asc) -> the first k ids
            std::vector<int32_t> order(V);
            std::iota(order.begin(), order.end(), 0);
            std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return l[a] > l[b]; });
            const size_t kk = std::min<size_t>(static_cast<size_t>(k), V);
            const std::set<int32_t> want(order.begin(), order.begin() + static_cast<std::ptrdiff_t>(kk));
            const std::set<int32_t> got(t.ids.begin(), t.ids.end());
            EXPECT_EQ(got, want) << "V " << V << " k " << k;
            for (size_t i = 0; i < t.ids.size(); ++i) {
                if (t.ids[i] >= 0 && static_cast<size_t>(t.ids[i]) < V) {
                    EXPECT_EQ(t.logits[i], l[static_cast<size_t>(t.ids[i])]);
                }
            }
            const float mx = *std::max_element(l.begin(), l.end());
            double z = 0;
            for (float x : l) z += std::exp(x - mx);
            EXPECT_EQ(t.max_logit, mx);
            EXPECT_NEAR(t.z, z, 1e-12 * z);
        }
    }
    std::vector<float> l(500, 0.5f);
    l[17] = std::nanf("");
    l[400] = INFINITY;
    uint32_t bad = 0;
    summarise(l, {}, none, 4, &bad);
    EXPECT_EQ(bad, 2u);
}

// End to end: for each parameter set, 60 steps of device summary + sample_top against the host
// sampler on the full logits, with a history driving the penalties.
TEST_F(CudaSample, SampleTopOnTheDeviceSummaryEqualsHostSampling) {
    std::mt19937 rng(9);
    const size_t V = 129280;
    struct combo {
        float temp;
        int top_k;
        float top_p, min_p, rep, freq, pres;
        int n_lp;
    };
    for (const combo c : {combo{0.0f, 40, 0.95f, 0.05f, 1.0f, 0.0f, 0.0f, 0}, combo{0.8f, 40, 0.95f, 0.05f, 1.1f, 0.2f, 0.3f, 3},
                          combo{1.0f, 0, 0.9f, 0.0f, 1.3f, 0.0f, 0.0f, 0}, combo{1.0f, 0, 1.0f, 0.2f, 1.0f, 0.5f, 0.0f, 5},
                          combo{0.0f, 0, 1.0f, 0.0f, 1.5f, 0.0f, 1.0f, 2}}) {
        sampling_params p;
        p.temperature = c.temp;
        p.top_k = c.top_k;
        p.top_p = c.top_p;
        p.min_p = c.min_p;
        p.repeat_penalty = c.rep;
        p.frequency_penalty = c.freq;
        p.presence_penalty = c.pres;
        p.n_logprobs = c.n_lp;
        p.repeat_last_n = 32;
        p.seed = 77;
        sampler ref(p), dev_s(p);
        std::vector<int32_t> hist;
        int declined = 0;
        for (int step = 0; step < 60; ++step) {
            auto l = vocab(V, rng);
            for (int j = 0; j < 8 && !hist.empty(); ++j) l[static_cast<size_t>(hist[rng() % hist.size()])] += 6.0f;  // history near the top
            const sample_result want = ref.sample(l, hist);
            uint32_t bad = 0;
            const logits_top t = summarise(l, dev_s.penalty_counts(hist, static_cast<int64_t>(V)), p,
                                           static_cast<int>(dev_s.top_candidates()), &bad);
            ASSERT_EQ(bad, 0u);
            const auto got = dev_s.sample_top(t);
            if (!got) {
                ++declined;
                EXPECT_EQ(dev_s.sample(l, hist).token, want.token);
            } else {
                EXPECT_EQ(got->token, want.token) << "step " << step;
                EXPECT_NEAR(got->logprob, want.logprob, 1e-5) << "step " << step;
                ASSERT_EQ(got->top.size(), want.top.size());
                for (size_t i = 0; i < want.top.size(); ++i) EXPECT_EQ(got->top[i].token, want.top[i].token);
            }
            hist.push_back(want.token);
            if (HasFailure()) return;
        }
        EXPECT_LE(declined, 3) << "temperature " << c.temp << " top_k " << c.top_k;
    }
}

TEST_F(CudaSample, RejectsBadArguments) {
    cuda::logits_top_args a;
    cuda::logits_top_out o;
    a.n = 0;
    EXPECT_THROW(cuda::launch_logits_top(a, o, s_), error);
    a.n = 10;
    a.k = 0;
    EXPECT_THROW(cuda::launch_logits_top(a, o, s_), error);
    a.k = cuda::logits_top_max_k + 1;
    EXPECT_THROW(cuda::launch_logits_top(a, o, s_), error);
}

}  // namespace
}  // namespace fathom
