// engine::decode_step of the dense engine (one fused forward over all sessions: dense_forward over
// a batch, src/models/dense_forward.cpp) against the single-session path: after every step, each
// session's logits must be bit-identical to those a separate session gets from session::eval of
// the same token after the same prefix, whatever the batch size and composition (the server's
// greedy output must not depend on what else is running). The single-session path is checked
// against llama.cpp goldens in tests/models. Real models; skipped when not installed.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "fathom/engine.h"

using namespace fathom;

namespace {

const std::string kSmol = std::string(FATHOM_SOURCE_DIR) + "/models/SmolLM2-135M-Instruct.Q4_1.gguf";
const std::string kGemma = std::string(FATHOM_SOURCE_DIR) + "/models/gemma-3-270m-q4_k_m.gguf";

std::unique_ptr<engine> load(const std::string &path, int n_ctx) {
    engine_options o;
    o.model_path = path;
    o.n_ctx = n_ctx;
    o.n_batch = 64;
    return engine::load(o);
}

int32_t argmax(std::span<const float> l) {
    return int32_t(std::max_element(l.begin(), l.end()) - l.begin());
}

// Prompts of different lengths, so the sequences sit at different positions in one step.
std::vector<std::vector<int32_t>> prompts(const engine &e, size_t n) {
    static const char *texts[] = {
        "The capital of France is",
        "Once upon a time, in a small village by the sea, there lived an old fisherman who",
        "1, 2, 3, 4,",
        "def fibonacci(n):",
        "Water boils at",
        "The quick brown fox jumps over the lazy dog. The quick brown fox",
        "In 1969, astronauts",
        "Q: What is the largest planet? A:",
        "Roses are red,",
        "Translate to French: good morning ->",
        "A list of fruits: apple, banana,",
        "The theory of relativity states that",
        "Hello",
        "SELECT * FROM users WHERE",
        "Dear Sir or Madam, I am writing to",
        "The mitochondria is the",
        "x",
    };
    std::vector<std::vector<int32_t>> out;
    for (size_t i = 0; i < n; ++i) out.push_back(e.tokenize(texts[i % std::size(texts)], true, false));
    return out;
}

// Runs `steps` batched steps over `batch` sessions (greedy continuation) and checks every session's
// logits against a single-session reference fed the same tokens.
void check_batched_equals_single(engine &e, size_t batch, int steps) {
    const auto ps = prompts(e, batch);
    std::vector<std::unique_ptr<session>> bat, ref;
    for (const auto &p : ps) {
        bat.push_back(e.new_session());
        ref.push_back(e.new_session());
        bat.back()->sync(p);
        ref.back()->sync(p);
    }
    std::vector<int32_t> next(batch);
    for (size_t i = 0; i < batch; ++i) next[i] = argmax(bat[i]->logits());
    const size_t n_vocab = size_t(e.info().n_vocab);
    for (int step = 0; step < steps; ++step) {
        // Vary the composition: from the second step on, leave one session out in turn.
        std::vector<session *> ss;
        std::vector<int32_t> toks;
        std::vector<size_t> idx;
        for (size_t i = 0; i < batch; ++i) {
            if (batch > 2 && step > 0 && i == size_t(step) % batch) continue;
            ss.push_back(bat[i].get());
            toks.push_back(next[i]);
            idx.push_back(i);
        }
        e.decode_step(ss, toks);
        for (size_t j = 0; j < idx.size(); ++j) {
            const size_t i = idx[j];
            ref[i]->eval(std::span<const int32_t>(&next[i], 1));
            ASSERT_EQ(bat[i]->n_past(), ref[i]->n_past());
            ASSERT_EQ(bat[i]->tokens(), ref[i]->tokens());
            const auto lb = bat[i]->logits(), lr = ref[i]->logits();
            ASSERT_EQ(lb.size(), n_vocab);
            ASSERT_EQ(lr.size(), n_vocab);
            size_t n_diff = 0;
            float max_diff = 0;
            for (size_t t = 0; t < n_vocab; ++t)
                if (std::memcmp(&lb[t], &lr[t], sizeof(float)) != 0) {
                    ++n_diff;
                    max_diff = std::max(max_diff, std::abs(lb[t] - lr[t]));
                }
            EXPECT_EQ(n_diff, 0u) << "batch " << batch << " step " << step << " session " << i << " (row " << j
                                  << " of " << idx.size() << ", position " << bat[i]->n_past() - 1 << "): " << n_diff
                                  << " logits differ (max |diff| " << max_diff << ")";
            next[i] = argmax(lr);  // the reference decides the continuation
        }
    }
}

}  // namespace

TEST(BatchDecode, SmolLM2BitIdenticalToSingleSession) {
    if (!std::filesystem::exists(kSmol)) GTEST_SKIP() << "SmolLM2 not installed";
    auto e = load(kSmol, 256);
    for (size_t b : {1u, 5u, 16u}) check_batched_equals_single(*e, b, 3);
}

TEST(BatchDecode, Gemma3BitIdenticalToSingleSession) {
    // Sliding-window layers, q/k norms, post-norms, embedding scale and k-quant weights.
    if (!std::filesystem::exists(kGemma)) GTEST_SKIP() << "gemma3 not installed";
    auto e = load(kGemma, 256);
    check_batched_equals_single(*e, 6, 3);
}

TEST(BatchDecode, Validation) {
    if (!std::filesystem::exists(kSmol)) GTEST_SKIP() << "SmolLM2 not installed";
    auto e = load(kSmol, 8);
    auto a = e->new_session(), b = e->new_session();
    a->sync(std::vector<int32_t>{1, 2, 3});
    b->sync(std::vector<int32_t>{1, 2});
    session *two[] = {a.get(), b.get()};
    const int32_t one_tok[] = {5};
    EXPECT_THROW(e->decode_step(two, one_tok), error);  // size mismatch
    session *dup[] = {a.get(), a.get()};
    const int32_t toks[] = {5, 6};
    EXPECT_THROW(e->decode_step(dup, toks), error);  // one session twice
    const int32_t bad[] = {5, int32_t(e->info().n_vocab)};
    EXPECT_THROW(e->decode_step(two, bad), error);  // token outside the vocabulary
    EXPECT_EQ(a->n_past(), 3);  // failed steps leave the timelines untouched
    EXPECT_EQ(b->n_past(), 2);
    auto other = load(kSmol, 8);
    auto foreign = other->new_session();
    foreign->sync(std::vector<int32_t>{1});
    session *mixed[] = {a.get(), foreign.get()};
    EXPECT_THROW(e->decode_step(mixed, toks), error);  // session of another engine
    // Context full: a holds 3 of 8; five steps fill it, the sixth must throw.
    for (int i = 0; i < 5; ++i) {
        session *one[] = {a.get()};
        const int32_t t[] = {7};
        e->decode_step(one, t);
    }
    EXPECT_EQ(a->n_past(), 8);
    session *one[] = {a.get()};
    const int32_t t[] = {7};
    EXPECT_THROW(e->decode_step(one, t), error);
}

// ---- engine::sync_step: prompt chunks of several sessions and running decodes in one forward ----

namespace {

std::vector<int32_t> synth_prompt(size_t n, int salt) {
    std::vector<int32_t> p;
    for (size_t i = 0; i < n; ++i) p.push_back(int32_t(300 + (i * 53 + size_t(salt) * 17) % 4000));
    return p;
}

// Logits of `prefix` from a fresh single session (the reference path: session::sync).
std::vector<float> reference_logits(engine &e, std::span<const int32_t> prefix) {
    auto s = e.new_session();
    s->sync(prefix);
    return std::vector<float>(s->logits().begin(), s->logits().end());
}

void expect_same_bits(std::span<const float> got, const std::vector<float> &want, const std::string &what) {
    ASSERT_EQ(got.size(), want.size()) << what;
    size_t n_diff = 0;
    for (size_t t = 0; t < want.size(); ++t) n_diff += std::memcmp(&got[t], &want[t], sizeof(float)) != 0;
    EXPECT_EQ(n_diff, 0u) << what << ": " << n_diff << " logits differ from the single-session path";
}

// One sync_step mixing: decodes of sessions at different positions, whole prompts of different
// lengths (one longer than n_batch = 64, so it needs several pieces and forwards), an intermediate
// chunk without logits, a prefix diverging from what the session holds, a prefix the session holds
// with more after it, one it holds exactly, and an empty prefix. Every session must end holding its
// prefix, with logits bit-identical to a fresh session synced to the same prefix.
void check_sync_step(engine &e) {
    const auto ps = prompts(e, 6);
    const size_t n_vocab = size_t(e.info().n_vocab);
    // Running decodes: four sessions past their prompts, each appending its greedy token.
    std::vector<std::unique_ptr<session>> dec;
    std::vector<std::vector<int32_t>> dec_prefix;
    for (size_t i = 0; i < 4; ++i) {
        dec.push_back(e.new_session());
        dec.back()->sync(ps[i]);
        dec_prefix.push_back(ps[i]);
        dec_prefix.back().push_back(argmax(dec.back()->logits()));
    }
    const std::vector<int32_t> long_p = synth_prompt(150, 1), mid_p = synth_prompt(50, 2), div_p = synth_prompt(40, 3);
    auto s_long = e.new_session(), s_short = e.new_session(), s_chunk = e.new_session(), s_div = e.new_session(),
         s_more = e.new_session(), s_same = e.new_session(), s_empty = e.new_session();
    std::vector<int32_t> div_held(div_p.begin(), div_p.begin() + 30);  // then 10 other tokens
    for (int i = 0; i < 10; ++i) div_held.push_back(4000 + i);
    s_div->sync(div_held);
    std::vector<int32_t> more_held = ps[5];
    more_held.push_back(11);
    more_held.push_back(12);
    s_more->sync(more_held);
    s_same->sync(ps[4]);
    s_empty->sync(ps[3]);
    const std::span<const int32_t> chunk(mid_p.data(), 20);

    std::vector<sync_item> items = {
        {dec[0].get(), dec_prefix[0], true}, {s_long.get(), long_p, true},  {s_chunk.get(), chunk, false},
        {dec[1].get(), dec_prefix[1], true}, {s_short.get(), ps[2], true},  {s_div.get(), div_p, true},
        {dec[2].get(), dec_prefix[2], true}, {s_more.get(), ps[5], true},   {s_same.get(), ps[4], true},
        {dec[3].get(), dec_prefix[3], true}, {s_empty.get(), std::span<const int32_t>(), true},
    };
    e.sync_step(items);
    for (size_t i = 0; i < items.size(); ++i) {
        const sync_item &it = items[i];
        EXPECT_TRUE(std::equal(it.sess->tokens().begin(), it.sess->tokens().end(), it.prefix.begin(), it.prefix.end()))
            << "item " << i << " holds other tokens than its prefix";
        if (it.prefix.empty()) {
            EXPECT_EQ(it.sess->n_past(), 0);
        } else if (it.want_logits) {
            ASSERT_EQ(it.sess->logits().size(), n_vocab);
            expect_same_bits(it.sess->logits(), reference_logits(e, it.prefix), "item " + std::to_string(i));
        } else {
            EXPECT_TRUE(it.sess->logits().empty()) << "intermediate chunk: no logits computed";
        }
    }
    // Step 2: the chunked prompt's final chunk with the decodes' next tokens.
    std::vector<sync_item> items2;
    for (size_t i = 0; i < 4; ++i) {
        dec_prefix[i].push_back(argmax(dec[i]->logits()));
        items2.push_back({dec[i].get(), dec_prefix[i], true});
    }
    items2.insert(items2.begin() + 2, sync_item{s_chunk.get(), mid_p, true});
    e.sync_step(items2);
    for (size_t i = 0; i < items2.size(); ++i) {
        ASSERT_EQ(items2[i].sess->n_past(), int64_t(items2[i].prefix.size()));
        expect_same_bits(items2[i].sess->logits(), reference_logits(e, items2[i].prefix), "step 2 item " + std::to_string(i));
    }
}

}  // namespace

TEST(BatchDecode, SyncStepSmolLM2PromptsAndDecodesBitIdenticalToSingleSession) {
    if (!std::filesystem::exists(kSmol)) GTEST_SKIP() << "SmolLM2 not installed";
    auto e = load(kSmol, 256);
    check_sync_step(*e);
}

TEST(BatchDecode, SyncStepGemma3PromptsAndDecodesBitIdenticalToSingleSession) {
    if (!std::filesystem::exists(kGemma)) GTEST_SKIP() << "gemma3 not installed";
    auto e = load(kGemma, 256);
    check_sync_step(*e);
}

TEST(BatchDecode, SyncStepValidationLeavesSessionsUntouched) {
    if (!std::filesystem::exists(kSmol)) GTEST_SKIP() << "SmolLM2 not installed";
    auto e = load(kSmol, 16);
    auto a = e->new_session(), b = e->new_session();
    const std::vector<int32_t> pa = {1, 2, 3}, pb = {4, 5};
    a->sync(pa);
    b->sync(pb);
    const std::vector<int32_t> a_next = {1, 2, 3, 9}, b_next = {4, 5, 9};
    const std::vector<int32_t> bad_tok = {4, 5, int32_t(e->info().n_vocab)}, too_long(17, 7);
    auto other = load(kSmol, 16);
    auto foreign = other->new_session();
    const std::vector<std::vector<sync_item>> bad = {
        {{a.get(), a_next, true}, {a.get(), a_next, true}},        // one session twice
        {{a.get(), a_next, true}, {b.get(), bad_tok, true}},       // token outside the vocabulary
        {{a.get(), a_next, true}, {b.get(), too_long, true}},      // beyond n_ctx
        {{a.get(), a_next, true}, {foreign.get(), b_next, true}},  // another engine's session
        {{a.get(), a_next, true}, {nullptr, b_next, true}},        // no session
    };
    for (const auto &items : bad) {
        EXPECT_THROW(e->sync_step(items), error);
        EXPECT_EQ(a->tokens(), pa);
        EXPECT_EQ(b->tokens(), pb);
    }
    std::vector<sync_item> ok = {{a.get(), a_next, true}, {b.get(), b_next, true}};
    e->sync_step(ok);
    EXPECT_EQ(a->tokens(), a_next);
    EXPECT_EQ(b->tokens(), b_next);
}
