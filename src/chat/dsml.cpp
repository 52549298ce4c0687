// DSML tool calls of DeepSeek V4: Python-compatible JSON text, canonical rendering of calls and
// of the "## Tools" section, the streaming parser, the exact-replay map, and the DSML
// fathom::toolcall::tool_format. Format facts come from the official encoding_dsv4.py; see
// docs/ds4-chat-format.md for every rule and its source.
#include "chat/dsml.h"

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cmath>
#include <cstdio>

#include "core/error.h"
#include "chat/tool_format.h"

namespace fathom::ds4chat {

using ojson = nlohmann::ordered_json;

// ================================================================================================
// Python json.dumps(ensure_ascii=False)
// ================================================================================================

namespace {

void dump_string(std::string &out, std::string_view s) {
    out += '"';
    for (const char ch : s) {
        const auto c = static_cast<unsigned char>(ch);
        switch (c) {
            case '"': out += "\\\""; break;
            case '\\': out += "\\\\"; break;
            case '\n': out += "\\n"; break;
            case '\r': out += "\\r"; break;
            case '\t': out += "\\t"; break;
            case '\b': out += "\\b"; break;
            case '\f': out += "\\f"; break;
            default:
                if (c < 0x20) {
                    char buf[8];
                    std::snprintf(buf, sizeof buf, "\\u%04x", c);
                    out += buf;
                } else {
                    out += ch;  // ensure_ascii=False: everything else verbatim, DEL included
                }
        }
    }
    out += '"';
}

// float.__repr__: shortest round-trip digits; fixed notation when the decimal exponent e of
// d.ddd x 10^e satisfies -4 <= e < 16, else d.ddde+XX with at least two exponent digits.
void dump_float(std::string &out, double v) {
    if (std::isnan(v)) { out += "NaN"; return; }
    if (std::isinf(v)) { out += v < 0 ? "-Infinity" : "Infinity"; return; }
    char buf[64];
    const auto r = std::to_chars(buf, buf + sizeof buf, v, std::chars_format::scientific);
    std::string_view sci(buf, static_cast<size_t>(r.ptr - buf));  // "-d.ddde+XX"
    std::string sign;
    if (!sci.empty() && sci[0] == '-') {
        sign = "-";
        sci.remove_prefix(1);
    }
    const size_t epos = sci.find('e');
    std::string digits;
    for (const char c : sci.substr(0, epos))
        if (c != '.') digits += c;
    const int exp = std::atoi(std::string(sci.substr(epos + 1)).c_str());
    while (digits.size() > 1 && digits.back() == '0') digits.pop_back();
    out += sign;
    if (exp >= -4 && exp < 16) {
        if (exp >= 0) {
            const auto ipart = static_cast<size_t>(exp) + 1;
            if (digits.size() <= ipart) {
                out += digits + std::string(ipart - digits.size(), '0') + ".0";
            } else {
                out += digits.substr(0, ipart) + "." + digits.substr(ipart);
            }
        } else {
            out += "0." + std::string(static_cast<size_t>(-exp - 1), '0') + digits;
        }
        return;
    }
    out += digits.substr(0, 1);
    if (digits.size() > 1) out += "." + digits.substr(1);
    char ebuf[16];
    std::snprintf(ebuf, sizeof ebuf, "e%c%02d", exp < 0 ? '-' : '+', exp < 0 ? -exp : exp);
    out += ebuf;
}

void dump_value(std::string &out, const ojson &v, int depth) {
    if (depth > 512) throw error("py_json_dumps: JSON nesting deeper than 512");
    switch (v.type()) {
        case ojson::value_t::null: out += "null"; return;
        case ojson::value_t::boolean: out += v.get<bool>() ? "true" : "false"; return;
        case ojson::value_t::number_integer: out += std::to_string(v.get<int64_t>()); return;
        case ojson::value_t::number_unsigned: out += std::to_string(v.get<uint64_t>()); return;
        case ojson::value_t::number_float: dump_float(out, v.get<double>()); return;
        case ojson::value_t::string: dump_string(out, v.get_ref<const std::string &>()); return;
        case ojson::value_t::array: {
            out += '[';
            bool first = true;
            for (const auto &e : v) {
                if (!first) out += ", ";
                first = false;
                dump_value(out, e, depth + 1);
            }
            out += ']';
            return;
        }
        case ojson::value_t::object: {
            out += '{';
            bool first = true;
            for (const auto &[k, e] : v.items()) {
                if (!first) out += ", ";
                first = false;
                dump_string(out, k);
                out += ": ";
                dump_value(out, e, depth + 1);
            }
            out += '}';
            return;
        }
        default: throw error("py_json_dumps: binary or discarded JSON value cannot be written");
    }
}

}  // namespace

std::string py_json_dumps(const ojson &value) {
    std::string out;
    dump_value(out, value, 0);
    return out;
}

// ================================================================================================
// Canonical rendering
// ================================================================================================

std::string dsml_render_parameters(std::string_view arguments) {
    ojson args = ojson::parse(arguments, nullptr, false);
    if (args.is_discarded()) {  // official: not JSON -> one string parameter "arguments"
        args = ojson::object();
        args["arguments"] = std::string(arguments);
    }
    if (!args.is_object())
        throw error("dsml: tool call arguments are JSON but not an object: " +
                    std::string(arguments.substr(0, 80)));
    std::string out;
    bool first = true;
    for (const auto &[key, v] : args.items()) {
        if (!first) out += '\n';
        first = false;
        out += "<｜DSML｜parameter name=\"";
        out += key;
        out += v.is_string() ? "\" string=\"true\">" : "\" string=\"false\">";
        out += v.is_string() ? v.get_ref<const std::string &>() : py_json_dumps(v);
        out += "</｜DSML｜parameter>";
    }
    return out;
}

std::string dsml_render_tool_calls(const std::vector<dsml_call> &calls) {
    if (calls.empty()) return {};
    std::string out = "\n\n<｜DSML｜tool_calls>\n";
    for (size_t i = 0; i < calls.size(); ++i) {
        if (i) out += '\n';
        out += "<｜DSML｜invoke name=\"" + calls[i].name + "\">\n";
        out += dsml_render_parameters(calls[i].arguments);
        out += "\n</｜DSML｜invoke>";
    }
    out += "\n</｜DSML｜tool_calls>";
    return out;
}

std::string dsml_render_tools_section(const ojson &tools) {
    if (!tools.is_array()) throw error("dsml: tools must be a JSON array");
    std::string schemas;
    for (const auto &t : tools) {
        const ojson &fn = t.is_object() && t.contains("function") && t["function"].is_object() ? t["function"] : t;
        if (!schemas.empty()) schemas += '\n';
        schemas += py_json_dumps(fn);
    }
    return "## Tools\n\n"
           "You have access to a set of tools to help answer the user's question. You can invoke tools by "
           "writing a \"<｜DSML｜tool_calls>\" block like the following:\n\n"
           "<｜DSML｜tool_calls>\n"
           "<｜DSML｜invoke name=\"$TOOL_NAME\">\n"
           "<｜DSML｜parameter name=\"$PARAMETER_NAME\" string=\"true|false\">$PARAMETER_VALUE</｜DSML｜parameter>\n"
           "...\n"
           "</｜DSML｜invoke>\n"
           "<｜DSML｜invoke name=\"$TOOL_NAME2\">\n"
           "...\n"
           "</｜DSML｜invoke>\n"
           "</｜DSML｜tool_calls>\n\n"
           "String parameters should be specified as is and set `string=\"true\"`. For all other types "
           "(numbers, booleans, arrays, objects), pass the value in JSON format and set `string=\"false\"`.\n\n"
           "If thinking_mode is enabled (triggered by <think>), you MUST output your complete reasoning inside "
           "<think>...</think> BEFORE any tool calls or final response.\n\n"
           "Otherwise, output directly after </think> with tool calls or final response.\n\n"
           "### Available Tool Schemas\n\n" +
           schemas +
           "\n\nYou MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.\n";
}

// ================================================================================================
// Streaming parser
// ================================================================================================

namespace {

// Tag prefixes after "<" or "</": official, short, ASCII bars, bare.
constexpr std::string_view k_prefixes[] = {"｜DSML｜", "DSML｜", "|DSML|"};
constexpr std::string_view k_openers[] = {"<｜DSML｜tool_calls>", "<DSML｜tool_calls>", "<|DSML|tool_calls>",
                                          "<tool_calls>"};
constexpr std::string_view k_param_closers[] = {"</｜DSML｜parameter>", "</DSML｜parameter>",
                                                "</|DSML|parameter>", "</parameter>"};
constexpr size_t k_max_tag = 4096;

bool is_ws(char c) { return c == ' ' || c == '\n' || c == '\r' || c == '\t'; }

bool all_ws(std::string_view s) {
    return std::all_of(s.begin(), s.end(), [](char c) { return is_ws(c); });
}

// Number of trailing bytes of s that begin a UTF-8 sequence not yet complete.
size_t utf8_incomplete_tail(std::string_view s) {
    const size_t n = s.size();
    for (size_t back = 1; back <= 4 && back <= n; ++back) {
        const auto c = static_cast<unsigned char>(s[n - back]);
        if ((c & 0xC0) == 0x80) continue;  // continuation byte: keep looking for the lead
        size_t need = 1;
        if ((c & 0xE0) == 0xC0) need = 2;
        else if ((c & 0xF0) == 0xE0) need = 3;
        else if ((c & 0xF8) == 0xF0) need = 4;
        return back < need ? back : 0;
    }
    return 0;
}

// Longest proper prefix of any marker that s ends with.
template <size_t N>
size_t partial_marker_suffix(std::string_view s, const std::string_view (&markers)[N], std::string_view extra) {
    size_t best = 0;
    auto check = [&](std::string_view m) {
        for (size_t k = std::min(s.size(), m.size() - 1); k > best; --k)
            if (s.substr(s.size() - k) == m.substr(0, k)) {
                best = k;
                break;
            }
    };
    for (const auto &m : markers) check(m);
    if (!extra.empty()) check(extra);
    return best;
}

struct tag_info {
    bool close = false;
    std::string name;
    std::vector<std::pair<std::string, std::string>> attrs;
    const std::string *attr(std::string_view key) const {
        for (const auto &[k, v] : attrs)
            if (k == key) return &v;
        return nullptr;
    }
};

// "<...>" -> tag_info; nullopt when it is not a well-formed DSML tag.
std::optional<tag_info> parse_tag(std::string_view tag) {
    tag_info t;
    std::string_view s = tag.substr(1, tag.size() - 2);
    if (!s.empty() && s[0] == '/') {
        t.close = true;
        s.remove_prefix(1);
    }
    for (const auto p : k_prefixes)
        if (s.substr(0, p.size()) == p) {
            s.remove_prefix(p.size());
            break;
        }
    size_t i = 0;
    while (i < s.size() && ((s[i] >= 'a' && s[i] <= 'z') || s[i] == '_')) ++i;
    if (i == 0) return std::nullopt;
    t.name = std::string(s.substr(0, i));
    s.remove_prefix(i);
    for (;;) {
        size_t j = 0;
        while (j < s.size() && is_ws(s[j])) ++j;
        s.remove_prefix(j);
        if (s.empty()) break;
        if (t.close || j == 0) return std::nullopt;  // attributes need a separating space
        size_t k = 0;
        while (k < s.size() && (std::isalnum(static_cast<unsigned char>(s[k])) || s[k] == '_')) ++k;
        if (k == 0 || k >= s.size() || s[k] != '=' || k + 1 >= s.size() || s[k + 1] != '"') return std::nullopt;
        const size_t end = s.find('"', k + 2);
        if (end == std::string_view::npos) return std::nullopt;
        t.attrs.emplace_back(std::string(s.substr(0, k)), std::string(s.substr(k + 2, end - k - 2)));
        s.remove_prefix(end + 1);
    }
    return t;
}

std::string show_tag(std::string_view tag) { return std::string(tag.substr(0, 60)); }

// Invalid UTF-8 -> U+FFFD per maximal subpart (what Python's errors="replace" decoding does), so
// the arguments text is always valid JSON even when sampled bytes are not valid UTF-8.
std::string sanitize_utf8(std::string_view s) {
    std::string out;
    out.reserve(s.size());
    size_t i = 0;
    while (i < s.size()) {
        const auto c = static_cast<unsigned char>(s[i]);
        size_t need = 0;
        unsigned char lo = 0x80, hi = 0xBF;  // allowed range of the first continuation byte
        if (c < 0x80) {
            out += s[i++];
            continue;
        }
        if (c >= 0xC2 && c <= 0xDF) need = 1;
        else if (c == 0xE0) need = 2, lo = 0xA0;
        else if ((c >= 0xE1 && c <= 0xEC) || c == 0xEE || c == 0xEF) need = 2;
        else if (c == 0xED) need = 2, hi = 0x9F;
        else if (c == 0xF0) need = 3, lo = 0x90;
        else if (c >= 0xF1 && c <= 0xF3) need = 3;
        else if (c == 0xF4) need = 3, hi = 0x8F;
        size_t ok = 0;
        while (need && ok < need && i + 1 + ok < s.size()) {
            const auto cc = static_cast<unsigned char>(s[i + 1 + ok]);
            const bool in_range = ok == 0 ? (cc >= lo && cc <= hi) : (cc & 0xC0) == 0x80;
            if (!in_range) break;
            ++ok;
        }
        if (need && ok == need) {
            out.append(s.substr(i, need + 1));
            i += need + 1;
        } else {
            out += "\xEF\xBF\xBD";
            i += 1 + ok;
        }
    }
    return out;
}

}  // namespace

dsml_stream_parser::dsml_stream_parser(dsml_parser_options opts)
    : opts_(opts), st_(opts.thinking ? state::reasoning : state::content) {}

size_t dsml_stream_parser::content_before_first_block() const {
    return any_block_ ? content_before_block_ : res_.content.size();
}

void dsml_stream_parser::emit_content(std::string_view s, dsml_delta &d) {
    if (s.empty()) return;
    res_.content.append(s);
    d.content.append(s);
    if (after_block_) {  // text after a block: content + raw no longer reproduces the output
        after_block_ = false;
        res_.replay_exact = false;
    }
}

dsml_delta dsml_stream_parser::feed(std::string_view piece) {
    dsml_delta d;
    switch (st_) {
        case state::reasoning:
        case state::content: pend_.append(piece); break;
        case state::block: blk_.append(piece); break;
        case state::failed:
            res_.error_text.append(piece);
            if (opts_.malformed_as_text) pend_.append(piece);
            break;
        case state::done: return d;
    }
    pump(d, false);
    return d;
}

dsml_delta dsml_stream_parser::finish() {
    dsml_delta d;
    pump(d, true);
    st_ = state::done;
    return d;
}

void dsml_stream_parser::pump(dsml_delta &d, bool at_end) {
    for (;;) {
        bool again = false;
        switch (st_) {
            case state::reasoning: again = step_reasoning(d, at_end); break;
            case state::content: again = step_content(d, at_end); break;
            case state::block: again = step_block(d, at_end); break;
            case state::failed: {
                // malformed_as_text: the rest of the output is plain text (complete UTF-8 only).
                const size_t cut = at_end ? pend_.size() : pend_.size() - utf8_incomplete_tail(pend_);
                emit_content(std::string_view(pend_).substr(0, cut), d);
                pend_.erase(0, cut);
                break;
            }
            case state::done: break;
        }
        if (!again) break;
    }
}

bool dsml_stream_parser::step_reasoning(dsml_delta &d, bool at_end) {
    const size_t close = pend_.find(k_think_close);
    const size_t eos = pend_.find(k_eos);
    const size_t hit = std::min(close, eos);
    if (hit != std::string::npos) {
        res_.reasoning.append(pend_, 0, hit);
        d.reasoning.append(pend_, 0, hit);
        if (hit == close) {
            res_.reasoning_closed = true;
            pend_.erase(0, hit + k_think_close.size());
            st_ = state::content;
            return true;
        }
        res_.saw_eos = true;
        pend_.clear();
        st_ = state::done;
        return false;
    }
    static constexpr std::string_view markers[] = {k_think_close, k_eos};
    size_t cut = pend_.size();
    if (!at_end) {
        cut -= partial_marker_suffix(pend_, markers, {});
        cut -= utf8_incomplete_tail(std::string_view(pend_).substr(0, cut));
    }
    res_.reasoning.append(pend_, 0, cut);
    d.reasoning.append(pend_, 0, cut);
    pend_.erase(0, cut);
    return false;
}

bool dsml_stream_parser::step_content(dsml_delta &d, bool at_end) {
    size_t best = std::string::npos, blen = 0;
    for (const auto m : k_openers) {
        const size_t p = pend_.find(m);
        if (p < best) best = p, blen = m.size();
    }
    const size_t eos = pend_.find(k_eos);
    // Text that ends the output (EOS or the end): trailing whitespace right after a block belongs
    // to the block's raw bytes, so that content + raw_dsml reproduces the output.
    auto flush_tail = [&](std::string_view tail) {
        if (after_block_ && all_ws(tail)) res_.raw_dsml.append(tail);
        else emit_content(tail, d);
    };
    if (eos < best) {
        flush_tail(std::string_view(pend_).substr(0, eos));
        res_.saw_eos = true;
        pend_.clear();
        st_ = state::done;
        return false;
    }
    if (best != std::string::npos) {
        // Official parse: the block starts at "\n\n<｜DSML｜tool_calls"; other whitespace before
        // the tag stays content.
        const size_t ws = best >= 2 && pend_.compare(best - 2, 2, "\n\n") == 0 ? best - 2 : best;
        emit_content(std::string_view(pend_).substr(0, ws), d);
        if (!any_block_) {
            content_before_block_ = res_.content.size();
            res_.replay_exact = true;
        }
        any_block_ = true;
        seg_ = pend_.substr(ws, best + blen - ws);
        blk_ = pend_.substr(best + blen);
        pend_.clear();
        cur_ = scan_ = 0;
        bst_ = block_state::top;
        block_calls_.clear();
        st_ = state::block;
        return true;
    }
    if (at_end) {
        flush_tail(pend_);
        pend_.clear();
        return false;
    }
    // Hold a possible marker start, the whitespace before it (it may precede a block) and an
    // incomplete UTF-8 character.
    size_t cut = pend_.size() - partial_marker_suffix(pend_, k_openers, k_eos);
    while (cut > 0 && is_ws(pend_[cut - 1])) --cut;
    cut -= utf8_incomplete_tail(std::string_view(pend_).substr(0, cut));
    emit_content(std::string_view(pend_).substr(0, cut), d);
    pend_.erase(0, cut);
    return false;
}

bool dsml_stream_parser::step_block(dsml_delta &d, bool at_end) {
    for (;;) {
        if (bst_ == block_state::value) {
            size_t best = std::string::npos, blen = 0;
            const size_t from = std::max(cur_, scan_);
            for (const auto m : k_param_closers) {
                const size_t p = blk_.find(m, from);
                if (p < best) best = p, blen = m.size();
            }
            if (best == std::string::npos) {
                const size_t keep = k_param_closers[0].size() - 1;
                scan_ = std::max(cur_, blk_.size() > keep ? blk_.size() - keep : size_t{0});
                if (at_end) {
                    fail("unterminated DSML parameter value", d);
                } else if (param_is_string_) {  // stream what cannot be part of the closing tag
                    const std::string_view v = std::string_view(blk_).substr(cur_);
                    size_t safe = v.size() - partial_marker_suffix(v, k_param_closers, {});
                    safe -= utf8_incomplete_tail(v.substr(0, safe));
                    if (safe > vsent_) stream_value(d, safe);
                }
                return at_end;
            }
            std::string value = sanitize_utf8(std::string_view(blk_).substr(cur_, best - cur_));
            std::string text;
            if (param_is_string_) {
                stream_value(d, best - cur_);
                call_fragment(d, "\"", false);
                text = py_json_dumps(ojson(value));
            } else if (ojson::parse(value, nullptr, false).is_discarded()) {
                text = py_json_dumps(ojson(value));  // string="false" but not JSON: keep it as a string
            } else {
                text = std::move(value);  // official: the JSON text verbatim
            }
            if (!param_is_string_) call_fragment(d, text, false);
            cur_ = best + blen;
            call_args_.emplace_back(param_name_, std::move(text));
            bst_ = block_state::invoke;
            continue;
        }
        while (cur_ < blk_.size() && is_ws(blk_[cur_])) ++cur_;
        if (cur_ == blk_.size()) {
            if (at_end) fail("unterminated DSML tool_calls block", d);
            return at_end;
        }
        if (blk_[cur_] != '<') {
            // No quote of the text: how much of it has arrived depends on the token split.
            fail("unexpected text in DSML tool_calls block", d);
            return true;
        }
        size_t end = cur_ + 1;
        bool quoted = false;
        while (end < blk_.size() && (quoted || blk_[end] != '>')) {
            if (blk_[end] == '"') quoted = !quoted;
            ++end;
        }
        if (end == blk_.size()) {
            if (blk_.size() - cur_ > k_max_tag) fail("DSML tag longer than 4096 bytes", d);
            else if (at_end) fail("unterminated DSML tag", d);
            return st_ != state::block;
        }
        const std::string tag = blk_.substr(cur_, end + 1 - cur_);
        cur_ = end + 1;
        if (!block_tag(tag, d)) return true;  // block closed or failed: state changed
    }
}

// One complete tag inside a block. Returns false when the block closed or failed.
bool dsml_stream_parser::block_tag(std::string_view tag, dsml_delta &d) {
    const auto t = parse_tag(tag);
    if (!t) {
        fail("malformed DSML tag " + show_tag(tag), d);
        return false;
    }
    if (bst_ == block_state::top) {
        if (!t->close && t->name == "invoke") {
            const std::string *name = t->attr("name");
            if (!name) {
                fail("DSML invoke without a name: " + show_tag(tag), d);
                return false;
            }
            call_name_ = sanitize_utf8(*name);
            call_args_.clear();
            bst_ = block_state::invoke;
            d.call_deltas.push_back({n_invokes_++, true, false, call_name_, "{", d.content.size()});
            return true;
        }
        if (t->close && t->name == "tool_calls") {
            close_block(cur_, d);
            return false;
        }
    } else if (bst_ == block_state::invoke) {
        if (!t->close && t->name == "parameter") {
            const std::string *name = t->attr("name");
            const std::string *str = t->attr("string");
            if (!name || (str && *str != "true" && *str != "false")) {
                fail("malformed DSML parameter tag " + show_tag(tag), d);
                return false;
            }
            for (const auto &a : call_args_)
                if (a.first == *name) {
                    fail("duplicate DSML parameter \"" + *name + "\" in invoke \"" + call_name_ + "\"", d);
                    return false;
                }
            param_name_ = sanitize_utf8(*name);
            param_is_string_ = !str || *str == "true";
            bst_ = block_state::value;
            scan_ = cur_;
            vsent_ = 0;
            call_fragment(d, (call_args_.empty() ? "" : ", ") + py_json_dumps(ojson(param_name_)) + ": " +
                                 (param_is_string_ ? "\"" : ""),
                          false);
            return true;
        }
        if (t->close && t->name == "invoke") {
            // Official decode_dsml_to_arguments: "{" + ", ".join(json(key) + ": " + value) + "}".
            std::string args = "{";
            for (size_t i = 0; i < call_args_.size(); ++i) {
                if (i) args += ", ";
                args += py_json_dumps(ojson(call_args_[i].first)) + ": " + call_args_[i].second;
            }
            args += "}";
            call_fragment(d, "}", true);
            block_calls_.push_back({call_name_, std::move(args)});
            bst_ = block_state::top;
            return true;
        }
    }
    fail("unexpected DSML tag " + show_tag(tag), d);
    return false;
}

void dsml_stream_parser::call_fragment(dsml_delta &d, std::string text, bool end) {
    const size_t index = n_invokes_ - 1;  // the open invoke
    if (d.call_deltas.empty() || d.call_deltas.back().index != index || d.call_deltas.back().end)
        d.call_deltas.push_back({index, false, false, {}, {}, d.content.size()});
    d.call_deltas.back().arguments += text;
    d.call_deltas.back().end = end;
}

// The open string value's bytes [vsent_, upto) (relative to its start, cur_) as JSON string
// content: sanitised and escaped piece by piece, which gives the same bytes as escaping the whole
// value (cuts never split a UTF-8 sequence; escaping is per byte).
void dsml_stream_parser::stream_value(dsml_delta &d, size_t upto) {
    if (upto <= vsent_) return;
    const std::string q = py_json_dumps(ojson(sanitize_utf8(std::string_view(blk_).substr(cur_ + vsent_, upto - vsent_))));
    call_fragment(d, q.substr(1, q.size() - 2), false);
    vsent_ = upto;
}

void dsml_stream_parser::close_block(size_t end, dsml_delta &d) {
    res_.raw_dsml += seg_;
    res_.raw_dsml.append(blk_, 0, end);
    for (auto &c : block_calls_) {
        d.calls.push_back(c);
        res_.calls.push_back(std::move(c));
    }
    block_calls_.clear();
    pend_ = blk_.substr(end);
    blk_.clear();
    seg_.clear();
    after_block_ = true;
    st_ = state::content;
}

void dsml_stream_parser::fail(std::string message, dsml_delta &d) {
    res_.error = std::move(message);
    res_.error_text = seg_ + blk_;
    res_.replay_exact = false;
    block_calls_.clear();
    if (opts_.malformed_as_text) pend_ = res_.error_text;
    seg_.clear();
    blk_.clear();
    after_block_ = false;
    st_ = state::failed;
    (void)d;
}

dsml_result dsml_parse(std::string_view text, dsml_parser_options opts) {
    dsml_stream_parser p(opts);
    p.feed(text);
    p.finish();
    return p.result();
}

size_t dsml_safe_content_prefix(std::string_view text) {
    dsml_stream_parser p;
    p.feed(text);
    return p.content_before_first_block();
}

// ================================================================================================
// Exact-replay map
// ================================================================================================

dsml_replay_map::dsml_replay_map(size_t max_ids) : max_ids_(max_ids) {}

void dsml_replay_map::remember(const std::vector<std::string> &ids, std::string raw) {
    if (ids.empty()) throw error("dsml_replay_map: remember() needs at least one tool call id");
    for (size_t i = 0; i < ids.size(); ++i) {
        if (ids[i].empty()) throw error("dsml_replay_map: empty tool call id");
        for (size_t j = 0; j < i; ++j)
            if (ids[j] == ids[i]) throw error("dsml_replay_map: duplicate tool call id " + ids[i]);
    }
    auto rec = std::make_shared<const record>(record{ids, std::move(raw)});
    std::lock_guard lock(mu_);
    for (const auto &id : ids) {
        const uint64_t seq = next_seq_++;
        by_id_[id] = slot{rec, seq};
        order_.emplace_back(id, seq);
    }
    evict_locked();
}

void dsml_replay_map::evict_locked() {
    while (by_id_.size() > max_ids_ && !order_.empty()) {
        const auto [id, seq] = order_.front();
        order_.pop_front();
        const auto it = by_id_.find(id);
        if (it != by_id_.end() && it->second.seq == seq) by_id_.erase(it);
    }
    // Re-stored ids leave stale queue entries behind; compact when they dominate.
    if (order_.size() > 2 * by_id_.size() + 64) {
        std::deque<std::pair<std::string, uint64_t>> live;
        for (auto &e : order_) {
            const auto it = by_id_.find(e.first);
            if (it != by_id_.end() && it->second.seq == e.second) live.push_back(std::move(e));
        }
        order_.swap(live);
    }
}

std::optional<std::string> dsml_replay_map::lookup(const std::vector<std::string> &ids) const {
    if (ids.empty()) return std::nullopt;
    std::lock_guard lock(mu_);
    const auto first = by_id_.find(ids[0]);
    if (first == by_id_.end()) return std::nullopt;
    const auto &rec = first->second.rec;
    if (rec->ids != ids) return std::nullopt;
    for (const auto &id : ids) {  // every id must still be present (eviction is per id)
        const auto it = by_id_.find(id);
        if (it == by_id_.end() || it->second.rec != rec) return std::nullopt;
    }
    return rec->raw;
}

size_t dsml_replay_map::size() const {
    std::lock_guard lock(mu_);
    return by_id_.size();
}

}  // namespace fathom::ds4chat

// ================================================================================================
// fathom::toolcall::tool_format for DSML
// ================================================================================================

namespace fathom::toolcall {
namespace {

class dsml_format : public tool_format {
public:
    std::string name() const override { return "dsml"; }

    std::string system_prompt(const nlohmann::json &tools, const tool_choice &choice) const override {
        // Keys arrive sorted (nlohmann::json); the byte-exact path is ds4chat::render_prompt.
        std::string s = ds4chat::dsml_render_tools_section(nlohmann::ordered_json::parse(tools.dump()));
        if (choice.kind == tool_choice::required) s += "\nYou MUST call at least one tool.\n";
        if (choice.kind == tool_choice::function) s += "\nYou MUST call the tool \"" + choice.name + "\".\n";
        return s;
    }

    std::string render_calls(const std::vector<tool_call> &calls) const override {
        std::vector<ds4chat::dsml_call> v;
        for (const auto &c : calls) v.push_back({c.name, c.arguments});
        return ds4chat::dsml_render_tool_calls(v);
    }

    std::string render_result(std::string_view, std::string_view content) const override {
        return "<tool_result>" + std::string(content) + "</tool_result>";
    }

    // DSML markup is unambiguous, so every well-formed call is returned whatever its name
    // (known_names is not consulted); malformed DSML stays in the content as text.
    parsed_output parse(std::string_view text, const std::vector<std::string> &) const override {
        ds4chat::dsml_parser_options o;
        o.malformed_as_text = true;
        const auto r = ds4chat::dsml_parse(text, o);
        parsed_output out;
        out.content = r.content;
        for (const auto &c : r.calls) out.calls.push_back({random_id("call_"), c.name, c.arguments});
        return out;
    }

    size_t safe_content_prefix(std::string_view text) const override {
        return ds4chat::dsml_safe_content_prefix(text);
    }

    // The block and invoke openings the official encoder writes (a named choice also ends the invoke tag),
    // so the model continues inside a call.
    std::string forced_call_prefix(const tool_choice &choice) const override {
        const std::string s = "\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"";
        if (choice.kind == tool_choice::required) return s;
        if (choice.kind == tool_choice::function) return s + choice.name + "\">\n";
        return {};
    }

    std::string_view result_separator() const override { return "\n\n"; }
    bool results_in_call_order() const override { return true; }

    std::unique_ptr<call_decoder> decoder(const std::vector<std::string> &) const override;

    // The official encoder's response_format rendering (docs/ds4-chat-format.md, item 5), appended to
    // the system message after the tools. Keys arrive sorted, as in system_prompt.
    std::string response_format_prompt(const nlohmann::json &schema) const override {
        return "## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n" +
               ds4chat::py_json_dumps(nlohmann::ordered_json::parse(schema.dump()));
    }
};

// DSML calls while they are generated: the stream parser's content and call deltas as call events.
// Malformed markup (parser error) ends decoding; its bytes become content at the end (as parse()
// keeps them as text) unless a call of the failed block was already streamed, in which case they are
// dropped (markup never reaches the content).
class dsml_decoder : public call_decoder {
public:
    dsml_decoder() : p_(ds4chat::dsml_parser_options{}) {}
    void push(std::string_view t, std::vector<call_event> &out) override { convert(p_.feed(t), out); }
    void finish(std::vector<call_event> &out) override {
        convert(p_.finish(), out);
        const ds4chat::dsml_result &r = p_.result();
        // Calls of closed blocks are in r.calls; more begun ones belong to the failed block.
        if (!r.error.empty() && n_begun_ == r.calls.size() && !r.error_text.empty())
            out.push_back({call_event::content, r.error_text});
    }

private:
    void convert(const ds4chat::dsml_delta &d, std::vector<call_event> &out) {
        size_t sent = 0;  // content and call deltas in the order they were decoded
        for (const auto &c : d.call_deltas) {
            if (c.content_pos > sent) out.push_back({call_event::content, d.content.substr(sent, c.content_pos - sent)});
            sent = std::max(sent, c.content_pos);
            if (c.begin) ++n_begun_;
            out.push_back({call_event::call, c.arguments, c.index, c.begin, c.end, c.name});
        }
        if (d.content.size() > sent) out.push_back({call_event::content, d.content.substr(sent)});
    }
    ds4chat::dsml_stream_parser p_;
    size_t n_begun_ = 0;
};

std::unique_ptr<call_decoder> dsml_format::decoder(const std::vector<std::string> &) const {
    return std::make_unique<dsml_decoder>();
}

}  // namespace

std::unique_ptr<tool_format> make_dsml_tool_format() { return std::make_unique<dsml_format>(); }

}  // namespace fathom::toolcall
