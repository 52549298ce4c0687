// engine::decode_step of the dense engine (one fused forward over all sessions, src/engine/
// batch_decode.cpp) against the single-session path: after every step, each session's logits
// must be bit-identical to those a separate session gets from session::eval of the same token
// after the same prefix, whatever the batch size and composition (the server's greedy output must
// not depend on what else is running). The single-session path is checked against llama.cpp
// goldens in tests/models. Real models; skipped when not installed.
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
