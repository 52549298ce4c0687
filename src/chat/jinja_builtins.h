// Jinja builtins: filters, tests, attribute/item access (with jinja2 sandbox semantics), Python
// str/dict/list methods, operators and the stateless globals (range, dict, namespace,
// raise_exception). Everything here mirrors what jinja2 3.1 + transformers' environment do.
#pragma once
#include <string>
#include <string_view>

#include "chat/jinja_value.h"
#include "core/error.h"

namespace fathom::jinja {

bool has_filter(std::string_view name);
bool has_test(std::string_view name);
value apply_filter(const std::string &name, const value &input, call_args &args);
bool apply_test(const std::string &name, const value &input, call_args &args);

// jinja2 environment.getattr / getitem: methods and keys; missing -> Undefined; Undefined -> throws.
value get_attribute(const value &obj, const std::string &name);
value get_item(const value &obj, const value &key);
value get_slice(const value &obj, const value &start, const value &stop, const value &step);
value call_value(const value &fn, call_args &args);

// Operators with Python semantics (op: + - * / // % ** ~), `in`, unary minus.
value binary_op(const std::string &op, const value &a, const value &b);
bool contains(const value &container, const value &item);
value negate(const value &v);

// Iteration / len() as Python does them (dict -> keys, str -> code points, Undefined -> empty).
value_list iterate(const value &v);
int64_t py_len(const value &v);
[[noreturn]] void fail_undefined(const value &u);

// Globals without interpreter state; the caller adds strftime_now with its injectable clock.
value make_global(std::string_view name);  // range, dict, namespace, raise_exception; else undefined

}  // namespace fathom::jinja
