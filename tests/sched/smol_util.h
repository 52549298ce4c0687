// Helpers for the scheduler tests over the real dense CPU engine (SmolLM2-135M Q4_1; the tests skip
// when models/ does not have it), shared by tests/sched/test_sched_batch.cpp and
// tests/kv/test_kv_sched.cpp: loading the model, reproducible prompts, the reference greedy loop on a
// plain session, and draining a scheduler job.
#pragma once
#include <gtest/gtest.h>

#include <chrono>
#include <filesystem>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "fathom/engine.h"
#include "fathom/sampling.h"
#include "sched/scheduler.h"

namespace fathom::test {

// SmolLM2 on 2 threads, 256 positions, n_batch 64; nullptr when the file is not installed.
inline std::unique_ptr<engine> load_smol() {
    const std::string p = std::string(FATHOM_SOURCE_DIR) + "/models/SmolLM2-135M-Instruct.Q4_1.gguf";
    if (!std::filesystem::exists(p)) return nullptr;
    engine_options o;
    o.model_path = p;
    o.n_threads = 2;
    o.n_ctx = 256;
    o.n_batch = 64;
    return engine::load(o);
}

// n token ids of a fixed pattern in [300, 4300) (ordinary text tokens); `salt` gives another prompt.
inline std::vector<int32_t> prompt_of(size_t n, int salt) {
    std::vector<int32_t> p;
    for (size_t i = 0; i < n; ++i) p.push_back(int32_t(300 + (i * 53 + size_t(salt) * 17) % 4000));
    return p;
}

// The reference: greedy generation of up to max_tokens on a fresh session of `e`, stopping before an
// end-of-generation token (what the scheduler streams for a temperature-0 request).
inline std::vector<int32_t> greedy_alone(engine &e, const std::vector<int32_t> &prompt, int max_tokens) {
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

// Appends the tokens of job j's events to `tokens` until its final event, which it returns; waits at
// most `timeout` for each event (a test failure and the last event received when one does not come).
inline sched::event run_to_end(sched::job &j, std::vector<int32_t> &tokens, std::chrono::milliseconds timeout) {
    sched::event ev;
    for (;;) {
        if (!j.next(ev, timeout)) {
            ADD_FAILURE() << "timed out";
            return ev;
        }
        for (const auto &t : ev.tokens) tokens.push_back(t.id);
        if (ev.final) return ev;
    }
}

}  // namespace fathom::test
