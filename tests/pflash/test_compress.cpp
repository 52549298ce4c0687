// PFlash end to end on small prompts with the real models (skipped when models/ lacks them): target
// Gemma3-270M (SPM vocab), drafter SmolLM2-135M (BPE vocab). Checks that the output is a subsequence
// of the original target tokens, that the scorer finds a needle the question asks about (anchors
// off, so only the attention scores can find it), residency and failed loads, and the score cache /
// drafter prefix reuse across calls.
#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>

#include "fathom/engine.h"
#include "fathom/pflash.h"

namespace fathom::pflash {
namespace {

const std::string k_target = FATHOM_SOURCE_DIR "/models/gemma-3-270m-q4_k_m.gguf";
const std::string k_drafter = FATHOM_SOURCE_DIR "/models/SmolLM2-135M-Instruct.Q4_1.gguf";

bool have_models() { return std::filesystem::exists(k_target) && std::filesystem::exists(k_drafter); }

engine &target() {
    static std::unique_ptr<engine> e = [] {
        engine_options o;
        o.model_path = k_target;
        o.n_threads = 2;
        return engine::load(o);
    }();
    return *e;
}

// ~350 target tokens of filler with one needle in the middle and a question at the end.
std::string needle_prompt() {
    static const char *fill[] = {"The harbor lights flickered over the quiet water. ",
                                 "Farmers carried baskets of apples to the busy market. ",
                                 "A narrow bridge connected the two halves of the old village. ",
                                 "Children read stories in the library until the evening bell. "};
    std::string s;
    for (int i = 0; i < 32; ++i) {
        s += fill[i % 4];
        if (i == 16) s += "The secret code for the blue door is 48213. ";
    }
    return s + "\nQuestion: what is the secret code for the blue door?\nAnswer:";
}

options base_opts() {
    options o;
    o.drafter_path = k_drafter;
    o.n_threads = 2;
    o.chunk_tokens = 16;
    o.verbatim_last_user = false;
    return o;
}

bool is_subsequence(const std::vector<int32_t> &sub, const std::vector<int32_t> &full, std::vector<size_t> &where) {
    size_t j = 0;
    for (int32_t t : sub) {
        while (j < full.size() && full[j] != t) ++j;
        if (j == full.size()) return false;
        where.push_back(j++);
    }
    return true;
}

TEST(pflash_compress, needle_found_by_scores_and_tokens_are_original) {
    if (!have_models()) GTEST_SKIP() << "models missing";
    const std::vector<int32_t> prompt = target().tokenize(needle_prompt(), true, false);
    options o = base_opts();
    o.keep_ratio = 0.3;  // ~22 chunks: budget 7, of which 3 are head/tail, 4 chosen by score
    o.anchor_ngram = 0;  // the scores alone must find the needle
    auto c = compressor::create(o);
    const result r = c->compress(target(), prompt);
    EXPECT_EQ(r.n_original, static_cast<int64_t>(prompt.size()));
    EXPECT_EQ(r.n_effective, static_cast<int64_t>(r.tokens.size()));
    EXPECT_LT(r.n_effective, r.n_original * 6 / 10);
    std::vector<size_t> where;
    ASSERT_TRUE(is_subsequence(r.tokens, prompt, where));
    EXPECT_EQ(where.front(), 0u);                   // BOS / head kept
    EXPECT_EQ(where.back(), prompt.size() - 1);     // tail kept
    const std::string kept = target().detokenize(r.tokens);
    EXPECT_NE(kept.find("48213"), std::string::npos) << kept;
    EXPECT_NE(kept.find("Question: what is the secret code"), std::string::npos);
}

// The prompt on which the old anchor rule over-fired (keep 0.2, 0.5 and 1.0 all kept ~75 %): a Gemma
// chat of ~700 target tokens with a numbered list ("entry 40".."entry 49": single-digit drafter
// tokens), a filler sentence repeated in every turn, role markers in every turn, and a last user
// question about one entry.
std::string chat_list_prompt() {
    static const char *val[] = {"amber", "basil", "cedar", "delta", "ember", "fable", "garnet", "harbor", "indigo", "juniper"};
    const std::string filler = "The weather stayed calm and the harbor lights were dim that evening. ";
    std::string s;
    for (int turn = 0; turn < 5; ++turn) {
        s += "<start_of_turn>user\nHere are more notes. " + filler;
        for (int k = 0; k < 2; ++k) {
            const int e = 40 + turn * 2 + k;
            s += "The value of entry " + std::to_string(e) + " is " + val[e - 40] + ". ";
            s += "Farmers carried baskets of apples number " + std::to_string(turn * 7 + k) + " to the market. " + filler;
        }
        s += "Children read stories in the library until the bell. A narrow bridge joined the two halves of the village.";
        s += "<end_of_turn>\n<start_of_turn>model\nNoted, thank you.<end_of_turn>\n";
    }
    return s + "<start_of_turn>user\nWhat is the value of entry 47?<end_of_turn>\n<start_of_turn>model\n";
}

TEST(pflash_compress, keep_ratio_bounds_anchors_on_repetitive_chat) {
    if (!have_models()) GTEST_SKIP() << "models missing";
    const std::vector<int32_t> prompt = target().tokenize(chat_list_prompt(), true, true);
    options o = base_opts();
    o.chunk_tokens = 32;
    o.verbatim_last_user = true;
    o.residency = drafter_residency::keep;
    auto c = compressor::create(o);
    int64_t prev = 0;
    for (double keep : {0.2, 0.5, 1.0}) {
        c->set_keep_ratio(keep);
        const result r = c->compress(target(), prompt);  // scores cached after the first call
        std::printf("keep %.1f: %lld of %zu tokens, %lld/%lld chunks (%lld forced, %lld anchor)\n", keep,
                    static_cast<long long>(r.n_effective), prompt.size(), static_cast<long long>(r.n_kept_chunks),
                    static_cast<long long>(r.n_chunks), static_cast<long long>(r.n_forced_chunks),
                    static_cast<long long>(r.n_anchor_chunks));
        EXPECT_GT(r.n_effective, prev) << "keep " << keep;
        if (keep < 1.0) {
            EXPECT_LE(r.n_effective, static_cast<int64_t>(static_cast<double>(prompt.size()) * (keep + 0.2))) << "keep " << keep;
        }
        prev = r.n_effective;
        const std::string kept = target().detokenize(r.tokens);
        EXPECT_NE(kept.find("entry 47 is harbor"), std::string::npos) << "keep " << keep << ": " << kept;
        EXPECT_NE(kept.find("What is the value of entry 47?"), std::string::npos);
        if (keep == 0.2) {
            EXPECT_GT(r.n_anchor_chunks, 0);
        }
    }
    EXPECT_EQ(prev, static_cast<int64_t>(prompt.size()));
}

TEST(pflash_compress, score_cache_and_prefix_reuse) {
    if (!have_models()) GTEST_SKIP() << "models missing";
    const std::vector<int32_t> prompt = target().tokenize(needle_prompt(), true, false);
    options o = base_opts();
    o.keep_ratio = 0.3;
    o.residency = drafter_residency::keep;
    auto c = compressor::create(o);
    EXPECT_TRUE(c->drafter_loaded());
    const result a = c->compress(target(), prompt);
    EXPECT_EQ(a.n_cached_chunks, 0);
    EXPECT_EQ(a.n_drafter_evaluated, a.n_drafter_tokens);
    EXPECT_EQ(static_cast<int64_t>(c->score_cache_size()), a.n_chunks);
    // Same prompt: every chunk from the cache, no drafter work, same selection.
    const result b = c->compress(target(), prompt);
    EXPECT_EQ(b.n_cached_chunks, b.n_chunks);
    EXPECT_EQ(b.n_drafter_evaluated, 0);
    EXPECT_EQ(b.tokens, a.tokens);
    // Next turn: only the new text is scored; the drafter re-evaluates only past the common prefix.
    std::vector<int32_t> longer = prompt;
    const std::vector<int32_t> more = target().tokenize(" 48213.\nQuestion: and what colour was the door?\nAnswer:", false, false);
    longer.insert(longer.end(), more.begin(), more.end());
    const result d = c->compress(target(), longer);
    EXPECT_GT(d.n_cached_chunks, d.n_chunks / 2);
    EXPECT_LT(d.n_cached_chunks, d.n_chunks);
    EXPECT_LT(d.n_drafter_evaluated, d.n_drafter_tokens / 4);
    c->clear_score_cache();
    EXPECT_EQ(c->score_cache_size(), 0u);
}

TEST(pflash_compress, residency_and_failed_loads) {
    if (!have_models()) GTEST_SKIP() << "models missing";
    const std::vector<int32_t> prompt = target().tokenize(needle_prompt(), true, false);
    options o = base_opts();
    o.residency = drafter_residency::release_after_use;
    auto c = compressor::create(o);
    EXPECT_FALSE(c->drafter_loaded());
    const result r = c->compress(target(), prompt);
    EXPECT_FALSE(c->drafter_loaded());
    EXPECT_GT(r.n_chunks, 0);
    o.residency = drafter_residency::auto_select;  // SmolLM2-135M is far below the 1 GiB threshold
    auto ca = compressor::create(o);
    ca->compress(target(), prompt);
    EXPECT_TRUE(ca->drafter_loaded());
    ca->release_drafter();
    EXPECT_FALSE(ca->drafter_loaded());

    // A GGUF with a llama vocabulary but no weights: the load fails part-way (after the file is
    // mapped and the backend built) and must leave nothing loaded.
    const std::string vocab_only = FATHOM_SHARED_DIR "/tokenizer-tests/ggml-vocab-llama-spm.gguf";
    if (std::filesystem::exists(vocab_only)) {
        options bad = base_opts();
        bad.drafter_path = vocab_only;
        bad.residency = drafter_residency::release_after_use;
        auto cb = compressor::create(bad);
        EXPECT_THROW(cb->compress(target(), prompt), fathom::error);
        EXPECT_FALSE(cb->drafter_loaded());
        bad.residency = drafter_residency::keep;
        EXPECT_THROW(compressor::create(bad), fathom::error);
    }
    options missing = base_opts();
    missing.drafter_path = "/nonexistent/drafter.gguf";
    missing.residency = drafter_residency::auto_select;
    auto cm = compressor::create(missing);
    EXPECT_THROW(cm->compress(target(), prompt), fathom::error);
    EXPECT_FALSE(cm->drafter_loaded());
}

TEST(pflash_compress, keep_all_and_short_prompts) {
    if (!have_models()) GTEST_SKIP() << "models missing";
    const std::vector<int32_t> prompt = target().tokenize(needle_prompt(), true, false);
    options o = base_opts();
    o.keep_ratio = 1.0;  // nothing to drop: no drafter work at all
    o.residency = drafter_residency::release_after_use;
    auto c = compressor::create(o);
    const result r = c->compress(target(), prompt);
    EXPECT_EQ(r.tokens, prompt);
    EXPECT_FALSE(c->drafter_loaded());
    c->set_keep_ratio(0.1);
    const std::vector<int32_t> tiny = target().tokenize("Hello there, a short prompt.", true, false);
    EXPECT_EQ(c->compress(target(), tiny).tokens, tiny);  // fewer chunks than head + tail
    EXPECT_THROW(c->compress(target(), std::vector<int32_t>{}), fathom::error);
}

}  // namespace
}  // namespace fathom::pflash
