// Jinja value type: construction, JSON import, and the Python object semantics templates rely on
// (str/repr layout, truthiness, ==, <, json.dumps). See jinja_value.h.
#include "chat/jinja_value.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>

#include "core/error.h"

namespace fathom::jinja {

// ---- construction --------------------------------------------------------------------------------

value value::undefined(std::string hint) {
    value v;
    v.s_ = std::move(hint);
    return v;
}
value value::none() {
    value v;
    v.kind_ = value_kind::value_kind_none;
    return v;
}
value value::boolean(bool b) {
    value v;
    v.kind_ = value_kind::value_kind_bool;
    v.b_ = b;
    return v;
}
value value::integer(int64_t i) {
    value v;
    v.kind_ = value_kind::value_kind_int;
    v.i_ = i;
    return v;
}
value value::floating(double f) {
    value v;
    v.kind_ = value_kind::value_kind_float;
    v.f_ = f;
    return v;
}
value value::string(std::string s) {
    value v;
    v.kind_ = value_kind::value_kind_string;
    v.s_ = std::move(s);
    return v;
}
value value::list(value_list items) {
    value v;
    v.kind_ = value_kind::value_kind_list;
    v.list_ = std::make_shared<value_list>(std::move(items));
    return v;
}
value value::tuple(value_list items) {
    value v = list(std::move(items));
    v.kind_ = value_kind::value_kind_tuple;
    return v;
}
value value::dict(value_pairs entries) {
    value v;
    v.kind_ = value_kind::value_kind_dict;
    v.dict_ = std::make_shared<value_pairs>(std::move(entries));
    return v;
}
value value::make_namespace(value_pairs entries) {
    value v = dict(std::move(entries));
    v.kind_ = value_kind::value_kind_namespace;
    return v;
}
value value::function(std::string name, native_fn fn) {
    value v;
    v.kind_ = value_kind::value_kind_function;
    v.fn_ = std::make_shared<function_data>(function_data{std::move(name), std::move(fn)});
    return v;
}

value value::from_json(const nlohmann::ordered_json &j) {
    switch (j.type()) {
    case nlohmann::ordered_json::value_t::null: return none();
    case nlohmann::ordered_json::value_t::boolean: return boolean(j.get<bool>());
    case nlohmann::ordered_json::value_t::number_integer: return integer(j.get<int64_t>());
    case nlohmann::ordered_json::value_t::number_unsigned: {
        uint64_t u = j.get<uint64_t>();
        if (u > static_cast<uint64_t>(INT64_MAX)) throw fathom::error("chat template: integer " + std::to_string(u) + " exceeds int64");
        return integer(static_cast<int64_t>(u));
    }
    case nlohmann::ordered_json::value_t::number_float: return floating(j.get<double>());
    case nlohmann::ordered_json::value_t::string: return string(j.get<std::string>());
    case nlohmann::ordered_json::value_t::array: {
        value_list items;
        items.reserve(j.size());
        for (const auto &e : j) items.push_back(from_json(e));
        return list(std::move(items));
    }
    case nlohmann::ordered_json::value_t::object: {
        value_pairs entries;
        entries.reserve(j.size());
        for (auto it = j.begin(); it != j.end(); ++it) entries.emplace_back(string(it.key()), from_json(it.value()));
        return dict(std::move(entries));
    }
    default: throw fathom::error("chat template: unsupported JSON value type (binary/discarded)");
    }
}

const value *value::find(std::string_view key) const {
    if (!dict_) return nullptr;
    for (const auto &[k, v] : *dict_)
        if (k.is_string() && k.as_string() == key) return &v;
    return nullptr;
}

const value *value::find(const value &key) const {
    if (!dict_) return nullptr;
    if (key.is_string()) return find(std::string_view(key.as_string()));
    for (const auto &[k, v] : *dict_)
        if (py_equal(k, key)) return &v;
    return nullptr;
}

size_t approx_bytes(const value &v, size_t cap) {
    if (v.is_string()) return std::min(v.as_string().size(), cap + 1);
    size_t n = 16;
    if (v.is_list() || v.is_tuple()) {  // immutable in the sandbox: no cycles
        for (const auto &e : v.items()) {
            n += approx_bytes(e, cap - std::min(n, cap));
            if (n > cap) return cap + 1;
        }
    } else if (v.is_dict()) {
        for (const auto &[k, e] : v.entries()) {
            n += approx_bytes(k, cap - std::min(n, cap)) + approx_bytes(e, cap - std::min(n, cap));
            if (n > cap) return cap + 1;
        }
    }
    return n;  // numbers, none, namespaces (which may hold themselves) and functions: their own 16
}

void check_string_size(size_t bytes) {
    if (bytes > kMaxValueBytes)
        throw fathom::error("result too large (over " + std::to_string(kMaxValueBytes >> 20) +
                            " MiB): the chat template sandbox's limit");
}

void check_value_size(const value &v) {
    if (approx_bytes(v) > kMaxValueBytes) check_string_size(kMaxValueBytes + 1);
}

bool value::truthy() const {
    switch (kind_) {
    case value_kind::value_kind_undefined:
    case value_kind::value_kind_none: return false;
    case value_kind::value_kind_bool: return b_;
    case value_kind::value_kind_int: return i_ != 0;
    case value_kind::value_kind_float: return f_ != 0.0;
    case value_kind::value_kind_string: return !s_.empty();
    case value_kind::value_kind_list:
    case value_kind::value_kind_tuple: return !list_->empty();
    case value_kind::value_kind_dict: return !dict_->empty();
    default: return true;
    }
}

std::string value::type_name() const {
    switch (kind_) {
    case value_kind::value_kind_undefined: return "Undefined";
    case value_kind::value_kind_none: return "NoneType";
    case value_kind::value_kind_bool: return "bool";
    case value_kind::value_kind_int: return "int";
    case value_kind::value_kind_float: return "float";
    case value_kind::value_kind_string: return "str";
    case value_kind::value_kind_list: return "list";
    case value_kind::value_kind_tuple: return "tuple";
    case value_kind::value_kind_dict: return "dict";
    case value_kind::value_kind_namespace: return "Namespace";
    default: return "function";
    }
}

const value *call_args::get(size_t index, std::string_view name) const {
    if (index < pos.size()) return &pos[index];
    for (const auto &[k, v] : kw)
        if (k == name) return &v;
    return nullptr;
}

void call_args::check(size_t max_pos, std::initializer_list<std::string_view> allowed) const {
    if (pos.size() > max_pos)
        throw fathom::error(callee + "() takes at most " + std::to_string(max_pos) + " positional arguments (" +
                            std::to_string(pos.size()) + " given)");
    for (const auto &[k, v] : kw)
        if (std::find(allowed.begin(), allowed.end(), k) == allowed.end())
            throw fathom::error(callee + "() got an unexpected keyword argument '" + k + "'");
}

// ---- UTF-8 ---------------------------------------------------------------------------------------

void utf8_append(std::string &out, char32_t cp) {
    if (cp >= 0xDC80 && cp <= 0xDCFF) {  // surrogate-escaped raw byte
        out.push_back(static_cast<char>(cp - 0xDC00));
    } else if (cp < 0x80) {
        out.push_back(static_cast<char>(cp));
    } else if (cp < 0x800) {
        out.push_back(static_cast<char>(0xC0 | (cp >> 6)));
        out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
    } else if (cp < 0x10000) {
        out.push_back(static_cast<char>(0xE0 | (cp >> 12)));
        out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
        out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
    } else {
        out.push_back(static_cast<char>(0xF0 | (cp >> 18)));
        out.push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
        out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
        out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
    }
}

std::u32string utf8_decode(std::string_view s) {
    std::u32string out;
    out.reserve(s.size());
    size_t i = 0;
    while (i < s.size()) {
        auto b0 = static_cast<unsigned char>(s[i]);
        int len = b0 < 0x80 ? 1 : (b0 >> 5) == 0x6 ? 2 : (b0 >> 4) == 0xE ? 3 : (b0 >> 3) == 0x1E ? 4 : 0;
        char32_t cp = len == 1 ? b0 : len == 2 ? (b0 & 0x1F) : len == 3 ? (b0 & 0x0F) : (b0 & 0x07);
        bool ok = len > 0 && i + len <= s.size();
        for (int k = 1; ok && k < len; ++k) {
            auto b = static_cast<unsigned char>(s[i + k]);
            if ((b & 0xC0) != 0x80) ok = false;
            cp = (cp << 6) | (b & 0x3F);
        }
        // Reject overlong forms, surrogates and out-of-range values so encode(decode(s)) == s.
        if (ok && ((len == 2 && cp < 0x80) || (len == 3 && cp < 0x800) || (len == 4 && (cp < 0x10000 || cp > 0x10FFFF)) ||
                   (cp >= 0xD800 && cp <= 0xDFFF)))
            ok = false;
        if (!ok) {
            out.push_back(0xDC00 + b0);
            i += 1;
        } else {
            out.push_back(cp);
            i += len;
        }
    }
    return out;
}

std::string utf8_encode(std::u32string_view s) {
    std::string out;
    out.reserve(s.size());
    for (char32_t c : s) utf8_append(out, c);
    return out;
}

bool py_isspace(char32_t c) {
    if ((c >= 0x09 && c <= 0x0D) || (c >= 0x1C && c <= 0x20)) return true;
    if (c == 0x85 || c == 0xA0 || c == 0x1680) return true;
    if (c >= 0x2000 && c <= 0x200A) return true;
    return c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F || c == 0x3000;
}

// ---- str / repr ----------------------------------------------------------------------------------

std::string py_float_repr(double f) {
    if (std::isnan(f)) return "nan";
    if (std::isinf(f)) return f < 0 ? "-inf" : "inf";
    // Shortest round-trip digits in scientific form, e.g. "1.2345e+17", then Python's layout rule:
    // fixed notation when -4 <= exponent < 16, scientific otherwise.
    char buf[64];
    auto res = std::to_chars(buf, buf + sizeof(buf), f, std::chars_format::scientific);
    std::string sci(buf, res.ptr);
    bool neg = sci[0] == '-';
    if (neg) sci.erase(0, 1);
    size_t epos = sci.find('e');
    std::string mant = sci.substr(0, epos);
    int exp10 = std::stoi(sci.substr(epos + 1));
    std::string digits;
    for (char c : mant)
        if (c != '.') digits.push_back(c);
    std::string out = neg ? "-" : "";
    if (exp10 >= -4 && exp10 < 16) {
        if (exp10 < 0) {
            out += "0." + std::string(static_cast<size_t>(-exp10 - 1), '0') + digits;
        } else if (static_cast<int>(digits.size()) <= exp10 + 1) {
            out += digits + std::string(static_cast<size_t>(exp10 + 1 - static_cast<int>(digits.size())), '0') + ".0";
        } else {
            out += digits.substr(0, static_cast<size_t>(exp10 + 1)) + "." + digits.substr(static_cast<size_t>(exp10 + 1));
        }
        return out;
    }
    out += digits.substr(0, 1);
    if (digits.size() > 1) out += "." + digits.substr(1);
    char ebuf[16];
    std::snprintf(ebuf, sizeof(ebuf), "e%c%02d", exp10 < 0 ? '-' : '+', exp10 < 0 ? -exp10 : exp10);
    return out + ebuf;
}

// Python's str.isprintable() for the code points repr() escapes. Covers controls, the Unicode
// separators and the common format characters; other unassigned/private code points print raw.
static bool py_isprintable(char32_t c) {
    if (c < 0x20 || (c >= 0x7F && c <= 0xA0) || c == 0xAD) return false;
    if (c == 0x1680 || (c >= 0x2000 && c <= 0x200F) || (c >= 0x2028 && c <= 0x202F)) return false;
    if ((c >= 0x205F && c <= 0x2064) || c == 0x3000 || c == 0xFEFF) return false;
    if (c >= 0xD800 && c <= 0xDFFF) return false;
    return true;
}

static std::string py_string_repr(const std::string &s) {
    bool has_single = s.find('\'') != std::string::npos, has_double = s.find('"') != std::string::npos;
    char quote = (has_single && !has_double) ? '"' : '\'';
    std::string out(1, quote);
    for (char32_t c : utf8_decode(s)) {
        if (c == static_cast<char32_t>(quote) || c == '\\') {
            out.push_back('\\');
            out.push_back(static_cast<char>(c));
        } else if (c == '\n') {
            out += "\\n";
        } else if (c == '\r') {
            out += "\\r";
        } else if (c == '\t') {
            out += "\\t";
        } else if (!py_isprintable(c)) {
            char buf[16];
            if (c < 0x100) std::snprintf(buf, sizeof(buf), "\\x%02x", static_cast<unsigned>(c));
            else std::snprintf(buf, sizeof(buf), "\\u%04x", static_cast<unsigned>(c));
            out += buf;
        } else {
            utf8_append(out, c);
        }
    }
    out.push_back(quote);
    return out;
}

static std::string py_container_str(const value &v) {
    std::string out;
    if (v.is_sequence()) {
        out = v.is_list() ? "[" : "(";
        const auto &items = v.items();
        for (size_t i = 0; i < items.size(); ++i) {
            if (i) out += ", ";
            out += py_repr(items[i]);
        }
        if (v.is_tuple() && items.size() == 1) out += ",";
        out += v.is_list() ? "]" : ")";
        return out;
    }
    out = v.is_namespace() ? "<Namespace {" : "{";
    bool first = true;
    for (const auto &[k, e] : v.entries()) {
        if (!first) out += ", ";
        first = false;
        out += py_repr(k) + ": " + py_repr(e);
    }
    out += v.is_namespace() ? "}>" : "}";
    return out;
}

std::string py_str(const value &v) {
    switch (v.kind()) {
    case value_kind::value_kind_undefined: return "";
    case value_kind::value_kind_none: return "None";
    case value_kind::value_kind_bool: return v.as_bool() ? "True" : "False";
    case value_kind::value_kind_int: return std::to_string(v.as_int());
    case value_kind::value_kind_float: return py_float_repr(v.as_double());
    case value_kind::value_kind_string: return v.as_string();
    case value_kind::value_kind_function: return "<function " + v.func().name + ">";
    default: return py_container_str(v);
    }
}

std::string py_repr(const value &v) {
    if (v.is_string()) return py_string_repr(v.as_string());
    if (v.is_undefined()) return "Undefined";
    return py_str(v);
}

// ---- comparison ----------------------------------------------------------------------------------

bool py_equal(const value &a, const value &b) {
    if (a.is_number() && b.is_number()) {
        if (a.is_float() || b.is_float()) return a.as_double() == b.as_double();
        return a.as_int() == b.as_int();
    }
    if (a.kind() != b.kind()) return false;
    switch (a.kind()) {
    case value_kind::value_kind_undefined:
    case value_kind::value_kind_none: return true;
    case value_kind::value_kind_string: return a.as_string() == b.as_string();
    case value_kind::value_kind_list:
    case value_kind::value_kind_tuple: {
        const auto &x = a.items(), &y = b.items();
        if (x.size() != y.size()) return false;
        for (size_t i = 0; i < x.size(); ++i)
            if (!py_equal(x[i], y[i])) return false;
        return true;
    }
    case value_kind::value_kind_dict: {
        if (a.entries().size() != b.entries().size()) return false;
        for (const auto &[k, v] : a.entries()) {
            const value *o = b.find(k);
            if (!o || !py_equal(v, *o)) return false;
        }
        return true;
    }
    case value_kind::value_kind_namespace: return &a.entries() == &b.entries();
    case value_kind::value_kind_function: return &a.func() == &b.func();
    default: return false;
    }
}

bool py_less(const value &a, const value &b) {
    if (a.is_number() && b.is_number()) {
        if (a.is_float() || b.is_float()) return a.as_double() < b.as_double();
        return a.as_int() < b.as_int();
    }
    if (a.is_string() && b.is_string()) return a.as_string() < b.as_string();  // UTF-8 order == code point order
    if (a.kind() == b.kind() && a.is_sequence()) {
        const auto &x = a.items(), &y = b.items();
        for (size_t i = 0; i < x.size() && i < y.size(); ++i) {
            if (py_equal(x[i], y[i])) continue;
            return py_less(x[i], y[i]);
        }
        return x.size() < y.size();
    }
    throw fathom::error("'<' not supported between instances of '" + a.type_name() + "' and '" + b.type_name() + "'");
}

// ---- json.dumps ----------------------------------------------------------------------------------

static void json_string(std::string &out, const std::string &s) {
    out.push_back('"');
    for (char ch : s) {
        auto c = static_cast<unsigned char>(ch);
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
                std::snprintf(buf, sizeof(buf), "\\u%04x", c);
                out += buf;
            } else {
                out.push_back(ch);
            }
        }
    }
    out.push_back('"');
}

static std::string json_key(const value &k) {
    if (k.is_string()) return k.as_string();
    if (k.is_bool()) return k.as_bool() ? "true" : "false";
    if (k.is_none()) return "null";
    if (k.is_int()) return std::to_string(k.as_int());
    if (k.is_float()) return py_float_repr(k.as_double());
    throw fathom::error("keys must be str, int, float, bool or None, not " + k.type_name());
}

static void json_dump(std::string &out, const value &v, const json_dump_options &opt, int depth) {
    auto newline_indent = [&](int d) {
        if (opt.indent < 0 && !opt.indent_is_string) return;
        out.push_back('\n');
        for (int i = 0; i < d; ++i) out += opt.indent_is_string ? opt.indent_str : std::string(static_cast<size_t>(opt.indent), ' ');
    };
    switch (v.kind()) {
    case value_kind::value_kind_none: out += "null"; return;
    case value_kind::value_kind_bool: out += v.as_bool() ? "true" : "false"; return;
    case value_kind::value_kind_int: out += std::to_string(v.as_int()); return;
    case value_kind::value_kind_float: {
        double f = v.as_double();
        out += std::isnan(f) ? "NaN" : std::isinf(f) ? (f < 0 ? "-Infinity" : "Infinity") : py_float_repr(f);
        return;
    }
    case value_kind::value_kind_string: json_string(out, v.as_string()); return;
    case value_kind::value_kind_list:
    case value_kind::value_kind_tuple: {
        if (v.items().empty()) {
            out += "[]";
            return;
        }
        out.push_back('[');
        bool first = true;
        for (const auto &e : v.items()) {
            if (!first) out += opt.item_sep;
            first = false;
            newline_indent(depth + 1);
            json_dump(out, e, opt, depth + 1);
        }
        newline_indent(depth);
        out.push_back(']');
        return;
    }
    case value_kind::value_kind_dict: {
        if (v.entries().empty()) {
            out += "{}";
            return;
        }
        std::vector<std::pair<std::string, const value *>> items;
        for (const auto &[k, e] : v.entries()) items.emplace_back(json_key(k), &e);
        if (opt.sort_keys)
            std::stable_sort(items.begin(), items.end(), [](const auto &x, const auto &y) { return x.first < y.first; });
        out.push_back('{');
        bool first = true;
        for (const auto &[k, e] : items) {
            if (!first) out += opt.item_sep;
            first = false;
            newline_indent(depth + 1);
            json_string(out, k);
            out += opt.key_sep;
            json_dump(out, *e, opt, depth + 1);
        }
        newline_indent(depth);
        out.push_back('}');
        return;
    }
    default: throw fathom::error("Object of type " + v.type_name() + " is not JSON serializable");
    }
}

std::string py_json_dumps(const value &v, const json_dump_options &opt) {
    std::string out;
    json_dump(out, v, opt, 0);
    return out;
}

}  // namespace fathom::jinja
