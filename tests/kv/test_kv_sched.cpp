// The scheduler over the dense engine's paged KV pool (real SmolLM2 model; skipped without it):
// the scheduler's KV gauges are the engine pool's own counts, admission reserves real blocks,
// eviction and cancellation give them back, and a request's greedy output equals a plain
// session's greedy loop on a separate engine.
#include <gtest/gtest.h>

#include <chrono>
#include <thread>

#include "sched/scheduler.h"
#include "sched/smol_util.h"

namespace fathom {
namespace {

using namespace std::chrono_literals;
using sched::event;
using sched::finish_reason;
using test::greedy_alone;
using test::load_smol;
using test::prompt_of;
using test::run_to_end;

int64_t blocks_for(int64_t tokens) { return (tokens + 15) / 16; }

TEST(KvScheduler, EnginePoolIsTheRecord) {
    auto eng = load_smol();
    if (!eng) GTEST_SKIP() << "models/SmolLM2-135M-Instruct.Q4_1.gguf not installed";
    sched::scheduler_options o;
    o.n_slots = 2;
    o.kv_blocks = 12;  // 192 positions
    o.kv_block_tokens = 16;
    o.prefill_chunk = 64;
    sched::scheduler s(*eng, o);
    EXPECT_EQ(eng->kv_pool().block_tokens, 16);
    EXPECT_EQ(eng->kv_pool().max_blocks, 12);
    EXPECT_EQ(eng->kv_pool().n_used, 0);

    // A: 40-token prompt, 8 greedy tokens.
    sched::request a;
    a.prompt = prompt_of(40, 1);
    a.sampling.temperature = 0.0f;
    a.max_tokens = 8;
    std::vector<int32_t> got;
    const event fa = run_to_end(*s.submit(a), got, 60000ms);
    ASSERT_TRUE(fa.reason == finish_reason::length || fa.reason == finish_reason::eog) << sched::to_string(fa.reason);
    auto st = s.stats();
    int64_t held = 0, want_blocks = 0;
    for (const auto &sl : s.slots()) {
        held += sl.n_tokens;
        want_blocks += blocks_for(sl.n_tokens);
    }
    EXPECT_GE(held, 40);
    EXPECT_EQ(st.kv_blocks_used, eng->kv_pool().n_used);  // one record
    EXPECT_EQ(st.kv_blocks_used, want_blocks);            // only the held tokens' blocks remain
    EXPECT_EQ(st.kv_blocks_cached, st.kv_blocks_used);

    // The same greedy generation with a plain session on another engine.
    EXPECT_EQ(got, greedy_alone(*load_smol(), a.prompt, a.max_tokens));

    // B needs the whole pool (50 + 150 positions, capped at 192 = 12 blocks): A's cached prefix is
    // evicted to make room. Cancelled mid-generation, B's reservation goes back.
    sched::request b;
    b.prompt = prompt_of(50, 2);
    b.sampling.temperature = 0.0f;
    b.max_tokens = 150;
    auto jb = s.submit(b);
    event ev;
    ASSERT_TRUE(jb->next(ev, 60000ms));  // first token: B is decoding with its reservation
    st = s.stats();
    EXPECT_EQ(st.kv_blocks_used, 12);
    EXPECT_EQ(eng->kv_pool().n_used, 12);
    EXPECT_EQ(st.kv_blocks_cached, 0);
    EXPECT_GE(st.kv_evictions, 1u);
    jb->cancel();
    std::vector<int32_t> rest;
    const event fb = ev.final ? ev : run_to_end(*jb, rest, 60000ms);
    EXPECT_EQ(fb.reason, finish_reason::cancelled);
    st = s.stats();
    EXPECT_EQ(st.kv_blocks_used, eng->kv_pool().n_used);
    EXPECT_EQ(st.kv_blocks_used, st.kv_blocks_cached);
    EXPECT_LT(st.kv_blocks_used, 12);

    // A prompt larger than the whole pool is refused at once (an error: 400), not run out of memory.
    sched::request c;
    c.prompt = prompt_of(200, 3);
    c.max_tokens = 4;
    EXPECT_THROW(s.submit(c), error);
    try {
        s.submit(c);
    } catch (const sched::queue_full &) {
        ADD_FAILURE() << "queue_full (503) for a prompt that can never fit";
    } catch (const error &) {
    }
}

}  // namespace
}  // namespace fathom
