// KV block pool: the KV memory budget of a server, cut into fixed-size blocks of `block_tokens`
// token positions, with one block table (list of block ids) per sequence. The scheduler reserves a
// request's blocks before admitting it and frees them when it ends, so the KV memory in use can
// never exceed the budget: a request that does not fit waits in the queue (or is refused when it
// could never fit) instead of running the process out of memory.
//
// Two users: the dense engine's physical pool (src/kv/kv_pool.h) keeps one of these as the record
// of which block holds which sequence's positions (block b of a sequence's table holds positions
// [b * block_tokens, (b + 1) * block_tokens) of that sequence, wherever block b's memory is); the
// scheduler keeps its own only for engines whose sessions own their KV memory (DS4, the tests'
// fake engine), where the blocks count memory without placing it.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace fathom {

class kv_block_pool {
public:
    // n_blocks >= 1, block_tokens >= 1, n_seqs sequences (ids 0..n_seqs-1) with empty tables.
    kv_block_pool(int64_t n_blocks, int32_t block_tokens, int n_seqs);

    int32_t block_tokens() const { return block_tokens_; }
    int64_t n_blocks() const { return int64_t(owner_.size()); }
    int64_t n_free() const { return int64_t(free_.size()); }
    int64_t n_used() const { return n_blocks() - n_free(); }
    // Blocks needed to hold `tokens` positions (ceil; 0 for 0).
    int64_t blocks_for(int64_t tokens) const;

    // Grow seq's table to cover `tokens` positions. All or nothing: returns false and allocates
    // nothing when the free blocks do not suffice. Never shrinks.
    bool reserve(int seq, int64_t tokens);
    // Shrink seq's table to the blocks covering `tokens` positions, freeing the rest.
    void shrink(int seq, int64_t tokens);
    void release(int seq) { shrink(seq, 0); }

    // Growth (the engine's pool allocates memory in arenas): n more free blocks, ids n_blocks()..;
    // one more sequence with an empty table, whose id is returned.
    void add_blocks(int64_t n);
    int add_seq();
    int n_seqs() const { return int(tables_.size()); }

    const std::vector<int32_t> &table(int seq) const;
    int64_t held(int seq) const { return int64_t(table(seq).size()); }
    // Owner of a block (-1 when free); for tests and consistency checks.
    int owner(int32_t block) const;
    // Throws fathom::error when the free list, tables and owners disagree (tests).
    void check() const;

private:
    void check_seq(int seq, const char *op) const;
    int32_t block_tokens_;
    std::vector<int32_t> free_;               // stack of free block ids
    std::vector<int> owner_;                  // [n_blocks] owning sequence or -1
    std::vector<std::vector<int32_t>> tables_;  // [n_seqs] block ids in position order
};

}  // namespace fathom
