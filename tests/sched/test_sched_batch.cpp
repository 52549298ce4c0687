// The scheduler over the dense CPU engine (real SmolLM2; skipped without it): prompts of different
// lengths are prefilled together with running decodes in shared forward passes (engine::sync_step),
// under a small chunk and token budget so prompts also split over steps and rounds, and every
// request's greedy output must equal a plain session's greedy loop on a separate engine (batch
// invariance: the output does not depend on what else is in the batch).
#include <gtest/gtest.h>

#include <chrono>

#include "sched/scheduler.h"
#include "sched/smol_util.h"

namespace fathom {
namespace {

using namespace std::chrono_literals;
using test::greedy_alone;
using test::load_smol;
using test::prompt_of;

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
        std::vector<int32_t> got;
        const sched::event fin = test::run_to_end(*jobs[i], got, 120000ms);
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
