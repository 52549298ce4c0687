// ds4-tiny-a golden logits (../shared/golden/ds4-tiny/cases.jsonl, produced by the official
// DeepSeek-V4 model.py in f32): every case in its tier, evaluated as one prefill, in chunks of 7 and
// 64, and token by token (decode), with an f32 KV cache.
#include <gtest/gtest.h>

#include <memory>
#include <numeric>

#include "golden_util.h"
#include "models/deepseek4.h"

namespace {

using namespace fathom;

const ds4::model &tiny_model() {
    static std::unique_ptr<ds4::model> m = ds4::load_model(ds4_test::golden_dir() + "/ds4-tiny-a.gguf");
    return *m;
}

const std::vector<ds4_test::golden_case> &cases() {
    static std::vector<ds4_test::golden_case> c = ds4_test::load_cases("cases.jsonl");
    return c;
}

// Evaluate all tokens in chunks of `chunk` (0: one prefill); returns logits [n, V].
std::vector<float> run(const ds4::model &m, const ds4_test::golden_case &c, size_t chunk) {
    ds4::state st = ds4::new_state(m, c.qat, kv_precision::f32);
    const size_t n = c.tokens.size(), V = static_cast<size_t>(m.hp.n_vocab);
    std::vector<float> logits(n * V);
    std::vector<int64_t> pos(n);
    std::iota(pos.begin(), pos.end(), 0);
    if (chunk == 0) chunk = n;
    for (size_t b = 0; b < n; b += chunk) {
        const size_t e = std::min(n, b + chunk);
        ds4::forward(m, st, std::span(c.tokens).subspan(b, e - b), std::span(pos).subspan(b, e - b),
                     {std::span(logits).subspan(b * V, (e - b) * V), {}});
    }
    return logits;
}

// (chunk, case index): chunk 0 = one prefill, 1 = token-by-token decode.
class golden : public ::testing::TestWithParam<std::tuple<size_t, size_t>> {};

TEST_P(golden, matches_tier) {
    const auto [chunk, index] = GetParam();
    ASSERT_EQ(cases().size(), 12u);
    const auto &c = cases()[index];
    const auto v = ds4_test::compare(c, run(tiny_model(), c, chunk), tiny_model().hp.n_vocab);
    EXPECT_TRUE(v.ok) << c.name << " chunk " << chunk << ": " << v.why;
    std::printf("  %-20s chunk %3zu  max e_p %.3g  median e_p %.3g\n", c.name.c_str(), chunk, v.max_e,
                v.median_e);
}

INSTANTIATE_TEST_SUITE_P(ds4_tiny, golden,
                         ::testing::Combine(::testing::Values(0, 1, 7, 64), ::testing::Range<size_t>(0, 12)),
                         [](const auto &info) {
                             const size_t chunk = std::get<0>(info.param);
                             const std::string mode = chunk == 0   ? "prefill"
                                                      : chunk == 1 ? "decode"
                                                                   : "chunk" + std::to_string(chunk);
                             return mode + "_case" + std::to_string(std::get<1>(info.param));
                         });

}  // namespace
