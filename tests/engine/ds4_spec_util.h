// Test helper shared by the DS4 drafter suites (tests/engine/test_ds4_drafters.cpp,
// tests/models/ds4/test_ds4_synth_mtp.cpp): n tokens generated from `prompt` by the plain loop (one token
// per step) or by the speculative loop with the session's own drafter (spec::generate at a fixed width of 4,
// so every step drafts and rolls back: deterministic, no timing in the widths).
#pragma once
#include <cstdint>
#include <span>
#include <vector>

#include "fathom/engine.h"
#include "fathom/sampling.h"
#include "fathom/speculative.h"

namespace ds4_test {

// The two samplers the identity tests run: greedy, and temperature 0.9 with seed 7.
inline fathom::sampling_params greedy_or_sampled(bool sampled) {
    fathom::sampling_params p;
    p.temperature = sampled ? 0.9f : 0.0f;
    p.seed = 7;
    return p;
}

inline std::vector<int32_t> generate(fathom::engine &e, const std::vector<int32_t> &prompt,
                                     const fathom::sampling_params &p, int n, bool spec,
                                     fathom::spec::spec_stats *st = nullptr) {
    using namespace fathom;
    auto s = e.new_session();
    s->sync(prompt);
    sampler smp(p);
    std::vector<int32_t> out;
    if (!spec) {
        while (static_cast<int>(out.size()) < n) {
            const int32_t t = s->sample(smp, s->tokens()).token;
            out.push_back(t);
            s->eval(std::span<const int32_t>(&t, 1));
        }
        return out;
    }
    session &sr = *s;
    spec::width_options w;
    w.draft_max = 4;
    w.adaptive = false;
    const spec::spec_stats r = spec::generate(
        sr, smp, e.info().n_ctx, w, [&sr](std::span<const int32_t> h, int32_t max) { return sr.draft(h, max); },
        [&](int32_t t) {
            out.push_back(t);
            return static_cast<int>(out.size()) >= n ? spec::token_verdict::keep_and_stop : spec::token_verdict::keep;
        });
    if (st) *st = r;
    return out;
}

}  // namespace ds4_test
