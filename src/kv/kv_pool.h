// Paged KV memory of the dense family: ONE pool per engine, shared by all of its sessions. The
// pool's memory is cut into blocks of `block_tokens` token positions; each block holds, for every
// layer, the K and V rows of those positions for every kv head:
//
//   block  [n_layer][2 (K, V)][n_head_kv][block_tokens][head_dim]   (f16 or f32 elements)
//
// so one sequence's keys of one head inside one block are contiguous (what the attention's inner
// loop streams), and a block is one contiguous range of memory. A sequence (one session) owns a
// block table: the ids of its blocks in position order, position p living in block
// table[p / block_tokens] at row p % block_tokens. Sequences grow block by block as they evaluate
// tokens and give blocks back when they are truncated, reset or closed; the attention reads K/V
// through the table (backend::attention_paged), never through a gathered copy.
//
// Memory: blocks live in arenas of `arena_blocks` blocks allocated from the backend when the free
// blocks run out (the CPU backend maps them lazily, so untouched blocks cost no resident memory).
// max_blocks > 0 caps the pool (a KV memory budget: the server sets it from --kv-mem or from
// --parallel x --ctx); 0 lets it grow with demand, like a contiguous cache per session would.
// Freed blocks go back on a free stack and are reused first, so the resident set stays at the
// high-water mark of blocks in use; arenas are returned to the backend only by configure() or
// when the pool is destroyed.
//
// The block accounting (kv_block_pool) is the single record of KV use: the scheduler's
// admission control, the /metrics gauges and session truncation all read and change it here.
// Thread-safe: every member takes the pool's mutex (sessions of one engine may live on different
// threads; their forward passes are serialised by the engine).
#pragma once
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "backend/backend.h"
#include "kv/paged_pool.h"

namespace fathom {

class kv_pool {
public:
    // block_tokens: a power of two >= 8; arena_blocks >= 1; max_blocks >= 0 (0 = no cap).
    kv_pool(backend &be, int32_t n_layer, int32_t n_head_kv, int32_t head_dim, dtype type, int32_t block_tokens,
            int64_t arena_blocks, int64_t max_blocks);
    ~kv_pool();
    kv_pool(const kv_pool &) = delete;
    kv_pool &operator=(const kv_pool &) = delete;

    // Change the block size and the cap. Only while no block is in use (throws otherwise); the
    // arenas allocated so far are released. Open sequences stay open (with empty tables).
    void configure(int32_t block_tokens, int64_t arena_blocks, int64_t max_blocks);

    int32_t block_tokens() const;
    int64_t max_blocks() const;   // 0 = no cap
    int64_t n_blocks() const;     // blocks allocated so far (arenas)
    int64_t n_used() const;       // blocks in some sequence's table
    // Blocks a reserve() could still obtain: the free ones plus, under a cap, those not yet
    // allocated (INT64_MAX without a cap).
    int64_t n_available() const;
    int64_t blocks_for(int64_t tokens) const;
    size_t block_bytes() const { return block_bytes_; }
    int32_t n_layer() const { return n_layer_; }
    int32_t n_head_kv() const { return n_head_kv_; }
    int32_t head_dim() const { return head_dim_; }
    dtype type() const { return type_; }

    // Sequences: ids are reused after close. close() frees the sequence's blocks.
    int seq_open();
    void seq_close(int seq);
    // Grow seq's table to cover positions [0, tokens), allocating arenas as needed. All or
    // nothing: false (and nothing allocated) when the cap does not leave enough blocks.
    bool reserve(int seq, int64_t tokens);
    // Shrink seq's table to the blocks covering `tokens` positions, freeing the rest.
    void shrink(int seq, int64_t tokens);
    int64_t held(int seq) const;  // blocks in seq's table
    std::vector<int32_t> table(int seq) const;

    // Base address of every block of seq's table, in position order (out is resized), and the
    // kv_pages of one layer over such a list (valid until the table changes).
    void block_addrs(int seq, std::vector<uint8_t *> &out) const;
    kv_pages pages(const std::vector<uint8_t *> &addrs, int32_t layer) const;

    // Throws fathom::error when the accounting is inconsistent (tests).
    void check() const;

private:
    uint8_t *addr_locked(int32_t block) const;
    bool grow_locked(int64_t need_free);
    void release_arenas_locked();

    backend &be_;
    const int32_t n_layer_, n_head_kv_, head_dim_;
    const dtype type_;
    int32_t block_tokens_ = 0;
    int64_t arena_blocks_ = 0, max_blocks_ = 0;
    size_t block_bytes_ = 0;       // one block, all layers, K and V (64-byte multiple)
    size_t half_bytes_ = 0;        // one layer's K (or V) part of a block: n_head_kv * block_tokens rows
    mutable std::mutex mu_;
    std::vector<void *> arenas_;   // arena i holds blocks [i * arena_blocks, (i + 1) * arena_blocks)
    std::unique_ptr<kv_block_pool> acct_;  // null until the first arena
    int n_seqs_ = 0;               // sequence ids handed out so far (0..n_seqs_-1)
    std::vector<int> free_seqs_;   // closed ids, reused first
    std::vector<bool> open_;       // [n_seqs_]
};

}  // namespace fathom
