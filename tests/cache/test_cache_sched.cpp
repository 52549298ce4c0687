// The disk prompt cache through the scheduler on real engines: a request, a "restart" (a new engine and
// scheduler on the same cache directory), the same request again: its prompt comes from disk (reported
// as reused tokens) and the greedy output equals the first run's and a plain session's. A follow-up turn
// extending the first conversation reuses prompt + generated tokens. SmolLM2 (skipped when models/ lacks
// it) and ds4-tiny (whose sessions load whole states only, so the scheduler also saves the prompt alone).
#include <gtest/gtest.h>

#include <filesystem>

#include "cache_test_util.h"
#include "fathom/engine.h"
#include "sched/scheduler.h"
#include "engine/fake_engine.h"
#include "sched/smol_util.h"

namespace {

using namespace fathom;
using namespace std::chrono_literals;

std::unique_ptr<engine> load(const std::string &path, int n_ctx, int n_batch, int64_t checkpoint_mib = 4096) {
    engine_options o;
    o.ds4_checkpoint_mib = checkpoint_mib;
    o.model_path = path;
    o.n_threads = 2;
    o.n_ctx = n_ctx;
    o.n_batch = n_batch;
    o.kv = kv_precision::f32;
    o.ds4_qat = "off";
    return engine::load(o);
}

using test::greedy_alone;

struct run_result {
    std::vector<int32_t> tokens;
    sched::event final;
};

run_result run(sched::scheduler &s, const std::vector<int32_t> &prompt, int max_tokens) {
    sched::request r;
    r.prompt = prompt;
    r.sampling.temperature = 0.0f;
    r.max_tokens = max_tokens;
    auto j = s.submit(r);
    run_result out;
    for (;;) {
        sched::event ev;
        if (!j->next(ev, 120s)) {
            ADD_FAILURE() << "timed out";
            return out;
        }
        for (const auto &t : ev.tokens) out.tokens.push_back(t.id);
        if (ev.final) {
            out.final = ev;
            return out;
        }
    }
}

sched::scheduler_options sched_opts(const std::string &dir) {
    sched::scheduler_options o;
    o.n_slots = 2;
    o.prefill_chunk = 64;
    o.step_token_budget = 64;
    o.prompt_cache.dir = dir;
    o.prompt_cache.min_tokens = 16;
    return o;
}

std::vector<int32_t> prompt_tokens(size_t n, int salt, int32_t cap) {
    std::vector<int32_t> p;
    for (size_t i = 0; i < n; ++i)
        p.push_back(int32_t(300 % cap + (i * 53 + size_t(salt) * 17) % size_t(cap - 300 % cap)));
    return p;
}

// The restart scenario of the banner on the model at `path`.
void restart_scenario(const std::string &path, int32_t vocab_cap) {
    cache_test::temp_dir d;
    const std::vector<int32_t> prompt = prompt_tokens(150, 1, vocab_cap);
    const int max_tokens = 8;
    run_result first;
    {
        auto e = load(path, 512, 64);
        sched::scheduler s(*e, sched_opts(d.path));
        first = run(s, prompt, max_tokens);
        EXPECT_EQ(first.final.n_reused, 0);
        EXPECT_EQ(first.tokens, greedy_alone(*e, prompt, max_tokens));
        s.stop();  // drains the saves
        EXPECT_GE(s.stats().disk.saves, 1u);
        EXPECT_EQ(s.stats().disk_misses, 1u);
    }
    run_result again, next;
    std::vector<int32_t> turn2;
    {
        auto e = load(path, 512, 64);
        sched::scheduler s(*e, sched_opts(d.path));
        again = run(s, prompt, max_tokens);
        EXPECT_EQ(again.final.n_reused, int64_t(prompt.size()) - 1);
        EXPECT_EQ(again.tokens, first.tokens);
        EXPECT_EQ(s.stats().disk_hits, 1u);
        EXPECT_EQ(s.stats().disk_load_s.count, 1u);
        s.stop();
    }
    {
        // A follow-up turn: the first conversation (prompt + generated) plus new tokens, in a third
        // server. The entry holds the prompt and the generated tokens but the last (never evaluated).
        auto e = load(path, 512, 64);
        sched::scheduler s(*e, sched_opts(d.path));
        turn2 = prompt;
        turn2.insert(turn2.end(), first.tokens.begin(), first.tokens.end());
        const std::vector<int32_t> more = prompt_tokens(40, 2, vocab_cap);
        turn2.insert(turn2.end(), more.begin(), more.end());
        next = run(s, turn2, max_tokens);
        EXPECT_GE(next.final.n_reused, int64_t(prompt.size() + first.tokens.size()) - 1);
        EXPECT_EQ(next.tokens, greedy_alone(*e, turn2, max_tokens));
        EXPECT_EQ(s.stats().disk_hits, 1u);
    }
}

TEST(CacheSched, SmolLM2RestartReusesTheDiskEntry) {
    const std::string p = std::string(FATHOM_SOURCE_DIR) + "/models/SmolLM2-135M-Instruct.Q4_1.gguf";
    if (!std::filesystem::exists(p)) GTEST_SKIP() << p << " not installed";
    restart_scenario(p, 4000);
}

TEST(CacheSched, Ds4TinyRestartReusesTheSavedPrompt) {
    restart_scenario(std::string(FATHOM_SHARED_DIR) + "/golden/ds4-tiny/ds4-tiny-a.gguf", 500);
}

// A long DS4 prompt with prompt_cache.save_every = 64 (prefill chunks of 64): entries at 64, 128, 192
// and 256 tokens besides the prompt's and the request's. After a restart, a request sharing only the
// first 200 prompt tokens (an edited turn) loads the 192-token entry, a prefix of it, and evaluates the
// rest; without the periodic entries nothing on disk would be a prefix of it. The engines have no RAM
// checkpoints (ds4_checkpoint_mib 0): the tokens come from disk.
TEST(CacheSched, Ds4PeriodicEntriesServeAnEditedPromptAfterARestart) {
    cache_test::temp_dir d;
    const std::string path = std::string(FATHOM_SHARED_DIR) + "/golden/ds4-tiny/ds4-tiny-a.gguf";
    const std::vector<int32_t> prompt = prompt_tokens(300, 3, 500);
    sched::scheduler_options o = sched_opts(d.path);
    o.n_slots = 1;
    o.prompt_cache.save_every = 64;
    {
        auto e = load(path, 512, 64, 0);
        sched::scheduler s(*e, o);
        const run_result first = run(s, prompt, 4);
        EXPECT_EQ(first.tokens, greedy_alone(*e, prompt, 4));
        s.stop();
        EXPECT_EQ(s.stats().disk.saves, 6u);  // 64, 128, 192, 256, the prompt (300), prompt + reply
        EXPECT_EQ(d.files().size(), 6u);
    }
    std::vector<int32_t> edited(prompt.begin(), prompt.begin() + 200);
    const std::vector<int32_t> tail = prompt_tokens(30, 4, 500);
    edited.insert(edited.end(), tail.begin(), tail.end());
    auto e = load(path, 512, 64, 0);
    sched::scheduler s(*e, o);
    const run_result again = run(s, edited, 4);
    EXPECT_EQ(again.final.n_reused, 192);
    EXPECT_EQ(again.tokens, greedy_alone(*e, edited, 4));
    s.stop();
    EXPECT_EQ(s.stats().disk_hits, 1u);
}

// The scheduler on one CPU with RAM checkpoints: a regenerate after a 40-token reply (beyond the
// rollback reach) and an edited prompt give the greedy tokens of a fresh session.
TEST(CacheSched, Ds4RegenerateAndEditedPromptThroughCheckpoints) {
    const std::string path = std::string(FATHOM_SHARED_DIR) + "/golden/ds4-tiny/ds4-tiny-a.gguf";
    auto e = load(path, 512, 64, 64), ref = load(path, 512, 64, 0);
    sched::scheduler_options o;
    o.n_slots = 1;
    o.prefill_chunk = 64;
    o.step_token_budget = 64;
    sched::scheduler s(*e, o);
    const std::vector<int32_t> prompt = prompt_tokens(200, 5, 500);
    const run_result first = run(s, prompt, 40);
    EXPECT_EQ(first.tokens, greedy_alone(*ref, prompt, 40));
    const run_result again = run(s, prompt, 40);
    EXPECT_EQ(again.tokens, first.tokens);
    EXPECT_EQ(again.final.n_reused, 199);
    std::vector<int32_t> edited(prompt.begin(), prompt.begin() + 150);
    const std::vector<int32_t> tail = prompt_tokens(20, 6, 500);
    edited.insert(edited.end(), tail.begin(), tail.end());
    const run_result third = run(s, edited, 8);
    EXPECT_EQ(third.tokens, greedy_alone(*ref, edited, 8));
    s.stop();
}

// A cache directory that cannot be created fails the scheduler's construction (the server's start).
TEST(CacheSched, BadDirectoryFailsAtConstruction) {
    const std::string p = std::string(FATHOM_SHARED_DIR) + "/golden/ds4-tiny/ds4-tiny-a.gguf";
    auto e = load(p, 256, 64);
    sched::scheduler_options o = sched_opts("/proc/fathom-no-such-dir/cache");
    EXPECT_THROW(sched::scheduler(*e, o), error);
}

// A session whose load_state throws something other than fathom::error (std::bad_alloc: a large state
// on a machine short of memory). The I/O thread used to let it escape (std::terminate: the whole server
// gone) and the slot stayed io_busy; now the load is a miss, the slot's request evaluates its prompt
// and the entry, intact, stays on disk.
TEST(CacheSched, LoadThrowingAnyExceptionFallsBackToPrefill) {
    cache_test::temp_dir d;
    test::fake_engine eng(4096);
    sched::scheduler_options o = sched_opts(d.path);
    o.n_slots = 1;
    o.prompt_cache.min_tokens = 8;
    std::vector<int32_t> prompt(40, 'q');
    prompt[0] = test::k_bos;
    run_result first;
    {
        sched::scheduler s(eng, o);
        first = run(s, prompt, 3);
        s.stop();  // drains the save
        ASSERT_EQ(s.stats().disk.saves, 1u);
    }
    const auto entries = d.files();
    ASSERT_EQ(entries.size(), 1u);
    eng.load_throws = true;
    sched::scheduler s(eng, o);
    const run_result again = run(s, prompt, 3);
    EXPECT_EQ(again.final.reason, sched::finish_reason::length);
    EXPECT_EQ(again.tokens, first.tokens);
    EXPECT_EQ(again.final.n_reused, 0);
    EXPECT_EQ(eng.state_loads_tried.load(), 1);  // the disk entry was chosen, and its load failed
    s.stop();
    EXPECT_EQ(s.stats().disk_hits, 0u);
    EXPECT_EQ(s.stats().disk_misses, 1u);
    EXPECT_EQ(s.stats().disk.rejected, 0u);  // memory, not the file: it is kept
    EXPECT_EQ(d.files(), entries);
}

}  // namespace
