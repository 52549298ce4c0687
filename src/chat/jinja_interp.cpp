// Jinja interpreter: statement execution and expression evaluation over the trees of jinja_ast.h.
// Scoping follows jinja2: each for-loop iteration and each macro call runs in a fresh child scope
// (assignments there do not leak out, and do not survive to the next iteration), `if` shares its
// parent's scope, and lookups fall back to the template variables, then the environment globals.
#include "chat/jinja_interp.h"

#include <memory>

#include "chat/jinja_builtins.h"
#include "core/error.h"

namespace fathom::jinja {
namespace {

// An error already prefixed with its template line; not re-wrapped by enclosing statements.
class located_error : public fathom::error {
public:
    explicit located_error(const std::string &msg) : fathom::error(msg) {}
};

struct scope {
    std::vector<std::pair<std::string, value>> vars;
    std::shared_ptr<scope> parent;

    const value *lookup(const std::string &name) const {
        for (const scope *s = this; s; s = s->parent.get())
            for (const auto &[k, v] : s->vars)
                if (k == name) return &v;
        return nullptr;
    }
    void set(const std::string &name, value v) {
        for (auto &[k, old] : vars)
            if (k == name) {
                old = std::move(v);
                return;
            }
        vars.emplace_back(name, std::move(v));
    }
};
using scope_ptr = std::shared_ptr<scope>;

enum class flow : uint8_t { flow_normal, flow_break, flow_continue };

std::shared_ptr<scope> child_of(const scope_ptr &parent) {
    auto s = std::make_shared<scope>();
    s->parent = parent;
    return s;
}

class interpreter {
public:
    explicit interpreter(const render_options &opt) : opt_(opt) {}

    std::string run(const template_ast &ast, const std::vector<std::pair<std::string, value>> &vars) {
        auto globals = std::make_shared<scope>();
        for (const char *g : {"range", "dict", "namespace", "raise_exception"}) globals->set(g, make_global(g));
        globals->set("strftime_now", value::function("strftime_now", [this](call_args &a) { return strftime_now(a); }));
        for (const auto &[k, v] : vars) globals->set(k, v);
        auto root = child_of(globals);
        std::string out;
        exec_list(ast.body, root, out);
        return out;
    }

private:
    const render_options &opt_;
    int call_depth_ = 0;  // nested macro calls (recursive macros are legal; unbounded ones are not)
    int64_t steps_ = 0;   // statements and loop iterations run (render_options::max_steps)

    void step() {
        if (++steps_ > opt_.max_steps)
            throw fathom::error("over " + std::to_string(opt_.max_steps) +
                                " statements and loop iterations: the chat template sandbox's limit");
    }

    // ---- statements --------------------------------------------------------------------------

    flow exec_list(const stmt_list &body, const scope_ptr &sc, std::string &out) {
        for (const auto &s : body) {
            flow f = exec_located(*s, sc, out);
            if (f != flow::flow_normal) return f;
        }
        return flow::flow_normal;
    }

    flow exec_located(const stmt &s, const scope_ptr &sc, std::string &out) {
        try {
            step();
            const flow f = exec(s, sc, out);
            check_string_size(out.size());  // the text rendered so far (a block's, or the whole output)
            return f;
        } catch (const template_exception &) {
            throw;
        } catch (const located_error &) {
            throw;
        } catch (const fathom::error &e) {
            throw located_error("chat template line " + std::to_string(s.line) + ": " + e.what());
        }
    }

    flow exec(const stmt &s, const scope_ptr &sc, std::string &out) {
        switch (s.kind) {
        case stmt_kind::stmt_kind_text: out += s.text; return flow::flow_normal;
        case stmt_kind::stmt_kind_output: out += py_str(eval(*s.value, sc)); return flow::flow_normal;
        case stmt_kind::stmt_kind_if:
            for (const auto &[cond, body] : s.branches)
                if (eval(*cond, sc).truthy()) return exec_list(body, sc, out);
            return exec_list(s.else_body, sc, out);
        case stmt_kind::stmt_kind_for: exec_for(s, sc, out); return flow::flow_normal;
        case stmt_kind::stmt_kind_set: exec_set(s, sc); return flow::flow_normal;
        case stmt_kind::stmt_kind_set_block: {
            std::string body;
            exec_list(s.body, child_of(sc), body);
            value v = value::string(body);
            if (s.filter) v = eval_filter(*s.filter, sc, &v);
            sc->set(s.text, v);
            return flow::flow_normal;
        }
        case stmt_kind::stmt_kind_macro: sc->set(s.text, make_macro(s, sc)); return flow::flow_normal;
        case stmt_kind::stmt_kind_call: {
            value caller = make_macro(s, sc);
            out += py_str(eval_call(*s.value, sc, &caller));
            return flow::flow_normal;
        }
        case stmt_kind::stmt_kind_filter: {
            std::string body;
            flow f = exec_list(s.body, sc, body);
            value v = value::string(body);
            out += py_str(eval_filter(*s.filter, sc, &v));
            return f;
        }
        case stmt_kind::stmt_kind_break: return flow::flow_break;
        case stmt_kind::stmt_kind_continue: return flow::flow_continue;
        case stmt_kind::stmt_kind_scope: {
            if (!s.is_with) return exec_list(s.body, sc, out);
            auto inner = child_of(sc);
            for (const auto &[name, e] : s.with_assigns) inner->set(name, eval(*e, sc));
            return exec_list(s.body, inner, out);
        }
        }
        return flow::flow_normal;
    }

    static void bind_targets(const std::vector<std::string> &targets, const value &v, scope &sc) {
        if (targets.size() == 1) {
            sc.set(targets[0], v);
            return;
        }
        value_list parts = iterate(v);
        if (parts.size() != targets.size())
            throw fathom::error(parts.size() < targets.size() ? "not enough values to unpack (expected " + std::to_string(targets.size()) +
                                                                     ", got " + std::to_string(parts.size()) + ")"
                                                               : "too many values to unpack (expected " + std::to_string(targets.size()) + ")");
        for (size_t i = 0; i < targets.size(); ++i) sc.set(targets[i], parts[i]);
    }

    void exec_for(const stmt &s, const scope_ptr &sc, std::string &out) {
        value seq = eval(*s.value, sc);
        value_list items = iterate(seq);
        if (s.cond) {  // "for x in xs if cond": filtered before loop.length / loop.last are known
            value_list kept;
            for (const auto &it : items) {
                step();
                auto probe = child_of(sc);
                bind_targets(s.targets, it, *probe);
                if (eval(*s.cond, probe).truthy()) kept.push_back(it);
            }
            items = std::move(kept);
        }
        const int64_t n = static_cast<int64_t>(items.size());
        for (int64_t i = 0; i < n; ++i) {
            step();
            auto body = child_of(sc);
            bind_targets(s.targets, items[static_cast<size_t>(i)], *body);
            body->set("loop", make_loop(items, i));
            flow f = exec_list(s.body, body, out);
            if (f == flow::flow_break) break;
        }
        if (n == 0) exec_list(s.else_body, child_of(sc), out);
    }

    static value make_loop(const value_list &items, int64_t i) {
        const int64_t n = static_cast<int64_t>(items.size());
        value_pairs e;
        auto put = [&](const char *k, value v) { e.emplace_back(value::string(k), std::move(v)); };
        put("index", value::integer(i + 1));
        put("index0", value::integer(i));
        put("revindex", value::integer(n - i));
        put("revindex0", value::integer(n - i - 1));
        put("first", value::boolean(i == 0));
        put("last", value::boolean(i == n - 1));
        put("length", value::integer(n));
        put("depth", value::integer(1));
        put("depth0", value::integer(0));
        put("previtem", i > 0 ? items[static_cast<size_t>(i - 1)] : value::undefined("there is no previous item"));
        put("nextitem", i + 1 < n ? items[static_cast<size_t>(i + 1)] : value::undefined("there is no next item"));
        put("cycle", value::function("loop.cycle", [i](call_args &a) {
                if (a.pos.empty()) throw fathom::error("no items for cycling given");
                return a.pos[static_cast<size_t>(i) % a.pos.size()];
            }));
        return value::dict(std::move(e));
    }

    void exec_set(const stmt &s, const scope_ptr &sc) {
        value v = eval(*s.value, sc);
        if (s.attr_target.empty()) {
            bind_targets(s.targets, v, *sc);
            return;
        }
        const value *ns = sc->lookup(s.targets[0]);
        if (!ns || !ns->is_namespace()) throw fathom::error("cannot assign attribute on non-namespace object");
        if (!s.attr_target.empty() && s.attr_target[0] == '_')
            throw fathom::error("Chat templates cannot store underscore-prefixed attributes on a namespace, but got '" + s.attr_target + "'.");
        for (auto &[k, old] : ns->namespace_entries())
            if (k.is_string() && k.as_string() == s.attr_target) {
                old = v;
                return;
            }
        ns->namespace_entries().emplace_back(value::string(s.attr_target), v);
    }

    // A macro (or a call block's body, as `caller`): binds parameters in a child of the defining
    // scope, renders the body and returns the text.
    // The defining scope is held weakly: the macro value lives in that scope, and a strong
    // reference would make a cycle that is never freed.
    value make_macro(const stmt &s, const scope_ptr &defining) {
        const stmt *node = &s;
        std::string name = s.kind == stmt_kind::stmt_kind_macro ? s.text : "caller";
        std::weak_ptr<scope> weak = defining;
        return value::function(name, [this, node, weak, name](call_args &a) {
            scope_ptr parent = weak.lock();
            if (!parent) throw fathom::error("macro '" + name + "' called after its defining scope ended");
            if (call_depth_ >= 100) throw fathom::error("macro '" + name + "': recursion deeper than 100 calls");
            struct depth_scope {
                int &d;
                ~depth_scope() { --d; }
            } depth{++call_depth_};
            auto sc = child_of(parent);
            value_list extra_pos;
            for (size_t i = 0; i < a.pos.size(); ++i) {
                if (i < node->params.size()) sc->set(node->params[i].name, a.pos[i]);
                else extra_pos.push_back(a.pos[i]);
            }
            value_pairs extra_kw;
            value caller;
            for (const auto &[k, v] : a.kw) {
                bool is_param = false;
                for (size_t i = 0; i < node->params.size(); ++i)
                    if (node->params[i].name == k) {
                        if (i < a.pos.size()) throw fathom::error("macro '" + name + "' got multiple values for argument '" + k + "'");
                        is_param = true;
                    }
                if (is_param) sc->set(k, v);
                else if (k == "caller") caller = v;
                else extra_kw.emplace_back(value::string(k), v);
            }
            for (const auto &p : node->params) {
                bool given = false;
                for (const auto &[k, v] : sc->vars) given = given || k == p.name;
                if (!given) sc->set(p.name, p.default_value ? eval(*p.default_value, sc) : value::undefined("parameter '" + p.name + "' was not provided"));
            }
            sc->set("varargs", value::tuple(std::move(extra_pos)));
            sc->set("kwargs", value::dict(std::move(extra_kw)));
            if (!caller.is_undefined()) sc->set("caller", caller);
            std::string out;
            exec_list(node->body, sc, out);
            return value::string(out);
        });
    }

    value strftime_now(call_args &a) {
        const value *fmt = a.get(0, "format");
        if (!fmt || !fmt->is_string()) throw fathom::error("strftime_now() needs a format string");
        std::tm tm{};
        if (opt_.now) {
            tm = *opt_.now;
        } else {
            std::time_t t = std::time(nullptr);
            localtime_r(&t, &tm);
        }
        if (fmt->as_string().empty()) return value::string("");
        std::string buf(256 + fmt->as_string().size() * 8, '\0');
        size_t n = std::strftime(buf.data(), buf.size(), fmt->as_string().c_str(), &tm);
        if (n == 0) throw fathom::error("strftime_now: format produced no output or is too long");
        buf.resize(n);
        return value::string(buf);
    }

    // ---- expressions -------------------------------------------------------------------------

    value lookup(const std::string &name, const scope_ptr &sc) {
        const value *v = sc->lookup(name);
        return v ? *v : value::undefined("'" + name + "' is undefined");
    }

    void eval_args(const expr &e, size_t first, const scope_ptr &sc, call_args &a) {
        for (size_t i = first; i < e.args.size(); ++i) a.pos.push_back(eval(*e.args[i], sc));
        for (const auto &[k, v] : e.kwargs) a.kw.emplace_back(k, eval(*v, sc));
    }

    value eval_call(const expr &e, const scope_ptr &sc, const value *caller) {
        value fn = eval(*e.args[0], sc);
        call_args a;
        eval_args(e, 1, sc, a);
        if (caller) a.kw.emplace_back("caller", *caller);
        if (fn.is_undefined()) fail_undefined(fn);
        value r = call_value(fn, a);
        check_value_size(r);
        return r;
    }

    // Filter chain node; `base` replaces the innermost null input ({% filter %} / block set body).
    value eval_filter(const expr &e, const scope_ptr &sc, const value *base) {
        value input = e.args[0] ? (e.args[0]->kind == expr_kind::expr_kind_filter ? eval_filter(*e.args[0], sc, base) : eval(*e.args[0], sc))
                                : *base;
        call_args a;
        eval_args(e, 1, sc, a);
        value r = apply_filter(e.name, input, a);
        check_value_size(r);
        return r;
    }

    bool compare(const std::string &op, const value &l, const value &r) {
        if (op == "==") return py_equal(l, r);
        if (op == "!=") return !py_equal(l, r);
        if (op == "<") return py_less(l, r);
        if (op == ">") return py_less(r, l);
        if (op == "<=") return !py_less(r, l);
        if (op == ">=") return !py_less(l, r);
        if (op == "in") return contains(r, l);
        return !contains(r, l);  // notin
    }

    value eval(const expr &e, const scope_ptr &sc) {
        switch (e.kind) {
        case expr_kind::expr_kind_literal: return e.lit;
        case expr_kind::expr_kind_name: return lookup(e.name, sc);
        case expr_kind::expr_kind_list:
        case expr_kind::expr_kind_tuple: {
            value_list items;
            for (const auto &a : e.args) items.push_back(eval(*a, sc));
            return e.kind == expr_kind::expr_kind_list ? value::list(std::move(items)) : value::tuple(std::move(items));
        }
        case expr_kind::expr_kind_dict: {
            value_pairs entries;
            for (size_t i = 0; i + 1 < e.args.size(); i += 2) {
                value k = eval(*e.args[i], sc), v = eval(*e.args[i + 1], sc);
                bool replaced = false;
                for (auto &[ek, ev] : entries)
                    if (py_equal(ek, k)) {
                        ev = v;
                        replaced = true;
                    }
                if (!replaced) entries.emplace_back(std::move(k), std::move(v));
            }
            return value::dict(std::move(entries));
        }
        case expr_kind::expr_kind_getattr: return get_attribute(eval(*e.args[0], sc), e.name);
        case expr_kind::expr_kind_getitem: return get_item(eval(*e.args[0], sc), eval(*e.args[1], sc));
        case expr_kind::expr_kind_slice: {
            value obj = eval(*e.args[0], sc);
            auto part = [&](size_t i) { return e.args[i] ? eval(*e.args[i], sc) : value::none(); };
            return get_slice(obj, part(1), part(2), part(3));
        }
        case expr_kind::expr_kind_call: return eval_call(e, sc, nullptr);
        case expr_kind::expr_kind_filter: return eval_filter(e, sc, nullptr);
        case expr_kind::expr_kind_test: {
            value v = eval(*e.args[0], sc);
            call_args a;
            eval_args(e, 1, sc, a);
            return value::boolean(apply_test(e.name, v, a) != e.negated);
        }
        case expr_kind::expr_kind_not: return value::boolean(!eval(*e.args[0], sc).truthy());
        case expr_kind::expr_kind_neg: return negate(eval(*e.args[0], sc));
        case expr_kind::expr_kind_pos: {
            value v = eval(*e.args[0], sc);
            if (!v.is_number()) throw fathom::error("bad operand type for unary +: '" + v.type_name() + "'");
            return v.is_bool() ? value::integer(v.as_int()) : v;
        }
        case expr_kind::expr_kind_binary: return binary_op(e.name, eval(*e.args[0], sc), eval(*e.args[1], sc));
        case expr_kind::expr_kind_compare: {
            value l = eval(*e.args[0], sc);
            for (size_t i = 0; i < e.ops.size(); ++i) {
                value r = eval(*e.args[i + 1], sc);
                if (!compare(e.ops[i], l, r)) return value::boolean(false);
                l = std::move(r);
            }
            return value::boolean(true);
        }
        case expr_kind::expr_kind_and: {
            value l = eval(*e.args[0], sc);
            return l.truthy() ? eval(*e.args[1], sc) : l;
        }
        case expr_kind::expr_kind_or: {
            value l = eval(*e.args[0], sc);
            return l.truthy() ? l : eval(*e.args[1], sc);
        }
        case expr_kind::expr_kind_condition:
            if (eval(*e.args[0], sc).truthy()) return eval(*e.args[1], sc);
            return e.args[2] ? eval(*e.args[2], sc) : value::undefined("the inline if-expression evaluated to false and no else section was defined");
        }
        throw fathom::error("internal: unknown expression kind");
    }
};

}  // namespace

std::string jinja_render(const template_ast &ast, const std::vector<std::pair<std::string, value>> &vars, const render_options &opt) {
    return interpreter(opt).run(ast, vars);
}

}  // namespace fathom::jinja
