// The MTP drafting rule's bookkeeping (make_mtp_drafter over an mtp_head, src/engine/ds4_drafter.cpp) with a
// recording head instead of a model: which rows the head runs, with which states and next tokens, and when it
// restarts its history. The rule (docs/speculative.md "DeepSeek V4's drafters"): observe() only keeps the
// target's states; a draft first runs the rows the head has not seen since its last draft, from at most 32
// rows back; the head's row i is (the target's state at i, token i + 1); a rollback drops the head's rows
// whose next token was rolled back. The end-to-end truth (drafts equal the golden MTP head's) is
// tests/engine/test_ds4_drafters.cpp; this pins what each step costs the head.
#include <gtest/gtest.h>

#include <algorithm>
#include <memory>
#include <vector>

#include "engine/ds4_drafter.h"
#include "models/deepseek4.h"

namespace {

using namespace fathom;

constexpr size_t kS = 4;  // state floats; a state's first float is its position

struct head_log {
    std::vector<int64_t> row_pos;      // positions of rows() rows, in order
    std::vector<int32_t> row_next;     // their next tokens
    std::vector<float> row_state;      // their states' first floats
    std::vector<int64_t> restarts;     // restart(at) calls
    std::vector<int64_t> chain_pos;    // positions of row() calls (a draft's rows), in order
    std::vector<int32_t> chain_next;   // their next tokens
};

class recording_head final : public mtp_head {
  public:
    explicit recording_head(head_log &log) : log_(log) {}
    int64_t n_past() const override { return n_past_; }
    int64_t window() const override { return 128; }
    int64_t rollback_floor() const override { return std::max<int64_t>(0, n_past_ - ds4::max_rollback); }
    void rows(std::span<const float> x, std::span<const int32_t> next) override {
        for (size_t i = 0; i < next.size(); ++i) {
            log_.row_pos.push_back(n_past_);
            log_.row_next.push_back(next[i]);
            log_.row_state.push_back(x[i * kS]);
            ++n_past_;
        }
    }
    int32_t row(std::span<const float> x, int32_t next, std::span<float> out) override {
        log_.chain_pos.push_back(n_past_);
        log_.chain_next.push_back(next);
        ++n_past_;
        std::copy(x.begin(), x.end(), out.begin());
        return next + 1;  // a draft the test can tell apart
    }
    void truncate(int64_t n) override { n_past_ = std::min(n_past_, n); }
    void restart(int64_t at) override {
        log_.restarts.push_back(at);
        n_past_ = at;
    }

  private:
    head_log &log_;
    int64_t n_past_ = 0;
};

// The target's states of positions [p0, p0 + n): state q = {q, 0, 0, 0}.
std::vector<float> states(int64_t p0, int64_t n) {
    std::vector<float> hc(static_cast<size_t>(n) * kS, 0.0f);
    for (int64_t i = 0; i < n; ++i) hc[static_cast<size_t>(i) * kS] = static_cast<float>(p0 + i);
    return hc;
}

struct fixture {
    head_log log;
    std::unique_ptr<ds4_drafter> d;
    std::vector<int32_t> held;  // token at position q: 1000 + q
    fixture() {
        d = make_mtp_drafter(std::make_unique<recording_head>(log), kS);
        log.restarts.clear();  // the constructor's restart(0)
    }
    // One target forward of n rows at the end of `held`, as a session hands them over.
    void forward(int64_t n) {
        const int64_t p0 = static_cast<int64_t>(held.size());
        for (int64_t i = 0; i < n; ++i) held.push_back(static_cast<int32_t>(1000 + p0 + i));
        d->observe(held, p0, states(p0, n), {});
    }
    void rollback(int64_t n) {
        held.resize(static_cast<size_t>(n));
        d->truncate(n);
    }
    // The pending token is the one position held.size() will hold: 1000 + that position.
    std::vector<int32_t> draft(int32_t max) {
        return d->draft(held, static_cast<int32_t>(1000 + held.size()), max, nullptr);
    }
};

TEST(ds4_mtp_drafter, observing_runs_no_head_rows) {
    fixture f;
    f.forward(40);  // a prompt
    for (int i = 0; i < 100; ++i) f.forward(1);  // plain steps: the width paused
    EXPECT_TRUE(f.log.row_pos.empty());
    EXPECT_TRUE(f.log.chain_pos.empty());
}

TEST(ds4_mtp_drafter, drafting_every_step_runs_each_row_once_in_order) {
    fixture f;
    f.forward(10);
    std::vector<int32_t> dr = f.draft(3);
    // rows 0..8 (each with its next token), then the chain: row 9 with the pending token (kept: its next
    // token is the true one) and two rows on the head's own drafts (rolled back)
    ASSERT_EQ(f.log.row_pos.size(), 9u);
    for (int64_t i = 0; i < 9; ++i) {
        EXPECT_EQ(f.log.row_pos[static_cast<size_t>(i)], i);
        EXPECT_EQ(f.log.row_next[static_cast<size_t>(i)], 1000 + i + 1);
        EXPECT_EQ(f.log.row_state[static_cast<size_t>(i)], static_cast<float>(i));
    }
    EXPECT_EQ(f.log.chain_pos, (std::vector<int64_t>{9, 10, 11}));
    EXPECT_EQ(f.log.chain_next, (std::vector<int32_t>{1010, 1011, 1012}));
    EXPECT_EQ(dr, (std::vector<int32_t>{1011, 1012, 1013}));
    // a verification of the pending token + 3 drafts keeps 2 of them: 4 rows, the last rolled back
    f.forward(4);
    f.rollback(13);
    f.draft(2);
    // the next draft runs rows 10 and 11 (row 9 is the head's already; row 12's next token is the
    // pending one: it starts the chain), nothing twice and nothing of the rolled-back position
    ASSERT_EQ(f.log.row_pos.size(), 11u);
    EXPECT_EQ(f.log.row_pos[9], 10);
    EXPECT_EQ(f.log.row_pos[10], 11);
    EXPECT_EQ(f.log.row_next[9], 1011);
    EXPECT_EQ(f.log.row_next[10], 1012);
    EXPECT_EQ(f.log.chain_pos[3], 12);
    EXPECT_TRUE(f.log.restarts.empty());
    // rolled back below the head's rows (a rejected step deeper than its last draft): they run again
    f.rollback(11);
    f.forward(2);
    f.draft(1);
    EXPECT_EQ(f.log.row_pos.back(), 11);
    EXPECT_EQ(f.log.row_next.back(), 1012);
}

TEST(ds4_mtp_drafter, a_draft_after_a_pause_catches_up_at_most_32_rows) {
    fixture f;
    f.forward(20);
    f.draft(1);
    const size_t before = f.log.row_pos.size();
    for (int i = 0; i < 200; ++i) f.forward(1);  // paused: 200 plain steps
    f.draft(1);
    const int64_t n = static_cast<int64_t>(f.held.size());
    ASSERT_EQ(f.log.restarts.size(), 1u);
    EXPECT_EQ(f.log.restarts[0], n - 1 - 32);
    ASSERT_EQ(f.log.row_pos.size() - before, 32u);
    for (size_t i = before; i < f.log.row_pos.size(); ++i) {
        const int64_t q = n - 1 - 32 + static_cast<int64_t>(i - before);
        EXPECT_EQ(f.log.row_pos[i], q);
        EXPECT_EQ(f.log.row_state[i], static_cast<float>(q));  // the state of that position, not a stale one
        EXPECT_EQ(f.log.row_next[i], 1000 + q + 1);
    }
}

TEST(ds4_mtp_drafter, a_state_never_handed_over_restarts_the_history_after_it) {
    fixture f;
    f.forward(10);
    // positions 10..19 evaluated without their states reaching the drafter (a loaded prefix), then 3 rows
    for (int64_t q = 10; q < 20; ++q) f.held.push_back(static_cast<int32_t>(1000 + q));
    f.forward(3);
    f.draft(1);
    ASSERT_FALSE(f.log.restarts.empty());
    EXPECT_EQ(f.log.restarts.back(), 20);  // the first position after the gap
    for (size_t i = 0; i < f.log.row_pos.size(); ++i) EXPECT_EQ(f.log.row_state[i], static_cast<float>(f.log.row_pos[i]));
    // a draft needs the state of the last position
    fixture g;
    g.forward(5);
    g.held.push_back(2000);
    EXPECT_TRUE(g.draft(2).empty());
}

}  // namespace
