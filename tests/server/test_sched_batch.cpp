// The scheduler over the dense CPU engine (real SmolLM2; skipped without it): prompts of different
// lengths are prefilled together with running decodes in shared forward passes (engine::sync_step),
// under a small chunk and token budget so prompts also split over steps and rounds, and every
// request's greedy output must equal a plain session's greedy loop on a separate engine (batch
// invariance: the output does not depend on what else is in the batch).
#include <gtest/gtest.h>

#include <chrono>
#include <filesystem>

#include "fathom/engine.h"
#include "fathom/sampling.h"
#include "sched/scheduler.h"

namespace fathom {
namespace {

using namespace std::chrono_literals;

std::unique_ptr<engine> load_smol() {
    const std::string p = std::string(FATHOM_SOURCE_DIR) + "/models/SmolLM2-135M-Instruct.Q4_1.gguf";
    if (!std::filesystem::exists(p)) return nullptr;
    engine_options o;
    o.model_path = p;
    o.n_threads = 2;
    o.n_ctx = 256;
    o.n_batch = 64;
    return engine::load(o);
}

std::vector<int32_t> prompt_of(size_t n, int salt) {
    std::vector<int32_t> p;
    for (size_t i = 0; i < n; ++i) p.push_back(int32_t(300 + (i * 53 + size_t(salt) * 17) % 4000));
    return p;
}

std::vector<int32_t> greedy_alone(engine &e, const std::vector<int32_t> &prompt, int max_tokens) {
    auto sess = e.new_session();
    sampling_params sp;
    sp.temperature = 0.0f;
    sampler smp(sp);
    std::vector<int32_t> hist = prompt, out;
    sess->sync(prompt);
    for (int i = 0; i < max_tokens; ++i) {
        const int32_t t = smp.sample(sess->logits(), hist).token;
        if (e.is_end_of_generation(t)) break;
        out.push_back(t);
        hist.push_back(t);
        if (i + 1 < max_tokens) sess->eval(std::span<const int32_t>(&t, 1));
    }
    return out;
}

std::vector<int32_t> tokens_until_final(sched::job &j, sched::event &final) {
    std::vector<int32_t> out;
    for (;;) {
        if (!j.next(final, 120000ms)) {
            ADD_FAILURE() << "timed out";
            return out;
        }
        for (const auto &t : final.tokens) out.push_back(t.id);
        if (final.final) return out;
    }
}

// (suite BatchDecode: scripts/asan_server.sh skips the real-model tests; its load test covers the path)
TEST(BatchDecode, SchedulerPromptsWithRunningDecodesMatchAlone) {
    auto eng = load_smol();
    if (!eng) GTEST_SKIP() << "models/SmolLM2-135M-Instruct.Q4_1.gguf not installed";
    auto ref = load_smol();
    sched::scheduler_options o;
    o.n_slots = 6;
    o.prefill_chunk = 16;
    o.step_token_budget = 40;
    sched::scheduler s(*eng, o);
    const size_t lens[] = {10, 37, 70, 5, 33, 90};
    const int max_tokens = 12;
    std::vector<std::vector<int32_t>> ps;
    for (size_t i = 0; i < std::size(lens); ++i) ps.push_back(prompt_of(lens[i], int(i) + 1));
    auto submit = [&](size_t i) {
        sched::request r;
        r.prompt = ps[i];
        r.sampling.temperature = 0.0f;
        r.max_tokens = max_tokens;
        return s.submit(r);
    };
    // Three requests, then (once the first streams, i.e. decodes) three more of other lengths.
    std::vector<std::shared_ptr<sched::job>> jobs;
    for (size_t i = 0; i < 3; ++i) jobs.push_back(submit(i));
    sched::event first;
    ASSERT_TRUE(jobs[0]->next(first, 120000ms));
    for (size_t i = 3; i < 6; ++i) jobs.push_back(submit(i));
    uint64_t prompt_tokens = 0;
    for (size_t i = 0; i < jobs.size(); ++i) {
        sched::event fin;
        std::vector<int32_t> got = tokens_until_final(*jobs[i], fin);
        if (i == 0)
            for (auto it = first.tokens.rbegin(); it != first.tokens.rend(); ++it) got.insert(got.begin(), it->id);
        EXPECT_TRUE(fin.reason == sched::finish_reason::length || fin.reason == sched::finish_reason::eog)
            << sched::to_string(fin.reason) << " " << fin.error;
        EXPECT_EQ(got, greedy_alone(*ref, ps[i], max_tokens)) << "request " << i << " (prompt of " << lens[i] << ")";
        prompt_tokens += ps[i].size();
    }
    EXPECT_EQ(s.stats().prompt_tokens_evaluated, prompt_tokens);
    EXPECT_EQ(s.stats().requests_finished, jobs.size());
}

}  // namespace
}  // namespace fathom
