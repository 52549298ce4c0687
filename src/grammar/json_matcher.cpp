// The JSON pushdown automaton (json_matcher.h). step() hands a byte to the top frame; a frame that
// completes pops itself and tells the one below (child_done: only a sequence moves on); a frame that
// completes lazily (number, literal prefix of another) pops on the first byte it cannot take and the
// byte goes on to the frame below. Containers set their next state before a value begins, so the
// value's completion needs nothing from them.
#include "grammar/json_matcher.h"

namespace fathom::grammar {

namespace {

enum frame_kind : uint8_t { fk_val, fk_obj, fk_key, fk_arr, fk_str, fk_num, fk_lit, fk_seq };
enum obj_state : uint8_t { o_first, o_colon, o_value, o_after, o_next };
enum arr_state : uint8_t { a_first, a_after, a_next };
enum num_state : uint8_t { n_start, n_sign, n_zero, n_int, n_dot, n_frac, n_e, n_esign, n_exp };

bool is_ws(int c) { return c == ' ' || c == '\n' || c == '\t' || c == '\r'; }
bool is_digit(int c) { return c >= '0' && c <= '9'; }
bool is_hex(int c) { return is_digit(c) || (c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F'); }

// Narrows the sorted strings [lo, hi) (all sharing their first `pos` bytes) to those whose byte
// `pos` is c: a contiguous range, since the strings are sorted. false when none is left.
template <class Get>
bool narrow(int32_t &lo, int32_t &hi, int64_t pos, uint8_t c, Get get) {
    int32_t a = lo;
    const size_t p = size_t(pos);
    while (a < hi && (get(a).size() <= p || static_cast<uint8_t>(get(a)[p]) < c)) ++a;
    int32_t b = a;
    while (b < hi && get(b).size() > p && static_cast<uint8_t>(get(b)[p]) == c) ++b;
    if (a == b) return false;
    lo = a;
    hi = b;
    return true;
}

}  // namespace

json_matcher::json_matcher(std::shared_ptr<const json_grammar> g) : g_(std::move(g)), frames_(kMaxDepth) {
    frame root;
    root.kind = fk_val;
    root.node = g_->root;
    push(root);
}

json_matcher::frame &json_matcher::mut_top() {
    frame &f = frames_[size_t(depth_ - 1)];
    if (recording_ > 0) trail_.emplace_back(depth_ - 1, f);
    return f;
}

bool json_matcher::push(const frame &f) {
    if (depth_ >= kMaxDepth) return false;  // nesting limit: the byte is refused
    if (recording_ > 0) trail_.emplace_back(depth_, frames_[size_t(depth_)]);
    frames_[size_t(depth_++)] = f;
    return true;
}

json_matcher::mark_t json_matcher::mark() {
    ++recording_;
    return {trail_.size(), depth_, ws_};
}

void json_matcher::undo(const mark_t &m) {
    while (trail_.size() > m.trail) {
        frames_[size_t(trail_.back().first)] = trail_.back().second;
        trail_.pop_back();
    }
    depth_ = m.depth;
    ws_ = m.ws;
    if (--recording_ == 0) trail_.clear();
}

bool json_matcher::feed(uint8_t c) {
    const mark_t m = mark();
    if (!step(c)) {
        undo(m);
        return false;
    }
    if (--recording_ == 0) trail_.clear();  // kept for an enclosing mark
    return true;
}

bool json_matcher::feed(const std::string &bytes) {
    const mark_t m = mark();
    for (char ch : bytes)
        if (!step(static_cast<uint8_t>(ch))) {
            undo(m);
            return false;
        }
    if (--recording_ == 0) trail_.clear();
    return true;
}

bool json_matcher::complete() {
    if (depth_ == 0) return true;
    const mark_t m = mark();
    const bool ok = step(-1);
    undo(m);
    return ok;
}

bool json_matcher::in_plain_string(int64_t &room) const {
    if (depth_ == 0) return false;
    const frame &f = frames_[size_t(depth_ - 1)];
    if (f.esc != 0 || f.rem != 0) return false;
    if (f.kind == fk_str) {
        const node &n = g_->nodes[size_t(f.node)];
        room = n.max_len < 0 ? -1 : n.max_len - f.len;
        return true;
    }
    if (f.kind == fk_key && f.free_ok && f.lo >= f.hi) {
        room = -1;
        return true;
    }
    return false;
}

void json_matcher::add_plain(int64_t n) {
    frame &f = mut_top();
    if (f.kind == fk_str) f.len += n;
    ws_ = 0;
}

// One byte (c = -1: the end of the document) through the stack.
bool json_matcher::step(int c) {
    if (c >= 0 && !is_ws(c)) ws_ = 0;
    for (;;) {
        if (depth_ == 0) return c < 0;  // complete: only the end may follow
        const frame f = top();
        int r;
        switch (f.kind) {
        case fk_val:
            if (c < 0) return false;
            pop();
            return start_value(f.node, uint8_t(c));
        case fk_obj: return c >= 0 && feed_object(top(), uint8_t(c), is_ws(c));
        case fk_key: return c >= 0 && feed_key(uint8_t(c));
        case fk_arr: return c >= 0 && feed_array(top(), uint8_t(c), is_ws(c));
        case fk_str: return c >= 0 && feed_string(uint8_t(c));
        case fk_num:
            r = c < 0 ? (f.st == n_zero || f.st == n_int || f.st == n_frac || f.st == n_exp ? 0 : -1)
                      : feed_number(uint8_t(c));
            if (r != 0) return r > 0;
            pop();
            if (!child_done()) return false;
            continue;  // the number ended: c goes to the frame below
        case fk_lit:
            if (c >= 0) {
                r = feed_literals(uint8_t(c));
                if (r != 0) return r > 0;
            } else if (!literal_complete(f)) {
                return false;
            }
            if (!finish_literal()) return false;
            continue;
        default: return false;  // a sequence is never the top frame while a byte arrives
        }
    }
}

// A value of `node` begins with byte c: push its frame and let it take c.
bool json_matcher::start_value(int32_t id, uint8_t c) {
    const node &n = g_->nodes[size_t(id)];
    frame f;
    f.node = id;
    switch (n.kind) {
    case node_kind::any:
        if (c == '{') return start_value(json_grammar::k_any_object, c);
        if (c == '[') return start_value(json_grammar::k_any_array, c);
        if (c == '"') return start_value(json_grammar::k_any_string, c);
        if (c == '-' || is_digit(c)) return start_value(json_grammar::k_any_number, c);
        if (c == 't' || c == 'f' || c == 'n') return start_value(json_grammar::k_any_literal, c);
        return false;
    case node_kind::object:
        f.kind = fk_obj;
        f.st = o_first;
        return c == '{' && push(f);
    case node_kind::array:
        f.kind = fk_arr;
        f.st = a_first;
        return c == '[' && push(f);
    case node_kind::string:
        f.kind = fk_str;
        return c == '"' && push(f);
    case node_kind::number:
    case node_kind::integer:
        f.kind = fk_num;
        f.st = n_start;
        return push(f) && feed_number(c) == 1;
    case node_kind::literals:
    case node_kind::choice:
        f.kind = fk_lit;
        f.lo = 0;
        f.hi = int32_t(n.lits.size());
        f.len = 0;
        return push(f) && feed_literals(c) == 1;
    case node_kind::any_of: {
        const int16_t b = n.by_first_byte[c];
        return b >= 0 && start_value(n.branches[size_t(b)], c);
    }
    case node_kind::sequence:
        f.kind = fk_seq;
        f.lo = 0;
        return push(f) && start_value(n.parts[0], c);
    }
    return false;
}

// The frame above the top just completed (and was popped): a sequence moves to its next part, or
// completes in turn.
bool json_matcher::child_done() {
    if (depth_ == 0 || top().kind != fk_seq) return true;
    frame &s = mut_top();
    const node &n = g_->nodes[size_t(s.node)];
    if (size_t(++s.lo) < n.parts.size()) {
        frame v;
        v.kind = fk_val;
        v.node = n.parts[size_t(s.lo)];
        return push(v);
    }
    pop();
    return child_done();
}

bool json_matcher::feed_object(frame &f, uint8_t c, bool ws) {
    const node &n = g_->nodes[size_t(f.node)];
    const uint64_t all = n.props.size() >= 64 ? ~uint64_t(0) : (uint64_t(1) << n.props.size()) - 1;
    const bool can_add = n.additional >= 0 || (f.used & all) != all;
    const bool can_close = (f.used & n.required_mask) == n.required_mask;
    if (ws) {
        if (ws_ >= kMaxWhitespace) return false;
        ++ws_;
        return true;
    }
    switch (f.st) {
    case o_first:
    case o_next:
        if (c == '}' && f.st == o_first && can_close) {
            pop();
            return child_done();
        }
        if (c != '"' || !can_add) return false;
        {
            frame k;
            k.kind = fk_key;
            k.node = f.node;
            k.lo = 0;
            k.hi = int32_t(n.props.size());
            k.len = 1;  // every listed key starts with the quote
            k.free_ok = n.additional >= 0;
            return push(k);
        }
    case o_colon:
        if (c != ':') return false;
        mut_top().st = o_value;
        return true;
    case o_value: {
        const int32_t v = f.cur >= 0 ? n.props[size_t(f.cur)].node : n.additional;
        mut_top().st = o_after;
        return start_value(v, c);
    }
    case o_after:
        if (c == ',' && can_add) {
            mut_top().st = o_next;
            return true;
        }
        if (c == '}' && can_close) {
            pop();
            return child_done();
        }
        return false;
    }
    return false;
}

// A key: listed names matched byte by byte (a range of the sorted props), and, when unlisted keys
// are allowed, any string as well (without escapes, except in json_object mode). A key equal to a
// name already given is refused at its closing quote.
bool json_matcher::feed_key(uint8_t c) {
    const frame &obj = frames_[size_t(depth_ - 2)];
    const node &n = g_->nodes[size_t(obj.node)];
    frame &f = mut_top();
    ws_ = 0;
    int32_t lo = f.lo, hi = f.hi;
    const bool lit = lo < hi && narrow(lo, hi, f.len, c, [&](int32_t i) -> const std::string & { return n.props[size_t(i)].key; });
    if (!lit) lo = hi = 0;
    const int r = f.free_ok ? string_byte(f, c, n.key_escapes) : -1;
    const bool lit_closed = lit && n.props[size_t(lo)].key.size() == size_t(f.len + 1);
    if (lit_closed || r == 2) {  // the closing quote
        const int32_t p = lit_closed ? lo : -1;
        if (p >= 0 && (obj.used >> p) & 1) return false;  // a property given twice
        if (p < 0 && r != 2) return false;
        pop();
        frame &o = mut_top();
        o.cur = p;
        if (p >= 0) o.used |= uint64_t(1) << p;
        o.st = o_colon;
        return true;
    }
    bool unused = false;  // a listed key still reachable (unlisted keys cannot spell a used one: refused at the close)
    for (int32_t i = lo; lit && i < hi && !unused; ++i) unused = !((obj.used >> i) & 1);
    f.lo = lo;
    f.hi = hi;
    f.len += 1;
    f.free_ok = r >= 0;
    return unused || r >= 0;
}

bool json_matcher::feed_array(frame &f, uint8_t c, bool ws) {
    const node &n = g_->nodes[size_t(f.node)];
    if (ws) {
        if (ws_ >= kMaxWhitespace) return false;
        ++ws_;
        return true;
    }
    switch (f.st) {
    case a_first:
        if (c == ']') {
            if (n.min_items > 0) return false;
            pop();
            return child_done();
        }
        if (n.max_items == 0) return false;
        break;
    case a_after:
        if (c == ',' && (n.max_items < 0 || f.lo < n.max_items)) {
            mut_top().st = a_next;
            return true;
        }
        if (c == ']' && f.lo >= n.min_items) {
            pop();
            return child_done();
        }
        return false;
    case a_next: break;
    }
    frame &m = mut_top();  // an item begins
    m.st = a_after;
    m.lo += 1;
    return start_value(n.items, c);
}

int json_matcher::string_byte(frame &f, uint8_t c, bool escapes) {
    if (f.rem > 0) {  // UTF-8 continuation
        if (c < f.ulo || c > f.uhi) return -1;
        f.ulo = 0x80;
        f.uhi = 0xBF;
        --f.rem;
        return 0;
    }
    if (f.esc == 1) {
        if (c == 'u') {
            f.esc = 2;
            return 0;
        }
        for (const char *e = "\"\\/bfnrt"; *e; ++e)
            if (c == uint8_t(*e)) {
                f.esc = 0;
                return 0;
            }
        return -1;
    }
    if (f.esc >= 2) {  // the four hex digits of \u; no UTF-16 surrogate (D800-DFFF)
        if (!is_hex(c)) return -1;
        if (f.esc == 2) f.sur = c == 'd' || c == 'D';
        if (f.esc == 3 && f.sur && !(c >= '0' && c <= '7')) return -1;
        f.esc = f.esc == 5 ? 0 : uint8_t(f.esc + 1);
        return 0;
    }
    if (c == '"') return 2;
    if (c == '\\') {
        if (!escapes) return -1;
        f.esc = 1;
        return 1;
    }
    if (c < 0x20) return -1;
    if (c < 0x80) return 1;
    // UTF-8 lead bytes (RFC 3629): no overlong forms, no surrogates, nothing above U+10FFFF.
    if (c >= 0xC2 && c <= 0xDF) f.rem = 1;
    else if (c == 0xE0) f.rem = 2, f.ulo = 0xA0;
    else if ((c >= 0xE1 && c <= 0xEC) || c == 0xEE || c == 0xEF) f.rem = 2;
    else if (c == 0xED) f.rem = 2, f.uhi = 0x9F;
    else if (c == 0xF0) f.rem = 3, f.ulo = 0x90;
    else if (c >= 0xF1 && c <= 0xF3) f.rem = 3;
    else if (c == 0xF4) f.rem = 3, f.uhi = 0x8F;
    else return -1;
    return 1;
}

bool json_matcher::feed_string(uint8_t c) {
    frame &f = mut_top();
    const node &n = g_->nodes[size_t(f.node)];
    ws_ = 0;
    const int r = string_byte(f, c, true);
    if (r < 0) return false;
    if (r == 1) {
        if (n.max_len >= 0 && f.len >= n.max_len) return false;
        ++f.len;
    } else if (r == 2) {
        if (f.len < n.min_len) return false;
        pop();
        return child_done();
    }
    return true;
}

// JSON number (integer: no fraction or exponent), at most kMaxNumberDigits digits before and after
// the point and two exponent digits, so every value stays a finite double.
int json_matcher::feed_number(uint8_t c) {
    frame &f = mut_top();
    const bool integer = g_->nodes[size_t(f.node)].kind == node_kind::integer;
    const bool d = is_digit(c);
    auto to = [&](uint8_t st, int64_t len) {
        f.st = st;
        f.len = len;
        return 1;
    };
    switch (f.st) {
    case n_start:
        if (c == '-') return to(n_sign, 0);
        [[fallthrough]];
    case n_sign:
        if (c == '0') return to(n_zero, 1);
        return d ? to(n_int, 1) : -1;
    case n_zero:
    case n_int:
        if (d) return f.st == n_int && f.len < kMaxNumberDigits ? to(n_int, f.len + 1) : -1;
        if (c == '.' && !integer) return to(n_dot, 0);
        if ((c == 'e' || c == 'E') && !integer) return to(n_e, 0);
        return 0;
    case n_dot: return d ? to(n_frac, 1) : -1;
    case n_frac:
        if (d) return f.len < kMaxNumberDigits ? to(n_frac, f.len + 1) : -1;
        if (c == 'e' || c == 'E') return to(n_e, 0);
        return 0;
    case n_e:
        if (c == '+' || c == '-') return to(n_esign, 0);
        return d ? to(n_exp, 1) : -1;
    case n_esign: return d ? to(n_exp, 1) : -1;
    case n_exp:
        if (d) return f.len < 2 ? to(n_exp, f.len + 1) : -1;
        return 0;
    }
    return -1;
}

bool json_matcher::literal_complete(const frame &f) const {
    const node &n = g_->nodes[size_t(f.node)];
    return f.lo < f.hi && n.lits[size_t(f.lo)].size() == size_t(f.len);
}

// 1: c extends a candidate (the literal is finished at once when it is the only one left and
// whole); 0: c extends none but a candidate is whole (it ends; c goes below); -1: refused.
int json_matcher::feed_literals(uint8_t c) {
    const frame cur = top();
    const node &n = g_->nodes[size_t(cur.node)];
    int32_t lo = cur.lo, hi = cur.hi;
    if (!narrow(lo, hi, cur.len, c, [&](int32_t i) -> const std::string & { return n.lits[size_t(i)]; }))
        return literal_complete(cur) ? 0 : -1;
    frame &f = mut_top();
    f.lo = lo;
    f.hi = hi;
    f.len += 1;
    ws_ = 0;
    if (hi - lo == 1 && n.lits[size_t(lo)].size() == size_t(f.len)) return finish_literal() ? 1 : -1;
    return 1;
}

// The top literal is whole: pop it; a choice continues with the value its literal selects.
bool json_matcher::finish_literal() {
    const frame f = top();
    const node &n = g_->nodes[size_t(f.node)];
    pop();
    if (n.kind == node_kind::choice) {
        frame v;
        v.kind = fk_val;
        v.node = n.conts[size_t(f.lo)];
        return push(v);
    }
    return child_done();
}

}  // namespace fathom::grammar
