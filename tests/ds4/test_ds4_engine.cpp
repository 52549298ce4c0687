// DS4 behind the public engine API (src/engine/ds4_session.cpp): engine::load dispatch, the three
// evaluation paths and the QAT option against the ds4-tiny goldens, session::sync prefix reuse
// (extend, diverge, strict prefix) checked against golden logits, kv_bytes_per_token against
// hand-computed figures (ds4-tiny and the full DS4-Flash geometry) and option errors.
#include <gtest/gtest.h>

#include <cmath>
#include <numeric>

#include "fathom/engine.h"
#include "golden_util.h"
#include "models/deepseek4.h"

namespace {

using namespace fathom;

std::string tiny_path() { return ds4_test::golden_dir() + "/ds4-tiny-a.gguf"; }

std::unique_ptr<engine> load(const std::string &qat, kv_precision kv = kv_precision::f32, int n_ctx = 1024) {
    engine_options o;
    o.model_path = tiny_path();
    o.n_threads = 2;
    o.n_ctx = n_ctx;
    o.kv = kv;
    o.ds4_qat = qat;
    return engine::load(o);
}

const ds4_test::golden_case &find_case(const std::string &name) {
    static const auto cases = ds4_test::load_cases("cases.jsonl");
    for (const auto &c : cases)
        if (c.name == name) return c;
    throw std::runtime_error("no golden case " + name);
}

// Logits of every position, evaluated `step` tokens per eval() call (0 = all at once).
std::vector<float> eval_all(engine &e, const std::vector<int32_t> &toks, size_t step) {
    const size_t V = static_cast<size_t>(e.info().n_vocab);
    auto s = e.new_session();
    std::vector<float> out(toks.size() * V);
    if (step == 0) step = toks.size();
    for (size_t i = 0; i < toks.size(); i += step) {
        const size_t m = std::min(step, toks.size() - i);
        s->eval(std::span<const int32_t>(toks.data() + i, m), &out[i * V]);
    }
    EXPECT_EQ(s->n_past(), static_cast<int64_t>(toks.size()));
    return out;
}

TEST(ds4_engine, dispatches_and_reports_info) {
    auto e = load("off");
    const model_info &i = e->info();
    EXPECT_EQ(i.arch, "deepseek4");
    EXPECT_EQ(i.n_vocab, 512);
    EXPECT_EQ(i.n_layer, 6);
    EXPECT_EQ(i.n_embd, 128);
    EXPECT_EQ(i.n_ctx, 1024);
    EXPECT_EQ(e->bos_token(), 0);
    EXPECT_TRUE(e->is_end_of_generation(1));
    EXPECT_FALSE(e->tokenize("hello world", false, false).empty());
}

class ds4_engine_paths : public ::testing::TestWithParam<std::tuple<std::string, std::string, size_t>> {};

// Every evaluation path of the engine meets the golden tier of the case.
TEST_P(ds4_engine_paths, match_golden) {
    const auto &[case_name, qat, step] = GetParam();
    const auto &c = find_case(case_name);
    auto e = load(qat);
    const auto logits = eval_all(*e, c.tokens, step);
    const auto v = ds4_test::compare(c, logits, e->info().n_vocab);
    EXPECT_TRUE(v.ok) << case_name << " step " << step << ": " << v.why;
}

INSTANTIATE_TEST_SUITE_P(
    ds4, ds4_engine_paths,
    ::testing::Values(std::make_tuple("len67.no_qat", "off", size_t{0}), std::make_tuple("len67.no_qat", "off", size_t{1}),
                      std::make_tuple("len67.no_qat", "off", size_t{7}),
                      std::make_tuple("len67.qat_fp4only", "fp4only", size_t{0}),
                      std::make_tuple("len300.qat_full", "full", size_t{64})),
    [](const auto &info) {
        std::string n = std::get<0>(info.param) + "_" + std::to_string(std::get<2>(info.param));
        for (char &ch : n)
            if (ch == '.') ch = '_';
        return n;
    });

// The QAT option reaches the state: on a case long enough for FP8/FP4 to matter, "off" misses the
// full-QAT golden while "full" meets it.
TEST(ds4_engine, qat_option_selects_mode) {
    const auto &c = find_case("len300.qat_full");
    auto off = load("off");
    EXPECT_FALSE(ds4_test::compare(c, eval_all(*off, c.tokens, 0), 512).ok);
}

// Relative L2 distance between a session's current logits and golden last-position logits of a
// case truncated at `n` tokens: position n-1's top8 checked instead when n < case length.
void expect_logits_at(const ds4_test::golden_case &c, std::span<const float> l, size_t n) {
    ASSERT_EQ(l.size(), 512u);
    for (const auto &[id, g] : c.top8[n - 1]) EXPECT_NEAR(l[static_cast<size_t>(id)], g, 1e-3) << "position " << n - 1;
}

TEST(ds4_engine, sync_reuses_extends_and_rebuilds) {
    const auto &c = find_case("len67.no_qat");
    auto e = load("off");
    auto s = e->new_session();
    const std::vector<int32_t> &t = c.tokens;
    int64_t last_total = -1;
    auto progress = [&](int64_t, int64_t total) { last_total = total; };

    s->sync(std::span<const int32_t>(t.data(), 30), progress);
    expect_logits_at(c, s->logits(), 30);
    EXPECT_EQ(last_total, 30);
    s->sync(t, progress);  // extends: only the 37 new tokens are evaluated
    EXPECT_EQ(last_total, 37);
    EXPECT_EQ(s->n_past(), 67);
    expect_logits_at(c, s->logits(), 67);
    s->sync(t, progress);  // identical: nothing evaluated
    EXPECT_EQ(last_total, 0);
    expect_logits_at(c, s->logits(), 67);

    s->sync(std::span<const int32_t>(t.data(), 40), progress);  // strict prefix: rebuilt from scratch
    EXPECT_EQ(last_total, 40);
    EXPECT_EQ(s->n_past(), 40);
    expect_logits_at(c, s->logits(), 40);

    std::vector<int32_t> other(t.begin(), t.begin() + 50);
    other[20] = (other[20] + 1) % 512;
    s->sync(other, progress);  // diverges at 20
    EXPECT_EQ(last_total, 50);
    s->sync(t, progress);  // diverged: rebuilt, and the result is the golden one
    EXPECT_EQ(last_total, 67);
    expect_logits_at(c, s->logits(), 67);

    s->sync(std::span<const int32_t>(), progress);
    EXPECT_EQ(s->n_past(), 0);
    EXPECT_TRUE(s->logits().empty());
}

// ds4-tiny-a has no tokenizer.chat_template: the DeepSeek V4 chat-mode layout (spec of the official
// encoder, docs/ds4-chat-format.md): BOS, system text, <｜User｜>text, <｜Assistant｜></think>.
TEST(ds4_engine, builtin_chat_template) {
    auto e = load("off");
    const std::string bos = "<\xEF\xBD\x9C" "begin\xE2\x96\x81of\xE2\x96\x81sentence\xEF\xBD\x9C>";
    const std::string user = "<\xEF\xBD\x9C" "User\xEF\xBD\x9C>";
    const std::string asst = "<\xEF\xBD\x9C" "Assistant\xEF\xBD\x9C>";
    const std::vector<chat_message> msgs = {{"system", "Be brief."}, {"user", "hi"}};
    EXPECT_EQ(e->apply_chat_template(msgs, true), bos + "Be brief." + user + "hi" + asst + "</think>");
    EXPECT_EQ(e->apply_chat_template(msgs, false), bos + "Be brief." + user + "hi");
}

TEST(ds4_engine, context_limit) {
    auto e = load("off", kv_precision::f32, 16);
    auto s = e->new_session();
    const std::vector<int32_t> toks(17, 5);
    EXPECT_THROW(s->eval(toks), error);
    EXPECT_THROW(s->sync(toks), error);
    const int32_t bad = 512;
    EXPECT_THROW(s->eval(std::span<const int32_t>(&bad, 1)), error);
    EXPECT_EQ(s->n_past(), 0);
}

// Hand count for ds4-tiny (ratios 0,0,4,128,4,128; d 192; indexer dim 128; window 32): per token
// 2 x (192/4 + 128/4) + 2 x 192/128 = 163 elements = 326 bytes at f16; rings 6 x 32 x 192 elements
// = 73728 bytes, / 1024 = 72 bytes per token of a 1024-token context.
TEST(ds4_engine, kv_bytes_per_token_tiny) {
    EXPECT_EQ(load("off", kv_precision::f16, 1024)->info().kv_bytes_per_token, 326u + 72u);
    EXPECT_EQ(load("off", kv_precision::f32, 1024)->info().kv_bytes_per_token, 2u * (326u + 72u));
}

// Full DS4-Flash geometry (spec section 1): 43 layers, ratios 0,0 then 4/128 alternating (21 ratio-4,
// 20 ratio-128), d 512, indexer dim 128, window 128. Per token 21 x (128 + 32) + 20 x 4 = 3440
// elements = 6880 bytes at f16; rings 43 x 128 x 512 x 2 = 5636096 bytes, amortised.
TEST(ds4_engine, kv_bytes_per_token_flash) {
    ds4::hparams hp;
    hp.n_layer = 43;
    hp.head_dim = 512;
    hp.idx_dim = 128;
    hp.window = 128;
    hp.compress_ratio = {0, 0};
    for (int il = 2; il < 43; ++il) hp.compress_ratio.push_back(il % 2 == 0 ? 4 : 128);
    const int64_t ctx = 1 << 20;
    EXPECT_DOUBLE_EQ(ds4::kv_bytes_per_token(hp, kv_precision::f16, ctx), 6880.0 + 5636096.0 / ctx);
    EXPECT_LE(ds4::kv_bytes_per_token(hp, kv_precision::f16, ctx), 6900.0);
    EXPECT_DOUBLE_EQ(ds4::kv_bytes_per_token(hp, kv_precision::f16, 8192), 6880.0 + 688.0);
    EXPECT_THROW(ds4::kv_bytes_per_token(hp, kv_precision::f16, 0), error);
}

TEST(ds4_engine, option_errors) {
    engine_options o;
    o.model_path = tiny_path();
    o.ds4_qat = "fp8";
    EXPECT_THROW(engine::load(o), error);
    o.ds4_qat = "full";
    o.device = "tpu";
    EXPECT_THROW(engine::load(o), error);
    o.device = "cpu";
    o.n_batch = -1;
    EXPECT_THROW(engine::load(o), error);
    o.n_batch = 0;  // the default chunk (512 on the CPU)
    EXPECT_NO_THROW(engine::load(o));
}

}  // namespace
