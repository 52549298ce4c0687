// N-gram speculative decoding (include/fathom/speculative.h).
//
// ngram_draft on hand-worked histories. generate_ngram against the plain decoding loop (the loop the
// header defines, written out here with session::sample / eval): the same tokens, greedy and sampled with
// a seed, on the real SmolLM2 and Gemma3 models when installed and on a tiny synthetic Qwen3 always;
// the session afterwards holds what the plain loop's session holds; token limits and a full context stop
// it where they stop the plain loop, also in the middle of a step's drafts; drafts were accepted (the
// test exercises acceptance, not only rejection). A session without cheap rollback (DeepSeek V4) is refused.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <fstream>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/error.h"
#include "models/ds4/golden_util.h"
#include "fathom/engine.h"
#include "fathom/speculative.h"
#include "models/dense_synth.h"
#include "sched/scheduler.h"

using namespace fathom;

namespace {

std::vector<int32_t> draft(const std::vector<int32_t> &h, int32_t max, int nmin = 2, int nmax = 4) {
    spec::ngram_options o;
    o.ngram_min = nmin;
    o.ngram_max = nmax;
    return spec::ngram_draft(h, o, max);
}

TEST(SpecNgram, DraftsWhatFollowedTheLongestRecurringSuffix) {
    // suffix [3 4] occurs at 2..3, followed by 5 6 7 3 4
    EXPECT_EQ(draft({1, 2, 3, 4, 5, 6, 7, 3, 4}, 3), (std::vector<int32_t>{5, 6, 7}));
    EXPECT_EQ(draft({1, 2, 3, 4, 5, 6, 7, 3, 4}, 10), (std::vector<int32_t>{5, 6, 7, 3, 4}));  // up to the end
    // The longest suffix wins: [9 3 4] occurs at 5..7 (followed by 8), [3 4] alone most recently at 6..7 too,
    // but [2 3 4] ... here: history 2 3 4 1 | 9 3 4 8 | 9 3 4 -> suffix [9 3 4] at 4..6 -> 8 9 3 4.
    EXPECT_EQ(draft({2, 3, 4, 1, 9, 3, 4, 8, 9, 3, 4}, 2, 2, 3), (std::vector<int32_t>{8, 9}));
    // The most recent earlier occurrence: [5 6] at 0..1 (-> 1) and at 3..4 (-> 2): 2.
    EXPECT_EQ(draft({5, 6, 1, 5, 6, 2, 5, 6}, 1), (std::vector<int32_t>{2}));
    // A periodic history drafts its period (an occurrence overlapping the suffix).
    EXPECT_EQ(draft({7, 7, 7, 7}, 4, 2, 2), (std::vector<int32_t>{7}));
    EXPECT_EQ(draft({1, 2, 1, 2, 1, 2}, 4, 2, 2), (std::vector<int32_t>{1, 2}));
    // No recurring suffix of >= ngram_min tokens: nothing; with ngram_min 1 the last token alone.
    EXPECT_TRUE(draft({1, 2, 3, 4, 2}, 4).empty());
    EXPECT_EQ(draft({1, 2, 3, 4, 2}, 4, 1, 4), (std::vector<int32_t>{3, 4, 2}));
    EXPECT_TRUE(draft({}, 4).empty());
    EXPECT_TRUE(draft({5}, 4, 1, 1).empty());
    EXPECT_TRUE(draft({1, 2, 1, 2}, 0).empty());
}

TEST(SpecNgram, OptionsAreValidated) {
    const auto msg = [](spec::ngram_options o) {
        try {
            o.validate();
        } catch (const error &e) {
            return std::string(e.what());
        }
        return std::string();
    };
    spec::ngram_options o;
    EXPECT_EQ(msg(o), "");
    o.draft_max = 0;
    EXPECT_NE(msg(o).find("draft_max"), std::string::npos);
    o = {};
    o.ngram_min = 5;  // > ngram_max 4
    EXPECT_NE(msg(o).find("ngram_min"), std::string::npos);
    o = {};
    o.ngram_max = 17;
    EXPECT_NE(msg(o).find("ngram_max"), std::string::npos);
}

const std::string kSmol = std::string(FATHOM_SOURCE_DIR) + "/models/SmolLM2-135M-Instruct.Q4_1.gguf";
const std::string kGemma = std::string(FATHOM_SOURCE_DIR) + "/models/gemma-3-270m-q4_k_m.gguf";

// A synthetic Qwen3 (src/models/dense_synth.h: seeded random weights, the Qwen2 tokenizer of the shared
// tokenizer tests), written once per process per seed.
std::string synth_qwen(uint64_t seed) {
    const std::string vocab = std::string(FATHOM_SHARED_DIR) + "/tokenizer-tests/ggml-vocab-qwen2.gguf";
    const std::string p = ::testing::TempDir() + "/fathom_spec_qwen3_" + std::to_string(::getpid()) + "_" +
                          std::to_string(seed) + ".gguf";
    if (!std::ifstream(p).good()) dense_synth_write(dense_synth_preset("qwen3", vocab, seed), p);
    return p;
}
const std::string &tiny_qwen() {
    static const std::string path = synth_qwen(5);
    return path;
}

bool exists(const std::string &p) {
    return std::ifstream(p).good();
}

std::unique_ptr<engine> load(const std::string &path, int n_ctx = 1024) {
    engine_options o;
    o.model_path = path;
    o.n_ctx = n_ctx;
    o.n_threads = 2;
    return engine::load(o);  // default numerics: batch-invariant
}

struct outcome {
    std::vector<int32_t> tokens;  // kept tokens
    std::vector<int32_t> held;    // what the session holds afterwards
    bool hit_eog = false, hit_ctx = false;
    spec::spec_stats st;
};

// The plain loop of speculative.h's contract.
outcome plain(engine &e, const std::vector<int32_t> &prompt, const sampling_params &p, int max_tokens) {
    auto s = e.new_session();
    s->sync(prompt);
    sampler smp(p);
    outcome o;
    const int64_t n_ctx = e.info().n_ctx;
    for (;;) {
        const int32_t t = s->sample(smp, s->tokens()).token;
        if (e.is_end_of_generation(t)) {
            o.hit_eog = true;
            break;
        }
        o.tokens.push_back(t);
        if (static_cast<int>(o.tokens.size()) >= max_tokens) break;
        if (s->n_past() >= n_ctx) {
            o.hit_ctx = true;
            break;
        }
        s->eval(std::span<const int32_t>(&t, 1));
    }
    o.held = s->tokens();
    return o;
}

// A speculative loop (`call`: generate_ngram or generate) from a session synced to `prompt`, with the
// plain loop's verdicts (end of generation: stop; max_tokens: keep and stop).
using spec_call = std::function<spec::spec_stats(session &, sampler &, int64_t n_ctx,
                                                 const std::function<spec::token_verdict(int32_t)> &)>;
outcome run_spec(engine &e, const std::vector<int32_t> &prompt, const sampling_params &p, int max_tokens,
                 const spec_call &call) {
    auto s = e.new_session();
    s->sync(prompt);
    sampler smp(p);
    outcome o;
    o.st = call(*s, smp, e.info().n_ctx, [&](int32_t t) {
        if (e.is_end_of_generation(t)) {
            o.hit_eog = true;
            return spec::token_verdict::stop;
        }
        o.tokens.push_back(t);
        return static_cast<int>(o.tokens.size()) >= max_tokens ? spec::token_verdict::keep_and_stop
                                                               : spec::token_verdict::keep;
    });
    o.hit_ctx = o.st.hit_ctx;
    o.held = s->tokens();
    return o;
}

outcome speculative(engine &e, const std::vector<int32_t> &prompt, const sampling_params &p, int max_tokens,
                    spec::ngram_options so = {}) {
    return run_spec(e, prompt, p, max_tokens, [&so](session &s, sampler &smp, int64_t n_ctx, const auto &on_token) {
        return spec::generate_ngram(s, smp, n_ctx, so, on_token);
    });
}

void expect_same(const outcome &want, const outcome &got, const std::string &what) {
    EXPECT_EQ(want.tokens, got.tokens) << what;
    EXPECT_EQ(want.held, got.held) << what;
    EXPECT_EQ(want.hit_eog, got.hit_eog) << what;
    EXPECT_EQ(want.hit_ctx, got.hit_ctx) << what;
    EXPECT_EQ(got.st.emitted, static_cast<int64_t>(got.tokens.size())) << what;
    EXPECT_LE(got.st.accepted, got.st.drafted) << what;
}

std::vector<int32_t> chat_prompt(engine &e, const std::string &text) {
    return e.tokenize(e.apply_chat_template({{"user", text}}, true), true, true);
}

const char *kRepeat =
    "Repeat the following paragraph exactly, word for word: The quick brown fox jumps over the lazy dog. The "
    "lazy dog sleeps in the warm sun while the quick brown fox runs across the green field toward the old "
    "wooden fence near the river.";
const char *kCode =
    "Write a Python function that prints the numbers from 1 to 20, one per line, then write the same function "
    "again but named print_numbers_again.";

sampling_params greedy() {
    sampling_params p;
    p.temperature = 0.0f;
    return p;
}
sampling_params sampled(uint64_t seed) {
    sampling_params p;
    p.temperature = 0.8f;
    p.seed = seed;
    p.repeat_penalty = 1.1f;  // penalties read the history: it must be the plain loop's at every position
    return p;
}

// Real models: greedy and sampled outputs equal plain decoding; drafts are accepted.
void real_model_case(const std::string &path, int n_greedy, int n_sampled, std::vector<uint64_t> seeds) {
    if (!exists(path)) {
        GTEST_SKIP() << path << " not installed (scripts/install-models.sh)";
    }
    auto e = load(path);
    int64_t accepted = 0;
    // Rows priced free (row_cost 0: every step drafts what the n-grams offer): the identity under test
    // must see many kept and dropped drafts, which the measured CPU costs (~0.85 of a step a row) would
    // mostly pause (the width itself: test_spec_width.cpp).
    spec::ngram_options so;
    so.row_cost = 0;
    for (const char *text : {kRepeat, kCode}) {
        const auto prompt = chat_prompt(*e, text);
        const outcome a = plain(*e, prompt, greedy(), n_greedy), b = speculative(*e, prompt, greedy(), n_greedy, so);
        expect_same(a, b, std::string("greedy: ") + text);
        accepted += b.st.accepted;
        for (uint64_t seed : seeds) {
            const outcome c = plain(*e, prompt, sampled(seed), n_sampled),
                          d = speculative(*e, prompt, sampled(seed), n_sampled, so);
            expect_same(c, d, "sampled seed " + std::to_string(seed) + ": " + text);
            accepted += d.st.accepted;
        }
    }
    EXPECT_GT(accepted, 20) << "drafts were hardly ever accepted: the comparison did not exercise acceptance";
}

TEST(SpecGenerate, SmolLM2SameTokensAsPlainDecoding) {
    real_model_case(kSmol, 160, 120, {1, 7});
}

TEST(SpecGenerate, Gemma3SameTokensAsPlainDecoding) {
    real_model_case(kGemma, 100, 60, {1});
}

// Drafts from a known continuation: the plain loop's own output (`ref`), every `wrong`-th drafted token
// replaced by another id (0: none), so steps accept all, some or none of their drafts.
spec::drafter oracle(const std::vector<int32_t> &prompt, const std::vector<int32_t> &ref, int wrong, int n_vocab) {
    return [&prompt, &ref, wrong, n_vocab, count = 0](std::span<const int32_t> h, int32_t max) mutable {
        std::vector<int32_t> d;
        for (size_t i = h.size() - prompt.size(); i < ref.size() && static_cast<int32_t>(d.size()) < max; ++i) {
            int32_t t = ref[i];
            if (wrong > 0 && ++count % wrong == 0) t = (t + 1) % n_vocab;
            d.push_back(t);
        }
        return d;
    };
}

outcome with_drafter(engine &e, const std::vector<int32_t> &prompt, const sampling_params &p, int max_tokens,
                     int draft_max, bool adaptive, const spec::drafter &d) {
    return run_spec(e, prompt, p, max_tokens, [&](session &s, sampler &smp, int64_t n_ctx, const auto &on_token) {
        spec::width_options w;
        w.draft_max = draft_max;
        w.adaptive = adaptive;
        w.row_cost = 0;  // deterministic widths: the drafts' timing must not decide what the test exercises
        return spec::generate(s, smp, n_ctx, w, d, on_token);
    });
}

// A tiny synthetic Qwen3 (always available). Its random weights rarely repeat themselves, so besides the
// n-gram drafter (identity, little acceptance) the loop runs with drafts from the plain output itself
// (every draft right, every 2nd or 3rd wrong): steps that keep all, some and none of their drafts; a
// token limit at every position 1..40 (stops in the middle of a step's drafts); a context that fills
// mid-step; greedy and sampled.
TEST(SpecGenerate, TinyQwen3DraftsKeptOrDroppedMatchPlainDecoding) {
    auto e = load(tiny_qwen(), 256);
    const int V = e->info().n_vocab;
    const std::vector<int32_t> prompt = e->tokenize("one two three one two three one two three four five", true, false);
    for (const sampling_params &p : {greedy(), sampled(3)}) {
        const std::string what = p.temperature == 0 ? "greedy" : "sampled seed " + std::to_string(p.seed);
        const outcome ref = plain(*e, prompt, p, 60);
        ASSERT_EQ(ref.tokens.size(), 60u) << what;
        for (int k : {1, 8, 64})
            for (bool adaptive : {true, false}) {
                spec::ngram_options so;
                so.draft_max = k;
                so.adaptive = adaptive;
                so.ngram_min = 1;
                const std::string w = what + ", draft_max " + std::to_string(k) + (adaptive ? " adaptive" : " fixed");
                expect_same(ref, speculative(*e, prompt, p, 60, so), w + ", n-gram");
                for (int wrong : {0, 2, 3}) {
                    const outcome got = with_drafter(*e, prompt, p, 60, k, adaptive, oracle(prompt, ref.tokens, wrong, V));
                    expect_same(ref, got, w + ", oracle wrong every " + std::to_string(wrong));
                    if (wrong == 0) {
                        EXPECT_EQ(got.st.accepted, got.st.drafted) << w;
                    }
                    if (wrong == 0 && k > 1) {
                        EXPECT_GT(got.st.accepted, 30) << w;
                    }
                    if (wrong == 2 && k > 1) {
                        EXPECT_LT(got.st.accepted, got.st.drafted) << w;
                    }
                }
            }
        for (int m = 1; m <= 24; ++m) {
            const outcome want = plain(*e, prompt, p, m);
            expect_same(want, with_drafter(*e, prompt, p, m, 8, false, oracle(prompt, ref.tokens, 0, V)),
                        what + ", max_tokens " + std::to_string(m));
            expect_same(want, with_drafter(*e, prompt, p, m, 8, true, oracle(prompt, ref.tokens, 3, V)),
                        what + ", max_tokens " + std::to_string(m) + ", some wrong");
        }
    }
    // A context of prompt + 23 tokens: it fills in the middle of a step.
    auto small = load(tiny_qwen(), static_cast<int>(prompt.size()) + 23);
    const outcome a = plain(*small, prompt, greedy(), 1000);
    EXPECT_TRUE(a.hit_ctx);
    const outcome ref = plain(*e, prompt, greedy(), 60);
    for (int wrong : {0, 3})
        expect_same(a, with_drafter(*small, prompt, greedy(), 1000, 8, false, oracle(prompt, ref.tokens, wrong, V)),
                    "full context, wrong every " + std::to_string(wrong));
    expect_same(a, speculative(*small, prompt, greedy(), 1000), "full context, n-gram");
}

// DeepSeek V4 on one CPU device rolls back (position-indexed rings, src/models/deepseek4.h): ds4-tiny with
// drafts from the plain output (all right; every 2nd or 3rd wrong: deep rollbacks) and with the n-gram
// drafter gives plain decoding's output, greedy and sampled, and drafts at most rollback_limit() tokens a
// step whatever draft_max says. Over 40 generated tokens after a 100-token prompt cross raw-ring wraps
// (window 32), ratio-4 block ends and the ratio-128 block end at position 127.
TEST(SpecGenerate, DeepSeekV4TinySameTokensAsPlainDecoding) {
    auto e = load(ds4_test::golden_dir() + "/ds4-tiny-a.gguf", 512);
    const int V = e->info().n_vocab;
    {
        auto s = e->new_session();
        EXPECT_TRUE(s->rolls_back());
        EXPECT_EQ(s->rollback_limit(), 16);
    }
    std::vector<int32_t> prompt;
    for (const auto &c : ds4_test::load_cases("cases.jsonl"))
        if (c.tokens.size() >= 100 && prompt.empty()) prompt.assign(c.tokens.begin(), c.tokens.begin() + 100);
    ASSERT_EQ(prompt.size(), 100u);
    for (const sampling_params &p : {greedy(), sampled(3)}) {
        const std::string what = p.temperature == 0 ? "greedy" : "sampled seed " + std::to_string(p.seed);
        const outcome ref = plain(*e, prompt, p, 150);
        ASSERT_GT(ref.tokens.size(), 40u) << what << ": the plain output ended early (end of generation)";
        for (int k : {4, 16, 64})
            for (int wrong : {0, 2, 3}) {
                const outcome got = with_drafter(*e, prompt, p, 150, k, wrong != 3, oracle(prompt, ref.tokens, wrong, V));
                expect_same(ref, got, what + ", draft_max " + std::to_string(k) + ", wrong every " + std::to_string(wrong));
                EXPECT_LE(got.st.drafted, got.st.steps * 16) << "more drafts per step than the state can drop";
                if (wrong == 0) {
                    EXPECT_EQ(got.st.accepted, got.st.drafted) << what;
                }
            }
        spec::ngram_options so;
        so.ngram_min = 1;
        expect_same(ref, speculative(*e, prompt, p, 150, so), what + ", n-gram");
    }
}

// Sessions that cannot drop positions (DeepSeek V4 over several devices: a pipeline) are refused with
// one line, before anything is evaluated.
TEST(SpecGenerate, SessionWithoutRollbackIsRefused) {
    engine_options o;
    o.model_path = ds4_test::golden_dir() + "/ds4-tiny-a.gguf";
    o.n_ctx = 64;
    o.n_threads = 2;
    o.dist.devices = "cpu,cpu";
    auto e = engine::load(o);
    auto s = e->new_session();
    s->sync(std::vector<int32_t>{1, 2, 3});
    EXPECT_FALSE(s->rolls_back());
    sampler smp(greedy());
    try {
        spec::generate_ngram(*s, smp, 64, {}, [](int32_t) { return spec::token_verdict::keep; });
        ADD_FAILURE() << "accepted";
    } catch (const error &e) {
        EXPECT_NE(std::string(e.what()).find("needs a session that can drop rejected positions"), std::string::npos) << e.what();
    }
    EXPECT_EQ(s->n_past(), 3);
}

}  // namespace

namespace {

// The dense engine's batched step with verification rows (sync_item::n_rows, the server's speculative
// decode): rows fused into one forward with a plain decode and a prompt chunk give, bit for bit, the
// logits a lone session's eval(all_logits) gives for the same tokens; the session then holds the prefix
// and its logits() are the last row's; again after a rollback, fused with a decode of another session.
void rows_case(bool pool) {
    if (!exists(kSmol)) {
        GTEST_SKIP() << kSmol << " not installed";
    }
    auto e = load(kSmol);
    if (pool) {
        ASSERT_TRUE(e->kv_pool_configure(16, 256));
    }
    const size_t V = static_cast<size_t>(e->info().n_vocab);
    const auto p0 = chat_prompt(*e, kRepeat), p1 = chat_prompt(*e, kCode);
    auto a = e->new_session(), b = e->new_session(), c = e->new_session(), ref = e->new_session();
    a->sync(p0);
    b->sync(p1);
    // a: pending + 4 drafts (with rows); b: one decode; c: a whole prompt.
    std::vector<int32_t> pa = p0;
    for (int32_t t : {11, 22, 33, 44, 55}) pa.push_back(t);
    std::vector<int32_t> pb = p1;
    pb.push_back(77);
    std::vector<float> rows(5 * V, -1.0f);
    std::vector<sync_item> items = {{a.get(), pa, true, 5, rows.data()}, {b.get(), pb, true}, {c.get(), p0, true}};
    e->sync_step(items);
    ref->sync(p0);
    std::vector<float> want(5 * V);
    ref->eval(std::span<const int32_t>(pa).subspan(p0.size()), want.data());
    EXPECT_EQ(0, std::memcmp(rows.data(), want.data(), rows.size() * sizeof(float))) << "pool " << pool;
    EXPECT_EQ(a->tokens(), pa);
    const auto la = a->logits();
    EXPECT_EQ(0, std::memcmp(la.data(), want.data() + 4 * V, V * sizeof(float)));
    // A second verification after a rollback (truncate to the pending token + 1 kept draft).
    a->truncate(static_cast<int64_t>(p0.size() + 2));
    std::vector<int32_t> pa2(pa.begin(), pa.begin() + static_cast<std::ptrdiff_t>(p0.size() + 2));
    for (int32_t t : {66, 88}) pa2.push_back(t);
    std::vector<float> rows2(2 * V);
    std::vector<int32_t> pb2 = pb;
    pb2.push_back(78);  // b decodes in the same step
    std::vector<sync_item> items2 = {{b.get(), pb2, true}, {a.get(), pa2, true, 2, rows2.data()}};
    e->sync_step(items2);
    ref->truncate(static_cast<int64_t>(p0.size() + 2));
    std::vector<float> want2(2 * V);
    ref->eval(std::span<const int32_t>(pa2).subspan(p0.size() + 2), want2.data());
    EXPECT_EQ(0, std::memcmp(rows2.data(), want2.data(), rows2.size() * sizeof(float))) << "pool " << pool;
    EXPECT_EQ(a->tokens(), pa2);
}

TEST(SpecRows, FusedVerificationRowsEqualALoneEval) {
    rows_case(true);
}

// A verification item whose new tokens exceed one piece (n_batch 8; a fresh session asked for a long
// prefix) runs alone after the fused forward (sync_with_rows): the same rows as a lone eval.
TEST(SpecRows, LongVerificationItemRunsAlone) {
    engine_options o;
    o.model_path = tiny_qwen();
    o.n_ctx = 256;
    o.n_batch = 8;
    o.n_threads = 2;
    auto e = engine::load(o);
    ASSERT_TRUE(e->kv_pool_configure(16, 64));
    const size_t V = static_cast<size_t>(e->info().n_vocab);
    const std::vector<int32_t> prefix = e->tokenize("one two three four five six seven eight nine ten eleven twelve thirteen fourteen", true, false);
    ASSERT_GT(prefix.size(), 12u);
    auto a = e->new_session(), b = e->new_session(), ref = e->new_session();
    b->sync(std::vector<int32_t>(prefix.begin(), prefix.begin() + 5));
    std::vector<int32_t> pb(prefix.begin(), prefix.begin() + 6);
    std::vector<float> rows(3 * V, -1.0f);
    e->sync_step(std::vector<sync_item>{{a.get(), prefix, true, 3, rows.data()}, {b.get(), pb, true}});
    ref->sync(std::vector<int32_t>(prefix.begin(), prefix.end() - 3));
    std::vector<float> want(3 * V);
    ref->eval(std::span<const int32_t>(prefix).last(3), want.data());
    EXPECT_EQ(0, std::memcmp(rows.data(), want.data(), rows.size() * sizeof(float)));
    EXPECT_EQ(a->tokens(), prefix);
    EXPECT_EQ(b->tokens(), pb);
}

}  // namespace

namespace {

// The server's scheduler with and without --spec on SmolLM2, two slots at once: the same token ids, text,
// finish and logprobs (every value, bit for bit) for greedy and for sampled requests whose whole
// distribution matters (top-k/top-p/min-p off, repeat penalty on, logprobs with 3 alternatives), so the
// history each verification row is sampled with, the RNG draws and the logprob path are those of plain
// decoding; drafts were kept.
struct sched_out {
    std::vector<int32_t> ids;
    std::vector<float> lp;
    std::vector<int32_t> top_ids;
    std::string text;
    int reason = -1;
    bool operator==(const sched_out &o) const {
        return ids == o.ids && lp == o.lp && top_ids == o.top_ids && text == o.text && reason == o.reason;
    }
};

sched_out drain(sched::job &j) {
    sched_out o;
    sched::event ev;
    while (j.next(ev, std::chrono::milliseconds(60000))) {
        o.text += ev.text;
        for (const auto &t : ev.tokens) {
            o.ids.push_back(t.id);
            o.lp.push_back(t.logprob);
            for (const auto &a : t.top) o.top_ids.push_back(a.token);
        }
        if (ev.final) {
            o.reason = static_cast<int>(ev.reason);
            return o;
        }
    }
    ADD_FAILURE() << "timed out";
    return o;
}

// DeepSeek V4 on the CPU through the scheduler: three slots share every step (the engine's fused multi-row
// step), each decoding with the session's own MTP drafter, with n-gram drafts, or plainly: the same
// tokens and logprobs (bit for bit) as without speculation, greedy and sampled with the whole
// distribution in play.
TEST(SpecScheduler, DeepSeekV4SameTokensAndLogprobsWithItsDrafters) {
    const std::string target = ds4_test::golden_dir() + "/ds4-tiny-a.gguf", mtp = ds4_test::golden_dir() + "/ds4-tiny-a-mtp.gguf";
    const auto cases = ds4_test::load_cases("cases.jsonl");
    std::vector<sched::request> reqs;
    for (int i = 0; i < 4; ++i) {
        sched::request r;
        r.prompt.assign(cases.at(static_cast<size_t>(1 + i % 2)).tokens.begin(), cases.at(static_cast<size_t>(1 + i % 2)).tokens.begin() + 40 + i);
        r.max_tokens = 60;
        r.sampling.temperature = i % 2 == 0 ? 0.0f : 0.9f;
        r.sampling.seed = 5;
        r.sampling.top_k = 0;
        r.sampling.top_p = 1.0f;
        r.sampling.min_p = 0.0f;
        r.sampling.n_logprobs = 3;
        r.want_logprobs = true;
        reqs.push_back(r);
    }
    std::vector<std::vector<sched_out>> got(3);
    for (int mode = 0; mode < 3; ++mode) {  // plain, MTP drafts, n-gram drafts
        engine_options eo;
        eo.model_path = target;
        eo.n_threads = 2;
        eo.n_ctx = 256;
        if (mode == 1) {
            eo.ds4_draft = "mtp";
            eo.ds4_draft_model = mtp;
        }
        auto e = engine::load(eo);
        sched::scheduler_options o;
        o.n_slots = 3;
        o.spec = mode > 0;
        o.spec_session_drafter = mode == 1;
        o.spec_ngram.adaptive = false;  // every step drafts (and rolls back what is rejected)
        o.spec_ngram.draft_max = 4;
        o.spec_ngram.ngram_min = 1;
        sched::scheduler s(*e, o);
        std::vector<std::shared_ptr<sched::job>> jobs;
        for (const auto &r : reqs) jobs.push_back(s.submit(r));
        for (auto &j : jobs) got[static_cast<size_t>(mode)].push_back(drain(*j));
        if (mode > 0) {
            EXPECT_GT(s.stats().spec_drafted, 50u) << "mode " << mode;
        }
        EXPECT_EQ(s.stats().spec_draft_failures, 0u);
    }
    for (int mode = 1; mode < 3; ++mode)
        for (size_t i = 0; i < reqs.size(); ++i) {
            EXPECT_TRUE(got[0][i] == got[static_cast<size_t>(mode)][i]) << "mode " << mode << " request " << i;
            EXPECT_EQ(got[0][i].ids.size(), 60u);
        }
}

// Batch invariance of DeepSeek V4 on the CPU through the scheduler: a request's tokens and logprobs are
// bit-identical whether it runs alone or beside five others in the same multi-row steps (prompt chunks
// of the others arriving while it decodes included).
TEST(SpecScheduler, DeepSeekV4RequestAloneOrBesideOthers) {
    const auto cases = ds4_test::load_cases("cases.jsonl");
    auto request = [&](size_t i) {
        sched::request r;
        const auto &t = cases.at(1 + i % 3).tokens;
        r.prompt.assign(t.begin(), t.begin() + static_cast<std::ptrdiff_t>(std::min<size_t>(t.size(), 30 + 9 * i)));
        r.max_tokens = 40;
        r.sampling.temperature = i % 2 == 0 ? 0.0f : 0.8f;
        r.sampling.seed = 17 + i;
        r.sampling.n_logprobs = 2;
        r.want_logprobs = true;
        return r;
    };
    engine_options eo;
    eo.model_path = ds4_test::golden_dir() + "/ds4-tiny-a.gguf";
    eo.n_threads = 2;
    eo.n_ctx = 256;
    eo.n_batch = 16;  // prompts arrive in several chunks, beside the others' decodes
    auto e = engine::load(eo);
    std::vector<sched_out> alone;
    for (size_t i = 0; i < 6; ++i) {
        sched::scheduler_options o;
        o.n_slots = 1;
        sched::scheduler s(*e, o);
        auto j = s.submit(request(i));
        alone.push_back(drain(*j));
    }
    sched::scheduler_options o;
    o.n_slots = 6;
    o.prefill_chunk = 16;
    o.step_token_budget = 24;
    sched::scheduler s(*e, o);
    std::vector<std::shared_ptr<sched::job>> jobs;
    for (size_t i = 0; i < 6; ++i) jobs.push_back(s.submit(request(i)));
    size_t total = 0;
    for (size_t i = 0; i < 6; ++i) {
        const sched_out together = drain(*jobs[i]);
        EXPECT_TRUE(together == alone[i]) << "request " << i;
        EXPECT_FALSE(together.ids.empty());
        total += together.ids.size();
    }
    EXPECT_GT(total, 150u);  // (a request may end early at the end-of-sequence token)
}

TEST(SpecScheduler, SameTokensTextAndLogprobsAsPlainDecoding) {
    if (!exists(kSmol)) {
        GTEST_SKIP() << kSmol << " not installed";
    }
    std::vector<sched::request> reqs;
    for (int prompt = 0; prompt < 2; ++prompt)  // kRepeat, kCode (set per engine below)
        for (int mode = 0; mode < 2; ++mode) {
            sched::request r;
            r.max_tokens = 90;
            r.sampling.temperature = mode == 0 ? 0.0f : 0.9f;
            r.sampling.seed = 11;
            r.sampling.top_k = 0;
            r.sampling.top_p = 1.0f;
            r.sampling.min_p = 0.0f;
            r.sampling.repeat_penalty = 1.1f;
            r.sampling.n_logprobs = 3;
            r.want_logprobs = true;
            reqs.push_back(r);
        }
    std::vector<std::vector<sched_out>> got(2);
    uint64_t accepted = 0;
    for (int spec_on = 0; spec_on < 2; ++spec_on) {
        auto e = load(kSmol);
        const auto p0 = chat_prompt(*e, kRepeat), p1 = chat_prompt(*e, kCode);
        for (size_t i = 0; i < reqs.size(); ++i) reqs[i].prompt = i < 2 ? p0 : p1;
        sched::scheduler_options o;
        o.n_slots = 2;
        o.spec = spec_on == 1;
        o.spec_ngram.row_cost = 0;  // deterministic widths: acceptance must be exercised whatever the box's timing
        sched::scheduler s(*e, o);
        std::vector<std::shared_ptr<sched::job>> jobs;
        for (const auto &r : reqs) jobs.push_back(s.submit(r));  // two at a time share the steps
        for (auto &j : jobs) got[static_cast<size_t>(spec_on)].push_back(drain(*j));
        accepted = s.stats().spec_accepted;
    }
    for (size_t i = 0; i < reqs.size(); ++i) {
        EXPECT_TRUE(got[0][i] == got[1][i]) << "request " << i << ": '" << got[0][i].text << "' vs '" << got[1][i].text << "'";
        EXPECT_FALSE(got[0][i].ids.empty());
    }
    EXPECT_GT(accepted, 10u);
}

}  // namespace

namespace {

// Draft-model speculation (spec::model_drafter): the target's plain output whatever the drafter; the same
// model as its own drafter keeps nearly every draft, another model (same tokenizer, other weights) few;
// a drafter with another vocabulary is refused.
TEST(SpecDraftModel, SameTokensAsPlainDecodingWithAnyDraftModel) {
    auto target = load(tiny_qwen(), 256);
    const std::vector<int32_t> prompt = target->tokenize("one two three one two three four", true, false);
    for (uint64_t draft_seed : {5u, 6u}) {
        auto draft = load(synth_qwen(draft_seed), 256);
        spec::model_drafter d(*draft, *target);
        for (const sampling_params &p : {greedy(), sampled(9)}) {
            const outcome want = plain(*target, prompt, p, 50);
            const outcome got = with_drafter(*target, prompt, p, 50, 6, true,
                                             [&d](std::span<const int32_t> h, int32_t max) { return d(h, max); });
            const std::string what =
                "draft seed " + std::to_string(draft_seed) + (p.temperature == 0 ? ", greedy" : ", sampled");
            expect_same(want, got, what);
            if (draft_seed == 5 && p.temperature == 0) {
                EXPECT_GT(got.st.accepted, 40) << what;  // its own drafts: kept
            }
        }
    }
}

TEST(SpecDraftModel, AnotherVocabularyIsRefused) {
    if (!exists(kSmol)) {
        GTEST_SKIP() << kSmol << " not installed";
    }
    auto target = load(tiny_qwen(), 256);
    auto draft = load(kSmol, 256);
    try {
        spec::model_drafter d(*draft, *target);
        ADD_FAILURE() << "accepted";
    } catch (const error &e) {
        EXPECT_NE(std::string(e.what()).find("needs the same tokenizer"), std::string::npos) << e.what();
    }
}

}  // namespace
