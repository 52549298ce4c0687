// KV block pool (src/kv/paged_pool.h) and the scheduler's KV admission control with the fake
// engine: block arithmetic worked by hand, all-or-nothing reservation, free on finish/cancel,
// waiting (not failing) when the pool is short, eviction of idle caches, 503 for prompts that can
// never fit, and the pool gauges.
#include <gtest/gtest.h>

#include "engine/fake_engine.h"
#include "kv/paged_pool.h"
#include "sched/scheduler.h"

using namespace fathom;
using namespace fathom::sched;
using namespace std::chrono_literals;

namespace {

request completion(size_t prompt_len, int32_t max_tokens) {
    request r;
    r.prompt.assign(prompt_len, int32_t('p'));  // fake engine: completion mode, emits 'a' + n % 26 forever
    r.sampling.temperature = 0.0f;
    r.max_tokens = max_tokens;
    return r;
}

event wait_final(job &j) {
    event ev;
    for (;;) {
        if (!j.next(ev, 10000ms)) {
            ADD_FAILURE() << "timed out";
            return ev;
        }
        if (ev.final) return ev;
    }
}

}  // namespace

TEST(KvPool, BlockArithmeticAndTables) {
    kv_block_pool p(10, 16, 3);
    EXPECT_EQ(p.blocks_for(0), 0);
    EXPECT_EQ(p.blocks_for(1), 1);
    EXPECT_EQ(p.blocks_for(16), 1);
    EXPECT_EQ(p.blocks_for(17), 2);
    ASSERT_TRUE(p.reserve(0, 40));  // 3 blocks: 0, 1, 2
    EXPECT_EQ(p.table(0), (std::vector<int32_t>{0, 1, 2}));
    ASSERT_TRUE(p.reserve(1, 100));  // 7 blocks: the rest
    EXPECT_EQ(p.n_free(), 0);
    EXPECT_FALSE(p.reserve(2, 1));   // nothing left: all or nothing
    EXPECT_EQ(p.held(2), 0);
    EXPECT_TRUE(p.reserve(0, 48));   // still 3 blocks: no new block needed
    p.shrink(1, 33);                 // keep 3 of 7
    EXPECT_EQ(p.held(1), 3);
    EXPECT_EQ(p.n_free(), 4);
    EXPECT_FALSE(p.reserve(2, 16 * 5));  // 5 > 4 free
    EXPECT_EQ(p.n_free(), 4);
    EXPECT_TRUE(p.reserve(2, 16 * 4));
    p.check();
    for (int32_t b : p.table(2)) EXPECT_EQ(p.owner(b), 2);
    p.release(0);
    p.release(1);
    p.release(2);
    EXPECT_EQ(p.n_free(), 10);
    p.check();
    EXPECT_THROW(p.reserve(3, 1), error);
    EXPECT_THROW(kv_block_pool(0, 16, 1), error);
    EXPECT_THROW(kv_block_pool(4, 0, 1), error);
}

TEST(KvPool, SchedulerReservesAndFreesBlocks) {
    test::fake_engine eng(512, 3000);  // slow steps so the running state can be observed
    scheduler_options o;
    o.n_slots = 2;
    o.kv_blocks = 8;
    o.kv_block_tokens = 16;
    scheduler s(eng, o);
    EXPECT_EQ(s.stats().kv_blocks_total, 8);
    EXPECT_EQ(s.stats().kv_tokens_capacity, 128);
    // 40-token prompt + 40 tokens = 80 positions = 5 blocks.
    auto a = s.submit(completion(40, 40));
    for (int i = 0; i < 500 && s.stats().kv_blocks_used == 0; ++i) std::this_thread::sleep_for(1ms);
    EXPECT_EQ(s.stats().kv_blocks_used, 5);
    // A second request needing 5 blocks cannot fit beside it (3 free): it waits, it is not refused.
    auto b = s.submit(completion(30, 50));
    // a runs for >= 120 ms (40 steps of 3 ms): poll until the scheduler has seen b wait (a fixed sleep
    // flakes on a loaded sanitizer run).
    for (int i = 0; i < 100 && s.stats().kv_waits == 0; ++i) std::this_thread::sleep_for(1ms);
    auto st = s.stats();
    EXPECT_EQ(st.slots_busy, 1);
    EXPECT_EQ(st.queue_depth, 1);
    EXPECT_GE(st.kv_waits, 1u);
    const event fa = wait_final(*a);
    EXPECT_EQ(fa.reason, finish_reason::length);
    EXPECT_EQ(fa.n_generated, 40);
    const event fb = wait_final(*b);
    EXPECT_EQ(fb.reason, finish_reason::length);
    EXPECT_EQ(fb.n_generated, 50);
    // b took a's slot or the other one; a's cache (79 positions) either was dropped or is cached.
    st = s.stats();
    EXPECT_EQ(st.slots_busy, 0);
    EXPECT_LE(st.kv_blocks_used, 8);
    EXPECT_EQ(st.kv_blocks_used, st.kv_blocks_cached);  // nothing reserved by running requests
}

TEST(KvPool, IdleCachesAreEvictedAndCancelFrees) {
    test::fake_engine eng(512, 2000);
    scheduler_options o;
    o.n_slots = 2;
    o.kv_blocks = 6;
    o.kv_block_tokens = 16;
    scheduler s(eng, o);
    // 50 + 10 = 60 positions: 4 blocks; when it ends its slot caches 59 tokens = 4 blocks.
    EXPECT_EQ(wait_final(*s.submit(completion(50, 10))).reason, finish_reason::length);
    EXPECT_EQ(s.stats().kv_blocks_cached, 4);
    const int created = eng.sessions_created.load();
    // A different prompt needing 4 blocks goes to the other (empty) slot: only 2 are free, so
    // the idle cache must be dropped (its session recreated).
    request r = completion(20, 40);
    r.prompt.assign(20, int32_t('q'));
    auto j = s.submit(r);
    for (int i = 0; i < 1000 && s.stats().slots_busy == 0; ++i) std::this_thread::sleep_for(1ms);
    auto st = s.stats();
    EXPECT_EQ(st.kv_evictions, 1u);
    EXPECT_EQ(eng.sessions_created.load(), created + 1);
    EXPECT_EQ(st.kv_blocks_cached, 0);
    EXPECT_EQ(st.kv_blocks_used, 4);
    j->cancel();
    EXPECT_EQ(wait_final(*j).reason, finish_reason::cancelled);
    st = s.stats();
    EXPECT_EQ(st.kv_blocks_used, st.kv_blocks_cached);  // the cancelled request's reservation is gone
    EXPECT_LE(st.kv_blocks_used, 4);
}

TEST(KvPool, PromptLargerThanThePoolIsRefused) {
    test::fake_engine eng(512);
    scheduler_options o;
    o.kv_blocks = 2;
    o.kv_block_tokens = 16;
    scheduler s(eng, o);
    try {  // 32 + 1 > 32 positions: never servable, so an error (400), not queue_full (503, retry)
        s.submit(completion(32, 1));
        ADD_FAILURE() << "expected an error";
    } catch (const queue_full &) {
        ADD_FAILURE() << "queue_full (503) for a prompt that can never fit";
    } catch (const error &e) {
        EXPECT_NE(std::string(e.what()).find("the KV pool holds 32"), std::string::npos) << e.what();
    }
    EXPECT_EQ(s.stats().requests_rejected, 1u);
    // 20 tokens fit; generation is capped by the pool (32 positions): 12 sampled, the last one
    // needs no evaluation... so the request ends with 'length' after 13 tokens at most.
    const event f = wait_final(*s.submit(completion(20, 100)));
    EXPECT_EQ(f.reason, finish_reason::length);
    EXPECT_EQ(f.n_generated, 13);
}
