// KV block pool accounting (see paged_pool.h).
#include "kv/paged_pool.h"

#include <limits>

#include "core/error.h"

namespace fathom {

kv_block_pool::kv_block_pool(int64_t n_blocks, int32_t block_tokens, int n_seqs) : block_tokens_(block_tokens) {
    if (n_blocks < 1 || n_blocks > std::numeric_limits<int32_t>::max())
        throw error("kv pool: block count must be in [1, 2^31), got " + std::to_string(n_blocks));
    if (block_tokens < 1) throw error("kv pool: block size must be >= 1 token, got " + std::to_string(block_tokens));
    if (n_seqs < 1) throw error("kv pool: need at least one sequence");
    owner_.assign(size_t(n_blocks), -1);
    free_.reserve(size_t(n_blocks));
    for (int64_t b = n_blocks - 1; b >= 0; --b) free_.push_back(int32_t(b));  // hands out 0, 1, 2, ...
    tables_.resize(size_t(n_seqs));
}

int64_t kv_block_pool::blocks_for(int64_t tokens) const {
    if (tokens < 0) throw error("kv pool: negative token count");
    return (tokens + block_tokens_ - 1) / block_tokens_;
}

void kv_block_pool::check_seq(int seq, const char *op) const {
    if (seq < 0 || size_t(seq) >= tables_.size())
        throw error(std::string("kv pool: ") + op + ": sequence " + std::to_string(seq) + " outside [0, " +
                    std::to_string(tables_.size()) + ")");
}

bool kv_block_pool::reserve(int seq, int64_t tokens) {
    check_seq(seq, "reserve");
    auto &t = tables_[size_t(seq)];
    const int64_t need = blocks_for(tokens) - int64_t(t.size());
    if (need <= 0) return true;
    if (need > n_free()) return false;
    for (int64_t i = 0; i < need; ++i) {
        const int32_t b = free_.back();
        free_.pop_back();
        owner_[size_t(b)] = seq;
        t.push_back(b);
    }
    return true;
}

void kv_block_pool::shrink(int seq, int64_t tokens) {
    check_seq(seq, "shrink");
    auto &t = tables_[size_t(seq)];
    const size_t keep = size_t(blocks_for(tokens));
    while (t.size() > keep) {
        const int32_t b = t.back();
        t.pop_back();
        owner_[size_t(b)] = -1;
        free_.push_back(b);
    }
}

void kv_block_pool::add_blocks(int64_t n) {
    if (n < 1 || n_blocks() + n > std::numeric_limits<int32_t>::max())
        throw error("kv pool: cannot add " + std::to_string(n) + " blocks to " + std::to_string(n_blocks()));
    const int64_t first = n_blocks();
    owner_.resize(size_t(first + n), -1);
    // The new ids go under the free stack's existing entries, lowest on top: recently freed blocks
    // (memory already resident) are handed out before fresh ones.
    std::vector<int32_t> fresh;
    fresh.reserve(size_t(n));
    for (int64_t b = first + n - 1; b >= first; --b) fresh.push_back(int32_t(b));
    free_.insert(free_.begin(), fresh.begin(), fresh.end());
}

int kv_block_pool::add_seq() {
    tables_.emplace_back();
    return int(tables_.size()) - 1;
}

const std::vector<int32_t> &kv_block_pool::table(int seq) const {
    check_seq(seq, "table");
    return tables_[size_t(seq)];
}

int kv_block_pool::owner(int32_t block) const {
    if (block < 0 || size_t(block) >= owner_.size()) throw error("kv pool: block " + std::to_string(block) + " out of range");
    return owner_[size_t(block)];
}

void kv_block_pool::check() const {
    std::vector<int> seen(owner_.size(), 0);
    for (int32_t b : free_) {
        if (owner_[size_t(b)] != -1) throw error("kv pool: free block " + std::to_string(b) + " has an owner");
        ++seen[size_t(b)];
    }
    for (size_t s = 0; s < tables_.size(); ++s)
        for (int32_t b : tables_[s]) {
            if (owner_[size_t(b)] != int(s)) throw error("kv pool: block " + std::to_string(b) + " owner mismatch");
            ++seen[size_t(b)];
        }
    for (size_t b = 0; b < seen.size(); ++b)
        if (seen[b] != 1) throw error("kv pool: block " + std::to_string(b) + " accounted " + std::to_string(seen[b]) + " times");
}

}  // namespace fathom
