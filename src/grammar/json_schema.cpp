// JSON Schema subset -> grammar graph (json_schema.h). One pass builds the nodes (local $refs
// resolved through a memo, so recursive schemas become cycles of the graph), a second pass computes
// each node's first bytes: the dispatch table of anyOf and the check that its branches start
// differently.
#include "grammar/json_schema.h"

#include <algorithm>
#include <bitset>
#include <map>
#include <set>

namespace fathom::grammar {

using json = nlohmann::json;

namespace {

using byteset = std::bitset<256>;

[[noreturn]] void fail(const std::string &msg, const std::string &keyword, const std::string &path) {
    throw schema_error(msg, keyword, path);
}

std::string where(const std::string &path) { return path.empty() ? "the schema's root" : "schema " + path; }

// Keywords that only annotate (accepted, no effect on what is generated). "format" is documented as
// not enforced; "$defs" / "definitions" hold schemas reached through "$ref".
const std::set<std::string> k_annotations = {"title", "description", "default", "examples", "$schema", "$id",
                                             "$comment", "deprecated", "readOnly", "writeOnly", "format",
                                             "$defs", "definitions", "contentEncoding", "contentMediaType"};
// Keywords of the subset, per type (a keyword of a type the schema does not generate has no effect).
const std::set<std::string> k_supported = {"type", "enum", "const", "anyOf", "oneOf", "allOf", "$ref",
                                           "properties", "required", "additionalProperties", "items",
                                           "minItems", "maxItems", "minLength", "maxLength", "uniqueItems"};

// JSON pointer token escaping (RFC 6901) for error paths.
std::string ptr_token(const std::string &s) {
    std::string out;
    for (char c : s) {
        if (c == '~') out += "~0";
        else if (c == '/') out += "~1";
        else out += c;
    }
    return out;
}

int64_t get_count(const json &s, const char *key, const std::string &path) {
    const json &v = s[key];
    if (!v.is_number_integer() || v.get<int64_t>() < 0)
        fail(std::string("'") + key + "' in " + where(path) + " must be a non-negative integer", key, path);
    return v.get<int64_t>();
}

class compiler {
public:
    json_grammar g;

    compiler() {
        // Built-in nodes (json_grammar::k_*): any value and the pieces it dispatches to.
        g.nodes.resize(6);
        g.nodes[json_grammar::k_any].kind = node_kind::any;
        node &obj = g.nodes[json_grammar::k_any_object];
        obj.kind = node_kind::object;
        obj.additional = json_grammar::k_any;
        obj.key_escapes = true;
        node &arr = g.nodes[json_grammar::k_any_array];
        arr.kind = node_kind::array;
        arr.items = json_grammar::k_any;
        g.nodes[json_grammar::k_any_string].kind = node_kind::string;
        g.nodes[json_grammar::k_any_number].kind = node_kind::number;
        node &lit = g.nodes[json_grammar::k_any_literal];
        lit.kind = node_kind::literals;
        lit.lits = {"false", "null", "true"};
        paths_.resize(g.nodes.size());
    }

    // Compiles `schema` with `doc` as the document its "$ref"s point into; `prefix` starts its paths.
    int32_t compile_root(const json &schema, const json &doc, const std::string &prefix) {
        doc_ = &doc;
        prefix_ = prefix;
        refs_.clear();
        return compile(schema, prefix);
    }

    int32_t add(node n, const std::string &path) {
        g.nodes.push_back(std::move(n));
        paths_.push_back(path);
        return int32_t(g.nodes.size() - 1);
    }

    // Second pass: first bytes of every node, anyOf dispatch tables.
    void finalize() {
        state_.assign(g.nodes.size(), 0);
        first_.assign(g.nodes.size(), byteset());
        for (size_t i = 0; i < g.nodes.size(); ++i) first(int32_t(i));
    }

private:
    const json *doc_ = nullptr;
    std::string prefix_;
    std::map<std::string, int32_t> refs_;  // "$ref" target -> node
    std::vector<std::string> paths_;       // per node: where its schema is (errors)
    std::vector<int> state_;               // finalize: 0 new, 1 in progress, 2 done
    std::vector<byteset> first_;
    int depth_ = 0;                        // compile() recursion

    int32_t compile(const json &s, const std::string &path);
    int32_t compile_ref(const json &s, const std::string &path);
    int32_t compile_literals(const json &s, const std::string &path);
    int32_t compile_type(const json &s, const std::string &type, const std::string &path);
    int32_t compile_object(const json &s, const std::string &path);
    int32_t compile_array(const json &s, const std::string &path);
    int32_t compile_string(const json &s, const std::string &path);
    const byteset &first(int32_t id);
};

// Every keyword of s must be an annotation or one of `allowed`; otherwise a schema_error naming it.
void check_keywords(const json &s, const std::set<std::string> &allowed, const std::string &path,
                    const char *context) {
    for (auto it = s.begin(); it != s.end(); ++it) {
        const std::string &k = it.key();
        if (k_annotations.count(k) || allowed.count(k)) continue;
        if (k == "uniqueItems" && it->is_boolean() && !it->get<bool>()) continue;  // false: no constraint
        if (k_supported.count(k))
            fail("keyword '" + k + "' in " + where(path) + " cannot be combined with " + context, k, path);
        fail("unsupported JSON Schema keyword '" + k + "' in " + where(path) +
                 " (structured output supports type, properties, required, additionalProperties, items, minItems, "
                 "maxItems, minLength, maxLength, enum, const, anyOf, oneOf, $ref; docs/server.md)",
             k, path);
    }
}

int32_t compiler::compile(const json &s, const std::string &path) {
    // Schemas nest (and $refs chain) through this recursion: bounded, so a hostile schema cannot
    // exhaust the stack.
    struct depth_guard {
        int &d;
        explicit depth_guard(int &d) : d(d) { ++d; }
        ~depth_guard() { --d; }
    } guard(depth_);
    if (depth_ > kMaxSchemaDepth)
        fail(where(path) + " is nested deeper than " + std::to_string(kMaxSchemaDepth) + " schemas", "", path);
    if (s.is_boolean()) {
        if (s.get<bool>()) return json_grammar::k_any;
        fail(where(path) + " is false: no value matches it", "", path);
    }
    if (!s.is_object()) fail(where(path) + " must be an object or a boolean", "", path);
    if (s.contains("$ref")) return compile_ref(s, path);
    if (s.contains("enum") || s.contains("const")) return compile_literals(s, path);
    for (const char *k : {"anyOf", "oneOf", "allOf"}) {
        if (!s.contains(k)) continue;
        check_keywords(s, {k}, path, k);
        const json &arr = s[k];
        if (!arr.is_array() || arr.empty()) fail("'" + std::string(k) + "' in " + where(path) + " must be a non-empty array", k, path);
        if (std::string(k) == "allOf") {
            // One schema: itself (Pydantic writes a described $ref so); several would need an intersection.
            if (arr.size() != 1) fail("'allOf' with more than one schema is not supported (" + where(path) + ")", k, path);
            return compile(arr[0], path + "/allOf/0");
        }
        // oneOf = anyOf here: the branches must start with different bytes, so at most one matches.
        node n;
        n.kind = node_kind::any_of;
        for (size_t i = 0; i < arr.size(); ++i) n.branches.push_back(compile(arr[i], path + "/" + k + "/" + std::to_string(i)));
        return add(std::move(n), path + "/" + k);
    }
    check_keywords(s, k_supported, path, "");
    if (!s.contains("type")) {  // the type its keywords imply; "any" when they imply none
        if (s.contains("properties") || s.contains("required") || s.contains("additionalProperties"))
            return compile_object(s, path);
        if (s.contains("items") || s.contains("minItems") || s.contains("maxItems")) return compile_array(s, path);
        if (s.contains("minLength") || s.contains("maxLength")) return compile_string(s, path);
        return json_grammar::k_any;
    }
    const json &t = s["type"];
    if (t.is_string()) return compile_type(s, t.get<std::string>(), path);
    if (!t.is_array() || t.empty()) fail("'type' in " + where(path) + " must be a string or a non-empty array", "type", path);
    std::vector<std::string> types;
    for (const auto &e : t) {
        if (!e.is_string()) fail("'type' in " + where(path) + " must hold strings", "type", path);
        types.push_back(e.get<std::string>());
    }
    // integer is a subset of number: together they are number.
    if (std::count(types.begin(), types.end(), "number"))
        types.erase(std::remove(types.begin(), types.end(), "integer"), types.end());
    std::sort(types.begin(), types.end());
    types.erase(std::unique(types.begin(), types.end()), types.end());
    if (types.size() == 1) return compile_type(s, types[0], path);
    node n;
    n.kind = node_kind::any_of;
    for (const auto &ty : types) n.branches.push_back(compile_type(s, ty, path));
    return add(std::move(n), path + "/type");
}

// "$ref": "#..." — a JSON pointer into the document (local references only). The target's node is
// reserved before it is compiled, so a schema that refers to itself becomes a cycle of the graph.
int32_t compiler::compile_ref(const json &s, const std::string &path) {
    check_keywords(s, {"$ref"}, path, "'$ref'");
    if (!s["$ref"].is_string()) fail("'$ref' in " + where(path) + " must be a string", "$ref", path);
    const std::string ref = s["$ref"].get<std::string>();
    if (ref.empty() || ref[0] != '#')
        fail("'$ref' \"" + ref + "\" in " + where(path) + ": only local references (\"#/...\") are supported", "$ref", path);
    if (auto it = refs_.find(ref); it != refs_.end()) return it->second;
    const json *target = nullptr;
    try {
        target = &doc_->at(json::json_pointer(ref.substr(1)));
    } catch (const std::exception &) {
        fail("'$ref' \"" + ref + "\" in " + where(path) + " does not resolve", "$ref", path);
    }
    const int32_t id = add(node{}, prefix_ + ref.substr(1));  // reserved: refs inside the target find it
    refs_[ref] = id;
    const int32_t body = compile(*target, prefix_ + ref.substr(1));
    // The target compiled to its own node (or a built-in one): the reserved node becomes a one-part
    // sequence pointing at it.
    g.nodes[size_t(id)].kind = node_kind::sequence;
    g.nodes[size_t(id)].parts = {body};
    return id;
}

// "enum" / "const" (with an optional "type" that the values must satisfy): the values' compact
// serialisations as literals.
int32_t compiler::compile_literals(const json &s, const std::string &path) {
    check_keywords(s, {"enum", "const", "type"}, path, "'enum' / 'const'");
    std::vector<json> values;
    if (s.contains("const")) values.push_back(s["const"]);
    if (s.contains("enum")) {
        if (!s["enum"].is_array() || s["enum"].empty()) fail("'enum' in " + where(path) + " must be a non-empty array", "enum", path);
        if (s.contains("const")) fail("give either 'enum' or 'const' in " + where(path), "enum", path);
        values.assign(s["enum"].begin(), s["enum"].end());
    }
    std::set<std::string> types;
    if (s.contains("type")) {
        const json &t = s["type"];
        if (t.is_string()) types.insert(t.get<std::string>());
        else if (t.is_array())
            for (const auto &e : t)
                if (e.is_string()) types.insert(e.get<std::string>());
    }
    auto type_ok = [&](const json &v) {
        if (types.empty()) return true;
        if (v.is_string()) return types.count("string") > 0;
        if (v.is_boolean()) return types.count("boolean") > 0;
        if (v.is_null()) return types.count("null") > 0;
        if (v.is_object()) return types.count("object") > 0;
        if (v.is_array()) return types.count("array") > 0;
        if (types.count("number")) return true;
        return types.count("integer") > 0 && (v.is_number_integer() || v.get<double>() == double(int64_t(v.get<double>())));
    };
    node n;
    n.kind = node_kind::literals;
    for (const auto &v : values)
        if (type_ok(v)) n.lits.push_back(v.dump(-1, ' ', false, json::error_handler_t::strict));
    if (n.lits.empty()) fail("no value of 'enum' / 'const' in " + where(path) + " has the schema's 'type'", "enum", path);
    std::sort(n.lits.begin(), n.lits.end());
    n.lits.erase(std::unique(n.lits.begin(), n.lits.end()), n.lits.end());
    return add(std::move(n), path);
}

int32_t compiler::compile_type(const json &s, const std::string &type, const std::string &path) {
    node n;
    if (type == "object") return compile_object(s, path);
    if (type == "array") return compile_array(s, path);
    if (type == "string") return compile_string(s, path);
    if (type == "number" || type == "integer") {
        n.kind = type == "number" ? node_kind::number : node_kind::integer;
    } else if (type == "boolean") {
        n.kind = node_kind::literals;
        n.lits = {"false", "true"};
    } else if (type == "null") {
        n.kind = node_kind::literals;
        n.lits = {"null"};
    } else {
        fail("unknown type \"" + type + "\" in " + where(path) +
                 " (string, number, integer, boolean, null, object or array)",
             "type", path);
    }
    return add(std::move(n), path);
}

int32_t compiler::compile_object(const json &s, const std::string &path) {
    node n;
    n.kind = node_kind::object;
    if (s.contains("properties")) {
        const json &props = s["properties"];
        if (!props.is_object()) fail("'properties' in " + where(path) + " must be an object", "properties", path);
        for (auto it = props.begin(); it != props.end(); ++it) {
            property p;
            p.key = json(it.key()).dump();
            p.node = compile(it.value(), path + "/properties/" + ptr_token(it.key()));
            n.props.push_back(std::move(p));
        }
    }
    if (s.contains("additionalProperties")) {
        const json &a = s["additionalProperties"];
        if (a.is_boolean()) n.additional = a.get<bool>() ? json_grammar::k_any : -1;
        else n.additional = compile(a, path + "/additionalProperties");
    } else if (n.props.empty()) {
        n.additional = json_grammar::k_any;  // {"type": "object"} alone: any object, as the schema says
    }  // else: the properties listed describe the object; no others are generated
    if (s.contains("required")) {
        const json &req = s["required"];
        if (!req.is_array()) fail("'required' in " + where(path) + " must be an array of strings", "required", path);
        for (const auto &r : req) {
            if (!r.is_string()) fail("'required' in " + where(path) + " must be an array of strings", "required", path);
            const std::string key = json(r.get<std::string>()).dump();
            auto it = std::find_if(n.props.begin(), n.props.end(), [&](const property &p) { return p.key == key; });
            if (it != n.props.end()) {
                it->required = true;
                continue;
            }
            if (n.additional < 0)
                fail("required property " + key + " of " + where(path) +
                         " is not in 'properties' and additionalProperties does not allow it",
                     "required", path);
            n.props.push_back({key, n.additional, true});  // generated as a listed key with the extra values' schema
        }
    }
    if (n.props.size() > size_t(kMaxProperties))
        fail(where(path) + " lists " + std::to_string(n.props.size()) + " properties; at most " +
                 std::to_string(kMaxProperties) + " are supported",
             "properties", path);
    std::sort(n.props.begin(), n.props.end(), [](const property &a, const property &b) { return a.key < b.key; });
    for (size_t i = 0; i < n.props.size(); ++i)
        if (n.props[i].required) n.required_mask |= uint64_t(1) << i;
    return add(std::move(n), path);
}

int32_t compiler::compile_array(const json &s, const std::string &path) {
    node n;
    n.kind = node_kind::array;
    n.items = json_grammar::k_any;
    if (s.contains("items")) {
        if (s["items"].is_array()) fail("tuple 'items' (an array of schemas) in " + where(path) + " is not supported", "items", path);
        n.items = compile(s["items"], path + "/items");
    }
    if (s.contains("minItems")) n.min_items = get_count(s, "minItems", path);
    if (s.contains("maxItems")) n.max_items = get_count(s, "maxItems", path);
    if (n.max_items >= 0 && n.min_items > n.max_items)
        fail("'minItems' exceeds 'maxItems' in " + where(path), "minItems", path);
    return add(std::move(n), path);
}

int32_t compiler::compile_string(const json &s, const std::string &path) {
    node n;
    n.kind = node_kind::string;
    if (s.contains("minLength")) n.min_len = get_count(s, "minLength", path);
    if (s.contains("maxLength")) n.max_len = get_count(s, "maxLength", path);
    if (n.max_len >= 0 && n.min_len > n.max_len)
        fail("'minLength' exceeds 'maxLength' in " + where(path), "minLength", path);
    return add(std::move(n), path);
}

// First bytes of node id's values; builds anyOf's dispatch table on the way. A cycle that reaches a
// node again before any byte is consumed (a $ref to itself through anyOf) generates nothing: refused.
const byteset &compiler::first(int32_t id) {
    const size_t i = size_t(id);
    if (state_[i] == 2) return first_[i];
    if (state_[i] == 1) fail(where(paths_[i]) + " refers to itself before any value begins", "$ref", paths_[i]);
    state_[i] = 1;
    node &n = g.nodes[i];
    byteset b;
    auto set_chars = [&](const char *cs) {
        for (; *cs; ++cs) b.set(static_cast<unsigned char>(*cs));
    };
    switch (n.kind) {
    case node_kind::any: set_chars("{[\"-0123456789tfn"); break;
    case node_kind::object: set_chars("{"); break;
    case node_kind::array: set_chars("["); break;
    case node_kind::string: set_chars("\""); break;
    case node_kind::number:
    case node_kind::integer: set_chars("-0123456789"); break;
    case node_kind::literals:
    case node_kind::choice:
        for (const auto &l : n.lits) b.set(static_cast<unsigned char>(l[0]));
        break;
    case node_kind::sequence: b = first(n.parts[0]); break;
    case node_kind::any_of:
        n.by_first_byte.fill(-1);
        for (size_t k = 0; k < n.branches.size(); ++k) {
            const byteset fb = first(n.branches[k]);
            if ((fb & b).any())
                fail("the branches of " + where(paths_[i]) +
                         " overlap: anyOf / oneOf / a list of types needs branches that start differently (a string, "
                         "a number, an object, an array, a boolean, null; enum values count by their first character)",
                     "anyOf", paths_[i]);
            b |= fb;
            for (int c = 0; c < 256; ++c)
                if (fb.test(size_t(c))) g.nodes[i].by_first_byte[size_t(c)] = int16_t(k);
        }
        break;
    }
    first_[i] = b;
    state_[i] = 2;
    return first_[i];
}

}  // namespace

std::shared_ptr<const json_grammar> grammar_json_object() {
    compiler c;
    c.g.root = json_grammar::k_any_object;
    c.finalize();
    return std::make_shared<const json_grammar>(std::move(c.g));
}

std::shared_ptr<const json_grammar> compile_schema(const json &schema) {
    compiler c;
    c.g.root = c.compile_root(schema, schema, "");
    c.finalize();
    return std::make_shared<const json_grammar>(std::move(c.g));
}

std::shared_ptr<const json_grammar> compile_tool_call(const std::vector<std::string> &before,
                                                      const std::vector<json> &schemas, const std::string &after) {
    if (before.empty() || before.size() != schemas.size()) throw std::invalid_argument("compile_tool_call: bad arguments");
    compiler c;
    std::vector<int32_t> bodies;
    for (size_t i = 0; i < schemas.size(); ++i) {
        int32_t v = c.compile_root(schemas[i], schemas[i], "/" + std::to_string(i));
        if (!after.empty()) {
            node tail;
            tail.kind = node_kind::literals;
            tail.lits = {after};
            node seq;
            seq.kind = node_kind::sequence;
            seq.parts = {v, c.add(std::move(tail), "")};
            v = c.add(std::move(seq), "");
        }
        bodies.push_back(v);
    }
    if (before.size() == 1 && before[0].empty()) {
        c.g.root = bodies[0];
    } else {
        std::vector<size_t> order(before.size());
        for (size_t i = 0; i < order.size(); ++i) order[i] = i;
        std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return before[a] < before[b]; });
        node ch;
        ch.kind = node_kind::choice;
        for (size_t k = 0; k < order.size(); ++k) {
            const std::string &l = before[order[k]];
            // Sorted: a literal that is a prefix of another one comes right before one it prefixes.
            if (l.empty() || (k > 0 && l.compare(0, ch.lits.back().size(), ch.lits.back()) == 0))
                throw std::invalid_argument("compile_tool_call: the call openings must be non-empty and prefix-free");
            ch.lits.push_back(l);
            ch.conts.push_back(bodies[order[k]]);
        }
        c.g.root = c.add(std::move(ch), "");
    }
    c.finalize();
    return std::make_shared<const json_grammar>(std::move(c.g));
}

}  // namespace fathom::grammar
