// engine::sync_step's rule for one item (session::sync semantics), shared by the engines that fuse a
// step's items into one forward: the dense engine (engine.cpp, plan_sync_step) and DS4 on one CPU device
// (ds4_engine.cpp, plan_cpu_step).
#pragma once
#include <algorithm>
#include <cstdint>
#include <span>
#include <string>

#include "fathom/engine.h"

namespace fathom {

struct sync_plan {
    enum class kind {
        done,      // the session holds the prefix already (with its logits, or none wanted)
        alone,     // malformed verification, or more new tokens than one piece: sync_with_rows after the step
        evaluate,  // keep `keep` tokens of what is held, evaluate prefix[keep, end) (empty prefix: reset)
    } what = kind::evaluate;
    size_t keep = 0;
};

// Throws fathom::error (nothing changed yet) for a prefix over n_ctx or a token to evaluate outside the
// vocabulary. A verification (n_rows > 0) evaluates its last n_rows afresh, the rest kept as held; when
// the whole prefix is held but its last token's logits are wanted and not kept, that token is evaluated
// again.
inline sync_plan plan_sync_item(const sync_item &it, std::span<const int32_t> held, bool have_logits, int64_t n_ctx,
                                int64_t n_batch, int32_t n_vocab) {
    if (static_cast<int64_t>(it.prefix.size()) > n_ctx)
        throw error("prompt of " + std::to_string(it.prefix.size()) + " tokens exceeds n_ctx " + std::to_string(n_ctx));
    if (it.n_rows > 0 && (!it.rows || static_cast<size_t>(it.n_rows) > it.prefix.size()))
        return {sync_plan::kind::alone, 0};  // malformed: sync_with_rows reports it
    if (it.prefix.empty()) return {sync_plan::kind::evaluate, 0};  // sync of nothing: reset
    size_t k = 0;
    while (k < it.prefix.size() && k < held.size() && it.prefix[k] == held[k]) ++k;
    if (it.n_rows > 0) {
        k = std::min(k, it.prefix.size() - static_cast<size_t>(it.n_rows));
        if (static_cast<int64_t>(it.prefix.size() - k) > n_batch) return {sync_plan::kind::alone, 0};
    } else if (k == it.prefix.size()) {
        if (k == held.size() && (have_logits || !it.want_logits)) return {sync_plan::kind::done, 0};
        if (it.want_logits) --k;  // re-evaluate the last token for its logits (k >= 1 here)
    }
    for (size_t t = k; t < it.prefix.size(); ++t)
        if (it.prefix[t] < 0 || it.prefix[t] >= n_vocab)
            throw error("token id " + std::to_string(it.prefix[t]) + " outside the vocabulary [0, " +
                        std::to_string(n_vocab) + ")");
    return {sync_plan::kind::evaluate, k};
}

}  // namespace fathom
