// Python str methods and string helpers for the Jinja interpreter. See jinja_strings.h.
#include "chat/jinja_strings.h"

#include <algorithm>
#include <cstdio>

#include "core/error.h"

namespace fathom::jinja {

static bool ascii_alpha(char32_t c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z'); }
static bool ascii_digit(char32_t c) { return c >= '0' && c <= '9'; }
// "Cased" for str.title(): letters of the scripts the case mapping below covers.
static bool is_cased(char32_t c) {
    return ascii_alpha(c) || (c >= 0xC0 && c <= 0x24F && c != 0xD7 && c != 0xF7) || (c >= 0x370 && c <= 0x52F) || c == 0xB5 ||
           (c >= 0xFF21 && c <= 0xFF3A) || (c >= 0xFF41 && c <= 0xFF5A);
}
// Simple (1:1) case mapping for ASCII, Latin-1, Latin Extended-A, Greek, Cyrillic and fullwidth
// Latin, as Python's str.upper()/lower() do them; 'ß'.upper() -> "SS" is handled by the callers.
// Not covered: other scripts (unchanged), Greek final-sigma lowering, İ -> "i̇", ŉ -> "ʼN".
static bool pair_even_upper(char32_t c) {  // blocks where upper case is the even code point of a pair
    return (c >= 0x100 && c <= 0x12F) || (c >= 0x132 && c <= 0x137) || (c >= 0x14A && c <= 0x177) ||
           (c >= 0x460 && c <= 0x481) || (c >= 0x48A && c <= 0x4BF) || (c >= 0x4D0 && c <= 0x52F);
}
static bool pair_odd_upper(char32_t c) { return (c >= 0x139 && c <= 0x148) || (c >= 0x179 && c <= 0x17E) || (c >= 0x4C1 && c <= 0x4CE); }

static char32_t up(char32_t c) {
    if (c < 0x80) return (c >= 'a' && c <= 'z') ? c - 32 : c;
    if ((c >= 0xE0 && c <= 0xFE && c != 0xF7) || (c >= 0x3B1 && c <= 0x3CB && c != 0x3C2) || (c >= 0x430 && c <= 0x44F)) return c - 32;
    if (c >= 0x450 && c <= 0x45F) return c - 80;
    if (c >= 0xFF41 && c <= 0xFF5A) return c - 32;
    if (pair_even_upper(c)) return c & ~char32_t{1};
    if (pair_odd_upper(c)) return (c & 1) ? c : c - 1;
    switch (c) {
    case 0xB5: return 0x39C;
    case 0xFF: return 0x178;
    case 0x131: return 'I';
    case 0x17F: return 'S';
    case 0x3C2: return 0x3A3;
    case 0x3AC: return 0x386;
    case 0x3AD: case 0x3AE: case 0x3AF: return c - 37;
    case 0x3CC: return 0x38C;
    case 0x3CD: case 0x3CE: return c - 63;
    case 0x4CF: return 0x4C0;
    default: return c;
    }
}

static char32_t low(char32_t c) {
    if (c < 0x80) return (c >= 'A' && c <= 'Z') ? c + 32 : c;
    if ((c >= 0xC0 && c <= 0xDE && c != 0xD7) || (c >= 0x391 && c <= 0x3AB && c != 0x3A2) || (c >= 0x410 && c <= 0x42F)) return c + 32;
    if (c >= 0x400 && c <= 0x40F) return c + 80;
    if (c >= 0xFF21 && c <= 0xFF3A) return c + 32;
    if (pair_even_upper(c)) return c | 1;
    if (pair_odd_upper(c)) return (c & 1) ? c + 1 : c;
    switch (c) {
    case 0x178: return 0xFF;
    case 0x386: return 0x3AC;
    case 0x388: case 0x389: case 0x38A: return c + 37;
    case 0x38C: return 0x3CC;
    case 0x38E: case 0x38F: return c + 63;
    case 0x4C0: return 0x4CF;
    default: return c;
    }
}

std::string py_upper(const std::string &s) {
    std::string out;
    out.reserve(s.size());
    for (char32_t c : utf8_decode(s)) {
        if (c == 0xDF) out += "SS";
        else utf8_append(out, up(c));
    }
    return out;
}

std::string py_lower(const std::string &s) {
    std::string out;
    out.reserve(s.size());
    for (char32_t c : utf8_decode(s)) utf8_append(out, low(c));
    return out;
}

std::string py_capitalize(const std::string &s) {
    std::u32string u = utf8_decode(s);
    for (size_t i = 0; i < u.size(); ++i) u[i] = i == 0 ? up(u[i]) : low(u[i]);
    return utf8_encode(u);
}

std::string py_title(const std::string &s) {
    std::u32string u = utf8_decode(s);
    bool prev_cased = false;
    for (char32_t &c : u) {
        c = prev_cased ? low(c) : up(c);
        prev_cased = is_cased(c);
    }
    return utf8_encode(u);
}

std::string html_escape(const std::string &s) {
    std::string out;
    for (char c : s) {
        switch (c) {
        case '&': out += "&amp;"; break;
        case '<': out += "&lt;"; break;
        case '>': out += "&gt;"; break;
        case '"': out += "&#34;"; break;
        case '\'': out += "&#39;"; break;
        default: out.push_back(c);
        }
    }
    return out;
}

std::string py_strip(const std::string &s, const std::optional<std::string> &chars, bool left, bool right) {
    std::u32string u = utf8_decode(s);
    std::u32string set = chars ? utf8_decode(*chars) : std::u32string();
    auto strip_it = [&](char32_t c) { return chars ? set.find(c) != std::u32string::npos : py_isspace(c); };
    size_t b = 0, e = u.size();
    if (left)
        while (b < e && strip_it(u[b])) ++b;
    if (right)
        while (e > b && strip_it(u[e - 1])) --e;
    return utf8_encode(std::u32string_view(u).substr(b, e - b));
}

std::vector<std::string> py_split(const std::string &s, const std::optional<std::string> &sep, int64_t maxsplit, bool from_right) {
    std::vector<std::string> out;
    if (sep) {
        if (sep->empty()) throw fathom::error("empty separator");
        if (!from_right) {
            size_t pos = 0;
            while (maxsplit < 0 || static_cast<int64_t>(out.size()) < maxsplit) {
                size_t f = s.find(*sep, pos);
                if (f == std::string::npos) break;
                out.push_back(s.substr(pos, f - pos));
                pos = f + sep->size();
            }
            out.push_back(s.substr(pos));
            return out;
        }
        size_t end = s.size();
        while (maxsplit < 0 || static_cast<int64_t>(out.size()) < maxsplit) {
            if (end < sep->size()) break;
            size_t f = s.rfind(*sep, end - sep->size());
            if (f == std::string::npos) break;
            out.push_back(s.substr(f + sep->size(), end - f - sep->size()));
            end = f;
        }
        out.push_back(s.substr(0, end));
        std::reverse(out.begin(), out.end());
        return out;
    }
    // Whitespace split: runs of whitespace separate, leading/trailing runs are dropped; once
    // maxsplit is reached the rest (minus whitespace on the consumed side only) is one item.
    std::u32string u = utf8_decode(s);
    if (from_right) std::reverse(u.begin(), u.end());
    size_t i = 0, n = u.size();
    while (true) {
        while (i < n && py_isspace(u[i])) ++i;
        if (i >= n) break;
        if (maxsplit >= 0 && static_cast<int64_t>(out.size()) >= maxsplit) {
            std::u32string piece = u.substr(i);  // the remainder keeps its far-side whitespace
            if (from_right) std::reverse(piece.begin(), piece.end());
            out.push_back(utf8_encode(piece));
            break;
        }
        size_t b = i;
        while (i < n && !py_isspace(u[i])) ++i;
        std::u32string piece = u.substr(b, i - b);
        if (from_right) std::reverse(piece.begin(), piece.end());
        out.push_back(utf8_encode(piece));
    }
    if (from_right) std::reverse(out.begin(), out.end());
    return out;
}

static bool is_line_break(char32_t c) {
    return c == '\n' || c == '\r' || c == 0x0B || c == 0x0C || c == 0x1C || c == 0x1D || c == 0x1E || c == 0x85 || c == 0x2028 ||
           c == 0x2029;
}

std::vector<std::string> py_splitlines(const std::string &s, bool keepends) {
    std::u32string u = utf8_decode(s);
    std::vector<std::string> out;
    size_t b = 0, i = 0;
    while (i < u.size()) {
        if (!is_line_break(u[i])) {
            ++i;
            continue;
        }
        size_t eol = i;
        i += (u[i] == '\r' && i + 1 < u.size() && u[i + 1] == '\n') ? 2 : 1;
        out.push_back(utf8_encode(std::u32string_view(u).substr(b, (keepends ? i : eol) - b)));
        b = i;
    }
    if (b < u.size()) out.push_back(utf8_encode(std::u32string_view(u).substr(b)));
    return out;
}

std::string py_replace(const std::string &s, const std::string &old_s, const std::string &new_s, int64_t count) {
    std::string out;
    int64_t done = 0;
    if (old_s.empty()) {  // insert new_s before every code point and at the end
        std::u32string u = utf8_decode(s);
        for (char32_t c : u) {
            if (count < 0 || done < count) {
                out += new_s;
                ++done;
            }
            utf8_append(out, c);
            check_string_size(out.size());
        }
        if (count < 0 || done < count) out += new_s;
        return out;
    }
    size_t pos = 0;
    while (count < 0 || done < count) {
        size_t f = s.find(old_s, pos);
        if (f == std::string::npos) break;
        out.append(s, pos, f - pos);
        out += new_s;
        check_string_size(out.size());
        pos = f + old_s.size();
        ++done;
    }
    out.append(s, pos, std::string::npos);
    return out;
}

std::string py_percent_format(const std::string &fmt, const value_list &args, bool lenient) {
    std::string out;
    size_t next = 0;
    for (size_t i = 0; i < fmt.size(); ++i) {
        if (fmt[i] != '%') {
            out.push_back(fmt[i]);
            continue;
        }
        if (++i >= fmt.size()) throw fathom::error("incomplete format");
        if (fmt[i] == '%') {
            out.push_back('%');
            continue;
        }
        int prec = -1;
        if (fmt[i] == '.') {
            size_t j = i + 1;
            prec = 0;
            while (j < fmt.size() && fmt[j] >= '0' && fmt[j] <= '9') prec = std::min(prec * 10 + (fmt[j++] - '0'), 1000);
            i = j;
        }
        if (i >= fmt.size()) throw fathom::error("incomplete format");
        if (next >= args.size()) throw fathom::error("not enough arguments for format string");
        const value &x = args[next++];
        char c = fmt[i];
        if (c == 's') {
            out += py_str(x);
        } else if (c == 'r') {
            out += py_repr(x);
        } else if ((c == 'd' || c == 'i') && x.is_number()) {
            out += std::to_string(x.is_float() ? static_cast<int64_t>(x.as_double()) : x.as_int());
        } else if (c == 'f' && x.is_number()) {
            char buf[512];
            std::snprintf(buf, sizeof(buf), "%.*f", prec < 0 ? 6 : std::min(prec, 100), x.as_double());
            out += buf;
        } else {
            throw fathom::error(std::string("unsupported format character '") + c + "' (or argument type " + x.type_name() + ")");
        }
    }
    if (next != args.size() && !lenient) throw fathom::error("not all arguments converted during string formatting");
    return out;
}

// ---- str methods ---------------------------------------------------------------------------------

static std::optional<std::string> opt_str(const call_args &a, size_t i, const char *name) {
    const value *v = a.get(i, name);
    if (!v || v->is_none()) return std::nullopt;
    if (!v->is_string()) throw fathom::error(a.callee + "() argument must be str or None, not " + v->type_name());
    return v->as_string();
}

static const std::string &req_str(const call_args &a, size_t i, const char *name) {
    const value *v = a.get(i, name);
    if (!v) throw fathom::error(a.callee + "() missing required argument '" + name + "'");
    if (!v->is_string()) throw fathom::error(a.callee + "() argument must be str, not " + v->type_name());
    return v->as_string();
}

static int64_t opt_int(const call_args &a, size_t i, const char *name, int64_t dflt) {
    const value *v = a.get(i, name);
    if (!v || v->is_none()) return dflt;
    if (!v->is_int() && !v->is_bool()) throw fathom::error("'" + v->type_name() + "' object cannot be interpreted as an integer");
    return v->as_int();
}

static value str_list(const std::vector<std::string> &parts) {
    value_list out;
    for (const auto &p : parts) out.push_back(value::string(p));
    return value::list(std::move(out));
}

// startswith / endswith with a str or tuple-of-str argument.
static bool affix_match(const std::string &s, const value &arg, bool prefix) {
    auto one = [&](const value &p) {
        if (!p.is_string()) throw fathom::error("startswith/endswith first arg must be str or a tuple of str, not " + p.type_name());
        const std::string &x = p.as_string();
        if (x.size() > s.size()) return false;
        return prefix ? s.compare(0, x.size(), x) == 0 : s.compare(s.size() - x.size(), x.size(), x) == 0;
    };
    if (arg.is_tuple()) {
        for (const auto &p : arg.items())
            if (one(p)) return true;
        return false;
    }
    return one(arg);
}

// str.format with positional / keyword fields; format specs and conversions are not supported.
static std::string py_format(const std::string &fmt, const call_args &a) {
    std::string out;
    size_t auto_idx = 0;
    for (size_t i = 0; i < fmt.size(); ++i) {
        char c = fmt[i];
        if (c == '}' ) {
            if (i + 1 < fmt.size() && fmt[i + 1] == '}') ++i;
            else throw fathom::error("Single '}' encountered in format string");
            out.push_back('}');
            continue;
        }
        if (c != '{') {
            out.push_back(c);
            continue;
        }
        if (i + 1 < fmt.size() && fmt[i + 1] == '{') {
            out.push_back('{');
            ++i;
            continue;
        }
        size_t close = fmt.find('}', i);
        if (close == std::string::npos) throw fathom::error("Single '{' encountered in format string");
        std::string field = fmt.substr(i + 1, close - i - 1);
        if (field.find_first_of(":!.[") != std::string::npos) throw fathom::error("unsupported: str.format field '{" + field + "}' (specs/conversions)");
        const value *v = nullptr;
        if (field.empty()) {
            if (auto_idx >= a.pos.size()) throw fathom::error("Replacement index " + std::to_string(auto_idx) + " out of range for positional args tuple");
            v = &a.pos[auto_idx++];
        } else if (std::all_of(field.begin(), field.end(), [](char d) { return d >= '0' && d <= '9'; })) {
            size_t k = std::stoul(field);
            if (k >= a.pos.size()) throw fathom::error("Replacement index " + field + " out of range for positional args tuple");
            v = &a.pos[k];
        } else {
            for (const auto &[name, kv] : a.kw)
                if (name == field) v = &kv;
            if (!v) throw fathom::error("KeyError: '" + field + "'");
        }
        out += py_str(*v);
        i = close;
    }
    return out;
}

static value str_method_impl(const std::string &s, const std::string &name, call_args &a) {
    a.callee = name;
    if (name == "strip" || name == "lstrip" || name == "rstrip") {
        a.check(1, {});
        return value::string(py_strip(s, opt_str(a, 0, "chars"), name != "rstrip", name != "lstrip"));
    }
    if (name == "split" || name == "rsplit") {
        a.check(2, {"sep", "maxsplit"});
        return str_list(py_split(s, opt_str(a, 0, "sep"), opt_int(a, 1, "maxsplit", -1), name == "rsplit"));
    }
    if (name == "splitlines") {
        const value *k = a.get(0, "keepends");
        return str_list(py_splitlines(s, k && k->truthy()));
    }
    if (name == "startswith" || name == "endswith") {
        a.check(1, {});
        const value *p = a.get(0, "prefix");
        if (!p) throw fathom::error(name + "() takes at least 1 argument (0 given)");
        return value::boolean(affix_match(s, *p, name == "startswith"));
    }
    if (name == "upper") return value::string(py_upper(s));
    if (name == "lower" || name == "casefold") return value::string(py_lower(s));
    if (name == "title") return value::string(py_title(s));
    if (name == "capitalize") return value::string(py_capitalize(s));
    if (name == "replace") {
        a.check(3, {"count"});
        return value::string(py_replace(s, req_str(a, 0, "old"), req_str(a, 1, "new"), opt_int(a, 2, "count", -1)));
    }
    if (name == "find" || name == "rfind" || name == "index" || name == "rindex" || name == "count") {
        a.check(1, {});
        std::u32string u = utf8_decode(s), sub = utf8_decode(req_str(a, 0, "sub"));
        if (name == "count") {
            if (sub.empty()) return value::integer(static_cast<int64_t>(u.size() + 1));
            int64_t n = 0;
            for (size_t p = u.find(sub); p != std::u32string::npos; p = u.find(sub, p + sub.size())) ++n;
            return value::integer(n);
        }
        size_t p = (name == "find" || name == "index") ? u.find(sub) : u.rfind(sub);
        if (p == std::u32string::npos) {
            if (name == "index" || name == "rindex") throw fathom::error("substring not found");
            return value::integer(-1);
        }
        return value::integer(static_cast<int64_t>(p));
    }
    if (name == "join") {
        a.check(1, {});
        if (a.pos.empty()) throw fathom::error("join() takes exactly one argument (0 given)");
        std::string out;
        bool first = true;
        for (const auto &e : a.pos[0].is_dict() ? value_list() : a.pos[0].items()) {
            if (!e.is_string()) throw fathom::error("sequence item: expected str instance, " + e.type_name() + " found");
            if (!first) out += s;
            first = false;
            out += e.as_string();
        }
        return value::string(out);
    }
    if (name == "format") return value::string(py_format(s, a));
    if (name == "removeprefix" || name == "removesuffix") {
        const std::string &x = req_str(a, 0, "affix");
        bool pre = name == "removeprefix";
        if (affix_match(s, value::string(x), pre))
            return value::string(pre ? s.substr(x.size()) : s.substr(0, s.size() - x.size()));
        return value::string(s);
    }
    if (name == "isdigit" || name == "isalpha" || name == "isalnum" || name == "isspace" || name == "isupper" || name == "islower") {
        std::u32string u = utf8_decode(s);
        if (u.empty()) return value::boolean(false);
        bool any_cased = false, ok = true;
        for (char32_t c : u) {
            if (name == "isdigit") ok = ok && ascii_digit(c);
            else if (name == "isalpha") ok = ok && ascii_alpha(c);
            else if (name == "isalnum") ok = ok && (ascii_alpha(c) || ascii_digit(c));
            else if (name == "isspace") ok = ok && py_isspace(c);
            else if (name == "isupper") { ok = ok && !(c >= 'a' && c <= 'z'); any_cased = any_cased || (c >= 'A' && c <= 'Z'); }
            else { ok = ok && !(c >= 'A' && c <= 'Z'); any_cased = any_cased || (c >= 'a' && c <= 'z'); }
        }
        if (name == "isupper" || name == "islower") ok = ok && any_cased;
        return value::boolean(ok);
    }
    if (name == "partition" || name == "rpartition") {
        const std::string &sep = req_str(a, 0, "sep");
        if (sep.empty()) throw fathom::error("empty separator");
        size_t p = name == "partition" ? s.find(sep) : s.rfind(sep);
        if (p == std::string::npos)
            return name == "partition" ? value::tuple({value::string(s), value::string(""), value::string("")})
                                       : value::tuple({value::string(""), value::string(""), value::string(s)});
        return value::tuple({value::string(s.substr(0, p)), value::string(sep), value::string(s.substr(p + sep.size()))});
    }
    if (name == "zfill" || name == "ljust" || name == "rjust" || name == "center") {
        int64_t width = opt_int(a, 0, "width", 0);
        std::optional<std::string> fill = name == "zfill" ? std::optional<std::string>("0") : opt_str(a, 1, "fillchar");
        std::u32string u = utf8_decode(s), f = utf8_decode(fill.value_or(" "));
        if (f.size() != 1) throw fathom::error("The fill character must be exactly one character long");
        int64_t len = static_cast<int64_t>(u.size());
        if (width <= len) return value::string(s);
        if (width > (int64_t{1} << 28)) throw fathom::error(name + "(): width too large");
        int64_t pad = width - len, left = 0;
        if (name == "rjust") left = pad;
        else if (name == "center") left = pad / 2 + (pad & width & 1);
        else if (name == "zfill") {
            left = pad;
            if (!u.empty() && (u[0] == '+' || u[0] == '-'))
                return value::string(utf8_encode(u.substr(0, 1) + std::u32string(static_cast<size_t>(pad), '0') + u.substr(1)));
        }
        std::u32string out = std::u32string(static_cast<size_t>(left), f[0]) + u + std::u32string(static_cast<size_t>(pad - left), f[0]);
        return value::string(utf8_encode(out));
    }
    throw fathom::error("unsupported str method '" + name + "'");
}

value string_method(const value &obj, const std::string &name) {
    static const char *const names[] = {"strip", "lstrip", "rstrip", "split", "rsplit", "splitlines", "startswith", "endswith",
                                        "upper", "lower", "casefold", "title", "capitalize", "replace", "find", "rfind", "index",
                                        "rindex", "count", "join", "format", "removeprefix", "removesuffix", "isdigit", "isalpha",
                                        "isalnum", "isspace", "isupper", "islower", "partition", "rpartition", "zfill", "ljust",
                                        "rjust", "center"};
    if (std::find_if(std::begin(names), std::end(names), [&](const char *n) { return name == n; }) == std::end(names)) return value();
    std::string s = obj.as_string();
    return value::function("str." + name, [s, name](call_args &a) { return str_method_impl(s, name, a); });
}

}  // namespace fathom::jinja
