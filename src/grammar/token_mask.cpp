// Token masks from the JSON automaton (token_mask.h).
#include "grammar/token_mask.h"

#include <algorithm>
#include <limits>
#include <numeric>

namespace fathom::grammar {

namespace {

// Code points of s when it is ordinary JSON string content (whole UTF-8 characters, RFC 3629; no
// '"', '\\' or byte below 0x20), else 0.
int32_t plain_chars(const std::string &s) {
    int32_t n = 0;
    for (size_t i = 0; i < s.size();) {
        const uint8_t c = uint8_t(s[i]);
        int rem;
        uint8_t lo = 0x80, hi = 0xBF;
        if (c == '"' || c == '\\' || c < 0x20) return 0;
        if (c < 0x80) rem = 0;
        else if (c >= 0xC2 && c <= 0xDF) rem = 1;
        else if (c == 0xE0) rem = 2, lo = 0xA0;
        else if ((c >= 0xE1 && c <= 0xEC) || c == 0xEE || c == 0xEF) rem = 2;
        else if (c == 0xED) rem = 2, hi = 0x9F;
        else if (c == 0xF0) rem = 3, lo = 0x90;
        else if (c >= 0xF1 && c <= 0xF3) rem = 3;
        else if (c == 0xF4) rem = 3, hi = 0x8F;
        else return 0;
        ++i;
        for (int k = 0; k < rem; ++k, ++i) {
            if (i >= s.size()) return 0;
            const uint8_t d = uint8_t(s[i]);
            if (d < lo || d > hi) return 0;
            lo = 0x80;
            hi = 0xBF;
        }
        ++n;
    }
    return n;
}

inline void set_bit(std::vector<uint64_t> &m, int32_t id) { m[size_t(id) >> 6] |= uint64_t(1) << (id & 63); }

}  // namespace

vocab_index::vocab_index(int32_t n_vocab, const std::function<std::string(int32_t)> &piece,
                         const std::function<bool(int32_t)> &is_eog, const std::function<bool(int32_t)> &banned)
    : n_vocab_(n_vocab), pieces_(size_t(n_vocab)), usable_(size_t(n_vocab), 0), eog_(size_t(n_vocab), 0),
      pure_cp_(size_t(n_vocab), 0), pure_mask_((size_t(n_vocab) + 63) / 64, 0) {
    std::vector<int32_t> all_ids, impure_ids;
    for (int32_t id = 0; id < n_vocab; ++id) {
        if (is_eog(id)) {
            eog_[size_t(id)] = 1;
            eog_ids_.push_back(id);
            continue;
        }
        try {
            if (banned(id)) continue;
            pieces_[size_t(id)] = piece(id);
        } catch (const std::exception &) {
            continue;  // an id past the tokenizer's vocabulary (padded output rows)
        }
        if (pieces_[size_t(id)].empty()) continue;
        usable_[size_t(id)] = 1;
        all_ids.push_back(id);
        const int32_t cp = plain_chars(pieces_[size_t(id)]);
        pure_cp_[size_t(id)] = cp;
        if (cp > 0) {
            set_bit(pure_mask_, id);
            pure_sorted_.emplace_back(cp, id);
        } else {
            impure_ids.push_back(id);
        }
    }
    std::sort(pure_sorted_.begin(), pure_sorted_.end());
    all_ = build(std::move(all_ids), pieces_);
    impure_ = build(std::move(impure_ids), pieces_);
}

// A trie of the tokens' bytes. Inserted in byte order, so a new node is always the last child of a
// node on the path of the previous token: the path is kept as a stack, children are appended
// through each node's last child, and tokens with equal bytes end at one node with adjacent ids.
vocab_index::trie vocab_index::build(std::vector<int32_t> ids, const std::vector<std::string> &pieces) {
    std::sort(ids.begin(), ids.end(), [&](int32_t a, int32_t b) { return pieces[size_t(a)] < pieces[size_t(b)] || (pieces[size_t(a)] == pieces[size_t(b)] && a < b); });
    trie t;
    t.nodes.emplace_back();
    std::vector<int32_t> last_child(1, -1);
    std::vector<int32_t> path{0};  // path[k]: the node of the previous token's first k bytes
    const std::string *prev = nullptr;
    for (size_t i = 0; i < ids.size(); ++i) {
        const std::string &p = pieces[size_t(ids[i])];
        size_t l = 0;
        if (prev)
            while (l < p.size() && l < prev->size() && p[l] == (*prev)[l]) ++l;
        path.resize(l + 1);
        for (size_t k = l; k < p.size(); ++k) {
            const int32_t parent = path.back();
            const int32_t id = int32_t(t.nodes.size());
            trie_node n;
            n.byte = uint8_t(p[k]);
            n.tok_begin = n.tok_end = int32_t(i);
            t.nodes.push_back(n);
            last_child.push_back(-1);
            if (last_child[size_t(parent)] < 0) t.nodes[size_t(parent)].first_child = id;
            else t.nodes[size_t(last_child[size_t(parent)])].next_sibling = id;
            last_child[size_t(parent)] = id;
            path.push_back(id);
        }
        trie_node &end = t.nodes[size_t(path.back())];
        if (end.tok_begin == end.tok_end) end.tok_begin = int32_t(i);
        end.tok_end = int32_t(i) + 1;
        prev = &p;
    }
    t.tok_ids = std::move(ids);
    return t;
}

token_constraint::token_constraint(std::shared_ptr<const json_grammar> g, std::shared_ptr<const vocab_index> v)
    : m_(std::move(g)), v_(std::move(v)) {}

void token_constraint::walk(const vocab_index::trie &t, int32_t node, std::vector<uint64_t> &mask) {
    for (int32_t c = t.nodes[size_t(node)].first_child; c >= 0; c = t.nodes[size_t(c)].next_sibling) {
        const vocab_index::trie_node &n = t.nodes[size_t(c)];
        const json_matcher::mark_t mk = m_.mark();
        if (m_.feed(n.byte)) {
            for (int32_t k = n.tok_begin; k < n.tok_end; ++k) set_bit(mask, t.tok_ids[size_t(k)]);
            walk(t, c, mask);
        }
        m_.undo(mk);
    }
}

void token_constraint::fill_mask(std::vector<uint64_t> &mask) {
    const vocab_index &v = *v_;
    mask.assign((size_t(v.n_vocab()) + 63) / 64, 0);
    int64_t room = 0;
    if (m_.in_plain_string(room)) {
        if (room < 0) {
            mask = v.pure_mask();
        } else {
            for (const auto &[cp, id] : v.pure_by_chars()) {
                if (cp > room) break;
                set_bit(mask, id);
            }
        }
        walk(v.impure(), 0, mask);
    } else {
        walk(v.all(), 0, mask);
    }
    if (m_.complete())
        for (int32_t id : v.eog_ids()) set_bit(mask, id);
}

int64_t token_constraint::apply(std::span<float> logits) {
    fill_mask(scratch_);
    const size_t n = std::min(logits.size(), size_t(v_->n_vocab()));
    int64_t allowed = 0;
    for (size_t i = 0; i < n; ++i) {
        if ((scratch_[i >> 6] >> (i & 63)) & 1) ++allowed;
        else logits[i] = -std::numeric_limits<float>::infinity();
    }
    for (size_t i = n; i < logits.size(); ++i) logits[i] = -std::numeric_limits<float>::infinity();
    return allowed;
}

bool token_constraint::accept(int32_t id) {
    const vocab_index &v = *v_;
    if (v.is_eog(id)) return m_.complete();
    if (!v.usable(id)) return false;
    int64_t room = 0;
    const int32_t cp = v.pure_chars(id);
    if (cp > 0 && m_.in_plain_string(room) && (room < 0 || cp <= room)) {
        m_.add_plain(cp);
        return true;
    }
    return m_.feed(v.piece(id));
}

}  // namespace fathom::grammar
