// Scheduler with the fake engine: generation, stop/length/EOG endings, validation, queue limit,
// cancellation, FIFO admission, prefix reuse and concurrent jobs routed to the right channel.
#include <gtest/gtest.h>

#include "engine/fake_engine.h"
#include "sched/scheduler.h"

using namespace fathom;
using namespace fathom::sched;
using namespace std::chrono_literals;

namespace {

using test::chat_prompt;

request greedy(std::vector<int32_t> prompt, int32_t max_tokens = 100) {
    request r;
    r.prompt = std::move(prompt);
    r.sampling.temperature = 0.0f;
    r.max_tokens = max_tokens;
    return r;
}

struct collected {
    std::string text;
    event final;
    size_t n_events = 0;
};

collected collect(job &j) {
    collected c;
    event ev;
    for (;;) {
        if (!j.next(ev, 5000ms)) {
            ADD_FAILURE() << "timed out waiting for an event";
            return c;
        }
        ++c.n_events;
        c.text += ev.text;
        if (ev.final) {
            c.final = ev;
            return c;
        }
    }
}

}  // namespace

TEST(Scheduler, EchoUntilEog) {
    test::fake_engine eng;
    scheduler s(eng, {});
    const auto prompt = chat_prompt(eng, "hello");
    auto c = collect(*s.submit(greedy(prompt)));
    EXPECT_EQ(c.text, "hello");
    EXPECT_EQ(c.final.reason, finish_reason::eog);
    EXPECT_EQ(c.final.n_generated, 5);
    EXPECT_EQ(c.final.n_prompt, int64_t(prompt.size()));
    const auto st = s.stats();
    EXPECT_EQ(st.requests_finished, 1u);
    EXPECT_EQ(st.generated_tokens, 5u);
    EXPECT_EQ(st.ttft_s.count, 1u);
    EXPECT_EQ(st.token_latency_s.count, 5u);  // 4 more text tokens + the EOG draw
}

TEST(Scheduler, MaxTokensAndStopString) {
    test::fake_engine eng;
    scheduler s(eng, {});
    auto c = collect(*s.submit(greedy(chat_prompt(eng, "hello"), 3)));
    EXPECT_EQ(c.text, "hel");
    EXPECT_EQ(c.final.reason, finish_reason::length);
    auto r = greedy(chat_prompt(eng, "say ll now"));
    r.stop = {"ll"};
    c = collect(*s.submit(r));
    EXPECT_EQ(c.text, "say ");
    EXPECT_EQ(c.final.reason, finish_reason::stop_string);
    EXPECT_EQ(c.final.stop_string, "ll");
}

TEST(Scheduler, ContextEndsGeneration) {
    test::fake_engine eng(32);
    scheduler s(eng, {});
    const auto prompt = chat_prompt(eng, "LOOP");
    auto c = collect(*s.submit(greedy(prompt, 1000)));
    EXPECT_EQ(c.final.reason, finish_reason::length);
    // The session holds at most 32 tokens: every sample but the last is evaluated.
    EXPECT_EQ(c.final.n_generated, 32 - int64_t(prompt.size()) + 1);
}

TEST(Scheduler, RejectsInvalidRequests) {
    test::fake_engine eng(32);
    scheduler s(eng, {});
    EXPECT_THROW(s.submit(greedy({})), error);
    EXPECT_THROW(s.submit(greedy(std::vector<int32_t>(32, 'a'))), error);
    EXPECT_THROW(s.submit(greedy({1, 2, 999})), error);
    EXPECT_THROW(s.submit(greedy({1, 2}, 0)), error);
    auto bad = greedy({1, 2});
    bad.sampling.temperature = -1.0f;
    EXPECT_THROW(s.submit(bad), error);
}

TEST(Scheduler, QueueLimitAndCancellation) {
    test::fake_engine eng(4096, 2000);
    scheduler_options o;
    o.n_slots = 1;
    o.max_queue = 1;
    scheduler s(eng, o);
    auto a = s.submit(greedy(chat_prompt(eng, "LOOP a"), 100000));
    auto b = s.submit(greedy(chat_prompt(eng, "LOOP b"), 100000));
    EXPECT_THROW(s.submit(greedy(chat_prompt(eng, "c"))), queue_full);
    EXPECT_EQ(s.stats().requests_rejected, 1u);
    event ev;
    ASSERT_TRUE(a->next(ev, 5000ms));  // a is generating
    b->cancel();                       // b is still waiting: dropped from the queue
    a->cancel();
    EXPECT_EQ(collect(*a).final.reason, finish_reason::cancelled);
    EXPECT_EQ(collect(*b).final.reason, finish_reason::cancelled);
    const auto st = s.stats();
    EXPECT_EQ(st.requests_cancelled, 2u);
    EXPECT_EQ(st.slots_busy, 0);
    EXPECT_EQ(st.queue_depth, 0);
    // The slot serves the next request.
    EXPECT_EQ(collect(*s.submit(greedy(chat_prompt(eng, "ok")))).text, "ok");
}

TEST(Scheduler, FifoWithOneSlot) {
    test::fake_engine eng(512, 200);
    scheduler_options o;
    o.n_slots = 1;
    scheduler s(eng, o);
    auto a = s.submit(greedy(chat_prompt(eng, "aaaa")));
    auto b = s.submit(greedy(chat_prompt(eng, "bbbb")));
    auto c = s.submit(greedy(chat_prompt(eng, "cccc")));
    EXPECT_EQ(collect(*c).text, "cccc");
    // c finished, so a and b (admitted earlier) have already posted their final events.
    event ev;
    bool a_final = false, b_final = false;
    while (a->next(ev, 0ms)) a_final |= ev.final;
    while (b->next(ev, 0ms)) b_final |= ev.final;
    EXPECT_TRUE(a_final);
    EXPECT_TRUE(b_final);
}

TEST(Scheduler, PrefixReusePicksTheMatchingSlot) {
    test::fake_engine eng;
    scheduler_options o;
    o.n_slots = 3;
    scheduler s(eng, o);
    const std::string turn1 = eng.apply_chat_template({{"user", "first"}}, true);
    auto c1 = collect(*s.submit(greedy(eng.tokenize(turn1, true, true))));
    ASSERT_EQ(c1.text, "first");
    collect(*s.submit(greedy(chat_prompt(eng, "other"))));  // occupies another slot's history
    // Second turn extends the first conversation: its slot holds turn1 + "first".
    const std::string turn2 = eng.apply_chat_template({{"user", "first"}, {"assistant", "first"}, {"user", "again"}}, true);
    const auto p2 = eng.tokenize(turn2, true, true);
    const int64_t before = eng.evaluated.load();
    auto c2 = collect(*s.submit(greedy(p2)));
    EXPECT_EQ(c2.text, "again");
    // Shared prefix: BOS + "[user]first\n[assistant]\x02first" (turn1 + the generated text).
    const int64_t shared = 1 + int64_t(turn1.size()) + 5;
    EXPECT_EQ(c2.final.n_reused, shared);
    // Evaluated: the rest of the prompt, then one token per generated token ("again" = 5).
    EXPECT_EQ(eng.evaluated.load() - before, int64_t(p2.size()) - shared + 5);
}

TEST(Scheduler, ConcurrentJobsGetTheirOwnOutput) {
    test::fake_engine eng(512, 100);
    scheduler_options o;
    o.n_slots = 3;
    scheduler s(eng, o);
    std::vector<std::shared_ptr<job>> jobs;
    std::vector<std::string> words;
    for (int i = 0; i < 8; ++i) {
        words.push_back("word" + std::to_string(i) + std::string(size_t(i), 'z'));
        jobs.push_back(s.submit(greedy(chat_prompt(eng, words.back()))));
    }
    for (int i = 0; i < 8; ++i) EXPECT_EQ(collect(*jobs[size_t(i)]).text, words[size_t(i)]);
    EXPECT_EQ(s.stats().requests_finished, 8u);
}

TEST(Scheduler, DecodesAndPromptChunksShareOneEngineStep) {
    // Each evaluation sleeps 30 ms. Once the first request streams (it is decoding), the worker is held
    // at its next engine step and three more are submitted meanwhile (so no timing decides it): they are
    // admitted together, and the step after carries the first one's decode and the three prompts in one
    // engine call.
    test::fake_engine eng(512, 30000);
    scheduler_options o;
    o.n_slots = 4;
    scheduler s(eng, o);
    std::vector<std::shared_ptr<job>> jobs;
    std::vector<std::string> words = {"alpha-bravo", "bravo", "charlie", "delta"};
    jobs.push_back(s.submit(greedy(chat_prompt(eng, words[0]))));
    event first;
    ASSERT_TRUE(jobs[0]->next(first, 5000ms));
    ASSERT_FALSE(first.final);
    eng.hold = true;
    for (int i = 0; i < 2500 && eng.held.load() == 0; ++i) std::this_thread::sleep_for(2ms);
    ASSERT_EQ(eng.held.load(), 1) << "the worker never reached its next engine step";
    for (size_t i = 1; i < words.size(); ++i) jobs.push_back(s.submit(greedy(chat_prompt(eng, words[i]))));
    eng.hold = false;
    EXPECT_EQ(first.text + collect(*jobs[0]).text, words[0]);
    for (size_t i = 1; i < words.size(); ++i) EXPECT_EQ(collect(*jobs[i]).text, words[i]);
    // The step counter moves after the step's last event is posted: wait for it to catch up.
    for (int i = 0; i < 500 && s.stats().steps != uint64_t(eng.sync_steps.load()); ++i) std::this_thread::sleep_for(2ms);
    const scheduler_stats st = s.stats();
    EXPECT_EQ(eng.max_step_items.load(), 4);
    EXPECT_GE(eng.mixed_steps.load(), 1);
    EXPECT_EQ(uint64_t(eng.sync_steps.load()), st.steps);  // one engine step per scheduler step
    uint64_t prompt_tokens = 0;
    for (const auto &w : words) prompt_tokens += chat_prompt(eng, w).size();
    EXPECT_EQ(st.prompt_tokens_evaluated, prompt_tokens);
}

TEST(Scheduler, SmallBudgetSplitsPromptsIntoAlignedChunks) {
    // Chunk 4, budget 10: a step gives the oldest prompt chunks while the budget lasts (later ones in
    // further engine steps of the same scheduler step); outputs and token accounting are unchanged.
    test::fake_engine eng(512);
    scheduler_options o;
    o.n_slots = 3;
    o.prefill_chunk = 4;
    o.step_token_budget = 10;
    scheduler s(eng, o);
    std::vector<std::shared_ptr<job>> jobs;
    std::vector<std::string> words = {"a-rather-long-first-message", "second", "third-one"};
    for (const auto &w : words) jobs.push_back(s.submit(greedy(chat_prompt(eng, w))));
    for (size_t i = 0; i < words.size(); ++i) EXPECT_EQ(collect(*jobs[i]).text, words[i]);
    uint64_t prompt_tokens = 0;
    for (const auto &w : words) prompt_tokens += chat_prompt(eng, w).size();
    EXPECT_EQ(s.stats().prompt_tokens_evaluated, prompt_tokens);
    EXPECT_GT(uint64_t(eng.sync_steps.load()), s.stats().steps);  // multi-chunk steps took several rounds
}

// A paged engine pool coarser than its block counts (DeepSeek V4 on a GPU: 2 MiB blocks per row array): a
// request the counts admit but the pool cannot map next to an idle slot's cache gets that cache evicted
// instead of waiting forever, and one that cannot fit even alone fails with a clear error (no hang).
TEST(Scheduler, CoarsePagedPoolEvictsIdleCachesOrFailsClearly) {
    test::fake_engine eng(512);
    eng.coarse.granule = 64;
    eng.coarse.capacity = 4;  // 256 positions in all; a session maps ceil(n / 64) + 1 granules
    scheduler_options o;
    o.n_slots = 2;
    o.kv_block_tokens = 16;
    scheduler s(eng, o);
    EXPECT_EQ(s.stats().kv_blocks_total, 16);  // the engine's pool bounds the scheduler's
    std::vector<int32_t> a(40, 'a'), b(60, 'b'), c(200, 'c');
    // A: 40 + 20 positions (2 granules), finished: its slot keeps its cache (2 granules)
    auto ra = collect(*s.submit(greedy(a, 20)));
    EXPECT_EQ(ra.final.reason, finish_reason::length);
    // B: 60 + 60 positions, 8 blocks by the counts (8 free), 3 granules in fact (2 free): A's cache goes
    auto rb = collect(*s.submit(greedy(b, 60)));
    EXPECT_EQ(rb.final.reason, finish_reason::length);
    EXPECT_EQ(rb.text.size(), 60u);
    EXPECT_GE(s.stats().kv_evictions, 1u);
    // C: 200 + 56 positions = the whole pool by the counts, 5 granules in fact: cannot fit, even alone
    auto rc = collect(*s.submit(greedy(c, 56)));
    EXPECT_EQ(rc.final.reason, finish_reason::error);
    EXPECT_NE(rc.final.error.find("cannot hold"), std::string::npos) << rc.final.error;
    // and the scheduler keeps serving
    EXPECT_EQ(collect(*s.submit(greedy(a, 10))).final.reason, finish_reason::length);
}
