// In-RAM prefix checkpoints of DS4 states (one CPU device; docs/ds4.md "Prefix checkpoints").
//
// A ds4::state can roll back only ds4::max_rollback positions (its raw rings and compressor frontiers
// keep no older history), so a request that diverges deeper from what a session holds (a regenerate
// after a long reply, an edited last turn, a dropped reasoning block) would re-evaluate the whole
// conversation. The engine keeps snapshots of its sessions' states at chunk boundaries in this store,
// and session::sync restores the longest one whose tokens are a prefix of the request, then evaluates
// only the rest. The store is engine-wide: any session of the engine may restore any checkpoint.
//
// Sharing. A state at n tokens is (a) a fixed-size part: the raw KV rings and the compressor frontiers
// (and n_past / rollback bookkeeping), and (b) the compressed and indexer rows, floor(n / R) per
// ratio-R layer, which only grow and are a function of the token prefix alone (the CPU forward is
// batch invariant: a row's bits do not depend on how the sequence was chunked). So a checkpoint stores
// its fixed part and only the rows emitted since the longest earlier checkpoint whose tokens are a
// prefix of its own (its parent): a `segment` (tokens and rows of positions [parent's n, n)), linked to
// the parent's segment. A timeline's rows are held once however many checkpoints it has; a segment
// lives while any checkpoint at or after it does.
//
// Which states are kept (the engine's hooks call these):
//   * start: before a multi-token append (a prompt) to a non-empty state (the end of the previous
//     turn: where an edited turn or a dropped reasoning block diverges);
//   * end: after a multi-token evaluation whose last logits were computed (a prompt's end; the logits
//     are kept, so a regenerate evaluates nothing);
//   * grid: after any evaluation (prompt chunk or generated token) that crosses a multiple of `grid`
//     positions (the engine's n_batch). Grid checkpoints of one timeline thin geometrically as they
//     age: at age a = (newest grid index - its grid index) >= 4 one is kept only when its grid index is
//     a multiple of 2^(floor(log2 a) - 1), i.e. about two per doubling of the distance from the newest.
// Beyond the byte budget, the least recently used checkpoints (created or restored longest ago) are
// dropped first. A checkpoint alone larger than the budget is not kept.
#pragma once
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <span>
#include <vector>

#include "models/deepseek4.h"

namespace fathom {

class ds4_checkpoints {
  public:
    // budget_bytes > 0; grid >= 1 (positions between grid checkpoints).
    ds4_checkpoints(uint64_t budget_bytes, int64_t grid);
    ~ds4_checkpoints();
    ds4_checkpoints(const ds4_checkpoints &) = delete;
    ds4_checkpoints &operator=(const ds4_checkpoints &) = delete;

    // Hooks. `tokens` are what `st` holds (tokens.size() == st.n_past).
    // Before `n_new` tokens are appended to st (a start checkpoint when st is not empty and n_new >= 2).
    void before_append(const ds4::state &st, std::span<const int32_t> tokens, int64_t n_new);
    // After st went from n_before to tokens.size() tokens; `logits` (may be empty) are the last token's.
    void after_eval(const ds4::state &st, std::span<const int32_t> tokens, int64_t n_before,
                    std::span<const float> logits);

    // The longest checkpoint whose tokens are a prefix of `prefix`, longer than `min_len` tokens, and
    // (when it is all of `prefix`) carrying logits: its length, or 0 when none.
    size_t longest(std::span<const int32_t> prefix) const;
    // Restores that checkpoint into st / tokens / logits (logits empty when it has none; `logits`
    // keeps its size, n_vocab, and gets the saved values). false, changing nothing, when none.
    bool restore(std::span<const int32_t> prefix, size_t min_len, ds4::state &st,
                 std::vector<int32_t> &tokens, std::vector<float> &logits, bool &has_logits);

    struct stats {
        uint64_t checkpoints = 0;  // held now
        uint64_t bytes = 0;        // their fixed parts, logits and every live segment
        uint64_t taken = 0, restored = 0, evicted = 0, thinned = 0;
    };
    stats get_stats() const;
    uint64_t budget() const { return budget_; }

    // engine_options::ds4_checkpoint_mib -> the budget in bytes (0: off). Throws fathom::error for a
    // negative value or one above this machine's physical memory.
    static uint64_t budget_from_mib(int64_t mib);

    // Bytes of one checkpoint's fixed part (raw rings, frontiers) for a state of this model: what a
    // checkpoint costs beyond the rows its segment adds (docs/ds4.md gives the DS4-Flash figures).
    static uint64_t fixed_bytes(const ds4::state &st);

  private:
    struct segment;
    struct checkpoint;
    enum class kind { start, end, grid };
    void add_locked(const ds4::state &st, std::span<const int32_t> tokens, std::span<const float> logits,
                    kind k);
    // Index into ckpts_ of the longest checkpoint that is a prefix of `toks` (length <= max_len), or -1.
    ptrdiff_t find_locked(std::span<const int32_t> toks, size_t max_len, bool need_logits_at_full) const;
    void thin_locked(std::span<const int32_t> toks, int64_t newest_grid);
    void evict_locked();
    uint64_t bytes_locked() const;

    const uint64_t budget_;
    const int64_t grid_;
    mutable std::mutex mu_;
    std::vector<std::unique_ptr<checkpoint>> ckpts_;
    std::shared_ptr<std::atomic<uint64_t>> segment_bytes_;  // live segments' bytes (each subtracts its own)
    uint64_t clock_ = 0;                                    // LRU
    stats stats_;
};

}  // namespace fathom
