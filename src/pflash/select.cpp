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

bool is_content_piece(std::string_view piece) {
    for (size_t i = 0; i < piece.size(); ++i) {
        const auto c = static_cast<unsigned char>(piece[i]);
        if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z')) return true;
        if (c < 0xC0) continue;  // ASCII non-letter, or a continuation byte
        // A non-ASCII lead byte: content unless General Punctuation (U+2000..U+206F: E2 80..81 xx) or
        // CJK Symbols and Punctuation (U+3000..U+303F: E3 80 xx).
        const auto n = i + 1 < piece.size() ? static_cast<unsigned char>(piece[i + 1]) : 0u;
        if ((c == 0xE2 && (n == 0x80 || n == 0x81)) || (c == 0xE3 && n == 0x80)) continue;
        return true;
    }
    return false;
}

byte_span anchor_query_bytes(const prompt_structure &st, std::string_view text) {
    for (auto it = st.turns.rbegin(); it != st.turns.rend(); ++it)
        if (it->role == "user") return it->content;
    return {0, text.size()};
}

namespace {

bool is_word_byte(char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9');
}

// A boundary at byte b cuts a word when ASCII letters/digits touch on both sides ("entry 4|7").
bool cuts_word(std::string_view text, uint64_t b) {
    return b > 0 && b < text.size() && is_word_byte(text[b - 1]) && is_word_byte(text[b]);
}

}  // namespace

std::vector<anchor_group> anchor_groups(std::span<const int32_t> ids, std::span<const byte_span> spans,
                                        std::string_view text, byte_span query, const options &o) {
    const int64_t n = static_cast<int64_t>(ids.size()), g = o.anchor_ngram, C = o.chunk_tokens;
    if (g <= 0 || n < 2 * g || o.anchor_tail_tokens <= 0) return {};
    // Query tokens: the last anchor_tail_tokens drafter tokens inside `query` (and non-empty).
    std::vector<int64_t> q;
    for (int64_t i = n - 1; i >= 0 && static_cast<int64_t>(q.size()) < o.anchor_tail_tokens; --i) {
        const byte_span &s = spans[static_cast<size_t>(i)];
        if (s.begin >= query.begin && s.end <= query.end && s.end > s.begin) q.push_back(i);
        else if (s.end <= query.begin) break;
    }
    std::reverse(q.begin(), q.end());
    if (static_cast<int64_t>(q.size()) < g) return {};
    const int64_t q0 = q.front();  // occurrences must end before the query starts
    auto piece = [&](int64_t i) {
        const byte_span &s = spans[static_cast<size_t>(i)];
        return text.substr(s.begin, s.end - s.begin);
    };
    // An n-gram starting at token i qualifies: contiguous tokens, whole words, one content token.
    auto whole_words = [&](int64_t i) {
        for (int64_t k = i; k + 1 < i + g; ++k)
            if (spans[static_cast<size_t>(k)].end != spans[static_cast<size_t>(k + 1)].begin) return false;
        return !cuts_word(text, spans[static_cast<size_t>(i)].begin) &&
               !cuts_word(text, spans[static_cast<size_t>(i + g - 1)].end);
    };
    struct gram {
        int64_t start;              // token index in the query
        std::vector<int64_t> occ;   // earlier occurrences (at most anchor_max_hits + 1 recorded)
    };
    std::vector<gram> grams;
    std::unordered_map<uint64_t, size_t> by_hash;  // n-gram hash -> grams index (first in query order)
    auto gram_hash = [&](int64_t i) { return XXH3_64bits(ids.data() + i, static_cast<size_t>(g) * sizeof(int32_t)); };
    for (size_t k = 0; k + static_cast<size_t>(g) <= q.size(); ++k) {
        const int64_t i = q[k];
        if (q[k + static_cast<size_t>(g) - 1] != i + g - 1 || !whole_words(i)) continue;
        bool content = false;
        for (int64_t j = i; j < i + g && !content; ++j) content = is_content_piece(piece(j));
        if (!content) continue;
        if (by_hash.emplace(gram_hash(i), grams.size()).second) grams.push_back({i, {}});
    }
    if (grams.empty()) return {};
    for (int64_t i = 0; i + g <= q0; ++i) {
        const auto it = by_hash.find(gram_hash(i));
        if (it == by_hash.end()) continue;
        gram &gr = grams[it->second];
        // Hash equality is not enough: compare the tokens; then the occurrence must not cut a word either.
        if (!std::equal(ids.begin() + i, ids.begin() + i + g, ids.begin() + gr.start) || !whole_words(i)) continue;
        if (static_cast<int64_t>(gr.occ.size()) <= o.anchor_max_hits) gr.occ.push_back(i);  // one past = too common
    }
    std::vector<size_t> order;
    for (size_t k = 0; k < grams.size(); ++k) {
        const int64_t h = static_cast<int64_t>(grams[k].occ.size());
        if (h >= 1 && h <= o.anchor_max_hits) order.push_back(k);
    }
    // Latest in the query first (the question sits at the end, after any document text that falls
    // inside the query window), then rarest first.
    std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
        if (grams[a].start != grams[b].start) return grams[a].start > grams[b].start;
        return grams[a].occ.size() < grams[b].occ.size();
    });
    auto add_range = [&](std::vector<int64_t> &v, int64_t a, int64_t b) {  // chunks of tokens [a, b)
        for (int64_t c = std::max<int64_t>(0, a) / C; c <= (std::min(n, b) - 1) / C; ++c) v.push_back(c);
    };
    auto sort_unique = [](std::vector<int64_t> &v) {
        std::sort(v.begin(), v.end());
        v.erase(std::unique(v.begin(), v.end()), v.end());
    };
    std::vector<anchor_group> out;
    for (size_t k : order) {
        anchor_group grp;
        for (int64_t p : grams[k].occ) {
            add_range(grp.core, p, p + g);
            add_range(grp.all, p - o.anchor_radius_tokens, p + g + o.anchor_radius_tokens);
        }
        sort_unique(grp.core);
        sort_unique(grp.all);
        if (std::find(out.begin(), out.end(), grp) == out.end()) out.push_back(std::move(grp));
    }
    return out;
}

int64_t anchor_budget(int64_t budget, const options &o) {
    return std::llround(o.anchor_budget_fraction * static_cast<double>(budget));
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

    // Forced chunks: head, tail, and chunks overlapping forced verbatim text. Forced ranges made only of
    // role markers are kept as bytes (added to the ranges below) but force no chunk: a marker is a few
    // tokens, and forcing the chunks around every turn's markers would eat the budget of a long chat.
    std::vector<byte_span> verbatim;
    for (const byte_span &f : st.forced) {
        uint64_t marker_bytes = 0;  // headers and footers are disjoint: their overlaps with f add up
        for (const chat_turn &t : st.turns)
            for (const byte_span &m : {t.header, t.footer})
                marker_bytes += std::min(f.end, m.end) > std::max(f.begin, m.begin)
                                    ? std::min(f.end, m.end) - std::max(f.begin, m.begin)
                                    : 0;
        if (marker_bytes < f.end - f.begin) verbatim.push_back(f);
    }
    std::vector<bool> forced(static_cast<size_t>(n_chunks), false);
    for (int64_t c = 0; c < n_chunks; ++c) {
        if (c < o.head_chunks || c >= n_chunks - o.tail_chunks) forced[static_cast<size_t>(c)] = true;
        const byte_span cb = chunk_bytes(c);
        for (const byte_span &f : verbatim)
            if (f.begin < cb.end && cb.begin < f.end) forced[static_cast<size_t>(c)] = true;
    }
    int64_t kept = 0;
    for (int64_t c = 0; c < n_chunks; ++c) {
        if (!forced[static_cast<size_t>(c)]) continue;
        sel.kept_chunk[static_cast<size_t>(c)] = true;
        ++kept;
    }
    sel.n_forced = kept;
    const int64_t budget = chunk_budget(n_chunks, o);

    // Anchors claim their share of the budget, the query's last n-grams first. The share is reserved even when head/tail/structure already fill the budget (many chat
    // turns), so the question's references survive; the output is then at most n_forced + share.
    const int64_t anchor_cap = anchor_budget(budget, o);
    if (anchor_cap > 0) {
        for (const anchor_group &grp : anchor_groups(ids, spans, text, anchor_query_bytes(st, text), o)) {
            // The whole neighbourhood if it fits, else the chunks of the occurrences alone, else nothing.
            for (const std::vector<int64_t> *part : {&grp.all, &grp.core}) {
                int64_t add = 0;
                for (int64_t c : *part) add += sel.kept_chunk[static_cast<size_t>(c)] ? 0 : 1;
                if (sel.n_anchor + add > anchor_cap) continue;
                for (int64_t c : *part) sel.kept_chunk[static_cast<size_t>(c)] = true;
                sel.n_anchor += add;
                kept += add;
                break;
            }
        }
    }

    // Fill the budget with the best-scoring other chunks (ties: earlier first).
    std::vector<int64_t> order(static_cast<size_t>(n_chunks));
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
        return chunk_scores[static_cast<size_t>(a)] > chunk_scores[static_cast<size_t>(b)];
    });
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
