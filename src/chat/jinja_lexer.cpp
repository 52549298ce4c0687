// Jinja lexer: splits a template into data text and tag tokens, applying jinja2's whitespace rules
// exactly as jinja2.lexer.Lexer.tokeniter does for trim_blocks / lstrip_blocks environments:
//  - source newlines \r\n and \r become \n, and one trailing newline is dropped;
//  - "{%-" / "{{-" / "{#-" strip all whitespace before the tag, "-%}" / "-}}" / "-#}" after it;
//  - trim_blocks removes the first newline after "%}" and "#}" (not after "}}"); "+%}" keeps it;
//  - lstrip_blocks removes spaces/tabs between a line start and "{%" / "{#" (not "{{"); "{%+" keeps.
#include <cstring>

#include "chat/jinja_ast.h"
#include "core/error.h"

namespace fathom::jinja {
namespace {

bool ascii_space(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v'; }
bool is_digit(char c) { return c >= '0' && c <= '9'; }
bool is_name_start(char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_'; }
bool is_name_char(char c) { return is_name_start(c) || is_digit(c); }

// Python str.rstrip() (Unicode whitespace).
std::string py_rstrip(const std::string &s) {
    std::u32string u = utf8_decode(s);
    size_t n = u.size();
    while (n > 0 && py_isspace(u[n - 1])) --n;
    return utf8_encode(std::u32string_view(u).substr(0, n));
}

// True when s is non-empty and entirely (Unicode) whitespace: re.fullmatch(r"\s+", s).
bool all_space(const std::string &s) {
    if (s.empty()) return false;
    for (char32_t c : utf8_decode(s))
        if (!py_isspace(c)) return false;
    return true;
}

int count_newlines(const std::string &s, size_t from, size_t to) {
    int n = 0;
    for (size_t i = from; i < to; ++i) n += s[i] == '\n';
    return n;
}

class lexer {
public:
    lexer(const std::string &source, const lexer_options &opt) : opt_(opt) { normalize(source); }

    std::vector<token> run() {
        while (pos_ < src_.size()) lex_root();
        out_.push_back({token_kind::token_kind_eof, "", line_});
        return std::move(out_);
    }

private:
    const lexer_options &opt_;
    std::string src_;
    size_t pos_ = 0;
    int line_ = 1;
    bool line_starting_ = true;  // the previous match ended with '\n' (jinja2's line_starting)
    std::vector<token> out_;

    [[noreturn]] void fail(const std::string &msg) const {
        throw fathom::error("chat template line " + std::to_string(line_) + ": " + msg);
    }

    void normalize(const std::string &source) {
        src_.reserve(source.size());
        for (size_t i = 0; i < source.size(); ++i) {
            if (source[i] == '\r') {
                src_.push_back('\n');
                if (i + 1 < source.size() && source[i + 1] == '\n') ++i;
            } else {
                src_.push_back(source[i]);
            }
        }
        if (!src_.empty() && src_.back() == '\n') src_.pop_back();  // keep_trailing_newline=False
    }

    void emit(token_kind k, std::string text) { out_.push_back({k, std::move(text), line_}); }

    // Applies the '-' / lstrip rules to the data text before a tag and emits it.
    void emit_data_before_tag(std::string text, char sign, bool is_variable) {
        if (sign == '-') {
            text = py_rstrip(text);
        } else if (sign != '+' && opt_.lstrip_blocks && !is_variable) {
            size_t nl = text.rfind('\n');
            size_t l_pos = nl == std::string::npos ? 0 : nl + 1;
            if ((l_pos > 0 || line_starting_) && all_space(text.substr(l_pos))) text.resize(l_pos);
        }
        if (!text.empty()) emit(token_kind::token_kind_data, text);
    }

    // Matches "{%[-+]? \s* raw \s* (-%}\s* | %})" at p; returns the end position or npos.
    size_t match_raw_begin(size_t p) const {
        if (src_.compare(p, 2, "{%") != 0) return std::string::npos;
        p += 2;
        if (p < src_.size() && (src_[p] == '-' || src_[p] == '+')) ++p;
        while (p < src_.size() && ascii_space(src_[p])) ++p;
        if (src_.compare(p, 3, "raw") != 0) return std::string::npos;
        p += 3;
        while (p < src_.size() && ascii_space(src_[p])) ++p;
        if (src_.compare(p, 3, "-%}") == 0) {
            p += 3;
            while (p < src_.size() && ascii_space(src_[p])) ++p;
            return p;
        }
        if (src_.compare(p, 2, "%}") == 0) return p + 2;
        return std::string::npos;
    }

    void lex_root() {
        size_t tag = src_.find('{', pos_);
        while (tag != std::string::npos && tag + 1 < src_.size() && std::strchr("{%#", src_[tag + 1]) == nullptr)
            tag = src_.find('{', tag + 1);
        if (tag == std::string::npos || tag + 1 >= src_.size()) {
            std::string rest = src_.substr(pos_);
            emit(token_kind::token_kind_data, rest);
            line_ += count_newlines(src_, pos_, src_.size());
            line_starting_ = !rest.empty() && rest.back() == '\n';
            pos_ = src_.size();
            return;
        }
        char type = src_[tag + 1];
        char sign = (tag + 2 < src_.size() && (src_[tag + 2] == '-' || src_[tag + 2] == '+')) ? src_[tag + 2] : 0;
        std::string text = src_.substr(pos_, tag - pos_);
        size_t raw_end = type == '%' ? match_raw_begin(tag) : std::string::npos;
        emit_data_before_tag(text, sign, type == '{');
        line_ += count_newlines(src_, pos_, tag);
        pos_ = tag + 2 + (sign ? 1 : 0);
        if (raw_end != std::string::npos) {
            line_ += count_newlines(src_, tag, raw_end);
            line_starting_ = src_[raw_end - 1] == '\n';
            pos_ = raw_end;
            lex_raw();
        } else if (type == '#') {
            lex_comment();
        } else {
            emit(type == '{' ? token_kind::token_kind_variable_begin : token_kind::token_kind_block_begin, "");
            lex_tag(type == '{');
        }
    }

    // After "#}" / "%}": '-' eats all following whitespace, '+' nothing, else trim_blocks eats one '\n'.
    size_t tag_suffix_end(size_t end_start, size_t end_len, char sign, bool trim) const {
        size_t p = end_start + end_len;
        if (sign == '-') {
            while (p < src_.size() && ascii_space(src_[p])) ++p;
        } else if (sign != '+' && trim && p < src_.size() && src_[p] == '\n') {
            ++p;
        }
        return p;
    }

    void lex_comment() {
        size_t end = src_.find("#}", pos_);
        if (end == std::string::npos) fail("Missing end of comment tag");
        char sign = (end > pos_ && (src_[end - 1] == '-' || src_[end - 1] == '+')) ? src_[end - 1] : 0;
        size_t after = tag_suffix_end(end, 2, sign, opt_.trim_blocks);
        line_ += count_newlines(src_, pos_, after);
        line_starting_ = src_[after - 1] == '\n';
        pos_ = after;
    }

    void lex_raw() {
        // Find "{%[-+]?\s*endraw\s*(+%}|-%}\s*|%}\n?)".
        for (size_t p = src_.find("{%", pos_); p != std::string::npos; p = src_.find("{%", p + 1)) {
            size_t q = p + 2;
            char sign = (q < src_.size() && (src_[q] == '-' || src_[q] == '+')) ? src_[q] : 0;
            if (sign) ++q;
            while (q < src_.size() && ascii_space(src_[q])) ++q;
            if (src_.compare(q, 6, "endraw") != 0) continue;
            q += 6;
            while (q < src_.size() && ascii_space(src_[q])) ++q;
            char end_sign = (q < src_.size() && (src_[q] == '-' || src_[q] == '+')) ? src_[q] : 0;
            if (src_.compare(q + (end_sign ? 1 : 0), 2, "%}") != 0) continue;
            emit_data_before_tag(src_.substr(pos_, p - pos_), sign, false);
            size_t after = tag_suffix_end(q + (end_sign ? 1 : 0), 2, end_sign, opt_.trim_blocks);
            line_ += count_newlines(src_, pos_, after);
            line_starting_ = src_[after - 1] == '\n';
            pos_ = after;
            return;
        }
        fail("Missing end of raw directive");
    }

    // Tokens inside {{ }} / {% %} until the matching end (only when brackets are balanced).
    void lex_tag(bool is_variable) {
        std::string brackets;  // expected closers
        const char *end_tag = is_variable ? "}}" : "%}";
        while (true) {
            if (pos_ >= src_.size()) fail(is_variable ? "unexpected end of template, expected '}}'" : "unexpected end of template, expected '%}'");
            if (brackets.empty()) {
                size_t p = pos_;
                char sign = 0;
                if ((src_[p] == '-' || (src_[p] == '+' && !is_variable)) && src_.compare(p + 1, 2, end_tag) == 0) sign = src_[p++];
                if (src_.compare(p, 2, end_tag) == 0) {
                    size_t after = is_variable ? tag_suffix_end(p, 2, sign, false) : tag_suffix_end(p, 2, sign, opt_.trim_blocks);
                    emit(is_variable ? token_kind::token_kind_variable_end : token_kind::token_kind_block_end, "");
                    line_ += count_newlines(src_, pos_, after);
                    line_starting_ = src_[after - 1] == '\n';
                    pos_ = after;
                    return;
                }
            }
            char c = src_[pos_];
            if (ascii_space(c)) {
                line_ += c == '\n';
                ++pos_;
            } else if (is_digit(c)) {
                lex_number();
            } else if (is_name_start(c)) {
                size_t b = pos_;
                while (pos_ < src_.size() && is_name_char(src_[pos_])) ++pos_;
                emit(token_kind::token_kind_name, src_.substr(b, pos_ - b));
            } else if (c == '\'' || c == '"') {
                lex_string();
            } else {
                lex_operator(brackets);
            }
        }
    }

    void lex_number() {
        size_t b = pos_;
        auto digits = [&] {  // (\d+_)*\d+
            size_t s = pos_;
            while (pos_ < src_.size() && (is_digit(src_[pos_]) || (src_[pos_] == '_' && pos_ + 1 < src_.size() && is_digit(src_[pos_ + 1]) && pos_ > s)))
                ++pos_;
            return pos_ > s;
        };
        digits();
        bool is_float = false;
        if (pos_ + 1 < src_.size() && src_[pos_] == '.' && is_digit(src_[pos_ + 1])) {
            ++pos_;
            digits();
            is_float = true;
        }
        if (pos_ < src_.size() && (src_[pos_] == 'e' || src_[pos_] == 'E')) {
            size_t save = pos_++;
            if (pos_ < src_.size() && (src_[pos_] == '+' || src_[pos_] == '-')) ++pos_;
            if (pos_ < src_.size() && is_digit(src_[pos_])) {
                digits();
                is_float = true;
            } else {
                pos_ = save;
            }
        }
        std::string text;
        for (size_t i = b; i < pos_; ++i)
            if (src_[i] != '_') text.push_back(src_[i]);
        if (!is_float && text.size() > 1 && text[0] == '0') {
            for (char ch : text)
                if (ch != '0') fail("unsupported integer literal '" + text + "' (leading zeros / 0x / 0o / 0b)");
        }
        emit(is_float ? token_kind::token_kind_float : token_kind::token_kind_integer, text);
    }

    // Python string literal with jinja2's escape decoding ("unicode-escape").
    void lex_string() {
        char quote = src_[pos_];
        size_t p = pos_ + 1;
        std::string out;
        while (true) {
            if (p >= src_.size()) fail("unexpected end of string literal");
            char c = src_[p];
            if (c == quote) break;
            if (c != '\\') {
                out.push_back(c);
                ++p;
                continue;
            }
            if (p + 1 >= src_.size()) fail("unexpected end of string literal");
            char e = src_[p + 1];
            p += 2;
            switch (e) {
            case '\n': break;  // line continuation
            case '\\': out.push_back('\\'); break;
            case '\'': out.push_back('\''); break;
            case '"': out.push_back('"'); break;
            case 'a': out.push_back('\a'); break;
            case 'b': out.push_back('\b'); break;
            case 'f': out.push_back('\f'); break;
            case 'n': out.push_back('\n'); break;
            case 'r': out.push_back('\r'); break;
            case 't': out.push_back('\t'); break;
            case 'v': out.push_back('\v'); break;
            case 'x': case 'u': case 'U': {
                size_t n = e == 'x' ? 2 : e == 'u' ? 4 : 8;
                if (p + n > src_.size()) fail("truncated \\" + std::string(1, e) + " escape in string literal");
                uint32_t cp = 0;
                for (size_t k = 0; k < n; ++k) {
                    char h = src_[p + k];
                    int d = is_digit(h) ? h - '0' : (h >= 'a' && h <= 'f') ? h - 'a' + 10 : (h >= 'A' && h <= 'F') ? h - 'A' + 10 : -1;
                    if (d < 0) fail("truncated \\" + std::string(1, e) + " escape in string literal");
                    cp = cp * 16 + static_cast<uint32_t>(d);
                }
                if (cp > 0x10FFFF) fail("illegal Unicode character in string literal");
                utf8_append(out, cp);
                p += n;
                break;
            }
            default:
                if (e >= '0' && e <= '7') {  // up to 3 octal digits
                    uint32_t cp = static_cast<uint32_t>(e - '0');
                    for (int k = 0; k < 2 && p < src_.size() && src_[p] >= '0' && src_[p] <= '7'; ++k) cp = cp * 8 + static_cast<uint32_t>(src_[p++] - '0');
                    utf8_append(out, cp);
                } else {  // unknown escape: kept verbatim, as Python does
                    out.push_back('\\');
                    out.push_back(e);
                }
            }
        }
        line_ += count_newlines(src_, pos_, p);
        emit(token_kind::token_kind_string, out);
        pos_ = p + 1;
    }

    void lex_operator(std::string &brackets) {
        static const char *const ops[] = {"//", "**", "==", "!=", ">=", "<=", "+", "-", "/", "*", "%", "~", "[", "]",
                                          "(", ")", "{", "}", ">", "<", "=", ".", ":", "|", ",", ";"};
        for (const char *op : ops) {
            size_t n = std::strlen(op);
            if (src_.compare(pos_, n, op) != 0) continue;
            char c = op[0];
            if (n == 1 && (c == '(' || c == '[' || c == '{')) brackets.push_back(c == '(' ? ')' : c == '[' ? ']' : '}');
            if (n == 1 && (c == ')' || c == ']' || c == '}')) {
                if (brackets.empty()) fail(std::string("unexpected '") + c + "'");
                if (brackets.back() != c) fail(std::string("unexpected '") + c + "', expected '" + brackets.back() + "'");
                brackets.pop_back();
            }
            emit(token_kind::token_kind_operator, op);
            pos_ += n;
            return;
        }
        fail(std::string("unexpected char '") + src_[pos_] + "'");
    }
};

}  // namespace

std::vector<token> jinja_tokenize(const std::string &source, const lexer_options &opt) { return lexer(source, opt).run(); }

}  // namespace fathom::jinja
