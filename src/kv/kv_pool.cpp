// Paged KV pool of the dense family (see kv_pool.h).
#include "kv/kv_pool.h"

#include <algorithm>
#include <bit>
#include <limits>
#include <string>

#include "core/error.h"

namespace fathom {

namespace {

void check_geometry(int32_t block_tokens, int64_t arena_blocks, int64_t max_blocks) {
    if (block_tokens < 8 || block_tokens > 4096 || !std::has_single_bit(static_cast<uint32_t>(block_tokens)))
        throw error("kv pool: block size must be a power of two in [8, 4096] tokens, got " + std::to_string(block_tokens));
    if (arena_blocks < 1) throw error("kv pool: arena must hold at least one block");
    if (max_blocks < 0 || max_blocks >= std::numeric_limits<int32_t>::max())
        throw error("kv pool: block cap must be in [0, 2^31), got " + std::to_string(max_blocks));
}

}  // namespace

kv_pool::kv_pool(backend &be, int32_t n_layer, int32_t n_head_kv, int32_t head_dim, dtype type, int32_t block_tokens,
                 int64_t arena_blocks, int64_t max_blocks)
    : be_(be), n_layer_(n_layer), n_head_kv_(n_head_kv), head_dim_(head_dim), type_(type) {
    if (type != dtype::f16 && type != dtype::f32) throw error("kv pool: type must be f16 or f32");
    if (n_layer <= 0 || n_head_kv <= 0 || head_dim <= 0) throw error("kv pool: invalid geometry");
    configure(block_tokens, arena_blocks, max_blocks);
}

kv_pool::~kv_pool() { release_arenas_locked(); }

void kv_pool::release_arenas_locked() {
    for (void *a : arenas_) be_.release(a);
    arenas_.clear();
    acct_.reset();
}

void kv_pool::configure(int32_t block_tokens, int64_t arena_blocks, int64_t max_blocks) {
    check_geometry(block_tokens, arena_blocks, max_blocks);
    std::lock_guard<std::mutex> lk(mu_);
    if (acct_ && acct_->n_used() > 0)
        throw error("kv pool: cannot change the block size or cap while " + std::to_string(acct_->n_used()) +
                    " blocks are in use");
    release_arenas_locked();
    block_tokens_ = block_tokens;
    arena_blocks_ = max_blocks > 0 ? std::min(arena_blocks, max_blocks) : arena_blocks;
    max_blocks_ = max_blocks;
    half_bytes_ = dtype_row_bytes(type_, head_dim_) * static_cast<size_t>(n_head_kv_) * static_cast<size_t>(block_tokens);
    block_bytes_ = (half_bytes_ * 2 * static_cast<size_t>(n_layer_) + 63) & ~size_t{63};
}

int32_t kv_pool::block_tokens() const {
    std::lock_guard<std::mutex> lk(mu_);
    return block_tokens_;
}

int64_t kv_pool::max_blocks() const {
    std::lock_guard<std::mutex> lk(mu_);
    return max_blocks_;
}

int64_t kv_pool::n_blocks() const {
    std::lock_guard<std::mutex> lk(mu_);
    return acct_ ? acct_->n_blocks() : 0;
}

int64_t kv_pool::n_used() const {
    std::lock_guard<std::mutex> lk(mu_);
    return acct_ ? acct_->n_used() : 0;
}

int64_t kv_pool::n_available() const {
    std::lock_guard<std::mutex> lk(mu_);
    if (max_blocks_ == 0) return std::numeric_limits<int64_t>::max();
    return max_blocks_ - (acct_ ? acct_->n_used() : 0);
}

int64_t kv_pool::blocks_for(int64_t tokens) const {
    if (tokens < 0) throw error("kv pool: negative token count");
    std::lock_guard<std::mutex> lk(mu_);
    return (tokens + block_tokens_ - 1) / block_tokens_;
}

int kv_pool::seq_open() {
    std::lock_guard<std::mutex> lk(mu_);
    int seq;
    if (!free_seqs_.empty()) {
        seq = free_seqs_.back();
        free_seqs_.pop_back();
    } else {
        seq = n_seqs_++;
        open_.push_back(false);
        while (acct_ && acct_->n_seqs() < n_seqs_) acct_->add_seq();
    }
    open_[size_t(seq)] = true;
    return seq;
}

void kv_pool::seq_close(int seq) {
    std::lock_guard<std::mutex> lk(mu_);
    if (seq < 0 || seq >= n_seqs_ || !open_[size_t(seq)]) throw error("kv pool: close of a sequence that is not open");
    if (acct_) acct_->release(seq);
    open_[size_t(seq)] = false;
    free_seqs_.push_back(seq);
}

// Under mu_: make at least need_free blocks free, allocating arenas within the cap. All or nothing.
bool kv_pool::grow_locked(int64_t need_free) {
    const int64_t have = acct_ ? acct_->n_blocks() : 0, free_now = acct_ ? acct_->n_free() : 0;
    if (free_now >= need_free) return true;
    const int64_t missing = need_free - free_now;
    if (max_blocks_ > 0 && have + missing > max_blocks_) return false;
    // Whole arenas (the last one cut at the cap), so block b always lives in arena b / arena_blocks_.
    int64_t add = 0;
    std::vector<void *> fresh;
    try {
        while (add < missing) {
            int64_t n = arena_blocks_;
            if (max_blocks_ > 0) n = std::min(n, max_blocks_ - have - add);
            fresh.push_back(be_.alloc(block_bytes_ * static_cast<size_t>(n)));
            add += n;
        }
    } catch (...) {
        for (void *a : fresh) be_.release(a);
        throw;
    }
    arenas_.insert(arenas_.end(), fresh.begin(), fresh.end());
    if (!acct_) acct_ = std::make_unique<kv_block_pool>(add, block_tokens_, std::max(1, n_seqs_));
    else acct_->add_blocks(add);
    return true;
}

bool kv_pool::reserve(int seq, int64_t tokens) {
    if (tokens < 0) throw error("kv pool: negative token count");
    std::lock_guard<std::mutex> lk(mu_);
    if (seq < 0 || seq >= n_seqs_ || !open_[size_t(seq)]) throw error("kv pool: reserve for a sequence that is not open");
    const int64_t want = (tokens + block_tokens_ - 1) / block_tokens_;
    const int64_t held = acct_ ? acct_->held(seq) : 0;
    if (want <= held) return true;
    if (!grow_locked(want - held)) return false;
    return acct_->reserve(seq, tokens);
}

void kv_pool::shrink(int seq, int64_t tokens) {
    std::lock_guard<std::mutex> lk(mu_);
    if (seq < 0 || seq >= n_seqs_ || !open_[size_t(seq)]) throw error("kv pool: shrink of a sequence that is not open");
    if (acct_) acct_->shrink(seq, tokens);
}

int64_t kv_pool::held(int seq) const {
    std::lock_guard<std::mutex> lk(mu_);
    if (seq < 0 || seq >= n_seqs_) throw error("kv pool: unknown sequence " + std::to_string(seq));
    return acct_ ? acct_->held(seq) : 0;
}

std::vector<int32_t> kv_pool::table(int seq) const {
    std::lock_guard<std::mutex> lk(mu_);
    if (seq < 0 || seq >= n_seqs_) throw error("kv pool: unknown sequence " + std::to_string(seq));
    return acct_ ? acct_->table(seq) : std::vector<int32_t>{};
}

uint8_t *kv_pool::addr_locked(int32_t block) const {
    return static_cast<uint8_t *>(arenas_[size_t(block / arena_blocks_)]) +
           static_cast<size_t>(block % arena_blocks_) * block_bytes_;
}

void kv_pool::block_addrs(int seq, std::vector<uint8_t *> &out) const {
    std::lock_guard<std::mutex> lk(mu_);
    if (seq < 0 || seq >= n_seqs_) throw error("kv pool: unknown sequence " + std::to_string(seq));
    out.clear();
    if (!acct_) return;
    for (int32_t b : acct_->table(seq)) out.push_back(addr_locked(b));
}

kv_pages kv_pool::pages(const std::vector<uint8_t *> &addrs, int32_t layer) const {
    if (layer < 0 || layer >= n_layer_) throw error("kv pool: layer " + std::to_string(layer) + " out of range");
    kv_pages p;
    p.blocks = addrs.data();
    p.n_blocks = static_cast<int64_t>(addrs.size());
    p.n_head_kv = n_head_kv_;
    p.head_dim = head_dim_;
    p.type = type_;
    std::lock_guard<std::mutex> lk(mu_);
    p.block_tokens = block_tokens_;
    p.k_offset = static_cast<size_t>(layer) * 2 * half_bytes_;
    p.v_offset = p.k_offset + half_bytes_;
    return p;
}

void kv_pool::check() const {
    std::lock_guard<std::mutex> lk(mu_);
    if (!acct_) return;
    acct_->check();
    if (acct_->n_seqs() != std::max(1, n_seqs_)) throw error("kv pool: sequence count mismatch");
    for (int s = 0; s < n_seqs_; ++s)
        if (!open_[size_t(s)] && acct_->held(s) != 0) throw error("kv pool: closed sequence holds blocks");
    int64_t cap = 0;
    for (size_t i = 0; i < arenas_.size(); ++i) cap += arena_blocks_;
    if (acct_->n_blocks() > cap) throw error("kv pool: more blocks than arena memory");
    if (max_blocks_ > 0 && acct_->n_blocks() > max_blocks_) throw error("kv pool: blocks beyond the cap");
}

}  // namespace fathom
