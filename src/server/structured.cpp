// Structured output request fields -> grammars (structured.h).
#include "server/structured.h"

#include <algorithm>

#include "server/api.h"

namespace fathom::server {

using json = nlohmann::json;

namespace {

// A schema_error as a 400: "<where>: <message>", param naming the field and the keyword's path.
[[noreturn]] void schema_bad_request(const grammar::schema_error &e, const std::string &where, const std::string &param) {
    throw api_error(400, "invalid_request_error", where + ": " + e.what(), param);
}

std::shared_ptr<const grammar::json_grammar> compile(const json &schema, const std::string &where, const std::string &param) {
    try {
        return grammar::compile_schema(schema);
    } catch (const grammar::schema_error &e) {
        schema_bad_request(e, where, param);
    }
}

}  // namespace

std::shared_ptr<const grammar::json_grammar> parse_response_format(const json &rf) {
    if (!rf.is_object() || !rf.contains("type") || !rf["type"].is_string())
        bad_request("'response_format' must be an object with a string 'type' (text, json_object or json_schema)",
                    "response_format");
    const std::string type = rf["type"].get<std::string>();
    if (type == "text") return nullptr;
    if (type == "json_object") return grammar::grammar_json_object();
    if (type != "json_schema")
        bad_request("'response_format.type' must be text, json_object or json_schema (got \"" + type + "\")",
                    "response_format.type");
    if (!rf.contains("json_schema") || !rf["json_schema"].is_object())
        bad_request("'response_format.json_schema' must be an object {name, schema, strict}", "response_format.json_schema");
    const json &js = rf["json_schema"];
    if (!js.contains("name") || !js["name"].is_string())
        bad_request("'response_format.json_schema.name' is required (a string)", "response_format.json_schema.name");
    const std::string name = js["name"].get<std::string>();
    const bool name_ok = !name.empty() && name.size() <= 64 && std::all_of(name.begin(), name.end(), [](char c) {
        return std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '-';
    });
    if (!name_ok)
        bad_request("'response_format.json_schema.name' must be 1 to 64 characters of a-z, A-Z, 0-9, _ and - (got \"" +
                        name + "\")",
                    "response_format.json_schema.name");
    if (js.contains("strict") && !js["strict"].is_boolean() && !js["strict"].is_null())
        bad_request("'response_format.json_schema.strict' must be a boolean", "response_format.json_schema.strict");
    if (js.contains("description") && !js["description"].is_string() && !js["description"].is_null())
        bad_request("'response_format.json_schema.description' must be a string", "response_format.json_schema.description");
    for (auto it = js.begin(); it != js.end(); ++it)
        if (it.key() != "name" && it.key() != "schema" && it.key() != "strict" && it.key() != "description")
            bad_request("unknown field 'response_format.json_schema." + it.key() + "'", "response_format.json_schema");
    // No schema: any JSON value (OpenAI's default), generated as an object like json_object.
    if (!js.contains("schema") || js["schema"].is_null()) return grammar::grammar_json_object();
    if (!js["schema"].is_object())
        bad_request("'response_format.json_schema.schema' must be a JSON Schema object", "response_format.json_schema.schema");
    return compile(js["schema"], "response_format.json_schema.schema", "response_format.json_schema.schema");
}

std::shared_ptr<const grammar::json_grammar> parse_text_format(const json &format) {
    // Reshaped into the chat form; error params renamed from response_format[.json_schema] to text.format.
    json rf = format;
    if (format.is_object() && format.value("type", json()) == "json_schema") {
        json js = json::object();
        for (auto it = format.begin(); it != format.end(); ++it)
            if (it.key() != "type") js[it.key()] = it.value();
        rf = {{"type", "json_schema"}, {"json_schema", js}};
    }
    try {
        return parse_response_format(rf);
    } catch (const api_error &e) {
        std::string param = e.param, msg = e.what();
        for (const std::string from : {"response_format.json_schema", "response_format"}) {
            if (param.rfind(from, 0) == 0) param = "text.format" + param.substr(from.size());
            for (size_t at; (at = msg.find(from)) != std::string::npos;) msg.replace(at, from.size(), "text.format");
        }
        throw api_error(e.status, e.type, msg, param);
    }
}

std::shared_ptr<const grammar::json_grammar> parse_output_format(const json &of) {
    if (!of.is_object() || of.value("type", json()) != "json_schema")
        bad_request("'output_format' must be {\"type\": \"json_schema\", \"schema\": {...}}", "output_format");
    if (!of.contains("schema") || !of["schema"].is_object())
        bad_request("'output_format.schema' must be a JSON Schema object", "output_format.schema");
    return compile(of["schema"], "output_format.schema", "output_format.schema");
}

std::shared_ptr<const grammar::json_grammar> forced_call_grammar(const json &tools, const tool_choice &choice,
                                                                 const tool_format &fmt) {
    std::vector<std::string> before, names;
    std::vector<json> schemas;
    std::string after;
    for (const auto &t : tools) {
        const json &f = t["function"];
        const std::string name = f["name"].get<std::string>();
        if (choice.kind == tool_choice::function && name != choice.name) continue;
        const std::optional<tool_format::call_frame> fr = fmt.forced_call_frame(choice, name);
        if (!fr) return nullptr;
        json schema = f.contains("parameters") && f["parameters"].is_object() ? f["parameters"] : json::object();
        // The arguments are an object whatever the schema's root says (a schema without a type or
        // combinator would otherwise allow any value).
        if (!schema.contains("type") && !schema.contains("$ref") && !schema.contains("anyOf") && !schema.contains("oneOf") &&
            !schema.contains("allOf") && !schema.contains("enum") && !schema.contains("const"))
            schema["type"] = "object";
        before.push_back(fr->before);
        schemas.push_back(std::move(schema));
        names.push_back(name);
        after = fr->after;
    }
    if (schemas.empty()) return nullptr;
    try {
        return grammar::compile_tool_call(before, schemas, after);
    } catch (const grammar::schema_error &e) {
        // The path starts with the tool's index among those compiled: name the tool instead.
        size_t i = 0, k = 1;
        for (; k < e.path.size() && std::isdigit(static_cast<unsigned char>(e.path[k])); ++k) i = i * 10 + size_t(e.path[k] - '0');
        if (i >= names.size()) i = 0;
        const std::string rest = k < e.path.size() ? e.path.substr(k) : "";
        throw api_error(400, "invalid_request_error",
                        "tool '" + names[i] + "' parameters" + (rest.empty() ? "" : " at " + rest) +
                            " cannot be enforced for tool_choice: " + e.what(),
                        "tools");
    } catch (const std::invalid_argument &e) {
        return nullptr;  // call openings that are not prefix-free: left unconstrained
    }
}

}  // namespace fathom::server
