// Jinja parser: token stream -> statement/expression trees, following jinja2.parser.Parser's grammar
// and operator precedence (condexpr < or < and < not < compare < +,- < ~ < *,/,//,% < ** < unary <
// postfix/filter/test). Unknown tags, filters and tests are rejected here, as jinja2 rejects them at
// compile time, with the template line in the message.
#include <cerrno>
#include <cstdlib>

#include "chat/jinja_ast.h"
#include "chat/jinja_builtins.h"
#include "core/error.h"

namespace fathom::jinja {
namespace {

class parser {
public:
    explicit parser(std::vector<token> toks) : toks_(std::move(toks)) {}

    template_ast parse_template() {
        template_ast t;
        t.body = subparse({});
        if (cur().kind != token_kind::token_kind_eof) fail("unexpected '" + cur().text + "'");
        return t;
    }

private:
    std::vector<token> toks_;
    size_t i_ = 0;
    int loop_depth_ = 0;
    int nesting_ = 0;  // recursion depth of the descent, bounded so hostile input cannot overflow the stack

    struct depth_guard {
        parser &p;
        explicit depth_guard(parser &owner) : p(owner) {
            if (++p.nesting_ > 200) p.fail("template nesting too deep (more than 200 levels)");
        }
        ~depth_guard() { --p.nesting_; }
    };

    const token &cur() const { return toks_[i_]; }
    const token &peek(size_t k = 1) const { return toks_[std::min(i_ + k, toks_.size() - 1)]; }
    void next() {
        if (i_ + 1 < toks_.size()) ++i_;
    }
    [[noreturn]] void fail(const std::string &msg) const {
        throw fathom::error("chat template line " + std::to_string(cur().line) + ": " + msg);
    }
    bool is_op(const char *op) const { return cur().kind == token_kind::token_kind_operator && cur().text == op; }
    bool is_name(const char *n) const { return cur().kind == token_kind::token_kind_name && cur().text == n; }
    bool skip_op(const char *op) {
        if (!is_op(op)) return false;
        next();
        return true;
    }
    bool skip_name(const char *n) {
        if (!is_name(n)) return false;
        next();
        return true;
    }
    void expect_op(const char *op) {
        if (!skip_op(op)) fail(std::string("expected '") + op + "', got '" + describe(cur()) + "'");
    }
    std::string expect_name() {
        if (cur().kind != token_kind::token_kind_name) fail("expected a name, got '" + describe(cur()) + "'");
        std::string n = cur().text;
        next();
        return n;
    }
    void expect_block_end() {
        if (cur().kind != token_kind::token_kind_block_end) fail("expected end of statement block, got '" + describe(cur()) + "'");
        next();
    }
    static std::string describe(const token &t) {
        switch (t.kind) {
        case token_kind::token_kind_eof: return "end of template";
        case token_kind::token_kind_block_end: return "%}";
        case token_kind::token_kind_variable_end: return "}}";
        case token_kind::token_kind_block_begin: return "{%";
        case token_kind::token_kind_variable_begin: return "{{";
        default: return t.text;
        }
    }

    expr_ptr make(expr_kind k, int line) {
        auto e = std::make_unique<expr>();
        e->kind = k;
        e->line = line;
        return e;
    }

    // ---- statements --------------------------------------------------------------------------

    // Parses until "{% <end_name>" for one of end_names (left unconsumed: cur() is that name).
    stmt_list subparse(std::initializer_list<const char *> end_names) {
        stmt_list body;
        while (true) {
            const token &t = cur();
            if (t.kind == token_kind::token_kind_eof) {
                if (end_names.size() != 0) {
                    std::string want;
                    for (const char *n : end_names) want += std::string(want.empty() ? "'" : " or '") + n + "'";
                    fail("unexpected end of template, expected " + want);
                }
                return body;
            }
            if (t.kind == token_kind::token_kind_data) {
                auto s = std::make_unique<stmt>();
                s->kind = stmt_kind::stmt_kind_text;
                s->line = t.line;
                s->text = t.text;
                body.push_back(std::move(s));
                next();
            } else if (t.kind == token_kind::token_kind_variable_begin) {
                next();
                auto s = std::make_unique<stmt>();
                s->kind = stmt_kind::stmt_kind_output;
                s->line = t.line;
                s->value = parse_tuple(true);
                if (cur().kind != token_kind::token_kind_variable_end) fail("expected '}}', got '" + describe(cur()) + "'");
                next();
                body.push_back(std::move(s));
            } else if (t.kind == token_kind::token_kind_block_begin) {
                next();
                if (cur().kind == token_kind::token_kind_name)
                    for (const char *n : end_names)
                        if (cur().text == n) return body;
                body.push_back(parse_statement());
            } else {
                fail("unexpected '" + describe(t) + "'");
            }
        }
    }

    stmt_ptr new_stmt(stmt_kind k) {
        auto s = std::make_unique<stmt>();
        s->kind = k;
        s->line = cur().line;
        return s;
    }

    stmt_ptr parse_statement() {
        depth_guard guard(*this);
        if (cur().kind != token_kind::token_kind_name) fail("tag name expected");
        std::string tag = cur().text;
        if (tag == "if") return parse_if();
        if (tag == "for") return parse_for();
        if (tag == "set") return parse_set();
        if (tag == "macro") return parse_macro();
        if (tag == "call") return parse_call_block();
        if (tag == "filter") return parse_filter_block();
        if (tag == "with") return parse_with();
        if (tag == "generation") {  // transformers' AssistantTracker tag: renders its body unchanged
            auto s = new_stmt(stmt_kind::stmt_kind_scope);
            next();
            expect_block_end();
            s->body = subparse({"endgeneration"});
            next();
            expect_block_end();
            return s;
        }
        if (tag == "break" || tag == "continue") {
            if (loop_depth_ == 0) fail("'" + tag + "' outside of a for loop");
            auto s = new_stmt(tag == "break" ? stmt_kind::stmt_kind_break : stmt_kind::stmt_kind_continue);
            next();
            expect_block_end();
            return s;
        }
        if (tag == "block" || tag == "extends" || tag == "include" || tag == "import" || tag == "from" || tag == "autoescape")
            fail("unsupported tag '" + tag + "' (template inheritance / loading is not available to chat templates)");
        fail("Encountered unknown tag '" + tag + "'");
    }

    stmt_ptr parse_if() {
        auto s = new_stmt(stmt_kind::stmt_kind_if);
        next();
        while (true) {
            expr_ptr cond = parse_tuple(false);
            expect_block_end();
            stmt_list body = subparse({"elif", "else", "endif"});
            s->branches.emplace_back(std::move(cond), std::move(body));
            std::string t = cur().text;
            next();
            if (t == "elif") continue;
            if (t == "else") {
                expect_block_end();
                s->else_body = subparse({"endif"});
                next();
            }
            expect_block_end();
            return s;
        }
    }

    stmt_ptr parse_for() {
        auto s = new_stmt(stmt_kind::stmt_kind_for);
        next();
        do {
            s->targets.push_back(expect_name());
        } while (skip_op(","));
        if (!skip_name("in")) fail("expected 'in' in for loop, got '" + describe(cur()) + "'");
        s->value = parse_tuple(false, {"recursive"});
        if (is_name("recursive")) fail("unsupported: recursive for loops");
        if (skip_name("if")) s->cond = parse_expression(true);
        expect_block_end();
        ++loop_depth_;
        s->body = subparse({"endfor", "else"});
        --loop_depth_;
        if (cur().text == "else") {
            next();
            expect_block_end();
            s->else_body = subparse({"endfor"});
        }
        next();
        expect_block_end();
        return s;
    }

    stmt_ptr parse_set() {
        auto s = new_stmt(stmt_kind::stmt_kind_set);
        next();
        s->targets.push_back(expect_name());
        if (skip_op(".")) {
            s->attr_target = expect_name();
        } else {
            while (skip_op(",")) {
                if (is_op("=")) break;
                s->targets.push_back(expect_name());
            }
        }
        if (skip_op("=")) {
            s->value = parse_tuple(true);
            expect_block_end();
            return s;
        }
        if (!s->attr_target.empty() || s->targets.size() != 1) fail("expected '=' in set");
        s->kind = stmt_kind::stmt_kind_set_block;
        s->text = s->targets[0];
        if (is_op("|")) s->filter = parse_filter_chain(nullptr);
        expect_block_end();
        s->body = subparse({"endset"});
        next();
        expect_block_end();
        return s;
    }

    void parse_signature(std::vector<macro_param> &params) {
        expect_op("(");
        while (!is_op(")")) {
            if (!params.empty()) expect_op(",");
            if (is_op(")")) break;
            macro_param p;
            p.name = expect_name();
            if (skip_op("=")) p.default_value = parse_expression(true);
            params.push_back(std::move(p));
        }
        next();
    }

    stmt_ptr parse_macro() {
        auto s = new_stmt(stmt_kind::stmt_kind_macro);
        next();
        s->text = expect_name();
        parse_signature(s->params);
        expect_block_end();
        int saved = loop_depth_;
        loop_depth_ = 0;
        s->body = subparse({"endmacro"});
        loop_depth_ = saved;
        next();
        expect_block_end();
        return s;
    }

    stmt_ptr parse_call_block() {
        auto s = new_stmt(stmt_kind::stmt_kind_call);
        next();
        if (is_op("(")) parse_signature(s->params);
        s->value = parse_expression(true);
        if (s->value->kind != expr_kind::expr_kind_call) fail("expected call");
        expect_block_end();
        s->body = subparse({"endcall"});
        next();
        expect_block_end();
        return s;
    }

    stmt_ptr parse_filter_block() {
        auto s = new_stmt(stmt_kind::stmt_kind_filter);
        next();
        s->filter = parse_filter_chain(nullptr, true);
        expect_block_end();
        s->body = subparse({"endfilter"});
        next();
        expect_block_end();
        return s;
    }

    stmt_ptr parse_with() {
        auto s = new_stmt(stmt_kind::stmt_kind_scope);
        s->is_with = true;
        next();
        while (cur().kind != token_kind::token_kind_block_end) {
            if (!s->with_assigns.empty()) expect_op(",");
            std::string name = expect_name();
            expect_op("=");
            s->with_assigns.emplace_back(name, parse_expression(true));
        }
        next();
        s->body = subparse({"endwith"});
        next();
        expect_block_end();
        return s;
    }

    // ---- expressions -------------------------------------------------------------------------

    // Comma-separated expressions; one without a trailing comma is returned as is.
    expr_ptr parse_tuple(bool with_condexpr, std::initializer_list<const char *> extra_end = {}, bool explicit_parens = false) {
        int line = cur().line;
        std::vector<expr_ptr> items;
        bool is_tuple = false;
        while (true) {
            if (!items.empty()) {
                if (!skip_op(",")) break;
                is_tuple = true;
            }
            const token &t = cur();
            if (t.kind == token_kind::token_kind_variable_end || t.kind == token_kind::token_kind_block_end ||
                (t.kind == token_kind::token_kind_operator && (t.text == ")" || t.text == "]" || t.text == "}")))
                break;
            bool end = false;
            for (const char *n : extra_end) end = end || is_name(n);
            if (end) break;
            items.push_back(parse_expression(with_condexpr));
        }
        if (!is_tuple) {
            if (!items.empty()) return std::move(items[0]);
            if (!explicit_parens) fail("Expected an expression, got '" + describe(cur()) + "'");
        }
        auto e = make(expr_kind::expr_kind_tuple, line);
        e->args = std::move(items);
        return e;
    }

    expr_ptr parse_expression(bool with_condexpr) { return with_condexpr ? parse_condexpr() : parse_or(); }

    expr_ptr parse_condexpr() {
        expr_ptr e = parse_or();
        while (is_name("if")) {
            int line = cur().line;
            next();
            auto c = make(expr_kind::expr_kind_condition, line);
            c->args.push_back(parse_or());
            c->args.push_back(std::move(e));
            c->args.push_back(skip_name("else") ? parse_condexpr() : nullptr);
            e = std::move(c);
        }
        return e;
    }

    expr_ptr binary(expr_kind k, std::string op, expr_ptr l, expr_ptr r, int line) {
        auto e = make(k, line);
        e->name = std::move(op);
        e->args.push_back(std::move(l));
        e->args.push_back(std::move(r));
        return e;
    }

    expr_ptr parse_or() {
        expr_ptr l = parse_and();
        while (is_name("or")) {
            int line = cur().line;
            next();
            l = binary(expr_kind::expr_kind_or, "or", std::move(l), parse_and(), line);
        }
        return l;
    }

    expr_ptr parse_and() {
        expr_ptr l = parse_not();
        while (is_name("and")) {
            int line = cur().line;
            next();
            l = binary(expr_kind::expr_kind_and, "and", std::move(l), parse_not(), line);
        }
        return l;
    }

    expr_ptr parse_not() {
        if (is_name("not")) {
            auto e = make(expr_kind::expr_kind_not, cur().line);
            next();
            e->args.push_back(parse_not());
            return e;
        }
        return parse_compare();
    }

    expr_ptr parse_compare() {
        int line = cur().line;
        expr_ptr first = parse_math1();
        auto e = make(expr_kind::expr_kind_compare, line);
        e->args.push_back(std::move(first));
        while (true) {
            const token &t = cur();
            if (t.kind == token_kind::token_kind_operator &&
                (t.text == "==" || t.text == "!=" || t.text == "<" || t.text == "<=" || t.text == ">" || t.text == ">=")) {
                e->ops.push_back(t.text);
                next();
            } else if (is_name("in")) {
                e->ops.push_back("in");
                next();
            } else if (is_name("not") && peek().kind == token_kind::token_kind_name && peek().text == "in") {
                e->ops.push_back("notin");
                next();
                next();
            } else {
                break;
            }
            e->args.push_back(parse_math1());
        }
        if (e->ops.empty()) return std::move(e->args[0]);
        return e;
    }

    expr_ptr parse_math1() {
        expr_ptr l = parse_concat();
        while (is_op("+") || is_op("-")) {
            std::string op = cur().text;
            int line = cur().line;
            next();
            l = binary(expr_kind::expr_kind_binary, op, std::move(l), parse_concat(), line);
        }
        return l;
    }

    expr_ptr parse_concat() {
        expr_ptr l = parse_math2();
        while (is_op("~")) {
            int line = cur().line;
            next();
            l = binary(expr_kind::expr_kind_binary, "~", std::move(l), parse_math2(), line);
        }
        return l;
    }

    expr_ptr parse_math2() {
        expr_ptr l = parse_pow();
        while (is_op("*") || is_op("/") || is_op("//") || is_op("%")) {
            std::string op = cur().text;
            int line = cur().line;
            next();
            l = binary(expr_kind::expr_kind_binary, op, std::move(l), parse_pow(), line);
        }
        return l;
    }

    expr_ptr parse_pow() {
        expr_ptr l = parse_unary(true);
        while (is_op("**")) {
            int line = cur().line;
            next();
            l = binary(expr_kind::expr_kind_binary, "**", std::move(l), parse_unary(true), line);
        }
        return l;
    }

    expr_ptr parse_unary(bool with_filter) {
        depth_guard guard(*this);
        int line = cur().line;
        expr_ptr e;
        if (is_op("-") || is_op("+")) {
            auto u = make(is_op("-") ? expr_kind::expr_kind_neg : expr_kind::expr_kind_pos, line);
            next();
            u->args.push_back(parse_unary(false));
            e = std::move(u);
        } else {
            e = parse_primary();
        }
        e = parse_postfix(std::move(e));
        if (with_filter) e = parse_filter_expr(std::move(e));
        return e;
    }

    expr_ptr parse_primary() {
        const token &t = cur();
        int line = t.line;
        auto lit = [&](value v) {
            auto e = make(expr_kind::expr_kind_literal, line);
            e->lit = std::move(v);
            return e;
        };
        switch (t.kind) {
        case token_kind::token_kind_name: {
            std::string n = t.text;
            next();
            if (n == "true" || n == "True") return lit(value::boolean(true));
            if (n == "false" || n == "False") return lit(value::boolean(false));
            if (n == "none" || n == "None") return lit(value::none());
            auto e = make(expr_kind::expr_kind_name, line);
            e->name = n;
            return e;
        }
        case token_kind::token_kind_string: {
            std::string s = t.text;
            next();
            while (cur().kind == token_kind::token_kind_string) {  // adjacent literals concatenate
                s += cur().text;
                next();
            }
            return lit(value::string(s));
        }
        case token_kind::token_kind_integer: {
            std::string s = t.text;
            next();
            errno = 0;
            char *end = nullptr;
            long long v = std::strtoll(s.c_str(), &end, 10);
            if (errno == ERANGE) fail("integer literal out of range: " + s);
            return lit(value::integer(v));
        }
        case token_kind::token_kind_float: {
            std::string s = t.text;
            next();
            return lit(value::floating(std::strtod(s.c_str(), nullptr)));
        }
        default: break;
        }
        if (skip_op("(")) {
            expr_ptr e = parse_tuple(true, {}, true);
            expect_op(")");
            return e;
        }
        if (skip_op("[")) {
            auto e = make(expr_kind::expr_kind_list, line);
            while (!is_op("]")) {
                if (!e->args.empty()) expect_op(",");
                if (is_op("]")) break;
                e->args.push_back(parse_expression(true));
            }
            next();
            return e;
        }
        if (skip_op("{")) {
            auto e = make(expr_kind::expr_kind_dict, line);
            while (!is_op("}")) {
                if (!e->args.empty()) expect_op(",");
                if (is_op("}")) break;
                e->args.push_back(parse_expression(true));
                expect_op(":");
                e->args.push_back(parse_expression(true));
            }
            next();
            return e;
        }
        fail("unexpected '" + describe(t) + "'");
    }

    expr_ptr parse_postfix(expr_ptr e) {
        while (true) {
            if (is_op(".") || is_op("[")) {
                e = parse_subscript(std::move(e));
            } else if (is_op("(")) {
                e = parse_call(std::move(e));
            } else {
                return e;
            }
        }
    }

    expr_ptr parse_filter_expr(expr_ptr e) {
        while (true) {
            if (is_op("|")) {
                e = parse_filter_chain(std::move(e));
            } else if (is_name("is")) {
                e = parse_test(std::move(e));
            } else if (is_op("(")) {
                e = parse_call(std::move(e));
            } else {
                return e;
            }
        }
    }

    expr_ptr parse_subscript(expr_ptr e) {
        int line = cur().line;
        if (skip_op(".")) {
            if (cur().kind == token_kind::token_kind_name) {
                auto g = make(expr_kind::expr_kind_getattr, line);
                g->name = cur().text;
                next();
                g->args.push_back(std::move(e));
                return g;
            }
            if (cur().kind != token_kind::token_kind_integer) fail("expected name or number after '.'");
            auto g = make(expr_kind::expr_kind_getitem, line);
            g->args.push_back(std::move(e));
            g->args.push_back(parse_primary());
            return g;
        }
        next();  // '['
        std::vector<expr_ptr> subs;
        while (!is_op("]")) {
            if (!subs.empty()) {
                expect_op(",");
                if (is_op("]")) break;
            }
            subs.push_back(parse_subscribed());
        }
        next();
        if (subs.empty()) fail("expected subscript");
        if (subs.size() == 1 && subs[0] && subs[0]->kind == expr_kind::expr_kind_slice) {
            subs[0]->args[0] = std::move(e);
            return std::move(subs[0]);
        }
        auto g = make(expr_kind::expr_kind_getitem, line);
        g->args.push_back(std::move(e));
        if (subs.size() == 1) {
            g->args.push_back(std::move(subs[0]));
        } else {
            auto t = make(expr_kind::expr_kind_tuple, line);
            t->args = std::move(subs);
            g->args.push_back(std::move(t));
        }
        return g;
    }

    // One subscript: an expression, or a slice [start]:[stop][:[step]] (args[0] filled by caller).
    expr_ptr parse_subscribed() {
        int line = cur().line;
        expr_ptr first;
        if (!is_op(":")) {
            first = parse_expression(true);
            if (!is_op(":")) return first;
        }
        next();  // ':'
        auto s = make(expr_kind::expr_kind_slice, line);
        s->args.push_back(nullptr);
        s->args.push_back(std::move(first));
        auto end_of_part = [&] { return is_op("]") || is_op(",") || is_op(":"); };
        s->args.push_back(end_of_part() ? nullptr : parse_expression(true));
        if (skip_op(":")) s->args.push_back(end_of_part() ? nullptr : parse_expression(true));
        else s->args.push_back(nullptr);
        return s;
    }

    void parse_call_args(expr &e) {
        expect_op("(");
        while (!is_op(")")) {
            if (!e.args.empty() || !e.kwargs.empty()) {
                expect_op(",");
                if (is_op(")")) break;
            }
            if (is_op("*") || is_op("**")) fail("unsupported: *args / **kwargs in calls");
            if (cur().kind == token_kind::token_kind_name && peek().kind == token_kind::token_kind_operator && peek().text == "=") {
                std::string key = cur().text;
                next();
                next();
                e.kwargs.emplace_back(key, parse_expression(true));
            } else {
                if (!e.kwargs.empty()) fail("positional argument follows keyword argument");
                e.args.push_back(parse_expression(true));
            }
        }
        next();
    }

    expr_ptr parse_call(expr_ptr callee) {
        auto e = make(expr_kind::expr_kind_call, cur().line);
        expr tmp;  // arguments parsed apart so args[0] can hold the callee
        tmp.kind = expr_kind::expr_kind_filter;
        parse_call_args(tmp);
        e->args.push_back(std::move(callee));
        for (auto &a : tmp.args) e->args.push_back(std::move(a));
        e->kwargs = std::move(tmp.kwargs);
        return e;
    }

    std::string parse_dotted_name() {
        std::string n = expect_name();
        while (is_op(".")) {
            next();
            n.push_back('.');
            n += expect_name();
        }
        return n;
    }

    // "| f1(args) | f2 ..." applied to `base` (null for {% filter %} / block set bodies).
    expr_ptr parse_filter_chain(expr_ptr base, bool start_inline = false) {
        expr_ptr e = std::move(base);
        while (start_inline || is_op("|")) {
            if (!start_inline) next();
            start_inline = false;
            int line = cur().line;
            auto f = make(expr_kind::expr_kind_filter, line);
            f->name = parse_dotted_name();
            if (!has_filter(f->name)) fail("No filter named '" + f->name + "'.");
            expr tmp;
            tmp.kind = expr_kind::expr_kind_filter;
            if (is_op("(")) parse_call_args(tmp);
            f->args.push_back(std::move(e));
            for (auto &a : tmp.args) f->args.push_back(std::move(a));
            f->kwargs = std::move(tmp.kwargs);
            e = std::move(f);
        }
        return e;
    }

    expr_ptr parse_test(expr_ptr base) {
        int line = cur().line;
        next();  // 'is'
        auto t = make(expr_kind::expr_kind_test, line);
        if (skip_name("not")) t->negated = true;
        t->name = parse_dotted_name();
        if (!has_test(t->name)) fail("No test named '" + t->name + "'.");
        t->args.push_back(std::move(base));
        const token &c = cur();
        if (is_op("(")) {
            expr tmp;
            tmp.kind = expr_kind::expr_kind_filter;
            parse_call_args(tmp);
            for (auto &a : tmp.args) t->args.push_back(std::move(a));
            t->kwargs = std::move(tmp.kwargs);
        } else if ((c.kind == token_kind::token_kind_name && c.text != "else" && c.text != "or" && c.text != "and") ||
                   c.kind == token_kind::token_kind_string || c.kind == token_kind::token_kind_integer ||
                   c.kind == token_kind::token_kind_float || is_op("[") || is_op("{")) {
            if (is_name("is")) fail("You cannot chain multiple tests with is");
            t->args.push_back(parse_postfix(parse_primary()));
        }
        return t;
    }
};

}  // namespace

template_ast jinja_parse(const std::string &source, const lexer_options &opt) {
    return parser(jinja_tokenize(source, opt)).parse_template();
}

}  // namespace fathom::jinja
