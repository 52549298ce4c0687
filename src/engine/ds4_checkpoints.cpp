// In-RAM prefix checkpoints of DS4 states (see ds4_checkpoints.h).
#include "engine/ds4_checkpoints.h"

#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <string>

#include "core/error.h"

namespace fathom {

namespace {

// Rolling hash of token prefixes: h[i] covers tokens [0, i). Candidates are compared by hash, the chosen
// one then token by token.
std::vector<uint64_t> prefix_hashes(std::span<const int32_t> toks) {
    std::vector<uint64_t> h(toks.size() + 1, 0);
    for (size_t i = 0; i < toks.size(); ++i)
        h[i + 1] = h[i] * 0x100000001b3ull + static_cast<uint64_t>(static_cast<uint32_t>(toks[i])) + 1;
    return h;
}

uint64_t row_bytes(const ds4::row_store &r) {
    return static_cast<uint64_t>(r.width()) * (r.precision() == kv_precision::f32 ? 4 : 2);
}

uint64_t frontier_bytes(const ds4::compressor_state &c) {
    return (c.kv.size() + c.score.size()) * sizeof(float);
}

}  // namespace

// Tokens and compressed / indexer rows of positions [t0, t1) of one timeline; the parent holds [0, t0).
struct ds4_checkpoints::segment {
    mutable std::shared_ptr<const segment> parent;
    int64_t t0 = 0, t1 = 0;
    uint64_t hash = 0;            // of tokens [0, t1)
    std::vector<int32_t> tokens;  // [t0, t1)
    struct rows {
        int64_t begin = 0, end = 0;  // row range of the layer's store
        std::vector<uint8_t> bytes;
    };
    std::vector<rows> comp, idx;  // [layer]
    uint64_t bytes = 0;
    std::shared_ptr<std::atomic<uint64_t>> counter;

    ~segment() {
        *counter -= bytes;
        // Release the chain iteratively (a long timeline must not recurse once per segment).
        std::shared_ptr<const segment> p = std::move(parent);
        while (p && p.use_count() == 1) {
            std::shared_ptr<const segment> next = std::move(p->parent);
            p = std::move(next);
        }
    }
};

struct ds4_checkpoints::checkpoint {
    std::shared_ptr<const segment> seg;
    ds4::state fixed;  // raw rings, frontiers, n_past / reached / floor; no compressed or indexer rows
    std::vector<float> logits;  // empty: none
    kind k = kind::grid;
    uint64_t used = 0;
    uint64_t own_bytes = 0;  // fixed part + logits
    int64_t n() const { return seg->t1; }
};

ds4_checkpoints::ds4_checkpoints(uint64_t budget_bytes, int64_t grid)
    : budget_(budget_bytes),
      grid_(std::max<int64_t>(grid, 1)),
      segment_bytes_(std::make_shared<std::atomic<uint64_t>>(0)) {}

ds4_checkpoints::~ds4_checkpoints() = default;

uint64_t ds4_checkpoints::budget_from_mib(int64_t mib) {
    if (mib < 0)
        throw error("ds4_checkpoint_mib (--ds4-checkpoint-mib) must be >= 0 (0 = no DS4 checkpoints), got " +
                    std::to_string(mib));
    const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGE_SIZE);
    const int64_t machine =
        pages > 0 && page > 0
            ? static_cast<int64_t>((static_cast<uint64_t>(pages) * static_cast<uint64_t>(page)) >> 20)
            : INT64_MAX;
    if (mib > machine)
        throw error("ds4_checkpoint_mib (--ds4-checkpoint-mib) " + std::to_string(mib) +
                    " MiB exceeds this machine's " + std::to_string(machine) + " MiB of memory");
    return static_cast<uint64_t>(mib) << 20;
}

uint64_t ds4_checkpoints::fixed_bytes(const ds4::state &st) {
    uint64_t b = 0;
    for (const ds4::layer_state &ls : st.layers)
        b += ls.raw.bytes().size() + frontier_bytes(ls.comp) + frontier_bytes(ls.idx_comp);
    return b;
}

uint64_t ds4_checkpoints::bytes_locked() const {
    uint64_t b = segment_bytes_->load();
    for (const auto &c : ckpts_) b += c->own_bytes;
    return b;
}

ds4_checkpoints::stats ds4_checkpoints::get_stats() const {
    std::lock_guard<std::mutex> lock(mu_);
    stats s = stats_;
    s.checkpoints = ckpts_.size();
    s.bytes = bytes_locked();
    return s;
}

ptrdiff_t ds4_checkpoints::find_locked(std::span<const int32_t> toks, size_t max_len,
                                       bool need_logits_at_full) const {
    const std::vector<uint64_t> h = prefix_hashes(toks);
    std::vector<size_t> cand;
    for (size_t i = 0; i < ckpts_.size(); ++i) {
        const checkpoint &c = *ckpts_[i];
        const auto n = static_cast<size_t>(c.n());
        if (n > max_len || n > toks.size() || h[n] != c.seg->hash) continue;
        if (need_logits_at_full && n == toks.size() && c.logits.empty()) continue;
        cand.push_back(i);
    }
    std::sort(cand.begin(), cand.end(), [&](size_t a, size_t b) { return ckpts_[a]->n() > ckpts_[b]->n(); });
    for (size_t i : cand) {  // the longest whose tokens really are a prefix (a hash collision is not)
        bool same = true;
        for (const segment *s = ckpts_[i]->seg.get(); s && same; s = s->parent.get())
            same = std::equal(s->tokens.begin(), s->tokens.end(), toks.begin() + s->t0);
        if (same) return static_cast<ptrdiff_t>(i);
    }
    return -1;
}

void ds4_checkpoints::before_append(const ds4::state &st, std::span<const int32_t> tokens, int64_t n_new) {
    if (tokens.empty() || n_new < 2) return;
    std::lock_guard<std::mutex> lock(mu_);
    add_locked(st, tokens, {}, kind::start);
}

void ds4_checkpoints::after_eval(const ds4::state &st, std::span<const int32_t> tokens, int64_t n_before,
                                 std::span<const float> logits) {
    const auto n = static_cast<int64_t>(tokens.size());
    const bool crossed = n / grid_ > n_before / grid_;
    if (logits.empty() && !crossed) return;
    std::lock_guard<std::mutex> lock(mu_);
    add_locked(st, tokens, logits, logits.empty() ? kind::grid : kind::end);
    if (crossed) thin_locked(tokens, n / grid_);
}

void ds4_checkpoints::add_locked(const ds4::state &st, std::span<const int32_t> toks,
                                 std::span<const float> logits, kind k) {
    const auto n = static_cast<int64_t>(toks.size());
    if (n == 0 || st.n_past != n) return;
    const ptrdiff_t same = find_locked(toks, toks.size(), false);
    if (same >= 0 && ckpts_[static_cast<size_t>(same)]->n() == n) {  // already kept: mark it used
        checkpoint &c = *ckpts_[static_cast<size_t>(same)];
        c.used = ++clock_;
        if (c.logits.empty() && !logits.empty()) {
            c.logits.assign(logits.begin(), logits.end());
            c.own_bytes += logits.size() * sizeof(float);
            evict_locked();
        }
        return;
    }
    std::shared_ptr<const segment> parent = same >= 0 ? ckpts_[static_cast<size_t>(same)]->seg : nullptr;
    auto seg = std::make_shared<segment>();
    seg->t0 = parent ? parent->t1 : 0;
    seg->t1 = n;
    seg->hash = prefix_hashes(toks).back();
    seg->tokens.assign(toks.begin() + seg->t0, toks.end());
    seg->comp.resize(st.layers.size());
    seg->idx.resize(st.layers.size());
    uint64_t b = seg->tokens.size() * sizeof(int32_t);
    const auto take = [&](const ds4::row_store &r, segment::rows &out, int64_t begin) {
        out.begin = std::min(begin, r.size());
        out.end = r.size();
        const uint64_t rb = row_bytes(r);
        const auto src = r.bytes();
        out.bytes.assign(src.begin() + static_cast<ptrdiff_t>(out.begin * rb), src.end());
        b += out.bytes.size();
    };
    for (size_t l = 0; l < st.layers.size(); ++l) {
        take(st.layers[l].comp_rows, seg->comp[l], parent ? parent->comp[l].end : 0);
        take(st.layers[l].idx_rows, seg->idx[l], parent ? parent->idx[l].end : 0);
    }
    seg->bytes = b;
    seg->counter = segment_bytes_;
    *segment_bytes_ += b;
    seg->parent = std::move(parent);
    auto c = std::make_unique<checkpoint>();
    c->seg = std::move(seg);
    c->k = k;
    c->used = ++clock_;
    c->fixed.n_past = st.n_past;
    c->fixed.reached = st.reached;
    c->fixed.floor = st.floor;
    c->fixed.exec = st.exec;
    c->fixed.qat = st.qat;
    c->fixed.kv = st.kv;
    c->fixed.layers.resize(st.layers.size());
    for (size_t l = 0; l < st.layers.size(); ++l) {
        const ds4::layer_state &from = st.layers[l];
        ds4::layer_state &to = c->fixed.layers[l];
        to.raw = from.raw;
        to.comp = from.comp;
        to.idx_comp = from.idx_comp;
        to.comp_rows = ds4::row_store(from.comp_rows.width(), from.comp_rows.precision());
        to.idx_rows = ds4::row_store(from.idx_rows.width(), from.idx_rows.precision());
    }
    c->logits.assign(logits.begin(), logits.end());
    c->own_bytes = fixed_bytes(st) + logits.size() * sizeof(float);
    ckpts_.push_back(std::move(c));
    ++stats_.taken;
    evict_locked();
}

void ds4_checkpoints::thin_locked(std::span<const int32_t> toks, int64_t newest_grid) {
    const std::vector<uint64_t> h = prefix_hashes(toks);
    for (size_t i = 0; i < ckpts_.size();) {
        const checkpoint &c = *ckpts_[i];
        const auto n = static_cast<size_t>(c.n());
        const int64_t age = newest_grid - c.n() / grid_;
        bool drop = false;
        if (c.k == kind::grid && n < toks.size() && h[n] == c.seg->hash && age >= 4) {
            const int log2a = 63 - __builtin_clzll(static_cast<unsigned long long>(age));
            const int64_t stride = int64_t{1} << (log2a - 1);
            drop = (c.n() / grid_) % stride != 0;
        }
        if (drop) {
            ckpts_.erase(ckpts_.begin() + static_cast<ptrdiff_t>(i));
            ++stats_.thinned;
        } else {
            ++i;
        }
    }
}

void ds4_checkpoints::evict_locked() {
    while (!ckpts_.empty() && bytes_locked() > budget_) {
        const auto lru = std::min_element(ckpts_.begin(), ckpts_.end(),
                                          [](const auto &a, const auto &b) { return a->used < b->used; });
        ckpts_.erase(lru);
        ++stats_.evicted;
    }
}

size_t ds4_checkpoints::longest(std::span<const int32_t> prefix) const {
    std::lock_guard<std::mutex> lock(mu_);
    const ptrdiff_t i = find_locked(prefix, prefix.size(), true);
    return i < 0 ? 0 : static_cast<size_t>(ckpts_[static_cast<size_t>(i)]->n());
}

bool ds4_checkpoints::restore(std::span<const int32_t> prefix, size_t min_len, ds4::state &st,
                              std::vector<int32_t> &tokens, std::vector<float> &logits, bool &has_logits) {
    std::lock_guard<std::mutex> lock(mu_);
    const ptrdiff_t i = find_locked(prefix, prefix.size(), true);
    if (i < 0 || static_cast<size_t>(ckpts_[static_cast<size_t>(i)]->n()) <= min_len) return false;
    checkpoint &c = *ckpts_[static_cast<size_t>(i)];
    if (c.fixed.layers.size() != st.layers.size()) return false;
    std::vector<const segment *> chain;
    for (const segment *s = c.seg.get(); s; s = s->parent.get()) chain.push_back(s);
    const ds4::exec_options exec = st.exec;
    st = c.fixed;  // rings, frontiers, bookkeeping; the rows below
    st.exec = exec;
    for (size_t l = 0; l < st.layers.size(); ++l) {
        ds4::layer_state &ls = st.layers[l];
        ls.comp_rows.resize(c.seg->comp[l].end);
        ls.idx_rows.resize(c.seg->idx[l].end);
        const uint64_t cb = row_bytes(ls.comp_rows), ib = row_bytes(ls.idx_rows);
        for (const segment *s : chain) {
            const segment::rows &cr = s->comp[l], &ir = s->idx[l];
            if (!cr.bytes.empty())
                std::memcpy(ls.comp_rows.bytes().data() + cr.begin * cb, cr.bytes.data(), cr.bytes.size());
            if (!ir.bytes.empty())
                std::memcpy(ls.idx_rows.bytes().data() + ir.begin * ib, ir.bytes.data(), ir.bytes.size());
        }
    }
    tokens.resize(static_cast<size_t>(c.n()));
    for (const segment *s : chain) std::copy(s->tokens.begin(), s->tokens.end(), tokens.begin() + s->t0);
    has_logits = !c.logits.empty();
    if (has_logits) std::copy(c.logits.begin(), c.logits.end(), logits.begin());
    c.used = ++clock_;
    ++stats_.restored;
    return true;
}

}  // namespace fathom
