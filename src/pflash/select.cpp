// PFlash span selection (see select.h).
#include "pflash/select.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <unordered_map>

#include <xxhash.h>

namespace fathom::pflash {

std::vector<float> smooth_scores(std::span<const float> x, int32_t k) {
    const int64_t n = static_cast<int64_t>(x.size()), h = std::max(0, k / 2);
    std::vector<double> pre(static_cast<size_t>(n) + 1, 0.0);  // prefix sums: window means in O(n)
    for (int64_t i = 0; i < n; ++i) pre[static_cast<size_t>(i) + 1] = pre[static_cast<size_t>(i)] + x[static_cast<size_t>(i)];
    std::vector<float> y(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) {
        const int64_t a = std::max<int64_t>(0, i - h), b = std::min<int64_t>(n, i + h + 1);
        y[static_cast<size_t>(i)] = static_cast<float>((pre[static_cast<size_t>(b)] - pre[static_cast<size_t>(a)]) /
                                                      static_cast<double>(b - a));
    }
    return y;
}

std::vector<float> chunk_means(std::span<const float> x, int32_t chunk) {
    std::vector<float> out;
    for (size_t c = 0; c < x.size(); c += static_cast<size_t>(chunk)) {
        const size_t e = std::min(x.size(), c + static_cast<size_t>(chunk));
        double s = 0;
        for (size_t i = c; i < e; ++i) s += x[i];
        out.push_back(static_cast<float>(s / static_cast<double>(e - c)));
    }
    return out;
}

std::vector<bool> anchor_chunks(std::span<const int32_t> ids, const options &o) {
    const int64_t n = static_cast<int64_t>(ids.size()), g = o.anchor_ngram, C = o.chunk_tokens;
    std::vector<bool> forced(static_cast<size_t>((n + C - 1) / C), false);
    if (g <= 0 || n < 2 * g) return forced;
    const int64_t tail0 = std::max<int64_t>(0, n - o.anchor_tail_tokens);
    auto gram_hash = [&](int64_t i) { return XXH3_64bits(ids.data() + i, static_cast<size_t>(g) * sizeof(int32_t)); };
    // The query tail's distinct n-grams -> their earlier occurrences (positions < tail0).
    std::unordered_map<uint64_t, std::vector<int64_t>> tail_grams;
    for (int64_t i = tail0; i + g <= n; ++i) tail_grams.emplace(gram_hash(i), std::vector<int64_t>{});
    if (tail_grams.empty()) return forced;
    for (int64_t i = 0; i + g <= tail0; ++i) {
        const auto it = tail_grams.find(gram_hash(i));
        if (it == tail_grams.end()) continue;
        // Hash equality is not enough: confirm against one tail occurrence of the n-gram.
        bool same = false;
        for (int64_t j = tail0; j + g <= n && !same; ++j)
            same = std::equal(ids.begin() + i, ids.begin() + i + g, ids.begin() + j);
        if (!same) continue;
        // One entry past anchor_max_hits is enough to know the n-gram is too common (caps memory).
        if (static_cast<int64_t>(it->second.size()) <= o.anchor_max_hits) it->second.push_back(i);
    }
    for (const auto &[h, occ] : tail_grams) {
        if (occ.empty() || static_cast<int64_t>(occ.size()) > o.anchor_max_hits) continue;
        for (int64_t p : occ) {
            const int64_t a = std::max<int64_t>(0, p - o.anchor_radius_tokens);
            const int64_t b = std::min<int64_t>(n, p + g + o.anchor_radius_tokens);  // exclusive
            for (int64_t c = a / C; c <= (b - 1) / C; ++c) forced[static_cast<size_t>(c)] = true;
        }
    }
    return forced;
}

int64_t chunk_budget(int64_t n_chunks, const options &o) {
    if (o.keep_ratio == 0.0) return 0;
    const int64_t want = std::max<int64_t>(o.min_chunks, std::llround(o.keep_ratio * static_cast<double>(n_chunks)));
    return std::min(want, n_chunks);
}

namespace {

// Widen ranges by the atomic blocks they touch (a block is kept whole or not at all).
std::vector<byte_span> widen_atomic(std::vector<byte_span> kept, std::span<const byte_span> atomic) {
    kept = merge_ranges(std::move(kept));
    for (bool changed = true; changed;) {
        changed = false;
        for (byte_span &r : kept) {
            for (const byte_span &a : atomic) {
                if (a.begin < r.end && r.begin < a.end && (a.begin < r.begin || a.end > r.end)) {
                    r.begin = std::min(r.begin, a.begin);
                    r.end = std::max(r.end, a.end);
                    changed = true;
                }
            }
        }
        kept = merge_ranges(std::move(kept));
    }
    return kept;
}

}  // namespace

selection select_spans(std::span<const int32_t> ids, std::span<const byte_span> spans,
                       std::span<const float> chunk_scores, const prompt_structure &st, std::string_view text,
                       const options &o) {
    const int64_t n = static_cast<int64_t>(ids.size()), C = o.chunk_tokens;
    const int64_t n_chunks = (n + C - 1) / C;
    selection sel;
    sel.kept_chunk.assign(static_cast<size_t>(n_chunks), false);
    auto chunk_bytes = [&](int64_t c) {
        const int64_t a = c * C, b = std::min(n, a + C) - 1;
        return byte_span{spans[static_cast<size_t>(a)].begin, spans[static_cast<size_t>(b)].end};
    };

    // Forced chunks: head, tail, anchors, and chunks overlapping forced structure.
    std::vector<bool> forced = anchor_chunks(ids, o);
    for (int64_t c = 0; c < n_chunks; ++c) {
        if (c < o.head_chunks || c >= n_chunks - o.tail_chunks) forced[static_cast<size_t>(c)] = true;
        const byte_span cb = chunk_bytes(c);
        for (const byte_span &f : st.forced)
            if (f.begin < cb.end && cb.begin < f.end) forced[static_cast<size_t>(c)] = true;
    }
    int64_t kept = 0;
    for (int64_t c = 0; c < n_chunks; ++c) {
        if (!forced[static_cast<size_t>(c)]) continue;
        sel.kept_chunk[static_cast<size_t>(c)] = true;
        ++kept;
    }
    sel.n_forced = kept;

    // Fill the budget with the best-scoring other chunks (ties: earlier first).
    std::vector<int64_t> order(static_cast<size_t>(n_chunks));
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
        return chunk_scores[static_cast<size_t>(a)] > chunk_scores[static_cast<size_t>(b)];
    });
    const int64_t budget = chunk_budget(n_chunks, o);
    for (int64_t c : order) {
        if (kept >= budget) break;
        if (sel.kept_chunk[static_cast<size_t>(c)]) continue;
        sel.kept_chunk[static_cast<size_t>(c)] = true;
        ++kept;
    }

    std::vector<byte_span> ranges(st.forced.begin(), st.forced.end());
    for (int64_t c = 0; c < n_chunks; ++c)
        if (sel.kept_chunk[static_cast<size_t>(c)]) ranges.push_back(chunk_bytes(c));
    sel.kept = snap_utf8(text, widen_atomic(std::move(ranges), st.atomic));
    return sel;
}

}  // namespace fathom::pflash
