// Jinja builtins: attribute/item access, operators, Python str/dict/list methods and the stateless
// globals. Filters and tests live in jinja_filters.cpp. Semantics follow jinja2 3.1's sandboxed
// environment (ImmutableSandboxedEnvironment) as transformers configures it.
#include <algorithm>
#include <cmath>
#include <limits>

#include "chat/jinja_builtins.h"
#include "chat/jinja_strings.h"

namespace fathom::jinja {

[[noreturn]] void fail_undefined(const value &u) {
    throw fathom::error(u.as_string().empty() ? std::string("undefined value") : u.as_string());
}

static std::string obj_desc(const value &v) {
    std::string out = "'";  // built by appending: GCC 12 -Wrestrict misfires on "lit" + std::string&&
    out += v.type_name();
    out += " object'";
    return out;
}

value_list iterate(const value &v) {
    switch (v.kind()) {
    case value_kind::value_kind_undefined: return {};
    case value_kind::value_kind_list:
    case value_kind::value_kind_tuple: return v.items();
    case value_kind::value_kind_dict: {
        value_list keys;
        for (const auto &[k, e] : v.entries()) keys.push_back(k);
        return keys;
    }
    case value_kind::value_kind_string: {
        value_list chars;
        for (char32_t c : utf8_decode(v.as_string())) chars.push_back(value::string(utf8_encode(std::u32string(1, c))));
        return chars;
    }
    default: throw fathom::error("'" + v.type_name() + "' object is not iterable");
    }
}

int64_t py_len(const value &v) {
    switch (v.kind()) {
    case value_kind::value_kind_undefined: return 0;
    case value_kind::value_kind_string: return static_cast<int64_t>(utf8_decode(v.as_string()).size());
    case value_kind::value_kind_list:
    case value_kind::value_kind_tuple: return static_cast<int64_t>(v.items().size());
    case value_kind::value_kind_dict: return static_cast<int64_t>(v.entries().size());
    default: throw fathom::error("object of type '" + v.type_name() + "' has no len()");
    }
}

// ---- methods -------------------------------------------------------------------------------------

static value bound(const std::string &name, native_fn fn) { return value::function(name, std::move(fn)); }

static value unsafe_method(const value &obj, const std::string &name) {
    std::string msg = "access to attribute '" + name + "' of '" + obj.type_name() + "' object is unsafe.";
    return bound(name, [msg](call_args &) -> value { throw fathom::error(msg); });
}

static value dict_method(const value &obj, const std::string &name) {
    if (name == "get")
        return bound("dict.get", [obj](call_args &a) {
            a.callee = "get";
            a.check(2, {});
            if (a.pos.empty()) throw fathom::error("get expected at least 1 argument, got 0");
            const value *v = obj.find(a.pos[0]);
            return v ? *v : (a.pos.size() > 1 ? a.pos[1] : value::none());
        });
    if (name == "items" || name == "keys" || name == "values")
        return bound("dict." + name, [obj, name](call_args &a) {
            a.callee = name;
            a.check(0, {});
            value_list out;
            for (const auto &[k, v] : obj.entries())
                out.push_back(name == "items" ? value::tuple({k, v}) : name == "keys" ? k : v);
            return value::list(std::move(out));
        });
    if (name == "copy") return bound("dict.copy", [obj](call_args &) { return value::dict(obj.entries()); });
    if (name == "update" || name == "pop" || name == "popitem" || name == "setdefault" || name == "clear") return unsafe_method(obj, name);
    return value();
}

static value list_method(const value &obj, const std::string &name) {
    if (name == "index" || name == "count")
        return bound("list." + name, [obj, name](call_args &a) {
            a.callee = name;
            a.check(1, {});
            if (a.pos.empty()) throw fathom::error(name + "() takes exactly one argument (0 given)");
            int64_t n = 0;
            const auto &items = obj.items();
            for (size_t i = 0; i < items.size(); ++i) {
                if (!py_equal(items[i], a.pos[0])) continue;
                if (name == "index") return value::integer(static_cast<int64_t>(i));
                ++n;
            }
            if (name == "index") throw fathom::error(py_repr(a.pos[0]) + " is not in list");
            return value::integer(n);
        });
    if (name == "append" || name == "extend" || name == "insert" || name == "pop" || name == "remove" || name == "reverse" ||
        name == "sort" || name == "clear")
        return unsafe_method(obj, name);
    return value();
}

value get_attribute(const value &obj, const std::string &name) {
    if (obj.is_undefined()) fail_undefined(obj);
    std::string hint = obj_desc(obj) + " has no attribute '" + name + "'";
    if (!name.empty() && name[0] == '_') return value::undefined(hint);  // sandbox: no private attributes
    if (obj.is_dict()) {
        value m = dict_method(obj, name);
        if (!m.is_undefined()) return m;
        const value *v = obj.find(std::string_view(name));
        return v ? *v : value::undefined(hint);
    }
    if (obj.is_namespace()) {
        const value *v = obj.find(std::string_view(name));
        return v ? *v : value::undefined(hint);
    }
    if (obj.is_string()) {
        value m = string_method(obj, name);
        return m.is_undefined() ? value::undefined(hint) : m;
    }
    if (obj.is_sequence()) {
        value m = list_method(obj, name);
        return m.is_undefined() ? value::undefined(hint) : m;
    }
    return value::undefined(hint);
}

// Python index -> position in [0, n), or -1 when out of range.
static int64_t normalize_index(const value &key, int64_t n) {
    int64_t i = key.as_int();
    if (i < 0) i += n;
    return (i < 0 || i >= n) ? -1 : i;
}

value get_item(const value &obj, const value &key) {
    if (obj.is_undefined()) fail_undefined(obj);
    std::string hint = key.is_string() ? obj_desc(obj) + " has no attribute '" + key.as_string() + "'"
                                       : obj.type_name() + " object has no element " + py_repr(key);
    if (obj.is_dict() || obj.is_namespace()) {
        const value *v = obj.find(key);
        if (v) return *v;
    } else if ((obj.is_sequence() || obj.is_string()) && (key.is_int() || key.is_bool())) {
        if (obj.is_string()) {
            std::u32string u = utf8_decode(obj.as_string());
            int64_t i = normalize_index(key, static_cast<int64_t>(u.size()));
            if (i >= 0) return value::string(utf8_encode(u.substr(static_cast<size_t>(i), 1)));
        } else {
            int64_t i = normalize_index(key, static_cast<int64_t>(obj.items().size()));
            if (i >= 0) return obj.items()[static_cast<size_t>(i)];
        }
    }
    if (key.is_string()) {  // jinja2 falls back to getattr for string keys
        value a = get_attribute(obj, key.as_string());
        if (!a.is_undefined()) return a;
    }
    return value::undefined(hint);
}

value get_slice(const value &obj, const value &start, const value &stop, const value &step) {
    if (obj.is_undefined()) fail_undefined(obj);
    auto opt_int = [](const value &v, const char *what) -> std::optional<int64_t> {
        if (v.is_undefined() || v.is_none()) return std::nullopt;
        if (!v.is_int() && !v.is_bool()) throw fathom::error(std::string("slice ") + what + " must be an integer or None");
        return v.as_int();
    };
    int64_t st = opt_int(step, "step").value_or(1);
    if (st == 0) throw fathom::error("slice step cannot be zero");
    std::u32string u;
    int64_t n;
    if (obj.is_string()) {
        u = utf8_decode(obj.as_string());
        n = static_cast<int64_t>(u.size());
    } else if (obj.is_sequence()) {
        n = static_cast<int64_t>(obj.items().size());
    } else {
        throw fathom::error("'" + obj.type_name() + "' object is not subscriptable");
    }
    // CPython's PySlice_AdjustIndices.
    auto adjust = [&](std::optional<int64_t> v, int64_t dflt) {
        if (!v) return dflt;
        int64_t i = *v;
        if (i < 0) {
            i += n;
            if (i < 0) i = st < 0 ? -1 : 0;
        } else if (i >= n) {
            i = st < 0 ? n - 1 : n;
        }
        return i;
    };
    int64_t b = adjust(opt_int(start, "start"), st < 0 ? n - 1 : 0);
    int64_t e = adjust(opt_int(stop, "stop"), st < 0 ? -1 : n);
    std::vector<int64_t> idx;
    for (int64_t i = b; st > 0 ? i < e : i > e;) {
        idx.push_back(i);
        if (__builtin_add_overflow(i, st, &i)) break;  // a huge step just ends the slice
    }
    if (obj.is_string()) {
        std::u32string out;
        for (int64_t i : idx) out.push_back(u[static_cast<size_t>(i)]);
        return value::string(utf8_encode(out));
    }
    value_list out;
    for (int64_t i : idx) out.push_back(obj.items()[static_cast<size_t>(i)]);
    return obj.is_tuple() ? value::tuple(std::move(out)) : value::list(std::move(out));
}

value call_value(const value &fn, call_args &args) {
    if (fn.is_undefined()) fail_undefined(fn);
    if (!fn.is_function()) throw fathom::error("'" + fn.type_name() + "' object is not callable");
    if (args.callee.empty()) args.callee = fn.func().name;
    return fn.func().fn(args);
}

// ---- operators -----------------------------------------------------------------------------------

static void check_overflow(bool overflow) {
    if (overflow) throw fathom::error("integer overflow (Python integers are unbounded; Fathom's are 64-bit)");
}

static value arith(const std::string &op, const value &a, const value &b) {
    bool ints = !a.is_float() && !b.is_float();
    if (ints) {
        int64_t x = a.as_int(), y = b.as_int(), r = 0;
        if (op == "+" || op == "-" || op == "*") {
            check_overflow(op == "+" ? __builtin_add_overflow(x, y, &r) : op == "-" ? __builtin_sub_overflow(x, y, &r) : __builtin_mul_overflow(x, y, &r));
            return value::integer(r);
        }
        if (op == "//" || op == "%") {
            if (y == 0) throw fathom::error(op == "//" ? "integer division or modulo by zero" : "integer modulo by zero");
            if (x == INT64_MIN && y == -1) throw fathom::error("integer overflow");
            int64_t q = x / y, m = x % y;
            if (m != 0 && ((m < 0) != (y < 0))) {
                --q;
                m += y;
            }
            return value::integer(op == "//" ? q : m);
        }
        if (op == "**" && y >= 0) {  // square-and-multiply, overflow-checked
            int64_t p = 1, base = x;
            for (int64_t e = y; e > 0; e >>= 1) {
                if (e & 1) check_overflow(__builtin_mul_overflow(p, base, &p));
                if (e > 1) check_overflow(__builtin_mul_overflow(base, base, &base));
            }
            return value::integer(p);
        }
    }
    double x = a.as_double(), y = b.as_double();
    if (op == "+") return value::floating(x + y);
    if (op == "-") return value::floating(x - y);
    if (op == "*") return value::floating(x * y);
    if (op == "/") {
        if (y == 0) throw fathom::error("division by zero");
        return value::floating(x / y);
    }
    if (op == "//" || op == "%") {
        if (y == 0) throw fathom::error("float division by zero");
        double m = std::fmod(x, y);
        if (m != 0 && ((m < 0) != (y < 0))) m += y;
        if (op == "%") return value::floating(m);
        double div = (x - m) / y;  // CPython float_divmod: exact multiple, then snap to the floor
        if (div == 0) return value::floating(std::copysign(0.0, x / y));
        double fl = std::floor(div);
        return value::floating(div - fl > 0.5 ? fl + 1 : fl);
    }
    if (op == "**") {
        if (x == 0 && y < 0) throw fathom::error("0.0 cannot be raised to a negative power");
        return value::floating(std::pow(x, y));
    }
    throw fathom::error("unknown operator " + op);
}

static value repeat(const value &seq, int64_t n) {
    size_t unit = seq.is_string() ? seq.as_string().size() : seq.items().size();
    if (n > 0 && unit > 0 && static_cast<uint64_t>(n) > (size_t{1} << 28) / unit)
        throw fathom::error("sequence repetition result too large (over 2^28 elements)");
    if (n > 0 && static_cast<uint64_t>(n) > kMaxValueBytes / std::max<size_t>(1, approx_bytes(seq)))
        check_string_size(kMaxValueBytes + 1);  // the sandbox's size limit (jinja_value.h)
    if (seq.is_string()) {
        std::string out;
        for (int64_t i = 0; i < n; ++i) out += seq.as_string();
        return value::string(out);
    }
    value_list out;
    for (int64_t i = 0; i < n; ++i) out.insert(out.end(), seq.items().begin(), seq.items().end());
    return seq.is_tuple() ? value::tuple(std::move(out)) : value::list(std::move(out));
}

value binary_op(const std::string &op, const value &a, const value &b) {
    if (op == "~") {
        std::string l = py_str(a), r = py_str(b);
        check_string_size(l.size() + r.size());
        return value::string(l + r);
    }
    if (op == "%" && a.is_string()) {  // printf-style formatting: a tuple spreads, anything else is one argument
        value_list args = b.is_tuple() ? b.items() : value_list{b};
        // Python skips the "not all arguments converted" check for operands with __getitem__.
        return value::string(py_percent_format(a.as_string(), args, b.is_dict() || b.is_list() || b.is_undefined()));
    }
    if (a.is_undefined()) fail_undefined(a);
    if (b.is_undefined()) fail_undefined(b);
    if (a.is_number() && b.is_number()) return arith(op, a, b);
    if (op == "+") {
        if (a.is_string() && b.is_string()) {
            check_string_size(a.as_string().size() + b.as_string().size());
            return value::string(a.as_string() + b.as_string());
        }
        if (a.kind() == b.kind() && a.is_sequence()) {
            check_string_size(approx_bytes(a) + approx_bytes(b));
            value_list out = a.items();
            out.insert(out.end(), b.items().begin(), b.items().end());
            return a.is_tuple() ? value::tuple(std::move(out)) : value::list(std::move(out));
        }
        if (a.is_string()) throw fathom::error("can only concatenate str (not \"" + b.type_name() + "\") to str");
        if (a.is_list()) throw fathom::error("can only concatenate list (not \"" + b.type_name() + "\") to list");
    }
    if (op == "*") {
        if ((a.is_string() || a.is_sequence()) && (b.is_int() || b.is_bool())) return repeat(a, b.as_int());
        if ((b.is_string() || b.is_sequence()) && (a.is_int() || a.is_bool())) return repeat(b, a.as_int());
    }

    throw fathom::error("unsupported operand type(s) for " + op + ": '" + a.type_name() + "' and '" + b.type_name() + "'");
}

bool contains(const value &container, const value &item) {
    if (container.is_string()) {
        if (!item.is_string()) throw fathom::error("'in <string>' requires string as left operand, not " + item.type_name());
        return container.as_string().find(item.as_string()) != std::string::npos;
    }
    if (container.is_dict() || container.is_namespace()) {
        if (item.is_list() || item.is_dict() || item.is_namespace()) throw fathom::error("unhashable type: '" + item.type_name() + "'");
        return container.find(item) != nullptr;
    }
    if (container.is_sequence()) {
        for (const auto &e : container.items())
            if (py_equal(e, item)) return true;
        return false;
    }
    if (container.is_undefined()) return false;
    throw fathom::error("argument of type '" + container.type_name() + "' is not iterable");
}

value negate(const value &v) {
    if (v.is_float()) return value::floating(-v.as_double());
    if (v.is_int() || v.is_bool()) {
        if (v.as_int() == INT64_MIN) throw fathom::error("integer overflow");
        return value::integer(-v.as_int());
    }
    if (v.is_undefined()) fail_undefined(v);
    throw fathom::error("bad operand type for unary -: '" + v.type_name() + "'");
}

// ---- globals -------------------------------------------------------------------------------------

static value_pairs kwargs_to_pairs(const call_args &a) {
    value_pairs out;
    if (!a.pos.empty()) {
        if (a.pos.size() > 1 || !(a.pos[0].is_dict() || a.pos[0].is_namespace()))
            throw fathom::error(a.callee + "() accepts at most one mapping positional argument");
        out = a.pos[0].entries();
    }
    for (const auto &[k, v] : a.kw) {
        bool replaced = false;
        for (auto &[ek, ev] : out)
            if (ek.is_string() && ek.as_string() == k) {
                ev = v;
                replaced = true;
            }
        if (!replaced) out.emplace_back(value::string(k), v);
    }
    return out;
}

value make_global(std::string_view name) {
    if (name == "range")
        return bound("range", [](call_args &a) {
            a.callee = "range";
            a.check(3, {});
            if (a.pos.empty()) throw fathom::error("range expected at least 1 argument, got 0");
            for (const auto &p : a.pos)
                if (!p.is_int() && !p.is_bool()) throw fathom::error("'" + p.type_name() + "' object cannot be interpreted as an integer");
            int64_t start = a.pos.size() > 1 ? a.pos[0].as_int() : 0;
            int64_t stop = a.pos.size() > 1 ? a.pos[1].as_int() : a.pos[0].as_int();
            int64_t step = a.pos.size() > 2 ? a.pos[2].as_int() : 1;
            if (step == 0) throw fathom::error("range() arg 3 must not be zero");
            value_list out;
            for (int64_t i = start; step > 0 ? i < stop : i > stop;) {
                if (out.size() >= 100000) throw fathom::error("Range too big. The sandbox blocks ranges larger than MAX_RANGE (100000).");
                out.push_back(value::integer(i));
                if (__builtin_add_overflow(i, step, &i)) break;
            }
            return value::list(std::move(out));
        });
    if (name == "dict")
        return bound("dict", [](call_args &a) {
            a.callee = "dict";
            return value::dict(kwargs_to_pairs(a));
        });
    if (name == "namespace")
        return bound("namespace", [](call_args &a) {
            a.callee = "namespace";
            value_pairs p = kwargs_to_pairs(a);
            for (const auto &[k, v] : p)
                if (k.is_string() && !k.as_string().empty() && k.as_string()[0] == '_')
                    throw fathom::error("Chat templates cannot store underscore-prefixed attributes on a namespace, but got '" +
                                        k.as_string() + "'. Please rename the attribute.");
            return value::make_namespace(std::move(p));
        });
    if (name == "raise_exception")
        return bound("raise_exception", [](call_args &a) -> value {
            const value *m = a.get(0, "message");
            throw template_exception(m ? py_str(*m) : std::string());
        });
    return value::undefined("'" + std::string(name) + "' is undefined");
}

}  // namespace fathom::jinja
