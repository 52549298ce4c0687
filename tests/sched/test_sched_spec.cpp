// Speculative decoding in the scheduler (scheduler_options::spec) with the fake engine, whose chat replies
// echo the last user message (so n-gram drafts from the prompt are right): every request's text, finish
// reason, token count and stop string equal the scheduler without speculation, for token limits at every
// length (stops inside a step's drafts), stop strings, a context that fills, sampled requests, several
// slots at once with and without a KV block budget (the counting pool: the fake engine has no paged pool);
// drafts were kept and the engine took fewer steps. (Its one-hot logits make sampled requests nearly greedy:
// tests/spec/test_spec.cpp SpecScheduler covers sampling on a real model.)
#include <gtest/gtest.h>

#include <string>
#include <thread>
#include <vector>

#include "engine/fake_engine.h"
#include "sched/scheduler.h"

using namespace fathom;
using namespace fathom::sched;
using namespace std::chrono_literals;

namespace {

using test::chat_prompt;

struct result {
    std::string text;
    finish_reason reason = finish_reason::error;
    int64_t n_generated = -1;
    std::string stop_string;
    std::vector<int32_t> ids;
    bool operator==(const result &o) const {
        return text == o.text && reason == o.reason && n_generated == o.n_generated && stop_string == o.stop_string &&
               ids == o.ids;
    }
};

std::ostream &operator<<(std::ostream &os, const result &r) {
    return os << "{'" << r.text << "', reason " << int(r.reason) << ", n " << r.n_generated << ", stop '"
              << r.stop_string << "'}";
}

result collect(job &j) {
    result c;
    event ev;
    for (;;) {
        if (!j.next(ev, 5000ms)) {
            ADD_FAILURE() << "timed out waiting for an event";
            return c;
        }
        c.text += ev.text;
        for (const auto &t : ev.tokens) c.ids.push_back(t.id);
        if (ev.final) {
            c.reason = ev.reason;
            c.n_generated = ev.n_generated;
            c.stop_string = ev.stop_string;
            return c;
        }
    }
}

request req(std::vector<int32_t> prompt, int32_t max_tokens, float temp = 0.0f, uint64_t seed = 1) {
    request r;
    r.prompt = std::move(prompt);
    r.sampling.temperature = temp;
    r.sampling.seed = seed;
    r.max_tokens = max_tokens;
    return r;
}

scheduler_options opts(bool spec, int slots = 1, int draft_max = 8) {
    scheduler_options o;
    o.n_slots = slots;
    o.spec = spec;
    o.spec_ngram.draft_max = draft_max;
    o.spec_ngram.ngram_min = 1;
    o.spec_ngram.row_cost = 0;  // deterministic widths (the fake engine's step times are noise)
    return o;
}

// The user text appears in the prompt, so the echo is drafted from it.
const std::string kText = "the cat sat on the mat; the cat sat on the hat; the dog sat on the log";

TEST(SchedSpec, SameOutputAsPlainDecodingAtEveryLength) {
    test::fake_engine plain_eng, spec_eng;
    scheduler plain(plain_eng, opts(false)), spec(spec_eng, opts(true));
    const auto prompt = chat_prompt(plain_eng, kText);
    for (int32_t m : {1, 2, 3, 5, 8, 9, 17, 30, 69, 70, 71, 200}) {
        const result a = collect(*plain.submit(req(prompt, m))), b = collect(*spec.submit(req(prompt, m)));
        EXPECT_EQ(a, b) << "max_tokens " << m;
    }
    const auto st = spec.stats();
    EXPECT_GT(st.spec_accepted, 100u);
    EXPECT_LE(st.spec_accepted, st.spec_drafted);
    EXPECT_LT(spec_eng.sync_steps.load(), plain_eng.sync_steps.load() / 2) << "speculation saved no steps";
    EXPECT_EQ(plain.stats().spec_drafted, 0u);
}

// The request's own cap (request::draft_max: 0 off, N at most N per step): the same output; the final
// event reports the request's drafted and kept tokens.
TEST(SchedSpec, PerRequestDraftCapAndCounts) {
    test::fake_engine pe, se;
    scheduler plain(pe, opts(false)), spec(se, opts(true));
    const auto prompt = chat_prompt(pe, kText);
    const result want = collect(*plain.submit(req(prompt, 80)));
    auto final_of = [](job &j, result &r) {
        event ev;
        event last;
        for (;;) {
            if (!j.next(ev, 5000ms)) {
                ADD_FAILURE() << "timed out";
                return last;
            }
            r.text += ev.text;
            for (const auto &t : ev.tokens) r.ids.push_back(t.id);
            if (ev.final) {
                r.reason = ev.reason;
                r.n_generated = ev.n_generated;
                return ev;
            }
        }
    };
    for (int32_t cap : {-1, 0, 1, 3}) {
        request r = req(prompt, 80);
        r.draft_max = cap;
        const uint64_t drafted_before = spec.stats().spec_drafted;
        result got;
        const event fin = final_of(*spec.submit(r), got);
        EXPECT_EQ(got, want) << "cap " << cap;
        const uint64_t drafted = spec.stats().spec_drafted - drafted_before;
        EXPECT_EQ(uint64_t(fin.n_drafted), drafted) << "cap " << cap;
        EXPECT_LE(fin.n_accepted, fin.n_drafted);
        if (cap == 0) EXPECT_EQ(fin.n_drafted, 0) << "speculation off for this request";
        else EXPECT_GT(fin.n_accepted, 20) << "cap " << cap;
        if (cap > 0) {  // at most cap drafts per step: steps >= drafted / cap
            EXPECT_GE(int64_t(spec.stats().spec_steps) * cap, fin.n_drafted);
        }
    }
}

TEST(SchedSpec, StopStringsSampledRequestsAndFullContext) {
    {
        test::fake_engine pe, se;
        scheduler plain(pe, opts(false)), spec(se, opts(true, 1, 4));
        const auto prompt = chat_prompt(pe, kText);
        for (const char *stop : {"mat", "the dog", "; ", "log", "zzz"}) {
            request r = req(prompt, 200);
            r.stop = {stop};
            EXPECT_EQ(collect(*plain.submit(r)), collect(*spec.submit(r))) << "stop '" << stop << "'";
        }
        for (uint64_t seed : {1u, 2u, 3u})
            EXPECT_EQ(collect(*plain.submit(req(prompt, 60, 0.9f, seed))), collect(*spec.submit(req(prompt, 60, 0.9f, seed))))
                << "seed " << seed;
    }
    {
        // A 96-token context: the reply runs into it (the echo is longer than the room left).
        test::fake_engine pe(96), se(96);
        scheduler plain(pe, opts(false)), spec(se, opts(true));
        const auto prompt = chat_prompt(pe, "ab ab ab ab ab ab ab ab ab ab ab ab ab ab ab ab ab ab ab ab");
        ASSERT_LT(prompt.size(), 90u);
        const result a = collect(*plain.submit(req(prompt, 1000))), b = collect(*spec.submit(req(prompt, 1000)));
        EXPECT_EQ(a.reason, finish_reason::length);
        EXPECT_EQ(a, b);
    }
}

TEST(SchedSpec, SeveralSlotsAndABlockBudget) {
    for (int64_t blocks : {0, 40}) {
        test::fake_engine pe(256), se(256);
        scheduler_options po = opts(false, 3), so = opts(true, 3);
        po.kv_blocks = so.kv_blocks = blocks;  // 40 blocks of 16: admission against a block budget
        scheduler plain(pe, po), spec(se, so);
        const std::vector<std::string> texts = {kText, "one two one two one two one two", "xyz xyz xyz xyz xyz xyz"};
        std::vector<result> want;
        for (const auto &t : texts) want.push_back(collect(*plain.submit(req(chat_prompt(pe, t), 100))));
        std::vector<std::shared_ptr<job>> jobs;
        for (const auto &t : texts) jobs.push_back(spec.submit(req(chat_prompt(se, t), 100)));
        for (size_t i = 0; i < jobs.size(); ++i) EXPECT_EQ(collect(*jobs[i]), want[i]) << "blocks " << blocks << ", request " << i;
        EXPECT_GT(spec.stats().spec_accepted, 20u);
    }
}

// A session whose verification rows stay on its device (sync_item::rows_on_device; DS4 on one GPU):
// the scheduler samples them there (session::sample_row), with the same output as plain decoding, greedy
// and sampled; a structured-output request keeps host rows (its grammar masks them).
TEST(SchedSpec, RowsHeldOnTheDeviceAreSampledThere) {
    test::fake_engine pe, se;
    se.device_rows = true;
    scheduler plain(pe, opts(false, 2)), spec(se, opts(true, 2));
    const auto prompt = chat_prompt(pe, kText);
    for (int32_t m : {1, 5, 17, 70, 200})
        EXPECT_EQ(collect(*plain.submit(req(prompt, m))), collect(*spec.submit(req(prompt, m)))) << "max_tokens " << m;
    EXPECT_EQ(collect(*plain.submit(req(prompt, 120, 0.7f, 5))), collect(*spec.submit(req(prompt, 120, 0.7f, 5))));
    EXPECT_GT(spec.stats().spec_accepted, 100u);
    EXPECT_GT(se.rows_sampled.load(), 100);
}

TEST(SchedSpec, BadOptionsAreRefused) {
    test::fake_engine eng;
    scheduler_options o = opts(true);
    o.spec_ngram.draft_max = 0;
    EXPECT_THROW(scheduler(eng, o), error);
}

}  // namespace
