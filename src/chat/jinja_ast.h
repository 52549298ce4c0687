// Jinja template syntax: lexer tokens, expression and statement trees, and the lexer/parser entry
// points. The lexer reproduces jinja2's whitespace rules (trim_blocks, lstrip_blocks, '-' / '+'
// modifiers, newline normalisation, dropped final newline) with the settings transformers uses.
#pragma once
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "chat/jinja_value.h"

namespace fathom::jinja {

// ---- tokens --------------------------------------------------------------------------------------

enum class token_kind : uint8_t {
    token_kind_data,            // literal template text
    token_kind_variable_begin,  // {{
    token_kind_variable_end,    // }}
    token_kind_block_begin,     // {%
    token_kind_block_end,       // %}
    token_kind_name,
    token_kind_string,  // text holds the decoded string value
    token_kind_integer,
    token_kind_float,
    token_kind_operator,  // text holds the operator spelling ("+", "//", "==", "[", ...)
    token_kind_eof,
};

struct token {
    token_kind kind;
    std::string text;
    int line;
};

struct lexer_options {
    bool trim_blocks = true;    // transformers: ImmutableSandboxedEnvironment(trim_blocks=True, ...)
    bool lstrip_blocks = true;  // transformers: lstrip_blocks=True
};

std::vector<token> jinja_tokenize(const std::string &source, const lexer_options &opt);

// ---- expressions ---------------------------------------------------------------------------------

struct expr;
using expr_ptr = std::unique_ptr<expr>;

enum class expr_kind : uint8_t {
    expr_kind_literal,    // lit
    expr_kind_name,       // name
    expr_kind_list,       // args = elements
    expr_kind_tuple,      // args = elements
    expr_kind_dict,       // args = k0, v0, k1, v1, ...
    expr_kind_getattr,    // args[0] . name
    expr_kind_getitem,    // args[0] [ args[1] ]
    expr_kind_slice,      // args[0] [ args[1] : args[2] : args[3] ] (null = omitted)
    expr_kind_call,       // args[0] ( args[1..] , kwargs )
    expr_kind_filter,     // args[0] | name ( args[1..], kwargs ); args[0] null inside {% filter %}
    expr_kind_test,       // args[0] is [not] name ( args[1..] ); negated
    expr_kind_not,        // not args[0]
    expr_kind_neg,        // - args[0]
    expr_kind_pos,        // + args[0]
    expr_kind_binary,     // args[0] op args[1]; op in + - * / // % ** ~
    expr_kind_compare,    // args[0] ops[0] args[1] ops[1] args[2] ... (chained)
    expr_kind_and,        // args[0] and args[1]
    expr_kind_or,         // args[0] or args[1]
    expr_kind_condition,  // args[1] if args[0] else args[2] (args[2] null = undefined)
};

struct expr {
    expr_kind kind;
    int line = 0;
    value lit;
    std::string name;              // name / attribute / filter / test / binary operator
    std::vector<std::string> ops;  // compare operators: == != < <= > >= in notin
    std::vector<expr_ptr> args;
    std::vector<std::pair<std::string, expr_ptr>> kwargs;
    bool negated = false;
};

// ---- statements ----------------------------------------------------------------------------------

struct stmt;
using stmt_ptr = std::unique_ptr<stmt>;
using stmt_list = std::vector<stmt_ptr>;

enum class stmt_kind : uint8_t {
    stmt_kind_text,      // text
    stmt_kind_output,    // {{ value }}
    stmt_kind_if,        // branches (cond, body) ...; else_body
    stmt_kind_for,       // for targets in value [if cond]: body [else else_body]
    stmt_kind_set,       // set targets = value  (target "ns.attr" via attr_target)
    stmt_kind_set_block, // set name [| filters] %} body {% endset
    stmt_kind_macro,     // macro name(params) body
    stmt_kind_call,      // call(params) value(...) body  -> body becomes caller()
    stmt_kind_filter,    // filter filters %} body {% endfilter
    stmt_kind_break,
    stmt_kind_continue,
    stmt_kind_scope,     // generation / with: body rendered in place (with: in a child scope)
};

struct macro_param {
    std::string name;
    expr_ptr default_value;  // null: required (undefined when omitted, as jinja2)
};

struct stmt {
    stmt_kind kind;
    int line = 0;
    std::string text;                  // text / macro name / set_block name
    std::vector<std::string> targets;  // for / set targets (names)
    std::string attr_target;           // set ns.attr: targets[0] = "ns", attr_target = "attr"
    expr_ptr value;                    // output / for iterable / set value / call expression
    expr_ptr cond;                     // for ... if cond
    expr_ptr filter;                   // set_block / filter block: filter chain with null innermost arg
    std::vector<std::pair<expr_ptr, stmt_list>> branches;  // if / elif
    std::vector<std::pair<std::string, expr_ptr>> with_assigns;  // {% with a = 1 %}
    stmt_list body;
    stmt_list else_body;
    std::vector<macro_param> params;  // macro / call parameters
    bool is_with = false;
};

struct template_ast {
    stmt_list body;
};

template_ast jinja_parse(const std::string &source, const lexer_options &opt);

}  // namespace fathom::jinja
