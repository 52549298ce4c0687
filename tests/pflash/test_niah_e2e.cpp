// Slow end-to-end gate (ctest label "slow", see tests.cmake; disabled in the default run): target
// Gemma3-270M, drafter SmolLM2-135M, 4K- and 8K-token haystacks with 5 needles. Retrieval accuracy
// with PFlash at keep 0.2 must be within 10 points of full prefill. Both accuracies and TTFTs are printed.
// Gemma3-270M is a small base model: absolute accuracy can be low; the gate is the difference.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>

#include "fathom/engine.h"
#include "fathom/pflash.h"
#include "pflash/niah.h"

namespace fathom::pflash {
namespace {

const std::string k_target = FATHOM_SOURCE_DIR "/models/gemma-3-270m-q4_k_m.gguf";
const std::string k_drafter = FATHOM_SOURCE_DIR "/models/SmolLM2-135M-Instruct.Q4_1.gguf";

struct answer_t {
    int32_t correct = 0;
    double ttft_s = 0;
};

answer_t greedy_answer(engine &eng, const std::vector<int32_t> &prompt, const niah_case &c) {
    auto sess = eng.new_session();
    const auto t0 = std::chrono::steady_clock::now();
    sess->sync(prompt);
    answer_t a;
    a.ttft_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::vector<int32_t> out;
    std::string text;
    for (int i = 0; i < 64; ++i) {
        const auto lg = sess->logits();
        const int32_t tok = static_cast<int32_t>(std::max_element(lg.begin(), lg.end()) - lg.begin());
        if (eng.is_end_of_generation(tok)) break;
        out.push_back(tok);
        text = eng.detokenize(out);
        if (std::count(text.begin(), text.end(), '\n') >= static_cast<long>(c.needles.size())) break;
        sess->eval(std::span<const int32_t>(&tok, 1));
    }
    a.correct = niah_score(c, text);
    return a;
}

// Runs `trials` haystacks of about n_tokens target tokens (seeds 100, 101, ...) with full prefill and
// with PFlash keep 0.2; expects PFlash's accuracy within 10 points of full prefill's.
void niah_gate(int64_t n_tokens, int trials) {
    engine_options eo;
    eo.model_path = k_target;
    eo.n_ctx = static_cast<int>(n_tokens + 512);
    auto eng = engine::load(eo);
    options po;
    po.drafter_path = k_drafter;
    po.keep_ratio = 0.2;
    po.residency = drafter_residency::keep;
    po.verbatim_last_user = false;
    auto comp = compressor::create(po);
    int32_t full_ok = 0, pf_ok = 0, total = 0;
    double full_ttft = 0, pf_ttft = 0;
    int64_t n_eff = 0, n_orig = 0;
    for (int t = 0; t < trials; ++t) {
        niah_options no;
        no.n_tokens = n_tokens;
        no.n_needles = 5;
        no.seed = 100 + static_cast<uint64_t>(t);
        const niah_case c =
            niah_generate(no, [&](std::string_view s) { return static_cast<int64_t>(eng->tokenize(s, false, false).size()); });
        const std::vector<int32_t> full = eng->tokenize(c.prompt, true, false);
        const answer_t f = greedy_answer(*eng, full, c);
        const result r = comp->compress(*eng, full);
        const answer_t p = greedy_answer(*eng, r.tokens, c);
        std::printf("trial %d: %zu tokens, full %d/5 (ttft %.2f s), pflash %lld tokens %d/5 (ttft %.2f s = score %.2f + prefill %.2f)\n",
                    t, full.size(), f.correct, f.ttft_s, static_cast<long long>(r.n_effective), p.correct, r.total_s + p.ttft_s,
                    r.score_s, p.ttft_s);
        full_ok += f.correct, pf_ok += p.correct, total += static_cast<int32_t>(c.needles.size());
        full_ttft += f.ttft_s, pf_ttft += r.total_s + p.ttft_s;
        n_eff += r.n_effective, n_orig += static_cast<int64_t>(full.size());
    }
    const double acc_full = 100.0 * full_ok / total, acc_pf = 100.0 * pf_ok / total;
    std::printf("full prefill: %.1f%% (mean TTFT %.2f s, %lld tokens) | pflash 0.2: %.1f%% (mean TTFT %.2f s, %lld tokens)\n",
                acc_full, full_ttft / trials, static_cast<long long>(n_orig / trials), acc_pf, pf_ttft / trials,
                static_cast<long long>(n_eff / trials));
    ::testing::Test::RecordProperty("acc_full_" + std::to_string(n_tokens), std::to_string(acc_full));
    ::testing::Test::RecordProperty("acc_pflash_" + std::to_string(n_tokens), std::to_string(acc_pf));
    EXPECT_GE(acc_pf, acc_full - 10.0);
}

TEST(pflash_niah_e2e, DISABLED_keep_0_2_within_10_points_of_full) {
    if (!std::filesystem::exists(k_target) || !std::filesystem::exists(k_drafter)) GTEST_SKIP() << "models missing";
    niah_gate(4096, 3);
}

TEST(pflash_niah_e2e, DISABLED_keep_0_2_within_10_points_of_full_8k) {
    if (!std::filesystem::exists(k_target) || !std::filesystem::exists(k_drafter)) GTEST_SKIP() << "models missing";
    niah_gate(8192, 2);
}

}  // namespace
}  // namespace fathom::pflash
