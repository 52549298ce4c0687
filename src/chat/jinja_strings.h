// Python str behaviour for chat templates: the str methods templates call (strip, split,
// startswith, replace, ...) and the helpers the string filters share. Strings are UTF-8; indices,
// lengths and character sets are in code points, as in Python. Case mapping (upper, lower, title,
// capitalize) covers ASCII, Latin-1, Latin Extended-A, Greek, Cyrillic and fullwidth Latin; other
// scripts pass through unchanged.
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
std::string py_upper(const std::string &s);  // str.upper() (see the coverage note above)
std::string py_lower(const std::string &s);  // str.lower()
std::string py_capitalize(const std::string &s);  // str.capitalize
std::string py_title(const std::string &s);       // str.title
std::string html_escape(const std::string &s);    // markupsafe.escape: & < > " '
// printf-style fmt % args with %s %r %d %i %f %.Nf %%; `lenient` skips the "not all arguments
// converted" check (Python's rule when the right operand of % is a mapping or a list).
std::string py_percent_format(const std::string &fmt, const value_list &args, bool lenient);

}  // namespace fathom::jinja
