// Jinja filters and tests: the jinja2 3.1 builtins chat templates use, with tojson replaced by
// transformers' version (json.dumps(x, ensure_ascii=False, indent, separators, sort_keys): no HTML
// escaping, unlike jinja2's own tojson). Filters whose result jinja2 returns as a generator (map,
// select, reject, selectattr, rejectattr, batch) return lists here; they print differently only when
// a template prints the generator object itself.
#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <map>

#include "chat/jinja_builtins.h"
#include "chat/jinja_strings.h"

namespace fathom::jinja {
namespace {

using filter_fn = value (*)(const value &, call_args &);
using test_fn = bool (*)(const value &, call_args &);

const value *arg(const call_args &a, size_t i, const char *name) { return a.get(i, name); }
bool arg_bool(const call_args &a, size_t i, const char *name, bool dflt) {
    const value *v = arg(a, i, name);
    return v ? v->truthy() : dflt;
}
int64_t arg_int(const call_args &a, size_t i, const char *name, int64_t dflt) {
    const value *v = arg(a, i, name);
    if (!v) return dflt;
    if (!v->is_int() && !v->is_bool()) throw fathom::error(a.callee + ": argument '" + name + "' must be an integer");
    return v->as_int();
}
std::string soft_str(const value &v) { return py_str(v); }

// jinja2 make_attrgetter: "a.b.0" walks getitem per dotted part (digits become integer indices).
value attr_path(const value &v, const std::string &path) {
    value cur = v;
    size_t b = 0;
    while (true) {
        size_t e = path.find('.', b);
        std::string part = path.substr(b, e == std::string::npos ? std::string::npos : e - b);
        bool digits = !part.empty() && std::all_of(part.begin(), part.end(), [](char c) { return c >= '0' && c <= '9'; });
        cur = get_item(cur, digits ? value::integer(std::stoll(part)) : value::string(part));
        if (e == std::string::npos) return cur;
        b = e + 1;
    }
}

// Sort key of jinja2's ignore_case postprocessor: lowercase strings unless case_sensitive.
value sort_key(const value &v, bool case_sensitive) {
    return (!case_sensitive && v.is_string()) ? value::string(py_lower(v.as_string())) : v;
}

// ---- filters -------------------------------------------------------------------------------------

value f_abs(const value &v, call_args &) {
    if (v.is_float()) return value::floating(std::fabs(v.as_double()));
    if (v.is_int() || v.is_bool()) return v.as_int() < 0 ? negate(v) : value::integer(v.as_int());
    throw fathom::error("bad operand type for abs(): '" + v.type_name() + "'");
}

value f_attr(const value &v, call_args &a) {
    const value *n = arg(a, 0, "name");
    if (!n || !n->is_string()) throw fathom::error("attr filter needs an attribute name");
    return get_attribute(v, n->as_string());
}

value f_batch(const value &v, call_args &a) {
    int64_t n = arg_int(a, 0, "linecount", 0);
    if (n <= 0 || n > (1 << 20)) throw fathom::error("batch(): linecount must be in [1, 2^20]");
    const value *fill = arg(a, 1, "fill_with");
    value_list out, cur;
    for (const auto &e : iterate(v)) {
        cur.push_back(e);
        if (static_cast<int64_t>(cur.size()) == n) out.push_back(value::list(std::exchange(cur, {})));
    }
    if (!cur.empty()) {
        if (fill && !fill->is_none())
            while (static_cast<int64_t>(cur.size()) < n) cur.push_back(*fill);
        out.push_back(value::list(std::move(cur)));
    }
    return value::list(std::move(out));
}

value f_capitalize(const value &v, call_args &) { return value::string(py_capitalize(soft_str(v))); }

value f_center(const value &v, call_args &a) {
    call_args m;
    m.pos.push_back(value::integer(arg_int(a, 0, "width", 80)));
    return call_value(string_method(value::string(soft_str(v)), "center"), m);
}

value f_default(const value &v, call_args &a) {
    const value *d = arg(a, 0, "default_value");
    bool boolean = arg_bool(a, 1, "boolean", false);
    if (v.is_undefined() || (boolean && !v.truthy())) return d ? *d : value::string("");
    return v;
}

value f_dictsort(const value &v, call_args &a) {
    bool cs = arg_bool(a, 0, "case_sensitive", false);
    const value *by = arg(a, 1, "by");
    bool reverse = arg_bool(a, 2, "reverse", false);
    int pos = 0;
    if (by && by->is_string() && by->as_string() == "value") pos = 1;
    else if (by && !(by->is_string() && by->as_string() == "key")) throw fathom::error("You can only sort by either \"key\" or \"value\"");
    if (!v.is_dict()) throw fathom::error("dictsort: expected a dict, got " + v.type_name());
    value_list items;
    for (const auto &[k, e] : v.entries()) items.push_back(value::tuple({k, e}));
    std::stable_sort(items.begin(), items.end(), [&](const value &x, const value &y) {
        const value &kx = sort_key(x.items()[pos], cs), &ky = sort_key(y.items()[pos], cs);
        return reverse ? py_less(ky, kx) : py_less(kx, ky);
    });
    return value::list(std::move(items));
}

value f_escape(const value &v, call_args &) { return value::string(html_escape(soft_str(v))); }

value f_first(const value &v, call_args &) {
    value_list items = iterate(v);
    return items.empty() ? value::undefined("No first item, sequence was empty.") : items.front();
}

value f_last(const value &v, call_args &) {
    value_list items = iterate(v);
    return items.empty() ? value::undefined("No last item, sequence was empty.") : items.back();
}

// Python float(str): optional sign, digits, '.', exponent, inf/nan, surrounding whitespace, '_'.
bool parse_py_float(const std::string &s, double &out) {
    std::string t = py_strip(s, std::nullopt, true, true);
    std::string clean;
    for (size_t i = 0; i < t.size(); ++i) {
        if (t[i] == '_') {
            if (i == 0 || i + 1 == t.size() || !isdigit(static_cast<unsigned char>(t[i - 1])) || !isdigit(static_cast<unsigned char>(t[i + 1]))) return false;
            continue;
        }
        clean.push_back(t[i]);
    }
    if (clean.empty()) return false;
    std::string low = py_lower(clean);
    std::string body = (low[0] == '+' || low[0] == '-') ? low.substr(1) : low;
    if (body == "inf" || body == "infinity" || body == "nan") {
        out = body == "nan" ? NAN : (low[0] == '-' ? -INFINITY : INFINITY);
        return true;
    }
    if (body.empty() || body.find_first_not_of("0123456789.e+-") != std::string::npos) return false;
    const char *b = clean.c_str() + (clean[0] == '+' ? 1 : 0);
    auto res = std::from_chars(b, clean.c_str() + clean.size(), out, std::chars_format::general);
    return res.ec == std::errc() && res.ptr == clean.c_str() + clean.size();
}

value f_float(const value &v, call_args &a) {
    const value *d = arg(a, 0, "default");
    value dflt = d ? *d : value::floating(0.0);
    if (v.is_undefined()) fail_undefined(v);  // Undefined.__float__ raises
    if (v.is_number()) return value::floating(v.as_double());
    double f;
    if (v.is_string() && parse_py_float(v.as_string(), f)) return value::floating(f);
    return dflt;
}

value f_int(const value &v, call_args &a) {
    const value *d = arg(a, 0, "default");
    value dflt = d ? *d : value::integer(0);
    int64_t base = arg_int(a, 1, "base", 10);
    if (v.is_undefined()) fail_undefined(v);  // Undefined.__int__ raises
    if (v.is_int() || v.is_bool()) return value::integer(v.as_int());
    if (v.is_float()) {
        double f = v.as_double();
        if (!std::isfinite(f) || std::fabs(f) >= 9.2e18) return dflt;
        return value::integer(static_cast<int64_t>(f));
    }
    if (!v.is_string()) return dflt;
    std::string t;
    for (char c : py_strip(v.as_string(), std::nullopt, true, true))
        if (c != '_') t.push_back(c);
    if (!t.empty()) {
        size_t s = (t[0] == '+' || t[0] == '-') ? 1 : 0;
        // int(str, base) accepts the 0x / 0o / 0b prefix matching the base; base 0 infers it.
        auto prefix = [&](char p) { return t.size() > s + 1 && t[s] == '0' && (t[s + 1] == p || t[s + 1] == p - 32); };
        if (base == 0) base = prefix('x') ? 16 : prefix('o') ? 8 : prefix('b') ? 2 : 10;
        if ((base == 16 && prefix('x')) || (base == 8 && prefix('o')) || (base == 2 && prefix('b'))) s += 2;
        if (base < 2 || base > 36) return dflt;
        int64_t r = 0;
        auto res = std::from_chars(t.data() + s, t.data() + t.size(), r, static_cast<int>(base));
        if (s < t.size() && res.ec == std::errc() && res.ptr == t.data() + t.size()) return value::integer(t[0] == '-' ? -r : r);
    }
    double f;
    if (parse_py_float(v.as_string(), f) && std::isfinite(f) && std::fabs(f) < 9.2e18) return value::integer(static_cast<int64_t>(f));
    return dflt;
}

value f_format(const value &v, call_args &a) {
    if (!a.kw.empty()) throw fathom::error("format filter: keyword arguments are not supported");
    return value::string(py_percent_format(soft_str(v), a.pos, false));
}

value f_indent(const value &v, call_args &a) {
    const value *w = arg(a, 0, "width");
    if (w && !w->is_string() && !w->is_int()) throw fathom::error("indent(): width must be an int or a string");
    if (w && w->is_int() && w->as_int() > 4096) throw fathom::error("indent(): width too large");
    std::string ind = (w && w->is_string()) ? w->as_string() : std::string(static_cast<size_t>(std::max<int64_t>(0, w ? w->as_int() : 4)), ' ');
    bool first = arg_bool(a, 1, "first", false), blank = arg_bool(a, 2, "blank", false);
    if (!v.is_string()) throw fathom::error("indent filter: expected a string, got " + v.type_name());  // jinja2: s += "\n"
    std::string s = v.as_string() + "\n";  // jinja2's quirk so splitlines keeps a trailing empty line
    std::vector<std::string> lines = py_splitlines(s, false);
    std::string rv;
    if (blank) {
        for (size_t i = 0; i < lines.size(); ++i) rv += (i ? "\n" + ind : "") + lines[i];
    } else {
        rv = lines.empty() ? "" : lines[0];
        for (size_t i = 1; i < lines.size(); ++i) rv += "\n" + (lines[i].empty() ? "" : ind + lines[i]);
    }
    return value::string(first ? ind + rv : rv);
}

value f_items(const value &v, call_args &) {
    if (v.is_undefined()) return value::list({});
    if (!v.is_dict()) throw fathom::error("items filter: expected a mapping, got " + v.type_name());
    value_list out;
    for (const auto &[k, e] : v.entries()) out.push_back(value::tuple({k, e}));
    return value::list(std::move(out));
}

value f_join(const value &v, call_args &a) {
    const value *d = arg(a, 0, "d");
    const value *attr = arg(a, 1, "attribute");
    std::string sep = d ? soft_str(*d) : "", out;
    bool first = true;
    for (const auto &e : iterate(v)) {
        if (!first) out += sep;
        first = false;
        out += soft_str(attr && !attr->is_none() ? attr_path(e, py_str(*attr)) : e);
        check_string_size(out.size());
    }
    return value::string(out);
}

value f_length(const value &v, call_args &) { return value::integer(py_len(v)); }
value f_list(const value &v, call_args &) { return value::list(iterate(v)); }
value f_lower(const value &v, call_args &) { return value::string(py_lower(soft_str(v))); }
value f_upper(const value &v, call_args &) { return value::string(py_upper(soft_str(v))); }
value f_title(const value &v, call_args &) {
    // jinja2 do_title: split on runs of [-\s({[<], capitalise each piece.
    std::u32string u = utf8_decode(soft_str(v)), out;
    auto is_sep = [](char32_t c) { return py_isspace(c) || c == '-' || c == '(' || c == '{' || c == '[' || c == '<'; };
    size_t i = 0;
    while (i < u.size()) {
        size_t b = i;
        bool sep = is_sep(u[i]);
        while (i < u.size() && is_sep(u[i]) == sep) ++i;
        std::u32string piece = u.substr(b, i - b);
        out += sep ? piece : utf8_decode(py_upper(utf8_encode(piece.substr(0, 1))) + py_lower(utf8_encode(piece.substr(1))));
    }
    return value::string(utf8_encode(out));
}

value f_map(const value &v, call_args &a) {
    const value *attribute = nullptr;
    const value *dflt = nullptr;
    for (const auto &[k, e] : a.kw) {
        if (k == "attribute") attribute = &e;
        else if (k == "default") dflt = &e;
    }
    value_list out;
    if (attribute) {
        for (const auto &e : iterate(v)) {
            value r = attr_path(e, py_str(*attribute));
            out.push_back(r.is_undefined() && dflt ? *dflt : r);
        }
        return value::list(std::move(out));
    }
    if (a.pos.empty() || !a.pos[0].is_string()) throw fathom::error("map(): expected a filter name or attribute=");
    std::string fname = a.pos[0].as_string();
    if (!has_filter(fname)) throw fathom::error("No filter named '" + fname + "'.");
    call_args rest;
    rest.callee = fname;
    rest.pos.assign(a.pos.begin() + 1, a.pos.end());
    rest.kw = a.kw;
    for (const auto &e : iterate(v)) {
        call_args c = rest;
        out.push_back(apply_filter(fname, e, c));
    }
    return value::list(std::move(out));
}

// select / reject / selectattr / rejectattr share one implementation.
value select_impl(const value &v, call_args &a, bool with_attr, bool keep_if) {
    size_t off = 0;
    std::string attr;
    if (with_attr) {
        if (a.pos.empty()) throw fathom::error(a.callee + "(): missing attribute name");
        attr = py_str(a.pos[0]);
        off = 1;
    }
    bool has_test_name = a.pos.size() > off;
    std::string tname = has_test_name ? py_str(a.pos[off]) : "";
    if (has_test_name && !has_test(tname)) throw fathom::error("No test named '" + tname + "'.");
    call_args targs;
    targs.callee = tname;
    if (has_test_name) targs.pos.assign(a.pos.begin() + static_cast<long>(off) + 1, a.pos.end());
    targs.kw = a.kw;
    value_list out;
    for (const auto &e : iterate(v)) {
        value x = with_attr ? attr_path(e, attr) : e;
        call_args c = targs;
        bool r = has_test_name ? apply_test(tname, x, c) : x.truthy();
        if (r == keep_if) out.push_back(e);
    }
    return value::list(std::move(out));
}
value f_select(const value &v, call_args &a) { return select_impl(v, a, false, true); }
value f_reject(const value &v, call_args &a) { return select_impl(v, a, false, false); }
value f_selectattr(const value &v, call_args &a) { return select_impl(v, a, true, true); }
value f_rejectattr(const value &v, call_args &a) { return select_impl(v, a, true, false); }

value min_max(const value &v, call_args &a, bool want_max) {
    bool cs = arg_bool(a, 0, "case_sensitive", false);
    const value *attr = arg(a, 1, "attribute");
    value_list items = iterate(v);
    if (items.empty()) return value::undefined(std::string("No aggregated item, sequence was empty."));
    auto key = [&](const value &e) { return sort_key(attr && !attr->is_none() ? attr_path(e, py_str(*attr)) : e, cs); };
    value best = items[0];
    for (size_t i = 1; i < items.size(); ++i) {
        bool better = want_max ? py_less(key(best), key(items[i])) : py_less(key(items[i]), key(best));
        if (better) best = items[i];
    }
    return best;
}
value f_max(const value &v, call_args &a) { return min_max(v, a, true); }
value f_min(const value &v, call_args &a) { return min_max(v, a, false); }

value f_replace(const value &v, call_args &a) {
    const value *o = arg(a, 0, "old"), *n = arg(a, 1, "new");
    if (!o || !n) throw fathom::error("replace(): needs old and new");
    const value *c = arg(a, 2, "count");
    return value::string(py_replace(soft_str(v), soft_str(*o), soft_str(*n), c && !c->is_none() ? c->as_int() : -1));
}

value f_reverse(const value &v, call_args &) {
    if (v.is_string()) {
        std::u32string u = utf8_decode(v.as_string());
        std::reverse(u.begin(), u.end());
        return value::string(utf8_encode(u));
    }
    value_list items = iterate(v);
    std::reverse(items.begin(), items.end());
    return value::list(std::move(items));
}

value f_round(const value &v, call_args &a) {
    int64_t prec = arg_int(a, 0, "precision", 0);
    const value *m = arg(a, 1, "method");
    std::string method = m ? py_str(*m) : "common";
    if (!v.is_number()) throw fathom::error("round filter: expected a number, got " + v.type_name());
    if (method != "common" && method != "ceil" && method != "floor") throw fathom::error("method must be common, ceil or floor");
    if (method == "common" && !v.is_float()) return value::integer(v.as_int());  // round(int, n) stays int
    double x = v.as_double(), scale = std::pow(10.0, static_cast<double>(prec));
    if (method == "ceil") return value::floating(std::ceil(x * scale) / scale);
    if (method == "floor") return value::floating(std::floor(x * scale) / scale);
    if (!std::isfinite(x)) return value::floating(x);
    if (prec == 0) return value::floating(std::nearbyint(x));  // round-half-even, as Python
    if (prec < 0 || prec > 300) return value::floating(std::nearbyint(x * scale) / scale);
    // Python rounds the exact binary value correctly to `prec` decimals; so does to_chars(fixed).
    char buf[512];
    auto res = std::to_chars(buf, buf + sizeof(buf), x, std::chars_format::fixed, static_cast<int>(prec));
    double r = 0;
    std::from_chars(buf, res.ptr, r);
    return value::floating(r);
}

value f_safe(const value &v, call_args &) { return value::string(soft_str(v)); }
value f_string(const value &v, call_args &) { return value::string(soft_str(v)); }

value f_sort(const value &v, call_args &a) {
    bool reverse = arg_bool(a, 0, "reverse", false), cs = arg_bool(a, 1, "case_sensitive", false);
    const value *attr = arg(a, 2, "attribute");
    value_list items = iterate(v);
    auto key = [&](const value &e) { return sort_key(attr && !attr->is_none() ? attr_path(e, py_str(*attr)) : e, cs); };
    std::stable_sort(items.begin(), items.end(), [&](const value &x, const value &y) {
        return reverse ? py_less(key(y), key(x)) : py_less(key(x), key(y));
    });
    return value::list(std::move(items));
}

value f_sum(const value &v, call_args &a) {
    const value *attr = arg(a, 0, "attribute");
    const value *start = arg(a, 1, "start");
    value total = start ? *start : value::integer(0);
    for (const auto &e : iterate(v)) total = binary_op("+", total, attr && !attr->is_none() ? attr_path(e, py_str(*attr)) : e);
    return total;
}

value f_tojson(const value &v, call_args &a) {
    a.check(1, {"ensure_ascii", "indent", "separators", "sort_keys"});
    json_dump_options opt;
    for (const auto &[k, e] : a.kw)
        if (k == "ensure_ascii" && e.truthy()) throw fathom::error("tojson: ensure_ascii=True is not supported");
    const value *indent = arg(a, 0, "indent");
    if (indent && !indent->is_none()) {
        if (indent->is_string()) {
            opt.indent_is_string = true;
            opt.indent_str = indent->as_string();
        } else {
            if (!indent->is_int() || indent->as_int() > 4096) throw fathom::error("tojson: indent must be an int <= 4096, a string or None");
            opt.indent = static_cast<int>(std::max<int64_t>(0, indent->as_int()));
        }
        opt.item_sep = ",";
    }
    for (const auto &[k, e] : a.kw) {
        if (k == "separators" && !e.is_none()) {
            if (!e.is_sequence() || e.items().size() != 2) throw fathom::error("tojson: separators must be a pair of strings");
            opt.item_sep = py_str(e.items()[0]);
            opt.key_sep = py_str(e.items()[1]);
        }
        if (k == "sort_keys") opt.sort_keys = e.truthy();
    }
    return value::string(py_json_dumps(v, opt));
}

value f_trim(const value &v, call_args &a) {
    const value *c = arg(a, 0, "chars");
    std::optional<std::string> chars;
    if (c && !c->is_none()) chars = soft_str(*c);
    return value::string(py_strip(soft_str(v), chars, true, true));
}

value f_unique(const value &v, call_args &a) {
    bool cs = arg_bool(a, 0, "case_sensitive", false);
    const value *attr = arg(a, 1, "attribute");
    value_list out, seen;
    for (const auto &e : iterate(v)) {
        value k = sort_key(attr && !attr->is_none() ? attr_path(e, py_str(*attr)) : e, cs);
        if (std::any_of(seen.begin(), seen.end(), [&](const value &s) { return py_equal(s, k); })) continue;
        seen.push_back(k);
        out.push_back(e);
    }
    return value::list(std::move(out));
}

value f_wordcount(const value &v, call_args &) {
    // len(re.findall(r"\w+", s)): word characters are letters, digits, '_' (all non-ASCII
    // non-space code points count as letters here).
    int64_t n = 0;
    bool in_word = false;
    for (char32_t c : utf8_decode(soft_str(v))) {
        bool w = (c >= '0' && c <= '9') || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_' || (c >= 0x80 && !py_isspace(c));
        if (w && !in_word) ++n;
        in_word = w;
    }
    return value::integer(n);
}

const std::map<std::string, filter_fn, std::less<>> &filters() {
    static const std::map<std::string, filter_fn, std::less<>> m = {
        {"abs", f_abs}, {"attr", f_attr}, {"batch", f_batch}, {"capitalize", f_capitalize}, {"center", f_center},
        {"count", f_length}, {"d", f_default}, {"default", f_default}, {"dictsort", f_dictsort}, {"e", f_escape},
        {"escape", f_escape}, {"first", f_first}, {"float", f_float}, {"forceescape", f_escape}, {"format", f_format},
        {"indent", f_indent}, {"int", f_int}, {"items", f_items}, {"join", f_join}, {"last", f_last}, {"length", f_length},
        {"list", f_list}, {"lower", f_lower}, {"map", f_map}, {"max", f_max}, {"min", f_min}, {"reject", f_reject},
        {"rejectattr", f_rejectattr}, {"replace", f_replace}, {"reverse", f_reverse}, {"round", f_round}, {"safe", f_safe},
        {"select", f_select}, {"selectattr", f_selectattr}, {"sort", f_sort}, {"string", f_string}, {"sum", f_sum},
        {"title", f_title}, {"tojson", f_tojson}, {"trim", f_trim}, {"unique", f_unique}, {"upper", f_upper},
        {"wordcount", f_wordcount},
    };
    return m;
}

// ---- tests ---------------------------------------------------------------------------------------

const value &test_arg(const call_args &a, const char *what) {
    if (a.pos.empty()) throw fathom::error(std::string("test '") + what + "' needs an argument");
    return a.pos[0];
}
bool t_defined(const value &v, call_args &) { return !v.is_undefined(); }
bool t_undefined(const value &v, call_args &) { return v.is_undefined(); }
bool t_none(const value &v, call_args &) { return v.is_none(); }
bool t_boolean(const value &v, call_args &) { return v.is_bool(); }
bool t_true(const value &v, call_args &) { return v.is_bool() && v.as_bool(); }
bool t_false(const value &v, call_args &) { return v.is_bool() && !v.as_bool(); }
bool t_integer(const value &v, call_args &) { return v.is_int(); }
bool t_float(const value &v, call_args &) { return v.is_float(); }
bool t_number(const value &v, call_args &) { return v.is_number(); }
bool t_string(const value &v, call_args &) { return v.is_string(); }
bool t_mapping(const value &v, call_args &) { return v.is_dict(); }
bool t_iterable(const value &v, call_args &) { return v.is_undefined() || v.is_string() || v.is_sequence() || v.is_dict(); }
bool t_sequence(const value &v, call_args &) { return v.is_undefined() || v.is_string() || v.is_sequence() || v.is_dict(); }
bool t_callable(const value &v, call_args &) { return v.is_function(); }
bool t_escaped(const value &, call_args &) { return false; }
// str(value).islower() / isupper(): no letters of the other case, and at least one cased letter.
bool t_lower(const value &v, call_args &) {
    std::string s = py_str(v);
    return py_lower(s) == s && py_upper(s) != s;
}
bool t_upper(const value &v, call_args &) {
    std::string s = py_str(v);
    return py_upper(s) == s && py_lower(s) != s;
}
// jinja2's even / odd / divisibleby compute Python's value % n, which floats support too.
value py_mod(const value &v, const value &n, const char *test) {
    if (!v.is_number() || !n.is_number()) throw fathom::error(std::string("test '") + test + "' needs numbers, got " + v.type_name());
    return binary_op("%", v, n);
}
bool t_even(const value &v, call_args &) { return py_equal(py_mod(v, value::integer(2), "even"), value::integer(0)); }
bool t_odd(const value &v, call_args &) { return py_equal(py_mod(v, value::integer(2), "odd"), value::integer(1)); }
bool t_divisibleby(const value &v, call_args &a) {
    return py_equal(py_mod(v, test_arg(a, "divisibleby"), "divisibleby"), value::integer(0));
}
bool t_eq(const value &v, call_args &a) { return py_equal(v, test_arg(a, "eq")); }
bool t_ne(const value &v, call_args &a) { return !py_equal(v, test_arg(a, "ne")); }
bool t_lt(const value &v, call_args &a) { return py_less(v, test_arg(a, "lt")); }
bool t_le(const value &v, call_args &a) { return !py_less(test_arg(a, "le"), v); }
bool t_gt(const value &v, call_args &a) { return py_less(test_arg(a, "gt"), v); }
bool t_ge(const value &v, call_args &a) { return !py_less(v, test_arg(a, "ge")); }
bool t_in(const value &v, call_args &a) { return contains(test_arg(a, "in"), v); }
bool t_sameas(const value &v, call_args &a) {
    const value &o = test_arg(a, "sameas");
    if (v.is_none() || v.is_bool() || v.is_undefined()) return v.kind() == o.kind() && py_equal(v, o);
    if (v.is_dict() || v.is_sequence() || v.is_namespace()) return v.kind() == o.kind() && (&v.entries() == &o.entries());
    return false;
}
bool t_filter(const value &v, call_args &) { return v.is_string() && has_filter(v.as_string()); }
bool t_test(const value &v, call_args &) { return v.is_string() && has_test(v.as_string()); }

const std::map<std::string, test_fn, std::less<>> &tests() {
    static const std::map<std::string, test_fn, std::less<>> m = {
        {"defined", t_defined}, {"undefined", t_undefined}, {"none", t_none}, {"boolean", t_boolean}, {"true", t_true},
        {"false", t_false}, {"integer", t_integer}, {"float", t_float}, {"number", t_number}, {"string", t_string},
        {"mapping", t_mapping}, {"iterable", t_iterable}, {"sequence", t_sequence}, {"callable", t_callable},
        {"escaped", t_escaped}, {"lower", t_lower}, {"upper", t_upper}, {"even", t_even}, {"odd", t_odd},
        {"divisibleby", t_divisibleby}, {"eq", t_eq}, {"equalto", t_eq}, {"==", t_eq}, {"ne", t_ne}, {"!=", t_ne},
        {"lt", t_lt}, {"lessthan", t_lt}, {"<", t_lt}, {"le", t_le}, {"<=", t_le}, {"gt", t_gt}, {"greaterthan", t_gt},
        {">", t_gt}, {"ge", t_ge}, {">=", t_ge}, {"in", t_in}, {"sameas", t_sameas}, {"filter", t_filter}, {"test", t_test},
    };
    return m;
}

}  // namespace

bool has_filter(std::string_view name) { return filters().count(name) != 0; }
bool has_test(std::string_view name) { return tests().count(name) != 0; }

value apply_filter(const std::string &name, const value &input, call_args &args) {
    auto it = filters().find(name);
    if (it == filters().end()) throw fathom::error("No filter named '" + name + "'.");
    args.callee = name;
    return it->second(input, args);
}

bool apply_test(const std::string &name, const value &input, call_args &args) {
    auto it = tests().find(name);
    if (it == tests().end()) throw fathom::error("No test named '" + name + "'.");
    args.callee = name;
    return it->second(input, args);
}

}  // namespace fathom::jinja
