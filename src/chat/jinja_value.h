// Jinja value type: the dynamic values a chat template computes with, modelled on the Python objects
// that jinja2 (as configured by HF transformers) sees: None, bool, int, float, str, list, tuple,
// dict (insertion ordered), jinja2 Namespace, callables, and jinja2's default Undefined.
// Owns: value representation, Python-compatible str()/repr()/truthiness/equality/ordering,
// conversion from nlohmann::ordered_json, json.dumps-compatible serialisation, UTF-8 helpers.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/error.h"

namespace fathom::jinja {

// A template's raise_exception("msg"): what() is exactly msg, so callers can show it to users.
class template_exception : public fathom::error {
public:
    explicit template_exception(const std::string &msg) : fathom::error(msg) {}
};

class value;
struct call_args;
using value_list = std::vector<value>;
using value_pairs = std::vector<std::pair<value, value>>;  // dict entries in insertion order
using native_fn = std::function<value(call_args &)>;

enum class value_kind : uint8_t {
    value_kind_undefined,
    value_kind_none,
    value_kind_bool,
    value_kind_int,
    value_kind_float,
    value_kind_string,
    value_kind_list,       // Python list
    value_kind_tuple,      // Python tuple (items() pairs, literal (a, b)); prints with ()
    value_kind_dict,       // Python dict: immutable in the sandbox, so shared freely
    value_kind_namespace,  // jinja2 Namespace: the one mutable object ({% set ns.x = ... %})
    value_kind_function,   // builtin global, bound method, macro, caller
};

struct function_data {
    std::string name;
    native_fn fn;
};

// A value is cheap to copy: containers are shared (immutable after construction, except namespaces).
class value {
public:
    value() = default;  // undefined
    static value undefined(std::string hint = {});
    static value none();
    static value boolean(bool b);
    static value integer(int64_t i);
    static value floating(double f);
    static value string(std::string s);
    static value list(value_list items);
    static value tuple(value_list items);
    static value dict(value_pairs entries);
    static value make_namespace(value_pairs entries);
    static value function(std::string name, native_fn fn);
    static value from_json(const nlohmann::ordered_json &j);

    value_kind kind() const { return kind_; }
    bool is_undefined() const { return kind_ == value_kind::value_kind_undefined; }
    bool is_none() const { return kind_ == value_kind::value_kind_none; }
    bool is_bool() const { return kind_ == value_kind::value_kind_bool; }
    bool is_int() const { return kind_ == value_kind::value_kind_int; }
    bool is_float() const { return kind_ == value_kind::value_kind_float; }
    bool is_number() const { return is_bool() || is_int() || is_float(); }  // Python: bool is an int
    bool is_string() const { return kind_ == value_kind::value_kind_string; }
    bool is_list() const { return kind_ == value_kind::value_kind_list; }
    bool is_tuple() const { return kind_ == value_kind::value_kind_tuple; }
    bool is_sequence() const { return is_list() || is_tuple(); }
    bool is_dict() const { return kind_ == value_kind::value_kind_dict; }
    bool is_namespace() const { return kind_ == value_kind::value_kind_namespace; }
    bool is_function() const { return kind_ == value_kind::value_kind_function; }

    bool as_bool() const { return b_; }
    int64_t as_int() const { return is_bool() ? (b_ ? 1 : 0) : i_; }  // int or bool
    double as_double() const { return is_float() ? f_ : static_cast<double>(as_int()); }
    const std::string &as_string() const { return s_; }  // string; for undefined: the hint
    const value_list &items() const { return *list_; }     // list / tuple
    const value_pairs &entries() const { return *dict_; }  // dict / namespace
    value_pairs &namespace_entries() const { return *dict_; }
    const function_data &func() const { return *fn_; }

    // Dict / namespace lookup by key (Python equality); nullptr when absent.
    const value *find(const value &key) const;
    const value *find(std::string_view key) const;

    bool truthy() const;
    std::string type_name() const;  // Python type name, for error messages ("str", "dict", ...)

private:
    value_kind kind_ = value_kind::value_kind_undefined;
    bool b_ = false;
    int64_t i_ = 0;
    double f_ = 0.0;
    std::string s_;
    std::shared_ptr<value_list> list_;
    std::shared_ptr<value_pairs> dict_;
    std::shared_ptr<function_data> fn_;
};

// Positional and keyword arguments of a call; builtins read them with the helpers below.
struct call_args {
    value_list pos;
    std::vector<std::pair<std::string, value>> kw;
    std::string callee;  // for error messages

    // Argument `index` by position, else by keyword `name`; nullptr when not given.
    const value *get(size_t index, std::string_view name) const;
    // Throws when more than `max_pos` positional arguments, or a keyword outside `allowed`, were given.
    void check(size_t max_pos, std::initializer_list<std::string_view> allowed) const;
};

// ---- sandbox limits ------------------------------------------------------------------------------
// A chat template comes from the model file, so a hostile one must not exhaust the server. jinja2's sandbox
// bounds range() only; here no single value (a string, or a list / dict counting its elements' strings) may
// exceed kMaxValueBytes, the rendered text neither, and a render runs at most kMaxRenderSteps statements and
// loop iterations. Real templates stay far below both (a 1M-token prompt is a few MiB of text).
constexpr size_t kMaxValueBytes = size_t{64} << 20;
constexpr int64_t kMaxRenderSteps = 4'000'000;
// The bytes of v's strings plus 16 per element, counted until they pass `cap` (then cap + 1).
size_t approx_bytes(const value &v, size_t cap = kMaxValueBytes);
// Throws fathom::error when approx_bytes(v) or `bytes` passes kMaxValueBytes.
void check_value_size(const value &v);
void check_string_size(size_t bytes);

// ---- Python semantics --------------------------------------------------------------------------
std::string py_str(const value &v);   // str(v): what {{ v }} prints
std::string py_repr(const value &v);  // repr(v): how v appears inside a printed list / dict
std::string py_float_repr(double f);  // repr(float): shortest round-trip, Python's layout
bool py_equal(const value &a, const value &b);
bool py_less(const value &a, const value &b);  // throws fathom::error on unorderable types

// json.dumps(v, ensure_ascii=False, indent=..., separators=..., sort_keys=...) as transformers'
// tojson filter calls it. indent < 0 means None. Throws on values JSON cannot represent.
struct json_dump_options {
    int indent = -1;
    std::string indent_str;  // used when indent_is_string (Python allows indent="\t")
    bool indent_is_string = false;
    std::string item_sep = ", ";
    std::string key_sep = ": ";
    bool sort_keys = false;
};
std::string py_json_dumps(const value &v, const json_dump_options &opt);

// ---- UTF-8 <-> code points (Python str indexing is by code point) --------------------------------
// Invalid bytes decode to U+DC80+byte (like Python's surrogateescape) and encode back unchanged.
std::u32string utf8_decode(std::string_view s);
std::string utf8_encode(std::u32string_view s);
void utf8_append(std::string &out, char32_t cp);
bool py_isspace(char32_t c);  // str.isspace() for one code point

}  // namespace fathom::jinja
