// DS4 behind the public engine API (src/engine/ds4_engine.cpp): engine::load dispatch, the three
// evaluation paths and the QAT option against the ds4-tiny goldens, session::sync prefix reuse
// (extend, diverge, strict prefix) checked against golden logits, kv_bytes_per_token against
// hand-computed figures (ds4-tiny and the full DS4-Flash geometry) and option errors.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <tuple>
#include <numeric>

#include "dist/gpu_stage.h"
#include "engine/device.h"
#include "fathom/engine.h"
#include "models/ds4/golden_util.h"
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
    o.ds4_checkpoint_mib = 0;  // these tests count what the rollback alone re-evaluates (checkpoints: test_ds4_checkpoints)
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

// On one CPU device a session rolls back up to 16 positions for free (position-indexed rings): a sync that
// diverges, or asks for a strict prefix, within that reach evaluates only what is new; truncate() within
// it keeps the state, deeper it rebuilds. Every result is the golden one (and bit-identical to a fresh
// session's).
TEST(ds4_engine, sync_and_truncate_roll_back_within_reach) {
    const auto &c = find_case("len67.no_qat");
    auto e = load("off");
    auto s = e->new_session(), fresh = e->new_session();
    EXPECT_TRUE(s->rolls_back());
    EXPECT_EQ(s->rollback_limit(), 16);
    const std::vector<int32_t> &t = c.tokens;
    int64_t last_total = -1;
    auto progress = [&](int64_t, int64_t total) { last_total = total; };
    auto same_as_fresh = [&](std::span<const int32_t> prefix) {
        fresh->reset();
        fresh->sync(prefix);
        const auto a = s->logits(), b = fresh->logits();
        ASSERT_EQ(a.size(), b.size());
        EXPECT_EQ(0, std::memcmp(a.data(), b.data(), a.size() * sizeof(float))) << prefix.size() << " tokens";
    };
    s->sync(t, progress);
    s->sync(std::span<const int32_t>(t.data(), 60), progress);  // strict prefix, 7 back: the last token again
    EXPECT_EQ(last_total, 1);
    expect_logits_at(c, s->logits(), 60);
    same_as_fresh(std::span<const int32_t>(t.data(), 60));
    std::vector<int32_t> other(t.begin(), t.begin() + 60);
    other[52] = (other[52] + 1) % 512;
    s->sync(other, progress);  // diverges at 52, within reach of the furthest evaluated position (67): 8 new
    EXPECT_EQ(last_total, 8);
    same_as_fresh(other);
    s->sync(t, progress);  // back to the golden sequence: diverged at 52, 15 new tokens
    EXPECT_EQ(last_total, 15);
    expect_logits_at(c, s->logits(), 67);
    s->truncate(55);  // within reach: kept, no logits until the next evaluation
    EXPECT_EQ(s->n_past(), 55);
    EXPECT_TRUE(s->logits().empty());
    s->sync(std::span<const int32_t>(t.data(), 58), progress);
    EXPECT_EQ(last_total, 3);
    expect_logits_at(c, s->logits(), 58);
    std::vector<int32_t> other2(t.begin(), t.begin() + 50);
    other2[49] = (other2[49] + 1) % 512;
    s->sync(other2, progress);  // diverges at 49, 18 behind the furthest evaluated position (67): rebuilt
    EXPECT_EQ(last_total, 50);
    s->sync(t, progress);
    EXPECT_EQ(last_total, 18);  // the rebuilt state reached 50: back to 49 is free
    expect_logits_at(c, s->logits(), 67);
    s->truncate(30);  // deeper than 16 behind the furthest evaluated position (67): rebuilt
    EXPECT_EQ(s->n_past(), 30);
    expect_logits_at(c, s->logits(), 30);
    s->sync(std::span<const int32_t>(t.data(), 20), progress);  // the rebuilt state reached 30: 10 back is free
    EXPECT_EQ(last_total, 1);
    expect_logits_at(c, s->logits(), 20);
}

// The engine's batched step on one CPU device runs every item as rows of one forward: a verification
// (pending + 4 drafts, every row's logits), decodes, a whole prompt in several pieces (n_batch 16), a
// regeneration that diverges within the rollback reach; each session's logits are bit-identical to
// the same tokens evaluated in a lone session (batch invariance), and decode_step likewise.
TEST(ds4_engine, sync_step_fuses_items_bit_identical_to_alone) {
    const auto &c = find_case("len300.qat_full");
    engine_options o;
    o.model_path = tiny_path();
    o.n_threads = 2;
    o.n_ctx = 512;
    o.n_batch = 16;
    o.kv = kv_precision::f16;
    auto e = engine::load(o);
    const size_t V = 512;
    const std::vector<int32_t> &t = c.tokens;
    const std::vector<int32_t> p0(t.begin(), t.begin() + 40), p1(t.begin() + 100, t.begin() + 160),
        p2(t.begin() + 200, t.begin() + 250);
    auto a = e->new_session(), b = e->new_session(), cc = e->new_session(), d = e->new_session(), ref = e->new_session();
    a->sync(p0);
    b->sync(p1);
    d->sync(p2);
    std::vector<int32_t> pa = p0, pb = p1, pd(p2.begin(), p2.end() - 5);
    for (int32_t x : {11, 22, 33, 44, 55}) pa.push_back(x);
    pb.push_back(77);
    for (int32_t x : {5, 6, 7}) pd.push_back(x);  // the last 5 regenerated as 3 others
    std::vector<float> rows(5 * V, -1.0f);
    e->sync_step(std::vector<sync_item>{{a.get(), pa, true, 5, rows.data()}, {b.get(), pb, true}, {cc.get(), p2, true},
                                        {d.get(), pd, true}});
    auto lone = [&](const std::vector<int32_t> &prefix, size_t n_rows) {
        ref->reset();
        ref->sync(std::span<const int32_t>(prefix).first(prefix.size() - n_rows));
        std::vector<float> out(n_rows * V);
        ref->eval(std::span<const int32_t>(prefix).last(n_rows), out.data());
        return out;
    };
    const auto wa = lone(pa, 5), wb = lone(pb, 1), wc = lone(p2, 1), wd = lone(pd, 1);
    EXPECT_EQ(0, std::memcmp(rows.data(), wa.data(), rows.size() * sizeof(float)));
    using check = std::tuple<session *, const std::vector<float> *, const std::vector<int32_t> *>;
    for (auto [s, w, prefix] : {check{a.get(), &wa, &pa}, check{b.get(), &wb, &pb}, check{cc.get(), &wc, &p2},
                                check{d.get(), &wd, &pd}}) {
        EXPECT_EQ(s->tokens(), *prefix);
        const auto l = s->logits();
        ASSERT_EQ(l.size(), V);
        EXPECT_EQ(0, std::memcmp(l.data(), w->data() + w->size() - V, V * sizeof(float))) << prefix->size();
    }
    // A rollback of the verification's rejected drafts, then every session decodes in one step.
    a->truncate(static_cast<int64_t>(p0.size() + 2));
    pa.resize(p0.size() + 2);
    std::vector<session *> ss = {a.get(), b.get(), cc.get(), d.get()};
    const std::vector<int32_t> next = {9, 8, 7, 6};
    e->decode_step(ss, next);
    for (size_t i = 0; i < ss.size(); ++i) {
        std::vector<int32_t> prefix = ss[i]->tokens();
        ASSERT_EQ(prefix.back(), next[i]);
        const auto w = lone(prefix, 1);
        EXPECT_EQ(0, std::memcmp(ss[i]->logits().data(), w.data(), V * sizeof(float))) << "session " << i;
    }
    // Bad items change nothing: a token outside the vocabulary.
    const auto held = b->tokens();
    std::vector<int32_t> bad = held;
    bad.push_back(512);
    EXPECT_THROW(e->sync_step(std::vector<sync_item>{{b.get(), bad, true}}), error);
    EXPECT_EQ(b->tokens(), held);
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

// Thinking modes (chat_thinking) through the built-in format: the official encoder's thinking mode
// opens "<think>" after the last Assistant marker and renders an earlier turn (its reasoning dropped:
// chat_message carries none) as "<｜Assistant｜></think>answer<｜end▁of▁sentence｜>"; max adds the
// Think-Max paragraph after BOS. The server cuts the final "<think>" off and forces it as the first
// generated token, so turn 1's prompt without it is a prefix of turn 2's prompt (docs/server.md
// "Thinking"): checked on the text and on the tokens.
TEST(ds4_engine, thinking_chat_template) {
    auto e = load("off");
    const std::string bos = "<\xEF\xBD\x9C" "begin\xE2\x96\x81of\xE2\x96\x81sentence\xEF\xBD\x9C>";
    const std::string eos = "<\xEF\xBD\x9C" "end\xE2\x96\x81of\xE2\x96\x81sentence\xEF\xBD\x9C>";
    const std::string user = "<\xEF\xBD\x9C" "User\xEF\xBD\x9C>";
    const std::string asst = "<\xEF\xBD\x9C" "Assistant\xEF\xBD\x9C>";
    const std::vector<chat_message> one = {{"system", "Be brief."}, {"user", "hi"}};
    EXPECT_EQ(e->apply_chat_template(one, true, chat_thinking::on), bos + "Be brief." + user + "hi" + asst + "<think>");
    EXPECT_EQ(e->apply_chat_template(one, true, chat_thinking::off), bos + "Be brief." + user + "hi" + asst + "</think>");
    EXPECT_EQ(e->apply_chat_template(one, false, chat_thinking::on), bos + "Be brief." + user + "hi");
    const std::string mx = e->apply_chat_template(one, true, chat_thinking::max);
    EXPECT_EQ(mx.rfind(bos + "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n", 0), 0u);
    const std::string tail = "\n\nBe brief." + user + "hi" + asst + "<think>";  // the paragraph ends with a blank line
    ASSERT_GT(mx.size(), tail.size());
    EXPECT_EQ(mx.substr(mx.size() - tail.size()), tail);

    const std::vector<chat_message> turn1 = {{"user", "q1"}};
    const std::vector<chat_message> turn2 = {{"user", "q1"}, {"assistant", "a1"}, {"user", "q2"}};
    const std::string p1 = e->apply_chat_template(turn1, true, chat_thinking::on);
    const std::string p2 = e->apply_chat_template(turn2, true, chat_thinking::on);
    EXPECT_EQ(p2, bos + user + "q1" + asst + "</think>a1" + eos + user + "q2" + asst + "<think>");
    ASSERT_EQ(p1.substr(p1.size() - 7), "<think>");
    const std::string cut = p1.substr(0, p1.size() - 7);
    EXPECT_EQ(p2.rfind(cut, 0), 0u);
    const std::vector<int32_t> t1 = e->tokenize(cut, true, true), t2 = e->tokenize(p2, true, true);
    ASSERT_LT(t1.size(), t2.size());
    EXPECT_TRUE(std::equal(t1.begin(), t1.end(), t2.begin()));
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
// 2 x (192/4 + 128/4) + 2 x 192/128 = 163 elements = 326 bytes at f16; rings of window 32 + 16 rollback
// rows: 6 x 48 x 192 elements = 110592 bytes, / 1024 = 108 bytes per token of a 1024-token context.
TEST(ds4_engine, kv_bytes_per_token_tiny) {
    EXPECT_EQ(load("off", kv_precision::f16, 1024)->info().kv_bytes_per_token, 326u + 108u);
    EXPECT_EQ(load("off", kv_precision::f32, 1024)->info().kv_bytes_per_token, 2u * (326u + 108u));
}

// Full DS4-Flash geometry (spec section 1): 43 layers, ratios 0,0 then 4/128 alternating (21 ratio-4,
// 20 ratio-128), d 512, indexer dim 128, window 128. Per token 21 x (128 + 32) + 20 x 4 = 3440
// elements = 6880 bytes at f16; rings of 128 + 16 rollback rows: 43 x 144 x 512 x 2 = 6340608 bytes,
// amortised (6928.4 bytes per token at 128K).
TEST(ds4_engine, kv_bytes_per_token_flash) {
    ds4::hparams hp;
    hp.n_layer = 43;
    hp.head_dim = 512;
    hp.idx_dim = 128;
    hp.window = 128;
    hp.compress_ratio = {0, 0};
    for (int il = 2; il < 43; ++il) hp.compress_ratio.push_back(il % 2 == 0 ? 4 : 128);
    const int64_t ctx = 1 << 20;
    EXPECT_DOUBLE_EQ(ds4::kv_bytes_per_token(hp, kv_precision::f16, ctx), 6880.0 + 6340608.0 / ctx);
    EXPECT_LE(ds4::kv_bytes_per_token(hp, kv_precision::f16, ctx), 6900.0);
    EXPECT_DOUBLE_EQ(ds4::kv_bytes_per_token(hp, kv_precision::f16, 8192), 6880.0 + 774.0);
    EXPECT_LE(ds4::kv_bytes_per_token(hp, kv_precision::f16, 131072), 6929.0);  // the issue's <= 6.9 KB at 128K
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

// A build without the CUDA backend: the executors' stand-ins (src/engine/no_cuda, src/dist/no_cuda) report
// no device, and every way of asking for one fails with one line naming the build; auto falls back.
TEST(ds4_engine, cuda_requests_without_cuda_backend) {
    if (gpu_in_build()) GTEST_SKIP() << "this build has the CUDA backend";
    EXPECT_EQ(gpu_count(), 0);
    const auto load_error = [](const engine_options &o) -> std::string {
        try {
            engine::load(o);
        } catch (const error &e) {
            return e.what();
        }
        return "(loaded)";
    };
    engine_options o;
    o.model_path = tiny_path();
    o.n_ctx = 256;
    o.device = "cuda:0";
    EXPECT_EQ(load_error(o), "device 'cuda:0': this build has no CUDA backend (configure with -DFATHOM_CUDA=ON)");
    o.device = "cpu";
    o.dist.devices = "cpu,cuda:0";
    EXPECT_EQ(load_error(o), "devices 'cpu,cuda:0': entry 2: device 'cuda:0': this build has no CUDA backend "
                             "(configure with -DFATHOM_CUDA=ON)");
    o.dist.devices.clear();
    o.device = "auto";
    EXPECT_EQ(engine::load(o)->info().device, "cpu");
    const std::unique_ptr<ds4::model> m = ds4::load_model(tiny_path());
    dist::stage_device dev;
    dev.cuda_device = 0;
    dev.n_ctx = 256;
    try {
        dist::make_gpu_stage(*m, dev, {0, m->hp.n_layer}, ds4::qat_mode::full, kv_precision::f32);
        ADD_FAILURE() << "a CUDA stage was built";
    } catch (const error &e) {
        EXPECT_STREQ(e.what(), "dist: CUDA stage requested but this build has no CUDA backend (configure with "
                               "-DFATHOM_CUDA=ON)");
    }
}

}  // namespace
