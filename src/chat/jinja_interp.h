// Jinja interpreter: renders a parsed template against a set of variables, with jinja2's scoping
// (for-loop bodies and macros get their own scope, `if` does not; namespaces are the only objects a
// template can mutate), loop variables, macros / call blocks, loop controls and filter blocks.
#pragma once
#include <ctime>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "chat/jinja_ast.h"

namespace fathom::jinja {

struct render_options {
    std::optional<std::tm> now;  // what strftime_now formats; nullopt = the current local time
    int64_t max_steps = kMaxRenderSteps;  // statements and loop iterations a render may run (the sandbox)
};

// Renders `ast` with template variables `vars` (messages, tools, bos_token, ...). Errors are
// fathom::error "chat template line N: ..."; a template's raise_exception(msg) throws
// template_exception whose what() is exactly msg.
std::string jinja_render(const template_ast &ast, const std::vector<std::pair<std::string, value>> &vars,
                         const render_options &opt);

}  // namespace fathom::jinja
