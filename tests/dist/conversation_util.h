// One scripted DS4 conversation through the public session API and its helpers, shared by the
// --devices tests on the CPU (tests/dist/test_dist_engine.cpp) and on CUDA
// (tests/engine/test_cuda_ds4_devices.cpp): whatever engine runs it, the logits it returns must equal
// those of a one-device engine of the same kind bit for bit.
#pragma once
#include <gtest/gtest.h>

#include <algorithm>
#include <limits>
#include <span>
#include <vector>

#include "dist/dist_test_util.h"  // same_bits
#include "fathom/engine.h"

namespace dist_test {

using namespace fathom;

// NaN-filled buffer: a logit the engine fails to write cannot pass a comparison.
inline std::vector<float> poisoned(size_t n) { return std::vector<float>(n, std::numeric_limits<float>::quiet_NaN()); }

// Tokens [0, n) of a fixed pseudo-random stream inside the vocabulary (not the golden's tokens, so
// the conversation also covers text the goldens do not).
inline std::vector<int32_t> stream(size_t n, int vocab, size_t salt) {
    std::vector<int32_t> t(n);
    for (size_t i = 0; i < n; ++i) t[i] = static_cast<int32_t>((i * 131 + salt * 17 + 5) % static_cast<size_t>(vocab));
    return t;
}

// One conversation on a fresh session; every logit the session produces is appended to the result
// in order. Also checks, against hand-counted figures, how many tokens each sync evaluated (prefix
// reuse where the held tokens are a prefix, a full re-evaluation where they are not).
inline std::vector<float> conversation(engine &e) {
    const int V = e.info().n_vocab;
    const auto turn1 = stream(40, V, 1), turn2 = stream(30, V, 2), other = stream(25, V, 3);
    std::vector<float> out;
    auto keep = [&](std::span<const float> l) {
        EXPECT_EQ(l.size(), static_cast<size_t>(V));
        out.insert(out.end(), l.begin(), l.end());
    };
    int64_t evaluated = 0;
    auto progress = [&](int64_t, int64_t total) { evaluated = total; };
    auto s = e.new_session();

    // Turn 1: prefill, then five greedy decode steps.
    s->sync(turn1, progress);
    EXPECT_EQ(evaluated, 40);
    keep(s->logits());
    std::vector<int32_t> held = turn1;
    for (int i = 0; i < 5; ++i) {
        const auto l = s->logits();
        const int32_t next = static_cast<int32_t>(std::max_element(l.begin(), l.end()) - l.begin());
        s->eval(std::span<const int32_t>(&next, 1));
        held.push_back(next);
        keep(s->logits());
    }
    // Turn 2: the conversation so far plus the new turn: only the new turn is evaluated.
    held.insert(held.end(), turn2.begin(), turn2.end());
    s->sync(held, progress);
    EXPECT_EQ(evaluated, 30);
    EXPECT_EQ(s->n_past(), 75);
    keep(s->logits());
    // Every token's logits of an appended span, into a poisoned buffer.
    const std::vector<int32_t> tail = stream(9, V, 4);
    std::vector<float> all = poisoned(tail.size() * static_cast<size_t>(V));
    s->eval(tail, all.data());
    out.insert(out.end(), all.begin(), all.end());
    keep(s->logits());
    // Truncation (a DS4 state cannot be cut: the session re-evaluates the kept prefix).
    s->truncate(20);
    EXPECT_EQ(s->n_past(), 20);
    keep(s->logits());
    // Reset, then a different conversation from position 0.
    s->reset();
    EXPECT_EQ(s->n_past(), 0);
    EXPECT_TRUE(s->logits().empty());
    s->sync(other, progress);
    EXPECT_EQ(evaluated, 25);
    keep(s->logits());
    return out;
}

}  // namespace dist_test
