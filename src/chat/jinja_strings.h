// Python str behaviour for chat templates: the str methods templates call (strip, split,
// startswith, replace, ...) and the helpers the string filters share. Strings are UTF-8; indices,
// lengths and character sets are in code points, as in Python. Case mapping (upper, lower, title,
// capitalize) covers ASCII only: non-ASCII letters pass through unchanged.
#pragma once
#include <optional>
#include <string>
#include <vector>

#include "chat/jinja_value.h"

namespace fathom::jinja {

// Bound method `name` of string `obj`, or Undefined when str has no such (supported) method.
value string_method(const value &obj, const std::string &name);

// str.strip/lstrip/rstrip(chars): chars == nullopt strips Unicode whitespace.
std::string py_strip(const std::string &s, const std::optional<std::string> &chars, bool left, bool right);
// str.split(sep, maxsplit) / rsplit: sep == nullopt splits on whitespace runs.
std::vector<std::string> py_split(const std::string &s, const std::optional<std::string> &sep, int64_t maxsplit, bool from_right);
std::vector<std::string> py_splitlines(const std::string &s, bool keepends);
std::string py_replace(const std::string &s, const std::string &old_s, const std::string &new_s, int64_t count);
std::string ascii_upper(std::string s);
std::string ascii_lower(std::string s);
std::string py_capitalize(const std::string &s);  // str.capitalize
std::string py_title(const std::string &s);       // str.title
std::string html_escape(const std::string &s);    // markupsafe.escape: & < > " '

}  // namespace fathom::jinja
