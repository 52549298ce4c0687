// DS4 evaluation state on the tiny model: compressed-row visibility counts, input validation, the f16
// KV option, and negative controls showing the golden comparison rejects a wrong QAT mode.
#include <gtest/gtest.h>

#include <numeric>

#include "core/error.h"
#include "golden_util.h"
#include "models/deepseek4.h"

namespace {

using namespace fathom;

const ds4::model &tiny() {
    static std::unique_ptr<ds4::model> m = ds4::load_model(ds4_test::golden_dir() + "/ds4-tiny-a.gguf");
    return *m;
}

const ds4_test::golden_case &golden(const std::string &name) {
    static std::vector<ds4_test::golden_case> c = ds4_test::load_cases("cases.jsonl");
    for (const auto &x : c)
        if (x.name == name) return x;
    throw std::runtime_error("no golden case " + name);
}

std::vector<float> run(const ds4_test::golden_case &c, ds4::qat_mode qat, kv_precision kv, size_t n = 0) {
    const ds4::model &m = tiny();
    if (n == 0) n = c.tokens.size();
    ds4::state st = ds4::new_state(m, qat, kv);
    std::vector<float> logits(n * static_cast<size_t>(m.hp.n_vocab));
    std::vector<int64_t> pos(n);
    std::iota(pos.begin(), pos.end(), 0);
    ds4::forward(m, st, std::span(c.tokens).first(n), pos, {logits, {}});
    return logits;
}

// Block b of ratio R is visible once token bR+R-1 is processed: after n tokens, floor(n/R) rows.
TEST(ds4_state, compressed_rows_visible_after_block_end) {
    const ds4::model &m = tiny();
    ds4::state st = ds4::new_state(m, ds4::qat_mode::off, kv_precision::f32);
    const auto &toks = golden("len300.no_qat").tokens;
    int64_t p = 0;
    for (int64_t n : {3, 1, 123, 1, 2}) {  // ends at 3, 4, 127, 128, 130
        std::vector<int64_t> pos(static_cast<size_t>(n));
        std::iota(pos.begin(), pos.end(), p);
        ds4::forward(m, st, std::span(toks).subspan(static_cast<size_t>(p), static_cast<size_t>(n)), pos, {});
        p += n;
        EXPECT_EQ(st.layers[0].comp_rows.size(), 0);
        EXPECT_EQ(st.layers[2].comp_rows.size(), p / 4) << p;
        EXPECT_EQ(st.layers[2].idx_rows.size(), p / 4) << p;
        EXPECT_EQ(st.layers[3].comp_rows.size(), p / 128) << p;
        EXPECT_EQ(st.layers[3].idx_rows.size(), 0);
    }
    EXPECT_EQ(st.n_past, 130);
}

TEST(ds4_state, rejects_bad_inputs) {
    const ds4::model &m = tiny();
    ds4::state st = ds4::new_state(m, ds4::qat_mode::off, kv_precision::f32);
    const std::vector<int32_t> toks = {0, 5};
    const std::vector<int64_t> gap = {0, 2}, ok = {0, 1};
    EXPECT_THROW(ds4::forward(m, st, toks, gap, {}), fathom::error);
    const std::vector<int32_t> bad_tok = {0, 512};
    EXPECT_THROW(ds4::forward(m, st, bad_tok, ok, {}), fathom::error);
    std::vector<float> small(10);
    EXPECT_THROW(ds4::forward(m, st, toks, ok, {small, {}}), fathom::error);
    EXPECT_EQ(st.n_past, 0);  // rejected calls leave the state untouched
}

// The f16 cache changes the numbers (it is really used) but, on a short sequence, stays close to the
// f32 golden; the README warns it drifts far on long ones, so no long case is checked here.
TEST(ds4_state, f16_kv_cache_is_used) {
    const auto &c = golden("len67.no_qat");
    const auto f32 = run(c, c.qat, kv_precision::f32), f16 = run(c, c.qat, kv_precision::f16);
    double max_diff = 0;
    for (size_t i = 0; i < f32.size(); ++i)
        max_diff = std::max(max_diff, static_cast<double>(std::fabs(f32[i] - f16[i])));
    EXPECT_GT(max_diff, 1e-5);
    EXPECT_LT(max_diff, 0.05);
}

// Negative controls: evaluating in the wrong QAT mode must fail the comparison, so the golden tests
// can tell the modes apart.
TEST(ds4_state, wrong_qat_mode_fails_golden) {
    const auto &full = golden("len300.qat_full");
    EXPECT_FALSE(ds4_test::compare(full, run(full, ds4::qat_mode::fp4only, kv_precision::f32), 512).ok);
    const auto &fp4 = golden("len67.qat_fp4only");
    EXPECT_FALSE(ds4_test::compare(fp4, run(fp4, ds4::qat_mode::full, kv_precision::f32), 512).ok);
    const auto &off = golden("len300.no_qat");
    EXPECT_FALSE(ds4_test::compare(off, run(off, ds4::qat_mode::fp4only, kv_precision::f32), 512).ok);
}

}  // namespace
